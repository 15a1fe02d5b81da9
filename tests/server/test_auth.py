"""The server's side of authentication: the challenge, the proofs, roles, slowing guessers down,
and protected mode (issue "Safe on a shared network")."""

from __future__ import annotations

import os

import pytest
from twisted.internet.testing import MemoryReactorClock

from tensorshare.server import EmbeddedServer, ServerConfig
from tensorshare.server.auth import FailedAttempts, check_exposure, is_loopback
from tensorshare.server.core import ServerFactory
from tensorshare.wire import codec
from tensorshare.wire.auth import client_proof, server_proof, token_bytes
from tensorshare.wire.messages import (
    Auth,
    Challenge,
    ErrorReply,
    Fetched,
    Hello,
    HelloReply,
    Item,
    Ping,
    Put,
    Stored,
)
from tensorshare.wire.protocol import PROTOCOL_VERSIONS
from tests.rawwire import Peek
from tests.server.test_connection import Peer

TOKEN, READ = "write-token", "read-token"
NONCE = os.urandom(32)


@pytest.fixture
def clock() -> MemoryReactorClock:
    return MemoryReactorClock()


@pytest.fixture
def factory(clock: MemoryReactorClock) -> ServerFactory:
    return ServerFactory(clock, config=ServerConfig(token=TOKEN, read_token=READ))


def _handshake(f: ServerFactory, token: str, *, session: bytes | None = None
               ) -> tuple[Peer, HelloReply | ErrorReply, bytes]:
    p = Peer(f, hello=False)
    hello = Hello(p.rid(), PROTOCOL_VERSIONS, "t", NONCE, session)
    challenge = p.request(hello)
    assert isinstance(challenge, Challenge) and challenge.id == hello.id
    proof = client_proof(token_bytes(token), NONCE, challenge.nonce, session, "t")
    reply = p.request(Auth(p.rid(), proof))
    return p, reply, challenge.nonce


def test_the_right_token_gets_in_and_the_server_proves_it_knows_it(
        factory: ServerFactory) -> None:
    sid = os.urandom(16)
    p, reply, nonce = _handshake(factory, TOKEN, session=sid)
    assert isinstance(reply, HelloReply) and reply.role == "write"
    assert reply.proof == server_proof(token_bytes(TOKEN), NONCE, nonce, sid, "t")
    rid = p.rid()
    assert p.request(Put(rid, "w", Item(codec.encode(1)))) == Stored(rid, 1, 1)
    _, again, nonce2 = _handshake(factory, TOKEN)
    assert nonce2 != nonce  # every challenge is fresh


def test_no_token_and_a_wrong_token_are_refused_and_closed(factory: ServerFactory) -> None:
    p = Peer(factory, hello=False)
    reply = p.request(Hello(p.rid(), PROTOCOL_VERSIONS, "t"))
    assert isinstance(reply, ErrorReply) and reply.code == "authentication_failed"
    assert "requires a token" in reply.message and p.transport.disconnecting
    p, reply, _ = _handshake(factory, "guess")
    assert isinstance(reply, ErrorReply) and reply.code == "authentication_failed"
    assert "wrong token" in reply.message and p.transport.disconnecting
    assert factory.stats.counters["auth_failures"] == 2


def test_a_replayed_handshake_is_refused(factory: ServerFactory) -> None:
    _, _, nonce = _handshake(factory, TOKEN)
    captured = client_proof(token_bytes(TOKEN), NONCE, nonce, None, "t")  # what a tap saw
    p = Peer(factory, hello=False)
    p.request(Hello(p.rid(), PROTOCOL_VERSIONS, "t", NONCE))  # a new challenge
    reply = p.request(Auth(p.rid(), captured))
    assert isinstance(reply, ErrorReply) and reply.code == "authentication_failed"


def test_the_read_only_token_may_read_but_not_write(factory: ServerFactory) -> None:
    writer, _, _ = _handshake(factory, TOKEN)
    writer.put("w", 5)
    p, reply, _ = _handshake(factory, READ)
    assert isinstance(reply, HelloReply) and reply.role == "read"
    got = p.request(Peek(p.rid(), "w"))
    assert isinstance(got, Fetched)
    for rid in (p.rid(), p.rid()):
        denied = p.request(Put(rid, "w", Item(codec.encode(1))))
        assert isinstance(denied, ErrorReply) and denied.code == "permission_denied"
        assert "put is not allowed with the read-only token" in denied.message
    p.ping()  # the connection stays usable


def test_nothing_but_auth_may_follow_a_challenge(factory: ServerFactory) -> None:
    p = Peer(factory, hello=False)
    p.request(Hello(p.rid(), PROTOCOL_VERSIONS, "t", NONCE))
    reply = p.request(Put(p.rid(), "w", Item(codec.encode(1))))
    assert isinstance(reply, ErrorReply) and reply.id == 0 and "then 'auth'" in reply.message
    assert factory.store.n_items("w") == 0


