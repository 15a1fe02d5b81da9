"""Tests for tensorshare.txclient: the Twisted client.

Most tests run the real ServerFactory and the client protocol over in-memory transports
(``twisted.test.iosim``), with fake clocks for every timer: no sockets, no waiting. Two tests
use real loopback sockets with an EmbeddedServer and a private client reactor in a thread;
they wait on Events with a deadline, never on a sleep.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from twisted.internet import defer
from twisted.internet.epollreactor import EPollReactor
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import globalLogPublisher
from twisted.python.failure import Failure
from twisted.test import iosim

from tensorshare import Client
from tensorshare.client.ops import NOWAIT, FetchResult
from tensorshare.client.twisted import TxClient, connect
from tensorshare.errors import (
    BinNotFound,
    ConnectError,
    ConnectionLost,
    MemoryLimitExceeded,
    ReplyTimeout,
    SessionLost,
    UnsupportedType,
    UnsupportedVersion,
    WaitTimeout,
)
from tensorshare.memory import shm
from tensorshare.server import EmbeddedServer
from tensorshare.server.core import ServerFactory
from tensorshare.wire.messages import (
    Bye,
    Cancel,
    ErrorReply,
    Fetch,
    Hello,
    HelloReply,
    Limits,
    Ping,
    Put,
)
from tests.rawwire import ServerWire, server_frames

WAIT = 30.0  # safety deadline for the loopback tests; never reached when things work
ADDRESS = ("memory", 1)
QUIET = 1e6  # a heartbeat that never comes during a test on a fake clock


# ------------------------------------------------------------------------------- helpers


def fired(d: defer.Deferred[Any]) -> bool:
    return bool(d.called)


def success(d: defer.Deferred[Any]) -> Any:
    """The result of an already fired Deferred (raises its failure)."""
    out: list[Any] = []
    d.addBoth(out.append)
    assert out, "the Deferred has not fired"
    if isinstance(out[0], Failure):
        out[0].raiseException()
    return out[0]


def failure(d: defer.Deferred[Any], *types: type[BaseException]) -> BaseException:
    """The exception of an already failed Deferred, checked against ``types``."""
    out: list[Any] = []
    d.addBoth(out.append)
    assert out, "the Deferred has not fired"
    assert isinstance(out[0], Failure), f"expected a failure, got {out[0]!r}"
    assert out[0].check(*types), out[0].getTraceback()
    return out[0].value


class Memory:
    """A ServerFactory on a fake clock, and helpers to attach in-memory clients to it.

    Each client's connector attaches a new in-memory connection to the factory, so a client
    that loses its connection reconnects here too (when its retry timer fires).
    """

    def __init__(self, limits: Limits | None = None, max_memory: int | None = None) -> None:
        self.server_clock = MemoryReactorClock()
        self.factory = ServerFactory(self.server_clock, limits, max_memory)
        self.pumps: list[iosim.IOPump] = []
        self.refuse = False  # the server is "down": connection attempts fail

    def attach(self, client: TxClient) -> None:
        if self.refuse:
            client._connect_failed("connection refused")
            return
        proto = client.make_protocol()
        server_proto = self.factory.buildProtocol(None)
        pump = iosim.connect(server_proto, iosim.makeFakeServer(server_proto),
                             proto, iosim.makeFakeClient(proto), greet=True)
        self.pumps.append(pump)

    def client(self, clock: Clock | None = None, **kw: Any) -> tuple[TxClient, iosim.IOPump]:
        kw.setdefault("heartbeat", QUIET)
        client = TxClient(clock or Clock(), *ADDRESS, connector=self.attach, **kw)
        d = client.start()
        self.flush()
        return success(d), self.pumps[-1]

    @staticmethod
    def cut(pump: iosim.IOPump) -> None:
        """The server gets what the client wrote, then the connection dies before any reply
        reaches the client (the replies are lost in transit)."""
        requests = pump.clientIO.getOutBuffer()
        pump.serverIO.bufferReceived(requests)
        pump.serverIO.getOutBuffer()  # lost
        pump.clientIO.loseConnection()
        pump.flush()

    def flush(self) -> None:
        """Pump every connection until no bytes move on any (one can cause writes on another)."""
        for _ in range(100):
            moved = [pump.flush() for pump in self.pumps]
            if not any(moved):
                return
        raise AssertionError("the connections never went quiet")

    def run(self, d: defer.Deferred[Any]) -> Any:
        """Move bytes until nothing moves; return the Deferred's result."""
        self.flush()
        return success(d)

    def run_fail(self, d: defer.Deferred[Any], *types: type[BaseException]) -> BaseException:
        self.flush()
        return failure(d, *types)


