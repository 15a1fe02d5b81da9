"""Instructions per tiny request, counted with callgrind: a measure a busy machine cannot blur.

Timings on a shared 2-core VM move by 20% from one minute to the next; the number of
instructions a request executes does not (the same count to 0.01% run after run). This counts
them for the two halves of a tiny put or get:

* **server**: a ``ServerProtocol`` (the real one, with its factory, store and sessions) fed the
  frames of ``--pairs`` put+get pairs of a 4-byte tensor, as a client sends them, through a
  transport that swallows the replies: everything tensorshare does per request, without the
  reactor's loop and the system calls (about 20-30 µs more per request, measured apart);
* **client**: a ``Client`` doing ``--pairs`` put+get pairs against a server in another process
  (only the client process is counted: all its threads, the reader's included).

Each is counted with the compiled modules (where they are built) and with the pure-Python
ones (``TENSORSHARE_NO_EXTENSIONS=1``), and instructions are collected only around the timed
loop (callgrind's instrumentation is switched on and off with ``callgrind_control``).

Usage::

    python benchmarks/instructions.py            # needs valgrind (apt-get install valgrind)
    python benchmarks/instructions.py --pairs 500

Exit status 0 with a line saying why when valgrind is not installed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- the two halves
def _frames_file(path: str, pairs: int) -> None:
    """The bytes a client sends for hello and ``pairs`` put+get pairs, one frame per record."""
    import torch

    from tensorshare.wire.codec import encode
    from tensorshare.wire.messages import Fetch, FetchSpec, Hello, Item, Put
    from tensorshare.wire.protocol import AckInfo, ClientConnection

    conn = ClientConnection()
    item = Item(encode(torch.ones(1)), None)

    def frame(msg: object, ack: AckInfo | None = None) -> bytes:
        return b"".join(bytes(c) for c in conn.send(msg, ack))  # type: ignore[arg-type]

    with open(path, "wb") as f:
        records = [frame(Hello(1, (1,), "instructions", None, b"s" * 16, False, False))]
        for i in range(pairs):
            records.append(frame(Put(2 + 2 * i, "x", item), AckInfo(1 + 2 * i)))
            records.append(frame(Fetch(3 + 2 * i, "x", FetchSpec(True)), AckInfo(2 + 2 * i)))
        for r in records:
            f.write(struct.pack("<I", len(r)) + r)


class _Swallow:
    """A transport that takes every reply and sends nothing (what ServerProtocol needs)."""

    connected, disconnecting, _writeDisconnected = True, False, False
    queued_bytes, producer, streamingProducer = 0, None, True

    def __init__(self) -> None:
        self.frames = 0

    def write_frames(self, chunks: list[object]) -> None:
        self.frames += 1

    def writeSequence(self, chunks: list[object], fds: object = None,  # noqa: N802
                      owner: object = None) -> None:
        self.frames += 1

    def getPeer(self) -> object:  # noqa: N802
        return type("Peer", (), {"host": "127.0.0.1", "port": 1})()

    def registerProducer(self, producer: object, streaming: bool) -> None:  # noqa: N802
        pass


def _server_half(frames_path: str, warm: int) -> None:
    from twisted.internet.epollreactor import EPollReactor

    from tensorshare.server.core import ServerFactory

    data = Path(frames_path).read_bytes()
    records, i = [], 0
    while i < len(data):
        (n,) = struct.unpack_from("<I", data, i)
        records.append(data[i + 4:i + 4 + n])
        i += 4 + n
    factory = ServerFactory(EPollReactor(), None, None)
    proto = factory.buildProtocol(None)
    transport = _Swallow()
    proto.makeConnection(transport)  # type: ignore[arg-type]
    proto.dataReceived(records[0])
    assert proto.version is not None, "the handshake failed"
    for r in records[1:warm + 1]:
        proto.dataReceived(r)
    timed = records[warm + 1:]
    _instrument("on")
    for r in timed:
        proto.dataReceived(r)
    _instrument("off")
    assert transport.frames >= len(timed), "some requests went unanswered"
    print(f"requests {len(timed)}")


def _client_half(port: int, pairs: int) -> None:
    import torch

    from tensorshare import Client

    t = torch.ones(1)
    with Client("127.0.0.1", port, timeout=300) as c:
        # Under callgrind a request takes milliseconds, not tens of microseconds: longer than
        # the reader thread's LINGER, so it would wake for every request, which it does not
        # do at full speed (a lone caller reads its own replies). Count that path.
        c._conn._election.linger = 60.0
        for _ in range(50):
            c.put("x", t)
            c.get("x")
        _instrument("on")
        for _ in range(pairs):
            c.put("x", t)
            c.get("x")
        _instrument("off")
    print(f"requests {2 * pairs}")


def _instrument(state: str) -> None:
    subprocess.run(["callgrind_control", "-i", state, str(os.getpid())], capture_output=True,
                   check=False, timeout=60)


# --------------------------------------------------------------------------- running them
def _count(args: list[str], env: dict[str, str], workdir: str) -> tuple[int, int]:
    """Run this file with ``args`` under callgrind; return (instructions, requests)."""
    out = os.path.join(workdir, "cg.out")
    proc = subprocess.run(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
         sys.executable, str(Path(__file__).resolve()), *args],
        env={**env, "PYTHONHASHSEED": "0"}, capture_output=True, text=True, timeout=3600)
    match = re.search(r"^requests (\d+)$", proc.stdout, re.M)
    if proc.returncode != 0 or match is None:
        raise RuntimeError(f"callgrind run {args} failed:\n{proc.stdout}\n{proc.stderr[-2000:]}")
    total = next(int(line.split()[1]) for line in Path(out).read_text().splitlines()
                 if line.startswith("totals:"))
    os.remove(out)
    return total, int(match.group(1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=500, help="put+get pairs counted per half")
    p.add_argument("--half", choices=("server", "client"), help=argparse.SUPPRESS)
    p.add_argument("--frames", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.half == "server":
        _server_half(args.frames, 200)
        return 0
    if args.half == "client":
        _client_half(args.port, args.pairs)
        return 0
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("skipped: valgrind is not installed (apt-get install valgrind)")
        return 0
    sys.path.insert(0, str(ROOT))
    try:
        from tensorshare import _ext
        if not Path(_ext.__file__).resolve().is_relative_to(ROOT):
            raise ImportError("another tree's (an editable install's finder found it)")
    except ImportError:  # a tree from before the compiled hot path: one column
        _ext = None  # type: ignore[assignment]
        print("compiled modules: none in this tree")
    else:
        print(f"compiled modules built: {sum(_ext.compiled().values())} of "
              f"{len(getattr(_ext, 'TWINS', None) or _ext.COMPILED)}")  # (or an older tree's)
    base_env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as workdir:
        frames = os.path.join(workdir, "frames.bin")
        _frames_file(frames, args.pairs + 200)
        server = subprocess.Popen([sys.executable, "-m", "tensorshare", "serve", "--port", "0",
                                   "-q"], stdout=subprocess.PIPE, text=True, env=base_env)
        try:
            assert server.stdout is not None
            port = int(server.stdout.readline().rsplit(":", 1)[1])
            print(f"{'instructions per request':28s}{'compiled':>14s}{'pure Python':>14s}"
                  f"{'ratio':>8s}")
            for half, extra in (("server", ["--frames", frames]),
                                ("client", ["--port", str(port)])):
                counts = []
                for pure in ((False, True) if _ext is not None else (True,)):
                    env = dict(base_env)
                    if pure and _ext is not None:
                        env[_ext.NO_EXTENSIONS_ENV] = "1"
                    total, n = _count(["--half", half, "--pairs", str(args.pairs), *extra],
                                      env, workdir)
                    counts.append(total / n)
                if len(counts) == 1:
                    print(f"{half:28s}{'-':>14s}{counts[0]:>14,.0f}{'-':>8s}")
                else:
                    print(f"{half:28s}{counts[0]:>14,.0f}{counts[1]:>14,.0f}"
                          f"{counts[0] / counts[1]:>8.2f}")
        finally:
            server.terminate()
            server.wait(60)
    print("server: a ServerProtocol fed the frames in-process (no reactor loop, no system "
          "calls); client: a Client against a server process, all its threads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
