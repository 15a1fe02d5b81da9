"""The GPU path, measured side by side on one machine (needs CUDA; elsewhere it prints
``skipped: no CUDA ...`` and exits 0)::

    python benchmarks/gpu.py              # about a minute on an H100
    python benchmarks/gpu.py --quick      # fewer repeats

Three tables, each with its baseline in the same run:

1. **Host to device** at 1, 16 and 256 MiB: from pageable memory (a plain CPU tensor), from
   torch's pinned memory (``pin_memory=True``), and from a buffer of tensorshare's pinned pool
   (``cudaHostRegister`` once, then reused), in GB/s.
2. **A read onto the GPU**: ``get(device="cuda")`` against ``get()`` then ``.cuda()``, at 16
   and 256 MiB, over TCP and ``unix://``.
3. **A SharedLoader of 19.3 MB batches to 3 jobs on one GPU** (each job its own process,
   reading as fast as it can), through host memory and through CUDA IPC
   (``serve_loader(..., device_ipc=True)``), per job in GB/s, against tensorsocket's
   measured 2.1 GB/s per job with 3 consumers.

The numbers are printed, never asserted; the exit status is non-zero only if something
crashed or a value came back wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

MiB = 1 << 20
TENSORSOCKET_GBPS = 2.1  # per job, 3 consumers on one GPU (measured; see the issue)
BATCH = (32, 3, 224, 224)  # float32: 19,267,584 bytes


def timed(fn: Callable[[], object], repeat: int) -> float:
    """The median seconds of ``fn`` (after one warm-up), the GPU synchronized around it."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def h2d(repeat: int) -> None:
    from tensorshare.memory.pinned import PinnedPool

    print("\nhost to device, GB/s (median of", repeat, "copies)")
    print(f"{'size':>8} {'pageable':>10} {'pinned':>10} {'pooled':>10} {'pooled/pageable':>16}")
    pool = PinnedPool(limit=1 << 30, background=False)
    for mib in (1, 16, 256):
        n = mib * MiB
        dst = torch.empty(n, dtype=torch.uint8, device="cuda")
        pageable = torch.full((n,), 7, dtype=torch.uint8)
        pinned = torch.full((n,), 7, dtype=torch.uint8).pin_memory()
        part = pool.take(n)
        pool.staged(torch.frombuffer(part, dtype=torch.uint8).data_ptr())
        del part  # pinned on its way back (once); the next take gets it
        part = pool.take(n)
        pooled = torch.frombuffer(part, dtype=torch.uint8)
        assert pooled.is_pinned(), "the pool's buffer is not pinned"
        pooled.fill_(7)
        rates = [n / timed(lambda s=src, d=dst: d.copy_(s, non_blocking=True), repeat) / 1e9
                 for src in (pageable, pinned, pooled)]
        assert int(dst[-1]) == 7
        print(f"{mib:>6}Mi {rates[0]:>10.1f} {rates[1]:>10.1f} {rates[2]:>10.1f} "
              f"{rates[2] / rates[0]:>15.2f}x")
        del pooled, part
    pool.trim()


