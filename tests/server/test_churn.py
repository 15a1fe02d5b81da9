"""A server gives back what every closed connection held (issue 35).

A connection joins registries when it is made (the server's open connections, its user's,
the listeners of bins, waiting requests, the other kinds' records, its session, timers); it
must leave every one of them when it ends, whichever way it ends: ``bye``, a clean close, a
cut, a fatal frame, a hello that never came, a refusal at ``max_connections``, a user removed
by a reload, the server's shutdown. Two ways to see it: ``gc`` in an :class:`EmbeddedServer`
finds no :class:`ServerProtocol` of a closed connection, and the RSS of a ``tensorshare
serve`` process stays flat over 5,000 short-lived clients of each kind. The per-user
connection counts of ``stats`` come back to where they were. This file runs on the pure path
too (``tests/test_ext.py``).
"""

from __future__ import annotations

import gc
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tensorshare import Client
from tensorshare.errors import AuthenticationError, LimitExceeded, QuotaExceeded
from tensorshare.server import EmbeddedServer, ServerConfig
from tensorshare.server.connection import ServerProtocol
from tensorshare.wire.auth import client_proof, new_nonce, token_bytes
from tensorshare.wire.codec import encode
from tensorshare.wire.messages import Auth, Bye, Hello, Ping
from tensorshare.wire.protocol import PROTOCOL_VERSIONS, AckInfo
from tensorshare.wire.records import Append, ErrorReply, Item
from tensorshare.wire.services import ServiceCall, ServiceTake
from tensorshare.wire.streams import StreamJoin, StreamRead
from tests.conftest import wait_until
from tests.rawwire import Get, WireClient

TOKENS = {"default": "churn-default-token", "alice": "churn-alice-token",
          "temp": "churn-temp-token"}


def _users_file(tmp: Any, with_temp: bool = True) -> str:
    """A users file: ``alice`` (its own bins, two connections at most) and ``temp`` (the
    user a reload removes), beside the built-in ``default`` of ``--token-file``."""
    for name, token in TOKENS.items():
        (tmp / f"{name}.token").write_text(token)
    text = ('[users.alice]\ntoken_file = "alice.token"\nread = ["alice/*"]\n'
            'write = ["alice/*"]\nmax_connections = 2\n')
    if with_temp:
        text += '[users.temp]\ntoken_file = "temp.token"\nread = ["*"]\nwrite = ["*"]\n'
    path = tmp / "users.toml"
    path.write_text(text)
    return str(path)


