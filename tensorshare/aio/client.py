"""The asyncio client: the same requests as :class:`tensorshare.Client`, awaited.

:class:`AsyncClient` is one more face of the op surface (:class:`~tensorshare.client.ops.Ops`:
each op is written once for every face) over the same sans-I/O
:class:`~tensorshare.client.session.ClientSession` as the blocking and Twisted clients, so it
behaves as they do: the same arguments, results and errors, the same timeouts, the same
reconnect with exactly-once replay. It runs on the caller's event loop (asyncio's own or
uvloop's; it never sets a loop policy), with no thread and no lock: every task that awaits a
call shares the one connection, their requests in flight together, written out once per turn
of the loop.

Cancelling a task that awaits a call abandons the call (as cancelling a Twisted ``Deferred``
does): a waiting get/peek, a blocked append, a waiting stream read or service call is
withdrawn on the server (the protocol's ``cancel``). A get whose reply had already come when
the cancellation reached its task (the reply is handed over on a later turn of the loop) is
undone: its id stays open in the acknowledgements until the task took the reply
(``ClientSession.hold``), so a ``cancel`` puts its items back at the front of their bin.
Never lost, never read twice; ``asyncio.timeout()`` around a call is the same cancellation.
"""

from __future__ import annotations

import asyncio
import builtins
import inspect
import logging
import socket
import ssl
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Unpack

from ..client.command import gc_paused
from ..client.endpoint import Endpoint
from ..client.facts import (
    Refused,
    SessionEvents,
    SessionFacts,
    connect_failed,
    dropped,
    reconnected,
    try_again,
)
from ..client.failover import PrimaryChoice, located
from ..client.ops import NOWAIT, Command, FetchResult, Ops
from ..client.options import UNSET, ClientOptions, OptionFields, Unset
from ..client.pipeline import Pipeline
from ..client.session import Call, ClientSession, Done, Notify, Ready
from ..errors import ConnectError, ConnectionLost, ServerError, TensorShareError, error_from_code
from ..wire.messages import ErrorReply, Unlisten
from .failover import find_primary
from .listen import ListenEvents
from .pipeline import AsyncPipeline
from .protocol import AioProtocol, SocketStream

__all__ = ["NOWAIT", "AsyncClient", "FetchResult"]

log = logging.getLogger("tensorshare.aio")

Listener = Callable[[dict[str, Any]], Any]

#: The token of a call nobody awaits (an iterator's unlisten after its loop was left).
_NOBODY = object()


