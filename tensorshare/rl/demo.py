"""``tensorshare demo``: asynchronous distributed RL (IMPALA-style) through a tensorshare server.

Worker processes act without pause: each runs a few environments, plays fixed-length segments
with the newest parameters it has and appends every segment to the rollout bin, tagged with the
parameter version it was played with. Between segments it asks for newer parameters, which
costs one tiny round trip and downloads each version at most once. The trainer consumes a fixed
amount of experience per update (``SEGMENTS_PER_UPDATE`` segments, from whichever workers sent
them), takes a step and publishes; workers never wait for it, nor it for any one of them.

Experience a few versions old is used, not thrown away: the trainer keeps segments at most
``MAX_VERSION_LAG`` versions old (older ones are dropped on the server) and corrects for the
lag with importance weights. The learner is an actor-critic with V-trace targets and a
PPO-style clipped objective ("decoupled" PPO: the clip is taken against the parameters at the
start of the update, and the lag between those and the parameters that acted is corrected by
truncated importance weights ``min(1, pi/mu)``). On fresh experience it is plain PPO with
GAE(lambda).

Environments come from Gymnasium when it is installed (``pip install -e ".[rl]"``):
``Acrobot-v1`` by default, whose step integrates the double pendulum with RK4, so that acting
costs more than learning and workers add throughput; ``CartPole-v1`` and any Gymnasium task
with discrete actions and a vector observation work too. Without Gymnasium a hand-written
CartPole (as in gym's v0: 200 steps, solved at 195) stands in.

Everything lives in this module so that the installed package can run it: ``tensorshare demo``
calls :func:`run_demo`, the examples and ``benchmarks/rl_scaling.py`` call :func:`train`, and
each worker process is ``python -m tensorshare.demo worker --port PORT ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import random
import subprocess
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, SupportsFloat, TextIO

import numpy as np
import torch
from torch import nn

from ..client.blocking import Client
from ..errors import BinNotFound, ConnectError, Timeout, TransportError, is_server_timeout
from .api import RLTrainer, RLWorker, TrainerStopped, stop_bin_for

__all__ = [
    "BUILTIN_CARTPOLE",
    "ActorCritic",
    "Bins",
    "CartPole",
    "Collector",
    "EnvSpec",
    "Learner",
    "NumpyActor",
    "Phase",
    "TrainResult",
    "UpdateStats",
    "default_env",
    "env_spec",
    "have_gymnasium",
    "main",
    "run_demo",
    "run_worker",
    "start_workers",
    "stop_workers",
    "train",
    "vtrace",
]

# -- the hand-written CartPole: Barto, Sutton & Anderson (1983), as in gym's v0 ------------------
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
LAMBDA = 0.95  # V-trace's trace-cutting lambda; GAE's lambda on fresh experience
LEARNING_RATE = 4e-3
HIDDEN = 64
# One pass over each batch, in 4 minibatches: a second pass saved ~10-20% of the samples on
# Acrobot but cost ~75% more learner time per sample, and the learner shares the cores with
# the workers (it is what keeps 2 workers on 2 cores from being twice as fast as one).
EPOCHS = 1
MINIBATCHES = 4
CLIP = 0.2  # PPO's clip range
ENTROPY_COEF = 0.02  # keeps Acrobot exploring through its long -500 plateau
VALUE_COEF = 0.5
MAX_GRAD_NORM = 0.5
ENVS_PER_WORKER = 16  # environments each worker steps together (one forward pass for all)
SEGMENT_STEPS = 64  # time steps per segment: a segment is SEGMENT_STEPS x ENVS_PER_WORKER steps
SEGMENTS_PER_UPDATE = 2  # experience per update, however many workers produce it
MAX_VERSION_LAG = 4  # segments played with parameters at most this many versions old are used
WINDOW = 100  # "solved" is judged on the average return of this many recent episodes
WORKER_TIMEOUT = 10.0  # a worker's per-call timeout: how long it outlives a vanished server
WARMUP_SECONDS = 2.0  # the demo's 1-worker phase, for the speedup it prints

BUILTIN_CARTPOLE = "builtin-CartPole"
DEFAULT_GYM_ENV = "Acrobot-v1"
# The most an episode can return, where we know it: a target above it can never be reached.
BEST_RETURN = {"CartPole-v0": 200.0, "CartPole-v1": 500.0, "Acrobot-v1": 0.0,
               "MountainCar-v0": 0.0, BUILTIN_CARTPOLE: float(MAX_STEPS)}


class Env(Protocol):
    """The part of Gymnasium's ``Env`` API the workers use."""

    def reset(self, *, seed: int | None = None) -> tuple[Any, dict[str, Any]]: ...

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]: ...


