"""Unit tests for tensorshare.session: the sans-I/O client session, with time passed in.

A ``Server`` here is a ``ServerWire`` (tests/rawwire.py) that parses what the session writes and builds the
frames a server would answer with; nothing touches a socket or a clock.
"""

from __future__ import annotations

from typing import Any

import pytest

from tensorshare.client.session import ACK_DELAY, ClientSession, Done, Drop, Notify, Ready
from tensorshare.errors import (
    ConnectionLost,
    ReplyTimeout,
    SessionLost,
    UnsupportedVersion,
)
from tensorshare.wire import codec
from tensorshare.wire.messages import (
    Acked,
    Append,
    Cancel,
    Changed,
    ErrorReply,
    Fetch,
    Fetched,
    FetchSpec,
    Hello,
    HelloReply,
    Item,
    Limits,
    Listen,
    Listening,
    Ping,
    Put,
    Stored,
)
from tensorshare.wire.protocol import MAX_OPEN_ACKS, AckInfo
from tests.rawwire import ServerWire

T = 10.0  # the session's timeout in these tests


class Server:
    """Reads the session's frames as a server would, and writes frames back into it."""

    def __init__(self) -> None:
        self.conn = ServerWire()
        self.conn.handshake_done()

    def read(self, chunks: list[Any]) -> list[Any]:
        return self.conn.receive_data(b"".join(chunks))

    def requests(self, chunks: list[Any]) -> list[Any]:
        return [m for m in self.read(chunks) if type(m) is not AckInfo]

    @staticmethod
    def frames(*msgs: Any) -> bytes:
        conn = ServerWire()
        return b"".join(b"".join(conn.send(m)) for m in msgs)


def item(value: Any) -> Item:
    return Item(codec.encode(value))


def new_session(**kw: Any) -> ClientSession:
    kw.setdefault("timeout", T)
    kw.setdefault("heartbeat", 1e6)
    return ClientSession(address="test:1", **kw)


def connect(s: ClientSession, now: float = 0.0, *, resumed: bool = False,
            server_id: str = "A") -> tuple[Server, Hello, list[Any]]:
    """Open a connection and complete its handshake; return the hello and the events."""
    server = Server()
    (hello,) = server.requests(s.connection_made(now))
    events = s.receive_data(Server.frames(HelloReply(hello.id, 1, "t", Limits(), resumed,
                                                     server_id)), now)
    return server, hello, events


def done(events: list[Any]) -> list[Done]:
    return [e for e in events if type(e) is Done]


def get(rid: int = 0, name: str = "q", **kw: Any) -> Fetch:
    return Fetch(rid, name, FetchSpec(True, **kw))


# -- handshake and ids -------------------------------------------------------------------------
def test_handshake_carries_the_session_and_nothing_is_sent_before_it() -> None:
    s = new_session()
    server = Server()
    (hello,) = server.requests(s.connection_made(0.0))
    assert hello.session == s.session_id and len(hello.session) == 16 and not hello.resume
    call = s.call(Put(0, "w", item(1)), "put", 0.0, token="t")
    assert s.pop_sendable(0.0) == [] and not s.connected  # waits for the handshake
    events = s.receive_data(Server.frames(HelloReply(hello.id, 1, "t", Limits(), False, "A")),
                            0.0)
    assert [type(e) for e in events] == [Ready] and events[0].first
    (put,) = server.requests(s.pop_sendable(0.0))
    assert put.id == call.id and call.id > hello.id
    (d,) = done(s.receive_data(Server.frames(Stored(call.id, 1, 1)), 0.1))
    assert d.call is call and d.reply == Stored(call.id, 1, 1) and s.pending == 0


def test_without_a_session_hello_carries_none() -> None:
    s = new_session(session=False)
    (hello,) = Server().requests(s.connection_made(0.0))
    assert hello.session is None


@pytest.mark.parametrize("first", [True, False])
def test_a_refused_handshake_closes_with_its_typed_error_never_retried(first: bool) -> None:
    s = new_session()
    server = Server()
    if not first:  # a reconnect refused (say, the server restarted with another token)
        server, _, _ = connect(s)
        s.connection_lost("reset", 1.0)
    (hello,) = server.requests(s.connection_made(2.0))
    events = s.receive_data(Server.frames(ErrorReply(hello.id, "unsupported_version", "no")),
                            2.0)
    assert any(type(e) is Drop for e in events)
    assert isinstance(s.closed, UnsupportedVersion) and "server at" in str(s.closed)
    assert s.connection_lost("closed", 2.0) == []  # closed: nothing to ride out


