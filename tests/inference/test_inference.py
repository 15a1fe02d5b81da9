"""InferenceHost and InferenceClient on a real server (127.0.0.1, port 0), with a real
``torch.nn.Module``: answers computed from each caller's own input, many callers in several
processes, a host SIGKILLed with calls outstanding, a caller SIGKILLed mid-call, and weight
sync from RLTrainer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from tensorshare import EmbeddedServer, RLTrainer, ServiceFailed, WaitTimeout
from tensorshare.inference import InferenceClient, InferenceHost, split_outputs, stack_inputs
from tensorshare.server import ServerConfig
from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parents[2]
DEADLINE = 20.0


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


class TwoHeads(torch.nn.Module):
    """A model with a dict input and a tuple output (policy logits and value)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.body = torch.nn.Linear(6, 16)
        self.pi = torch.nn.Linear(16, 3)
        self.v = torch.nn.Linear(16, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.body(torch.cat([batch["obs"], batch["goal"]], dim=1)))
        return self.pi(h), self.v(h)[:, 0]


def _service(server: EmbeddedServer, name: str) -> dict:
    """The service's stats (read on the server's reactor thread)."""
    return server.call(lambda: server.factory.bin_stats(name).get(name, {}))


def _held(server: EmbeddedServer) -> int:
    """What the server holds beyond its stored bins (read on its reactor thread)."""
    return server.call(server.factory.held_bytes)


def test_stack_and_split_keep_each_callers_rows() -> None:
    a, b = torch.zeros(2, 3), torch.ones(1, 3)
    x = stack_inputs([a, b])
    assert x.shape == (3, 3)
    parts = split_outputs((x * 2, {"v": x[:, 0]}), [2, 1])
    assert parts[0][0].shape == (2, 3) and parts[1][1]["v"].tolist() == [1.0]
    with pytest.raises(ValueError, match="first dimension"):
        split_outputs(torch.zeros(2), [2, 1])


@pytest.mark.timeout(60)
def test_predict_returns_the_models_rows_for_this_input(server: EmbeddedServer) -> None:
    model = _mlp()
    with InferenceHost("policy", model, "127.0.0.1", server.port, max_wait_ms=1), \
            InferenceClient("policy", "127.0.0.1", server.port) as pc:
        x = torch.randn(8)
        with torch.no_grad():
            want = model(x[None])[0]
        out = pc.predict(x)
        assert out.shape == (4,) and torch.allclose(out, want, atol=1e-6)
        xs = torch.randn(5, 8)
        out, version = pc.predict(xs, batched=True, return_version=True)
        with torch.no_grad():
            assert torch.allclose(out, model(xs), atol=1e-6)
        assert version is None  # no params_bin: no version
        futs = [pc.predict_async(torch.full((8,), float(i))) for i in range(200)]
        with torch.no_grad():
            want = model(torch.stack([torch.full((8,), float(i)) for i in range(200)]))
        got = torch.stack([f.result(DEADLINE) for f in futs])
        assert torch.allclose(got, want, atol=1e-5)
    st = _service(server, "policy")["service"]
    assert st["answered"] == 202 and st["batches"] < 202  # some calls shared a batch


@pytest.mark.timeout(60)
def test_dict_inputs_and_tuple_outputs(server: EmbeddedServer) -> None:
    model = TwoHeads()
    with InferenceHost("ac", model, "127.0.0.1", server.port), \
            InferenceClient("ac", "127.0.0.1", server.port) as pc:
        obs = {"obs": torch.randn(4), "goal": torch.randn(2)}
        logits, value = pc.predict(obs)
        with torch.no_grad():
            want_logits, want_value = model({k: v[None] for k, v in obs.items()})
        assert torch.allclose(logits, want_logits[0], atol=1e-6)
        assert torch.allclose(value, want_value[0], atol=1e-6)


