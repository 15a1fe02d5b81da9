"""The address list of a replicated set (client/failover): how it is written, and a client that
finds no primary in it."""

from __future__ import annotations

import pytest

from tensorshare import Client, EmbeddedServer
from tensorshare.client.failover import addresses
from tensorshare.errors import ConnectError
from tests.conftest import wait_until


def test_an_address_list_is_a_list_or_commas_with_the_scheme_for_each(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TENSORSHARE_URL", raising=False)
    assert addresses("a:1") is None and addresses(None) is None
    assert addresses(["a:1", "b:2"]) == ["a:1", "b:2"]
    assert addresses("a:1, b:2") == ["a:1", "b:2"]
    assert addresses("tensorshare+tls://a:1,b:2") == ["tensorshare+tls://a:1",
                                                      "tensorshare+tls://b:2"]
    monkeypatch.setenv("TENSORSHARE_URL", "tensorshare://a:1,b:2")
    assert addresses(None) == ["tensorshare://a:1", "tensorshare://b:2"]
    for bad in ([], ["a:1", ""], "a:1,,b:2"):
        with pytest.raises(ValueError):
            addresses(bad)


def test_with_no_primary_in_the_list_the_client_cannot_connect_and_says_why() -> None:
    with EmbeddedServer(0) as primary, \
            EmbeddedServer(0, replica_of=f"127.0.0.1:{primary.port}") as replica:
        r = Client("127.0.0.1", replica.port, timeout=5)
        wait_until(lambda: r.stats()["server"]["replication"]["synced"], 10, "in sync")
        with pytest.raises(ConnectError, match="no primary among .* is a replica"):
            Client([f"127.0.0.1:{replica.port}"], timeout=1, reconnect=False)
        c = Client([f"127.0.0.1:{replica.port}", f"127.0.0.1:{primary.port}"], timeout=5)
        c.put("v", 1)  # to the primary
        wait_until(lambda: "v" in r.list(), 10, "the put on the replica")
        c.close()
        r.close()
