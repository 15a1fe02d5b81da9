"""Benchmark tensorshare against a minimal plain-socket baseline (and Redis), in the same run.

Run ``python benchmarks/bench.py`` (about three minutes), ``--quick`` (under a minute),
``--sizes 4K,1M``, ``--repeat N`` and/or ``--only SECTIONS`` to change what is measured.
See README.md here.

The servers run as separate processes pinned to core 0 (when there are at least two cores):

* tensorshare: ``python -m tensorshare serve --port 0 -q`` (Twisted, msgpack headers);
* baseline: this file run as ``bench.py --baseline-server PORT_FILE``, a threaded plain-Python
  socket server speaking a trivial length-prefixed protocol (see :class:`BaselineServer`);
* for the persistence rows, two more tensorshare servers with ``--data-dir`` (in temporary
  directories) and ``--fsync everysec`` / ``--fsync always``;
* for the tiny rows, this file run as ``bench.py --bare-twisted-server PORT_FILE``: a bare
  Twisted protocol answering each frame with no parsing or store (the floor of the server's
  CPU per request, :func:`serve_bare_twisted`);
* for the Redis row, ``redis-server`` (when it and redis-py with hiredis are installed).

The benchmark process, pinned to core 1, talks to each with a blocking client:
``tensorshare.Client``, :class:`BaselineClient` (which sends ``memoryview(t.numpy())`` and
rebuilds the tensor with ``torch.frombuffer``, so both sides do the same useful work) and
redis-py. Helper processes (the notification listener, the 32 fan-out readers) are forked
from a forkserver that inherits core 1.

Sections (``--only``), for tensorshare and the baseline unless said otherwise:

* ``transfer``: put and get throughput of float32 tensors (4 KiB to 64 MiB, put then get of
  the same bin);
* ``tiny``: the rate of tiny put+get round trips (a 4-byte tensor; every put and every get
  counts as one op), each side's CPU per op (the server's against the bare Twisted
  server's), and the same for Redis (SET + GETDEL) when it is installed;
* ``notify``: put-to-listener notification latency (listener in a separate process);
* ``fanout``: one 16 MiB put read once by each of 32 listening reader processes;
* ``persist``: put throughput of 4 KiB and 1 MiB with ``--data-dir`` and ``--fsync
  everysec`` / ``always``, as a ratio to the in-memory tensorshare server;
* ``streams``: 16 MiB batches through a stream bin to 1 consumer process (vs the baseline)
  and to 3 at once (each vs 1 alone);
* ``inference``: ``predict`` at 1, 16 and 64 concurrent callers through an ``InferenceHost``
  vs a model server that runs each call alone (see ``bench_wings.py``);
* ``relays``: one 16 MiB put read by 32 readers through 2 relays vs straight from the
  primary, with the primary's egress per version.

Every operation is timed on its own and rates come from the median operation time; the same
ratios from total time are printed below the table. Every repeat runs every system, in
alternating order. Goals are printed, never asserted: the exit status is 0 unless something
crashed or a tensor came back wrong.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import queue
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # torch is imported lazily: the baseline server process never needs it
    import torch

ROOT = Path(__file__).resolve().parent.parent
SERVER_CORE = 0
CLIENT_CORE = 1
STARTUP_TIMEOUT = 30.0
REPLY_TIMEOUT = 60.0  # how long a helper process may take to answer the benchmark

FANOUT_READERS = 32
FANOUT_SIZE = 16 << 20
PERSIST_SIZES = (4 << 10, 1 << 20)
FSYNC_POLICIES = ("everysec", "always")
REDIS_MISSING = ("redis-server not installed "
                 "(apt-get install redis-server; pip install redis hiredis)")
REDIS_PY_MISSING = "redis-py or hiredis not installed (pip install redis hiredis)"

# --------------------------------------------------------------------------- baseline wire
# request: op (1 byte) + name length (u64) + payload length (u64), then the name, then the
# payload. 'P' put -> reply u64 version. 'G' get (removes) -> reply u64 length + bytes
# (MISSING if the bin is empty). 'K' peek: the same as 'G' but the bin keeps its buffer.
# 'L' listen -> reply u64 0, then one u64 version per put.
_HEAD = struct.Struct("<cQQ")
_U64 = struct.Struct("<Q")
MISSING = (1 << 64) - 1


def _recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` from ``sock``. False on a clean EOF before the first byte."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            if got == 0:
                return False
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        got += k
    return True


def _sendmsg_all(sock: socket.socket, buffers: Sequence[Any]) -> None:
    """``sendmsg`` every buffer (no joining), coping with partial sends."""
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        sent = sock.sendmsg(views)
        while sent:
            n = len(views[0])
            if sent >= n:
                views.pop(0)
                sent -= n
            else:
                views[0] = views[0][sent:]
                sent = 0
        while views and not len(views[0]):
            views.pop(0)


class BaselineServer:
    """The baseline: named bins in a dict, one thread per connection, plain Python sockets.

    A put is read with ``recv_into`` straight into a bytearray of the announced size and
    stored as a view of it (no copy); a get answers with one ``sendmsg`` of the length
    prefix and the stored buffer (no joining). A peek does the same without removing the
    buffer: a stored buffer is never written again (a put stores a new one), so any number
    of peeks can send it at once.
    """

    #: With ``reuse``: buffers of one size kept for the next put (``--baseline-reuse``).
    REUSE_PER_SIZE = 8

    def __init__(self, reuse: bool = False) -> None:
        self.bins: dict[bytes, memoryview] = {}
        self.versions: dict[bytes, int] = {}
        self.listeners: dict[bytes, list[socket.socket]] = {}
        self.lock = threading.Lock()
        # ``reuse``: a get's buffer, once sent, goes on a free list of its size, and the next
        # put of that size is read into it (already faulted in) instead of a new bytearray.
        self.reuse = reuse
        self.free: dict[int, list[bytearray]] = {}

    def _buffer(self, n: int) -> bytearray:
        if self.reuse:
            with self.lock:
                free = self.free.get(n)
                if free:
                    return free.pop()
        return bytearray(n)

    def _give_back(self, data: memoryview) -> None:
        buf = data.obj
        if self.reuse and type(buf) is bytearray:
            with self.lock:
                free = self.free.setdefault(len(buf), [])
                if len(free) < self.REUSE_PER_SIZE:
                    free.append(buf)

    def serve(self, port_file: str) -> None:
        """Listen on a free loopback port, write it to ``port_file``, serve forever."""
        lsock = socket.create_server(("127.0.0.1", 0))
        tmp = f"{port_file}.tmp"
        Path(tmp).write_text(str(lsock.getsockname()[1]))
        os.replace(tmp, port_file)
        while True:
            sock, _ = lsock.accept()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # A timeout, as tensorshare.Client has: CPython then runs the socket non-blocking
            # and poll()s, which moved large buffers faster than blocking calls on the 2-core
            # VM this was written on. Long enough for a connection idle between workloads.
            sock.settimeout(3600.0)
            threading.Thread(target=self._handle, args=(sock,), daemon=True).start()

    def _handle(self, sock: socket.socket) -> None:
        head = bytearray(_HEAD.size)
        head_view = memoryview(head)
        try:
            while _recv_exact(sock, head_view):
                op, name_len, payload_len = _HEAD.unpack(head)
                body = self._buffer(name_len + payload_len)
                _recv_exact(sock, memoryview(body))
                name = bytes(body[:name_len])
                if op == b"P":
                    with self.lock:
                        self.bins[name] = memoryview(body)[name_len:]
                        version = self.versions[name] = self.versions.get(name, 0) + 1
                        for listener in self.listeners.get(name, ()):
                            listener.sendall(_U64.pack(version))
                    sock.sendall(_U64.pack(version))
                elif op in (b"G", b"K"):
                    with self.lock:
                        data = (self.bins.pop(name, None) if op == b"G"
                                else self.bins.get(name))
                    if data is None:
                        sock.sendall(_U64.pack(MISSING))
                    else:
                        _sendmsg_all(sock, [_U64.pack(len(data)), data])
                        if op == b"G":  # (nobody else can hold a buffer a get removed)
                            self._give_back(data)
                elif op == b"L":
                    with self.lock:
                        self.listeners.setdefault(name, []).append(sock)
                    sock.sendall(_U64.pack(0))
                else:
                    return
        except OSError:
            pass
        finally:
            with self.lock:
                for subs in self.listeners.values():
                    if sock in subs:
                        subs.remove(sock)
            sock.close()


def serve_bare_twisted(port_file: str) -> None:
    """The floor Twisted puts under one small request (``--bare-twisted-server``): a bare
    Twisted protocol on Twisted's epoll reactor answering each frame of the baseline's
    protocol with no parsing beyond the 17-byte head and no store. A put is answered with
    version 1; a get or peek with the connection's last put payload (kept only so that the
    round trip can be checked). Listens on a free loopback port, writes it to ``port_file``.
    """
    from twisted.internet import epollreactor

    epollreactor.install()
    from twisted.internet import protocol, reactor

    head, u64, size = _HEAD, _U64, _HEAD.size

    class Bare(protocol.Protocol):
        def connectionMade(self) -> None:
            self.buf, self.last = bytearray(), b""
            self.transport.setTcpNoDelay(True)  # type: ignore[attr-defined]

        def dataReceived(self, data: bytes) -> None:
            buf = self.buf
            buf += data
            while len(buf) >= size:
                op, n_name, n_payload = head.unpack_from(buf)
                end = size + n_name + n_payload
                if len(buf) < end:
                    break
                if op == b"P":
                    self.last = bytes(buf[size + n_name:end])
                    self.transport.write(u64.pack(1))
                else:
                    self.transport.write(u64.pack(len(self.last)) + self.last)
                del buf[:end]

    factory = protocol.Factory.forProtocol(Bare)
    port = reactor.listenTCP(0, factory, interface="127.0.0.1")  # type: ignore[attr-defined]
    tmp = f"{port_file}.tmp"
    Path(tmp).write_text(str(port.getHost().port))
    os.replace(tmp, port_file)
    reactor.run()  # type: ignore[attr-defined]


class BaselineClient:
    """Blocking client of :class:`BaselineServer`; no reader thread, one request at a time."""

    def __init__(self, port: int) -> None:
        # The same socket mode as tensorshare.Client: a timeout (non-blocking + poll()).
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._u64 = bytearray(8)
        self._u64_view = memoryview(self._u64)

    def _read_u64(self) -> int:
        if not _recv_exact(self.sock, self._u64_view):
            raise ConnectionError("baseline server closed the connection")
        return int(_U64.unpack(self._u64)[0])

    def put_many(self, name: str, tensors: Sequence[torch.Tensor]) -> None:
        """Put each tensor, every request written back to back, then read every reply: the
        pipelining a plain socket protocol allows (the baseline has no batches)."""
        key = name.encode()
        chunks: list[Any] = []
        for t in tensors:
            data = t.numpy().data.cast("B")
            chunks += [_HEAD.pack(b"P", len(key), len(data)) + key, data]
            if len(chunks) >= 512:
                _sendmsg_all(self.sock, chunks)
                chunks = []
        if chunks:
            _sendmsg_all(self.sock, chunks)
        for _ in tensors:
            self._read_u64()

    def put(self, name: str, tensor: torch.Tensor) -> int:
        """Store ``tensor`` (contiguous, CPU) in bin ``name``; return the bin's version."""
        data = tensor.numpy().data.cast("B")  # ndarray.data: a memoryview, no copy
        key = name.encode()
        _sendmsg_all(self.sock, [_HEAD.pack(b"P", len(key), len(data)) + key, data])
        return self._read_u64()

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """Take bin ``name``; rebuild a tensor of ``like``'s dtype and shape on the bytes."""
        return self._fetch(b"G", name, like)

    def peek(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """Like :meth:`get`, but the bin keeps its buffer (``like`` may be a meta tensor)."""
        return self._fetch(b"K", name, like)

    def _fetch(self, op: bytes, name: str, like: torch.Tensor) -> torch.Tensor:
        import torch

        key = name.encode()
        self.sock.sendall(_HEAD.pack(op, len(key), 0) + key)
        n = self._read_u64()
        if n == MISSING:
            raise KeyError(name)
        buf = bytearray(n)
        if not _recv_exact(self.sock, memoryview(buf)):
            raise ConnectionError("baseline server closed the connection")
        return torch.frombuffer(buf, dtype=like.dtype).reshape(like.shape)

    def listen(self, name: str) -> None:
        """Turn this connection into a listener of bin ``name`` (see :meth:`next_version`)."""
        key = name.encode()
        self.sock.sendall(_HEAD.pack(b"L", len(key), 0) + key)
        self._read_u64()
        self.sock.settimeout(None)  # a listener may wait for a put as long as it likes

    def next_version(self) -> int:
        """Block for the next put notification (after :meth:`listen`)."""
        return self._read_u64()

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()


# --------------------------------------------------------------------------- the systems


class Side(Protocol):
    """What the put/get workloads need from a system under test."""

    name: str

    def put(self, name: str, tensor: torch.Tensor) -> int: ...

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor: ...

    def close(self) -> None: ...


class TensorShareSide:
    """tensorshare's blocking ``Client``, as a :class:`Side`."""

    def __init__(self, port: int, name: str = "tensorshare", address: str | None = None,
                 **options: Any) -> None:
        from tensorshare import Client

        self.name = name
        self.client = Client(address or "127.0.0.1", port, timeout=60, **options)

    def put(self, name: str, tensor: torch.Tensor) -> int:
        """``Client.put``; returns the bin's version."""
        return int(self.client.put(name, tensor))

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """``Client.get`` (removes the bin); ``like`` is not needed."""
        return self.client.get(name)  # type: ignore[no-any-return]

    def peek(self, name: str) -> torch.Tensor:
        """``Client.peek`` (the bin keeps its value)."""
        return self.client.peek(name)  # type: ignore[no-any-return]

    def close(self) -> None:
        """Close the client."""
        self.client.close()


class BaselineSide(BaselineClient):
    """The baseline client, as a :class:`Side`."""

    name = "baseline"


class BareTwistedSide(BaselineClient):
    """The baseline client talking to the bare Twisted server (:func:`serve_bare_twisted`)."""

    name = "bare twisted"


class RedisSide:
    """redis-py (with hiredis) as a :class:`Side`: put is ``SET``, get is ``GETDEL``.

    Like the baseline, it stores the tensor's raw bytes (``memoryview(t.numpy())``, no copy)
    and rebuilds the tensor from ``like``'s dtype and shape with ``torch.frombuffer``.
    """

    name = "redis"

    def __init__(self, port: int) -> None:
        import redis

        self.redis = redis.Redis(host="127.0.0.1", port=port, socket_timeout=60)

    def put(self, name: str, tensor: torch.Tensor) -> int:
        """``SET name bytes``; Redis keeps no version, so this returns 0."""
        self.redis.set(name, tensor.numpy().data.cast("B"))
        return 0

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """``GETDEL name`` (Redis 6.2 and later), rebuilt as a tensor like ``like``."""
        import torch

        raw = self.redis.getdel(name)
        if not isinstance(raw, bytes):  # None: no such key
            raise KeyError(name)
        return torch.frombuffer(bytearray(raw), dtype=like.dtype).reshape(like.shape)

    def close(self) -> None:
        """Close the connection pool."""
        self.redis.close()


# --------------------------------------------------------------------------- processes


def _pin_prefix() -> list[str]:
    """``taskset -c 0`` when there are two cores to split and taskset exists."""
    if (os.cpu_count() or 1) >= 2 and shutil.which("taskset"):
        return ["taskset", "-c", str(SERVER_CORE)]
    return []


def _child_env() -> dict[str, str]:
    """The environment of the servers: this checkout first on ``sys.path``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _affinity(pid: int) -> str:
    try:
        return ",".join(map(str, sorted(os.sched_getaffinity(pid))))
    except OSError:
        return "?"


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` (all its threads) so far, in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    """A loopback port that was free a moment ago (for servers that cannot pick their own)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A server process the benchmark started (pinned to the server core)."""

    label: str
    proc: subprocess.Popen[Any]
    port: int
    cores: str = "?"  # its CPU affinity once it was ready

    @property
    def pid(self) -> int:
        return self.proc.pid


class Children:
    """Owns the server subprocesses; :meth:`close` terminates them (then kills)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[Any]] = []
        self.servers: list[Server] = []  # every server that started, for the title line

    def start(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` pinned to the server core, with this checkout on the path.

        In a session of its own, so that Ctrl+C in a terminal (which signals the whole
        foreground process group) reaches only the benchmark, which then stops the servers
        after its clients and helpers: nothing logs a lost connection on the way out.
        """
        proc = subprocess.Popen(_pin_prefix() + argv, env=_child_env(), cwd=ROOT,
                                start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def ready(self, label: str, proc: subprocess.Popen[Any], port: int) -> Server:
        """Record a server that answers (its affinity is final by then: taskset has exec'd)."""
        server = Server(label, proc, port, _affinity(proc.pid))
        self.servers.append(server)
        return server

    @staticmethod
    def _stop(procs: Sequence[subprocess.Popen[Any]]) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            if proc.stdout is not None:
                proc.stdout.close()

    def stop(self, proc: subprocess.Popen[Any]) -> None:
        """Stop one server now (SIGTERM, then SIGKILL after 5 s)."""
        self._stop([proc])

    def close(self) -> None:
        """Stop every server still running."""
        self._stop(self.procs)


def launch_tensorshare(children: Children, label: str = "tensorshare",
                       extra: Sequence[str] = ()) -> Callable[[], Server]:
    """Start a tensorshare server (``extra``: more ``serve`` options). Returns a function
    that waits until it prints where it listens (so that servers start side by side)."""
    proc = children.start([sys.executable, "-m", "tensorshare", "serve", "--port", "0", "-q",
                           *extra], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + STARTUP_TIMEOUT

    def wait() -> Server:
        assert proc.stdout is not None
        line = ""
        while "listening on" not in line:
            left = deadline - time.monotonic()
            if proc.poll() is not None or left <= 0:
                raise RuntimeError(f"{label} server did not start (exit status {proc.poll()})")
            if select.select([proc.stdout], [], [], left)[0]:
                line = proc.stdout.readline()
        return children.ready(label, proc, int(line.strip().rsplit(":", 1)[1]))

    return wait


def launch_baseline(children: Children, workdir: str, *, reuse: bool = False,
                    label: str = "baseline", bare_twisted: bool = False
                    ) -> Callable[[], Server]:
    """Start the baseline server (this file, ``--baseline-server``; ``reuse``: the one that
    reuses the buffers its gets free; ``bare_twisted``: the bare Twisted protocol instead,
    ``--bare-twisted-server``); returns a function that waits until it listens."""
    port_file = os.path.join(workdir, f"{label}.port")
    kind = "--bare-twisted-server" if bare_twisted else "--baseline-server"
    proc = children.start([sys.executable, str(Path(__file__).resolve()),
                           kind, port_file, *(["--baseline-reuse"] if reuse else [])])
    deadline = time.monotonic() + STARTUP_TIMEOUT

    def wait() -> Server:
        while not os.path.exists(port_file):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"baseline server did not start (exit status {proc.poll()})")
            time.sleep(0.01)
        return children.ready(label, proc, int(Path(port_file).read_text()))

    return wait


def redis_unavailable() -> str | None:
    """Why the Redis row cannot run here, or None when it can."""
    if shutil.which("redis-server") is None:
        return REDIS_MISSING
    try:
        import hiredis  # noqa: F401  (redis-py uses it when it is importable)
        import redis  # noqa: F401
    except ImportError:
        return REDIS_PY_MISSING
    return None


def redis_versions() -> str:
    """``redis-server 7.0.15, redis-py 5.0.1, hiredis 2.3.2`` (as far as they can be found)."""
    import hiredis
    import redis

    server = "?"
    with suppress(OSError, subprocess.TimeoutExpired):
        out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True,
                             timeout=10).stdout
        server = next((w[2:] for w in out.split() if w.startswith("v=")), "?")
    return (f"redis-server {server}, redis-py {redis.__version__}, "
            f"hiredis {getattr(hiredis, '__version__', '?')}")


def start_redis(children: Children, workdir: str) -> Server:
    """Start ``redis-server`` on a free loopback port, without persistence.

    Redis cannot pick a free port itself (``--port 0`` disables TCP), so this picks one and
    tries again if another process took it first.
    """
    import redis

    status: int | None = None
    for _ in range(3):
        port = _free_port()
        proc = children.start(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no", "--dir", workdir,
                               "--loglevel", "warning"], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while proc.poll() is None and time.monotonic() < deadline:
            probe = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1)
            try:
                probe.ping()
            except redis.RedisError:
                time.sleep(0.05)
            else:
                return children.ready("redis", proc, port)
            finally:
                probe.close()
        status = proc.poll()
        children.stop(proc)
    raise RuntimeError(f"redis-server did not start (exit status {status})")


def _fs_type(path: str) -> str:
    """The file system type of ``path`` (from /proc/mounts), e.g. ``ext4`` or ``tmpfs``."""
    best, kind = "", "?"
    with suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) < 3:
                continue
            mount = parts[1]
            inside = path == mount or path.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) > len(best):
                best, kind = mount, parts[2]
    return kind


def _dir_bytes(path: str) -> int:
    """Total size of the files under ``path``."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _ignore_sigint() -> None:
    """In a helper process: leave Ctrl+C to the benchmark, which stops the helpers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextmanager
def helper_processes(ctx: ForkServerContext, target: Callable[..., None],
                     args_list: Sequence[tuple[Any, ...]], what: str) -> Iterator[list[Connection]]:
    """Start one process per ``args_list`` entry as ``target(*args, pipe)``; yield the pipes
    once every process sent ``"ready"``. On exit, ask them to stop (send None), then kill
    whichever is still there after 3 s."""
    procs: list[tuple[Any, Connection]] = []
    try:
        for args in args_list:
            here, there = ctx.Pipe()
            proc = ctx.Process(target=target, args=(*args, there), daemon=True)
            proc.start()
            there.close()  # so that a dead helper reads as EOF here
            procs.append((proc, here))
        deadline = time.monotonic() + STARTUP_TIMEOUT + len(procs)
        for _, conn in procs:
            _expect(conn, "ready", max(0.0, deadline - time.monotonic()), what)
        yield [conn for _, conn in procs]
    finally:
        for _, conn in procs:
            with suppress(OSError, ValueError):
                conn.send(None)
        deadline = time.monotonic() + 3.0
        for proc, _ in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc, conn in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            conn.close()


def _receive(conn: Connection, timeout: float, what: str) -> Any:
    """The next message from a helper process, or RuntimeError if none comes in time."""
    try:
        if conn.poll(timeout):
            return conn.recv()
    except (EOFError, OSError):
        raise RuntimeError(f"{what} process died") from None
    raise RuntimeError(f"{what} process did not answer within {timeout:.0f} s")


def _expect(conn: Connection, message: str, timeout: float, what: str) -> None:
    got = _receive(conn, timeout, what)
    if got != message:
        raise RuntimeError(f"{what} process sent {got!r}, expected {message!r}")

# --------------------------------------------------------------------------- workloads


@dataclass
class Config:
    """How much to measure."""

    sizes: list[int]
    repeat: int
    target_bytes: int  # bytes moved per repeat, side and direction (bounded by max_iters)
    max_iters: int
    tiny_pairs: int  # put+get round trips per repeat and side
    notify_puts: int
    notify_gap: float  # seconds between notified puts
    fanout_rounds: int  # timed fan-out rounds per system (after one warm-up round each)
    persist_puts: int  # timed puts per repeat, server and size, in the persistence section
    batch_items: int  # tiny appends per repeat through one pipeline
    sections: list[str]


@dataclass(frozen=True)
class Rate:
    """A rate from per-operation times, two ways.

    ``median``: work per operation / median operation time (what the table shows).
    ``total``: total work / total time; includes every stall, e.g. a time slice lost to
    another process, so it is lower and noisier on a shared machine.
    """

    median: float
    total: float

    @classmethod
    def of(cls, work_per_op: float, ns: Sequence[int]) -> Rate:
        """The rate of ``work_per_op`` per operation, from operation times in ns."""
        return cls(work_per_op * 1e9 / statistics.median(ns),
                   work_per_op * 1e9 * len(ns) / sum(ns))


@dataclass
class Row:
    """One line of the result table.

    ``ts`` and ``base`` are the two measured columns: tensorshare and what it is compared
    with (the baseline server, Redis, or the in-memory tensorshare server: see ``group``).
    """

    workload: str
    ts: str
    base: str
    ratio: float | None
    total_ratio: float | None = None  # the same ratio from total time (see Rate)
    goal: str = "-"
    met: bool | None = None
    notes: list[str] = field(default_factory=list)
    group: str = "baseline"  # which sub-table: a key of Bench.headings
    skipped: str | None = None  # why the row was not measured (printed instead of numbers)


def _label(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift} {unit}"
    return f"{size} B"


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _meets(ratio: float, goal: float) -> bool:
    """Judge the ratio as printed (two decimals), so a printed 0.80 never reads MISSED."""
    return round(ratio, 2) >= goal


def transfer_goal(size: int) -> float:
    """The goal for put/get of ``size`` bytes, as tensorshare / baseline (the issue "Small
    requests at the speed of the machine"): 4 KiB (any size under 1 MiB) >= 0.6, 1 MiB (up to
    16 MiB) >= 0.8, 16 MiB and 64 MiB (and up) >= 0.9."""
    if size < 1 << 20:
        return 0.6
    if size < 16 << 20:
        return 0.8
    return 0.9


def _turns(sides: Sequence[Any], rep: int) -> Sequence[Any]:
    """The sides in the order they run in repeat ``rep``: alternating, so neither always
    runs right after the other (whose freed memory, cache state or backlog it would inherit)."""
    return sides if rep % 2 == 0 else list(reversed(sides))


def measure_transfer(sides: Sequence[Side], size: int, cfg: Config) -> dict[str, tuple[Rate, Rate]]:
    """Put then get one tensor of ``size`` bytes, again and again; (put, get) MB/s per side.

    Every operation is timed on its own. Each repeat runs both sides (in alternating order)
    so drift and other load hit both alike. The tensor read back is checked (``torch.equal``)
    after the warm-up and after the timed operations.
    """
    import torch

    like = torch.randn(size // 4, dtype=torch.float32)
    iters = max(1, min(cfg.max_iters, cfg.target_bytes // size))
    bin_name = f"bench-{size}"
    put_ns: dict[str, list[int]] = {s.name: [] for s in sides}
    get_ns: dict[str, list[int]] = {s.name: [] for s in sides}
    for side in sides:  # warm up, and check that what comes back is what went out
        side.put(bin_name, like)
        if not torch.equal(side.get(bin_name, like), like):
            raise AssertionError(f"{side.name}: {_label(size)} tensor read back differs")
    last: dict[str, torch.Tensor] = {}
    clock = time.perf_counter_ns
    for rep in range(cfg.repeat):
        for side in _turns(sides, rep):
            puts, gets = put_ns[side.name], get_ns[side.name]
            for _ in range(iters):
                t0 = clock()
                side.put(bin_name, like)
                t1 = clock()
                last[side.name] = side.get(bin_name, like)
                t2 = clock()
                puts.append(t1 - t0)
                gets.append(t2 - t1)
    for name, back in last.items():  # the timed reads returned real data, too
        if not torch.equal(back, like):
            raise AssertionError(f"{name}: {_label(size)} tensor read back differs after timing")
    mb = size / 1e6
    return {s.name: (Rate.of(mb, put_ns[s.name]), Rate.of(mb, get_ns[s.name])) for s in sides}


@dataclass
class Tiny:
    """tiny put+get of one side: the rate, and the CPU per op (µs) of its client (this
    process, all its threads) and of its server (from /proc), summed over the timed pairs."""

    rate: Rate
    client_us: float
    server_us: float


def measure_tiny(sides: Sequence[Side], cfg: Config, pids: dict[str, int]) -> dict[str, Tiny]:
    """Ops/s of put+get round trips of a 4-byte tensor (each put and each get is one op), and
    the CPU each op costs the client and the server (``pids``: each side's server process).

    Timed per put+get pair, every side in every repeat as in :func:`measure_transfer`.
    """
    import torch

    tiny = torch.tensor([1.5], dtype=torch.float32)
    pair_ns: dict[str, list[int]] = {s.name: [] for s in sides}
    cpu = {s.name: [0.0, 0.0] for s in sides}  # client, server seconds
    for side in sides:
        side.put("tiny", tiny)
        if not torch.equal(side.get("tiny", tiny), tiny):
            raise AssertionError(f"{side.name}: tiny tensor read back differs")
    clock = time.perf_counter_ns
    for rep in range(cfg.repeat):
        for side in _turns(sides, rep):
            put, get, out = side.put, side.get, pair_ns[side.name]
            pid = pids[side.name]
            c0, s0 = time.process_time(), _cpu_seconds(pid)
            for _ in range(cfg.tiny_pairs):
                t0 = clock()
                put("tiny", tiny)
                get("tiny", tiny)
                out.append(clock() - t0)
            used = cpu[side.name]
            used[0] += time.process_time() - c0
            used[1] += _cpu_seconds(pid) - s0
    ops = 2 * cfg.tiny_pairs * cfg.repeat
    return {name: Tiny(Rate.of(2, ns), 1e6 * cpu[name][0] / ops, 1e6 * cpu[name][1] / ops)
            for name, ns in pair_ns.items()}


def measure_puts(sides: Sequence[TensorShareSide], size: int, cfg: Config) -> dict[str, Rate]:
    """MB/s of puts of ``size`` bytes to one bin (each put replaces the last), per side.

    Every put is timed on its own, every side in every repeat (alternating order). The
    value is read back with a peek (``torch.equal``) after the warm-up and after timing.
    """
    import torch

    like = torch.randn(size // 4, dtype=torch.float32)
    bin_name = f"persist-{size}"
    put_ns: dict[str, list[int]] = {s.name: [] for s in sides}
    for side in sides:
        side.put(bin_name, like)
        if not torch.equal(side.peek(bin_name), like):
            raise AssertionError(f"{side.name}: {_label(size)} tensor read back differs")
    clock = time.perf_counter_ns
    for rep in range(cfg.repeat):
        for side in _turns(sides, rep):
            put, out = side.put, put_ns[side.name]
            for _ in range(cfg.persist_puts):
                t0 = clock()
                put(bin_name, like)
                out.append(clock() - t0)
    for side in sides:
        if not torch.equal(side.peek(bin_name), like):
            raise AssertionError(f"{side.name}: {_label(size)} tensor read back differs "
                                 "after timing")
        side.client.delete(bin_name)
    return {name: Rate.of(size / 1e6, ns) for name, ns in put_ns.items()}


def _listener_main(system: str, port: int, bin_name: str, inline: bool,
                   pipe: Connection) -> None:
    """Listener process: stamp ``perf_counter_ns`` when each put notification arrives.

    ``perf_counter_ns`` is CLOCK_MONOTONIC on Linux, one clock for every process, so the
    writer's and the listener's stamps can be subtracted. ``inline``: tensorshare's
    ``listen(..., inline=True)`` (the callback on the client's reading thread, no hand-off
    to its event thread). Protocol with the benchmark:
    send ``"ready"``; on ``"stop"`` send the stamps; on None (or EOF) exit.
    """
    _ignore_sigint()
    stamps: list[tuple[int, int]] = []  # (version, arrival ns)
    closer: Callable[[], None]
    if system == "tensorshare":
        from tensorshare import Client

        client = Client("127.0.0.1", port, timeout=60)
        client.listen(bin_name, lambda ev: stamps.append((ev["version"],
                                                          time.perf_counter_ns())),
                      inline=inline)
        closer = client.close
    else:
        listener = BaselineClient(port)
        listener.listen(bin_name)

        def loop() -> None:
            with suppress(OSError):
                while True:
                    version = listener.next_version()
                    stamps.append((version, time.perf_counter_ns()))

        threading.Thread(target=loop, daemon=True).start()
        closer = listener.close
    try:
        pipe.send("ready")
        with suppress(EOFError):
            while pipe.recv() == "stop":
                pipe.send(list(stamps))
    finally:
        closer()


def measure_notify(side: Side, port: int, cfg: Config, ctx: ForkServerContext,
                   inline: bool = False) -> tuple[float, float, int]:
    """Put-to-listener latency: from just before ``put()`` to the listener's callback.

    The listener is a separate process (forked from the forkserver, so it runs on the
    client core); puts are spaced by ``cfg.notify_gap`` so notifications never queue.

    Returns:
        (p50 ms, p99 ms, notifications matched to a put).
    """
    import torch

    tiny = torch.tensor([2.5], dtype=torch.float32)
    bin_name = "notify"
    what = f"{side.name} listener"
    with helper_processes(ctx, _listener_main, [(side.name, port, bin_name, inline)],
                          what) as pipes:
        sent: dict[int, int] = {}  # version -> ns just before the put
        for _ in range(cfg.notify_puts):
            t0 = time.perf_counter_ns()
            sent[side.put(bin_name, tiny)] = t0
            time.sleep(cfg.notify_gap)
        time.sleep(0.2)  # let the last notifications arrive
        pipes[0].send("stop")
        stamps: list[tuple[int, int]] = _receive(pipes[0], REPLY_TIMEOUT, what)
    lat = sorted((t - sent[v]) / 1e6 for v, t in stamps if v in sent)
    if not lat:
        raise RuntimeError(f"{side.name}: the listener saw no notifications")
    p99 = lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))]
    return statistics.median(lat), p99, len(lat)


def _fanout_check(value: Any, n: int, rnd: int, full: bool) -> str | None:
    """What is wrong with a fan-out reader's tensor (None if nothing).

    The writer's tensor is ``arange(n)`` as float32 with element 0 set to the round number,
    so each round's value is distinct; the rest is compared on warm-up and last rounds.
    """
    import torch

    if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or value.shape != (n,):
        return f"got {type(value).__name__} {getattr(value, 'dtype', '')} " \
               f"{tuple(getattr(value, 'shape', ()))}, expected float32 ({n},)"
    if value[0].item() != rnd:
        return f"element 0 is {value[0].item()}, expected the round number {rnd}"
    if full and not torch.equal(value[1:], torch.arange(1, n, dtype=torch.float32)):
        return "the tensor's content differs from what was put"
    return None


def _fanout_reader_main(ts_port: int, base_port: int, bin_name: str, n: int,
                        pipe: Connection) -> None:
    """Fan-out reader process: listens to ``bin_name`` on both servers and, each round,
    fetches the new version once from the system the benchmark names.

    tensorshare: one ``Client``; its listen callback runs inline on the client's reader
    thread and only queues the version; this process's main thread then calls
    ``fetch(remove=False, newer_than=last_version)``. Baseline: one listening connection
    (its notifications and replies cannot share a socket), one for the peek ('K').

    Protocol with the benchmark: send ``"ready"``; then per round receive
    ``(system, round, full_check)``, send ``"armed"``, wait for the notification, fetch,
    stamp ``perf_counter_ns()``, check, send ``(stamp, error or None, CPU seconds this
    process spent from "armed" to the stamp)``; exit on None/EOF.
    """
    _ignore_sigint()
    import torch

    from tensorshare import Client

    versions: queue.SimpleQueue[int] = queue.SimpleQueue()

    def on_change(ev: dict[str, Any]) -> None:
        if ev.get("op") == "put":
            versions.put(int(ev["version"]))

    ts = Client("127.0.0.1", ts_port, timeout=REPLY_TIMEOUT)
    base_listen = BaselineClient(base_port)
    base_req = BaselineClient(base_port)
    try:
        ts.begin_listen(bin_name, on_change, inline=True).result()
        base_listen.listen(bin_name)
        like = torch.empty(n, dtype=torch.float32, device="meta")  # dtype and shape only
        last = 0  # the tensorshare version this reader holds
        pipe.send("ready")
        while (cmd := pipe.recv()) is not None:
            system, rnd, full = cmd
            pipe.send("armed")
            cpu0 = time.process_time()  # this process, all threads
            error = None
            if system == "tensorshare":
                try:
                    version = versions.get(timeout=REPLY_TIMEOUT)
                except queue.Empty:
                    pipe.send((0, f"no put notification within {REPLY_TIMEOUT:.0f} s", 0.0))
                    continue
                res = ts.fetch(bin_name, remove=False, newer_than=last)
                stamp = time.perf_counter_ns()
                value = res.value
                if res.unchanged or res.version < version:
                    error = f"fetch newer than {last} gave version {res.version} " \
                            f"(unchanged={res.unchanged}), notified {version}"
                last = res.version
                del res
            else:
                base_listen.next_version()
                value = base_req.peek(bin_name, like)
                stamp = time.perf_counter_ns()
            cpu = time.process_time() - cpu0
            error = error or _fanout_check(value, n, rnd, full)
            del value  # the next round's buffer is a new one, as it would be for a real reader
            pipe.send((stamp, error, cpu))
    except EOFError:
        pass
    finally:
        ts.close()
        base_listen.close()
        base_req.close()


@dataclass
class FanOut:
    """One system's fan-out result."""

    rate: Rate  # aggregate MB/s: readers x size / (put start to last reader holding it)
    server_cpu_ms: float  # the server's CPU time per version (median over rounds)
    readers_cpu_ms: float  # all readers' CPU time per version, together (median)
    first_ms: float  # median time from the put to the first reader holding the version


def measure_fanout(sides: Sequence[Side], servers: dict[str, Server], ctx: ForkServerContext,
                   cfg: Config, readers: int = FANOUT_READERS,
                   size: int = FANOUT_SIZE) -> dict[str, FanOut]:
    """One ``size`` put, read once by each of ``readers`` listening processes, per round.

    The readers (see :func:`_fanout_reader_main`) are started once and listen to both
    systems; each round addresses one system. A round: every reader is told which system
    and round comes and answers ``"armed"``; the writer (this process) puts the tensor;
    each reader fetches it on the notification; the round's time runs from just before the
    put to the last reader's stamp. One warm-up round per system, then ``cfg.fanout_rounds``
    timed ones per system, alternating which system goes first.
    """
    import torch

    n = size // 4
    bin_name = "fanout"
    data = torch.arange(n, dtype=torch.float32)
    args = [(servers["tensorshare"].port, servers["baseline"].port, bin_name, n)] * readers
    round_ns: dict[str, list[int]] = {s.name: [] for s in sides}
    first_ns: dict[str, list[int]] = {s.name: [] for s in sides}
    cpu_ms: dict[str, list[float]] = {s.name: [] for s in sides}
    readers_ms: dict[str, list[float]] = {s.name: [] for s in sides}
    with helper_processes(ctx, _fanout_reader_main, args, "fan-out reader") as pipes:
        rnd = 0
        plan = [(side, True, False) for side in sides]  # warm-up rounds, checked in full
        for rep in range(cfg.fanout_rounds):
            plan += [(side, rep == cfg.fanout_rounds - 1, True) for side in _turns(sides, rep)]
        for side, full, timed in plan:
            rnd += 1
            what = f"{side.name} fan-out reader"
            for conn in pipes:
                conn.send((side.name, rnd, full))
            for conn in pipes:
                _expect(conn, "armed", REPLY_TIMEOUT, what)
            data[0] = rnd
            pid = servers[side.name].pid
            cpu0 = _cpu_seconds(pid)
            t0 = time.perf_counter_ns()
            side.put(bin_name, data)
            results = [_receive(conn, REPLY_TIMEOUT, what) for conn in pipes]
            cpu1 = _cpu_seconds(pid)
            errors = [err for _, err, _ in results if err]
            if errors:
                raise AssertionError(f"{side.name} fan-out, {len(errors)} of {readers} readers: "
                                     f"{errors[0]}")
            if timed:
                stamps = [stamp for stamp, _, _ in results]
                round_ns[side.name].append(max(stamps) - t0)
                first_ns[side.name].append(min(stamps) - t0)
                cpu_ms[side.name].append((cpu1 - cpu0) * 1e3)
                readers_ms[side.name].append(sum(cpu for _, _, cpu in results) * 1e3)
    mb = readers * size / 1e6
    return {name: FanOut(Rate.of(mb, ns), statistics.median(cpu_ms[name]),
                         statistics.median(readers_ms[name]),
                         statistics.median(first_ns[name]) / 1e6)
            for name, ns in round_ns.items()}

# --------------------------------------------------------------------------- sections


@dataclass
class Bench:
    """What every section gets: the configuration, the two main servers and their clients,
    the process machinery, and where to put its output besides its rows."""

    cfg: Config
    children: Children
    workdir: str  # a temporary directory, removed at the end
    ctx: ForkServerContext  # forkserver: helper processes start cheaply, on the client core
    servers: dict[str, Server]  # "tensorshare" and "baseline"
    ts: TensorShareSide
    base: BaselineSide
    headings: dict[str, str]  # Row.group -> the line printed above that group's rows
    unix_path: str = ""  # the main tensorshare server's Unix socket
    info: list[str] = field(default_factory=list)  # lines printed under the table


def section_transfer(b: Bench) -> list[Row]:
    """put / get N: throughput of each size in ``--sizes``, vs the baseline."""
    rows: list[Row] = []
    gets: list[Row] = []
    for size in b.cfg.sizes:
        res = measure_transfer([b.ts, b.base], size, b.cfg)
        goal = transfer_goal(size)
        for i, (direction, out) in enumerate((("put", rows), ("get", gets))):
            ts_r, base_r = res[b.ts.name][i], res[b.base.name][i]
            ratio = ts_r.median / base_r.median
            out.append(Row(f"{direction} {_label(size)}", f"{_fmt(ts_r.median)} MB/s",
                           f"{_fmt(base_r.median)} MB/s", ratio, ts_r.total / base_r.total,
                           f">= {goal}", _meets(ratio, goal)))
    return rows + gets  # all puts, then all gets


def section_tiny(b: Bench) -> list[Row]:
    """tiny put+get vs the baseline, the bare Twisted server (the floor of the server's CPU
    per request) and, when it is installed, Redis (all interleaved)."""
    sides: list[Side] = [b.ts, b.base]
    why = redis_unavailable()
    redis_server: Server | None = None
    redis_side: RedisSide | None = None
    bare_server = launch_baseline(b.children, b.workdir, label="bare-twisted",
                                  bare_twisted=True)()
    bare = BareTwistedSide(bare_server.port)
    sides.append(bare)
    try:
        if why is None:
            redis_server = start_redis(b.children, b.workdir)
            redis_side = RedisSide(redis_server.port)
            sides.append(redis_side)
            b.headings["redis"] += f" ({redis_versions()})"
            b.info.append("redis: redis-server --save '' --appendonly no (no persistence), "
                          "pinned like the others; put = SET, get = GETDEL, one redis-py "
                          "client with hiredis; measured in the same repeats as tiny put+get")
        pids = {name: server.pid for name, server in b.servers.items()}
        pids[bare.name] = bare_server.pid
        if redis_side is not None and redis_server is not None:
            pids[redis_side.name] = redis_server.pid
        res = measure_tiny(sides, b.cfg, pids)
    finally:
        bare.close()
        b.children.stop(bare_server.proc)
        if redis_side is not None:
            redis_side.close()
        if redis_server is not None:
            b.children.stop(redis_server.proc)
    return _tiny_rows(b, res, redis_side, why)


def _tiny_rows(b: Bench, res: dict[str, Tiny], redis_side: RedisSide | None,
               why: str | None) -> list[Row]:
    ts, base, bare = res[b.ts.name], res[b.base.name], res[BareTwistedSide.name]
    ts_r, base_r = ts.rate, base.rate
    ratio = ts_r.median / base_r.median
    row = Row("tiny put+get", f"{ts_r.median:,.0f} ops/s", f"{base_r.median:,.0f} ops/s",
              ratio, ts_r.total / base_r.total, ">= 0.5", _meets(ratio, 0.5))
    row.notes.append(f"CPU per op, tensorshare / baseline: client {ts.client_us:.0f} / "
                     f"{base.client_us:.0f} µs, server {ts.server_us:.0f} / "
                     f"{base.server_us:.0f} µs (from /proc; 10 ms ticks over every timed pair)")
    client = base.client_us / ts.client_us
    server = bare.server_us / ts.server_us
    rows = [row,
            Row("tiny client CPU/op", f"{ts.client_us:.1f} µs", f"{base.client_us:.1f} µs",
                client, None, ">= 0.4 (<= 2.5x)", _meets(client, 0.4)),
            Row("tiny server CPU/op", f"{ts.server_us:.1f} µs", f"{bare.server_us:.1f} µs",
                server, None, ">= 0.67 (<= 1.5x)", _meets(server, 1 / 1.5), group="floor")]
    rows[-1].notes.append(f"the bare Twisted server: {bare.rate.median:,.0f} ops/s, answering "
                          "each frame with no parsing or store (same client as the baseline)")
    if redis_side is None:
        rows.append(Row("tiny put+get (redis)", "", "", None, group="redis", skipped=why))
    else:
        red = res[redis_side.name]
        ratio = ts_r.median / red.rate.median
        red_row = Row("tiny put+get (redis)", f"{ts_r.median:,.0f} ops/s",
                      f"{red.rate.median:,.0f} ops/s", ratio, ts_r.total / red.rate.total,
                      ">= 1.2", _meets(ratio, 1.2), group="redis")
        red_row.notes.append(f"CPU per op, redis: client {red.client_us:.0f} µs, server "
                             f"{red.server_us:.0f} µs")
        rows.append(red_row)
    return rows


#: Issue 28: a notification's p50 at most 1.5x the baseline's (ratio = baseline / tensorshare).
_NOTIFY_GOAL = ">= 0.67 (p50 <= 1.5x)"


def section_notify(b: Bench) -> list[Row]:
    """notify p50 / p99: put-to-listener latency, listener in a separate process."""
    cfg = b.cfg
    ts_p50, ts_p99, ts_n = measure_notify(b.ts, b.servers["tensorshare"].port, cfg, b.ctx)
    b_p50, b_p99, b_n = measure_notify(b.base, b.servers["baseline"].port, cfg, b.ctx)
    notify = Row("notify p50 / p99", f"{ts_p50:.2f} / {ts_p99:.2f} ms",
                 f"{b_p50:.2f} / {b_p99:.2f} ms", b_p50 / ts_p50, None, _NOTIFY_GOAL,
                 _meets(b_p50 / ts_p50, 1 / 1.5))
    i_p50, i_p99, i_n = measure_notify(b.ts, b.servers["tensorshare"].port, cfg, b.ctx,
                                       inline=True)
    inline = Row("notify inline p50 / p99", f"{i_p50:.2f} / {i_p99:.2f} ms",
                 f"{b_p50:.2f} / {b_p99:.2f} ms", b_p50 / i_p50, None, _NOTIFY_GOAL,
                 _meets(b_p50 / i_p50, 1 / 1.5))
    for row, name, n in ((notify, "tensorshare", ts_n), (notify, "baseline", b_n),
                         (inline, "tensorshare inline", i_n)):
        if n < cfg.notify_puts:
            row.notes.append(f"{name}: {n} of {cfg.notify_puts} notifications matched")
    b.info.append(f"notify: {cfg.notify_puts} puts {cfg.notify_gap * 1e3:g} ms apart, listener "
                  "callback in a separate process on the client core; inline: "
                  "listen(..., inline=True), the callback on the client's reading thread")
    return [notify, inline]


def section_fanout(b: Bench) -> list[Row]:
    """fan-out: one 16 MiB put read once by each of 32 listening reader processes."""
    res = measure_fanout([b.ts, b.base], b.servers, b.ctx, b.cfg)
    ts_f, base_f = res[b.ts.name], res[b.base.name]
    ratio = ts_f.rate.median / base_f.rate.median
    row = Row(f"fan-out {_label(FANOUT_SIZE)} x {FANOUT_READERS} readers",
              f"{_fmt(ts_f.rate.median)} MB/s", f"{_fmt(base_f.rate.median)} MB/s", ratio,
              ts_f.rate.total / base_f.rate.total, ">= 0.8", _meets(ratio, 0.8))
    row.notes.append(f"per version, tensorshare / baseline: server CPU {ts_f.server_cpu_ms:.0f} / "
                     f"{base_f.server_cpu_ms:.0f} ms, readers' CPU {ts_f.readers_cpu_ms:.0f} / "
                     f"{base_f.readers_cpu_ms:.0f} ms, first reader done after "
                     f"{ts_f.first_ms:.0f} / {base_f.first_ms:.0f} ms")
    b.info.append(f"fan-out: {FANOUT_READERS} reader processes on the client core, each fetching "
                  f"every new version once; MB/s = {FANOUT_READERS} x {_label(FANOUT_SIZE)} / "
                  f"(put start to last reader holding it), median of {b.cfg.fanout_rounds} "
                  "rounds per system")
    return [row]


def section_persist(b: Bench) -> list[Row]:
    """put 4 KiB / 1 MiB with ``--data-dir`` and each fsync policy, vs in-memory tensorshare.

    Two more tensorshare servers, each with its own temporary data directory; both are
    stopped and their directories removed before this returns.
    """
    sides: list[TensorShareSide] = []
    servers: list[Server] = []
    dirs: list[str] = []
    rows: list[Row] = []
    try:
        waits = []
        for policy in FSYNC_POLICIES:
            data_dir = tempfile.mkdtemp(prefix=f"data-{policy}-", dir=b.workdir)
            dirs.append(data_dir)
            # The log is dropped after each snapshot; 256M (not the default 1G) bounds the
            # disk a full run uses. A snapshot holds one bin of at most 1 MiB: cheap.
            waits.append(launch_tensorshare(
                b.children, f"tensorshare fsync={policy}",
                ["--data-dir", data_dir, "--fsync", policy, "--snapshot-log-bytes", "256M"]))
        for policy, wait in zip(FSYNC_POLICIES, waits, strict=True):
            servers.append(wait())
            sides.append(TensorShareSide(servers[-1].port, name=f"fsync={policy}"))
        for size in PERSIST_SIZES:
            res = measure_puts([b.ts, *sides], size, b.cfg)
            mem = res[b.ts.name]
            for side in sides:
                r = res[side.name]
                rows.append(Row(f"put {_label(size)} {side.name}", f"{_fmt(r.median)} MB/s",
                                f"{_fmt(mem.median)} MB/s", r.median / mem.median,
                                r.total / mem.total, group="persist"))
        for side, data_dir in zip(sides, dirs, strict=True):
            if _dir_bytes(data_dir) < PERSIST_SIZES[0]:
                raise AssertionError(f"{side.name}: nothing was written to {data_dir}")
        b.info.append(f"persistence: data directories on {_fs_type(b.workdir)} under "
                      f"{os.path.dirname(b.workdir)}, {b.cfg.persist_puts} puts per repeat, "
                      "server and size")
    finally:
        for side in sides:
            with suppress(Exception):
                side.close()
        for server in servers:
            b.children.stop(server.proc)
        for data_dir in dirs:
            shutil.rmtree(data_dir, ignore_errors=True)
    return rows


# ------------------------------------------------------ EXTENSION POINTS (rows to add later)
# Each is a section like the ones above: it gets the Bench, measures (interleaving the
# systems in every repeat), and returns its rows; the SECTIONS entry makes it run in order
# and selectable with --only. They return no rows until they are written.


def measure_appends(b: Bench) -> tuple[Rate, Rate, Rate]:
    """Tiny appends through a pipeline, the reading side's drain, and the baseline's
    pipelined tiny puts; each as items (requests) per second, medians over the repeats."""
    import torch

    n = b.cfg.batch_items
    tiny = [torch.tensor([float(i)]) for i in range(n)]
    client = b.ts.client
    appends: list[int] = []
    drains: list[int] = []
    base: list[int] = []
    clock = time.perf_counter_ns
    for rep in range(b.cfg.repeat):
        for system in (("ts", "base") if rep % 2 == 0 else ("base", "ts")):
            if system == "ts":
                t0 = clock()
                with client.pipeline() as p:
                    for t in tiny:
                        p.append("batch", t)
                t1 = clock()
                got = 0
                while got < n:
                    got += len(client.get("batch", max_items=n))
                t2 = clock()
                appends.append(t1 - t0)
                drains.append(t2 - t1)
            else:
                t0 = clock()
                b.base.put_many("batch", tiny)
                base.append(clock() - t0)
    return Rate.of(n, appends), Rate.of(n, drains), Rate.of(n, base)


def section_batched_appends(b: Bench) -> list[Row]:
    """appends (batched): tiny appends through ``Client.pipeline()``; drain: ``get(max_items)``.

    The goal (issue 9) is tensorshare's own rate, at least 100,000 appends/s; the baseline
    column is the baseline server's rate of tiny puts written back to back in one
    ``sendmsg`` and answered afterwards (its protocol has no batches). The drain is also
    compared with the appends that filled the bin (issue 37: at least 1.5x; a drained run
    of like tensors travels as one buffer, docs/PROTOCOL.md §3.3.3.1).
    """
    appends, drains, base = measure_appends(b)
    rows = [Row("appends (pipeline)", f"{appends.median:,.0f} items/s",
                f"{base.median:,.0f} puts/s", appends.median / base.median,
                appends.total / base.total, ">= 100,000/s",
                appends.median >= 100_000),
            Row("drain get(max_items)", f"{drains.median:,.0f} items/s",
                f"{base.median:,.0f} puts/s", drains.median / base.median,
                drains.total / base.total, ">= 1.5", _meets(drains.median / base.median, 1.5)),
            # (issue 37: the drain against the pipelined appends that filled the bin)
            Row("drain / its appends", f"{drains.median:,.0f} items/s",
                f"{appends.median:,.0f} appends/s", drains.median / appends.median,
                drains.total / appends.total, ">= 1.5",
                _meets(drains.median / appends.median, 1.5))]
    b.info.append(f"appends: {b.cfg.batch_items} tiny (4-byte) tensors per repeat through one "
                  "pipeline (consecutive appends to one bin travel as batched requests), then "
                  "drained with get(max_items); baseline: the same number of tiny puts "
                  "pipelined on one connection")
    return rows


def section_reuse(b: Bench) -> list[Row]:
    """put / get of 1 and 16 MiB vs a baseline that reuses the buffers its gets free for the
    next put of their size (a queue's put-take loop then never touches fresh memory)."""
    server = launch_baseline(b.children, b.workdir, reuse=True, label="baseline-reuse")()
    side = BaselineSide(server.port)
    side.name = "baseline-reuse"
    try:
        rows: list[Row] = []
        for size in (1 << 20, 16 << 20):
            res = measure_transfer([b.ts, side], size, b.cfg)
            for i, direction in enumerate(("put", "get")):
                t, r = res[b.ts.name][i], res[side.name][i]
                ratio = t.median / r.median
                rows.append(Row(f"{direction} {_label(size)} vs reuse", f"{_fmt(t.median)} MB/s",
                                f"{_fmt(r.median)} MB/s", ratio, t.total / r.total,
                                ">= 0.8" if direction == "put" else "-",
                                _meets(ratio, 0.8) if direction == "put" else None,
                                group="reuse"))
        return rows
    finally:
        side.close()
        b.children.stop(server.proc)


def section_unix_socket(b: Bench) -> list[Row]:
    """put / get and tiny put+get over the Unix socket (no shared memory) vs TCP, both
    tensorshare, same server, interleaved."""
    unix = TensorShareSide(0, "unix", f"unix://{b.unix_path}", shm=False)
    try:
        rows: list[Row] = []
        for size in (1 << 20, 64 << 20):
            res = measure_transfer([unix, b.ts], size, b.cfg)
            for i, direction in enumerate(("put", "get")):
                u, t = res[unix.name][i], res[b.ts.name][i]
                rows.append(Row(f"{direction} {_label(size)} unix", f"{_fmt(u.median)} MB/s",
                                f"{_fmt(t.median)} MB/s", u.median / t.median,
                                u.total / t.total, group="unix"))
        pid = b.servers["tensorshare"].pid
        tiny = measure_tiny([unix, b.ts], b.cfg, {unix.name: pid, b.ts.name: pid})
        u, t = tiny[unix.name].rate, tiny[b.ts.name].rate
        rows.append(Row("tiny put+get unix", f"{u.median:,.0f} ops/s", f"{t.median:,.0f} ops/s",
                        u.median / t.median, u.total / t.total, group="unix"))
        return rows
    finally:
        unix.close()


def section_tls(b: Bench) -> list[Row]:
    """put / get of 1 and 64 MiB over TLS (a second server, ``--tls-cert``, certificates made
    with trustme) vs plain TCP, interleaved."""
    try:
        import trustme
    except ImportError:
        b.info.append("tls: skipped (pip install trustme, to make the certificates)")
        return []
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    paths = {n: os.path.join(b.workdir, f"{n}.pem") for n in ("ca", "cert", "key")}
    ca.cert_pem.write_to_path(paths["ca"])
    cert.cert_chain_pems[0].write_to_path(paths["cert"])
    cert.private_key_pem.write_to_path(paths["key"])
    server = launch_tensorshare(b.children, "tensorshare-tls", extra=[
        "--tls-cert", paths["cert"], "--tls-key", paths["key"]])()
    tls = TensorShareSide(server.port, "tls", f"tensorshare+tls://localhost:{server.port}",
                          tls_ca=paths["ca"])
    try:
        rows: list[Row] = []
        for size in (1 << 20, 64 << 20):
            res = measure_transfer([tls, b.ts], size, b.cfg)
            for i, direction in enumerate(("put", "get")):
                s, t = res[tls.name][i], res[b.ts.name][i]
                rows.append(Row(f"{direction} {_label(size)} tls", f"{_fmt(s.median)} MB/s",
                                f"{_fmt(t.median)} MB/s", s.median / t.median,
                                s.total / t.total, group="tls"))
        return rows
    finally:
        tls.close()


def section_shared_memory(b: Bench) -> list[Row]:
    """put / get of 16 and 64 MiB through sealed memfds (Unix socket, ``shm=True``) vs TCP,
    and vs an in-process copy of the same tensor (``torch.Tensor.copy_``)."""
    import torch

    shm = TensorShareSide(0, "shm", f"unix://{b.unix_path}", shm=True)
    try:
        if not shm.client.shared_memory:
            return [Row("put/get via shared memory", "", "", None, group="shm",
                        skipped="this platform cannot pass sealed memfds (Linux only)")]
        rows: list[Row] = []
        for size in (16 << 20, 64 << 20):
            res = measure_transfer([shm, b.ts], size, b.cfg)
            src = torch.randn(size // 4)
            dst = torch.empty_like(src)
            copies = []
            for _ in range(b.cfg.repeat * 3):
                t0 = time.perf_counter_ns()
                dst.copy_(src)
                copies.append(time.perf_counter_ns() - t0)
            memcpy = Rate.of(size / 1e6, copies)
            for i, direction in enumerate(("put", "get")):
                m, t = res[shm.name][i], res[b.ts.name][i]
                ratio = m.median / t.median
                big = size == 64 << 20
                row = Row(f"{direction} {_label(size)} shm", f"{_fmt(m.median)} MB/s",
                          f"{_fmt(t.median)} MB/s", ratio, m.total / t.total,
                          ">= 3 (vs TCP)" if big else "-", _meets(ratio, 3.0) if big else None,
                          group="shm")
                vs_copy = m.median / memcpy.median
                row.notes.append(f"vs an in-process copy ({_fmt(memcpy.median)} MB/s): "
                                 f"{vs_copy:.2f}{'  (goal >= 0.5 met)' if vs_copy >= 0.5 else '  (goal >= 0.5 MISSED)' if big else ''}")
                rows.append(row)
        b.info.append("shm: the Unix socket client with shm=True: a put writes each tensor "
                      "once into a sealed memfd, a get maps the server's copy-on-write")
        return rows
    finally:
        shm.close()


STREAM_SIZE = 16 << 20
STREAM_BATCHES = 8  # batches per round and consumer
STREAM_CONSUMERS = 3


def _stream_reader_main(ts_port: int, base_port: int, unix_path: str, bin_name: str, n: int,
                        pipe: Connection) -> None:
    """Stream consumer process: per round receive ``(system, round)``. tensorshare (or
    ``shm``: over the Unix socket, batches as shared memory): join
    stream ``BIN_NAME-ROUND`` as consumer ``reader-PID`` (at ``"now"``), send ``"armed"``,
    read ``STREAM_BATCHES`` batches; baseline: send ``"armed"``, wait for ``"go"`` (every
    batch was put), then get ``base-ROUND-I`` for each. Stamp ``perf_counter_ns()`` after the
    last batch, check every batch (its first element is its index, its last ``n - 1``) and
    send ``(stamp, error or None)``; exit on None/EOF."""
    _ignore_sigint()
    import torch

    from tensorshare.data import StreamConsumer

    base = BaselineClient(base_port)
    like = torch.empty(n, dtype=torch.float32, device="meta")
    pipe.send("ready")
    try:
        while (cmd := pipe.recv()) is not None:
            system, rnd = cmd
            values: list[Any] = []
            if system != "baseline":
                where = (f"unix://{unix_path}", None) if system == "shm" else \
                    ("127.0.0.1", ts_port)
                with StreamConsumer(f"{bin_name}-{rnd}", f"reader-{os.getpid()}", *where,
                                    timeout=REPLY_TIMEOUT, prefetch=True) as c:
                    pipe.send("armed")
                    while len(values) < STREAM_BATCHES:
                        values += c.read().items
                    stamp = time.perf_counter_ns()
                    c.leave()
            else:
                pipe.send("armed")
                _expect(pipe, "go", REPLY_TIMEOUT, "benchmark")
                values = [base.get(f"base-{rnd}-{i}", like) for i in range(STREAM_BATCHES)]
                stamp = time.perf_counter_ns()
            bad = [i for i, v in enumerate(values)
                   if v.shape != (n,) or int(v[0]) != i or int(v[-1]) != n - 1]
            pipe.send((stamp, f"batches {bad} came back wrong" if bad else None))
            del values
    except EOFError:
        pass
    finally:
        base.close()


def _stream_round(b: Bench, pipes: list[Connection], system: str, rnd: int,
                  data: torch.Tensor) -> list[int]:
    """One round: every reader armed, then the batches sent; each reader's time (ns) from
    the first batch sent to its last batch in hand."""
    from tensorshare.data import StreamProducer

    for conn in pipes:
        conn.send((system, rnd))
    producer = None
    if system != "baseline":
        where = (f"unix://{b.unix_path}", None) if system == "shm" else \
            ("127.0.0.1", b.servers["tensorshare"].port)
        producer = StreamProducer(f"stream-{rnd}", *where, window=4, timeout=REPLY_TIMEOUT)
    try:
        for conn in pipes:
            _expect(conn, "armed", REPLY_TIMEOUT, "stream reader")
        t0 = time.perf_counter_ns()
        for i in range(STREAM_BATCHES):
            data[0] = i
            if producer is not None:
                producer.append(data)
            else:
                b.base.put(f"base-{rnd}-{i}", data)
        if producer is None:
            for conn in pipes:
                conn.send("go")
        results = [_receive(conn, REPLY_TIMEOUT, "stream reader") for conn in pipes]
    finally:
        if producer is not None:
            producer.close()
    errors = [err for _, err in results if err]
    if errors:
        raise AssertionError(f"{system} stream round {rnd}: {errors[0]}")
    return [stamp - t0 for stamp, _ in results]


def section_streams(b: Bench) -> list[Row]:
    """A stream bin of 16 MiB batches: one consumer vs the baseline (put every batch, then
    a reader process gets them), and each of 3 consumers vs one consumer alone."""
    import torch

    n = STREAM_SIZE // 4
    data = torch.arange(n, dtype=torch.float32)
    args = [(b.servers["tensorshare"].port, b.servers["baseline"].port, b.unix_path, "stream",
             n)]
    ns: dict[str, list[int]] = {"one": [], "base": [], "each": [], "one_shm": [],
                                "each_shm": []}
    rnd = 0
    with helper_processes(b.ctx, _stream_reader_main, args * STREAM_CONSUMERS,
                          "stream reader") as pipes:
        for rep in range(b.cfg.fanout_rounds + 1):  # the first round of each is a warm-up
            plan = [("one", "tensorshare", pipes[:1]), ("base", "baseline", pipes[:1]),
                    ("each", "tensorshare", pipes), ("one_shm", "shm", pipes[:1]),
                    ("each_shm", "shm", pipes)]
            for key, system, readers in (plan if rep % 2 == 0 else plan[::-1]):
                rnd += 1
                times = _stream_round(b, readers, system, rnd, data)
                if rep:
                    ns[key].append(max(times))  # the slowest consumer of the round
    mb = STREAM_BATCHES * STREAM_SIZE / 1e6
    one, base, each, one_shm, each_shm = (Rate.of(mb, ns[k]) for k in ns)
    ratio = one.median / base.median
    rows = [Row(f"stream {_label(STREAM_SIZE)} x 1", f"{_fmt(one.median)} MB/s",
                f"{_fmt(base.median)} MB/s", ratio, one.total / base.total)]
    ratio = each.median / one.median
    rows.append(Row(f"stream {_label(STREAM_SIZE)} x {STREAM_CONSUMERS} each",
                    f"{_fmt(each.median)} MB/s", f"{_fmt(one.median)} MB/s", ratio,
                    each.total / one.total, ">= 0.8", _meets(ratio, 0.8), group="streams"))
    ratio = each_shm.median / one_shm.median
    rows.append(Row(f"stream {_label(STREAM_SIZE)} x {STREAM_CONSUMERS} each shm",
                    f"{_fmt(each_shm.median)} MB/s", f"{_fmt(one_shm.median)} MB/s", ratio,
                    each_shm.total / one_shm.total, ">= 0.8", _meets(ratio, 0.8),
                    group="streams"))
    rows.append(Row(f"stream {_label(STREAM_SIZE)} x 1 shm", f"{_fmt(one_shm.median)} MB/s",
                    f"{_fmt(one.median)} MB/s", one_shm.median / one.median,
                    one_shm.total / one.total, group="shm"))
    b.info.append(f"streams: {STREAM_BATCHES} batches of {_label(STREAM_SIZE)} per round, "
                  f"window 4, consumer processes on the client core; MB/s per consumer = "
                  f"batches x size / (first batch sent to its last batch in hand, the slowest "
                  f"consumer's); baseline: the batches put to the baseline server, then one "
                  f"reader process gets each; shm: the same over the Unix socket with shared "
                  f"memory (every consumer maps the one copy); median of "
                  f"{b.cfg.fanout_rounds} rounds")
    return rows


SECTIONS: dict[str, Callable[[Bench], list[Row]]] = {
    "transfer": section_transfer,
    "tiny": section_tiny,  # includes the Redis row
    "notify": section_notify,
    "fanout": section_fanout,
    "persist": section_persist,
    "appends": section_batched_appends,
    "reuse": section_reuse,
    "unix": section_unix_socket,
    "tls": section_tls,
    "shm": section_shared_memory,
    "streams": section_streams,
    "inference": lambda b: __import__("bench_wings").section_inference(b),
    "relays": lambda b: __import__("bench_wings").section_relays(b),
}


# --------------------------------------------------------------------------- report

_COLS = (28, 20, 20, 8)  # workload, tensorshare, compared system, ratio; then the goal


def print_table(title: str, rows: list[Row], headings: dict[str, str]) -> None:
    """Print the rows, grouped (the baseline rows first), each group under its heading."""
    w0, w1, w2, w3 = _COLS
    print(title)
    print(f"{'workload':<{w0}}{'tensorshare':<{w1}}{'baseline':<{w2}}{'ratio':<{w3}}goal")
    for group in dict.fromkeys(["baseline", *(r.group for r in rows)]):
        members = [r for r in rows if r.group == group]
        if members and headings.get(group):
            print(f"-- {headings[group]}")
        for r in members:
            if r.skipped is not None:
                print(f"{r.workload:<{w0}}skipped: {r.skipped}")
                continue
            ratio = f"{r.ratio:.2f}" if r.ratio is not None else "-"
            goal = r.goal if r.met is None else f"{r.goal}  {'met' if r.met else 'MISSED'}"
            print(f"{r.workload:<{w0}}{r.ts:<{w1}}{r.base:<{w2}}{ratio:<{w3}}{goal}".rstrip())
            for note in r.notes:
                print(f"  note: {note}")


def _git_revision() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return out.stdout.strip() or "?"


def _forkserver() -> ForkServerContext:
    """The context for helper processes: a forkserver that imports torch and tensorshare
    once, so that 32 readers start in a second rather than a torch import each (as spawned
    processes would). Started now, so that its imports overlap the servers' start; call this
    after pinning, so that it and every helper inherit the client core."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", "torch", "tensorshare"])
    forkserver.ensure_running()
    return ctx


def run(cfg: Config) -> None:
    """Start the servers, run every section, print the table."""
    children = Children()
    sides: list[Side] = []
    workdir = tempfile.mkdtemp(prefix="tensorshare-bench-")
    try:
        pinned = (os.cpu_count() or 1) >= 2
        if pinned:  # the servers are pinned by taskset; what this process starts inherits this
            os.sched_setaffinity(0, {CLIENT_CORE})
        unix_path = os.path.join(workdir, "tensorshare.sock")
        waits = [launch_tensorshare(children, extra=["--unix", unix_path]),
                 launch_baseline(children, workdir)]
        ctx = _forkserver()
        import torch  # while the servers start (seconds on a busy machine)

        import tensorshare

        ts_server, base_server = (wait() for wait in waits)
        ts, base = TensorShareSide(ts_server.port), BaselineSide(base_server.port)
        sides += [ts, base]
        b = Bench(cfg, children, workdir, ctx,
                  {"tensorshare": ts_server, "baseline": base_server}, ts, base,
                  headings={"floor": "the server's CPU per tiny op vs a bare Twisted "
                                     "protocol answering each frame (no parsing, no store); "
                                     "columns: tensorshare | bare twisted; ratio = bare / "
                                     "tensorshare",
                            "redis": "tiny put+get vs Redis in the same run; columns: "
                                     "tensorshare | redis",
                            "persist": "tensorshare --data-dir (fsync policy) vs the in-memory "
                                       "tensorshare server; columns: persistent | in-memory",
                            "reuse": "puts and gets vs a baseline that reuses the buffers its "
                                     "gets free for the next put of their size; columns: "
                                     "tensorshare | reusing baseline",
                            "unix": "the same server over its Unix socket (no shared memory) vs "
                                    "TCP; columns: unix | tcp",
                            "shm": "large tensors through shared memory (sealed memfds over the "
                                   "Unix socket) vs TCP; columns: shm | tcp",
                            "tls": "the same transfers over TLS (a second server with "
                                   "--tls-cert) vs plain TCP; columns: tls | tcp",
                            "streams": "a stream bin read by 3 consumers at once vs by 1 "
                                       "consumer alone; columns: each of 3 | 1 alone",
                            "inference": "predict through an InferenceHost (batched) vs a "
                                         "model server that runs each call alone; columns: "
                                         "tensorshare | per call",
                            "relays": "one put read by 32 readers through 2 relays vs straight "
                                      "from the primary; columns: via relays | direct"},
                  unix_path=unix_path)
        rows: list[Row] = []
        t_start = time.monotonic()
        load_before = os.getloadavg()[0]
        took: list[str] = []
        for name in cfg.sections:
            t_section = time.monotonic()
            new = SECTIONS[name](b)
            rows += new
            if new:  # the extension points return no rows yet
                took.append(f"{name} {time.monotonic() - t_section:.0f} s")
        elapsed = time.monotonic() - t_start
        load_after = os.getloadavg()[0]

        if pinned:
            servers = ", ".join(f"{s.label} {s.pid}@{s.cores}" for s in children.servers)
            where = f"servers (pid@core) {servers}; client on core {_affinity(0)}"
        else:
            where = "one core: nothing pinned"
        print_table(f"tensorshare benchmark  ({where}; python {platform.python_version()}, "
                    f"torch {torch.__version__})", rows, b.headings)
        totals = "  ".join(f"{r.workload} {r.total_ratio:.2f}" for r in rows
                           if r.total_ratio is not None)
        info = "".join(f"\n{line}" for line in b.info)
        print(f"""
tensorshare {tensorshare.__version__} (git {_git_revision()}); {cfg.repeat} repeats, every system in every repeat; rate = work per op / median op time; MB = 10^6 bytes
ratio = tensorshare / the compared column (baseline, redis, or in-memory tensorshare), above 1 = tensorshare (or the persistent server) faster; notify: baseline p50 / tensorshare p50{info}
ratios from total time instead (every stall included): {totals}
measured in {elapsed:.0f} s ({", ".join(took)}); 1-min load average {load_before:.1f} at start, {load_after:.1f} at end (the benchmark adds about 1-2; more means other processes competed)""")
    finally:
        for side in sides:
            with suppress(Exception):
                side.close()
        children.close()
        shutil.rmtree(workdir, ignore_errors=True)


# --------------------------------------------------------------------------- command line


def _parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if mult != 1 else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 4K, 1M, 64MiB)") from None
    if value <= 0 or value % 4:
        raise argparse.ArgumentTypeError(f"size must be a positive multiple of 4: {text!r}")
    return value


def _parse_sizes(text: str) -> list[int]:
    return [_parse_size(s) for s in text.split(",") if s.strip()]


def _parse_sections(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown section(s) {', '.join(unknown) or text!r}; "
                                         f"choose from {', '.join(SECTIONS)}")
    return [n for n in SECTIONS if n in names]  # always in the table's order


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a short run (under a minute)")
    p.add_argument("--sizes", type=_parse_sizes, default=None, metavar="LIST",
                   help="tensor sizes of the put/get rows, e.g. 4K,1M,16M,64M (the default)")
    p.add_argument("--repeat", type=int, default=None,
                   help="repeats per measurement (default 21, --quick 7)")
    p.add_argument("--only", type=_parse_sections, default=None, metavar="SECTIONS",
                   help=f"run only these sections, comma-separated: {', '.join(SECTIONS)}")
    p.add_argument("--baseline-server", metavar="PORT_FILE", help=argparse.SUPPRESS)
    p.add_argument("--baseline-reuse", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bare-twisted-server", metavar="PORT_FILE", help=argparse.SUPPRESS)
    p.add_argument("--model-server", metavar="PORT_FILE", help=argparse.SUPPRESS)
    p.add_argument("--inference-host", metavar="PORT", type=int, help=argparse.SUPPRESS)
    p.add_argument("--model", default="mlp", help=argparse.SUPPRESS)
    return p


@contextmanager
def _sigterm_exits() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into SystemExit so ``finally`` blocks stop the servers."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, previous in old.items():
            signal.signal(sig, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 whatever the numbers)."""
    args = _parser().parse_args(argv)
    if args.baseline_server:
        _ignore_sigint()  # Ctrl+C reaches the whole process group; the benchmark stops us
        BaselineServer(reuse=args.baseline_reuse).serve(args.baseline_server)
        return 0
    if args.bare_twisted_server:
        _ignore_sigint()
        serve_bare_twisted(args.bare_twisted_server)
        return 0
    if args.model_server or args.inference_host:
        _ignore_sigint()
        sys.path.insert(0, str(ROOT))
        import bench_wings

        if args.model_server:
            bench_wings.model_server(args.model_server, args.model)
        else:
            bench_wings.inference_host(args.inference_host, args.model)
        return 0
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # measure this checkout, installed or not
    os.environ["PYTHONPATH"] = _child_env()["PYTHONPATH"]  # and so do the helper processes
    quick = args.quick
    cfg = Config(
        sizes=args.sizes or [4 << 10, 1 << 20, 16 << 20, 64 << 20],
        repeat=args.repeat if args.repeat is not None else (7 if quick else 21),
        target_bytes=(32 if quick else 128) << 20,
        max_iters=100 if quick else 200,
        tiny_pairs=200 if quick else 400,
        notify_puts=300 if quick else 1000,
        notify_gap=0.002,
        fanout_rounds=2 if quick else 9,
        persist_puts=20 if quick else 40,
        batch_items=50_000 if quick else 100_000,
        sections=args.only or list(SECTIONS),
    )
    if cfg.repeat < 1:
        raise SystemExit("--repeat must be at least 1")
    with _sigterm_exits():
        try:
            run(cfg)
        except KeyboardInterrupt:
            print("interrupted; servers and helper processes stopped", file=sys.stderr)
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
