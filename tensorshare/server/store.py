"""The bins: a pure in-memory data structure. It never sees bytes or connections.

Semantics (pinned in tests and in docs/PROTOCOL.md):

* ``put`` replaces whatever the bin holds; the bin then holds that one value (kind "value").
* ``append`` adds one item (kind "list"); appending to a "value" bin makes it ``[value, new]``.
* ``fetch`` with ``spec.remove`` (get) returns and removes the content: the one value of a
  "value" bin, or up to ``max_items`` items from the front of a "list" bin (FIFO), leaving the
  rest. Without ``remove`` (peek) it returns the same without removing.
* A bin that becomes empty disappears. Fetching a missing bin raises ``BinNotFound``.
* Every change (put, append, get, delete, restore) increases the bin's version. Versions,
  limits and counters are kept per name for the life of the store, so a bin that is deleted
  and written again continues its count: a listener or an RL worker never sees a version go
  backwards.
* Items may carry an integer tag; ``min_tag`` drops (get) or skips (peek) items tagged below
  it, and items without a tag count as stale when ``min_tag`` is given.
* A fetch may wait (``fetch_or_wait``): the store keeps the waiter and serves it, in FIFO
  order, as soon as a change makes it satisfiable. Timers belong to the caller.
* A bin may be bounded (``configure``): at ``max_items`` items or ``max_bytes`` bytes an append
  is refused (``BinFull``), pushes the oldest items out (``drop_oldest``), or waits until a get
  makes room (``block``, through ``append_or_wait``).
* A write may name an ``owner`` (its user's bookkeeping, see :mod:`.accounts`): each item is
  charged to its writer (``owner.stored``) until it leaves its bin, and a write that would
  take the owner over its quota is refused first (``owner.check_room``).
"""

from __future__ import annotations

import builtins
import fnmatch
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import BinFull, BinNotFound, LimitExceeded, MemoryLimitExceeded
from ..wire.records import (
    Fetched,
    FetchSpec,
)

__all__ = ["BinConfig", "Blocked", "Store", "Waiter", "Waits", "Written"]

# (bin, op, n_items, version, dropped)
ChangeHook = Callable[[str, str, int, int, int], None]
# (op, bin, ctx, fields): every effect, in the order it happens (see Store.journal)
JournalHook = Callable[[str, str, Any, dict[str, Any]], None]
OVERFLOWS = ("reject", "drop_oldest", "block")


class Written:
    """The outcome of a put or append: the bin's version and items after it, and how many
    old items a ``drop_oldest`` bin pushed out to make room."""

    __slots__ = ("version", "n_items", "dropped")

    def __init__(self, version: int, n_items: int, dropped: int = 0) -> None:
        self.version = version
        self.n_items = n_items
        self.dropped = dropped

    def __eq__(self, other: object) -> bool:
        """Equal to a Written, or to the tuple ``(version, n_items, dropped)``."""
        mine = (self.version, self.n_items, self.dropped)
        if type(other) is Written:
            return mine == (other.version, other.n_items, other.dropped)
        return isinstance(other, tuple) and mine == other

    __hash__ = None  # type: ignore[assignment]  # unhashable, as its __eq__ takes tuples

    def __repr__(self) -> str:
        return f"Written({self.version}, {self.n_items}, {self.dropped})"


@dataclass(frozen=True, slots=True)
class BinConfig:
    """A bin's limits. ``None`` means no limit."""

    max_items: int | None = None
    max_bytes: int | None = None
    overflow: str = "reject"

    def __post_init__(self) -> None:
        if self.overflow not in OVERFLOWS:
            raise ValueError(f"overflow must be one of {OVERFLOWS}, not {self.overflow!r}")
        for name in ("max_items", "max_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive int or None, not {v!r}")

    @property
    def bounded(self) -> bool:
        """Whether any limit is set."""
        return self.max_items is not None or self.max_bytes is not None


_UNBOUNDED = BinConfig()


class _Entry:
    __slots__ = ("item", "nbytes", "tag", "owner")

    def __init__(self, item: Any, nbytes: int, tag: int | None, owner: Any = None) -> None:
        self.item = item
        self.nbytes = nbytes
        self.tag = tag
        self.owner = owner  # who the item is charged to (a user's Usage), if anyone