class AsyncClient(SessionFacts, SessionEvents, Ops):
    """A connection to a tensorshare server for asyncio programs.

    Usage::

        async with AsyncClient("tensorshare://127.0.0.1:8000") as c:
            await c.put("weights", {"w": torch.zeros(3)})
            value = await c.get("queue", timeout=5)
            async for event in c.listen("weights"):
                ...

    Every op of :class:`tensorshare.Client` (put, append, get, peek, fetch, list, delete,
    configure, stats, ping, listen, unlisten, reload_users, the stream and service ops) is a
    method that returns an awaitable, with the same arguments, defaults, results and errors;
    a call is sent when it is awaited. Local mistakes (a bad name, an unsupported value, a
    negative timeout) raise at the call. ``listen(name)`` without a callback is an async
    iterator (:class:`~.listen.ListenEvents`).

    Args:
        host, port, timeout, options, **overrides: as for :class:`tensorshare.Client` (a URL
            ``tensorshare://``, ``tensorshare+tls://`` or ``unix://``; neither:
            ``TENSORSHARE_URL``); over ``unix://`` tensors of at least ``shm_min_bytes``
            travel through shared memory both ways. The default name is
            ``"tensorshare-asyncio"``. An address list (``["a:7000", "b:7000"]``, or
            ``"tensorshare://a:7000,b:7000"``): a primary and its replicas; every
            connection goes to the one that says it is the primary, so the client follows
            a promotion (see :mod:`tensorshare.client.failover`).

    :meth:`connect` (or ``async with``) connects within ``timeout`` and raises
    ``ConnectError`` or the server's typed refusal (``AuthenticationError``, ...); the
    client then rides out dropped connections by itself (see ``reconnect``). Use it from
    the loop it connected on (other threads: ``asyncio.run_coroutine_threadsafe``).
    """

    def __init__(self, host: str | list[str] | None = None, port: int | None = None,
                 timeout: float | Unset = UNSET, *, options: ClientOptions | None = None,
                 **overrides: Unpack[OptionFields]) -> None:
        changes: dict[str, Any] = dict(overrides)
        if timeout is not UNSET:
            changes["timeout"] = timeout
        opts = self._options = ClientOptions.of(options, **changes)
        self.timeout, self.reconnect = opts.timeout, opts.reconnect
        #: An address list's servers (``None``: one server): each connection goes to the
        #: one that says it is the primary (README: Replication and failover).
        self.primary_choice: PrimaryChoice | None
        (self.endpoint, self.primary_choice, self.host, self.port, self.path,
         self.address) = located(host, port, opts)
        self.compress, self.compress_min_bytes = opts.compress, opts.compress_min_bytes
        self.shm_min_bytes = opts.shm_min_bytes
        self._session = opts.new_session(self.endpoint, "tensorshare-asyncio", True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._protocol: AioProtocol | None = None
        self._runner: asyncio.Task[None] | None = None
        self._ready: asyncio.Future[AsyncClient] | None = None
        self._lost: asyncio.Future[str] | None = None
        self._timer: asyncio.Handle | None = None
        # When it fires: uvloop's call_at gives a plain Handle (no ``when()``) for a time
        # already past, so the time is kept here.
        self._timer_at = 0.0
        self._flushing = False  # a flush is scheduled for this turn of the loop
        self._closing = False
        self._drop_reason: str | None = None
        self._attempt = 0  # connection attempts since the last handshake (the backoff)
        self._lost_at: float | None = None
        self._inboxes: weakref.WeakSet[Any] = weakref.WeakSet()  # listen iterators
        self._tasks: set[asyncio.Task[Any]] = set()  # async listen callbacks running

    # -- what the server said -----------------------------------------------------------------
    # (limits, server_version, protocol_version, server_id, connected, closed and
    # shared_memory: SessionFacts)
    def _client_session(self) -> ClientSession:
        return self._session

    @property
    def options(self) -> ClientOptions:
        """The options this client was made with."""
        return self._options


    def __repr__(self) -> str:
        state = "closed" if self.closed else ("connected" if self.connected else "reconnecting")
        return f"<tensorshare.aio.AsyncClient {self.address} {state}>"

    # -- the op surface (see tensorshare.client.ops) ------------------------------------------
    def _execute(self, cmd: Command) -> Any:
        """The awaitable of ``cmd``: sent when awaited, its converted result (or error)."""
        if cmd.kind == "call":
            return self._call(cmd)
        return self._listener_call(cmd)

    def listen(self, name: str, callback: Listener | None = None, *,
               max_queue: int = 1024, inline: bool = False) -> Any:
        """Listen to the changes of bin ``name``.

        Without ``callback``: an async iterator of the events (see
        :class:`~.listen.ListenEvents`: ``async for event in c.listen(name)``, or
        ``async with c.listen(name) as events``), at most ``max_queue`` of them queued.
        With one: ``await c.listen(name, callback)`` calls ``callback(event)`` on the loop
        for every change (an ``async def`` callback runs as a task), as ``Client.listen``
        does. ``inline`` is accepted for the blocking client's sake: callbacks always run on
        the loop, never delaying a reply.
        """
        if callback is None:
            return ListenEvents(self, name, max_queue)
        return super().listen(name, callback)

    def pipeline(self, *, raise_on_error: bool = True) -> AsyncPipeline:
        """Queue many requests and send them together (``async with c.pipeline() as p:``),
        as ``Client.pipeline`` does; ``p.results`` holds what each call returned."""
        return AsyncPipeline(self, raise_on_error)

    async def _call(self, cmd: Command, extra: Any = None) -> Any:
        loop = self._loop_now()
        fut = loop.create_future()
        call = self._session.call(cmd.request, cmd.what, loop.time(), fut, cmd.convert, None,
                                  extra)
        self._sent(call)
        try:
            reply = await fut
        except asyncio.CancelledError:
            self._cancelled(call, fut)
            raise
        if self._session.held:
            self._session.release(call, loop.time())
            self._ack_soon()
        if type(reply) is ErrorReply:
            raise error_from_code(reply.code, reply.message)
        convert = call.convert
        return convert(reply) if convert is not None else reply

    async def _listener_call(self, cmd: Command) -> Any:
        self._loop_now()
        name = cmd.bin
        assert name is not None
        session = self._session
        if cmd.kind == "listen":
            callback = cmd.listener[0]
            if not session.add_listener(name, callback):
                return None
            return await self._call(cmd, callback)
        for inbox in list(self._inboxes):  # every listener of the bin goes, iterators too
            if inbox.name == name:
                inbox.end(None)
        if not session.remove_listener(name):
            return False
        return await self._call(cmd)

    def _forget_listener(self, name: str, callback: Listener) -> None:
        """An iterator's loop was left: drop its callback, and stop listening to the bin on
        the server when it was the bin's last (nobody awaits that)."""
        session = self._session
        if session.closed is not None or self._loop is None:
            return
        if not session.remove_listener(name, callback) or name in session.listeners:
            return
        call = session.call(Unlisten(0, name), f"unlisten from bin {name!r}", self._loop.time(),
                            _NOBODY)
        self._sent(call)

    def _sent(self, call: Call) -> None:
        """A call was added: write it now when it is the only one in flight, else this turn
        of the loop with every other call made meanwhile (one write for many tasks'
        requests); wake up for its deadline."""
        if not self._flushing:
            if self._session.pending == 1:
                self._flush()
            else:
                self._flushing = True
                assert self._loop is not None
                self._loop.call_soon(self._flush)
        t, deadline = self._timer, call.deadline
        if t is None or (deadline is not None and deadline < self._timer_at):
            self._reschedule()

    def _cancelled(self, call: Call, fut: asyncio.Future[Any]) -> None:
        """The task awaiting ``call`` was cancelled: withdraw the call, or undo a get whose
        reply was already in."""
        now = self._loop_now().time()
        session = self._session
        if fut.done() and not fut.cancelled():
            if fut.exception() is None and call.id in session.held:
                session.release(call, now, undo=True)
                self._flush()
            return
        fut.cancel()
        call.token = None
        session.abandon(call, now)
        self._flush()  # now: the cancel goes before anything read later is acknowledged

    def _run_pipeline(self, pipeline: Pipeline, batch: Iterable[tuple[Command, int]]) -> Any:
        """Add every command of ``batch`` to the session (sent together this turn of the
        loop); return the awaitable of ``pipeline.finish(outcomes)``."""
        loop = self._loop_now()
        session, now = self._session, loop.time()
        entries: builtins.list[tuple[Call | None, Any]] = []
        counts: builtins.list[int] = []
        for cmd, n in batch:
            counts.append(n)
            try:
                fut = loop.create_future()
                entries.append((session.call(cmd.request, cmd.what, now, fut, cmd.convert),
                                fut))
            except TensorShareError as exc:  # the session is closed: each call fails alike
                entries.append((None, exc))
        for call, _ in entries:
            if call is not None:
                self._sent(call)
                break
        return self._pipeline_outcomes(pipeline, entries, counts)

    async def _pipeline_outcomes(self, pipeline: Pipeline,
                                 entries: builtins.list[tuple[Call | None, Any]],
                                 counts: builtins.list[int]) -> builtins.list[Any]:
        replies: builtins.list[Any] = []
        try:
            for call, fut in entries:  # (nothing is handed over before every reply is in)
                if call is None:
                    replies.append(fut)
                    continue
                try:
                    replies.append(await fut)
                except TensorShareError as exc:
                    replies.append(exc)
        except asyncio.CancelledError:
            for call, fut in entries:
                if call is not None:
                    self._cancelled(call, fut)
            raise
        return pipeline.finish(self._outcomes(entries, replies), counts)

    def _outcomes(self, entries: builtins.list[tuple[Call | None, Any]],
                  replies: builtins.list[Any]) -> builtins.list[Any]:
        session, now = self._session, self._loop_now().time()
        outcomes: builtins.list[Any] = []
        for (call, _), reply in zip(entries, replies, strict=True):
            if call is None or isinstance(reply, BaseException):
                outcomes.append(reply)
                continue
            if session.held:
                session.release(call, now)
                self._ack_soon()
            try:
                if type(reply) is ErrorReply:
                    raise error_from_code(reply.code, reply.message)
                convert = call.convert
                outcomes.append(convert(reply) if convert is not None else reply)
            except TensorShareError as exc:
                outcomes.append(exc)
        return outcomes

    # -- events ---------------------------------------------------------------------------------
    # (_process: SessionEvents, which hands each event to the handlers below)
    def _send(self, chunks: Any) -> None:
        if self._protocol is not None:
            self._protocol.write(chunks)

    def _finish(self, ev: Done) -> None:
        call = ev.call
        fut = call.token
        if fut is None or fut is _NOBODY:
            return
        taken = call.op == "get" and ev.error is None and type(ev.reply) is not ErrorReply
        if fut.done():
            if taken:  # its task was cancelled and has not withdrawn it yet: undo it
                self._session.hold(call)
                self._session.release(call, self._loop_now().time(), undo=True)
                self._flush_soon()
            return
        if ev.error is not None:
            fut.set_exception(ev.error)
            return
        if taken:  # acknowledged only once its task took it (see the module docstring)
            self._session.hold(call)
        fut.set_result(ev.reply)

    def _notify(self, ev: Notify) -> None:
        for callback in ev.callbacks:
            try:
                result = callback(dict(ev.event))  # a copy each
            except Exception:
                log.exception("listen callback for bin %r raised", ev.bin)
                continue
            if result is not None and inspect.isawaitable(result):
                task = asyncio.ensure_future(result, loop=self._loop)
                self._tasks.add(task)
                task.add_done_callback(self._callback_done)

    def _callback_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("listen callback failed", exc_info=task.exception())

    def _on_ready(self, ev: Ready) -> None:
        self._attempt = 0
        if ev.first:
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(self)
        else:
            reconnected(self, ev, self._loop_now().time(), log)
        self._flush_soon()
        self._reschedule()

    def _drop(self, reason: str) -> None:
        """The stream is unusable (or silent): abort the connection; we reconnect."""
        proto = self._protocol
        log.warning("dropping connection to tensorshare server at %s: %s", self.address,
                    reason)
        if proto is not None and not proto.lost:
            self._drop_reason = reason
            proto.abort()

    # -- bytes ----------------------------------------------------------------------------------
    def _loop_now(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None:
            raise ConnectError(f"the client for {self.address} is not connected: use 'async "
                               f"with AsyncClient(...)' or 'await client.connect()' first")
        return loop

    def _flush_soon(self) -> None:
        if not self._flushing and self._loop is not None:
            self._flushing = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        proto, session = self._protocol, self._session
        if proto is None or proto.lost:
            return
        chunks = session.pop_sendable(self._loop_now().time())
        shared = session.take_shared() if session.has_shared else None
        if session.has_finished:
            self._process(session.take_finished())
        if chunks:
            proto.write(chunks, shared)

    def _direct_buffer(self, proto: AioProtocol) -> memoryview | None:
        if proto is not self._protocol:
            return None
        return self._session.get_buffer()

    def _received(self, proto: AioProtocol, nbytes: int, direct: int) -> None:
        """``nbytes`` arrived: into the session's own buffer of ``direct`` bytes, or (0)
        into ``proto``'s scratch buffer."""
        session = self._session
        if proto is not self._protocol or session.conn is None:
            return  # an old connection's last bytes, or we are closing
        now = self._loop_now().time()
        if direct:
            # The end of a large message may complete thousands of items at once.
            with gc_paused(direct if nbytes == direct else 0):
                events = session.buffer_updated(nbytes, now)
        else:
            events = session.receive_data(proto.view[:nbytes], now)
        if events:
            self._process(events)
            self._ack_soon()
        if session.has_sendable or session.has_finished:
            self._flush()

    def _fds(self, proto: AioProtocol, fds: builtins.list[int]) -> None:
        conn = self._session.conn
        if proto is self._protocol and conn is not None and conn.shm:
            conn.add_fds(fds)
            return
        for fd in fds:  # an old connection's, or shared memory was not agreed
            _close_fd(fd)

    # -- time -----------------------------------------------------------------------------------
    def _ack_soon(self) -> None:
        """A get's items wait for their acknowledgement: wake up in time to send it."""
        due, t = self._session.ack_due(), self._timer
        if due is not None and (t is None or due < self._timer_at):
            self._reschedule()

    def _reschedule(self) -> None:
        """Keep one timer, at the session's next deadline, acknowledgement or heartbeat (a
        timer that fires early only looks again)."""
        session, loop = self._session, self._loop
        t = self._timer
        if loop is None or session.closed is not None:
            if t is not None:
                t.cancel()
                self._timer = None
            return
        times = (session.next_deadline(), session.ack_due(),
                 session.heartbeat_due(loop.time()) if session.connected else None)
        wake = min((w for w in times if w is not None), default=None)
        if wake is None:
            return
        if t is not None:
            if self._timer_at <= wake + 1e-3:
                return
            t.cancel()
        self._timer = loop.call_at(wake, self._tick)
        self._timer_at = wake

    def _tick(self) -> None:
        self._timer = None
        session = self._session
        events = session.tick(self._loop_now().time())
        if events:
            self._process(events)
        if session.has_sendable:
            self._flush()
        self._reschedule()

    # -- connections ----------------------------------------------------------------------------
    async def connect(self) -> AsyncClient:
        """Connect (retrying within ``timeout`` with ``reconnect`` on) and do the handshake.

        Returns:
            This client.

        Raises:
            ConnectError: no server answered within ``timeout``, or TLS failed.
            AuthenticationError, UnsupportedVersion, LimitExceeded: the server refused.
        """
        if self._runner is None:
            if self._closing:
                raise ConnectError(f"the client for {self.address} was closed")
            loop = self._loop = asyncio.get_running_loop()
            self._ready = loop.create_future()
            self._runner = loop.create_task(self._run(),
                                            name=f"tensorshare-connection-{self.address}")
        assert self._ready is not None
        try:
            async with asyncio.timeout(self.timeout + 5.0):
                return await asyncio.shield(self._ready)
        except BaseException as exc:
            error = self._session.closed
            await self.aclose()
            if isinstance(exc, TimeoutError) and not isinstance(exc, TensorShareError):
                raise ConnectError(f"cannot connect to tensorshare server at {self.address}: "
                                   f"{error or 'no answer'}") from None
            raise

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _run(self) -> None:
        """Connect, serve the connection until it ends, wait, connect again: until the
        client closes or gives up."""
        session, loop = self._session, self._loop_now()
        start = loop.time()
        try:
            while not self._closing and session.closed is None:
                try:
                    proto = await self._open()
                except (Refused, OSError) as exc:
                    if not try_again(self, exc, start):
                        break
                    await self._backoff()
                    continue
                reason = await asyncio.shield(proto.done)
                if self._closing or session.closed is not None:
                    break
                if not dropped(self, session, loop.time() - start, loop.time(), reason, log):
                    break
                await self._backoff()
        except Exception:  # never leave callers waiting
            log.exception("the connection task of the tensorshare client for %s failed",
                          self.address)
            self._end(ConnectionLost(f"the connection task of the client for {self.address} "
                                     f"failed"))
        finally:
            self._fail_ready()

    async def _backoff(self) -> None:
        await asyncio.sleep(self._session.backoff(self._attempt))
        self._attempt += 1

    async def _open(self) -> AioProtocol:
        """One connection attempt, within ``timeout``.

        Raises:
            Refused: TLS failed for good. OSError: the attempt failed (retried).
        """
        loop = self._loop_now()
        async with asyncio.timeout(self.timeout):
            ep = self.endpoint if self.primary_choice is None else \
                await find_primary(self.primary_choice, _tls_context)
            where = ep.address
            if ep.tls:
                try:
                    _, made = await loop.create_connection(
                        lambda: AioProtocol(self), where.host, where.port,
                        ssl=_tls_context(ep), server_hostname=where.host)
                except ssl.SSLError as exc:
                    raise Refused(_tls_error(exc, ep, str(ep))) from None
                return made
            sock = await self._socket(loop, ep)
            proto = AioProtocol(self)
            SocketStream(loop, sock, proto)
            return proto

    async def _socket(self, loop: asyncio.AbstractEventLoop, ep: Endpoint) -> socket.socket:
        """A connected non-blocking socket to ``ep``: the Unix socket's, or the first address
        of the host that answers (TCP_NODELAY on).

        Raises:
            OSError: none answered.
        """
        a = ep.address
        if a.path is not None:
            where: list[tuple[Any, ...]] = [(socket.AF_UNIX, a.path)]
        else:
            infos = await loop.getaddrinfo(a.host, a.port, type=socket.SOCK_STREAM)
            where = [(family, addr) for family, _, _, _, addr in infos]
        error: OSError = OSError(f"no address for {ep}")
        for family, addr in where:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                await loop.sock_connect(sock, addr)
            except OSError as exc:
                sock.close()
                error = exc
                continue
            except BaseException:
                sock.close()
                raise
            if family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        raise error

    def _connect_failed(self, exc: OSError, start: float) -> bool:
        """An attempt failed: whether to try again (see :func:`.facts.connect_failed`)."""
        return connect_failed(self, self._session, exc, start, self._loop_now().time(), log)

    def _connection_made(self, proto: AioProtocol) -> None:
        if self._closing or self._session.closed is not None:
            proto.abort()
            return
        self._protocol = proto
        proto.write(self._session.connection_made(self._loop_now().time()))
        self._reschedule()

    def _connection_lost(self, proto: AioProtocol, why: str) -> None:
        if proto is not self._protocol:
            return
        self._protocol = None
        why = self._drop_reason or why
        self._drop_reason = None
        self._process(self._session.connection_lost(why, self._loop_now().time()))
        if self._session.closed is not None:
            self._end_inboxes()
        self._reschedule()

    def _end(self, error: TensorShareError) -> None:
        """Close the session with ``error``: every waiting call gets it."""
        self._process(self._session.close(error))
        self._fail_ready()
        self._end_inboxes()

    def _fail_ready(self) -> None:
        ready = self._ready
        if ready is None or ready.done():
            return
        error = self._session.closed
        if not isinstance(error, (ConnectError, ServerError)):  # a typed refusal keeps its type
            error = ConnectError(f"cannot connect to tensorshare server at {self.address}: "
                                 f"{error or 'no answer'}")
        ready.set_exception(error)
        ready.exception()  # (retrieved: connect() may be gone already)

    def _end_inboxes(self) -> None:
        closed = self._session.closed
        error = None if self._closing else closed
        for inbox in list(self._inboxes):
            inbox.end(error)

    async def aclose(self) -> None:
        """End the session on the server (``bye``: within a second) and close the
        connection; calls still pending fail with ``ConnectionLost``. Idempotent."""
        if self._closing:
            await self._closed()
            return
        self._closing = True
        loop = self._loop
        if loop is None:
            self._session.close(ConnectionLost(f"client for {self.address} was closed"))
            return
        bye = self._session.goodbye(loop.time())
        said: asyncio.Future[Any] | None = None
        if bye is not None:
            said = bye.token = loop.create_future()
            self._flush()
        closing = ConnectionLost(f"client for {self.address} was closed")
        self._process(self._session.close(closing, keep=bye))
        self._end_inboxes()
        if said is not None and bye is not None and self._protocol is not None:
            await asyncio.wait([said], timeout=bye.timeout)
        self._process(self._session.close(closing))
        self._fail_ready()
        await self._closed()

    #: ``await client.close()`` is :meth:`aclose`.
    close = aclose

    async def _closed(self) -> None:
        """Stop the timer and the connection task; close the connection, waiting for what
        it still writes at most ``timeout``."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        runner = self._runner
        if runner is not None and not runner.done():
            runner.cancel()
            await asyncio.wait([runner], timeout=self.timeout)
        proto = self._protocol
        if proto is None or proto.lost or proto.transport is None:
            return
        proto.transport.close()
        await asyncio.wait([proto.done], timeout=self.timeout)
        if not proto.lost:  # a server that stops reading must not keep close() waiting
            proto.abort()
            await asyncio.wait([proto.done], timeout=1.0)


def _close_fd(fd: int) -> None:
    import os

    try:
        os.close(fd)
    except OSError:
        pass


def _tls_context(endpoint: Endpoint) -> ssl.SSLContext:
    """The server's certificate checked against ``tls_ca`` (or the system's CAs)."""
    return ssl.create_default_context(cafile=endpoint.tls_ca)


def _tls_error(exc: ssl.SSLError, endpoint: Endpoint, address: str) -> ConnectError:
    if isinstance(exc, ssl.SSLCertVerificationError):
        ca = endpoint.tls_ca or "the system's"
        return ConnectError(
            f"TLS with tensorshare server at {address} failed: its certificate does not check "
            f"out ({exc.verify_message}; CA: {ca}): give the CA that signed it with tls_ca= "
            f"or TENSORSHARE_TLS_CA, and connect by a name the certificate holds")
    return ConnectError(f"TLS with tensorshare server at {address} failed ({exc.reason or exc})"
                        f": is the server started with --tls-cert? (a plain server: connect "
                        f"with tensorshare://)")
