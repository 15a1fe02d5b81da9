"""InferenceHost and InferenceClient on a real server (127.0.0.1, port 0), with a real
``torch.nn.Module``: answers computed from each caller's own input, many callers in several
processes, two live hosts sharing the calls (one SIGKILLed mid-run), a host SIGKILLed with
calls outstanding, a caller SIGKILLed mid-call (a server process, its memory as its stats
report it), the caller's choice on a full queue, lz4 only where it pays, and weight sync
from RLTrainer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorshare import (
    BinFull,
    Client,
    ClientOptions,
    EmbeddedServer,
    RLTrainer,
    ServiceFailed,
    WaitTimeout,
)
from tensorshare.inference import InferenceClient, InferenceHost, split_outputs, stack_inputs
from tensorshare.wire.codec import decode, encode
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


class Embedder(torch.nn.Module):
    """Token ids to scores: an id out of the vocabulary makes the embedding raise
    (IndexError), as a real model does on a bad input of the right shape."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.embed = torch.nn.Embedding(10, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(dim=1))


@pytest.mark.timeout(60)
def test_one_poisoned_input_fails_only_its_own_call(server: EmbeddedServer) -> None:
    model = Embedder()
    inputs = [torch.tensor([i % 10, (i + 3) % 10, 7]) for i in range(24)]
    poisoned = {5, 17}
    for i in poisoned:
        inputs[i] = torch.tensor([1, 99, 2])  # the same shape, an id out of range
    with InferenceClient("embed", "127.0.0.1", server.port, timeout=DEADLINE) as pc:
        futs = [pc.predict_async(x) for x in inputs]
        # Every call is queued before the host starts: they are one batch.
        wait_until(lambda: _service(server, "embed").get("service", {}).get("queue") == 24,
                   what="the 24 calls to queue")
        with InferenceHost("embed", model, "127.0.0.1", server.port, max_batch=64):
            for i, fut in enumerate(futs):
                if i in poisoned:
                    with pytest.raises(ServiceFailed, match="IndexError"):
                        fut.result(DEADLINE)
                    continue
                with torch.no_grad():
                    want = model(inputs[i][None])[0]
                assert torch.allclose(fut.result(DEADLINE), want, atol=1e-6)
    st = _service(server, "embed")["service"]
    assert st["batches"] == 1 and st["answered"] == 22 and st["failed"] == 2


@pytest.mark.timeout(60)
def test_an_input_without_its_batch_dimension_is_told_the_shape(
        server: EmbeddedServer) -> None:
    with InferenceHost("policy", _mlp(), "127.0.0.1", server.port), \
            Client("127.0.0.1", server.port) as c:
        with pytest.raises(ServiceFailed, match=r"shape \(rows, \.\.\.\).*rows=1.*is 8"):
            c.service_call("policy", torch.randn(8), rows=1, timeout=DEADLINE)
        with pytest.raises(ServiceFailed, match=r"shape \(rows, \.\.\.\).*rows=1.*\(\)"):
            c.service_call("policy", torch.tensor(1.0), rows=1, timeout=DEADLINE)
        assert c.service_call("policy", torch.randn(1, 8), rows=1,
                              timeout=DEADLINE).value.shape == (1, 4)


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


class Tagged(torch.nn.Module):
    """``x * 2`` with a last column naming the host that computed it; each batch takes a
    few milliseconds of compute, so that another host takes calls meanwhile."""

    def __init__(self, tag: float) -> None:
        super().__init__()
        self.tag = tag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.002)
        return torch.cat([x * 2, torch.full((x.shape[0], 1), self.tag)], dim=1)


TAGGED_HOST = textwrap.dedent("""
    import sys
    from tests.inference.test_inference import Tagged
    from tensorshare.inference import InferenceHost
    print("READY", flush=True)
    InferenceHost("policy", Tagged(float(sys.argv[2])), "127.0.0.1", int(sys.argv[1]),
                  max_batch=8, max_wait_ms=1, lease=120).serve_forever()
""")


