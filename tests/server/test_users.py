"""Many teams on one server (issue 31), on in-memory connections: the users file, every op of
every kind of bin checked against the user's patterns (table-driven over the op table), what
list, listen and stats show, sessions kept to their user, quotas, and reloading."""

from __future__ import annotations

import fnmatch
import math
import os
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.testing import MemoryReactorClock

from tensorshare.server import ServerConfig
from tensorshare.server.accounts import load_users, parse_size
from tensorshare.server.core import ServerFactory
from tensorshare.server.sessions import SessionTable
from tensorshare.server.users import ROOM_POLL
from tensorshare.wire import codec
from tensorshare.wire.auth import client_proof, server_proof, token_bytes
from tensorshare.wire.messages import (
    Acked,
    Append,
    Auth,
    Bye,
    Cancel,
    Challenge,
    Changed,
    Delete,
    ErrorReply,
    Fetched,
    Hello,
    HelloReply,
    Item,
    ListBins,
    Listen,
    Listing,
    Ping,
    Put,
    Reload,
    Stats,
    StatsReply,
    Stored,
)
from tensorshare.wire.protocol import OPS, PROTOCOL_VERSIONS, AckInfo
from tensorshare.wire.replication import Promote, ReplAck, WaitReplicas
from tests.rawwire import Get, Peek, replaced
from tests.server.test_connection import Peer
from tests.wire.test_protocol_doc import _full_requests

NONCE = os.urandom(32)
TOKENS = {"alice": "alice-secret-1", "bob": "bob-secret-1", "dash": "dash-secret-1",
          "ops": "ops-secret-1"}
QUOTA = 64 * 1024
USERS = f"""
[users.alice]
token_file = "alice.token"
read  = ["alice/*", "shared/*"]
write = ["alice/*"]
max_memory = {QUOTA}
max_connections = 3

[users.bob]
token_file = "bob.token"
read  = ["bob/*", "shared/*"]
write = ["bob/*", "shared/*"]

[users.dash]
token_file = "dash.token"
read = ["*"]

[users.ops]
token_file = "ops.token"
admin = true
"""
# The patterns above, as this test reads them (not through the server's code).
PATTERNS = {"alice": (["alice/*", "shared/*"], ["alice/*"]),
            "bob": (["bob/*", "shared/*"], ["bob/*", "shared/*"]),
            "dash": (["*"], []), "ops": ([], [])}
BINS = ("alice/b", "bob/b", "shared/b")

# What each op needs, decided here once: an op added to the table fails this test until its
# row says what it needs (and the table test below then checks it is enforced).
EXPECTED_ACCESS = {
    "hello": "none", "auth": "none", "put": "write", "append": "write", "get": "take",
    "peek": "read", "list": "none", "delete": "write", "listen": "read", "unlisten": "none",
    "ping": "none", "cancel": "none", "stats": "none", "configure": "write", "bye": "none",
    "reload": "admin", "stream_open": "write", "stream_append": "write",
    "stream_end": "write", "stream_join": "read", "stream_read": "read",
    "stream_leave": "read", "service_call": "write", "service_take": "take",
    "service_reply": "take", "replay_open": "write", "replay_insert": "write",
    "replay_sample": "read", "replay_update": "write", "replay_info": "read", "psync": "none",
    "repl_ack": "none", "promote": "admin", "wait_replicas": "none",
}


def write_users(where: Path, text: str = USERS, tokens: dict[str, str] | None = None) -> Path:
    for name, token in (tokens or TOKENS).items():
        (where / f"{name}.token").write_text(token + "\n")
    path = where / "users.toml"
    path.write_text(text)
    return path


@pytest.fixture
def clock() -> MemoryReactorClock:
    return MemoryReactorClock()


@pytest.fixture
def users_file(tmp_path: Path) -> Path:
    return write_users(tmp_path)


@pytest.fixture
def factory(clock: MemoryReactorClock, users_file: Path) -> ServerFactory:
    return ServerFactory(clock, config=ServerConfig(token=None, users_file=str(users_file)))


