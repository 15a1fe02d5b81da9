"""The bookkeeping of one stream bin (:class:`Stream`), a pure data structure (the time is
passed in; no connections, no timers), under the server's kind (:mod:`.streams`, which
describes what a stream does) and its data log (:mod:`.streamlog`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import BinNotFound, InvalidRequest, LimitExceeded
from ..wire import codec
from ..wire.streams import ProducerGone, StreamEnded, StreamItems, StreamJoined, StreamOpened

__all__ = ["CONSUMER_COST", "DEFAULT_MAX_STALL", "EPOCHS_KEPT", "MAX_CONSUMERS", "STREAM_COST",
           "Consumer", "Event", "Position", "Producer", "Settings", "Stream"]

#: The most consumers one stream keeps (dropped ones included, the oldest dropped go first).
MAX_CONSUMERS = 1024
#: What one stream is counted as against ``max_memory`` (its tables), besides its items.
STREAM_COST = 4096
#: What one consumer or producer record is counted as.
CONSUMER_COST = 512
#: Epochs whose bounds a stream remembers (to count the items a lagging consumer missed).
EPOCHS_KEPT = 64
#: ``max_stall`` of an ``on_lag="detach"`` stream that did not say.
DEFAULT_MAX_STALL = 10.0

Event = tuple[str, int]  # (notification op, count it reports in ``dropped``)


@dataclass(frozen=True, slots=True)
class Settings:
    """A stream's settings, as its producers opened it (see ``StreamOpen``)."""

    producers: int = 1
    window: int = 32
    on_lag: str = "wait"
    max_stall: float | None = None
    replay: str = "none"
    device_ipc: bool = False  # the items are CUDA IPC descriptors: same-host consumers only

    @property
    def stall_limit(self) -> float:
        """Seconds a consumer may hold the window full before it is detached."""
        return DEFAULT_MAX_STALL if self.max_stall is None else self.max_stall


@dataclass(slots=True)
class _Entry:
    item: Any  # the Item; None for an epoch mark
    nbytes: int
    epoch: int
    offset: int  # samples of its epoch before it (a mark: the epoch's total)
    n: int = 0  # samples it holds
    aborted: bool = False  # (a mark) the epoch was cut short: a producer died
    owner: Any = None  # the producer's user (its Usage) the item counts for while kept


@dataclass(slots=True)
class _Epoch:
    start: int
    end: int | None = None  # the position of its mark
    samples: int | None = None
    aborted: bool = False


@dataclass(eq=False, slots=True)
class Producer:
    """A producer of a stream: ``state`` is live, away (its connection is gone, its lease
    runs), gone (dead before ending its epoch) or done (it ended its last epoch)."""

    index: int
    owner: Any
    lease: float
    seen: float
    epoch: int
    sent: int = 0  # samples it appended to ``epoch``
    hint: int | None = None  # samples it expects to send per epoch
    state: str = "live"


@dataclass(eq=False, slots=True)
class Consumer:
    """A consumer of a stream, by name: ``state`` is live, away or dropped; ``cursor`` is
    ``None`` while it waits for the next epoch to begin."""

    name: str
    owner: Any
    lease: float
    seen: float
    acked: int | None
    cursor: int | None
    state: str = "live"
    detached: bool = False
    stall_since: float | None = None
    stall_total: float = 0.0
    missed: int = 0
    reads: int = 0

    @property
    def holds(self) -> bool:
        """Whether it holds the producers back (items it has not acknowledged are kept)."""
        return self.state != "dropped" and not self.detached and self.acked is not None


@dataclass(slots=True)
class Position:
    """Where a consumer is: the epoch at that position, the samples of the epoch before
    it, and how many samples the epoch has (``None``: unknown yet)."""

    epoch: int
    offset: int
    epoch_samples: int | None


