"""Stream bins: one sequence of items that every consumer of the stream receives.

A stream has positions the server assigns (0, 1, 2, ...). Producers append items to their
current epoch and mark its end with the samples they sent; once every producer marked an
epoch the server puts an *epoch mark* in the sequence (it takes a position). Each consumer
has a name and a cursor kept here: a read names the position it wants (which acknowledges
everything before it) and gets the items of one epoch from there, never across a mark.

* **Bounded memory.** An item is freed once every live consumer acknowledged it (and, with
  ``replay="epoch"``, once its epoch is over). A producer's append is held while the stream
  holds more than ``window`` positions its slowest live consumer has not acknowledged.
* **Leases.** A producer or consumer whose connection is gone (or silent) for longer than
  its lease is dropped: one lease after its connection closed (a killed process's closes
  at once), or after it was last heard from (requests and heartbeats) if its connection
  stays open but silent. A consumer then stops holding anyone back (one that comes back
  later learns how many items it missed); a producer that had not ended its epoch is
  *gone*, and that epoch can never complete: consumers reading it get ``ProducerGone``
  instead of waiting, until a producer opens the stream again, which ends the broken epoch
  as *aborted* and starts a new one.
* **Lag.** Under ``on_lag="detach"`` a consumer that held the window full for longer than
  ``max_stall`` seconds is detached: it no longer holds anyone back. Its next read brings it
  back: it skips what was freed meanwhile (the read reports it ``missed``) and holds the
  window again, like every other consumer.

:class:`Stream` is the bookkeeping of one stream, a pure data structure (the time is passed
in; no connections, no timers) tested on its own; :class:`StreamKind` is the server's kind of
bin over it: handlers, waiting requests, the one timer for leases and stalls, statistics.

With a data directory, or while a replica follows this server, every change of a stream is a
record of the data log and every stream is in the snapshots and full copies
(:mod:`.streamlog`): a restarted server has its streams back, and a replica holds its
primary's (it refuses their ops, ``read_only_replica``, until it is promoted; then the
members' leases run from the promotion, and a client that resumes its session carries on).
Without either, nothing of the kind is built: no record costs an append anything.
"""

from __future__ import annotations

import fnmatch
import heapq
import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from twisted.internet.interfaces import IDelayedCall

from ..errors import (
    BinFull,
    BinNotFound,
    InvalidRequest,
    LimitExceeded,
    PermissionDenied,
    ServerError,
    WaitTimeout,
    code_for,
)
from ..wire import codec
from ..wire.messages import Acked, ErrorReply
from ..wire.protocol import item_wire_size, items_header
from ..wire.streams import (
    ProducerGone,
    StreamAppend,
    StreamAppended,
    StreamEnd,
    StreamEnded,
    StreamItems,
    StreamJoin,
    StreamJoined,
    StreamLeave,
    StreamOpen,
    StreamOpened,
    StreamRead,
)
from .kinds import check_memory, claim_name

if TYPE_CHECKING:
    from .parts import AnyReply, Conn, Handler, Server

__all__ = ["CONSUMER_COST", "FINISHED_TTL", "MAX_CONSUMERS", "MAX_FINISHED_STREAMS",
           "STREAM_COST", "Settings", "Stream", "StreamKind"]

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
#: Seconds a finished stream that nobody is in stays listed (so that a job that joins late
#: learns it is finished, and how many epochs it had, instead of finding a new, empty one).
FINISHED_TTL = 3600.0
#: The most finished streams kept that nobody is in; beyond, the longest kept go first.
MAX_FINISHED_STREAMS = 1024

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


# -- the server's kind ----------------------------------------------------------------------
class _Gone:
    """The owner of a stream's member whose client had no session, once its connection is
    gone (equal to nothing else: no later connection is that owner)."""

    __slots__ = ("peer",)

    def __init__(self, peer: str) -> None:
        self.peer = peer

    def __repr__(self) -> str:
        return f"<gone client at {self.peer}>"


