"""Ape-X DQN on Gymnasium's CartPole-v1: actor processes fill a prioritized replay bin, one
learner samples it.

The learner hosts a tensorshare server (on a free port) with a replay bin
(``ReplayBuffer``, ``sampler="prioritized"``). Each actor process (``python
examples/ape_x.py actor ...``) plays CartPole with its own exploration rate (Ape-X's
``eps_i = 0.4 ** (1 + 7 i / (N - 1))``), computes 3-step transitions and their initial
priorities from its own copy of the Q network (the absolute TD error, as Ape-X does), and
inserts them in batches of 32 (``insert_many``: one request). The learner samples
prioritized batches of 64, corrects them with importance weights ``(size * p) ** -beta``,
takes a double-DQN step, updates the priorities (``update_priorities``: one request) and
publishes its parameters every 25 steps (``put``; the actors pick them up between batches).
The bin's rate limiter (``samples_per_insert=8``) keeps the learner from sampling each
transition more than about 8 times: it waits for the actors rather than overfit what it has.
Every second of training it evaluates the greedy policy on 5 episodes of its own; the run
ends when their average return reaches ``--target``.

More actors fill the buffer with more, and more varied, experience: the learner reaches the
target sooner (``python examples/ape_x.py --actors 1`` against ``--actors 2``)::

    python examples/ape_x.py --actors 2 --max-seconds 120

``--smoke`` runs a few seconds and checks the plumbing (inserts, samples, updates) instead of
the target. Exit status: 0 if the target was reached (or, with ``--smoke``, the plumbing
worked) within ``--max-seconds``, 1 if not, 2 without Gymnasium.
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tensorshare import Client, EmbeddedServer
from tensorshare.errors import WaitTimeout
from tensorshare.rl import ReplayBuffer

REPLAY, PARAMS, STOP = "apex/replay", "apex/params", "apex/stop"
GAMMA, N_STEP, BATCH, INSERT_BATCH = 0.99, 3, 64, 32
#: The replay bin's configuration: the learner creates the bin with it, each actor checks it.
CONFIG: dict[str, Any] = {"max_size": 100_000, "priority_exponent": 0.6,
                          "min_size_to_sample": 1_000, "samples_per_insert": 8.0,
                          "error_buffer": 4_000.0}


def q_network() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 2))


def _make_env() -> Any:
    import gymnasium

    return gymnasium.make("CartPole-v1")


# -- actors ---------------------------------------------------------------------------------
def _td_errors(net: nn.Module, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """|TD error| of 3-step transitions under ``net`` (its own target: an actor's estimate)."""
    with torch.no_grad():
        q = net(t["obs"]).gather(1, t["action"].view(-1, 1)).squeeze(1)
        best = net(t["next_obs"]).max(1).values
        target = t["reward"] + (GAMMA ** N_STEP) * (1.0 - t["done"]) * best
    return (target - q).abs()


def _stack(transitions: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([t[k] for t in transitions]) for k in transitions[0]}


def _n_step(window: list[tuple[Any, int, float]], next_obs: Any, done: bool
            ) -> dict[str, torch.Tensor]:
    obs, action, _ = window[0]
    ret = sum((GAMMA ** i) * r for i, (_, _, r) in enumerate(window))
    return {"obs": torch.as_tensor(obs, dtype=torch.float32), "action": torch.tensor(action),
            "reward": torch.tensor(ret, dtype=torch.float32),
            "next_obs": torch.as_tensor(next_obs, dtype=torch.float32),
            "done": torch.tensor(float(done))}


def _episode(env: Any, net: nn.Module, eps: float, rng: torch.Generator,
             out: list[dict[str, torch.Tensor]]) -> float:
    """Play one episode, appending its 3-step transitions to ``out``; its return."""
    obs, _ = env.reset(seed=int(torch.randint(1 << 30, (1,), generator=rng)))
    window: list[tuple[Any, int, float]] = []
    total, done = 0.0, False
    while not done:
        if float(torch.rand((), generator=rng)) < eps:
            action = int(torch.randint(2, (1,), generator=rng))
        else:
            with torch.no_grad():
                action = int(net(torch.as_tensor(obs, dtype=torch.float32)).argmax())
        next_obs, reward, terminated, truncated, _ = env.step(action)
        total += float(reward)
        done = terminated or truncated
        window.append((obs, action, float(reward)))
        if len(window) == N_STEP or done:
            out.append(_n_step(window, next_obs, terminated))
            window.pop(0)
        while done and window:  # the episode's last steps, each with a shorter horizon
            out.append(_n_step(window, next_obs, terminated))
            window.pop(0)
        obs = next_obs
    return total


def run_actor(port: int, index: int, eps: float) -> int:
    """One actor: play, insert prioritized transitions, pick up new parameters."""
    env, net = _make_env(), q_network()
    rng = torch.Generator().manual_seed(1000 + index)
    with Client("127.0.0.1", port, timeout=30.0) as c:
        buf = ReplayBuffer.over(c, REPLAY, **CONFIG)
        version, pending = 0, []
        while not c.list().get(STOP):
            got = c.fetch(PARAMS, remove=False, newer_than=version)
            if not got.unchanged and got.items:
                net.load_state_dict(got.value)
                version = got.version
            _episode(env, net, eps, rng, pending)
            while len(pending) >= INSERT_BATCH:
                batch, pending = pending[:INSERT_BATCH], pending[INSERT_BATCH:]
                prios = _td_errors(net, _stack(batch)) + 1e-3
                if not _insert(c, buf, batch, prios):
                    return 0  # the learner is done
    return 0


def _insert(c: Client, buf: ReplayBuffer, batch: list[Any], prios: Any) -> bool:
    """Insert a batch, waiting while the rate limiter holds it (the learner samples slower
    than the actors insert) for as long as the learner runs; ``False`` once it stopped."""
    while True:
        try:
            buf.insert_many(batch, prios, timeout=2.0)
            return True
        except WaitTimeout:
            if c.list().get(STOP):
                return False


# -- the learner ----------------------------------------------------------------------------
def _greedy_return(net: nn.Module, env: Any, episodes: int, seed: int) -> float:
    total = 0.0
    for e in range(episodes):
        obs, _ = env.reset(seed=seed + e)
        done = False
        while not done:
            with torch.no_grad():
                action = int(net(torch.as_tensor(obs, dtype=torch.float32)).argmax())
            obs, reward, terminated, truncated, _ = env.step(action)
            total += float(reward)
            done = terminated or truncated
    return total / episodes


def _learn_step(net: nn.Module, target: nn.Module, opt: torch.optim.Optimizer,
                buf: ReplayBuffer, beta: float) -> int:
    items, keys, probs, size = buf.sample(BATCH, timeout=30.0)
    weights = (size * probs) ** -beta
    weights = (weights / weights.max()).float()
    q = net(items["obs"]).gather(1, items["action"].view(-1, 1)).squeeze(1)
    with torch.no_grad():  # double DQN: the online net picks, the target net values
        best = net(items["next_obs"]).argmax(1, keepdim=True)
        value = target(items["next_obs"]).gather(1, best).squeeze(1)
        y = items["reward"] + (GAMMA ** N_STEP) * (1.0 - items["done"]) * value
    td = y - q
    loss = (weights * nn.functional.smooth_l1_loss(q, y, reduction="none")).mean()
    opt.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(net.parameters(), 10.0)
    opt.step()
    buf.update_priorities(keys, td.detach().abs() + 1e-3)
    return BATCH


def _spawn(port: int, n: int) -> list[subprocess.Popen[bytes]]:
    procs = []
    for i in range(n):
        eps = 0.4 ** (1 + 7 * i / (n - 1)) if n > 1 else 0.1
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "actor",
                                       str(port), str(i), str(eps)]))
    return procs


