"""The Twisted client: the same requests as :class:`tensorshare.Client`, returning Deferreds.

For programs that already run a Twisted reactor. The reactor is always passed in (this module
never imports the global one), every result is a :class:`~twisted.internet.defer.Deferred`,
and everything, including decoding received tensors and calling listen callbacks, happens in
the reactor thread. It is a thin shell over the same sans-I/O
:class:`~tensorshare.session.ClientSession` as the blocking client, so the two behave alike:
the same errors (:class:`~tensorshare.errors.BinNotFound`,
:class:`~tensorshare.errors.WaitTimeout`, :class:`~tensorshare.errors.ReplyTimeout`,
:class:`~tensorshare.errors.ConnectionLost`, ...), the same timeouts, the same automatic
reconnect with exactly-once replay.

Usage::

    import torch
    from twisted.internet import reactor, defer
    from tensorshare.txclient import connect

    @defer.inlineCallbacks
    def main():
        client = yield connect(reactor, "127.0.0.1", 8000)
        version = yield client.put("weights", {"w": torch.zeros(3)})
        value = yield client.peek("weights")
        yield client.close()

Local mistakes (a bad bin name, a tag that is not an int, a value holding an unsupported type,
a negative wait) raise synchronously from the method, before anything is sent, as they do in
the blocking client. Everything that involves the server or the connection is reported through
the returned Deferred. Cancelling a returned Deferred abandons the request (a waiting get/peek
is cancelled on the server, and the items of a get that already ran go back to their bin).
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable, Iterable
from typing import Any, Unpack
from typing import Protocol as _Protocol

from twisted.internet.defer import Deferred, fail, gatherResults, succeed
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IDelayedCall, IFileDescriptorReceiver, IUNIXTransport
from twisted.internet.protocol import ClientFactory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from ..errors import ConnectError, ConnectionLost, TensorShareError, error_from_code
from ..wire.frames import BytesLike
from ..wire.messages import ErrorReply
from .endpoint import Endpoint
from .facts import SessionEvents, SessionFacts
from .failover import PROBE_ERRORS, PrimaryChoice, Probe, located
from .ops import (
    NOWAIT,
    Command,
    FetchResult,
    Ops,
)
from .options import AllOptionFields, ClientOptions
from .pipeline import Pipeline
from .session import Call, ClientSession, Done, Notify, Ready

__all__ = ["NOWAIT", "FetchResult", "TxClient", "TxProtocol", "connect"]

log = Logger(namespace="tensorshare.txclient")

Listener = Callable[[dict[str, Any]], Any]


class _Transport(_Protocol):
    """What a :class:`TxProtocol` uses of its transport (TCP, TLS, Unix and the tests'
    in-memory ones all have these)."""

    def write(self, data: bytes) -> None: ...

    def loseConnection(self) -> None: ...

    def abortConnection(self) -> None: ...


@implementer(IFileDescriptorReceiver)
class TxProtocol(Protocol):
    """One connection of a :class:`TxClient`: hands bytes, passed descriptors and events to
    it, nothing more."""

    transport: _Transport | None  # type: ignore[assignment]  # narrower than ITransport

    def __init__(self, client: TxClient) -> None:
        self.client = client
        self.lost = False

    def connectionMade(self) -> None:
        self.client._connection_made(self)

    def fileDescriptorReceived(self, descriptor: int) -> None:
        """A memfd the server passed (a Unix socket): comes before the data it came with."""
        self.client._fd(self, descriptor)

    def dataReceived(self, data: bytes) -> None:
        self.client._data(self, data)

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.lost = True
        self.client._connection_lost(self, reason or Failure(ConnectionDone()))


class _Factory(ClientFactory):
    """Connects one :class:`TxProtocol` at a time for its client."""

    noisy = False

    def __init__(self, client: TxClient) -> None:
        self.client = client

    def buildProtocol(self, addr: Any) -> TxProtocol:
        return TxProtocol(self.client)

    def clientConnectionFailed(self, connector: Any, reason: Failure) -> None:
        self.client._connect_failed(reason.getErrorMessage())


class TxClient(SessionFacts, SessionEvents, Ops):
    """A connection to a tensorshare server, for code running in a Twisted reactor.

    Made by :func:`connect`. Mirrors :class:`tensorshare.Client`: the same methods, arguments
    and errors, but each returns a Deferred. It survives connection loss the same way (see
    ``reconnect``). Like everything Twisted it is not thread-safe: call it from the reactor
    thread (other threads use ``reactor.callFromThread`` or
    ``twisted.internet.threads.blockingCallFromThread``).

    Args:
        reactor: provides ``connectTCP``/``connectSSL``/``connectUNIX`` and ``callLater``.
        host, port: the server's address (``host`` may be a ``tensorshare://``,
            ``tensorshare+tls://`` or ``unix://`` URL; neither: ``TENSORSHARE_URL``), as for
            :class:`tensorshare.Client`; an address list (``["a:7000", "b:7000"]``, or
            ``"tensorshare://a:7000,b:7000"``): a primary and its replicas, each connection
            to the one that says it is the primary (:func:`find_primary`), so the client
            follows a promotion.
        options: a :class:`~.options.ClientOptions` (``timeout``, ``reconnect``,
            ``compress``, ``name``, ``shm``, ``tls``, ``token``, ...), as for
            :class:`tensorshare.Client` (over a ``unix://`` address, tensors of at least
            ``shm_min_bytes`` travel through shared memory both ways); the default name is
            ``"tensorshare-twisted"``.
        **overrides: any field of :class:`~.options.ClientOptions` as a keyword: overrides
            that field of ``options``.
        connector: ``connector(client)`` starts a connection attempt instead of
            ``reactor.connectTCP`` (tests attach in-memory transports this way).

    Attributes:
        ready: fires with this client once the first handshake completed, or errbacks with
            :class:`~tensorshare.errors.ConnectError` (no server in time) or the server's
            typed refusal (:class:`~tensorshare.errors.AuthenticationError`, ...).
    """

    def __init__(self, reactor: Any, host: str | list[str] | None = None,
                 port: int | None = None, *, options: ClientOptions | None = None,
                 connector: Callable[[TxClient], Any] | None = None,
                 **overrides: Unpack[AllOptionFields]) -> None:
        opts = self.options = ClientOptions.of(options, **overrides)
        self.reactor = reactor
        #: An address list's servers (``None``: one server): each connection goes to the
        #: one that says it is the primary (README: Replication and failover).
        self.primary_choice: PrimaryChoice | None
        (self.endpoint, self.primary_choice, self.host, self.port, self.path,
         self.address) = located(host, port, opts)
        self.timeout, self.reconnect = opts.timeout, opts.reconnect
        self.compress, self.compress_min_bytes = opts.compress, opts.compress_min_bytes
        self.session = opts.new_session(self.endpoint, "tensorshare-twisted", connector is None)
        self.shm_min_bytes = opts.shm_min_bytes
        self.protocol: TxProtocol | None = None
        self.ready: Deferred[TxClient] = Deferred(lambda d: self._cancel_connect())
        self._connector = connector
        self._connecting: Any = None  # the IConnector of an attempt in progress
        self._timer: IDelayedCall | None = None  # the next tick
        self._retry: IDelayedCall | None = None  # the next connection attempt
        self._attempt = 0
        self._started = reactor.seconds()
        self._lost_at: float | None = None
        self._closing = False
        self._close_waiters: list[Deferred[None]] = []
        self._close_timer: IDelayedCall | None = None
        self._start_timer: IDelayedCall | None = None
        self._drop_reason: str | None = None

    # -- what the server said ---------------------------------------------------------------
    # (limits, server_version, protocol_version, server_id, connected, closed and
    # shared_memory: SessionFacts)
    def _client_session(self) -> ClientSession:
        return self.session


    # -- the op surface (see .ops) ----------------------------------------------------------
    def _execute(self, cmd: Command) -> Deferred[Any]:
        """Send ``cmd``; the Deferred fires with its result (or its error)."""
        if cmd.kind != "call":
            name = cmd.bin
            assert name is not None
            if cmd.kind == "listen":
                if not self.session.add_listener(name, cmd.listener[0]):
                    return succeed(None)
                return self._request(cmd, cmd.listener[0])
            if not self.session.remove_listener(name):
                return succeed(False)
        return self._request(cmd)

    def pipeline(self, *, raise_on_error: bool = True) -> Pipeline:
        """Queue many requests and send them together (see ``Client.pipeline``); its
        ``execute()`` returns a Deferred that fires with the results."""
        return Pipeline(self, raise_on_error)

    def _run_pipeline(self, pipeline: Pipeline, batch: Iterable[tuple[Command, int]]
                      ) -> Deferred[builtins.list[Any]]:
        batch = list(batch)
        deferreds = [self._request(cmd).addErrback(_outcome) for cmd, _ in batch]
        counts = [n for _, n in batch]
        return gatherResults(deferreds).addCallback(pipeline.finish, counts)

    def close(self) -> Deferred[None]:
        """End the session on the server (``bye``: within a second) and close the connection;
        requests still pending then errback with ConnectionLost.

        Returns a Deferred that fires once the connection is gone. Idempotent.
        """
        if self._closing:
            return self._close_now()
        self._closing = True
        call = self.session.goodbye(self.reactor.seconds())
        bye: Deferred[Any] = Deferred()
        if call is not None:
            call.token = bye
            self._flush()
        self._process(self.session.close(ConnectionLost(f"client for {self.address} was closed"),
                                         keep=call))
        if call is None or self.protocol is None:
            return self._close_now()
        # The session is closed now, so no tick will expire the bye: wait for it ourselves.
        def no_answer() -> None:
            if not bye.called:
                bye.callback(None)

        give_up = self.reactor.callLater(call.timeout, no_answer)

        def done(_: Any) -> Deferred[None]:
            if give_up.active():
                give_up.cancel()
            return self._close_now()

        return bye.addBoth(done)

    def _close_now(self) -> Deferred[None]:
        self._process(self.session.close(ConnectionLost(f"client for {self.address} was closed")))
        for t in (self._timer, self._retry):
            if t is not None and t.active():
                t.cancel()
        self._timer = self._retry = None
        self._stop_connecting()
        if not self.ready.called:
            self.ready.errback(ConnectError(f"client for {self.address} was closed"))
        proto = self.protocol
        if proto is None or proto.lost or proto.transport is None:
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._close_waiters.append(d)
        if self._close_timer is None:
            proto.transport.loseConnection()
            # loseConnection waits for buffered writes; a server that stops reading must not
            # keep close() from finishing.
            self._close_timer = self.reactor.callLater(self.timeout, self._abort, proto)
        return d

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("connected" if self.connected else "reconnecting")
        return f"<tensorshare.TxClient {self.address} {state}>"

    # -- requests ---------------------------------------------------------------------------
    def _request(self, cmd: Command, extra: Any = None) -> Deferred[Any]:
        """Add one request to the session; fire with ``cmd.convert(reply)``."""
        holder: builtins.list[Call] = []
        d: Deferred[Any] = Deferred(lambda _: self._abandon(holder[0]))
        try:
            call = self.session.call(cmd.request, cmd.what, self.reactor.seconds(), token=d,
                                     convert=cmd.convert, extra=extra)
        except TensorShareError as exc:
            return fail(exc)
        holder.append(call)
        self._flush()
        self._reschedule()
        return d

    def _abandon(self, call: Call) -> None:
        """Canceller of a request's Deferred: stop waiting for its reply."""
        call.token = None
        self.session.abandon(call, self.reactor.seconds())
        self._flush()

    def _flush(self) -> None:
        proto = self.protocol
        if proto is None or proto.lost or proto.transport is None:
            return
        chunks = self.session.pop_sendable(self.reactor.seconds())
        shared = self.session.take_shared() if self.session.has_shared else None
        self._process(self.session.take_finished())
        if shared:
            # Each descriptor goes with one byte of what is written next (Twisted's unix
            # transport), so all reach the server before the frames' last bytes. The memfds
            # stay open: the calls that carry them hold them until their replies.
            unix = IUNIXTransport(proto.transport)
            for mem in shared:
                unix.sendFileDescriptor(mem.fd)
        if chunks:
            _write(proto, chunks)

    # (_process: SessionEvents, which hands each event to the handlers below)
    def _send(self, chunks: Any) -> None:
        if self.protocol is not None and not self.protocol.lost:
            _write(self.protocol, chunks)

    @staticmethod
    def _finish(ev: Done) -> None:
        d: Deferred[Any] | None = ev.call.token
        if d is None or d.called:
            return
        if ev.error is not None:
            d.errback(ev.error)
            return
        reply = ev.reply
        if type(reply) is ErrorReply:
            d.errback(error_from_code(reply.code, reply.message))
            return
        convert = ev.call.convert
        try:
            result = convert(reply) if convert is not None else reply
        except TensorShareError as exc:  # e.g. a malformed value from a peer
            d.errback(exc)
            return
        d.callback(result)

    def _notify(self, ev: Notify) -> None:
        for cb in ev.callbacks:
            try:
                result = cb(dict(ev.event))
            except Exception:
                log.failure("listen callback for bin {bin!r} raised", bin=ev.bin)
                continue
            if isinstance(result, Deferred):  # an async callback: log its failure too
                result.addErrback(self._log_callback_failure, ev.bin)

    @staticmethod
    def _log_callback_failure(failure: Failure, name: str) -> None:
        log.failure("listen callback for bin {bin!r} failed", failure, bin=name)

    # -- time -------------------------------------------------------------------------------
    def _reschedule(self) -> None:
        """Keep one timer, at the session's next deadline, heartbeat or acknowledgement."""
        now = self.reactor.seconds()
        times = [self.session.next_deadline(), self.session.ack_due()]
        if self.session.connected:
            times.append(self.session.heartbeat_due(now))
        wake = min((t for t in times if t is not None), default=None)
        t = self._timer
        if wake is None or self.session.closed is not None:
            if t is not None and t.active():
                t.cancel()
            self._timer = None
            return
        delay = max(wake - now, 0.0)
        if t is not None and t.active():
            if abs(t.getTime() - (now + delay)) > 1e-6:
                t.reset(delay)
            return
        self._timer = self.reactor.callLater(delay, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._process(self.session.tick(self.reactor.seconds()))
        self._flush()
        self._reschedule()

    # -- connections ------------------------------------------------------------------------
    def start(self) -> Deferred[TxClient]:
        """Start connecting; returns :attr:`ready`."""
        self._start_timer = self.reactor.callLater(self.timeout, self._start_overdue)
        self.ready.addBoth(self._started_ok)
        self._connect()
        return self.ready

    def _started_ok(self, result: Any) -> Any:
        t, self._start_timer = self._start_timer, None
        if t is not None and t.active():
            t.cancel()
        return result

    def _start_overdue(self) -> None:
        self._start_timer = None
        if self.ready.called:
            return
        self._stop_connecting()
        error = ConnectError(f"cannot connect to tensorshare server at {self.address}: no "
                             f"connection within {self.timeout:g} s")
        self._fail_start(error)
        proto = self.protocol
        if proto is not None and proto.transport is not None and not proto.lost:
            proto.transport.abortConnection()

    def _connect(self) -> None:
        self._retry = None
        if self._closing or self.session.closed is not None:
            return
        if self._connector is not None:
            self._connecting = self._connector(self)
            return
        if self.primary_choice is None:
            self._dial(self.endpoint)
            return
        finding = self._connecting = _Finding(find_primary(self.reactor, self.primary_choice))
        finding.d.addCallbacks(self._found, self._not_found, callbackArgs=(finding,),
                               errbackArgs=(finding,))

    def _found(self, ep: Endpoint, finding: _Finding) -> None:
        """The address list's primary is ``ep``: connect to it (unless given up since)."""
        if self._connecting is not finding:
            return  # (stopped: the client closed, or its start is overdue)
        self._connecting = None
        if not self._closing and self.session.closed is None:
            self._dial(ep)

    def _not_found(self, failure: Failure, finding: _Finding) -> None:
        """No primary in the address list (yet): like a refused connection."""
        if self._connecting is finding:
            self._connect_failed(failure.getErrorMessage())

    def _dial(self, ep: Endpoint) -> None:
        try:
            self._connecting = dial(self.reactor, ep, _Factory(self), self.timeout)
        except Exception as exc:  # e.g. a malformed address refused synchronously
            self._connect_failed(str(exc))

    def _connect_failed(self, reason: str) -> None:
        self._connecting = None
        if self._closing:
            return
        now = self.reactor.seconds()
        if self.session.server is None:
            if not self.reconnect or now - self._started >= self.timeout:
                self._fail_start(ConnectError(
                    f"cannot connect to tensorshare server at {self.address}: {reason}"))
                return
        elif self.session.give_up_due(now):
            self._give_up(now)
            return
        self.session.last_loss = f"cannot connect: {reason}"
        self._retry_later()

    def _retry_later(self) -> None:
        delay = self.session.backoff(self._attempt)
        self._attempt += 1
        self._retry = self.reactor.callLater(delay, self._connect)
        self._reschedule()

    def _fail_start(self, error: TensorShareError) -> None:
        self._process(self.session.close(error))
        if not self.ready.called:
            self.ready.errback(error)

    def _give_up(self, now: float) -> None:
        since = self.session.disconnected_since or now
        self._process(self.session.close(ConnectionLost(
            f"the tensorshare server at {self.address} has been unreachable for "
            f"{now - since:.1f} s ({self.session.last_loss}); gave up (reconnect="
            f"{self.reconnect:g})")))
        log.warn("gave up reconnecting to tensorshare server at {address}",
                 address=self.address)

    def make_protocol(self) -> TxProtocol:
        """A protocol for a new connection of this client (for custom transports)."""
        return TxProtocol(self)

    def _connection_made(self, proto: TxProtocol) -> None:
        self._connecting = None
        if self._closing or self.session.closed is not None:
            proto.transport.loseConnection()  # type: ignore[union-attr]  # it was just made
            return
        self.protocol = proto
        _write(proto, self.session.connection_made(self.reactor.seconds()))
        self._reschedule()

    def _fd(self, proto: TxProtocol, fd: int) -> None:
        conn = self.session.conn
        if proto is self.protocol and conn is not None and conn.shm:
            conn.add_fds([fd])
        else:  # an old connection's, or shared memory was not agreed: nobody will take it
            os.close(fd)

    def _data(self, proto: TxProtocol, data: bytes) -> None:
        if proto is not self.protocol or self.session.conn is None:
            return  # an old connection's last bytes, or we are closing
        self._process(self.session.receive_data(data, self.reactor.seconds()))
        self._flush()
        self._reschedule()

    def _connection_lost(self, proto: TxProtocol, reason: Failure) -> None:
        if self._close_timer is not None and self._close_timer.active():
            self._close_timer.cancel()
        self._close_timer = None
        waiters, self._close_waiters = self._close_waiters, []
        if proto is self.protocol:
            self.protocol = None
            why = self._drop_reason or ("the server closed the connection"
                                        if reason.check(ConnectionDone)
                                        else reason.getErrorMessage())
            self._drop_reason = None
            refused = self._tls_refused(reason)
            if refused is not None:  # retrying would not help: fail at once
                self._process(self.session.close(refused))
            self._process(self.session.connection_lost(why, self.reactor.seconds()))
            if not self._closing and self.session.closed is None:
                if self._lost_at is None:
                    self._lost_at = self.reactor.seconds()
                    log.warn("lost connection to tensorshare server at {address} ({why}); "
                             "reconnecting", address=self.address, why=why)
                self._retry_later()
            elif self.session.server is None and not self.ready.called:
                error = self.session.closed  # a typed refusal keeps its type
                self.ready.errback(error if error is not None else ConnectError(
                    f"handshake with {self.address} failed"))
        for d in waiters:
            d.callback(None)

    def _tls_refused(self, reason: Failure) -> ConnectError | None:
        """The TLS handshake failed (a certificate that does not check out, a server that
        does not speak TLS): the error to fail with, or ``None`` for an ordinary loss."""
        if not self.endpoint.tls or self.session.connected or self.session.closed:
            return None
        from OpenSSL.SSL import Error as TLSError

        if not reason.check(TLSError):
            return None
        text = reason.getErrorMessage()
        if "certificate verify failed" in text:
            ca = self.endpoint.tls_ca or "the system's"
            return ConnectError(
                f"TLS with tensorshare server at {self.address} failed: its certificate does "
                f"not check out ({text}; CA: {ca}): give the CA that signed it with tls_ca= "
                f"or TENSORSHARE_TLS_CA, and connect by a name the certificate holds")
        return ConnectError(f"TLS with tensorshare server at {self.address} failed ({text}): "
                            f"is the server started with --tls-cert? (a plain server: "
                            f"connect with tensorshare://)")

    def _on_ready(self, ev: Ready) -> None:
        self._attempt = 0
        if ev.first:
            if not self.ready.called:
                self.ready.callback(self)
        else:
            away = self.reactor.seconds() - self._lost_at if self._lost_at is not None else 0.0
            self._lost_at = None
            how = "session resumed" if ev.resumed else "new session: the server did not know ours"
            log.warn("reconnected to tensorshare server at {address} after {away:.1f} s "
                     "({how})", address=self.address, away=away, how=how)

    def _drop(self, reason: str) -> None:
        """The stream is unusable (or silent): abort the connection; we reconnect."""
        proto = self.protocol
        log.warn("dropping connection to tensorshare server at {address}: {reason}",
                 address=self.address, reason=reason)
        if proto is not None and proto.transport is not None and not proto.lost:
            self._drop_reason = reason
            proto.transport.abortConnection()
        if self.session.server is None and self.session.closed is not None \
                and not self.ready.called:
            self._fail_start(self.session.closed)

    def _cancel_connect(self) -> None:
        """Canceller of :attr:`ready`: give up on the connection."""
        self.close()

    def _stop_connecting(self) -> None:
        c = self._connecting
        self._connecting = None
        if c is not None:
            try:
                c.stopConnecting()
            except Exception:  # not connecting any more (twisted's NotConnectingError)
                pass

    def _abort(self, proto: TxProtocol) -> None:
        self._close_timer = None
        if not proto.lost and proto.transport is not None:
            proto.transport.abortConnection()


def _outcome(failure: Failure) -> Any:
    """A pipelined request's error, as a result (the pipeline reports it in order)."""
    if failure.check(TensorShareError):
        return failure.value
    return failure


def _tls_options(endpoint: Endpoint) -> Any:
    """The TLS client options: the server's certificate checked against ``tls_ca`` (or the
    platform's CAs), and its host name (service_identity)."""
    from twisted.internet import ssl

    if endpoint.tls_ca is not None:
        with open(endpoint.tls_ca, "rb") as f:
            trust: Any = ssl.Certificate.loadPEM(f.read())
    else:
        trust = ssl.platformTrust()
    return ssl.optionsForClientTLS(endpoint.address.host, trustRoot=trust)


def dial(reactor: Any, ep: Endpoint, factory: Any, timeout: float) -> Any:
    """Connect ``factory`` to ``ep`` (TCP, TLS or a Unix socket); the ``IConnector``."""
    where = ep.address
    if where.path is not None:
        return reactor.connectUNIX(where.path, factory, timeout=timeout)
    if ep.tls:
        from twisted.protocols.tls import TLSMemoryBIOFactory

        # (Not reactor.connectSSL: its TLS layer flushes on the global reactor.)
        factory = TLSMemoryBIOFactory(_tls_options(ep), True, factory, clock=reactor)
    return reactor.connectTCP(where.host, where.port, factory, timeout=timeout)


class _Finding:
    """A client's connection attempt while it asks an address list for its primary."""

    def __init__(self, d: Deferred[Endpoint]) -> None:
        self.d = d

    def stopConnecting(self) -> None:  # noqa: N802 (IConnector's name)
        self.d.cancel()


def find_primary(reactor: Any, choice: PrimaryChoice) -> Deferred[Endpoint]:
    """Ask every server of ``choice`` its role and term, at once (the blocking client's
    :class:`~.failover.Probe` over the reactor's connections); fence a former primary
    that has not heard of the newer term (best effort); fire with the primary's endpoint.
    Errbacks with ``ConnectionRefusedError`` while none says it is the primary."""
    probes = [(ep, choice.role_probe(ep)) for ep in choice.endpoints]
    asked = [_exchange(reactor, probe, choice.probe_timeout).addCallbacks(
        lambda p, ep=ep: choice.heard(ep, p), lambda f, ep=ep: choice.failed(ep, f.value))
        for ep, probe in probes]

    def chosen(_: Any) -> Deferred[Endpoint]:
        primary, stale = choice.choose()
        fenced = [_exchange(reactor, choice.fence_probe(ep, term), choice.probe_timeout)
                  .addErrback(lambda f: None) for ep, term in stale]
        return gatherResults(fenced).addCallback(lambda _: primary)

    return gatherResults(asked).addCallback(chosen)


def _exchange(reactor: Any, probe: Probe, timeout: float) -> Deferred[Probe]:
    """Run ``probe`` over a connection of its own, within ``timeout``."""
    done: Deferred[Probe] = Deferred()
    factory = _ProbeFactory(probe, done)
    try:
        connector = dial(reactor, probe.ep, factory, timeout)
    except Exception as exc:  # e.g. a malformed address refused synchronously
        return fail(exc)
    timer = reactor.callLater(timeout, factory.expire, connector)

    def stop_timer(result: Any) -> Any:
        if timer.active():
            timer.cancel()
        return result

    return done.addBoth(stop_timer)


class _ProbeProtocol(Protocol):
    def __init__(self, factory: _ProbeFactory) -> None:
        self.factory = factory

    def connectionMade(self) -> None:  # noqa: N802 (Twisted's name)
        self.factory.protocol_ = self
        t: Any = self.transport
        t.write(self.factory.probe.start())

    def dataReceived(self, data: bytes) -> None:  # noqa: N802 (Twisted's name)
        probe = self.factory.probe
        try:
            out = probe.feed(data)
        except PROBE_ERRORS as exc:
            self.factory.finish(Failure(exc))
            return
        if out:
            t: Any = self.transport
            t.write(out)
        if probe.done:
            self.factory.finish(probe)

    def connectionLost(self, reason: Failure | None = None) -> None:  # noqa: N802
        self.factory.protocol_ = None
        self.factory.finish(Failure(ConnectionResetError("the server closed the connection")))


class _ProbeFactory(ClientFactory):
    """One probe's connection: fires ``done`` with the probe once its reply is in (or with
    why not), then closes."""

    noisy = False

    def __init__(self, probe: Probe, done: Deferred[Probe]) -> None:
        self.probe, self.done = probe, done
        self.protocol_: _ProbeProtocol | None = None

    def buildProtocol(self, addr: Any) -> _ProbeProtocol:  # noqa: N802 (Twisted's name)
        return _ProbeProtocol(self)

    def clientConnectionFailed(self, connector: Any, reason: Failure) -> None:  # noqa: N802
        self.finish(reason)

    def expire(self, connector: Any) -> None:
        self.finish(Failure(TimeoutError("no answer to the probe in time")))
        try:
            connector.stopConnecting()
        except Exception:  # connected already (twisted's NotConnectingError)
            pass

    def finish(self, result: Probe | Failure) -> None:
        if not self.done.called:
            self.done.callback(result) if not isinstance(result, Failure) else \
                self.done.errback(result)
        proto = self.protocol_
        t: Any = None if proto is None else proto.transport
        if t is not None:
            t.abortConnection()


def _write(proto: TxProtocol, chunks: list[BytesLike]) -> None:
    # The stock Twisted transports only accept bytes, so the frame (header and every tensor
    # buffer) is joined into one bytes object here: one copy of the data. The server avoids
    # this copy with tensorshare._fasttcp (sendmsg of the buffers themselves).
    proto.transport.write(b"".join(chunks))  # type: ignore[union-attr]  # only when connected


def connect(reactor: Any, host: str | list[str] | None = None, port: int | None = None, *,
            options: ClientOptions | None = None,
            **overrides: Unpack[AllOptionFields]) -> Deferred[TxClient]:
    """Connect to a tensorshare server and do the handshake; fire with a :class:`TxClient`.

    Args:
        reactor: the reactor to use (``reactor.connectTCP`` and ``reactor.callLater``).
        host, port: the server's address, or an address list (see :class:`TxClient`).
        options: a :class:`~.options.ClientOptions`: ``timeout`` is how long the first
            connection may take (with ``reconnect`` on, attempts are repeated until then),
            and the server has to answer each request; the others are as for
            :class:`tensorshare.Client` (``compress``, ``name``, ``session``,
            ``heartbeat``, ``tls``, ``token``, ``shm``, ...).
        **overrides: any field of :class:`~.options.ClientOptions` as a keyword: overrides
            that field of ``options``.

    Errbacks with :class:`~tensorshare.errors.ConnectError` (naming ``host:port``) when no
    server answered within ``timeout``, or with the server's typed refusal of the handshake
    (:class:`~tensorshare.errors.AuthenticationError`, ...). Cancelling the Deferred gives up
    on the connection.

    Raises:
        ValueError: a bad ``compress``, ``timeout`` or ``reconnect`` (synchronously).
    """
    return TxClient(reactor, host, port, options=ClientOptions.of(options, **overrides)).start()
