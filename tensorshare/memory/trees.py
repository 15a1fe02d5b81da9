"""The tensors of a value tree (dicts, lists and tuples nested freely): find them in order,
and rebuild the tree with each replaced. :mod:`.device` (reads and writes to a device) and
:mod:`.ipc` (CUDA tensors as IPC descriptors) walk values with these.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["collect", "replace"]


def collect(x: Any, tensor: type, out: list[Any], *, cuda_only: bool = False) -> None:
    """Append to ``out`` each ``tensor`` in ``x`` (only CUDA ones with ``cuda_only``), in
    the order :func:`replace` visits them."""
    t = type(x)
    if t is dict:
        for v in x.values():
            collect(v, tensor, out, cuda_only=cuda_only)
    elif t is list or t is tuple:
        for v in x:
            collect(v, tensor, out, cuda_only=cuda_only)
    elif isinstance(x, tensor) and (not cuda_only or getattr(x, "is_cuda", False)):
        out.append(x)


def replace(x: Any, tensor: type, new: Iterator[Any], *, cuda_only: bool = False) -> Any:
    """``x`` with each tensor :func:`collect` finds replaced by the next of ``new``."""
    t = type(x)
    if t is dict:
        return {k: replace(v, tensor, new, cuda_only=cuda_only) for k, v in x.items()}
    if t is list:
        return [replace(v, tensor, new, cuda_only=cuda_only) for v in x]
    if t is tuple:
        return tuple(replace(v, tensor, new, cuda_only=cuda_only) for v in x)
    if isinstance(x, tensor) and (not cuda_only or getattr(x, "is_cuda", False)):
        return next(new)
    return x
