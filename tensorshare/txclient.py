"""The Twisted client: the same requests as :class:`tensorshare.Client`, returning Deferreds.

For programs that already run a Twisted reactor. The reactor is always passed in (this module
never imports the global one), every result is a :class:`~twisted.internet.defer.Deferred`,
and everything, including decoding received tensors and calling listen callbacks, happens in
the reactor thread. The protocol logic is the sans-I/O :class:`~tensorshare.protocol.Connection`
shared with the server and the blocking client, so errors carry the same exception types
(:class:`~tensorshare.errors.BinNotFound`, :class:`~tensorshare.errors.Timeout`,
:class:`~tensorshare.errors.MemoryLimitExceeded`, ...).

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
the returned Deferred: :class:`~tensorshare.errors.ServerError` subclasses,
:class:`~tensorshare.errors.Timeout` and :class:`~tensorshare.errors.ConnectionLost`.
Cancelling a returned Deferred abandons the request (a waiting get/peek is cancelled on the
server too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import ConnectionDone
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import ClientFactory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from .client import NOWAIT, FetchResult, _event, _fetch_request, _make_item
from .errors import (
    ConnectError,
    ConnectionLost,
    ProtocolError,
    TensorShareError,
    Timeout,
    TransportError,
    error_from_code,
)
from .frames import BytesLike
from .messages import (
    Append,
    Cancel,
    Changed,
    Delete,
    ErrorReply,
    Fetched,
    Hello,
    HelloReply,
    Item,
    Limits,
    ListBins,
    Listen,
    Message,
    Ping,
    Put,
    Unlisten,
)
from .protocol import CLIENT, PROTOCOL_VERSIONS, Connection, ProtocolViolation, check_bin_name

__all__ = ["NOWAIT", "FetchResult", "TxClient", "TxProtocol", "connect"]

log = Logger(namespace="tensorshare.txclient")

Listener = Callable[[dict[str, Any]], Any]


def _same(reply: Any) -> Any:
    return reply


def _none(reply: Any) -> None:
    return None


def _version(reply: Any) -> int:
    return int(reply.version)


class _Pending:
    """One request awaiting its reply."""

    __slots__ = ("deferred", "what", "convert", "timer", "cancel_on_timeout")

    def __init__(self, deferred: Deferred[Any], what: str, convert: Callable[[Any], Any],
                 cancel_on_timeout: bool) -> None:
        self.deferred = deferred
        self.what = what  # e.g. "get on bin 'x'", for error messages
        self.convert = convert
        self.timer: IDelayedCall | None = None
        self.cancel_on_timeout = cancel_on_timeout

    def stop_timer(self) -> None:
        if self.timer is not None and self.timer.active():
            self.timer.cancel()
        self.timer = None


class TxProtocol(Protocol):
    """One client connection: frames in and out, request ids, reply timers, listen dispatch.

    On ``connectionMade`` it sends the hello handshake; :attr:`ready` fires with a
    :class:`TxClient` once the server answered (or errbacks with
    :class:`~tensorshare.errors.ConnectError`). :func:`connect` builds one for you; build it
    yourself to run over any transport (tests connect it to in-memory transports).

    Args:
        reactor: provides ``callLater`` for the reply timers.
        host, port: the server's address, used in error messages.
        timeout: seconds to wait for the server to answer a request (and the handshake).
        compress, compress_min_bytes, name: as for :class:`tensorshare.Client`.
    """

    def __init__(self, reactor: Any, host: str = "127.0.0.1", port: int = 8000, *,
                 timeout: float = 30.0, compress: str | None = None,
                 compress_min_bytes: int = 64 * 1024,
                 name: str = "tensorshare-twisted") -> None:
        if compress not in (None, "lz4"):
            raise ValueError(f"compress must be None or 'lz4', not {compress!r}")
        self.reactor = reactor
        self.host, self.port, self.timeout = host, port, timeout
        self.address = f"{host}:{port}"
        self.compress, self.compress_min_bytes = compress, compress_min_bytes
        self.client_name = name
        self.conn = Connection(CLIENT)
        self.ready: Deferred[TxClient] = Deferred()
        self.client: TxClient | None = None
        self._pending: dict[int, _Pending] = {}
        self._listeners: dict[str, list[Listener]] = {}
        self._lost: TransportError | None = None  # set once no request may be sent any more
        self._disconnected = False  # connectionLost has run
        self._closing = False
        self._server_said: str | None = None
        self._close_waiters: list[Deferred[None]] = []
        self._close_timer: IDelayedCall | None = None

    # -- Twisted hooks ----------------------------------------------------------------------
    def connectionMade(self) -> None:
        d = self.request(lambda rid: Hello(rid, PROTOCOL_VERSIONS, self.client_name),
                         "handshake", _same)
        d.addCallbacks(self._handshake_done, self._handshake_failed)

    def dataReceived(self, data: bytes) -> None:
        if self._lost is not None:
            return  # closed by us, or the stream is already known to be broken
        for msg in self.conn.receive_data(data):
            if self._lost is not None:
                return  # a callback closed the client: the rest is not for anyone
            if type(msg) is ProtocolViolation:
                self._drop(f"protocol error: {msg.message}")
                return
            self._on_message(msg)  # type: ignore[arg-type]

    def connectionLost(self, reason: Failure | None = None) -> None:  # type: ignore[override]
        if reason is None:
            reason = Failure(ConnectionDone())
        self._disconnected = True
        if self._close_timer is not None and self._close_timer.active():
            self._close_timer.cancel()
        self._close_timer = None
        if self._lost is None:
            if reason.check(ConnectionDone):
                why = "the server closed the connection"
            else:
                why = reason.getErrorMessage()
            if self._server_said:
                why = f"{why}; the server said: {self._server_said}"
            log.warn("connection to tensorshare server at {address} lost: {why}",
                     address=self.address, why=why)
            self._fail_all(ConnectionLost(
                f"connection to tensorshare server at {self.address} lost: {why}"))
        waiters, self._close_waiters = self._close_waiters, []
        for d in waiters:
            d.callback(None)

    # -- requests ---------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether the connection is closed or lost (no request can be sent)."""
        return self._lost is not None

    def request(self, build: Callable[[int], Message], what: str,
                convert: Callable[[Any], Any], timeout: Any = NOWAIT, *,
                cancel_on_timeout: bool = False) -> Deferred[Any]:
        """Send one request now; return a Deferred of ``convert(reply)``.

        Args:
            build: makes the message from a fresh request id.
            what: describes the request in error messages.
            convert: turns the reply message into the result.
            timeout: seconds to wait for the reply (``NOWAIT``: this protocol's ``timeout``;
                ``None``: no limit).
            cancel_on_timeout: send a Cancel for the request when it times out (waiting
                get/peek).
        """
        if self._lost is not None:
            return fail(type(self._lost)(f"cannot send {what}: {self._lost}"))
        if self.transport is None:
            return fail(ConnectionLost(
                f"cannot send {what}: not connected to tensorshare server at {self.address}"))
        rid = self.conn.next_id()
        chunks = self.conn.send(build(rid))
        d: Deferred[Any] = Deferred(lambda _: self._abandon(rid))
        entry = _Pending(d, what, convert, cancel_on_timeout)
        self._pending[rid] = entry
        reply_timeout = self.timeout if timeout is NOWAIT else timeout
        if reply_timeout is not None:
            entry.timer = self.reactor.callLater(reply_timeout, self._timed_out, rid,
                                                 reply_timeout)
        self._write(chunks)
        return d

    def _write(self, chunks: list[BytesLike]) -> None:
        # The stock Twisted transports only accept bytes, so the frame (header and every
        # tensor buffer) is joined into one bytes object here: one copy of the data. The
        # server avoids this copy with tensorshare._fasttcp (sendmsg of the buffers
        # themselves); a zero-copy client transport is future work.
        self.transport.write(b"".join(chunks))  # type: ignore[union-attr]

    def _timed_out(self, rid: int, after: float) -> None:
        entry = self._pending.pop(rid, None)
        if entry is None:
            return
        entry.timer = None
        self.conn.forget(rid)
        if entry.cancel_on_timeout:
            self._cancel_quietly(rid)
        entry.deferred.errback(Timeout(
            f"no reply from tensorshare server at {self.address} to {entry.what} "
            f"within {after:g} s"))

    def _abandon(self, rid: int) -> None:
        """Canceller of a request's Deferred: stop waiting for its reply."""
        entry = self._pending.pop(rid, None)
        if entry is None:
            return
        entry.stop_timer()
        self.conn.forget(rid)
        if entry.cancel_on_timeout:
            self._cancel_quietly(rid)

    def _cancel_quietly(self, target: int) -> None:
        d = self.request(lambda rid: Cancel(rid, target), "cancel", _none)
        d.addErrback(lambda _: None)

    def _on_message(self, msg: Message) -> None:
        if isinstance(msg, Changed):
            self._dispatch_event(msg)
            return
        rid = getattr(msg, "id", 0)
        if rid == 0 and isinstance(msg, ErrorReply):
            self._server_said = f"{msg.message} ({msg.code})"
            return
        entry = self._pending.pop(rid, None)
        if entry is None:
            if isinstance(msg, Fetched) and msg.items:
                log.warn("discarded a late reply with {n} item(s) to request {rid} "
                         "that timed out", n=len(msg.items), rid=rid)
            return
        entry.stop_timer()
        if isinstance(msg, ErrorReply):
            entry.deferred.errback(error_from_code(msg.code, msg.message))
            return
        try:
            result = entry.convert(msg)
        except TensorShareError as exc:  # e.g. a malformed value from a peer
            entry.deferred.errback(exc)
            return
        entry.deferred.callback(result)

    def _fail_all(self, error: TransportError) -> None:
        """Errback every pending request at once (as AMP's ``failAllOutgoing``)."""
        if self._lost is None:
            self._lost = error
        pending, self._pending = self._pending, {}
        for rid, entry in pending.items():
            entry.stop_timer()
            self.conn.forget(rid)
        for entry in pending.values():
            entry.deferred.errback(type(error)(f"{entry.what} failed: {error}"))

    def _drop(self, reason: str) -> None:
        """The stream is unusable: fail everything now and abort the connection."""
        log.warn("dropping connection to tensorshare server at {address}: {reason}",
                 address=self.address, reason=reason)
        self._fail_all(ConnectionLost(
            f"connection to tensorshare server at {self.address} lost: {reason}"))
        if self.transport is not None and not self._disconnected:
            self.transport.abortConnection()  # type: ignore[attr-defined]

    # -- handshake --------------------------------------------------------------------------
    def _handshake_done(self, reply: Any) -> None:
        if not isinstance(reply, HelloReply):
            self._handshake_failed(Failure(ProtocolError(
                f"unexpected handshake reply {type(reply).__name__}")))
            return
        self.conn.set_limits(reply.limits)
        self.client = TxClient(self, reply)
        self.ready.callback(self.client)

    def _handshake_failed(self, failure: Failure) -> None:
        err = ConnectError(f"handshake with {self.address} failed: {failure.value}")
        err.__cause__ = failure.value
        self.close()
        self.ready.errback(err)

    # -- listen -----------------------------------------------------------------------------
    def add_listener(self, name: str, callback: Listener) -> bool:
        """Register a callback; return whether it is the bin's first (Listen must be sent)."""
        first = name not in self._listeners
        self._listeners.setdefault(name, []).append(callback)
        return first

    def remove_listeners(self, name: str) -> bool:
        """Drop the bin's callbacks; return whether there were any."""
        return self._listeners.pop(name, None) is not None

    def _dispatch_event(self, msg: Changed) -> None:
        event = _event(msg)
        for cb in list(self._listeners.get(msg.bin, ())):
            try:
                result = cb(dict(event))
            except Exception:
                log.failure("listen callback for bin {bin!r} raised", bin=msg.bin)
                continue
            if isinstance(result, Deferred):  # an async callback: log its failure too
                result.addErrback(self._log_callback_failure, msg.bin)

    @staticmethod
    def _log_callback_failure(failure: Failure, name: str) -> None:
        log.failure("listen callback for bin {bin!r} failed", failure, bin=name)

    # -- closing ----------------------------------------------------------------------------
    def close(self) -> Deferred[None]:
        """Close the connection; pending requests errback with ConnectionLost at once.

        Returns a Deferred that fires once the connection is gone. Idempotent.
        """
        if self.transport is None or self._disconnected:
            self._closing = True
            if self._lost is None:
                self._lost = ConnectionLost(f"client for {self.address} was closed")
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._close_waiters.append(d)
        if not self._closing:
            self._closing = True
            self._fail_all(ConnectionLost(f"client for {self.address} was closed"))
            self.transport.loseConnection()
            # loseConnection waits for buffered writes; a server that stops reading must not
            # keep close() from finishing.
            self._close_timer = self.reactor.callLater(self.timeout, self._abort)
        return d

    def _abort(self) -> None:
        self._close_timer = None
        if not self._disconnected and self.transport is not None:
            self.transport.abortConnection()  # type: ignore[attr-defined]


