"""Tests for tensorshare.server: ServerFactory/ServerProtocol on in-memory transports.

Every connection is a ``ServerProtocol`` on a ``StringTransport``; requests are frames built
by a ``WireClient`` and written into ``dataReceived``; what the server wrote is parsed back
with the same ``WireClient`` (which knows the ops of the requests it sent).
Timers run on a ``MemoryReactorClock``: no sockets, no real time.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import globalLogPublisher
from twisted.python.failure import Failure

from tensorshare.server import ServerConfig
from tensorshare.server.connection import ServerProtocol
from tensorshare.server.core import ServerFactory
from tensorshare.server.sessions import SessionTable
from tensorshare.wire import codec
from tensorshare.wire.messages import (
    Acked,
    Append,
    Cancel,
    Changed,
    Configure,
    Configured,
    Delete,
    Deleted,
    ErrorReply,
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
    Stats,
    StatsReply,
    Stored,
    Unlisten,
)
from tensorshare.wire.protocol import PROTOCOL_VERSIONS, AckInfo
from tests.rawwire import Get, Peek, WireClient

# ------------------------------------------------------------------------------- helpers


class Peer:
    """One client connection to the factory, over a StringTransport."""

    _ports = iter(range(40000, 50000))

    def __init__(self, factory: ServerFactory, *, hello: bool = True,
                 session: bytes | None = None, resume: bool = False,
                 conn: WireClient | None = None) -> None:
        self.factory = factory
        addr = IPv4Address("TCP", "127.0.0.1", next(self._ports))
        self.proto: ServerProtocol = factory.buildProtocol(addr)
        self.transport = StringTransport(peerAddress=addr)
        self.proto.makeConnection(self.transport)
        self.conn = conn or WireClient()  # a reconnecting client keeps its ids
        self.hello: HelloReply | None = None
        if hello:
            reply = self.request(Hello(self.rid(), PROTOCOL_VERSIONS, "test", None, session,
                                       resume))
            assert type(reply) is HelloReply, reply
            self.hello = reply

    def rid(self) -> int:
        return self.conn.next_id()

    def write(self, data: bytes) -> None:
        self.proto.dataReceived(data)

    def send(self, msg: Any) -> None:
        self.write(b"".join(self.conn.send(msg)))

    def received(self) -> list[Any]:
        """Everything the server wrote since the last call, parsed."""
        data = self.transport.value()
        self.transport.clear()
        return self.conn.receive_data(data)

    def request(self, msg: Any) -> Any:
        """Send one request and return the one message the server wrote back."""
        self.send(msg)
        out = self.received()
        assert len(out) == 1, out
        return out[0]

    # conveniences
    def put(self, name: str, value: Any, tag: int | None = None) -> Any:
        return self.request(Put(self.rid(), name, Item(codec.encode(value), tag)))

    def append(self, name: str, value: Any) -> Any:
        return self.request(Append(self.rid(), name, Item(codec.encode(value))))

    def ping(self) -> None:
        rid = self.rid()
        assert self.request(Ping(rid)) == Acked(rid, True)

    def lose(self) -> None:
        self.proto.connectionLost(Failure(ConnectionDone()))


def values(reply: Fetched) -> list[Any]:
    assert type(reply) is Fetched, reply
    return [codec.decode(it.value) for it in reply.items]


def assert_error(reply: Any, rid: int, code: str, match: str = "") -> None:
    assert type(reply) is ErrorReply, reply
    assert (reply.id, reply.code) == (rid, code), reply
    assert match in reply.message, reply.message


@pytest.fixture
def clock() -> MemoryReactorClock:
    return MemoryReactorClock()


@pytest.fixture
def factory(clock: MemoryReactorClock) -> ServerFactory:
    return ServerFactory(clock)


@pytest.fixture(autouse=True)
def no_logged_failures() -> Iterator[list[dict[str, Any]]]:
    """Every test must finish without the server logging an internal error."""
    events: list[dict[str, Any]] = []

    def observer(event: dict[str, Any]) -> None:
        if "log_failure" in event:
            events.append(event)

    globalLogPublisher.addObserver(observer)
    try:
        yield events
    finally:
        globalLogPublisher.removeObserver(observer)
    assert not events, [e["log_failure"].getTraceback() for e in events]


# ------------------------------------------------------------------------------- handshake


def test_hello_reply_carries_version_and_limits(clock: MemoryReactorClock) -> None:
    limits = Limits(max_frame_bytes=1 << 20, max_header_bytes=1 << 12, max_depth=7,
                    max_name_bytes=99)
    factory = ServerFactory(clock, limits)
    peer = Peer(factory, hello=False)
    reply = peer.request(Hello(1, (1, 5), "me"))
    assert type(reply) is HelloReply
    assert reply.id == 1 and reply.version == 1 and reply.limits == limits
    assert reply.server.startswith("tensorshare/")
    assert peer.proto in factory.connections
    assert not peer.transport.disconnecting


@pytest.mark.parametrize(
    "first",
    [
        lambda c: Ping(1),
        lambda c: ListBins(1),
        lambda c: Put(1, "b", Item(codec.encode(1))),
        lambda c: Get(1, "b", wait=True, timeout=None),
    ],
    ids=["ping", "list", "put", "waiting-get"],
)
def test_first_request_must_be_hello(factory: ServerFactory, first: Any) -> None:
    peer = Peer(factory, hello=False)
    reply = peer.request(first(peer.conn))
    assert type(reply) is ErrorReply and (reply.id, reply.code) == (0, "protocol_error")
    assert "first request must be 'hello'" in reply.message
    assert peer.transport.disconnecting
    assert factory.store.list() == {} and factory.store.n_waiters == 0
    # nothing more is read from a connection being closed
    peer.send(Hello(2, (1,)))
    assert peer.received() == []


def test_a_bad_request_before_hello_also_closes(factory: ServerFactory) -> None:
    peer = Peer(factory, hello=False)
    peer.write(b"".join(WireClient().send(Delete(3, ""))))
    out = peer.received()
    assert len(out) == 1 and out[0].id == 0 and out[0].code == "protocol_error"
    assert peer.transport.disconnecting


def test_unsupported_version(factory: ServerFactory) -> None:
    peer = Peer(factory, hello=False)
    assert_error(peer.request(Hello(1, (99,))), 1, "unsupported_version", "[99]")
    assert peer.transport.disconnecting


def test_hello_twice_is_refused_but_the_connection_stays(factory: ServerFactory) -> None:
    peer = Peer(factory)
    rid = peer.rid()
    assert_error(peer.request(Hello(rid, (1,))), rid, "invalid_request", "already")
    assert not peer.transport.disconnecting
    peer.ping()


# ------------------------------------------------------------------------------- requests


def test_put_get_peek_list_delete(factory: ServerFactory) -> None:
    peer = Peer(factory)
    w = torch.randn(3, 4)
    assert peer.put("w", {"w": w, "step": 1}) == Stored(2, 1, 1)
    rid = peer.rid()
    reply = peer.request(Peek(rid, "w"))
    assert (reply.id, reply.kind, reply.version, reply.n_items) == (rid, "value", 1, 1)
    (got,) = values(reply)
    assert torch.equal(got["w"], w) and got["step"] == 1

    assert peer.put("w", "replaced").version == 2
    assert peer.append("q", torch.arange(3)).n_items == 1
    assert peer.append("q", torch.arange(4)).n_items == 2
    assert peer.append("q", "third") == Stored(7, 3, 3)
    rid = peer.rid()
    assert peer.request(ListBins(rid)) == Listing(rid, {"w": 1, "q": 3})

    rid = peer.rid()
    reply = peer.request(Get(rid, "q", max_items=2))
    assert (reply.kind, reply.version, reply.n_items) == ("list", 4, 1)
    a, b = values(reply)
    assert torch.equal(a, torch.arange(3)) and torch.equal(b, torch.arange(4))
    rid = peer.rid()
    reply = peer.request(Get(rid, "q"))
    assert values(reply) == ["third"] and reply.n_items == 0

    rid = peer.rid()
    assert_error(peer.request(Get(rid, "q")), rid, "bin_not_found", "'q'")
    rid = peer.rid()
    assert_error(peer.request(Peek(rid, "nope")), rid, "bin_not_found")

    rid = peer.rid()
    assert peer.request(Delete(rid, "w")) == Deleted(rid, True, 3)
    rid = peer.rid()
    assert peer.request(Delete(rid, "w")) == Deleted(rid, False, 3)
    rid = peer.rid()
    assert peer.request(ListBins(rid)) == Listing(rid, {})
    assert factory.store.nbytes == 0


def test_tagged_items_and_min_tag(factory: ServerFactory) -> None:
    peer = Peer(factory)
    for tag in (1, 2, 3):
        peer.request(Append(peer.rid(), "r", Item(codec.encode(tag), tag)))
    rid = peer.rid()
    reply = peer.request(Get(rid, "r", min_tag=2))
    assert values(reply) == [2, 3] and [it.tag for it in reply.items] == [2, 3]
    assert reply.dropped == 1


def test_newer_than_unchanged(factory: ServerFactory) -> None:
    peer = Peer(factory)
    peer.put("p", 1)
    rid = peer.rid()
    reply = peer.request(Peek(rid, "p", newer_than=1))
    assert reply == Fetched(rid, "value", (), 1, 1, 0, True)


def test_listen_sees_changes_made_by_another_connection(factory: ServerFactory) -> None:
    listener, writer = Peer(factory), Peer(factory)
    writer.put("b", 0)
    rid = listener.rid()
    assert listener.request(Listen(rid, "b")) == Listening(rid, 1, 1)

    writer.put("b", torch.ones(3))
    assert listener.received() == [Changed("b", "put", 1, 2)]
    writer.append("b", 2)
    writer.request(Get(writer.rid(), "b", max_items=1))
    writer.request(Delete(writer.rid(), "b"))
    assert listener.received() == [
        Changed("b", "append", 2, 3), Changed("b", "get", 1, 4), Changed("b", "delete", 0, 5)]
    writer.put("other", 1)
    assert listener.received() == []

    rid = listener.rid()
    assert listener.request(Unlisten(rid, "b")) == Acked(rid, True)
    writer.put("b", 1)
    assert listener.received() == []
    rid = listener.rid()
    assert listener.request(Unlisten(rid, "b")) == Acked(rid, False)


def test_listen_to_a_bin_that_does_not_exist_yet(factory: ServerFactory) -> None:
    a, b = Peer(factory), Peer(factory)
    rid = a.rid()
    assert a.request(Listen(rid, "later")) == Listening(rid, 0, 0)
    b.put("later", 1)
    assert a.received() == [Changed("later", "put", 1, 1)]


# ------------------------------------------------------------------------------- waiting


def test_waiting_get_times_out(factory: ServerFactory, clock: MemoryReactorClock) -> None:
    peer = Peer(factory)
    rid = peer.rid()
    peer.send(Get(rid, "empty", wait=True, timeout=3))
    assert peer.received() == []
    assert factory.store.n_waiters == 1
    clock.advance(2.5)
    assert peer.received() == []
    clock.advance(0.5)
    (reply,) = peer.received()
    assert_error(reply, rid, "timeout", "'empty'")
    assert factory.store.n_waiters == 0
    assert clock.getDelayedCalls() == []
    # a put after the timeout stays in the bin
    peer.put("empty", 5)
    assert factory.store.list() == {"empty": 1}


def test_waiting_get_served_by_a_put_before_the_timeout(factory: ServerFactory,
                                                         clock: MemoryReactorClock) -> None:
    waiter, writer = Peer(factory), Peer(factory)
    rid = waiter.rid()
    waiter.send(Get(rid, "b", wait=True, timeout=3))
    clock.advance(2)
    t = torch.randn(5)
    assert writer.put("b", t) == Stored(2, 1, 1)
    (reply,) = waiter.received()
    assert reply.id == rid and reply.n_items == 0
    (got,) = values(reply)
    assert torch.equal(got, t)
    assert clock.getDelayedCalls() == []
    clock.advance(10)
    assert waiter.received() == []
    assert factory.store.n_waiters == 0 and factory.store.list() == {}


def test_waiting_peek_without_timeout_served_by_append(factory: ServerFactory,
                                                        clock: MemoryReactorClock) -> None:
    waiter, writer = Peer(factory), Peer(factory)
    rid = waiter.rid()
    waiter.send(Peek(rid, "q", wait=True, timeout=None, min_items=2))
    assert clock.getDelayedCalls() == []
    writer.append("q", 1)
    assert waiter.received() == []
    writer.append("q", 2)
    (reply,) = waiter.received()
    assert values(reply) == [1, 2]
    assert factory.store.list() == {"q": 2}


def test_waiting_get_served_at_once_when_data_is_there(factory: ServerFactory,
                                                       clock: MemoryReactorClock) -> None:
    peer = Peer(factory)
    peer.put("b", 1)
    rid = peer.rid()
    assert values(peer.request(Get(rid, "b", wait=True, timeout=3))) == [1]
    assert clock.getDelayedCalls() == [] and factory.store.n_waiters == 0


def test_a_waiting_get_behind_a_waiter_that_cannot_be_served_is_answered_at_once(
        factory: ServerFactory, clock: MemoryReactorClock) -> None:
    # The store serves its queue in order as the second waiter comes: the first wants more
    # items than the bin has, the second is served at once and answered with its pass.
    first, second = Peer(factory), Peer(factory)
    second.append("q", 1)
    rid = first.rid()
    first.send(Peek(rid, "q", wait=True, timeout=5, min_items=3))
    assert first.received() == []
    rid = second.rid()
    got = second.request(Get(rid, "q", wait=True, timeout=5))
    assert got.id == rid and values(got) == [1]
    assert second.proto.started == {} and len(clock.getDelayedCalls()) == 1  # the first's
    assert factory.store.n_waiters == 1 and first.received() == []
    clock.advance(5)
    (late,) = first.received()
    assert isinstance(late, ErrorReply) and late.code == "timeout"


def test_cancel_a_waiting_get(factory: ServerFactory, clock: MemoryReactorClock) -> None:
    peer, writer = Peer(factory), Peer(factory)
    target = peer.rid()
    peer.send(Get(target, "b", wait=True, timeout=3))
    assert factory.store.n_waiters == 1
    rid = peer.rid()
    assert peer.request(Cancel(rid, target)) == Acked(rid, True)
    assert factory.store.n_waiters == 0
    assert clock.getDelayedCalls() == []
    writer.put("b", 1)
    clock.advance(5)
    assert peer.received() == []  # neither data nor a timeout for the cancelled get
    assert factory.store.list() == {"b": 1}
    rid = peer.rid()
    assert peer.request(Cancel(rid, target)) == Acked(rid, False)
    rid = peer.rid()
    assert peer.request(Cancel(rid, 12345)) == Acked(rid, False)


def test_connection_lost_removes_listeners_and_cancels_waiters(
        factory: ServerFactory, clock: MemoryReactorClock) -> None:
    peer, other = Peer(factory), Peer(factory)
    peer.send(Listen(peer.rid(), "l1"))
    peer.send(Listen(peer.rid(), "l2"))
    peer.send(Get(peer.rid(), "w1", wait=True, timeout=3))
    peer.send(Peek(peer.rid(), "w2", wait=True, timeout=None))
    peer.send(Get(peer.rid(), "w1", wait=True, timeout=None, max_items=1))
    assert len(peer.received()) == 2  # the two Listening replies
    other.send(Get(other.rid(), "w1", wait=True, timeout=None))
    assert factory.store.n_waiters == 4
    assert len(clock.getDelayedCalls()) == 1

    peer.lose()
    assert factory.store.n_waiters == 1  # only the other connection's waiter is left
    assert clock.getDelayedCalls() == []
    assert peer.proto not in factory.connections
    assert peer.proto.listening == set()
    assert "l1" not in factory._listeners and "l2" not in factory._listeners

    # the data goes to the surviving waiter, nothing is written to the lost connection
    other.send(Put(other.rid(), "w1", Item(codec.encode(7))))
    fetched, stored = other.received()
    assert values(fetched) == [7] and type(stored) is Stored
    other.put("l1", 1)
    assert peer.transport.value() == b""
    assert factory.store.list() == {"l1": 1}
    assert factory.store.n_waiters == 0


def test_connection_lost_before_hello(factory: ServerFactory) -> None:
    peer = Peer(factory, hello=False)
    peer.lose()
    assert peer.proto not in factory.connections


# ------------------------------------------------------------------------------- bad input


def test_garbage_closes_that_connection_only(factory: ServerFactory) -> None:
    good = Peer(factory)
    good.put("keep", 1)
    bad = Peer(factory, hello=False)
    bad.write(b"GET / HTTP/1.1\r\n\r\n")
    (err,) = bad.received()
    assert type(err) is ErrorReply and (err.id, err.code) == (0, "protocol_error")
    assert "magic" in err.message
    assert bad.transport.disconnecting
    bad.write(b"more garbage")
    assert bad.transport.value() == b""
    bad.lose()

    good.ping()
    rid = good.rid()
    assert values(good.request(Get(rid, "keep"))) == [1]
    assert not good.transport.disconnecting


def test_garbage_after_hello(factory: ServerFactory) -> None:
    peer = Peer(factory)
    peer.write(b"\x00" * 64)
    (err,) = peer.received()
    assert (err.id, err.code) == (0, "protocol_error")
    assert peer.transport.disconnecting


def test_requests_before_garbage_in_the_same_chunk_are_served(factory: ServerFactory) -> None:
    """A complete request is served whether or not garbage follows it in the same read.

    Split into two reads, the put is stored and answered before the garbage closes the
    connection; in one read it must not be silently dropped instead.
    """
    split = Peer(factory)
    put = b"".join(split.conn.send(Put(split.rid(), "a", Item(codec.encode(1)))))
    split.write(put)
    split.write(b"XX" * 20)
    assert [type(m) for m in split.received()] == [Stored, ErrorReply]
    assert factory.store.list() == {"a": 1}

    joined = Peer(factory)
    put = b"".join(joined.conn.send(Put(joined.rid(), "b", Item(codec.encode(1)))))
    joined.write(put + b"XX" * 20)
    assert [type(m) for m in joined.received()] == [Stored, ErrorReply]
    assert factory.store.list() == {"a": 1, "b": 1}
    assert joined.transport.disconnecting


def test_unknown_op_is_an_error_reply_and_the_connection_stays(factory: ServerFactory) -> None:
    import msgpack

    from tensorshare.wire.frames import encode_frame

    peer = Peer(factory)
    peer.write(b"".join(encode_frame(msgpack.packb({"op": "frobnicate", "id": 41}))))
    (reply,) = peer.received()
    assert_error(reply, 41, "invalid_request", "frobnicate")
    assert not peer.transport.disconnecting
    peer.ping()


def test_bad_bin_name_is_an_error_reply(factory: ServerFactory) -> None:
    peer = Peer(factory)
    rid = peer.rid()
    assert_error(peer.request(Delete(rid, "")), rid, "invalid_request", "empty")
    rid = peer.rid()
    assert_error(peer.request(Listen(rid, "x" * 1025)), rid, "limit_exceeded")
    assert peer.proto.listening == set()
    peer.ping()


def test_max_memory_refusal_leaves_the_store_unchanged(clock: MemoryReactorClock) -> None:
    factory = ServerFactory(clock, max_memory=10_000)
    peer = Peer(factory)
    small = torch.arange(100, dtype=torch.int32)  # ~400 bytes
    assert peer.put("b", small) == Stored(2, 1, 1)
    nbytes = factory.store.nbytes
    rid = peer.rid()
    big = torch.zeros(5000, dtype=torch.float32)  # 20 KB
    assert_error(peer.request(Put(rid, "b", Item(codec.encode(big)))), rid, "memory_limit",
                 "max_memory=10000")
    rid = peer.rid()
    assert_error(peer.request(Append(rid, "c", Item(codec.encode(big)))), rid, "memory_limit")
    assert factory.store.nbytes == nbytes
    assert factory.store.list() == {"b": 1}
    assert factory.store.version("b") == 1 and factory.store.version("c") == 0
    rid = peer.rid()
    reply = peer.request(Peek(rid, "b"))
    assert reply.version == 1
    assert torch.equal(values(reply)[0], small)


def test_oversized_frame_is_refused_and_the_connection_serves_on(
        clock: MemoryReactorClock) -> None:
    factory = ServerFactory(clock, Limits(max_frame_bytes=4096, max_header_bytes=1024))
    peer = Peer(factory)
    rid = peer.rid()
    big = torch.zeros(10 * 1024, dtype=torch.uint8)
    data = b"".join(peer.conn.send(Put(rid, "big", Item(codec.encode(big)))))
    assert len(data) > 10 * 1024
    # in pieces, as TCP would deliver it
    for i in range(0, len(data), 1000):
        peer.write(data[i : i + 1000])
    (reply,) = peer.received()
    assert_error(reply, rid, "limit_exceeded", "max_frame_bytes=4096")
    assert not peer.transport.disconnecting
    assert factory.store.list() == {} and factory.store.nbytes == 0
    assert peer.put("small", torch.ones(10)).version == 1
    rid = peer.rid()
    assert torch.equal(values(peer.request(Get(rid, "small")))[0], torch.ones(10))


def test_oversized_header_closes_the_connection(clock: MemoryReactorClock) -> None:
    factory = ServerFactory(clock, Limits(max_frame_bytes=4096, max_header_bytes=1024))
    peer = Peer(factory)
    peer.send(Put(peer.rid(), "b", Item(codec.encode(b"x" * 2000))))  # bytes go in the header
    (err,) = peer.received()
    assert (err.id, err.code) == (0, "protocol_error") and "max_header_bytes" in err.message
    assert peer.transport.disconnecting


def test_nan_timeout_is_refused(factory: ServerFactory) -> None:
    """A NaN wait timeout must be an invalid_request, and must leave no waiter behind."""
    import msgpack

    from tensorshare.wire.frames import encode_frame

    peer = Peer(factory)
    peer.write(b"".join(encode_frame(msgpack.packb(
        {"op": "get", "id": 50, "bin": "b", "wait": True, "timeout": float("nan")}))))
    replies = peer.received()
    n_waiters = factory.store.n_waiters
    assert len(replies) == 1, f"no reply to a get with timeout=NaN; {n_waiters} waiter(s) stored"
    assert_error(replies[0], 50, "invalid_request", "timeout")
    assert n_waiters == 0


# ------------------------------------------------------------------------------- sessions

SID = b"S" * 16


def test_a_resent_put_is_answered_from_memory_and_not_run_twice(factory: ServerFactory) -> None:
    peer = Peer(factory, session=SID)
    assert peer.hello is not None and not peer.hello.resumed
    rid = peer.rid()
    frame = peer.conn.frame(Append(rid, "q", Item(codec.encode(1))))
    peer.write(frame)
    (first,) = peer.received()
    peer.lose()  # the client never saw the reply: it reconnects and sends the same frame
    again = Peer(factory, session=SID, resume=True, conn=peer.conn)
    assert again.hello is not None and again.hello.resumed
    again.conn.ops[rid] = "append"
    again.write(frame)
    (second,) = again.received()
    assert second == first and factory.store.n_items("q") == 1
    assert factory.stats.counters["replayed"] == 1


def test_a_get_whose_reply_was_lost_is_delivered_again_not_lost(factory: ServerFactory) -> None:
    writer = Peer(factory)
    for i in range(3):
        writer.append("q", i)
    peer = Peer(factory, session=SID)
    rid = peer.rid()
    frame = peer.conn.frame(Get(rid, "q", max_items=2))
    peer.write(frame)
    peer.received()  # lost in transit, as far as the client knows
    assert factory.sessions.held > 0 and factory.store.n_items("q") == 1
    peer.lose()
    again = Peer(factory, session=SID, resume=True, conn=peer.conn)
    again.conn.ops[rid] = "get"
    again.write(frame)
    (reply,) = again.received()
    assert values(reply) == [0, 1] and factory.store.n_items("q") == 1
    # the next request acknowledges it: the held items are released
    again.send(Ping(again.rid()), )
    again.received()
    assert factory.sessions.held > 0  # no ack field was sent: still held
    again.write(again.conn.frame(Ping(again.rid()), AckInfo(rid)))
    again.received()
    assert factory.sessions.held == 0
    assert factory.held_bytes() == SessionTable.SESSION_COST * len(factory.sessions)  # itself


def test_open_ids_below_the_ack_stay_remembered(factory: ServerFactory) -> None:
    peer = Peer(factory, session=SID)
    r1, r2 = peer.rid(), peer.rid()
    peer.send(Put(r1, "a", Item(codec.encode(1))))
    peer.send(Put(r2, "b", Item(codec.encode(2))))
    peer.received()
    session = factory.sessions.get(SID)
    assert session is not None and set(session.replies) == {r1, r2}
    peer.write(peer.conn.frame(Ping(peer.rid()), AckInfo(r2, (r1,))))
    peer.received()
    assert set(session.replies) == {r1}


def test_cancel_of_a_get_that_ran_puts_its_items_back_in_front(factory: ServerFactory) -> None:
    writer = Peer(factory)
    listener = Peer(factory)
    listener.request(Listen(listener.rid(), "q"))
    for i in range(3):
        writer.append("q", i)
    listener.received()
    peer = Peer(factory, session=SID)
    rid = peer.rid()
    assert values(peer.request(Get(rid, "q", max_items=2))) == [0, 1]
    writer.append("q", 3)
    cancel = peer.rid()
    assert peer.request(Cancel(cancel, rid)) == Acked(cancel, True)
    assert values(writer.request(Get(writer.rid(), "q"))) == [0, 1, 2, 3]
    events = [m for m in listener.received() if type(m) is Changed]
    assert [e.op for e in events] == ["get", "append", "restore", "get"]
    assert factory.sessions.held == 0


def test_an_expired_session_gives_back_what_its_gets_took(
        factory: ServerFactory, clock: MemoryReactorClock) -> None:
    writer = Peer(factory)
    writer.append("q", "a")
    writer.append("q", "b")
    peer = Peer(factory, session=SID)
    assert values(peer.request(Get(peer.rid(), "q", max_items=1))) == ["a"]
    peer.lose()
    assert len(factory.sessions) == 1
    clock.advance(factory.config.session_ttl - 1)
    assert factory.store.n_items("q") == 1
    clock.advance(2)
    assert len(factory.sessions) == 0 and factory.stats.counters["sessions_expired"] == 1
    assert values(writer.request(Get(writer.rid(), "q"))) == ["a", "b"]
    # the client coming back later starts a new session: the server says so
    late = Peer(factory, session=SID, resume=True)
    assert late.hello is not None and not late.hello.resumed


def test_resuming_a_session_still_attached_elsewhere_takes_it_over(
        factory: ServerFactory) -> None:
    old = Peer(factory, session=SID)
    old.send(Get(old.rid(), "never", wait=True, timeout=None))
    assert factory.store.n_waiters == 1
    new = Peer(factory, session=SID, resume=True)
    assert new.hello is not None and new.hello.resumed
    assert old.transport.disconnecting and factory.store.n_waiters == 0
    new.ping()


def test_a_session_reconnecting_in_time_keeps_its_replies(
        factory: ServerFactory, clock: MemoryReactorClock) -> None:
    peer = Peer(factory, session=SID)
    peer.put("x", 1)
    peer.lose()
    clock.advance(factory.config.session_ttl / 2)
    again = Peer(factory, session=SID, resume=True, conn=peer.conn)
    assert again.hello is not None and again.hello.resumed
    clock.advance(factory.config.session_ttl)
    assert len(factory.sessions) == 1  # attached: no expiry while connected


# ------------------------------------------------------------------------------- limits


def test_a_large_frame_before_hello_closes_the_connection(factory: ServerFactory) -> None:
    peer = Peer(factory, hello=False)
    header = msgpack.packb({"op": "put", "id": 1, "bin": "x",
                            "items": [[msgpack.packb(None), [[0, 2**30]], None]]})
    peer.write(struct.pack("<2sBBIQ", b"TS", 1, 0, len(header), 2**30) + header)
    assert peer.transport.disconnecting
    (err,) = peer.received()
    assert err.code == "protocol_error" and "before the handshake" in err.message


def test_a_connection_that_never_says_hello_is_closed(
        factory: ServerFactory, clock: MemoryReactorClock) -> None:
    peer = Peer(factory, hello=False)
    clock.advance(factory.config.hello_timeout + 0.1)
    assert peer.transport.disconnecting
    (err,) = peer.received()
    assert "no hello within" in err.message and factory.stats.counters["hello_timeouts"] == 1


def test_connections_over_max_connections_are_refused_with_a_reason(
        clock: MemoryReactorClock) -> None:
    factory = ServerFactory(clock, config=ServerConfig(max_connections=2))
    a, b = Peer(factory), Peer(factory)
    c = Peer(factory, hello=False)
    assert c.transport.disconnecting
    (err,) = c.received()
    assert err.code == "limit_exceeded" and "max_connections=2" in err.message
    a.ping()
    b.ping()


def test_configure_reject_and_block(factory: ServerFactory, clock: MemoryReactorClock) -> None:
    peer = Peer(factory)
    rid = peer.rid()
    assert peer.request(Configure(rid, "q", 1, None, "reject")) == Configured(rid, 1, None,
                                                                              "reject")
    peer.append("q", 1)
    assert_error(peer.append("q", 2), peer.conn._next, "bin_full", "is full")
    rid = peer.rid()
    peer.request(Configure(rid, "q", 1, None, "block"))
    blocked = peer.rid()
    peer.send(Append(blocked, "q", Item(codec.encode(2)), 5.0))
    assert peer.received() == []
    consumer = Peer(factory)
    assert values(consumer.request(Get(consumer.rid(), "q"))) == [1]
    (stored,) = peer.received()
    assert type(stored) is Stored and stored.id == blocked
    late = peer.rid()
    peer.send(Append(late, "q", Item(codec.encode(3)), 5.0))
    clock.advance(5.1)
    assert_error(peer.received()[0], late, "bin_full", "stayed full for 5 s")
    assert factory.store.n_blocked == 0


def test_stats_reply(factory: ServerFactory) -> None:
    peer = Peer(factory)
    peer.put("w", {"a": torch.zeros(2, 3)})
    rid = peer.rid()
    reply = peer.request(Stats(rid, "w*"))
    assert type(reply) is StatsReply and reply.server["connections"] == 1
    assert reply.bins["w"]["first"] == "{a: float32[2,3]}"
    assert reply.bins["w"]["kind"] == "value" and reply.bins["w"]["version"] == 1


# ------------------------------------------------------------------- one pass per read


def test_the_replies_to_one_read_leave_in_one_write(factory: ServerFactory) -> None:
    """Every request a read completes is served in one pass; their replies go out together,
    in order, with one write to the transport (one sendmsg on a socket)."""
    p = Peer(factory)
    writes: list[int] = []
    write = p.transport.write
    p.transport.writeSequence = lambda chunks: (writes.append(len(chunks)),  # type: ignore
                                                write(b"".join(map(bytes, chunks))))
    item = Item(codec.encode(torch.arange(4)))
    ids = [p.rid() for _ in range(4)]
    data = b"".join(b"".join(map(bytes, p.conn.send(m))) for m in (
        Put(ids[0], "a", item), Put(ids[1], "b", item), Get(ids[2], "a"), Ping(ids[3])))
    p.transport.clear()
    p.proto.dataReceived(data)
    assert len(writes) == 1
    replies = p.received()
    assert [r.id for r in replies] == ids
    assert [type(r) for r in replies] == [Stored, Stored, Fetched, Acked]
    stats = factory.stats.counters
    assert stats["op.put"] == 2 and stats["op.get"] == 1 and stats["op.ping"] == 1
    assert sum(factory.stats.latency["put"][:-1]) == 2


def test_an_error_during_a_pass_still_answers_what_came_before(factory: ServerFactory) -> None:
    """A pass whose read ends in garbage sends the replies of the good frames before it, then
    the error that closes the connection."""
    p = Peer(factory)
    rid = p.rid()
    p.transport.clear()
    p.proto.dataReceived(b"".join(map(bytes, p.conn.send(Ping(rid))))
                         + b"garbage that is no frame at all")
    replies = p.received()
    assert type(replies[0]) is Acked and replies[0].id == rid
    assert type(replies[-1]) is ErrorReply and replies[-1].id == 0
    assert p.transport.disconnecting
