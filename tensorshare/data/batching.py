"""Batches as DataLoaders yield them, and re-batching to another batch size.

A batch is a tensor (or numpy array), or a tuple, list or dict of batches (nested as deep as
you like); every tensor in it has the batch's samples along dimension 0. :class:`Rebatcher`
turns batches of one size into batches of another, keeping sample order: it splits them
(views, no copy) and concatenates pieces (one copy) along dimension 0.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from ..client.streams import is_array as _is_array
from ..client.streams import sample_count

__all__ = ["Rebatcher", "concat", "sample_count", "split"]


def _rebuild(like: Any, parts: list[Any]) -> Any:
    if isinstance(like, tuple) and hasattr(like, "_fields"):  # a namedtuple
        return type(like)(*parts)
    return type(like)(parts) if isinstance(like, (tuple, list)) else parts


def _map(fn: Callable[[Any], Any], batch: Any, where: str = "batch") -> Any:
    if _is_array(batch):
        return fn(batch)
    if isinstance(batch, dict):
        return type(batch)((k, _map(fn, v, f"{where}[{k!r}]")) for k, v in batch.items())
    if isinstance(batch, (tuple, list)):
        return _rebuild(batch, [_map(fn, v, f"{where}[{i}]") for i, v in enumerate(batch)])
    raise TypeError(f"{where} is a {type(batch).__name__}: a batch to re-batch holds tensors "
                    f"(or numpy arrays) in tuples, lists and dicts")


def split(batch: Any, k: int) -> tuple[Any, Any]:
    """The first ``k`` samples of ``batch`` and the rest (views: nothing is copied).

    Raises:
        TypeError: the batch holds something other than tensors in tuples, lists, dicts.
    """
    return _map(lambda t: t[:k], batch), _map(lambda t: t[k:], batch)


def concat(batches: list[Any]) -> Any:
    """The batches one after the other along dimension 0 (one batch of their structure).

    Raises:
        TypeError: they hold something other than tensors, or differ in structure.
        ValueError: their tensors differ in shape beyond dimension 0.
    """
    first = batches[0]
    if _is_array(first):
        if type(first).__module__ == "numpy":
            import numpy

            return numpy.concatenate(batches)
        import torch

        return torch.cat(batches)
    if isinstance(first, dict):
        keys = list(first)
        if any(not isinstance(b, dict) or list(b) != keys for b in batches):
            raise TypeError("batches to concatenate have different keys")
        return type(first)((k, concat([b[k] for b in batches])) for k in keys)
    if isinstance(first, (tuple, list)):
        if any(not isinstance(b, (tuple, list)) or len(b) != len(first) for b in batches):
            raise TypeError("batches to concatenate have different lengths")
        return _rebuild(first, [concat([b[i] for b in batches]) for i in range(len(first))])
    raise TypeError(f"a batch is a {type(first).__name__}: a batch to re-batch holds tensors "
                    f"(or numpy arrays) in tuples, lists and dicts")


class Rebatcher:
    """Batches in, batches of ``batch_size`` samples out, in sample order.

    Args:
        batch_size: the samples of each batch out; ``None``: the batches as they came.
        drop_last: :meth:`flush` drops a last batch smaller than ``batch_size``.
    """

    def __init__(self, batch_size: int | None, drop_last: bool = False) -> None:
        if batch_size is not None and (isinstance(batch_size, bool)
                                       or not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive int or None, not {batch_size!r}")
        self.batch_size = batch_size
        self.drop_last = drop_last
        self._pieces: deque[tuple[Any, int]] = deque()
        self.n = 0  # samples held

    def add(self, batch: Any) -> None:
        """Take one batch in.

        Raises:
            TypeError: re-batching a batch without tensors.
        """
        if self.batch_size is None:
            self._pieces.append((batch, 0))
            return
        n = sample_count(batch)
        if n is None:
            raise TypeError(f"a {type(batch).__name__} holds no tensor with samples along "
                            f"dimension 0: it cannot be re-batched (batch_size=None keeps "
                            f"the producer's batches)")
        if n:
            self._pieces.append((batch, n))
            self.n += n

    @property
    def held(self) -> int:
        """What it holds: samples, or with ``batch_size=None`` batches."""
        return len(self._pieces) if self.batch_size is None else self.n

    @property
    def ready(self) -> bool:
        """Whether a full batch can be taken out."""
        if self.batch_size is None:
            return bool(self._pieces)
        return self.n >= self.batch_size

    def pop(self) -> Any:
        """Take a full batch out (only when :attr:`ready`)."""
        if self.batch_size is None:
            return self._pieces.popleft()[0]
        return self._take(self.batch_size)

    def flush(self) -> Any | None:
        """What is left, as one last (smaller) batch; ``None`` if nothing (or ``drop_last``)."""
        if self.batch_size is None or not self.n:
            return None
        if self.drop_last:
            self._pieces.clear()
            self.n = 0
            return None
        return self._take(self.n)

    def _take(self, k: int) -> Any:
        out: list[Any] = []
        need = k
        while need:
            piece, m = self._pieces[0]
            if m <= need:
                self._pieces.popleft()
                out.append(piece)
                need -= m
            else:
                head, tail = split(piece, need)
                self._pieces[0] = (tail, m - need)
                out.append(head)
                need = 0
        self.n -= k
        return out[0] if len(out) == 1 else concat(out)