class TxClient:
    """A connection to a tensorshare server, for code running in a Twisted reactor.

    Made by :func:`connect` (or :attr:`TxProtocol.ready`). Mirrors :class:`tensorshare.Client`:
    the same methods, arguments and errors, but each returns a Deferred. Like everything
    Twisted it is not thread-safe: call it from the reactor thread (other threads use
    ``reactor.callFromThread`` or ``twisted.internet.threads.blockingCallFromThread``).

    Attributes:
        host, port, address, timeout: as given to :func:`connect`.
        server_version: e.g. ``"tensorshare/0.1.0"``. protocol_version: the agreed version.
        limits: the server's limits, adopted for this connection.
        protocol: the underlying :class:`TxProtocol`.
    """

    def __init__(self, protocol: TxProtocol, hello: HelloReply) -> None:
        self.protocol = protocol
        self.host, self.port, self.address = protocol.host, protocol.port, protocol.address
        self.timeout = protocol.timeout
        self.server_version: str = hello.server
        self.protocol_version: int = hello.version
        self.limits: Limits = hello.limits

    # -- store ------------------------------------------------------------------------------
    def put(self, name: str, value: Any, *, tag: int | None = None) -> Deferred[int]:
        """Store ``value`` in bin ``name``, replacing whatever it held.

        Fires with the bin's new version once the server holds the value.

        Raises (synchronously, nothing sent):
            UnsupportedType: ``value`` holds a type that cannot be sent.
            TypeError, ValueError: a bad bin name or tag.
        Errbacks:
            MemoryLimitExceeded, LimitExceeded, Timeout, ConnectionLost.
        """
        item = self._item(name, value, tag)
        return self.protocol.request(lambda rid: Put(rid, name, item), f"put to bin {name!r}",
                                     _version)

    def append(self, name: str, value: Any, *, tag: int | None = None) -> Deferred[int]:
        """Append ``value`` as one item to bin ``name``; fires with the new version (see put)."""
        item = self._item(name, value, tag)
        return self.protocol.request(lambda rid: Append(rid, name, item),
                                     f"append to bin {name!r}", _version)

    # -- fetch ------------------------------------------------------------------------------
    def get(self, name: str, *, max_items: int | None = None,
            timeout: Any = NOWAIT) -> Deferred[Any]:
        """Fire with the content of bin ``name`` and remove it.

        Args:
            max_items: for an appended bin, take at most this many items (FIFO).
            timeout: ``NOWAIT`` (default): do not wait. A number: the server waits up to
                that many seconds for data, then errbacks with Timeout. ``None``: wait
                without limit.

        Fires with the value of a put bin, or the list of items of an appended bin.
        Errbacks with BinNotFound (missing or empty bin, when not waiting) or Timeout.
        """
        d = self.fetch(name, remove=True, max_items=max_items, timeout=timeout)
        return d.addCallback(lambda r: r.value)

    def peek(self, name: str, *, max_items: int | None = None,
             timeout: Any = NOWAIT) -> Deferred[Any]:
        """Like :meth:`get`, but leave the content in the bin."""
        d = self.fetch(name, remove=False, max_items=max_items, timeout=timeout)
        return d.addCallback(lambda r: r.value)

    def fetch(self, name: str, *, remove: bool, max_items: int | None = None,
              timeout: Any = NOWAIT, min_tag: int | None = None,
              newer_than: int | None = None, min_items: int = 1) -> Deferred[FetchResult]:
        """The full form of get (``remove=True``) and peek; fires with a FetchResult.

        See :meth:`tensorshare.Client.fetch` for ``min_tag``, ``newer_than``, ``min_items``.
        The reply timer is the client's ``timeout`` plus the wait time (no timer when
        waiting without limit); when it expires the wait is cancelled on the server.
        """
        req = _fetch_request(name, remove=remove, max_items=max_items, timeout=timeout,
                             min_tag=min_tag, newer_than=newer_than, min_items=min_items,
                             limits=self.protocol.conn.limits, answer_timeout=self.timeout)
        return self.protocol.request(req.build, req.what, req.convert, req.reply_timeout,
                                     cancel_on_timeout=req.wait)

    # -- other requests ---------------------------------------------------------------------
    def list(self) -> Deferred[dict[str, int]]:
        """Fire with ``{bin: n_items}`` for every non-empty bin (1 for a put bin)."""
        return self.protocol.request(ListBins, "list", lambda r: dict(r.bins))

    def delete(self, name: str) -> Deferred[bool]:
        """Delete bin ``name``; fire with whether it existed."""
        self._check_name(name)
        return self.protocol.request(lambda rid: Delete(rid, name), f"delete of bin {name!r}",
                                     lambda r: r.existed)

    def listen(self, name: str, callback: Listener) -> Deferred[None]:
        """Call ``callback(event)`` in the reactor thread on every change of bin ``name``.

        ``event`` is ``{'status': 'OK', 'bin': name, 'op': 'put'|'append'|'get'|'delete',
        'n_items': n, 'version': v}``. Exceptions raised by a callback are logged and
        ignored. Fires once the server has registered the listener (at once for a further
        callback on a bin already listened to).
        """
        self._check_name(name)
        if not callable(callback):
            raise TypeError("callback must be callable")
        if not self.protocol.add_listener(name, callback):
            return succeed(None)
        return self.protocol.request(lambda rid: Listen(rid, name), f"listen to bin {name!r}",
                                     _none)

    def unlisten(self, name: str) -> Deferred[bool]:
        """Drop the bin's callbacks and tell the server; fire with whether we listened."""
        self._check_name(name)
        if not self.protocol.remove_listeners(name):
            return succeed(False)
        return self.protocol.request(lambda rid: Unlisten(rid, name),
                                     f"unlisten from bin {name!r}", lambda r: True)

    def ping(self) -> Deferred[None]:
        """Round-trip to the server; errbacks with Timeout if it does not answer in time."""
        return self.protocol.request(Ping, "ping", _none)

    @property
    def closed(self) -> bool:
        """Whether the connection is closed or lost."""
        return self.protocol.closed

    def close(self) -> Deferred[None]:
        """Close the connection; pending requests errback with ConnectionLost. Idempotent."""
        return self.protocol.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<tensorshare.TxClient {self.address} {state}>"

    # -- helpers ----------------------------------------------------------------------------
    def _check_name(self, name: str) -> None:
        check_bin_name(name, self.protocol.conn.limits.max_name_bytes)

    def _item(self, name: str, value: Any, tag: int | None) -> Item:
        proto = self.protocol
        return _make_item(name, value, tag, proto.conn.limits, proto.compress,
                          proto.compress_min_bytes)


