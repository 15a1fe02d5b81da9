"""The bins: a pure in-memory data structure. It never sees bytes or connections.

Semantics (pinned in tests and in docs/PROTOCOL.md):

* ``put`` replaces whatever the bin holds; the bin then holds that one value (kind "value").
* ``append`` adds one item (kind "list"); appending to a "value" bin makes it ``[value, new]``.
* ``fetch(remove=True)`` (get) returns and removes the content: the one value of a "value" bin,
  or up to ``max_items`` items from the front of a "list" bin (FIFO), leaving the rest.
  ``fetch(remove=False)`` (peek) returns the same without removing.
* A bin that becomes empty disappears. Fetching a missing bin raises ``BinNotFound``.
* Every change (put, append, get, delete) increases the bin's version. Versions are kept per
  name for the life of the store, so a bin that is deleted and written again continues its
  count: a listener or an RL worker never sees a version go backwards.
* Items may carry an integer tag; ``min_tag`` drops (get) or skips (peek) items tagged below
  it, and items without a tag count as stale when ``min_tag`` is given.
* A fetch may wait (``fetch_or_wait``): the store keeps the waiter and serves it, in FIFO
  order, as soon as a change makes it satisfiable. Timers belong to the caller.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import BinNotFound, MemoryLimitExceeded

__all__ = ["Store", "Taken", "Waiter"]

ChangeHook = Callable[[str, str, int, int], None]  # (bin, op, n_items, version)


@dataclass(slots=True)
class _Entry:
    item: Any
    nbytes: int
    tag: int | None


@dataclass(slots=True)
class _Bin:
    kind: str  # "value" or "list"
    entries: deque[_Entry] = field(default_factory=deque)
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class Taken:
    """The result of a fetch.

    Attributes:
        kind: "value" or "list" (what the bin was).
        items: the stored objects, oldest first.
        tags: their tags, same order.
        version: the bin's version after the fetch.
        n_items: items left in the bin.
        dropped: items dropped (get; counted since the last get of the bin that returned
            items) or skipped (peek) because of ``min_tag``.
        unchanged: ``newer_than`` was given and the bin is not newer; no items.
    """

    kind: str
    items: tuple[Any, ...]
    tags: tuple[int | None, ...]
    version: int
    n_items: int
    dropped: int = 0
    unchanged: bool = False


@dataclass(eq=False, slots=True)
class Waiter:
    """A pending fetch. ``callback(Taken)`` is called once when it is served."""

    name: str
    remove: bool
    max_items: int | None
    min_tag: int | None
    newer_than: int | None
    min_items: int
    max_bytes: int | None
    callback: Callable[[Taken], None]
    active: bool = True


class Store:
    """Named bins in memory.

    Args:
        max_memory: refuse a put/append that would take the stored bytes above this
            (``None``: no limit). Nothing already stored is ever evicted.
        on_change: called as ``on_change(bin, op, n_items, version)`` after every change.
    """

    def __init__(self, max_memory: int | None = None, on_change: ChangeHook | None = None) -> None:
        self.max_memory = max_memory
        self.on_change = on_change
        self.nbytes = 0
        self._bins: dict[str, _Bin] = {}
        self._versions: dict[str, int] = {}
        self._waiters: dict[str, deque[Waiter]] = {}
        # Stale items a get dropped without returning anything (no fresh item yet, too few for
        # a waiter): reported by the next get of that bin that returns items.
        self._unreported_drops: dict[str, int] = {}

    # -- queries ----------------------------------------------------------------------------
    def version(self, name: str) -> int:
        """The bin's current version (0 if it was never written)."""
        return self._versions.get(name, 0)

    def n_items(self, name: str) -> int:
        """How many items the bin holds (1 for a "value" bin, 0 if missing)."""
        b = self._bins.get(name)
        return len(b.entries) if b else 0

    def list(self) -> dict[str, int]:
        """``{bin: n_items}`` for every non-empty bin."""
        return {name: len(b.entries) for name, b in self._bins.items()}

    # -- changes ----------------------------------------------------------------------------
    def put(self, name: str, item: Any, nbytes: int, tag: int | None = None) -> tuple[int, int]:
        """Replace the bin's content with one value.

        Returns:
            ``(version, n_items)`` after the put.

        Raises:
            MemoryLimitExceeded: the store would exceed ``max_memory``; nothing changed.
        """
        old = self._bins.get(name)
        self._check_memory(name, nbytes - (old.nbytes if old else 0), nbytes)
        b = _Bin("value", deque([_Entry(item, nbytes, tag)]), nbytes)
        self.nbytes += nbytes - (old.nbytes if old else 0)
        self._bins[name] = b
        return self._changed(name, "put", b)

    def append(self, name: str, item: Any, nbytes: int, tag: int | None = None) -> tuple[int, int]:
        """Add one item at the end of the bin (a list value is one item, never flattened).

        Returns:
            ``(version, n_items)`` after the append.

        Raises:
            MemoryLimitExceeded: the store would exceed ``max_memory``; nothing changed.
        """
        self._check_memory(name, nbytes, nbytes)
        b = self._bins.get(name)
        if b is None:
            b = self._bins[name] = _Bin("list")
        b.kind = "list"  # a put value becomes the first item of the list
        b.entries.append(_Entry(item, nbytes, tag))
        b.nbytes += nbytes
        self.nbytes += nbytes
        return self._changed(name, "append", b)

    def delete(self, name: str) -> tuple[bool, int]:
        """Remove a bin. Waiters on it keep waiting.

        Returns:
            ``(existed, version)``.
        """
        b = self._bins.pop(name, None)
        if b is None:
            return False, self.version(name)
        self.nbytes -= b.nbytes
        version, _ = self._changed(name, "delete", None)
        return True, version

    def fetch(
        self,
        name: str,
        *,
        remove: bool,
        max_items: int | None = None,
        min_tag: int | None = None,
        newer_than: int | None = None,
        max_bytes: int | None = None,
    ) -> Taken:
        """Get (``remove=True``) or peek at the content of a bin, without waiting.

        ``max_bytes`` caps the summed size of the items of a list bin returned at once (at
        least one item is always returned); the rest stay in the bin.

        Raises:
            BinNotFound: the bin is missing or empty (or holds only stale items).
        """
        taken = self._try_fetch(name, remove, max_items, min_tag, newer_than, 1, max_bytes)
        if taken is None:
            raise BinNotFound(self._missing_message(name, min_tag))
        return taken

    def fetch_or_wait(
        self,
        name: str,
        callback: Callable[[Taken], None],
        *,
        remove: bool,
        max_items: int | None = None,
        min_tag: int | None = None,
        newer_than: int | None = None,
        min_items: int = 1,
        max_bytes: int | None = None,
    ) -> Taken | Waiter:
        """Fetch now if the bin can satisfy the request, else register a waiter.

        A waiter whose ``newer_than`` is set is satisfied only by a version above it.

        Returns:
            The :class:`Taken` if served at once, else the :class:`Waiter` (pass it to
            :meth:`cancel` on timeout or disconnect); ``callback`` is then called when served.
        """
        queue = self._waiters.get(name)
        if not queue:
            taken = self._try_fetch(name, remove, max_items, min_tag, newer_than, min_items,
                                    max_bytes, report_unchanged=False)
            if taken is not None:
                return taken
        w = Waiter(name, remove, max_items, min_tag, newer_than, min_items, max_bytes, callback)
        self._waiters.setdefault(name, deque()).append(w)
        if queue:
            # Earlier waiters keep their turn, but one that cannot be served yet (say it
            # wants more items) must not hold back this one: serve the queue in order now.
            # If this waiter is served, ``callback`` has run and ``w.active`` is False.
            self._serve_waiters(name)
        return w

    def cancel(self, waiter: Waiter) -> bool:
        """Withdraw a waiter. Returns whether it was still waiting."""
        if not waiter.active:
            return False
        waiter.active = False
        q = self._waiters.get(waiter.name)
        if q is not None:
            q.remove(waiter)
            if not q:
                del self._waiters[waiter.name]
        return True

    @property
    def n_waiters(self) -> int:
        """How many fetches are waiting."""
        return sum(len(q) for q in self._waiters.values())

    # -- internals --------------------------------------------------------------------------
    def _check_memory(self, name: str, growth: int, nbytes: int) -> None:
        if self.max_memory is not None and growth > 0 and self.nbytes + growth > self.max_memory:
            raise MemoryLimitExceeded(
                f"storing {nbytes} bytes in bin {name!r} would take the server to "
                f"{self.nbytes + growth} bytes, over its max_memory={self.max_memory}; "
                f"nothing was stored"
            )

    def _missing_message(self, name: str, min_tag: int | None) -> str:
        if min_tag is not None and name in self._bins:
            return f"bin {name!r} holds no items tagged >= {min_tag}"
        return f"bin {name!r} does not exist or is empty"

    def _changed(self, name: str, op: str, b: _Bin | None) -> tuple[int, int]:
        version = self._versions.get(name, 0) + 1
        self._versions[name] = version
        n = len(b.entries) if b else 0
        if self.on_change is not None:
            self.on_change(name, op, n, version)
        if op in ("put", "append") and name in self._waiters:
            self._serve_waiters(name)
        return version, n

    def _serve_waiters(self, name: str) -> None:
        q = self._waiters[name]
        for w in list(q):
            if name not in self._bins:
                break
            if not w.active:  # cancelled, or served by a re-entrant call from a callback
                continue
            taken = self._try_fetch(name, w.remove, w.max_items, w.min_tag, w.newer_than,
                                    w.min_items, w.max_bytes, report_unchanged=False)
            if taken is None:
                continue
            w.active = False
            q.remove(w)
            w.callback(taken)
        if not q and self._waiters.get(name) is q:  # a callback may have made a new queue
            del self._waiters[name]

    def _try_fetch(
        self,
        name: str,
        remove: bool,
        max_items: int | None,
        min_tag: int | None,
        newer_than: int | None,
        min_items: int,
        max_bytes: int | None = None,
        report_unchanged: bool = True,
    ) -> Taken | None:
        b = self._bins.get(name)
        if b is None:
            return None
        version = self._versions[name]
        if newer_than is not None and version <= newer_than:
            if report_unchanged:
                return Taken(b.kind, (), (), version, len(b.entries), unchanged=True)
            return None
        entries = b.entries
        dropped = 0
        fresh: deque[_Entry] | list[_Entry] = entries
        if min_tag is not None:
            fresh = [e for e in entries if e.tag is not None and e.tag >= min_tag]
            dropped = len(entries) - len(fresh)
            if dropped and remove:
                # Stale items are garbage for this caller: drop them here, never ship them.
                self._unreported_drops[name] = self._unreported_drops.get(name, 0) + dropped
                stale = b.nbytes - sum(e.nbytes for e in fresh)
                self.nbytes -= stale
                b.nbytes -= stale
                b.entries = entries = deque(fresh)
                fresh = entries
        if len(fresh) < min_items or not fresh:
            if dropped and remove:
                self._after_removal(name, b)
            return None
        n = len(fresh) if (max_items is None or b.kind == "value") else min(max_items, len(fresh))
        if max_bytes is not None and n > 1:
            total = 0
            for i in range(n):  # at least one item, then as many as fit
                total += fresh[i].nbytes
                if i and total > max_bytes:
                    n = i
                    break
        if remove:
            dropped = self._unreported_drops.pop(name, 0)
            chosen = [entries.popleft() for _ in range(n)]
            freed = sum(e.nbytes for e in chosen)
            b.nbytes -= freed
            self.nbytes -= freed
            version, left = self._after_removal(name, b)
        else:
            chosen = [fresh[i] for i in range(n)]
            left = len(entries)
        return Taken(b.kind, tuple(e.item for e in chosen), tuple(e.tag for e in chosen),
                     version, left, dropped)

    def _after_removal(self, name: str, b: _Bin) -> tuple[int, int]:
        if not b.entries:
            del self._bins[name]
        return self._changed(name, "get", b)