def login(f: ServerFactory, user: str | None, token: str | None = None, *,
          session: bytes | None = None, resume: bool = False) -> tuple[Peer, Any]:
    """A connection that authenticates as ``user`` (its token unless ``token`` is given)."""
    p = Peer(f, hello=False)
    key = token_bytes(token if token is not None else TOKENS[user or ""])
    challenge = p.request(Hello(p.rid(), PROTOCOL_VERSIONS, "t", NONCE, session, resume,
                                False, user))
    assert isinstance(challenge, Challenge), challenge
    proof = client_proof(key, NONCE, challenge.nonce, session, "t", user)
    reply = p.request(Auth(p.rid(), proof))
    if isinstance(reply, HelloReply):
        assert reply.proof == server_proof(key, NONCE, challenge.nonce, session, "t", user)
        p.hello = reply
    return p, reply


def peer(f: ServerFactory, user: str, **kw: Any) -> Peer:
    p, reply = login(f, user, **kw)
    assert isinstance(reply, HelloReply), reply
    return p


def item(value: Any = 1) -> Item:
    return Item(codec.encode(value))


def _allowed(user: str, access: str, name: str) -> bool:
    read, write = PATTERNS[user]
    may_read = any(fnmatch.fnmatchcase(name, p) for p in read)
    may_write = any(fnmatch.fnmatchcase(name, p) for p in write)
    return {"none": True, "read": may_read, "write": may_write,
            "take": may_read and may_write, "admin": user == "ops"}[access]


# ------------------------------------------------------------------- the op table, enforced

def test_every_op_states_what_it_needs() -> None:
    assert {name: op.access for name, op in OPS.items()} == EXPECTED_ACCESS


def _request(op: str, rid: int, name: str) -> Any:
    """One request of ``op`` on bin ``name`` (or without a bin, for the ops that have none)."""
    binless = {"list": ListBins(rid), "ping": Ping(rid), "cancel": Cancel(rid, 999),
               "stats": Stats(rid), "bye": Bye(rid), "reload": Reload(rid),
               "repl_ack": ReplAck(rid, 0), "promote": Promote(rid),
               "wait_replicas": WaitReplicas(rid, 0, 0.0)}
    if op in binless:
        return binless[op]
    msg = _full_requests()[op][0]
    return replaced(msg, id=rid, bin=name)


# (psync needs the user's ``replicate`` right, which its handler checks: see
# tests/system/test_replication.py)
@pytest.mark.parametrize("op", [name for name in OPS if name not in ("hello", "auth", "psync")])
def test_each_op_of_every_kind_is_allowed_or_refused_as_the_users_file_says(
        factory: ServerFactory, op: str) -> None:
    access = EXPECTED_ACCESS[op]
    for user in PATTERNS:
        for name in BINS:
            p = peer(factory, user)
            rid = p.rid()
            msg = _request(op, rid, name)
            assert getattr(msg, "bin", name) == name
            existed = set(factory.bin_stats())
            p.send(msg)
            denied = [r for r in p.received() if isinstance(r, ErrorReply) and r.id == rid
                      and r.code == "permission_denied"]
            expected = _allowed(user, access, name if hasattr(msg, "bin") else "")
            if op == "stream_join" and name not in existed:  # (joining makes it: a write)
                expected = expected and _allowed(user, "write", name)
            assert bool(denied) != expected, (op, user, name, denied)
            if denied:
                text = denied[0].message
                assert f"user {user!r}" in text and op in text, text
                if hasattr(msg, "bin"):
                    assert repr(name) in text, text
                if op != "bye":
                    p.ping()  # the connection stays usable


def test_a_reader_joins_a_stream_once_a_writer_made_it(factory: ServerFactory) -> None:
    """Joining a stream that does not exist makes it: alice, who may only read ``shared/*``,
    is refused there (and no bin appears) until bob, who may write it, has opened it."""
    from tensorshare.wire.streams import StreamJoin, StreamJoined, StreamOpen, StreamOpened

    alice, bob = peer(factory, "alice"), peer(factory, "bob")
    reply = alice.request(StreamJoin(alice.rid(), "shared/s", "job"))
    assert isinstance(reply, ErrorReply) and reply.code == "permission_denied", reply
    assert "join once its producer has opened it" in reply.message
    assert "shared/s" not in factory.bin_stats()
    assert isinstance(alice.request(StreamJoin(alice.rid(), "alice/s", "job")), StreamJoined)
    assert isinstance(bob.request(StreamOpen(bob.rid(), "shared/s")), StreamOpened)
    assert isinstance(alice.request(StreamJoin(alice.rid(), "shared/s", "job")), StreamJoined)


