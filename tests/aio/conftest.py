"""What the asyncio face's tests share: each test runs on asyncio's own loop and on uvloop's
(``loop_kind``), through :func:`run`, a fresh loop per call (the library never sets a loop
policy: the tests never do either)."""

from __future__ import annotations

import asyncio
import threading
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

        # On a thread of its own, as an application's loop would be: the test process's main
        # thread may hold another loop marked as running (Playwright's sync API keeps one
        # for the whole session, in the browser tests a parallel worker may also run).
        box: list[tuple[bool, Any]] = []

        def main() -> None:
            try:
                with asyncio.Runner(loop_factory=loop_factory(loop_kind)) as runner:
                    box.append((True, runner.run(bounded())))
            except BaseException as exc:  # (handed to the test's thread as it is)
                box.append((False, exc))

        t = threading.Thread(target=main, name="tensorshare-test-loop", daemon=True)
        t.start()
        t.join(WAIT + 30)
        if not box:
            raise AssertionError(f"the scenario's loop did not end within {WAIT + 30:g} s")
        ok, value = box[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    yield go


def running_loop_kind() -> str:
    """Which kind of loop runs this coroutine."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") \
        else "asyncio"
