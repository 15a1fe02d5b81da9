"""Run the examples and the demo as a user would: as separate processes, on free ports.

Each test bounds every wait with a subprocess timeout (no sleeps) and kills whatever it
started in ``finally``. The learning runs (CartPole, the demo) take 5-15 s on 2 cores when
they work; their ``--max-seconds`` and ``timeout`` marks only bound a failing run. The whole
file takes about a minute.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tensorshare import Client, ConnectError, EmbeddedServer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # Examples import tensorshare; make sure it is this checkout's, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"  # so that a killed process still shows what it printed
    env.update(extra)
    return env


def _run(args: Sequence[str], timeout: float, **extra_env: str) -> subprocess.CompletedProcess[str]:
    """Run ``python args...`` from the repository root; fail the test if it overruns."""
    try:
        return subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(**extra_env),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:  # run() has killed it already
        pytest.fail(f"{' '.join(args)} did not finish within {timeout} s; it printed:\n"
                    f"{exc.stdout!r}\n{exc.stderr!r}")


def _free_port() -> int:
    """A port that was free a moment ago (for scripts that must be told their port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill(procs: Sequence[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.communicate()


def _leftover_workers(port: int) -> list[int]:
    """PIDs of live ``tensorshare.demo worker`` processes pointed at ``port`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # exited meanwhile, or not ours to read
        if b"tensorshare.demo" in argv and b"worker" in argv and str(port).encode() in argv:
            found.append(int(entry.name))
    return found


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    with EmbeddedServer(port=0) as s:
        yield s


@pytest.mark.timeout(60)
def test_basic_example(server: EmbeddedServer) -> None:
    res = _run([str(EXAMPLES / "basic.py")], timeout=50, TENSORSHARE_PORT=str(server.port))
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "peek data_bin {'status': 'OK', 'data': {'a': tensor(" in out, out
    # Two gets answer; which one finds the appended items depends on callback timing.
    assert out.count("get xyz {'status': ") == 2, out
    assert "get xyz {'status': 'OK', 'data': " in out, out
    # The list reply; what xyz holds by then depends on the order the callbacks ran in.
    assert re.search(r"^\{'status': 'OK', 'data': \{'data_bin': 1, 'xyz': \d+\}\}$", out,
                     re.MULTILINE), out
    updates = re.findall(r"^Bin xyz updated\. Num items:\s+(\d+)$", out, re.MULTILINE)
    assert updates, out
    # Events arrive in the order the bin changed: put + append made 2 items, then 3.
    assert updates[:2] == ["2", "3"][: len(updates)], out


def _wait_until_serving(port: int, proc: subprocess.Popen[str], timeout: float) -> None:
    """Connect to ``port`` until it answers, pacing retries on ``proc`` (which must live)."""
    for _ in range(int(timeout / 0.1)):
        try:
            Client("127.0.0.1", port, timeout=5.0).close()
            return
        except ConnectError:
            pass
        try:
            proc.wait(timeout=0.1)  # doubles as the retry delay
        except subprocess.TimeoutExpired:
            continue
        out, err = proc.communicate()
        pytest.fail(f"the server process exited with {proc.returncode}:\n{out}\n{err}")
    pytest.fail(f"nothing listening on port {port} after {timeout} s")


@pytest.mark.timeout(120)
def test_rl_trainer_and_workers() -> None:
    port = _free_port()
    env = _env(TENSORSHARE_PORT=str(port))
    popen = dict(cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    trainer = subprocess.Popen([sys.executable, str(EXAMPLES / "rl_trainer.py")], **popen)
    workers: list[subprocess.Popen[str]] = []
    try:
        _wait_until_serving(port, trainer, timeout=30)
        workers = [subprocess.Popen([sys.executable, str(EXAMPLES / "rl_worker.py")], **popen)
                   for _ in range(3)]
        out, err = trainer.communicate(timeout=90)
        assert trainer.returncode == 0, err
        iterations = re.findall(r"^Iteration (\d+) Loss: tensor\(", out, re.MULTILINE)
        assert iterations == [str(i) for i in range(10)], out
        # The trainer's server is gone: each worker's next request fails, and it exits.
        for w in workers:
            try:
                w.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                pytest.fail("a worker was still running 30 s after the trainer stopped")
            assert w.returncode == 0
    finally:
        _kill([trainer, *workers])


@pytest.mark.timeout(150)
def test_cartpole_solves() -> None:
    res = _run([str(EXAMPLES / "cartpole.py"), "--workers", "2", "--max-seconds", "90"],
               timeout=140)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.strip().splitlines()
    assert re.fullmatch(r"solved in [\d.]+ s: average return (\d+\.\d) over the last 100 "
                        r"episodes \(target 195\)", lines[-1]), res.stdout
    assert float(lines[-1].split("average return ")[1].split()[0]) >= 195
    assert any("samples/s" in line and "avg return" in line for line in lines), res.stdout
    port = int(re.search(r"server on 127\.0\.0\.1:(\d+)", res.stdout).group(1))  # type: ignore[union-attr]
    assert _leftover_workers(port) == []
    assert "Traceback" not in res.stderr, res.stderr  # workers exit quietly


@pytest.mark.timeout(90)
def test_triplet_mining_loss_falls() -> None:
    res = _run([str(EXAMPLES / "triplet_mining.py"), "--workers", "2", "--steps", "60",
                "--max-seconds", "60"], timeout=80)
    assert res.returncode == 0, res.stdout + res.stderr
    m = re.search(r"evaluation loss: start ([\d.]+), end ([\d.]+) \(lower\) after 60 steps",
                  res.stdout)
    assert m, res.stdout
    assert float(m.group(2)) < float(m.group(1))
    assert "Traceback" not in res.stderr, res.stderr  # miners exit quietly


@pytest.mark.timeout(150)
def test_demo_command() -> None:
    res = _run(["-m", "tensorshare", "demo", "--workers", "2", "--max-seconds", "90"],
               timeout=140)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    summary = out.split("\nsummary\n", 1)
    assert len(summary) == 2, out
    for field in ("time", "versions", "episodes", "stale rollouts", "final average"):
        assert re.search(rf"^{field} +\S", summary[1], re.MULTILINE), out
    assert re.search(r"^solved +yes$", summary[1], re.MULTILINE), out
    port = int(re.search(r"server on 127\.0\.0\.1:(\d+)", out).group(1))  # type: ignore[union-attr]
    assert _leftover_workers(port) == []
    assert "Traceback" not in res.stderr, res.stderr
