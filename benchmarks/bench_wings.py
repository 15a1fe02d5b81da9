"""The benchmark sections of this wave's wings, run by ``bench.py`` (``--only inference``,
``--only relays``); see its docstring and README.md here.

* ``inference``: ``InferenceHost`` answering ``predict`` calls from 1 caller, 16 callers
  with 4 calls in flight each (MLP 64-256-256-8, and ``Linear(8, 4)`` where only overhead
  counts) and 64 callers, against a per-call baseline: a plain socket server process that
  answers every connection from one thread and runs the same model once per request (no
  batching, no tensorshare server). Rows: calls/s, p50 and p99 latency, the host's mean
  batch.
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
# The models: the policy-sized MLP, and a Linear(8, 4) where nothing but overhead is measured.
# kind -> (inputs, outputs)
MODELS = {"mlp": (MODEL_IN, MODEL_OUT), "linear": (8, 4)}
# (model, callers, processes they are spread over, calls in flight per caller): threads per
# process = callers / processes; a caller keeps that many calls in flight (predict_async, or
# as many requests written ahead on its socket).
CALLER_PLANS = (("mlp", 1, 1, 1), ("mlp", 16, 4, 4), ("linear", 16, 4, 4), ("mlp", 64, 4, 1))
RELAY_READERS = 32
RELAY_SIZE = 16 << 20
RELAYS = 2


def _service(kind: str) -> str:
    return f"bench/{kind}"


def _model(kind: str = "mlp") -> Any:
    import torch

    torch.manual_seed(0)
    if kind == "linear":
        return torch.nn.Linear(*MODELS["linear"])
    return torch.nn.Sequential(torch.nn.Linear(MODEL_IN, MODEL_HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(MODEL_HIDDEN, MODEL_HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(MODEL_HIDDEN, MODEL_OUT))


# --------------------------------------------------------------------------- model servers
def model_server(port_file: str, kind: str = "mlp") -> None:
    """The per-call baseline: one thread answers every connection (``selectors``); each
    request is one observation (float32), each reply the model's output for it, the model
    run once per request (no batching). Every request a read completes is answered, the
    replies of one read in one ``sendall``."""
    import selectors

    import torch

    torch.set_num_threads(1)
    model = _model(kind)
    n_in, n_out = MODELS[kind]
    size = n_in * 4
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(256)
    tmp = port_file + ".tmp"
    Path(tmp).write_text(str(srv.getsockname()[1]))
    os.replace(tmp, port_file)
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ, None)
    pending: dict[socket.socket, bytearray] = {}
    while True:
        for key, _ in sel.select():
            sock = key.fileobj
            if key.data is None:
                conn, _ = srv.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                pending[conn] = bytearray()
                sel.register(conn, selectors.EVENT_READ, True)
                continue
            assert isinstance(sock, socket.socket)
            data = sock.recv(1 << 16)
            if not data:
                sel.unregister(sock)
                del pending[sock]
                sock.close()
                continue
            buf = pending[sock]
            buf += data
            out = []
            while len(buf) >= size:
                x = torch.frombuffer(bytearray(buf[:size]), dtype=torch.float32).view(1, n_in)
                del buf[:size]
                with torch.inference_mode():
                    out.append(model(x).numpy().tobytes())
            if out:
                sock.sendall(b"".join(out))


def inference_host(port: int, kind: str = "mlp") -> None:
    """The tensorshare side: an ``InferenceHost`` of the same model on the benchmark's
    server, with the host's defaults (max_batch 256, its default max_wait_ms)."""
    import logging

    import torch

    from tensorshare.inference import InferenceHost

    torch.set_num_threads(1)
    logging.getLogger("tensorshare").setLevel(logging.ERROR)  # its server stops first
    InferenceHost(_service(kind), _model(kind), "127.0.0.1", port,
                  max_batch=256).serve_forever()


