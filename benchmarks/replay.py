"""The replay benchmark (issue 38): a replay bin over the wire against an in-process buffer.

A server process (``python -m tensorshare serve``) on a free port holds one replay bin
(``sampler="prioritized"``, no rate limiter). In the same run:

* **inserts/s** of 1 KiB transitions (a dict of an observation of 240 float32, an action, a
  reward and a done flag) by ``insert_many`` batches of ``--insert-batch`` from 1 and from
  ``--actors`` actor processes at once, each inserting for ``--seconds``;
* from one learner on a bin of ``--size`` items: prioritized ``sample(--batch)`` batches/s and
  its p50 latency, and ``update_priorities(--batch)`` p50;
* the baseline: ``benchmarks/replay_baseline.py``'s ``PlainPrioritizedBuffer`` (a sum tree in
  numpy, in this process, nothing on the wire) filled to ``--size`` and timed the same way.

Goals (the issue's): sample(256) over the wire at least 0.5x the in-process rate; 16 actors at
least 200,000 transitions/s together; update_priorities(256) under 1 ms p50. The exit status
is 0 whatever the numbers.

    python benchmarks/replay.py                # 1M items, 16 actors (about 1.2 GiB in the server)
    python benchmarks/replay.py --quick        # 100k items, 4 actors
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from replay_baseline import PlainPrioritizedBuffer, timed  # noqa: E402

from tensorshare import Client  # noqa: E402
from tensorshare.rl import ReplayBuffer  # noqa: E402

NAME = "bench/replay"


def transition(i: int) -> dict[str, torch.Tensor]:
    """About 1 KiB: 240 float32 of observation and three scalars."""
    return {"obs": torch.full((240,), float(i)), "action": torch.tensor(i % 4),
            "reward": torch.tensor(1.0), "done": torch.tensor(0.0)}


def actor(port: int, seconds: float, batch: int) -> int:
    """Insert for ``seconds``; print how many transitions went in."""
    items = [transition(i) for i in range(batch)]
    prios = torch.rand(batch) + 0.01
    n = 0
    with Client("127.0.0.1", port, timeout=60.0) as c:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            c.replay_insert(NAME, items, prios)
            n += batch
    print(n)
    return 0


def serve(port: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "tensorshare", "serve", "--port", str(port),
                             "--quiet"], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise SystemExit(f"the server did not start: {line}")
    return proc


def inserts_per_s(port: int, actors: int, seconds: float, batch: int) -> float:
    procs = [subprocess.Popen([sys.executable, __file__, "actor", str(port), str(seconds),
                               str(batch)], stdout=subprocess.PIPE, text=True)
             for _ in range(actors)]
    total = sum(int(p.communicate(timeout=seconds + 120)[0].split()[-1]) for p in procs)
    return total / seconds


def wire_rates(port: int, size: int, batch: int, repeat: int) -> dict[str, list[float]]:
    with ReplayBuffer(NAME, "127.0.0.1", port, max_size=size, timeout=120.0) as buf:
        items = [transition(i) for i in range(256)]
        while len(buf) < size:
            buf.insert_many(items, torch.rand(256) + 0.01)
        buf.sample(batch)
        samples = timed(lambda: buf.sample(batch), repeat)
        keys = buf.sample(batch).keys
        prios = torch.rand(batch) + 0.01
        updates = timed(lambda: buf.update_priorities(keys, prios), repeat)
    return {"sample": samples, "update": updates}


def baseline(size: int, batch: int, repeat: int) -> list[float]:
    plain = PlainPrioritizedBuffer(size)
    item = transition(0)
    for _ in range(size // 256):
        plain.insert([item] * 256, (torch.rand(256) + 0.01).tolist())
    return timed(lambda: plain.sample(batch), repeat)


def report(args: argparse.Namespace, ins: dict[int, float], wire: dict[str, list[float]],
           base: list[float]) -> None:
    print(f"{args.size:,} items of ~1 KiB, batch {args.batch}, insert_many({args.insert_batch})")
    for actors, rate in ins.items():
        goal = "  (goal 200,000/s with 16)" if actors == 16 else ""
        print(f"inserts/s, {actors:2d} actor(s): {rate:12,.0f}{goal}")
    s, u = wire["sample"], wire["update"]
    print(f"wire sample({args.batch}):        {len(s) / sum(s):10,.1f} /s   "
          f"p50 {1e3 * statistics.median(s):7.3f} ms")
    print(f"wire update_priorities({args.batch}): p50 {1e3 * statistics.median(u):7.3f} ms "
          f"(goal < 1 ms)")
    print(f"in-process sample({args.batch}):  {len(base) / sum(base):10,.1f} /s   "
          f"p50 {1e3 * statistics.median(base):7.3f} ms")
    print(f"wire / in-process sample rate: x{statistics.median(base) / statistics.median(s):.2f}"
          f" (goal >= 0.5)")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["actor"]:
        return actor(int(argv[1]), float(argv[2]), int(argv[3]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--insert-batch", type=int, default=64)
    p.add_argument("--actors", type=int, default=16)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--repeat", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="100k items, 4 actors, 50 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.actors, args.repeat = 100_000, 4, 50
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = serve(port)
    try:
        with ReplayBuffer(NAME, "127.0.0.1", port, max_size=args.size):
            pass
        ins = {n: inserts_per_s(port, n, args.seconds, args.insert_batch)
               for n in sorted({1, args.actors})}
        wire = wire_rates(port, args.size, args.batch, args.repeat)
    finally:
        server.kill()
        server.wait(30)
    report(args, ins, wire, baseline(args.size, args.batch, args.repeat))
    return 0


if __name__ == "__main__":
    sys.exit(main())