def test_what_was_refused_changed_nothing(factory: ServerFactory) -> None:
    bob = peer(factory, "bob")
    assert isinstance(bob.put("bob/b", 1), Stored)
    alice = peer(factory, "alice")
    for msg in (Put(alice.rid(), "bob/b", item(2)), Append(alice.rid(), "bob/b", item(2)),
                Get(alice.rid(), "bob/b"), Delete(alice.rid(), "bob/b"),
                Put(alice.rid(), "shared/b", item(2))):
        reply = alice.request(msg)
        assert isinstance(reply, ErrorReply) and reply.code == "permission_denied"
    got = bob.request(Peek(bob.rid(), "bob/b"))
    assert isinstance(got, Fetched) and codec.decode(got.items[0].value) == 1
    assert got.version == 1 and factory.store.list() == {"bob/b": 1}
    usage = factory.users.usage["alice"]
    assert usage.denials == 5 and factory.stats.counters["denials"] == 5


# ------------------------------------------------------------ what list, listen, stats show

def test_list_listen_and_stats_show_only_what_the_user_may_read(
        factory: ServerFactory) -> None:
    bob = peer(factory, "bob")
    for name in ("bob/b", "shared/b", "bob/c"):
        bob.put(name, 1)
    alice = peer(factory, "alice")
    alice.put("alice/b", 1)
    rid = alice.rid()
    assert alice.request(ListBins(rid)) == Listing(rid, {"alice/b": 1, "shared/b": 1})
    # A listen names one bin: one the user may not read is refused; a readable one notifies.
    refused = alice.request(Listen(alice.rid(), "bob/b"))
    assert isinstance(refused, ErrorReply) and refused.code == "permission_denied"
    alice.request(Listen(alice.rid(), "shared/b"))
    bob.put("bob/b", 2)
    bob.put("shared/b", 2)
    events = alice.received()
    assert [e.bin for e in events if isinstance(e, Changed)] == ["shared/b"]
    # stats: its own bins and its own totals, not the server's.
    rid = alice.rid()
    reply = alice.request(Stats(rid))
    assert isinstance(reply, StatsReply)
    assert set(reply.bins) == {"alice/b", "shared/b"}
    s = reply.server
    assert "users" not in s and s["counters"] == {} and s["connections"] == 1
    assert s["bins"] == 2 and s["memory"]["max_memory"] == QUOTA
    assert s["user"]["requests"] >= 5 and s["user"]["denials"] == 1
    assert s["memory"]["stored"] == s["user"]["memory"]["stored"] > 0
    glob = alice.request(Stats(alice.rid(), "bob/*"))
    assert isinstance(glob, StatsReply) and glob.bins == {}
    # A user who may read everything sees the whole server, every user included.
    dash = peer(factory, "dash")
    whole = dash.request(Stats(dash.rid()))
    assert isinstance(whole, StatsReply)
    assert set(whole.bins) == {"alice/b", "bob/b", "bob/c", "shared/b"}
    assert whole.server["connections"] == 3 and whole.server["counters"]["denials"] == 1
    users = whole.server["users"]
    assert set(users) == set(TOKENS) and users["alice"]["connections"] == 1
    assert users["alice"]["memory"]["max_memory"] == QUOTA


def test_a_session_is_resumed_or_taken_over_only_by_its_own_user(
        factory: ServerFactory) -> None:
    sid = os.urandom(16)
    alice = peer(factory, "alice", session=sid)
    alice.put("alice/b", 1)
    for resume in (True, False):  # resumed, or started afresh with the id (which ends it)
        bob, reply = login(factory, "bob", session=sid, resume=resume)
        assert isinstance(reply, ErrorReply) and reply.code == "permission_denied"
        assert "belongs to another user" in reply.message and bob.transport.disconnecting
    s = factory.sessions.get(sid)
    assert s is not None and s.attached is alice.proto and not alice.transport.disconnecting
    alice.ping()
    again = peer(factory, "alice", session=sid, resume=True)  # its own user: taken over
    assert again.hello is not None and again.hello.resumed and alice.transport.disconnecting


# ------------------------------------------------------------------------------- handshake