# --------------------------------------------------------------------------- callers
def _ts_calls(kind: str, port: int, calls: int, inflight: int, barrier: threading.Barrier,
              lat: list[int]) -> str | None:
    """One tensorshare caller: ``calls`` predictions, ``inflight`` at a time, each timed
    from its submission to its result; returns a problem, or ``None``."""
    from collections import deque

    import torch

    from tensorshare.inference import InferenceClient

    n_in, n_out = MODELS[kind]
    obs = torch.randn(n_in)
    with InferenceClient(_service(kind), "127.0.0.1", port, timeout=60) as pc:
        out = pc.predict(obs)  # connected and warm
        barrier.wait(60)
        if inflight == 1:
            for _ in range(calls):
                t0 = time.perf_counter_ns()
                out = pc.predict(obs)
                lat.append(time.perf_counter_ns() - t0)
        else:
            window: deque[tuple[int, Any]] = deque()
            sent = 0
            while sent < min(inflight, calls):
                window.append((time.perf_counter_ns(), pc.predict_async(obs)))
                sent += 1
            while window:
                t0, fut = window.popleft()
                out = fut.result(60)
                lat.append(time.perf_counter_ns() - t0)
                if sent < calls:
                    window.append((time.perf_counter_ns(), pc.predict_async(obs)))
                    sent += 1
    return None if out.shape == (n_out,) else f"output of shape {tuple(out.shape)}"


def _base_calls(kind: str, port: int, calls: int, inflight: int, barrier: threading.Barrier,
                lat: list[int]) -> None:
    """One caller of the per-call server: as :func:`_ts_calls`, ``inflight`` requests
    written ahead on its socket, each reply read whole."""
    from collections import deque

    import torch

    n_in, n_out = MODELS[kind]
    raw = torch.randn(n_in).numpy().tobytes()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        back = bytearray(n_out * 4)
        view = memoryview(back)
        barrier.wait(60)
        window: deque[int] = deque()
        sent = 0
        while sent < min(inflight, calls):
            window.append(time.perf_counter_ns())
            s.sendall(raw)
            sent += 1
        while window:
            got = 0
            while got < len(back):
                n = s.recv_into(view[got:])
                if not n:
                    raise ConnectionError("the model server closed the connection")
                got += n
            torch.frombuffer(back, dtype=torch.float32)
            lat.append(time.perf_counter_ns() - window.popleft())
            if sent < calls:
                window.append(time.perf_counter_ns())
                s.sendall(raw)
                sent += 1


def _call_loop(system: str, kind: str, ts_port: int, model_port: int, calls: int,
               inflight: int, barrier: threading.Barrier, lat: list[int],
               errors: list[str]) -> None:
    """One caller: ``calls`` predictions, ``inflight`` at a time, each timed into ``lat``."""
    try:
        if system == "tensorshare":
            problem = _ts_calls(kind, ts_port, calls, inflight, barrier, lat)
            if problem:
                errors.append(problem)
        else:
            _base_calls(kind, model_port, calls, inflight, barrier, lat)
    except Exception as exc:  # reported to the benchmark
        errors.append(repr(exc))
        barrier.abort()


def _caller_main(ts_port: int, model_ports: dict[str, int], pipe: Connection) -> None:
    """A process of callers: per command ``(system, kind, threads, calls, inflight)``, run
    ``threads`` threads that each make ``calls`` predictions, ``inflight`` at a time (each
    its own client or socket, as separate workers would), then send ``(latencies ns, start
    ns, end ns, errors, CPU seconds of this process meanwhile)``."""
    from bench import _ignore_sigint

    _ignore_sigint()
    import torch

    torch.set_num_threads(1)
    pipe.send("ready")
    while (cmd := pipe.recv()) is not None:
        system, kind, threads, calls, inflight = cmd
        lat: list[list[int]] = [[] for _ in range(threads)]
        errors: list[str] = []
        barrier = threading.Barrier(threads + 1)
        ts = [threading.Thread(target=_call_loop,
                               args=(system, kind, ts_port, model_ports[kind], calls,
                                     inflight, barrier, lat[i], errors))
              for i in range(threads)]
        for t in ts:
            t.start()
        try:
            barrier.wait(60)
        except threading.BrokenBarrierError:
            pass
        start, cpu = time.perf_counter_ns(), time.process_time()
        for t in ts:
            t.join()
        end = time.perf_counter_ns()
        pipe.send(([x for one in lat for x in one], start, end, errors[:1],
                   time.process_time() - cpu))


