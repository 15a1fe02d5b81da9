"""The in-process baseline of the replay benchmark (issue 38), beside the replay table's own
rates, in the same run.

Three prioritized buffers do the same work in this one process, with nothing on the wire:

* ``table``: tensorshare's :class:`~tensorshare.server.replay.ReplayTable` (the data structure
  under a replay bin; pure Python unless a compiled twin of it was built);
* ``plain``: :class:`PlainPrioritizedBuffer` below, what an in-process user writes: a ring of
  ``max_size`` items (the oldest overwritten), a sum tree over ``priority ** alpha`` in numpy,
  a batch drawn by one vectorised descent, a batch of priorities updated level by level;
* ``torchrl``: TorchRL's ``PrioritizedReplayBuffer`` over a ``LazyTensorStorage``, where
  TorchRL is installed and its compiled segment trees load (TorchRL is no dependency of
  tensorshare: the row says why it is skipped otherwise).

Each fills a table of ``--size`` items by inserts of ``--insert-batch``, then times, item
payloads of a few bytes (the index is measured, not copies): ``insert`` of
``--insert-batch`` items into the full table (the oldest make room), prioritized
``sample(--batch)`` and ``update_priorities(--batch)`` of the keys just drawn. It prints
batches per second and the median latency; the exit status is 0 whatever the numbers.

    python benchmarks/replay_baseline.py             # 1M items, about a minute
    python benchmarks/replay_baseline.py --quick     # 100k items
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorshare.server.replay import ReplayConfig, ReplayTable  # noqa: E402

ALPHA = 0.6


class PlainPrioritizedBuffer:
    """A plain in-process prioritized replay buffer (the baseline): ``insert``, ``sample``,
    ``update_priorities``, the same shape as the replay bin's."""

    def __init__(self, max_size: int, alpha: float = ALPHA, seed: int = 0) -> None:
        self.max_size = max_size
        self.alpha = alpha
        self.capacity = 1 << max(0, (max_size - 1).bit_length())
        self.depth = self.capacity.bit_length() - 1
        self.tree = np.zeros(2 * self.capacity)
        self.items: list[Any] = [None] * max_size
        self.size = 0
        self.cursor = 0
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return self.size

    def insert(self, items: Sequence[Any], priorities: Sequence[float]) -> np.ndarray:
        """Store ``items`` (over the oldest when full); their indices."""
        count = len(items)
        index = (self.cursor + np.arange(count)) % self.max_size
        for i, item in zip(index.tolist(), items, strict=True):
            self.items[i] = item
        self.cursor = (self.cursor + count) % self.max_size
        self.size = min(self.size + count, self.max_size)
        self._set(index, np.asarray(priorities, dtype=np.float64))
        return index

    def sample(self, batch_size: int) -> tuple[np.ndarray, list[Any], np.ndarray, int]:
        """``batch_size`` independent draws: indices, items, probabilities, size."""
        tree = self.tree
        total = tree[1]
        target = self.rng.random(batch_size) * total
        node = np.ones(batch_size, dtype=np.int64)
        for _ in range(self.depth):
            node *= 2
            left = tree[node]
            right = (target >= left) & (tree[node + 1] > 0.0)
            target -= left * right
            node += right
        index = node - self.capacity
        items = [self.items[i] for i in index.tolist()]
        return index, items, tree[node] / total, self.size

    def update_priorities(self, index: np.ndarray, priorities: Sequence[float]) -> None:
        """Set the priorities at ``index``."""
        self._set(np.asarray(index), np.asarray(priorities, dtype=np.float64))

    def _set(self, index: np.ndarray, priorities: np.ndarray) -> None:
        tree = self.tree
        node = index + self.capacity
        tree[node] = priorities ** self.alpha
        for _ in range(self.depth):
            node = np.unique(node // 2)
            tree[node] = tree[2 * node] + tree[2 * node + 1]


class TableAdapter:
    """tensorshare's replay table, in the same shape."""

    def __init__(self, max_size: int) -> None:
        self.table = ReplayTable(ReplayConfig(max_size=max_size, sampler="prioritized",
                                              priority_exponent=ALPHA, remover="fifo", seed=0))

    def insert(self, items: Sequence[Any], priorities: Sequence[float]) -> list[int]:
        return self.table.insert(items, priorities, [len(items)] * len(items))

    def sample(self, batch_size: int) -> tuple[list[int], list[Any], list[float], int]:
        drawn = self.table.sample(batch_size)
        return drawn.keys, drawn.payloads, drawn.probabilities, drawn.sizes[0]

    def update_priorities(self, keys: Sequence[int], priorities: Sequence[float]) -> None:
        self.table.update_priorities(keys, priorities)


class TorchRLAdapter:
    """TorchRL's PrioritizedReplayBuffer, in the same shape (tensordict items)."""

    def __init__(self, max_size: int) -> None:
        import torch
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, PrioritizedReplayBuffer

        self.torch = torch
        self.TensorDict = TensorDict
        self.buffer = PrioritizedReplayBuffer(alpha=ALPHA, beta=0.4,
                                              storage=LazyTensorStorage(max_size))

    def insert(self, items: Sequence[Any], priorities: Sequence[float]) -> Any:
        torch = self.torch
        batch = self.TensorDict({"obs": torch.zeros(len(items), 4)}, batch_size=[len(items)])
        index = self.buffer.extend(batch)
        self.buffer.update_priority(index, torch.as_tensor(priorities))
        return index

    def sample(self, batch_size: int) -> tuple[Any, Any, Any, int]:
        batch, info = self.buffer.sample(batch_size, return_info=True)
        return info["index"], batch, info.get("_weight"), len(self.buffer)

    def update_priorities(self, keys: Any, priorities: Sequence[float]) -> None:
        self.buffer.update_priority(keys, self.torch.as_tensor(priorities))


def timed(op: Callable[[], Any], repeat: int) -> list[float]:
    """Seconds of each of ``repeat`` calls of ``op``."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return times


def measure(name: str, make: Callable[[int], Any], size: int, batch: int, insert_batch: int,
            repeat: int) -> dict[str, Any]:
    """Fill one buffer and time its three operations."""
    rng = np.random.default_rng(1)
    buffer = make(size)
    payload = b"transition"
    items = [payload] * insert_batch
    start = time.perf_counter()
    for _ in range(size // insert_batch):
        buffer.insert(items, (rng.random(insert_batch) + 0.01).tolist())
    fill = time.perf_counter() - start
    gc.collect()
    priorities = (rng.random(batch) + 0.01).tolist()
    inserts = timed(lambda: buffer.insert(items, priorities[:insert_batch]), repeat)
    samples = timed(lambda: buffer.sample(batch), repeat)
    keys = buffer.sample(batch)[0]
    updates = timed(lambda: buffer.update_priorities(keys, priorities), repeat)
    return {"name": name, "fill_items_per_s": (size // insert_batch) * insert_batch / fill,
            "insert": inserts, "sample": samples, "update": updates}


def report(rows: list[dict[str, Any]], batch: int, insert_batch: int) -> None:
    print(f"{'buffer':<10}{'fill items/s':>14}"
          f"{f'insert({insert_batch}) /s':>18}{'p50 ms':>9}"
          f"{f'sample({batch}) /s':>18}{'p50 ms':>9}"
          f"{f'update({batch}) /s':>18}{'p50 ms':>9}")
    for row in rows:
        cells = [f"{row['name']:<10}{row['fill_items_per_s']:>14,.0f}"]
        for op in ("insert", "sample", "update"):
            times = row[op]
            cells.append(f"{len(times) / sum(times):>18,.0f}{1000 * statistics.median(times):>9.3f}")
        print("".join(cells))
    by_name = {row["name"]: row for row in rows}
    table = by_name["table"]
    for other in ("plain", "torchrl"):
        if other in by_name:
            base = by_name[other]
            ratio = (statistics.median(base["sample"]) / statistics.median(table["sample"]))
            print(f"table / {other}: sample({batch}) rate x{ratio:.2f} (median latencies)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--insert-batch", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="100k items, 50 repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.repeat = 100_000, 50
    print(f"{args.size:,} items, python {sys.version.split()[0]}, numpy {np.__version__}")
    makers: list[tuple[str, Callable[[int], Any]]] = [
        ("table", TableAdapter), ("plain", PlainPrioritizedBuffer), ("torchrl", TorchRLAdapter)]
    rows = []
    for name, make in makers:
        try:
            rows.append(measure(name, make, args.size, args.batch, args.insert_batch,
                                args.repeat))
        except Exception as exc:  # torchrl absent or broken: say so, go on
            if name != "torchrl":
                raise
            print(f"torchrl: skipped ({type(exc).__name__}: {str(exc).splitlines()[0]})")
        gc.collect()
    report(rows, args.batch, args.insert_batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