class _Load:
    """16 caller threads on 4 clients, each keeping two calls in flight until stopped;
    every answer is checked against its own input and kept as (key, host tag)."""

    def __init__(self, port: int) -> None:
        self.answers: list[tuple[float, float]] = []
        self.issued = [0] * 16
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.clients = [InferenceClient("policy", "127.0.0.1", port, timeout=30)
                        for _ in range(4)]
        self.threads = [threading.Thread(target=self._run, args=(t,)) for t in range(16)]
        for t in self.threads:
            t.start()

    def _run(self, t: int) -> None:
        pc = self.clients[t % 4]
        try:
            while not self.stop.is_set():
                keys = [float(t * 1_000_000 + self.issued[t] + j) for j in range(2)]
                self.issued[t] += 2
                futs = [pc.predict_async(torch.full((8,), k)) for k in keys]
                for k, f in zip(keys, futs, strict=True):
                    out = f.result(DEADLINE * 3)
                    assert out[:8].tolist() == [2 * k] * 8, (k, out.tolist())
                    self.answers.append((k, float(out[8])))
        except BaseException as exc:  # the test reports it
            self.errors.append(exc)

    def by(self, tag: float) -> int:
        return sum(1 for _, t in list(self.answers) if t == tag)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(DEADLINE * 4)
        for pc in self.clients:
            pc.close()


@pytest.mark.timeout(180)
def test_two_live_hosts_share_the_calls_and_one_may_leave_mid_run(
        server: EmbeddedServer) -> None:
    # Host 0 (a thread here) serves 16 concurrent callers; host 1 (a process) joins and
    # takes a share; then it is SIGKILLed mid-run. Every call is answered exactly once with
    # its own rows, by one host or the other, before and after.
    load = None
    other = _spawn(TAGGED_HOST, server.port, 1)
    try:
        with InferenceHost("policy", Tagged(0.0), "127.0.0.1", server.port, max_batch=8,
                           max_wait_ms=1) as host:
            load = _Load(server.port)
            assert other.stdout is not None
            assert other.stdout.readline().startswith("READY")
            wait_until(lambda: load.by(1.0) >= 50 and load.by(0.0) >= 50, DEADLINE * 2,
                       "both hosts to answer calls")
            assert _service(server, "policy")["service"]["hosts"] == 2
            other.send_signal(signal.SIGKILL)
            other.wait(DEADLINE)
            mark = len(load.answers)
            wait_until(lambda: len(load.answers) >= mark + 300, DEADLINE * 2,
                       "calls answered after a host left")
            load.close()
        assert not load.errors, load.errors[:3]
        keys = [k for k, _ in load.answers]
        assert len(keys) == len(set(keys)) == sum(load.issued)  # each call, one answer
        assert host.calls == load.by(0.0)  # every call host 0 computed was answered by it
        st = _service(server, "policy")["service"]
        assert st["calls"] == st["answered"] == len(keys)
        assert st["failed"] == st["timed_out"] == 0
        wait_until(lambda: _service(server, "policy")["service"]["hosts"] == 0, DEADLINE,
                   "both hosts gone")
    finally:
        if load is not None:
            load.close()
        other.kill()
        other.wait(DEADLINE)


