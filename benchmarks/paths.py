"""Instructions per operation on three paths, per function, counted with callgrind.

Where ``instructions.py`` counts a tiny put+get, this counts the paths issue 37's other goals are
about, with the measured process under ``valgrind --tool=callgrind`` and counting switched on
(``callgrind_control -i on``) only around the measured operations:

* ``predict``: ``Linear(8, 4)`` through an ``InferenceHost``, 16 ``InferenceClient`` s with 4 calls
  in flight each in one process (as ``bench.py``'s callers); ``--side server`` or ``callers``;
* ``notify``: puts 2 ms apart to a bin an ``inline`` listener in another process listens to;
  ``--side server`` or ``listener``;
* ``get``: a 1 MiB tensor put and got back by a ``Client``; the client is counted, around its gets.

It prints the instructions per operation and the package's functions by inclusive cost per
operation. Needs valgrind (``callgrind_control``, ``callgrind_annotate``). Run from the
repository root: ``python benchmarks/paths.py predict --side server``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CALLGRIND = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]


def _toggle(pid: int, on: bool) -> None:
    subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(pid)], check=True,
                   capture_output=True, timeout=60)


def _serve(out: Path | None, tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A server on a free port (under callgrind when ``out``)."""
    ports = tmp / "port.txt"
    cmd = [*CALLGRIND, f"--callgrind-out-file={out}"] if out else []
    proc = subprocess.Popen([*cmd, sys.executable, "-m", "tensorshare", "serve", "--port", "0",
                             "-q"], stdout=ports.open("wb"), stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        m = re.search(r"listening on \S+:(\d+)\n", ports.read_text() if ports.exists() else "")
        if m:
            return proc, int(m.group(1))
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start within 120 s")


def _predict(port: int, pid: int, calls: int) -> int:
    """16 clients, 4 calls in flight each; counts around the second round. Returns calls."""
    import torch

    from tensorshare.inference import InferenceClient

    obs = torch.randn(8)

    def one(n: int, start: threading.Barrier, end: threading.Barrier) -> None:
        with InferenceClient("bench/linear", "127.0.0.1", port, timeout=600) as pc:
            pc.predict(obs)
            start.wait(600)
            window: deque[Any] = deque(pc.predict_async(obs) for _ in range(min(4, n)))
            sent = len(window)
            while window:
                window.popleft().result(600)
                if sent < n:
                    window.append(pc.predict_async(obs))
                    sent += 1
            end.wait(600)

    for measured in (False, True):
        start, end = threading.Barrier(17), threading.Barrier(17)
        threads = [threading.Thread(target=one, args=(calls, start, end)) for _ in range(16)]
        for t in threads:
            t.start()
        start.wait(600)
        if measured:
            _toggle(pid, True)
        end.wait(600)
        if measured:
            _toggle(pid, False)
        for t in threads:
            t.join(600)
    return 16 * calls


def _host(port: int) -> subprocess.Popen[bytes]:
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import bench_wings; "
            f"bench_wings.inference_host({port}, 'linear')")
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)


def _listener(port: int) -> None:
    """The listener process: listens inline until its stdin closes."""
    from tensorshare import Client

    got: list[int] = []
    with Client("127.0.0.1", port, timeout=60) as c:
        c.listen("paths", lambda ev: got.append(ev["version"]), inline=True)
        print("ready", flush=True)
        sys.stdin.readline()
    print(len(got), flush=True)


