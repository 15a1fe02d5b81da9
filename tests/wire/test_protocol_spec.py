"""What docs/PROTOCOL.md says where it used to be silent, checked on the real server.

Each test talks the wire to the server's own protocol (a ``ServerFactory`` on a
``StringTransport`` with a fake clock, or a real ``EmbeddedServer`` over a socket) the way a
client written from the document alone would, and checks what the document now states:
which request a handshake's refusal answers, the order of writes waiting for room in a
user's quota, who ``default`` is with only a users file, two users with one token, what
``list`` shows of streams and services, a producer after its last epoch, and versions at
the top of ``min_version``'s range.
"""

from __future__ import annotations

import re
import socket
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
from twisted.internet.address import IPv4Address
from twisted.internet.testing import MemoryReactorClock, StringTransport

from tensorshare.server import EmbeddedServer, ServerConfig
from tensorshare.server.core import ServerFactory
from tensorshare.server.users import ROOM_POLL, load_users
from tensorshare.wire import codec
from tensorshare.wire.auth import client_proof, token_bytes
from tensorshare.wire.frames import PREFIX, aligned
from tensorshare.wire.messages import (
    Auth,
    Challenge,
    Delete,
    ErrorReply,
    Hello,
    HelloReply,
    Item,
    ListBins,
    Put,
    Reload,
    Stats,
    Stored,
)
from tensorshare.wire.protocol import MAX_VERSION, PROTOCOL_VERSIONS
from tensorshare.wire.services import ServiceCall
from tensorshare.wire.streams import StreamAppend, StreamEnd, StreamEnded, StreamOpen
from tests.rawwire import Peek, WireClient
from tests.server.test_users import write_users as _write_users

