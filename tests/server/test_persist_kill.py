"""The server survives ``kill -9`` with everything it acknowledged.

A subprocess server with ``--data-dir`` and ``--fsync always`` is killed with SIGKILL at random
moments while a writer keeps appending and putting through one elastic Client, and restarted
on the same port each time. After every restart every acknowledged write is there, in order,
nothing twice, and bin versions never went backwards; the writer's loop never sees an error.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from tensorshare import Client
from tests.conftest import wait_until

WAIT = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``tensorshare serve`` with a data directory, killed and restarted on one port."""

    def __init__(self, data_dir: Path, port: int, *args: str) -> None:
        self.data_dir, self.port, self.args = data_dir, port, args
        self.proc: subprocess.Popen[str] | None = None
        self.stderr: list[str] = []

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tensorshare", "serve", "--port", str(self.port),
             "--data-dir", str(self.data_dir), *self.args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.proc.kill()
            raise AssertionError(f"the server did not start: {line}{self.proc.stderr.read()}")
        err = self.proc.stderr
        threading.Thread(target=lambda: self.stderr.extend(err), daemon=True).start()

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        assert self.proc.wait(WAIT) == -signal.SIGKILL

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(WAIT)


def test_every_acknowledged_write_survives_sigkill_at_random_moments(tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    server = Server(tmp_path / "data", free_port(), "--fsync", "always", "--quiet",
                    "--snapshot-log-bytes", "64K")  # snapshots happen during the run too
    server.start()
    acked: list[int] = []  # items whose append returned, in order
    versions: list[int] = []  # what each append returned
    puts: list[int] = []  # values whose put returned
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer() -> None:
        try:
            with Client("127.0.0.1", server.port, timeout=WAIT) as c:
                i = 0
                while not stop.is_set():
                    versions.append(c.append("log", i, tag=i))
                    acked.append(i)
                    if i % 7 == 0:
                        c.put("last", i)
                        puts.append(i)
                    i += 1
        except BaseException as exc:  # the loop must never see one
            errors.append(exc)

    t = threading.Thread(target=writer)
    t.start()
    try:
        for kill in range(8):
            target = len(acked) + rng.randrange(20, 300)
            wait_until(lambda t=target: len(acked) >= t or bool(errors),  # type: ignore[misc]
                       timeout=WAIT, what="more acknowledged writes")
            server.kill()
            known = list(acked)  # acknowledged before the kill
            server.start()
            with Client("127.0.0.1", server.port, timeout=WAIT, reconnect=False,
                        session=False) as check:
                items = check.peek("log")
                # Everything acknowledged is there, in order, once; at most the writes in
                # flight at the kill may follow (they were logged but not yet answered).
                assert items[: len(known)] == known, f"seed {seed}, kill {kill}"
                assert items == list(range(len(items))), f"seed {seed}, kill {kill}"
                if puts:
                    assert check.peek("last") >= [p for p in puts if p <= known[-1]][-1]
        stop.set()
        t.join(WAIT)
        assert not t.is_alive() and not errors, (seed, errors)
        assert versions == sorted(set(versions)), f"seed {seed}: versions went backwards"
        with Client("127.0.0.1", server.port, timeout=WAIT, session=False) as c:
            assert c.peek("log") == acked  # nothing lost, nothing twice, in order
        assert not any("Traceback" in line for line in server.stderr), server.stderr
    finally:
        stop.set()
        t.join(WAIT)
        server.stop()


def test_a_torn_log_tail_starts_with_one_warning(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = Server(data, free_port(), "--fsync", "always")
    server.start()
    try:
        with Client("127.0.0.1", server.port, timeout=WAIT, session=False) as c:
            for i in range(5):
                c.append("q", i)
        server.kill()
        log = sorted(data.glob("log-*.tsl"))[-1]
        with open(log, "r+b") as f:
            f.truncate(log.stat().st_size - 3)  # the last record loses its end
        server.start()
        with Client("127.0.0.1", server.port, timeout=WAIT, session=False) as c:
            assert c.peek("q") == [0, 1, 2, 3]
        wait_until(lambda: any("cut short" in line for line in server.stderr), timeout=WAIT,
                   what="the warning")
        warnings = [line for line in server.stderr if "cut short" in line]
        assert len(warnings) == 1 and str(log) in warnings[0]
    finally:
        server.stop()


def test_a_corrupt_snapshot_refuses_to_start_and_says_why(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = Server(data, free_port())
    server.start()
    try:
        with Client("127.0.0.1", server.port, timeout=WAIT, session=False) as c:
            c.put("w", list(range(1000)))
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)  # a clean stop writes a final snapshot
        assert server.proc.wait(WAIT) == 0
        (snap,) = data.glob("snapshot-*.tss")
        raw = bytearray(snap.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        snap.write_bytes(bytes(raw))
        proc = subprocess.run([sys.executable, "-m", "tensorshare", "serve", "--port", "0",
                               "--data-dir", str(data)], capture_output=True, text=True,
                              timeout=WAIT)
        assert proc.returncode == 1
        assert f"snapshot {snap} is corrupt at offset" in proc.stderr
        assert "Move the file away" in proc.stderr
    finally:
        server.stop()


def test_sigterm_writes_a_snapshot_and_the_restart_loads_it(tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = Server(data, free_port())
    server.start()
    try:
        with Client("127.0.0.1", server.port, timeout=WAIT, session=False) as c:
            c.configure("b", max_items=10)
            for i in range(3):
                c.append("b", {"i": i})
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(WAIT) == 0
        assert len(list(data.glob("snapshot-*.tss"))) == 1
        server.start()
        with Client("127.0.0.1", server.port, timeout=WAIT, session=False) as c:
            assert c.peek("b") == [{"i": 0}, {"i": 1}, {"i": 2}]
            info: Any = c.stats("b")["bins"]["b"]
            assert info["version"] == 3 and info["limits"]["max_items"] == 10
    finally:
        server.stop()
