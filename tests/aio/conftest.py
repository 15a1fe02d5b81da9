"""What the asyncio face's tests share: each test runs on asyncio's own loop and on uvloop's
(``loop_kind``), through :func:`run`, a fresh loop per call (the library never sets a loop
policy: the tests never do either)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import uvloop

T = TypeVar("T")

LOOPS = ["asyncio", "uvloop"]
WAIT = 30.0  # every test's own deadline for a whole scenario


def loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    return uvloop.new_event_loop if kind == "uvloop" else None


@pytest.fixture(params=LOOPS)
def loop_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


Run = Callable[[Coroutine[Any, Any, Any]], Any]


@pytest.fixture
def run(loop_kind: str) -> Iterator[Run]:
    """``run(coro)``: run ``coro`` to its end on a new loop of ``loop_kind``, within
    :data:`WAIT` seconds."""

    def go(coro: Coroutine[Any, Any, T]) -> T:
        async def bounded() -> T:
            async with asyncio.timeout(WAIT):
                return await coro

        with asyncio.Runner(loop_factory=loop_factory(loop_kind)) as runner:
            return runner.run(bounded())

    yield go


def running_loop_kind() -> str:
    """Which kind of loop runs this coroutine."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") \
        else "asyncio"
