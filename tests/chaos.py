"""Fault injection for tests: a TCP proxy that cuts connections, and a killable server process.

:class:`ChaosProxy` listens on 127.0.0.1 (port 0, so it never collides) and forwards every
accepted connection to a target ``(host, port)`` that may be changed at run time (a replaced
backend server). Faults are described by :class:`Faults` and drawn per connection from a seeded
random generator:

* **cuts by bytes**, per direction: after a random number of forwarded bytes (client to server,
  and server to client, each with its own budget) the proxy forwards exactly that many bytes,
  which usually ends in the middle of a frame, and cuts the connection;
* **cuts by time**: a connection is cut a random number of seconds after it was accepted (so
  that quiet connections, a waiting ``get`` say, are cut too);
* a cut closes both sockets at once, with a reset (``SO_LINGER`` 0: ``ECONNRESET`` on the other
  side, unsent bytes discarded) or a plain close (``EOF``), chosen at random; optionally it
  closes only the client's side and leaves the server's open and silent (**half-open**), so
  that the server learns of it only when the client comes back;
* optional **chunking** (data forwarded in random small pieces, each its own TCP segment) and
  **delays** (each piece held back a random time; the order of bytes is always kept).

Switches that tests drive by hand: :meth:`~ChaosProxy.cut_all` (drop every live connection at
once), :meth:`~ChaosProxy.pause_accepting` (every new connection is accepted and reset at once,
as a server that refuses), :meth:`~ChaosProxy.set_target` and :meth:`~ChaosProxy.set_faults`.
A proxy may listen on several ports (:meth:`~ChaosProxy.open_port`), each with its own
counters: give each client its own port to count how often that client connected and was cut.

Reproducing a failure: connection number ``n`` draws its faults from ``Random(f"{seed}/{n}")``;
run again with the seed the assertion printed (tests read ``TENSORSHARE_CHAOS_SEED``). Thread
scheduling still varies, so a seed reproduces the fault pattern, not the exact interleaving.

Everything runs on one thread around a ``selectors`` loop; public methods hand work to it and
wait for it with a deadline. :meth:`~ChaosProxy.close` closes every socket and joins the thread
(raising if it does not stop in time), so nothing leaks.

:class:`ServerProcess` runs ``python -m tensorshare serve --port P --quiet`` in a child
process, reads back where it listens, and kills it (SIGKILL) with deadlines; ``restart`` starts
a new one on the same port.
"""

from __future__ import annotations

import collections
import errno
import os
import queue
import random
import re
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ChaosProxy", "Faults", "ServerProcess", "chaos_seed"]

HOST = "127.0.0.1"
DEADLINE = 10.0  # how long a caller waits for the proxy thread to act; never reached normally
_READ = 64 * 1024
_MAX_QUEUED = 256 * 1024  # per direction: stop reading the source beyond this (backpressure)
_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset


def chaos_seed() -> int:
    """The seed for this run: ``$TENSORSHARE_CHAOS_SEED`` if set, else a fresh random one."""
    env = os.environ.get("TENSORSHARE_CHAOS_SEED")
    return int(env) if env else random.SystemRandom().randrange(1 << 32)


@dataclass(frozen=True)
class Faults:
    """What the proxy does to each connection. Ranges are ``(low, high)``, drawn uniformly per
    connection (per direction for bytes); ``None`` turns that fault off.

    Attributes:
        cut_after_bytes: cut once this many bytes went through in one direction (each
            direction draws its own budget, so cuts happen both ways and mid-frame).
        cut_after_seconds: cut this long after the connection was accepted.
        reset_probability: the chance that a cut is a reset rather than a plain close.
        half_open_probability: the chance that a fault's cut closes only the client's side
            and leaves the server's open and silent (as a dead NAT entry would): the server
            learns of it only when the client comes back and takes its session over.
        chunk_bytes: forward in pieces of this many bytes (each sent on its own).
        delay_seconds: hold each piece back this long (bytes keep their order).
    """

    cut_after_bytes: tuple[int, int] | None = None
    cut_after_seconds: tuple[float, float] | None = None
    reset_probability: float = 0.5
    half_open_probability: float = 0.0
    chunk_bytes: tuple[int, int] | None = None
    delay_seconds: tuple[float, float] | None = None