def _service_counts(port: int, kind: str) -> tuple[int, int]:
    from tensorshare import Client

    name = _service(kind)
    with Client("127.0.0.1", port, timeout=30) as c:
        sv = c.stats(name)["bins"].get(name, {}).get("service", {})
    return sv.get("answered", 0), sv.get("batches", 0)


def _start_models(b: Bench, ts_port: int) -> tuple[dict[str, int], dict[str, Any]]:
    """A per-call model server and an InferenceHost per model: the model servers' ports,
    and the processes started (``(model server, host)`` per model)."""
    ports: dict[str, int] = {}
    procs: dict[str, Any] = {}
    script = str(Path(__file__).with_name("bench.py"))
    for kind in MODELS:
        port_file = os.path.join(b.workdir, f"model-{kind}.port")
        model_proc = b.children.start([sys.executable, script, "--model-server", port_file,
                                       "--model", kind])
        host_proc = b.children.start([sys.executable, script, "--inference-host",
                                      str(ts_port), "--model", kind])
        procs[kind] = (model_proc, host_proc)
        deadline = time.monotonic() + 60
        while not os.path.exists(port_file):
            if model_proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the model server did not start")
            time.sleep(0.01)
        ports[kind] = int(Path(port_file).read_text())
        b.children.ready(f"model {kind} (per call)", model_proc, ports[kind])
        b.children.ready(f"inference host {kind}", host_proc, ts_port)
    return ports, procs


def _plan_goal(kind: str, callers: int, ts: dict[str, float],
               base: dict[str, float]) -> tuple[str, bool]:
    """Issue 37's goal for a plan, and whether it is met."""
    if callers == 1:
        return "p50 <= 3x per call", ts["p50"] <= 3 * base["p50"]
    if callers >= 64:
        return "batch >= 8", ts["batch"] >= 8
    want = 1.5 if kind == "mlp" else 0.5
    return f">= {want}", round(ts["rate"] / base["rate"], 2) >= want


