"""One spelling of a server's address in every client API and command: ``HOST:PORT``,
``tensorshare://``, ``tensorshare+tls://`` and ``unix://`` (tls in tests/system), or a
message that lists the forms that work."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tensorshare import (
    Client,
    ClientOptions,
    EmbeddedServer,
    RLWorker,
    ShardedClient,
    TensorShare,
)
from tensorshare.client.twisted import connect
from tensorshare.inference import InferenceClient
from tensorshare.wire.address import Address, parse_address
from tests.client.test_both_clients import Reactor

TIMEOUT = 10.0


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    path = tmp_path_factory.mktemp("address") / "s.sock"
    with EmbeddedServer(port=0, unix=str(path)) as server:
        yield server


def _forms(server: EmbeddedServer) -> list[str]:
    return [f"127.0.0.1:{server.port}", f"tensorshare://127.0.0.1:{server.port}",
            f"unix://{server.unix}"]


@pytest.mark.parametrize("given, expected", [
    ("127.0.0.1:48021", Address("127.0.0.1", 48021)),
    ("shard-0.shards:7000", Address("shard-0.shards", 7000)),
    ("[::1]:7000", Address("::1", 7000)),
    ("[::1]", Address("::1", 8000)),
    ("::1", Address("::1", 8000)),  # a bare IPv6 literal is a host
    ("localhost", Address("localhost", 8000)),
    ("tensorshare://h:1", Address("h", 1)),
    ("tensorshare+tls://[::1]:9", Address("::1", 9, tls=True)),
    ("unix:///tmp/x.sock", Address(path="/tmp/x.sock")),
])
def test_every_form_parses(given: str, expected: Address) -> None:
    assert parse_address(given, 8000) == expected


@pytest.mark.parametrize("given", ["h:abc", "h:", ":7000", "h:70000", "[::1:7000",
                                   "tensorshare://h", "http://h:1"])
def test_a_malformed_address_is_told_the_forms_that_work(given: str) -> None:
    with pytest.raises(ValueError, match=r"HOST:PORT, tensorshare://HOST:PORT, "
                                         r"tensorshare\+tls://HOST:PORT or unix://PATH"):
        Client(given, timeout=1.0)


def test_the_blocking_client_takes_every_form_and_a_port_in_host_wins(
        srv: EmbeddedServer) -> None:
    for i, where in enumerate(_forms(srv)):
        with Client(where, 1, timeout=TIMEOUT) as c:  # (port 1: the address's own wins)
            assert c.put(f"b{i}", i) == 1


def test_the_other_clients_take_host_port(srv: EmbeddedServer) -> None:
    where = f"127.0.0.1:{srv.port}"
    with ShardedClient([where, f"unix://{srv.unix}"], timeout=TIMEOUT) as sc:
        sc.ping()
    worker = RLWorker(where, timeout=TIMEOUT, watch_stop=False)
    try:
        assert worker.client.ping() is None
    finally:
        worker.stop()
    with InferenceClient("svc", where, timeout=TIMEOUT) as ic:
        assert ic.client.ping() is None
    ts = TensorShare(where, timeout=TIMEOUT)
    got: list[object] = []
    ts.put("cb", torch.ones(1), callback=lambda r: (got.append(r), ts.stop()))
    ts.start()
    assert got and got[0]["status"] == "OK"  # type: ignore[index]
    r = Reactor()
    try:
        tx = r.call(connect, r.reactor, where, timeout=TIMEOUT)
        assert r.call(tx.put, "tx", 1) == 1
        r.call(tx.close)
    finally:
        r.stop()


def test_the_command_line_takes_host_port(srv: EmbeddedServer) -> None:
    out = subprocess.run([sys.executable, "-m", "tensorshare", "health", "--host",
                          f"127.0.0.1:{srv.port}"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"ok: 127.0.0.1:{srv.port} answered")


def test_the_demo_takes_the_same_forms() -> None:
    from tensorshare.rl.demo import _parse_server

    assert _parse_server("h:7000") == ("h", 7000)
    assert _parse_server("tensorshare://h:7000") == ("tensorshare://h:7000", 7000)
    assert _parse_server("unix:///tmp/s.sock")[0] == "unix:///tmp/s.sock"
    for bad in ("nowhere", "h:x", "tensorshare://h"):
        with pytest.raises(ValueError, match="HOST:PORT, tensorshare://HOST:PORT"):
            _parse_server(bad)


@pytest.mark.parametrize("given", ["/tmp/x.sock", "run/x.sock"])
def test_a_bare_socket_path_is_refused_with_the_unix_form_never_taken_for_a_host(
        given: str) -> None:
    tried: list[int] = []

    def connector() -> socket.socket:  # (never called: refused before anything is tried)
        tried.append(1)
        raise OSError("not reached")

    for make in (lambda: Client(given, timeout=TIMEOUT, connector=connector),
                 lambda: ClientOptions().endpoint(given, None)):  # (every face's resolve)
        with pytest.raises(ValueError, match=re.escape(f"unix://{given}")):
            make()
    assert not tried


def test_a_tls_ca_that_names_no_file_fails_at_once_naming_the_file_and_tls_ca(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is tried (the connector is never called): a missing CA file is not a
    network blip to retry until the timeout."""
    tried: list[int] = []

    def connector() -> socket.socket:
        tried.append(1)
        raise OSError("not reached")

    missing = str(tmp_path / "nowhere" / "ca.pem")
    url = "tensorshare+tls://localhost:7000"
    with pytest.raises(FileNotFoundError) as info:
        Client(url, timeout=60.0, tls_ca=missing, connector=connector)
    assert "tls_ca=" in str(info.value) and missing in str(info.value)
    monkeypatch.setenv("TENSORSHARE_TLS_CA", missing)
    with pytest.raises(FileNotFoundError,
                       match=f"TENSORSHARE_TLS_CA names {re.escape(repr(missing))}"):
        Client(url, timeout=60.0, connector=connector)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=f"tls_ca= names {re.escape(repr(str(garbage)))}, "
                                         f"which holds no CA certificate"):
        Client(url, timeout=60.0, tls_ca=str(garbage), connector=connector)
    assert not tried


def test_a_missing_tls_ca_does_not_stop_a_plain_connection(srv: EmbeddedServer,
                                                           tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Without TLS the CA is not used, so not looked at (a TENSORSHARE_TLS_CA set for
    another server does not break this one)."""
    monkeypatch.setenv("TENSORSHARE_TLS_CA", str(tmp_path / "absent.pem"))
    with Client(f"127.0.0.1:{srv.port}", timeout=TIMEOUT) as c:
        assert c.ping() is None
