"""Offload hard-triplet mining to worker processes, with tensorshare in between.

Metric learning with a triplet loss learns fastest from *hard* triplets: for each anchor, the
positive of its class that the current embedding puts farthest away and the negative of another
class that it puts closest. Finding them means embedding a batch and comparing all pairs, work
that worker processes can do while the trainer trains:

* the trainer runs a server (``EmbeddedServer(port=0)``) and ``put`` s the embedding net's
  parameters into a bin; every put gives the bin a new version;
* each worker waits for a version newer than the one it mined with (``fetch(newer_than=...)``),
  embeds a random batch, mines one hard triplet per anchor and ``append`` s the triplets (as
  dataset indices: every process builds the same dataset from the same seed, so only indices
  travel) tagged with the parameter version they were mined with;
* the trainer takes the triplets that arrived (``fetch(remove=True, min_tag=...)`` drops those
  mined with parameters more than one version old), takes a step of
  ``torch.nn.TripletMarginLoss`` and publishes the new parameters.

It uses the plain :class:`tensorshare.Client` (``examples/cartpole.py`` shows the RL helpers)
and ``multiprocessing`` with the ``spawn`` start method::

    python examples/triplet_mining.py --workers 2 --steps 300

Exit status: 0 if the loss on a fixed evaluation batch of hard triplets ended lower than it
started, 1 if not (or if time ran out before any step).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import sys
import time
from collections.abc import Sequence

import torch
from torch import nn

from tensorshare import Client, ConnectError, ConnectionLost, EmbeddedServer, Timeout

PARAMS_BIN = "triplets/parameters"
TRIPLETS_BIN = "triplets/mined"
READY_BIN = "triplets/ready"
N_CLASSES, DIM, N_POINTS = 10, 32, 2000
DATA_SEED = 1234  # every process builds the same dataset from this
MARGIN = 1.0


def make_dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """10 Gaussian clusters in 32-d, overlapping enough that the embedding has work to do.

    Returns:
        ``(points, labels)``: (2000, 32) float32 and (2000,) int64, identical in every process.
    """
    gen = torch.Generator().manual_seed(DATA_SEED)
    centers = torch.randn(N_CLASSES, DIM, generator=gen)
    labels = torch.arange(N_POINTS) % N_CLASSES
    points = centers[labels] + torch.randn(N_POINTS, DIM, generator=gen)
    return points, labels


def embedding_net() -> nn.Module:
    """32 -> 64 -> 16."""
    return nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, 16))


def mine_hard_triplets(net: nn.Module, points: torch.Tensor, labels: torch.Tensor,
                       batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Embed a random batch; for each anchor pick its hardest positive and hardest negative.

    Returns:
        ``{"anchor", "positive", "negative"}``: (batch_size,) int64 indices into ``points``.
    """
    idx = torch.randperm(len(points), generator=generator)[:batch_size]
    with torch.no_grad():
        emb = net(points[idx])
    dist = torch.cdist(emb, emb)
    y = labels[idx]
    same = y[:, None] == y[None, :]
    itself = torch.eye(len(idx), dtype=torch.bool)
    positive = dist.masked_fill(~same | itself, -1.0).argmax(dim=1)  # farthest of its class
    negative = dist.masked_fill(same, float("inf")).argmin(dim=1)  # closest of another class
    return {"anchor": idx, "positive": idx[positive], "negative": idx[negative]}