# -- a bare client: one connection, as short as a client can make it ----------------------
class Raw:
    """One connection spoken by hand (fast enough for thousands per test)."""

    def __init__(self, port: int, *, user: str | None = None, token: str | None = None,
                 session: bytes | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.wire = WireClient()
        self.buf: list[Any] = []
        nonce = new_nonce() if token is not None else None
        hello = Hello(self.wire.next_id(), PROTOCOL_VERSIONS, "churn", nonce, session,
                      user=user)
        reply = self.call(hello)
        if token is not None and not isinstance(reply, ErrorReply):
            proof = client_proof(token_bytes(token), nonce or b"", reply.nonce, session,
                                 "churn", user)
            reply = self.call(Auth(self.wire.next_id(), proof))
        self.hello = reply

    def call(self, msg: Any, ack: Any = None) -> Any:
        self.sock.sendall(self.wire.frame(msg, ack))
        return self.reply()

    def reply(self) -> Any:
        """The next message from the server."""
        while not self.buf:
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("closed by the server")
            self.buf.extend(self.wire.receive_data(data))
        return self.buf.pop(0)

    def cut(self) -> None:
        """Drop the connection without a word (a reset, as a killed process's)."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    def close(self) -> None:
        self.sock.close()

    def wait_closed(self) -> None:
        """Read until the server closes this connection."""
        while True:
            try:
                if not self.sock.recv(1 << 16):
                    break
            except OSError:
                break
        self.sock.close()


def _ok(reply: Any) -> Any:
    assert not isinstance(reply, ErrorReply), reply
    return reply


# -- the ways a connection ends -------------------------------------------------------------
def ping_and_bye(port: int, cred: dict[str, Any]) -> None:
    """A client that connects with a session, pings and says goodbye (``Client.close``)."""
    c = Raw(port, session=os.urandom(16), **cred)
    _ok(c.hello)
    _ok(c.call(Ping(c.wire.next_id())))
    _ok(c.call(Bye(c.wire.next_id())))
    c.wait_closed()


def append_get_and_bye(port: int, cred: dict[str, Any]) -> None:
    """A session that appends, gets (items held until acknowledged), acks and says bye."""
    c = Raw(port, session=os.urandom(16), **cred)
    name = _bin(cred, "q")
    _ok(c.call(Append(c.wire.next_id(), name, ITEM)))
    got = _ok(c.call(Get(c.wire.next_id(), name, max_items=1)))
    assert len(got.items) == 1
    _ok(c.call(Bye(c.wire.next_id()), AckInfo(got.id, ())))
    c.wait_closed()


def listen_and_cut(port: int, cred: dict[str, Any]) -> None:
    """A session that listens and waits on a get, then is cut without a bye."""
    from tensorshare.wire.messages import Listen

    c = Raw(port, session=os.urandom(16), **cred)
    name = _bin(cred, "w")
    _ok(c.call(Listen(c.wire.next_id(), name)))
    c.sock.sendall(c.wire.frame(Get(c.wire.next_id(), name, wait=True, timeout=30.0)))
    _ok(c.call(Ping(c.wire.next_id())))
    c.cut()


def clean_close(port: int, cred: dict[str, Any]) -> None:
    """A connection closed after its hello without a bye (no session)."""
    c = Raw(port, **cred)
    _ok(c.hello)
    c.close()


def fatal_frame(port: int, cred: dict[str, Any]) -> None:
    """A connection that sends a frame the server cannot parse: closed by the server."""
    c = Raw(port, **cred)
    _ok(c.hello)
    c.sock.sendall(b"\xff" * 64)
    c.wait_closed()


def host_waits_and_is_cut(port: int, cred: dict[str, Any]) -> None:
    """A service host whose take waits for calls, cut."""
    c = Raw(port, session=os.urandom(16), **cred)
    c.sock.sendall(c.wire.frame(ServiceTake(c.wire.next_id(), _bin(cred, "svc"), timeout=30.0)))
    _ok(c.call(Ping(c.wire.next_id())))
    c.cut()


def caller_waits_and_is_cut(port: int, cred: dict[str, Any]) -> None:
    """A caller whose call waits in a service no host serves (kept for its session), cut."""
    c = Raw(port, session=os.urandom(16), **cred)
    c.sock.sendall(c.wire.frame(ServiceCall(c.wire.next_id(), _bin(cred, "idle"), ITEM,
                                            timeout=30.0)))
    _ok(c.call(Ping(c.wire.next_id())))
    c.cut()


def reader_waits_and_is_cut(port: int, cred: dict[str, Any]) -> None:
    """A stream consumer (without a session) whose read waits, cut."""
    c = Raw(port, **cred)
    who = os.urandom(6).hex()
    # Sent together: the read reaches the server before the 0.2 s lease of the join (the
    # stream's only member) can run out, however slowly this process runs.
    c.sock.sendall(c.wire.frame(StreamJoin(c.wire.next_id(), _bin(cred, "st"), who, lease=0.2))
                   + c.wire.frame(StreamRead(c.wire.next_id(), _bin(cred, "st"), who,
                                             timeout=30.0)))
    _ok(c.reply())  # the join's
    ping = Ping(c.wire.next_id())
    reply = c.call(ping)
    if isinstance(reply, ErrorReply) and reply.id == ping.id - 1 and reply.code == "bin_not_found":
        # A machine so slow that the lease ran out first: the stream was removed and its
        # waiting read answered so (as it should be); the ping's reply comes next.
        reply = c.reply()
    _ok(reply)
    c.cut()


def _bin(cred: dict[str, Any], name: str) -> str:
    return f"alice/{name}" if cred.get("user") == "alice" else name


ITEM = Item(encode(torch.arange(4)))


KINDS: dict[str, Callable[[int, dict[str, Any]], None]] = {
    "bye": ping_and_bye, "session": append_get_and_bye, "cut": listen_and_cut,
    "close": clean_close, "fatal": fatal_frame, "take": host_waits_and_is_cut,
    "call": caller_waits_and_is_cut, "read": reader_waits_and_is_cut,
}


def refused(port: int, cred: dict[str, Any]) -> None:
    """A connection refused at ``max_connections`` (the server's, or its user's quota)."""
    try:
        c = Raw(port, **cred)
    except (ConnectionError, OSError):
        return  # refused before its hello was answered
    assert isinstance(c.hello, ErrorReply), c.hello
    assert c.hello.code in (LimitExceeded.code, QuotaExceeded.code), c.hello
    c.wait_closed()


# -- looking inside an embedded server -------------------------------------------------------
def _inside(server: EmbeddedServer) -> dict[str, Any]:
    """In the server's thread, after a collection: the protocols still alive that belong to
    closed connections, the open ones, and each user's count of connections."""

    def look() -> dict[str, Any]:
        gc.collect()
        f = server.factory
        protos = [o for o in gc.get_objects() if type(o) is ServerProtocol]
        return {"closed_alive": sum(1 for p in protos if p._closed),
                "open": len(f.connections),
                "users": {name: len(u.conns) for name, u in f.users.usage.items()}}

    return server.call(look)


def _open(server: EmbeddedServer) -> int:
    """The server's open connections (to wait on: :func:`_inside`'s collection, a full one
    of this process's heap, is for the check once they closed, not for every poll)."""
    return int(server.call(lambda: len(server.factory.connections)))


def _per_user(client: Client) -> dict[str, int]:
    """Every user's open connections, as ``stats`` says."""
    users = client.stats()["server"].get("users") or {}
    return {name: entry["connections"] for name, entry in users.items()}


@pytest.fixture(params=["open", "users"])
def embedded(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[tuple[EmbeddedServer,
                                                                             dict[str, Any]]]:
    """A server without tokens, and one with a users file (clients are ``alice``)."""
    if request.param == "open":
        config = ServerConfig(hello_timeout=0.3, max_connections=64)
        srv = EmbeddedServer(port=0, config=config)
        cred: dict[str, Any] = {}
    else:
        config = ServerConfig(hello_timeout=0.3, max_connections=64,
                              users_file=_users_file(tmp_path),
                              token_file=str(tmp_path / "default.token"))
        srv = EmbeddedServer(port=0, config=config)
        cred = {"user": "alice", "token": TOKENS["alice"]}
    try:
        yield srv, cred
    finally:
        srv.stop()


def _watcher(srv: EmbeddedServer) -> Client:
    """A client that reads every user's figures (``default``, with a token when there is one)."""
    token = TOKENS["default"] if srv.factory.users.authenticating else None
    return Client("127.0.0.1", srv.port, token=token, timeout=10)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_no_closed_connection_survives_a_collection(embedded: tuple[EmbeddedServer,
                                                                    dict[str, Any]],
                                                    kind: str) -> None:
    srv, cred = embedded
    with _watcher(srv) as watcher:
        before = _per_user(watcher)
        for _ in range(150):
            KINDS[kind](srv.port, cred)
        wait_until(lambda: _open(srv) == 1, what="the server to see them close")
        inside = _inside(srv)
        assert inside["closed_alive"] == 0, inside
        assert sum(inside["users"].values()) == 1, inside  # the watcher's own
        assert _per_user(watcher) == before
        assert watcher.stats()["server"]["connections"] == 1


def test_a_hello_that_never_comes_and_a_refusal_leave_nothing(
        embedded: tuple[EmbeddedServer, dict[str, Any]]) -> None:
    srv, cred = embedded
    with _watcher(srv) as watcher:
        before = _per_user(watcher)
        silent = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(20)]
        wait_until(lambda: _open(srv) == 1, what="hello deadlines to pass")
        for s in silent:
            s.close()
        # At the user's quota (alice: 2), or the server's max_connections (64).
        held = [Raw(srv.port, **cred) for _ in range(2 if cred else 63)]
        for _ in range(100):
            refused(srv.port, cred)
        for c in held:
            c.close()
        wait_until(lambda: _open(srv) == 1, what="the held connections to close")
        # A refused connection no longer counts: the next one is admitted at once.
        again = Raw(srv.port, **cred)
        _ok(again.hello)
        again.close()
        wait_until(lambda: _open(srv) == 1, what="the last one to close")
        inside = _inside(srv)
        assert inside["closed_alive"] == 0, inside
        assert _per_user(watcher) == before


def test_a_removed_user_and_the_shutdown_leave_nothing(tmp_path: Any) -> None:
    users = _users_file(tmp_path)
    config = ServerConfig(users_file=users, token_file=str(tmp_path / "default.token"))
    srv = EmbeddedServer(port=0, config=config)
    try:
        with _watcher(srv) as watcher:
            for _ in range(5):
                temps = [Raw(srv.port, user="temp", token=TOKENS["temp"]) for _ in range(20)]
                for c in temps:
                    _ok(c.hello)
                assert _per_user(watcher)["temp"] == 20
                _users_file(tmp_path, with_temp=False)
                watcher.reload_users()
                for c in temps:
                    c.wait_closed()
                _users_file(tmp_path, with_temp=True)
                watcher.reload_users()
            wait_until(lambda: _open(srv) == 1, what="the removed user's connections")
            assert _inside(srv)["closed_alive"] == 0
            assert _per_user(watcher)["temp"] == 0
        with pytest.raises(AuthenticationError):
            Client("127.0.0.1", srv.port, user="gone", token="x", timeout=2).ping()
        keep = [Raw(srv.port, user="alice", token=TOKENS["alice"]) for _ in range(2)]
        assert all(not isinstance(c.hello, ErrorReply) for c in keep)
    finally:
        srv.stop()
    # The shutdown closed every connection and left none registered.
    assert not srv.factory.connections
    assert all(not u.conns for u in srv.factory.users.usage.values())


def test_a_closed_client_does_not_reconnect_after_its_bye(
        server: EmbeddedServer, caplog: pytest.LogCaptureFixture) -> None:
    """The server closes a connection once it answered its bye: the client's reader must
    take that end as the client's own, never as a drop to reconnect from."""
    with caplog.at_level("WARNING", logger="tensorshare"):
        for _ in range(300):
            c = Client("127.0.0.1", server.port, timeout=5)
            c.put("x", torch.ones(1))
            c.close()
    assert not [r for r in caplog.records if "reconnecting" in r.getMessage()]
    wait_until(lambda: server.call(lambda: len(server.factory.connections)) == 0,
               what="every client's connection to close")
    assert server.call(lambda: server.factory.stats.counters["connections_total"]) == 300


# -- the RSS of a real server process under churn ---------------------------------------------
def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _serve(tmp: Any, users: bool, pure: bool) -> tuple[subprocess.Popen[bytes], int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, "-m", "tensorshare", "serve", "--port", str(port), "-q",
            "--session-ttl", "0.5", "--max-connections", "16"]
    if users:
        args += ["--users-file", _users_file(tmp), "--token-file", str(tmp / "default.token")]
    env = {**os.environ}
    if pure:
        env["TENSORSHARE_NO_EXTENSIONS"] = "1"
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise AssertionError("the server did not start") from None
            time.sleep(0.05)
    return proc, port


def _removed_users(port: int, tmp: Any, watcher: Client, n: int) -> None:
    """``n`` connections of user ``temp``, closed by the reload that removes it (then the
    user is defined again), 20 at a time."""
    for _ in range(n // 20):
        temps = [Raw(port, user="temp", token=TOKENS["temp"]) for _ in range(20)]
        _users_file(tmp, with_temp=False)
        watcher.reload_users()
        for c in temps:
            c.wait_closed()
        _users_file(tmp, with_temp=True)
        watcher.reload_users()


@pytest.mark.long
@pytest.mark.timeout(300)  # (busy: on 2 cores shared with other tests, about a minute)
@pytest.mark.parametrize("path", ["compiled", "pure"])
@pytest.mark.parametrize("users", [False, True], ids=["open", "users"])
def test_rss_stays_flat_under_5000_short_lived_clients_of_each_kind(
        tmp_path: Any, users: bool, path: str) -> None:
    """Ten rounds of 500 clients of each kind (every way a connection ends, a refusal at
    ``max_connections`` and, with users, a user removed by a reload): the server's RSS after
    the last round within 10 MiB of its RSS after the first."""
    from tensorshare import _ext

    if path == "compiled" and not any(_ext.compiled().values()):
        pytest.skip("no compiled twin runs in this process (the pure path is tested)")
    if os.environ.get(_ext.NO_EXTENSIONS_ENV, "") not in ("", "0"):
        pytest.skip("the servers of this test pick their path themselves: the default run "
                    "runs it both ways")
    proc, port = _serve(tmp_path, users, pure=path == "pure")
    cred: dict[str, Any] = {"user": "alice", "token": TOKENS["alice"]} if users else {}
    limit = 2 if users else 15  # alice's quota; the server's 16 less the watcher
    samples = []
    try:
        with Client("127.0.0.1", port, token=TOKENS["default"] if users else None,
                    timeout=10) as watcher:
            before = _per_user(watcher)
            for _ in range(10):
                for churn in KINDS.values():
                    for _ in range(500):
                        churn(port, cred)
                held = [Raw(port, **cred) for _ in range(limit)]
                for _ in range(500):
                    refused(port, cred)
                for c in held:
                    c.close()
                if users:
                    _removed_users(port, tmp_path, watcher, 500)
                # (nothing asks for stats meanwhile: a count that prunes closed connections
                # when it is read must not hide them)
                samples.append(_rss_mib(proc.pid))
            wait_until(lambda: watcher.stats()["server"]["connections"] == 1,
                       what="every client's connection to close")
            assert _per_user(watcher) == before
        assert samples[-1] - samples[0] < 10, f"RSS (MiB) after each round: {samples}"
    finally:
        proc.terminate()
        proc.wait(10)
