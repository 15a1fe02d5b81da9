"""Replication: what a replica costs its primary, how far it lags, and how long a failover takes.

Runs ``tensorshare serve`` processes on this machine (the primary pinned to core 0, its
replica to core 1 where there are two, the client on the last core: on two cores the
replica and the client share one) and measures:

* write throughput (tiny appends, 1 MiB puts, 64 MiB puts) with no replica, one asynchronous
  replica, and one synchronous replica (``--min-replicas 1``), as ratios of the first, with
  the CPU each write cost the primary, the replica and the client (``/proc``: what a busy
  machine's wall clock hides), and the full copies the replica took (more than one: it was
  dropped and resynced during the run);
* the replica's lag under that load (``lag_bytes`` and ``lag_s`` sampled from the primary's
  stats while it runs: p50 and p99);
* failover: from the primary's ``kill -9`` to the first acknowledged write on the promoted
  replica (a client with both addresses, ``tensorshare promote`` in between);
* failover under Ray (when Ray is installed; a local two-node cluster): ``start_shards(1,
  replicas=1)``, from ``ray.kill`` of the primary's actor to the first acknowledged write of
  a client of ``shards.client()`` (the keeper notices, promotes, the client follows), with
  ``min_replicas`` 0 and 1 (with 1, the write waits until the dead member, started again as
  the replica, has its full copy). Goal: under 5 s.

    python benchmarks/replication.py            # the full run (a few minutes)
    python benchmarks/replication.py --quick    # a smoke run (seconds)
    python benchmarks/replication.py --no-failover  # the throughput and lag only
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from tensorshare import Client

HOST = "127.0.0.1"


def serve(*args: str, core: int | None = None) -> tuple[subprocess.Popen[str], int]:
    cmd = [sys.executable, "-m", "tensorshare", "serve", "--host", HOST, "--port", "0",
           "--quiet", "--max-memory", "none", *args]
    if core is not None and hasattr(os, "sched_setaffinity") and os.cpu_count():
        cmd = ["taskset", "-c", str(core % (os.cpu_count() or 1)), *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    m = re.search(r"listening on \S+:(\d+)", proc.stdout.readline())
    if m is None:
        proc.kill()
        raise RuntimeError("the server did not start")
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return proc, int(m.group(1))


def writes(c: Client, size: int, n: int) -> float:
    """Writes per second of ``n`` writes of ``size`` bytes (tiny: appends of an int)."""
    import torch

    value: Any = torch.zeros(size, dtype=torch.uint8) if size else 0
    start = time.perf_counter()
    for i in range(n):
        if size:
            c.put(f"bench/{i % 4}", value)
        else:
            c.append("bench/tiny", i)
    return n / (time.perf_counter() - start)


def cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds (user and system) process ``pid`` used so far (``None``: this one)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(c: Client, size: int, n: int, pids: list[int]) -> tuple[float, list[float]]:
    """Writes per second, and the CPU milliseconds per write of each of ``pids`` and of
    this process (the client) while they ran (the replica's until it caught up too)."""
    before = [cpu_seconds(p) for p in pids] + [cpu_seconds()]
    rate = writes(c, size, n)
    client = cpu_seconds()
    deadline = time.monotonic() + 60
    while len(pids) > 1 and time.monotonic() < deadline and any(
            r["lag_bytes"] for r in c.stats()["server"]["replication"]["replicas"]):
        time.sleep(0.01)
    after = [cpu_seconds(p) for p in pids] + [client]
    return rate, [1000 * (b - a) / n for a, b in zip(before, after, strict=True)]


def lag_sampler(c: Client, out: list[tuple[int, float]], stop: threading.Event) -> None:
    while not stop.is_set():
        for r in c.stats()["server"]["replication"].get("replicas", []):
            out.append((r["lag_bytes"], r["lag_s"]))
        stop.wait(0.01)


def run_setup(mode: str, plan: list[tuple[str, int, int]]) -> dict[str, Any]:
    """Rates, CPU per write (primary, replica, client), lag samples and full resyncs."""
    extra = ["--min-replicas", "1"] if mode == "sync" else []
    primary, port = serve(*extra, core=0)
    procs = [primary]
    try:
        if mode != "none":
            procs.append(serve("--replica-of", f"{HOST}:{port}", core=1)[0])
        c = Client(HOST, port, timeout=120)
        probe = Client(HOST, port, timeout=30)
        while mode != "none" and not any(r["live"] for r in
                                         probe.stats()["server"]["replication"]["replicas"]):
            time.sleep(0.05)
        lags: list[tuple[int, float]] = []
        stop = threading.Event()
        sampler = threading.Thread(target=lag_sampler, args=(probe, lags, stop), daemon=True)
        sampler.start()
        pids = [p.pid for p in procs]
        runs = {name: measure(c, size, n, pids) for name, size, n in plan}
        stop.set()
        sampler.join()
        resyncs = probe.stats()["server"]["replication"]["full_resyncs"]
        return {"rates": {k: v[0] for k, v in runs.items()},
                "cpu": {k: v[1] for k, v in runs.items()}, "lags": lags, "resyncs": resyncs}
    finally:
        for p in procs:
            p.kill()
            p.wait()


def failover() -> float:
    primary, port = serve("--min-replicas", "1", core=0)
    replica, rport = serve("--replica-of", f"{HOST}:{port}", core=1)
    try:
        admin = Client(HOST, rport, timeout=30)
        while not admin.stats()["server"]["replication"].get("synced"):
            time.sleep(0.05)
        c = Client(f"tensorshare://{HOST}:{rport},{HOST}:{port}", timeout=30)
        c.append("q", 0)
        start = time.perf_counter()
        os.kill(primary.pid, signal.SIGKILL)
        admin.promote()
        c.append("q", 1)
        return time.perf_counter() - start
    finally:
        for p in (primary, replica):
            p.kill()
            p.wait()


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def ray_failover(min_replicas: int) -> float | None:
    """Seconds from ``ray.kill`` of a replicated shard's primary to the first acknowledged
    write on the promoted replica (``None``: Ray is not installed)."""
    import tempfile

    try:
        import ray
        from ray.cluster_utils import Cluster

        import tensorshare.ray as tsray
    except ImportError:
        return None
    from tensorshare.errors import NotEnoughReplicas

    mb = 1 << 20
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "object_store_memory": 80 * mb, "include_dashboard": False})
    cluster.add_node(num_cpus=2, object_store_memory=80 * mb)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as d, tsray.start_shards(
                1, data_dir=d, replicas=1, min_replicas=min_replicas) as shards, \
                shards.client(timeout=30) as c:
            c.append("q", 0)
            primary = shards.primary_actor(0)
            pid = ray.get(primary.info.remote(), timeout=30)["pid"]
            start = time.perf_counter()
            ray.kill(primary, no_restart=True)
            while process_alive(pid):  # (ray.kill returns at once: a write acknowledged
                time.sleep(0.001)      # before the kill landed would be the old primary's)
            while True:
                try:
                    c.append("q", 1)
                    return time.perf_counter() - start
                except NotEnoughReplicas:  # nothing applied: the new replica is not in sync
                    time.sleep(0.01)
    finally:
        ray.shutdown()
        cluster.shutdown()


