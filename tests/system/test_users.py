"""Many teams on one server (issue 31), end to end: real clients of two teams and a dashboard
on one server, quotas that hold one team back and not the other, tokens rotated with SIGHUP
while clients keep working, the command line, and the clients that forward with their own
user (a sharded client, a relay)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorshare import (
    AuthenticationError,
    Client,
    EmbeddedServer,
    PermissionDenied,
    QuotaExceeded,
    ShardedClient,
)
from tensorshare.relay import Relay
from tensorshare.server import ServerConfig
from tests.chaos import HOST, ServerProcess
from tests.conftest import wait_until
from tests.server.test_users import TOKENS, USERS, write_users

QUOTA = 64 * 1024  # alice's, in USERS
WAIT = 20.0


@pytest.fixture
def users_file(tmp_path: Path) -> Path:
    return write_users(tmp_path)


@pytest.fixture
def server(users_file: Path) -> Iterator[EmbeddedServer]:
    config = ServerConfig(token=None, users_file=str(users_file), max_memory=1 << 30)
    with EmbeddedServer(port=0, config=config) as srv:
        yield srv


def client(srv: EmbeddedServer | ServerProcess, user: str, **kw: Any) -> Client:
    kw.setdefault("token", TOKENS[user])
    kw.setdefault("timeout", 10)
    return Client(HOST, srv.port, user=user, **kw)


# -------------------------------------------------------------------------------- quotas

def test_one_user_at_its_quota_does_not_hold_another_back(server: EmbeddedServer) -> None:
    """alice fills her quota and keeps trying (one thread), and a second alice client waits
    for room; meanwhile every one of bob's puts completes. No timing is asserted."""
    refused: list[QuotaExceeded] = []
    stop = threading.Event()
    chunk = torch.zeros(4096)  # 16 KiB: her quota holds a few

    with client(server, "alice") as alice, client(server, "alice") as waiter, \
            client(server, "bob") as bob:
        def fill() -> None:
            n = 0
            while not stop.is_set():
                try:
                    alice.put(f"alice/{n % 64}", chunk)
                    n += 1
                except QuotaExceeded as exc:
                    refused.append(exc)

        filler = threading.Thread(target=fill, daemon=True)
        filler.start()
        try:
            wait_until(lambda: bool(refused), WAIT, "alice at her quota")
            waiting = waiter.begin.put("alice/late", chunk, wait_room=True)
            for i in range(300):
                assert bob.put(f"bob/{i % 8}", torch.randn(4096)) >= 1
            assert bob.list() == {f"bob/{i}": 1 for i in range(8)}
        finally:
            stop.set()
            filler.join(WAIT)
        # still waiting for alice's room, on the server
        assert server.call(lambda: server.factory.users.usage["alice"].waiting) > 0
        for name in alice.list():
            if name != "shared/b":
                alice.delete(name)
        assert waiting.result() >= 1  # room again: the waiting put went through
    text = str(refused[0])
    assert "user 'alice'" in text and f"max_memory={QUOTA}" in text, text


def test_a_wait_for_room_that_runs_out_raises_quota_exceeded(
        server: EmbeddedServer) -> None:
    with client(server, "alice", timeout=1.0) as alice:
        alice.put("alice/a", torch.zeros(12 * 1024))  # 48 KiB of her 64
        with pytest.raises(QuotaExceeded, match="waited 0.8 s for room.*user 'alice'"):
            alice.append("alice/b", torch.zeros(12 * 1024), wait_room=True)
        with pytest.raises(QuotaExceeded, match="user 'alice'"):  # no wait asked: at once
            alice.append("alice/b", torch.zeros(12 * 1024))
        assert alice.list() == {"alice/a": 1}


# ------------------------------------------------------------------------ what users see

def test_two_teams_and_a_dashboard_see_what_the_file_says(server: EmbeddedServer) -> None:
    with client(server, "alice") as alice, client(server, "bob") as bob, \
            client(server, "dash") as dash:
        alice.put("alice/w", torch.ones(3))
        bob.put("bob/w", torch.ones(3))
        bob.put("shared/data", torch.arange(4))
        assert torch.equal(alice.peek("shared/data"), torch.arange(4))
        with pytest.raises(PermissionDenied, match="user 'alice' may not peek bin 'bob/w'"):
            alice.peek("bob/w")
        with pytest.raises(PermissionDenied, match="user 'alice' may not put bin 'shared/x'"):
            alice.put("shared/x", 1)
        with pytest.raises(PermissionDenied, match="user 'dash' may not delete bin 'bob/w'"):
            dash.delete("bob/w")
        assert alice.ping() is None  # still usable after each refusal
        assert alice.list() == {"alice/w": 1, "shared/data": 1}
        assert dash.list() == {"alice/w": 1, "bob/w": 1, "shared/data": 1}
        mine = alice.stats()
        assert set(mine["bins"]) == {"alice/w", "shared/data"} and "users" not in mine["server"]
        assert mine["server"]["user"]["denials"] == 2
        every = dash.stats()["server"]["users"]
        assert every["alice"]["memory"]["max_memory"] == QUOTA
        assert every["bob"]["connections"] == 1 and every["alice"]["denials"] == 2


