"""``tensorshare demo``: worker processes and a trainer learn CartPole through a tensorshare server.

The trainer hosts the server (``RLTrainer(host_server=True)``) and publishes the policy's
parameters; each worker process waits for a new parameter version, plays a batch of CartPole
episodes with it and appends the rollout, tagged with that version, to the rollout bin. The
trainer takes one rollout per worker, drops stale ones on the server (``filter_version``), takes
a REINFORCE step and publishes again. CartPole counts as solved once the average return of the
last 100 episodes reaches the target (195 by default; 200 is the most an episode can give).

Everything lives in this module so that the installed package can run it: ``tensorshare demo``
calls :func:`run_demo`, ``examples/cartpole.py`` calls :func:`train`, and each worker process is
``python -m tensorshare.demo worker --port PORT``. No gym, no numpy: the classic
Barto-Sutton-Anderson cart-pole physics is written out below.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

import torch
from torch import nn

from .errors import ConnectError, ConnectionLost, Timeout
from .rl import RLTrainer, RLWorker

__all__ = [
    "CartPole",
    "Learner",
    "Policy",
    "TrainResult",
    "collect_episodes",
    "main",
    "run_demo",
    "run_worker",
    "start_workers",
    "stop_workers",
    "train",
]

# -- CartPole: the classic cart-pole of Barto, Sutton & Anderson (1983), as in gym's v0 ---------
GRAVITY = 9.8
MASS_CART = 1.0
MASS_POLE = 0.1
TOTAL_MASS = MASS_CART + MASS_POLE
HALF_LENGTH = 0.5  # half the pole's length
POLE_MASS_LENGTH = MASS_POLE * HALF_LENGTH
FORCE_MAG = 10.0
TAU = 0.02  # seconds per step (explicit Euler)
X_LIMIT = 2.4
THETA_LIMIT = 12 * 2 * math.pi / 360  # 12 degrees
MAX_STEPS = 200  # reward is 1 per step, so 200 is the best possible return

# -- learning ------------------------------------------------------------------------------------
GAMMA = 0.99
LEARNING_RATE = 1e-2
HIDDEN = 64
ENVS_PER_WORKER = 8  # episodes each worker plays per parameter version
WINDOW = 100  # "solved" is judged on the average return of this many recent episodes


class CartPole:
    """One cart-pole, in plain Python floats (for a handful of them this beats tensor ops).

    Args:
        rng: where the random start states come from (seed it for reproducible episodes).
    """

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.state = [0.0, 0.0, 0.0, 0.0]
        self.steps = 0

    def reset(self) -> list[float]:
        """Start an episode near upright and still. Returns the observation."""
        self.state = [self.rng.uniform(-0.05, 0.05) for _ in range(4)]
        self.steps = 0
        return list(self.state)

    def step(self, action: int) -> tuple[list[float], bool]:
        """Push left (0) or right (1) for one time step; the reward is always 1.

        Returns:
            The new observation ``[x, x_dot, theta, theta_dot]`` and whether the episode is
            over (cart off the track, pole past 12 degrees, or ``MAX_STEPS`` reached).
        """
        x, x_dot, theta, theta_dot = self.state
        force = FORCE_MAG if action == 1 else -FORCE_MAG
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + POLE_MASS_LENGTH * theta_dot * theta_dot * sin) / TOTAL_MASS
        theta_acc = (GRAVITY * sin - cos * temp) / (
            HALF_LENGTH * (4.0 / 3.0 - MASS_POLE * cos * cos / TOTAL_MASS))
        x_acc = temp - POLE_MASS_LENGTH * theta_acc * cos / TOTAL_MASS
        x += TAU * x_dot
        x_dot += TAU * x_acc
        theta += TAU * theta_dot
        theta_dot += TAU * theta_acc
        self.state = [x, x_dot, theta, theta_dot]
        self.steps += 1
        done = (abs(x) > X_LIMIT or abs(theta) > THETA_LIMIT or self.steps >= MAX_STEPS)
        return list(self.state), done


class Policy(nn.Module):
    """A 4-64-2 MLP giving the logits of pushing left and right."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 2))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs)  # type: ignore[no-any-return]