def test_a_drop_during_the_first_handshake_is_a_blip() -> None:
    s = new_session()
    s.connection_made(0.0)
    assert s.connection_lost("reset by peer", 0.1) == [] and s.closed is None
    s.connection_made(0.2)  # the shell tries again, within its first connection's timeout


def test_a_handshake_that_is_never_answered_is_dropped() -> None:
    s = new_session()
    s.connection_made(0.0)
    assert s.tick(T - 0.1) == []
    (drop,) = s.tick(T)
    assert type(drop) is Drop and "handshake" in drop.reason


# -- acknowledgements ---------------------------------------------------------------------------
def test_each_request_acknowledges_the_replies_received_so_far() -> None:
    s = new_session()
    server, _, _ = connect(s)
    a = s.call(Put(0, "a", item(1)), "put", 0.0, token=1)
    events = server.read(s.pop_sendable(0.0))
    assert [type(e) for e in events] == [Put]  # nothing to acknowledge yet: no field
    s.receive_data(Server.frames(Stored(a.id, 1, 1)), 0.0)
    s.call(Put(0, "b", item(2)), "put", 0.0, token=2)
    ack, _ = server.read(s.pop_sendable(0.0))
    assert ack == AckInfo(a.id)
    s.call(Put(0, "c", item(3)), "put", 0.0, token=3)
    assert [type(e) for e in server.read(s.pop_sendable(0.0))] == [Put]  # unchanged: none


def test_requests_still_waiting_below_the_ack_are_listed_open() -> None:
    s = new_session()
    server, _, _ = connect(s)
    waiting = s.call(get(wait=True, timeout=None), "get", 0.0, token=1)
    later = s.call(Put(0, "b", item(2)), "put", 0.0, token=2)
    server.read(s.pop_sendable(0.0))
    s.receive_data(Server.frames(Stored(later.id, 1, 1)), 0.0)
    s.call(Put(0, "c", item(3)), "put", 0.0, token=3)
    ack, _ = server.read(s.pop_sendable(0.0))
    assert ack == AckInfo(later.id, (waiting.id,))


def test_too_many_open_ids_fall_back_to_a_lower_ack() -> None:
    s = new_session()
    server, _, _ = connect(s)
    waits = [s.call(get(wait=True, timeout=None), "get", 0.0, token=i)
             for i in range(MAX_OPEN_ACKS + 1)]
    last = s.call(Put(0, "b", item(2)), "put", 0.0, token="p")
    server.read(s.pop_sendable(0.0))
    s.receive_data(Server.frames(Stored(last.id, 1, 1)), 0.0)
    s.call(Ping(0), "ping", 0.0, token="x")
    ack, _ = server.read(s.pop_sendable(0.0))
    assert ack == AckInfo(waits[0].id - 1)  # conservative: forgets nothing still open


# -- reconnect ----------------------------------------------------------------------------------
def test_a_resumed_session_resends_what_had_no_reply_in_id_order() -> None:
    s = new_session()
    server, _, _ = connect(s)
    a = s.call(Append(0, "q", item(1)), "append", 0.0, token=1)
    b = s.call(Append(0, "q", item(2)), "append", 0.0, token=2)
    server.read(s.pop_sendable(0.0))
    s.receive_data(Server.frames(Stored(a.id, 1, 1)), 0.0)
    assert s.connection_lost("reset", 1.0) == []  # reconnect on: nothing fails
    c = s.call(Append(0, "q", item(3)), "append", 1.5, token=3)  # made while away
    server = Server()
    (hello,) = server.requests(s.connection_made(2.0))
    assert hello.resume and hello.session == s.session_id
    events = s.receive_data(Server.frames(HelloReply(hello.id, 1, "t", Limits(), True, "A")),
                            2.0)
    assert [type(e) for e in events] == [Ready] and events[0].resumed
    resent = server.requests(s.pop_sendable(2.0))
    assert [m.id for m in resent] == [b.id, c.id]


def test_a_forgotten_session_fails_unknown_outcomes_and_resends_reads() -> None:
    s = new_session()
    server, _, _ = connect(s)
    put = s.call(Put(0, "w", item(1)), "put to bin 'w'", 0.0, token=1)
    peek = s.call(Fetch(0, "w", FetchSpec(False)), "peek", 0.0, token=2)
    server.read(s.pop_sendable(0.0))
    s.connection_lost("reset", 1.0)
    never = s.call(Put(0, "v", item(2)), "put", 1.5, token=3)
    _, _, events = connect(s, 2.0, resumed=False, server_id="B")
    (lost,) = done(events)
    assert lost.call is put and isinstance(lost.error, SessionLost)
    assert "put to bin 'w'" in str(lost.error) and "restarted without persistence" in str(
        lost.error)
    assert isinstance(lost.error, ConnectionLost)
    resent = Server().requests(s.pop_sendable(2.0))
    assert [m.id for m in resent] == [peek.id, never.id]