def triplet_loss(net: nn.Module, points: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The triplet margin loss of index triplets ``t``."""
    loss_fn = nn.TripletMarginLoss(margin=MARGIN)
    return loss_fn(net(points[t["anchor"]]), net(points[t["positive"]]),
                   net(points[t["negative"]]))  # type: ignore[no-any-return]


def mine_worker(port: int, worker_id: int, batch_size: int, seed: int) -> None:
    """A worker process: mine with each new parameter version until the trainer goes away."""
    torch.set_num_threads(1)  # the processes share few cores
    # The trainer closing the server is how a run ends; the client's warning is noise here.
    logging.getLogger("tensorshare").setLevel(logging.ERROR)
    points, labels = make_dataset()
    net = embedding_net()
    generator = torch.Generator().manual_seed(seed * 1000 + worker_id)
    version = 0
    try:
        with Client("127.0.0.1", port, timeout=30.0) as client:
            client.append(READY_BIN, worker_id)
            while True:
                try:
                    # One batch per version: mining twice with the same parameters would
                    # only produce triplets the trainer considers stale sooner.
                    res = client.fetch(PARAMS_BIN, remove=False, newer_than=version, timeout=30.0)
                except Timeout:
                    continue  # the trainer is slow; keep waiting
                net.load_state_dict(res.value)
                version = res.version
                triplets = mine_hard_triplets(net, points, labels, batch_size, generator)
                client.append(TRIPLETS_BIN, triplets, tag=version)
    except ConnectionLost:
        return  # the trainer stopped its server: we are done
    except ConnectError as exc:
        print(f"miner {worker_id}: {exc}", file=sys.stderr)
        sys.exit(1)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the trainer and the worker processes. Returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="mining processes (default 2)")
    p.add_argument("--steps", type=int, default=300, help="gradient steps (default 300)")
    p.add_argument("--max-seconds", type=float, default=120.0,
                   help="stop after this long even if --steps are not done (default 120)")
    p.add_argument("--batch-size", type=int, default=256, help="anchors per mined batch")
    p.add_argument("--seed", type=int, default=0, help="seeds the net and the mining batches")
    args = p.parse_args(argv)
    if args.workers < 1 or args.steps < 1:
        p.error("--workers and --steps must be at least 1")

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    points, labels = make_dataset()
    net = embedding_net()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    # A fixed batch to measure progress on: its hard triplets are re-mined with the current
    # net each time, so the number only falls if the embedding really separates the classes.
    eval_gen_seed = 10_000 + args.seed

    def eval_loss() -> float:
        t = mine_hard_triplets(net, points, labels, 1000, torch.Generator().manual_seed(eval_gen_seed))
        with torch.no_grad():
            return float(triplet_loss(net, points, t))

    start_loss = eval_loss()
    print(f"evaluation loss at the start: {start_loss:.4f}", flush=True)

    start = time.monotonic()
    deadline = start + args.max_seconds
    server = EmbeddedServer(port=0)
    ctx = mp.get_context("spawn")  # fork would copy torch's threads and the server's reactor
    workers = [ctx.Process(target=mine_worker, args=(server.port, i, args.batch_size, args.seed),
                           name=f"miner-{i}") for i in range(args.workers)]
    step = used = 0
    losses: list[float] = []
    try:
        with Client("127.0.0.1", server.port, timeout=30.0) as client:
            for w in workers:
                w.start()
            # Starting a process and importing torch takes seconds, training steps take
            # milliseconds: wait for every miner to say it is connected, so that they all
            # mine from the first version on.
            try:
                client.fetch(READY_BIN, remove=True, min_items=args.workers,
                             timeout=max(deadline - time.monotonic(), 0.0))
            except Timeout:
                print("not every mining process connected in time", file=sys.stderr)
            version = client.put(PARAMS_BIN, net.state_dict())
            print(f"server on 127.0.0.1:{server.port}; {args.workers} mining processes "
                  f"connected after {time.monotonic() - start:.1f} s", flush=True)
            while step < args.steps and time.monotonic() < deadline:
                try:
                    # Triplets mined with the newest parameters or the ones before.
                    res = client.fetch(TRIPLETS_BIN, remove=True, min_tag=version - 1,
                                       timeout=min(5.0, max(deadline - time.monotonic(), 0.0)))
                except Timeout:
                    if not any(w.is_alive() for w in workers):
                        print("every mining process exited", file=sys.stderr)
                        return 1
                    continue
                batch = {k: torch.cat([t[k] for t in res.value]) for k in res.value[0]}
                loss = triplet_loss(net, points, batch)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                version = client.put(PARAMS_BIN, net.state_dict())
                losses.append(float(loss.detach()))
                used += len(batch["anchor"])
                step += 1
                if step == 1 or step % 25 == 0 or step == args.steps:
                    print(f"step {step:4d}  version {version:4d}  triplets {used:7,d}  "
                          f"loss {losses[-1]:.4f}  ({time.monotonic() - start:.1f} s)",
                          flush=True)
    finally:
        server.stop()  # the workers' connections drop: they return and exit 0
        for w in workers:
            if w.pid is None:
                continue  # never started
            w.join(timeout=10.0)
            if w.is_alive():
                w.kill()
                w.join()

    if not losses:
        print("no step was taken before --max-seconds ran out", file=sys.stderr)
        return 1
    end_loss = eval_loss()
    print(f"training loss on mined triplets: first step {losses[0]:.4f}, "
          f"last step {losses[-1]:.4f}")
    print(f"evaluation loss: start {start_loss:.4f}, end {end_loss:.4f} "
          f"({'lower' if end_loss < start_loss else 'NOT lower'}) after {step} steps")
    return 0 if end_loss < start_loss else 1


if __name__ == "__main__":
    sys.exit(main())
