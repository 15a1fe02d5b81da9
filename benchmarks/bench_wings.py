"""The benchmark sections of this wave's wings, run by ``bench.py`` (``--only inference``,
``--only relays``); see its docstring and README.md here.

* ``inference``: ``InferenceHost`` answering ``predict`` calls from 1, 16 and 64 concurrent
  callers (MLP 64-256-256-8 on the CPU), against a per-call baseline: a plain socket server
  process that runs the same model once per request (no batching, no tensorshare server).
  Rows: calls/s, p50 and p99 latency, and the host's mean batch.
* ``relays``: one 16 MiB put read by 32 waiting readers, straight from the primary vs through
  2 relays (16 readers each), with the primary's egress per version from its own stats.

The model servers and relays run pinned to the server core, callers and readers on the
client core, as in ``bench.py``.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench import Bench, Row

MODEL_IN, MODEL_HIDDEN, MODEL_OUT = 64, 256, 8
SERVICE = "bench/policy"
# (callers, processes they are spread over): threads per process = callers / processes
CALLER_PLANS = ((1, 1), (16, 4), (64, 4))
RELAY_READERS = 32
RELAY_SIZE = 16 << 20
RELAYS = 2


def _mlp() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(MODEL_IN, MODEL_HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(MODEL_HIDDEN, MODEL_HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(MODEL_HIDDEN, MODEL_OUT))


# --------------------------------------------------------------------------- model servers
def model_server(port_file: str) -> None:
    """The per-call baseline: one thread per connection; each request is ``MODEL_IN``
    float32 (one observation), each reply the model's ``MODEL_OUT`` float32 for it."""
    import torch

    torch.set_num_threads(1)
    model = _mlp()
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(256)
    tmp = port_file + ".tmp"
    Path(tmp).write_text(str(srv.getsockname()[1]))
    os.replace(tmp, port_file)
    n_in = MODEL_IN * 4

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(n_in)
        view = memoryview(buf)
        with conn:
            while True:
                got = 0
                while got < n_in:
                    n = conn.recv_into(view[got:])
                    if not n:
                        return
                    got += n
                x = torch.frombuffer(buf, dtype=torch.float32).view(1, MODEL_IN)
                with torch.inference_mode():
                    y = model(x)
                conn.sendall(y.numpy().tobytes())

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def inference_host(port: int) -> None:
    """The tensorshare side: an ``InferenceHost`` of the same model on the benchmark's
    server."""
    import logging

    import torch

    from tensorshare.inference import InferenceHost

    torch.set_num_threads(1)
    logging.getLogger("tensorshare").setLevel(logging.ERROR)  # its server stops first
    InferenceHost(SERVICE, _mlp(), "127.0.0.1", port, max_batch=256,
                  max_wait_ms=2.0).serve_forever()


# --------------------------------------------------------------------------- callers
def _call_loop(system: str, ts_port: int, model_port: int, calls: int,
               barrier: threading.Barrier, lat: list[int], errors: list[str]) -> None:
    """One caller: ``calls`` predictions one after another, each timed into ``lat``."""
    import torch

    from tensorshare.inference import InferenceClient

    obs = torch.randn(MODEL_IN)
    try:
        if system == "tensorshare":
            with InferenceClient(SERVICE, "127.0.0.1", ts_port, timeout=60) as pc:
                out = pc.predict(obs)  # connected and warm
                barrier.wait(60)
                for _ in range(calls):
                    t0 = time.perf_counter_ns()
                    out = pc.predict(obs)
                    lat.append(time.perf_counter_ns() - t0)
                if out.shape != (MODEL_OUT,):
                    errors.append(f"output of shape {tuple(out.shape)}")
            return
        with socket.create_connection(("127.0.0.1", model_port), timeout=60) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            raw, back = obs.numpy().tobytes(), bytearray(MODEL_OUT * 4)
            barrier.wait(60)
            for _ in range(calls):
                t0 = time.perf_counter_ns()
                s.sendall(raw)
                got, view = 0, memoryview(back)
                while got < len(back):
                    got += s.recv_into(view[got:])
                torch.frombuffer(back, dtype=torch.float32)
                lat.append(time.perf_counter_ns() - t0)
    except Exception as exc:  # reported to the benchmark
        errors.append(repr(exc))
        barrier.abort()


