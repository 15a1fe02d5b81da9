"""What the system tests share."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any, TypeVar

import pytest

from tensorshare import Client, EmbeddedServer
from tests.chaos import ServerProcess
from tests.conftest import wait_until

#: Each client's timeout: generous, so that only real failures raise.
CLIENT_TIMEOUT = 30.0

#: How long a failover test waits for each step (the writers, the promoted replica).
FAILOVER_TIMEOUT = 20.0

T = TypeVar("T")


def closed_after(new: Callable[..., T]) -> Iterator[Callable[..., T]]:
    """A fixture's body: yields ``new`` (clients, servers, proxies: anything with a
    ``close``), and closes everything it made at the end of the test."""
    made: list[Any] = []

    def make(*args: Any, **kw: Any) -> T:
        x = new(*args, **kw)
        made.append(x)
        return x

    try:
        yield make
    finally:
        for x in made:
            x.close()


@pytest.fixture
def clients() -> Iterator[Callable[..., Client]]:
    """``clients(port, **kw)``: a client of the server on ``port`` (on 127.0.0.1), closed at
    the end of the test."""

    def client(port: int, **kw: Any) -> Client:
        kw.setdefault("timeout", CLIENT_TIMEOUT)
        return Client("127.0.0.1", port, **kw)

    yield from closed_after(client)


@pytest.fixture
def procs() -> Iterator[Callable[..., ServerProcess]]:
    """``procs(*args)``: a ``tensorshare serve`` process on a free port with those options
    (:class:`tests.chaos.ServerProcess`), killed at the end of the test."""
    yield from closed_after(lambda *args: ServerProcess(0, *args))


def fail_over_under(threads: list[threading.Thread], acked: list[list[int]],
                    errors: list[BaseException], stop: threading.Event,
                    primary: ServerProcess, admin: Client, n: int) -> None:
    """Start ``threads`` (writers that fill ``acked``); once ``n`` writes are acknowledged,
    kill -9 the primary and promote the replica ``admin`` is connected to; once ``n`` more
    are acknowledged there, stop them: none failed."""
    for t in threads:
        t.start()
    try:
        wait_until(lambda: sum(map(len, acked)) >= n or bool(errors), FAILOVER_TIMEOUT,
                   "writes under way")
        primary.kill()
        assert admin.promote() == 1
        before = sum(map(len, acked))
        wait_until(lambda: sum(map(len, acked)) >= before + n or bool(errors),
                   FAILOVER_TIMEOUT, "writes on the promoted replica")
    finally:
        stop.set()
        for t in threads:
            t.join(FAILOVER_TIMEOUT * 2)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors


@pytest.fixture
def servers() -> Iterator[Callable[..., EmbeddedServer]]:
    """``servers(**kw)``: an :class:`EmbeddedServer` on a free port, stopped at the end."""
    with ExitStack() as stack:
        yield lambda **kw: stack.enter_context(EmbeddedServer(0, **kw))