@pytest.mark.timeout(60)
def test_a_full_queue_makes_a_call_wait_or_fail_as_the_caller_chooses(
        server: EmbeddedServer) -> None:
    with Client("127.0.0.1", server.port) as bound:
        with pytest.raises(WaitTimeout):  # a host's take sets the bound: 2 calls
            bound.service_take("policy", max_queue=2, timeout=0)
    with InferenceClient("policy", "127.0.0.1", server.port, timeout=30) as waits, \
            InferenceClient("policy", "127.0.0.1", server.port, timeout=30,
                            wait_room=False) as sheds:
        queued = [waits.predict_async(torch.full((8,), float(i))) for i in range(2)]
        wait_until(lambda: _service(server, "policy").get("n_items") == 2, DEADLINE, "full")
        # Failing at once: the call is refused on arrival (a call that waited would end in
        # WaitTimeout after 30 s, never in BinFull).
        with pytest.raises(BinFull, match="max_queue=2"):
            sheds.predict(torch.zeros(8))
        with pytest.raises(BinFull):
            sheds.predict_async(torch.zeros(8)).result(DEADLINE)
        with pytest.raises(BinFull):
            waits.predict(torch.zeros(8), wait_room=False)
        # Waiting for room: the default, or chosen per call.
        waiting = [waits.predict_async(torch.full((8,), 2.0)),
                   sheds.predict_async(torch.full((8,), 3.0), wait_room=True)]
        wait_until(lambda: _service(server, "policy")["blocked"] == 2, DEADLINE,
                   "two calls waiting for room")
        assert not any(f.done() for f in queued + waiting)
        with InferenceHost("policy", Double(), "127.0.0.1", server.port):
            got = [f.result(DEADLINE).tolist() for f in queued + waiting]
    assert got == [[2.0 * i] * 8 for i in range(4)]
    st = _service(server, "policy")["service"]
    assert st["calls"] == 4 and st["answered"] == 4  # the refused calls were never queued


def _frames(n: int) -> torch.Tensor:
    """``n`` uint8 frames of 4 x 128 x 128 (64 KiB each) that look like a game screen: a
    flat background with a few solid shapes (what frames are, and why they compress)."""
    f = torch.zeros(n, 4, 128, 128, dtype=torch.uint8)
    for i in range(n):
        f[i, :, 20 + i:40 + i, 30:90] = 200
        f[i, :, 100:110, (5 * i) % 100:(5 * i) % 100 + 20] = 90
    return f


def test_auto_compresses_only_large_integer_buffers_that_shrink() -> None:
    value = {"frame": _frames(1)[0], "zeros": torch.zeros(128, 128),
             "noise": torch.randint(0, 256, (65536,), dtype=torch.uint8),
             "mask": torch.zeros(65536, dtype=torch.bool), "small": torch.zeros(1000,
                                                                             dtype=torch.uint8)}
    codecs = [b.codec for b in encode(value, compress="auto").buffers]
    # Floats never (even zeros); random bytes do not shrink; a small buffer is not worth it.
    assert codecs == ["lz4", None, None, "lz4", None]
    assert [b.codec for b in encode(value, compress="lz4").buffers][:2] == ["lz4", "lz4"]
    back = decode(encode(value, compress="auto"))
    assert all(torch.equal(back[k], v) for k, v in value.items())


def _wire_codecs(server: EmbeddedServer, name: str) -> list[list[str | None]]:
    """The codec of each buffer of each call queued in service ``name``, as it arrived."""
    def read() -> list[list[str | None]]:
        kind = next(k for k in server.factory.kinds if k.name == "service")
        return [[b.codec for b in c.item.value.buffers] for c in kind.services[name].queue]
    return server.call(read)


@pytest.mark.timeout(60)
def test_uint8_frames_travel_compressed_and_random_floats_raw(server: EmbeddedServer) -> None:
    frames, noise = _frames(4), torch.randn(4, 16384)  # 64 KiB of each per call
    with InferenceClient("policy", "127.0.0.1", server.port, timeout=30) as pc, \
            InferenceClient("policy", "127.0.0.1", server.port, timeout=30,
                            compress=None) as raw:
        futs = [pc.predict_async({"frame": frames[i], "noise": noise[i]}) for i in range(4)]
        wait_until(lambda: _service(server, "policy").get("n_items") == 4, DEADLINE, "4 queued")
        futs.append(raw.predict_async({"frame": frames[0], "noise": noise[0]}))
        wait_until(lambda: _service(server, "policy").get("n_items") == 5, DEADLINE, "5 queued")
        # The calls as the server received them: frame compressed, noise raw (dict keys are
        # encoded in order: frame, then noise); with compress=None, both raw.
        assert _wire_codecs(server, "policy") == [["lz4", None]] * 4 + [[None, None]]
        before = server.call(server.factory.server_stats)["bytes_in"].get("service_reply", 0)
        with InferenceHost("policy", lambda b: (b["frame"], b["noise"]), "127.0.0.1",
                           server.port, max_batch=1):  # one reply per call
            got = [f.result(DEADLINE) for f in futs]
    for i, (frame, out) in enumerate(zip(got, [*range(4), 0], strict=True)):
        assert torch.equal(frame[0], frames[out]) and torch.equal(frame[1], noise[out]), i
    # The host's answers (a frame and the noise each) went compressed the same way: each
    # reply carried the 64 KiB of floats and much less than 64 KiB of the frame.
    sent = server.call(server.factory.server_stats)["bytes_in"]["service_reply"] - before
    assert 5 * 65536 < sent < 5 * (65536 + 16384), sent


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


