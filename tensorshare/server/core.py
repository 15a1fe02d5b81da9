"""The server's state: :class:`ServerFactory` holds the store, the session table, the listeners
and the data directory, and builds one :class:`~.connection.ServerProtocol` per connection.

It is also where the parts meet: a change in the store becomes notifications to listeners
(encoded once for all of them), a session's life (attach, detach, expiry, acknowledgements)
is kept here with its timers, the data log is committed at the end of every batch of work
(the connections that hold replies for it are told then), and the ``stats`` reply's two
maps are built here from every part. It is the :class:`~.parts.Server` the other parts see.
"""

from __future__ import annotations

import fnmatch
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import Factory
from twisted.logger import Logger

from .._version import __version__
from ..memory.pool import BufferPool
from ..wire import codec
from ..wire.frames import BytesLike
from ..wire.messages import Changed, Fetched, Item, Limits
from ..wire.prepared import notify_chunks
from ..wire.protocol import (
    encode_fetched_parts,
    encode_fetched_with_id,
    item_wire_size,
)
from .auth import FailedAttempts
from .config import ServerConfig
from .handlers import Responder
from .persist import Loaded, Persistence
from .replaykind import ReplayKind
from .replication import Replication
from .services import ServiceKind
from .sessions import ServerSession, SessionTable
from .stats import ServerStats
from .store import Store
from .streams import StreamKind
from .users import Users

if TYPE_CHECKING:
    from .connection import ServerProtocol
    from .parts import Conn, Kind

__all__ = ["ServerFactory"]

log = Logger(namespace="tensorshare.server")

# Free space (beyond the data log's margin) that counts as "writes work again".
RECOVERED_ROOM = 1 << 20


class QueuedLedger:
    """The bytes written to connections and not yet sent, all together: each connection's
    transport adds what it queues and subtracts what it sends (see
    ``transports._ZeroCopy.ledger``), so the total costs nothing to read."""

    __slots__ = ("queued",)

    def __init__(self) -> None:
        self.queued = 0


class ReceiveBudget:
    """What frames still being received may reserve of ``max_memory`` (the frame decoders'
    :class:`~tensorshare.wire.frames.Budget`): counted like stored data, so that a peer that
    announces large frames cannot make the server commit memory it never receives.

    Attributes:
        receiving: bytes reserved by frames being received now.
    """

    def __init__(self, server: ServerFactory) -> None:
        self.server = server
        self.receiving = 0

    def reserve(self, nbytes: int) -> str | None:
        f = self.server
        limit = f.config.max_memory
        if limit is not None:
            used = f.store.nbytes + f.held_bytes()
            if used + nbytes > limit:
                f.stats.counters["frames_refused_memory"] += 1
                return (f"receiving it would take the server to {used + nbytes} bytes, over "
                        f"its max_memory={limit}")
            if used + nbytes + f.pool.idle > limit:  # idle memory kept for reuse goes first
                f.pool.trim(keep=limit - used - nbytes)
        self.receiving += nbytes
        return None

    def release(self, nbytes: int) -> None:
        self.receiving -= nbytes


