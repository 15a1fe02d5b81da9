"""Tests for tensorshare._fasttcp: the zero-copy Twisted TCP server transport.

Every test runs a private (not installed) EPollReactor in a background thread and
talks to it over real loopback sockets with plain blocking clients. Waiting is
always on a condition with a deadline, never a sleep.
"""

from __future__ import annotations

import array
import io
import os
import random
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from twisted.internet import error as twisted_error
from twisted.internet.epollreactor import EPollReactor
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.threads import blockingCallFromThread
from twisted.logger import globalLogPublisher
from twisted.protocols.basic import FileSender
from twisted.python.failure import Failure
from zope.interface import implementer

from tensorshare.server.reactor import LeanEPollReactor
from tensorshare.server.transports import BufferedProtocol, FastPort, FastServer, listen_fast_tcp
from tests.conftest import wait_until

TIMEOUT = 60.0  # generous: these are correctness tests, not speed tests
MIB = 1024 * 1024
PREFIX = struct.Struct("<Q")


# --------------------------------------------------------------------- fixtures


class ServerState:
    """What the server side did, shared between the reactor and the test thread.

    Protocols call :meth:`changed` after every state change so the test thread can
    block on a condition instead of polling with sleeps.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.protocols: list[Any] = []

    def changed(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, predicate: Callable[[], Any], what: str) -> None:
        with self.cond:
            if not self.cond.wait_for(predicate, timeout=TIMEOUT):
                raise AssertionError(f"timed out waiting for {what}")

    def wait_protocols(self, count: int) -> list[Any]:
        self.wait_for(lambda: len(self.protocols) >= count, f"{count} connection(s)")
        return self.protocols


class RecordingFactory(Factory):
    """Builds ``protocol_class(state, script)`` and records every instance."""

    def __init__(
        self,
        protocol_class: type[Protocol],
        state: ServerState,
        script: Callable[[FastServer], None] | None = None,
    ) -> None:
        self.protocol_class = protocol_class
        self.state = state
        self.script = script

    def buildProtocol(self, addr: object) -> Protocol:
        proto = self.protocol_class(self.state, self.script)  # type: ignore[call-arg]
        proto.factory = self
        return proto


@pytest.fixture(params=[EPollReactor, LeanEPollReactor], ids=["stock", "lean"])
def reactor(request: pytest.FixtureRequest) -> Iterator[EPollReactor]:
    """A private reactor running in a thread, Twisted's EPollReactor and the server's own
    (every transport test runs on both); fails the test on logged errors, but those a test
    expects (``reactor.expected_failures``, a list the test extends)."""
    logged_failures: list[dict[str, Any]] = []

    def observer(event: dict[str, Any]) -> None:
        if "log_failure" in event:
            logged_failures.append(event)

    globalLogPublisher.addObserver(observer)
    r = request.param()
    r.expected_failures = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=r.run, kwargs={"installSignalHandlers": False}, daemon=True)
    thread.start()
    try:
        yield r
    finally:
        r.callFromThread(r.stop)
        thread.join(TIMEOUT)
        globalLogPublisher.removeObserver(observer)
    assert not thread.is_alive(), "reactor thread did not stop"
    unexpected = [e for e in logged_failures
                  if not any(isinstance(e["log_failure"].value, t)
                             for t in r.expected_failures)]  # type: ignore[attr-defined]
    assert not unexpected, [e["log_failure"].getTraceback() for e in unexpected]


def listen(
    reactor: EPollReactor,
    protocol_class: type[Protocol],
    script: Callable[[FastServer], None] | None = None,
) -> tuple[int, ServerState]:
    """Start a FastPort on 127.0.0.1:0 from the reactor thread; return (port, state)."""
    state = ServerState()
    factory = RecordingFactory(protocol_class, state, script)
    port = blockingCallFromThread(reactor, listen_fast_tcp, reactor, 0, factory)
    assert isinstance(port, FastPort)
    return port.getHost().port, state


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)


def recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if not n:
            raise AssertionError(f"EOF after {got} of {size} bytes")
        got += n
    return bytes(buf)


def recv_until_eof(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        chunk = sock.recv(4 * MIB)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def frame(body: bytes) -> bytes:
    return PREFIX.pack(len(body)) + body


# -------------------------------------------------------------------- protocols


class EchoProtocol(Protocol):
    """Length-prefixed echo using the BufferedProtocol read path.

    The 8-byte prefix arrives through ``dataReceived`` (``get_read_buffer`` returns
    None meanwhile); the body is read straight into a preallocated bytearray of
    exactly the announced size. Each complete frame is echoed back as
    ``writeSequence([prefix, memoryview(body)])``.
    """

    def __init__(self, state: ServerState, script: object = None) -> None:
        self.state = state
        self._prefix = bytearray()
        self._body: bytearray | None = None
        self._filled = 0
        self.data_received_bytes = 0
        self.buffer_updated_calls = 0
        self.buffer_updated_bytes = 0
        self.frames = 0
        self.lost_reason: Failure | None = None
        self.late_write_queued: int | None = None

    def connectionMade(self) -> None:
        self.state.protocols.append(self)
        self.state.changed()

    def get_read_buffer(self) -> memoryview | None:
        if self._body is None:
            return None
        return memoryview(self._body)[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self.buffer_updated_calls += 1
        self.buffer_updated_bytes += nbytes
        self._filled += nbytes
        if self._body is not None and self._filled == len(self._body):
            self._finish_frame()
        self.state.changed()

    def dataReceived(self, data: bytes) -> None:
        self.data_received_bytes += len(data)
        view = memoryview(data)
        pos = 0
        while pos < len(view):
            if self._body is None:
                chunk = view[pos : pos + PREFIX.size - len(self._prefix)]
                self._prefix += chunk
                pos += len(chunk)
                if len(self._prefix) == PREFIX.size:
                    (size,) = PREFIX.unpack(self._prefix)
                    self._body = bytearray(size)
                    self._filled = 0
                    if size == 0:
                        self._finish_frame()
            else:
                chunk = view[pos : pos + len(self._body) - self._filled]
                self._body[self._filled : self._filled + len(chunk)] = chunk
                self._filled += len(chunk)
                pos += len(chunk)
                if self._filled == len(self._body):
                    self._finish_frame()
        self.state.changed()

    def _finish_frame(self) -> None:
        assert self._body is not None
        body, prefix = self._body, bytes(self._prefix)
        self._prefix = bytearray()
        self._body = None  # the next frame gets a fresh buffer: the old one is queued
        self._filled = 0
        # Count before writing: write-through may deliver the echo before writeSequence
        # returns, and the test reads the count as soon as the echo arrives.
        self.frames += 1
        self.transport.writeSequence([prefix, memoryview(body)])

    @property
    def body_bytes_received(self) -> int:
        return self._filled if self._body is not None else 0

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        # Writing after the connection is gone must be silently ignored.
        transport = self.transport
        transport.write(b"late")
        transport.writeSequence([b"late", bytearray(b"late")])
        self.late_write_queued = transport.queued_bytes
        self.lost_reason = reason
        self.state.changed()


class ScriptedProtocol(Protocol):
    """Runs ``script(transport)`` on connect; records what it receives.

    It has no ``get_read_buffer``, so it also exercises the stock read fallback.
    """

    def __init__(self, state: ServerState, script: Callable[[FastServer], None] | None) -> None:
        self.state = state
        self.script = script
        self.received = bytearray()
        self.lost_reason: Failure | None = None

    def connectionMade(self) -> None:
        self.state.protocols.append(self)
        if self.script is not None:
            self.script(self.transport)
        self.state.changed()

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        self.state.changed()

    def connectionLost(self, reason: Failure = None) -> None:  # type: ignore[assignment]
        self.lost_reason = reason
        self.state.changed()


class PlainEchoProtocol(ScriptedProtocol):
    """Stock-style echo: no BufferedProtocol methods, bytes in, bytes out."""

    def dataReceived(self, data: bytes) -> None:
        self.transport.write(data)


# ------------------------------------------------------------------------ tests


def echo_round_trip(port: int, body: bytes) -> bytes:
    with connect(port) as sock:
        sock.sendall(PREFIX.pack(len(body)))
        sock.sendall(body)
        return recv_exact(sock, PREFIX.size + len(body))


@pytest.mark.parametrize("size", [0, 1, MIB, 64 * MIB], ids=["0B", "1B", "1MiB", "64MiB"])
def test_echo_round_trip(reactor: EPollReactor, size: int) -> None:
    port, state = listen(reactor, EchoProtocol)
    body = os.urandom(size)

    echoed = echo_round_trip(port, body)

    assert echoed[: PREFIX.size] == PREFIX.pack(size)
    assert echoed[PREFIX.size :] == body
    (proto,) = state.wait_protocols(1)
    assert proto.frames == 1
    assert proto.data_received_bytes + proto.buffer_updated_bytes == PREFIX.size + size
    if size >= MIB:
        # The stock path reads at most bufferSize (64 KiB) per dataReceived; all the
        # rest of the body must have been recv_into'd straight into the frame.
        assert proto.data_received_bytes <= FastServer.bufferSize
        assert proto.buffer_updated_calls >= 1
        assert proto.buffer_updated_bytes >= size - FastServer.bufferSize
    if size == 64 * MIB:
        assert proto.data_received_bytes < size // 100


def test_pipelined_small_frames(reactor: EPollReactor) -> None:
    port, state = listen(reactor, EchoProtocol)
    rng = random.Random(1234)
    bodies = [rng.randbytes(rng.choice([0, 1, 7, 8, 9, 100, 4000, 70_000])) for _ in range(2000)]
    stream = b"".join(frame(b) for b in bodies)

    with connect(port) as sock:
        sock.sendall(stream)  # one sendall: frames arrive back to back, split anywhere
        echoed = recv_exact(sock, len(stream))

    assert echoed == stream
    (proto,) = state.wait_protocols(1)
    assert proto.frames == len(bodies)


def test_sequential_frames_on_one_connection(reactor: EPollReactor) -> None:
    port, state = listen(reactor, EchoProtocol)
    with connect(port) as sock:
        for size in [5, 3 * MIB, 0, 100_000, 1]:
            body = os.urandom(size)
            sock.sendall(frame(body))
            assert recv_exact(sock, PREFIX.size + size) == frame(body)
    (proto,) = state.wait_protocols(1)
    assert proto.frames == 5


def test_buffered_protocol_interface() -> None:
    assert isinstance(EchoProtocol(ServerState()), BufferedProtocol)
    assert not isinstance(ScriptedProtocol(ServerState(), None), BufferedProtocol)


def test_connection_properties(reactor: EPollReactor) -> None:
    port, state = listen(reactor, ScriptedProtocol)
    with connect(port):
        (proto,) = state.wait_protocols(1)
        transport = proto.transport
        assert isinstance(transport, FastServer)
        assert blockingCallFromThread(reactor, transport.getTcpNoDelay)
        assert transport.queued_bytes == 0


def test_write_non_byte_format_memoryviews(reactor: EPollReactor) -> None:
    floats = array.array("f", [i / 7 for i in range(10_001)])
    doubles = array.array("d", [-i * 1.5 for i in range(333)])
    grid = memoryview(bytearray(range(48))).cast("B", (6, 8))  # 2-D, C-contiguous
    expected = floats.tobytes() + doubles.tobytes() + grid.tobytes() + doubles.tobytes()

    def script(transport: FastServer) -> None:
        transport.write(memoryview(floats))
        transport.writeSequence([memoryview(doubles), grid])
        transport.write(doubles)  # the array itself, not a view of it
        # Write-through may already have sent some; never more than was written.
        assert 0 <= transport.queued_bytes <= len(expected)
        transport.loseConnection()

    port, _ = listen(reactor, ScriptedProtocol, script)
    with connect(port) as sock:
        assert recv_until_eof(sock) == expected


def test_write_bytearray_and_mixed_sequence(reactor: EPollReactor) -> None:
    first = bytearray(os.urandom(300_000))
    parts = [
        b"abc",
        bytearray(b"def"),
        memoryview(b"0123456789")[2:7],
        b"",
        bytearray(),
    ]
    expected = bytes(first) + b"abcdef23456"

    def script(transport: FastServer) -> None:
        transport.write(first)
        transport.write(b"")  # no-op
        transport.writeSequence(iter(parts))  # any iterable, not only lists
        transport.loseConnection()

    port, _ = listen(reactor, ScriptedProtocol, script)
    with connect(port) as sock:
        assert recv_until_eof(sock) == expected


def test_write_rejects_non_bytes_like(reactor: EPollReactor) -> None:
    port, state = listen(reactor, ScriptedProtocol)
    with connect(port):
        (proto,) = state.wait_protocols(1)
        transport = proto.transport
        for bad in ["text", 42, memoryview(b"abcdef")[::2]]:
            with pytest.raises(TypeError):
                blockingCallFromThread(reactor, transport.write, bad)
        # A bad item anywhere in a sequence queues nothing.
        with pytest.raises(TypeError):
            blockingCallFromThread(reactor, transport.writeSequence, [b"ok", "bad"])
        assert transport.queued_bytes == 0


def test_many_buffers_and_partial_sends(reactor: EPollReactor) -> None:
    """More buffers than one sendmsg takes, and byte caps that split buffers."""
    rng = random.Random(99)
    chunks = [rng.randbytes(rng.randrange(1, 3000)) for _ in range(3000)]

    def script(transport: FastServer) -> None:
        # Tiny per-call caps force many sendmsg calls, each ending mid-buffer.
        transport.SEND_MAX_BYTES = 7777
        transport.SEND_MAX_BUFFERS = 5
        transport.writeSequence(chunks[:1500])
        for chunk in chunks[1500:]:
            transport.write(memoryview(chunk))
        transport.loseConnection()

    port, _ = listen(reactor, ScriptedProtocol, script)
    with connect(port) as sock:
        assert recv_until_eof(sock) == b"".join(chunks)


def test_lose_connection_flushes_large_write_sequence(reactor: EPollReactor) -> None:
    payload = os.urandom(48 * MIB)
    view = memoryview(payload)
    queued_before_close: list[int] = []

    def script(transport: FastServer) -> None:
        transport.writeSequence([view[i : i + 3 * MIB] for i in range(0, len(view), 3 * MIB)])
        queued_before_close.append(transport.queued_bytes)
        transport.loseConnection()

    port, state = listen(reactor, ScriptedProtocol, script)
    with connect(port) as sock:
        received = recv_until_eof(sock)

    # Write-through sends what the socket takes at once; 48 MiB cannot all fit, so most of
    # it is still queued when loseConnection() is called, and must still arrive whole.
    assert 0 < queued_before_close[0] <= len(payload)
    assert len(received) == len(payload)
    assert received == payload
    (proto,) = state.wait_protocols(1)
    state.wait_for(lambda: proto.lost_reason is not None, "connectionLost")
    assert proto.lost_reason.check(twisted_error.ConnectionDone)


def test_lose_write_connection_half_close(reactor: EPollReactor) -> None:
    def script(transport: FastServer) -> None:
        transport.write(bytearray(b"hello"))
        transport.loseWriteConnection()

    port, state = listen(reactor, ScriptedProtocol, script)
    with connect(port) as sock:
        assert recv_until_eof(sock) == b"hello"  # EOF from the server's shutdown(SHUT_WR)
        sock.sendall(b"still reading")
        (proto,) = state.wait_protocols(1)
        state.wait_for(lambda: bytes(proto.received) == b"still reading", "data after half-close")
        transport = proto.transport
        # Writes after a half-close are ignored, like the stock transport.
        blockingCallFromThread(reactor, transport.write, b"ignored")
        assert transport.queued_bytes == 0


@pytest.mark.parametrize("how", ["reset", "close"])
def test_client_disconnects_mid_body(reactor: EPollReactor, how: str) -> None:
    port, state = listen(reactor, EchoProtocol)
    partial = 300_000

    sock = connect(port)
    try:
        sock.sendall(PREFIX.pack(MIB) + os.urandom(partial))
        (proto,) = state.wait_protocols(1)
        state.wait_for(lambda: proto.body_bytes_received == partial, "partial body")
        assert proto.buffer_updated_calls >= 1  # the body was being recv_into'd
        if how == "reset":
            # SO_LINGER 0: close() sends RST instead of FIN.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    finally:
        sock.close()

    state.wait_for(lambda: proto.lost_reason is not None, "connectionLost")
    expected = twisted_error.ConnectionLost if how == "reset" else twisted_error.ConnectionDone
    assert proto.lost_reason.check(expected)
    assert proto.frames == 0
    assert proto.late_write_queued == 0  # writes after connectionLost were ignored

    # The port keeps serving new connections.
    body = os.urandom(2 * MIB)
    assert echo_round_trip(port, body) == frame(body)
    state.wait_protocols(2)


def test_plain_protocol_uses_stock_read_path(reactor: EPollReactor) -> None:
    port, _ = listen(reactor, PlainEchoProtocol)
    payload = os.urandom(2 * MIB)
    with connect(port) as sock:
        sock.sendall(payload)
        assert recv_exact(sock, len(payload)) == payload


def test_pull_producer(reactor: EPollReactor) -> None:
    """FileSender is a non-streaming producer: it writes when asked for more."""
    payload = os.urandom(5 * MIB + 123)
    done = threading.Event()

    def script(transport: FastServer) -> None:
        d = FileSender().beginFileTransfer(io.BytesIO(payload), transport)
        d.addCallback(lambda _: done.set())
        d.addCallback(lambda _: transport.loseConnection())

    port, _ = listen(reactor, ScriptedProtocol, script)
    with connect(port) as sock:
        assert recv_until_eof(sock) == payload
    assert done.is_set()


@implementer(IPushProducer)
class ChunkPusher:
    """A streaming producer writing fixed chunks until paused, then finishing."""

    def __init__(self, transport: FastServer, payload: bytes, chunk: int) -> None:
        self.transport = transport
        self.view = memoryview(payload)
        self.chunk = chunk
        self.pos = 0
        self.paused = False
        self.pauses = 0
        self.resumes = 0
        self.max_queued = 0

    def start(self) -> None:
        self.transport.registerProducer(self, True)
        self._produce()

    def _produce(self) -> None:
        while not self.paused and self.pos < len(self.view):
            self.transport.write(self.view[self.pos : self.pos + self.chunk])
            self.pos += self.chunk
            self.max_queued = max(self.max_queued, self.transport.queued_bytes)
        if self.pos >= len(self.view):
            self.transport.unregisterProducer()
            self.transport.loseConnection()

    def pauseProducing(self) -> None:
        self.paused = True
        self.pauses += 1

    def resumeProducing(self) -> None:
        self.paused = False
        self.resumes += 1
        self._produce()

    def stopProducing(self) -> None:
        self.paused = True


def test_streaming_producer_is_paused_and_resumed(reactor: EPollReactor) -> None:
    payload = os.urandom(16 * MIB)
    pushers: list[ChunkPusher] = []

    def script(transport: FastServer) -> None:
        pusher = ChunkPusher(transport, payload, 256 * 1024)
        pushers.append(pusher)
        pusher.start()

    port, _ = listen(reactor, ScriptedProtocol, script)
    with connect(port) as sock:
        # Read nothing until the kernel's buffers are full and the transport paused the
        # producer (a reader as fast as the writer would never let the queue grow).
        wait_until(lambda: bool(pushers) and pushers[0].pauses >= 1, what="a pause")
        assert recv_until_eof(sock) == payload

    (pusher,) = pushers
    assert pusher.pauses >= 1 and pusher.resumes >= 1
    # Paused as soon as the queue exceeded bufferSize: at most one chunk over.
    assert pusher.max_queued <= FastServer.bufferSize + pusher.chunk


def test_abort_connection_drops_queued_data(reactor: EPollReactor) -> None:
    payload = os.urandom(32 * MIB)  # far more than the kernel buffers can hold

    port, state = listen(reactor, ScriptedProtocol, lambda transport: transport.write(payload))
    with connect(port) as sock:
        (proto,) = state.wait_protocols(1)
        transport = proto.transport
        # The client is not reading, so most of the payload is still queued.
        assert blockingCallFromThread(reactor, lambda: transport.queued_bytes) > 0
        blockingCallFromThread(reactor, transport.abortConnection)
        try:
            received = recv_until_eof(sock)
        except ConnectionResetError:
            received = b""
    assert len(received) < len(payload)
    state.wait_for(lambda: proto.lost_reason is not None, "connectionLost")
    assert proto.lost_reason.check(twisted_error.ConnectionAborted)
    assert transport.queued_bytes == 0  # the queued buffers were released


def test_small_write_is_sent_at_once(reactor: EPollReactor) -> None:
    # Write-through: with nothing queued, a small reply leaves in the write() call itself,
    # without waiting for the reactor's next pass.
    queued_after_write: list[int] = []

    def script(transport: FastServer) -> None:
        transport.writeSequence([b"head", memoryview(b"-body")])
        queued_after_write.append(transport.queued_bytes)
        transport.loseConnection()

    port, _ = listen(reactor, ScriptedProtocol, script)
    with connect(port) as sock:
        assert recv_until_eof(sock) == b"head-body"
    assert queued_after_write == [0]


def test_the_servers_queued_total_is_kept_by_the_transports() -> None:
    """``held_bytes`` is asked on every write: the bytes queued on all connections are a
    running total that the transports keep, equal at every moment to the sum over the
    connections, and back to zero once they are gone (however they ended)."""
    import torch

    from tensorshare import Client
    from tensorshare.server import EmbeddedServer
    from tensorshare.wire.messages import Hello
    from tests.rawwire import Peek, WireClient

    def totals(server: EmbeddedServer) -> tuple[int, int]:
        f = server.factory
        return server.call(lambda: (f.queued_bytes(),
                                    sum(p.queued_bytes for p in f.connections)))

    with EmbeddedServer(0) as server, Client("127.0.0.1", server.port, timeout=30) as c:
        c.put("big", torch.zeros(1 << 20))  # 4 MiB
        slow: list[socket.socket] = []
        for _ in range(6):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            wire = WireClient()
            sock.sendall(b"".join(bytes(x) for x in wire.send(Hello(wire.next_id(), (1,), "x"))))
            for _ in range(4):  # peeks whose replies this client never reads
                sock.sendall(b"".join(bytes(x) for x in wire.send(Peek(wire.next_id(), "big"))))
            slow.append(sock)
        wait_until(lambda: totals(server)[1] > 6 * (4 << 20), timeout=30,
                   what="the unread replies to queue up")
        queued, summed = totals(server)
        assert queued == summed
        slow[0].shutdown(socket.SHUT_RDWR)  # some end at once, the others with a reset
        for sock in slow:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        wait_until(lambda: server.call(lambda: len(server.factory.connections)) == 1,
                   timeout=30, what="the slow connections to end")
        assert totals(server) == (0, 0)
        c.put("big", torch.ones(4))  # the server works on, its total exact
        assert totals(server)[0] == totals(server)[1] == 0


class _Boom(Exception):
    """What RaisingProtocol raises (a bug in application code)."""


class RaisingProtocol(Protocol):
    """Echoes, but raises on a read that starts with b"boom" (a bug in application code)."""

    def __init__(self, state: ServerState, script: object = None) -> None:
        self.state = state
        self.lost: Any = None

    def connectionMade(self) -> None:
        self.state.protocols.append(self)
        self.state.changed()

    def dataReceived(self, data: bytes) -> None:
        if bytes(data).startswith(b"boom"):
            raise _Boom("a bug in the application's read")
        self.transport.write(bytes(data))  # type: ignore[union-attr]

    def connectionLost(self, reason: Failure = twisted_error.ConnectionDone) -> None:  # type: ignore[assignment]
        self.lost = reason
        self.state.changed()


def test_an_error_in_a_read_drops_that_connection_only(reactor: EPollReactor) -> None:
    """On either reactor, a protocol that raises while handling a read loses its own
    connection (the error is logged), and every other connection carries on."""
    reactor.expected_failures.append(_Boom)  # type: ignore[attr-defined]
    port, state = listen(reactor, RaisingProtocol)
    good, bad = connect(port), connect(port)
    protos = state.wait_protocols(2)
    bad.sendall(b"boom")
    state.wait_for(lambda: any(p.lost is not None for p in protos), "the bad connection lost")
    assert bad.recv(16) == b""  # closed by the server
    good.sendall(b"still here")
    assert recv_exact(good, 10) == b"still here"
    assert sum(p.lost is None for p in protos) == 1
    good.close()
    bad.close()
