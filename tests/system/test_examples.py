"""Run the examples and the demo as a user would: as separate processes, on free ports.

Each test bounds every wait with a subprocess timeout (no sleeps) and kills whatever it
started in ``finally``. The full learning runs (the demo and the example on Acrobot,
CartPole to 475, the demo without Gymnasium) are marked ``long``: 5-10 s each on 2 cores when
they work, about 25 s together; their ``--max-seconds`` and ``timeout`` marks only bound a
failing run. The demo on a running server checks the same plumbing with a target any policy
reaches at once.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import statistics
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tensorshare import Client, ConnectError, EmbeddedServer
from tensorshare.server import ServerConfig
from tests.conftest import TlsFiles

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

# The runs that learn (a trainer and its workers, each busy): one after the other on one
# worker of a parallel run, so that they never compete with each other for the cores
# (central inference, the longest, runs alone).
LEARNING = pytest.mark.xdist_group("learning")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # Examples import tensorshare; make sure it is this checkout's, installed or not.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"  # so that a killed process still shows what it printed
    if "PYTHONPATH" in extra:  # (put first: what was on the path stays, tensorshare too)
        extra["PYTHONPATH"] = os.pathsep.join((extra["PYTHONPATH"], env["PYTHONPATH"]))
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


SECRET = "the-deployment-token"


def _secure_env(port: int, tls: TlsFiles) -> dict[str, str]:
    """What a cluster's environment says: the server's URL (TLS), its token and CA, and,
    for a script that hosts its server, the server's certificate and key (and a
    TENSORSHARE_PORT that is not the server's: the URL comes first)."""
    return {"TENSORSHARE_PORT": "1", "TENSORSHARE_URL": f"tensorshare+tls://localhost:{port}",
            "TENSORSHARE_TOKEN": SECRET, "TENSORSHARE_TLS_CA": tls.ca,
            "TENSORSHARE_TLS_CERT": tls.cert, "TENSORSHARE_TLS_KEY": tls.key}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["port", "url", "secure"],
                         ids=["TENSORSHARE_PORT", "TENSORSHARE_URL first",
                              "token and TLS from the env"])
def test_basic_example(server: EmbeddedServer, tls_files: TlsFiles, where: str) -> None:
    env = {"TENSORSHARE_PORT": str(server.port)}
    if where == "url":  # the URL wins over a port that is not the server's
        env = {"TENSORSHARE_URL": f"tensorshare://127.0.0.1:{server.port}",
               "TENSORSHARE_PORT": "1"}
    secure = where == "secure"
    if secure:  # the seed's example, unchanged, against a server with a token and TLS
        config = ServerConfig(token=SECRET, tls_cert=tls_files.cert, tls_key=tls_files.key)
        server = EmbeddedServer(port=0, config=config)
        env = _secure_env(server.port, tls_files)
    try:
        res = _run([str(EXAMPLES / "basic.py")], timeout=50, **env)
    finally:
        if secure:
            server.stop()
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


def _wait_until_serving(port: int, proc: subprocess.Popen[str], timeout: float,
                        **client: Any) -> None:
    """Connect to ``port`` until it answers, pacing retries on ``proc`` (which must live)."""
    for _ in range(int(timeout / 0.1)):
        try:
            Client(client.pop("host", "127.0.0.1"), port, timeout=5.0, **client).close()
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


