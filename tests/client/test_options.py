"""ClientOptions: one options object that every client face and ``connect`` share.

Each face takes ``options=`` beside its keywords (which override that field), against a real
server; the Twisted faces against a MemoryReactorClock (no sockets: what they would connect
to, and with what, is visible on the reactor).
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from twisted.internet.testing import MemoryReactorClock

import tensorshare
from tensorshare import Client, ClientOptions, ShardedClient, TensorShare
from tensorshare.client import sharded
from tensorshare.client.twisted import TxClient, _Factory
from tensorshare.client.twisted import connect as tx_connect
from tensorshare.server import EmbeddedServer

HOST = "127.0.0.1"
WAIT = 10.0


@pytest.fixture
def clients() -> Iterator[list[Any]]:
    """Clients a test made, closed at its end."""
    made: list[Any] = []
    yield made
    for c in made:
        c.close()


def names_seen(server: EmbeddedServer) -> list[str]:
    """How the server's connected clients introduced themselves."""
    return sorted(server.call(lambda: [p.client_name for p in server.factory.connections]))


def test_the_defaults_are_those_every_face_had() -> None:
    assert dataclasses.asdict(ClientOptions()) == dict(
        timeout=30.0, reconnect=True, compress=None, compress_min_bytes=64 * 1024, name=None,
        session=True, heartbeat=None, shm=True, shm_min_bytes=1 << 20, tls=None, tls_ca=None,
        token=None, token_file=None, user=None)
    assert tensorshare.client.ClientOptions is ClientOptions


