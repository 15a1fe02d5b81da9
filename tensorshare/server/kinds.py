"""Kinds of bins beside the store's value and list bins: streams (one sequence every consumer
reads with its own cursor, :mod:`.streams`) and services (calls answered by hosts that take
them in batches, :mod:`.services`).

A kind (:class:`~.parts.Kind`) brings its own requests (their handlers join the responder's
table, each returning its reply), keeps its own bookkeeping keyed by connection and session,
owns the names of its bins (a name is of one kind at a time), and describes its bins for the
stats. :func:`claim_name` and :func:`check_memory` are the checks every kind makes before it
takes a new bin or more memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import InvalidRequest, MemoryLimitExceeded

if TYPE_CHECKING:
    from .parts import Kind, Server

__all__ = ["check_memory", "claim_name"]


def claim_name(kind: Kind, server: Server, name: str) -> None:
    """Check that the bin ``name`` may become one of ``kind``'s.

    Raises:
        InvalidRequest: it is a value or list bin of the store, or a bin of another kind.
    """
    store = server.store
    why = f"{kind.name} operations are for {kind.name} bins"
    if store.n_items(name) or store.config(name).bounded:
        raise InvalidRequest(f"bin {name!r} is a value or list bin: {why}")
    for other in server.kinds:
        if other is not kind and other.owns(name):
            raise InvalidRequest(f"bin {name!r} is a {other.name} bin: {why}")


def check_memory(server: Server, nbytes: int, what: str, undone: str) -> None:
    """Check that ``what`` of ``nbytes`` keeps the server within its ``max_memory``.

    Raises:
        MemoryLimitExceeded: it would not (the message ends "nothing was ``undone``").
    """
    limit = server.config.max_memory
    if limit is None or nbytes <= 0:
        return
    total = server.store.nbytes + server.held_bytes() + nbytes
    if total > limit:
        raise MemoryLimitExceeded(f"{what} of {nbytes} bytes would take the server to "
                                  f"{total} bytes, over its max_memory={limit}; nothing "
                                  f"was {undone}")