def collect_episodes(policy: Policy, envs: Sequence[CartPole], generator: torch.Generator,
                     gamma: float = GAMMA) -> dict[str, torch.Tensor]:
    """Play one episode in each env at once (one batched forward pass per time step).

    Returns:
        The rollout, with all episodes' steps concatenated: ``obs`` (T, 4), ``actions`` (T,),
        ``returns`` (T,) the discounted reward-to-go, ``timesteps`` (T,) the step index within
        its episode, and ``episode_return`` (E,) one total per episode.
    """
    obs = [env.reset() for env in envs]
    seen: list[list[list[float]]] = [[] for _ in envs]
    taken: list[list[int]] = [[] for _ in envs]
    alive = list(range(len(envs)))
    with torch.inference_mode():
        while alive:
            logits = policy(torch.tensor([obs[i] for i in alive], dtype=torch.float32))
            p_right = torch.softmax(logits, dim=-1)[:, 1]
            actions = (torch.rand(len(alive), generator=generator) < p_right).tolist()
            still = []
            for i, right in zip(alive, actions, strict=True):
                seen[i].append(obs[i])
                taken[i].append(int(right))
                obs[i], done = envs[i].step(int(right))
                if not done:
                    still.append(i)
            alive = still
    returns, timesteps = [], []
    for acts in taken:
        n = len(acts)
        # Every reward is 1, so the reward-to-go has a closed form: a geometric sum.
        to_go = torch.arange(n, 0, -1, dtype=torch.float64)
        returns.append(to_go if gamma == 1.0 else (1 - gamma ** to_go) / (1 - gamma))
        timesteps.append(torch.arange(n))
    return {
        "obs": torch.tensor([o for ep in seen for o in ep], dtype=torch.float32),
        "actions": torch.tensor([a for ep in taken for a in ep], dtype=torch.int64),
        "returns": torch.cat(returns).float(),
        "timesteps": torch.cat(timesteps),
        "episode_return": torch.tensor([float(len(a)) for a in taken]),
    }