def test_replace_derives_a_checked_variant_and_the_token_stays_out_of_the_repr() -> None:
    base = ClientOptions(timeout=5, token="s3cret-token")
    fast = base.replace(timeout=1, compress="lz4")
    assert (base.timeout, base.compress) == (5.0, None)  # unchanged: frozen
    assert (fast.timeout, fast.compress, fast.token) == (1.0, "lz4", "s3cret-token")
    assert isinstance(fast.timeout, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.timeout = 2  # type: ignore[misc]
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        base.replace(timeout=0)
    assert "s3cret" not in repr(fast)


def test_client_from_options_behaves_as_with_the_keywords(
        server: EmbeddedServer, clients: list[Any]) -> None:
    opts = ClientOptions(timeout=7, compress="lz4", name="from-options")
    c = Client(HOST, server.port, options=opts)
    clients.append(c)
    assert (c.timeout, c.compress, c.options) == (7.0, "lz4", opts)
    assert names_seen(server) == ["from-options"]
    t = torch.arange(256 * 1024, dtype=torch.int32) % 7  # 1 MiB, compressible
    c.put("z", t)
    assert 0 < server.call(lambda: server.factory.store.nbytes) < t.nbytes // 4  # lz4 ran
    assert torch.equal(c.get("z"), t)
    plain = Client(HOST, server.port)
    clients.append(plain)
    assert (plain.timeout, plain.compress) == (30.0, None)
    assert names_seen(server) == ["from-options", "tensorshare-python"]


def test_a_keyword_beside_options_overrides_that_field(
        server: EmbeddedServer, clients: list[Any]) -> None:
    opts = ClientOptions(timeout=7, compress="lz4", name="a")
    c = Client(HOST, server.port, 5, options=opts, name="b")
    clients.append(c)
    assert (c.timeout, c.compress, c.options.name) == (5.0, "lz4", "b")
    assert names_seen(server) == ["b"]
    assert opts.name == "a"  # the caller's object is left alone


def test_the_twisted_client_and_connect_take_options() -> None:
    opts = ClientOptions(timeout=3, compress="auto", name="tx-options")
    tx = TxClient(MemoryReactorClock(), HOST, 7000, options=opts, compress=None)
    assert (tx.timeout, tx.compress, tx.session.name) == (3.0, None, "tx-options")
    assert TxClient(MemoryReactorClock(), HOST, 7000).session.name == "tensorshare-twisted"
    reactor = MemoryReactorClock()
    d = tx_connect(reactor, HOST, 7001, options=opts, timeout=4)
    host, port, factory, timeout, _ = reactor.tcpClients[0]
    assert isinstance(factory, _Factory)
    client = factory.client
    assert (host, port, timeout) == (HOST, 7001, 4.0)  # it connects with its options
    assert (client.compress, client.session.name) == ("auto", "tx-options")
    d.addErrback(lambda _: None)
    d.cancel()


def test_sharded_client_and_connect_hand_one_options_object_on(
        server: EmbeddedServer, clients: list[Any]) -> None:
    opts = ClientOptions(timeout=4, name="sharded-options")
    sc = ShardedClient([f"{HOST}:{server.port}"], options=opts, compress="lz4")
    clients.append(sc)
    assert (sc.timeout, sc.compress) == (4.0, "lz4")
    inner = sc.client_for("x")
    assert inner.options is sc.options and (inner.timeout, inner.compress) == (4.0, "lz4")
    assert sc.begin.timeout == 4.0
    c = sharded.connect(HOST, server.port, 6, options=opts)
    clients.append(c)
    assert isinstance(c, Client) and (c.timeout, c.options.name) == (6.0, "sharded-options")
    assert names_seen(server) == ["sharded-options", "sharded-options"]


def test_tensorshare_connects_with_its_options(server: EmbeddedServer) -> None:
    ts = TensorShare(HOST, server.port, options=ClientOptions(timeout=9, name="ts-options"),
                     compress="lz4")
    assert (ts.timeout, ts.options.compress, ts.options.name) == (9.0, "lz4", "ts-options")
    seen: list[list[str]] = []

    def listed(reply: dict[str, Any]) -> None:
        seen.append(names_seen(server))
        ts.stop()

    ts.list(listed)
    runner = threading.Thread(target=ts.start, daemon=True)
    runner.start()
    runner.join(WAIT)
    assert not runner.is_alive() and seen == [["ts-options"]]
    assert TensorShare(HOST, server.port, 2.5, options=ClientOptions(timeout=9)).timeout == 2.5


BAD: list[tuple[dict[str, Any], type[Exception], str]] = [
    (dict(timeout=0), ValueError, "timeout must be a positive number of seconds, not 0"),
    (dict(timeout=None), ValueError, "timeout must be a positive number of seconds, not None"),
    (dict(reconnect=-1), ValueError, "reconnect must be a positive number of seconds"),
    (dict(compress="zstd"), ValueError, "compress must be None, 'lz4' or 'auto', not 'zstd'"),
    (dict(bogus=1), TypeError, "bogus"),
    (dict(options="timeout=5"), TypeError, "options must be a ClientOptions, not str"),
]

FACES: dict[str, Callable[..., Any]] = {
    "Client": lambda port, **kw: Client(HOST, port, **kw),
    "TxClient": lambda port, **kw: TxClient(MemoryReactorClock(), HOST, port, **kw),
    "txclient.connect": lambda port, **kw: tx_connect(MemoryReactorClock(), HOST, port, **kw),
    "ShardedClient": lambda port, **kw: ShardedClient([f"{HOST}:{port}"], **kw),
    "connect": lambda port, **kw: sharded.connect(HOST, port, **kw),
    "TensorShare": lambda port, **kw: TensorShare(HOST, port, **kw),
}


@pytest.mark.parametrize("face", sorted(FACES))
@pytest.mark.parametrize("bad", BAD, ids=lambda b: str(b[0]))
def test_a_bad_option_raises_when_the_face_is_made_before_any_connection(
        face: str, bad: tuple[dict[str, Any], type[Exception], str], free_port: int) -> None:
    kw, error, message = bad
    if face in ("connect", "TensorShare") and kw == dict(timeout=None):
        kw, message = dict(timeout=0), "not 0"  # (their timeout=None means the default)
    with pytest.raises(error, match=re.escape(message)):
        FACES[face](free_port, **kw)  # nothing listens there: no ConnectError first
    if "options" not in kw:  # a bad keyword beside good options: the same error
        with pytest.raises(error, match=re.escape(message)):
            FACES[face](free_port, options=ClientOptions(timeout=5), **kw)