def _caller_main(ts_port: int, model_port: int, pipe: Connection) -> None:
    """A process of callers: per command ``(system, threads, calls)``, run ``threads``
    threads that each make ``calls`` predictions one after another (each its own client or
    socket, as separate workers would), then send ``(latencies ns, start ns, end ns,
    errors)``."""
    from bench import _ignore_sigint

    _ignore_sigint()
    import torch

    torch.set_num_threads(1)
    pipe.send("ready")
    while (cmd := pipe.recv()) is not None:
        system, threads, calls = cmd
        lat: list[list[int]] = [[] for _ in range(threads)]
        errors: list[str] = []
        barrier = threading.Barrier(threads + 1)
        ts = [threading.Thread(target=_call_loop, args=(system, ts_port, model_port, calls,
                                                         barrier, lat[i], errors))
              for i in range(threads)]
        for t in ts:
            t.start()
        try:
            barrier.wait(60)
        except threading.BrokenBarrierError:
            pass
        start = time.perf_counter_ns()
        for t in ts:
            t.join()
        end = time.perf_counter_ns()
        pipe.send(([x for one in lat for x in one], start, end, errors[:1]))


def _service_counts(port: int) -> tuple[int, int]:
    from tensorshare import Client

    with Client("127.0.0.1", port, timeout=30) as c:
        sv = c.stats(SERVICE)["bins"].get(SERVICE, {}).get("service", {})
    return sv.get("answered", 0), sv.get("batches", 0)