NO_FAULTS = Faults()


@dataclass
class _Pipe:
    """One direction of a proxied connection."""

    src: socket.socket
    dst: socket.socket
    name: str  # "up" (client to server) or "down"
    queue: collections.deque[list[Any]] = field(default_factory=collections.deque)  # [due, bytes]
    queued: int = 0
    eof: bool = False  # the source closed its side
    shut: bool = False  # we passed the close on (shutdown of the destination's write side)
    budget: int | None = None  # bytes left before a cut
    sent: int = 0
    last_due: float = 0.0  # when the last queued piece may leave (pieces keep their order)


@dataclass
class _Conn:
    index: int
    port: int  # the proxy port it came in on
    client: socket.socket
    server: socket.socket
    rng: random.Random
    faults: Faults
    up: _Pipe = field(init=False)
    down: _Pipe = field(init=False)
    connecting: bool = True
    half_open: bool = False  # the client's side is gone; the server's is read and discarded
    cut_at: float | None = None
    closed: bool = False

    def __post_init__(self) -> None:
        self.up = _Pipe(self.client, self.server, "up")
        self.down = _Pipe(self.server, self.client, "down")


class ChaosProxy:
    """A TCP proxy on 127.0.0.1 that injects faults (see the module's docstring).

    Args:
        target: ``(host, port)`` to forward to (changeable with :meth:`set_target`).
        seed: seeds every random choice (default: :func:`chaos_seed`).
        faults: the faults of new connections (default: none; see :meth:`set_faults`).
        first: faults for the first connections only, in order (then ``faults``).
        tap: keep every byte forwarded (:attr:`captured`), for tests that check what a
            listener on the network sees.

    Attributes:
        port: the first listening port. seed: the seed in use.
        captured: with ``tap``, ``{"up": bytes client to server, "down": ...}`` of every
            connection, in the order forwarded.

    Example::

        with ChaosProxy(("127.0.0.1", server.port), seed=1) as proxy:
            client = Client("127.0.0.1", proxy.port)        # connect while nothing is cut
            proxy.set_faults(Faults(cut_after_bytes=(1, 5000), cut_after_seconds=(0.1, 1)))
            ...
            assert proxy.stats()["cuts"] > 10, proxy.describe()
    """

    def __init__(self, target: tuple[str, int], *, seed: int | None = None,
                 faults: Faults = NO_FAULTS, first: tuple[Faults, ...] = (),
                 tap: bool = False) -> None:
        self.seed = chaos_seed() if seed is None else seed
        self._first = collections.deque(first)
        self._tap = tap
        self.captured: dict[str, bytearray] = {"up": bytearray(), "down": bytearray()}
        self.error: str | None = None  # the traceback, if the proxy thread failed
        self._target = target
        self._faults = faults
        self._sel = selectors.DefaultSelector()
        self._interest: dict[socket.socket, int] = {}
        self._listeners: dict[socket.socket, int] = {}
        self._conns: list[_Conn] = []
        self._owner: dict[socket.socket, _Conn] = {}  # both sockets of each connection
        self._count = 0  # connections accepted so far (numbers them for the rng)
        self._stats: dict[int, collections.Counter[str]] = {}
        self._paused = False
        self._stopping = False
        self._commands: collections.deque[tuple[Callable[[], Any], threading.Event, list[Any]]]
        self._commands = collections.deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._set_interest(self._wake_r, selectors.EVENT_READ)
        self.port = self._listen()
        self._thread = threading.Thread(target=self._run, name=f"chaos-proxy-{self.port}",
                                        daemon=True)
        self._thread.start()

    # -- public API (any thread) -------------------------------------------------------------
    @property
    def address(self) -> tuple[str, int]:
        return HOST, self.port

    def open_port(self) -> int:
        """Listen on one more port (same target and faults, its own counters); return it."""
        return int(self._call(self._listen))

    def set_target(self, target: tuple[str, int]) -> None:
        """Forward connections accepted from now on to ``target`` (live ones keep theirs)."""
        def run() -> None:
            self._target = target
        self._call(run)

    def set_faults(self, faults: Faults) -> None:
        """Use ``faults`` from now on, for new connections and (drawn afresh) live ones."""
        def run() -> None:
            self._faults = faults
            for c in self._conns:
                self._draw(c, faults)
        self._call(run)

    def pause_accepting(self) -> None:
        """Refuse new connections: each is accepted and reset at once (counted as refused)."""
        self._call(lambda: setattr(self, "_paused", True))

    def resume_accepting(self) -> None:
        self._call(lambda: setattr(self, "_paused", False))

    def cut_all(self, reset: bool = True) -> int:
        """Cut every live connection now (reset, or a plain close); return how many."""
        def run() -> int:
            conns = list(self._conns)
            for c in conns:
                self._cut(c, "cut_all", reset)
            return len(conns)
        return int(self._call(run))

    def live(self, port: int | None = None) -> int:
        """How many connections are open (on ``port``, or on any), half-open ones included."""
        return int(self._call(lambda: sum(1 for c in self._conns
                                          if port is None or c.port == port), closed_ok=True))

    def stats(self, port: int | None = None) -> dict[str, int]:
        """Counters of ``port`` (or of all ports together), also readable after :meth:`close`:

        ``accepted`` (connections forwarded), ``refused`` (reset at once while paused),
        ``backend_errors`` (the target could not be reached), ``cuts`` (by a fault, by bytes or
        by time), ``mid_stream`` (those of ``cuts`` made when a byte budget ran out: at an
        arbitrary byte, so nearly always inside a frame), ``cut_all`` (by :meth:`cut_all`),
        ``resets`` (cuts sent as a reset rather than a close), ``half_open`` (cuts that left
        the server's side open), ``bytes_up`` (client to
        server), ``bytes_down``."""
        def run() -> dict[str, int]:
            total: collections.Counter[str] = collections.Counter()
            for p, counter in self._stats.items():
                if port is None or p == port:
                    total.update(counter)
            return dict(total)
        out = self._call(run, closed_ok=True)
        for key in ("accepted", "refused", "backend_errors", "cuts", "cut_all", "resets",
                    "mid_stream", "half_open", "bytes_up", "bytes_down"):
            out.setdefault(key, 0)
        return out  # type: ignore[no-any-return]

    def describe(self) -> str:
        """One line for assertion messages: the seed and the counters."""
        try:
            counters: Any = self.stats()
        except RuntimeError as exc:
            counters = f"(counters unavailable: {exc})"
        failed = f" PROXY FAILED: {self.error}" if self.error else ""
        return f"chaos seed={self.seed} (TENSORSHARE_CHAOS_SEED={self.seed}) {counters}{failed}"

    def close(self) -> None:
        """Close every socket and join the proxy thread. Idempotent.

        Raises:
            RuntimeError: the thread did not stop in time, or it had failed (a bug in the
                proxy: the traceback is in the message), so a test cannot pass unnoticed.
        """
        if self._thread.is_alive():
            self._stopping = True
            self._wake()
            self._thread.join(DEADLINE)
            if self._thread.is_alive():
                raise RuntimeError(f"the chaos proxy thread on port {self.port} did not stop")
        self._close_everything()
        error, self.error = self.error, None
        if error is not None:
            raise RuntimeError(f"the chaos proxy thread failed:\n{error}")

    def __enter__(self) -> ChaosProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing between threads ------------------------------------------------------------
    def _call(self, fn: Callable[[], Any], closed_ok: bool = False) -> Any:
        """Run ``fn`` on the proxy thread and return its result (or raise its exception).

        Once the thread has ended, ``fn`` runs here if ``closed_ok`` (it only reads), else
        this raises ``RuntimeError``.
        """
        if threading.current_thread() is self._thread:
            return fn()
        if not self._thread.is_alive():
            if closed_ok:
                return fn()
            raise RuntimeError("the chaos proxy is closed")
        done = threading.Event()
        box: list[Any] = []
        self._commands.append((fn, done, box))
        self._wake()
        if not done.wait(DEADLINE):
            raise RuntimeError("the chaos proxy thread did not answer in time")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # full (a wake is pending anyway) or closed

    # -- the proxy thread ----------------------------------------------------------------------
    def _listen(self) -> int:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((HOST, 0))
        s.listen(128)
        s.setblocking(False)
        port = int(s.getsockname()[1])
        self._listeners[s] = port
        self._stats[port] = collections.Counter()
        self._set_interest(s, selectors.EVENT_READ)
        return port

    def _run(self) -> None:
        try:
            while not self._stopping:
                timeout = self._next_timer()
                for key, mask in self._sel.select(timeout):
                    self._event(key.fileobj, mask)  # type: ignore[arg-type]
                self._run_commands()
                self._on_time()
        except BaseException:
            self.error = traceback.format_exc()  # a bug in the proxy: reported by close()
            raise
        finally:
            self._stopping = True
            self._run_commands()  # answer whoever waits (they will see the proxy closed)
            self._close_everything()

    def _run_commands(self) -> None:
        while self._commands:
            fn, done, box = self._commands.popleft()
            try:
                box.append((True, fn()))
            except BaseException as exc:  # handed back to the caller
                box.append((False, exc))
            done.set()

    def _next_timer(self) -> float:
        now = time.monotonic()
        wake = now + 0.5
        for c in self._conns:
            if c.cut_at is not None:
                wake = min(wake, c.cut_at)
            if not c.connecting:
                for pipe in (c.up, c.down):
                    if pipe.queue and pipe.queue[0][0] > now:
                        wake = min(wake, pipe.queue[0][0])
        return max(wake - now, 0.0)

    def _on_time(self) -> None:
        now = time.monotonic()
        for c in list(self._conns):
            if c.closed or c.half_open:
                continue
            if c.cut_at is not None and now >= c.cut_at:
                self._fault_cut(c)
            elif not c.connecting:
                for pipe in (c.up, c.down):
                    if pipe.queue and pipe.queue[0][0] <= now and not c.closed:
                        self._pump(c, pipe)
                if not c.closed:
                    self._refresh(c)

    def _event(self, sock: socket.socket, mask: int) -> None:
        if sock is self._wake_r:
            try:
                while self._wake_r.recv(4096):
                    pass
            except (BlockingIOError, OSError):
                pass
            return
        port = self._listeners.get(sock)
        if port is not None:
            self._accept(sock, port)
            return
        conn = self._owner.get(sock)
        if conn is None or conn.closed:
            return
        if conn.half_open:
            self._discard(conn)
            return
        if conn.connecting:
            if sock is conn.server and mask & selectors.EVENT_WRITE:
                self._connected(conn)
            return
        if mask & selectors.EVENT_READ:
            self._read(conn, conn.up if sock is conn.client else conn.down)
        if not conn.closed and mask & selectors.EVENT_WRITE:
            self._pump(conn, conn.down if sock is conn.client else conn.up)
        if not conn.closed:
            self._refresh(conn)

    def _accept(self, listener: socket.socket, port: int) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            counter = self._stats[port]
            if self._paused:
                counter["refused"] += 1
                _close(client, reset=True)
                continue
            counter["accepted"] += 1
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            server.setblocking(False)
            server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._count += 1
            rng = random.Random(f"{self.seed}/{self._count}")
            faults = self._first.popleft() if self._first else self._faults
            conn = _Conn(self._count, port, client, server, rng, faults)
            self._owner[client] = conn
            self._owner[server] = conn
            self._conns.append(conn)
            self._draw(conn, faults)
            err = server.connect_ex(self._target)
            if err not in (0, errno.EINPROGRESS):
                counter["backend_errors"] += 1
                self._drop(conn, reset=True)
                continue
            self._set_interest(server, selectors.EVENT_WRITE)

    def _connected(self, conn: _Conn) -> None:
        err = conn.server.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            self._stats[conn.port]["backend_errors"] += 1
            self._drop(conn, reset=True)
            return
        conn.connecting = False
        self._refresh(conn)

    def _draw(self, conn: _Conn, faults: Faults) -> None:
        """Draw this connection's faults (afresh when the faults change)."""
        rng = conn.rng
        conn.faults = faults
        for pipe in (conn.up, conn.down):
            b = faults.cut_after_bytes
            pipe.budget = rng.randint(b[0], b[1]) if b else None
        t = faults.cut_after_seconds
        conn.cut_at = time.monotonic() + rng.uniform(t[0], t[1]) if t else None

    def _read(self, conn: _Conn, pipe: _Pipe) -> None:
        try:
            data = pipe.src.recv(_READ)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # the peer reset: pass it on
            self._drop(conn, reset=True)
            return
        if not data:
            pipe.eof = True
            self._pump(conn, pipe)
            return
        if self._tap:
            self.captured[pipe.name] += data
        faults, rng = conn.faults, conn.rng
        now = time.monotonic()
        view = memoryview(data)
        while view:
            n = rng.randint(*faults.chunk_bytes) if faults.chunk_bytes else len(view)
            due = now + rng.uniform(*faults.delay_seconds) if faults.delay_seconds else now
            due = max(due, pipe.last_due)  # never reorder bytes
            pipe.last_due = due
            pipe.queue.append([due, view[:n]])
            pipe.queued += len(view[:n])
            view = view[n:]
        self._pump(conn, pipe)

    def _pump(self, conn: _Conn, pipe: _Pipe) -> None:
        """Send what is due; cut when the byte budget runs out; pass an EOF on."""
        now = time.monotonic()
        chunked = conn.faults.chunk_bytes is not None
        while pipe.queue and pipe.queue[0][0] <= now:
            head = pipe.queue[0]
            data = head[1]
            n = len(data) if pipe.budget is None else min(len(data), pipe.budget)
            try:
                sent = pipe.dst.send(data[:n]) if n else 0
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._drop(conn, reset=True)
                return
            pipe.sent += sent
            pipe.queued -= sent
            self._stats[conn.port]["bytes_" + pipe.name] += sent
            if sent == len(data):
                pipe.queue.popleft()
            else:
                head[1] = data[sent:]
            if pipe.budget is not None:
                pipe.budget -= sent
                if pipe.budget <= 0:
                    self._stats[conn.port]["mid_stream"] += 1
                    self._fault_cut(conn)
                    return
            if sent < n:
                return  # the socket is full: wait until it is writable
            if chunked:
                break  # one piece per turn, so pieces leave as separate segments
        if pipe.eof and not pipe.queue and not pipe.shut:
            pipe.shut = True
            try:
                pipe.dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            other = conn.down if pipe is conn.up else conn.up
            if other.shut:
                self._drop(conn, reset=False)

    def _refresh(self, conn: _Conn) -> None:
        """Listen for what each socket of ``conn`` can do now."""
        if conn.closed or conn.half_open:
            return
        if conn.connecting:
            self._set_interest(conn.client, 0)
            self._set_interest(conn.server, selectors.EVENT_WRITE)
            return
        now = time.monotonic()
        masks = {conn.client: 0, conn.server: 0}
        for pipe in (conn.up, conn.down):
            if not pipe.eof and pipe.queued < _MAX_QUEUED:
                masks[pipe.src] |= selectors.EVENT_READ
            if pipe.queue and pipe.queue[0][0] <= now:
                masks[pipe.dst] |= selectors.EVENT_WRITE
        for sock, mask in masks.items():
            self._set_interest(sock, mask)

    def _set_interest(self, sock: socket.socket, mask: int) -> None:
        old = self._interest.get(sock, 0)
        if mask == old:
            return
        if old == 0:
            self._sel.register(sock, mask)
        elif mask == 0:
            self._sel.unregister(sock)
        else:
            self._sel.modify(sock, mask)
        if mask:
            self._interest[sock] = mask
        else:
            self._interest.pop(sock, None)

    def _fault_cut(self, conn: _Conn) -> None:
        """Cut as the faults say: reset or close, both sides or only the client's."""
        rng, faults = conn.rng, conn.faults
        reset = rng.random() < faults.reset_probability
        if conn.connecting or rng.random() >= faults.half_open_probability:
            self._cut(conn, "cuts", reset)
            return
        stats = self._stats[conn.port]
        stats["cuts"] += 1
        stats["half_open"] += 1
        stats["resets"] += reset
        conn.half_open = True
        conn.cut_at = None
        conn.up.queue.clear()
        conn.down.queue.clear()
        self._set_interest(conn.client, 0)
        self._owner.pop(conn.client, None)
        _close(conn.client, reset)
        self._set_interest(conn.server, selectors.EVENT_READ)

    def _discard(self, conn: _Conn) -> None:
        """Read and drop what the server sends on a half-open connection, until it closes."""
        try:
            data = conn.server.recv(_READ)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn, reset=False)

    def _cut(self, conn: _Conn, counter: str, reset: bool) -> None:
        stats = self._stats[conn.port]
        stats[counter] += 1
        if reset:
            stats["resets"] += 1
        self._drop(conn, reset)

    def _drop(self, conn: _Conn, reset: bool) -> None:
        if conn.closed:
            return
        conn.closed = True
        for sock in (conn.client, conn.server):
            self._set_interest(sock, 0)
            self._owner.pop(sock, None)
            _close(sock, reset)
        conn.up.queue.clear()
        conn.down.queue.clear()
        self._conns.remove(conn)

    def _close_everything(self) -> None:
        if self._sel.get_map() is None:
            return  # done already
        for conn in list(self._conns):
            self._drop(conn, reset=True)
        for sock in list(self._listeners):
            self._set_interest(sock, 0)
            sock.close()
        self._listeners.clear()
        self._set_interest(self._wake_r, 0)
        self._wake_r.close()
        self._wake_w.close()
        self._sel.close()