def learn(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    with EmbeddedServer(port=0) as srv, Client("127.0.0.1", srv.port, timeout=30.0) as c:
        buf = ReplayBuffer.over(c, REPLAY, seed=args.seed, **CONFIG)
        net = q_network()
        target, opt = copy.deepcopy(net), torch.optim.Adam(net.parameters(), lr=5e-4)
        c.put(PARAMS, net.state_dict())
        procs = _spawn(srv.port, args.actors)
        try:
            return _train(args, c, buf, net, target, opt)
        finally:
            c.put(STOP, torch.ones(1))
            for p in procs:
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()


def _train(args: argparse.Namespace, c: Client, buf: ReplayBuffer, net: nn.Module,
           target: nn.Module, opt: torch.optim.Optimizer) -> int:
    env = _make_env()
    start = time.monotonic()
    steps, last_eval, score = 0, start, 0.0
    while time.monotonic() - start < args.max_seconds:
        beta = min(1.0, 0.4 + 0.6 * (time.monotonic() - start) / max(args.max_seconds, 1.0))
        steps += _learn_step(net, target, opt, buf, beta) // BATCH
        if steps % 25 == 0:
            c.put(PARAMS, net.state_dict())
        if steps % 250 == 0:
            target.load_state_dict(net.state_dict())
        if args.smoke and steps >= 20:
            break
        if time.monotonic() - last_eval >= 1.0:
            score, last_eval = _greedy_return(net, env, 5, 10_000 + steps), time.monotonic()
            stats = buf.stats()
            print(f"{time.monotonic() - start:6.1f}s  updates {steps:6d}  replay {stats['size']:6d}"
                  f"  inserts/s {stats['inserts_per_s']:8.0f}  greedy return {score:6.1f}",
                  flush=True)
            if score >= args.target:
                break
    elapsed = time.monotonic() - start
    stats = buf.stats()
    print(f"summary: {args.actors} actors, {steps} updates, {stats['inserts']} transitions "
          f"inserted, {stats['samples']} sampled, greedy return {score:.1f} "
          f"(target {args.target:g}) after {elapsed:.1f} s")
    if args.smoke:
        ok = steps >= 20 and stats["inserts"] > 0 and stats["samples"] >= 20 * BATCH
        print("smoke: the replay plumbing works" if ok else "smoke: FAILED")
        return 0 if ok else 1
    reached = score >= args.target
    print(f"reached the target in {elapsed:.1f} s" if reached else "did not reach the target")
    return 0 if reached else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)  # (small networks: one thread each, not one per core each)
    try:
        import gymnasium  # noqa: F401
    except ImportError:
        print("examples/ape_x.py needs Gymnasium: pip install -e '.[rl]'", file=sys.stderr)
        return 2
    if argv[:1] == ["actor"]:
        return run_actor(int(argv[1]), int(argv[2]), float(argv[3]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--actors", type=int, default=2, help="actor processes (default 2)")
    p.add_argument("--target", type=float, default=475.0,
                   help="greedy return that counts as solved (default 475)")
    p.add_argument("--max-seconds", type=float, default=180.0, help="give up after this long")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true",
                   help="a few seconds: check the plumbing, not the learning")
    args = p.parse_args(argv)
    if args.actors < 1:
        p.error("--actors must be at least 1")
    return learn(args)


if __name__ == "__main__":
    sys.exit(main())
