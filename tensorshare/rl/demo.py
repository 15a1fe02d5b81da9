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

The learner is :mod:`tensorshare.rl.learner` and the environments :mod:`tensorshare.rl.envs`;
this module runs them: ``tensorshare demo`` calls :func:`run_demo`, the examples and
``benchmarks/rl_scaling.py`` call :func:`train`, and each worker process is
``python -m tensorshare.demo worker --port PORT ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import subprocess
import sys
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO, cast

import numpy as np
import torch

from ..client.blocking import Client
from ..client.ops import BinClient
from ..errors import BinNotFound, ConnectError, Timeout, TransportError, is_server_timeout
from .api import RLTrainer, RLWorker, TrainerStopped, stop_bin_for
from .envs import BUILTIN_CARTPOLE, DEFAULT_GYM_ENV, EnvSpec, default_env, env_spec, have_gymnasium
from .learner import (
    SEGMENT_STEPS,
    ActorCritic,
    Collector,
    Learner,
    NumpyActor,
    sample_actions,
)

__all__ = [
    "ENVS_PER_WORKER",
    "MAX_VERSION_LAG",
    "SEGMENTS_PER_UPDATE",
    "WARMUP_SECONDS",
    "WINDOW",
    "WORKER_TIMEOUT",
    "Bins",
    "Phase",
    "TrainResult",
    "main",
    "run_demo",
    "run_worker",
    "start_workers",
    "stop_workers",
    "train",
]

ENVS_PER_WORKER = 16  # environments each worker steps together (one forward pass for all)
SEGMENTS_PER_UPDATE = 2  # experience per update, however many workers produce it
MAX_VERSION_LAG = 4  # segments played with parameters at most this many versions old are used
WINDOW = 100  # "solved" is judged on the average return of this many recent episodes
WORKER_TIMEOUT = 10.0  # a worker's per-call timeout: how long it outlives a vanished server
WARMUP_SECONDS = 2.0  # the demo's 1-worker phase, for the speedup it prints


# -- the run's bins ------------------------------------------------------------------------------------
#: The bins of a run: each one's attribute of :class:`Bins` -> its name under the run's prefix.
_BIN_NAMES = {"params": "parameters", "data": "rollouts", "policy": "policy", "ready": "ready",
              "active": "active"}


@dataclass(frozen=True)
class Bins:
    """The bins of one run, all under one prefix so that runs sharing a server stay apart.

    Attributes:
        params: the parameters (its version is the parameter version).
        data: the segments, tagged with the version that played them.
        policy: the service bin of the policy, with central inference (``central=True``).
        ready: each worker appends its id once connected: the trainer starts the clock after.
        active: how many workers may act (ids below it); missing: all. For the demo's warm-up.
        stop: where the trainer signals the end of the run (see :mod:`tensorshare.rl`).
    """

    prefix: str
    params: str = field(init=False)
    data: str = field(init=False)
    policy: str = field(init=False)
    ready: str = field(init=False)
    active: str = field(init=False)
    stop: str = field(init=False)

    def __post_init__(self) -> None:
        for attr, name in _BIN_NAMES.items():
            object.__setattr__(self, attr, f"{self.prefix}/{name}")
        object.__setattr__(self, "stop", stop_bin_for(self.data))

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



# -- the workers ----------------------------------------------------------------------------------
def _settle_worker_process(cpu: int | None) -> None:
    """Ready this process to share few cores with others: one thread, quick GIL hand-offs."""
    torch.set_num_threads(1)  # several processes share few cores: threads would only contend
    # Replies are handled by the client's threads, which need the GIL for moments; after
    # CPU-bound acting, CPython's default switch interval (5 ms) made each call wait for it.
    # Measured: 1 ms takes the calls' share of a worker's time from ~35% to ~13%.
    sys.setswitchinterval(0.001)
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})
    # A lost connection while the run winds down is expected; the client's warning is noise.
    logging.getLogger("tensorshare").setLevel(logging.ERROR)


def _play(worker: RLWorker, collector: Collector, worker_id: int, steps: int,
          parent_alive: Callable[[], bool]) -> None:
    """Act and send segments, with the newest parameters, until the trainer's process is gone.

    Raises what ``worker`` raises: :class:`TrainerStopped` at the end of the run.
    """
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


