"""One suite, two clients: the blocking Client and the Twisted client behave the same.

Both are shells over one ClientSession; this suite pins that down from the outside, against a
real server on 127.0.0.1: the same results, the same errors, the same options, the same
behaviour when the server goes away and comes back. The Twisted client runs in a private
reactor thread behind a small synchronous facade.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from twisted.internet import defer
from twisted.internet.epollreactor import EPollReactor
from twisted.python.failure import Failure

from tensorshare import Client, EmbeddedServer
from tensorshare.client.twisted import TxClient, connect
from tensorshare.errors import (
    BinFull,
    BinNotFound,
    ConnectError,
    ConnectionLost,
    SessionLost,
    Timeout,
    WaitTimeout,
)
from tests.conftest import wait_until

WAIT = 30.0


class Reactor:
    """A private reactor in a daemon thread."""

    def __init__(self) -> None:
        self.reactor = EPollReactor()
        self.thread = threading.Thread(target=self.reactor.run,
                                       kwargs={"installSignalHandlers": False}, daemon=True)
        self.thread.start()

    def call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Run ``fn`` in the reactor thread and wait (with a deadline) for its result."""
        done = threading.Event()
        box: list[Any] = []

        def run() -> None:
            d = defer.maybeDeferred(fn, *args, **kw)
            d.addBoth(lambda r: (box.append(r), done.set()))

        self.reactor.callFromThread(run)
        assert done.wait(WAIT * 2), "the client reactor did not answer"
        if isinstance(box[0], Failure):
            box[0].raiseException()
        return box[0]

    def stop(self) -> None:
        self.reactor.callFromThread(self.reactor.stop)
        self.thread.join(WAIT)


class SyncTx:
    """The Twisted client, called like the blocking one (every call waits for its Deferred)."""

    def __init__(self, r: Reactor, client: TxClient) -> None:
        self._r, self._client = r, client

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr
        return lambda *a, **kw: self._r.call(attr, *a, **kw)


@pytest.fixture(params=["blocking", "twisted"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make(kind: str) -> Iterator[Callable[..., Any]]:
    """Make clients of this test's kind (closed at the end)."""
    made: list[Any] = []
    reactor: list[Reactor] = []

    def build(port: int, **kw: Any) -> Any:
        kw.setdefault("timeout", WAIT)
        if kind == "blocking":
            c: Any = Client("127.0.0.1", port, **kw)
        else:
            if not reactor:
                reactor.append(Reactor())
            r = reactor[0]
            c = SyncTx(r, r.call(connect, r.reactor, "127.0.0.1", port, **kw))
        made.append(c)
        return c

    try:
        yield build
    finally:
        for c in made:
            c.close()
        for r in reactor:
            r.stop()


def test_the_same_results(server: EmbeddedServer, make: Callable[..., Any]) -> None:
    c = make(server.port)
    assert c.put("w", {"a": torch.arange(4)}) == 1
    assert torch.equal(c.peek("w")["a"], torch.arange(4))
    assert c.append("q", 1) == 1 and c.append("q", [2, 3]) == 2
    assert c.list() == {"w": 1, "q": 2}
    assert c.get("q", max_items=1) == [1]
    res = c.fetch("q", remove=False, min_tag=None)
    assert res.kind == "list" and res.value == [[2, 3]] and res.n_items == 1
    assert c.delete("w") is True and c.delete("w") is False
    assert c.configure("b", max_items=1).max_items == 1
    c.append("b", 1)
    with pytest.raises(BinFull):
        c.append("b", 2)
    stats = c.stats()
    assert stats["server"]["connections"] >= 1 and "b" in stats["bins"]


def test_the_same_errors(server: EmbeddedServer, make: Callable[..., Any]) -> None:
    c = make(server.port)
    with pytest.raises(BinNotFound):
        c.get("missing")
    with pytest.raises(WaitTimeout) as info:
        c.get("missing", timeout=0.1)
    assert isinstance(info.value, Timeout) and isinstance(info.value, TimeoutError)
    assert not isinstance(info.value, ConnectionError)  # the server is fine
    with pytest.raises(ValueError):
        c.get("missing", timeout=-1)
    with pytest.raises(TypeError):
        c.put("x", {"bad": object()})


def test_the_same_connect_errors(free_port: int, make: Callable[..., Any]) -> None:
    with pytest.raises(ConnectError, match=str(free_port)):
        make(free_port, reconnect=False, timeout=5.0)
    with pytest.raises(ConnectError, match=str(free_port)):
        make(free_port, timeout=0.5)  # with reconnect: tried until the timeout


def test_a_server_restart_is_ridden_out(make: Callable[..., Any]) -> None:
    srv = EmbeddedServer(port=0)
    port = srv.port
    try:
        c = make(port, timeout=WAIT)
        watcher = make(port)
        events: list[dict[str, Any]] = []
        watcher.listen("w", events.append)
        c.put("w", 1)
        wait_until(lambda: len(events) == 1, what="the first event")
        srv.stop()
        wait_until(lambda: not c.connected and not watcher.connected, what="both to notice")
        result: list[Any] = []
        t = threading.Thread(target=lambda: result.append(c.put("w", 2)))
        t.start()  # made while the server is down: waits for it
        srv = EmbeddedServer(port=port)
        t.join(WAIT)
        assert result == [1]  # a new server (no persistence): versions started again
        wait_until(lambda: any(e["op"] == "resync" for e in events), what="the resync")
        resync = [e for e in events if e["op"] == "resync"][0]
        assert resync["restarted"] is True  # the new server starts versions from 0 again
        # After the resync, versions only go up again, up to the put on the new server
        # (seen as a put event, or in the resync itself if the watcher came back later).
        wait_until(lambda: events[-1]["version"] == 1, what="the put on the new server")
        after = [e["version"] for e in events[events.index(resync):]]
        assert after == sorted(set(after))
        assert c.peek("w") == 2 and c.connected
    finally:
        srv.stop()


def test_a_request_in_flight_when_the_server_restarts_fails_with_session_lost(
        make: Callable[..., Any]) -> None:
    srv = EmbeddedServer(port=0)
    port = srv.port
    try:
        c = make(port)
        box: list[Any] = []

        def waiting_get() -> None:
            try:
                box.append(c.get("never", timeout=None))
            except BaseException as exc:  # checked below
                box.append(exc)

        t = threading.Thread(target=waiting_get)
        t.start()
        wait_until(lambda: srv.call(lambda: srv.factory.store.n_waiters) == 1,
                   what="the waiting get to reach the server")
        srv.stop()
        srv = EmbeddedServer(port=port)
        t.join(WAIT)
        assert isinstance(box[0], SessionLost), box
        assert c.put("after", 1) == 1  # requests after the reconnect work
    finally:
        srv.stop()


def test_without_reconnect_the_first_drop_is_final(make: Callable[..., Any]) -> None:
    srv = EmbeddedServer(port=0)
    try:
        c = make(srv.port, reconnect=False)
        c.put("x", 1)
        srv.stop()
        with pytest.raises(ConnectionLost):
            for _ in range(1000):  # the first call may race the loss; one soon fails
                c.ping()
        assert c.closed
    finally:
        srv.stop()