def _uncharge(entries: Iterable[_Entry]) -> None:
    """Items leave their bin: they no longer count for their writers."""
    for e in entries:
        o = e.owner
        if o is not None:
            o.stored -= e.nbytes


class _Bin:
    __slots__ = ("kind", "entries", "nbytes")

    def __init__(self, kind: str, entries: deque[_Entry] | None = None,
                 nbytes: int = 0) -> None:
        self.kind = kind  # "value" or "list"
        self.entries: deque[_Entry] = deque() if entries is None else entries
        self.nbytes = nbytes


class _Meta:
    """What the store keeps per name, whether or not the bin holds anything now."""

    __slots__ = ("version", "config", "changed_at", "ops", "bytes_in", "bytes_out")

    def __init__(self) -> None:
        self.version = 0
        self.config = _UNBOUNDED
        self.changed_at = 0.0
        self.ops: dict[str, int] = {}  # op -> count
        self.bytes_in = 0
        self.bytes_out = 0


class Waits(Protocol):
    """A request kept waiting on its connection (``Conn.wait``): the store's :class:`Waiter`
    and :class:`Blocked`, and the other kinds' waiting requests, whose ``name`` is empty
    (no bin's is): :meth:`Store.cancel` only marks those inactive, and their kind drops them.
    """

    name: str
    active: bool


class Waiter:
    """A pending fetch. ``callback(Fetched)`` is called once when it is served."""

    __slots__ = ("name", "spec", "max_bytes", "callback", "ctx", "active")

    def __init__(self, name: str, spec: FetchSpec, max_bytes: int | None,
                 callback: Callable[[Fetched], None], ctx: Any = None) -> None:
        self.name = name
        self.spec = spec
        self.max_bytes = max_bytes
        self.callback = callback
        self.ctx = ctx
        self.active = True


class Blocked:
    """An append waiting for room in a ``block`` bin. ``callback(Written)`` runs once served
    (``callback(exc)`` with the :class:`LimitExceeded` that refused it, if it was)."""

    __slots__ = ("name", "entries", "callback", "ctx", "active", "min_version", "owner")

    def __init__(self, name: str, entries: list[tuple[Any, int, int | None]],
                 callback: Callable[[Written | BaseException], None], ctx: Any = None,
                 min_version: int | None = None, owner: Any = None) -> None:
        self.name = name
        self.entries = entries
        self.callback = callback
        self.ctx = ctx
        self.active = True
        self.min_version = min_version
        self.owner = owner