class RemoteActor:
    """Acts through the run's :class:`~tensorshare.inference.InferenceHost`: one call per step
    for all of a worker's environments, answered in a batch with the other workers' calls.

    Records the parameter version of each answer (``versions``): a segment is tagged with the
    oldest one that played it.
    """

    def __init__(self, client: Any, worker: RLWorker) -> None:
        self.client = client
        self.worker = worker
        self.versions: list[int | None] = []
        self.checksum = 0.0  # (the parameters live in the host: the version tells them apart)

    def _call(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.worker.trainer_stopped:  # the run is over: the host may be gone already
            raise TrainerStopped("the trainer signalled the end of the run")
        (logits, value), version = self.client.predict(torch.from_numpy(obs), batched=True,
                                                       return_version=True)
        self.versions.append(version)
        return logits.numpy().astype(np.float64), value.numpy()

    def act(self, obs: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        logits, _ = self._call(obs)
        return sample_actions(logits, rng)

    def value(self, obs: np.ndarray) -> np.ndarray:
        return self._call(obs)[1]


def _play_central(worker: RLWorker, collector: Collector, worker_id: int, steps: int,
                  parent_alive: Callable[[], bool], actor: RemoteActor) -> None:
    """Act through the inference host and send segments tagged with the oldest version that
    played them, until the trainer's process is gone."""
    while parent_alive():
        actor.versions.clear()
        segment = collector.collect(actor, steps)
        versions = actor.versions
        version = None if None in versions else min(cast(list[int], versions))
        segment["worker"] = worker_id
        segment["downloads"] = len(set(versions))
        worker.add_data(segment, version=version)  # untagged (no parameters yet): dropped


def run_worker(host: str, port: int, worker_id: int = 0, seed: int = 0,
               envs: int = ENVS_PER_WORKER, *, env: str | None = None, prefix: str = "rl",
               steps: int = SEGMENT_STEPS, timeout: float = WORKER_TIMEOUT,
               cpu: int | None = None, central: bool = False) -> int:
    """The loop of one worker process: act, send each segment, pick up new parameters.

    Args:
        host, port: the server. worker_id: this worker's number (seeds, warm-up order).
        seed: the run's seed. envs: environments stepped together. env: which (see
            :func:`~tensorshare.rl.envs.env_spec`). prefix: the run's bins (:class:`Bins`).
            steps: segment length.
        timeout: per call; with the server gone, the worker gives up after about this long.
        cpu: pin this process to that CPU.
        central: act through the run's inference host (service bin ``Bins.policy``)
            instead of a local copy of the parameters.

    Returns:
        0 once the trainer signals the end of the run (or its process is gone, or the server
        is); 1 if the server could not be reached at all.
    """
    _settle_worker_process(cpu)
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
            if central:
                from ..inference import InferenceClient

                with InferenceClient(bins.policy, host, port, timeout=timeout) as pc:
                    _play_central(worker, collector, worker_id, steps, parent_alive,
                                  RemoteActor(pc, worker))
            else:
                _play(worker, collector, worker_id, steps, parent_alive)
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
                  timeout: float = WORKER_TIMEOUT,
                  central: bool = False) -> list[subprocess.Popen[bytes]]:
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
            if central:
                cmd.append("--central")
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


def _wait_for_ready(client: BinClient, bins: Bins, n: int, procs: Sequence[subprocess.Popen[bytes]],
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
    """``--server`` as the clients spell an address (``HOST:PORT`` or a URL), as ``(host,
    port)`` for the trainer and the workers (a URL stays the host: its scheme counts)."""
    from ..client.endpoint import resolve

    where = None
    if "://" in server or ":" in server:
        try:
            where = resolve(server).address
        except ValueError:
            pass
    if where is None or (where.path is None and not 0 < where.port < 65536):
        raise ValueError(f"--server wants HOST:PORT, tensorshare://HOST:PORT, "
                         f"tensorshare+tls://HOST:PORT or unix://PATH, not {server!r}")
    return (server if "://" in server else where.host), where.port


@dataclass(frozen=True)
class _Settings:
    """The arguments of one :func:`train` call, resolved."""

    spec: EnvSpec
    workers: int
    target: float
    max_seconds: float
    seed: int
    warmup: float
    envs: int
    max_version_lag: int
    segments_per_update: int
    cpus: Sequence[int] | None
    progress_every: float
    out: TextIO
    central: bool = False

    @property
    def staged(self) -> bool:
        """Whether the run starts with a warm-up in which only one worker acts."""
        return self.warmup > 0 and self.workers > 1

    @property
    def segment_steps(self) -> int:
        """Environment steps in one segment."""
        return SEGMENT_STEPS * self.envs


def _open_trainer(server: str | None, bins: Bins,
                  max_version_lag: int) -> tuple[RLTrainer, str, int]:
    """Host a server in this process (``server`` is ``None``) or connect to ``server``.

    Returns:
        The trainer, and the host and port the workers are to use.
    """
    if server is None:
        trainer = RLTrainer("127.0.0.1", 0, host_server=True, max_version_lag=max_version_lag,
                            params_bin=bins.params, data_bin=bins.data, timeout=30.0)
        return trainer, "127.0.0.1", trainer.port
    host, port = _parse_server(server)
    trainer = RLTrainer(host, port, max_version_lag=max_version_lag, params_bin=bins.params,
                        data_bin=bins.data, timeout=30.0)
    return trainer, host, port


class _Run:
    """The trainer's side of one run: the server, the run's bins and the worker processes.

    Made, it has a trainer (a server hosted here, or a connection to ``server``); as a context
    manager it ends the run on the way out, however it ends: signals the end, waits for the
    workers (or kills them), deletes the run's bins from a server it does not host, and stops
    the trainer.
    """

    def __init__(self, cfg: _Settings, server: str | None) -> None:
        self.cfg = cfg
        self.bins = Bins(f"demo/{uuid.uuid4().hex[:12]}")
        self.tidy = server is not None  # a server that outlives the run keeps none of its bins
        self.trainer, self.host, self.port = _open_trainer(server, self.bins, cfg.max_version_lag)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.inference: Any = None  # the policy's InferenceHost, with central inference
        self.exit_codes: list[int] = []
        self.started = time.monotonic()
        self._switch_interval = sys.getswitchinterval()

    def __enter__(self) -> _Run:
        # The hosted server's thread answers the workers while the learner computes: let it
        # have the GIL within a millisecond instead of CPython's default 5 (restored at the end).
        sys.setswitchinterval(min(self._switch_interval, 0.001))
        return self

    def __exit__(self, *exc_info: object) -> None:
        with contextlib.suppress(TransportError):
            self.trainer.signal_stop()  # workers raise TrainerStopped and exit
        self.exit_codes = stop_workers(self.procs)
        if self.inference is not None:
            self.inference.stop()
        if self.tidy:
            with contextlib.suppress(TransportError):
                for name in self.bins.all():
                    self.trainer.client.delete(name)
        self.trainer.stop()
        sys.setswitchinterval(self._switch_interval)

    def start(self) -> Learner:
        """Start the workers (only worker 0 acting, with a warm-up) and wait for them.

        Returns:
            The learner, built while the workers start.

        Raises:
            RuntimeError: the workers did not all connect in time, or all exited.
        """
        cfg = self.cfg
        if cfg.staged:
            self.trainer.client.put(self.bins.active, 1)
        if cfg.central:
            from ..inference import InferenceHost

            # The policy answers every worker's step in batches, and loads each version the
            # learner publishes between batches.
            self.inference = InferenceHost(
                self.bins.policy, ActorCritic(cfg.spec.observation_size, cfg.spec.n_actions),
                self.host, self.port, max_batch=1024, max_wait_ms=1.0,
                params_bin=self.bins.params).start()
        self.procs = start_workers(self.port, cfg.workers, cfg.seed, self.host, cfg.envs,
                                   env=cfg.spec.name, prefix=self.bins.prefix, cpus=cfg.cpus,
                                   central=cfg.central)
        # After the workers: building the first optimizer imports much of torch, which can
        # take a second or two, and the workers spend that long starting anyway.
        learner = Learner(cfg.spec.observation_size, cfg.spec.n_actions, cfg.seed)
        print(f"trainer: server on {self.host}:{self.port}, {cfg.workers} worker processes x "
              f"{cfg.envs} {cfg.spec.name} environments, "
              f"{cfg.segments_per_update * cfg.segment_steps} steps per update, rollouts up to "
              f"{cfg.max_version_lag} versions old used", file=cfg.out, flush=True)
        _wait_for_ready(self.trainer.client, self.bins, cfg.workers, self.procs,
                        self.started + max(60.0, cfg.max_seconds))
        return learner


class _Phases:
    """The warm-up (one worker acting) and the rest of the run, timed for the speedup.

    The many-worker phase starts once every worker has delivered after the warm-up: the first
    segments of the newly active ones were partly played before.
    """

    def __init__(self, cfg: _Settings, start: float) -> None:
        self.cfg, self.start = cfg, start
        self.phases = [Phase(1 if cfg.staged else cfg.workers, 0.0, 0)]
        self.phase_start: float | None = start  # of the phase that is counting steps
        self.activated_at: float | None = None  # when the warm-up ended
        self.seen_since_activation: set[int] = set()

    @property
    def acting(self) -> int:
        """How many workers may act now."""
        return 1 if self.cfg.staged and self.activated_at is None else self.cfg.workers

    def warmup_over(self, now: float) -> bool:
        """Whether the warm-up has run its time and not been ended yet."""
        return (self.cfg.staged and self.activated_at is None
                and now - self.start >= self.cfg.warmup)

    def end_warmup(self, now: float) -> None:
        """Every worker acts from ``now`` on."""
        self.phases[0].seconds = now - self.start
        self.activated_at, self.phase_start = now, None
        self.phases.append(Phase(self.cfg.workers, 0.0, 0))

    def received(self, segment: dict[str, Any], now: float) -> None:
        """Count a segment the trainer received at ``now``."""
        if self.phase_start is not None:
            self.phases[-1].steps += self.cfg.segment_steps
        elif self.activated_at is not None:
            self.seen_since_activation.add(int(segment["worker"]))
            if len(self.seen_since_activation) == self.cfg.workers:
                self.phase_start = now

    def close(self, end: float) -> list[Phase]:
        """End the last phase at ``end``. Returns the phases."""
        if self.phase_start is not None:
            self.phases[-1].seconds = (end - self.phase_start if len(self.phases) > 1
                                       else end - self.start)
        return self.phases


class _Learning:
    """The timed part of a run: learn from the workers' segments until solved or out of time."""

    def __init__(self, run: _Run, learner: Learner, start: float) -> None:
        self.run, self.cfg, self.trainer, self.learner = run, run.cfg, run.trainer, learner
        self.start, self.deadline = start, start + run.cfg.max_seconds
        self.phases = _Phases(run.cfg, start)
        self.window: deque[float] = deque(maxlen=WINDOW)
        self.episodes = self.samples = self.stale_used = self.max_lag = 0
        self.stale_weight_sum = 0.0
        self.batch: list[dict[str, Any]] = []
        self.lags: list[int] = []
        self.last_print, self.last_samples = start, 0

    def loop(self) -> bool:
        """Receive, learn and publish until the target is reached (``True``) or time is up."""
        solved = False
        while not solved:
            now = time.monotonic()
            if now >= self.deadline:
                break
            if self.phases.warmup_over(now):
                self.trainer.client.put(self.run.bins.active, self.cfg.workers)
                self.phases.end_warmup(now)
            got = self._receive(now)
            now = time.monotonic()
            for segment, version in got:
                self._count(segment, (self.trainer.version or 0) - (version or 0), now)
            if len(self.window) == WINDOW and sum(self.window) / WINDOW >= self.cfg.target:
                solved = True
            elif len(self.batch) == self.cfg.segments_per_update:
                self._update()
            elif not got and all(p.poll() is not None for p in self.run.procs):
                raise RuntimeError("every worker process exited; see their errors above")
            if now - self.last_print >= self.cfg.progress_every or solved:
                self._print_progress(now)
        return solved

    def _receive(self, now: float) -> list[tuple[Any, int | None]]:
        """Wait (briefly) for the segments that complete the batch: those that came."""
        need = self.cfg.segments_per_update - len(self.batch)
        return self.trainer.get_data(return_versions=True, timeout=min(0.5, self.deadline - now),
                                     min_items=need, max_items=need)

    def _count(self, segment: dict[str, Any], lag: int, now: float) -> None:
        """Add a segment, played ``lag`` versions ago, to the batch and the statistics."""
        self.batch.append(segment)
        self.lags.append(lag)
        self.window.extend(segment["episode_returns"].tolist())
        self.episodes += len(segment["episode_returns"])
        self.samples += self.cfg.segment_steps
        self.phases.received(segment, now)

    def _update(self) -> None:
        """Learn from the batch, publish the new parameters, start the next batch."""
        stats = self.learner.update(self.batch, self.lags)
        for lg, weight in stats.weight_by_lag.items():
            if lg > 0:  # segments are all the same size: a plain mean over segments
                self.stale_used += self.lags.count(lg)
                self.stale_weight_sum += weight * self.lags.count(lg)
        self.max_lag = max(self.max_lag, *self.lags)
        self.trainer.publish_parameters(self.learner.state_dict())
        self.batch, self.lags = [], []

    def _print_progress(self, now: float) -> None:
        dt = max(now - self.last_print, 1e-9)
        avg = sum(self.window) / len(self.window) if self.window else float("nan")
        print(f"{now - self.start:6.1f}s  version {self.trainer.version:5d}  "
              f"{(self.samples - self.last_samples) / dt:8,.0f} steps/s  "
              f"{self.phases.acting} acting  avg return {avg:7.1f}  stale used "
              f"{self.stale_used}  dropped {self.trainer.dropped}", file=self.cfg.out, flush=True)
        self.last_print, self.last_samples = now, self.samples

    def result(self, solved: bool, end: float) -> TrainResult:
        """How the run went, if it ended at ``end``."""
        cfg, trainer, window = self.cfg, self.trainer, self.window
        return TrainResult(
            solved=solved, seconds=end - self.start, target=cfg.target,
            versions=trainer.version or 0, episodes=self.episodes, samples=self.samples,
            average_return=sum(window) / len(window) if window else 0.0,
            dropped=trainer.dropped, env=cfg.spec.name, workers=cfg.workers,
            startup_seconds=self.start - self.run.started, stale_used=self.stale_used,
            max_lag=self.max_lag,
            mean_stale_weight=self.stale_weight_sum / self.stale_used if self.stale_used else 1.0,
            phases=self.phases.close(end))


def _learn(run: _Run, learner: Learner) -> TrainResult:
    """Publish the first parameters, then learn until the target is reached or time is up."""
    run.trainer.publish_parameters(learner.state_dict())
    learning = _Learning(run, learner, start=time.monotonic())
    solved = learning.loop()
    return learning.result(solved, end=time.monotonic())


def train(workers: int = 2, target: float | None = None, max_seconds: float = 120.0,
          seed: int = 0, *, env: str | None = None, server: str | None = None,
          warmup: float = 0.0, envs: int = ENVS_PER_WORKER, max_version_lag: int = MAX_VERSION_LAG,
          segments_per_update: int = SEGMENTS_PER_UPDATE, cpus: Sequence[int] | None = None,
          progress_every: float = 1.0, out: TextIO | None = None,
          central: bool = False) -> TrainResult:
    """Start ``workers`` worker processes and train until the target or out of time.

    Args:
        workers: worker processes. target: average return over the last ``WINDOW`` episodes
            that counts as solved (``None``: the environment's). max_seconds: give up then.
        seed: seeds the learner and the workers. env: see
            :func:`~tensorshare.rl.envs.env_spec`.
        server: ``"HOST:PORT"`` of a running server to use; ``None`` hosts one here.
        warmup: with more than one worker, let only one act for this many seconds first, to
            measure the speedup of the rest (:attr:`TrainResult.phases`).
        envs: environments per worker. max_version_lag: see :class:`~tensorshare.RLTrainer`.
        segments_per_update: experience per update.
        cpus: pin worker ``i`` to ``cpus[i % len(cpus)]``.
        progress_every: seconds between progress lines on ``out`` (stdout).
        central: the workers act through one :class:`~tensorshare.inference.InferenceHost`
            in this process (batched inference over a service bin) instead of each running
            its own copy of the policy.

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
    cfg = _Settings(spec, workers, spec.target if target is None else target, max_seconds, seed,
                    warmup, envs, max_version_lag, segments_per_update, cpus, progress_every, out,
                    central)
    torch.set_num_threads(1)
    with _Run(cfg, server) as run:  # a server hosted here, or a connection to one
        learner = run.start()  # the workers, connected; the learner
        result = _learn(run, learner)  # the warm-up, the learning loop
    result.worker_exit_codes = run.exit_codes  # the run is over: every worker has exited
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
    w.add_argument("--central", action="store_true",
                   help="act through the run's inference host (the policy's service bin)")
    args = p.parse_args(argv)
    if args.command == "worker":
        return run_worker(args.host, args.port, args.worker_id, args.seed, args.envs,
                          env=args.env, prefix=args.prefix, timeout=args.timeout, cpu=args.cpu,
                          central=args.central)
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