class Stream:
    """The bookkeeping of one stream (pure: time is passed in as ``now``).

    Args:
        name: the stream's bin name (for messages).
        now: the time it is created.
    """

    def __init__(self, name: str, now: float) -> None:
        self.name = name
        self.settings: Settings | None = None  # set by the first producer that opens it
        self.entries: deque[_Entry] = deque()
        self.base = 0  # the position of entries[0]
        self.head = 0  # the next position
        self.epoch = 0  # the epoch producers append to now
        self.epoch_start = 0
        self.epoch_sent = 0  # samples appended to it so far
        self.marked: dict[int, int] = {}  # producer -> samples it marked for ``epoch``
        self.epochs: dict[int, _Epoch] = {0: _Epoch(0)}
        self.aborted: set[int] = set()
        self.producers: dict[int, Producer] = {}
        self.consumers: dict[str, Consumer] = {}
        self.finished = False
        self.nbytes = 0  # bytes of the items kept
        self.n_items = 0  # items kept (epoch marks not counted)
        self.version = 0
        self.changed_at = 0.0
        self.ops: dict[str, int] = {}
        self.bytes_in = 0
        self.bytes_out = 0
        # Kept by the server's kind: the cost it counted for this stream, and the deadline
        # it has in its heap for it (never later than :meth:`next_deadline`).
        self.counted = 0
        self.due: float | None = None
        # A finished stream nobody is in is kept (listed, with its epochs) until this time.
        self.kept_until: float | None = None

    # -- settings and queries ---------------------------------------------------------------
    @property
    def cfg(self) -> Settings:
        """The settings (the defaults until a producer opened the stream)."""
        return self.settings or Settings()

    @property
    def broken(self) -> bool:
        """Whether a producer is gone (some epoch can never complete)."""
        return any(p.state == "gone" for p in self.producers.values())

    @property
    def idle(self) -> bool:
        """Whether nobody is in it any more (no live or away producer or consumer)."""
        return not any(c.state != "dropped" for c in self.consumers.values()) and \
            not any(p.state in ("live", "away") for p in self.producers.values())

    def expected(self) -> int | None:
        """The samples of the current epoch, as the producers announced them."""
        hints = [p.hint for p in self.producers.values()]
        if len(hints) < self.cfg.producers or any(h is None for h in hints):
            return None
        return sum(h for h in hints if h is not None)

    def epoch_samples(self, epoch: int) -> int | None:
        """The samples of ``epoch``: exact once it ended, else as announced (current)."""
        info = self.epochs.get(epoch)
        if info is not None and info.samples is not None:
            return info.samples
        return self.expected() if epoch >= self.epoch else None

    def position(self, pos: int | None) -> Position:
        """The epoch at position ``pos`` (``None``: the next epoch's start) and the samples
        of that epoch before it."""
        if pos is None:
            return Position(self.epoch + 1, 0, self.expected())
        pos = max(pos, self.base)
        if pos >= self.head:
            return Position(self.epoch, self.epoch_sent, self.epoch_samples(self.epoch))
        e = self.entries[pos - self.base]
        return Position(e.epoch, e.offset, self.epoch_samples(e.epoch))

    def live_consumers(self) -> int:
        return sum(1 for c in self.consumers.values() if c.state != "dropped")

    def _count(self, op: str) -> None:
        self.ops[op] = self.ops.get(op, 0) + 1

    # -- producers --------------------------------------------------------------------------
    def open(self, index: int, owner: Any, settings: Settings, lease: float,
             hint: int | None, now: float) -> tuple[StreamOpened, list[Event]]:
        """A producer opens the stream (a reopen by the same owner carries on; one by another
        owner takes the slot over, and any epoch broken by a gone producer ends as aborted).

        Raises:
            InvalidRequest: the settings differ from those of the live producers.
        """
        others = [p for p in self.producers.values()
                  if p.index != index and p.state in ("live", "away")]
        if self.settings is not None and settings != self.settings and others:
            raise InvalidRequest(f"stream {self.name!r} is open with other settings "
                                 f"({self.settings}); its producers must agree")
        self._count("open")
        p = self.producers.get(index)
        if p is not None and p.owner == owner and p.state in ("live", "away"):
            p.state, p.seen, p.lease, p.hint = "live", now, lease, hint
            return self._opened(p), []
        if self.finished:  # a new run after the last one: every producer opens again
            self.finished = False
            self.producers = {i: q for i, q in self.producers.items() if q.state != "done"}
        if p is not None and p.state in ("live", "away"):
            p.state = "gone"  # taken over: the old instance's epoch cannot be trusted
        self.settings = settings
        events: list[Event] = [("open", 0)]
        repair = any(q.state == "gone" for q in self.producers.values())
        self.producers[index] = Producer(index, owner, lease, now, self.epoch, hint=hint)
        aborted = None
        if repair:
            aborted, more = self._repair(now)
            events += more
        return self._opened(self.producers[index], aborted), events

    def _opened(self, p: Producer, aborted: int | None = None) -> StreamOpened:
        return StreamOpened(0, p.epoch, self.head, p.sent, self.live_consumers(), self.broken,
                            aborted)

    def _repair(self, now: float) -> tuple[int | None, list[Event]]:
        """A producer came back: the epoch a gone producer broke ends as aborted (if anything
        of it was sent) and every producer starts the next one, those that had ended the
        aborted epoch as their last included: an epoch ends only when every producer marked
        it, so they must send it again (one that no longer answers is gone after its lease,
        and consumers get ``ProducerGone`` instead of waiting for it). Returns the epoch it
        ended as aborted (``None``: nothing of it was sent, it goes on) and the events."""
        events: list[Event] = []
        marked = set(self.marked)
        aborted = None
        if self.epoch_start < self.head or self.marked:
            aborted = self.epoch
            self._close_epoch(now, aborted=True)
            events.append(("epoch", 0))
        for p in self.producers.values():
            if p.state == "done" and p.index in marked:
                p.state, p.seen = "away", now  # its lease runs from now
            if p.state != "done":
                p.epoch, p.sent = self.epoch, 0
        return aborted, events

    def _producer(self, index: int, owner: Any, epoch: int) -> Producer:
        """The producer ``index`` of ``owner``, checked to be appending to ``epoch``.

        Raises:
            InvalidRequest: opened by another owner, done, or another epoch.
            ProducerGone: not open (the stream was made anew since), it was gone, or its
                epoch was aborted or cannot complete.
        """
        p = self.producers.get(index)
        if p is None:
            raise ProducerGone(f"producer {index} is not open in stream {self.name!r} (the "
                               f"server restarted, or the stream was removed while nobody "
                               f"was in it): open the stream again")
        if p.owner != owner:
            raise InvalidRequest(f"producer {index} of stream {self.name!r} is not open by "
                                 f"this client (stream_open first)")
        if p.state == "gone":
            raise ProducerGone(f"producer {index} of stream {self.name!r} counted as gone "
                               f"(unreachable longer than its lease): open the stream again")
        if p.state == "done":
            raise InvalidRequest(f"producer {index} of stream {self.name!r} ended its last "
                                 f"epoch")
        if epoch != p.epoch:
            if epoch in self.aborted:
                raise ProducerGone(f"epoch {epoch} of stream {self.name!r} was aborted (a "
                                   f"producer died); it now produces epoch {p.epoch}")
            raise InvalidRequest(f"producer {index} of stream {self.name!r} is in epoch "
                                 f"{p.epoch}, not {epoch}")
        g = self._gone_for(p.epoch)
        if g is not None:
            raise ProducerGone(f"producer {g.index} of stream {self.name!r} is gone: epoch "
                               f"{p.epoch} cannot complete until it opens the stream again")
        p.state = "live"  # (one that was away is back)
        return p

    def check_append(self, index: int, owner: Any, epoch: int, k: int, now: float) -> None:
        """Whether an append of ``k`` items may wait to be stored (else it raises).

        Raises:
            as :meth:`_producer`; InvalidRequest: more items than the window.
        """
        p = self._producer(index, owner, epoch)
        p.seen = now
        if k > self.cfg.window:
            raise InvalidRequest(f"an append of {k} items to stream {self.name!r} can never "
                                 f"fit its window={self.cfg.window}")

    def append_ready(self, index: int, k: int) -> bool:
        """Whether ``k`` items of producer ``index`` can be stored now (its epoch is the
        stream's and the window has room)."""
        p = self.producers[index]
        return p.epoch == self.epoch and self.head + k - self._floor(False) <= self.cfg.window

    def why_held(self, index: int) -> str:
        """Why an append of producer ``index`` waits (for messages)."""
        p = self.producers.get(index)
        if p is not None and p.epoch > self.epoch:
            return (f"it waits for the other producers to end epoch {self.epoch}")
        slow = min((c for c in self.consumers.values() if c.holds),
                   key=lambda c: c.acked or 0, default=None)
        if slow is None:
            return "its window is full"
        return (f"consumer {slow.name!r} is {self.head - (slow.acked or 0)} positions behind "
                f"(window={self.cfg.window})")

    def append(self, index: int, entries: list[tuple[Any, int, int]], now: float) -> int:
        """Store items of producer ``index`` (checked and ready): ``(item, nbytes, samples)``
        each. Returns the position of the first."""
        p = self.producers[index]
        pos = self.head
        for item, nbytes, n in entries:
            self.entries.append(_Entry(item, nbytes, self.epoch, self.epoch_sent, n))
            self.epoch_sent += n
            p.sent += n
            self.nbytes += nbytes
            self.bytes_in += nbytes
        self.head += len(entries)
        self.n_items += len(entries)
        self.changed_at = now
        self._count("append")
        self._settle(now)
        return pos

    def end_ready(self, index: int) -> bool:
        """Whether producer ``index`` may mark its epoch now: the earlier one ended and, if
        its mark ends the epoch (the epoch mark takes a position), the window has room for
        it, as for an append."""
        if self.producers[index].epoch != self.epoch:
            return False
        marks = sum(1 for q in self.producers.values() if q.index in self.marked
                    or q.index == index)
        return marks < self.cfg.producers or \
            self.head + 1 - self._floor(False) <= self.cfg.window

    def end(self, index: int, owner: Any, epoch: int, samples: int, last: bool, now: float,
            check_only: bool = False) -> tuple[StreamEnded, list[Event]]:
        """Producer ``index`` marks the end of ``epoch`` with the samples it sent; the epoch
        ends once every producer marked it (``last`` from all: the stream is finished).

        Raises:
            as :meth:`_producer`; InvalidRequest: ``samples`` is not what it appended.
        """
        p = self._producer(index, owner, epoch)
        p.seen = now
        if samples != p.sent:
            raise InvalidRequest(f"producer {index} says it sent {samples} samples in epoch "
                                 f"{epoch} of stream {self.name!r}; the stream received "
                                 f"{p.sent}")
        if check_only:
            return StreamEnded(0, p.epoch), []
        self._count("end")
        self.marked[index] = samples
        p.epoch, p.sent = epoch + 1, 0
        if last:
            p.state = "done"
        done = [q for q in self.producers.values() if q.index in self.marked]
        if len(done) < self.cfg.producers:
            return StreamEnded(0, p.epoch), []
        final = all(q.state == "done" for q in done)
        self._close_epoch(now, aborted=False)
        self.finished = final
        return StreamEnded(0, p.epoch, True, final), [("epoch", 0)]

    def _close_epoch(self, now: float, *, aborted: bool) -> None:
        e, total = self.epoch, self.epoch_sent
        self.entries.append(_Entry(None, 0, e, total, 0, aborted))
        info = self.epochs.setdefault(e, _Epoch(self.epoch_start))
        info.end, info.samples, info.aborted = self.head, total, aborted
        if aborted:
            self.aborted.add(e)
        self.head += 1
        self.epoch, self.epoch_start, self.epoch_sent, self.marked = e + 1, self.head, 0, {}
        self.epochs[e + 1] = _Epoch(self.head)
        while len(self.epochs) > EPOCHS_KEPT:
            old = next(iter(self.epochs))
            del self.epochs[old]
            self.aborted.discard(old)
        for c in self.consumers.values():  # those waiting for the next epoch start here
            if c.cursor is None and c.state != "dropped":
                c.cursor = c.acked = self.head
        self.changed_at = now
        self._settle(now)

    def _gone_for(self, epoch: int) -> Producer | None:
        """A gone producer that has not marked ``epoch`` (so it can never complete)."""
        for p in self.producers.values():
            if p.state == "gone" and p.epoch <= epoch:
                return p
        return None

    # -- consumers --------------------------------------------------------------------------
    def join(self, name: str, owner: Any, start: str, lease: float, resume: bool,
             now: float) -> tuple[StreamJoined, list[Event]]:
        """A consumer joins (a known one resumes at what it acknowledged, with ``resume``).

        Raises:
            InvalidRequest: ``"epoch_start"`` but the current epoch's first items are freed.
            LimitExceeded: the stream has :data:`MAX_CONSUMERS` consumers.
        """
        self._count("join")
        c = self.consumers.get(name)
        events: list[Event] = []
        if c is not None and resume:
            if c.state == "dropped":
                events.append(("join", 0))
            c.owner, c.lease, c.seen, c.state = owner, lease, now, "live"
            c.cursor = c.acked
            where = self.position(c.cursor)
            return StreamJoined(0, c.cursor, where.epoch, where.offset, where.epoch_samples,
                                self.head, True, self._at_end(c.cursor)), events
        pos = self._start(start)
        if c is None:
            self._make_room()
        self.consumers[name] = Consumer(name, owner, lease, now, pos, pos)
        self._settle(now)
        where = self.position(pos)
        return StreamJoined(0, pos, where.epoch, where.offset, where.epoch_samples, self.head,
                            False, self._at_end(pos)), [("join", 0)]

    def _at_end(self, pos: int | None) -> bool:
        """Whether a consumer at ``pos`` has read all of a finished stream."""
        return self.finished and pos is not None and pos >= self.head

    def _start(self, start: str) -> int | None:
        if start == "now":
            return self.head
        if start == "next_epoch":
            return self.head if self.epoch_start == self.head else None
        # "epoch_start" needs the epoch kept (replay="epoch"): never by chance, because its
        # first items happen not to be freed yet. (A stream no producer opened yet has sent
        # nothing: its first epoch starts where a consumer joining now starts.)
        if self.settings is not None and self.cfg.replay != "epoch" or \
                self.epoch_start < self.base:
            raise InvalidRequest(
                f"stream {self.name!r} does not keep the start of its epochs (its producers "
                f"opened it with replay={self.cfg.replay!r}; replay='epoch' keeps it): join "
                f"at 'now' or 'next_epoch'")
        return self.epoch_start

    def _make_room(self) -> None:
        if len(self.consumers) < MAX_CONSUMERS:
            return
        dropped = next((n for n, c in self.consumers.items() if c.state == "dropped"), None)
        if dropped is None:
            raise LimitExceeded(f"stream {self.name!r} has {MAX_CONSUMERS} consumers, its "
                                f"limit (MAX_CONSUMERS)")
        del self.consumers[dropped]

    def consumer(self, name: str, owner: Any, now: float) -> tuple[Consumer, list[Event]]:
        """The consumer ``name``, now served for ``owner`` (one that was dropped comes back).

        Raises:
            BinNotFound: no such consumer (it must join first).
        """
        c = self.consumers.get(name)
        if c is None:
            raise BinNotFound(f"consumer {name!r} is not in stream {self.name!r}: "
                              f"stream_join first")
        events: list[Event] = [("join", 0)] if c.state == "dropped" else []
        c.owner, c.seen, c.state = owner, now, "live"
        return c, events

    def ack(self, c: Consumer, at: int | None, now: float) -> None:
        """Consumer ``c`` will read from ``at`` next: everything before it is acknowledged.

        Raises:
            InvalidRequest: ``at`` is beyond the stream's head.
        """
        if at is not None:
            if at > self.head:
                raise InvalidRequest(f"position {at} of stream {self.name!r} does not exist "
                                     f"yet (head {self.head})")
            c.cursor = at
            if c.acked is None or at > c.acked:
                c.acked = at
        self._reattach(c)
        self._settle(now)

    def _reattach(self, c: Consumer) -> None:
        """A detached consumer reads again: it is back, a consumer like the others. It holds
        the window again from where it is, or from the oldest item kept if what it had not
        acknowledged was freed meanwhile (its read skips those and reports them missed),
        and its stall clock starts afresh."""
        if c.detached:
            c.detached = False
            if c.acked is not None and c.acked < self.base:
                c.acked = self.base

    def read(self, name: str, pos: int | None, max_items: int | None, max_bytes: int,
             now: float) -> StreamItems | None:
        """Items of one epoch for consumer ``name`` from ``pos`` (``None``: its cursor), at
        most ``max_items`` and ``max_bytes`` (at least one item); ``None`` if there is
        nothing yet (the caller waits). Moves the consumer's cursor past them.

        Raises:
            ProducerGone: the epoch at that position can never complete.
        """
        c = self.consumers[name]
        pos = c.cursor if pos is None else pos
        if pos is None:
            return None  # it waits for the next epoch to begin
        missed = 0
        if pos < self.base:  # freed before it read them: it lagged
            missed = self._items_between(pos, self.base)
            pos = self.base
            c.missed += missed
            c.acked = max(c.acked or 0, pos)
            self._reattach(c)
        g = self._gone_for(self.position(pos).epoch)
        if g is not None:
            raise ProducerGone(f"producer {g.index} of stream {self.name!r} is gone (its "
                               f"connection was lost for longer than its lease) before ending "
                               f"epoch {g.epoch}; join again at 'next_epoch' to go on once a "
                               f"producer opens the stream again")
        taken, nxt, mark = self._take(pos, max_items, max_bytes)
        if not taken and mark is None and not missed and not (self.finished and pos == self.head):
            return None
        c.cursor = nxt
        c.reads += 1
        self._count("read")
        size = sum(e.nbytes for e in taken)
        self.bytes_out += size
        where = self.position(pos)
        return StreamItems(0, tuple(e.item for e in taken), pos, nxt, where.epoch, where.offset,
                           where.epoch_samples, None if mark is None else mark.offset,
                           mark is not None and mark.aborted, missed,
                           self.finished and nxt == self.head,
                           tuple(e.item.tag for e in taken), size)

    def _take(self, pos: int, max_items: int | None, max_bytes: int
              ) -> tuple[list[_Entry], int, _Entry | None]:
        """The items from ``pos`` to the next epoch mark (the mark included, if reached)."""
        entries = self.entries
        i, n = pos - self.base, len(entries)
        taken: list[_Entry] = []
        size = 0
        while i < n:
            e = entries[i]
            if e.item is None:
                return taken, self.base + i + 1, e
            if taken and ((max_items is not None and len(taken) >= max_items)
                          or size + e.nbytes > max_bytes):
                break
            taken.append(e)
            size += e.nbytes
            i += 1
        return taken, self.base + i, None

    def _items_between(self, a: int, b: int) -> int:
        marks = sum(1 for info in self.epochs.values()
                    if info.end is not None and a <= info.end < b)
        return max(b - a - marks, 0)

    def leave(self, name: str, now: float) -> bool:
        """Consumer ``name`` leaves. Returns whether it was in the stream."""
        c = self.consumers.pop(name, None)
        if c is None:
            return False
        self._count("leave")
        self._settle(now)
        return True

    # -- liveness ---------------------------------------------------------------------------
    def members(self) -> Iterator[Producer | Consumer]:
        yield from self.producers.values()
        yield from self.consumers.values()

    def lost(self, owned: Callable[[Any], bool], now: float, gone: Any = None) -> None:
        """The connection of the members ``owned`` says they have is gone: their lease runs
        from now. ``gone``: the owner they have from now on when theirs was that connection
        itself (a client without a session, which never comes back as that owner), so that
        the stream holds nothing of a closed connection."""
        for m in self.members():
            if owned(m.owner):
                if m.state == "live":
                    m.state, m.seen = "away", now
                if gone is not None:
                    m.owner = gone

    def ended(self, owner: Any, now: float) -> list[Event]:
        """The session ``owner`` ended (its client said goodbye, or it expired): its
        consumers are dropped, its producers that had not ended their last epoch are gone."""
        events: list[Event] = []
        for m in self.members():
            if m.owner == owner and m.state in ("live", "away"):
                events.append(self._drop(m))
        self._settle(now)
        return events

    def _drop(self, m: Producer | Consumer) -> Event:
        if isinstance(m, Consumer):
            m.state = "dropped"
            return "leave", 0
        m.state = "gone"
        return "gone", 0

    def check(self, now: float, heard: Callable[[Any], float | None]) -> list[Event]:
        """Leases and stalls at time ``now``: a member whose lease ran out is dropped unless
        ``heard(owner)`` (the seconds since its connection was last heard from, ``None``
        when it has no open connection) is within its lease; a stalled consumer of an
        ``on_lag="detach"`` stream is detached.

        A member kept alive by its connection (its heartbeats) has its lease run from when
        that connection was last heard from, not from this check: one that falls silent
        (a machine gone without closing its connections) is dropped one lease after it was
        last heard, not up to a lease later."""
        events: list[Event] = []
        for m in list(self.members()):
            if m.state in ("live", "away") and now >= m.seen + m.lease:
                silent = heard(m.owner)
                if silent is not None and silent < m.lease:
                    m.state, m.seen = "live", max(m.seen, now - silent)
                else:
                    events.append(self._drop(m))
        cfg = self.cfg
        if cfg.on_lag == "detach":
            for c in self.consumers.values():
                if c.holds and c.stall_since is not None and \
                        now - c.stall_since >= cfg.stall_limit:
                    c.detached = True
                    events.append(("lag", self.head - (c.acked or 0)))
        self._settle(now)
        return events

    def next_deadline(self) -> float | None:
        """When :meth:`check` (or, for a finished stream nobody is in, its removal) has
        something to do next (``None``: never)."""
        due = [m.seen + m.lease for m in self.members() if m.state in ("live", "away")]
        if self.kept_until is not None:
            due.append(self.kept_until)
        if self.cfg.on_lag == "detach":
            due += [c.stall_since + self.cfg.stall_limit for c in self.consumers.values()
                    if c.holds and c.stall_since is not None]
        return min(due, default=None)

    # -- memory -----------------------------------------------------------------------------
    def _floor(self, replay: bool = True) -> int:
        """The oldest position someone still needs (``replay``: the current epoch's start
        too, with ``replay="epoch"``)."""
        f = self.head
        for c in self.consumers.values():
            if c.holds and c.acked is not None and c.acked < f:
                f = c.acked
        if replay and self.cfg.replay == "epoch" and self.epoch_start < f:
            f = self.epoch_start
        return f

    def charge(self, pos: int, count: int, owner: Any) -> None:
        """Count the ``count`` items appended at ``pos`` that are still kept for ``owner`` (a
        user's usage) until they are freed."""
        for i in range(max(pos - self.base, 0), min(pos + count - self.base, len(self.entries))):
            e = self.entries[i]
            if e.item is not None and e.owner is None:
                e.owner = owner
                owner.stored += e.nbytes

    def _settle(self, now: float) -> None:
        """Free what nobody needs; start or stop the stall clock of each consumer."""
        floor = self._floor()
        entries = self.entries
        while self.base < floor and entries:
            e = entries.popleft()
            self.nbytes -= e.nbytes
            if e.owner is not None:
                e.owner.stored -= e.nbytes
            if e.item is not None:
                self.n_items -= 1
            self.base += 1
        window = self.cfg.window
        for c in self.consumers.values():
            holding = c.holds and self.head - (c.acked or 0) >= window
            if holding and c.stall_since is None:
                c.stall_since = now
            elif not holding and c.stall_since is not None:
                c.stall_total += now - c.stall_since
                c.stall_since = None

    @property
    def cost(self) -> int:
        """Bytes counted against ``max_memory``: the items kept and the records."""
        return self.nbytes + STREAM_COST + CONSUMER_COST * (len(self.consumers)
                                                            + len(self.producers))

    # -- statistics -------------------------------------------------------------------------
    def describe(self, now: float) -> dict[str, Any]:
        """A summary for the stats (see :meth:`StreamKind.describe`)."""
        first = next((e for e in self.entries if e.item is not None), None)
        last = next((e for e in reversed(self.entries) if e.item is not None), None)
        return {
            "kind": "stream", "n_items": self.n_items, "nbytes": self.nbytes,
            "version": self.version, "changed_at": self.changed_at, "ops": dict(self.ops),
            "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
            "limits": {"max_items": None, "max_bytes": None, "overflow": "block"},
            "first": None if first is None else codec.describe(first.item.value.value),
            "last": None if last is None or last is first
            else codec.describe(last.item.value.value),
            "stream": self._describe_stream(now),
        }

    def _describe_stream(self, now: float) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "head": self.head, "base": self.base, "epoch": self.epoch,
            "epoch_start": self.epoch_start, "epoch_sent": self.epoch_sent,
            "epoch_samples": self.expected(), "window": cfg.window, "on_lag": cfg.on_lag,
            "max_stall": cfg.stall_limit if cfg.on_lag == "detach" else None,
            "replay": cfg.replay, "producers_expected": cfg.producers,
            "device_ipc": cfg.device_ipc,
            "finished": self.finished, "broken": self.broken,
            "producers": {str(p.index): {
                "state": p.state, "epoch": p.epoch, "sent": p.sent, "samples": p.hint,
                "silent_s": round(max(now - p.seen, 0.0), 3), "lease": p.lease}
                for p in self.producers.values()},
            "consumers": {c.name: self._describe_consumer(c, now)
                          for c in self.consumers.values()},
        }

    def _describe_consumer(self, c: Consumer, now: float) -> dict[str, Any]:
        state = c.state
        if state != "dropped":
            state = "pending" if c.cursor is None else ("detached" if c.detached else state)
        stalled = now - c.stall_since if c.stall_since is not None else 0.0
        return {"state": state, "position": c.acked, "cursor": c.cursor,
                "lag": None if c.acked is None else self.head - c.acked,
                "stalled_s": round(stalled, 3),
                "stall_total_s": round(c.stall_total + stalled, 3), "missed": c.missed,
                "reads": c.reads, "lease": c.lease}
