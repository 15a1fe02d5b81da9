"""The Twisted server: named bins in memory, served over one connection per client.

The protocol logic lives in :mod:`tensorshare.protocol` (bytes <-> messages) and the bins in
:mod:`tensorshare.store`; this module only wires them to Twisted: feed received bytes, loop
over the messages, call the store, write the replies, fan out change notifications.

The reactor is always passed in. :class:`EmbeddedServer` runs a private reactor in a daemon
thread, so a server can live inside any program (a trainer, a test) without taking its main
thread or the global reactor; :func:`run_server` is the blocking form the seed used.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import Factory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from ._fasttcp import listen_fast_tcp
from ._version import __version__
from .errors import InvalidRequest, ProtocolError, ServerError, code_for
from .frames import BytesLike
from .messages import (
    Acked,
    Append,
    Cancel,
    Changed,
    Delete,
    Deleted,
    ErrorReply,
    Fetched,
    Get,
    Hello,
    HelloReply,
    Item,
    Limits,
    ListBins,
    Listen,
    Listening,
    Listing,
    Message,
    Peek,
    Ping,
    Put,
    Stored,
    Unlisten,
)
from .protocol import PROTOCOL_VERSIONS, SERVER, BadRequest, Connection, ProtocolViolation
from .store import Store, Taken, Waiter

__all__ = ["EmbeddedServer", "ServerFactory", "ServerProtocol", "run_server"]

log = Logger(namespace="tensorshare.server")

# A connection we close gets this long to take what is queued for it (say, the error that
# explains why) before it is cut.
CLOSE_GRACE_SECONDS = 10.0


class ServerProtocol(Protocol):
    """One client connection. Implements the zero-copy read hooks of :mod:`._fasttcp`."""

    def __init__(self, factory: ServerFactory) -> None:
        self.factory = factory
        self.conn = Connection(SERVER, factory.limits)
        self.version: int | None = None  # protocol version agreed in the handshake
        self.peer = "?"
        self.listening: set[str] = set()
        self._waiting: dict[int, tuple[Waiter, IDelayedCall | None]] = {}
        self._closed = False
        self._abort_timer: IDelayedCall | None = None

    # -- Twisted hooks ----------------------------------------------------------------------
    def connectionMade(self) -> None:
        peer = self.transport.getPeer()  # type: ignore[union-attr]
        self.peer = f"{getattr(peer, 'host', '?')}:{getattr(peer, 'port', '?')}"
        self.factory.connections.add(self)
        log.info("connection from {peer}", peer=self.peer)

    def dataReceived(self, data: bytes) -> None:
        if not self._closed:
            self._handle(lambda: self.conn.receive_data(data))

    def get_read_buffer(self) -> memoryview | None:
        return None if self._closed else self.conn.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self._handle(lambda: self.conn.buffer_updated(nbytes))

    def connectionLost(self, reason: Failure | None = None) -> None:  # type: ignore[override]
        self._release()
        self.factory.connections.discard(self)
        if self._abort_timer is not None and self._abort_timer.active():
            self._abort_timer.cancel()
        log.info("connection from {peer} closed: {reason}", peer=self.peer,
                 reason=reason.getErrorMessage() if reason else "closed")

    # -- plumbing ---------------------------------------------------------------------------
    def write_chunks(self, chunks: Sequence[BytesLike]) -> None:
        if not self._closed:
            # Our transport (_fasttcp.FastServer) takes memoryviews, hence no bytes copies.
            self.transport.writeSequence(chunks)  # type: ignore[union-attr, arg-type]

    def send(self, msg: Message) -> None:
        self.write_chunks(self.conn.send(msg))

    def _release(self) -> None:
        """Stop serving this connection: withdraw its waiting fetches and its listeners.

        Done as soon as we decide to close, not when the socket is finally gone: a waiter of
        a closing connection must never take data it can no longer deliver.
        """
        self._closed = True
        for name in self.listening:
            self.factory.unsubscribe(name, self)
        self.listening.clear()
        for waiter, timer in self._waiting.values():
            self.factory.store.cancel(waiter)
            if timer is not None and timer.active():
                timer.cancel()
        self._waiting.clear()

    def _close(self) -> None:
        """Close after what is queued is sent; abort if the peer does not read it in time."""
        self._release()
        self.transport.loseConnection()  # type: ignore[union-attr]
        self._abort_timer = self.factory.reactor.callLater(
            CLOSE_GRACE_SECONDS, self.transport.abortConnection)  # type: ignore[union-attr]

    def _fail_connection(self, code: str, message: str) -> None:
        """Tell the peer why, then close this one connection; the server carries on."""
        log.warn("closing connection from {peer}: {message}", peer=self.peer, message=message)
        self.send(ErrorReply(0, code, message))
        self._close()

    def _handle(self, receive: Any) -> None:
        for msg in receive():
            if self._closed:
                return
            if type(msg) is ProtocolViolation:
                self._fail_connection("protocol_error", msg.message)
                return
            try:
                self._dispatch(msg)
            except ServerError as exc:
                self.send(ErrorReply(msg.id, code_for(exc), str(exc)))
            except Exception:  # a bug must cost one request, never the server
                log.failure("internal error serving {msg!r} from {peer}",
                            msg=type(msg).__name__, peer=self.peer)
                self.send(ErrorReply(msg.id, "error", "internal server error; see the server log"))

    # -- requests ---------------------------------------------------------------------------
    def _dispatch(self, msg: Message | BadRequest) -> None:
        if self.version is None and not isinstance(msg, Hello):
            reason = msg.message if isinstance(msg, BadRequest) else "the first request must be 'hello'"
            self._fail_connection("protocol_error", f"handshake failed: {reason}")
            return
        store = self.factory.store
        cls = type(msg)
        if cls is Put or cls is Append:
            m: Put | Append = msg  # type: ignore[assignment]
            do = store.put if cls is Put else store.append
            version, n = do(m.bin, m.item, _wire_size(m.item), m.item.tag)
            self.send(Stored(m.id, version, n))
        elif cls is Get or cls is Peek:
            self._fetch(msg)  # type: ignore[arg-type]
        elif cls is BadRequest:
            b: BadRequest = msg  # type: ignore[assignment]
            log.warn("bad request from {peer}: {message}", peer=self.peer, message=b.message)
            self.send(ErrorReply(b.id, b.code, b.message))
        elif cls is ListBins:
            self.send(Listing(msg.id, store.list()))  # type: ignore[union-attr]
        elif cls is Delete:
            existed, version = store.delete(msg.bin)  # type: ignore[union-attr]
            self.send(Deleted(msg.id, existed, version))  # type: ignore[union-attr]
        elif cls is Listen:
            name = msg.bin  # type: ignore[union-attr]
            self.listening.add(name)
            self.factory.subscribe(name, self)
            self.send(Listening(msg.id, store.version(name), store.n_items(name)))  # type: ignore[union-attr]
        elif cls is Unlisten:
            name = msg.bin  # type: ignore[union-attr]
            was = name in self.listening
            self.listening.discard(name)
            self.factory.unsubscribe(name, self)
            self.send(Acked(msg.id, was))  # type: ignore[union-attr]
        elif cls is Ping:
            self.send(Acked(msg.id, True))  # type: ignore[union-attr]
        elif cls is Cancel:
            self.send(Acked(msg.id, self._cancel(msg.target)))  # type: ignore[union-attr]
        elif cls is Hello:
            self._hello(msg)  # type: ignore[arg-type]
        else:
            raise ProtocolError(f"unexpected message {cls.__name__}")

    def _hello(self, msg: Hello) -> None:
        if self.version is not None:
            self.send(ErrorReply(msg.id, "invalid_request", "handshake already done"))
            return
        common = set(msg.versions) & set(PROTOCOL_VERSIONS)
        if not common:
            self.send(ErrorReply(msg.id, "unsupported_version",
                                 f"client speaks protocol versions {list(msg.versions)}, "
                                 f"this server speaks {list(PROTOCOL_VERSIONS)}"))
            self._close()
            return
        self.version = max(common)
        log.info("{peer} is {client!r}, protocol version {version}", peer=self.peer,
                 client=msg.client, version=self.version)
        self.send(HelloReply(msg.id, self.version, f"tensorshare/{__version__}", self.factory.limits))

    def _fetch(self, msg: Get | Peek) -> None:
        store = self.factory.store
        remove = type(msg) is Get
        max_bytes = self.factory.max_reply_bytes
        if not msg.wait:
            taken = store.fetch(msg.bin, remove=remove, max_items=msg.max_items,
                                min_tag=msg.min_tag, newer_than=msg.newer_than,
                                max_bytes=max_bytes)
            self.send(_fetched(msg.id, taken))
            return
        rid = msg.id
        if rid in self._waiting:
            raise InvalidRequest(f"request id {rid} is already waiting on this connection")

        def served(taken: Taken) -> None:
            _, timer = self._waiting.pop(rid, (None, None))
            if timer is not None and timer.active():
                timer.cancel()
            self.send(_fetched(rid, taken))

        result = store.fetch_or_wait(
            msg.bin, served, remove=remove, max_items=msg.max_items, min_tag=msg.min_tag,
            newer_than=msg.newer_than, min_items=msg.min_items, max_bytes=max_bytes)
        if isinstance(result, Taken):
            self.send(_fetched(rid, result))
            return
        if not result.active:  # served at once, through ``served``, behind earlier waiters
            return
        timer = None
        if msg.timeout is not None:
            try:
                timer = self.factory.reactor.callLater(msg.timeout, self._timed_out, rid, msg)
            except BaseException:
                store.cancel(result)  # never leave a waiter nobody will answer
                raise
        self._waiting[rid] = (result, timer)

    def _timed_out(self, rid: int, msg: Get | Peek) -> None:
        entry = self._waiting.pop(rid, None)
        if entry is None:
            return
        self.factory.store.cancel(entry[0])
        what = "newer data" if msg.newer_than is not None else "data"
        self.send(ErrorReply(rid, "timeout",
                             f"no {what} in bin {msg.bin!r} within {msg.timeout:g} s"))

    def _cancel(self, target: int) -> bool:
        entry = self._waiting.pop(target, None)
        if entry is None:
            return False
        waiter, timer = entry
        if timer is not None and timer.active():
            timer.cancel()
        return self.factory.store.cancel(waiter)


def _wire_size(item: Item) -> int:
    """Bytes an item takes in a frame: its value and buffers, plus padding and descriptors.

    The store counts this per item, for the memory limit and to keep every reply within
    the frame limit (a get of a long list bin returns the items that fit; the rest stay).
    """
    return item.value.nbytes + 64 * (len(item.value.buffers) + 1)


def _fetched(rid: int, taken: Taken) -> Fetched:
    items: tuple[Item, ...] = taken.items
    return Fetched(rid, taken.kind, items, taken.version, taken.n_items, taken.dropped,
                   taken.unchanged)


class ServerFactory(Factory):
    """Holds the store, the limits and the listeners; builds one protocol per connection.

    Args:
        reactor: the reactor that runs this server (used for wait timeouts).
        limits: hard limits applied to every connection.
        max_memory: bytes of stored values above which put/append are refused.
    """

    def __init__(self, reactor: Any, limits: Limits | None = None,
                 max_memory: int | None = None) -> None:
        self.reactor = reactor
        self.limits = limits or Limits()
        # Room for the reply's own header fields around the items (a few hundred bytes).
        self.max_reply_bytes = max(self.limits.max_frame_bytes - 4096, 1)
        self.store = Store(max_memory=max_memory, on_change=self._changed)
        self.connections: set[ServerProtocol] = set()
        self._listeners: dict[str, set[ServerProtocol]] = {}
        self._encoder = Connection(SERVER, self.limits)  # stateless on the server side

    noisy = False  # we log connections ourselves

    def buildProtocol(self, addr: Any) -> ServerProtocol:
        return ServerProtocol(self)

    def subscribe(self, name: str, proto: ServerProtocol) -> None:
        self._listeners.setdefault(name, set()).add(proto)

    def unsubscribe(self, name: str, proto: ServerProtocol) -> None:
        subs = self._listeners.get(name)
        if subs is not None:
            subs.discard(proto)
            if not subs:
                del self._listeners[name]

    def _changed(self, name: str, op: str, n_items: int, version: int) -> None:
        subs = self._listeners.get(name)
        if not subs:
            return
        # Encode once, write the same chunks to every listener.
        chunks = self._encoder.send(Changed(name, op, n_items, version))
        for proto in list(subs):
            proto.write_chunks(chunks)


class EmbeddedServer:
    """A server running on a private reactor in a daemon thread.

    Usage::

        with EmbeddedServer(port=0) as server:
            client = Client("127.0.0.1", server.port)

    Args:
        port: TCP port; 0 picks a free one (read it back from ``.port``).
        host: interface to bind; 127.0.0.1 unless you mean to accept other machines.
        limits: hard limits (see :class:`~tensorshare.messages.Limits`).
        max_memory: refuse values that would take the stored bytes above this.

    Raises:
        OSError: the port could not be bound (e.g. it is in use).
    """

    def __init__(self, port: int = 0, host: str = "127.0.0.1", *, limits: Limits | None = None,
                 max_memory: int | None = None) -> None:
        from twisted.internet.epollreactor import EPollReactor

        self.host = host
        self.reactor = EPollReactor()
        self.factory = ServerFactory(self.reactor, limits, max_memory)
        self._port = listen_fast_tcp(self.reactor, port, self.factory, interface=host)
        self.port: int = self._port.getHost().port
        self._thread = threading.Thread(
            target=self.reactor.run, kwargs={"installSignalHandlers": False},
            name=f"tensorshare-server-{self.port}", daemon=True)
        self._thread.start()
        log.info("tensorshare server listening on {host}:{port}", host=host, port=self.port)

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

    def stop(self, timeout: float = 10.0) -> None:
        """Close the port and every connection, stop the reactor and join its thread."""
        if not self._thread.is_alive():
            return

        def shutdown() -> None:
            self._port.stopListening()
            for proto in list(self.factory.connections):
                proto.transport.abortConnection()  # type: ignore[union-attr]
            self.reactor.callLater(0, self.reactor.stop)

        self.reactor.callFromThread(shutdown)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the server thread on port {self.port} did not stop within "
                               f"{timeout:g} s")
        # A private reactor is never used again: give back its epoll and waker descriptors,
        # or a process that starts many servers (a test suite) runs out of them.
        try:
            self.reactor.waker.connectionLost(None)
            self.reactor._poller.close()
        except (AttributeError, OSError):  # another reactor type, or already closed
            pass

    @property
    def running(self) -> bool:
        """Whether the server thread is alive."""
        return self._thread.is_alive()

    def __enter__(self) -> EmbeddedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_server(port: int = 8000, host: str = "127.0.0.1", *, limits: Limits | None = None,
               max_memory: int | None = None, ready: Any = None) -> None:
    """Run a server until interrupted (Ctrl+C). This blocks, as in the seed.

    Args:
        port: TCP port (0 picks a free one; it is logged and passed to ``ready``).
        host: interface to bind; 127.0.0.1 by default, ``0.0.0.0`` to accept other machines.
        limits: hard limits; max_memory: see :class:`EmbeddedServer`.
        ready: optional callable ``ready(server)`` called once the port is bound.
    """
    server = EmbeddedServer(port, host, limits=limits, max_memory=max_memory)
    if ready is not None:
        ready(server)
    try:
        while server.running:
            server._thread.join(0.5)  # short joins keep Ctrl+C responsive
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