@pytest.mark.timeout(60)
def test_a_bad_input_fails_alone(server: EmbeddedServer) -> None:
    with InferenceHost("policy", _mlp(), "127.0.0.1", server.port, max_wait_ms=50), \
            InferenceClient("policy", "127.0.0.1", server.port) as pc:
        good = [pc.predict_async(torch.randn(8)) for _ in range(5)]
        bad = pc.predict_async(torch.randn(7))  # the wrong width: the model raises
        assert all(f.result(DEADLINE).shape == (4,) for f in good)
        with pytest.raises(ServiceFailed, match="RuntimeError"):
            bad.result(DEADLINE)
        assert pc.predict(torch.randn(8)).shape == (4,)  # the host serves on


@pytest.mark.timeout(30)
def test_no_host_means_a_timeout_not_a_hang(server: EmbeddedServer) -> None:
    with InferenceClient("nobody", "127.0.0.1", server.port, timeout=0.5) as pc:
        start = time.monotonic()
        with pytest.raises(WaitTimeout):
            pc.predict(torch.zeros(8))
        assert time.monotonic() - start < 5.0


CALLER = textwrap.dedent("""
    import sys, threading, torch
    from tensorshare.inference import InferenceClient
    port, proc, threads, calls = (int(a) for a in sys.argv[1:5])
    bad = []
    def run(t):
        with InferenceClient("policy", "127.0.0.1", port, timeout=30) as pc:
            futs = []
            for i in range(calls):
                key = float(proc * 1_000_000 + t * 1000 + i)
                x = torch.full((8,), key)
                futs.append((key, pc.predict_async(x) if i % 2 else None, x))
            for key, fut, x in futs:
                out = fut.result(60) if fut is not None else pc.predict(x)
                if out.tolist() != [key * 2] * 8:
                    bad.append((key, out.tolist()))
    ts = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
    [t.start() for t in ts]
    [t.join(120) for t in ts]
    print("BAD", len(bad), bad[:3])
    sys.exit(1 if bad else 0)
""")