class Served:
    """``tensorshare serve`` in a subprocess on 127.0.0.1, port 0."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tensorshare", "serve", "--port", "0", "--quiet", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert "listening on" in line, line
        self.port = int(line.rsplit(":", 1)[1])

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(DEADLINE)


# A caller that keeps 16 calls of 256 KiB each in flight (a new one as each is answered)
# until it is killed.
FLOODING_CALLER = textwrap.dedent("""
    import sys, torch
    from tensorshare.inference import InferenceClient
    pc = InferenceClient("policy", "127.0.0.1", int(sys.argv[1]), timeout=60)
    x = torch.zeros(64, 1024)
    futs = [pc.predict_async(x, batched=True) for _ in range(16)]
    print("SENT", flush=True)
    while True:
        futs.pop(0).result(60)
        futs.append(pc.predict_async(x, batched=True))
""")


class _Survivors:
    """Callers that predict one after another on their own connections until stopped, each
    checking that every answer is computed from its own input (``Double``)."""

    def __init__(self, port: int, n: int) -> None:
        self.done = [0] * n
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(port, i)) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, port: int, i: int) -> None:
        try:
            with InferenceClient("policy", "127.0.0.1", port, timeout=30) as pc:
                while not self.stop.is_set():
                    key = float(i * 100_000 + self.done[i])
                    out = pc.predict(torch.full((1024,), key))
                    assert torch.equal(out, torch.full((1024,), 2 * key)), (key, out[:4])
                    self.done[i] += 1
        except BaseException as exc:  # the test reports it
            self.errors.append(exc)

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(DEADLINE * 3)


def _memory(c: Client) -> tuple[int, int]:
    """The server's ``memory.total`` and ``sessions``, as its stats say."""
    st = c.stats("policy")["server"]
    return st["memory"]["total"], st["sessions"]


@pytest.mark.timeout(180)
def test_a_caller_killed_mid_call_leaves_the_others_and_the_servers_memory_alone() -> None:
    # A server process with a short session_ttl; three callers predict throughout. A fourth
    # floods the service with 256 KiB calls and is SIGKILLed with many in flight: the others
    # are served before, during and after; once the dead caller's session expires (its
    # queued calls withdrawn, the answers kept for it freed) the server's memory, as its
    # stats report it, is back to what it was before that caller came.
    served = Served("--session-ttl", "2")
    victim = None
    survivors = None
    try:
        with Client("127.0.0.1", served.port, timeout=DEADLINE) as stats, \
                InferenceHost("policy", Double(), "127.0.0.1", served.port, max_batch=256):
            survivors = _Survivors(served.port, 3)
            wait_until(lambda: min(survivors.done) >= 5, DEADLINE, "every caller served")
            baseline, sessions = _memory(stats)
            victim = _spawn(FLOODING_CALLER, served.port)
            assert victim.stdout is not None
            assert victim.stdout.readline().startswith("SENT")
            held = [(baseline, sessions)]

            def flooded() -> bool:
                held[0] = _memory(stats)
                return held[0][0] > baseline + (2 << 20)

            wait_until(flooded, DEADLINE, "the flood on the server")
            victim.send_signal(signal.SIGKILL)  # with calls in flight: it never stopped
            victim.wait(DEADLINE)
            assert held[0][1] == sessions + 1  # what it held belonged to its session
            before_kill = list(survivors.done)
            wait_until(lambda: _memory(stats)[1] == sessions, DEADLINE * 2,
                       "the dead caller's session to expire")
            wait_until(lambda: _memory(stats)[0] - baseline < 256 << 10, DEADLINE,
                       "the server's memory back to its baseline")
            after = list(survivors.done)
            wait_until(lambda: all(d >= a + 20 for d, a in zip(survivors.done, after,
                                                                   strict=True)),
                       DEADLINE, "every caller served after the expiry")
            survivors.join()
            assert not survivors.errors, survivors.errors
            # Served while the dead caller's session was still kept, too.
            assert all(a > b for a, b in zip(after, before_kill, strict=True)), \
                (before_kill, after)
            st = stats.stats("policy")["bins"]["policy"]["service"]
            assert st["queue"] == 0 and st["with_hosts"] == 0 and st["failed"] == 0
    finally:
        if survivors is not None:
            survivors.join()
        if victim is not None:
            victim.kill()
            victim.wait(DEADLINE)
        served.stop()


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


