"""``ClientSession.hold`` / ``release``: a reply the shell has not handed to its caller yet
keeps its id open in the acknowledgements, so that a get whose caller is gone (an asyncio
task cancelled after its reply came, before it resumed) can still be undone with a cancel.
Scripted like tests/client/test_session.py: no socket, no clock."""

from __future__ import annotations

from tensorshare.client.session import ClientSession
from tensorshare.errors import ConnectionLost
from tensorshare.wire.messages import Acked, Fetched, Ping, Put, Stored
from tensorshare.wire.protocol import MAX_OPEN_ACKS, AckInfo
from tests.client.test_session import Server, connect, get, item, new_session


def _got(s: ClientSession, server: Server) -> tuple[object, object]:
    """A get sent and answered with one item; a put sent after it and answered."""
    g = s.call(get(), "get", 0.0, token=1)
    p = s.call(Put(0, "w", item(1)), "put", 0.0, token=2)
    server.read(s.pop_sendable(0.0))
    s.receive_data(Server.frames(Fetched(g.id, "append", (item(7),), 1, 0)), 0.0)
    s.hold(g)
    s.receive_data(Server.frames(Stored(p.id, 1, 1)), 0.0)
    return g, p


def test_a_held_reply_stays_open_in_the_acknowledgements_until_released() -> None:
    s = new_session()
    server, _, _ = connect(s)
    g, p = _got(s, server)
    s.call(Ping(0), "ping", 0.0, token=3)
    ack, _ = server.read(s.pop_sendable(0.0))
    assert ack == AckInfo(p.id, (g.id,))  # the put acknowledged, the get not yet
    s.release(g, 0.0)
    s.call(Ping(0), "ping", 0.0, token=4)
    ack, _ = server.read(s.pop_sendable(0.0))
    assert ack == AckInfo(p.id)  # taken by its caller: acknowledged now
    assert not s.held


def test_releasing_with_undo_cancels_the_get_and_keeps_it_open_until_answered() -> None:
    s = new_session()
    server, _, _ = connect(s)
    g, p = _got(s, server)
    s.release(g, 1.0, undo=True)
    ack, cancel = server.read(s.pop_sendable(1.0))
    assert cancel.target == g.id and ack == AckInfo(p.id, (g.id,))
    s.receive_data(Server.frames(Acked(cancel.id, True)), 1.0)  # the items are back
    assert not s.held
    s.call(Ping(0), "ping", 1.0, token=5)
    ack, _ = server.read(s.pop_sendable(1.0))
    assert ack == AckInfo(cancel.id)


def test_release_of_a_call_not_held_does_nothing() -> None:
    s = new_session()
    server, _, _ = connect(s)
    g = s.call(get(), "get", 0.0, token=1)
    server.read(s.pop_sendable(0.0))
    s.release(g, 0.0, undo=True)
    assert server.read(s.pop_sendable(0.0)) == [] and s.pending == 1


def test_too_many_held_ids_fall_back_to_a_lower_ack() -> None:
    s = new_session()
    server, _, _ = connect(s)
    gets = [s.call(get(), "get", 0.0, token=i) for i in range(MAX_OPEN_ACKS + 1)]
    server.read(s.pop_sendable(0.0))
    for g in gets:
        s.receive_data(Server.frames(Fetched(g.id, "append", (item(1),), 1, 0)), 0.0)
        s.hold(g)
    s.call(Ping(0), "ping", 0.0, token="x")
    ack, _ = server.read(s.pop_sendable(0.0))
    assert ack == AckInfo(gets[0].id - 1)  # conservative: forgets nothing still held


def test_a_session_the_server_forgot_or_closed_holds_nothing() -> None:
    s = new_session()
    server, _, _ = connect(s)
    g, _ = _got(s, server)
    s.connection_lost("cut", 1.0)
    connect(s, 1.0, resumed=False)
    assert not s.held  # that server has nothing of ours to give back
    s.release(g, 1.0, undo=True)
    assert s.pending == 0
    s2 = new_session()
    server2, _, _ = connect(s2)
    g2, _ = _got(s2, server2)
    s2.close(ConnectionLost("closed"))
    assert not s2.held


def test_a_late_reply_to_an_abandoned_get_is_never_acknowledged_before_its_cancel() -> None:
    """A get given up on (its cancel not sent yet) whose reply then comes, the last reply so
    far: the ack that goes with the cancel must not cover it, or the server would forget
    the items before the cancel could give them back (an ack covers its own id)."""
    s = new_session()
    server, _, _ = connect(s)
    g = s.call(get(), "get", 0.0, token=1)
    server.read(s.pop_sendable(0.0))
    s.abandon(g, 1.0)
    s.receive_data(Server.frames(Fetched(g.id, "append", (item(7),), 1, 0)), 1.0)  # late
    ack, cancel = server.read(s.pop_sendable(1.0))
    assert cancel.target == g.id
    assert ack.through < g.id and g.id not in ack.open
