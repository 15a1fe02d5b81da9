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

:class:`Stream` (:mod:`.streambook`) is the bookkeeping of one stream, a pure data structure
(the time is passed in; no connections, no timers) tested on its own; :class:`StreamKind` is
the server's kind of bin over it: handlers, waiting requests, the one timer for leases and
stalls, statistics.

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
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from twisted.internet.interfaces import IDelayedCall

from ..errors import (
    BinFull,
    BinNotFound,
    InvalidRequest,
    PermissionDenied,
    ServerError,
    WaitTimeout,
    code_for,
)
from ..wire.messages import Acked, ErrorReply
from ..wire.protocol import item_wire_size, items_header
from ..wire.streams import (
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
from .streambook import (
    CONSUMER_COST,
    MAX_CONSUMERS,
    STREAM_COST,
    Event,
    Settings,
    Stream,
)

if TYPE_CHECKING:
    from .parts import AnyReply, Conn, Handler, Server

__all__ = ["CONSUMER_COST", "FINISHED_TTL", "MAX_CONSUMERS", "MAX_FINISHED_STREAMS",
           "STREAM_COST", "Settings", "Stream", "StreamKind"]

#: Seconds a finished stream that nobody is in stays listed (so that a job that joins late
#: learns it is finished, and how many epochs it had, instead of finding a new, empty one).
FINISHED_TTL = 3600.0
#: The most finished streams kept that nobody is in; beyond, the longest kept go first.
MAX_FINISHED_STREAMS = 1024


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
        # The sessions each stream read back from the data log has as members (a replica's
        # streams change by records only: what left one is found here, not by a scan).
        self._followed: dict[str, set[bytes]] = {}

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

    def followed(self, st: Stream, op: str | None, members: bool = False) -> None:
        """A record of the data log changed ``st`` (a restart's replay, or a replica following
        its primary): its cost kept, its members' owners too if they may have changed
        (``members``: a session that is no longer in it no longer names it), its listeners
        told."""
        self._recount(st)
        if members:
            owners = {m.owner for m in st.members() if isinstance(m.owner, bytes)}
            was = self._followed.get(st.name, set())
            for owner in was - owners:
                self._not_in(owner, st.name)
            for owner in owners - was:
                self._by_owner.setdefault(owner, set()).add(st.name)
            self._followed[st.name] = owners
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
        self._followed.pop(st.name, None)
        for m in st.members():
            self._not_in(m.owner, st.name)
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

    def _not_in(self, owner: Any, name: str) -> None:
        names = self._by_owner.get(owner)
        if names is not None:
            names.discard(name)
            if not names:
                del self._by_owner[owner]

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
