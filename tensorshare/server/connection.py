"""The Twisted server: named bins in memory, served over one connection per client.

The protocol logic lives in :mod:`tensorshare.protocol` (bytes <-> messages), the bins in
:mod:`tensorshare.store` and the sessions in :mod:`tensorshare.sessions`; this module only wires
them to Twisted: feed received bytes, loop over the messages, call the store, write the
replies, remember what makes replays exact, fan out change notifications.

The reactor is always passed in. :class:`EmbeddedServer` runs a private reactor in a daemon
thread, so a server can live inside any program (a trainer, a test) without taking its main
thread or the global reactor; :func:`run_server` is the blocking form the seed used.
"""

from __future__ import annotations

import fnmatch
import gc
import os
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from .._version import __version__
from ..errors import InvalidRequest, LimitExceeded, ServerError, code_for
from ..memory import shm
from ..wire import codec
from ..wire.frames import BytesLike
from ..wire.messages import (
    Acked,
    Append,
    Cancel,
    Changed,
    Configure,
    Configured,
    Delete,
    Deleted,
    ErrorReply,
    Fetch,
    Fetched,
    Hello,
    HelloReply,
    Item,
    Limits,
    ListBins,
    Listen,
    Listening,
    Listing,
    Ping,
    Put,
    Reply,
    Request,
    Stats,
    StatsReply,
    Stored,
    Unlisten,
)
from ..wire.protocol import (
    OPS,
    PRE_HELLO_MAX_BYTES,
    PROTOCOL_VERSIONS,
    AckInfo,
    BadRequest,
    ProtocolViolation,
    ServerConnection,
    encode_fetched_parts,
    encode_fetched_with_id,
    encode_message,
    item_wire_size,
    op_name,
)
from .persist import Loaded, Persistence
from .sessions import ServerSession, SessionTable
from .store import BinConfig, Blocked, Store, Taken, Waiter, Written
from .transports import listen_fast_tcp, listen_fast_unix

__all__ = ["EmbeddedServer", "ServerConfig", "ServerFactory", "ServerProtocol", "run_server"]

log = Logger(namespace="tensorshare.server")

