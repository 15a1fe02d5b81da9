"""A get's items are held for the consumer's session (and counted against its user's quota)
until the client acknowledges the reply. A consumer that gets and then sends nothing must
not hold a writer of the same user, waiting with ``wait_room=True``, back until its wait
runs out: the client acknowledges a get's reply by itself, soon, when nothing else carries
the acknowledgement (``client.session.ACK_DELAY``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorshare import Client, EmbeddedServer
from tensorshare.server import ServerConfig
from tensorshare.txclient import TxClient
from tests.client.test_both_clients import Reactor
from tests.conftest import wait_until
from tests.server.test_users import QUOTA, TOKENS, write_users

WAIT = 20.0
CHUNK = 4096  # float32s: 16 KiB, a quarter of alice's 64 KiB quota


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    config = ServerConfig(token=None, users_file=str(write_users(tmp_path)),
                          max_memory=1 << 30)
    with EmbeddedServer(port=0, config=config) as srv:
        yield srv


def _alice(srv: EmbeddedServer, timeout: float, heartbeat: float | None = None) -> Client:
    return Client("127.0.0.1", srv.port, timeout=timeout, heartbeat=heartbeat, user="alice",
                  token=TOKENS["alice"])


def _held(srv: EmbeddedServer) -> int:
    """What counts against alice's quota now (her bins, her sessions' held items...)."""
    return int(srv.call(lambda: srv.factory.users.usage["alice"].held()))


def _fill_and_take(srv: EmbeddedServer, consumer_get: Callable[[], Any]) -> None:
    with _alice(srv, WAIT) as producer:
        for _ in range(3):
            producer.append("alice/q", torch.zeros(CHUNK))  # 48 KiB of her 64
    got = consumer_get()
    assert len(got) == 3


def test_a_writer_waiting_for_room_is_not_held_back_by_a_silent_consumers_items(
        server: EmbeddedServer) -> None:
    # The consumer's heartbeat would carry the acknowledgement only after a minute: longer
    # than the writer waits (80% of its 10 s), so only the prompt acknowledgement lets it in.
    with _alice(server, WAIT, heartbeat=60.0) as consumer, _alice(server, 10.0) as writer:
        _fill_and_take(server, lambda: consumer.get("alice/q"))
        # The items left the bin and went to the consumer; it says nothing more. A put that
        # needs 24 KiB more of a 64 KiB quota fits only once they are acknowledged.
        version = writer.put("alice/w", torch.zeros(CHUNK * 3 // 2), wait_room=True)
        assert version == 1 and writer.list() == {"alice/w": 1}
        wait_until(lambda: _held(server) < QUOTA, WAIT, "alice's held items freed")


def test_the_twisted_client_acknowledges_a_gets_items_by_itself_too(
        server: EmbeddedServer) -> None:
    r = Reactor()
    try:
        tx = r.call(TxClient, r.reactor, f"127.0.0.1:{server.port}", timeout=WAIT,
                    heartbeat=60.0, user="alice", token=TOKENS["alice"])
        r.call(tx.start)
        _fill_and_take(server, lambda: r.call(tx.get, "alice/q"))
        with _alice(server, 10.0) as writer:
            assert writer.put("alice/w", torch.zeros(CHUNK * 3 // 2), wait_room=True) == 1
        r.call(tx.close)
    finally:
        r.stop()
