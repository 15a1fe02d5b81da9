"""The asyncio face (``tensorshare.aio.AsyncClient``) against ``redis.asyncio`` and against
the blocking client, in the same run.

Run ``python benchmarks/bench_aio.py`` (about two minutes; ``--quick``: under one). The
servers run as separate processes pinned to core 0 (``bench.py``'s ``Children``), this
process on core 1; every row alternates the systems it compares, repeat after repeat, and
takes the median of the repeats' rates. Rows:

* tiny put+get, one task: a 4-byte tensor put then got (two ops) by one task, on asyncio's
  loop and on uvloop's, against ``redis.asyncio`` with hiredis doing SET then GETDEL on the
  same loop (when ``redis-server`` is on ``PATH`` and redis-py and hiredis are installed).
  Goal: at least 1.2x ``redis.asyncio``.
* tiny put+get, 64 tasks: 64 tasks doing the same at once on one client (``redis.asyncio``:
  its connection pool, as it is used), against the blocking client's pipelined rate (a
  pipeline of 64 puts, then one of 64 gets). Goal: at least 0.8x the blocking pipeline.
* CPU per request: this process's CPU time (``/proc/self/stat``, every thread) per op of the
  one-task rows, against the blocking client's for the same ops one at a time. Goal: at
  most the blocking client's.
* 1 MiB and 64 MiB: a float32 tensor put then got, the async client against the blocking
  one. Goal: no slower.

Goals are printed, never asserted; the exit status is 0 unless something crashed or a
tensor came back wrong. The machine's other load moves absolute numbers a lot: read the
ratios, which are measured side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench import (  # noqa: E402
    CLIENT_CORE,
    Children,
    launch_tensorshare,
    redis_unavailable,
    redis_versions,
    start_redis,
)

from tensorshare import Client  # noqa: E402
from tensorshare.aio import AsyncClient  # noqa: E402

TASKS = 64


def cpu_seconds() -> float:
    """This process's CPU time (user + system, every thread) from ``/proc/self/stat``."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop  # type: ignore[no-any-return]
    return None


class Measure:
    """Rates (ops/s) and CPU per op of named systems, repeat after repeat."""

    def __init__(self) -> None:
        self.rates: dict[str, list[float]] = {}
        self.cpu: dict[str, list[float]] = {}

    def add(self, name: str, ops: int, seconds: float, cpu: float) -> None:
        self.rates.setdefault(name, []).append(ops / seconds)
        self.cpu.setdefault(name, []).append(cpu / ops)

    def rate(self, name: str) -> float:
        return statistics.median(self.rates[name])

    def cpu_us(self, name: str) -> float:
        return statistics.median(self.cpu[name]) * 1e6


async def timed(m: Measure, name: str, ops: int, body: Callable[[], Awaitable[None]]) -> None:
    c0, t0 = cpu_seconds(), time.perf_counter()
    await body()
    m.add(name, ops, time.perf_counter() - t0, cpu_seconds() - c0)


def blocking_timed(m: Measure, name: str, ops: int, body: Callable[[], None]) -> None:
    c0, t0 = cpu_seconds(), time.perf_counter()
    body()
    m.add(name, ops, time.perf_counter() - t0, cpu_seconds() - c0)