def test_the_user_is_bound_into_the_proof(factory: ServerFactory) -> None:
    # bob's token, claiming to be alice: refused, and so is a proof made for another name.
    _, reply = login(factory, "alice", TOKENS["bob"])
    assert isinstance(reply, ErrorReply) and reply.code == "authentication_failed"
    assert "wrong token for user 'alice'" in reply.message
    p = Peer(factory, hello=False)
    challenge = p.request(Hello(p.rid(), PROTOCOL_VERSIONS, "t", NONCE, None, False, False,
                                "bob"))
    assert isinstance(challenge, Challenge)
    swapped = client_proof(token_bytes(TOKENS["alice"]), NONCE, challenge.nonce, None, "t",
                           "alice")  # alice's valid proof, the hello says bob
    reply = p.request(Auth(p.rid(), swapped))
    assert isinstance(reply, ErrorReply) and reply.code == "authentication_failed"
    _, reply = login(factory, None, TOKENS["alice"])  # no user named: default, none here
    assert isinstance(reply, ErrorReply) and "name yours with user=" in reply.message
    factory.auth_failures.failed = lambda peer, now=None: 0.0  # (not slowed down here)
    _, reply = login(factory, "nobody", "x")  # no such user: the same answer
    assert isinstance(reply, ErrorReply) and "wrong token for user 'nobody'" in reply.message
    _, ok = login(factory, "alice")
    assert isinstance(ok, HelloReply) and ok.user == "alice" and ok.role == "write"
    _, ok = login(factory, "dash")
    assert isinstance(ok, HelloReply) and ok.user == "dash" and ok.role == "read"


def test_the_two_tokens_of_before_are_the_built_in_users(
        clock: MemoryReactorClock, users_file: Path) -> None:
    f = ServerFactory(clock, config=ServerConfig(token="w-token", read_token="r-token",
                                                 users_file=str(users_file)))
    p, reply = login(f, None, "w-token")  # a client from before users: no user named
    assert isinstance(reply, HelloReply) and reply.user == "default" and reply.role == "write"
    p.put("anything/at/all", 1)
    reader, reply = login(f, None, "r-token")
    assert isinstance(reply, HelloReply) and reply.user == "readonly" and reply.role == "read"
    assert isinstance(reader.request(Peek(reader.rid(), "anything/at/all")), Fetched)
    for msg in (Put(reader.rid(), "x", item()),
                replaced(_full_requests()["stream_join"][0], id=reader.rid())):
        denied = reader.request(msg)
        assert isinstance(denied, ErrorReply) and denied.code == "permission_denied"
        assert "not allowed with the read-only token" in denied.message
    _, reply = login(f, "default", "w-token")  # naming it works too
    assert isinstance(reply, HelloReply) and reply.user == "default"
    _, reply = login(f, "alice")
    assert isinstance(reply, HelloReply) and reply.user == "alice"


def test_a_user_has_at_most_max_connections(factory: ServerFactory) -> None:
    sid = os.urandom(16)
    first = peer(factory, "alice", session=sid)
    peers = [peer(factory, "alice") for _ in range(2)]
    p, reply = login(factory, "alice")
    assert isinstance(reply, ErrorReply) and reply.code == "quota_exceeded"
    assert "user 'alice'" in reply.message and "max_connections=3" in reply.message
    assert p.transport.disconnecting
    peer(factory, "bob")  # another user is not affected
    # Taking its own session over replaces a connection: not one more.
    again = peer(factory, "alice", session=sid, resume=True)
    assert first.transport.disconnecting and again.hello is not None
    peers[0].lose()
    peer(factory, "alice")  # room again


# -------------------------------------------------------------------------------- quotas

def test_a_write_over_the_quota_fails_at_once_naming_the_user(factory: ServerFactory) -> None:
    alice = peer(factory, "alice")
    big = bytes(40 * 1024)
    assert isinstance(alice.put("alice/a", big), Stored)
    rid = alice.rid()
    refused = alice.request(Put(rid, "alice/b", item(big)))
    assert isinstance(refused, ErrorReply) and refused.code == "quota_exceeded"
    assert "user 'alice'" in refused.message and f"max_memory={QUOTA}" in refused.message
    assert "wait_room=True" in refused.message  # a put could have waited for room
    assert "alice/b" not in factory.store
    assert isinstance(alice.put("alice/a", big), Stored)  # replacing its own value fits
    got = alice.request(Get(alice.rid(), "alice/a"))
    assert isinstance(got, Fetched)
    assert isinstance(alice.put("alice/b", big), Stored)  # the get freed the room
    usage = factory.users.usage["alice"]
    assert usage.refusals == 1 and usage.stored == factory.store.nbytes
    bob = peer(factory, "bob")
    for i in range(5):  # another user is not held to alice's quota
        assert isinstance(bob.put(f"bob/{i}", big), Stored)


