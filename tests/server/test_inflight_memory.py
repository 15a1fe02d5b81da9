"""Frames still being received are bounded (issue "Safe on a shared network", the defect).

Tried as a new user would: 20 connections each say hello, then announce a put of a 900 MiB
tensor and send 2 MiB of it. Before, the server allocated every announced byte (18 GB of RSS,
with or without --max-memory). Now a large payload reserves its announced size against
--max-memory before anything is allocated (a frame that does not fit is refused with
MemoryLimitExceeded, and its connection survives), and its memory is taken as bytes arrive.
"""

from __future__ import annotations

import mmap
import socket
from collections.abc import Iterator

import pytest
import torch

from tensorshare import Client, MemoryLimitExceeded
from tensorshare.client.ops import make_item
from tensorshare.wire.frames import PREFIX
from tensorshare.wire.messages import Acked, ErrorReply, Hello, HelloReply, Limits, Ping, Put
from tensorshare.wire.protocol import PROTOCOL_VERSIONS
from tests.chaos import HOST, ServerProcess
from tests.conftest import wait_until
from tests.rawwire import WireClient

ANNOUNCED = 900 << 20
SENT = 2 << 20
ATTACKERS = 20
SLACK = 200 << 20  # the interpreter, Twisted, and what the attackers really sent


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class Attacker:
    """A connection that announces a 900 MiB put and sends only its first 2 MiB."""

    def __init__(self, port: int, big: memoryview) -> None:
        self.wire = WireClient()
        self.sock = socket.create_connection((HOST, port), timeout=10)
        self.sock.sendall(self.wire.frame(Hello(self.wire.next_id(), PROTOCOL_VERSIONS)))
        (reply,) = self._read(1)
        assert isinstance(reply, HelloReply)
        self.wire.set_limits(Limits(max_frame_bytes=1 << 40, max_header_bytes=1 << 20))
        item = make_item("big", torch.frombuffer(big, dtype=torch.uint8), None,
                         Limits(max_frame_bytes=1 << 40), None, 1 << 62)
        self.put_id = self.wire.next_id()
        chunks = self.wire.send(Put(self.put_id, "big", item))
        head = b"".join(bytes(c) for c in chunks[:-1])
        assert len(head) >= PREFIX and len(chunks[-1]) == ANNOUNCED
        self.sock.sendall(head)
        self.sock.sendall(memoryview(chunks[-1])[:SENT])

    def _read(self, n: int) -> list[object]:
        out: list[object] = []
        while len(out) < n:
            data = self.sock.recv(65536)
            assert data, "the server closed the connection"
            out.extend(self.wire.receive_data(data))
        return out

    def refused(self) -> bool:
        """Whether the server refused the put at once (it answers before the payload)."""
        self.sock.settimeout(0.5)
        try:
            (reply,) = self._read(1)
        except TimeoutError:
            return False
        finally:
            self.sock.settimeout(10)
        assert isinstance(reply, ErrorReply) and reply.id == self.put_id, reply
        assert reply.code == MemoryLimitExceeded.code and "max_memory" in reply.message
        return True


@pytest.fixture
def big() -> Iterator[memoryview]:
    """900 MiB of address space that is never touched (so the test costs no memory)."""
    mm = mmap.mmap(-1, ANNOUNCED)
    view = memoryview(mm)
    try:
        yield view
    finally:
        view.release()
        mm.close()


@pytest.mark.parametrize("max_memory", ["1G", None], ids=["--max-memory 1G", "default"])
def test_announced_frames_cost_what_was_sent_and_a_good_client_keeps_working(
        big: memoryview, max_memory: str | None) -> None:
    args = ("--max-memory", max_memory) if max_memory else ()
    with ServerProcess(0, *args) as server:
        assert server.proc is not None
        pid = server.proc.pid
        good = Client(HOST, server.port, timeout=10)
        try:
            limit = good.stats()["server"]["memory"]["max_memory"]
            assert limit is not None and (max_memory is None or limit == 1 << 30)
            base = _rss(pid)
            attackers = []
            for i in range(ATTACKERS):
                attackers.append(Attacker(server.port, big))
                good.put(f"ok{i}", torch.full((1000,), float(i)))  # keeps working throughout
                assert torch.equal(good.get(f"ok{i}"), torch.full((1000,), float(i)))
            accepted = [a for a in attackers if not a.refused()]
            # Each announced frame that fits the limit holds its reservation; the rest were
            # refused before anything was allocated, and their connections stay usable.
            assert len(accepted) == min(ATTACKERS, limit // ANNOUNCED)
            memory = good.stats()["server"]["memory"]
            assert memory["receiving"] == len(accepted) * ANNOUNCED
            assert memory["total"] <= limit
            rss = _rss(pid)
            assert rss < base + SLACK, f"RSS grew from {base >> 20} to {rss >> 20} MiB"
            refused = [a for a in attackers if a not in accepted]
            if refused:  # the refused frame is skipped as it streams past: the connection
                a = refused[0]  # (and its session) serve the next request
                a.sock.sendall(big[SENT:])
                a.sock.sendall(a.wire.frame(Ping(a.wire.next_id())))
                (reply,) = a._read(1)
                assert isinstance(reply, Acked), reply
            for a in attackers:
                a.sock.close()
            wait_until(lambda: good.stats()["server"]["memory"]["receiving"] == 0,
                       what="the reservations to be released")
            good.put("after", torch.zeros(1 << 20))  # 4 MiB: there is room again
        finally:
            good.close()


def test_a_frame_that_stops_arriving_is_closed_after_frame_timeout(big: memoryview) -> None:
    with ServerProcess(0, "--max-memory", "1G", "--frame-timeout", "0.5") as server:
        with Client(HOST, server.port, timeout=10) as good:
            a = Attacker(server.port, big)
            wait_until(lambda: good.stats()["server"]["memory"]["receiving"] == ANNOUNCED,
                       what="the reservation")
            wait_until(lambda: good.stats()["server"]["memory"]["receiving"] == 0,
                       what="the stalled frame's connection to be closed")
            assert good.stats()["server"]["counters"]["stalled_frames"] == 1
            a.sock.settimeout(5)
            data = a.sock.recv(65536)
            msgs = a.wire.receive_data(data) if data else []
            assert any(isinstance(m, ErrorReply) and "frame_timeout" in m.message
                       for m in msgs), msgs
            a.sock.close()
