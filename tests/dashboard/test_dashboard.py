"""The dashboard without a browser: its event stream against ``tensorshare stats --json``,
the login and its refusals, read-only by construction (405, a read-only upstream, a token
that may write refused), a stream that is never read, servers that go away and come back,
several servers (a relay beside its primary), and the commands that start it."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from twisted.internet.defer import maybeDeferred
from twisted.python.failure import Failure

from tensorshare import Client, EmbeddedServer, PermissionDenied
from tensorshare.cli.main import main
from tensorshare.client.rates import RATES
from tensorshare.dashboard import Dashboard
from tensorshare.dashboard.snapshot import relay_lag, roles
from tensorshare.dashboard.web import CSP
from tensorshare.relay import Relay
from tensorshare.server import ServerConfig
from tests.conftest import interrupt, interruptible, wait_until
from tests.dashboard.conftest import READ_TOKEN, WRITE_TOKEN, Events, log_in, request


def _writer(server: EmbeddedServer) -> Client:
    return Client("127.0.0.1", server.port, token=WRITE_TOKEN)


def _in_reactor(dash: Dashboard, fn: Any, timeout: float = 10.0) -> Any:
    """Run ``fn`` (which may return a Deferred) in the dashboard's reactor; its result, or
    the exception it failed with."""
    box: queue.Queue[Any] = queue.Queue()
    dash.reactor.callFromThread(lambda: maybeDeferred(fn).addBoth(box.put))
    out = box.get(timeout=timeout)
    return out.value if isinstance(out, Failure) else out


# -- the event stream -------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_the_event_stream_yields_snapshots_whose_fields_match_stats_json(
        secured: EmbeddedServer, dash: Dashboard, capsys: pytest.CaptureFixture[str]) -> None:
    with _writer(secured) as c:
        c.put("weights", {"w": torch.zeros(4, 4), "step": 7})
        c.append("rollouts", torch.ones(3))
        c.append("rollouts", torch.ones(3))
        with Events(dash.url, log_in(dash.url)) as events:
            assert events.status == 200
            assert events.response.getheader("content-type").startswith("text/event-stream")
            first = events.next()
            assert first["history"] is True  # a new stream gets the charts' history
            wait_until(lambda: len(events.next()["bins"]) == 2, 10, "both bins listed")
            c.append("rollouts", torch.ones(3))
            wait_until(lambda: events.next()["bins"][0]["rates"] is not None, 10, "rates")
            snap = events.next()
    assert snap["history"] is False and snap["seq"] > first["seq"]
    assert main(["stats", "--json", "--port", str(secured.port)]) == 1  # no token: refused
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TENSORSHARE_TOKEN", READ_TOKEN)
        capsys.readouterr()
        assert main(["stats", "--json", "--port", str(secured.port)]) == 0
    stats = json.loads(capsys.readouterr().out)
    (server,) = snap["servers"]
    assert server["up"] and server["read_only"] and server["error"] is None
    assert set(server["stats"]) == set(stats["server"])  # the server's map, verbatim
    assert set(server["stats"]["memory"]) == set(stats["server"]["memory"])
    assert server["stats"]["server_id"] == stats["server"]["server_id"]
    rows = {b["name"]: b for b in snap["bins"]}
    assert set(rows) == set(stats["bins"]) == {"weights", "rollouts"}
    for name, summary in stats["bins"].items():
        assert set(summary) <= set(rows[name])  # every field of the bin's summary
        for key in ("kind", "n_items", "nbytes", "version", "first", "last", "limits"):
            assert rows[name][key] == summary[key], (name, key)
        assert set(rows[name]["rates"]) == set(RATES)  # as tensorshare monitor computes them
    assert rows["rollouts"]["n_items"] == 3 and rows["rollouts"]["kind"] == "list"
    assert rows["weights"]["first"] == "{w: float32[4,4], step: int}"
    assert server["ops"]["stats"]["requests"] >= 2
    assert server["requests_per_s"] is not None and set(server["rates"]) >= set(RATES)


@pytest.mark.timeout(60)
def test_changes_are_pushed_as_they_happen_coalesced(secured: EmbeddedServer,
                                                     dash: Dashboard) -> None:
    with _writer(secured) as c, Events(dash.url, log_in(dash.url)) as events:
        c.append("queue", 0)
        wait_until(lambda: any(b["name"] == "queue" for b in events.next()["bins"]), 10,
                   "the bin listed")
        wait_until(lambda: c.stats("queue")["bins"]["queue"]["listeners"] == 1, 10,
                   "the dashboard listening")
        events.seen.clear()
        for i in range(30):  # far faster than CHANGE_EVERY: folded into a few events
            c.append("queue", i)
        latest: dict[str, Any] = {}
        while latest.get("n_items") != 31:
            latest = next(ch for ch in reversed(events.next("change")) if ch["bin"] == "queue")
        sent = [e for e in events.seen if e[0] == "change"]
    assert latest["version"] == 31 and latest["op"] == "append" and latest["server"] == 0
    assert len(sent) < 30  # coalesced, the latest per bin


# -- authentication ----------------------------------------------------------------------------
def test_401_without_a_token_with_a_wrong_token_and_with_a_wrong_cookie(
        dash: Dashboard) -> None:
    for path in ("/", "/events", "/dashboard.js", "/index.html"):
        status, headers, _ = request(dash.url, path=path)
        assert status == 401, path
        assert headers["content-security-policy"] == CSP
    status, headers, _ = request(dash.url, path="/?token=not-the-token")
    assert status == 401 and headers["set-cookie"] == ""
    status, headers, _ = request(dash.url, path=f"/?token={WRITE_TOKEN}")
    assert status == 401  # the read-write token is not a login: only the read-only one is
    name = f"tensorshare_dashboard_{dash.port}"
    assert request(dash.url, path="/events", cookie=f"{name}=forged")[0] == 401


def test_a_token_in_the_url_becomes_an_httponly_strict_cookie_and_the_url_is_cleaned(
        dash: Dashboard) -> None:
    status, headers, body = request(dash.url, path=f"/?token={READ_TOKEN}")
    assert status == 303 and headers["location"] == "/"  # the token is gone from the URL
    cookie = headers["set-cookie"]
    attributes = {a.strip().lower() for a in cookie.split(";")[1:]}
    assert {"httponly", "samesite=strict", "path=/"} <= attributes
    assert READ_TOKEN not in cookie  # the cookie is not the token
    jar = cookie.split(";", 1)[0]
    status, headers, body = request(dash.url, path="/", cookie=jar)
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert headers["content-security-policy"] == CSP
    assert "'unsafe-inline'" not in CSP and "script-src 'self'" in CSP
    assert headers["x-content-type-options"] == "nosniff"
    assert b"<script src=\"dashboard.js\" defer></script>" in body
    assert b"<script>" not in body and b"http" not in body.replace(b"http-equiv", b"")
    for path, kind in (("/dashboard.js", "text/javascript"), ("/dashboard.css", "text/css"),
                       ("/favicon.svg", "image/svg+xml")):
        status, headers, body = request(dash.url, path=path, cookie=jar)
        assert status == 200 and headers["content-type"].startswith(kind) and body
    assert request(dash.url, path="/nothing", cookie=jar)[0] == 404
    status, headers, body = request(dash.url, "HEAD", "/", cookie=jar)
    assert status == 200 and body == b""


def test_the_page_never_writes_server_strings_as_html() -> None:
    from importlib import resources

    script = (resources.files("tensorshare.dashboard") / "static" / "dashboard.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
                 "new Function"):
        assert sink not in script, sink


def test_405_for_every_method_but_get_and_head(dash: Dashboard) -> None:
    jar = log_in(dash.url)
    for path in ("/", "/events", "/dashboard.js", "/nothing", f"/?token={READ_TOKEN}"):
        for method in ("POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE"):
            for cookie in (None, jar):
                status, headers, _ = request(dash.url, method, path, cookie=cookie,
                                             body=b"x" * 1000)
                assert status == 405, (method, path)
                assert headers["allow"] == "GET, HEAD"


def test_without_a_token_only_loopback_host_names_are_served(server: EmbeddedServer) -> None:
    with Dashboard(f"127.0.0.1:{server.port}", port=0) as dash:
        assert request(dash.url)[0] == 200
        assert request(dash.url, headers={"Host": f"localhost:{dash.port}"})[0] == 200
        # A page elsewhere whose name now resolves to 127.0.0.1 (DNS rebinding): refused.
        assert request(dash.url, headers={"Host": f"attacker.example:{dash.port}"})[0] == 401


def test_an_open_address_without_a_token_is_refused(server: EmbeddedServer) -> None:
    with pytest.raises(ValueError, match="without a token"):
        Dashboard(f"127.0.0.1:{server.port}", host="0.0.0.0", port=0)
    out = subprocess.run([sys.executable, "-m", "tensorshare", "dashboard", "--server",
                          f"127.0.0.1:{server.port}", "--host", "0.0.0.0", "--port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "without a token" in out.stderr


# -- read-only upstream --------------------------------------------------------------------------
def test_the_dashboards_connection_cannot_write(secured: EmbeddedServer,
                                                dash: Dashboard) -> None:
    client = dash.upstreams[0].client
    assert client is not None
    for attempt in (lambda: client.put("x", 1), lambda: client.append("x", 1),
                    lambda: client.delete("x")):
        assert isinstance(_in_reactor(dash, attempt), PermissionDenied)
    with _writer(secured) as c:
        assert c.list() == {}


@pytest.mark.timeout(60)
def test_a_token_that_may_write_is_refused(secured: EmbeddedServer, tmp_path: Path) -> None:
    with Dashboard(f"127.0.0.1:{secured.port}", port=0, read_token=WRITE_TOKEN) as dash:
        (error,) = dash.first_contact(10)
        assert error is not None and "read-only token" in error
        assert dash.upstreams[0].fatal and dash.upstreams[0].client is None
        with Events(dash.url, log_in(dash.url, WRITE_TOKEN)) as events:
            (server,) = events.next()["servers"]
            assert not server["up"] and "read-only token" in server["error"]
    with Dashboard(f"127.0.0.1:{secured.port}", port=0, read_token="a wrong one") as dash:
        (error,) = dash.first_contact(10)
        assert error is not None and dash.upstreams[0].fatal  # not tried again and again
    token = tmp_path / "token"
    token.write_text(WRITE_TOKEN + "\n")
    out = subprocess.run([sys.executable, "-m", "tensorshare", "dashboard", "--server",
                          f"127.0.0.1:{secured.port}", "--read-token-file", str(token),
                          "--port", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "read-only token" in out.stderr


@pytest.mark.timeout(60)
def test_the_dashboard_command_without_a_token_names_its_flag(secured: EmbeddedServer) -> None:
    out = subprocess.run([sys.executable, "-m", "tensorshare", "dashboard", "--server",
                          f"127.0.0.1:{secured.port}", "--port", "0", "--timeout", "5"],
                         capture_output=True, text=True, timeout=50,
                         env={k: v for k, v in os.environ.items()
                              if not k.startswith("TENSORSHARE_TOKEN")})
    assert out.returncode == 2, out.stderr
    assert "requires a token" in out.stderr and "--read-token-file PATH" in out.stderr
    assert "token=" not in out.stderr and "token_file=" not in out.stderr  # (Python's)


# -- bounded memory ----------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_stream_that_is_never_read_keeps_the_dashboards_memory_bounded(
        secured: EmbeddedServer) -> None:
    with _writer(secured) as c:  # snapshots of about 150 kB
        for i in range(250):
            c.put(f"bins/{i:04d}/" + "n" * 120, {"w": torch.zeros(2)})
    with Dashboard(f"127.0.0.1:{secured.port}", port=0, read_token=READ_TOKEN,
                   interval=0.05, max_paused=4.0) as dash:
        assert dash.first_contact(10) == [None]
        jar = log_in(dash.url)
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.connect(("127.0.0.1", dash.port))
        stalled.sendall(f"GET /events HTTP/1.1\r\nHost: 127.0.0.1:{dash.port}\r\n"
                        f"Cookie: {jar}\r\n\r\n".encode())  # and never reads

        def stream() -> Any:
            subs = list(dash.hub.subscribers)
            return subs[0] if subs else None

        wait_until(lambda: dash.call(stream) is not None, 10, "the stream")
        start = dash.call(lambda: dash.hub.seq)
        wait_until(lambda: dash.call(lambda: dash.hub.seq) >= start + 60, 30, "60 ticks")
        size = dash.call(lambda: len(dash.hub.encoded(False)))
        ticks, skipped, queued = dash.call(lambda: (dash.hub.seq - start, stream().skipped,
                                                    dash.hub.queued_bytes()))
        assert size > 100_000
        assert ticks * size > 20 * (64 * 1024 + size)  # what writing them all would hold
        assert queued <= 64 * 1024 + 2 * size  # one transport buffer and one snapshot
        assert skipped > ticks // 2
        with Events(dash.url, jar) as other:  # the others are not held back
            a, b = other.next(), other.next()
            assert b["seq"] > a["seq"]
        # Unread for max_paused: closed (a browser would reconnect once it reads again).
        wait_until(lambda: dash.call(lambda: stream() is None), 30, "the stream closed")
        stalled.settimeout(10)
        with pytest.raises(OSError):
            while stalled.recv(1 << 20):
                pass
            raise ConnectionResetError("closed")
        stalled.close()


def test_more_streams_than_max_streams_get_503(secured: EmbeddedServer) -> None:
    with Dashboard(f"127.0.0.1:{secured.port}", port=0, read_token=READ_TOKEN,
                   max_streams=2) as dash:
        jar = log_in(dash.url)
        with Events(dash.url, jar) as a, Events(dash.url, jar) as b:
            assert a.status == b.status == 200
            wait_until(lambda: dash.call(lambda: len(dash.hub.subscribers)) == 2)
            assert request(dash.url, path="/events", cookie=jar)[0] == 503


# -- servers that go away, several servers -----------------------------------------------------
@pytest.mark.timeout(90)
def test_a_server_restart_shows_it_unreachable_then_its_numbers_resume(
        tmp_path: Path, free_port: int) -> None:
    def start() -> EmbeddedServer:
        return EmbeddedServer(port=free_port, config=ServerConfig(data_dir=str(tmp_path)))

    srv = start()
    with Client("127.0.0.1", free_port) as c:
        c.put("weights", torch.zeros(3))
    with Dashboard(f"127.0.0.1:{free_port}", port=0, interval=0.2) as dash, \
            Events(dash.url) as events:
        wait_until(lambda: events.next()["bins"] != [], 10, "the bin")
        srv.stop()
        down = events.next()
        while down["servers"][0]["up"]:
            down = events.next()
        assert down["servers"][0]["error"] and down["servers"][0]["down_since"]
        assert [b["name"] for b in down["bins"]] == ["weights"]  # the last numbers stay
        srv = start()
        try:
            with Client("127.0.0.1", free_port) as c:
                c.put("weights", torch.ones(3))
            back = events.next(timeout=20)
            while not back["servers"][0]["up"] or back["bins"][0]["version"] != 2:
                back = events.next(timeout=20)
            assert back["servers"][0]["error"] is None
        finally:
            srv.stop()


@pytest.mark.timeout(90)
def test_several_servers_a_relay_beside_its_primary(server: EmbeddedServer) -> None:
    other = EmbeddedServer(port=0)
    try:
        with Client("127.0.0.1", server.port) as c, \
                Relay(f"127.0.0.1:{server.port}", ["params"], poll=0.2) as relay:
            c.put("params", torch.zeros(3))
            assert relay.wait_synced(20)
            servers = f"127.0.0.1:{server.port},127.0.0.1:{relay.port}"
            with Dashboard([servers, f"127.0.0.1:{other.port}"], port=0,
                           interval=0.2) as dash, Events(dash.url) as events:
                snap = events.next()
                while len(snap["bins"]) < 2 or any(s["stats"] is None for s in snap["servers"]):
                    snap = events.next()
        assert [(s["role"], s["relay_of"]) for s in snap["servers"]] == [
            ("primary", None), ("relay", 0), ("shard", None)]
        relayed = {(b["server"], b["name"]): b for b in snap["bins"]}
        assert relayed[(1, "params")]["behind"] == 0
        assert snap["servers"][1]["bins_behind"] == 0
    finally:
        other.stop()


def test_roles_and_relay_lag_from_the_stats_alone() -> None:
    def reply(sid: str, puts: int) -> dict[str, Any]:
        return {"server": {"server_id": sid, "requests": {"put": puts, "stats": 9}}, "bins": {}}

    assert roles([reply("a", 0)]) == [("server", None)]
    # The relay is listed first, but the primary is the one that served the writes.
    assert roles([reply("a", 0), reply("a", 5), reply("b", 0), None]) == [
        ("relay", 1), ("primary", None), ("shard", None), ("shard", None)]
    rows = [{"server": 1, "name": "p", "version": 9}, {"server": 0, "name": "p", "version": 7},
            {"server": 0, "name": "only-here", "version": 1}]
    assert relay_lag(rows, [1, None, None, None]) == {0: 1}
    assert rows[1]["behind"] == 2 and "behind" not in rows[0] and "behind" not in rows[2]
    # Replication says what each server is in its stats.
    primary, replica, fenced = (reply(s, 0) for s in "cde")
    primary["server"].update(role="primary", replication={"replicas": [{"offset": 1}]})
    replica["server"].update(role="replica", replication={"primary": "x:1"})
    fenced["server"].update(role="fenced", replication={"replicas": []})
    assert roles([primary, replica, fenced]) == [
        ("primary", None), ("replica", None), ("fenced", None)]


def test_the_ops_table_rates_and_latency_quantiles() -> None:
    from tensorshare.dashboard.snapshot import ops_table

    server = {"uptime": 12.0, "requests": {"put": 30, "get": 4},
              "bytes_in": {"put": 3000, "get": 40}, "bytes_out": {"put": 300, "get": 4000},
              "latency": {"buckets": [0.001, 0.01], "sum_us": {"put": 60_000, "get": 80_000},
                          "ops": {"put": [15, 15, 0], "get": [0, 1, 3]}}}
    ops = ops_table(server, (10.0, {"put": 10}))
    assert ops["put"] == {"requests": 30, "per_s": 10.0, "bytes_in": 3000, "bytes_out": 300,
                          "mean_ms": 2.0, "p50_ms": 1.0, "p50_above": False, "p99_ms": 10.0,
                          "p99_above": False}
    assert ops["get"]["per_s"] == 2.0  # 4 since the last look, which had none
    assert ops["get"]["p99_ms"] is None and ops["get"]["p99_above"]  # past the last bound
    assert ops_table(server, None)["put"]["per_s"] is None  # a first look: no rate yet


def test_the_readme_dashboard_section_runs_real_options_and_shows_a_test_screenshot() -> None:
    import re
    import shlex

    from tensorshare.cli.main import _parser

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Dashboard", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^tensorshare (.+?)(?:\s+#.*)?$", section, flags=re.M)
    assert len(commands) == 2
    for command in commands:
        _parser().parse_args(shlex.split(command))
    assert "](docs/dashboard.png)" in section
    assert (root / "docs" / "dashboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "TENSORSHARE_DASHBOARD_SCREENSHOT=docs/dashboard.png" in section


# -- the commands --------------------------------------------------------------------------------
def _until(proc: subprocess.Popen[str], prefix: str) -> str:
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return line
    raise AssertionError(f"no line starting {prefix!r}: {lines}")


@pytest.mark.timeout(90)
def test_serve_with_dashboard_port_serves_it_with_a_read_only_token_of_its_own(
        tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(WRITE_TOKEN)
    proc = subprocess.Popen([sys.executable, "-m", "tensorshare", "serve", "--port", "0",
                             "--dashboard-port", "0", "--token-file", str(token), "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **interruptible())
    try:
        port = int(_until(proc, "tensorshare ").rsplit(":", 1)[1])
        url = _until(proc, "dashboard at ").split()[-1]
        assert url.startswith("http://127.0.0.1:") and "?token=" in url
        base, login = url.split("?", 1)
        status, headers, _ = request(base, path="/?" + login)
        assert status == 303 and headers["location"] == "/"
        with Events(base, headers["set-cookie"].split(";")[0]) as events:
            snap = events.next()
            while snap["servers"][0]["stats"] is None:
                snap = events.next()
        (server,) = snap["servers"]
        assert server["up"] and server["read_only"]  # a read-only token made for this run
        assert server["address"] == f"tensorshare://127.0.0.1:{port}"
        assert interrupt(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.timeout(90)
def test_the_dashboard_command_watches_servers_given_with_commas_or_repeated(
        secured: EmbeddedServer, tmp_path: Path) -> None:
    server = EmbeddedServer(port=0, config=ServerConfig(token=WRITE_TOKEN,
                                                        read_token=READ_TOKEN))
    token = tmp_path / "read-token"
    token.write_text(READ_TOKEN + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "tensorshare", "dashboard", "--server",
                             f"127.0.0.1:{secured.port}", "--server",
                             f"tensorshare://127.0.0.1:{server.port},127.0.0.1:1",
                             "--read-token-file", str(token), "--port", "0",
                             "--timeout", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **interruptible())
    try:
        line = _until(proc, "dashboard at ")
        url = line.split()[2]
        assert READ_TOKEN not in line  # the user has the token: it is not printed
        with Events(url, log_in(url)) as events:
            snap = events.next()
            while snap["servers"][0]["stats"] is None:
                snap = events.next()
        assert [s["address"] for s in snap["servers"]] == [
            f"tensorshare://127.0.0.1:{secured.port}", f"tensorshare://127.0.0.1:{server.port}",
            "tensorshare://127.0.0.1:1"]
        assert snap["servers"][0]["up"] and not snap["servers"][2]["up"]
        assert [s["role"] for s in snap["servers"]] == ["shard", "shard", "shard"]
        assert interrupt(proc) == 0
        assert "warning: tensorshare://127.0.0.1:1:" in (proc.stderr.read() if proc.stderr
                                                           else "")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        server.stop()

