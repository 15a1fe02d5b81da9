"""One client connection: parsing, limits, backpressure and the handshake.

:class:`ServerProtocol` feeds received bytes to the sans-I/O :class:`ServerConnection`, checks
what the connection may do (the handshake first, the limits before anything is allocated),
and hands each request to the server's :class:`~.handlers.Responder`. It owns what belongs
to one connection: its session (while attached), the requests waiting on the server, the bins
it listens to, and its output: every reply is answered here (:meth:`Connection.answer`),
the replies that wait for the data log are held here until it is written
(:meth:`Connection.committed`), and it stops producing (and folds notifications) while the
client reads slower than it is written to. It is the :class:`~.parts.Conn` the handlers see,
and it sees the server as a :class:`~.parts.Server`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from time import monotonic, perf_counter
from typing import TYPE_CHECKING, Any, cast

from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from .._version import __version__
from ..errors import (
    AuthenticationError,
    InvalidRequest,
    LimitExceeded,
    ProtocolError,
    SessionTakenOver,
    TensorShareError,
    UnsupportedVersion,
)
from ..memory import shm
from ..wire.auth import client_proof, new_nonce, server_proof, verify
from ..wire.frames import BytesLike
from ..wire.messages import (
    Auth,
    Challenge,
    Hello,
    HelloReply,
    Reply,
    Request,
)
from ..wire.prepared import notify_chunks
from ..wire.protocol import (
    PROTOCOL_VERSIONS,
    BadRequest,
    ServerConnection,
    encode_fetched_parts,
    encode_fetched_with_id,
    encode_message,
    encode_reply,
)
from ..wire.records import (
    Changed,
    ErrorReply,
    Fetched,
)
from .sessions import ServerSession

if TYPE_CHECKING:
    from .accounts import Usage, User
    from .parts import Route, Server
    from .store import Waits
    from .transports import _ZeroCopy

__all__ = ["ServerProtocol"]

log = Logger(namespace="tensorshare.server")

# A connection we close gets this long to take what is queued for it (say, the error that
# explains why) before it is cut.
CLOSE_GRACE_SECONDS = 10.0


def _in_turn(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        first()
        second()

    return both


class Connection:
    """What one connection does on every read (the hot half of :class:`ServerProtocol`,
    typed for the compiler: a cdef class in the compiled twin, see ``connection_c.pxd``):
    one pass per read, the one owner of its output, and the requests waiting on the server.
    :class:`ServerProtocol` adds the Twisted hooks, the handshake and closing."""

    def __init__(self, factory: Server) -> None:
        self.factory = factory
        self.transport: Any = None
        self.conn = ServerConnection(factory.config.limits,
                                     pre_hello_max_bytes=factory.config.pre_hello_bytes,
                                     allocate=factory.pool.take, budget=factory.budget)
        self._decoder = self.conn.decoder
        self._st: Any = None  # the socket's transport, once connected (see connectionMade)
        self.last_rx = monotonic()  # when bytes last arrived (see frame_timeout)
        self.version: int | None = None  # protocol version agreed in the handshake
        self.client_name = ""
        self.peer = "?"
        self.session: ServerSession | None = None
        self.listening: set[str] = set()
        # Requests answered later (a waiting get, a held append): id -> when they came in.
        self.started: dict[int, float] = {}
        self.shm = False  # the handshake agreed on memfd buffers (Unix socket)
        self.runs = False  # ... and on runs of like tensors in get/peek replies (wire/runs)
        self._waiting: dict[int, tuple[Waits, IDelayedCall | None]] = {}
        self._closed = False
        self._refusing = False  # the handshake failed: its refusal is on its way (delayed)
        self._timer: IDelayedCall | None = None  # hello deadline, then the close grace
        self._ack: tuple[int, tuple[int, ...]] | None = None  # an ack before the hello's end
        # While a pass over one read runs (see _pass): the output it queued, what it answered
        # (op -> [requests, reply bytes]), the request being served and when the read came.
        self._out: list[BytesLike] | None = None
        self._pass_ops: dict[str, list[int]] = {}
        self._serving = 0
        self._answered = 0
        self._pass_start = 0.0
        self._then: Callable[[], None] | None = None  # see then()
        # Replies held until the data log is written (--fsync always; see emit, committed).
        self._held: list[tuple[Sequence[BytesLike], list[Any] | None]] | None = None
        self._paused = False  # the transport says our output backs up: see the class doc
        self.keeps_reading = False  # (a replica's link: see pauseProducing)
        self._folded: dict[str, Changed] = {}  # notifications held back while paused
        self._stall: IDelayedCall | None = None  # watches a large frame that stops arriving
        self._greeting: tuple[Hello, bytes] | None = None  # a hello and our challenge's nonce
        self.role = "write"  # what the handshake allowed: "write", or "read" (read-only token)
        # The user the handshake proved (see .users), and what it holds: set by _greeted.
        self.user: User | None = None
        self.usage: Usage | None = None
        # The server's parts every request meets, looked up once.
        self._responder = factory.responder
        self._sessions = factory.sessions
        self._stats = factory.stats

    def dataReceived(self, data: bytes) -> None:
        if not self._closed:
            self.last_rx = monotonic()
            self._pass(*self.conn.frames(data))
            if self._decoder.reserved and self._stall is None:
                self._watch_stall()

    def get_read_buffer(self) -> memoryview | None:
        return None if self._closed else self.conn.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if not self._closed:
            self.last_rx = monotonic()
            self._pass(*self.conn.buffered(nbytes))
            if self._decoder.reserved and self._stall is None:
                self._watch_stall()

    # -- output: the one owner of what this connection sends -------------------------------
    def emit(self, chunks: Sequence[BytesLike], shared: list[Any] | None = None, *,
             hold: bool = False) -> None:
        """Send a frame (``shared``: shared memory whose descriptors go with it). During a
        pass over a read, it joins the pass's output, which leaves in one write at its end.

        ``hold``: the reply of a write: with a data directory it leaves only once the write
        is in the data log (on disk with fsync "always"): held here until the server's
        ``commit`` has written it (:meth:`committed`).
        """
        if self._closed:
            return
        if hold and self.factory.persist is not None and self.factory.holding:
            held = self._held
            if held is None:  # the server tells the connections that hold something
                held = self._held = []
                self.factory.hold(self)
            held.append((chunks, shared))
            return
        out = self._out
        if out is not None:
            if not shared:
                out.extend(chunks)
                return
            if out:  # what the pass queued goes first
                self._out = []
                self._write(out, None)
        self._write(chunks, shared)

    def gather(self) -> bool:
        """Gather what is sent to this connection from now until :meth:`flush`, to leave
        in one write (a service host's answers to several calls of one caller). ``False``:
        it gathers already (a pass over its own read, which writes at its end), or it is
        closed; then :meth:`flush` is not to be called."""
        if self._out is not None or self._closed:
            return False
        self._out = []
        return True

    def flush(self) -> None:
        """Write what was gathered since :meth:`gather` returned ``True``, in one write."""
        out, self._out = self._out, None
        if out:
            self._write(out, None)

    def committed(self) -> None:
        """The data log is written: the replies held for it leave, in order."""
        held, self._held = self._held, None
        if held:
            for chunks, shared in held:
                self.emit(chunks, shared)

    def _write(self, chunks: Sequence[BytesLike], shared: list[Any] | None) -> None:
        """Hand a frame to the transport (closing a connection that leaves too much unread)."""
        if self._closed:
            return
        f = self.factory
        st = self._st
        queued = 0 if st is None else st.queued_bytes
        limit = f.config.max_client_buffer
        # (a replica's link is bounded by --replica-buffer instead: replication drops it)
        if queued > limit and not self.keeps_reading:
            # Beyond the reply it is taking, a client may leave at most this much unread.
            f.stats.counters["client_buffer_closes"] += 1
            log.warn("closing connection from {peer} ({client!r}): {queued} bytes queued "
                     "for it are unread, over --max-client-buffer={limit}", peer=self.peer,
                     client=self.client_name, queued=queued, limit=limit)
            self.abort()
            return
        # Our transport (transports.FastServer) takes memoryviews, hence no bytes copies.
        t: Any = self.transport
        if shared:
            t.writeSequence(chunks, fds=[m.fd for m in shared], owner=shared)
        elif st is t:  # our own zero-copy transport (not TLS over it): the direct path
            t.write_frames(chunks)
        else:
            t.writeSequence(chunks)

    def notify(self, chunks: Sequence[BytesLike], msg: Changed) -> None:
        """Send a change notification, or fold it into the last one while we are paused."""
        if not self._paused:
            self.emit(chunks)
            return
        old = self._folded.pop(msg.bin, None)
        if old is not None:
            self.factory.stats.counters["notifications_folded"] += 1
            msg = Changed(msg.bin, msg.op, msg.n_items, msg.version,
                          old.skipped + msg.skipped + 1, old.dropped + msg.dropped)
        self._folded[msg.bin] = msg

    def send(self, msg: Reply | Changed) -> None:
        """Encode and send one message (no bookkeeping: see :meth:`answer` for replies)."""
        shared: list[Any] | None = [] if self.shm else None
        self.emit(encode_message(msg, None, shared)[0], shared)

    def answer(self, msg: Any, reply: Any, route: Route | None = None) -> None:
        """Answer ``msg``: the one place a reply is remembered (if re-running ``msg`` would
        change something: a get's items stay held for the session until acknowledged; a
        reply remembered already, answering a resent request again, is not remembered
        twice), encoded, counted and sent.

        A handler returns its reply (the pass answers it); a request answered later (a
        waiting get, a held append, a take that waits, a write that waited for room) is
        answered here when it is served or times out."""
        if route is None:
            route = self._responder.route(msg)
        cls = type(reply)
        if cls is ErrorReply:
            self._stats.count_error(reply.code)
        mutating = route.mutating
        s = self.session
        rid = msg.id
        # (a get or peek's reply with items: what it is remembered and encoded as depends on
        # whether it took them; ``fetched`` is the reply as its class, read without lookups)
        taken = peeked = False
        if cls is Fetched:
            fetched: Fetched = reply
            if fetched.items:
                taken = msg.spec.remove
                peeked = not taken
        if s is not None and mutating:
            if taken:
                self._sessions.remember(s, rid, reply, msg.bin, fetched.nbytes)
            else:  # (a put's reply is its frame's bytes: remembered as they are)
                self._sessions.remember(s, rid, reply)
        shared: list[Any] | None = [] if self.shm else None
        if cls is bytes:  # a reply prepared as its frame
            chunks: Sequence[BytesLike] = [reply]
        elif peeked:
            # Many readers of one version (parameters fanned out to every worker): the
            # reply is encoded once per bin version, then only the request id differs.
            chunks = self.factory.encode_peek(msg.bin, reply, shared, self.runs)
        elif cls is Fetched and self.runs and len(fetched.items) > 1:  # (runs: wire/runs.py)
            chunks = encode_fetched_with_id(fetched.id,
                                            *encode_fetched_parts(reply, shared, True))
        else:
            chunks = encode_reply(reply, shared)
        nbytes = len(chunks[0]) if len(chunks) == 1 else sum(map(len, chunks))
        if rid == self._serving and self._out is not None:  # counted with its pass
            self._answered = rid
            entry = self._pass_ops.get(route.op)
            if entry is None:
                self._pass_ops[route.op] = [1, nbytes]
            else:
                entry[0] += 1
                entry[1] += nbytes
        else:
            started = self.started.pop(rid, None)
            if started is not None:
                self._stats.observe(route.op, nbytes, perf_counter() - started)
        # (a refusal changed nothing: it waits for neither the data log nor the replicas)
        self.emit(chunks, shared, hold=mutating and cls is not ErrorReply)

    def then(self, work: Callable[[], None]) -> None:
        """Run ``work`` once the request being handled now is answered (or, its handler
        returning ``None``, once it returned), whatever the answer: the one hook for what
        must follow a reply (a ``bye`` closes the connection after its ``ok``; a stream op
        notifies listeners and serves what waits on the stream after its own reply). For
        handlers only: the pass (or :meth:`serve_later`) runs it."""
        prev = self._then
        if prev is None:
            self._then = work
        else:  # (two in one request: in order)
            self._then = _in_turn(prev, work)

    def _run_then(self) -> None:
        work, self._then = self._then, None
        if work is None:
            return
        try:
            work()
        except Exception:  # a bug must cost one request, never the server
            log.failure("internal error after answering a request from {peer}", peer=self.peer)

    def serve_later(self, msg: Any) -> None:
        """Serve a request that was kept waiting before it acted (a write waiting for room in
        its user's quota): handled now, its reply answered as a pass answers one."""
        route = self._responder.route(msg)
        reply = self._responder.handle(self, msg, route)
        if reply is not None:
            self.answer(msg, reply, route)
        if self._then is not None:
            self._run_then()

    @property
    def closed(self) -> bool:
        """Whether this connection is closed or closing (it answers nothing any more)."""
        return self._closed

    def ctx(self, msg: Request) -> tuple[bytes, int] | None:
        """What ties a store effect to ``msg`` (for the data log's remembered replies)."""
        s = self.session
        return None if s is None else (s.id, msg.id)

    # -- one pass per read -------------------------------------------------------------------
    def _pass(self, frames: list[Any], error: ProtocolError | None) -> None:
        """Serve every frame one read completed, in one loop: each parsed, routed, handled and
        answered before the next is parsed; the pass's replies leave in one write at its end
        (after what the data log must hold first), and its statistics are counted once."""
        f = self.factory
        if frames:
            self._out = []
            self._pass_start = perf_counter()
            try:
                n = self._serve(frames)
            finally:
                out, self._out = self._out, None
                self._serving = 0
                self._stats.counters["requests"] += n
                if self._pass_ops:
                    self._count_pass()
                if out:
                    self._write(out, None)
        if error is not None and not self._closed and not self._refusing:
            self.fail(ProtocolError(str(error)))
        if f.persist is not None:  # (else commit has nothing to do)
            f.commit()

    def _count_pass(self) -> None:
        """The requests a pass answered, by op: all read together, all written together."""
        seconds = perf_counter() - self._pass_start
        stats = self._stats
        for op, (n, nbytes) in self._pass_ops.items():
            stats.observe_many(op, n, nbytes, seconds)
        self._pass_ops.clear()

    def _serve(self, frames: list[Any]) -> int:
        """The loop of :meth:`_pass`; returns how many requests it served."""
        conn, n = self.conn, 0
        responder = self._responder
        for frame in frames:
            if self._closed:
                break
            try:
                msg, through, open_ids = conn.parse(frame)
            except ProtocolError as exc:
                self.fail(exc)
                break
            if through >= 0:
                if self.session is None:
                    self._ack = (through, open_ids)
                elif self.factory.persist is None:  # (nothing to log: the table alone)
                    self._sessions.ack(self.session, through, open_ids)
                else:
                    self.factory.ack(self.session, through, open_ids)
            if isinstance(msg, BadRequest):
                if not self._bad(msg):
                    break
                continue
            n += 1
            if self.version is None:
                if not self._handshake(msg):
                    break
                continue
            rid = self._serving = msg.id
            route = responder.route(msg)
            reply = responder.handle(self, msg, route)
            if reply is not None:
                self.answer(msg, reply, route)
                if self._then is not None:
                    self._run_then()
                continue
            if self._then is not None:
                self._run_then()
            if self._answered != rid:  # answered later: its latency counts from now
                self.started[rid] = self._pass_start
        return n

    # -- requests waiting on the server -----------------------------------------------------
    def wait(self, rid: int, waiter: Waits, timeout: float | None,
             on_timeout: Callable[[], None]) -> None:
        """Keep a waiting request (a fetch, a blocked append, another kind's read or take, a
        write waiting for room) until served, cancelled, timed out (``on_timeout`` then
        answers it) or the connection ends.

        Raises:
            InvalidRequest: a request with this id already waits on this connection.
        """
        store = self.factory.store
        if rid in self._waiting:
            store.cancel(waiter)
            raise InvalidRequest(f"request id {rid} is already waiting on this connection")
        timer = None
        if timeout is not None:

            def expired() -> None:
                entry = self._waiting.pop(rid, None)
                if entry is not None:
                    store.cancel(entry[0])
                    on_timeout()

            try:
                timer = self.factory.reactor.callLater(timeout, expired)
            except BaseException:
                store.cancel(waiter)  # never leave a waiter nobody will answer
                raise
        self._waiting[rid] = (waiter, timer)

    def stop_waiting(self, rid: int) -> None:
        """A waiting request was served: forget it (and its timer)."""
        entry = self._waiting.pop(rid, None)
        if entry is not None and entry[1] is not None and entry[1].active():
            entry[1].cancel()

    def cancel_wait(self, rid: int) -> bool | None:
        """Withdraw a waiting request: whether it was still waiting; ``None`` if not ours."""
        entry = self._waiting.pop(rid, None)
        if entry is None:
            return None
        waiter, timer = entry
        if timer is not None and timer.active():
            timer.cancel()
        return self.factory.store.cancel(waiter)

    def taken_over(self, by: str) -> None:
        """Another connection (from ``by``) took this one's session over: say so and close."""
        self.fail(SessionTakenOver(
            f"the session of this client was taken over by another connection (from {by}): "
            f"two processes are using one session id"))

    @property
    def queued_bytes(self) -> int:
        """Bytes written to this connection and not yet sent."""
        st = self._st
        return 0 if st is None else int(st.queued_bytes)

    # -- what the Twisted side (ServerProtocol) provides -------------------------------------
    def fail(self, error: TensorShareError) -> None:
        """Tell the peer why, then close this connection (see ServerProtocol)."""
        raise NotImplementedError

    def abort(self) -> None:
        """Close at once, dropping what is queued (see ServerProtocol)."""
        raise NotImplementedError

    def close(self) -> None:
        """Close after what is queued is sent (see ServerProtocol)."""
        raise NotImplementedError

    def _watch_stall(self) -> None:
        raise NotImplementedError

    def _handshake(self, msg: Request) -> bool:
        raise NotImplementedError

    def _bad(self, ev: BadRequest) -> bool:
        """Answer a request that cannot be served; False if the connection is closed."""
        if self.version is None:
            self.fail(ProtocolError(f"handshake failed: {ev.message}"))
            return False
        log.warn("bad request from {peer}: {message}", peer=self.peer, message=ev.message)
        self._stats.count_error(ev.code)
        self.send(ErrorReply(ev.id, ev.code, ev.message))
        if ev.op:  # what it names may wait on it (a service's batch): its kind settles it
            self._responder.refused(self, ev.op, ev.header, ev.message)
        return True


class ServerProtocol(Connection, Protocol):
    """One client connection. Implements the zero-copy read hooks of :mod:`.transports`.

    It is also the streaming producer of its own transport: when more than the transport's
    buffer size is queued for a client (it reads slower than we write), the transport pauses
    us. While paused we stop reading that client's requests (so it cannot make us queue
    more replies), and fold its notifications per bin (the latest wins, counting the ones
    it skipped), so a listener that does not keep up learns the newest state without a
    backlog. Past ``max_client_buffer`` queued bytes the connection is closed.
    """

    @property
    def _t(self) -> _ZeroCopy:
        """Our transport: a zero-copy one (see :mod:`.transports`), or TLS over one."""
        return cast("_ZeroCopy", self.transport)

    @property
    def _socket(self) -> _ZeroCopy:
        """The transport on the socket itself (under TLS, the one TLS writes to)."""
        t: Any = self.transport
        # (On the class: a TLS wrapper forwards unknown attributes to the protocol it wraps.)
        while getattr(type(t), "queued_bytes", None) is None and \
                getattr(t, "transport", None) is not None:
            t = t.transport
        return cast("_ZeroCopy", t)

    # -- Twisted hooks ----------------------------------------------------------------------
    def connectionMade(self) -> None:
        # Looked up once: every write asks the socket's transport how much is queued.
        sock = self._socket
        self._st = sock if getattr(type(sock), "queued_bytes", None) is not None else None
        if self._st is not None and hasattr(self._st, "attach_ledger"):
            self._st.attach_ledger(self.factory.ledger)
        peer = self._t.getPeer()
        host, port = getattr(peer, "host", None), getattr(peer, "port", None)
        self.peer = f"{host}:{port}" if host is not None else str(getattr(peer, "name", "?"))
        f = self.factory
        f.connections.add(self)
        f.stats.counters["connections_total"] += 1
        if len(f.connections) > f.config.max_connections:
            f.stats.counters["connections_refused"] += 1
            self.fail(LimitExceeded(
                f"the server is at its max_connections={f.config.max_connections}; try "
                f"again later or raise --max-connections"))
            return
        self._timer = f.reactor.callLater(f.config.hello_timeout, self._hello_overdue)
        self._t.registerProducer(self, True)
        log.debug("connection from {peer}", peer=self.peer)

    def _watch_stall(self) -> None:
        """While a large frame holds memory it reserved, it must keep arriving: one with no
        new bytes for ``frame_timeout`` closes the connection (releasing the memory)."""
        self._stall = None
        if self._closed or not self.conn.reserved:
            return
        limit = self.factory.config.frame_timeout
        idle = monotonic() - self.last_rx
        if idle >= limit:
            self.factory.stats.counters["stalled_frames"] += 1
            self.fail(ProtocolError(f"no bytes of a {self.conn.reserved}-byte frame part for "
                                    f"{limit:g} s (frame_timeout); the connection is closed"))
            return
        self._stall = self.factory.reactor.callLater(limit - idle, self._watch_stall)

    def connectionLost(self, reason: Failure | None = None) -> None:
        self._release()
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
            self.factory.stats.counters["client_paused"] += 1
            if not self.keeps_reading:  # (a replica's acknowledgements are read on)
                self._socket.pauseProducing()  # stop reading

    def resumeProducing(self) -> None:
        if not self._paused or self._closed:
            return
        self._paused = False
        folded, self._folded = self._folded, {}
        for msg in folded.values():
            self.emit(notify_chunks(msg))
        if not self._paused:
            self._socket.resumeProducing()

    def stopProducing(self) -> None:
        pass

    def fds_received(self, fds: list[int]) -> None:
        """Descriptors the client passed (Unix socket): its ``memfd`` buffers."""
        if self._closed or not self.shm:
            for fd in fds:  # not agreed in the handshake: nobody will take them
                os.close(fd)
            return
        self.conn.add_fds(fds)

    # -- closing ----------------------------------------------------------------------------
    def _stop_timer(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _release(self) -> None:
        """Leave every registry this connection joined: the one place that undoes them, run
        once whichever way the connection ends (``bye``, a clean close, a cut, a fatal frame,
        a timeout, a removed user, the server's shutdown). A connection joins:

        - the server's open connections (``factory.connections``, in ``connectionMade``);
        - its user's (``usage.conns``, in ``Users.bind``);
        - the listeners of every bin in ``listening`` (``factory.subscribe``);
        - the store, or its user's queue of writes waiting for room, for every request it
          keeps waiting (``wait``), each with its timer;
        - the other kinds' records (streams' cursors and reads, services' hosts, takes and
          calls: ``Kind.connection_lost``);
        - its session, left to wait ``session_ttl`` for its client (``factory.detach``);
        - the reactor, through its timers: the stall watch (here) and the hello deadline or
          the close grace (cancelled in ``connectionLost``).

        Done as soon as we decide to close, not when the socket is finally gone: a waiter of
        a closing connection must never take data it can no longer deliver, and a closing
        connection no longer counts against ``max_connections``.
        """
        if self._closed:
            return
        self._closed = True
        if self._stall is not None and self._stall.active():
            self._stall.cancel()
        self._stall = None
        self._folded.clear()
        self.started.clear()
        self._held = None
        self.conn.close()
        f = self.factory
        f.connections.discard(self)
        if self.usage is not None:
            self.usage.conns.discard(self)
        f.stats.add_bytes_in(self.conn.bytes_in)
        for name in self.listening:
            f.unsubscribe(name, self)
        self.listening.clear()
        for waiter, timer in self._waiting.values():
            f.store.cancel(waiter)
            if timer is not None and timer.active():
                timer.cancel()
        self._waiting.clear()
        for kind in f.kinds:
            kind.connection_lost(self)
        if self.session is not None:
            f.detach(self.session, self)

    def close(self) -> None:
        """Close after what is queued is sent; abort if the peer does not read it in time."""
        out = self._out
        if out:  # a pass's answers (the error that explains why, say) leave first
            self._out = []
            self._write(out, None)
        self._release()
        self._stop_timer()
        self._t.loseConnection()
        self._timer = self.factory.reactor.callLater(
            CLOSE_GRACE_SECONDS, self._t.abortConnection)

    def abort(self) -> None:
        """Close at once, dropping what is queued."""
        self._release()
        self._t.abortConnection()

    def fail(self, error: TensorShareError) -> None:
        """Tell the peer why (a connection-level error), then close this one connection; the
        server carries on."""
        log.warn("closing connection from {peer}: {message}", peer=self.peer, message=error)
        self.send(ErrorReply(0, error.code or ProtocolError.code, str(error)))
        self.close()

    def _hello_overdue(self) -> None:
        self._timer = None
        if self.version is None and not self._closed:
            self.factory.stats.counters["hello_timeouts"] += 1
            self.fail(ProtocolError(f"no hello within {self.factory.config.hello_timeout:g} s"))

    def _handshake(self, msg: Request) -> bool:
        """A request before the handshake is done: hello, then auth; False if it failed (or
        had failed: what follows a failed handshake is dropped unanswered, §8.1)."""
        if self._refusing:
            return False
        if type(msg) is Hello and self._greeting is None:
            self._hello(msg)
        elif type(msg) is Auth and self._greeting is not None:
            self._auth(msg)
        else:
            self.fail(ProtocolError(
                "handshake failed: the first request must be 'hello'"
                + ("" if self._greeting is None else ", then 'auth'")))
            return False
        return True

    # -- handshake --------------------------------------------------------------------------
    def _hello(self, msg: Hello) -> None:
        f = self.factory
        if not set(msg.versions) & set(PROTOCOL_VERSIONS):
            self._refuse(msg.id, UnsupportedVersion(
                f"client speaks protocol versions {list(msg.versions)}, this server speaks "
                f"{list(PROTOCOL_VERSIONS)}"))
            return
        if not f.users.authenticating:
            self._greeted(msg, msg.id, f.users.anonymous, None)
            return
        if msg.nonce is None:
            self._auth_failed(msg.id, "this server requires a token: give the client the "
                                      "server's token (token=, token_file= or TENSORSHARE_TOKEN)")
            return
        # A challenge: the client proves it knows a token over both fresh nonces (the token
        # never crosses the wire; a captured handshake cannot be replayed).
        self._greeting = (msg, new_nonce())
        self.send(Challenge(msg.id, self._greeting[1]))

    def _auth(self, msg: Auth) -> None:
        assert self._greeting is not None
        hello, nonce = self._greeting
        users = self.factory.users.candidates(hello.user)
        # (an unknown user costs one proof like a known one: the time does not tell)
        keys: list[tuple[Any, bytes]] = [(u, k) for u in users for k in u.keys] or \
            [(None, new_nonce())]
        for user, key in keys:
            args = (key, hello.nonce or b"", nonce, hello.session, hello.client, hello.user)
            if verify(client_proof(*args), msg.proof) and user is not None:
                self._greeted(hello, msg.id, user, server_proof(*args))
                return
        self._auth_failed(msg.id, (
            f"wrong token for user {hello.user!r} (or no such user): the client's proof does "
            f"not match" if hello.user is not None else
            "wrong token: the client's proof does not match this server's token" + (
                "" if users else " (this server has users: name yours with user=, "
                                 "TENSORSHARE_USER or --user)")))

    def _auth_failed(self, rid: int, why: str) -> None:
        f = self.factory
        f.stats.counters["auth_failures"] += 1
        delay = f.auth_failures.failed(self.peer.rsplit(":", 1)[0])
        log.warn("authentication failed for {peer}: {why}", peer=self.peer, why=why)
        error = AuthenticationError(why)
        if delay:  # repeated failures from one address are slowed down: until the refusal
            self._refusing = True  # leaves, nothing more is read, nor answered
            self._socket.pauseProducing()
            self._stop_timer()
            self._timer = f.reactor.callLater(delay, self._refuse, rid, error)
        else:
            self._refuse(rid, error)

    def _greeted(self, msg: Hello, rid: int, user: User, proof: bytes | None) -> None:
        """The handshake succeeded: attach the session and answer with the server's terms."""
        f = self.factory
        refused = f.users.refuse(self, user, msg.session)  # its quota, another's session
        if refused is not None:
            self._refuse(rid, refused)
            return
        resumed = False
        if msg.session is not None:
            try:
                self.session, resumed = f.attach(msg.session, self, msg.resume)
            except OverflowError as exc:
                self._refuse(rid, LimitExceeded(str(exc)))
                return
            if self._ack is not None:
                f.ack(self.session, *self._ack)
                self._ack = None
        self.version = max(set(msg.versions) & set(PROTOCOL_VERSIONS))
        role = user.role()
        self.client_name, self.role, self._greeting = msg.client, role, None
        f.users.bind(self, user)
        self.shm = msg.shm and bool(getattr(self.transport, "_passes_fds", False)) and \
            shm.available()
        self.runs = msg.runs
        self.conn.handshake_done()
        self._stop_timer()
        how = "resumed its session" if resumed else (
            "new session" if msg.session is not None else "no session")
        log.info("{client!r} at {peer} connected ({how}{ro})", client=msg.client,
                 peer=self.peer, how=how, ro=(", read-only" if role == "read" else "") + (
                     f", user {user.name!r}" if user.name != "default" else ""))
        self.send(HelloReply(rid, self.version, f"tensorshare/{__version__}", f.config.limits,
                             resumed, f.server_id, self.shm, proof, role, user.name,
                             self.runs))

    def _refuse(self, rid: int, error: TensorShareError) -> None:
        """Answer the handshake with ``error`` and close: it failed."""
        code = error.code or ProtocolError.code
        self.factory.stats.count_error(code)
        self.send(ErrorReply(rid, code, str(error)))
        self.close()
