"""The GPU path on a machine with CUDA (``-m cuda``; skipped with the reason elsewhere).

``benchmarks/gpu_check.sh`` runs these and ``benchmarks/gpu.py`` as one command. What they
check, with real CUDA: reads with ``device=`` bit-exact for every wire dtype over TCP and
``unix://``; a CUDA put read back bit-exact; the pinned pool really pinning and reused;
``non_blocking`` ordering; ``SharedLoader(device="cuda", prefetch=2)``; ``RLWorker`` and
``load_parameters_into``; CUDA IPC between processes: bit-exact, no torn reads through a
small ring with a slow consumer, a reused slot as ``Lagged``, a killed consumer and a killed
producer, 10,000 items on one shared handle, the UUID under ``CUDA_VISIBLE_DEVICES``, the
probe's fallback.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorshare import Client, EmbeddedServer, ProducerGone
from tensorshare.data import SharedLoader, StreamConsumer, StreamProducer, serve_loader
from tensorshare.memory import ipc, pinned
from tensorshare.memory.ipc import CudaIpcRing
from tensorshare.wire import codec
from tests.conftest import wait_until

CUDA = torch.cuda.is_available()
REASON = f"needs CUDA: torch {torch.__version__}, cuda.is_available()={CUDA}"
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason=REASON)]

WAIT = 60.0
ROOT = str(Path(__file__).resolve().parents[2])
N = 4096  # int64 elements of each IPC test item (32 KiB)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    for name in codec.DTYPES:
        dtype = getattr(torch, name, None)
        if dtype is None:
            continue
        if dtype.is_floating_point or dtype.is_complex:
            t = torch.randn(33, 5, generator=g, dtype=torch.float64).to(dtype) \
                if not dtype.is_complex else torch.randn(17, generator=g, dtype=dtype)
        elif dtype == torch.bool:
            t = torch.randint(0, 2, (40,), generator=g).bool()
        else:
            info = torch.iinfo(dtype)
            t = torch.tensor([info.min, 0, info.max] * 7, dtype=dtype)
        out[name] = t
    out["0-d"] = torch.tensor(2.5)
    out["empty"] = torch.empty(0, 3)
    out["non-contiguous"] = torch.randn(8, 6, generator=g).t()
    out["large"] = torch.randn(1 << 20, generator=g)  # 4 MiB: a pooled part, a memfd
    return out


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedServer, str]]:
    sock = str(tmp_path_factory.mktemp("gpu") / "s.sock")
    srv = EmbeddedServer(port=0, unix=sock)
    try:
        yield srv, sock
    finally:
        srv.stop()


@pytest.fixture(params=["tcp", "unix"])
def client(request: pytest.FixtureRequest, servers: tuple[EmbeddedServer, str]
           ) -> Iterator[Client]:
    srv, sock = servers
    c = Client(f"unix://{sock}" if request.param == "unix" else f"127.0.0.1:{srv.port}",
               timeout=WAIT)
    try:
        yield c
    finally:
        c.close()


def test_every_dtype_reads_bit_exact_onto_the_gpu(client: Client) -> None:
    v = values()
    client.put("dtypes", v)
    for op in ("peek", "get"):
        got = getattr(client, op)("dtypes", device="cuda")
        for k, t in v.items():
            assert got[k].device.type == "cuda", k
            assert got[k].is_contiguous() and same_bits(got[k], t), k
        got["float32"].fill_(0)  # the result is the caller's own: the bin is not changed
        if op == "peek":
            again = client.peek("dtypes")
            assert same_bits(again["float32"], v["float32"])
    if torch.cuda.device_count() > 1:
        client.put("one", v["large"])
        assert client.get("one", device="cuda:1").device == torch.device("cuda", 1)


def test_a_cuda_put_reads_back_bit_exact_and_sending_stays_bounded(client: Client) -> None:
    x = torch.randn(1 << 20, device="cuda").bfloat16()
    view = torch.arange(4096, device="cuda", dtype=torch.float32).reshape(64, 64)[::3, 1:7]
    client.put("cuda-put", {"x": x, "view": view, "cpu": torch.ones(2)})
    got = client.get("cuda-put")
    assert same_bits(got["x"], x) and same_bits(got["view"], view)
    assert got["x"].device.type == "cpu"
    pool = pinned.pinned_pool()
    for i in range(300):
        client.put("cuda-put", torch.full((1 << 18,), float(i), device="cuda"))
    assert torch.equal(client.get("cuda-put"), torch.full((1 << 18,), 299.0))
    if pool is not None:
        assert pool.idle <= pool.limit and pool.pinned_bytes <= pool.limit


def test_the_pinned_pool_pins_and_is_reused(servers: tuple[EmbeddedServer, str]) -> None:
    srv, _ = servers
    pool = pinned.pinned_pool()
    if pool is None:
        pytest.skip("TENSORSHARE_PINNED_POOL=0")
    before = pool.registered
    with Client("127.0.0.1", srv.port, timeout=WAIT) as c:
        for i in range(4):
            c.put("p", torch.full((3 << 20,), float(i)))  # 12 MiB
            got = c.get("p", device="cuda")
            assert torch.equal(got.cpu(), torch.full((3 << 20,), float(i)))
            del got
            gc.collect()
            if i == 0:
                wait_until(lambda: pool.registered > before, WAIT, "the buffer pinned")
    assert pool.registered >= before + 1 and pool.reused >= 2
    part = pool.take(3 << 20 << 2)  # that class again: a pinned buffer
    assert torch.frombuffer(part, dtype=torch.uint8).is_pinned()
    del part


def test_non_blocking_orders_the_copy_before_the_current_stream(client: Client) -> None:
    x = torch.arange(1 << 24, dtype=torch.float64)  # 128 MiB
    client.put("nb", x)
    for _ in range(3):
        got = client.peek("nb", device="cuda", non_blocking=True)
        total = got.sum()  # queued at once on the current stream, right after the copy
        assert float(total.item()) == float(x.sum().item())
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            got = client.peek("nb", device="cuda", non_blocking=True)
            assert float(got.sum().item()) == float(x.sum().item())  # (its current stream)


def _dataset(n: int, bs: int) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    ds = TensorDataset(torch.arange(n).float().unsqueeze(1).repeat(1, 64), torch.arange(n))
    return DataLoader(ds, batch_size=bs, shuffle=False)


def test_shared_loader_on_the_gpu_in_order_and_complete(servers: tuple[EmbeddedServer, str]
                                                        ) -> None:
    srv, _ = servers
    job = SharedLoader("cuda-loader", "127.0.0.1", srv.port, batch_size=32, device="cuda",
                       prefetch=2, timeout=WAIT, name="j")
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(serve_loader(
        _dataset(1000, 50), "cuda-loader", "127.0.0.1", srv.port, window=8, wait_for=1,
        progress=False)))
    t.start()
    labels, lens = [], []
    pool = pinned.pinned_pool()
    for x, y in job:
        assert x.device.type == "cuda" and y.device.type == "cuda"
        assert torch.equal(x[:, 0], y.float())
        torch.matmul(x.T, x)  # a step while the next batches copy
        labels += y.tolist()
        lens.append(len(job))
    t.join(WAIT)
    assert labels == list(range(1000)) and lens == [32] * 32
    if pool is not None:
        assert pool.pinned_bytes <= pool.limit and pool.idle <= pool.limit
    job.close()


def test_rl_worker_on_the_gpu_and_loading_into_a_model(servers: tuple[EmbeddedServer, str]
                                                       ) -> None:
    from tensorshare import RLTrainer, RLWorker

    srv, _ = servers
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 8))
    trainer = RLTrainer("127.0.0.1", srv.port)
    worker = RLWorker("127.0.0.1", srv.port, device="cuda")
    try:
        trainer.publish_parameters(src.state_dict())
        got = worker.get_parameters()
        assert all(t.device.type == "cuda" for t in got.values())
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 8)).cuda()
        worker.version = None  # (download again, into the model this time)
        del got
        worker._params = None
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        assert worker.load_parameters_into(model)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before  # into its own tensors: nothing new
        for k, v in model.state_dict().items():
            assert torch.equal(v.cpu(), src.state_dict()[k])
    finally:
        worker.stop()
        trainer.stop()


# -- CUDA IPC between processes -------------------------------------------------------------

CONSUMER = r"""
import json, os, sys, threading, torch
from tensorshare.data import StreamConsumer
from tensorshare import Lagged, ProducerGone, WaitTimeout
url, name, n, slow = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
N = int(os.environ["ITEM_N"])
base = torch.arange(N, dtype=torch.int64, device="cuda") * 7
c = StreamConsumer("ipc", name, url, start="now", lease=float(os.environ.get("LEASE", "10")),
                   timeout=60, device=os.environ.get("WANT_DEVICE") or None)
