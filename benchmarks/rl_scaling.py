"""Distributed RL scaling: environment steps per second and time to target, by worker count.

Runs :func:`tensorshare.demo.train` (asynchronous workers, a trainer that learns from a fixed
amount of experience per update, segments up to 4 versions old used with importance weights)
with 1, 2, 4, ... worker processes, up to the number of CPUs this process may use, each with
several seeds, and prints one row per worker count::

    python benchmarks/rl_scaling.py                      # Acrobot-v1, 3 seeds, 1..CPUs workers
    python benchmarks/rl_scaling.py --seeds 5 --workers 1,2,4,8
    python benchmarks/rl_scaling.py --env CartPole-v1    # a task where the trainer sets the pace

Each run starts its workers, waits until they are connected, then starts the clock with the
first publish and stops it when the average return of the last 100 episodes reaches the
target. ``steps/s`` counts the environment steps the trainer received and learned from in that
time (segments dropped as too stale are not counted; the ``dropped`` column says how many
there were). Medians over the seeds, with each seed's value in brackets; the speedups are the
ratios of the medians to the 1-worker row of the same invocation. Seeds run in turn, worker
counts in alternating order within each seed, so that slow drift on a shared machine spreads
over all rows. The load average is printed before and after: a busy machine shows up there.

Needs Gymnasium (``pip install -e ".[rl]"``) for the default environment. Goals (printed, never
asserted): 2 workers at least 1.6x the steps/s of 1 worker with a shorter median time to target
on 2 cores; 8 workers at least 5x on 16.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tensorshare.rl.demo import ENVS_PER_WORKER, train
from tensorshare.rl.envs import DEFAULT_GYM_ENV, env_spec
from tensorshare.rl.learner import SEGMENT_STEPS


@dataclass
class Run:
    """One training run."""

    workers: int
    seed: int
    solved: bool
    seconds: float
    steps_per_second: float
    dropped: int
    segments: int


def _cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _default_workers(n_cpus: int) -> list[int]:
    counts, n = [], 1
    while n <= n_cpus:
        counts.append(n)
        n *= 2
    return counts


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def _fmt_time(run: Run) -> str:
    return f"{run.seconds:.1f}" if run.solved else f">{run.seconds:.0f}"


def _table(runs: Sequence[Run], counts: Sequence[int]) -> list[str]:
    rows = []
    base_rate = base_time = math.nan
    header = (f"{'workers':>7}  {'steps/s: median (per seed)':<44}{'speedup':>8}   "
              f"{'time to target: median (per seed)':<40}{'speedup':>8}  {'dropped':>8}")
    rows.append(header)
    for n in counts:
        mine = [r for r in runs if r.workers == n]
        if not mine:
            continue
        rate = _median([r.steps_per_second for r in mine])
        # An unsolved run counts as infinitely slow, so it can only push the median up.
        seconds = _median([r.seconds if r.solved else math.inf for r in mine])
        if n == counts[0]:
            base_rate, base_time = rate, seconds
        rates = " ".join(f"{r.steps_per_second:,.0f}" for r in mine)
        times = " ".join(_fmt_time(r) for r in mine)
        dropped = sum(r.dropped for r in mine) / max(sum(r.segments for r in mine), 1)
        time_speedup = base_time / seconds if math.isfinite(seconds) else 0.0
        rows.append(f"{n:>7}  {f'{rate:,.0f} ({rates})':<44}{rate / base_rate:>7.2f}x   "
                    f"{f'{seconds:.1f} s ({times})':<40}{time_speedup:>7.2f}x  "
                    f"{dropped:>7.1%}")
    return rows


def _goals(runs: Sequence[Run], n_cpus: int) -> list[str]:
    def rate(n: int) -> float:
        return _median([r.steps_per_second for r in runs if r.workers == n])

    def seconds(n: int) -> float:
        return _median([r.seconds if r.solved else math.inf for r in runs if r.workers == n])

    lines = []
    have = {r.workers for r in runs}
    if {1, 2} <= have:
        ratio = rate(2) / rate(1)
        faster = seconds(2) < seconds(1)
        met = ratio >= 1.6 and faster
        lines.append(f"goal (2 cores): 2 workers >= 1.6x the steps/s of 1 and a shorter median "
                     f"time to target: {ratio:.2f}x, {seconds(2):.1f} s vs {seconds(1):.1f} s: "
                     f"{'met' if met else 'NOT met'}")
    if {1, 8} <= have:
        ratio = rate(8) / rate(1)
        lines.append(f"goal (16 cores): 8 workers >= 5x the steps/s of 1: {ratio:.2f}x: "
                     f"{'met' if ratio >= 5 else 'NOT met'}"
                     + ("" if n_cpus >= 16 else f" (only {n_cpus} CPUs here)"))
    return lines


@contextlib.contextmanager
def _server_process(wanted: bool) -> Iterator[str | None]:
    """``HOST:PORT`` of a ``tensorshare serve`` process for the whole benchmark, or None."""
    if not wanted:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-m", "tensorshare", "serve", "--port", "0", "-q"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "tensorshare X listening on HOST:PORT"
        if "listening on " not in line:
            raise RuntimeError(f"tensorshare serve did not start: {line!r}")
        yield line.rsplit("listening on ", 1)[1].split()[0]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _run(workers: int, seed: int, target: float, max_seconds: float, env: str,
         server: str | None, cpus: Sequence[int] | None) -> Run:
    res = train(workers, target, max_seconds, seed, env=env, server=server, cpus=cpus,
                progress_every=math.inf, out=io.StringIO())
    segments = res.samples // (SEGMENT_STEPS * ENVS_PER_WORKER) + res.dropped
    print(f"  seed {seed}, {workers} workers: {res.steps_per_second:,.0f} steps/s, "
          f"{'solved' if res.solved else 'NOT solved'} in {res.seconds:.1f} s "
          f"(+{res.startup_seconds:.1f} s start-up), {res.dropped} dropped",
          file=sys.stderr, flush=True)
    return Run(workers, seed, res.solved, res.seconds, res.steps_per_second, res.dropped,
               segments)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the table. Returns 0 unless a run crashed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", default=DEFAULT_GYM_ENV, help=f"default {DEFAULT_GYM_ENV}")
    p.add_argument("--workers", default=None,
                   help="comma-separated worker counts (default 1, 2, 4, ... up to the CPUs)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per worker count (default 3)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--target", type=float, default=None,
                   help="average return to reach (default: the environment's)")
    p.add_argument("--max-seconds", type=float, default=120.0,
                   help="a run that has not reached the target by then counts as unsolved")
    p.add_argument("--pin", action="store_true",
                   help="pin worker i to CPU i mod CPUs (the trainer is not pinned)")
    p.add_argument("--server-process", action="store_true",
                   help="run the server as its own process (tensorshare serve) instead of in "
                        "the trainer's: on many cores the trainer then only learns")
    args = p.parse_args(argv)
    cpus = _cpus()
    counts = ([int(x) for x in args.workers.split(",")] if args.workers
              else _default_workers(len(cpus)))
    if not counts or min(counts) < 1:
        p.error("--workers: positive counts, e.g. 1,2,4")
    counts = sorted(set(counts))
    spec = env_spec(args.env)
    target = spec.target if args.target is None else args.target
    load_before = os.getloadavg()
    print(f"{spec.name}, target {target:g}, {args.seeds} seeds per row, {len(cpus)} CPUs, "
          f"workers pinned: {'yes' if args.pin else 'no'}, server "
          f"{'in its own process' if args.server_process else 'in the trainer'}; load average "
          f"before {load_before[0]:.2f}", flush=True)
    runs: list[Run] = []
    started = time.monotonic()
    with _server_process(args.server_process) as server:
        for i, seed in enumerate(range(args.first_seed, args.first_seed + args.seeds)):
            order = counts if i % 2 == 0 else counts[::-1]
            for n in order:
                runs.append(_run(n, seed, target, args.max_seconds, spec.name, server,
                                 cpus if args.pin else None))
    load_after = os.getloadavg()
    print()
    for line in _table(runs, counts):
        print(line)
    print()
    for line in _goals(runs, len(cpus)):
        print(line)
    print(f"load average after {load_after[0]:.2f}; {time.monotonic() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
