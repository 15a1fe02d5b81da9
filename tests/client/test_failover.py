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


def test_a_server_of_the_list_that_never_answers_costs_each_face_one_probe_timeout() -> None:
    """A listening socket that never answers (a hung machine) first in the list: every face
    still connects to the primary within its timeout (the probe gives up on it in half)."""
    import asyncio
    import socket
    import threading

    from twisted.internet import defer
    from twisted.internet.epollreactor import EPollReactor
    from twisted.python.failure import Failure

    from tensorshare.aio import AsyncClient
    from tensorshare.client.twisted import connect

    with socket.socket() as silent, EmbeddedServer(0) as primary:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # (never accepted: the kernel completes the handshake, nobody talks)
        both = [f"127.0.0.1:{silent.getsockname()[1]}", f"127.0.0.1:{primary.port}"]
        with Client(both, timeout=4) as c:
            assert c.put("blocking", 1) == 1

        async def aio() -> int:
            async with AsyncClient(both, timeout=4) as a:
                return int(await a.put("aio", 1))

        assert asyncio.run(aio()) == 1
        reactor = EPollReactor()
        outcome: list[object] = []

        @defer.inlineCallbacks
        def tx() -> object:
            t = yield connect(reactor, both, timeout=4)
            version = yield t.put("twisted", 1)
            yield t.close()
            return version

        reactor.callWhenRunning(lambda: tx().addBoth(lambda r: (outcome.append(r),
                                                                reactor.stop())))
        thread = threading.Thread(target=reactor.run, kwargs={"installSignalHandlers": False})
        thread.start()
        thread.join(30)
        assert not thread.is_alive()
        if isinstance(outcome[0], Failure):
            outcome[0].raiseException()
        assert outcome == [1]
