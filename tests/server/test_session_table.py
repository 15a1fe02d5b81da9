"""Sessions a peer cannot pin: ``bye`` ends a session at once, a full table makes room by
ending the session that waited longest, and what sessions cost is counted.

(issue "Safe on a shared network": 10,050 short-lived clients used to lock every new client
out for up to 60 s, because a closed client left its session behind for --session-ttl.)
"""

from __future__ import annotations

import os

import pytest
from twisted.internet.testing import MemoryReactorClock

from tensorshare.server import ServerConfig
from tensorshare.server.core import ServerFactory
from tensorshare.server.sessions import SessionTable
from tensorshare.wire.messages import Acked, Bye, ErrorReply, Hello
from tensorshare.wire.protocol import PROTOCOL_VERSIONS, AckInfo
from tests.rawwire import Get
from tests.server.test_connection import Peer, values


@pytest.fixture
def clock() -> MemoryReactorClock:
    return MemoryReactorClock()


def _factory(clock: MemoryReactorClock, **config: object) -> ServerFactory:
    return ServerFactory(clock, config=ServerConfig(**config))  # type: ignore[arg-type]


def test_bye_ends_the_session_at_once_and_closes(clock: MemoryReactorClock) -> None:
    f = _factory(clock)
    for i in range(4):
        Peer(f).append("q", i)
    p = Peer(f, session=os.urandom(16))
    got = p.request(Get(p.rid(), "q", max_items=1))  # acknowledged by the bye below
    lost = Get(p.rid(), "q", max_items=1)  # its reply never reaches the client
    p.send(lost)
    p.received()
    assert values(got) == [0] and f.store.n_items("q") == 2 and len(f.sessions) == 1
    rid = p.rid()
    p.write(p.conn.frame(Bye(rid), AckInfo(lost.id, (lost.id,))))
    assert p.received() == [Acked(rid, True)]
    assert len(f.sessions) == 0 and not f.sessions.detached
    assert f.store.n_items("q") == 3  # the unacknowledged get's item went back, not the other
    assert p.transport.disconnecting  # closed once the answer is sent
    assert clock.getDelayedCalls() == [] or all(
        "abortConnection" in repr(c) for c in clock.getDelayedCalls())


def test_bye_without_a_session(clock: MemoryReactorClock) -> None:
    p = Peer(_factory(clock))
    rid = p.rid()
    assert p.request(Bye(rid)) == Acked(rid, False)


def test_a_dropped_connection_keeps_its_session_for_the_ttl(clock: MemoryReactorClock) -> None:
    f = _factory(clock, session_ttl=60.0)
    Peer(f, session=os.urandom(16)).lose()
    assert len(f.sessions) == 1 and len(f.sessions.detached) == 1
    clock.advance(59)
    assert len(f.sessions) == 1
    clock.advance(2)
    assert len(f.sessions) == 0 and f.stats.counters["sessions_expired"] == 1


def test_one_timer_serves_every_detached_session_in_order(clock: MemoryReactorClock) -> None:
    f = _factory(clock, session_ttl=10.0)
    for _ in range(50):
        Peer(f, session=os.urandom(16)).lose()
        clock.advance(0.1)
    assert len(clock.getDelayedCalls()) == 1
    clock.advance(7.45)  # now 12.45: those detached up to 2.4 s have waited their 10 s
    assert len(f.sessions) == 25
    clock.advance(2.5)
    assert len(f.sessions) == 0 and clock.getDelayedCalls() == []


def test_a_full_table_ends_the_longest_detached_session(clock: MemoryReactorClock) -> None:
    f = _factory(clock, max_sessions=3)
    first = Peer(f, session=os.urandom(16))
    first.append("q", 1)
    first.request(Get(first.rid(), "q"))  # holds the item, unacknowledged
    first.lose()
    clock.advance(1)
    second_id = os.urandom(16)
    Peer(f, session=second_id).lose()
    attached = Peer(f, session=os.urandom(16))
    assert len(f.sessions) == 3 and f.store.n_items("q") == 0
    Peer(f, session=os.urandom(16))  # room is made: the first (longest detached) ends
    assert len(f.sessions) == 3 and f.stats.counters["sessions_evicted"] == 1
    assert f.store.n_items("q") == 1  # its unacknowledged item went back, as on expiry
    again = Peer(f, session=second_id, resume=True)  # a detached one resumes
    assert again.hello is not None and again.hello.resumed
    attached.ping()


def test_only_a_table_of_attached_sessions_refuses_a_new_one(clock: MemoryReactorClock) -> None:
    f = _factory(clock, max_sessions=2)
    a, b = Peer(f, session=os.urandom(16)), Peer(f, session=os.urandom(16))
    c = Peer(f, hello=False)
    rid = c.rid()
    reply = c.request(Hello(rid, PROTOCOL_VERSIONS, "c", None, os.urandom(16)))
    assert isinstance(reply, ErrorReply) and reply.code == "limit_exceeded"
    assert "all of them with a connection" in reply.message
    # A reconnect of an attached client is never refused: it takes its own session over.
    assert a.proto.session is not None
    again = Peer(f, session=a.proto.session.id, resume=True)
    assert again.hello is not None and again.hello.resumed
    again.ping()
    b.ping()


def test_sessions_are_counted_as_they_are_held(clock: MemoryReactorClock) -> None:
    f = _factory(clock)
    for _ in range(10):
        Peer(f, session=os.urandom(16)).lose()
    stats = f.server_stats()
    assert stats["sessions"] == 10 and stats["sessions_detached"] == 10
    assert stats["memory"]["sessions"] == 10 * SessionTable.SESSION_COST
    assert f.held_bytes() >= 10 * SessionTable.SESSION_COST


def test_a_puts_reply_is_remembered_as_its_frame_and_read_back_when_asked(
        clock: MemoryReactorClock) -> None:
    """A put's reply is kept as the bytes it was sent in (no object per put): the same bytes
    answer the put resent, and a lookup or a snapshot reads the Stored back from them."""
    from tensorshare.wire import codec
    from tensorshare.wire.protocol import stored_frame
    from tensorshare.wire.records import Fetched, Item, Put, Stored

    f = _factory(clock)
    sid = os.urandom(16)
    p = Peer(f, session=sid)
    put = Put(p.rid(), "v", Item(codec.encode(7)))
    first = p.request(put)
    assert type(first) is Stored
    s = f.sessions.get(sid)
    assert s is not None and s.replies[put.id] == stored_frame(put.id, first.version,
                                                                first.n_items)
    assert p.request(put) == first  # resent: the remembered frame, not a second put
    assert f.store.version("v") == first.version
    assert s.lookup(put.id) == first
    got = p.request(Get(p.rid(), "v"))
    assert type(got) is Fetched
    assert [(rid, type(reply)) for rid, reply, _, _ in s.remembered()] == \
        [(put.id, Stored), (got.id, Fetched)]
    assert f.sessions.remembered == 2 * SessionTable.REPLY_COST
    f.sessions.ack(s, got.id)
    assert s.replies == {} and f.sessions.remembered == 0 and f.sessions.held == 0
