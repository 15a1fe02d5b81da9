"""Replication: replicas that follow a primary's data log, and terms that fence old primaries.

Every effect a server has is already a record of its data log (:mod:`.persist`). A primary
taps that stream (:attr:`.persist.Persistence.tap`; a server without a data directory gets a
:class:`MemoryLog`, which keeps nothing but the tap, once a replica asks), numbers it with a
byte **offset**, keeps the last ``--replica-backlog`` bytes of it, and pushes each record to
every replica as it is committed (the end of a pass). A replica that connects asks ``psync``
with the log id and offset it has: the records after it come from the backlog, or, when the
backlog no longer reaches back that far, a **full copy** (the snapshot's records, captured in
one go as references and streamed while the primary keeps serving) and then the records after
the copy's offset. A replica applies records through the same code as a restart's replay
(:meth:`.persist.Persistence._apply`), sessions, remembered replies and replay bins included
(their tables are in the copy, :meth:`.persist.Persistence.capture`, and each change is a
record), and writes them as they are to its own data log if it has one.

Writes on a replica are refused (``read_only_replica``, naming the primary) by the
responder's ``fence``; so are they on a former primary that heard of a newer **term** (the
epoch a ``promote`` starts, recorded in the data log), and, with ``--min-replicas N``, on a
primary while fewer than N replicas are in sync (``not_enough_replicas``). With N > 0 the
replies of writes are held until N replicas acknowledged the offset of their records
(``--replica-timeout``, then ``not_enough_replicas``).

The replication ops (``psync``, ``repl_ack``, ``promote``, ``wait_replicas``) are served by
:class:`Replication`, which the server holds as one of its kinds (it owns no bins).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import msgpack
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger

from ..errors import (
    InvalidRequest,
    NotEnoughReplicas,
    PermissionDenied,
    ReadOnlyReplica,
    StorageUnavailable,
)
from ..wire import services as wire_services
from ..wire import streams as wire_streams
from ..wire.frames import PREFIX, BytesLike
from ..wire.messages import Limits
from ..wire.records import Acked, ErrorReply
from ..wire.replication import (
    Promote,
    Psync,
    PsyncReply,
    ReplAck,
    ReplicaCount,
    WaitReplicas,
    pushed_frame,
)
from .persist import Persistence, _record, _snapshot_frames

if TYPE_CHECKING:
    from .parts import Conn, Handler, Route

__all__ = ["MemoryLog", "Replication"]

log = Logger(namespace="tensorshare.server")

_REPL_OPS = frozenset({"psync", "repl_ack", "promote", "wait_replicas"})
# The other kinds' ops live on the primary only (a replica keeps the streams' state, from the
# data log, to take over once promoted; services live in memory only).
_KIND_OPS = frozenset(op.name for op in (*wire_streams.ROWS, *wire_services.ROWS))
# Ops no read-only token may send but that change nothing: a replica serves them (replay
# bins are replicated; a sample moves their random state and counts, so it is a write).
_REPLICA_READS = frozenset({"replay_info"})
_ALLOWED_ON_REPLICA = frozenset({"reload"})
# What a replica serves only once its first full copy is applied.
_DATA_READS = frozenset({"peek", "list", "listen", "replay_info"})
_PUMP_BYTES = 8 << 20  # a full copy queues at most about this much before it waits
_PING_EVERY = 1.0


class MemoryLog(Persistence):
    """The record stream of a server without a data directory: nothing is written, each
    record only goes to the tap (replication), and the replica's own records are dropped."""

    on_disk = False

    def __init__(self, limits: Limits, hold: Callable[[], bool]) -> None:
        super().__init__(".", limits=limits, snapshot_every=None)
        self._hold = hold

    def _add(self, frame: list[BytesLike]) -> None:
        rec = _record(frame)
        self.records += 1
        if self.tap is not None:
            self.tap(rec, sum(len(c) for c in rec))

    def add_record(self, rec: list[BytesLike], nbytes: int) -> None:
        self.records += 1

    @property
    def dirty(self) -> bool:  # replies wait for replicas (--min-replicas) only
        return self._hold()

    def flush(self) -> None:
        pass

    def room(self, nbytes: int) -> str | None:
        return None

    def snapshot_due(self, now: float | None = None) -> bool:
        return False

    def snapshot(self, store: Any, sessions: Any, *, wait: bool = False,
                 done: Callable[[BaseException | None], None] | None = None) -> None:
        pass

    def close(self, store: Any = None, sessions: Any = None) -> None:
        pass


