"""A client shared across a fork, and a session taken over by another connection.

A DataLoader worker inherits its parent's objects: a ``Client`` among them must open the
child's own connection (with its own session) instead of reading and writing the parent's
socket. And when two live connections do use one session id, the server tells the one it
takes the session from (``session_taken_over``), which stops instead of taking it back.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch

from tensorshare import Client, ConnectionLost, EmbeddedServer
from tensorshare.errors import SessionTakenOver
from tensorshare.wire.messages import Hello, HelloReply
from tensorshare.wire.protocol import PROTOCOL_VERSIONS
from tests.conftest import wait_until
from tests.rawwire import WireClient


def _wait_children(pids: list[int], timeout: float) -> dict[int, int]:
    """Exit codes of the children, waited for with a deadline (killed after it)."""
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            for pid in pids:
                if pid not in codes:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    codes[pid] = -9
            break
        threading.Event().wait(0.01)  # poll the children, with the deadline above
    return codes


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork() of a threaded process
def test_forked_children_use_their_own_connection(server: EmbeddedServer) -> None:
    with Client("127.0.0.1", server.port, timeout=5) as c:
        c.put("w", torch.arange(4))
        pids = []
        for i in range(2):
            pid = os.fork()
            if pid == 0:  # the child: the inherited client must just work
                try:
                    ok = torch.equal(c.peek("w"), torch.arange(4))
                    c.append("from-children", i)
                    c.close()
                    os._exit(0 if ok else 1)
                except BaseException:
                    os._exit(2)
            pids.append(pid)
        codes = _wait_children(pids, timeout=15)
        assert list(codes.values()) == [0, 0], codes
        # The parent's connection and session were left alone.
        assert torch.equal(c.peek("w"), torch.arange(4))
        assert sorted(c.get("from-children")) == [0, 1]
        stats = c.stats()["server"]
        assert stats["counters"].get("sessions_taken_over", 0) == 0


def test_a_session_taken_over_stops_the_client_with_a_typed_error(
        server: EmbeddedServer) -> None:
    c = Client("127.0.0.1", server.port, timeout=5)
    try:
        c.put("w", 1)
        sid = c._conn._session.session_id
        assert sid is not None
        # Another process (here: a raw connection) resumes the same session.
        wire = WireClient()
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(wire.frame(Hello(wire.next_id(), PROTOCOL_VERSIONS, "other", None,
                                          sid, True)))
            reply = []
            while not reply:
                reply = wire.receive_data(sock.recv(65536))
            assert isinstance(reply[0], HelloReply) and reply[0].resumed
            wait_until(lambda: c.closed, what="the first client to stop")
            with pytest.raises(SessionTakenOver, match="taken over"):
                c.peek("w")
            assert isinstance(SessionTakenOver("x"), ConnectionLost)
            # It stopped: it did not reconnect and take the session back.
            stats = server.call(lambda: dict(server.factory.stats.counters))
            assert stats["sessions_taken_over"] == 1
    finally:
        c.close()
