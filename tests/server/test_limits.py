"""No client, slow or hostile, can make the server grow past its limits.

The server runs as a subprocess (``tensorshare serve``) so that its resident memory can be read
from ``/proc``, apart from the test's own.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch

from tensorshare import Client
from tensorshare.errors import BinFull
from tensorshare.wire.messages import Hello, Listen
from tests.conftest import wait_until
from tests.rawwire import Get, Peek, WireClient

MiB = 1 << 20
WAIT = 60.0


class Served:
    """``tensorshare serve`` in a subprocess, on a free port."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tensorshare", "serve", "--port", "0", "--quiet", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert "listening on" in line, line + (self.proc.stderr.read() if self.proc.stderr
                                               else "")
        self.port = int(line.rsplit(":", 1)[1])

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(WAIT)


@pytest.fixture
def served() -> Iterator[Any]:
    made: list[Served] = []

    def make(*args: str) -> Served:
        s = Served(*args)
        made.append(s)
        return s

    try:
        yield make
    finally:
        for s in made:
            s.stop()


def raw_connection(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    # A small receive buffer: the kernel absorbs little of what the server sends it.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    return sock


def test_a_listener_that_never_reads_cannot_make_the_server_grow(served: Any) -> None:
    srv = served("--max-client-buffer", "32M")
    writer = Client("127.0.0.1", srv.port, timeout=WAIT)
    other = Client("127.0.0.1", srv.port, timeout=WAIT)
    writer.put("params", torch.zeros(16 * MiB // 4))
    base = srv.rss()
    # The slow client listens, asks for the 16 MiB value twice, and then never reads.
    slow = raw_connection(srv.port)
    wire = WireClient()
    slow.sendall(wire.frame(Hello(wire.next_id(), (1,), "slow")))
    slow.sendall(wire.frame(Listen(wire.next_id(), "params")))
    for _ in range(2):
        slow.sendall(wire.frame(Peek(wire.next_id(), "params")))
    # Meanwhile 1 GiB goes through the bin it listens to, in 16 MiB tensors.
    peak = 0
    for i in range(64):
        assert writer.put("params", torch.full((16 * MiB // 4,), float(i))) == i + 2
        other.ping()  # everyone else is served throughout
        peak = max(peak, srv.rss())
    stats = other.stats()["server"]["counters"]
    # Stored: 16 MiB; the slow client: its queued replies (each referencing a 16 MiB value
    # that the bin has since replaced), bounded by the buffer limit; plus allocator slack.
    assert peak - base < 16 * MiB + 32 * MiB + 48 * MiB, (peak - base) / MiB
    assert stats.get("client_paused", 0) >= 1  # its output backed up: it was paused
    # Its notifications were folded (the latest wins), or it was cut off for not reading.
    assert stats.get("notifications_folded", 0) > 0 or stats.get("client_buffer_closes", 0)
    assert torch.equal(other.peek("params")[:4], torch.full((4,), 63.0))
    slow.close()
    writer.close()
    other.close()


def test_a_client_that_stops_reading_past_the_buffer_limit_is_disconnected(
        served: Any) -> None:
    srv = served("--max-client-buffer", "8M")
    writer = Client("127.0.0.1", srv.port, timeout=WAIT)
    slow = raw_connection(srv.port)
    wire = WireClient()
    slow.sendall(wire.frame(Hello(wire.next_id(), (1,), "slow")))
    # Waiting gets, read by the server before anything is queued for this client; each is
    # answered later with 4 MiB that the client never reads.
    for _ in range(6):
        slow.sendall(wire.frame(Get(wire.next_id(), "v", wait=True, timeout=None)))
    wait_until(lambda: writer.stats()["server"]["waiting"]["fetches"] == 6, timeout=WAIT,
               what="the six waiting gets")
    for i in range(6):
        writer.append("v", torch.full((4 * MiB // 4,), float(i)))
    wait_until(lambda: writer.stats()["server"]["counters"].get("client_buffer_closes", 0)
               >= 1, timeout=WAIT, what="the slow client to be disconnected")
    assert writer.stats()["server"]["connections"] == 1
    writer.ping()  # the server serves on
    writer.close()
    slow.close()


def test_two_hundred_half_frames_before_hello_cost_little_and_are_closed(served: Any) -> None:
    srv = served()
    good = Client("127.0.0.1", srv.port, timeout=WAIT)
    good.put("x", torch.ones(4))
    base = srv.rss()
    header = msgpack.packb({"op": "hello", "id": 1, "versions": [1]})
    prefix = struct.pack("<2sBBIQ", b"TS", 1, 0, len(header), 1 << 30)
    socks = []
    for _ in range(200):
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT)
        s.sendall(prefix + header)  # claims a 1 GiB frame, and never says hello
        socks.append(s)
        if len(socks) % 50 == 0:
            assert torch.equal(good.get("x"), torch.ones(4))  # served throughout
            good.put("x", torch.ones(4))
    grown = srv.rss() - base
    assert grown < 50 * MiB, grown / MiB

    def closed(s: socket.socket) -> bool:
        s.settimeout(0.01)
        try:
            while True:
                data = s.recv(65536)
                if not data:
                    return True
        except (TimeoutError, BlockingIOError):
            return False
        except OSError:
            return True

    wait_until(lambda: all(closed(s) for s in socks), timeout=WAIT,
               what="every hostile connection to be closed")
    for s in socks:
        s.close()
    assert good.stats()["server"]["connections"] == 1
    good.close()


def test_block_slows_a_fast_producer_to_the_consumer_pace(served: Any) -> None:
    srv = served()
    producer = Client("127.0.0.1", srv.port, timeout=WAIT)
    consumer = Client("127.0.0.1", srv.port, timeout=WAIT)
    watcher = Client("127.0.0.1", srv.port, timeout=WAIT)
    producer.configure("jobs", max_items=4, overflow="block")
    sizes: list[int] = []
    watcher.listen("jobs", lambda e: sizes.append(e["n_items"]))
    errors: list[BaseException] = []
    done = threading.Event()

    def produce() -> None:
        try:
            for i in range(40):
                producer.append("jobs", i)  # waits on the server while the bin is full
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    t = threading.Thread(target=produce)
    t.start()
    got: list[int] = []
    while len(got) < 40:
        got.extend(consumer.get("jobs", max_items=1, timeout=WAIT))
        if len(got) % 10 == 0:
            # The producer is ahead: the bin is full and it waits, it does not fail.
            wait_until(lambda: producer.stats("jobs")["bins"].get("jobs", {}).get(
                "blocked", 0) == 1 or done.is_set(), timeout=WAIT, what="a blocked append")
    t.join(WAIT)
    assert not errors and got == list(range(40))
    assert max(sizes) <= 4
    for c in (producer, consumer, watcher):
        c.close()


def test_a_block_bin_that_stays_full_refuses_with_bin_full(served: Any) -> None:
    srv = served()
    # The server gives up after 0.8 of the client's timeout; the rest is the reply's margin
    # (0.4 s here, so that a busy CI machine's stall cannot turn BinFull into a timeout).
    c = Client("127.0.0.1", srv.port, timeout=2.0)
    c.configure("full", max_items=1, overflow="block")
    c.append("full", 1)
    with pytest.raises(BinFull, match="stayed full for 1.6 s"):  # its share of the timeout
        c.append("full", 2)
    assert c.get("full") == [1]
    c.close()