print("READY", flush=True)
seen = bad = lagged = 0
device = None
pause = threading.Event()
try:
    while seen + lagged < n:
        try:
            got = c.read(4)
        except Lagged as e:
            lagged += e.missed or 0
            continue
        for x, i in got.items:
            device = str(x.device)
            if not (x.is_cuda and torch.equal(x, base + i)):
                bad += 1
            seen += 1
        if slow:
            pause.wait(slow)
        if got.finished:
            break
except ProducerGone as e:
    print(json.dumps({"gone": str(e), "seen": seen, "bad": bad}), flush=True)
    sys.exit(3)
print(json.dumps({"seen": seen, "bad": bad, "lagged": lagged, "device": device,
                  "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}), flush=True)
c.close(leave=True)
"""


def spawn(script: str, *args: Any, env: dict[str, str] | None = None,
          stdin: bool = False) -> subprocess.Popen[str]:
    e = dict(os.environ, PYTHONPATH=ROOT, ITEM_N=str(N), **(env or {}))
    p = subprocess.Popen([sys.executable, "-c", script, *map(str, args)], env=e,
                         stdin=subprocess.PIPE if stdin else None,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.startswith("READY"), (line, p.stderr.read() if p.poll() is not None else "")
    return p


def result(p: subprocess.Popen[str], timeout: float = WAIT) -> dict[str, Any]:
    out, err = p.communicate(timeout=timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, f"no result (exit {p.returncode}): {err[-2000:]}"
    return dict(json.loads(lines[-1]), code=p.returncode)


def item(i: int) -> torch.Tensor:
    return torch.arange(N, dtype=torch.int64, device="cuda") * 7 + i


def produce(sock: str, n: int, window: int, consumers: int, **kw: Any) -> StreamProducer:
    prod = StreamProducer("ipc", f"unix://{sock}", window=window, device_ipc=True, **kw)
    prod.wait_for_consumers(consumers, WAIT)
    for i in range(n):
        x = item(i)
        prod.append((x, i))
        x.fill_(-1)  # the producer reuses its own tensor at once: readers have their copy
    prod.end_epoch(last=True)
    return prod


@pytest.fixture
def unix_server(tmp_path: Path) -> Iterator[str]:
    sock = str(tmp_path / "ipc.sock")
    with EmbeddedServer(port=0, unix=sock):
        yield sock


def _uuid_env() -> str:
    u = ipc.gpu_uuid(0).hex()
    return f"GPU-{u[:8]}-{u[8:12]}-{u[12:16]}-{u[16:20]}-{u[20:]}"


def test_ipc_bit_exact_through_a_ring_of_4_with_a_slow_consumer(unix_server: str) -> None:
    url = f"unix://{unix_server}"
    slow = spawn(CONSUMER, url, "slow", 2000, 0.002)
    fast = spawn(CONSUMER, url, "fast", 2000, 0.0, env={"CUDA_VISIBLE_DEVICES": _uuid_env()})
    prod = produce(unix_server, 2000, window=2, consumers=2)  # ring of window + 2 = 4
    ring = prod.ring
    assert ring is not None and ring.reason is None, ring.reason if ring else None
    assert ring.slots == 4 and ring.exported == 2000 and ring.fallbacks == 0
    prod.close()
    a, b = result(slow), result(fast)
    assert a["seen"] == b["seen"] == 2000 and a["bad"] == b["bad"] == 0
    assert a["lagged"] == b["lagged"] == 0
    assert b["device"] == "cuda:0" and b["visible"].startswith("GPU-")  # found by UUID


def test_ten_thousand_items_share_one_handle(unix_server: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    shares = []
    real = torch.UntypedStorage._share_cuda_

    def counted(self: Any) -> Any:
        shares.append(1)
        return real(self)

    monkeypatch.setattr(torch.UntypedStorage, "_share_cuda_", counted)
    reader = spawn(CONSUMER, f"unix://{unix_server}", "r", 10000, 0.0)
    prod = produce(unix_server, 10000, window=32, consumers=1)
    prod.close()
    r = result(reader, 2 * WAIT)
    assert r["seen"] == 10000 and r["bad"] == 0
    assert len(shares) == 1  # one handle for the ring; a fresh event per item, never re-shared


def test_a_killed_consumer_holds_nobody_back_and_the_ring_is_freed(unix_server: str) -> None:
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    url = f"unix://{unix_server}"
    victim = spawn(CONSUMER, url, "victim", 1000, 0.01, env={"LEASE": "1"})
    other = spawn(CONSUMER, url, "other", 1000, 0.0, env={"LEASE": "1"})
    done: list[Any] = []
    t = threading.Thread(target=lambda: done.append(
        produce(unix_server, 1000, window=4, consumers=2, lease=5.0)))
    t.start()
    with Client(url, timeout=WAIT) as look:
        def victim_read() -> bool:
            info = look.stats("ipc")["bins"].get("ipc")
            pos = info and info["stream"]["consumers"].get("victim", {}).get("position")
            return bool(pos and pos >= 20)

        wait_until(victim_read, WAIT, "the victim mid-stream")
    victim.send_signal(signal.SIGKILL)
    victim.wait(WAIT)
    t.join(2 * WAIT)
    assert done, "the producer was held back by the killed consumer"
    done[0].close()
    r = result(other)
    assert r["seen"] == 1000 and r["bad"] == 0
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    assert torch.cuda.memory_allocated() == baseline  # the ring went back


PRODUCER = r"""
import os, sys, torch
from tensorshare.data import StreamProducer
N = int(os.environ["ITEM_N"])
p = StreamProducer("ipc", sys.argv[1], window=4, device_ipc=True, lease=1.0)
print("READY", flush=True)
p.wait_for_consumers(1, 60)
i = 0
while True:
    p.append((torch.arange(N, dtype=torch.int64, device="cuda") * 7 + i, i))
    i += 1
"""


def test_a_killed_producer_is_producer_gone_not_a_hang(unix_server: str) -> None:
    url = f"unix://{unix_server}"
    producer = spawn(PRODUCER, url)
    try:
        cons = StreamConsumer("ipc", "me", url, start="now", lease=5.0, timeout=20)
        got = cons.read(4)
        assert all(torch.equal(x, item(i)) for x, i in got.items)
        producer.send_signal(signal.SIGKILL)
        producer.wait(WAIT)
        start = time.monotonic()
        with pytest.raises(ProducerGone):
            for _ in range(10000):
                for x, i in cons.read(4).items:
                    assert torch.equal(x, item(i))  # never wrong data on the way
        assert time.monotonic() - start < 20
        cons.close()
    finally:
        producer.kill()
        producer.wait(WAIT)


GETTER = r"""
import json, sys, torch
from tensorshare import Client, Lagged
c = Client(sys.argv[1], timeout=30)
print("READY", flush=True)
sys.stdin.readline()
try:
    x = c.peek("params")
    print(json.dumps({"value": x.cpu().tolist()[:3]}), flush=True)
except Lagged as e:
    print(json.dumps({"lagged": str(e)}), flush=True)
"""


def test_a_reused_slot_is_lagged_never_the_new_data(unix_server: str) -> None:
    url = f"unix://{unix_server}"
    ring = CudaIpcRing(2)
    with Client(url, timeout=WAIT) as c:
        c.put("params", ring.export(torch.full((8,), 1.0, device="cuda")))
        ring.export(torch.full((8,), 2.0, device="cuda"))
        ring.export(torch.full((8,), 3.0, device="cuda"))  # slot 0 again
        reader = spawn(GETTER, url, stdin=True)
        out, err = reader.communicate("go\n", timeout=WAIT)
    ring.close()
    line = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert line and "lagged" in json.loads(line[-1]), (out, err[-2000:])


def test_the_probe_failing_falls_back_with_one_message(unix_server: str,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    monkeypatch.setenv(ipc.IPC_ENV, "fail-probe")
    monkeypatch.setattr(ipc, "_PROBED", {})
    monkeypatch.setattr(ipc, "_WARNED", set())
    reader = spawn(CONSUMER, f"unix://{unix_server}", "r", 50, 0.0,
                   env={"WANT_DEVICE": "cuda"})  # (host copies now: moved to the GPU)
    prod = produce(unix_server, 50, window=4, consumers=1)
    assert prod.ring is not None and "fail-probe" in (prod.ring.reason or "")
    assert prod.ring.fallbacks == 50
    prod.close()
    r = result(reader)
    assert r["seen"] == 50 and r["bad"] == 0  # the host path, same data
    assert sum("CUDA IPC is not used" in rec.message for rec in caplog.records) == 1


def test_expandable_segments_in_the_producer_falls_back(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setattr(ipc, "_WARNED", set())
    ring = CudaIpcRing(4)
    x = torch.ones(4, device="cuda")
    assert ring.export(x) is x  # not through the ring: the host path (asserted: a fallback)
    assert "expandable_segments" in (ring.reason or "")