#: ``_try_read``'s ``at`` for a read that was waiting (it acknowledged nothing now).
_NO_ACK = object()


@dataclass(eq=False, slots=True)
class _Waiting:
    """A stream request waiting on the server (a held append or end, a waiting read).

    ``name`` is empty, never a bin name: the connection withdraws a waiting request through
    the store's ``cancel``, which then only marks it inactive (the kind drops inactive ones).
    """

    conn: Conn
    msg: Any
    entries: list[tuple[Any, int, int]] = field(default_factory=list)
    pos: int | None = None  # a read's position
    name: str = ""
    active: bool = True



def _same_host(st: Stream, conn: Any) -> None:
    """Refuse a consumer of a ``device_ipc`` stream that is not on this host: its items
    point into the producer's GPU memory, which only a process on the same host (reached
    over the Unix socket) can open."""
    if st.settings is not None and st.cfg.device_ipc and \
            not getattr(conn.transport, "_passes_fds", False):
        raise InvalidRequest(
            f"stream {st.name!r} carries CUDA IPC handles (its producer opened it with "
            f"device_ipc=True): its consumers must run on the server's host and connect "
            f"over unix://, and this connection is TCP")

class StreamKind:
    """Stream bins on a server (see the module docstring).

    Args:
        server: the server's state (its reactor runs the lease timer).
    """

    name = "stream"

    def __init__(self, server: Server) -> None:
        self.server = server
        self.streams: dict[str, Stream] = {}
        self.table = self.streams
        self._held: dict[str, list[_Waiting]] = {}
        self._reads: dict[str, list[_Waiting]] = {}
        self._timer: IDelayedCall | None = None
        # Every op and every tick looks at the streams it concerns only, never at all of
        # them: the bytes all streams cost (kept as each changes), their deadlines in a heap
        # (deadline, sequence, stream; an entry is stale once its stream's ``due`` moved),
        # and the streams each owner (session or connection) is a member of.
        self._cost = 0
        self._deadlines: list[tuple[float, int, Stream]] = []
        self._seq = itertools.count()
        self._by_owner: dict[Any, set[str]] = {}
        self._kept: OrderedDict[str, None] = OrderedDict()  # finished, idle: oldest first
        # The last version of each name whose stream was removed, so that a listener never
        # sees a version go backwards when a stream of that name comes back.
        self._versions: dict[str, int] = {}

    def handlers(self) -> dict[type, Handler]:
        return {StreamOpen: self._open, StreamAppend: self._append, StreamEnd: self._end,
                StreamJoin: self._join, StreamRead: self._read, StreamLeave: self._leave}

    def owns(self, name: str) -> bool:
        return name in self.streams

    @property
    def nbytes(self) -> int:
        """What every stream costs (asked on every write: kept, never summed)."""
        return self._cost

    # -- the data log (see .streamlog) ------------------------------------------------------
    def persisted(self, p: Any) -> None:
        """The server keeps a data log ``p`` (a data directory, or a replica's record stream):
        streams are in it (called before it loads)."""
        from .streamlog import StreamLog

        StreamLog(self, self.server.config.limits.max_depth).register(p)

    @property
    def _following(self) -> bool:
        repl = getattr(self.server, "replication", None)  # (a test's bare server has none)
        return repl is not None and repl.role == "replica"

    def _logs(self) -> Any:
        """The data log to write a change to: ``None`` without one (no record is built), and
        on a replica (its records are its primary's)."""
        p = self.server.persist
        return None if p is None or self._following else p

    def _log(self, header: dict[str, Any], conn: Conn | None = None, msg: Any = None,
             buffers: list[Any] | None = None) -> None:
        p = self._logs()
        if p is None:
            return
        if conn is not None:
            ctx = conn.ctx(msg)
            if ctx is not None:
                header["s"], header["id"] = ctx
        p.add(header, buffers)

    def _log_state(self, st: Stream, events: list[Event], conn: Conn | None = None,
                   msg: Any = None, reply: Any = None) -> None:
        """A change of ``st`` other than an append or a read: its whole bookkeeping (with the
        reply of the request that made it, remembered again where it is replayed), and its
        version once the ``events`` it makes are told (each counts one)."""
        if self._logs() is None:
            return
        from .streamlog import REPLY_OPS, reply_fields, state_of

        state = state_of(st)
        state["version"] += len(events)
        h: dict[str, Any] = {"op": "stream_state", "bin": st.name, "state": state}
        if reply is not None and conn is not None and conn.session is not None:
            h["req_op"], h["reply"] = REPLY_OPS[type(reply)], reply_fields(reply)
        self._log(h, conn, msg)

    def _log_read(self, st: Stream, w: _Waiting, at: Any, res: StreamItems | None) -> None:
        if self._logs() is None:
            return
        msg: StreamRead = w.msg
        h: dict[str, Any] = {"op": "stream_read", "bin": st.name, "consumer": msg.consumer,
                             "at": at}
        if res is not None:
            h.update(read=True, pos=w.pos, max_items=msg.max_items,
                     max_bytes=self.server.max_reply_bytes, next=res.next)
        self._log(h, w.conn, msg)

    def adopt(self, st: Stream) -> Stream:
        """Take a stream read back from the data log (or a replica's full copy)."""
        st.version = max(st.version, self._versions.pop(st.name, 0))
        self.streams[st.name] = st
        return st

    def followed(self, st: Stream, op: str | None) -> None:
        """A record of the data log changed ``st`` (a restart's replay, or a replica following
        its primary): its cost and owners kept, its listeners told."""
        self._recount(st)
        for m in st.members():
            if isinstance(m.owner, bytes):
                self._by_owner.setdefault(m.owner, set()).add(st.name)
        if op is not None:
            st.version += 1
        self.server.changed(st.name, op or "put", st.n_items, st.version, 0)

    def took_over(self) -> None:
        """This server serves the streams it read back (a restart, or a promotion): every
        member's lease runs from now (a client that resumes its session carries on), and
        the streams' timers start."""
        if self._following:
            return
        now = self._now()
        for st in list(self.streams.values()):
            for m in st.members():
                if m.state == "live":
                    m.state = "away"
                if m.state == "away":
                    m.seen = now
            st.due = None
            self._after(st, [])

    # -- helpers ----------------------------------------------------------------------------
    def _now(self) -> float:
        return float(self.server.reactor.seconds())

    @staticmethod
    def _owner(conn: Conn) -> Any:
        """Whom a member belongs to: its client's session (so that it survives the
        client's reconnects), or the connection of a client without one."""
        return conn.session.id if conn.session is not None else conn

    def _member(self, st: Stream, conn: Conn) -> Any:
        """The owner of ``conn``, noted as a member of ``st`` (so that its connection's or
        session's end looks at the streams it is in, not at every stream)."""
        owner = self._owner(conn)
        self._by_owner.setdefault(owner, set()).add(st.name)
        return owner

    def _conn_of(self, owner: Any) -> Any:
        if isinstance(owner, bytes):
            s = self.server.sessions.get(owner)
            return None if s is None else s.attached
        return owner

    def _heard(self, owner: Any) -> float | None:
        """Seconds since the connection of ``owner`` was last heard from (any bytes: a
        request or a heartbeat); ``None`` when it has no open connection."""
        conn = self._conn_of(owner)
        if conn is None or conn not in self.server.connections or conn.closed:
            return None
        return max(time.monotonic() - conn.last_rx, 0.0)

    def _stream(self, name: str, create: bool) -> Stream:
        """The stream ``name`` (made if ``create``).

        Raises:
            InvalidRequest: the name is a bin of another kind.
            BinNotFound: no such stream (and not ``create``).
            MemoryLimitExceeded: a new stream would exceed ``max_memory``.
        """
        st = self.streams.get(name)
        if st is not None:
            return st
        claim_name(self, self.server, name)
        if not create:
            raise BinNotFound(f"no stream {name!r}: a producer opens it (stream_open), or a "
                              f"consumer joins it (stream_join)")
        check_memory(self.server, STREAM_COST, f"a new stream {name!r}", "stored")
        st = self.streams[name] = Stream(name, self._now())
        st.version = self._versions.pop(name, 0)
        return st

    def _after(self, st: Stream, events: list[Event]) -> None:
        """After a change: notify listeners, serve what waits, drop an idle stream, and
        keep its cost and its deadline right."""
        for op, n in events:
            self._notify(st, op, n)
        self._pump(st)
        if self.streams.get(st.name) is not st:
            return
        if not st.idle:
            if st.kept_until is not None:
                st.kept_until = None
                self._kept.pop(st.name, None)
            self._track(st)
        elif st.finished and self._keep(st):
            self._track(st)
        else:
            self._remove(st)

    def _keep(self, st: Stream) -> bool:
        """Whether ``st``, finished and nobody in it, stays listed: for
        :data:`FINISHED_TTL` seconds from when its last member left, the
        :data:`MAX_FINISHED_STREAMS` most recent only. What it keeps of its consumers is
        those that have not read all of it (one that comes back learns what it missed)."""
        now = self._now()
        if st.kept_until is None:
            st.kept_until = now + FINISHED_TTL
            st.consumers = {n: c for n, c in st.consumers.items()
                            if c.acked is None or c.acked < st.head}
            self._kept[st.name] = None
            self._log_state(st, [])
            while len(self._kept) > MAX_FINISHED_STREAMS:
                old = self.streams.get(self._kept.popitem(last=False)[0])
                if old is not None and old is not st:
                    self._remove(old)
        return now < st.kept_until

    def _notify(self, st: Stream, op: str, n: int = 0) -> None:
        st.version += 1
        st.changed_at = self._now()
        self.server.changed(st.name, op, st.n_items, st.version, n)

    def _remove(self, st: Stream, logged: bool = True) -> None:
        if logged:
            self._log({"op": "stream_remove", "bin": st.name})
        del self.streams[st.name]
        self._kept.pop(st.name, None)
        self._cost -= st.counted
        st.counted, st.due = 0, None
        for m in st.members():
            names = self._by_owner.get(m.owner)
            if names is not None:
                names.discard(st.name)
                if not names:
                    del self._by_owner[m.owner]
        for e in st.entries:  # (what it still kept no longer counts for its producers)
            if e.owner is not None:
                e.owner.stored -= e.nbytes
                e.owner = None
        self._versions[st.name] = st.version
        if len(self._versions) > 100_000:  # a bound: the oldest names are forgotten
            del self._versions[next(iter(self._versions))]
        for w in self._held.pop(st.name, []) + self._reads.pop(st.name, []):
            if w.active:
                self._answer(w, ErrorReply(w.msg.id, BinNotFound.code,
                                           f"stream {st.name!r} was removed: nobody is in it"))

    @staticmethod
    def _answer(w: _Waiting, reply: Any) -> None:
        """Answer a request that waited (a held append or end, a waiting read)."""
        w.active = False
        w.conn.stop_waiting(w.msg.id)
        w.conn.answer(w.msg, reply)

    def _error(self, w: _Waiting, exc: ServerError) -> None:
        self._answer(w, ErrorReply(w.msg.id, code_for(exc), str(exc)))

    def _then_after(self, conn: Conn, st: Stream, events: list[Event]) -> None:
        """Once the request being handled is answered: :meth:`_after` (its notifications
        follow its reply, and so does what it let go of what waits on ``st``)."""
        conn.then(lambda: self._after(st, events))

    # -- producers --------------------------------------------------------------------------
    def _open(self, conn: Conn, msg: StreamOpen) -> StreamOpened:
        st = self._stream(msg.bin, True)
        settings = Settings(msg.producers, msg.window, msg.on_lag, msg.max_stall, msg.replay,
                            msg.device_ipc)
        if msg.producer not in st.producers:
            check_memory(self.server, CONSUMER_COST, f"a producer of stream {msg.bin!r}", "stored")
        try:
            reply, events = st.open(msg.producer, self._member(st, conn), settings, msg.lease,
                                    msg.samples, self._now())
        except ServerError:
            self._after(st, [])
            raise
        self._then_after(conn, st, events)
        opened = StreamOpened(msg.id, reply.epoch, reply.head, reply.sent, reply.consumers,
                              reply.broken, reply.aborted)
        self._log_state(st, events, conn, msg, opened)
        return opened

    def _append(self, conn: Conn, msg: StreamAppend) -> StreamAppended | None:
        st = self._stream(msg.bin, False)
        samples = msg.samples or (1,) * len(msg.items)
        entries = [(it, item_wire_size(it), n) for it, n in zip(msg.items, samples, strict=True)]
        st.check_append(msg.producer, self._owner(conn), msg.epoch, len(entries), self._now())
        w = _Waiting(conn, msg, entries)
        if self._mine_waiting(st.name, msg.producer) or not st.append_ready(msg.producer,
                                                                             len(entries)):
            self._hold(st, w)
            return None
        reply = self._store(st, w)
        self._then_after(conn, st, [("append", 0)])
        return reply

    def _mine_waiting(self, name: str, producer: int) -> bool:
        """Whether an earlier request of this producer is held (they keep their order)."""
        return any(w.active and w.msg.producer == producer for w in self._held.get(name, ()))

    def _store(self, st: Stream, w: _Waiting) -> StreamAppended:
        """Store a checked, ready append; its reply.

        Raises:
            QuotaExceeded, MemoryLimitExceeded: it would exceed its user's quota or the
                server's ``max_memory`` (nothing was stored).
        """
        msg: StreamAppend = w.msg
        nbytes = sum(n for _, n, _ in w.entries)
        usage = w.conn.usage  # its user's quota first, then the server's memory
        if usage is not None:
            usage.check_room(nbytes, f"an append of {nbytes} bytes to stream {st.name!r}")
        check_memory(self.server, nbytes, f"an append to stream {st.name!r}", "stored")
        pos = st.append(msg.producer, w.entries, self._now())
        if self._logs() is not None:
            buffers: list[Any] = []
            self._log({"op": "stream_append", "bin": st.name, "producer": msg.producer,
                       "position": pos, "samples": [n for _, _, n in w.entries],
                       "items": items_header([e[0] for e in w.entries], buffers)},
                      w.conn, msg, buffers)
        self._recount(st)
        if usage is not None:
            st.charge(pos, len(w.entries), usage)
        return StreamAppended(msg.id, pos, st.head)

    def _hold(self, st: Stream, w: _Waiting) -> None:
        """Keep a request that must wait (an append, or an epoch end) until it can go."""
        msg = w.msg
        w.conn.wait(msg.id, w, msg.timeout, lambda: self._held_out(st, w))
        self._held.setdefault(st.name, []).append(w)
        self._track(st)

    def _held_out(self, st: Stream, w: _Waiting) -> None:
        msg = w.msg
        w.active = False
        if isinstance(msg, StreamEnd):  # the other producers, or the window (its mark)
            w.conn.answer(msg, ErrorReply(msg.id, WaitTimeout.code, (
                f"stream {st.name!r} held the end of epoch {msg.epoch} for {msg.timeout:g} s: "
                f"{st.why_held(msg.producer)}; nothing was marked")))
            return
        w.conn.answer(msg, ErrorReply(msg.id, BinFull.code, (
            f"stream {st.name!r} held the append for {msg.timeout:g} s: "
            f"{st.why_held(msg.producer)}; nothing was stored")))

    def _end(self, conn: Conn, msg: StreamEnd) -> StreamEnded | None:
        st = self._stream(msg.bin, False)
        owner, now = self._owner(conn), self._now()
        w = _Waiting(conn, msg)
        st.end(msg.producer, owner, msg.epoch, msg.samples, msg.last, now, check_only=True)
        if self._mine_waiting(st.name, msg.producer) or not st.end_ready(msg.producer):
            self._hold(st, w)
            return None
        reply, events = st.end(msg.producer, owner, msg.epoch, msg.samples, msg.last, now)
        self._then_after(conn, st, events)
        ended = StreamEnded(msg.id, reply.epoch, reply.complete, reply.finished)
        self._log_state(st, events, conn, msg, ended)
        return ended

    # -- consumers --------------------------------------------------------------------------
    def _join(self, conn: Conn, msg: StreamJoin) -> StreamJoined:
        user = conn.user
        if user is not None and msg.bin not in self.streams and not user.may_write(msg.bin):
            # Joining makes a stream that does not exist yet: a bin in the name's namespace,
            # which a user who may only read there must not add.
            raise PermissionDenied(
                f"user {user.name!r} may not stream_join bin {msg.bin!r} yet: no such stream, "
                f"and joining would make it, which needs write permission on it; join once its "
                f"producer has opened it")
        st = self._stream(msg.bin, True)
        _same_host(st, conn)
        if msg.consumer not in st.consumers:
            check_memory(self.server, CONSUMER_COST, f"a consumer of stream {msg.bin!r}", "stored")
        try:
            reply, events = st.join(msg.consumer, self._member(st, conn), msg.start, msg.lease,
                                    msg.resume, self._now())
        except ServerError:
            self._after(st, [])
            raise
        self._then_after(conn, st, events)
        joined = StreamJoined(msg.id, reply.position, reply.epoch, reply.offset,
                              reply.epoch_samples, reply.head, reply.resumed, reply.finished)
        self._log_state(st, events, conn, msg, joined)
        return joined

    def _read(self, conn: Conn, msg: StreamRead) -> AnyReply | None:
        st = self._stream(msg.bin, False)
        _same_host(st, conn)
        now = self._now()
        c, events = st.consumer(msg.consumer, self._member(st, conn), now)
        st.ack(c, msg.at, now)
        for op, n in events:
            self._notify(st, op, n)
        self._pump(st)  # what the acknowledgement made room for comes first
        w = _Waiting(conn, msg, pos=c.cursor)
        for other in self._reads.get(st.name, ()):
            if other.active and other.msg.consumer == msg.consumer and other.conn is not conn:
                # A read of the same consumer on an older connection (its client reconnected
                # and resent): the new one takes over.
                self._error(other, InvalidRequest(f"a newer read of consumer "
                                                  f"{msg.consumer!r} took over"))
        got = self._try_read(st, w, msg.at)
        reply: AnyReply | None = None
        after: list[Event] = []
        if got is not None:
            reply, missed = got
            if missed:  # (notified after its reply)
                after.append(("lag", missed))
        elif msg.timeout == 0:
            reply = ErrorReply(msg.id, WaitTimeout.code,
                               f"nothing to read in stream {st.name!r} yet")
        else:
            conn.wait(msg.id, w, msg.timeout, lambda: self._read_out(st, w))
            self._reads.setdefault(st.name, []).append(w)
        self._then_after(conn, st, after)
        return reply

    def _try_read(self, st: Stream, w: _Waiting, at: Any = _NO_ACK
                  ) -> tuple[AnyReply, int] | None:
        """What a read gets now (its items, or an error), with the items it missed (freed
        before it came: notified as ``lag``); ``None``: nothing to read yet. Logged (with
        the position ``at`` it acknowledged first, given by a request just received)."""
        msg: StreamRead = w.msg
        try:
            res = st.read(msg.consumer, w.pos, msg.max_items, self.server.max_reply_bytes,
                          self._now())
        except ServerError as exc:
            res = None
            got: tuple[AnyReply, int] | None = (ErrorReply(msg.id, code_for(exc), str(exc)), 0)
        else:
            got = None
        if res is not None or at is not _NO_ACK:
            self._log_read(st, w, None if at is _NO_ACK else at, res)
        if got is not None or res is None:
            return got
        return StreamItems(msg.id, res.items, res.first, res.next, res.epoch, res.offset,
                           res.epoch_samples, res.end, res.aborted, res.missed,
                           res.finished), res.missed

    def _read_out(self, st: Stream, w: _Waiting) -> None:
        msg = w.msg
        w.active = False
        w.conn.answer(msg, ErrorReply(msg.id, WaitTimeout.code,
                                      f"nothing to read in stream {st.name!r} within "
                                      f"{msg.timeout:g} s"))

    def _leave(self, conn: Conn, msg: StreamLeave) -> Acked:
        st = self.streams.get(msg.bin)
        was = st is not None and st.leave(msg.consumer, self._now())
        if st is not None:
            for w in self._reads.get(st.name, ()):
                if w.active and w.msg.consumer == msg.consumer:
                    self._error(w, InvalidRequest(f"consumer {msg.consumer!r} left"))
            if was:
                self._log_state(st, [("leave", 0)])
            self._then_after(conn, st, [("leave", 0)] if was else [])
        return Acked(msg.id, was)

    def refused(self, conn: Conn, op: str, header: Mapping[str, Any], why: str) -> None:
        """A refused stream request leaves nothing waiting on it."""

    # -- what waits -------------------------------------------------------------------------
    def _pump(self, st: Stream) -> None:
        """Serve what waits on ``st``: held appends and ends (in order per producer), then
        waiting reads."""
        name = st.name
        served = False
        blocked: set[int] = set()
        for w in list(self._held.get(name, ())):
            if w.active and w.msg.producer not in blocked:
                if self._try_held(st, w):
                    w.active = False
                    served = True
                else:
                    blocked.add(w.msg.producer)
        self._prune(self._held, name)
        if served:
            self._notify(st, "append")
        for w in list(self._reads.get(name, ())):
            if w.active:
                got = self._try_read(st, w)
                if got is not None:
                    self._answer(w, got[0])
                    if got[1]:
                        self._notify(st, "lag", got[1])
        self._prune(self._reads, name)

    @staticmethod
    def _prune(table: dict[str, list[_Waiting]], name: str) -> None:
        alive = [w for w in table.get(name, ()) if w.active]
        if alive:
            table[name] = alive
        else:
            table.pop(name, None)

    def _try_held(self, st: Stream, w: _Waiting) -> bool:
        """Store a held append (or make a held epoch end) if it can go now; answer it with
        an error if it never can. Returns whether it is done."""
        msg = w.msg
        try:
            owner = self._owner(w.conn)
            if isinstance(msg, StreamEnd):
                st.end(msg.producer, owner, msg.epoch, msg.samples, msg.last, self._now(),
                       check_only=True)
                if not st.end_ready(msg.producer):
                    return False
                reply, events = st.end(msg.producer, owner, msg.epoch, msg.samples, msg.last,
                                       self._now())
                ended = StreamEnded(msg.id, reply.epoch, reply.complete, reply.finished)
                self._log_state(st, events, w.conn, msg, ended)
                self._answer(w, ended)
                for op, n in events:
                    self._notify(st, op, n)
                return True
            st.check_append(msg.producer, owner, msg.epoch, len(w.entries), self._now())
            if not st.append_ready(msg.producer, len(w.entries)):
                return False
            self._answer(w, self._store(st, w))
        except ServerError as exc:
            self._error(w, exc)
        return True

    # -- leases ---------------------------------------------------------------------------
    def _recount(self, st: Stream) -> None:
        """Keep the cost of every stream together right after ``st`` changed."""
        cost = st.cost
        self._cost += cost - st.counted
        st.counted = cost

    def _track(self, st: Stream) -> None:
        """After ``st`` changed: its cost, and its next deadline in the heap if it is earlier
        than the one there (a later one is found when the earlier fires)."""
        self._recount(st)
        due = st.next_deadline()
        if due is not None and (st.due is None or due < st.due):
            st.due = due
            heapq.heappush(self._deadlines, (due, next(self._seq), st))
            if len(self._deadlines) > 2 * len(self.streams) + 64:  # mostly stale entries
                self._deadlines = [(d, next(self._seq), x) for x in self.streams.values()
                                   if (d := x.due) is not None]
                heapq.heapify(self._deadlines)
        self._arm()

    def _current(self, entry: tuple[float, int, Stream]) -> bool:
        due, _, st = entry
        return st.due == due and self.streams.get(st.name) is st

    def _arm(self) -> None:
        """Keep one timer, at the earliest deadline of any stream."""
        heap = self._deadlines
        while heap and not self._current(heap[0]):
            heapq.heappop(heap)
        timer = self._timer
        if not heap:
            if timer is not None and timer.active():
                timer.cancel()
            self._timer = None
            return
        # A little late rather than early: a lease runs out at its deadline, not before.
        at = heap[0][0] + 0.001
        if timer is not None and timer.active():
            if timer.getTime() <= at:
                return  # fires first; it looks at the rest
            timer.cancel()
        reactor = self.server.reactor
        self._timer = reactor.callLater(max(at - reactor.seconds(), 0.0), self._tick)

    def _tick(self) -> None:
        """The streams whose deadline came (only those) check their leases and stalls."""
        self._timer = None
        now = self._now()
        heap, due = self._deadlines, []
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            if self._current(entry):
                entry[2].due = None
                due.append(entry[2])
        for st in due:
            if self.streams.get(st.name) is st:
                events = st.check(now, self._heard)
                if events:
                    self._log_state(st, events)
                self._after(st, events)
        self._arm()

    def connection_lost(self, conn: Conn) -> None:
        if self._following:  # (a replica's streams change by its primary's records only)
            return
        now = self._now()
        owner = self._owner(conn)
        names = self._by_owner.get(owner, set())
        gone = None
        if owner is conn:  # (no session: this owner never comes back)
            self._by_owner.pop(conn, None)
            gone = _Gone(conn.peer)
        for name in list(names):
            # Its waiting requests were withdrawn by the connection (marked inactive): they
            # leave the queues now, not when the stream is next served.
            self._prune(self._held, name)
            self._prune(self._reads, name)
            st = self.streams.get(name)
            if st is not None:
                st.lost(lambda o: self._conn_of(o) is conn, now, gone)
                self._track(st)

    def session_ended(self, sid: bytes) -> None:
        if self._following:
            return
        now = self._now()
        for name in self._by_owner.pop(sid, ()):
            st = self.streams.get(name)
            if st is not None:
                events = st.ended(sid, now)
                if events:
                    self._log_state(st, events)
                    self._after(st, events)

    # -- statistics -------------------------------------------------------------------------
    def describe(self, glob: str | None) -> dict[str, dict[str, Any]]:
        """Each stream (matching ``glob``): the keys of every bin's summary (``kind`` is
        ``"stream"``, ``n_items`` counts the items kept, ``waiters`` the waiting reads,
        ``blocked`` the held appends), and ``stream``: its head, epoch, settings, each
        producer and each consumer with its position, lag and stall time (see
        docs/PROTOCOL.md, stream bins)."""
        now = self._now()
        out: dict[str, dict[str, Any]] = {}
        for name, st in sorted(self.streams.items()):
            if glob is not None and not fnmatch.fnmatchcase(name, glob):
                continue
            d = st.describe(now)
            d["waiters"] = sum(1 for w in self._reads.get(name, ()) if w.active)
            d["blocked"] = sum(1 for w in self._held.get(name, ()) if w.active)
            d["listeners"] = self.server.listener_count(name)
            out[name] = d
        return out
