"""Kinds of bins beside the store's value and list bins: streams (one sequence every consumer
reads with its own cursor, :mod:`.streams`) and services (calls answered by hosts that take
them in batches, :mod:`.services`).

A kind (:class:`~.parts.Kind`) brings its own requests (their handlers join the responder's
table, each returning its reply), keeps its own bookkeeping keyed by connection and session,
owns the names of its bins (a name is of one kind at a time), and describes its bins for the
stats. :func:`claim_name` and :func:`check_memory` are the checks every kind makes before it
takes a new bin or more memory; :class:`Rates` counts a bin's ops for the rates its stats show.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import InvalidRequest, MemoryLimitExceeded

if TYPE_CHECKING:
    from .parts import Kind, Server

__all__ = ["RATE_WINDOW", "SNAP_BYTES", "SNAP_ITEMS", "KindLog", "Rates", "check_memory",
           "claim_name", "snapshot_groups"]

#: Seconds over which a kind's rates (``inserts_per_s``, ``calls_per_s``, ...) are measured.
RATE_WINDOW = 10.0


class Rates:
    """Counts of a bin's ops (several kinds of op side by side) per second over the last
    :data:`RATE_WINDOW` seconds: one entry per second, so it holds at most
    ``RATE_WINDOW + 1`` entries however fast the ops come."""

    __slots__ = ("_recent", "_width")

    def __init__(self, width: int) -> None:
        self._recent: deque[list[float]] = deque()  # [second, count, count, ...]
        self._width = width

    def count(self, now: float, *counts: int) -> None:
        """Count ops that happened at ``now`` (one count per kind of op)."""
        second = float(int(now))
        recent = self._recent
        if recent and recent[-1][0] == second:
            row = recent[-1]
            for i, n in enumerate(counts, 1):
                row[i] += n
        else:
            recent.append([second, *counts])
        while recent and recent[0][0] < now - RATE_WINDOW:
            recent.popleft()

    def per_second(self, now: float) -> list[float]:
        """Each kind of op's rate over the last :data:`RATE_WINDOW` seconds, per second."""
        self.count(now, *([0] * self._width))
        return [round(sum(r[i] for r in self._recent) / RATE_WINDOW, 1)
                for i in range(1, self._width + 1)]


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


class KindLog:
    """What a kind of bins keeps in the data log (replay bins: :mod:`.replaylog`, streams:
    :mod:`.streamlog`), joined to a data log by :meth:`register`: the readers of its records
    (:meth:`readers`, op -> reader), its part of a snapshot (:meth:`capture`), the ops its
    remembered replies are logged as (``replies``), what runs once a log is loaded
    (:meth:`loaded`) and what is forgotten before (``_loading``, the snapshot being read)."""

    replies: dict[type, str] = {}
    _loading: dict[str, Any]
    readers: Callable[[], dict[str, Callable[[dict[str, Any], bytearray], Any]]]
    capture: Callable[[], Any]
    loaded: Callable[[], None]

    @staticmethod
    def named(bins: dict[str, Any], h: dict[str, Any], what: str) -> Any:
        """The bin a record names (``h["bin"]``) of ``bins``; ``ValueError`` (a malformed
        log) saying ``what`` when there is none."""
        b = bins.get(h["bin"])
        if b is None:
            raise ValueError(f"{h['bin']!r}: {what}")
        return b

    def register(self, p: Any) -> None:
        """Make the data log ``p`` (a :class:`~.persist.Persistence`) read and write this
        kind's records."""
        p.kind_records.update(self.readers())
        p.kind_parts.append(self.capture)
        p.kind_replies.update(self.replies)
        p.kind_loaded.append(self.loaded)
        p.kind_begin.append(self._loading.clear)



#: A snapshot record's items (a bin's, a replay bin's, a stream's), at most: this many, and
#: about this many bytes (large items: a record stays far below the largest frame).
SNAP_ITEMS = 256
SNAP_BYTES = 64 << 20
_E = TypeVar("_E")


def snapshot_groups(entries: Iterable[_E], nbytes: Callable[[_E], int]) -> Iterator[list[_E]]:
    """``entries`` in groups of one snapshot record each: at most :data:`SNAP_ITEMS`, and
    closed once their bytes (``nbytes`` of each) reach :data:`SNAP_BYTES`."""
    group: list[_E] = []
    size = 0
    for e in entries:
        group.append(e)
        size += nbytes(e)
        if len(group) >= SNAP_ITEMS or size >= SNAP_BYTES:
            yield group
            group, size = [], 0
    if group:
        yield group