def test_a_waiting_fetch_is_resent_with_the_time_it_has_left() -> None:
    s = new_session()
    server, _, _ = connect(s)
    w = s.call(get(wait=True, timeout=30.0), "get", 0.0, token=1)
    (first,) = server.requests(s.pop_sendable(0.0))
    assert first.spec.timeout == 30.0
    s.connection_lost("reset", 12.0)
    connect(s, 12.0, resumed=True)
    (again,) = Server().requests(s.pop_sendable(12.0))
    assert again.id == w.id and again.spec.timeout == pytest.approx(18.0)


def test_without_reconnect_a_lost_connection_fails_everything() -> None:
    s = new_session(reconnect=False)
    server, _, _ = connect(s)
    c = s.call(Ping(0), "ping", 0.0, token=1)
    server.read(s.pop_sendable(0.0))
    (d,) = done(s.connection_lost("reset by peer", 1.0))
    assert d.call is c and isinstance(d.error, ConnectionLost) and "reset by peer" in str(
        d.error)
    with pytest.raises(ConnectionLost, match="cannot send"):
        s.call(Ping(0), "ping", 1.0)


def test_a_numeric_reconnect_gives_up_after_that_long() -> None:
    s = new_session(reconnect=5.0)
    connect(s)
    s.connection_lost("reset", 10.0)
    assert not s.give_up_due(14.9) and s.give_up_due(15.1)


def test_backoff_grows_to_a_cap_with_jitter() -> None:
    s = new_session()
    delays = [s.backoff(i) for i in range(12)]
    assert 0.025 <= delays[0] <= 0.05 and max(delays) <= 2.0 and delays[-1] >= 1.0


# -- timeouts -----------------------------------------------------------------------------------
def test_no_reply_in_time_is_a_reply_timeout_and_a_get_is_cancelled() -> None:
    s = new_session()
    server, _, _ = connect(s)
    put = s.call(Put(0, "w", item(1)), "put to bin 'w'", 0.0, token=1)
    g = s.call(get(), "get on bin 'q'", 0.0, token=2)
    server.read(s.pop_sendable(0.0))
    events = s.tick(T)
    assert {d.call.id for d in done(events)} == {put.id, g.id}
    assert all(isinstance(d.error, ReplyTimeout) for d in done(events))
    assert "may or may not have taken effect" in str(done(events)[0].error)
    # The get may have taken items: a cancel asks for them back, its id stays open.
    (cancel,) = server.requests(s.pop_sendable(T))
    assert type(cancel) is Cancel and cancel.target == g.id
    assert s.op_of(g.id) is None  # a late reply to it is an orphan
    s.receive_data(Server.frames(Fetched(g.id, "list", (item(1),), 2, 0)), T)
    assert s.pending == 2
    s.receive_data(Server.frames(Acked(cancel.id, True)), T)
    assert s.pending == 0


def test_a_reply_that_is_still_streaming_in_is_not_abandoned() -> None:
    s = new_session()
    server, _, _ = connect(s)
    g = s.call(get(), "get", 0.0, token=1)
    server.read(s.pop_sendable(0.0))
    frame = Server.frames(Fetched(g.id, "value", (item(list(range(1000))),), 1, 0))
    s.receive_data(frame[:100], T - 1)  # the reply starts arriving
    assert s.tick(T) == []  # silence is what times out, not a slow transfer
    (d,) = done(s.receive_data(frame[100:], T + 5))
    assert type(d.reply) is Fetched


def test_calls_made_while_disconnected_fail_as_not_sent() -> None:
    s = new_session()
    connect(s)
    s.connection_lost("connection refused", 1.0)
    c = s.call(Put(0, "w", item(1)), "put to bin 'w'", 2.0, token=1)
    (d,) = done(s.tick(2.0 + T))
    assert d.call is c and type(d.error) is ConnectionLost
    assert "not sent" in str(d.error) and "unreachable for 11.0 s" in str(d.error)
    assert s.pending == 0