class Learner:
    """REINFORCE with a per-time-step baseline, on batches of whole episodes.

    The baseline is the batch's mean reward-to-go at the same time step. With the 200-step cap,
    a state-value baseline would blame the last actions of a perfect episode for the small
    returns left before the cap; comparing like time steps does not.
    """

    def __init__(self, seed: int = 0, lr: float = LEARNING_RATE) -> None:
        torch.manual_seed(seed)
        self.policy = Policy()
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=lr)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters to publish."""
        return self.policy.state_dict()

    def update(self, rollouts: Sequence[dict[str, torch.Tensor]]) -> float:
        """One gradient step on the concatenated rollouts. Returns the loss."""
        obs = torch.cat([r["obs"] for r in rollouts])
        actions = torch.cat([r["actions"] for r in rollouts])
        returns = torch.cat([r["returns"] for r in rollouts])
        t = torch.cat([r["timesteps"] for r in rollouts])
        totals = torch.zeros(MAX_STEPS).index_add_(0, t, returns)
        counts = torch.zeros(MAX_STEPS).index_add_(0, t, torch.ones_like(returns))
        advantage = returns - (totals / counts.clamp(min=1))[t]
        # Scaling by the spread keeps the step size steady as returns grow from 10 to 200.
        advantage = advantage / (advantage.std() + 1e-8)
        log_probs = torch.log_softmax(self.policy(obs), dim=-1)
        chosen = log_probs.gather(1, actions[:, None]).squeeze(1)
        loss = -(chosen * advantage).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())


# -- the worker process ----------------------------------------------------------------------------
def run_worker(host: str, port: int, worker_id: int = 0, seed: int = 0,
               envs: int = ENVS_PER_WORKER) -> int:
    """The loop of one worker process: wait for new parameters, play, send the rollout.

    Returns:
        0 once the trainer stops (its server closes the connection); 1 if the server could
        not be reached at all.
    """
    torch.set_num_threads(1)  # several processes share few cores: threads would only contend
    # The connection dropping is how a run ends; the client's warning about it is noise here.
    logging.getLogger("tensorshare").setLevel(logging.ERROR)
    worker_seed = seed * 1000 + worker_id
    generator = torch.Generator().manual_seed(worker_seed)
    rng = random.Random(worker_seed)
    cartpoles = [CartPole(rng) for _ in range(envs)]
    policy = Policy()
    try:
        with RLWorker(host, port, timeout=30.0) as worker:
            params = worker.get_parameters()
            while True:
                if params is None:
                    # Wait for a version newer than the last one played (or the first one).
                    # On-policy: a second rollout with the same parameters would be stale.
                    params = worker.await_new_parameters(timeout=30.0)
                    continue
                policy.load_state_dict(params)
                worker.add_data(collect_episodes(policy, cartpoles, generator))
                params = None
    except (ConnectionLost, Timeout):
        return 0
    except ConnectError as exc:
        # Also what a worker that starts after the trainer has finished sees.
        print(f"worker {worker_id}: {exc} (has the trainer stopped?)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def start_workers(port: int, n: int, seed: int = 0, host: str = "127.0.0.1",
                  envs: int = ENVS_PER_WORKER) -> list[subprocess.Popen[bytes]]:
    """Start ``n`` worker processes (``python -m tensorshare.demo worker ...``)."""
    env = dict(os.environ)
    # The package may not be installed (examples run from a checkout): point the child at it.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = []
    try:
        for i in range(n):
            cmd = [sys.executable, "-m", "tensorshare.demo", "worker", "--host", host,
                   "--port", str(port), "--worker-id", str(i), "--seed", str(seed),
                   "--envs", str(envs)]
            # A new session: Ctrl+C reaches only the trainer, which then stops the workers
            # by closing the server, instead of every worker printing a traceback.
            procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                          start_new_session=True))
    except BaseException:
        stop_workers(procs, grace=0.0)
        raise
    return procs


def stop_workers(procs: Sequence[subprocess.Popen[bytes]], grace: float = 5.0) -> None:
    """Give workers ``grace`` seconds to exit (they do once the server is gone), then kill."""
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# -- the trainer -------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    """How a run went."""

    solved: bool
    seconds: float
    target: float
    versions: int  # parameter versions published
    episodes: int
    samples: int  # environment steps in the rollouts used
    average_return: float  # over the last WINDOW episodes (or fewer, early on)
    dropped: int  # stale rollouts dropped on the server

    def final_line(self) -> str:
        """One line saying whether the run solved CartPole."""
        verdict = (f"solved in {self.seconds:.1f} s" if self.solved
                   else f"not solved in {self.seconds:.1f} s")
        return (f"{verdict}: average return {self.average_return:.1f} over the last "
                f"{WINDOW} episodes (target {self.target:g})")

    def summary(self) -> str:
        """A few lines for the end of a run."""
        return "\n".join([
            f"time              {self.seconds:.1f} s",
            f"versions          {self.versions} published",
            f"episodes          {self.episodes:,} ({self.samples:,} steps)",
            f"stale rollouts    {self.dropped} dropped",
            f"final average     {self.average_return:.1f} (target {self.target:g})",
            f"solved            {'yes' if self.solved else 'no'}",
            self.final_line(),
        ])


def train(workers: int = 3, target: float = 195.0, max_seconds: float = 120.0, seed: int = 0,
          *, envs: int = ENVS_PER_WORKER, progress_every: float = 1.0,
          out: TextIO | None = None) -> TrainResult:
    """Host a server, start ``workers`` worker processes and train until solved or out of time.

    Prints a progress line about every ``progress_every`` seconds to ``out`` (stdout).
    Worker processes are stopped before this returns, whatever happens.
    """
    if workers < 1:
        raise ValueError("workers must be >= 1")
    out = out or sys.stdout
    torch.set_num_threads(1)
    start = time.monotonic()
    deadline = start + max_seconds
    learner = Learner(seed)
    window: deque[float] = deque(maxlen=WINDOW)
    episodes = samples = 0
    # Interval counters for the progress line.
    last_print, last_samples, last_episodes = start, 0, 0
    procs: list[subprocess.Popen[bytes]] = []
    trainer = RLTrainer("127.0.0.1", 0, host_server=True, filter_version=True, timeout=30.0)
    try:
        trainer.publish_parameters(learner.state_dict())
        procs = start_workers(trainer.port, workers, seed, envs=envs)
        print(f"trainer: server on 127.0.0.1:{trainer.port}, {workers} worker processes, "
              f"{envs} episodes per worker per version", file=out, flush=True)
        solved = False
        while not solved:
            now = time.monotonic()
            if now >= deadline:
                break
            # One rollout per worker per version; whoever is late is dropped as stale next
            # time, so a slow or dead worker costs at most this wait, never the run.
            rollouts = trainer.get_data(timeout=min(0.5, deadline - now), min_items=workers)
            if rollouts:
                for r in rollouts:
                    window.extend(r["episode_return"].tolist())
                    episodes += len(r["episode_return"])
                    samples += len(r["actions"])
                solved = len(window) == WINDOW and sum(window) / WINDOW >= target
                if not solved:
                    learner.update(rollouts)
                    trainer.publish_parameters(learner.state_dict())
            elif all(p.poll() is not None for p in procs):
                raise RuntimeError("every worker process exited; see their errors above")
            now = time.monotonic()
            if now - last_print >= progress_every or solved:
                dt = max(now - last_print, 1e-9)
                if episodes:
                    avg = sum(window) / len(window)
                    print(f"{now - start:6.1f}s  version {trainer.version:4d}  "
                          f"{(samples - last_samples) / dt:8,.0f} samples/s  "
                          f"{(episodes - last_episodes) / dt:5.0f} episodes/s  "
                          f"avg return {avg:6.1f}  stale dropped {trainer.dropped}",
                          file=out, flush=True)
                else:
                    print(f"{now - start:6.1f}s  version {trainer.version:4d}  waiting for the "
                          f"first rollouts (workers are starting)", file=out, flush=True)
                last_print, last_samples, last_episodes = now, samples, episodes
        return TrainResult(
            solved=solved, seconds=time.monotonic() - start, target=target,
            versions=trainer.version or 0, episodes=episodes, samples=samples,
            average_return=sum(window) / len(window) if window else 0.0,
            dropped=trainer.dropped)
    finally:
        trainer.stop()  # closes the server: workers get ConnectionLost and exit
        stop_workers(procs)


def run_demo(workers: int = 3, max_seconds: float = 90.0, target: float = 195.0) -> int:
    """The ``tensorshare demo`` command. Returns the exit status: 0 if CartPole was solved."""
    if workers < 1:
        print("tensorshare demo: --workers must be at least 1", file=sys.stderr)
        return 2
    print(f"tensorshare demo: {workers} worker processes play CartPole with the parameters the "
          f"trainer publishes through a tensorshare server;\nthe trainer learns from their "
          f"rollouts until the average return of the last {WINDOW} episodes reaches "
          f"{target:g} (at most {max_seconds:g} s).", flush=True)
    try:
        result = train(workers, target, max_seconds)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print("\nsummary", flush=True)
    print(result.summary(), flush=True)
    return 0 if result.solved else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tensorshare.demo [worker ...]``: the demo, or one worker process of it."""
    p = argparse.ArgumentParser(prog="python -m tensorshare.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command")
    w = sub.add_parser("worker", help="run one worker process (the trainer starts these)")
    w.add_argument("--host", default="127.0.0.1")
    w.add_argument("--port", type=int, required=True)
    w.add_argument("--worker-id", type=int, default=0)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--envs", type=int, default=ENVS_PER_WORKER)
    args = p.parse_args(argv)
    if args.command == "worker":
        return run_worker(args.host, args.port, args.worker_id, args.seed, args.envs)
    return run_demo()


if __name__ == "__main__":
    raise SystemExit(main())