def test_a_write_that_asked_waits_for_room_then_goes_or_times_out(
        factory: ServerFactory, clock: MemoryReactorClock) -> None:
    alice = peer(factory, "alice")
    big = bytes(40 * 1024)
    alice.put("alice/a", big)
    rid = alice.rid()
    alice.send(Put(rid, "alice/b", item(big), room=30.0))
    assert alice.received() == []  # waits for room
    assert factory.users.usage["alice"].waiting > 0
    bob = peer(factory, "bob")
    assert isinstance(bob.put("bob/x", big), Stored)  # bob is not slowed meanwhile
    clock.advance(ROOM_POLL)
    assert alice.received() == []
    other = peer(factory, "alice")
    other.request(Delete(other.rid(), "alice/a"))
    clock.advance(ROOM_POLL)
    (stored,) = alice.received()
    assert isinstance(stored, Stored) and stored.id == rid
    assert factory.users.usage["alice"].waiting == 0 and factory.budget.receiving == 0
    # A wait that runs out is a QuotaExceeded too.
    rid = alice.rid()
    alice.send(Append(rid, "alice/c", item(big), 1.0, (), wait_room=True))
    clock.advance(0.5)
    assert alice.received() == []
    clock.advance(0.6)
    (late,) = alice.received()
    assert isinstance(late, ErrorReply) and late.code == "quota_exceeded" and late.id == rid
    assert "waited 1 s" in late.message and "user 'alice'" in late.message
    assert "alice/c" not in factory.store and factory.users.usage["alice"].waiting == 0


def test_a_cancel_or_a_disconnect_withdraws_a_waiting_write(
        factory: ServerFactory, clock: MemoryReactorClock) -> None:
    alice = peer(factory, "alice")
    big = bytes(40 * 1024)
    alice.put("alice/a", big)
    rid = alice.rid()
    alice.send(Put(rid, "alice/b", item(big), room=math.inf))
    cancel = alice.rid()
    assert alice.request(Cancel(cancel, rid)) == Acked(cancel, True)
    alice.send(Put(alice.rid(), "alice/c", item(big), room=math.inf))
    alice.lose()
    other = peer(factory, "alice")
    other.request(Delete(other.rid(), "alice/a"))
    clock.advance(ROOM_POLL * 2)
    assert factory.store.list() == {} and factory.users.usage["alice"].waiting == 0


def test_items_taken_by_a_get_count_for_the_getter_until_acknowledged(
        factory: ServerFactory) -> None:
    bob = peer(factory, "bob", session=os.urandom(16))
    bob.put("shared/b", bytes(1000))
    usage = factory.users.usage
    assert usage["bob"].stored > 1000
    rid = bob.rid()
    bob.request(Get(rid, "shared/b"))
    assert usage["bob"].stored == 0 and usage["bob"].sessions > 1000
    bob.write(bob.conn.frame(Ping(bob.rid()), AckInfo(rid)))  # it has the get's reply
    assert usage["bob"].sessions == SessionTable.SESSION_COST  # the session itself


# ------------------------------------------------------------------------------ reloading

# dash removed, bob no longer reads or writes shared/*, alice's file holds a second token.
RELOADED = """
[users.alice]
token_file = "alice.token"
read  = ["alice/*", "shared/*"]
write = ["alice/*"]

[users.bob]
token_file = "bob.token"
read  = ["bob/*"]
write = ["bob/*"]

[users.ops]
token_file = "ops.token"
admin = true
"""


