"""One DataLoader for three training jobs: ``serve_loader`` and ``SharedLoader``.

A hyper-parameter sweep where data loading is the bottleneck (an expensive transform on
every sample) runs three jobs, each with its own learning rate and batch size, twice:

* **private**: each job has its own DataLoader (three pipelines transform every sample);
* **shared**: one process runs the DataLoader and ``serve_loader``; each job swaps its
  DataLoader for a ``SharedLoader`` (one line) and gets every batch, re-batched to its own
  batch size, through a tensorshare server on a Unix socket.

Each job must reach the accuracy it reaches with a private DataLoader; the closing note
shows both timings. The data is synthetic (no download)::

    python examples/shared_loader.py                 # about 20 s on 2 cores
    python examples/shared_loader.py --quick         # a smaller run (the tests run this)
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import tempfile
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

STREAM = "sweep/train"
JOBS = [  # (learning rate, batch size): three jobs of a sweep
    (0.05, 32),
    (0.1, 64),
    (0.2, 128),
]
CLASSES, FEATURES = 4, 16
WORKERS = 2  # processes per DataLoader, private or shared


class Blobs(Dataset[tuple[torch.Tensor, int]]):
    """Gaussian blobs, one per class; every sample goes through a costly transform."""

    def __init__(self, n: int, cost: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.centers = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(7))
        self.labels = torch.randint(0, CLASSES, (n,), generator=g)
        self.noise = torch.randn(n, FEATURES, generator=g)
        self.cost = cost

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        # The "expensive augmentation": a fixed amount of CPU work per sample (a hash
        # chain), then a jitter derived from it, so that its result is used.
        h = hashlib.sha256(i.to_bytes(8, "little"))
        for _ in range(self.cost):
            h = hashlib.sha256(h.digest())
        jitter = (h.digest()[0] / 255.0 - 0.5) * 0.1
        y = int(self.labels[i])
        return self.centers[y] + self.noise[i] * 1.2 + jitter, y


def loader(dataset: Dataset[Any], batch_size: int, seed: int) -> DataLoader[Any]:
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=WORKERS,
                      generator=torch.Generator().manual_seed(seed))


def train(lr: float, batches: Any, epochs: int, test: tuple[torch.Tensor, torch.Tensor]
          ) -> float:
    """Train a small classifier on ``batches`` (a DataLoader or a SharedLoader) for
    ``epochs`` passes; return its test accuracy."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(epochs):
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    with torch.no_grad():
        return float((model(test[0]).argmax(1) == test[1]).float().mean())


def test_set() -> tuple[torch.Tensor, torch.Tensor]:
    clean = Blobs(1000, cost=0, seed=99)
    xs, ys = zip(*(clean[i] for i in range(len(clean))), strict=True)
    return torch.stack(xs), torch.tensor(ys)


# -- the processes ------------------------------------------------------------------------
def server_main(path: str, stop: Any) -> None:
    from tensorshare import EmbeddedServer

    with EmbeddedServer(port=None, unix=path):
        stop.wait()


def producer_main(address: str, args: argparse.Namespace) -> None:
    from tensorshare.data import serve_loader

    torch.set_num_threads(1)
    data = loader(Blobs(args.samples, args.cost), 64, seed=1)
    # window: how far the DataLoader may run ahead of the slowest job; wait_for: start
    # the first epoch once the three jobs are there, so that every job gets every epoch.
    serve_loader(data, STREAM, address, epochs=args.epochs, window=32, wait_for=len(JOBS),
                 timeout=120)


def job_main(shared: str | None, lr: float, batch_size: int, args: argparse.Namespace,
             results: Any) -> None:
    torch.set_num_threads(1)
    if shared is None:
        batches: Any = loader(Blobs(args.samples, args.cost), batch_size, seed=2)
    else:
        from tensorshare.data import SharedLoader

        # The one-line swap: the same batches as the producer's DataLoader, re-batched.
        batches = SharedLoader(STREAM, shared, batch_size=batch_size, name=f"lr={lr}",
                               start="next_epoch", timeout=120)
    acc = train(lr, batches, args.epochs, test_set())
    results.put((lr, acc))


def run(shared: bool, args: argparse.Namespace) -> tuple[float, dict[float, float]]:
    """Run the three jobs (and, when shared, the server and the producer); return the
    wall time from their start to the last job's end, and each job's accuracy."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    stop = ctx.Event()
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        address = f"unix://{os.path.join(tmp, 'ts.sock')}" if shared else None
        t0 = time.perf_counter()
        if address is not None:
            procs.append(ctx.Process(target=server_main, args=(address[7:], stop)))
            procs.append(ctx.Process(target=producer_main, args=(address, args)))
        for lr, bs in JOBS:
            procs.append(ctx.Process(target=job_main, args=(address, lr, bs, args, results)))
        for p in procs:
            p.start()
        try:
            accuracy = dict(results.get(timeout=600) for _ in JOBS)
            took = time.perf_counter() - t0
        finally:
            stop.set()
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    return took, accuracy


def summary(private: dict[float, float], shared: dict[float, float], private_s: float,
            shared_s: float, args: argparse.Namespace) -> str:
    """The closing note: each job's test accuracy both ways, then both wall times."""
    lines = [f"{'job':<18}{'private DataLoader':>20}{'SharedLoader':>16}"]
    for lr, bs in JOBS:
        lines.append(f"{f'lr={lr} batch={bs}':<18}{private[lr]:>19.1%} {shared[lr]:>15.1%}")
    off = {lr: abs(shared[lr] - private[lr]) for lr, _ in JOBS}
    if all(d <= 0.05 for d in off.values()):
        lines.append("accuracy: the same with one shared DataLoader (every job within 5 "
                     "points of its private run)")
    else:
        worst = max(off, key=lambda lr: off[lr])
        lines.append(f"accuracy: DIFFERENT with one shared DataLoader (lr={worst} is "
                     f"{off[worst] * 100:.1f} points off its private run; 5 are allowed)")
    ratio = (f"{private_s / shared_s:.1f}x faster" if shared_s <= private_s
             else f"{shared_s / private_s:.1f}x slower")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines += [
        f"wall time of the three jobs ({args.epochs} epochs of {args.samples} samples, "
        f"{cpus} CPUs, one run each),",
        "from starting their processes to the last job's result:",
        f"  {len(JOBS)} private DataLoaders ({WORKERS} workers each: each sample transformed "
        f"{len(JOBS)} times an epoch)  {private_s:6.1f} s",
        f"  1 shared DataLoader   ({WORKERS} workers:      each sample transformed once an "
        f"epoch)     {shared_s:6.1f} s: {ratio}, its server and producer included"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--cost", type=int, default=600,
                        help="hash rounds per sample: the transform's CPU cost")
    parser.add_argument("--quick", action="store_true", help="a smaller run")
    args = parser.parse_args()
    if args.quick:
        args.epochs, args.samples = 2, 2048
    # Import what the jobs use once, before the processes are forked (the first optimizer
    # imports parts of torch that take seconds): neither run pays for it.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    import tensorshare.data  # noqa: F401
    import tensorshare.server  # noqa: F401
    private_s, private = run(False, args)
    shared_s, shared = run(True, args)
    print(summary(private, shared, private_s, shared_s, args))


if __name__ == "__main__":
    main()
