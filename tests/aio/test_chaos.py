"""Chaos tests of the asyncio face: cancellations injected at random moments, and a
connection cut again and again under 64 tasks in flight. Every item is read exactly once by
someone; none is lost.

Each run prints its seed in assertion messages; ``TENSORSHARE_CHAOS_SEED=<seed>`` replays
the same choices (the loop's interleaving still varies with the machine's timing)."""

from __future__ import annotations

import asyncio
import collections
import random
from typing import Any

import pytest
import torch

from tensorshare import BinNotFound, EmbeddedServer, WaitTimeout
from tensorshare.aio import AsyncClient
from tests.aio.conftest import Run
from tests.chaos import HOST, ChaosProxy, Faults, chaos_seed

BIN = "q"


@pytest.fixture
def seed() -> int:
    return chaos_seed()


class CancellingClient(AsyncClient):
    """Injects cancellations where they hurt most: right after a get's reply came, before
    the task awaiting it resumed, it cancels a waiting consumer (often that one). Counts
    the cancellations that found their reply already in (a get undone)."""

    def __init__(self, *args: Any, rng: random.Random, rate: float, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.rng, self.rate = rng, rate
        self.consumers: list[asyncio.Task[Any]] = []
        self.raced = 0

    def _finish(self, ev: Any) -> None:
        super()._finish(ev)
        if ev.call.op == "get" and self.consumers and self.rng.random() < self.rate:
            self.rng.choice(self.consumers).cancel()

    def _cancelled(self, call: Any, fut: asyncio.Future[Any]) -> None:
        if fut.done() and not fut.cancelled() and call.id in self._session.held:
            self.raced += 1
        super()._cancelled(call, fut)


def duplicates(delivered: list[int]) -> dict[int, int]:
    return {item: n for item, n in collections.Counter(delivered).items() if n > 1}


async def _consume(c: AsyncClient, rng: random.Random, delivered: list[int]) -> None:
    while True:
        batch = await c.get(BIN, max_items=rng.randint(1, 6), timeout=None)
        delivered.extend(int(t) for t in batch)


async def _cancelling(c: CancellingClient, n: int, rng: random.Random, consumers: int,
                      delivered: list[int]) -> int:
    """Consumers that get until ``n`` items came, cancelled at random moments (waiting, or
    injected right after a reply) and started again; returns how many were cancelled."""
    def start() -> asyncio.Task[Any]:
        return asyncio.create_task(_consume(c, random.Random(rng.random()), delivered))

    c.consumers = [start() for _ in range(consumers)]
    cancelled = 0
    while len(delivered) < n:
        await asyncio.sleep(rng.uniform(0.0, 0.004))
        if rng.random() < 0.5:
            rng.choice(c.consumers).cancel()  # a wait withdrawn (or a reply just in)
        for i, task in enumerate(c.consumers):
            if task.done():
                assert task.cancelled(), task.exception()
                cancelled += 1
                c.consumers[i] = start()
    for task in c.consumers:
        task.cancel()
    await asyncio.gather(*c.consumers, return_exceptions=True)
    return cancelled


def test_cancelling_waiting_gets_at_random_moments_never_loses_or_doubles_an_item(
        run: Run, server: EmbeddedServer, seed: int) -> None:
    n = 4000
    rng = random.Random(seed)

    async def scenario() -> tuple[list[int], int, int, Any]:
        delivered: list[int] = []
        async with AsyncClient(f"tensorshare://{HOST}:{server.port}", timeout=20) as producer, \
                CancellingClient(HOST, server.port, timeout=20, rng=rng, rate=0.3) as c:
            async def produce() -> None:
                for start in range(0, n, 50):
                    async with producer.pipeline() as p:
                        for i in range(start, min(start + 50, n)):
                            p.append(BIN, torch.tensor(i))
                    await asyncio.sleep(rng.uniform(0.0, 0.003))

            feeding = asyncio.create_task(produce())
            cancelled = await _cancelling(c, n, rng, 4, delivered)
            await feeding
            while c._session.held:  # the last cancels' replies
                await asyncio.sleep(0.005)
            try:
                left = await c.peek(BIN)
            except BinNotFound:
                left = None
            return delivered, cancelled, c.raced, left

    delivered, cancelled, raced, left = run(scenario())
    info = f"seed={seed} cancelled={cancelled} raced={raced} delivered={len(delivered)}"
    assert not duplicates(delivered), f"{info}: read twice: {sorted(duplicates(delivered))[:20]}"
    assert sorted(delivered) == list(range(n)), \
        f"{info}: never read: {sorted(set(range(n)) - set(delivered))[:20]}"
    assert left is None, f"{info}: left in the bin: {left}"
    assert cancelled >= 200, info  # the cancellations did happen, many of them
    assert raced >= 1, info  # some reached a get whose reply was already in (undone)


def test_a_connection_cut_again_and_again_under_64_tasks_loses_and_doubles_nothing(
        run: Run, server: EmbeddedServer, seed: int) -> None:
    n_producers, n_consumers, n = 48, 16, 2400

    async def scenario(proxy: ChaosProxy) -> tuple[list[int], list[int], list[str]]:
        acked: list[int] = []
        delivered: list[int] = []
        errors: list[str] = []
        done = asyncio.Event()
        async with AsyncClient(HOST, proxy.port, timeout=30) as c:
            proxy.set_faults(Faults(cut_after_bytes=(2_000, 40_000),
                                    cut_after_seconds=(0.3, 1.5), reset_probability=0.5,
                                    half_open_probability=0.2, chunk_bytes=(1, 4096)))

            async def produce(p: int) -> None:
                for item in range(p, n, n_producers):
                    try:
                        await c.append(BIN, torch.tensor([p, item]))
                        acked.append(item)
                    except Exception as exc:
                        errors.append(f"producer {p}: append of {item} raised {exc!r}")

            async def consume(k: int) -> None:
                while True:
                    finished = done.is_set()
                    try:
                        batch = await c.get(BIN, max_items=16, timeout=0.25)
                    except WaitTimeout:
                        if finished:
                            return
                        continue
                    except Exception as exc:
                        errors.append(f"consumer {k}: get raised {exc!r}")
                        continue
                    for t in batch:
                        p, item = (int(x) for x in t.tolist())
                        if item % n_producers != p:
                            errors.append(f"consumer {k}: corrupt item {t!r}")
                        delivered.append(item)

            consumers = [asyncio.create_task(consume(k)) for k in range(n_consumers)]
            await asyncio.gather(*[produce(p) for p in range(n_producers)])
            done.set()
            await asyncio.gather(*consumers)
            proxy.set_faults(Faults())
        return acked, delivered, errors

    with ChaosProxy((HOST, server.port), seed=seed) as proxy:
        acked, delivered, errors = run(scenario(proxy))
        stats, info = proxy.stats(), f"seed={seed} {proxy.describe()}"
    assert not errors, f"{info}: {errors[:10]}"
    assert sorted(acked) == list(range(n)), info
    assert not duplicates(delivered), f"{info}: read twice: {sorted(duplicates(delivered))[:20]}"
    assert sorted(delivered) == list(range(n)), \
        f"{info}: never read: {sorted(set(range(n)) - set(delivered))[:20]}"
    assert stats["accepted"] >= 5 and stats["cuts"] >= 4, info  # cut, and back, many times
    assert stats["mid_stream"] >= 1, info
