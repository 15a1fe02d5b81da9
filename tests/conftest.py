"""Shared fixtures: a real server on 127.0.0.1, port 0, on a private reactor thread."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from tensorshare.server import EmbeddedServer


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    """A fresh server for one test; stopped afterwards."""
    srv = EmbeddedServer(port=0)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def free_port() -> int:
    """A port on 127.0.0.1 where nothing listens (bound, read back, released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``condition`` until it is true; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    tick = threading.Event()  # never set: wait() is the poll interval
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        tick.wait(0.005)
