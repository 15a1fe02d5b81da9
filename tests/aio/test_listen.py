"""Listening with the asyncio face: the async iterator (registered before the first event
is awaited, unlistened when its loop is left, bounded, with one 'missed' event for what a
slow consumer lost) and the callback form, against a real server, on both loops."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tensorshare import ConnectionLost, EmbeddedServer
from tensorshare.aio import AsyncClient, ListenEvents
from tests.aio.conftest import Run
from tests.chaos import HOST, ChaosProxy


def url(server: EmbeddedServer) -> str:
    return f"tensorshare://{HOST}:{server.port}"


async def listeners(c: AsyncClient, name: str) -> int:
    stats = await c.stats()
    return int(stats["bins"].get(name, {}).get("listeners", 0))


async def until(condition: Any, what: str, timeout: float = 10.0) -> None:
    """Await ``condition()`` (a coroutine function) until it is true, within ``timeout``."""
    async with asyncio.timeout(timeout):
        while not await condition():
            await asyncio.sleep(0.005)


def test_the_iterator_is_live_before_the_first_event_and_leaving_it_unlistens(
        run: Run, server: EmbeddedServer) -> None:
    async def scenario() -> None:
        async with AsyncClient(url(server), timeout=10) as c:
            await c.put("w", 0)
            versions = []

            async def writer() -> None:
                # Only once the listen is registered (the put before it is not an event).
                await until(lambda: _is(listeners(c, "w"), 1), "the listen")
                for i in range(1, 6):
                    await c.put("w", i)

            task = asyncio.create_task(writer())
            async for event in c.listen("w"):
                assert event["bin"] == "w" and event["op"] == "put"
                versions.append(event["version"])
                if len(versions) == 5:
                    break  # leaving the loop unlistens (the iterator is gone)
            await task
            assert versions == [2, 3, 4, 5, 6]
            await until(lambda: _is(listeners(c, "w"), 0), "the unlisten")
            assert "w" not in c._session.listeners

    run(scenario())


async def _is(value: Any, expected: Any) -> bool:
    return await value == expected


def test_async_with_is_live_in_its_body_and_several_listeners_share_a_bin(
        run: Run, server: EmbeddedServer) -> None:
    async def scenario() -> None:
        async with AsyncClient(url(server), timeout=10) as c:
            called: list[dict[str, Any]] = []
            async_called: list[int] = []

            async def slow(event: dict[str, Any]) -> None:
                await asyncio.sleep(0)
                async_called.append(event["version"])

            assert await c.listen("b", called.append) is None
            await c.listen("b", slow)
            async with c.listen("b") as one, c.listen("b") as two:
                assert isinstance(one, ListenEvents)
                await c.put("b", 1)
                assert (await one.__anext__())["version"] == 1
                assert (await two.__anext__())["version"] == 1
                await one.aclose()
                await c.put("b", 2)
                assert (await two.__anext__())["version"] == 2
                with pytest.raises(StopAsyncIteration):
                    await one.__anext__()
            assert await listeners(c, "b") == 1  # the callbacks still listen
            await until(lambda: _true(len(async_called) == 2), "the async callback")
            assert [e["version"] for e in called] == [1, 2] and async_called == [1, 2]
            # unlisten ends every listener of the bin, iterators too.
            events = await c.listen("b")  # (registered; iterated later)
            assert isinstance(events, ListenEvents) and await listeners(c, "b") == 1
            assert await c.unlisten("b") is True
            assert [e async for e in events] == []
            assert await listeners(c, "b") == 0 and await c.unlisten("b") is False

    run(scenario())


async def _true(value: bool) -> bool:
    return value


@pytest.mark.parametrize("max_queue", [1, 8])
def test_a_slow_consumer_keeps_memory_bounded_and_counts_what_it_missed(
        run: Run, server: EmbeddedServer, max_queue: int) -> None:
    n = 300

    async def scenario() -> None:
        async with AsyncClient(url(server), timeout=10) as c:
            async with c.listen("s", max_queue=max_queue) as events:
                for i in range(n):  # the consumer reads nothing meanwhile
                    await c.put("s", i)
                    assert events.queued <= max_queue
                await c.ping()  # every event of those puts came before this reply
                got = []
                while events.queued or events.missed:
                    got.append(await events.__anext__())
                regular = [e for e in got if e["op"] == "put"]
                missed = [e for e in got if e["op"] == "missed"]
                assert len(regular) == max_queue
                assert [e["version"] for e in regular] == list(range(1, max_queue + 1))
                assert missed == [{"status": "OK", "op": "missed", "bin": "s",
                                   "missed": n - max_queue}]
                # Caught up: the next change comes as itself, right after.
                await c.put("s", "again")
                assert (await events.__anext__())["version"] == n + 1

    run(scenario())


def test_a_consumer_that_keeps_falling_behind_gets_every_drop_counted_in_order(
        run: Run, server: EmbeddedServer) -> None:
    async def scenario() -> None:
        async with AsyncClient(url(server), timeout=10) as c:
            async with c.listen("s", max_queue=4) as events:
                seen, missed = [], 0
                for i in range(100):
                    await c.put("s", i)
                    if i % 7 == 0:  # reads one event now and then
                        await c.ping()
                        ev = await events.__anext__()
                        if ev["op"] == "missed":
                            missed += ev["missed"]
                        else:
                            seen.append(ev["version"])
                await c.ping()
                while events.queued or events.missed:
                    ev = await events.__anext__()
                    if ev["op"] == "missed":
                        missed += ev["missed"]
                    else:
                        seen.append(ev["version"])
                assert seen == sorted(seen) and len(set(seen)) == len(seen)
                assert len(seen) + missed == 100  # every change: seen, or counted

    run(scenario())


def test_after_a_reconnect_the_iterator_gets_one_resync(run: Run, server: EmbeddedServer
                                                        ) -> None:
    async def scenario() -> None:
        with ChaosProxy((HOST, server.port)) as proxy:
            async with AsyncClient(url(server), timeout=10) as writer, \
                    AsyncClient(HOST, proxy.port, timeout=10) as c:
                async with c.listen("r") as events:
                    await writer.put("r", 1)
                    assert (await events.__anext__())["version"] == 1
                    proxy.pause_accepting()
                    proxy.cut_all()
                    await until(lambda: _true(not c.connected), "the drop")
                    await writer.put("r", 2)
                    await writer.put("r", 3)
                    proxy.resume_accepting()
                    ev = await events.__anext__()
                    assert ev["op"] == "resync" and ev["version"] == 3

    run(scenario())


def test_the_iteration_ends_when_the_client_closes_and_raises_when_it_gave_up(
        run: Run, server: EmbeddedServer) -> None:
    async def scenario() -> None:
        c = await AsyncClient(url(server), timeout=10).connect()
        events = await c.listen("e").start()
        consumer = asyncio.create_task(_drain(events))
        await asyncio.sleep(0.01)
        await c.aclose()
        assert await consumer == []
        with ChaosProxy((HOST, server.port)) as proxy:
            async with AsyncClient(HOST, proxy.port, timeout=10, reconnect=False) as c2:
                events = await c2.listen("e").start()
                consumer = asyncio.create_task(_drain(events))
                await asyncio.sleep(0.01)
                proxy.cut_all()
                with pytest.raises(ConnectionLost):
                    await consumer

    run(scenario())


async def _drain(events: ListenEvents) -> list[dict[str, Any]]:
    return [e async for e in events]
