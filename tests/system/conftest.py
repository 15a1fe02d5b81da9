"""What the system tests share."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tensorshare import Client

#: Each client's timeout: generous, so that only real failures raise.
CLIENT_TIMEOUT = 30.0


@pytest.fixture
def clients() -> Iterator[Callable[..., Client]]:
    """``clients(port, **kw)``: a client of the server on ``port`` (on 127.0.0.1), closed at
    the end of the test."""
    made: list[Client] = []

    def make(port: int, **kw: Any) -> Client:
        kw.setdefault("timeout", CLIENT_TIMEOUT)
        c = Client("127.0.0.1", port, **kw)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()