def test_reload_applies_new_tokens_rights_and_removals(
        factory: ServerFactory, users_file: Path) -> None:
    alice = peer(factory, "alice")
    bob = peer(factory, "bob")
    bob.request(Listen(bob.rid(), "shared/b"))
    (users_file.parent / "alice.token").write_text("alice-secret-1\nalice-secret-2\n")
    users_file.write_text(RELOADED)
    dash = peer(factory, "dash")
    assert factory.reload_users() == ["alice", "bob", "ops"]
    assert dash.transport.disconnecting  # removed from the file
    alice.ping()  # established connections keep going
    assert isinstance(peer(factory, "alice", token="alice-secret-2").hello, HelloReply)
    assert isinstance(peer(factory, "alice").hello, HelloReply)  # both tokens are valid
    denied = bob.request(Peek(bob.rid(), "shared/b"))  # bob's new rights apply at once
    assert isinstance(denied, ErrorReply) and denied.code == "permission_denied"
    assert "shared/b" not in bob.proto.listening
    _, reply = login(factory, "dash")
    assert isinstance(reply, ErrorReply) and reply.code == "authentication_failed"


def test_a_broken_file_keeps_the_old_users_and_says_why(
        factory: ServerFactory, users_file: Path) -> None:
    alice = peer(factory, "alice")
    for broken, why in (("[users.alice\n", "not valid TOML"),
                        ('[users.alice]\ntoken_file = "nope.token"\n', "cannot read the token"),
                        ('[users.alice]\ntoken_file = "alice.token"\nwirte = ["*"]\n',
                         "unknown key(s) wirte"),
                        ("", "defines no user")):
        users_file.write_text(broken)
        with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
            factory.reload_users()
        alice.ping()
        assert isinstance(peer(factory, "bob").hello, HelloReply)
    # The reload op: for an admin only, and it says why a file does not load.
    ops = peer(factory, "ops")
    rid = ops.rid()
    reply = ops.request(Reload(rid))
    assert isinstance(reply, ErrorReply) and reply.code == "invalid_request"
    assert "the old users stay" in reply.message and "defines no user" in reply.message
    rid = alice.rid()
    reply = alice.request(Reload(rid))
    assert isinstance(reply, ErrorReply) and reply.code == "permission_denied"
    assert "admin = true" in reply.message
    write_users(users_file.parent)
    rid = ops.rid()
    assert ops.request(Reload(rid)) == Acked(rid, True)


# --------------------------------------------------------------------------- the file

def test_the_users_file_is_checked(tmp_path: Path) -> None:
    def load(text: str, **config: Any) -> Any:
        config.setdefault("token", None)
        return load_users(ServerConfig(users_file=str(write_users(tmp_path, text)), **config))

    users = load(USERS)
    assert users["alice"].max_memory == QUOTA and users["alice"].max_connections == 3
    assert users["ops"].admin and not users["alice"].admin
    assert users["alice"].may("read", "peek", "shared/x")
    assert not users["alice"].may("write", "put", "shared/x")
    for text, why in (
            ('[users."bad name"]\ntoken_file = "alice.token"\n', "a user name is"),
            ("[users.x]\nread = []\n", "needs a token_file"),
            ('[users.x]\ntoken_file = "alice.token"\nread = "a/*"\nwrite = [1]\n',
             "glob patterns"),
            ('[users.x]\ntoken_file = "alice.token"\nmax_memory = "lots"\n', "max_memory"),
            ('[users.x]\ntoken_file = "alice.token"\nmax_connections = 0\n',
             "max_connections"),
            ('[users.x]\ntoken_file = "alice.token"\n[users.y]\ntoken_file = "alice.token"\n',
             "have the same token"),
            ('[other]\n', "unknown top-level")):
        with pytest.raises(ValueError, match=why):
            load(text)
    with pytest.raises(ValueError, match="defined twice"):
        load('[users.default]\ntoken_file = "alice.token"\n', token="t")
    assert parse_size("4G") == 4 << 30 and parse_size("512MiB") == 512 << 20
    assert parse_size(100) == 100


def test_a_token_file_may_hold_several_tokens(tmp_path: Path,
                                              clock: MemoryReactorClock) -> None:
    path = tmp_path / "token"
    path.write_text("# rotated on Monday\nold-token\n\nnew-token\n")
    f = ServerFactory(clock, config=ServerConfig(token=None, token_file=str(path)))
    for token in ("old-token", "new-token"):
        _, reply = login(f, None, token)
        assert isinstance(reply, HelloReply) and reply.user == "default"
    _, reply = login(f, None, "# rotated on Monday")
    assert isinstance(reply, ErrorReply)