def _close(sock: socket.socket, reset: bool) -> None:
    try:
        if reset:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RST)
    except OSError:
        pass
    sock.close()


# --------------------------------------------------------------------------- server process


class ServerProcess:
    """``python -m tensorshare serve --port P --quiet`` in a child process.

    Args:
        port: where to listen; 0 picks a free port (read back from ``.port``), which
            :meth:`restart` then reuses.
        args: more ``serve`` options.
        deadline: seconds to wait for the server to start, or to die after a kill.

    The server's stderr goes to a temporary file (``.stderr()`` reads it, for messages).
    """

    def __init__(self, port: int = 0, *args: str, deadline: float = 30.0) -> None:
        self.port = port
        self.args = args
        self.deadline = deadline
        self.proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._err = tempfile.TemporaryFile(mode="w+")
        self.start()

    @property
    def address(self) -> tuple[str, int]:
        return HOST, self.port

    def start(self) -> None:
        """Start a server on ``self.port`` and wait until it listens.

        Raises:
            RuntimeError: it exited or printed nothing in time (the message has its stderr).
        """
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self._join_reader()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = self.proc = subprocess.Popen(
            [sys.executable, "-m", "tensorshare", "serve", "--host", HOST, "--port",
             str(self.port), "--quiet", *self.args],
            stdout=subprocess.PIPE, stderr=self._err, stdin=subprocess.DEVNULL, text=True,
            env=env)
        lines: queue.Queue[str] = queue.Queue()

        def read() -> None:  # drains stdout until the process exits
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put("")

        self._reader = threading.Thread(target=read, name="server-process-stdout", daemon=True)
        self._reader.start()
        try:
            line = lines.get(timeout=self.deadline)
        except queue.Empty:
            line = ""
        m = re.search(r"listening on (\S+):(\d+)$", line.strip())
        if not m:
            self.kill()
            raise RuntimeError(f"the server process did not start (first line {line!r}); "
                               f"stderr: {self.stderr()[-2000:]}")
        self.port = int(m.group(2))

    def kill(self) -> None:
        """SIGKILL the server (if running) and wait until it is gone."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        try:
            proc.wait(self.deadline)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"server process {proc.pid} survived SIGKILL") from None
        self._join_reader()

    def restart(self, same_port: bool = True) -> None:
        """Kill the server if it runs, and start a new one (on the same port by default)."""
        self.kill()
        if not same_port:
            self.port = 0
        self.start()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stderr(self) -> str:
        # pread: the child shares this file's offset; a seek and read here would move it
        # under the child's next write, which then overwrites what it wrote before.
        fd = self._err.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode("utf-8", "replace")

    def close(self) -> None:
        """Kill the server and release everything (idempotent)."""
        try:
            self.kill()
        finally:
            if not self._err.closed:
                self._err.close()

    def _join_reader(self) -> None:
        proc, reader = self.proc, self._reader
        if reader is None or proc is None:
            return
        if proc.poll() is None:
            return  # still running: its stdout stays open
        reader.join(self.deadline)
        if reader.is_alive():
            raise RuntimeError("the server process's stdout reader did not stop")
        if proc.stdout is not None:
            proc.stdout.close()
        self._reader = None

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