def test_calls_sent_before_a_drop_fail_as_maybe_taken_effect() -> None:
    s = new_session()
    server, _, _ = connect(s)
    c = s.call(Put(0, "w", item(1)), "put to bin 'w'", 0.0, token=1)
    server.read(s.pop_sendable(0.0))
    s.connection_lost("reset", 1.0)
    (d,) = done(s.tick(T))
    assert "may or may not have taken effect" in str(d.error) and d.call is c


def test_waiting_without_limit_never_times_out() -> None:
    s = new_session()
    server, _, _ = connect(s)
    s.call(get(wait=True, timeout=None), "get", 0.0, token=1)
    server.read(s.pop_sendable(0.0))
    assert s.next_deadline() is None and done(s.tick(1e9)) == []


# -- listeners ----------------------------------------------------------------------------------
def test_listen_events_are_delivered_and_never_go_backwards() -> None:
    s = new_session()
    server, _, _ = connect(s)
    assert s.add_listener("w", "cb")
    listen = s.call(Listen(0, "w"), "listen", 0.0, token=1, extra="cb")
    server.read(s.pop_sendable(0.0))
    s.receive_data(Server.frames(Listening(listen.id, 3, 1)), 0.0)
    events = s.receive_data(Server.frames(Changed("w", "put", 1, 3), Changed("w", "put", 1, 4),
                                          Changed("w", "append", 2, 5, 0, 1)), 0.0)
    notes = [e for e in events if type(e) is Notify]
    assert [n.event["version"] for n in notes] == [4, 5]  # 3 is not newer than the listen
    assert notes[1].event["dropped"] == 1 and notes[0].callbacks == ["cb"]


def test_a_refused_listen_forgets_its_callback() -> None:
    s = new_session()
    server, _, _ = connect(s)
    s.add_listener("w", "cb")
    listen = s.call(Listen(0, "w"), "listen", 0.0, token=1, extra="cb")
    server.read(s.pop_sendable(0.0))
    s.receive_data(Server.frames(ErrorReply(listen.id, "limit_exceeded", "too long")), 0.0)
    assert s.listener_callbacks("w") == [] and "w" not in s.listeners


def _listening(s: ClientSession, name: str, version: int) -> Server:
    server, _, _ = connect(s)
    s.add_listener(name, "cb")
    listen = s.call(Listen(0, name), "listen", 0.0, token=1, extra="cb")
    server.read(s.pop_sendable(0.0))
    s.receive_data(Server.frames(Listening(listen.id, version, 1)), 0.0)
    return server


@pytest.mark.parametrize(("new_version", "server_id", "expect"), [
    (7, "A", {"op": "resync", "version": 7, "n_items": 4}),
    (5, "A", None),  # nothing changed while away: no event
    (2, "B", {"op": "resync", "version": 2, "n_items": 4, "restarted": True}),
])
def test_listeners_are_renewed_after_a_reconnect(new_version: int, server_id: str,
                                                 expect: dict[str, Any] | None) -> None:
    s = new_session()
    _listening(s, "w", 5)
    s.connection_lost("reset", 1.0)
    _, _, events = connect(s, 2.0, resumed=server_id == "A", server_id=server_id)
    server = Server()
    (renew,) = server.requests(s.pop_sendable(2.0))
    assert type(renew) is Listen and renew.bin == "w"
    events = s.receive_data(Server.frames(Listening(renew.id, new_version, 4)), 2.0)
    notes = [e for e in events if type(e) is Notify]
    if expect is None:
        assert notes == []
    else:
        (note,) = notes
        assert {k: note.event[k] for k in expect} == expect and note.callbacks == ["cb"]
    later = s.receive_data(Server.frames(Changed("w", "put", 1, new_version + 1)), 2.0)
    assert [e.event["version"] for e in later if type(e) is Notify] == [new_version + 1]


# -- heartbeats, abandon and close --------------------------------------------------------------
def test_a_quiet_connection_is_checked_with_a_ping_and_dropped_if_it_is_dead() -> None:
    s = new_session(heartbeat=2.0)
    server, _, _ = connect(s)
    assert s.tick(1.9) == [] and not s.has_sendable
    assert s.tick(2.0) == [] and s.has_sendable
    (ping,) = server.requests(s.pop_sendable(2.0))
    assert type(ping) is Ping
    (drop,) = s.tick(2.0 + T)
    assert type(drop) is Drop and "heartbeat" in drop.reason


def test_an_answered_heartbeat_keeps_the_connection() -> None:
    s = new_session(heartbeat=2.0)
    server, _, _ = connect(s)
    s.tick(2.0)
    (ping,) = server.requests(s.pop_sendable(2.0))
    s.receive_data(Server.frames(Acked(ping.id, True)), 2.1)
    assert s.tick(2.0 + T) == []  # no Drop: a new ping goes out instead
    assert s.has_sendable