class CartPole:
    """The hand-written cart-pole, with Gymnasium's ``reset``/``step`` API (no Gymnasium needed).

    Plain Python floats: for one pole this beats numpy. An episode ends when the cart leaves
    the track or the pole passes 12 degrees (terminated) or after ``MAX_STEPS`` steps
    (truncated); every step rewards 1.

    Args:
        seed: seeds the random start states (``reset(seed=...)`` reseeds).
    """

    observation_size = 4
    n_actions = 2

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)
        self.state = [0.0, 0.0, 0.0, 0.0]
        self.steps = 0

    def reset(self, *, seed: int | None = None) -> tuple[list[float], dict[str, Any]]:
        """Start an episode near upright and still. Returns ``(observation, info)``."""
        if seed is not None:
            self.rng.seed(seed)
        self.state = [self.rng.uniform(-0.05, 0.05) for _ in range(4)]
        self.steps = 0
        return list(self.state), {}

    def step(self, action: int) -> tuple[list[float], float, bool, bool, dict[str, Any]]:
        """Push left (0) or right (1) for one time step.

        Returns:
            ``(observation, reward, terminated, truncated, info)`` as in Gymnasium; the
            observation is ``[x, x_dot, theta, theta_dot]``.
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
        terminated = abs(x) > X_LIMIT or abs(theta) > THETA_LIMIT
        return list(self.state), 1.0, terminated, self.steps >= MAX_STEPS and not terminated, {}


def have_gymnasium() -> bool:
    """Whether Gymnasium can be imported (the ``rl`` extra)."""
    try:
        import gymnasium  # noqa: F401
    except ImportError:
        return False
    return True


def default_env() -> str:
    """``Acrobot-v1`` with Gymnasium, else the hand-written CartPole."""
    return DEFAULT_GYM_ENV if have_gymnasium() else BUILTIN_CARTPOLE


@dataclass(frozen=True)
class EnvSpec:
    """What the trainer and the workers need to know about an environment.

    Attributes:
        name: a Gymnasium id, or ``BUILTIN_CARTPOLE``.
        observation_size, n_actions: a vector observation, discrete actions.
        target: the average return that counts as solved (Gymnasium's reward threshold).
        best_return: the most an episode can return, if known.
    """

    name: str
    observation_size: int
    n_actions: int
    target: float
    best_return: float | None

    def make(self) -> Env:
        """A new instance of the environment (seed it with ``reset(seed=...)``)."""
        if self.name == BUILTIN_CARTPOLE:
            return CartPole()
        import gymnasium

        return gymnasium.make(self.name)


def env_spec(name: str | None = None) -> EnvSpec:
    """Describe environment ``name`` (``None``: :func:`default_env`).

    Raises:
        ImportError: a Gymnasium id was named and Gymnasium is not installed.
        ValueError: the environment does not have discrete actions and a vector observation,
            or has no reward threshold to use as the target.
    """
    name = name or default_env()
    if name == BUILTIN_CARTPOLE:
        return EnvSpec(name, CartPole.observation_size, CartPole.n_actions, 195.0,
                       BEST_RETURN[name])
    try:
        import gymnasium
    except ImportError as exc:
        raise ImportError(f"environment {name!r} needs Gymnasium: pip install -e '.[rl]' "
                          f"(or use {BUILTIN_CARTPOLE!r})") from exc
    env = gymnasium.make(name)
    try:
        obs_space, act_space = env.observation_space, env.action_space
        if not (isinstance(act_space, gymnasium.spaces.Discrete)
                and isinstance(obs_space, gymnasium.spaces.Box) and len(obs_space.shape) == 1):
            raise ValueError(f"{name}: only discrete actions and vector observations are "
                             f"supported (it has {act_space} and {obs_space})")
        threshold = env.spec.reward_threshold if env.spec is not None else None
        if threshold is None:
            raise ValueError(f"{name} has no reward threshold: give a target")
        return EnvSpec(name, int(obs_space.shape[0]), int(act_space.n), float(threshold),
                       BEST_RETURN.get(name))
    finally:
        env.close()


# -- the policy ------------------------------------------------------------------------------------
class ActorCritic(nn.Module):
    """Two MLPs (ReLU, two hidden layers): the policy's logits and the state value.

    Separate networks: a shared trunk learns much worse here, because value targets are
    returns in the hundreds while the policy's signal is normalised advantages. ReLU rather
    than tanh: the same results on these tasks for a third less learner time.
    """

    def __init__(self, observation_size: int, n_actions: int, hidden: int = HIDDEN) -> None:
        super().__init__()
        logits = nn.Linear(hidden, n_actions)
        with torch.no_grad():  # start near uniform: every action gets tried
            logits.weight.mul_(0.01)
            logits.bias.zero_()
        self.pi = nn.Sequential(nn.Linear(observation_size, hidden), nn.ReLU(),
                                nn.Linear(hidden, hidden), nn.ReLU(), logits)
        self.v = nn.Sequential(nn.Linear(observation_size, hidden), nn.ReLU(),
                               nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(logits, value)`` for a batch of observations."""
        return self.pi(obs), self.v(obs).squeeze(-1)


class NumpyActor:
    """The workers' copy of an :class:`ActorCritic`, in numpy.

    For a handful of environments a torch call costs more in overhead than the arithmetic;
    numpy does the same forward pass in a fraction of the time, and acting is the workers'
    whole job.

    Args:
        state_dict: an :class:`ActorCritic`'s parameters, as published by the trainer.

    Raises:
        KeyError: ``state_dict`` is not an :class:`ActorCritic`'s.
    """

    def __init__(self, state_dict: dict[str, torch.Tensor]) -> None:
        def layers(net: str) -> list[tuple[np.ndarray, np.ndarray]]:
            return [(state_dict[f"{net}.{i}.weight"].numpy().astype(np.float32).T.copy(),
                     state_dict[f"{net}.{i}.bias"].numpy().astype(np.float32))
                    for i in (0, 2, 4)]

        self.pi, self.v = layers("pi"), layers("v")
        # A fingerprint of the parameters, sent with each segment: a test can check which
        # parameters really played it, independently of the version tag.
        self.checksum = float(sum(float(t.double().sum()) for t in state_dict.values()))

    @staticmethod
    def _mlp(layers: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
        (w1, b1), (w2, b2), (w3, b3) = layers
        h = np.maximum(x @ w1 + b1, 0.0)
        return np.maximum(h @ w2 + b2, 0.0) @ w3 + b3  # type: ignore[no-any-return]

    def act(self, obs: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Sample one action per row of ``obs``.

        Returns:
            ``(actions, log_probs)``: the actions and the log-probability each had.
        """
        logits = self._mlp(self.pi, obs)
        logits -= logits.max(axis=1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        cdf = np.exp(log_probs).cumsum(axis=1)
        u = rng.random(len(obs))[:, None]
        actions = np.minimum((u > cdf).sum(axis=1), logits.shape[1] - 1)
        return actions, log_probs[np.arange(len(obs)), actions]

    def value(self, obs: np.ndarray) -> np.ndarray:
        """The state values of the rows of ``obs``."""
        return self._mlp(self.v, obs)[:, 0]


# -- the worker side ---------------------------------------------------------------------------------
class Collector:
    """Steps ``n_envs`` environments together and cuts their experience into segments.

    Episodes run across segments: a segment ends after a fixed number of steps, wherever the
    episodes are, and carries the observation after its last step so that the learner can
    bootstrap from it. When an episode is truncated (a time limit, not a failure), the value
    of its last observation, discounted, is added to its last reward: the episode did not end
    there, it was only cut off.

    Args:
        spec: the environment. n_envs: how many to run.
        seed: seeds the environments and the action sampling.
        gamma: the discount (for the truncation bootstrap).
    """

    def __init__(self, spec: EnvSpec, n_envs: int, seed: int, gamma: float = GAMMA) -> None:
        seeds = np.random.SeedSequence(seed).generate_state(n_envs + 1)
        self.envs = [spec.make() for _ in range(n_envs)]
        self.obs = np.stack([np.asarray(env.reset(seed=int(s))[0], dtype=np.float32)
                             for env, s in zip(self.envs, seeds[1:], strict=True)])
        self.rng = np.random.default_rng(int(seeds[0]))
        self.gamma = gamma
        self.episode_return = np.zeros(n_envs)
        self.episode_length = np.zeros(n_envs, dtype=np.int64)

    def collect(self, actor: NumpyActor, steps: int = SEGMENT_STEPS) -> dict[str, Any]:
        """Play ``steps`` steps in every environment with ``actor``.

        Returns:
            The segment: ``obs`` (T+1, E, D) float32, ``actions`` (T, E) int64, ``log_probs``
            (T, E) float32 (the actor's, "mu"), ``rewards`` (T, E) float32, ``dones`` (T, E)
            float32 (1 where an episode ended at that step), ``episode_returns`` and
            ``episode_lengths`` (K,) of the episodes that ended, and ``params_checksum``.
        """
        n = len(self.envs)
        obs = np.empty((steps + 1, n, self.obs.shape[1]), dtype=np.float32)
        actions = np.empty((steps, n), dtype=np.int64)
        log_probs = np.empty((steps, n), dtype=np.float32)
        rewards = np.empty((steps, n), dtype=np.float32)
        dones = np.zeros((steps, n), dtype=np.float32)
        finished: list[float] = []
        lengths: list[int] = []
        for t in range(steps):
            obs[t] = self.obs
            a, lp = actor.act(self.obs, self.rng)
            actions[t], log_probs[t] = a, lp
            nxt = self.obs.copy()
            for i, (env, action) in enumerate(zip(self.envs, a.tolist(), strict=True)):
                o, r, terminated, truncated, _ = env.step(action)
                self.episode_return[i] += float(r)
                self.episode_length[i] += 1
                if terminated or truncated:
                    if truncated and not terminated:
                        last = np.asarray(o, dtype=np.float32)[None]
                        r = float(r) + self.gamma * float(actor.value(last)[0])
                    dones[t, i] = 1.0
                    finished.append(float(self.episode_return[i]))
                    lengths.append(int(self.episode_length[i]))
                    self.episode_return[i], self.episode_length[i] = 0.0, 0
                    o, _ = env.reset()
                rewards[t, i] = r
                nxt[i] = o
            self.obs = nxt
        obs[steps] = self.obs
        return {
            "obs": torch.from_numpy(obs),
            "actions": torch.from_numpy(actions),
            "log_probs": torch.from_numpy(log_probs),
            "rewards": torch.from_numpy(rewards),
            "dones": torch.from_numpy(dones),
            "episode_returns": torch.tensor(finished, dtype=torch.float32),
            "episode_lengths": torch.tensor(lengths, dtype=torch.int64),
            "params_checksum": actor.checksum,
        }


@dataclass(frozen=True)
class Bins:
    """The bins of one run, all under one prefix so that runs sharing a server stay apart."""

    prefix: str

    @property
    def params(self) -> str:
        """The parameters (its version is the parameter version)."""
        return f"{self.prefix}/parameters"

    @property
    def data(self) -> str:
        """The segments, tagged with the version that played them."""
        return f"{self.prefix}/rollouts"

    @property
    def ready(self) -> str:
        """Each worker appends its id once connected: the trainer starts the clock after."""
        return f"{self.prefix}/ready"

    @property
    def active(self) -> str:
        """How many workers may act (ids below it); missing: all. For the demo's warm-up."""
        return f"{self.prefix}/active"

    @property
    def stop(self) -> str:
        """Where the trainer signals the end of the run (see :mod:`tensorshare.rl`)."""
        return stop_bin_for(self.data)

    def all(self) -> list[str]:
        """Every bin of the run."""
        return [self.params, self.data, self.ready, self.active, self.stop]


def _wait_until_active(client: Client, bins: Bins, worker_id: int,
                       parent_alive: Callable[[], bool]) -> bool:
    """Wait (on the server) until the trainer lets worker ``worker_id`` act."""
    try:
        res = client.fetch(bins.active, remove=False)
    except BinNotFound:
        return True  # no warm-up in this run: everyone acts
    active, version = int(res.value), res.version
    while active <= worker_id:
        if not parent_alive():
            return False
        try:  # a server-side wait for the next change; the timeout only paces the check above
            res = client.fetch(bins.active, remove=False, newer_than=version, timeout=1.0)
        except Timeout as exc:
            if not is_server_timeout(exc):
                raise
            continue
        if not res.unchanged:
            active, version = int(res.value), res.version
    return True


def run_worker(host: str, port: int, worker_id: int = 0, seed: int = 0,
               envs: int = ENVS_PER_WORKER, *, env: str | None = None, prefix: str = "rl",
               steps: int = SEGMENT_STEPS, timeout: float = WORKER_TIMEOUT,
               cpu: int | None = None) -> int:
    """The loop of one worker process: act, send each segment, pick up new parameters.

    Args:
        host, port: the server. worker_id: this worker's number (seeds, warm-up order).
        seed: the run's seed. envs: environments stepped together. env: which (see
            :func:`env_spec`). prefix: the run's bins (:class:`Bins`). steps: segment length.
        timeout: per call; with the server gone, the worker gives up after about this long.
        cpu: pin this process to that CPU.

    Returns:
        0 once the trainer signals the end of the run (or its process is gone, or the server
        is); 1 if the server could not be reached at all.
    """
    torch.set_num_threads(1)  # several processes share few cores: threads would only contend
    # Replies are handled by the client's threads, which need the GIL for moments; after
    # CPU-bound acting, CPython's default switch interval (5 ms) made each call wait for it.
    # Measured: 1 ms takes the calls' share of a worker's time from ~35% to ~13%.
    sys.setswitchinterval(0.001)
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})
    # A lost connection while the run winds down is expected; the client's warning is noise.
    logging.getLogger("tensorshare").setLevel(logging.ERROR)
    parent = os.getppid()

    def parent_alive() -> bool:
        # Orphaned (the trainer was killed): nobody will ever signal the end, so stop now.
        return os.getppid() == parent

    bins = Bins(prefix)
    collector = Collector(env_spec(env), envs, seed=seed * 100_003 + worker_id)
    try:
        with RLWorker(host, port, timeout=timeout, params_bin=bins.params,
                      data_bin=bins.data) as worker:
            worker.client.append(bins.ready, worker_id)
            if not _wait_until_active(worker.client, bins, worker_id, parent_alive):
                return 0
            actor, actor_version = None, None
            while parent_alive():
                params = worker.get_parameters()  # one tiny round trip if nothing is new
                if params is None:
                    worker.await_new_parameters(timeout=1.0)
                    continue
                if worker.version != actor_version:
                    actor, actor_version = NumpyActor(params), worker.version
                assert actor is not None
                segment = collector.collect(actor, steps)
                segment["worker"] = worker_id
                segment["downloads"] = worker.downloads  # parameter versions fetched so far
                worker.add_data(segment)  # tagged with actor_version
    except TrainerStopped:
        return 0
    except ConnectError as exc:
        print(f"worker {worker_id}: {exc}", file=sys.stderr)
        return 1
    except (TransportError, Timeout):
        return 0  # the server went away without a word (trainer killed): nothing to do
    except KeyboardInterrupt:
        return 0
    return 0


def start_workers(port: int, n: int, seed: int = 0, host: str = "127.0.0.1",
                  envs: int = ENVS_PER_WORKER, *, env: str | None = None, prefix: str = "rl",
                  first_id: int = 0, cpus: Sequence[int] | None = None,
                  timeout: float = WORKER_TIMEOUT) -> list[subprocess.Popen[bytes]]:
    """Start ``n`` worker processes (``python -m tensorshare.demo worker ...``).

    Args:
        port, host: the server. seed, envs, env, prefix: see :func:`run_worker`.
        first_id: the first worker's id. cpus: pin worker ``i`` to ``cpus[i % len(cpus)]``.
        timeout: each worker's per-call timeout (see :func:`run_worker`).

    Returns:
        The processes; stop them with :func:`stop_workers` after signalling the end.
    """
    env_vars = dict(os.environ)
    # The package may not be installed (examples run from a checkout): point the child at it.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env_vars["PYTHONPATH"] = os.pathsep.join(p for p in (root, env_vars.get("PYTHONPATH")) if p)
    env_vars.setdefault("OMP_NUM_THREADS", "1")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(first_id, first_id + n):
            cmd = [sys.executable, "-m", "tensorshare.demo", "worker", "--host", host,
                   "--port", str(port), "--worker-id", str(i), "--seed", str(seed),
                   "--envs", str(envs), "--env", env or default_env(), "--prefix", prefix,
                   "--timeout", str(timeout)]
            if cpus:
                cmd += ["--cpu", str(cpus[i % len(cpus)])]
            # A new session: Ctrl+C reaches only the trainer, which then ends the run for
            # everyone, instead of every worker printing a traceback.
            procs.append(subprocess.Popen(cmd, env=env_vars, stdin=subprocess.DEVNULL,
                                          start_new_session=True))
    except BaseException:
        stop_workers(procs, grace=0.0)
        raise
    return procs


def stop_workers(procs: Sequence[subprocess.Popen[bytes]], grace: float = 10.0) -> list[int]:
    """Give workers ``grace`` seconds to exit (they do once the end is signalled), then kill.

    Returns:
        Their exit codes (negative: killed by that signal).
    """
    deadline = time.monotonic() + grace
    codes = []
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        codes.append(p.returncode)
    return codes


# -- the learner ----------------------------------------------------------------------------------------
def vtrace(values: torch.Tensor, rewards: torch.Tensor, dones: torch.Tensor,
           rhos: torch.Tensor, gamma: float = GAMMA, lam: float = LAMBDA,
           rho_bar: float = 1.0, c_bar: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace targets (Espeholt et al., 2018, eq. 1), and the advantages they give.

    Args:
        values: (T+1, B) the learner's values of the segment's observations.
        rewards, dones: (T, B). rhos: (T, B) importance ratios pi/mu of the actions taken.
        gamma: discount. lam: trace cutting (lambda). rho_bar, c_bar: truncation levels.

    Returns:
        ``(vs, advantages)``, both (T, B): the value targets, and
        ``r_t + gamma * vs_{t+1} - V(x_t)``. With all ``rhos`` 1 these are the lambda-returns
        and GAE(lambda).
    """
    discounts = gamma * (1.0 - dones)
    clipped_rho = rhos.clamp(max=rho_bar)
    cs = lam * rhos.clamp(max=c_bar)
    deltas = clipped_rho * (rewards + discounts * values[1:] - values[:-1])
    corrections = torch.empty_like(rewards)
    acc = torch.zeros_like(values[0])
    for t in range(rewards.shape[0] - 1, -1, -1):
        acc = deltas[t] + discounts[t] * cs[t] * acc
        corrections[t] = acc
    vs = values[:-1] + corrections
    vs_next = torch.cat([vs[1:], values[-1:]])
    return vs, rewards + discounts * vs_next - values[:-1]


@dataclass
class UpdateStats:
    """What one update did.

    Attributes:
        samples: steps learned from. stale_samples: those played with older parameters.
        weight_by_lag: the mean importance weight ``min(1, pi/mu)`` of the steps, by how many
            versions old their parameters were (0: fresh).
        policy_loss, value_loss, entropy: of the last minibatch.
    """

    samples: int
    stale_samples: int
    weight_by_lag: dict[int, float]
    policy_loss: float
    value_loss: float
    entropy: float


class Learner:
    """Actor-critic with V-trace targets and a decoupled PPO objective, for async experience.

    Per batch: the values and log-probabilities under the current parameters (the
    "proximal" policy) are computed once; ``rho = pi_prox / mu`` measures how far the
    parameters that acted (mu) lag behind. V-trace turns ``rho`` into value targets and
    advantages; the policy loss is PPO's clipped surrogate against ``pi_prox``, each step
    weighted by ``min(1, rho)``. So stale steps count, less where the policy has moved away
    from what was done; fresh steps have weight 1 and this is plain PPO.

    Args:
        observation_size, n_actions: the environment's. seed: initial parameters, shuffling.
        lr, epochs, minibatches, clip, entropy_coef, value_coef, gamma, lam, max_grad_norm:
            the usual PPO hyperparameters.
    """

    def __init__(self, observation_size: int, n_actions: int, seed: int = 0, *,
                 lr: float = LEARNING_RATE, epochs: int = EPOCHS, minibatches: int = MINIBATCHES,
                 clip: float = CLIP, entropy_coef: float = ENTROPY_COEF,
                 value_coef: float = VALUE_COEF, gamma: float = GAMMA, lam: float = LAMBDA,
                 max_grad_norm: float = MAX_GRAD_NORM) -> None:
        torch.manual_seed(seed)
        self.net = ActorCritic(observation_size, n_actions)
        # fused: one kernel for all parameters; the per-tensor loop costs more than the math
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=lr, eps=1e-5, fused=True)
        self.generator = torch.Generator().manual_seed(seed)
        self.epochs, self.minibatches, self.clip = epochs, minibatches, clip
        self.entropy_coef, self.value_coef = entropy_coef, value_coef
        self.gamma, self.lam, self.max_grad_norm = gamma, lam, max_grad_norm

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters to publish."""
        return self.net.state_dict()

    def update(self, segments: Sequence[dict[str, Any]],
               lags: Sequence[int] | None = None) -> UpdateStats:
        """Learn from ``segments`` (as :meth:`Collector.collect` makes them).

        Args:
            lags: per segment, how many versions older than the current parameters the ones
                that played it were (for the statistics only: the correction itself comes
                from the log-probabilities each segment carries).

        Returns:
            What the update did.

        Raises:
            ValueError: no segments, or segments of different lengths.
        """
        if not segments:
            raise ValueError("no segments to learn from")
        if len({int(s["actions"].shape[0]) for s in segments}) != 1:
            raise ValueError("segments must all have the same number of time steps")
        lags = list(lags) if lags is not None else [0] * len(segments)
        obs = torch.cat([s["obs"] for s in segments], dim=1)
        actions = torch.cat([s["actions"] for s in segments], dim=1)
        mu = torch.cat([s["log_probs"] for s in segments], dim=1)
        rewards = torch.cat([s["rewards"] for s in segments], dim=1)
        dones = torch.cat([s["dones"] for s in segments], dim=1)
        lag = torch.cat([torch.full(s["actions"].shape, lg) for s, lg in
                         zip(segments, lags, strict=True)], dim=1)
        steps, width = actions.shape
        with torch.no_grad():
            logits, values = self.net(obs)
            prox = torch.log_softmax(logits[:-1], -1).gather(-1, actions[..., None])[..., 0]
            rhos = torch.exp(prox - mu)
            vs, advantages = vtrace(values, rewards, dones, rhos, self.gamma, self.lam)
            weights = rhos.clamp(max=1.0)
        n = steps * width
        flat_obs = obs[:-1].reshape(n, -1)
        flat = [t.reshape(n) for t in (actions, prox, weights, vs, advantages)]
        f_actions, f_prox, f_weights, f_vs, f_adv = flat
        f_adv = (f_adv - f_adv.mean()) / (f_adv.std() + 1e-8)
        size = n // self.minibatches
        policy_loss = value_loss = entropy = torch.zeros(())
        for _ in range(self.epochs):
            order = torch.randperm(n, generator=self.generator)
            for k in range(self.minibatches):
                idx = order[k * size:(k + 1) * size]
                logits_mb, values_mb = self.net(flat_obs[idx])
                log_probs = torch.log_softmax(logits_mb, -1)
                chosen = log_probs.gather(-1, f_actions[idx, None])[:, 0]
                ratio = torch.exp(chosen - f_prox[idx])
                adv = f_adv[idx]
                surrogate = torch.min(ratio * adv, ratio.clamp(1 - self.clip, 1 + self.clip) * adv)
                policy_loss = -(f_weights[idx] * surrogate).mean()
                value_loss = 0.5 * (values_mb - f_vs[idx]).square().mean()
                entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
                loss = policy_loss + self.value_coef * value_loss - self.entropy_coef * entropy
                self.optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(self.net.parameters(), self.max_grad_norm)
                self.optimizer.step()
        by_lag = {int(lg): float(weights[lag == lg].mean()) for lg in sorted(set(lags))}
        return UpdateStats(samples=n, stale_samples=int((lag > 0).sum()), weight_by_lag=by_lag,
                           policy_loss=policy_loss.item(), value_loss=value_loss.item(),
                           entropy=entropy.item())


# -- the trainer ----------------------------------------------------------------------------------------
@dataclass
class Phase:
    """Throughput while a given number of workers was acting."""

    workers: int
    seconds: float
    steps: int

    @property
    def steps_per_second(self) -> float:
        """Environment steps received by the trainer per second."""
        return self.steps / self.seconds if self.seconds > 0 else 0.0


@dataclass
class TrainResult:
    """How a run went.

    ``seconds`` runs from the first publish, once the workers had started and connected
    (``startup_seconds`` before that), to the end. Steps count the segments the trainer
    received and learned from; ``dropped`` segments (too stale) were played but not used.
    """

    solved: bool
    seconds: float
    target: float
    versions: int  # parameter versions published
    episodes: int
    samples: int  # environment steps in the segments learned from
    average_return: float  # over the last WINDOW episodes (or fewer, early on)
    dropped: int  # segments dropped on the server as too stale
    env: str = ""
    workers: int = 0
    startup_seconds: float = 0.0
    stale_used: int = 0  # segments learned from that older parameters had played
    max_lag: int = 0  # the oldest version lag learned from
    mean_stale_weight: float = 1.0  # their mean importance weight
    phases: list[Phase] = field(default_factory=list)
    worker_exit_codes: list[int] = field(default_factory=list)

    @property
    def steps_per_second(self) -> float:
        """Environment steps learned from per second, over the whole run."""
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    def speedup_line(self) -> str | None:
        """The 1-worker warm-up against the rest of the run, if there were both."""
        if len(self.phases) < 2 or self.phases[0].seconds <= 0 or self.phases[1].seconds <= 0:
            return None
        one, many = self.phases[0], self.phases[-1]
        return (f"{one.workers} worker {one.steps_per_second:,.0f} steps/s, "
                f"{many.workers} workers {many.steps_per_second:,.0f} steps/s: "
                f"{many.steps_per_second / max(one.steps_per_second, 1e-9):.2f}x")

    def final_line(self) -> str:
        """One line saying whether the run reached the target."""
        verdict = (f"solved in {self.seconds:.1f} s" if self.solved
                   else f"not solved in {self.seconds:.1f} s")
        return (f"{verdict}: average return {self.average_return:.1f} over the last "
                f"{WINDOW} episodes (target {self.target:g})")

    def summary(self) -> str:
        """A few lines for the end of a run."""
        lines = [
            f"environment       {self.env}, {self.workers} workers",
            f"time              {self.seconds:.1f} s (after {self.startup_seconds:.1f} s "
            f"starting the workers)",
            f"versions          {self.versions} published",
            f"episodes          {self.episodes:,} ({self.samples:,} steps, "
            f"{self.steps_per_second:,.0f} steps/s)",
        ]
        speedup = self.speedup_line()
        if speedup:
            lines.append(f"speedup           {speedup}")
        lines += [
            f"stale rollouts    {self.stale_used} used with importance weights (mean "
            f"{self.mean_stale_weight:.2f}, up to {self.max_lag} versions old), "
            f"{self.dropped} dropped",
            f"final average     {self.average_return:.1f} (target {self.target:g})",
            f"solved            {'yes' if self.solved else 'no'}",
            self.final_line(),
        ]
        return "\n".join(lines)


def _wait_for_ready(client: Client, bins: Bins, n: int, procs: Sequence[subprocess.Popen[bytes]],
                    deadline: float) -> None:
    """Wait until ``n`` workers said they are connected."""
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"only {got} of {n} workers connected in time")
        try:
            res = client.fetch(bins.ready, remove=True, min_items=n - got, max_items=n - got,
                               timeout=min(left, 0.5))
            got += len(res.value) if res.kind == "list" else 1
        except Timeout as exc:
            if not is_server_timeout(exc):
                raise
        if procs and all(p.poll() is not None for p in procs):
            raise RuntimeError("every worker process exited; see their errors above")


def _parse_server(server: str) -> tuple[str, int]:
    host, sep, port = server.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--server wants HOST:PORT, not {server!r}")
    return host, int(port)


def train(workers: int = 2, target: float | None = None, max_seconds: float = 120.0,
          seed: int = 0, *, env: str | None = None, server: str | None = None,
          warmup: float = 0.0, envs: int = ENVS_PER_WORKER, max_version_lag: int = MAX_VERSION_LAG,
          segments_per_update: int = SEGMENTS_PER_UPDATE, cpus: Sequence[int] | None = None,
          progress_every: float = 1.0, out: TextIO | None = None) -> TrainResult:
    """Start ``workers`` worker processes and train until the target or out of time.

    Args:
        workers: worker processes. target: average return over the last ``WINDOW`` episodes
            that counts as solved (``None``: the environment's). max_seconds: give up then.
        seed: seeds the learner and the workers. env: see :func:`env_spec`.
        server: ``"HOST:PORT"`` of a running server to use; ``None`` hosts one here.
        warmup: with more than one worker, let only one act for this many seconds first, to
            measure the speedup of the rest (:attr:`TrainResult.phases`).
        envs: environments per worker. max_version_lag: see :class:`~tensorshare.RLTrainer`.
        segments_per_update: experience per update.
        cpus: pin worker ``i`` to ``cpus[i % len(cpus)]``.
        progress_every: seconds between progress lines on ``out`` (stdout).

    Returns:
        How it went. The worker processes have exited (or been killed) by then, and with
        ``server`` the run's bins are deleted from it.

    Raises:
        ValueError: a bad argument. ConnectError: ``server`` cannot be reached.
        RuntimeError: the workers could not start, or all died.
    """
    if workers < 1:
        raise ValueError("workers must be >= 1")
    out = out or sys.stdout
    spec = env_spec(env)
    target = spec.target if target is None else target
    torch.set_num_threads(1)
    bins = Bins(f"demo/{uuid.uuid4().hex[:12]}")
    if server is None:
        trainer = RLTrainer("127.0.0.1", 0, host_server=True, max_version_lag=max_version_lag,
                            params_bin=bins.params, data_bin=bins.data, timeout=30.0)
        host, port = "127.0.0.1", trainer.port
    else:
        host, port = _parse_server(server)
        trainer = RLTrainer(host, port, max_version_lag=max_version_lag, params_bin=bins.params,
                            data_bin=bins.data, timeout=30.0)
    segment_steps = SEGMENT_STEPS * envs
    procs: list[subprocess.Popen[bytes]] = []
    codes: list[int] = []
    started = time.monotonic()
    # The hosted server's thread answers the workers while the learner computes: let it have
    # the GIL within a millisecond instead of CPython's default 5 (restored at the end).
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(min(switch_interval, 0.001))
    try:
        staged = warmup > 0 and workers > 1
        if staged:
            trainer.client.put(bins.active, 1)
        procs = start_workers(port, workers, seed, host, envs, env=spec.name,
                              prefix=bins.prefix, cpus=cpus)
        # After the workers: building the first optimizer imports much of torch, which can
        # take a second or two, and the workers spend that long starting anyway.
        learner = Learner(spec.observation_size, spec.n_actions, seed)
        print(f"trainer: server on {host}:{port}, {workers} worker processes x {envs} "
              f"{spec.name} environments, {segments_per_update * segment_steps} steps per "
              f"update, rollouts up to {max_version_lag} versions old used",
              file=out, flush=True)
        _wait_for_ready(trainer.client, bins, workers, procs, started + max(60.0, max_seconds))
        trainer.publish_parameters(learner.state_dict())
        start = time.monotonic()
        startup = start - started
        deadline = start + max_seconds
        window: deque[float] = deque(maxlen=WINDOW)
        episodes = samples = stale_used = max_lag = 0
        stale_weight_sum = 0.0
        batch: list[dict[str, Any]] = []
        lags: list[int] = []
        phases = [Phase(1 if staged else workers, 0.0, 0)]
        phase_start: float | None = start
        activated_at: float | None = None
        seen_since_activation: set[int] = set()
        last_print, last_samples = start, 0
        solved = False
        while not solved:
            now = time.monotonic()
            if now >= deadline:
                break
            if staged and activated_at is None and now - start >= warmup:
                trainer.client.put(bins.active, workers)
                phases[0].seconds = now - start
                activated_at, phase_start = now, None
                phases.append(Phase(workers, 0.0, 0))
            need = segments_per_update - len(batch)
            got = trainer.get_data(return_versions=True, timeout=min(0.5, deadline - now),
                                   min_items=need, max_items=need)
            now = time.monotonic()
            for segment, version in got:
                lag = (trainer.version or 0) - (version or 0)
                batch.append(segment)
                lags.append(lag)
                window.extend(segment["episode_returns"].tolist())
                episodes += len(segment["episode_returns"])
                samples += segment_steps
                if phase_start is not None:
                    phases[-1].steps += segment_steps
                elif activated_at is not None:
                    # The many-worker phase starts once every worker has delivered: the
                    # first segments of the newly active ones were partly played before.
                    seen_since_activation.add(int(segment["worker"]))
                    if len(seen_since_activation) == workers:
                        phase_start = now
            if len(window) == WINDOW and sum(window) / WINDOW >= target:
                solved = True
            elif len(batch) == segments_per_update:
                stats = learner.update(batch, lags)
                for lg, weight in stats.weight_by_lag.items():
                    if lg > 0:  # segments are all the same size: a plain mean over segments
                        stale_used += lags.count(lg)
                        stale_weight_sum += weight * lags.count(lg)
                max_lag = max(max_lag, *lags)
                trainer.publish_parameters(learner.state_dict())
                batch, lags = [], []
            elif not got and all(p.poll() is not None for p in procs):
                raise RuntimeError("every worker process exited; see their errors above")
            if now - last_print >= progress_every or solved:
                dt = max(now - last_print, 1e-9)
                avg = sum(window) / len(window) if window else float("nan")
                active = 1 if staged and activated_at is None else workers
                print(f"{now - start:6.1f}s  version {trainer.version:5d}  "
                      f"{(samples - last_samples) / dt:8,.0f} steps/s  {active} acting  "
                      f"avg return {avg:7.1f}  stale used {stale_used}  dropped "
                      f"{trainer.dropped}", file=out, flush=True)
                last_print, last_samples = now, samples
        end = time.monotonic()
        if phase_start is not None:
            phases[-1].seconds = end - phase_start if len(phases) > 1 else end - start
        result = TrainResult(
            solved=solved, seconds=end - start, target=target, versions=trainer.version or 0,
            episodes=episodes, samples=samples,
            average_return=sum(window) / len(window) if window else 0.0,
            dropped=trainer.dropped, env=spec.name, workers=workers, startup_seconds=startup,
            stale_used=stale_used, max_lag=max_lag,
            mean_stale_weight=stale_weight_sum / stale_used if stale_used else 1.0,
            phases=phases)
    finally:
        with contextlib.suppress(TransportError):
            trainer.signal_stop()  # workers raise TrainerStopped and exit
        codes = stop_workers(procs)
        if server is not None:
            with contextlib.suppress(TransportError):
                for name in bins.all():
                    trainer.client.delete(name)
        trainer.stop()
        sys.setswitchinterval(switch_interval)
    result.worker_exit_codes = codes
    return result


# -- the demo command ---------------------------------------------------------------------------------
def _resolve_target(spec: EnvSpec, target: float | None, out: TextIO) -> float:
    if target is None:
        return spec.target
    if spec.best_return is not None and target > spec.best_return:
        # e.g. CartPole's 195 asked of Acrobot, whose returns are at most 0: never reached.
        print(f"target {target:g} is above the best return {spec.name} allows "
              f"({spec.best_return:g}); using its own target, {spec.target:g}", file=out)
        return spec.target
    return target


def run_demo(workers: int = 3, max_seconds: float = 90.0, target: float | None = None, *,
             server: str | None = None, env: str | None = None,
             warmup: float | None = None) -> int:
    """The ``tensorshare demo`` command.

    Args:
        workers: worker processes. max_seconds: give up after this long.
        target: the average return to reach (``None``: the environment's).
        server: ``"HOST:PORT"`` of a running server (a cluster smoke test); ``None`` hosts
            one in this process.
        env: the environment (``None``: ``Acrobot-v1`` with Gymnasium, else the built-in
            CartPole). warmup: seconds of 1-worker warm-up, to show the speedup of the
            others (default ``WARMUP_SECONDS`` with more than one worker).

    Returns:
        The exit status: 0 if the target was reached, 1 if not, 2 for bad arguments.
    """
    if workers < 1:
        print("tensorshare demo: --workers must be at least 1", file=sys.stderr)
        return 2
    if server is not None:
        try:
            _parse_server(server)
        except ValueError as exc:
            print(f"tensorshare demo: {exc}", file=sys.stderr)
            return 2
    if env is None and not have_gymnasium():
        print(f"Gymnasium is not installed (pip install -e '.[rl]'): using the built-in "
              f"CartPole instead of {DEFAULT_GYM_ENV}", flush=True)
    try:
        spec = env_spec(env)
    except (ImportError, ValueError) as exc:
        print(f"tensorshare demo: {exc}", file=sys.stderr)
        return 2
    target = _resolve_target(spec, target, sys.stdout)
    if warmup is None:
        warmup = WARMUP_SECONDS if workers > 1 else 0.0
    where = f"the server at {server}" if server else "a tensorshare server in this process"
    print(f"tensorshare demo: {workers} worker processes play {spec.name} without pause, each "
          f"with the newest parameters it has,\nand send their experience through {where}; "
          f"the trainer learns from it until the average return of the last {WINDOW} episodes "
          f"reaches {target:g} (at most {max_seconds:g} s)."
          + (f"\nFor comparison, only one worker acts for the first {warmup:g} s."
             if warmup > 0 and workers > 1 else ""), flush=True)
    try:
        result = train(workers, target, max_seconds, env=spec.name, server=server,
                       warmup=warmup)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except ConnectError as exc:
        print(f"tensorshare demo: {exc}", file=sys.stderr)
        return 1
    print("\nsummary", flush=True)
    print(result.summary(), flush=True)
    return 0 if result.solved else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tensorshare.demo [worker ...]``: the demo, or one worker process of it."""
    p = argparse.ArgumentParser(prog="python -m tensorshare.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    p.add_argument("--max-seconds", type=float, default=90.0, help="stop after this long")
    p.add_argument("--target", type=float, default=None,
                   help="average return to reach (default: the environment's)")
    p.add_argument("--env", default=None, help=f"Gymnasium id or {BUILTIN_CARTPOLE} "
                   f"(default {DEFAULT_GYM_ENV} with Gymnasium)")
    p.add_argument("--server", default=None, metavar="HOST:PORT",
                   help="use this running server instead of hosting one")
    p.add_argument("--warmup", type=float, default=None,
                   help=f"seconds of 1-worker warm-up (default {WARMUP_SECONDS:g})")
    sub = p.add_subparsers(dest="command")
    w = sub.add_parser("worker", help="run one worker process (the trainer starts these)")
    w.add_argument("--host", default="127.0.0.1")
    w.add_argument("--port", type=int, required=True)
    w.add_argument("--worker-id", type=int, default=0)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--envs", type=int, default=ENVS_PER_WORKER)
    w.add_argument("--env", default=None)
    w.add_argument("--prefix", default="rl")
    w.add_argument("--timeout", type=float, default=WORKER_TIMEOUT)
    w.add_argument("--cpu", type=int, default=None)
    args = p.parse_args(argv)
    if args.command == "worker":
        return run_worker(args.host, args.port, args.worker_id, args.seed, args.envs,
                          env=args.env, prefix=args.prefix, timeout=args.timeout, cpu=args.cpu)
    return run_demo(args.workers, args.max_seconds, args.target, server=args.server,
                    env=args.env, warmup=args.warmup)


if __name__ == "__main__":
    status = main()
    if sys.argv[1:2] == ["worker"]:
        # A worker has nothing left to tidy (its connection is closed), and the interpreter's
        # teardown of torch takes most of a second: the trainer would wait for it, per run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    raise SystemExit(status)