class Store:
    """Named bins in memory.

    Args:
        max_memory: refuse a put/append that would take the bytes the server holds above
            this (``None``: no limit). Nothing already stored is ever evicted.
        on_change: called as ``on_change(bin, op, n_items, version, dropped)`` after every
            change.
        clock: returns the current time in seconds (for "last changed"); ``None`` records 0.
        outside: returns the bytes the server holds for clients outside the bins (items
            taken by unacknowledged gets, queued output), counted against ``max_memory``
            together with what the bins hold; asked only when a limit is set.

    Attributes:
        nbytes: bytes stored in bins.
        journal: if set, called as ``journal(op, bin, ctx, fields)`` for every effect, in the
            order effects happen, with what replaying it needs: ``put``/``append`` (item,
            nbytes, tag), ``take`` (n items from the front after dropping stale ones below
            min_tag; n may be 0), ``delete``, ``restore`` (kind, items) and ``configure``
            (config). ``ctx`` is the opaque request context the caller passed (the waiting
            request's own for a served waiter or blocked append), so a persistence layer can
            tie an effect to the request whose reply it must remember.
    """

    def __init__(self, max_memory: int | None = None, on_change: ChangeHook | None = None,
                 clock: Callable[[], float] | None = None,
                 outside: Callable[[], int] | None = None) -> None:
        self.max_memory = max_memory
        self.on_change = on_change
        self.clock = clock
        self.outside = outside
        self.journal: JournalHook | None = None
        #: If set, the only bins whose changes ``on_change`` hears of (the server's: those
        #: with listeners or a cached reply): no call per change of a bin nobody watches.
        self.watched: set[str] | None = None
        self.nbytes = 0
        self._bins: dict[str, _Bin] = {}
        self._meta: dict[str, _Meta] = {}
        self._waiters: dict[str, deque[Waiter]] = {}
        self._blocked: dict[str, deque[Blocked]] = {}
        # Stale items a get dropped without returning anything (no fresh item yet, too few for
        # a waiter): reported by the next get of that bin that returns items.
        self._unreported_drops: dict[str, int] = {}

    # -- queries ----------------------------------------------------------------------------
    def version(self, name: str) -> int:
        """The bin's current version (0 if it was never written)."""
        m = self._meta.get(name)
        return m.version if m else 0

    def __contains__(self, name: object) -> bool:
        """Whether a non-empty bin of that name is here."""
        return name in self._bins

    def n_items(self, name: str) -> int:
        """How many items the bin holds (1 for a "value" bin, 0 if missing)."""
        b = self._bins.get(name)
        return len(b.entries) if b else 0

    def list(self) -> dict[str, int]:
        """``{bin: n_items}`` for every non-empty bin."""
        return {name: len(b.entries) for name, b in self._bins.items()}

    def config(self, name: str) -> BinConfig:
        """The bin's limits (unbounded unless configured)."""
        m = self._meta.get(name)
        return m.config if m else _UNBOUNDED

    def names(self, glob: str | None = None) -> builtins.list[str]:
        """Every name with data or a configuration (matching the shell-style ``glob``)."""
        names = [n for n, m in self._meta.items() if n in self._bins or m.config.bounded]
        if glob is not None:
            names = [n for n in names if fnmatch.fnmatchcase(n, glob)]
        return sorted(names)

    def describe(self, name: str) -> dict[str, Any]:
        """A summary of one bin for statistics (no item is copied).

        Returns:
            ``kind`` ("value", "list" or "empty"), ``n_items``, ``nbytes``, ``version``,
            ``changed_at``, ``config``, per-op counters ``ops``, ``bytes_in``, ``bytes_out``,
            ``waiters``, ``blocked``, and the ``first`` and ``last`` stored objects (or None).
        """
        b = self._bins.get(name)
        m = self._meta.get(name) or _Meta()
        return {
            "kind": b.kind if b else "empty",
            "n_items": len(b.entries) if b else 0,
            "nbytes": b.nbytes if b else 0,
            "version": m.version,
            "changed_at": m.changed_at,
            "config": m.config,
            "ops": dict(m.ops),
            "bytes_in": m.bytes_in,
            "bytes_out": m.bytes_out,
            "waiters": len(self._waiters.get(name, ())),
            "blocked": len(self._blocked.get(name, ())),
            "first": b.entries[0].item if b else None,
            "last": b.entries[-1].item if b else None,
        }

    def entries(self) -> Iterator[tuple[str, str, int, builtins.list[tuple[Any, int, int | None]]]]:
        """Every bin as ``(name, kind, version, [(item, nbytes, tag), ...])``, for snapshots.

        The lists are fresh, the items the stored (immutable) objects themselves.
        """
        for name, b in list(self._bins.items()):
            yield name, b.kind, self.version(name), [(e.item, e.nbytes, e.tag)
                                                     for e in b.entries]

    def metas(self) -> Iterator[tuple[str, int, BinConfig, int]]:
        """``(name, version, config, unreported_drops)`` for every name the store knows."""
        for name, m in list(self._meta.items()):
            yield name, m.version, m.config, self._unreported_drops.get(name, 0)

    def load_meta(self, name: str, version: int, config: BinConfig, drops: int = 0) -> None:
        """Set a name's version and limits as a snapshot recorded them (no change event)."""
        m = self._meta_of(name)
        m.version, m.config = version, config
        if drops:
            self._unreported_drops[name] = drops
        else:
            self._unreported_drops.pop(name, None)

    def load_bin(self, name: str, kind: str,
                 entries: builtins.list[tuple[Any, int, int | None]]) -> None:
        """Set a bin's content as a snapshot recorded it (no change event, no limit check)."""
        old = self._bins.pop(name, None)
        if old is not None:
            self.nbytes -= old.nbytes
            _uncharge(old.entries)
        if not entries:
            return
        b = self._bins[name] = _Bin(kind)
        for item, nbytes, tag in entries:
            b.entries.append(_Entry(item, nbytes, tag))
            b.nbytes += nbytes
        self.nbytes += b.nbytes

    def owned_by(self, name: str, owner: Any) -> int:
        """Bytes of bin ``name``'s items charged to ``owner``."""
        b = self._bins.get(name)
        if b is None:
            return 0
        return sum(e.nbytes for e in b.entries if e.owner is owner)

    @property
    def n_waiters(self) -> int:
        """How many fetches are waiting."""
        return sum(len(q) for q in self._waiters.values())

    @property
    def n_blocked(self) -> int:
        """How many appends are waiting for room."""
        return sum(len(q) for q in self._blocked.values())

    # -- changes ----------------------------------------------------------------------------
    def put(self, name: str, item: Any, nbytes: int, tag: int | None = None,
            ctx: Any = None, min_version: int | None = None, owner: Any = None) -> Written:
        """Replace the bin's content with one value (as version ``max(current + 1,
        min_version)``; charged to ``owner``, if given).

        Raises:
            BinFull: the value alone is larger than the bin's ``max_bytes``.
            QuotaExceeded: ``owner`` would exceed its quota; nothing changed.
            MemoryLimitExceeded: the server would exceed ``max_memory``; nothing changed.
        """
        cfg = self.config(name)
        if cfg.max_bytes is not None and nbytes > cfg.max_bytes:
            raise BinFull(f"a value of {nbytes} bytes does not fit bin {name!r}: its "
                          f"max_bytes={cfg.max_bytes}; nothing was stored")
        old = self._bins.get(name)
        if owner is not None and owner.max_memory is not None:  # (a user with a quota)
            owner.check_room(nbytes - self.owned_by(name, owner),
                             f"storing {nbytes} bytes in bin {name!r}", True)
        self._check_memory(name, nbytes - (old.nbytes if old else 0), nbytes)
        if self.journal is not None:
            self.journal("put", name, ctx, {"item": item, "nbytes": nbytes, "tag": tag,
                                            "min_version": min_version})
        b = _Bin("value", deque([_Entry(item, nbytes, tag, owner)]), nbytes)
        self.nbytes += nbytes - (old.nbytes if old else 0)
        if old is not None:
            _uncharge(old.entries)
        if owner is not None:
            owner.stored += nbytes
        self._bins[name] = b
        self._count(name, "put", nbytes, 0)
        version, n = self._changed(name, "put", b, 0, min_version)
        if old is not None and name in self._blocked:
            self._serve_blocked(name)  # a put may shrink a bin: room for blocked appends
        return Written(version, n)

    def put_version(self, name: str, item: Any, nbytes: int, version: int,
                    tag: int | None = None) -> Written:
        """Put a value as version ``version`` of the bin (a relay copies its primary's
        versions, so that readers compare them as on the primary).

        Raises:
            ValueError: ``version`` is not above the bin's current version (versions never go
                backwards).
        """
        m = self._meta_of(name)
        if version <= m.version:
            raise ValueError(f"bin {name!r} is at version {m.version}: cannot put version "
                             f"{version}")
        old, m.version = m.version, version - 1
        try:
            return self.put(name, item, nbytes, tag)
        except BaseException:
            m.version = old
            raise

    def forget(self, name: str) -> None:
        """Drop a bin and its version count (a relay whose primary restarted without its
        data: versions start again). Waiting requests keep waiting."""
        b = self._bins.pop(name, None)
        if b is not None:
            self.nbytes -= b.nbytes
            _uncharge(b.entries)
        self._meta.pop(name, None)

    def append(self, name: str, item: Any, nbytes: int, tag: int | None = None,
               ctx: Any = None, owner: Any = None) -> Written:
        """Add one item at the end of the bin (a list value is one item, never flattened).

        A bin at its limits refuses the item (``reject``, and ``block`` here: blocking is
        :meth:`append_or_wait`) or pushes out its oldest items (``drop_oldest``).

        Raises:
            BinFull: the bin is full (or the item alone exceeds its ``max_bytes``).
            MemoryLimitExceeded: the server would exceed ``max_memory``; nothing changed.
        """
        return self.append_many(name, [(item, nbytes, tag)], ctx, None, owner)

    def append_many(self, name: str, entries: builtins.list[tuple[Any, int, int | None]],
                    ctx: Any = None, min_version: int | None = None,
                    owner: Any = None) -> Written:
        """Add several items at the end of the bin, all or none, as one change (one version:
        ``max(current + 1, min_version)``), charged to ``owner`` if given.

        Raises:
            as :meth:`append`, for the items together: nothing is stored then;
            ``QuotaExceeded``: ``owner`` would exceed its quota.
        """
        b = self._bins.get(name)
        cfg = self.config(name)
        nbytes = sum(e[1] for e in entries)
        drop = 0
        if cfg.bounded:
            drop = self._room(name, b, cfg, entries)
            if drop and cfg.overflow != "drop_oldest":
                raise self._full(name, cfg, len(entries))
        freed = sum(b.entries[i].nbytes for i in range(drop)) if (b and drop) else 0
        if owner is not None and owner.max_memory is not None:  # (a user with a quota)
            mine = sum(b.entries[i].nbytes for i in range(drop)
                       if b.entries[i].owner is owner) if (b and drop) else 0
            owner.check_room(nbytes - mine, f"appending {nbytes} bytes to bin {name!r}", True)
        self._check_memory(name, nbytes - freed, nbytes)
        if self.journal is not None:
            self.journal("append", name, ctx, {"entries": entries, "min_version": min_version})
        if b is None:
            b = self._bins[name] = _Bin("list")
        for _ in range(drop):
            e = b.entries.popleft()
            b.nbytes -= e.nbytes
            self.nbytes -= e.nbytes
            if e.owner is not None:
                e.owner.stored -= e.nbytes
        b.kind = "list"  # a put value becomes the first item of the list
        add = b.entries.append
        for item, size, tag in entries:
            add(_Entry(item, size, tag, owner))
        b.nbytes += nbytes
        self.nbytes += nbytes
        if owner is not None:
            owner.stored += nbytes
        self._count(name, "append", nbytes, 0)
        version, n = self._changed(name, "append", b, drop, min_version)
        return Written(version, n, drop)

    def append_or_wait(self, name: str, entries: builtins.list[tuple[Any, int, int | None]],
                       callback: Callable[[Written | BaseException], None], ctx: Any = None,
                       min_version: int | None = None, owner: Any = None) -> Written | Blocked:
        """Append now if the bin has room (or is not a ``block`` bin), else wait for room.

        Args:
            entries: ``(item, nbytes, tag)`` of each item to append, all or none.

        Returns:
            The :class:`Written` outcome, or a :class:`Blocked` (pass it to :meth:`cancel`
            on timeout or disconnect); ``callback(Written)`` then runs once it is stored
            (``callback(exc)`` if it is refused when room comes).

        Raises:
            as :meth:`append_many`; ``BinFull`` at once if the items can never fit.
        """
        cfg = self.config(name)
        if cfg.overflow != "block" or not cfg.bounded:
            return self.append_many(name, entries, ctx, min_version, owner)
        queue = self._blocked.get(name)
        if not queue and not self._room(name, self._bins.get(name), cfg, entries):
            return self.append_many(name, entries, ctx, min_version, owner)
        blocked = Blocked(name, entries, callback, ctx, min_version, owner)
        self._blocked.setdefault(name, deque()).append(blocked)
        return blocked

    def delete(self, name: str, ctx: Any = None) -> tuple[bool, int]:
        """Remove a bin. Waiters on it keep waiting; blocked appends get room.

        Returns:
            ``(existed, version)``.
        """
        b = self._bins.pop(name, None)
        if b is None:
            return False, self.version(name)
        if self.journal is not None:
            self.journal("delete", name, ctx, {})
        self.nbytes -= b.nbytes
        _uncharge(b.entries)
        self._count(name, "delete", 0, 0)
        version, _ = self._changed(name, "delete", None)
        if name in self._blocked:
            self._serve_blocked(name)
        return True, version

    def configure(self, name: str, config: BinConfig, ctx: Any = None) -> BinConfig:
        """Set the bin's limits. Items already stored stay, even above new limits; blocked
        appends are re-examined (a larger limit may make room)."""
        if self.journal is not None:
            self.journal("configure", name, ctx, {"config": config})
        meta = self._meta_of(name)
        meta.config = config
        if name in self._blocked:
            if config.overflow != "block" or not config.bounded:
                # No longer a blocking bin: each waiting append is stored, or refused, now.
                self._serve_blocked(name, force=True)
            else:
                self._serve_blocked(name)
        return config

    def restore(self, name: str, kind: str, items: builtins.list[tuple[Any, int, int | None]],
                owner: Any = None) -> int:
        """Put items a client took but never received back at the front of their bin.

        A "value" taken from a bin that holds something again is superseded (a put would
        have replaced it) and dropped; list items go in front of whatever the bin holds now,
        in their order. Limits are not applied: these items were in the bin before.

        ``owner``: who they are charged to from now on (the user whose get had taken them).

        Returns:
            The bin's version after the restore (unchanged if nothing was restored).
        """
        if not items:
            return self.version(name)
        b = self._bins.get(name)
        if kind == "value" and b is not None:
            return self.version(name)
        if self.journal is not None:
            self.journal("restore", name, None, {"kind": kind, "items": items})
        if kind == "value":
            b = self._bins[name] = _Bin("value")
        elif b is None:
            b = self._bins[name] = _Bin("list")
        else:
            b.kind = "list"
        for item, nbytes, tag in reversed(items):
            b.entries.appendleft(_Entry(item, nbytes, tag, owner))
            b.nbytes += nbytes
            self.nbytes += nbytes
            if owner is not None:
                owner.stored += nbytes
        self._count(name, "restore", 0, 0)
        version, _ = self._changed(name, "restore", b)
        return version

    def fetch(self, name: str, spec: FetchSpec, max_bytes: int | None = None,
              ctx: Any = None) -> Fetched:
        """Get (``spec.remove``) or peek at the content of a bin, without waiting.

        ``max_bytes`` caps the summed size of the items of a list bin returned at once (at
        least one item is always returned); the rest stay in the bin.

        Raises:
            BinNotFound: the bin is missing or empty (or holds only stale items).
        """
        taken = self._try_fetch(name, spec, 1, max_bytes, ctx=ctx)
        if taken is None:
            raise BinNotFound(self._missing_message(name, spec.min_tag))
        return taken

    def fetch_or_wait(self, name: str, spec: FetchSpec, callback: Callable[[Fetched], None],
                      max_bytes: int | None = None, ctx: Any = None) -> Fetched | Waiter:
        """Fetch now if the bin can satisfy the request, else register a waiter.

        A waiter whose ``newer_than`` is set is satisfied only by a version above it.

        Returns:
            The :class:`Fetched` if served at once, else the :class:`Waiter` (pass it to
            :meth:`cancel` on timeout or disconnect); ``callback`` is then called when served.
        """
        queue = self._waiters.get(name)
        if not queue:
            taken = self._try_fetch(name, spec, spec.min_items, max_bytes,
                                    report_unchanged=False, ctx=ctx)
            if taken is not None:
                return taken
        w = Waiter(name, spec, max_bytes, callback, ctx)
        self._waiters.setdefault(name, deque()).append(w)
        if queue:
            # Earlier waiters keep their turn, but one that cannot be served yet (say it
            # wants more items) must not hold back this one: serve the queue in order now.
            # If this waiter is served, ``callback`` has run and ``w.active`` is False.
            self._serve_waiters(name)
        return w

    def cancel(self, waiter: Waits) -> bool:
        """Withdraw a waiting fetch or a blocked append (or mark another kind's waiting
        request inactive). Returns whether it was still waiting."""
        if not waiter.active:
            return False
        waiter.active = False
        table: dict[str, Any] = self._waiters if isinstance(waiter, Waiter) else self._blocked
        q = table.get(waiter.name)
        if q is not None:
            q.remove(waiter)
            if not q:
                del table[waiter.name]
        return True

    # -- internals --------------------------------------------------------------------------
    def _meta_of(self, name: str) -> _Meta:
        m = self._meta.get(name)
        if m is None:
            m = self._meta[name] = _Meta()
        return m

    def _count(self, name: str, op: str, bytes_in: int, bytes_out: int) -> None:
        m = self._meta.get(name)
        if m is None:
            m = self._meta[name] = _Meta()
        m.ops[op] = m.ops.get(op, 0) + 1
        m.bytes_in += bytes_in
        m.bytes_out += bytes_out

    def _room(self, name: str, b: _Bin | None, cfg: BinConfig,
              adding: builtins.list[tuple[Any, int, int | None]]) -> int:
        """How many of the oldest items must go for the items ``adding`` to fit.

        Raises:
            BinFull: the new items alone exceed ``max_items`` or ``max_bytes``.
        """
        k = len(adding)
        nbytes = sum(e[1] for e in adding)
        if cfg.max_bytes is not None and nbytes > cfg.max_bytes:
            what = "an item" if k == 1 else f"{k} items"
            raise BinFull(f"{what} of {nbytes} bytes do{'es' if k == 1 else ''} not fit bin "
                          f"{name!r}: its max_bytes={cfg.max_bytes}; nothing was stored")
        if cfg.max_items is not None and k > cfg.max_items:
            raise BinFull(f"{k} items do not fit bin {name!r}: its max_items="
                          f"{cfg.max_items}; nothing was stored")
        if b is None:
            return 0
        n, size, drop = len(b.entries), b.nbytes, 0
        entries = b.entries
        while ((cfg.max_items is not None and n - drop + k > cfg.max_items)
               or (cfg.max_bytes is not None and size + nbytes > cfg.max_bytes)):
            size -= entries[drop].nbytes
            drop += 1
        return drop

    def _full(self, name: str, cfg: BinConfig, k: int = 1) -> BinFull:
        b = self._bins.get(name)
        held = f"{len(b.entries)} items, {b.nbytes} bytes" if b else "nothing"
        limits = ", ".join(f"{key}={v}" for key, v in (("max_items", cfg.max_items),
                                                        ("max_bytes", cfg.max_bytes)) if v)
        more = "" if k == 1 else f" for {k} more items"
        return BinFull(f"bin {name!r} is full{more} ({held}; {limits}); nothing was stored")

    def _check_memory(self, name: str, growth: int, nbytes: int) -> None:
        if self.max_memory is None or growth <= 0:
            return
        total = self.nbytes + (self.outside() if self.outside else 0) + growth
        if total > self.max_memory:
            raise MemoryLimitExceeded(
                f"storing {nbytes} bytes in bin {name!r} would take the server to "
                f"{total} bytes, over its max_memory={self.max_memory}; nothing was stored"
            )

    def _missing_message(self, name: str, min_tag: int | None) -> str:
        if min_tag is not None and name in self._bins:
            return f"bin {name!r} holds no items tagged >= {min_tag}"
        return f"bin {name!r} does not exist or is empty"

    def _changed(self, name: str, op: str, b: _Bin | None, dropped: int = 0,
                 min_version: int | None = None) -> tuple[int, int]:
        m = self._meta.get(name)
        if m is None:
            m = self._meta[name] = _Meta()
        m.version += 1
        if min_version is not None and min_version > m.version:
            m.version = min_version
        version = m.version
        if self.clock is not None:
            m.changed_at = self.clock()
        n = len(b.entries) if b else 0
        if self.on_change is not None and (self.watched is None or name in self.watched):
            self.on_change(name, op, n, version, dropped)
        if op in ("put", "append", "restore") and name in self._waiters:
            self._serve_waiters(name)
        return version, n

    def _serve_waiters(self, name: str) -> None:
        q = self._waiters[name]
        for w in list(q):
            if name not in self._bins:
                break
            if not w.active:  # cancelled, or served by a re-entrant call from a callback
                continue
            taken = self._try_fetch(name, w.spec, w.spec.min_items, w.max_bytes,
                                    report_unchanged=False, ctx=w.ctx)
            if taken is None:
                continue
            w.active = False
            q.remove(w)
            w.callback(taken)
        if not q and self._waiters.get(name) is q:  # a callback may have made a new queue
            del self._waiters[name]

    def _serve_blocked(self, name: str, force: bool = False) -> None:
        """Store blocked appends, oldest first, while they fit (``force``: store or refuse
        each now, as a non-blocking append would)."""
        q = self._blocked.get(name)
        while q:
            blk = q[0]
            if not blk.active:
                q.popleft()
                continue
            if not force:
                cfg = self.config(name)
                try:
                    if self._room(name, self._bins.get(name), cfg, blk.entries):
                        break
                except BinFull:
                    pass  # can never fit (limits changed): refused below
            q.popleft()
            blk.active = False
            try:
                written: Written | BaseException = self.append_many(
                    name, blk.entries, blk.ctx, blk.min_version, blk.owner)
            except LimitExceeded as exc:  # BinFull, MemoryLimitExceeded, QuotaExceeded
                written = exc
            blk.callback(written)
            q = self._blocked.get(name)
        if name in self._blocked and not self._blocked[name]:
            del self._blocked[name]

    def take(self, name: str, n: int, min_tag: int | None = None) -> Fetched | None:
        """Replay a logged ``take``: drop items tagged below ``min_tag``, then remove ``n``
        items from the front (``n`` may be 0: only the drop). Exactly what the logged get
        did to the bin, given the same state. Returns what was taken (``None`` for 0)."""
        if n == 0:
            self._try_fetch(name, FetchSpec(True, min_tag=min_tag), 1 << 62, None)
            return None
        return self._try_fetch(name, FetchSpec(True, n, min_tag=min_tag), 1, None)

    def _try_fetch(self, name: str, spec: FetchSpec, min_items: int, max_bytes: int | None,
                   report_unchanged: bool = True, ctx: Any = None) -> Fetched | None:
        b = self._bins.get(name)
        if b is None:
            return None
        version = self._meta[name].version
        newer_than, min_tag, remove = spec.newer_than, spec.min_tag, spec.remove
        if newer_than is not None and version <= newer_than:
            if report_unchanged:
                return Fetched(0, b.kind, (), version, len(b.entries), unchanged=True)
            return None
        entries = b.entries
        dropped = 0
        fresh: deque[_Entry] | list[_Entry] = entries
        if min_tag is not None:
            fresh = [e for e in entries if e.tag is not None and e.tag >= min_tag]
            dropped = len(entries) - len(fresh)
            if dropped and remove:
                fresh = self._drop_stale(name, b, fresh, dropped)
        if len(fresh) < min_items or not fresh:
            if dropped and remove:
                if self.journal is not None:
                    self.journal("take", name, None, {"n": 0, "min_tag": min_tag})
                self._after_removal(name, b, 0)
            return None
        n = self._how_many(b, fresh, spec.max_items, max_bytes)
        if remove:
            if self.journal is not None:
                self.journal("take", name, ctx, {"n": n, "min_tag": min_tag})
            if self._unreported_drops:
                dropped = self._unreported_drops.pop(name, 0)
            chosen = [b.entries.popleft() for _ in range(n)] if n > 1 else [b.entries.popleft()]
        else:
            chosen = [fresh[i] for i in range(n)] if n > 1 else [fresh[0]]
        items: tuple[Any, ...]
        tags: tuple[int | None, ...]
        if n == 1:  # (a value bin, or one item: the usual get)
            e = chosen[0]
            items, tags, nbytes = (e.item,), (e.tag,), e.nbytes
        else:
            items, tags = tuple([e.item for e in chosen]), tuple([e.tag for e in chosen])
            nbytes = 0
            for e in chosen:
                nbytes += e.nbytes
        if remove:
            b.nbytes -= nbytes
            self.nbytes -= nbytes
            for e in chosen:
                o = e.owner
                if o is not None:
                    o.stored -= e.nbytes
            version, left = self._after_removal(name, b, nbytes)
        else:
            left = len(b.entries)
            self._count(name, "peek", 0, nbytes)
        return Fetched(0, b.kind, items, version, left, dropped, tags=tags, nbytes=nbytes)

    def _drop_stale(self, name: str, b: _Bin, fresh: builtins.list[_Entry], dropped: int
                    ) -> deque[_Entry]:
        """A taking fetch with ``min_tag``: the stale items are garbage for this caller, so
        they go here (counted for the next reply), never shipped."""
        self._unreported_drops[name] = self._unreported_drops.get(name, 0) + dropped
        kept = {id(e) for e in fresh}
        _uncharge(e for e in b.entries if id(e) not in kept)
        stale = b.nbytes - sum(e.nbytes for e in fresh)
        self.nbytes -= stale
        b.nbytes -= stale
        b.entries = deque(fresh)
        return b.entries

    @staticmethod
    def _how_many(b: _Bin, fresh: deque[_Entry] | builtins.list[_Entry], max_items: int | None,
                  max_bytes: int | None) -> int:
        """How many of ``fresh`` one fetch returns: up to ``max_items`` (all of a value bin),
        at least one, then as many as fit in ``max_bytes``."""
        n = len(fresh) if (max_items is None or b.kind == "value") else min(max_items, len(fresh))
        if max_bytes is not None and n > 1:
            total = 0
            for i in range(n):
                total += fresh[i].nbytes
                if i and total > max_bytes:
                    return i
        return n

    def _after_removal(self, name: str, b: _Bin, nbytes: int) -> tuple[int, int]:
        if not b.entries:
            del self._bins[name]
        self._count(name, "get", 0, nbytes)
        result = self._changed(name, "get", b)
        if name in self._blocked:
            self._serve_blocked(name)  # room for appends waiting on a full bin
        return result