def test_host_and_client_take_client_options_and_the_keywords_they_type() -> None:
    """``options=ClientOptions(...)`` and its fields as keywords reach the clients the host
    and the caller make (the server's token here); their own ``compress`` and ``timeout``
    stay theirs."""
    model = _mlp()
    x = torch.randn(8)
    with EmbeddedServer(port=0, token="infer-token") as srv:
        opts = ClientOptions(token="infer-token", compress="lz4", name="the-host")
        with InferenceHost("typed", model, "127.0.0.1", srv.port, options=opts,
                           compress=None, timeout=DEADLINE, max_wait_ms=1) as host, \
                InferenceClient("typed", "127.0.0.1", srv.port, timeout=DEADLINE,
                                token="infer-token", reconnect=30.0) as pc:
            host.start()
            assert host.client.options.name == "the-host" and host.compress is None
            assert host.client.options.compress == "lz4"  # (the client's own, as given)
            assert pc.client.options.reconnect == 30.0 and pc.compress == "auto"
            with torch.inference_mode():
                assert torch.allclose(pc.predict(x), model(x.unsqueeze(0))[0], atol=1e-6)
        bogus: dict[str, Any] = {"tokn": "infer-token"}
        with pytest.raises(TypeError, match="tokn"):
            InferenceClient("typed", "127.0.0.1", srv.port, timeout=DEADLINE, **bogus)


class Gate(torch.nn.Module):
    """Doubles its input, and blocks on its first batch until released (the test queues
    calls meanwhile); records each batch's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()
        self.batches: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.batches.append(int(x.shape[0]))
        if len(self.batches) == 1:
            self.entered.set()
            assert self.release.wait(DEADLINE)
        return x * 2


@pytest.mark.timeout(60)
def test_a_host_takes_every_call_queued_while_its_batch_ran_as_its_next_batch(
        server: EmbeddedServer) -> None:
    # Adaptive batching, the host's default (max_wait_ms 0): the next batch is whatever
    # queued while the previous one ran, taken at once.
    model = Gate()
    with InferenceHost("gate", model, "127.0.0.1", server.port) as host, \
            InferenceClient("gate", "127.0.0.1", server.port) as pc:
        assert host._take_command().request.max_wait_ms == 0
        first = pc.predict_async(torch.zeros(2))
        assert model.entered.wait(DEADLINE)
        later = [pc.predict_async(torch.full((2,), float(i))) for i in range(1, 6)]
        wait_until(lambda: _service(server, "gate")["service"]["queue"] == 5, DEADLINE,
                   "5 calls queued behind the running batch")
        model.release.set()
        assert first.result(DEADLINE).tolist() == [0.0, 0.0]
        assert [f.result(DEADLINE).tolist() for f in later] == \
            [[2.0 * i] * 2 for i in range(1, 6)]
    assert model.batches == [1, 5]
