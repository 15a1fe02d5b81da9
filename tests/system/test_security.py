"""Safe on a shared network, end to end (issue "Safe on a shared network"): which handshake
failures are retried, tokens and the read-only token through real clients, what a tap on the
network sees, TLS and its mismatches, protected mode, and sessions a burst of clients leaves.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from twisted.internet import defer
from twisted.internet.epollreactor import EPollReactor
from twisted.python.failure import Failure

from tensorshare import (
    AuthenticationError,
    Client,
    ConnectError,
    EmbeddedServer,
    LimitExceeded,
    PermissionDenied,
)
from tensorshare.client.twisted import connect
from tensorshare.server import ServerConfig
from tensorshare.wire.messages import ErrorReply
from tests.chaos import HOST, ChaosProxy, Faults
from tests.conftest import TlsFiles, wait_until
from tests.rawwire import WireClient, replaced

TOKEN, READ = "a-long-random-write-token", "a-long-random-read-token"
WAIT = 20.0


@pytest.fixture
def secured() -> Iterator[EmbeddedServer]:
    with EmbeddedServer(port=0, config=ServerConfig(token=TOKEN, read_token=READ)) as srv:
        yield srv


@pytest.fixture
def tls_server(tls_files: TlsFiles) -> Iterator[EmbeddedServer]:
    config = ServerConfig(token=TOKEN, tls_cert=tls_files.cert, tls_key=tls_files.key)
    with EmbeddedServer(port=0, config=config) as srv:
        yield srv


@pytest.fixture
def reactor() -> Iterator[EPollReactor]:
    r = EPollReactor()
    thread = threading.Thread(target=r.run, kwargs={"installSignalHandlers": False},
                              daemon=True)
    thread.start()
    try:
        yield r
    finally:
        r.callFromThread(r.stop)
        thread.join(WAIT)


def in_reactor(r: EPollReactor, fn: Callable[[], Any]) -> Any:
    done, box = threading.Event(), []

    def run() -> None:
        defer.maybeDeferred(fn).addBoth(lambda res: (box.append(res), done.set()))

    r.callFromThread(run)
    assert done.wait(WAIT), "the reactor did not answer"
    if isinstance(box[0], Failure):
        box[0].raiseException()
    return box[0]


# -------------------------------------------------------------- what is retried, what is not

CUT_IN_HANDSHAKE = Faults(cut_after_bytes=(40, 40), reset_probability=1.0)  # mid hello reply


def test_a_first_connection_cut_mid_handshake_is_retried(secured: EmbeddedServer) -> None:
    with ChaosProxy((HOST, secured.port), first=(CUT_IN_HANDSHAKE, CUT_IN_HANDSHAKE)) as proxy:
        with Client(HOST, proxy.port, timeout=10, token=TOKEN) as c:
            c.put("w", 1)
            assert c.get("w") == 1
        assert proxy.stats()["accepted"] == 3 and proxy.stats()["cuts"] == 2, proxy.describe()


def test_the_twisted_client_retries_a_cut_handshake_too(secured: EmbeddedServer,
                                                       reactor: EPollReactor) -> None:
    with ChaosProxy((HOST, secured.port), first=(CUT_IN_HANDSHAKE,)) as proxy:
        @defer.inlineCallbacks
        def scenario() -> Any:
            client = yield connect(reactor, HOST, proxy.port, timeout=10, token=TOKEN)
            version = yield client.put("w", 2)
            yield client.close()
            return version

        assert in_reactor(reactor, scenario) == 1
        assert proxy.stats()["accepted"] == 2, proxy.describe()


def test_a_wrong_token_fails_at_once_and_is_never_retried(secured: EmbeddedServer,
                                                         reactor: EPollReactor) -> None:
    with ChaosProxy((HOST, secured.port)) as proxy:
        with pytest.raises(AuthenticationError, match=f"{HOST}:{proxy.port}.*wrong token"):
            Client(HOST, proxy.port, timeout=10, token="guess")
        with pytest.raises(AuthenticationError, match="requires a token"):
            Client(HOST, proxy.port, timeout=10)
        with pytest.raises(AuthenticationError, match="wrong token"):
            in_reactor(reactor, lambda: connect(reactor, HOST, proxy.port, timeout=10,
                                                token="guess"))
        assert proxy.stats()["accepted"] == 3, proxy.describe()  # one attempt each


def test_a_full_server_refuses_at_once(secured: EmbeddedServer) -> None:
    with EmbeddedServer(port=0, config=ServerConfig(token=None, max_connections=1)) as srv, \
            Client(HOST, srv.port, timeout=10):
        with ChaosProxy((HOST, srv.port)) as proxy:
            with pytest.raises(LimitExceeded, match="max_connections=1"):
                Client(HOST, proxy.port, timeout=10)
            assert proxy.stats()["accepted"] == 1, proxy.describe()


# --------------------------------------------------------------------------- tokens

def test_the_token_never_crosses_the_wire_and_a_replayed_handshake_fails(
        secured: EmbeddedServer) -> None:
    with ChaosProxy((HOST, secured.port), tap=True) as proxy:
        with Client(HOST, proxy.port, timeout=10, token=TOKEN) as c:
            c.put("secret", torch.arange(10))
        captured = bytes(proxy.captured["up"]) + bytes(proxy.captured["down"])
    assert len(captured) > 200
    assert TOKEN.encode() not in captured
    assert TOKEN.encode().hex().encode() not in captured
    # Replay what the client sent, byte for byte, on a new connection: the server's fresh
    # challenge makes the old proof worthless.
    wire = WireClient()
    with socket.create_connection((HOST, secured.port), timeout=10) as sock:
        sock.sendall(bytes(proxy.captured["up"]))
        replies: list[Any] = []
        while not any(isinstance(r, ErrorReply) for r in replies):
            data = sock.recv(65536)
            assert data, "closed without an answer"
            wire.ops.update({1: "hello", 2: "auth"})
            replies += wire.receive_data(data)
    refusal = next(r for r in replies if isinstance(r, ErrorReply))
    assert refusal.code == "authentication_failed" and "wrong token" in refusal.message
    assert secured.call(lambda: secured.factory.store.n_items("secret")) == 1


def test_the_read_only_token_reads_and_listens_but_writes_nothing(
        secured: EmbeddedServer) -> None:
    with Client(HOST, secured.port, timeout=10, token=TOKEN) as writer, \
            Client(HOST, secured.port, timeout=10, token=READ) as reader:
        writer.put("params", {"w": torch.ones(3)})
        events: list[dict[str, Any]] = []
        reader.listen("params", events.append)
        assert torch.equal(reader.peek("params")["w"], torch.ones(3))
        assert reader.list() == {"params": 1}
        assert reader.stats()["bins"]["params"]["n_items"] == 1
        writer.put("params", {"w": torch.zeros(3)})
        wait_until(lambda: len(events) == 1, what="the reader's event")
        for attempt in (lambda: reader.put("params", 1), lambda: reader.append("q", 1),
                        lambda: reader.get("params"), lambda: reader.delete("params"),
                        lambda: reader.configure("q", max_items=3)):
            with pytest.raises(PermissionDenied, match="not allowed with the read-only token"):
                attempt()
        assert torch.equal(reader.peek("params")["w"], torch.zeros(3))  # still usable
        assert writer.list() == {"params": 1}


def test_clients_take_the_token_from_the_environment(secured: EmbeddedServer,
                                                     tmp_path: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENSORSHARE_TOKEN", TOKEN)
    with Client(HOST, secured.port, timeout=10) as c:
        c.put("w", 1)
    monkeypatch.delenv("TENSORSHARE_TOKEN")
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    monkeypatch.setenv("TENSORSHARE_TOKEN_FILE", str(path))
    with Client(HOST, secured.port, timeout=10) as c:
        assert c.get("w") == 1


# ------------------------------------------------------------------------------- TLS

def test_tls_with_a_test_ca_for_the_blocking_and_the_twisted_client(
        tls_server: EmbeddedServer, tls_files: TlsFiles, reactor: EPollReactor) -> None:
    big = torch.randn(1 << 20)
    url = f"tensorshare+tls://localhost:{tls_server.port}"
    with Client(url, timeout=10, tls_ca=tls_files.ca, token=TOKEN) as c:
        c.put("big", big)
        assert torch.equal(c.peek("big"), big)

    @defer.inlineCallbacks
    def scenario() -> Any:
        client = yield connect(reactor, url, timeout=10, tls_ca=tls_files.ca, token=TOKEN)
        got = yield client.get("big")
        yield client.close()
        return got

    assert torch.equal(in_reactor(reactor, scenario), big)


def test_tls_mismatches_fail_clearly(tls_server: EmbeddedServer, tls_files: TlsFiles,
                                     reactor: EPollReactor) -> None:
    port = tls_server.port
    with pytest.raises(ConnectError, match="this server speaks TLS"):
        Client(HOST, port, timeout=10, token=TOKEN)  # plain client, TLS server
    with EmbeddedServer(port=0, config=ServerConfig(token=TOKEN)) as plain, \
            pytest.raises(ConnectError, match="is the server started with --tls-cert"):
        Client(HOST, plain.port, timeout=10, tls=True, tls_ca=tls_files.ca, token=TOKEN)
    with pytest.raises(ConnectError, match="certificate does not check out"):
        Client("localhost", port, timeout=10, tls=True, tls_ca=tls_files.other_ca,
               token=TOKEN)
    with pytest.raises(ConnectError, match="does not check out"):
        in_reactor(reactor, lambda: connect(reactor, "localhost", port, timeout=3, tls=True,
                                            tls_ca=tls_files.other_ca, token=TOKEN,
                                            reconnect=False))


def test_tls_checks_the_host_name(tls_files: TlsFiles) -> None:
    config = ServerConfig(token=TOKEN, tls_cert=tls_files.localhost_cert,
                          tls_key=tls_files.localhost_key)
    with EmbeddedServer(port=0, config=config) as srv:
        with Client("localhost", srv.port, timeout=10, tls=True, tls_ca=tls_files.ca,
                    token=TOKEN) as c:
            c.ping()
        with pytest.raises(ConnectError, match="certificate does not check out.*"
                                               "(IP address mismatch|hostname)"):
            Client(HOST, srv.port, timeout=10, tls=True, tls_ca=tls_files.ca, token=TOKEN)


def test_the_cli_speaks_tls_with_a_token(tls_server: EmbeddedServer, tls_files: TlsFiles,
                                         tmp_path: Any) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with Client(f"tensorshare+tls://localhost:{tls_server.port}", timeout=10,
                tls_ca=tls_files.ca, token=TOKEN) as c:
        c.put("grad_norm", torch.tensor([1.0, 2.0]))
    out = subprocess.run(
        [sys.executable, "-m", "tensorshare", "ls", "--host",
         f"tensorshare+tls://localhost:{tls_server.port}", "--tls-ca", tls_files.ca,
         "--token-file", str(token_file)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^grad_norm\s+value\s+1\b", out.stdout, re.MULTILINE), out.stdout
    bad = subprocess.run([sys.executable, "-m", "tensorshare", "ls", "--host",
                          f"tensorshare+tls://localhost:{tls_server.port}", "--tls-ca",
                          tls_files.other_ca], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "does not check out" in bad.stderr


# ----------------------------------------------------------------------- protected mode

def _serve(*args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TENSORSHARE_TOKEN", None)
    return subprocess.Popen([sys.executable, "-m", "tensorshare", "serve", "--port", "0",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def test_binding_beyond_loopback_without_a_token_refuses_to_start() -> None:
    proc = _serve("--host", "0.0.0.0")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, (out, err)
    assert "refusing to listen on 0.0.0.0 without a token" in err and "--insecure" in err
    proc = _serve("--host", "0.0.0.0", "--insecure")
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert re.search(r"listening on 0\.0\.0\.0:\d+$", first.strip()), first
        # The memory and security lines, then the hot path's, printed after the warning (so
        # that the warning is out before the server is stopped).
        lines = [proc.stdout.readline() for _ in range(3)]
        assert lines[-1].startswith("hot path: "), lines
        assert any("authentication: off" in line and "TLS: off" in line for line in lines)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert "--insecure: this server accepts connections from other machines" in err


def test_the_startup_lines_say_whether_authentication_and_tls_are_on(
        tls_files: TlsFiles, tmp_path: Any) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    read = tmp_path / "read"
    read.write_text(READ)
    proc = _serve("--token-file", str(token), "--read-token-file", str(read), "--tls-cert",
                  tls_files.cert, "--tls-key", tls_files.key)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]
        assert "authentication: token required, read-only token too; TLS: on" in "".join(lines)
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


# ---------------------------------------------------------------- sessions a burst leaves

def test_a_burst_of_short_lived_clients_never_locks_the_next_one_out() -> None:
    config = ServerConfig(token=None, max_sessions=50)
    with EmbeddedServer(port=0, config=config) as srv:
        for i in range(80):  # each closes cleanly: its session ends at once
            with Client(HOST, srv.port, timeout=10) as c:
                c.put(f"job{i % 5}", i)
        with Client(HOST, srv.port, timeout=10) as c:
            assert c.stats()["server"]["sessions"] == 1
        # Clients that drop without a goodbye: their sessions wait, bounded by the table,
        # and a client that is connected is never refused its reconnect.
        keeper = Client(HOST, srv.port, timeout=10)
        wire = WireClient()
        for _ in range(80):
            with socket.create_connection((HOST, srv.port), timeout=10) as sock:
                from tensorshare.wire.messages import Hello
                from tensorshare.wire.protocol import PROTOCOL_VERSIONS
                sock.sendall(wire.frame(Hello(1, PROTOCOL_VERSIONS, "drop", None,
                                              os.urandom(16))))
                assert wire.receive_data(sock.recv(65536))  # its hello reply
        stats = keeper.stats()["server"]
        assert stats["sessions"] <= 50 and stats["counters"]["sessions_evicted"] >= 30
        srv.call(lambda: [p.abort() for p in list(srv.factory.connections)])  # a network blip
        keeper.put("still", 1)  # its reconnect resumed its session (or a new one): never refused
        assert keeper.get("still") == 1
        keeper.close()


def test_the_readme_lab_tls_recipe_works(tmp_path: Any) -> None:
    """The README's one-command lab CA (trustme's CLI, names changed to this machine's):
    its server.pem and server.key serve TLS, and its client.pem is the CA a client checks."""
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    line = next(ln for ln in readme.splitlines() if ln.startswith("python3 -m trustme "))
    args = line.split("#")[0].split()[3:]
    assert args[0] == "-i" and "-d" in args, line  # the recipe as the README writes it
    args = ["-i", "localhost", "127.0.0.1", "-d", str(tmp_path)]
    out = subprocess.run([sys.executable, "-m", "trustme", *args], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    files = {p.name for p in tmp_path.iterdir()}
    assert {"server.pem", "server.key", "client.pem"} <= files, files
    config = ServerConfig(token=TOKEN, tls_cert=str(tmp_path / "server.pem"),
                          tls_key=str(tmp_path / "server.key"))
    with EmbeddedServer(port=0, config=config) as srv, \
            Client(f"tensorshare+tls://localhost:{srv.port}", timeout=10,
                   tls_ca=str(tmp_path / "client.pem"), token=TOKEN) as c:
        c.put("w", torch.arange(3))
        assert torch.equal(c.peek("w"), torch.arange(3))


# ------------------------------------------------------------- a fuzz with users on (issue 31)

BOB_SECRET = b"only-bob-may-read-this-7f3a"
FUZZ_NAMES = ["alice/x", "alice/y", "shared/x", "bob/v", "bob/l", "bob/s", "bob/p", "x",
              "bob/*", "*", "alice/../bob/v", "alice", "bob/v\x00", "BOB/V"]
FUZZ_VALUES: list[Any] = [None, True, False, 0, -1, 7, 1 << 40, 1.5, float("nan"), "",
                          "alice/x", "bob/v", b"", b"\x00" * 16, b"\x01" * 32, [], [1, 2],
                          {}, {"op": "put"}]


def _fuzz_frame(rng: Any, rid: int) -> bytes:
    """A request of a random op on a random bin: well-formed, with random fields, or with
    random bytes changed."""

    import msgpack

    from tensorshare.wire.frames import encode_frame
    from tensorshare.wire.protocol import OPS, encode_message
    from tests.rawwire import Get, Peek
    from tests.wire.test_protocol_doc import _full_requests

    op = rng.choice(list(OPS))
    name = rng.choice(FUZZ_NAMES)
    msg = _full_requests()[op][0]
    if op in ("get", "peek") and rng.random() < 0.5:  # (no filter: what the bin holds)
        msg = (Get if op == "get" else Peek)(rid, name)
    if hasattr(msg, "bin"):
        msg = replaced(msg, bin=name)
    msg = replaced(msg, id=rid)
    roll = rng.random()
    if roll < 0.55:
        return b"".join(bytes(c) for c in encode_message(msg)[0])
    if roll < 0.85:
        fields = {f for o in OPS.values() for f in o.fields}
        header = {"op": op, "id": rid, "bin": name}
        for key in rng.sample(sorted(fields), rng.randint(0, 6)):
            header[key] = rng.choice(FUZZ_VALUES + FUZZ_NAMES)
        header["op"], header["id"] = op, rid
        return b"".join(bytes(c) for c in encode_frame(msgpack.packb(header)))
    data = bytearray(b"".join(bytes(c) for c in encode_message(msg)[0]))
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data)


def _outside_alice(f: Any) -> dict[str, Any]:
    """What every bin alice may not write holds: no frame of hers may change it."""
    from tensorshare.server.accounts import User

    alice = User("alice", write=("alice/*",))
    out: dict[str, Any] = {}
    for name, d in f.bin_stats().items():
        if alice.may_write(name):
            continue
        out[name] = (d["kind"], d["version"], d["n_items"], d["nbytes"],
                     sorted(d.get("stream", {}).get("consumers", {})),
                     d.get("service", {}).get("queue"))
    return out


def test_random_frames_never_reach_a_bin_outside_the_users_patterns(tmp_path: Any) -> None:
    """With users on, 3,000 random frames from alice (random ops of every kind of bin, on
    random names, with random fields or random bytes changed) never read a byte of bob's
    bins nor change any bin outside her write patterns, and never cost an internal error."""
    import random

    from twisted.internet.testing import MemoryReactorClock
    from twisted.logger import globalLogPublisher

    from tensorshare.server.core import ServerFactory
    from tensorshare.wire.codec import encode
    from tensorshare.wire.messages import Item, Limits
    from tests.server.test_users import peer, write_users
    from tests.wire.test_protocol_doc import _full_requests

    limits = Limits(max_frame_bytes=1 << 20, max_header_bytes=1 << 16)
    f = ServerFactory(MemoryReactorClock(), config=ServerConfig(
        token=None, users_file=str(write_users(tmp_path)), limits=limits))
    failures: list[Any] = []

    def observer(event: dict[str, Any]) -> None:
        if "log_failure" in event:
            failures.append(event)

    globalLogPublisher.addObserver(observer)
    try:
        bob = peer(f, "bob")
        secret = Item(encode(BOB_SECRET))
        full = _full_requests()
        for msg in (full["put"][0], full["append"][0], full["stream_open"][0],
                    full["stream_append"][0], full["service_call"][0]):
            name = {"Put": "bob/v", "Append": "bob/l", "ServiceCall": "bob/p"}.get(
                type(msg).__name__, "bob/s")
            fields = {"id": bob.rid(), "bin": name}
            if hasattr(msg, "item"):
                fields["item"] = secret
            if hasattr(msg, "rest"):
                fields["rest"] = ()
            if hasattr(msg, "samples") and type(msg).__name__ == "StreamAppend":
                fields["samples"] = None
            bob.send(replaced(msg, **fields))
        bob.received()
        before = _outside_alice(f)
        assert {"bob/v", "bob/l", "bob/s", "bob/p"} <= set(before), before
        rng = random.Random(31)
        alice = peer(f, "alice")
        seen = bytearray()
        for i in range(3000):
            if i % 20 == 0 and "bob/v" not in f.store:  # (only if a frame of hers took it:
                bob.put("bob/v", BOB_SECRET)  # then the state check below fails too)
                bob.received()
            alice.write(_fuzz_frame(rng, alice.rid()))
            seen += alice.transport.value()
            alice.transport.clear()
            if alice.transport.disconnecting or alice.proto.conn.receiving:
                alice.lose()  # closed (or stuck in a frame a changed length made): again
                alice = peer(f, "alice")
        assert BOB_SECRET not in seen
        assert _outside_alice(f) == before
    finally:
        globalLogPublisher.removeObserver(observer)
    assert not failures, failures[0].get("log_text") or failures[0]