def section_inference(b: Bench) -> list[Row]:
    """predict through tensorshare's batched InferenceHost vs a per-call model server that
    answers every connection from one thread, in the same run: 1 caller, 16 callers with 4
    calls in flight each (the MLP, and Linear(8, 4)), 64 callers."""
    from bench import REPLY_TIMEOUT, Row, _cpu_seconds, _fmt, _receive, _turns, helper_processes

    ts_port = b.servers["tensorshare"].port
    model_ports, started = _start_models(b, ts_port)
    quick = b.cfg.repeat <= 7
    reps = 3 if quick else 7
    per_caller = {1: 300 if quick else 1000, 16: 120 if quick else 400, 64: 20 if quick else 60}
    rows: list[Row] = []
    with helper_processes(b.ctx, _caller_main, [(ts_port, model_ports)] * 4,
                          "caller") as pipes:
        for kind, callers, procs, inflight in CALLER_PLANS:
            threads = callers // procs
            r: dict[str, dict[str, list[float]]] = {}
            for rep in range(reps + 1):  # the first is a warm-up
                for system in _turns(["tensorshare", "baseline"], rep):
                    before = _service_counts(ts_port, kind) if system == "tensorshare" \
                        else (0, 0)
                    # The server core's CPU: tensorshare's server and host, or the model server.
                    pids = [b.servers["tensorshare"].pid, started[kind][1].pid] \
                        if system == "tensorshare" else [started[kind][0].pid]
                    cpu0 = [_cpu_seconds(pid) for pid in pids]
                    for conn in pipes[:procs]:
                        conn.send((system, kind, threads, per_caller[callers], inflight))
                    got = [_receive(conn, REPLY_TIMEOUT * 2, "caller") for conn in pipes[:procs]]
                    errors = [e for _, _, _, errs, _ in got for e in errs]
                    if errors:
                        raise AssertionError(f"{system} predict: {errors[0]}")
                    if not rep:
                        continue
                    used = [_cpu_seconds(pid) - c for pid, c in zip(pids, cpu0, strict=True)]
                    lat = sorted(x for lats, *_ in got for x in lats)
                    wall = max(e for _, _, e, _, _ in got) - min(s for _, s, _, _, _ in got)
                    m = r.setdefault(system, {"p50": [], "p99": [], "rate": [], "batch": [],
                                              "client_us": [], "server_us": [],
                                              "host_us": []})
                    m["client_us"].append(sum(g[4] for g in got) * 1e6 / len(lat))
                    m["server_us"].append(used[0] * 1e6 / len(lat))
                    m["host_us"].append(used[-1] * 1e6 / len(lat) if len(used) > 1 else 0.0)
                    m["p50"].append(lat[len(lat) // 2] / 1e6)
                    m["p99"].append(lat[min(len(lat) - 1, int(len(lat) * 0.99))] / 1e6)
                    m["rate"].append(len(lat) * 1e9 / wall)
                    if system == "tensorshare":
                        after = _service_counts(ts_port, kind)
                        calls, batches = after[0] - before[0], after[1] - before[1]
                        m["batch"].append(calls / batches if batches else 0.0)
            med = {k: {n: statistics.median(v) if v else 0.0 for n, v in one.items()}
                   for k, one in r.items()}
            ts, base = med["tensorshare"], med["baseline"]
            goal, met = _plan_goal(kind, callers, ts, base)
            label = "MLP" if kind == "mlp" else "Linear(8,4)"
            who = f"{callers}x{inflight} in flight" if inflight > 1 else \
                f"{callers} caller{'s' if callers > 1 else ''}"
            rows.append(Row(f"predict {label} {who}", f"{_fmt(ts['rate'])}/s", f"{_fmt(base['rate'])}/s",
                            ts["rate"] / base["rate"], None, goal, met,
                            [f"p50 {ts['p50']:.3f} ms vs {base['p50']:.3f} ms "
                             f"({ts['p50'] / base['p50']:.1f}x), p99 {ts['p99']:.2f} ms vs "
                             f"{base['p99']:.2f} ms, tensorshare's mean batch "
                             f"{ts['batch']:.1f}",
                             f"CPU per call: tensorshare's callers {ts['client_us']:.0f} us, "
                             f"its server {ts['server_us']:.0f} us + host "
                             f"{ts['host_us']:.0f} us; per-call callers "
                             f"{base['client_us']:.0f} us, its server "
                             f"{base['server_us']:.0f} us"], group="inference"))
    for pair in started.values():
        for proc in pair:
            b.children.stop(proc)
    b.info.append(f"inference: MLP {MODEL_IN}-{MODEL_HIDDEN}-{MODEL_HIDDEN}-{MODEL_OUT} and "
                  f"Linear(8, 4) (float32, CPU, 1 thread) in processes on the server core: "
                  f"tensorshare's InferenceHost (max_batch 256, its default max_wait_ms) behind "
                  f"the tensorshare server, vs a plain socket server that answers every "
                  f"connection from one thread and runs the model once per call; callers are "
                  f"threads in up to 4 processes on the client core, each with its own client "
                  f"or socket, keeping 1 or 4 calls in flight; calls/s = calls / wall time; "
                  f"latency from a call's submission to its result; CPU per call: the caller "
                  f"processes' CPU time, and the server core's processes' (from /proc), over "
                  f"the calls; median of {reps} repeats")
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