class Double(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def _spawn(code: str, *args: object) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.timeout(180)
def test_64_callers_in_4_processes_get_their_own_answers(server: EmbeddedServer) -> None:
    # Every caller's inputs are unique; the answer must be computed from that input: nothing
    # crossed, lost or doubled (the server counts each call answered once).
    with InferenceHost("policy", Double(), "127.0.0.1", server.port, max_batch=64):
        procs = [_spawn(CALLER, server.port, p, 16, 10) for p in range(4)]
        outs = [p.communicate(timeout=150)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), outs
    st = _service(server, "policy")["service"]
    assert st["calls"] == 640 and st["answered"] == 640 and st["failed"] == 0
    assert st["mean_batch"] > 1.0  # concurrent callers shared batches


SLOW_HOST = textwrap.dedent("""
    import sys, time, torch
    from tensorshare.inference import InferenceHost
    class Slow(torch.nn.Module):
        def forward(self, x):
            print("TOOK", x.shape[0], flush=True)
            time.sleep(60)  # never answers: it is killed first
            return x
    InferenceHost("policy", Slow(), "127.0.0.1", int(sys.argv[1]), max_batch=4,
                  max_wait_ms=0, lease=120).serve_forever()
""")


@pytest.mark.timeout(90)
def test_a_host_killed_with_calls_outstanding_hands_them_to_another(
        server: EmbeddedServer) -> None:
    slow = _spawn(SLOW_HOST, server.port)
    try:
        with InferenceClient("policy", "127.0.0.1", server.port, timeout=30) as pc:
            futs = [pc.predict_async(torch.full((8,), float(i))) for i in range(10)]
            assert slow.stdout is not None
            assert slow.stdout.readline().startswith("TOOK")  # it holds a batch
            wait_until(lambda: _service(server, "policy")["service"]["with_hosts"] > 0,
                       DEADLINE, "a batch with the slow host")
            slow.send_signal(signal.SIGKILL)
            slow.wait(DEADLINE)
            start = time.monotonic()
            with InferenceHost("policy", Double(), "127.0.0.1", server.port):
                got = [f.result(DEADLINE).tolist() for f in futs]
            # The lease was 120 s: the calls came back as soon as the connection was gone.
            assert time.monotonic() - start < 15.0
        assert got == [[2.0 * i] * 8 for i in range(10)]
        st = _service(server, "policy")["service"]
        assert st["answered"] == 10 and st["requeued"] >= 1
    finally:
        slow.kill()
        slow.wait(DEADLINE)


BIG_CALLER = textwrap.dedent("""
    import sys, torch
    from tensorshare.inference import InferenceClient
    pc = InferenceClient("policy", "127.0.0.1", int(sys.argv[1]), timeout=60)
    futs = [pc.predict_async(torch.zeros(256, 1024), batched=True) for _ in range(16)]
    print("SENT", flush=True)
    futs[0].result(60)
    print("GOT", flush=True)
    import time; time.sleep(120)
""")


@pytest.mark.timeout(120)
def test_a_caller_killed_mid_call_leaves_the_others_and_the_servers_memory_alone() -> None:
    # The killed caller's session ends after session_ttl: its queued calls are withdrawn and
    # the answers kept for it are freed; the other caller is served throughout.
    with EmbeddedServer(port=0, config=ServerConfig(session_ttl=1.0)) as server:
        baseline = _held(server)
        gate = threading.Event()

        class Gated(torch.nn.Module):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                gate.wait(30)
                return x[:, :4]

        with InferenceHost("policy", Gated(), "127.0.0.1", server.port, max_batch=256), \
                InferenceClient("policy", "127.0.0.1", server.port, timeout=60) as other:
            victim = _spawn(BIG_CALLER, server.port)
            try:
                assert victim.stdout is not None
                assert victim.stdout.readline().startswith("SENT")
                wait_until(lambda: _service(server, "policy")["service"]["calls"] >= 16,
                           DEADLINE, "the victim's calls on the server")
                assert _held(server) > baseline + 8 * 256 * 1024 * 4
                victim.send_signal(signal.SIGKILL)
                victim.wait(DEADLINE)
                gate.set()
                x = torch.randn(1024)
                assert other.predict(x).tolist() == x[:4].tolist()
                wait_until(lambda: _held(server) - baseline < 1 << 20, 30,
                           "the server's memory back to its baseline")
            finally:
                gate.set()
                victim.kill()
                victim.wait(DEADLINE)


@pytest.mark.timeout(90)
def test_weight_sync_versions_never_go_back_and_follow_the_trainer(
        server: EmbeddedServer) -> None:
    trainer = RLTrainer("127.0.0.1", server.port)
    net = _mlp()
    trainer.publish_parameters(net.state_dict())
    stop = threading.Event()
    published: list[int] = []

    def publish() -> None:
        while not stop.is_set():
            with torch.no_grad():
                net[0].bias += 1.0
            published.append(trainer.publish_parameters(net.state_dict()))
            stop.wait(0.1)

    t = threading.Thread(target=publish)
    try:
        with InferenceHost("policy", _mlp(seed=5), "127.0.0.1", server.port,
                           params_bin="rl/parameters") as host, \
                InferenceClient("policy", "127.0.0.1", server.port) as pc:
            assert host.version == trainer.version  # loaded at start
            t.start()
            seen: list[tuple[int, int]] = []  # (newest published before the call, stamped)
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                before = published[-1] if published else trainer.version
                _, v = pc.predict(torch.zeros(8), return_version=True)
                seen.append((before, v))
                time.sleep(0.005)
    finally:
        stop.set()
        if t.is_alive():
            t.join(DEADLINE)
        trainer.stop()
    stamped = [v for _, v in seen]
    assert stamped == sorted(stamped), "a version went backwards"
    assert len(set(stamped)) >= 10, "the host did not follow the trainer"
    assert all(v >= before - 1 for before, v in seen), [s for s in seen if s[1] < s[0] - 1]