def test_stream_appends_and_service_calls_count_against_the_quota(
        factory: ServerFactory) -> None:
    from tensorshare.wire.services import ServiceCall
    from tensorshare.wire.streams import StreamAppend, StreamOpen, StreamOpened

    alice = peer(factory, "alice")
    usage = factory.users.usage["alice"]
    big = item(bytes(40 * 1024))
    opened = alice.request(StreamOpen(alice.rid(), "alice/s", replay="epoch"))
    assert isinstance(opened, StreamOpened)
    ok = alice.request(StreamAppend(alice.rid(), "alice/s", 0, opened.epoch, big))
    assert not isinstance(ok, ErrorReply), ok
    assert usage.stored >= 40 * 1024  # the stream keeps its epoch: counted for alice
    refused = alice.request(StreamAppend(alice.rid(), "alice/s", 0, opened.epoch, big))
    assert isinstance(refused, ErrorReply) and refused.code == "quota_exceeded"
    assert "user 'alice'" in refused.message and "stream 'alice/s'" in refused.message
    assert "wait_room" not in refused.message  # (a stream append cannot wait for room)
    alice.lose()  # the producer leaves: once its lease ends the stream goes, and its items
    factory.reactor.advance(30)
    assert usage.stored == 0
    caller = peer(factory, "alice")
    rid = caller.rid()
    caller.send(ServiceCall(rid, "alice/p", big, 5.0))  # queued: no host yet
    assert caller.received() == [] and usage.stored > 40 * 1024
    refused = caller.request(ServiceCall(caller.rid(), "alice/p", big, 5.0))
    assert isinstance(refused, ErrorReply) and refused.code == "quota_exceeded"
    assert "service 'alice/p'" in refused.message and "wait_room" not in refused.message
    factory.reactor.advance(5)  # the first call times out: no longer alice's to hold
    assert [r.code for r in caller.received() if isinstance(r, ErrorReply)] == ["timeout"]
    assert usage.stored == 0


def test_a_users_file_is_a_token_for_protected_mode_and_a_broken_one_stops_the_start(
        tmp_path: Path, users_file: Path) -> None:
    import subprocess
    import sys

    from tensorshare.server.auth import check_exposure

    check_exposure("0.0.0.0", ServerConfig(token=None, users_file=str(users_file)))
    with pytest.raises(ValueError, match="refusing to listen on 0.0.0.0"):
        check_exposure("0.0.0.0", ServerConfig(token=None))
    broken = tmp_path / "broken.toml"
    broken.write_text('[users.alice]\ntoken_file = "missing.token"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORSHARE_")}
    out = subprocess.run([sys.executable, "-m", "tensorshare", "serve", "--port", "0",
                          "--users-file", str(broken)], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 2, out
    assert "cannot read the token file of user 'alice'" in out.stderr, out.stderr


def test_replay_inserts_count_against_the_quota_until_their_items_leave(
        factory: ServerFactory) -> None:
    from tensorshare.wire.replay import (
        ReplayInsert,
        ReplayInserted,
        ReplayOpen,
        ReplayOpened,
        ReplaySample,
        ReplaySampled,
    )

    alice = peer(factory, "alice")
    usage = factory.users.usage["alice"]
    big = item(bytes(40 * 1024))
    opened = alice.request(ReplayOpen(alice.rid(), "alice/r", {"max_size": 10,
                                                               "max_times_sampled": 1}))
    assert isinstance(opened, ReplayOpened)
    ok = alice.request(ReplayInsert(alice.rid(), "alice/r", big, (), (1.0,)))
    assert isinstance(ok, ReplayInserted) and usage.stored >= 40 * 1024
    refused = alice.request(ReplayInsert(alice.rid(), "alice/r", big, (), (1.0,)))
    assert isinstance(refused, ErrorReply) and refused.code == "quota_exceeded"
    assert "user 'alice'" in refused.message and "replay bin 'alice/r'" in refused.message
    drawn = alice.request(ReplaySample(alice.rid(), "alice/r", 1))  # its one sample: it leaves
    assert isinstance(drawn, ReplaySampled) and usage.stored == 0
    assert isinstance(alice.request(ReplayInsert(alice.rid(), "alice/r", big, (), (1.0,))),
                      ReplayInserted)
