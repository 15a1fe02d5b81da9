"""The engine on its own: a :class:`Connection` held without a :class:`Client` face, and a
client that holds one (composition: the face binds the engine's entry points)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tensorshare import Client, ClientOptions, ConnectError, EmbeddedServer
from tensorshare.client.command import Command, make_item
from tensorshare.client.connection import Connection
from tensorshare.wire.messages import Ping
from tensorshare.wire.records import Fetch, FetchSpec, Put

WAIT = 20.0


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    with EmbeddedServer(port=0) as s:
        yield s


def test_a_connection_runs_commands_without_a_face(server: EmbeddedServer) -> None:
    opts = ClientOptions(timeout=WAIT)
    conn = Connection(opts.endpoint("127.0.0.1", server.port), opts)
    try:
        conn.wait_connected()
        limits = conn._session.limits
        item = make_item("x", torch.arange(3), None, limits, None, 1 << 16, None)
        version = conn._execute(Command(Put(0, "x", item), "put to bin 'x'",
                                        lambda reply: reply.version))
        assert version == 1
        assert conn._execute(Command(Ping(0), "ping", None)) is not None  # (the raw reply)
        pending = conn._submit(Command(Fetch(0, "x", FetchSpec(False)), "peek", None))
        assert pending.result().version == 1
        with Client("127.0.0.1", server.port, timeout=WAIT) as other:  # the same server
            assert torch.equal(other.peek("x"), torch.arange(3))
    finally:
        conn.close()
    assert conn._session.closed is not None


def test_wait_connected_raises_connect_error_and_closes(server: EmbeddedServer) -> None:
    port = server.port
    server.stop()  # nothing listens there now
    opts = ClientOptions(timeout=2.0, reconnect=False)
    conn = Connection(opts.endpoint("127.0.0.1", port), opts)
    with pytest.raises(ConnectError, match=f"127.0.0.1:{port}"):
        conn.wait_connected()
    assert conn._session.closed is not None


def test_a_client_holds_its_connection_and_calls_it_directly(server: EmbeddedServer) -> None:
    with Client("127.0.0.1", server.port, timeout=WAIT, compress="lz4") as c:
        conn = c._conn
        assert isinstance(conn, Connection)
        # The entry points are the connection's own, bound once: no hop per call.
        for name in ("_execute", "_submit", "_submit_future", "_submit_many", "_run_pipeline"):
            bound = getattr(c, name)
            assert bound.__self__ is conn and bound == getattr(conn, name), name
        assert c.options is conn._options and c.options.compress == "lz4"
        assert c.address == conn.address and c.connected and not c.closed
        assert c.put("y", 1) == 1 and c.begin_put("y", 2).result() == 2
        with c.pipeline() as p:
            p.append("z", 1)
            p.append("z", 2)
        assert p.results == [1, 1] and c.peek("z") == [1, 2]  # one request, one version
    assert c.closed and conn._session.closed is not None  # the with block closed both


def test_a_slot_makes_its_lock_only_for_a_thread_that_waits_and_wakes_it() -> None:
    import threading

    from tensorshare.client.connection import _Slot

    resolved = _Slot()
    resolved.resolve(7)
    assert resolved.wait(0.0) and resolved.wait(None) and resolved.reply == 7  # no lock made
    slot = _Slot()
    assert slot.wait(0.01) is False  # nothing yet (its lock made now)
    seen: list[bool] = []
    waiters = [threading.Thread(target=lambda: seen.append(slot.wait(30.0))) for _ in range(3)]
    for t in waiters:
        t.start()
    slot.resolve(None, ValueError("no"))
    for t in waiters:
        t.join(30.0)
    assert seen == [True, True, True] and isinstance(slot.error, ValueError)
    assert slot.wait(0.0)  # stays resolved