class Link:
    """One replica, as its primary sees it (on the replica's connection)."""

    def __init__(self, conn: Any, address: str, start: int, acked: int) -> None:
        self.conn = conn
        self.address = address or conn.peer
        self.start = start  # the offset its stream starts from
        self.sent = start
        self.acked = acked  # what it confirmed (a full copy: nothing until it says so)
        self.acked_at = time.monotonic()
        self.live = False  # its full copy (if any) is sent: it follows the log
        self.snap: Iterator[list[BytesLike]] | None = None
        self.queue: list[tuple[int, list[BytesLike], int]] = []
        self.queued = 0

    def write(self, chunks: list[BytesLike]) -> None:
        t = self.conn.transport
        if getattr(type(t), "write_frames", None) is not None:
            t.write_frames(chunks)
        else:
            t.writeSequence(chunks)


class _Wait:
    __slots__ = ("offset", "deadline", "entries")

    def __init__(self, offset: int, deadline: float) -> None:
        self.offset, self.deadline = offset, deadline
        self.entries: list[tuple[Any, list[Any]]] = []


class Replication:
    """A server's replication: its role and term, and, as a primary, its replicas (a kind
    of the server: it serves the replication ops and owns no bins)."""

    name = "replication"

    def __init__(self, server: Any) -> None:
        self.server = server
        cfg = self.config = server.config
        self.role = "replica" if cfg.replica_of else "primary"
        self.primary: str | None = cfg.replica_of
        self.term = 0
        self.fenced: int | None = None  # a newer term this former primary heard of
        self.replid = os.urandom(8).hex()
        self.offset = 0
        self.backlog: deque[tuple[int, list[BytesLike], int]] = deque()
        self.backlog_bytes = 0
        self.backlog_start = 0
        self.pending: list[tuple[list[BytesLike], int]] = []
        self.links: dict[Any, Link] = {}
        self.waits: deque[_Wait] = deque()
        self.count_waits: list[list[Any]] = []  # [offset, n, conn, request, timer]
        self._wait_timer: IDelayedCall | None = None
        self._ping: IDelayedCall | None = None
        self.upstream: Any = None  # the replica's side (see .upstream)
        self.resyncs = {"full_resyncs": 0, "partial_resyncs": 0, "replicas_dropped": 0}
        self._table: dict[str, Any] = {}

    # -- the Kind protocol (no bins) ------------------------------------------------------
    @property
    def table(self) -> Mapping[str, Any]:
        return self._table

    def handlers(self) -> dict[type, Handler]:
        return {Psync: self._psync, ReplAck: self._ack, Promote: self._promote,
                WaitReplicas: self._wait_replicas}

    def owns(self, name: str) -> bool:
        return False

    def refused(self, conn: Conn, op: str, header: Mapping[str, Any], why: str) -> None:
        pass

    def session_ended(self, sid: bytes) -> None:
        pass

    def describe(self, glob: str | None) -> dict[str, dict[str, Any]]:
        return {}

    @property
    def nbytes(self) -> int:
        return 0

    def connection_lost(self, conn: Conn) -> None:
        link = self.links.pop(conn, None)
        if link is not None:
            log.info("replica {addr} disconnected at offset {off}", addr=link.address,
                     off=link.acked)
            self._release()
        mine = [w for w in self.count_waits if w[2] is conn]
        for w in mine:
            self.count_waits.remove(w)
            if w[4] is not None and w[4].active():
                w[4].cancel()

    # -- start ----------------------------------------------------------------------------
    def start(self) -> None:
        """Called once the server is built: a replica starts following its primary."""
        p = self.server.persist
        if p is not None:
            self.term = p.term
        self._install_fence()
        if self.role == "replica":
            from .upstream import Upstream

            if p is None:
                self._memory_log()
            self.upstream = Upstream(self.server, self)
            self.upstream.start()

    def stop(self) -> None:
        if self.upstream is not None:
            self.upstream.stop()
        for timer in (self._wait_timer, self._ping):
            if timer is not None and timer.active():
                timer.cancel()

    def _memory_log(self) -> Persistence:
        f = self.server
        p = MemoryLog(f.config.limits, self._holds)
        p.term = self.term
        for kind in f.kinds:  # replay bins: their records and full-copy parts, as on disk
            getattr(kind, "persisted", lambda p: None)(p)
        f.persist = p
        f.store.journal = p.record
        return p

    @property
    def holds_replies(self) -> bool:
        """Every reply to a write waits for ``--min-replicas`` replicas (a primary's rule)."""
        return self.config.min_replicas > 0 and self.role == "primary"

    def _holds(self) -> bool:
        return bool(self.pending) and self.config.min_replicas > 0

    def _activate(self) -> None:
        """The first replica: tap the record stream from now on."""
        p = self.server.persist
        if p is None:
            p = self._memory_log()
        if p.tap is None:
            p.tap = self._tap
            self.backlog_start = self.offset
        if self._ping is None:
            self._ping = self.server.reactor.callLater(_PING_EVERY, self._pinger)

    def _tap(self, rec: list[BytesLike], nbytes: int) -> None:
        self.pending.append((rec, nbytes))

    # -- the fence: what this server refuses ----------------------------------------------
    def _install_fence(self) -> None:
        r = self.server.responder
        needed = (self.role == "replica" or self.fenced is not None
                  or self.config.min_replicas > 0)
        if r.relay_of is None:
            r.fence = self.fence if needed else None

    def fence(self, msg: Any, route: Route) -> Any:
        """The refusal of ``msg`` on this server now, or ``None`` (the responder asks)."""
        op = route.op
        if op in _REPL_OPS or op in _ALLOWED_ON_REPLICA:
            return None
        if self.role == "replica" or self.fenced is not None:
            if (route.read and op not in _KIND_OPS) or op in _REPLICA_READS:
                if op in _DATA_READS and self.role == "replica" and not self._synced():
                    return ErrorReply(msg.id, StorageUnavailable.code, (
                        f"this replica has not received its first full copy from "
                        f"{self.primary} yet: reads are served once it has"))
                return None
            return ErrorReply(msg.id, ReadOnlyReplica.code, self._read_only(op))
        if route.read or op in _REPLICA_READS:
            return None
        n = self.in_sync()
        if n < self.config.min_replicas:
            return ErrorReply(msg.id, NotEnoughReplicas.code, (
                f"{op} refused: {n} replica(s) in sync, --min-replicas is "
                f"{self.config.min_replicas}; nothing was applied (reads go on)"))
        return None

    def _synced(self) -> bool:
        return self.upstream is not None and self.upstream.ever_synced

    def _read_only(self, op: str) -> str:
        if self.fenced is not None:
            return (f"{op} refused: this server was a primary, but a newer term "
                    f"({self.fenced}) exists: another server was promoted (primary: "
                    f"{self.primary or 'unknown'}); make this one a replica of it")
        return (f"{op} refused: this server is a read-only replica (primary: "
                f"{self.primary}); write to the primary")

    def in_sync(self) -> int:
        """Replicas that follow the log now (their full copy sent)."""
        return sum(1 for link in self.links.values() if link.live)

    # -- the primary's side: pushing records ----------------------------------------------
    def push(self) -> None:
        """Number the records added since the last push, keep them in the backlog, and send
        them to every replica (the server's commit calls this, after the data log)."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        for rec, nbytes in pending:
            self.offset += nbytes
            entry = (self.offset, rec, nbytes)
            self.backlog.append(entry)
            self.backlog_bytes += nbytes
            for link in list(self.links.values()):
                self._send(link, entry)
        limit = self.config.replica_backlog
        while self.backlog_bytes > limit and len(self.backlog) > 1:
            end, _, nbytes = self.backlog.popleft()
            self.backlog_bytes -= nbytes
            self.backlog_start = end

    def _send(self, link: Link, entry: tuple[int, list[BytesLike], int]) -> None:
        end, rec, nbytes = entry
        if end <= link.sent:
            return
        if not link.live:  # its full copy is on its way: the record waits behind it
            link.queue.append(entry)
            link.queued += nbytes
            if link.queued > self.config.replica_buffer:
                self._drop(link, f"{link.queued} bytes of records wait behind its full copy")
            return
        if link.conn.queued_bytes > self.config.replica_buffer:
            self._drop(link, f"{link.conn.queued_bytes} bytes queued for it are unread")
            return
        link.write(pushed_frame({"op": "repl", "term": self.term, "offset": end}, rec, nbytes))
        link.sent = end

    def _drop(self, link: Link, why: str) -> None:
        self.resyncs["replicas_dropped"] += 1
        log.warn("dropping replica {addr}: {why}, over --replica-buffer={limit} (it resyncs "
                 "when it reconnects)", addr=link.address, why=why,
                 limit=self.config.replica_buffer)
        self.links.pop(link.conn, None)
        link.conn.abort()

    def _pinger(self) -> None:
        self._ping = None
        ping = pushed_frame({"op": "repl_ping", "term": self.term, "offset": self.offset,
                             "time": time.time()})
        for link in list(self.links.values()):
            if link.live and not link.conn.closed:
                link.write(ping)
        if self.role == "primary":
            self._ping = self.server.reactor.callLater(_PING_EVERY, self._pinger)

    # -- psync ----------------------------------------------------------------------------
    def _psync(self, conn: Conn, msg: Psync) -> Any:
        user = conn.user
        if user is None or not (user.replicate or user.name == "default"):
            return ErrorReply(msg.id, PermissionDenied.code, (
                f"user {getattr(user, 'name', '?')!r} may not replicate this server: give it "
                f"replicate = true in the users file"))
        if self.role != "primary" or self.fenced is not None:
            return ErrorReply(msg.id, ReadOnlyReplica.code, self._read_only("psync"))
        if msg.term > self.term:
            self._fence_by(msg.term, None)
            return ErrorReply(msg.id, ReadOnlyReplica.code, self._read_only("psync"))
        self._activate()
        self.server.commit()  # what this pass did so far is numbered before the copy
        old = self.links.pop(conn, None)
        if old is not None:
            old.live = False
        # Its output is bounded by --replica-buffer; its input is acknowledgements, which must
        # be read even while that output backs up (else its lag looks like the whole buffer,
        # and --min-replicas waits on acknowledgements already sent).
        conn.keeps_reading = True
        if (msg.replid == self.replid and self.backlog_start <= msg.offset <= self.offset):
            return self._continue(conn, msg)
        return self._full(conn, msg)

    def _continue(self, conn: Conn, msg: Psync) -> Any:
        link = self.links[conn] = Link(conn, msg.address, msg.offset, msg.offset)
        # What it missed goes first (after the reply), then what comes meanwhile.
        link.queue = [e for e in self.backlog if e[0] > msg.offset]
        link.queued = sum(e[2] for e in link.queue)
        link.snap = iter(())
        self.resyncs["partial_resyncs"] += 1
        log.info("replica {addr} continues from offset {off}", addr=link.address,
                 off=msg.offset)
        conn.then(lambda: self.server.reactor.callLater(0, self._pump, link))
        return PsyncReply(msg.id, "continue", self.replid, msg.offset, self.term,
                          self.server.server_id)

    def _full(self, conn: Conn, msg: Psync) -> Any:
        f = self.server
        link = self.links[conn] = Link(conn, msg.address, self.offset, 0)
        p = f.persist
        assert p is not None  # (_activate gave it one)
        # (the replay bins too: every kind whose bins are in the data log)
        link.snap = _snapshot_frames(p.capture(f.store, f.sessions, self.term))
        self.resyncs["full_resyncs"] += 1
        log.info("replica {addr} takes a full copy at offset {off}", addr=link.address,
                 off=self.offset)
        conn.then(lambda: f.reactor.callLater(0, self._pump, link))
        return PsyncReply(msg.id, "full", self.replid, self.offset, self.term, f.server_id)

    def _pump(self, link: Link) -> None:
        """Stream a full copy, a few MiB at a time (the server keeps serving between)."""
        if self.links.get(link.conn) is not link or link.snap is None:
            return
        while link.conn.queued_bytes < _PUMP_BYTES:
            frame = next(link.snap, None)
            if frame is None:
                link.snap = None
                link.live = True
                queue, link.queue, link.queued = link.queue, [], 0
                for entry in queue:
                    self._send(link, entry)
                log.info("replica {addr} follows the log from offset {off}", addr=link.address,
                         off=link.sent)
                return
            rec = _record(frame)
            link.write(pushed_frame({"op": "repl_snap", "term": self.term}, rec,
                                    sum(len(c) for c in rec)))
        self.server.reactor.callLater(0.002, self._pump, link)

    # -- acknowledgements and waits -------------------------------------------------------
    def _ack(self, conn: Conn, msg: ReplAck) -> Any:
        link = self.links.get(conn)
        if link is not None and msg.offset <= self.offset:
            if msg.offset > link.acked:
                link.acked = msg.offset
            link.acked_at = time.monotonic()
            self._release()
        return Acked(msg.id, link is not None)

    def _acked_by(self, n: int) -> int:
        """The highest offset that ``n`` replicas have acknowledged (-1: fewer than n)."""
        acks = sorted((lk.acked for lk in self.links.values() if lk.live), reverse=True)
        return acks[n - 1] if 0 < n <= len(acks) else (self.offset if n == 0 else -1)

    def hold(self, holders: list[Any]) -> bool:
        """With ``--min-replicas``: keep the replies ``holders`` hold until enough replicas
        have the records written so far (True), or let them go now (False)."""
        n = self.config.min_replicas
        if n <= 0 or self.role != "primary":
            return False
        w = _Wait(self.offset, time.monotonic() + self.config.replica_timeout)
        for conn in holders:
            held, conn._held = conn._held, None
            if held:
                w.entries.append((conn, held))
        self.waits.append(w)
        if self._wait_timer is None:
            self._wait_timer = self.server.reactor.callLater(self.config.replica_timeout,
                                                            self._timeouts)
        self._release()
        return True

    def _release(self) -> None:
        done = self._acked_by(self.config.min_replicas) if self.config.min_replicas else 0
        while self.waits and self.waits[0].offset <= done:
            w = self.waits.popleft()
            for conn, held in w.entries:
                for chunks, shared in held:
                    conn.emit(chunks, shared)
        self._answer_counts()

    def _timeouts(self) -> None:
        self._wait_timer = None
        now = time.monotonic()
        while self.waits and self.waits[0].deadline <= now:
            w = self.waits.popleft()
            for conn, held in w.entries:
                _fail_held(conn, held, (
                    f"the write's record did not reach {self.config.min_replicas} replica(s) "
                    f"within --replica-timeout={self.config.replica_timeout:g}s; it may have "
                    f"been applied"))
        if self.waits:
            self._wait_timer = self.server.reactor.callLater(
                max(self.waits[0].deadline - now, 0.0), self._timeouts)

    def _wait_replicas(self, conn: Conn, msg: WaitReplicas) -> Any:
        self.server.commit()
        target = self.offset
        have = sum(1 for lk in self.links.values() if lk.live and lk.acked >= target)
        if have >= msg.n or msg.timeout <= 0 or self.role != "primary":
            return ReplicaCount(msg.id, have, self.term)
        entry: list[Any] = [target, msg.n, conn, msg, None]

        def expired() -> None:
            if entry in self.count_waits:
                self.count_waits.remove(entry)
                conn.answer(msg, ReplicaCount(msg.id, self._count(target), self.term))

        entry[4] = self.server.reactor.callLater(msg.timeout, expired)
        self.count_waits.append(entry)
        return None

    def _count(self, target: int) -> int:
        return sum(1 for lk in self.links.values() if lk.live and lk.acked >= target)

    def _answer_counts(self) -> None:
        for entry in list(self.count_waits):
            target, n, conn, msg, timer = entry
            have = self._count(target)
            if have >= n:
                self.count_waits.remove(entry)
                if timer is not None and timer.active():
                    timer.cancel()
                conn.answer(msg, ReplicaCount(msg.id, have, self.term))

    # -- terms ----------------------------------------------------------------------------
    def _promote(self, conn: Conn, msg: Promote) -> Any:
        if self.role == "primary" and self.fenced is None:
            return ReplicaCount(msg.id, self.in_sync(), self.term)
        if self.role == "replica" and not self._synced():
            return ErrorReply(msg.id, InvalidRequest.code, (
                f"promote refused: this replica never received a full copy from "
                f"{self.primary}, so it has none of the primary's data"))
        self.promote()
        return ReplicaCount(msg.id, 0, self.term)

    def promote(self) -> None:
        """Become the primary under a new term (recorded in the data log)."""
        f = self.server
        if self.upstream is not None:
            self.upstream.stop()
            self.upstream = None
        self.term = max(self.term, self.fenced or 0) + 1
        self.role, self.fenced, self.primary = "primary", None, None
        self.replid = os.urandom(8).hex()  # a new history: replicas take a full copy
        self.backlog.clear()
        self.backlog_bytes, self.backlog_start = 0, self.offset
        p = f.persist
        if p is None:
            p = self._memory_log()
        p.term_record(self.term)
        expires = f.reactor.seconds() + f.config.session_ttl
        for s in f.sessions:  # its clients have session_ttl to resume them here
            if s.attached is None:
                f.sessions.detach(s, expires)
        f._schedule_expiry()
        for kind in f.kinds:  # (streams: their members' leases run from now)
            getattr(kind, "took_over", lambda: None)()
        self._install_fence()
        f.commit()
        log.warn("promoted to primary under term {term}", term=self.term)

    def _fence_by(self, term: int, primary: str | None) -> None:
        """A newer term exists elsewhere: accept no more writes."""
        if term <= self.term or self.role != "primary":
            return
        self.fenced, self.primary = term, primary
        self._install_fence()
        log.warn("a newer term ({term}) exists: this former primary refuses writes from now "
                 "on; make it a replica of the new primary", term=term)

    # -- statistics -----------------------------------------------------------------------
    def describe_role(self) -> dict[str, Any]:
        """The stats' ``role`` and ``term``, and their ``replication`` map."""
        out: dict[str, Any] = {"offset": self.offset, **self.resyncs}
        if self.role == "replica":
            up = self.upstream
            out.update(primary=self.primary, offset=up.offset if up else 0,
                       lag_s=up.lag_s() if up else None, synced=bool(up and up.synced))
        else:
            now = time.monotonic()
            out["replicas"] = [{
                "address": lk.address, "offset": lk.acked, "lag_bytes": self.offset - lk.acked,
                "lag_s": 0.0 if lk.acked >= self.offset else round(now - lk.acked_at, 3),
                "live": lk.live} for lk in self.links.values()]
            out["min_replicas"] = self.config.min_replicas
            if self.fenced is not None:
                out["fenced_by"] = self.fenced
        role = self.role if self.fenced is None else "fenced"
        return {"role": role, "term": self.term, "replication": out}


def _fail_held(conn: Any, held: list[Any], message: str) -> None:
    """Answer held replies with ``not_enough_replicas`` instead (same ids)."""
    if conn.closed:
        return
    for chunks, shared in held:
        rid = _reply_id(chunks)
        if rid is None:
            conn.emit(chunks, shared)
        else:
            conn.send(ErrorReply(rid, NotEnoughReplicas.code, message))


def _reply_id(chunks: Any) -> int | None:
    first = bytes(chunks[0][:PREFIX + 64]) if chunks else b""
    try:
        header_len = int.from_bytes(first[4:8], "little")
        head = bytes(chunks[0][PREFIX:PREFIX + header_len])
        h = msgpack.unpackb(head, raw=False)
        rid = h.get("id") if isinstance(h, dict) else None
    except (ValueError, msgpack.UnpackException):
        return None
    return rid if isinstance(rid, int) and rid > 0 else None