class ServerFactory(Factory):
    """Holds the store, the sessions and the listeners; builds one protocol per connection.

    Args:
        reactor: the reactor that runs this server (for timers).
        limits: hard limits applied to every connection (overrides ``config.limits``).
        max_memory: see :class:`ServerConfig` (overrides ``config.max_memory``).
        config: every other setting.
        clock: wall-clock time in seconds (for statistics); defaults to ``time.time``.
    """

    noisy = False  # we log connections ourselves

    def __init__(self, reactor: Any, limits: Limits | None = None,
                 max_memory: int | None = None, *, config: ServerConfig | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        config = config or ServerConfig()
        if limits is not None:
            config = replace(config, limits=limits)
        if max_memory is not None:
            config = replace(config, max_memory=max_memory)
        self.config = config
        self.reactor = reactor
        self.limits = config.limits
        self.clock = clock
        self.started_at = clock()
        # Random per data set: a client that sees it change knows versions started again.
        self.server_id = os.urandom(8).hex()
        # Room for the reply's own header fields around the items (a few hundred bytes).
        self.max_reply_bytes = max(self.limits.max_frame_bytes - 4096, 1)
        self.store = Store(max_memory=config.max_memory, on_change=self.changed, clock=clock,
                           outside=self.held_bytes)
        # Large parts of received frames: reused memory, reserved against max_memory.
        pool_bytes = config.pool_bytes
        if config.max_memory is not None:
            pool_bytes = min(pool_bytes, config.max_memory // 8)
        self.pool = BufferPool(pool_bytes)
        self.budget = ReceiveBudget(self)
        #: The bytes queued on every connection's transport, kept by the transports.
        self.ledger = QueuedLedger()
        self.sessions = SessionTable(config.max_sessions, config.max_session_bytes)
        self.users = Users(self)  # who may connect, with which rights and quotas
        self.auth_failures = FailedAttempts()
        # Replicas of this server, or its primary (a kind: it serves the replication ops).
        self.replication = Replication(self)
        self.kinds = kinds_for(self)  # streams, services: the bins beside the store's
        self.responder = Responder(self)
        self._expiry: IDelayedCall | None = None  # the next detached session's expiry
        self.connections: set[Conn] = set()
        self._listeners: dict[str, set[Conn]] = {}
        # The bins whose changes the store tells (changed): those with listeners or a
        # cached peek reply; the store calls nothing for the others.
        self._watched: set[str] = set()
        self.store.watched = self._watched
        self.stats = ServerStats()
        self._holders: list[Conn] = []  # connections holding replies for the data log
        # bin -> the last peek reply's encoding (see encode_peek); dropped on any change.
        self._peek_cache: dict[str, tuple[Any, ...]] = {}
        self._retry_log: IDelayedCall | None = None  # a retry of an unwritable data log
        self.refusing: str | None = None  # why writes are refused now (a full disk)
        self.persist: Persistence | None = None
        self.loaded: Loaded | None = None
        if config.data_dir is not None:
            self._open_data(config)
        self.replication.start()

    def _open_data(self, config: ServerConfig) -> None:
        """Load the data directory and log every effect from now on.

        Raises:
            DataError: the directory cannot be used (the message says why and what to do).
        """
        p = Persistence(config.data_dir or ".", fsync=config.fsync,
                        snapshot_every=config.snapshot_every,
                        snapshot_log_bytes=config.snapshot_log_bytes, limits=config.limits,
                        truncate_corrupt=config.truncate_corrupt_log)
        for kind in self.kinds:  # (a kind that keeps its bins in the data log: replay bins)
            getattr(kind, "persisted", lambda p: None)(p)
        self.loaded = loaded = p.open(self.store, self.sessions)
        self.persist = p
        self.server_id = loaded.server_id
        self.store.journal = p.record
        if loaded.warning:
            log.warn("{warning}", warning=loaded.warning)
        # Sessions come back detached: their clients have session_ttl to resume them.
        expires = self.reactor.seconds() + config.session_ttl
        for s in self.sessions:
            self.sessions.detach(s, expires)
        self._schedule_expiry()
        log.info("loaded {dir}: {bins} bins, {sessions} sessions ({records} log records "
                 "replayed{snap})", dir=p.dir, bins=len(self.store.list()),
                 sessions=len(self.sessions), records=loaded.records,
                 snap=f" after {os.path.basename(loaded.snapshot)}" if loaded.snapshot else "")

    def buildProtocol(self, addr: Any) -> ServerProtocol:  # type: ignore[override]  # no .factory
        from .connection import ServerProtocol

        return ServerProtocol(self)

    # -- listeners --------------------------------------------------------------------------
    def subscribe(self, name: str, proto: Conn) -> None:
        self._listeners.setdefault(name, set()).add(proto)
        self._watched.add(name)

    def unsubscribe(self, name: str, proto: Conn) -> None:
        subs = self._listeners.get(name)
        if subs is not None:
            subs.discard(proto)
            if not subs:
                del self._listeners[name]
                if name not in self._peek_cache:
                    self._watched.discard(name)

    def listener_count(self, name: str | None = None) -> int:
        """Listeners of bin ``name``, or of every bin together."""
        if name is not None:
            return len(self._listeners.get(name, ()))
        return sum(len(s) for s in self._listeners.values())

    def listened_bins(self) -> list[str]:
        """The bins someone listens to."""
        return list(self._listeners)

    def encode_peek(self, name: str, reply: Fetched, shared: list[Any] | None,
                    runs: bool = False) -> list[BytesLike]:
        """Encode a peek reply (``runs``: with runs of like tensors, wire/runs.py), reusing
        the encoding of the same bin version's last one."""
        key = (reply.kind, reply.version, reply.n_items, reply.dropped,
               tuple(id(it) for it in reply.items), shared is not None, runs)
        hit = self._peek_cache.get(name)
        if hit is None or hit[0] != key:
            # The items are kept with the entry, so their ids cannot be reused meanwhile.
            mine: list[Any] | None = [] if shared is not None else None
            hit = (key, reply.items, mine, *encode_fetched_parts(reply, mine, runs))
            self._peek_cache[name] = hit
            self._watched.add(name)
            self.stats.counters["reply_encodes"] += 1
        else:
            self.stats.counters["reply_reuses"] += 1
        if shared is not None and hit[2]:
            shared.extend(hit[2])
        return encode_fetched_with_id(reply.id, hit[3], hit[4], hit[5])

    def changed(self, name: str, op: str, n_items: int, version: int, dropped: int) -> None:
        """Bin ``name`` changed (the store's, or another kind's): notify its listeners."""
        self._peek_cache.pop(name, None)  # a new version: the old encoding is no use
        subs = self._listeners.get(name)
        if not subs:
            self._watched.discard(name)
            return
        # Encode once (from prepared pieces), write the same chunks to every listener.
        msg = Changed(name, op, n_items, version, 0, dropped)
        chunks = notify_chunks(msg)
        self.stats.counters["notifications"] += len(subs)
        for proto in list(subs):
            proto.notify(chunks, msg)

    # -- sessions ---------------------------------------------------------------------------
    def attach(self, sid: bytes, proto: Conn, resume: bool
               ) -> tuple[ServerSession, bool]:
        """Give ``proto`` the session ``sid``: the known one (resumed) or a new one.

        A session still attached to another connection is taken over: the old connection
        is told so (``session_taken_over``) and closed first. A full table makes room by
        ending the session that has waited longest for its client.

        Raises:
            OverflowError: a new session would exceed ``max_sessions`` and every session
                has a connection.
        """
        s = self.sessions.get(sid)
        if s is not None and not resume:
            # A client that starts afresh with an id we know (it restarted, reusing the id)
            # numbers its requests from scratch: the old session's replies must not answer
            # them. It ends as if it had expired.
            self._take_over(s, proto)
            self.end_session(s)
            s = None
        if s is None:
            self._make_room()
            s = self.sessions.open(sid)
            s.attached = proto
            if self.persist is not None:
                self.persist.session_record("session", sid)
            return s, False
        self._take_over(s, proto)
        self.sessions.reattach(s)
        s.attached = proto
        if resume:
            self.stats.counters["sessions_resumed"] += 1
        return s, True

    def _make_room(self) -> None:
        if not self.sessions.full:
            return
        victim = self.sessions.longest_detached()
        if victim is not None:
            self.stats.counters["sessions_evicted"] += 1
            log.info("the session table is full (max_sessions={n}): ending the session that "
                     "waited longest for its client", n=self.sessions.max_sessions)
            self.expire(victim)

    def _take_over(self, s: ServerSession, proto: Conn) -> None:
        old = s.attached
        if old is None or old is proto:
            return
        log.info("{peer} takes over a session attached to {old}; closing that one",
                 peer=proto.peer, old=old.peer)
        self.stats.counters["sessions_taken_over"] += 1
        old.taken_over(proto.peer)

    def detach(self, s: ServerSession, proto: Conn) -> None:
        """The connection of ``s`` is gone: keep the session ``session_ttl`` seconds."""
        if s.attached is not proto:
            return
        s.attached = None
        self.sessions.detach(s, self.reactor.seconds() + self.config.session_ttl)
        self._schedule_expiry()

    def end_session(self, s: ServerSession) -> None:
        """End ``s`` now, as if it had expired (its client said goodbye, or starts anew)."""
        s.attached = None
        self.expire(s)

    def _schedule_expiry(self) -> None:
        """Keep one timer, at the earliest detached session's deadline."""
        due = self.sessions.next_expiry()
        timer = self._expiry
        if due is None:
            if timer is not None and timer.active():
                timer.cancel()
            self._expiry = None
            return
        if timer is not None and timer.active():
            if timer.getTime() <= due:
                return  # fires first; it reschedules for the rest
            timer.cancel()
        self._expiry = self.reactor.callLater(max(due - self.reactor.seconds(), 0.0),
                                              self._expire_due)

    def _expire_due(self) -> None:
        self._expiry = None
        now = self.reactor.seconds()
        while True:
            due = self.sessions.next_expiry()
            s = self.sessions.longest_detached()
            if due is None or s is None or due > now:
                break
            self.expire(s)
        self._schedule_expiry()

    def expire(self, s: ServerSession) -> None:
        """Drop a session whose client did not come back; its unacknowledged gets go back."""
        if s.attached is not None or self.sessions.get(s.id) is not s:
            return
        if self.persist is not None:
            self.persist.session_record("expire", s.id)  # replayed with its restores
        restore = self.sessions.close(s)
        self.stats.counters["sessions_expired"] += 1
        for kind in self.kinds:
            kind.session_ended(s.id)
        n = 0
        # Latest get first: each goes in front, so the earliest ends up first, as taken.
        for name, reply, _ in reversed(restore):
            self.restore(name, reply, logged=True, owner=s.usage)
            n += len(reply.items)
        if n:
            log.info("a session ended; {n} item(s) it had taken but not acknowledged went "
                     "back to their bins", n=n)
        self.commit()

    def ack(self, s: ServerSession, through: int, open_ids: tuple[int, ...] = ()) -> None:
        """The client has the replies of every request up to ``through`` but those in
        ``open``: forget them (and release their items)."""
        if self.sessions.ack(s, through, open_ids) and self.persist is not None:
            # Logged only when it releases get items: else a restart could give them back.
            self.persist.session_record("ack", s.id, through=through, open=list(open_ids))

    def restore(self, name: str, reply: Fetched, *, logged: bool = False,
                owner: Any = None) -> None:
        """Put the items of a get reply back at the front of their bin.

        ``logged``: the data log already has a record that replays this restore.
        ``owner``: the user they count for again (the one whose session had taken them).
        """
        journal = self.store.journal
        if logged:
            self.store.journal = None
        try:
            self.store.restore(name, reply.kind,
                               [(it, item_wire_size(it), it.tag) for it in reply.items], owner)
        finally:
            self.store.journal = journal

    # -- persistence ------------------------------------------------------------------------
    @property
    def holding(self) -> bool:
        """Whether replies to writes must wait: for the data log (records are pending), or,
        on a primary with ``--min-replicas``, always (a write's reply, a resent one's
        remembered reply included, leaves once enough replicas have all written before it)."""
        p = self.persist
        return p is not None and (p.dirty or self.replication.holds_replies)

    def hold(self, conn: Conn) -> None:
        """``conn`` holds replies until the data log is written (it keeps them): the next
        :meth:`commit` that writes the log tells it (only the connections that hold some)."""
        self._holders.append(conn)

    def commit(self) -> None:
        """End of a batch of work: write the data log, then release held output.

        When the log cannot be written (a full disk), the records and the replies that wait
        for them are kept, writes are refused (:meth:`storage_refuses`), and the log is
        tried again every second: the first write that succeeds accepts writes again.
        """
        p = self.persist
        if p is None:
            return
        if p.dirty:
            was_failing = p.failed is not None
            try:
                p.flush()
            except OSError as exc:
                self._storage_failed(exc, was_failing)
                return
            if was_failing:
                self._storage_recovered()
        self.replication.push()
        if self._holders:
            holders, self._holders = self._holders, []
            if not self.replication.hold(holders):  # (--min-replicas: until replicas have it)
                for conn in holders:
                    conn.committed()
        if p.snapshot_due():
            self.snapshot()

    def storage_refuses(self, nbytes: int) -> str | None:
        """Why a write of about ``nbytes`` cannot be accepted now (``None``: it can)."""
        p = self.persist
        if p is None:
            return None
        # Once refusing, every write is refused until there is room for an ordinary one
        # again (not only for a small one): a client sees one state, not a flicker.
        why = p.room(nbytes if self.refusing is None else max(nbytes, RECOVERED_ROOM))
        if why is None:
            if self.refusing is not None:
                self.refusing = None
                self._storage_recovered()
            return None
        if self._retry_log is None:  # look again by itself once there may be room
            self._retry_log = self.reactor.callLater(1.0, self._retry_storage)
        self.refusing = (f"the server cannot write its data log in {p.dir} ({why}): writes are "
                         f"refused until there is room again; reads, listens and stats go on")
        return self.refusing

    def _storage_failed(self, exc: OSError, already: bool) -> None:
        if not already:
            self.stats.counters["storage_failures"] += 1
            log.critical("cannot write the data log in {dir}: {error}; refusing writes until "
                         "that works again (what was acknowledged is safe; the replies to "
                         "what was not written yet wait for it)",
                         dir=self.persist.dir if self.persist else "?", error=exc)
        if self._retry_log is None:
            self._retry_log = self.reactor.callLater(1.0, self._retry_storage)

    def storage_state(self) -> str | None:
        """Why writes are being refused now (``None``: they are accepted)."""
        p = self.persist
        if p is not None and p.failed is not None:
            return self.refusing or f"the data log in {p.dir} cannot be written: {p.failed}"
        return self.refusing

    def _storage_recovered(self) -> None:
        log.warn("the data log in {dir} can be written again: accepting writes",
                 dir=self.persist.dir if self.persist else "?")

    def _retry_storage(self) -> None:
        self._retry_log = None
        p = self.persist
        if p is None:
            return
        if p.dirty or p.failed is not None:
            if not p.dirty:  # nothing pending: see whether a write would succeed now
                p.failed = None
            self.commit()
        if self.refusing is not None and p.room(RECOVERED_ROOM) is None:
            self.refusing = None  # room again for an ordinary write
            self._storage_recovered()
        if (self.refusing is not None or p.failed is not None) and self._retry_log is None:
            self._retry_log = self.reactor.callLater(1.0, self._retry_storage)

    def snapshot(self, wait: bool = False) -> None:
        """Write a snapshot of the state now (in a background thread unless ``wait``)."""
        p = self.persist
        if p is None or p.failed is not None:
            return
        self.stats.counters["snapshots_started"] += 1

        def done(error: BaseException | None) -> None:
            if error is not None:
                log.error("writing a snapshot failed: {error}; the data log still holds "
                          "everything", error=error)

        try:
            p.snapshot(self.store, self.sessions, wait=wait, done=done)
        except OSError as exc:
            self._storage_failed(exc, p.failed is not None)

    def close_persistence(self) -> None:
        """Flush, write a final snapshot and release the data directory (at shutdown)."""
        self.replication.stop()
        p = self.persist
        if p is None:
            return
        self.persist = None
        self.store.journal = None
        try:
            if p.failed is None:
                p.flush()
            p.close(self.store, self.sessions)
        except OSError as exc:
            log.critical("closing the data log failed: {error}", error=exc)

    # -- memory -----------------------------------------------------------------------------
    def queued_bytes(self) -> int:
        """Bytes written to connections and not yet sent, all connections together (their
        transports keep the total up to date: see ``transports._ZeroCopy.ledger``)."""
        return self.ledger.queued

    def held_bytes(self) -> int:
        """What the server holds for clients outside the bins: items taken by gets whose
        replies are not yet acknowledged, remembered replies, queued output, and frames
        still being received. Asked on every write: O(1) in the number of connections."""
        held = self.sessions.nbytes + self.budget.receiving + self.ledger.queued
        for kind in self.kinds:
            held += kind.nbytes
        return held

    # -- statistics -------------------------------------------------------------------------
    def server_stats(self) -> dict[str, Any]:
        """The server-wide statistics of the ``stats`` reply (see docs/PROTOCOL.md §3.3.8)."""
        store, sessions = self.store, self.sessions
        open_in: dict[str, int] = {}
        for p in self.connections:
            for op, n in p.conn.bytes_in.items():
                open_in[op] = open_in.get(op, 0) + n
        queued, receiving = self.queued_bytes(), self.budget.receiving
        report = self.stats.report()
        # The bins of every kind: the store's, and the streams', services' and replay bins'.
        stored = store.nbytes + sum(kind.nbytes for kind in self.kinds)
        n_bins = len(store.list()) + sum(len(kind.describe(None)) for kind in self.kinds)
        return {
            "server": f"tensorshare/{__version__}", "server_id": self.server_id,
            "time": self.clock(), "uptime": max(self.clock() - self.started_at, 0.0),
            "connections": len(self.connections), "listeners": self.listener_count(),
            "sessions": len(sessions), "sessions_detached": len(sessions.detached),
            "bins": n_bins,
            "memory": {
                "stored": stored, "sessions": sessions.nbytes, "output": queued,
                "receiving": receiving,
                "total": stored + sessions.nbytes + queued + receiving,
                "max_memory": self.config.max_memory, "pool_idle": self.pool.idle,
            },
            "waiting": {"fetches": store.n_waiters, "appends": store.n_blocked},
            "persistence": self._persistence(),
            "counters": report["counters"], "errors": report["errors"],
            "requests": report["requests"], "bytes_in": self.stats.bytes_in(open_in),
            "bytes_out": report["bytes_out"], "latency": report["latency"],
            "users": self.users.describe(),
            **self.replication.describe_role(),
        }

    def _persistence(self) -> dict[str, Any] | None:
        p = self.persist
        if p is None or not p.on_disk:
            return None
        why = self.storage_state()
        return {"dir": p.dir, "fsync": p.fsync, "writable": why is None, "error": why}

    def reload_users(self) -> list[str]:
        """Reread the users file and the token files (``SIGHUP``; see :mod:`.users`)."""
        return self.users.reload()

    def bin_stats(self, glob: str | None = None) -> dict[str, dict[str, Any]]:
        """A summary of every bin (matching ``glob``) for the ``stats`` reply."""
        out: dict[str, dict[str, Any]] = {}
        names = set(self.store.names(glob))
        # Bins someone listens to are worth showing even while empty (a drained queue).
        names.update(n for n in self.listened_bins()
                     if glob is None or fnmatch.fnmatchcase(n, glob))
        for kind in self.kinds:
            out.update(kind.describe(glob))
        for name in sorted(names - set(out)):
            d = self.store.describe(name)
            cfg = d.pop("config")
            first, last = d.pop("first"), d.pop("last")
            d["listeners"] = self.listener_count(name)
            d["limits"] = {"max_items": cfg.max_items, "max_bytes": cfg.max_bytes,
                           "overflow": cfg.overflow}
            d["first"] = _describe(first)
            d["last"] = _describe(last) if d["n_items"] > 1 else None
            out[name] = d
        return dict(sorted(out.items()))


def _describe(item: Item | None) -> str | None:
    return None if item is None else codec.describe(item.value.value)

def kinds_for(server: ServerFactory) -> list[Kind]:
    """The kinds a server has (each bound to it)."""
    return [StreamKind(server), ServiceKind(server), ReplayKind(server), server.replication]