def test_a_gets_reply_is_acknowledged_by_a_ping_when_nothing_else_is_sent() -> None:
    """The server holds a get's items for the session until the client acknowledges the
    reply; a client that sends nothing after it sends a ping ACK_DELAY later to carry the
    acknowledgement (a writer of the same user waiting for quota room is then not held back
    by items already delivered)."""
    s = new_session()  # (no heartbeat for as long as the test runs)
    server, _, _ = connect(s)
    g = s.call(get(), "get", 0.0, token=1)
    server.read(s.pop_sendable(0.0))
    assert s.ack_due() is None  # nothing held yet
    s.receive_data(Server.frames(Fetched(g.id, "list", (item(1),), 2, 0)), 1.0)
    assert s.ack_due() == 1.0 + ACK_DELAY
    assert s.tick(1.0 + ACK_DELAY / 2) == [] and not s.has_sendable  # not yet
    assert s.tick(1.0 + ACK_DELAY) == [] and s.has_sendable
    msgs = server.read(s.pop_sendable(1.0 + ACK_DELAY))
    assert [type(m) for m in msgs] == [AckInfo, Ping] and msgs[0].through >= g.id
    assert s.ack_due() is None
    # A request sent in time carries the acknowledgement itself: no ping.
    g2 = s.call(get(), "get", 2.0, token=2)
    server.read(s.pop_sendable(2.0))
    s.receive_data(Server.frames(Acked(msgs[1].id, True), Fetched(g2.id, "list", (item(2),),
                                                                  3, 0)), 2.1)
    p = s.call(Put(0, "w", item(1)), "put", 2.15, token=3)
    acked = server.read(s.pop_sendable(2.15))
    assert [type(m) for m in acked] == [AckInfo, Put] and acked[0].through >= g2.id
    assert s.ack_due() is None and p.id > g2.id
    assert s.tick(2.1 + ACK_DELAY) == [] and not s.has_sendable
    # A put's reply (nothing held) and a session without a session id never ask for one.
    s.receive_data(Server.frames(Stored(p.id, 1, 1)), 2.2)
    assert s.ack_due() is None
    # While a ping is on its way (it left before a get's reply came), nothing is due: its
    # answer comes first, and then the next ping carries the acknowledgement.
    g4, g5 = (s.call(get(), "get", 3.0, token=t) for t in (4, 5))
    server.read(s.pop_sendable(3.0))
    s.receive_data(Server.frames(Fetched(g4.id, "list", (item(4),), 5, 0)), 3.1)
    s.tick(3.1 + ACK_DELAY)
    (ping,) = server.requests(s.pop_sendable(3.1 + ACK_DELAY))
    s.receive_data(Server.frames(Fetched(g5.id, "list", (item(5),), 6, 0)), 3.4)
    assert s.ack_due() is None and s.tick(4.0) == [] and not s.has_sendable
    s.receive_data(Server.frames(Acked(ping.id, True)), 4.1)
    assert s.ack_due() == 3.4 + ACK_DELAY
    plain = new_session(session=False)
    server, _, _ = connect(plain)
    g3 = plain.call(get(), "get", 0.0, token=1)
    server.read(plain.pop_sendable(0.0))
    plain.receive_data(Server.frames(Fetched(g3.id, "list", (item(1),), 2, 0)), 1.0)
    assert plain.ack_due() is None


def test_abandoning_a_sent_get_asks_for_its_items_back() -> None:
    s = new_session()
    server, _, _ = connect(s)
    g = s.call(get(), "get", 0.0, token=1)
    p = s.call(Put(0, "w", item(1)), "put", 0.0, token=2)
    server.read(s.pop_sendable(0.0))
    s.abandon(g, 1.0)
    s.abandon(p, 1.0)
    (cancel,) = server.requests(s.pop_sendable(1.0))
    assert cancel.target == g.id and s.pending == 2  # the get (until answered) + the cancel


def test_close_fails_every_call_and_refuses_new_ones() -> None:
    s = new_session()
    server, _, _ = connect(s)
    calls = [s.call(Ping(0), "ping", 0.0, token=i) for i in range(3)]
    server.read(s.pop_sendable(0.0))
    events = s.close(ConnectionLost("client was closed"))
    assert [d.call for d in done(events)] == calls
    assert all("client was closed" in str(d.error) for d in done(events))
    with pytest.raises(ConnectionLost):
        s.call(Ping(0), "ping", 0.0)