DOC = (Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md").read_text(encoding="utf-8")
TEXT = " ".join(DOC.split())
NONCE = bytes(32 * [5])
QUOTA = 64 * 1024
USERS = f"""
[users.alice]
token_file = "alice.token"
read  = ["alice/*"]
write = ["alice/*"]
max_memory = {QUOTA}
max_connections = 1

[users.bob]
token_file = "bob.token"
read  = ["*"]
write = ["*"]
"""
TOKENS = {"alice": "alice-secret", "bob": "bob-secret"}


class Conn:
    """One connection to a server's protocol over a StringTransport, speaking raw wire."""

    _ports = iter(range(30000, 40000))

    def __init__(self, factory: ServerFactory) -> None:
        addr = IPv4Address("TCP", "127.0.0.1", next(self._ports))
        self.proto = factory.buildProtocol(addr)
        self.transport = StringTransport(peerAddress=addr)
        self.proto.makeConnection(self.transport)
        self.wire = WireClient()

    def rid(self) -> int:
        return self.wire.next_id()

    def send(self, msg: Any) -> None:
        self.proto.dataReceived(self.wire.frame(msg))

    def received(self) -> list[Any]:
        data = self.transport.value()
        self.transport.clear()
        return self.wire.receive_data(data)

    def request(self, msg: Any) -> Any:
        self.send(msg)
        (reply,) = self.received()
        return reply

    def login(self, user: str | None, token: str, session: bytes | None = None
              ) -> tuple[int, Any]:
        """hello, then auth; the auth's id and the server's answer to it."""
        challenge = self.request(Hello(self.rid(), PROTOCOL_VERSIONS, "spec", NONCE, session,
                                       False, False, user))
        assert type(challenge) is Challenge, challenge
        proof = client_proof(token_bytes(token), NONCE, challenge.nonce, session, "spec", user)
        rid = self.rid()
        return rid, self.request(Auth(rid, proof))


def write_users(where: Path, text: str = USERS, tokens: dict[str, str] = TOKENS) -> Path:
    """The users file ``text`` and its token files in ``where``."""
    return _write_users(where, text, tokens)


@pytest.fixture
def clock() -> MemoryReactorClock:
    return MemoryReactorClock()


@pytest.fixture
def users(clock: MemoryReactorClock, tmp_path: Path) -> ServerFactory:
    return ServerFactory(clock, config=ServerConfig(users_file=str(write_users(tmp_path))))


def user(factory: ServerFactory, name: str, session: bytes | None = None) -> Conn:
    c = Conn(factory)
    _, reply = c.login(name, TOKENS[name], session)
    assert type(reply) is HelloReply, reply
    return c


def item(nbytes: int) -> Item:
    return Item(codec.encode(bytes(nbytes)))


# -------------------------------------------------------------------------- the handshake
def test_doc_8_1_refusals_after_a_challenge_are_the_reply_to_auth(
        users: ServerFactory) -> None:
    """§8.1 step 3, §8.2: a user at its max_connections, and a session of another user, are
    refused in the reply to ``auth`` (its id), and the connection is closed."""
    assert "are the reply to the `auth` (its `id`)" in TEXT
    sid = bytes(16 * [3])
    user(users, "alice", sid)  # alice's one connection (max_connections = 1)
    late = Conn(users)
    rid, reply = late.login("alice", TOKENS["alice"])
    assert type(reply) is ErrorReply and reply.id == rid and reply.code == "quota_exceeded"
    assert late.transport.disconnecting
    other = Conn(users)
    rid, reply = other.login("bob", TOKENS["bob"], sid)  # bob names alice's session
    assert type(reply) is ErrorReply and reply.id == rid and reply.code == "permission_denied"
    assert other.transport.disconnecting


def test_doc_8_2_1_no_default_user_with_only_a_users_file(
        clock: MemoryReactorClock, tmp_path: Path) -> None:
    """§8.2.1: without --token-file a hello that names no user fails, whatever token it
    proves, unless the users file defines ``default`` (with the file's rights)."""
    assert "there is no user `default`** unless the file defines one" in TEXT
    f = ServerFactory(clock, config=ServerConfig(users_file=str(write_users(tmp_path))))
    assert "default" not in f.users.table
    c = Conn(f)
    rid, reply = c.login(None, TOKENS["bob"])
    assert type(reply) is ErrorReply and reply.id == rid
    assert reply.code == "authentication_failed" and "name yours with user=" in reply.message
    text = USERS + '\n[users.default]\ntoken_file = "default.token"\nread = ["pub/*"]\n'
    f = ServerFactory(clock, config=ServerConfig(users_file=str(write_users(
        tmp_path, text, {**TOKENS, "default": "default-secret"}))))
    c = Conn(f)
    _, reply = c.login(None, "default-secret")
    assert type(reply) is HelloReply and reply.user == "default" and reply.role == "read"
    refused = c.request(Put(c.rid(), "pub/x", item(1)))
    assert type(refused) is ErrorReply and refused.code == "permission_denied"


def test_doc_8_2_1_two_users_with_one_token_are_refused_at_load(
        clock: MemoryReactorClock, tmp_path: Path) -> None:
    """§8.2.1: a configuration where two users share a token does not load (the server does
    not start; a reload of it fails and keeps the users it had)."""
    assert "refused when it is loaded, naming both users" in TEXT
    shared = {"alice": "same-secret", "bob": "same-secret"}
    path = write_users(tmp_path, USERS, shared)
    with pytest.raises(ValueError, match="users 'alice' and 'bob' have the same token"):
        load_users(ServerConfig(users_file=str(path)))
    with pytest.raises(ValueError, match="the same token"):
        ServerFactory(clock, config=ServerConfig(users_file=str(path)))
    with pytest.raises(ValueError, match="read-only token must differ"):
        load_users(ServerConfig(token="t", read_token="t"))
    f = ServerFactory(clock, config=ServerConfig(token="admin-secret",
                                                 users_file=str(write_users(tmp_path))))
    write_users(tmp_path, USERS, shared)
    admin = Conn(f)
    _, hello = admin.login(None, "admin-secret")
    assert type(hello) is HelloReply
    refused = admin.request(Reload(admin.rid()))
    assert type(refused) is ErrorReply and "the same token" in refused.message
    assert f.users.table["alice"].keys == (token_bytes(TOKENS["alice"]),)  # kept


# -------------------------------------------------------------------------- quota waits
def test_doc_8_2_1_writes_wait_for_room_first_come_first_served(
        users: ServerFactory, clock: MemoryReactorClock) -> None:
    """§8.2.1: waiting writes go oldest first; one with ``wait_room`` that fits waits behind
    them; one without it never waits (stored if it fits, ahead of them); one that could never
    fit does not wait."""
    alice = user(users, "alice")
    assert type(alice.request(Put(alice.rid(), "alice/a", item(40 * 1024)))) is Stored
    first, second = alice.rid(), alice.rid()
    alice.send(Put(first, "alice/b", item(30 * 1024), room=30.0))  # does not fit: waits
    alice.send(Put(second, "alice/c", item(1024), room=30.0))  # fits, but waits behind it
    assert alice.received() == []
    fits = alice.rid()
    assert alice.request(Put(fits, "alice/d", item(1024))) == Stored(fits, 1, 1)  # overtakes
    never = alice.rid()
    refused = alice.request(Put(never, "alice/e", item(QUOTA), room=30.0))
    assert type(refused) is ErrorReply and refused.code == "quota_exceeded"
    clock.advance(ROOM_POLL)
    assert alice.received() == []  # still no room for the oldest: nobody goes
    assert type(alice.request(Delete(alice.rid(), "alice/a"))).__name__ == "Deleted"
    clock.advance(ROOM_POLL)
    assert [(type(m), m.id) for m in alice.received()] == [(Stored, first), (Stored, second)]


# -------------------------------------------------------------------------- streams, services
def test_doc_6_9_list_shows_no_stream_or_service_and_stats_does(
        clock: MemoryReactorClock) -> None:
    """§6.9, §13.7: ``list`` has value and list bins only; streams (a finished one that is
    kept included) and services show in ``stats``."""
    f = ServerFactory(clock)
    c = Conn(f)
    assert type(c.request(Hello(c.rid(), PROTOCOL_VERSIONS, "spec"))) is HelloReply
    c.request(Put(c.rid(), "v", item(8)))
    c.request(StreamOpen(c.rid(), "s"))
    c.request(StreamAppend(c.rid(), "s", 0, 0, item(8)))
    ended = c.request(StreamEnd(c.rid(), "s", 0, 0, 1, True))
    assert type(ended) is StreamEnded and ended.finished
    c.send(ServiceCall(c.rid(), "p", item(8), 30.0))  # queued: no host
    assert c.request(ListBins(c.rid())).bins == {"v": 1}
    bins = c.request(Stats(c.rid())).bins
    assert bins["s"]["kind"] == "stream" and bins["s"]["stream"]["finished"]
    assert bins["p"]["kind"] == "service"
    c.proto.connectionLost(None)  # nobody is in the stream now: finished, it is kept
    d = Conn(f)
    d.request(Hello(d.rid(), PROTOCOL_VERSIONS, "spec"))
    assert d.request(ListBins(d.rid())).bins == {"v": 1}
    assert d.request(Stats(d.rid())).bins["s"]["stream"]["finished"]
    assert "(it shows in `stats`, §13.6, as every stream does; `list` shows no stream" in TEXT


def test_doc_13_1_a_producer_after_its_last_epoch_is_refused(clock: MemoryReactorClock) -> None:
    """§13.1: after its ``last`` epoch a producer's append or end is ``invalid_request``, and
    nothing is stored; ``stream_open`` starts a new run."""
    f = ServerFactory(clock)
    c = Conn(f)
    c.request(Hello(c.rid(), PROTOCOL_VERSIONS, "spec", None, bytes(16 * [9])))
    c.request(StreamOpen(c.rid(), "s"))
    c.request(StreamAppend(c.rid(), "s", 0, 0, item(8)))
    assert c.request(StreamEnd(c.rid(), "s", 0, 0, 1, True)).finished
    for msg in (StreamAppend(c.rid(), "s", 0, 1, item(8)), StreamEnd(c.rid(), "s", 0, 1, 0)):
        refused = c.request(msg)
        assert type(refused) is ErrorReply and refused.code == "invalid_request"
        assert "ended its last epoch" in refused.message
    assert f.bin_stats()["s"]["stream"]["head"] == 2  # the item and the epoch mark only
    opened = c.request(StreamOpen(c.rid(), "s"))
    assert opened.epoch == 1 and not f.bin_stats()["s"]["stream"]["finished"]
    assert '"... ended its last epoch"' in TEXT


# -------------------------------------------------------------------------- versions
def _frame(sock: socket.socket) -> tuple[bytes, dict[str, Any]]:
    """One frame from the server: its header's bytes and the header."""
    prefix = b""
    while len(prefix) < PREFIX:
        prefix += sock.recv(PREFIX - len(prefix))
    _, _, _, header_len, payload_len = struct.unpack("<2sBBIQ", prefix)
    rest = aligned(PREFIX + header_len) - PREFIX + payload_len if payload_len else header_len
    data = b""
    while len(data) < rest:
        data += sock.recv(rest - len(data))
    return data[:header_len], msgpack.unpackb(data[:header_len], raw=False)


def test_doc_6_1_versions_go_past_int64_after_min_version_at_its_top() -> None:
    """§6.1: ``min_version`` at 2^63 − 1 makes the version 2^63 − 1, and the next write 2^63,
    sent as a msgpack uint64 (``cf``); ``newer_than`` compares it as any version."""
    assert "version 2^63 (msgpack uint 64, `cf 80 00 00 00 00 00 00 00`)" in TEXT
    wire = WireClient()
    with EmbeddedServer(port=0) as srv, \
            socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(wire.frame(Hello(wire.next_id(), PROTOCOL_VERSIONS, "spec")))
        _frame(sock)
        sock.sendall(wire.frame(Put(wire.next_id(), "v", item(1), MAX_VERSION)))
        raw, h = _frame(sock)
        assert h["version"] == MAX_VERSION and b"\xcf" + struct.pack(">Q", MAX_VERSION) in raw
        sock.sendall(wire.frame(Put(wire.next_id(), "v", item(1))))
        raw, h = _frame(sock)
        assert h["version"] == 1 << 63 and b"\xcf" + struct.pack(">Q", 1 << 63) in raw
        sock.sendall(wire.frame(Peek(wire.next_id(), "v", newer_than=MAX_VERSION)))
        _, h = _frame(sock)
        assert h["ok"] and h["version"] == 1 << 63
        bad = {"op": "put", "id": wire.next_id(), "bin": "v", "min_version": 1 << 63,
               "items": [[codec.encode(1).value, [], None]]}
        sock.sendall(b"".join(bytes(c) for c in _raw_frame(bad)))
        _, h = _frame(sock)
        assert not h["ok"] and h["code"] == "invalid_request"
        assert re.search(r"at most 9223372036854775807", h["message"])


def _raw_frame(header: dict[str, Any]) -> list[Any]:
    from tensorshare.wire.frames import encode_frame

    return encode_frame(msgpack.packb(header, use_bin_type=True))