def reads(repeat: int) -> None:
    from tensorshare import Client, EmbeddedServer

    print("\na read onto the GPU, GB/s (median of", repeat, "peeks)")
    print(f"{'via':>6} {'size':>8} {'get(device=)':>13} {'get()+.cuda()':>14} {'ratio':>7}")
    with tempfile.TemporaryDirectory() as tmp, \
            EmbeddedServer(port=0, unix=f"{tmp}/s.sock") as srv:
        for via, url in (("tcp", f"127.0.0.1:{srv.port}"), ("unix", f"unix://{tmp}/s.sock")):
            with Client(url, timeout=120) as c:
                for mib in (16, 256):
                    x = torch.randn(mib * MiB // 4)
                    c.put("x", x)
                    direct = timed(lambda: c.peek("x", device="cuda"), repeat)
                    twice = timed(lambda: c.peek("x").cuda(), repeat)
                    assert torch.equal(c.peek("x", device="cuda").cpu(), x)
                    n = mib * MiB
                    print(f"{via:>6} {mib:>6}Mi {n / direct / 1e9:>13.2f} "
                          f"{n / twice / 1e9:>14.2f} {twice / direct:>6.2f}x")


PRODUCER = r"""
import sys, torch
from tensorshare import EmbeddedServer
from tensorshare.data import serve_loader
sock, ipc, batches = sys.argv[1], sys.argv[2] == "ipc", int(sys.argv[3])
dev = "cuda" if ipc else "cpu"
made = [torch.full((32, 3, 224, 224), float(i), device=dev) for i in range(4)]
with EmbeddedServer(port=None, unix=sock):
    print("READY", flush=True)
    report = serve_loader((made[i % 4] for i in range(batches)), "bench", f"unix://{sock}",
                          window=8, wait_for=3, device_ipc=ipc, progress=False,
                          samples_per_epoch=batches * 32, timeout=120)
    print("DONE", report.batches, flush=True)
"""

JOB = r"""
import json, sys, time, torch
from tensorshare.data import SharedLoader
job = SharedLoader("bench", f"unix://{sys.argv[1]}", device="cuda", prefetch=2,
                   name=sys.argv[2], timeout=120)
print("READY", flush=True)
n, nbytes, t0, ok = 0, 0, None, True
for x in job:
    n += 1
    if n % 10 == 1:  # (a look now and then: each is a sync)
        ok = ok and x.is_cuda and float(x[0, 0, 0, 0]) == float((n - 1) % 4)
    if n == 5:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
    elif n > 5:
        nbytes += x.numel() * x.element_size()
torch.cuda.synchronize()
print(json.dumps({"gbps": nbytes / (time.perf_counter() - t0) / 1e9, "batches": n, "ok": ok}))
job.close()
"""


def loader(batches: int) -> None:
    print(f"\nSharedLoader, {batches} batches of {32 * 3 * 224 * 224 * 4 / 1e6:.1f} MB to "
          f"3 jobs (processes) on one GPU, GB/s per job; tensorsocket: {TENSORSOCKET_GBPS}")
    print(f"{'path':>6} {'job 1':>7} {'job 2':>7} {'job 3':>7} {'mean':>7} {'vs tensorsocket':>16}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]), PYTHONUNBUFFERED="1")
    for mode in ("host", "ipc"):
        with tempfile.TemporaryDirectory() as tmp:
            sock = f"{tmp}/s.sock"
            prod = subprocess.Popen([sys.executable, "-c", PRODUCER, sock, mode, str(batches)],
                                    env=env, stdout=subprocess.PIPE, text=True)
            assert prod.stdout is not None and prod.stdout.readline().startswith("READY")
            jobs = [subprocess.Popen([sys.executable, "-c", JOB, sock, f"job{k}"], env=env,
                                     stdout=subprocess.PIPE, text=True) for k in range(3)]
            results = []
            for j in jobs:
                out, _ = j.communicate(timeout=300)
                results.append(json.loads(out.strip().splitlines()[-1]))
            prod.communicate(timeout=120)
            assert all(r["ok"] and r["batches"] == batches for r in results), results
            rates = [r["gbps"] for r in results]
            mean = statistics.mean(rates)
            print(f"{mode:>6} " + " ".join(f"{r:>7.2f}" for r in rates) +
                  f" {mean:>7.2f} {mean / TENSORSOCKET_GBPS:>15.2f}x")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats and batches")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(f"skipped: no CUDA (torch {torch.__version__}, "
              f"cuda.is_available()={torch.cuda.is_available()})")
        return 0
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name} ({props.total_memory / 2**30:.0f} GiB), torch "
          f"{torch.__version__}, CUDA {torch.version.cuda}")
    repeat = 5 if args.quick else 11
    h2d(repeat)
    reads(max(repeat // 2, 3))
    loader(100 if args.quick else 300)
    return 0


if __name__ == "__main__":
    sys.exit(main())