@LEARNING
@pytest.mark.timeout(120)
def test_rl_trainer_and_workers(tls_files: TlsFiles) -> None:
    """The seed's trainer (hosting its server) and workers, unchanged, on a cluster whose
    environment gives the URL (TLS), the token, the CA and the server's certificate."""
    port = _free_port()
    env = _env(**_secure_env(port, tls_files))
    popen = dict(cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    trainer = subprocess.Popen([sys.executable, str(EXAMPLES / "rl_trainer.py")], **popen)
    workers: list[subprocess.Popen[str]] = []
    try:
        _wait_until_serving(port, trainer, timeout=30, host="localhost", tls=True,
                            tls_ca=tls_files.ca, token=SECRET)
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


def _port_of(out: str) -> int:
    m = re.search(r"server on 127\.0\.0\.1:(\d+)", out)
    assert m, out
    return int(m.group(1))


def _check_summary(out: str, env: str, workers: int) -> str:
    """The run's summary lines are there and say it reached the target; returns them."""
    summary = out.split("\nsummary\n", 1)[-1]
    assert re.search(rf"^environment +{re.escape(env)}, {workers} workers$", summary,
                     re.MULTILINE), out
    for name in ("time", "versions", "episodes", "stale rollouts", "final average"):
        assert re.search(rf"^{name} +\S", summary, re.MULTILINE), out
    assert re.search(r"^solved +yes$", summary, re.MULTILINE), out
    last = summary.strip().splitlines()[-1]
    m = re.fullmatch(r"solved in [\d.]+ s: average return (-?\d+\.\d) over the last 100 "
                     r"episodes \(target (-?[\d.]+)\)", last)
    assert m and float(m.group(1)) >= float(m.group(2)), out
    return summary


HAVE_GYMNASIUM = importlib.util.find_spec("gymnasium") is not None
needs_gymnasium = pytest.mark.skipif(not HAVE_GYMNASIUM, reason="needs the rl extra")


@pytest.fixture
def no_gymnasium(tmp_path: Path) -> str:
    """A PYTHONPATH under which ``import gymnasium`` fails, as if not installed, and this
    checkout's tensorshare imports (installed or not)."""
    blocker = tmp_path / "gymnasium"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('gymnasium blocked for this test')\n")
    return os.pathsep.join([str(tmp_path), str(ROOT)])


@LEARNING
@pytest.mark.long
@pytest.mark.timeout(150)
def test_cartpole_solves() -> None:
    res = _run([str(EXAMPLES / "cartpole.py"), "--workers", "2", "--max-seconds", "100"],
               timeout=140)
    assert res.returncode == 0, res.stdout + res.stderr
    env = "CartPole-v1" if HAVE_GYMNASIUM else "builtin-CartPole"
    summary = _check_summary("\nsummary\n" + res.stdout, env, 2)
    assert f"(target {475 if HAVE_GYMNASIUM else 195})" in summary
    assert any("steps/s" in line and "avg return" in line for line in res.stdout.splitlines())
    assert _leftover_workers(_port_of(res.stdout)) == []
    assert "Traceback" not in res.stderr, res.stderr  # workers exit quietly


@LEARNING
@needs_gymnasium
@pytest.mark.long
@pytest.mark.timeout(120)
def test_acrobot_example_solves() -> None:
    res = _run([str(EXAMPLES / "acrobot.py"), "--workers", "2", "--max-seconds", "90"],
               timeout=110)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = _check_summary("\nsummary\n" + res.stdout, "Acrobot-v1", 2)
    assert "(target -100)" in summary
    assert _leftover_workers(_port_of(res.stdout)) == []
    assert "Traceback" not in res.stderr, res.stderr


def test_acrobot_example_says_what_it_needs(no_gymnasium: str) -> None:
    res = _run([str(EXAMPLES / "acrobot.py")], timeout=60, PYTHONPATH=no_gymnasium)
    assert res.returncode == 2 and "needs Gymnasium" in res.stderr, res.stdout + res.stderr


@LEARNING
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


@pytest.mark.long
@pytest.mark.alone  # each step a chain of hand-offs between threads and processes, which
# other tests' work on the same cores would slow many times over
@pytest.mark.timeout(180)
def test_central_inference_example_reaches_the_target_both_ways() -> None:
    # Workers acting through one InferenceHost learn CartPole as workers with local copies do.
    # The example's first run, with local copies, is the very training test_cartpole_solves
    # runs (examples/cartpole.py: train() with the same workers, seed, environment and
    # target): here only the second (--only-central), so that this test, which runs alone,
    # holds the machine half as long.
    res = _run([str(EXAMPLES / "central_inference.py"), "--workers", "2", "--only-central",
                "--max-seconds", "140"], timeout=170)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "local copies" not in res.stdout, res.stdout
    assert "central inference: reached the target" in res.stdout, res.stdout
    assert "Traceback" not in res.stderr, res.stderr


@LEARNING
@pytest.mark.timeout(180)
def test_shared_loader_example_reaches_private_accuracy() -> None:
    # Two jobs off one served DataLoader learn as well as two jobs with a loader each.
    res = _run([str(EXAMPLES / "shared_loader.py"), "--quick"], timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "accuracy: the same" in res.stdout, res.stdout


@LEARNING
@needs_gymnasium
@pytest.mark.long
@pytest.mark.timeout(150)
def test_demo_command() -> None:
    # The CLI as the README runs it (its --target default is CartPole's 195, which the demo
    # replaces by Acrobot's own -100 with a note, until the CLI passes no target).
    res = _run(["-m", "tensorshare", "demo", "--workers", "2", "--max-seconds", "90"],
               timeout=140)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    summary = _check_summary(out, "Acrobot-v1", 2)
    assert "(target -100)" in summary.splitlines()[-1], out
    # The 1-worker warm-up against the rest: both rates are shown, and their ratio.
    assert re.search(r"^speedup +1 worker [\d,]+ steps/s, 2 workers [\d,]+ steps/s: "
                     r"\d+\.\d\dx$", summary, re.MULTILINE), out
    assert _leftover_workers(_port_of(out)) == []
    assert "Traceback" not in res.stderr, res.stderr


@LEARNING
@pytest.mark.long
@pytest.mark.timeout(150)
def test_demo_without_gymnasium_falls_back_to_the_builtin_cartpole(no_gymnasium: str) -> None:
    res = _run(["-m", "tensorshare", "demo", "--workers", "2", "--max-seconds", "90"],
               timeout=140, PYTHONPATH=no_gymnasium)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert out.splitlines()[0].startswith("Gymnasium is not installed"), out
    _check_summary(out, "builtin-CartPole", 2)
    assert _leftover_workers(_port_of(out)) == []
    assert "Traceback" not in res.stderr, res.stderr


@pytest.mark.timeout(120)
def test_demo_against_a_running_server(server: EmbeddedServer) -> None:
    # The cluster smoke test: trainer and workers use a server that was already there.
    # A target any policy reaches: this checks the plumbing, not the learning.
    res = _run(["-m", "tensorshare.demo", "--server", f"127.0.0.1:{server.port}",
                "--workers", "2", "--env", "builtin-CartPole", "--target", "5",
                "--max-seconds", "60"], timeout=110)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"through the server at 127.0.0.1:{server.port}" in res.stdout, res.stdout
    _check_summary(res.stdout, "builtin-CartPole", 2)
    assert _leftover_workers(server.port) == []
    with Client("127.0.0.1", server.port) as c:
        assert c.list() == {}, "the demo left bins behind on the server"
    assert "Traceback" not in res.stderr, res.stderr


def test_demo_refuses_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    # In this process: the refusals are main()'s (python -m tensorshare.demo runs it, as the
    # tests above do), and a process each would only add three imports of torch.
    from tensorshare.demo import main

    for args, message in ((["--server", "nowhere"], "HOST:PORT"),
                          (["--workers", "0"], "at least 1"),
                          (["--env", "Pendulum-v1"], "discrete actions" if HAVE_GYMNASIUM
                           else "needs Gymnasium")):
        status = main(args)
        out, err = capsys.readouterr()
        assert status == 2 and message in err, (args, out, err)


@needs_gymnasium
@pytest.mark.timeout(150)
def test_ape_x_smoke_inserts_samples_and_updates() -> None:
    res = _run([str(EXAMPLES / "ape_x.py"), "--actors", "2", "--smoke", "--max-seconds", "100"],
               timeout=140)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "smoke: the replay plumbing works" in res.stdout, res.stdout
    m = re.search(r"summary: 2 actors, (\d+) updates, (\d+) transitions inserted, (\d+) sampled",
                  res.stdout)
    assert m and int(m.group(1)) >= 20 and int(m.group(2)) >= 1000, res.stdout
    assert "Traceback" not in res.stderr, res.stderr  # actors exit quietly


def _ape_x_seconds(actors: int) -> float:
    res = _run([str(EXAMPLES / "ape_x.py"), "--actors", str(actors), "--max-seconds", "400"],
               timeout=480)
    assert res.returncode == 0, res.stdout + res.stderr
    m = re.search(r"reached the target in ([\d.]+) s", res.stdout)
    assert m, res.stdout
    return float(m.group(1))


CORES = len(os.sched_getaffinity(0))


@needs_gymnasium
@pytest.mark.long
@pytest.mark.timeout(600)
def test_ape_x_with_two_actors_learns_to_the_target() -> None:
    # (On any machine: the learner reaches the target return from what two actors insert;
    # how much sooner than one actor is the scaling check below, where there are cores.)
    assert _ape_x_seconds(2) <= 400


@needs_gymnasium
@pytest.mark.skipif(CORES < 4, reason=(
    f"scaling needs a core for each of the learner, the two actors and the server; this "
    f"machine has {CORES}, where one actor and the learner already fill them (1 and 2 actors "
    f"insert at the same rate, and the time to the target is luck)"))
@pytest.mark.long
@pytest.mark.alone  # (wall time: nothing else running beside it)
@pytest.mark.timeout(1800)
def test_ape_x_with_two_actors_reaches_the_target_sooner_than_with_one() -> None:
    # The median of three runs each (interleaved): one run's time to the target swings by
    # 2x with how an early network happens to do and how the processes share the cores.
    runs = [(_ape_x_seconds(1), _ape_x_seconds(2)) for _ in range(3)]
    one, two = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    assert two < one, runs