def _notify(port: int, pid: int | None, n: int, out: Path | None) -> int:
    """Puts 2 ms apart to a listened bin; counts ``pid`` (or the listener when ``out``)."""
    import torch

    from tensorshare import Client

    cmd = [*CALLGRIND, f"--callgrind-out-file={out}"] if out else []
    lis = subprocess.Popen([*cmd, sys.executable, __file__, "listener", "--port", str(port)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert lis.stdout is not None and lis.stdin is not None
    if lis.stdout.readline().strip() != "ready":
        raise SystemExit("the listener did not start")
    counted = lis.pid if out else pid
    assert counted is not None
    with Client("127.0.0.1", port, timeout=60) as c:
        v = torch.ones(1)
        for measured in (False, True):
            if measured:
                time.sleep(0.5)
                _toggle(counted, True)
            for _ in range(n):
                c.put("paths", v)
                time.sleep(0.002)
            time.sleep(1.0)
            if measured:
                _toggle(counted, False)
    lis.stdin.close()
    lis.wait(120)
    return n


def _get(port: int, n: int) -> int:
    """Counts this process around ``n`` gets of a 1 MiB tensor (the puts are not counted)."""
    import torch

    from tensorshare import Client

    with Client("127.0.0.1", port, timeout=60) as c:
        v = torch.ones(1 << 18)
        for measured in (False, True):
            for _ in range(n):
                c.put("paths", v)
                if measured:
                    _toggle(os.getpid(), True)
                c.get("paths")
                if measured:
                    _toggle(os.getpid(), False)
    return n


def _report(out: Path, ops: int, what: str, top: int) -> None:
    text = subprocess.run(["callgrind_annotate", "--inclusive=yes", str(out)],
                          capture_output=True, text=True, timeout=600).stdout
    total = re.search(r"^([\d,]+) \(100\.0%\)\s+PROGRAM TOTALS", text, re.M)
    if total is None:
        raise SystemExit(f"no callgrind totals in {out}")
    print(f"{what}: {int(total.group(1).replace(',', '')) / ops:,.0f} instructions per "
          f"operation ({ops} operations counted)")
    seen: set[str] = set()
    for line in text.splitlines():
        m = re.match(r"^\s*([\d,]+) \([\d.]+%\)\s+\?\?\?:__pyx_(?:f|pf)_11tensorshare_(\S+)",
                     line)
        name = _demangle(m.group(2)) if m else ""
        if m and name not in seen and len(seen) < top:
            print(f"  {int(m.group(1).replace(',', '')) / ops:>10,.0f}  {name}")
            seen.add(name)
    copies = re.search(r"^\s*([\d,]+) \([\d.]+%\)\s+\S*:__mem(?:cpy|move)\w*", text, re.M)
    if copies:
        print(f"  {int(copies.group(1).replace(',', '')) / ops:>10,.0f}  libc memcpy (copies)")


def _demangle(s: str) -> str:
    """``6server_12connection_c_10Connection__pass`` -> ``server.connection.Connection._pass``
    (Cython's names: each part its length, then the function's own name; a ``def``'s a
    number first)."""
    parts, i = [], 0
    while i < len(s) and s[i].isdigit():
        j = i
        while s[j].isdigit():
            j += 1
        n = int(s[i:j])
        parts.append(s[j:j + n].removesuffix("_c"))
        i = j + n + 1 if s[j + n:j + n + 1] == "_" else j + n
    return ".".join([*parts, re.sub(r"^\d+", "", s[i:])]) if i < len(s) else ".".join(parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", choices=["predict", "notify", "get", "listener"])
    p.add_argument("--side", default="server",
                   help="predict: server or callers; notify: server or listener")
    p.add_argument("--ops", type=int, default=0, help="operations counted (per caller for "
                   "predict; default: predict 100, notify 300, get 60)")
    p.add_argument("--top", type=int, default=20, help="functions listed (default 20)")
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.path.insert(0, str(ROOT))
    if args.path == "listener":
        _listener(args.port)
        return 0
    if args.path == "predict" and args.side == "callers" or args.path == "get":
        if "--counted" not in os.environ.get("TENSORSHARE_PATHS", ""):
            out = Path(tempfile.mkdtemp(prefix="tensorshare-paths-")) / "this.cg"
            env = {**os.environ, "TENSORSHARE_PATHS": "--counted"}
            subprocess.run([*CALLGRIND, f"--callgrind-out-file={out}", sys.executable,
                            *sys.argv], env=env, check=True, timeout=3600)
            n = args.ops or (100 if args.path == "predict" else 60)
            _report(out, 16 * n if args.path == "predict" else n,
                    f"{args.path} ({args.side if args.path == 'predict' else 'client'})",
                    args.top)
            return 0
    with tempfile.TemporaryDirectory(prefix="tensorshare-paths-") as d:
        tmp = Path(d)
        out = tmp / "counted.cg"
        counted_server = args.side == "server" and args.path != "get"
        server, port = _serve(out if counted_server else None, tmp)
        host = _host(port) if args.path == "predict" else None
        try:
            if host is not None:
                time.sleep(8)  # the host connects and takes
            if args.path == "predict":
                ops = _predict(port, server.pid if counted_server else os.getpid(),
                               args.ops or 100)
            elif args.path == "notify":
                ops = _notify(port, server.pid if counted_server else None, args.ops or 300,
                              None if counted_server else out)
            else:
                ops = _get(port, args.ops or 60)
        finally:
            if host is not None:
                host.terminate()
                host.wait(60)
            server.terminate()
            server.wait(120)
        if counted_server or args.path == "notify":
            _report(out, ops, f"{args.path} ({args.side})", args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
