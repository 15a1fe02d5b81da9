"""The asynchronous RL machinery of ``tensorshare.demo`` against a real server, without timing.

Worker processes play the built-in CartPole (no Gymnasium needed): what is checked is who
played what with which parameters, what the trainer keeps, and that every process ends.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tensorshare import Client, EmbeddedServer, RLTrainer, RLWorker
from tensorshare.rl.demo import Bins, _resolve_target, start_workers, stop_workers, train
from tensorshare.rl.envs import BUILTIN_CARTPOLE, env_spec
from tensorshare.rl.learner import Collector, Learner, NumpyActor
from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parents[2]
SPEC = env_spec(BUILTIN_CARTPOLE)
torch.set_num_threads(1)  # the learner steps here share two cores with the workers


def _checksum(state: dict[str, torch.Tensor]) -> float:
    return NumpyActor(state).checksum


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    stop_workers(started, grace=0.0)  # whatever a failing test left: killed


@pytest.mark.timeout(90)
def test_workers_tag_segments_with_the_parameters_that_played_them(
        server: EmbeddedServer, procs: list[subprocess.Popen[bytes]]) -> None:
    bins = Bins("t1")
    learner = Learner(SPEC.observation_size, SPEC.n_actions, seed=0)
    with RLTrainer("127.0.0.1", server.port, max_version_lag=10, params_bin=bins.params,
                   data_bin=bins.data) as trainer:
        checksums = {trainer.publish_parameters(learner.state_dict()):
                     _checksum(learner.state_dict())}
        procs += start_workers(server.port, 2, env=BUILTIN_CARTPOLE, envs=2, prefix=bins.prefix)
        tags: dict[int, list[int]] = defaultdict(list)
        downloads: dict[int, list[int]] = defaultdict(list)
        while len(checksums) < 6:  # publish a new version after every segment received
            (segment, tag), = trainer.get_data(return_versions=True, timeout=60, max_items=1)
            assert segment["params_checksum"] == pytest.approx(checksums[tag], rel=1e-6)
            tags[int(segment["worker"])].append(tag)
            downloads[int(segment["worker"])].append(int(segment["downloads"]))
            learner.update([segment])
            checksums[trainer.publish_parameters(learner.state_dict())] = \
                _checksum(learner.state_dict())
        # Both workers keep acting and move on to newer parameters as they are published.
        newest = max(checksums)
        while not all(ts and ts[-1] == newest for ts in (tags[0], tags[1])):
            (segment, tag), = trainer.get_data(return_versions=True, timeout=60, max_items=1)
            assert segment["params_checksum"] == pytest.approx(checksums[tag], rel=1e-6)
            tags[int(segment["worker"])].append(tag)
            downloads[int(segment["worker"])].append(int(segment["downloads"]))
        for ts in tags.values():
            assert ts == sorted(ts)  # a worker never goes back to older parameters
        # One download per version played with, no more: every segment says how many
        # versions its worker had fetched by then.
        for worker, ts in tags.items():
            assert downloads[worker] == [len(set(ts[:i + 1])) for i in range(len(ts))]
        trainer.signal_stop()
        assert stop_workers(procs) == [0, 0]
    with Client("127.0.0.1", server.port) as c:
        assert c.peek(bins.stop) == newest


def test_stale_but_allowed_segments_are_weighted_and_older_ones_dropped(
        server: EmbeddedServer) -> None:
    bins = Bins("t2")
    learner = Learner(SPEC.observation_size, SPEC.n_actions, seed=0, lr=3e-3)
    collector = Collector(SPEC, n_envs=4, seed=0)
    with RLTrainer("127.0.0.1", server.port, max_version_lag=2, params_bin=bins.params,
                   data_bin=bins.data) as trainer, \
            RLWorker("127.0.0.1", server.port, params_bin=bins.params,
                     data_bin=bins.data) as worker:
        for version in range(1, 5):  # one segment played with each of versions 1..4
            assert trainer.publish_parameters(learner.state_dict()) == version
            params = worker.get_parameters()
            assert worker.version == version
            segment = collector.collect(NumpyActor(params), steps=32)
            worker.add_data(segment)
            learner.update([segment])  # the policy moves on
        trainer.publish_parameters(learner.state_dict())  # version 5: keeps 3, 4 and 5
        got = trainer.get_data(return_versions=True)
        assert [tag for _, tag in got] == [3, 4]
        assert trainer.last_dropped == 2  # versions 1 and 2: dropped on the server
        lags = [5 - tag for _, tag in got]
        stats = learner.update([seg for seg, _ in got], lags)
    assert stats.samples == stats.stale_samples == 2 * 32 * 4  # used, not dropped
    assert set(stats.weight_by_lag) == {1, 2}
    assert all(0.0 < w < 1.0 for w in stats.weight_by_lag.values())


@pytest.mark.timeout(90)
def test_a_run_on_an_existing_server_ends_every_worker_and_tidies_its_bins(
        server: EmbeddedServer) -> None:
    lines: list[str] = []

    class Out:
        def write(self, text: str) -> int:
            lines.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    # A target any policy reaches: this checks the mechanics, not the learning.
    result = train(2, target=5.0, max_seconds=60, env=BUILTIN_CARTPOLE,
                   server=f"127.0.0.1:{server.port}", out=Out())  # type: ignore[arg-type]
    assert result.solved and result.versions >= 1 and result.episodes >= 100
    assert result.worker_exit_codes == [0, 0]
    assert f"server on 127.0.0.1:{server.port}" in "".join(lines)
    with Client("127.0.0.1", server.port) as c:
        assert not [name for name in c.list() if name.startswith("demo/")]


def _start_parent_of_a_worker(port: int) -> tuple[subprocess.Popen[str], int]:
    """A process that starts one worker and then waits to be killed; returns it and the pid."""
    code = ("import sys, threading\n"
            "from tensorshare.rl.demo import start_workers\n"
            f"p = start_workers({port}, 1, env={BUILTIN_CARTPOLE!r}, prefix='t4')[0]\n"
            "print(p.pid, flush=True)\n"
            "threading.Event().wait(120)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=env, cwd=ROOT)
    assert parent.stdout is not None
    return parent, int(parent.stdout.readline())


@pytest.mark.timeout(60)
def test_a_worker_whose_trainer_was_killed_exits(server: EmbeddedServer) -> None:
    parent, worker = _start_parent_of_a_worker(server.port)
    try:
        with Client("127.0.0.1", server.port) as c:
            wait_until(lambda: c.list().get("t4/ready", 0) == 1, timeout=30,
                       what="the worker to connect")
        os.kill(parent.pid, signal.SIGKILL)  # no end-of-run signal will ever come
        parent.wait()
        wait_until(lambda: not _alive(worker), timeout=30, what="the orphaned worker to exit")
    finally:
        parent.kill()
        parent.wait()
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.timeout(60)
def test_a_worker_whose_server_vanished_gives_up_after_its_timeout(
        procs: list[subprocess.Popen[bytes]]) -> None:
    srv = EmbeddedServer(port=0)
    try:
        bins = Bins("t5")
        with RLTrainer("127.0.0.1", srv.port, params_bin=bins.params,
                       data_bin=bins.data) as trainer:
            trainer.publish_parameters(Learner(4, 2).state_dict())
            procs += start_workers(srv.port, 1, env=BUILTIN_CARTPOLE, prefix=bins.prefix,
                                   timeout=2.0)
            assert trainer.get_data(timeout=30)  # it is acting
    finally:
        srv.stop()  # no signal: the server just goes away
    # Its client keeps trying to reconnect, each call for up to 2 s; then the worker gives up.
    wait_until(lambda: procs[0].poll() is not None, timeout=30, what="the worker to give up")
    assert procs[0].returncode == 0


def test_train_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="workers"):
        train(0, env=BUILTIN_CARTPOLE)
    with pytest.raises(ValueError, match="HOST:PORT"):
        train(1, env=BUILTIN_CARTPOLE, server="nowhere")


def test_a_target_no_episode_can_reach_is_replaced_by_the_environments() -> None:
    pytest.importorskip("gymnasium")
    acrobot = env_spec("Acrobot-v1")
    # The CLI's CartPole target, asked of Acrobot (returns are at most 0), would never be met.
    out = io.StringIO()
    assert _resolve_target(acrobot, 195.0, out) == -100.0 and "above the best return" in \
        out.getvalue()
    assert _resolve_target(acrobot, -150.0, out) == -150.0
    assert _resolve_target(acrobot, None, out) == -100.0