async def tiny_async(m: Measure, kind: str, port: int, redis_port: int | None, n: int,
                     repeats: int) -> None:
    """One task, then 64, on one loop: tensorshare's async client and redis.asyncio."""
    value = torch.zeros(1, dtype=torch.float32)
    payload = b"\x00" * 4
    rcli: Any = None
    if redis_port is not None:
        import redis.asyncio as aioredis

        rcli = aioredis.Redis(host="127.0.0.1", port=redis_port, max_connections=TASKS)
    async with AsyncClient(f"tensorshare://127.0.0.1:{port}", timeout=30) as c:
        async def ts_one() -> None:
            for _ in range(n):
                await c.put("t", value)
                await c.get("t")

        async def ts_task(k: int, count: int) -> None:
            for _ in range(count):
                await c.put(f"t{k}", value)
                await c.get(f"t{k}")

        async def rd_one() -> None:
            for _ in range(n):
                await rcli.set("t", payload)
                await rcli.getdel("t")

        async def rd_task(k: int, count: int) -> None:
            for _ in range(count):
                await rcli.set(f"t{k}", payload)
                await rcli.getdel(f"t{k}")

        per = max(n // TASKS, 4)
        await ts_one()  # warm up
        if rcli is not None:
            await rd_one()
            await asyncio.gather(*[rd_task(k, per) for k in range(TASKS)])
        for _ in range(repeats):
            await timed(m, f"aio-{kind} 1 task", 2 * n, ts_one)
            if rcli is not None:
                await timed(m, f"redis.asyncio-{kind} 1 task", 2 * n, rd_one)
            await timed(m, f"aio-{kind} 64 tasks", 2 * per * TASKS,
                        lambda: _gather(ts_task, per))
            if rcli is not None:
                await timed(m, f"redis.asyncio-{kind} 64 tasks", 2 * per * TASKS,
                            lambda: _gather(rd_task, per))
    if rcli is not None:
        await rcli.aclose()


async def _gather(task: Callable[[int, int], Awaitable[None]], per: int) -> None:
    await asyncio.gather(*[task(k, per) for k in range(TASKS)])


def tiny_blocking(m: Measure, port: int, n: int, repeats: int) -> None:
    value = torch.zeros(1, dtype=torch.float32)
    with Client("127.0.0.1", port, timeout=30) as c:
        def one() -> None:
            for _ in range(n):
                c.put("t", value)
                c.get("t")

        def piped() -> None:
            for _ in range(max(n // TASKS, 4)):
                with c.pipeline() as p:
                    for k in range(TASKS):
                        p.put(f"t{k}", value)
                with c.pipeline() as p:
                    for k in range(TASKS):
                        p.get(f"t{k}")

        one()
        for _ in range(repeats):
            blocking_timed(m, "blocking 1 at a time", 2 * n, one)
            blocking_timed(m, "blocking pipelined", 2 * max(n // TASKS, 4) * TASKS, piped)


def large(m: Measure, port: int, kind: str, nbytes: int, repeats: int) -> None:
    """Put then get of one float32 tensor of ``nbytes``: async (on ``kind``) vs blocking."""
    t = torch.randn(nbytes // 4)
    label = f"{nbytes >> 20} MiB"

    async def one_async(c: AsyncClient) -> None:
        await c.put("big", t)
        got = await c.get("big")
        if not torch.equal(got, t):
            raise SystemExit("a tensor came back wrong (async client)")

    with Client("127.0.0.1", port, timeout=60) as b:
        def one_blocking() -> None:
            b.put("big", t)
            if not torch.equal(b.get("big"), t):
                raise SystemExit("a tensor came back wrong (blocking client)")

        one_blocking()
        with asyncio.Runner(loop_factory=loop_factory(kind)) as runner:
            for _ in range(repeats):
                runner.run(run_async_once(m, port, kind, label, one_async))
                blocking_timed(m, f"blocking {label}", 2, one_blocking)


async def run_async_once(m: Measure, port: int, kind: str, label: str,
                         one: Callable[[AsyncClient], Awaitable[None]]) -> None:
    async with AsyncClient(f"tensorshare://127.0.0.1:{port}", timeout=60) as c:
        await one(c)  # (a fresh connection each repeat, as the blocking client's is warm)
        await timed(m, f"aio-{kind} {label}", 2, lambda: one(c))


def report(m: Measure, kinds: list[str], have_redis: bool, sizes: list[int]) -> None:
    def ratio(a: str, b: str) -> float:
        return m.rate(a) / m.rate(b)

    print(f"\n{'row':<34}{'ops/s':>12}{'CPU µs/op':>12}")
    for name in m.rates:
        print(f"{name:<34}{m.rate(name):>12,.0f}{m.cpu_us(name):>12.1f}")
    print("\nratios (goal in brackets; printed, never asserted):")
    for kind in kinds:
        if have_redis:
            print(f"  one task, {kind}: aio / redis.asyncio = "
                  f"{ratio(f'aio-{kind} 1 task', f'redis.asyncio-{kind} 1 task'):.2f}x [>= 1.2]")
            print(f"  64 tasks, {kind}: aio / redis.asyncio = "
                  f"{ratio(f'aio-{kind} 64 tasks', f'redis.asyncio-{kind} 64 tasks'):.2f}x")
        print(f"  64 tasks, {kind}: aio / blocking pipelined = "
              f"{ratio(f'aio-{kind} 64 tasks', 'blocking pipelined'):.2f}x [>= 0.8]")
        cpu = m.cpu_us(f"aio-{kind} 1 task") / m.cpu_us("blocking 1 at a time")
        print(f"  CPU per request, {kind}: aio / blocking = {cpu:.2f}x [<= 1.0]")
        for nbytes in sizes:
            label = f"{nbytes >> 20} MiB"
            print(f"  {label} put+get, {kind}: aio / blocking = "
                  f"{ratio(f'aio-{kind} {label}', f'blocking {label}'):.2f}x [>= 1.0]")
    if not have_redis:
        print(f"  redis rows skipped: {redis_unavailable()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer ops and repeats")
    args = ap.parse_args()
    n, repeats = (1000, 3) if args.quick else (4000, 7)
    large_repeats = 3 if args.quick else 7
    sizes = [1 << 20, 64 << 20]
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {CLIENT_CORE})
    kinds = ["asyncio"]
    try:
        import uvloop  # noqa: F401

        kinds.append("uvloop")
    except ImportError:
        print("uvloop not installed: asyncio's loop only (pip install uvloop)")
    children = Children()
    try:
        ts = launch_tensorshare(children)()
        have_redis = redis_unavailable() is None
        with tempfile.TemporaryDirectory(prefix="bench-aio-") as workdir:
            redis_port = start_redis(children, workdir).port if have_redis else None
            if have_redis:
                print(redis_versions())
            m = Measure()
            for kind in kinds:
                with asyncio.Runner(loop_factory=loop_factory(kind)) as runner:
                    runner.run(tiny_async(m, kind, ts.port, redis_port, n, repeats))
            tiny_blocking(m, ts.port, n, repeats)
            for kind in kinds:
                for nbytes in sizes:
                    large(m, ts.port, kind, nbytes, large_repeats)
            report(m, kinds, have_redis, sizes)
    finally:
        children.close()


if __name__ == "__main__":
    main()