def section_inference(b: Bench) -> list[Row]:
    """predict at 1, 16 and 64 concurrent callers: tensorshare's batched InferenceHost vs a
    per-call model server, in the same run."""
    from bench import REPLY_TIMEOUT, Row, _fmt, _receive, _turns, helper_processes

    ts_port = b.servers["tensorshare"].port
    port_file = os.path.join(b.workdir, "model.port")
    model_proc = b.children.start([sys.executable, str(Path(__file__).with_name("bench.py")),
                                   "--model-server", port_file])
    host_proc = b.children.start([sys.executable, str(Path(__file__).with_name("bench.py")),
                                  "--inference-host", str(ts_port)])
    deadline = time.monotonic() + 60
    while not os.path.exists(port_file):
        if model_proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the model server did not start")
        time.sleep(0.01)
    model_port = int(Path(port_file).read_text())
    b.children.ready("model (per call)", model_proc, model_port)
    b.children.ready("inference host", host_proc, ts_port)
    quick = b.cfg.repeat <= 7
    reps = 3 if quick else 7
    per_caller = {1: 300 if quick else 1000, 16: 60 if quick else 200, 64: 20 if quick else 60}
    results: dict[tuple[str, int], dict[str, list[float]]] = {}
    rows: list[Row] = []
    with helper_processes(b.ctx, _caller_main, [(ts_port, model_port)] * 4,
                          "caller") as pipes:
        for callers, procs in CALLER_PLANS:
            threads = callers // procs
            for rep in range(reps + 1):  # the first is a warm-up
                for system in _turns(["tensorshare", "baseline"], rep):
                    before = _service_counts(ts_port) if system == "tensorshare" else (0, 0)
                    for conn in pipes[:procs]:
                        conn.send((system, threads, per_caller[callers]))
                    got = [_receive(conn, REPLY_TIMEOUT * 2, "caller") for conn in pipes[:procs]]
                    errors = [e for *_, errs in got for e in errs]
                    if errors:
                        raise AssertionError(f"{system} predict: {errors[0]}")
                    if not rep:
                        continue
                    lat = sorted(x for lats, *_ in got for x in lats)
                    wall = max(e for _, _, e, _ in got) - min(s for _, s, _, _ in got)
                    r = results.setdefault((system, callers), {"p50": [], "p99": [],
                                                               "rate": [], "batch": []})
                    r["p50"].append(lat[len(lat) // 2] / 1e6)
                    r["p99"].append(lat[min(len(lat) - 1, int(len(lat) * 0.99))] / 1e6)
                    r["rate"].append(len(lat) * 1e9 / wall)
                    if system == "tensorshare":
                        after = _service_counts(ts_port)
                        calls, batches = after[0] - before[0], after[1] - before[1]
                        r["batch"].append(calls / batches if batches else 0.0)
            med = {k: {m: statistics.median(v) if v else 0.0 for m, v in r.items()}
                   for k, r in results.items() if k[1] == callers}
            ts, base = med[("tensorshare", callers)], med[("baseline", callers)]
            # Issue 28: one caller's p50 at most 4x the per-call server's; 16 callers at
            # least half its calls/s (batching should pay, not cost).
            goal, met = {1: ("p50 <= 4x per call", ts["p50"] <= 4 * base["p50"]),
                         16: (">= 0.5", ts["rate"] >= 0.5 * base["rate"]),
                         64: ("batch >= 8", ts["batch"] >= 8)}[callers]
            rows.append(Row(f"predict {callers} caller{'s' if callers > 1 else ''}",
                            f"{_fmt(ts['rate'])}/s", f"{_fmt(base['rate'])}/s",
                            ts["rate"] / base["rate"], None, goal, met,
                            [f"p50 {ts['p50']:.2f} ms vs {base['p50']:.2f} ms, p99 "
                             f"{ts['p99']:.2f} ms vs {base['p99']:.2f} ms, tensorshare's mean "
                             f"batch {ts['batch']:.1f}"], group="inference"))
    b.children.stop(host_proc)
    b.children.stop(model_proc)
    b.info.append(f"inference: MLP {MODEL_IN}-{MODEL_HIDDEN}-{MODEL_HIDDEN}-{MODEL_OUT} "
                  f"(float32, CPU, 1 thread) in a process on the server core: tensorshare's "
                  f"InferenceHost (max_batch 256, max_wait_ms 2) behind the tensorshare server, "
                  f"vs a plain socket server that runs it once per call; callers are threads "
                  f"in up to 4 processes on the client core, each with its own client or socket, "
                  f"calling one after another; calls/s = calls / wall time; median of {reps} "
                  f"repeats")
    return rows


# --------------------------------------------------------------------------- relays
def _relay_reader_main(primary: int, relays: list[int], index: int, bin_name: str, n: int,
                       pipe: Connection) -> None:
    """A reader process: per round ``(system, version)`` wait (a waiting peek) for
    ``version`` from the primary or from its relay, stamp, check, send ``(stamp, error)``."""
    from bench import _ignore_sigint

    _ignore_sigint()
    from tensorshare import Client

    clients = {"direct": Client("127.0.0.1", primary, timeout=120),
               "relays": Client("127.0.0.1", relays[index % len(relays)], timeout=120)}
    pipe.send("ready")
    try:
        while (cmd := pipe.recv()) is not None:
            system, version = cmd
            pipe.send("armed")
            res = clients[system].fetch(bin_name, remove=False, newer_than=version - 1,
                                        timeout=60)
            stamp = time.perf_counter_ns()
            error = None
            if res.version != version or res.value.shape != (n,) or \
                    int(res.value[0]) != version:
                error = f"got version {res.version}, expected {version}"
            del res
            pipe.send((stamp, error))
    except EOFError:
        pass
    finally:
        for c in clients.values():
            c.close()


def section_relays(b: Bench) -> list[Row]:
    """One 16 MiB put read by 32 waiting readers: straight from the primary, or through 2
    relays; time to the last reader, and the primary's egress per version."""
    import select
    import subprocess

    import torch
    from bench import REPLY_TIMEOUT, Row, _expect, _fmt, _label, _receive, _turns, helper_processes

    from tensorshare import Client

    primary = b.servers["tensorshare"].port
    relays: list[int] = []
    for i in range(RELAYS):
        proc = b.children.start([sys.executable, "-m", "tensorshare", "relay", "--upstream",
                                 f"127.0.0.1:{primary}", "--bins", "relayfan", "--port", "0",
                                 "--poll", "0.2", "-q"], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        line = ""
        deadline = time.monotonic() + 60
        while "listening on" not in line:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("a relay did not start")
            if select.select([proc.stdout], [], [], 1.0)[0]:
                line = proc.stdout.readline()
        port = int(line.strip().rsplit(":", 1)[1])
        b.children.ready(f"relay {i}", proc, port)
        relays.append(port)
    n = RELAY_SIZE // 4
    data = torch.arange(n, dtype=torch.float32)
    times: dict[str, list[int]] = {"direct": [], "relays": []}
    egress: dict[str, list[int]] = {"direct": [], "relays": []}
    rounds = max(b.cfg.fanout_rounds, 2)
    with Client("127.0.0.1", primary, timeout=120) as writer, \
            helper_processes(b.ctx, _relay_reader_main,
                             [(primary, relays, i, "relayfan", n)
                              for i in range(RELAY_READERS)], "relay reader") as pipes:
        version = 0
        for rep in range(rounds + 1):  # the first round of each is a warm-up
            for system in _turns(["direct", "relays"], rep):
                version += 1
                for conn in pipes:
                    conn.send((system, version))
                for conn in pipes:
                    _expect(conn, "armed", REPLY_TIMEOUT, "relay reader")
                out0 = writer.stats("relayfan")["bins"].get("relayfan", {}).get("bytes_out", 0)
                data[0] = version
                t0 = time.perf_counter_ns()
                got = writer.put("relayfan", data)
                assert got == version, (got, version)
                results = [_receive(conn, REPLY_TIMEOUT, "relay reader") for conn in pipes]
                errors = [e for _, e in results if e]
                if errors:
                    raise AssertionError(f"relay fan-out ({system}): {errors[0]}")
                out1 = writer.stats("relayfan")["bins"]["relayfan"]["bytes_out"]
                if rep:
                    times[system].append(max(s for s, _ in results) - t0)
                    egress[system].append(out1 - out0)
    mb = RELAY_READERS * RELAY_SIZE / 1e6
    direct = mb * 1e9 / statistics.median(times["direct"])
    via = mb * 1e9 / statistics.median(times["relays"])
    e_direct = statistics.median(egress["direct"]) / RELAY_SIZE
    e_via = statistics.median(egress["relays"]) / RELAY_SIZE
    b.info.append(f"relays: one {_label(RELAY_SIZE)} put read by {RELAY_READERS} reader "
                  f"processes (a waiting peek each), straight from the primary or through "
                  f"{RELAYS} `tensorshare relay` processes ({RELAY_READERS // RELAYS} readers "
                  f"each; relays on the server core); MB/s = readers x size / (put to the last "
                  f"reader holding it); egress = the primary's bytes out of the bin per "
                  f"version, from its stats; median of {rounds} rounds. On one machine the "
                  f"relays share its cores: the point is the primary's egress")
    return [Row(f"relay fan-out {_label(RELAY_SIZE)} x {RELAY_READERS}",
                f"{_fmt(via)} MB/s", f"{_fmt(direct)} MB/s", via / direct, None,
                "egress once per relay", e_via <= RELAYS + 0.5,
                [f"the primary sent {e_via:.1f} x the tensor per version through {RELAYS} "
                 f"relays, {e_direct:.1f} x straight to the readers (the relays, which copy "
                 f"every version, included)"], group="relays")]