def test_repeated_failures_from_one_address_are_slowed_down(
        factory: ServerFactory, clock: MemoryReactorClock) -> None:
    for _ in range(3):  # the first few are answered at once
        _, reply, _ = _handshake(factory, "guess")
        assert isinstance(reply, ErrorReply)
    p = Peer(factory, hello=False)
    challenge = p.request(Hello(p.rid(), PROTOCOL_VERSIONS, "t", NONCE))
    p.send(Auth(p.rid(), b"x" * 32))
    assert p.received() == [] and not p.transport.disconnecting  # held back...
    clock.advance(0.25)
    (reply,) = p.received()  # ...then refused
    assert isinstance(reply, ErrorReply) and reply.code == "authentication_failed"
    assert isinstance(challenge, Challenge)
    attempts = FailedAttempts(free=1, max_delay=2.0)
    assert [attempts.failed("a", now=0) for _ in range(6)] == [0, 0.25, 0.5, 1.0, 2.0, 2.0]
    assert attempts.failed("a", now=100) == 0  # the window passed


@pytest.mark.parametrize("slowed", [False, True], ids=["fresh_address", "slowed_address"])
def test_a_wrong_auth_with_a_request_behind_it_gets_authentication_failed(
        factory: ServerFactory, clock: MemoryReactorClock, slowed: bool) -> None:
    # §8.1: if the handshake fails, the requests after it are dropped unanswered; the
    # refusal is authentication_failed, after its delay from an address already slowed down.
    if slowed:
        for _ in range(3):
            _handshake(factory, "guess")
    p = Peer(factory, hello=False)
    assert isinstance(p.request(Hello(p.rid(), PROTOCOL_VERSIONS, "t", NONCE)), Challenge)
    auth = Auth(p.rid(), b"x" * 32)
    p.write(p.conn.frame(auth) + p.conn.frame(Ping(p.rid())))  # pipelined: one read
    if slowed:
        assert p.received() == [] and not p.transport.disconnecting  # held back...
        clock.advance(0.25)
    (reply,) = p.received()
    assert isinstance(reply, ErrorReply) and reply.id == auth.id
    assert reply.code == "authentication_failed" and p.transport.disconnecting
    clock.advance(10.0)
    assert p.received() == []  # the ping got nothing


def test_a_read_only_token_needs_a_different_read_write_token() -> None:
    with pytest.raises(ValueError, match="must differ"):
        ServerFactory(MemoryReactorClock(), config=ServerConfig(token="a", read_token="a"))
    with pytest.raises(ValueError, match="needs a read-write token"):
        ServerFactory(MemoryReactorClock(), config=ServerConfig(token=None, read_token="a"))


def test_protected_mode_refuses_an_open_address_without_a_token() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    with pytest.raises(ValueError, match="refusing to listen on 0.0.0.0 without a token"):
        EmbeddedServer(port=0, host="0.0.0.0", config=ServerConfig(token=None))
    check_exposure("0.0.0.0", ServerConfig(token=None, insecure=True))
    check_exposure("0.0.0.0", ServerConfig(token="t"))
    with EmbeddedServer(port=0, host="0.0.0.0", config=ServerConfig(token="t")) as srv:
        assert srv.port


def test_python_secures_a_server_with_token_token_file_or_insecure(
        tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorshare import AuthenticationError, Client
    from tensorshare.server import run_server

    monkeypatch.delenv("TENSORSHARE_TOKEN", raising=False)
    monkeypatch.delenv("TENSORSHARE_TOKEN_FILE", raising=False)
    # The refusal names what Python takes, not the command line's options.
    with pytest.raises(ValueError, match="refusing to listen on 0.0.0.0") as info:
        EmbeddedServer(port=0, host="0.0.0.0")
    text = str(info.value)
    assert "token=" in text and "token_file=" in text and "insecure=True" in text
    assert "--token-file" not in text and "--insecure" not in text
    path = os.path.join(tmp_path, "token")
    with open(path, "w", encoding="utf-8") as f:
        f.write("s3cret\n")
    with EmbeddedServer(port=0, host="0.0.0.0", token_file=path) as srv:
        with Client("127.0.0.1", srv.port, timeout=10, token="s3cret") as c:
            assert c.put("w", 1) == 1
        with pytest.raises(AuthenticationError):
            Client("127.0.0.1", srv.port, timeout=10, reconnect=False)
    with EmbeddedServer(port=0, host="0.0.0.0", token="t", config=ServerConfig(token="old")) \
            as srv, Client("127.0.0.1", srv.port, timeout=10, token="t") as c:
        assert c.ping() is None  # the argument wins over the config's token
    with EmbeddedServer(port=0, host="0.0.0.0", insecure=True) as srv:
        assert srv.factory.config.insecure and not srv.factory.users.authenticating
    with pytest.raises(ValueError, match="not both"):
        EmbeddedServer(port=0, token="a", token_file=path)
    # The seed's call, with the same keywords: serves until stopped.
    seen: list[int] = []

    def ready(server: EmbeddedServer) -> None:
        with Client("127.0.0.1", server.port, timeout=10, token="s3cret") as c:
            seen.append(c.put("x", 2))
        server.stop()

    run_server(0, "0.0.0.0", token_file=path, ready=ready)
    assert seen == [1]