@pytest.fixture
def mem() -> Memory:
    return Memory()


@pytest.fixture
def logged_failures() -> Iterator[list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []

    def observer(event: dict[str, Any]) -> None:
        if "log_failure" in event:
            events.append(event)

    globalLogPublisher.addObserver(observer)
    try:
        yield events
    finally:
        globalLogPublisher.removeObserver(observer)


def server_bytes(*msgs: Any) -> bytes:
    """Frames as the server would send them."""
    return server_frames(*msgs)


def sent_requests(transport: StringTransport) -> list[Any]:
    """Parse what a client wrote to a StringTransport, as the server would."""
    conn = ServerWire()
    conn.handshake_done()
    return [m for m in conn.receive_data(transport.value()) if type(m).__name__ != "AckInfo"]


def string_client(timeout: float = 30.0, **kw: Any) -> tuple[TxClient, StringTransport, Clock]:
    """A client on a transport that swallows writes: the server never answers by itself."""
    clock = Clock()
    transport = StringTransport()

    def attach(client: TxClient) -> None:
        client.make_protocol().makeConnection(transport)

    kw.setdefault("heartbeat", QUIET)
    client = TxClient(clock, *ADDRESS, timeout=timeout, connector=attach, **kw)
    client.start()
    return client, transport, clock


def hello_reply(**kw: Any) -> bytes:
    return server_bytes(HelloReply(1, 1, "tensorshare/test", Limits(), **kw))


def sample() -> dict[str, Any]:
    return {
        "w": torch.randn(4, 5),
        "ids": torch.arange(7, dtype=torch.int64),
        "half": torch.ones(3, dtype=torch.bfloat16),
        "meta": {"step": 3, "name": "x", "rows": [1.5, None, b"raw"]},
    }


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for key in ("w", "ids", "half"):
        assert got[key].dtype == want[key].dtype
        assert got[key].shape == want[key].shape
        assert torch.equal(got[key], want[key])
    assert got["meta"] == want["meta"]


# ------------------------------------------------------------------------ in memory


def test_handshake_adopts_the_server_limits() -> None:
    limits = Limits(max_frame_bytes=1 << 20, max_header_bytes=1 << 16, max_depth=8,
                    max_name_bytes=16)
    mem = Memory(limits)
    client, _ = mem.client()
    assert client.limits == limits
    assert client.session.conn is not None and client.session.conn.limits == limits
    assert client.protocol_version == 1
    assert client.server_version.startswith("tensorshare/")
    assert client.address == "memory:1"
    assert not client.closed
    with pytest.raises(ValueError, match="max_name_bytes=16"):
        client.put("n" * 17, 1)  # a local mistake raises before anything is sent
    assert mem.run(client.ping()) is None


def test_put_peek_get_round_trip(mem: Memory) -> None:
    client, _ = mem.client()
    value = sample()
    assert mem.run(client.put("weights", value)) == 1
    assert_same(mem.run(client.peek("weights")), value)
    assert_same(mem.run(client.get("weights")), value)
    mem.run_fail(client.get("weights"), BinNotFound)


def test_lz4_compressed_round_trip(mem: Memory) -> None:
    client, _ = mem.client(compress="lz4", compress_min_bytes=1024)
    t = torch.zeros(64 * 1024, dtype=torch.float32)
    t[::7] = 1.0
    mem.run(client.put("z", t))
    got = mem.run(client.get("z"))
    assert got.dtype == torch.float32 and torch.equal(got, t)


def test_append_twice_then_get_gives_a_list(mem: Memory) -> None:
    client, _ = mem.client()
    assert mem.run(client.append("q", torch.tensor([1, 2]), tag=7)) == 1
    assert mem.run(client.append("q", {"b": torch.tensor([3.0])})) == 2
    result = mem.run(client.fetch("q", remove=False))
    assert isinstance(result, FetchResult)
    assert result.kind == "list" and result.tags == (7, None) and result.n_items == 2
    items = mem.run(client.get("q"))
    assert isinstance(items, list) and len(items) == 2
    assert torch.equal(items[0], torch.tensor([1, 2]))
    assert torch.equal(items[1]["b"], torch.tensor([3.0]))


def test_get_of_a_missing_bin_errbacks_bin_not_found(mem: Memory) -> None:
    client, _ = mem.client()
    exc = mem.run_fail(client.get("nothing-here"), BinNotFound)
    assert "nothing-here" in str(exc)
    mem.run_fail(client.peek("nothing-here"), BinNotFound)


def test_list_and_delete(mem: Memory) -> None:
    client, _ = mem.client()
    assert mem.run(client.list()) == {}
    mem.run(client.put("a", 1))
    mem.run(client.append("b", 2))
    mem.run(client.append("b", 3))
    assert mem.run(client.list()) == {"a": 1, "b": 2}
    assert mem.run(client.delete("a")) is True
    assert mem.run(client.delete("a")) is False
    assert mem.run(client.list()) == {"b": 2}


def test_server_errors_keep_their_type() -> None:
    mem = Memory(max_memory=1024)
    client, _ = mem.client()
    exc = mem.run_fail(client.put("big", torch.zeros(1024)), MemoryLimitExceeded)
    assert "max_memory=1024" in str(exc)
    assert mem.run(client.list()) == {}


def test_local_mistakes_raise_synchronously(mem: Memory) -> None:
    client, _ = mem.client()
    with pytest.raises(UnsupportedType):
        client.put("x", {"bad": object()})
    with pytest.raises(TypeError):
        client.append("x", 1, tag="7")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        client.get("x", timeout=-1)
    with pytest.raises(ValueError):
        client.delete("")
    assert mem.run(client.list()) == {}  # nothing was sent


def test_listen_gets_every_change_in_order(mem: Memory, logged_failures: list[Any]) -> None:
    client, _ = mem.client()
    other, _ = mem.client()
    events: list[dict[str, Any]] = []

    def broken(event: dict[str, Any]) -> None:
        raise RuntimeError("callback bug")

    def broken_later(event: dict[str, Any]) -> defer.Deferred[None]:
        return defer.fail(RuntimeError("callback bug"))

    assert mem.run(client.listen("ev", broken)) is None
    assert fired(client.listen("ev", broken_later))  # the bin is listened to already
    assert mem.run(client.listen("ev", events.append)) is None
    mem.run(other.put("ev", torch.ones(2)))
    mem.run(other.append("ev", torch.ones(2)))
    mem.run(client.get("ev"))
    mem.run(other.put("ev", 5))
    mem.run(other.delete("ev"))
    assert [e["op"] for e in events] == ["put", "append", "get", "put", "delete"]
    versions = [e["version"] for e in events]
    assert versions == sorted(set(versions))  # strictly increasing
    assert all(e["status"] == "OK" and e["bin"] == "ev" for e in events)
    assert [e["n_items"] for e in events[:3]] == [1, 2, 0]
    # Both broken callbacks were logged once per event and broke nothing.
    assert len(logged_failures) == 10
    assert all(e["log_failure"].check(RuntimeError) for e in logged_failures)

    assert mem.run(client.unlisten("ev")) is True
    assert mem.run(client.unlisten("ev")) is False
    mem.run(other.put("ev", 6))
    assert len(events) == 5


def test_waiting_get_is_served_by_a_later_put(mem: Memory) -> None:
    clock = Clock()
    waiter, _ = mem.client(clock)
    writer, _ = mem.client()
    d = waiter.get("jobs", timeout=5)
    mem.flush()
    assert not fired(d)
    mem.run(writer.put("jobs", {"t": torch.arange(3)}))
    got = mem.run(d)
    assert torch.equal(got["t"], torch.arange(3))
    # the reply timer was cancelled: only the (far away) heartbeat is left
    assert all(c.getTime() >= QUIET for c in clock.getDelayedCalls())


def test_waiting_get_times_out_on_the_server_clock(mem: Memory) -> None:
    client, _ = mem.client()
    d = client.get("empty", timeout=2)
    mem.flush()
    mem.server_clock.advance(1.9)
    mem.flush()
    assert not fired(d)
    mem.server_clock.advance(0.1)
    exc = mem.run_fail(d, WaitTimeout)
    assert "within 2 s" in str(exc)
    assert mem.run(client.ping()) is None  # the connection is still fine


def test_cancelling_a_waiting_get_cancels_it_on_the_server(mem: Memory) -> None:
    client, _ = mem.client()
    d = client.get("slot", timeout=None)
    mem.flush()
    d.cancel()
    mem.run_fail(d, defer.CancelledError)
    mem.run(client.put("slot", 42))
    # Had the waiter survived, it would have taken the value.
    assert mem.run(client.peek("slot")) == 42


def test_reply_timeout_when_the_server_never_answers() -> None:
    client, transport, clock = string_client(timeout=10)
    client.protocol.dataReceived(hello_reply())
    assert success(client.ready) is client
    put = client.put("x", torch.ones(3))
    wait = client.get("y", timeout=5)
    clock.advance(9.9)
    assert not fired(put) and not fired(wait)
    clock.advance(0.1)
    exc = failure(put, ReplyTimeout)
    assert "memory:1" in str(exc) and "put to bin 'x'" in str(exc)
    assert "may or may not have taken effect" in str(exc)
    assert not fired(wait)  # a waiting get gets its wait time on top
    clock.advance(5)
    failure(wait, ReplyTimeout)
    sent = sent_requests(transport)
    assert [type(m) for m in sent] == [Hello, Put, Fetch, Cancel]
    get = sent[2]
    assert get.spec.wait and get.spec.timeout == 5
    assert sent[3].target == get.id  # the timed out wait was cancelled on the server
    # What is left: the abandoned get, kept until its cancel is answered, and the cancel.
    assert client.session.pending == 2
    # A late reply to the abandoned request is ignored; the cancel's reply settles it.
    client.protocol.dataReceived(server_bytes(ErrorReply(get.id, "timeout", "late"),
                                              *[]))
    client.protocol.dataReceived(server_bytes(
        __import__("tensorshare.wire.messages").wire.messages.Acked(sent[3].id, True)))
    assert client.session.pending == 0 and not client.closed


def test_waiting_without_limit_has_no_reply_timer() -> None:
    client, _, clock = string_client(timeout=10, reconnect=False)
    client.protocol.dataReceived(hello_reply())
    d = client.get("y", timeout=None)
    assert all(c.getTime() >= QUIET for c in clock.getDelayedCalls())
    client.protocol.connectionLost(Failure(ConnectionLost("gone")))
    failure(d, ConnectionLost)


def test_handshake_timeout_is_a_connect_error() -> None:
    client, transport, clock = string_client(timeout=3)
    clock.advance(3)
    exc = failure(client.ready, ConnectError)
    assert "memory:1" in str(exc)
    assert transport.disconnecting


def test_a_refused_handshake_fails_with_its_typed_error() -> None:
    client, transport, _ = string_client()
    client.protocol.dataReceived(server_bytes(ErrorReply(1, "unsupported_version",
                                                         "no common version")))
    exc = failure(client.ready, UnsupportedVersion)
    assert "no common version" in str(exc)
    assert transport.disconnecting


def test_garbage_from_the_server_drops_the_connection() -> None:
    client, transport, _ = string_client(reconnect=False)
    client.protocol.dataReceived(hello_reply())
    d = client.ping()
    client.protocol.dataReceived(b"\xff" * 64)
    assert transport.disconnecting or client.protocol is None
    client.protocol and client.protocol.connectionLost(Failure(ConnectionLost("aborted")))
    exc = failure(d, ConnectionLost)
    assert "protocol error" in str(exc)
    assert client.closed


def test_without_reconnect_a_lost_connection_errbacks_every_pending_request(
        mem: Memory) -> None:
    client, pump = mem.client(reconnect=False)
    pending = [client.put("a", torch.ones(2)), client.get("b", timeout=None), client.ping()]
    assert not any(fired(d) for d in pending)
    pump.server.transport.loseConnection()
    mem.flush()
    for d in pending:
        exc = failure(d, ConnectionLost)
        assert "memory:1" in str(exc)
        assert "the server closed the connection" in str(exc)
    assert client.closed
    after = client.list()
    assert fired(after)  # errbacks at once
    assert "cannot send list" in str(failure(after, ConnectionLost))
    assert mem.factory.connections == set()


def test_a_dropped_connection_is_resumed_and_nothing_runs_twice(mem: Memory) -> None:
    clock = Clock()
    client, pump = mem.client(clock)
    other, _ = mem.client()
    mem.run(client.append("q", 1))
    events: list[dict[str, Any]] = []
    mem.run(client.listen("w", events.append))
    # Requests are written, then the connection dies before any reply comes back.
    pending = [client.append("q", 2), client.append("q", 3), client.get("q", max_items=1)]
    mem.cut(pump)
    assert not client.connected and not any(fired(d) for d in pending)
    mem.run(other.put("w", "changed while away"))
    clock.advance(5)  # the backoff timer: reconnect, resume, resend
    mem.flush()
    assert client.connected
    assert [success(d) for d in pending] == [2, 3, [1]]
    assert mem.run(other.get("q")) == [2, 3]  # each append stored once
    assert mem.factory.stats.counters["replayed"] == 3
    assert [e["op"] for e in events] == ["resync"] and events[0]["version"] == 1


def test_a_server_that_forgot_the_session_fails_unknown_outcomes_with_session_lost(
        mem: Memory) -> None:
    clock = Clock()
    client, pump = mem.client(clock)
    put = client.put("x", 1)
    peek = client.peek("nothing-here")
    mem.cut(pump)
    mem.factory.sessions.close(mem.factory.sessions.get(client.session.session_id))
    clock.advance(5)
    mem.flush()
    exc = failure(put, SessionLost)
    assert "put to bin 'x'" in str(exc) and "may or may not" in str(exc)
    failure(peek, BinNotFound)  # a read is simply resent
    assert mem.run(client.put("y", 2)) == 1  # and new requests work


def test_calls_made_while_disconnected_wait_and_then_time_out(mem: Memory) -> None:
    clock = Clock()
    client, pump = mem.client(clock, timeout=10)
    mem.refuse = True
    pump.server.transport.loseConnection()
    mem.flush()
    d = client.put("x", 1)
    clock.advance(9.9)
    assert not fired(d)
    clock.advance(0.2)
    exc = failure(d, ConnectionLost)
    assert "not sent" in str(exc) and "unreachable for" in str(exc)
    mem.refuse = False
    clock.advance(5)
    mem.flush()
    assert mem.run(client.put("x", 2)) == 1  # never stored twice: the first was not sent


def test_reconnect_gives_up_after_the_given_seconds(mem: Memory) -> None:
    clock = Clock()
    client, pump = mem.client(clock, reconnect=3.0)
    mem.refuse = True
    d = client.get("x", timeout=None)
    mem.flush()
    pump.server.transport.loseConnection()
    mem.flush()
    for _ in range(40):
        clock.advance(0.25)
    exc = failure(d, ConnectionLost)
    assert "gave up" in str(exc)
    assert client.closed


def test_close_fails_pending_requests_and_fires(mem: Memory) -> None:
    client, _ = mem.client()
    waiting = client.get("never", timeout=None)
    mem.flush()
    closing = client.close()
    assert "was closed" in str(failure(waiting, ConnectionLost))  # at once
    assert not fired(closing)
    mem.flush()
    assert success(closing) is None
    assert mem.factory.connections == set()
    assert success(client.close()) is None  # idempotent
    failure(client.ping(), ConnectionLost)


def test_connect_with_a_memory_reactor() -> None:
    reactor = MemoryReactorClock()
    factory = ServerFactory(reactor)
    reactor.listenTCP(8000, factory)
    d = connect(reactor, "127.0.0.1", 8000, name="memory-test")
    assert reactor.tcpClients[0][:2] == ("127.0.0.1", 8000)
    pump = iosim.ConnectionCompleter(reactor).succeedOnce()
    assert pump is not None
    client = success(d)
    assert isinstance(client, TxClient) and client.address == "127.0.0.1:8000"
    ping = client.ping()
    pump.flush()
    assert success(ping) is None
    reactor.advance(31)  # the connect timer was cancelled: nothing fails
    assert not client.closed


def test_connect_refused_is_a_connect_error_at_once_without_reconnect() -> None:
    reactor = MemoryReactorClock()
    d = connect(reactor, "127.0.0.1", 8000, reconnect=False)
    iosim.ConnectionCompleter(reactor).failOnce()
    exc = failure(d, ConnectError)
    assert "127.0.0.1:8000" in str(exc)


def test_with_reconnect_the_first_connection_is_retried_until_the_timeout() -> None:
    reactor = MemoryReactorClock()
    d = connect(reactor, "127.0.0.1", 8000, timeout=2)
    attempts = 0
    while not fired(d):
        while reactor.tcpClients:
            iosim.ConnectionCompleter(reactor).failOnce()
            attempts += 1
        reactor.advance(0.05)
    exc = failure(d, ConnectError)
    assert "127.0.0.1:8000" in str(exc) and attempts > 3


def test_connect_timeout_is_a_connect_error() -> None:
    reactor = MemoryReactorClock()
    d = connect(reactor, "10.255.255.1", 8000, timeout=4)
    reactor.advance(3.9)
    assert not fired(d)
    reactor.advance(0.1)
    exc = failure(d, ConnectError)
    assert "10.255.255.1:8000" in str(exc) and "4 s" in str(exc)


def test_nowait_is_the_default() -> None:
    # A get without timeout must not wait on the server.
    client, transport, _ = string_client()
    client.protocol.dataReceived(hello_reply())
    client.get("x")
    client.peek("x", timeout=NOWAIT)
    client.ping()
    hello, get, peek, ping = sent_requests(transport)
    assert isinstance(hello, Hello) and hello.client == "tensorshare-twisted"
    assert not get.spec.wait and not peek.spec.wait
    assert isinstance(ping, Ping)


# ------------------------------------------------------------------------- loopback


@pytest.fixture
def client_reactor() -> Iterator[EPollReactor]:
    """A private EPollReactor running in a daemon thread."""
    r = EPollReactor()
    thread = threading.Thread(target=r.run, kwargs={"installSignalHandlers": False},
                              daemon=True, name="txclient-test-reactor")
    thread.start()
    try:
        yield r
    finally:
        r.callFromThread(r.stop)
        thread.join(WAIT)
    assert not thread.is_alive(), "the client reactor did not stop"


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    with EmbeddedServer(port=0) as srv:
        yield srv


def in_reactor(r: EPollReactor, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in the reactor thread; wait (with a deadline) for its Deferred's result."""
    done = threading.Event()
    box: list[Any] = []

    def run() -> None:
        d = defer.maybeDeferred(fn)

        def finish(result: Any) -> None:
            box.append(result)
            done.set()

        d.addBoth(finish)

    r.callFromThread(run)
    assert done.wait(WAIT), "the client reactor did not answer"
    if isinstance(box[0], Failure):
        box[0].raiseException()
    return box[0]


def test_loopback_put_and_get_1_mib(client_reactor: EPollReactor,
                                    server: EmbeddedServer) -> None:
    tensor = torch.randn(256 * 1024)  # 1 MiB of float32

    @defer.inlineCallbacks
    def scenario() -> Any:
        client = yield connect(client_reactor, "127.0.0.1", server.port, timeout=WAIT)
        version = yield client.put("big", tensor)
        got = yield client.get("big")
        bins = yield client.list()
        yield client.close()
        return version, got, bins, client.closed

    version, got, bins, closed = in_reactor(client_reactor, scenario)
    assert version == 1
    assert got.dtype == torch.float32 and got.shape == tensor.shape
    assert torch.equal(got.view(torch.int32), tensor.view(torch.int32))  # bit-exact
    assert bins == {}
    assert closed


@pytest.mark.skipif(not shm.available(), reason="needs Linux memfd seals")
def test_over_a_unix_socket_large_tensors_travel_through_shared_memory_both_ways(
        client_reactor: EPollReactor, tmp_path: Any) -> None:
    """The Twisted client passes and receives memfds as the blocking client does: a put
    stores the memfd itself (the server holds it, no bytes in the socket), a get maps the
    server's, a pipeline of 100 shared appends (more descriptors than one message passes)
    arrives whole, and the blocking client reads what it wrote."""
    path = str(tmp_path / "tx.sock")
    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    with EmbeddedServer(port=None, unix=path) as srv:

        @defer.inlineCallbacks
        def scenario() -> Any:
            client = yield connect(client_reactor, f"unix://{path}", timeout=WAIT)
            assert client.shared_memory
            yield client.put("big", big)
            stored = srv.call(lambda: [b.shm is not None for b in
                                       srv.factory.store._bins["big"].entries[0].item.value.buffers])
            got = yield client.peek("big")
            p = client.pipeline()
            for i in range(100):
                p.append("many", torch.full((1 << 18,), float(i)))
            yield p.execute()  # (a TxClient pipeline's execute fires when all are done)
            many = yield client.get("many", max_items=100)
            yield client.close()
            return stored, got, many

        stored, got, many = in_reactor(client_reactor, scenario)
        assert stored == [True]  # kept as the memfd the client wrote
        assert torch.equal(got, big)
        assert [float(t[0]) for t in many] == [float(i) for i in range(100)]
        with Client(f"unix://{path}", timeout=WAIT) as blocking:
            assert torch.equal(blocking.peek("big"), big)


def test_loopback_connection_refused(client_reactor: EPollReactor) -> None:
    # A bound socket that does not listen: connecting to it is refused, with no race.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        with pytest.raises(ConnectError, match=f"127.0.0.1:{port}"):
            in_reactor(client_reactor, lambda: connect(client_reactor, "127.0.0.1", port,
                                                       timeout=WAIT, reconnect=False))


def test_loopback_pipeline_sends_many_requests_and_fires_with_every_result(
        client_reactor: EPollReactor, server: EmbeddedServer) -> None:
    @defer.inlineCallbacks
    def scenario() -> Any:
        client = yield connect(client_reactor, "127.0.0.1", server.port, timeout=WAIT)
        p = client.pipeline(raise_on_error=False)
        for i in range(100):
            p.append("q", torch.tensor([i]))  # consecutive appends: one request
        p.put("w", {"x": 1})
        p.get("missing")
        p.peek("w")
        results = yield p.execute()
        assert results is p.results
        p2 = client.pipeline(raise_on_error=True)
        p2.get("missing")
        try:
            yield p2.execute()
        except BinNotFound as exc:
            raised = exc
        items = yield client.get("q")
        stats = yield client.stats()
        yield client.close()
        return results, raised, items, stats

    results, raised, items, stats = in_reactor(client_reactor, scenario)
    assert results[:100] == [1] * 100  # one append of 100 items: one version
    assert results[100] == 1
    assert isinstance(results[101], BinNotFound) and results[102] == {"x": 1}
    assert isinstance(raised, BinNotFound)
    assert [int(t) for t in items] == list(range(100))
    assert stats["server"]["requests"]["append"] == 1


def test_listen_and_pipeline_refuse_to_mix(mem: Memory) -> None:
    client, _ = mem.client()
    p = client.pipeline()
    with pytest.raises(TypeError, match="listen cannot be pipelined"):
        p.listen("b", lambda ev: None)


def test_close_says_bye_so_the_server_ends_the_session_at_once(mem: Memory) -> None:
    client, _ = mem.client()
    assert len(mem.factory.sessions) == 1
    closing = client.close()
    mem.flush()
    assert success(closing) is None
    assert len(mem.factory.sessions) == 0  # not kept for session_ttl


def test_close_does_not_wait_more_than_a_second_for_a_silent_server() -> None:
    client, transport, clock = string_client(timeout=10)
    client.protocol.dataReceived(hello_reply())
    assert success(client.ready) is client
    pending = client.get("y", timeout=None)
    closing = client.close()
    failure(pending, ConnectionLost)  # at once
    assert isinstance(sent_requests(transport)[-1], Bye)
    assert not fired(closing) and not transport.disconnecting
    clock.advance(1.0)  # no answer to the bye: close anyway
    assert transport.disconnecting


def test_replay_ops_on_the_twisted_client(client_reactor: EPollReactor,
                                          server: EmbeddedServer) -> None:
    """The replay ops of every face: each fires with what the blocking client returns."""

    @defer.inlineCallbacks
    def scenario() -> Any:
        client = yield connect(client_reactor, "127.0.0.1", server.port, timeout=WAIT)
        opened = yield client.replay_open("tx/replay", max_size=10, sampler="fifo")
        keys = yield client.replay_insert("tx/replay", [torch.ones(2), torch.zeros(2)],
                                          [1.0, 2.0])
        sample = yield client.replay_sample("tx/replay", 3)
        updated = yield client.replay_update("tx/replay", keys, [0.5, 0.5])
        info = yield client.replay_info("tx/replay")
        yield client.close()
        return opened, keys, sample, updated, info

    opened, keys, sample, updated, info = in_reactor(client_reactor, scenario)
    assert opened.created and keys == [1, 2] and updated == 2
    items, drawn, probs, size = sample
    assert items.tolist() == [[1.0, 1.0]] * 3 and drawn.tolist() == [1, 1, 1] and size == 2
    assert info.size == 2 and info.stats["samples"] == 3