def test_the_user_comes_from_the_environment_and_needs_its_token(
        server: EmbeddedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TENSORSHARE_USER", "bob")
    monkeypatch.setenv("TENSORSHARE_TOKEN", TOKENS["bob"])
    with Client(HOST, server.port, timeout=10) as c:
        c.put("bob/env", 1)
        assert c.stats()["server"]["user"]["requests"] >= 1
    monkeypatch.delenv("TENSORSHARE_TOKEN")
    with pytest.raises(ValueError, match="user 'bob' needs its token"):
        Client(HOST, server.port, timeout=10)
    with pytest.raises(ValueError, match="a user name is"):
        Client(HOST, server.port, timeout=10, user="bob smith", token="x")
    with pytest.raises(AuthenticationError, match="wrong token for user 'alice'"):
        Client(HOST, server.port, timeout=10, user="alice", token=TOKENS["bob"])


def test_a_sharded_client_and_a_relay_forward_with_their_own_user(
        users_file: Path) -> None:
    config = ServerConfig(token=None, users_file=str(users_file))
    with EmbeddedServer(port=0, config=config) as one, \
            EmbeddedServer(port=0, config=config) as two:
        servers = [f"{HOST}:{one.port}", f"{HOST}:{two.port}"]
        with ShardedClient(servers, timeout=10, user="bob", token=TOKENS["bob"]) as c:
            for i in range(8):
                c.put(f"bob/{i}", i)
            with pytest.raises(PermissionDenied, match="user 'bob'"):
                c.put("alice/0", 0)
        for srv in (one, two):
            users = srv.call(lambda s=srv: s.factory.users.describe())
            assert users["bob"]["requests"] >= 1 and users["alice"]["requests"] == 0
        # A relay reads its upstream as its own user: alice's relay sees shared/*, not bob/*.
        with Client(HOST, one.port, timeout=10, user="bob", token=TOKENS["bob"]) as bob:
            bob.put("shared/params", torch.ones(2))
            with Relay(f"{HOST}:{one.port}", ["*"], poll=0.2, user="alice",
                       token=TOKENS["alice"]) as relay, \
                    Client(HOST, relay.port, timeout=10) as reader:
                wait_until(lambda: "shared/params" in reader.list(), WAIT, "the relayed bin")
                assert not any(name.startswith("bob/") for name in reader.list())


# -------------------------------------------------------------------- rotation with SIGHUP

def _reloads(srv: ServerProcess, what: str, n: int) -> None:
    wait_until(lambda: srv.stderr().count(what) >= n, WAIT, f"{n} x {what!r}: {srv.stderr()}")


def test_tokens_rotate_with_sighup_while_clients_keep_working(users_file: Path) -> None:
    token = users_file.parent / "alice.token"
    with ServerProcess(0, "--users-file", str(users_file)) as srv:
        old = client(srv, "alice", token="alice-secret-1")
        old.put("alice/w", 1)
        dash = client(srv, "dash", reconnect=5.0)
        assert dash.list() == {"alice/w": 1}
        # 1. A second token: both work.
        token.write_text("alice-secret-1\nalice-secret-2\n")
        assert srv.proc is not None
        os.kill(srv.proc.pid, signal.SIGHUP)
        _reloads(srv, "reloaded the users", 1)
        with client(srv, "alice", token="alice-secret-2") as new:
            assert new.peek("alice/w") == 1
        with client(srv, "alice", token="alice-secret-1") as again:
            again.ping()
        # 2. The first removed: its new connections are refused, the established one goes on.
        token.write_text("alice-secret-2\n")
        os.kill(srv.proc.pid, signal.SIGHUP)
        _reloads(srv, "reloaded the users", 2)
        with pytest.raises(AuthenticationError, match="wrong token for user 'alice'"):
            client(srv, "alice", token="alice-secret-1")
        old.put("alice/w", 2)
        assert old.peek("alice/w") == 2
        # 3. A broken file keeps the old users, and the server says why.
        users_file.write_text(USERS + "\n[users.broken\n")
        os.kill(srv.proc.pid, signal.SIGHUP)
        _reloads(srv, "reload failed, the old users stay", 1)
        assert "is not valid TOML" in srv.stderr()
        with client(srv, "alice", token="alice-secret-2") as new:
            assert new.peek("alice/w") == 2
        # 4. A user removed from the file is disconnected (and cannot come back).
        users_file.write_text(USERS.replace("[users.dash]", "[users.dash_gone]", 1).replace(
            'token_file = "dash.token"\nread = ["*"]', 'token_file = "dash.token"\n', 1))
        os.kill(srv.proc.pid, signal.SIGHUP)
        _reloads(srv, "reloaded the users", 3)
        with pytest.raises(AuthenticationError, match="wrong token for user 'dash'"):
            dash.list()
        assert old.peek("alice/w") == 2
        dash.close()
        old.close()


def test_the_command_line_names_its_user_and_reloads(server: EmbeddedServer,
                                                     users_file: Path) -> None:
    with client(server, "bob") as bob:
        bob.put("bob/w", 1)
        bob.put("shared/w", 1)

    def cli(*args: str, user: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORSHARE_")}
        return subprocess.run(
            [sys.executable, "-m", "tensorshare", *args, "--user", user, "--token-file",
             str(users_file.parent / f"{user}.token")],
            capture_output=True, text=True, timeout=60, env=env)

    ls = cli("ls", "--host", f"tensorshare://{HOST}:{server.port}", "--json", user="alice")
    assert ls.returncode == 0, ls.stderr
    assert "shared/w" in ls.stdout and "bob/w" not in ls.stdout
    denied = cli("reload", "--server", f"tensorshare://{HOST}:{server.port}", user="alice")
    assert denied.returncode == 1 and "admin = true" in denied.stderr
    done = cli("reload", "--server", f"tensorshare://{HOST}:{server.port}", user="ops")
    assert done.returncode == 0 and "reloaded its users" in done.stdout, done.stderr


# ------------------------------------------------------- stats, monitor and metrics per user

def test_stats_monitor_and_metrics_show_each_user(server: EmbeddedServer) -> None:
    from rich.console import Console

    from tensorshare.cli.tools import _monitor_view, _Rates
    from tensorshare.server.metrics import start_metrics_server
    from tests.server.test_metrics import _scrape, _value

    with client(server, "alice") as alice, client(server, "dash") as dash:
        alice.put("alice/w", torch.zeros(1024))
        with pytest.raises(PermissionDenied):
            alice.put("bob/w", 1)
        with pytest.raises(QuotaExceeded):
            alice.put("alice/big", torch.zeros(20_000))
        exporter = start_metrics_server(0, server=server)
        try:
            m = _scrape(exporter.url)
        finally:
            exporter.stop()
        held = _value(m, "tensorshare_user_memory_bytes", user="alice")
        assert 4096 < held <= QUOTA
        assert _value(m, "tensorshare_user_max_memory_bytes", user="alice") == QUOTA
        assert _value(m, "tensorshare_user_connections", user="alice") == 1
        assert _value(m, "tensorshare_user_max_connections", user="alice") == 3
        assert _value(m, "tensorshare_user_denials", "tensorshare_user_denials_total",
                      user="alice") == 1
        assert _value(m, "tensorshare_user_quota_refusals",
                      "tensorshare_user_quota_refusals_total", user="alice") == 1
        assert _value(m, "tensorshare_user_requests", "tensorshare_user_requests_total",
                      user="alice") >= 2
        # monitor: the whole server's users for dash, alice's own row for alice.
        for c, rows in ((dash, ("alice", "bob", "dash")), (alice, ("(you)",))):
            console = Console(record=True, width=200)
            console.print(_monitor_view(c.stats(), _Rates(4), "here", 1.0, None, None))
            text = console.export_text()
            assert "users" in text and all(row in text for row in rows), text
            assert ("bob" in text) == (c is dash), text
        assert "% of 64.0 KiB" in text, text  # (its quota: 64 KiB, in the same units)


def test_the_readme_users_file_is_what_the_server_reads(tmp_path: Path) -> None:
    import re

    from tensorshare.server.accounts import load_users

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```toml\n(.*?)```", readme, flags=re.S)
    for name in ("vision", "speech", "dash"):
        (tmp_path / f"{name}.token").write_text(f"{name}-token\n")
    path = tmp_path / "users.toml"
    path.write_text(block)
    users = load_users(ServerConfig(token=None, users_file=str(path)))
    assert set(users) == {"vision", "speech", "dash"}
    vision, speech, dash = users["vision"], users["speech"], users["dash"]
    assert vision.may("write", "put", "vision/x") and vision.may("read", "peek", "shared/x")
    assert not vision.may("write", "put", "shared/x") and not vision.may("read", "peek", "speech/x")
    assert speech.may("write", "put", "shared/x") and vision.max_memory == 200 << 30
    assert dash.reads_all and not dash.write and dash.admin and dash.max_memory is None