# A connection we close gets this long to take what is queued for it (say, the error that
# explains why) before it is cut.
CLOSE_GRACE_SECONDS = 10.0
# Upper bounds (seconds) of the request latency histogram's buckets (the last is +Inf).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0, float("inf"))


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything a server can be told, with safe defaults.

    Attributes:
        limits: hard limits of every connection (frame, header, depth, name).
        max_memory: bytes the server may hold for clients (bins, items taken by gets whose
            replies are not yet acknowledged, queued output); a put/append that would go
            above is refused. ``None``: no limit.
        session_ttl: seconds a disconnected client's session is kept for it to resume.
        max_sessions: sessions kept at once (connected or waiting to be resumed).
        max_session_bytes: bytes of unacknowledged get items one session may hold.
        max_connections: connections served at once; more are refused with an error.
        max_client_buffer: bytes queued for one connection beyond its current reply before
            the server gives up on it and closes it (a client that stopped reading).
        hello_timeout: seconds a new connection has to complete ``hello``.
        pre_hello_bytes: the largest frame accepted before ``hello``.
        data_dir: keep the data in this directory (a data log and snapshots, see
            :mod:`tensorshare.persist`); ``None``: in memory only.
        fsync: when the data log reaches the disk: ``"always"``, ``"everysec"``, ``"no"``.
        snapshot_every: seconds between snapshots (``None``: by log size and at exit only).
        snapshot_log_bytes: take a snapshot once the data log has grown this much.
        truncate_corrupt_log: start even if a log segment is corrupt in the middle,
            dropping it from there (only after reading the error that says so).
    """

    limits: Limits = field(default_factory=Limits)
    max_memory: int | None = None
    session_ttl: float = 60.0
    max_sessions: int = 10_000
    max_session_bytes: int = 1 << 30
    max_connections: int = 1024
    max_client_buffer: int = 64 << 20
    hello_timeout: float = 10.0
    pre_hello_bytes: int = PRE_HELLO_MAX_BYTES
    data_dir: str | None = None
    fsync: str = "everysec"
    snapshot_every: float | None = 300.0
    snapshot_log_bytes: int = 1 << 30
    truncate_corrupt_log: bool = False


class ServerProtocol(Protocol):
    """One client connection. Implements the zero-copy read hooks of :mod:`._fasttcp`.

    It is also the streaming producer of its own transport: when more than the transport's
    buffer size is queued for a client (it reads slower than we write), the transport pauses
    us. While paused we stop reading that client's requests (so it cannot make us queue
    more replies), and fold its notifications per bin (the latest wins, counting the ones
    it skipped), so a listener that does not keep up learns the newest state without a
    backlog. Past ``max_client_buffer`` queued bytes the connection is closed.
    """

    def __init__(self, factory: ServerFactory) -> None:
        self.factory = factory
        self.conn = ServerConnection(factory.config.limits,
                                     pre_hello_max_bytes=factory.config.pre_hello_bytes)
        self.version: int | None = None  # protocol version agreed in the handshake
        self.client_name = ""
        self.peer = "?"
        self.session: ServerSession | None = None
        self.listening: set[str] = set()
        self._waiting: dict[int, tuple[Waiter | Blocked, IDelayedCall | None]] = {}
        self._closed = False
        self._timer: IDelayedCall | None = None  # hello deadline, then the close grace
        self._ack: AckInfo | None = None  # an ack that came before the hello it rode on
        self._paused = False  # the transport says our output backs up: see the class doc
        self.shm = False  # the handshake agreed on memfd buffers (Unix socket)
        self._started: dict[int, float] = {}  # request id -> when it came in (latency)
        self._folded: dict[str, Changed] = {}  # notifications held back while paused
        self._handlers: dict[type, Callable[[Any], None]] = {
            Put: self._put, Append: self._append, Fetch: self._fetch, ListBins: self._list,
            Delete: self._delete, Listen: self._listen, Unlisten: self._unlisten,
            Ping: self._ping, Cancel: self._cancel, Stats: self._stats,
            Configure: self._configure, Hello: self._hello,
        }

    # -- Twisted hooks ----------------------------------------------------------------------
    def connectionMade(self) -> None:
        peer = self.transport.getPeer()  # type: ignore[union-attr]
        host, port = getattr(peer, "host", None), getattr(peer, "port", None)
        self.peer = f"{host}:{port}" if host is not None else str(getattr(peer, "name", "?"))
        f = self.factory
        f.connections.add(self)
        f.stats["connections_total"] += 1
        if len(f.connections) > f.config.max_connections:
            f.stats["connections_refused"] += 1
            self._fail_connection(
                "limit_exceeded", f"the server is at its max_connections="
                f"{f.config.max_connections}; try again later or raise --max-connections")
            return
        self._timer = f.reactor.callLater(f.config.hello_timeout, self._hello_overdue)
        self.transport.registerProducer(self, True)  # type: ignore[union-attr]
        log.debug("connection from {peer}", peer=self.peer)

    def dataReceived(self, data: bytes) -> None:
        if not self._closed:
            self._handle(self.conn.receive_data(data))

    def get_read_buffer(self) -> memoryview | None:
        return None if self._closed else self.conn.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if not self._closed:
            self._handle(self.conn.buffer_updated(nbytes))

    def connectionLost(self, reason: Failure | None = None) -> None:  # type: ignore[override]
        self._release()
        self.factory.connections.discard(self)
        self._stop_timer()
        why = reason.getErrorMessage() if reason else "closed"
        if self.version is None:
            log.debug("connection from {peer} closed before hello: {why}", peer=self.peer,
                      why=why)
        else:
            log.info("{client!r} at {peer} disconnected: {why}", client=self.client_name,
                     peer=self.peer, why=why)

    # -- flow control (IPushProducer, called by our transport) ------------------------------
    def pauseProducing(self) -> None:
        if not self._paused and not self._closed:
            self._paused = True
            self.factory.stats["client_paused"] += 1
            self.transport.pauseProducing()  # type: ignore[union-attr]  # stop reading

    def resumeProducing(self) -> None:
        if not self._paused or self._closed:
            return
        self._paused = False
        folded, self._folded = self._folded, {}
        for msg in folded.values():
            self.write_chunks(encode_message(msg)[0])
        if not self._paused:
            self.transport.resumeProducing()  # type: ignore[union-attr]

    def stopProducing(self) -> None:
        pass

    @property
    def queued_bytes(self) -> int:
        """Bytes written to this connection and not yet sent."""
        return int(getattr(self.transport, "queued_bytes", 0))

    # -- plumbing ---------------------------------------------------------------------------
    def write_chunks(self, chunks: Sequence[BytesLike], shared: list[Any] | None = None) -> None:
        """Queue a frame; ``shared``: shared memory whose descriptors go with it."""
        if self._closed:
            return
        f = self.factory
        if f.holding:
            # With fsync "always" nothing that depends on a write leaves before the write is
            # on disk: held until the batch is committed (see ServerFactory.commit).
            f.held.append((self, chunks, shared))
            return
        queued = self.queued_bytes
        limit = self.factory.config.max_client_buffer
        if queued > limit:
            # Beyond the reply it is taking, a client may leave at most this much unread.
            self.factory.stats["client_buffer_closes"] += 1
            log.warn("closing connection from {peer} ({client!r}): {queued} bytes queued "
                     "for it are unread, over --max-client-buffer={limit}", peer=self.peer,
                     client=self.client_name, queued=queued, limit=limit)
            self._release()
            self.transport.abortConnection()  # type: ignore[union-attr]
            return
        # Our transport (_fasttcp.FastServer) takes memoryviews, hence no bytes copies.
        if shared:
            fds = [m.fd for m in shared]
            self.transport.writeSequence(chunks, fds=fds,  # type: ignore[union-attr, call-arg, arg-type]
                                         owner=shared)
        else:
            self.transport.writeSequence(chunks)  # type: ignore[union-attr, arg-type]

    def notify(self, chunks: Sequence[BytesLike], msg: Changed) -> None:
        """Send a change notification, or fold it into the last one while we are paused."""
        if not self._paused:
            self.write_chunks(chunks)
            return
        old = self._folded.pop(msg.bin, None)
        if old is not None:
            self.factory.stats["notifications_folded"] += 1
            msg = Changed(msg.bin, msg.op, msg.n_items, msg.version,
                          old.skipped + msg.skipped + 1, old.dropped + msg.dropped)
        self._folded[msg.bin] = msg

    def send(self, msg: Reply | Changed) -> None:
        shared: list[Any] | None = [] if self.shm else None
        self.write_chunks(encode_message(msg, None, shared)[0], shared)

    def fds_received(self, fds: list[int]) -> None:
        """Descriptors the client passed (Unix socket): its ``memfd`` buffers."""
        if self._closed or not self.shm:
            for fd in fds:  # not agreed in the handshake: nobody will take them
                os.close(fd)
            return
        self.conn.add_fds(fds)

    def _stop_timer(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _release(self) -> None:
        """Stop serving this connection: withdraw its waiting requests and its listeners,
        and leave its session to wait for the client to come back.

        Done as soon as we decide to close, not when the socket is finally gone: a waiter of
        a closing connection must never take data it can no longer deliver.
        """
        if self._closed:
            return
        self._closed = True
        self._folded.clear()
        self._started.clear()
        self.conn.fds.close()
        self.factory.add_bytes_in(self.conn.bytes_in)
        f = self.factory
        for name in self.listening:
            f.unsubscribe(name, self)
        self.listening.clear()
        for waiter, timer in self._waiting.values():
            f.store.cancel(waiter)
            if timer is not None and timer.active():
                timer.cancel()
        self._waiting.clear()
        if self.session is not None:
            f.detach(self.session, self)

    def _close(self) -> None:
        """Close after what is queued is sent; abort if the peer does not read it in time."""
        self._release()
        self._stop_timer()
        self.transport.loseConnection()  # type: ignore[union-attr]
        self._timer = self.factory.reactor.callLater(
            CLOSE_GRACE_SECONDS, self.transport.abortConnection)  # type: ignore[union-attr]

    def _fail_connection(self, code: str, message: str) -> None:
        """Tell the peer why, then close this one connection; the server carries on."""
        log.warn("closing connection from {peer}: {message}", peer=self.peer, message=message)
        self.send(ErrorReply(0, code, message))
        self._close()

    def _hello_overdue(self) -> None:
        self._timer = None
        if self.version is None and not self._closed:
            self.factory.stats["hello_timeouts"] += 1
            self._fail_connection("protocol_error", f"no hello within "
                                  f"{self.factory.config.hello_timeout:g} s")

    # -- dispatch ---------------------------------------------------------------------------
    def _handle(self, events: list[Any]) -> None:
        try:
            self._handle_events(events)
        finally:
            self.factory.commit()

    def _handle_events(self, events: list[Any]) -> None:
        stats = self.factory.stats
        for ev in events:
            if self._closed:
                return
            cls = type(ev)
            if cls is AckInfo:
                if self.session is not None:
                    self.factory.ack(self.session, ev)
                else:
                    self._ack = ev
                continue
            if cls is ProtocolViolation:
                self._fail_connection("protocol_error", ev.message)
                return
            if cls is BadRequest:
                if self.version is None:
                    self._fail_connection("protocol_error", f"handshake failed: {ev.message}")
                    return
                log.warn("bad request from {peer}: {message}", peer=self.peer,
                         message=ev.message)
                self.reply_error(ev.id, ev.code, ev.message)
                continue
            if self.version is None and cls is not Hello:
                self._fail_connection("protocol_error",
                                      "handshake failed: the first request must be 'hello'")
                return
            stats["requests"] += 1
            self._request(ev)

    def _request(self, msg: Request) -> None:
        op = op_name(msg)
        self._started[msg.id] = time.perf_counter()
        s = self.session
        if s is not None and OPS[op].mutating:
            old = s.lookup(msg.id)
            if old is not None:  # ran before the connection dropped: answer the same again
                self.factory.stats["replayed"] += 1
                self._started.pop(msg.id, None)
                self.send(old)
                return
        try:
            self._handlers[type(msg)](msg)
        except ServerError as exc:
            self.reply(msg, ErrorReply(msg.id, code_for(exc), str(exc)))
        except Exception:  # a bug must cost one request, never the server
            log.failure("internal error serving {op} from {peer}", op=op, peer=self.peer)
            self.reply(msg, ErrorReply(msg.id, "error",
                                       "internal server error; see the server log"))

    def _ctx(self, msg: Request) -> tuple[bytes, int] | None:
        """What ties a store effect to this request (for the data log's remembered replies)."""
        s = self.session
        return None if s is None else (s.id, msg.id)

    def reply(self, msg: Request, reply: Reply, *, bin: str | None = None,
              held: int = 0) -> None:
        """Send a reply, remembering it first if re-running ``msg`` would change something."""
        s = self.session
        f = self.factory
        op = op_name(msg)
        if type(reply) is ErrorReply:
            f.count_error(reply.code)
        if s is not None and OPS[op].mutating:
            f.sessions.remember(s, msg.id, reply, bin, held)
        shared: list[Any] | None = [] if self.shm else None
        if type(reply) is Fetched and reply.items and not msg.spec.remove:  # type: ignore[union-attr]
            # Many readers of one version (parameters fanned out to every worker): the
            # reply is encoded once per bin version, then only the request id differs.
            chunks = f.encode_peek(msg.bin, reply, shared)  # type: ignore[union-attr]
        else:
            chunks = encode_message(reply, None, shared)[0]
        started = self._started.pop(msg.id, None)
        if started is not None:
            f.observe(op, sum(len(c) for c in chunks), time.perf_counter() - started)
        self.write_chunks(chunks, shared)

    def reply_error(self, rid: int, code: str, message: str) -> None:
        self.factory.count_error(code)
        self.send(ErrorReply(rid, code, message))

    # -- handshake --------------------------------------------------------------------------
    def _hello(self, msg: Hello) -> None:
        f = self.factory
        if self.version is not None:
            self.reply_error(msg.id, "invalid_request", "handshake already done")
            return
        common = set(msg.versions) & set(PROTOCOL_VERSIONS)
        if not common:
            self.reply_error(msg.id, "unsupported_version",
                             f"client speaks protocol versions {list(msg.versions)}, "
                             f"this server speaks {list(PROTOCOL_VERSIONS)}")
            self._close()
            return
        resumed = False
        if msg.session is not None:
            try:
                self.session, resumed = f.attach(msg.session, self, msg.resume)
            except OverflowError as exc:
                self.reply_error(msg.id, "limit_exceeded", str(exc))
                self._close()
                return
            if self._ack is not None:
                f.ack(self.session, self._ack)
                self._ack = None
        self.version = max(common)
        self.client_name = msg.client
        self.shm = msg.shm and bool(getattr(self.transport, "_passes_fds", False)) and \
            shm.available()
        self.conn.handshake_done()
        self._stop_timer()
        how = "resumed its session" if resumed else (
            "new session" if msg.session is not None else "no session")
        log.info("{client!r} at {peer} connected ({how})", client=msg.client, peer=self.peer,
                 how=how)
        self.send(HelloReply(msg.id, self.version, f"tensorshare/{__version__}",
                             f.config.limits, resumed, f.server_id, self.shm))

    # -- requests ---------------------------------------------------------------------------
    def _put(self, msg: Put) -> None:
        nbytes = item_wire_size(msg.item)
        w = self.factory.store.put(msg.bin, msg.item, nbytes, msg.item.tag, self._ctx(msg))
        self.reply(msg, Stored(msg.id, w.version, w.n_items))

    def _append(self, msg: Append) -> None:
        store = self.factory.store
        entries = [(it, item_wire_size(it), it.tag) for it in msg.items]
        rid = msg.id

        def stored(w: Written | BaseException) -> None:
            entry = self._waiting.pop(rid, None)
            if entry is not None and entry[1] is not None and entry[1].active():
                entry[1].cancel()
            if isinstance(w, ServerError):
                self.reply(msg, ErrorReply(rid, code_for(w), str(w)))
            else:
                self.reply(msg, Stored(rid, w.version, w.n_items, w.dropped))  # type: ignore[union-attr]

        result = store.append_or_wait(msg.bin, entries, stored, self._ctx(msg))
        if isinstance(result, Written):
            self.reply(msg, Stored(rid, result.version, result.n_items, result.dropped))
            return
        # A full "block" bin: wait for room, up to the append's timeout (a cancel or a
        # disconnect withdraws it too).
        if rid in self._waiting:
            store.cancel(result)
            raise InvalidRequest(f"request id {rid} is already waiting on this connection")
        timer = None
        if msg.timeout is not None:
            timer = self.factory.reactor.callLater(msg.timeout, self._block_timed_out, msg)
        self._waiting[rid] = (result, timer)

    def _block_timed_out(self, msg: Append) -> None:
        entry = self._waiting.pop(msg.id, None)
        if entry is None:
            return
        self.factory.store.cancel(entry[0])
        self.reply(msg, ErrorReply(msg.id, "bin_full",
                                   f"bin {msg.bin!r} stayed full for {msg.timeout:g} s "
                                   f"(overflow='block'); nothing was stored"))

    def _fetch(self, msg: Fetch) -> None:
        f = self.factory
        store = f.store
        spec = msg.spec
        max_bytes = f.max_reply_bytes
        s = self.session
        if spec.remove and s is not None:
            # What a get takes stays held for the session until acknowledged: keep within
            # the session's allowance (at least one item is still returned).
            room = f.sessions.max_session_bytes - s.held
            if room <= 0:
                raise LimitExceeded(
                    f"this client's session holds {s.held} bytes of items from gets it has "
                    f"not acknowledged, its max_session_bytes={f.sessions.max_session_bytes}")
            max_bytes = min(max_bytes, room)
        if not spec.wait:
            self._fetched(msg, store.fetch(msg.bin, spec, max_bytes, self._ctx(msg)))
            return
        rid = msg.id
        if rid in self._waiting:
            raise InvalidRequest(f"request id {rid} is already waiting on this connection")

        def served(taken: Taken) -> None:
            _, timer = self._waiting.pop(rid, (None, None))
            if timer is not None and timer.active():
                timer.cancel()
            self._fetched(msg, taken)

        result = store.fetch_or_wait(msg.bin, spec, served, max_bytes, self._ctx(msg))
        if isinstance(result, Taken):
            self._fetched(msg, result)
            return
        if not result.active:  # served at once, through ``served``, behind earlier waiters
            return
        timer = None
        if spec.timeout is not None:
            try:
                timer = f.reactor.callLater(spec.timeout, self._timed_out, msg)
            except BaseException:
                store.cancel(result)  # never leave a waiter nobody will answer
                raise
        self._waiting[rid] = (result, timer)

    def _fetched(self, msg: Fetch, taken: Taken) -> None:
        reply = Fetched(msg.id, taken.kind, taken.items, taken.version, taken.n_items,
                        taken.dropped, taken.unchanged)
        if msg.spec.remove and taken.items:
            self.reply(msg, reply, bin=msg.bin, held=taken.nbytes)
        else:
            self.reply(msg, reply)

    def _timed_out(self, msg: Fetch) -> None:
        entry = self._waiting.pop(msg.id, None)
        if entry is None:
            return
        self.factory.store.cancel(entry[0])
        what = "newer data" if msg.spec.newer_than is not None else "data"
        timeout = msg.spec.timeout or 0.0
        self.reply(msg, ErrorReply(msg.id, "timeout",
                                   f"no {what} in bin {msg.bin!r} within {timeout:g} s"))

    def _list(self, msg: ListBins) -> None:
        self.reply(msg, Listing(msg.id, self.factory.store.list()))

    def _delete(self, msg: Delete) -> None:
        existed, version = self.factory.store.delete(msg.bin, self._ctx(msg))
        self.reply(msg, Deleted(msg.id, existed, version))

    def _listen(self, msg: Listen) -> None:
        name = msg.bin
        store = self.factory.store
        self.listening.add(name)
        self.factory.subscribe(name, self)
        self.reply(msg, Listening(msg.id, store.version(name), store.n_items(name)))

    def _unlisten(self, msg: Unlisten) -> None:
        name = msg.bin
        was = name in self.listening
        self.listening.discard(name)
        self.factory.unsubscribe(name, self)
        self.reply(msg, Acked(msg.id, was))

    def _ping(self, msg: Ping) -> None:
        self.reply(msg, Acked(msg.id, True))

    def _cancel(self, msg: Cancel) -> None:
        f = self.factory
        target = msg.target
        entry = self._waiting.pop(target, None)
        if entry is not None:
            waiter, timer = entry
            if timer is not None and timer.active():
                timer.cancel()
            self.reply(msg, Acked(msg.id, f.store.cancel(waiter)))
            return
        # A get that already ran, whose reply the client will not take: its items go back.
        # (Other remembered replies stay: a resent put must still not run twice.)
        s = self.session
        done = s.replies.get(target) if s is not None else None
        if s is not None and done is not None and done.bin is not None and \
                isinstance(done.reply, Fetched):
            if f.persist is not None:
                f.persist.session_record("forget", s.id, id=target)
            f.sessions.forget(s, target)
            f.restore(done.bin, done.reply, logged=True)
            self.reply(msg, Acked(msg.id, True))
            return
        self.reply(msg, Acked(msg.id, False))

    def _stats(self, msg: Stats) -> None:
        self.reply(msg, StatsReply(msg.id, self.factory.server_stats(),
                                   self.factory.bin_stats(msg.glob)))

    def _configure(self, msg: Configure) -> None:
        try:
            cfg = BinConfig(msg.max_items, msg.max_bytes, msg.overflow)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        cfg = self.factory.store.configure(msg.bin, cfg, self._ctx(msg))
        self.reply(msg, Configured(msg.id, cfg.max_items, cfg.max_bytes, cfg.overflow))


class _Counters(dict[str, int]):
    """Named counters that start at 0."""

    def __missing__(self, key: str) -> int:
        return 0


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
        self.store = Store(max_memory=config.max_memory, on_change=self._changed, clock=clock,
                           outside=self.held_bytes)
        self.sessions = SessionTable(config.max_sessions, config.max_session_bytes)
        self.connections: set[ServerProtocol] = set()
        self._listeners: dict[str, set[ServerProtocol]] = {}
        self.stats = _Counters()
        self.held: list[tuple[ServerProtocol, Sequence[BytesLike], list[Any] | None]] = []
        # op -> request latency histogram: a count per LATENCY_BUCKETS bound, then the sum
        # in microseconds.
        self.latency: dict[str, list[int]] = {}
        # bin -> the last peek reply's encoding (see encode_peek); dropped on any change.
        self._peek_cache: dict[str, tuple[Any, ...]] = {}
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.persist: Persistence | None = None
        self.loaded: Loaded | None = None
        if config.data_dir is not None:
            self._open_data(config)

    def _open_data(self, config: ServerConfig) -> None:
        """Load the data directory and log every effect from now on.

        Raises:
            DataError: the directory cannot be used (the message says why and what to do).
        """
        p = Persistence(config.data_dir or ".", fsync=config.fsync,
                        snapshot_every=config.snapshot_every,
                        snapshot_log_bytes=config.snapshot_log_bytes, limits=config.limits,
                        truncate_corrupt=config.truncate_corrupt_log)
        self.loaded = loaded = p.open(self.store, self.sessions)
        self.persist = p
        self.server_id = loaded.server_id
        self.store.journal = p.record
        if loaded.warning:
            log.warn("{warning}", warning=loaded.warning)
        # Sessions come back detached: their clients have session_ttl to resume them.
        for s in self.sessions:
            s.timer = self.reactor.callLater(config.session_ttl, self.expire, s)
        log.info("loaded {dir}: {bins} bins, {sessions} sessions ({records} log records "
                 "replayed{snap})", dir=p.dir, bins=len(self.store.list()),
                 sessions=len(self.sessions), records=loaded.records,
                 snap=f" after {os.path.basename(loaded.snapshot)}" if loaded.snapshot else "")

    def buildProtocol(self, addr: Any) -> ServerProtocol:
        return ServerProtocol(self)

    # -- listeners --------------------------------------------------------------------------
    def subscribe(self, name: str, proto: ServerProtocol) -> None:
        self._listeners.setdefault(name, set()).add(proto)

    def unsubscribe(self, name: str, proto: ServerProtocol) -> None:
        subs = self._listeners.get(name)
        if subs is not None:
            subs.discard(proto)
            if not subs:
                del self._listeners[name]

    def encode_peek(self, name: str, reply: Fetched, shared: list[Any] | None
                    ) -> list[BytesLike]:
        """Encode a peek reply, reusing the encoding of the same bin version's last one."""
        key = (reply.kind, reply.version, reply.n_items, reply.dropped,
               tuple(id(it) for it in reply.items), shared is not None)
        hit = self._peek_cache.get(name)
        if hit is None or hit[0] != key:
            # The items are kept with the entry, so their ids cannot be reused meanwhile.
            mine: list[Any] | None = [] if shared is not None else None
            hit = (key, reply.items, mine, *encode_fetched_parts(reply, mine))
            self._peek_cache[name] = hit
            self.stats["reply_encodes"] += 1
        else:
            self.stats["reply_reuses"] += 1
        if shared is not None and hit[2]:
            shared.extend(hit[2])
        return encode_fetched_with_id(reply.id, hit[3], hit[4], hit[5])

    def _changed(self, name: str, op: str, n_items: int, version: int, dropped: int) -> None:
        self._peek_cache.pop(name, None)  # a new version: the old encoding is no use
        subs = self._listeners.get(name)
        if not subs:
            return
        # Encode once, write the same chunks to every listener.
        msg = Changed(name, op, n_items, version, 0, dropped)
        chunks = encode_message(msg)[0]
        self.stats["notifications"] += len(subs)
        for proto in list(subs):
            proto.notify(chunks, msg)

    # -- sessions ---------------------------------------------------------------------------
    def attach(self, sid: bytes, proto: ServerProtocol, resume: bool
               ) -> tuple[ServerSession, bool]:
        """Give ``proto`` the session ``sid``: the known one (resumed) or a new one.

        A session still attached to an older connection (the client reconnected before the
        server noticed the old one die) is taken over: the old connection is closed first.

        Raises:
            OverflowError: a new session would exceed ``max_sessions``.
        """
        s = self.sessions.get(sid)
        if s is not None and not resume:
            # A client that starts afresh with an id we know (it restarted, reusing the id)
            # numbers its requests from scratch: the old session's replies must not answer
            # them. It ends as if it had expired.
            if s.attached is not None and s.attached is not proto:
                s.attached._close()
            s.attached = None
            self.expire(s)
            s = None
        if s is None:
            s = self.sessions.open(sid)
            s.attached = proto
            if self.persist is not None:
                self.persist.session_record("session", sid)
            return s, False
        if s.attached is not None and s.attached is not proto:
            old = s.attached
            log.info("{peer} resumes a session still attached to {old}; closing that one",
                     peer=proto.peer, old=old.peer)
            old._close()
        if s.timer is not None and s.timer.active():
            s.timer.cancel()
        s.timer = None
        s.attached = proto
        if resume:
            self.stats["sessions_resumed"] += 1
        return s, True

    def detach(self, s: ServerSession, proto: ServerProtocol) -> None:
        """The connection of ``s`` is gone: keep the session ``session_ttl`` seconds."""
        if s.attached is not proto:
            return
        s.attached = None
        s.timer = self.reactor.callLater(self.config.session_ttl, self.expire, s)

    def expire(self, s: ServerSession) -> None:
        """Drop a session whose client did not come back; its unacknowledged gets go back."""
        s.timer = None
        if s.attached is not None or self.sessions.get(s.id) is not s:
            return
        if self.persist is not None:
            self.persist.session_record("expire", s.id)  # replayed with its restores
        restore = self.sessions.close(s)
        self.stats["sessions_expired"] += 1
        n = 0
        # Latest get first: each goes in front, so the earliest ends up first, as taken.
        for name, reply, _ in reversed(restore):
            self.restore(name, reply, logged=True)
            n += len(reply.items)
        if n:
            log.info("a session expired; {n} item(s) it had taken but not acknowledged went "
                     "back to their bins", n=n)
        self.commit()

    def ack(self, s: ServerSession, info: AckInfo) -> None:
        """The client has the replies ``info`` names: forget them (and release their items)."""
        if self.sessions.ack(s, info.through, info.open) and self.persist is not None:
            # Logged only when it releases get items: else a restart could give them back.
            self.persist.session_record("ack", s.id, through=info.through,
                                        open=list(info.open))

    def restore(self, name: str, reply: Fetched, *, logged: bool = False) -> None:
        """Put the items of a get reply back at the front of their bin.

        ``logged``: the data log already has a record that replays this restore.
        """
        journal = self.store.journal
        if logged:
            self.store.journal = None
        try:
            self.store.restore(name, reply.kind,
                               [(it, item_wire_size(it), it.tag) for it in reply.items])
        finally:
            self.store.journal = journal

    # -- persistence ------------------------------------------------------------------------
    @property
    def holding(self) -> bool:
        """Whether output must wait for the data log (fsync "always", records pending)."""
        p = self.persist
        return p is not None and p.fsync == "always" and p.dirty

    def commit(self) -> None:
        """End of a batch of work: write the data log, then release held output."""
        p = self.persist
        if p is None:
            return
        if p.dirty:
            try:
                p.flush()
            except OSError as exc:
                self._log_failed(exc)
                return
        if self.held:
            held, self.held = self.held, []
            for proto, chunks, shared in held:
                proto.write_chunks(chunks, shared)
        if p.snapshot_due():
            self.snapshot()

    def snapshot(self, wait: bool = False) -> None:
        """Write a snapshot of the state now (in a background thread unless ``wait``)."""
        p = self.persist
        if p is None or p.failed is not None:
            return
        self.stats["snapshots_started"] += 1

        def done(error: BaseException | None) -> None:
            if error is not None:
                log.error("writing a snapshot failed: {error}; the data log still holds "
                          "everything", error=error)

        try:
            p.snapshot(self.store, self.sessions, wait=wait, done=done)
        except OSError as exc:
            self._log_failed(exc)

    def _log_failed(self, exc: OSError) -> None:
        # What the server holds is now ahead of its disk: acknowledging anything more would
        # be a lie. Stop, so that a restart recovers what was acknowledged.
        log.critical("cannot write the data log in {dir}: {error}; stopping the server",
                     dir=self.persist.dir if self.persist else "?", error=exc)
        self.held.clear()
        for proto in list(self.connections):
            proto._release()
            proto.transport.abortConnection()  # type: ignore[union-attr]
        if self.on_fatal is not None:
            self.on_fatal(exc)

    def close_persistence(self) -> None:
        """Flush, write a final snapshot and release the data directory (at shutdown)."""
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

    def queued_bytes(self) -> int:
        """Bytes written to connections and not yet sent, all connections together."""
        return sum(p.queued_bytes for p in self.connections)

    def held_bytes(self) -> int:
        """What the server holds for clients outside the bins: items taken by gets whose
        replies are not yet acknowledged, remembered replies, and queued output."""
        return self.sessions.nbytes + self.queued_bytes()

    # -- statistics -------------------------------------------------------------------------
    def count_error(self, code: str) -> None:
        self.stats[f"errors.{code}"] += 1

    def observe(self, op: str, bytes_out: int, seconds: float) -> None:
        """Count one answered request: by op, its reply's bytes and its latency."""
        stats = self.stats
        stats[f"op.{op}"] += 1
        stats[f"bytes_out.{op}"] += bytes_out
        h = self.latency.get(op)
        if h is None:
            h = self.latency[op] = [0] * (len(LATENCY_BUCKETS) + 1)  # counts..., then sum (us)
        h[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        h[-1] += int(seconds * 1e6)

    def add_bytes_in(self, by_op: dict[str, int]) -> None:
        """Fold a connection's received bytes (by op) into the totals."""
        for op, n in by_op.items():
            self.stats[f"bytes_in.{op}"] += n
        by_op.clear()

    def bytes_in(self) -> dict[str, int]:
        """Request bytes received, by op, including connections that are still open."""
        out = {k[9:]: v for k, v in self.stats.items() if k.startswith("bytes_in.")}
        for p in self.connections:
            for op, n in p.conn.bytes_in.items():
                out[op] = out.get(op, 0) + n
        return out

    def server_stats(self) -> dict[str, Any]:
        """The server-wide statistics of the ``stats`` reply (see docs/PROTOCOL.md)."""
        store = self.store
        counters = {k: v for k, v in self.stats.items() if "." not in k}
        errors = {k[7:]: v for k, v in self.stats.items() if k.startswith("errors.")}
        ops = {k[3:]: v for k, v in self.stats.items() if k.startswith("op.")}
        bytes_out = {k[10:]: v for k, v in self.stats.items() if k.startswith("bytes_out.")}
        return {
            "server": f"tensorshare/{__version__}",
            "server_id": self.server_id,
            "time": self.clock(),
            "uptime": max(self.clock() - self.started_at, 0.0),
            "connections": len(self.connections),
            "listeners": sum(len(s) for s in self._listeners.values()),
            "sessions": len(self.sessions),
            "bins": len(store.list()),
            "memory": {
                "stored": store.nbytes,
                "sessions": self.sessions.nbytes,
                "output": (queued := self.queued_bytes()),
                "total": store.nbytes + self.sessions.nbytes + queued,
                "max_memory": self.config.max_memory,
            },
            "waiting": {"fetches": store.n_waiters, "appends": store.n_blocked},
            "counters": counters,
            "errors": errors,
            "requests": ops,
            "bytes_in": self.bytes_in(),
            "bytes_out": bytes_out,
            "latency": {"buckets": [b for b in LATENCY_BUCKETS if b != float("inf")],
                        "ops": {op: h[:-1] for op, h in self.latency.items()},
                        "sum_us": {op: h[-1] for op, h in self.latency.items()}},
        }

    def bin_stats(self, glob: str | None = None) -> dict[str, dict[str, Any]]:
        """A summary of every bin (matching ``glob``) for the ``stats`` reply."""
        out: dict[str, dict[str, Any]] = {}
        names = set(self.store.names(glob))
        # Bins someone listens to are worth showing even while empty (a drained queue).
        names.update(n for n in self._listeners if glob is None or fnmatch.fnmatchcase(n, glob))
        for name in sorted(names):
            d = self.store.describe(name)
            cfg: BinConfig = d.pop("config")
            first, last = d.pop("first"), d.pop("last")
            d["listeners"] = len(self._listeners.get(name, ()))
            d["limits"] = {"max_items": cfg.max_items, "max_bytes": cfg.max_bytes,
                           "overflow": cfg.overflow}
            d["first"] = _describe(first)
            d["last"] = _describe(last) if d["n_items"] > 1 else None
            out[name] = d
        return out


def _describe(item: Item | None) -> str | None:
    if item is None:
        return None
    return codec.describe(item.value.value)


class EmbeddedServer:
    """A server running on a private reactor in a daemon thread.

    Usage::

        with EmbeddedServer(port=0) as server:
            client = Client("127.0.0.1", server.port)

    Args:
        port: TCP port; 0 picks a free one (read it back from ``.port``); ``None``: no TCP
            (then ``unix`` must be given).
        host: interface to bind; 127.0.0.1 unless you mean to accept other machines.
        limits: hard limits (see :class:`~tensorshare.messages.Limits`).
        max_memory: refuse values that would take the bytes held above this.
        config: every other setting (:class:`ServerConfig`).
        unix: also listen on this Unix socket path (same-host clients: ``unix://PATH``;
            they may pass large tensors through shared memory). Readable and writable by
            its owner only; removed when the server stops.

    Raises:
        OSError: the port or path could not be bound (e.g. it is in use).
    """

    def __init__(self, port: int | None = 0, host: str = "127.0.0.1", *,
                 limits: Limits | None = None, max_memory: int | None = None,
                 config: ServerConfig | None = None, unix: str | None = None) -> None:
        from twisted.internet.epollreactor import EPollReactor

        if port is None and unix is None:
            raise ValueError("give a TCP port, a Unix socket path, or both")
        self.host = host
        self.unix = unix
        self._ports: list[Any] = []
        self.reactor = EPollReactor()
        self.error: BaseException | None = None  # why the server stopped by itself, if it did
        self._stopping = False
        self._reactor_closed = False
        try:
            self.factory = ServerFactory(self.reactor, limits, max_memory, config=config)
            self.factory.on_fatal = self._fatal
            if port is not None:
                self._ports.append(listen_fast_tcp(self.reactor, port, self.factory,
                                                   interface=host))
            if unix is not None:
                self._ports.append(listen_fast_unix(self.reactor, unix, self.factory))
        except BaseException:
            for p in self._ports:
                p.stopListening()
            if getattr(self, "factory", None) is not None:
                self.factory.close_persistence()
            self._close_reactor()
            raise
        # The TCP port (0 if there is none).
        self.port: int = self._ports[0].getHost().port if port is not None else 0
        # Liveness is this event, not Thread.is_alive(): a join() interrupted by Ctrl+C can
        # leave a thread marked as stopped while it runs on (CPython 3.11).
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"tensorshare-server-{self.port}",
                                        daemon=True)
        self._thread.start()
        log.info("tensorshare server listening on {where}", where=", ".join(self.addresses))

    @property
    def addresses(self) -> list[str]:
        """Where clients connect: ``HOST:PORT`` and/or ``unix://PATH``."""
        out = [f"{self.host}:{self.port}"] if self.port else []
        if self.unix is not None:
            out.append(f"unix://{self.unix}")
        return out

    def call(self, fn: Any, *args: Any, timeout: float = 10.0) -> Any:
        """Run ``fn(*args)`` in the server's reactor thread and return its result."""
        done = threading.Event()
        box: list[Any] = []

        def run() -> None:
            try:
                box.append((True, fn(*args)))
            except BaseException as exc:  # handed back to the caller below
                box.append((False, exc))
            done.set()

        self.reactor.callFromThread(run)
        if not done.wait(timeout):
            raise TimeoutError("the server's reactor did not answer")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def _run(self) -> None:
        try:
            self.reactor.run(installSignalHandlers=False)
        finally:
            self._done.set()

    def _fatal(self, error: BaseException) -> None:
        self.error = error
        self.reactor.callLater(0, self._shutdown)

    def _shutdown(self) -> None:
        if self._stopping or not self.reactor.running:
            return
        self._stopping = True
        for p in self._ports:
            p.stopListening()  # a Unix socket's file goes with it
        for proto in list(self.factory.connections):
            proto.transport.abortConnection()  # type: ignore[union-attr]
        # With a data directory: the log is flushed and a final snapshot written, so that
        # the next start loads quickly.
        self.factory.close_persistence()
        self.reactor.callLater(0, self.reactor.stop)

    def stop(self, timeout: float | None = None) -> None:
        """Close the port and every connection, write the final snapshot (with a data
        directory), stop the reactor and join its thread.

        Args:
            timeout: seconds to wait (default 10 s, or 10 minutes with a data directory:
                the final snapshot writes everything the server holds).
        """
        if timeout is None:
            timeout = 600.0 if self.factory.config.data_dir else 10.0
        if not self._done.is_set():
            self.reactor.callFromThread(self._shutdown)
            if not self._done.wait(timeout):
                raise TimeoutError(f"the server thread on port {self.port} did not stop "
                                   f"within {timeout:g} s")
        self._thread.join(timeout)
        self.factory.close_persistence()  # if the reactor ended some other way
        self._close_reactor()

    def _close_reactor(self) -> None:
        # A private reactor is never used again: give back its epoll and waker descriptors,
        # or a process that starts many servers (a test suite) runs out of them.
        if self._reactor_closed:
            return
        self._reactor_closed = True
        try:
            self.reactor.waker.connectionLost(None)
            self.reactor._poller.close()
        except (AttributeError, OSError):  # another reactor type, or already closed
            pass

    @property
    def running(self) -> bool:
        """Whether the server is running (its reactor thread has not ended)."""
        return not self._done.is_set()

    def __enter__(self) -> EmbeddedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_server(port: int | None = 8000, host: str = "127.0.0.1", *,
               limits: Limits | None = None, max_memory: int | None = None, ready: Any = None,
               config: ServerConfig | None = None, unix: str | None = None) -> None:
    """Run a server until interrupted (Ctrl+C). This blocks, as in the seed.

    Args:
        port: TCP port (0 picks a free one; it is logged and passed to ``ready``).
        host: interface to bind; 127.0.0.1 by default, ``0.0.0.0`` to accept other machines.
        limits, max_memory, config, unix: see :class:`EmbeddedServer`.
        ready: optional callable ``ready(server)`` called once the port is bound.
    """
    server = EmbeddedServer(port, host, limits=limits, max_memory=max_memory, config=config,
                            unix=unix)
    # This process is the server: tune the cyclic garbage collector for it. What is loaded
    # at start (a data directory) is frozen out of every collection, and collections come
    # less often: a batch of 50,000 small items would otherwise trigger hundreds, each
    # scanning every stored object. Nothing the server makes per request forms cycles.
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
    previous = None
    if threading.current_thread() is threading.main_thread():
        import signal

        def terminate(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt  # SIGTERM stops the server the way Ctrl+C does

        previous = signal.signal(signal.SIGTERM, terminate)
    try:
        if ready is not None:
            ready(server)
        while server.running:
            server._done.wait(0.5)  # short waits keep Ctrl+C responsive
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        if previous is not None:
            import signal

            signal.signal(signal.SIGTERM, previous)
    if server.error is not None:
        raise RuntimeError(f"the server stopped: {server.error}")
