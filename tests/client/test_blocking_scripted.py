"""The blocking Client against a scripted server on a socketpair: no real server at all.

Each connection the client makes (through its ``connector``) is one end of a socketpair; a
thread serves the other end with a ``ServerWire`` (tests/rawwire.py) and a script that decides
what to answer, so timeouts, late replies, listener bookkeeping and reconnects can be driven
exactly.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tensorshare.client.blocking import Client
from tensorshare.errors import ConnectionLost, ReplyTimeout
from tensorshare.wire import codec
from tensorshare.wire.messages import (
    Acked,
    Append,
    ErrorReply,
    Fetched,
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
from tensorshare.wire.protocol import AckInfo
from tests.conftest import wait_until
from tests.rawwire import ServerWire

WAIT = 10.0
Script = Callable[[Any, "Scripted"], list[Any] | None]


class Scripted:
    """Serves every connection of a client with ``script(request, self) -> replies``."""

    def __init__(self, script: Script, *, resumed: bool = True) -> None:
        self.script = script
        self.resumed = resumed
        self.server_id = "scripted"
        self.requests: list[Any] = []  # every request, from every connection, in order
        self.connections: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def connector(self) -> socket.socket:
        mine, theirs = socket.socketpair()
        theirs.settimeout(WAIT)
        t = threading.Thread(target=self._serve, args=(mine,), daemon=True)
        with self.lock:
            self.connections.append(mine)
            self.threads.append(t)
        t.start()
        return theirs

    def send(self, sock: socket.socket, *msgs: Any) -> None:
        conn = ServerWire()
        try:
            sock.sendall(b"".join(b"".join(conn.send(m)) for m in msgs))
        except OSError:
            pass

    def _serve(self, sock: socket.socket) -> None:
        conn = ServerWire()
        conn.handshake_done()
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    return
                for msg in conn.receive_data(data):
                    if type(msg) is AckInfo:
                        continue
                    with self.lock:
                        self.requests.append(msg)
                    if type(msg) is Hello:
                        self.send(sock, HelloReply(msg.id, 1, "scripted", Limits(),
                                                   self.resumed and msg.resume, self.server_id))
                        continue
                    replies = self.script(msg, self)
                    if replies:
                        self.send(sock, *replies)
        except OSError:
            return
        finally:
            sock.close()

    def cut(self) -> None:
        """Drop every connection (as a network failure would)."""
        with self.lock:
            for sock in self.connections:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def of(self, cls: type) -> list[Any]:
        with self.lock:
            return [m for m in self.requests if type(m) is cls]


def ok(msg: Any, _: Scripted) -> list[Any] | None:
    """Answer like a tiny server: versions count up, gets return one item."""
    if type(msg) in (Put, Append):
        return [Stored(msg.id, msg.id, 1)]
    if type(msg) is Ping:
        return [Acked(msg.id, True)]
    if type(msg) is Listen:
        return [Listening(msg.id, 1, 0)]
    return [ErrorReply(msg.id, "invalid_request", "not scripted")]


@pytest.fixture
def make() -> Iterator[Callable[..., tuple[Client, Scripted]]]:
    clients: list[Client] = []
    servers: list[Scripted] = []

    def build(script: Script = ok, *, resumed: bool = True, **kw: Any) -> tuple[Client, Scripted]:
        srv = Scripted(script, resumed=resumed)
        kw.setdefault("timeout", WAIT)
        kw.setdefault("heartbeat", 1000.0)
        c = Client("scripted", 1, connector=srv.connector, **kw)
        clients.append(c)
        servers.append(srv)
        return c, srv

    try:
        yield build
    finally:
        for c in clients:
            c.close()
        for srv in servers:
            srv.cut()
            for t in srv.threads:
                t.join(WAIT)


def test_a_late_reply_after_a_timeout_is_ignored_and_the_client_carries_on(make: Any) -> None:
    held: list[Any] = []

    def script(msg: Any, srv: Scripted) -> list[Any] | None:
        if type(msg) is Put and msg.bin == "slow":
            held.append(msg)  # answered later, by the test
            return None
        return ok(msg, srv)

    c, srv = make(script, timeout=0.3)
    with pytest.raises(ReplyTimeout, match="put to bin 'slow'.*may or may not"):
        c.put("slow", 1)
    srv.send(srv.connections[0], Stored(held[0].id, 7, 1))  # far too late
    assert c.put("fast", 2) > 0
    assert c.connected


def test_the_timeout_is_about_silence_not_a_slow_transfer(make: Any) -> None:
    payload = list(range(20000))

    def script(msg: Any, srv: Scripted) -> list[Any] | None:
        if type(msg).__name__ == "Fetch":
            frame = b"".join(ServerWire().send(
                Fetched(msg.id, "value", (Item(codec.encode(payload)),), 1, 0)))
            sock = srv.connections[-1]
            step = max(len(frame) // 8, 1)
            for i in range(0, len(frame), step):  # 8 chunks, 0.1 s apart: 0.8 s in all
                sock.sendall(frame[i: i + step])
                threading.Event().wait(0.1)
            return None
        return ok(msg, srv)

    c, _ = make(script, timeout=0.5)
    assert c.get("big") == payload  # took longer than the timeout, never silent that long


def test_a_refused_listen_forgets_the_callback(make: Any) -> None:
    def script(msg: Any, srv: Scripted) -> list[Any] | None:
        if type(msg) is Listen:
            return [ErrorReply(msg.id, "limit_exceeded", "no more listeners")]
        return ok(msg, srv)

    c, srv = make(script)
    with pytest.raises(Exception, match="no more listeners"):
        c.listen("w", lambda e: None)
    assert c.unlisten("w") is False  # nothing was kept
    with pytest.raises(Exception, match="no more listeners"):
        c.listen("w", lambda e: None)  # a second try asks the server again
    assert len(srv.of(Listen)) == 2


def test_a_second_callback_on_a_bin_sends_no_second_listen(make: Any) -> None:
    c, srv = make()
    c.listen("w", lambda e: None)
    c.listen("w", lambda e: None)
    assert len(srv.of(Listen)) == 1


def test_a_cut_connection_is_resumed_and_unanswered_requests_are_resent(make: Any) -> None:
    first_put = threading.Event()

    def script(msg: Any, srv: Scripted) -> list[Any] | None:
        if type(msg) is Put and not first_put.is_set():
            first_put.set()
            return None  # lost: the connection is cut before the reply
        return ok(msg, srv)

    c, srv = make(script)
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(c.put("w", 1)))
    t.start()
    assert first_put.wait(WAIT)
    srv.cut()
    t.join(WAIT)
    puts = srv.of(Put)
    assert len(puts) == 2 and puts[0].id == puts[1].id  # the same request, sent again
    hellos = srv.of(Hello)
    assert len(hellos) == 2 and hellos[1].resume and hellos[1].session == hellos[0].session
    assert result == [puts[0].id]


def test_without_reconnect_a_cut_fails_pending_calls(make: Any) -> None:
    def script(msg: Any, srv: Scripted) -> list[Any] | None:
        return None if type(msg) is Put else ok(msg, srv)

    c, srv = make(script, reconnect=False)
    call = c.begin_put("w", 1)
    wait_until(lambda: bool(srv.of(Put)), what="the put to reach the server")
    srv.cut()
    with pytest.raises(ConnectionLost):
        call.result()
    assert c.closed


def test_heartbeats_reach_a_quiet_server(make: Any) -> None:
    _, srv = make(heartbeat=0.05)
    wait_until(lambda: len(srv.of(Ping)) >= 3, what="three heartbeats")