class _TxClientFactory(ClientFactory):
    """Connects once, runs the connect timeout, hands the handshake's result to ``deferred``."""

    def __init__(self, reactor: Any, host: str, port: int, timeout: float,
                 compress: str | None, compress_min_bytes: int, name: str) -> None:
        self.reactor = reactor
        self.host, self.port, self.timeout = host, port, timeout
        self.address = f"{host}:{port}"
        self.compress, self.compress_min_bytes, self.name = compress, compress_min_bytes, name
        self.deferred: Deferred[TxClient] = Deferred(self._cancel)
        self.protocol_instance: TxProtocol | None = None
        self.connector: Any = None
        self._timer: IDelayedCall | None = None
        self._done = False  # the outcome was decided (deferred fired or cancelled)

    def start(self) -> Deferred[TxClient]:
        self._timer = self.reactor.callLater(self.timeout, self._timed_out)
        try:
            self.connector = self.reactor.connectTCP(self.host, self.port, self,
                                                     timeout=self.timeout)
        except Exception as exc:  # e.g. a malformed address refused synchronously
            self._finish(Failure(ConnectError(
                f"cannot connect to tensorshare server at {self.address}: {exc}")))
        return self.deferred

    def buildProtocol(self, addr: Any) -> TxProtocol:
        self._stop_timer()  # connected: from here on the handshake has its own timer
        proto = TxProtocol(self.reactor, self.host, self.port, timeout=self.timeout,
                           compress=self.compress, compress_min_bytes=self.compress_min_bytes,
                           name=self.name)
        self.protocol_instance = proto
        proto.ready.addBoth(self._handshake_result)
        return proto

    def clientConnectionFailed(self, connector: Any, reason: Failure) -> None:
        self._finish(Failure(ConnectError(
            f"cannot connect to tensorshare server at {self.address}: "
            f"{reason.getErrorMessage()}")))

    def _handshake_result(self, result: Any) -> None:
        if self._done:
            if isinstance(result, TxClient):  # cancelled meanwhile: do not leak it
                result.close()
            return None
        self._finish(result)
        return None

    def _finish(self, result: Any) -> None:
        if self._done:
            return
        self._done = True
        self._stop_timer()
        if isinstance(result, Failure):
            self.deferred.errback(result)
        else:
            self.deferred.callback(result)

    def _stop_timer(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        self._finish(Failure(ConnectError(
            f"cannot connect to tensorshare server at {self.address}: "
            f"no connection within {self.timeout:g} s")))
        self._stop_connecting()

    def _stop_connecting(self) -> None:
        if self.connector is not None:
            try:
                self.connector.stopConnecting()
            except Exception:  # not connecting any more (twisted's NotConnectingError)
                pass

    def _cancel(self, d: Deferred[TxClient]) -> None:
        self._done = True
        self._stop_timer()
        proto = self.protocol_instance
        if proto is not None:
            proto.close()
        else:
            self._stop_connecting()


def connect(reactor: Any, host: str = "127.0.0.1", port: int = 8000, *, timeout: float = 30.0,
            compress: str | None = None, name: str = "tensorshare-twisted",
            compress_min_bytes: int = 64 * 1024) -> Deferred[TxClient]:
    """Connect to a tensorshare server and do the handshake; fire with a :class:`TxClient`.

    Args:
        reactor: the reactor to use (``reactor.connectTCP`` and ``reactor.callLater``).
        host, port: the server's address.
        timeout: seconds allowed to establish the TCP connection, then again for the
            handshake (as the blocking client), and afterwards for each reply.
        compress: ``"lz4"`` to compress large tensor buffers before sending, or ``None``.
        name: how this client introduces itself in the server's log.
        compress_min_bytes: buffers smaller than this are never compressed.

    Errbacks with :class:`~tensorshare.errors.ConnectError` (naming ``host:port``) when the
    connection is refused or unreachable, the handshake fails, or either step takes longer
    than ``timeout``. Cancelling the Deferred gives up on the connection.

    Raises:
        ValueError: ``compress`` is not ``None`` or ``"lz4"`` (synchronously).
    """
    if compress not in (None, "lz4"):
        raise ValueError(f"compress must be None or 'lz4', not {compress!r}")
    factory = _TxClientFactory(reactor, host, port, timeout, compress, compress_min_bytes, name)
    return factory.start()