def quantile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q * 100) - 1] if len(xs) > 1 else \
        (xs[0] if xs else float("nan"))


def report(results: dict[str, dict[str, Any]], plan: list[tuple[str, int, int]]) -> None:
    """The rates as ratios of no replica, then what each write cost each process."""
    base = results["none"]["rates"]
    print(f"{'writes/s':>10} | " + " | ".join(f"{m:>16}" for m in results))
    for name, _, _ in plan:
        cells = [f"{r['rates'][name]:8.0f} ({r['rates'][name] / base[name]:4.2f}x)"
                 for r in results.values()]
        print(f"{name:>10} | " + " | ".join(f"{c:>16}" for c in cells))
    print("CPU ms per write (primary / replica / client; the replica's until it caught up):")
    for name, _, _ in plan:
        cells = [" / ".join(f"{x:.3f}" for x in r["cpu"][name]).replace(" / ", " / - / ")
                 if len(r["cpu"][name]) == 2 else " / ".join(f"{x:.3f}" for x in r["cpu"][name])
                 for r in results.values()]
        print(f"{name:>10} | " + " | ".join(f"{c:>22}" for c in cells))
    print("full copies taken (1: none after the first): " + ", ".join(
        f"{m} {r['resyncs']}" for m, r in results.items() if m != "none"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run")
    ap.add_argument("--no-failover", action="store_true",
                    help="only the throughput and lag (no failover, no Ray)")
    args = ap.parse_args()
    scale = 20 if args.quick else 1
    plan = [("tiny", 0, 20_000 // scale), ("1 MiB", 1 << 20, 400 // scale),
            ("64 MiB", 64 << 20, max(20 // scale, 2))]
    pin = hasattr(os, "sched_setaffinity") and bool(os.cpu_count())
    cores = os.sched_getaffinity(0) if pin else set()
    if pin:  # the client on the last core (the servers: taskset)
        os.sched_setaffinity(0, {(os.cpu_count() or 1) - 1})
    try:
        results = {mode: run_setup(mode, plan) for mode in ("none", "async", "sync")}
    finally:
        if pin:  # (Ray's processes below inherit it)
            os.sched_setaffinity(0, cores)
    report(results, plan)
    for mode in ("async", "sync"):
        lags = results[mode]["lags"]
        b = [float(x[0]) for x in lags]
        s = [x[1] for x in lags]
        print(f"lag ({mode}): bytes p50 {quantile(b, .5):.0f} p99 {quantile(b, .99):.0f}; "
              f"seconds p50 {quantile(s, .5):.3f} p99 {quantile(s, .99):.3f}")
    if args.no_failover:
        return
    print(f"failover (kill -9 to the first acknowledged write on the promoted replica): "
          f"{failover():.2f} s")
    for n in (0, 1):
        took = ray_failover(n)
        print(f"failover under Ray, min_replicas={n} (ray.kill of the primary's actor to the "
              f"first acknowledged write): " + ("Ray not installed" if took is None
                                                else f"{took:.2f} s"))


if __name__ == "__main__":
    main()
