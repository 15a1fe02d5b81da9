"""Many bins: what an op costs, and what an idle server burns, at 100 and at 5,000 streams.

A server that keeps thousands of stream bins (or service bins) must not slow down with them:
an op looks at the bins it concerns, and the periodic work (leases, stalls, expiries) looks
only at the bins whose deadline came. This measures, for each number of streams:

* **opens/s**: ``stream_open`` of new streams (each a producer of one client), over the
  last 200 opens that brought the server to that many streams;
* **puts/s**: tiny ``put``s (a 4-byte tensor) once that many streams exist: every write
  checks the server's memory limit, which counts what every stream holds;
* **idle CPU**: the server process's CPU time (``/proc/PID/stat``, user + system) over
  ``--idle`` seconds in which nothing happens but the client's heartbeats, as a share of
  one core. The producers' leases (10 s) end in that time, so every stream's lease is
  checked once;
* **kept**: the streams still listed after that (a server too busy to answer its
  client's heartbeats loses its producers, and their streams with them).

and the same puts/s with ``--services`` idle service bins (a host that took from each once).

Each server is a ``tensorshare serve`` process of its own; with ``--baseline TREE`` (a
checkout of another commit, say ``git worktree add /tmp/old main``) the same rows run against
a server from that tree first, side by side, so that the ratio is what the change did. The
client is always this tree's (the wire is the same).

Usage::

    python benchmarks/scale.py                           # this tree: about 40 s
    python benchmarks/scale.py --baseline /tmp/old       # both, about 2 minutes
    python benchmarks/scale.py --streams 100,2000,5000 --idle 12

Exit status 0 whatever the numbers (nothing is asserted); non-zero if a server failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tensorshare import Client, WaitTimeout  # noqa: E402

TIMED_OPENS = 200
PUTS = 500


@contextmanager
def serve(tree: Path) -> Iterator[tuple[int, int]]:
    """A ``tensorshare serve`` process from ``tree``: (pid, port)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen([sys.executable, "-m", "tensorshare", "serve", "--port", "0",
                             "-q"], stdout=subprocess.PIPE, text=True, env=env, cwd=tree)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"the server of {tree} did not start: {line!r}")
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # (drain)
        yield proc.pid, int(line.split()[-1].rsplit(":", 1)[1])
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid``, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def puts_per_s(c: Client) -> float:
    x = torch.zeros(1)
    t0 = time.perf_counter()
    for _ in range(PUTS):
        c.put("tiny", x)
    return PUTS / (time.perf_counter() - t0)


def stream_row(tree: Path, n: int, idle: float) -> tuple[float, float, float, int]:
    """(opens/s, puts/s, idle CPU %, streams still there after the idle time) of a server
    from ``tree`` with ``n`` streams."""
    with serve(tree) as (pid, port), Client("127.0.0.1", port, timeout=60) as c:
        timed = min(TIMED_OPENS, n)
        for i in range(n - timed):
            c.stream_open(f"s{i}", lease=10.0)
        t0 = time.perf_counter()
        for i in range(n - timed, n):
            c.stream_open(f"s{i}", lease=10.0)
        opens = timed / (time.perf_counter() - t0)
        puts = puts_per_s(c)
        before, t0 = cpu_seconds(pid), time.monotonic()
        threading.Event().wait(idle)  # (idle: only the client's heartbeats)
        busy = (cpu_seconds(pid) - before) / (time.monotonic() - t0)
        kept = len(c.stats("s*")["bins"])
    return opens, puts, 100 * busy, kept


def service_row(tree: Path, n: int) -> float:
    """Puts/s of a server from ``tree`` that lists ``n`` idle services."""
    with serve(tree) as (_, port), Client("127.0.0.1", port, timeout=60) as c:
        for i in range(n):  # one take each, answered at once: the service stays listed
            try:
                c.service_take(f"svc{i}", timeout=0)
            except WaitTimeout:  # (nothing queued, as meant)
                pass
        return puts_per_s(c)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, help="a tree of another commit to run first")
    p.add_argument("--streams", default="100,5000", help="numbers of streams, comma-separated")
    p.add_argument("--services", type=int, default=1000, help="idle services (0: no row)")
    p.add_argument("--idle", type=float, default=12.0, help="seconds of idle measured")
    args = p.parse_args(argv)
    counts = [int(x) for x in args.streams.split(",")]
    trees = ([("baseline", args.baseline.resolve())] if args.baseline else []) + \
        [("this tree", ROOT)]
    load = os.getloadavg()[0]
    print(f"tensorshare scale benchmark: {os.cpu_count()} cores, load average {load:.1f}; "
          f"idle measured over {args.idle:g} s")
    for label, tree in trees:
        print(f"  {label}: {tree}")
    print(f"{'server':12s}{'streams':>9s}{'opens/s':>10s}{'puts/s':>9s}{'idle CPU':>10s}"
          f"{'kept':>7s}")
    rows: dict[tuple[str, int], tuple[float, float, float, int]] = {}
    for label, tree in trees:
        for n in counts:
            rows[label, n] = r = stream_row(tree, n, args.idle)
            print(f"{label:12s}{n:>9d}{r[0]:>10.0f}{r[1]:>9.0f}{r[2]:>9.1f}%{r[3]:>7d}",
                  flush=True)
    if args.services:
        print(f"{'server':12s}{'services':>9s}{'':>10s}{'puts/s':>9s}")
        for label, tree in trees:
            print(f"{label:12s}{args.services:>9d}{'':>10s}{service_row(tree, args.services):>9.0f}",
                  flush=True)
    if args.baseline and len(counts) > 1:
        lo, hi = counts[0], counts[-1]
        for label, _ in trees:
            (o1, p1, *_), (o2, p2, *_) = rows[label, lo], rows[label, hi]
            print(f"{label}: opens/s at {hi} streams = {o2 / o1:.2f} x at {lo}; "
                  f"puts/s = {p2 / p1:.2f} x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
