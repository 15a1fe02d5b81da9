"""Relays on real servers (127.0.0.1, port 0, or Unix sockets): upstream versions (to waiting
readers and to listeners), read-only with the primary named, chains, restarts, and
parameter fan-out that leaves the primary once per relay (its stats count it)."""

from __future__ import annotations

import queue
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorshare import Client, EmbeddedServer, PermissionDenied, RLTrainer, RLWorker
from tensorshare.relay import Relay
from tests.conftest import wait_until

DEADLINE = 20.0


def _relay_has(relay: Relay, name: str, version: int) -> bool:
    return relay.versions.get(name, 0) >= version


@pytest.mark.timeout(60)
def test_a_relay_serves_the_primarys_versions_read_only(server: EmbeddedServer) -> None:
    with Client("127.0.0.1", server.port) as primary:
        primary.put("params", torch.zeros(4))
        primary.put("params", torch.ones(4))  # version 2 upstream
        primary.put("other", 1)
        with Relay(f"127.0.0.1:{server.port}", ["params*"], poll=0.2) as relay:
            assert relay.wait_synced(DEADLINE)
            with Client("127.0.0.1", relay.port) as reader:
                assert reader.list() == {"params": 1}  # only the bins of its globs
                got = reader.fetch("params", remove=False)
                assert got.version == 2 and got.value.tolist() == [1.0] * 4
                assert reader.server_id == primary.server_id
                # A new version arrives by notification, with the upstream's number.
                v = primary.put("params", torch.full((4,), 3.0))
                got = reader.fetch("params", remove=False, newer_than=2, timeout=DEADLINE)
                assert got.version == v and got.value.tolist() == [3.0] * 4
                for write in (lambda: reader.put("params", 1), lambda: reader.get("params"),
                              lambda: reader.append("x", 1), lambda: reader.delete("params")):
                    with pytest.raises(PermissionDenied, match=f"127.0.0.1:{server.port}"):
                        write()
                # A bin created upstream later is found by the next listing.
                primary.put("params/head", torch.zeros(2))
                got = reader.fetch("params/head", remove=False, timeout=DEADLINE)
                assert got.value.tolist() == [0.0, 0.0]


def _next_event(events: queue.SimpleQueue[dict[str, Any]], name: str) -> dict[str, Any]:
    """The next event of bin ``name`` (others are skipped); fails after DEADLINE."""
    deadline = time.monotonic() + DEADLINE
    while True:
        try:
            ev = events.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            raise AssertionError(f"no event of bin {name!r} within {DEADLINE} s") from None
        if ev.get("bin") == name:
            return ev


@pytest.mark.timeout(60)
def test_listen_through_a_relay_gets_each_upstream_version(server: EmbeddedServer) -> None:
    # A listener on a relay hears of each version the primary makes, with the primary's
    # number, once the relay serves it (a read right after the event gets that version);
    # also for a bin that appears upstream after the listener was registered.
    with Client("127.0.0.1", server.port) as primary:
        for _ in range(3):
            primary.put("params", torch.zeros(2))  # upstream: version 3 before the relay
        with Relay(f"127.0.0.1:{server.port}", ["params*"], poll=0.2) as relay:
            assert relay.wait_synced(DEADLINE)
            events: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
            with Client("127.0.0.1", relay.port, timeout=DEADLINE) as reader:
                reader.listen("params", events.put)
                reader.listen("params/late", events.put)  # not on the relay, nor upstream
                assert reader.fetch("params", remove=False).version == 3
                made, heard = [], []
                for n in range(4, 9):  # each version waited for before the next is made
                    made.append(primary.put("params", torch.full((2,), float(n))))
                    ev = _next_event(events, "params")
                    heard.append(ev["version"])
                    assert ev["op"] == "put" and ev["n_items"] == 1, ev
                    got = reader.fetch("params", remove=False)
                    assert got.version == ev["version"] and got.value.tolist() == [n, n]
                assert heard == made == [4, 5, 6, 7, 8]
                # A new bin upstream, found by the relay's next listing: the listener hears
                # the upstream's versions (the relay copies the latest it finds, so the
                # first one it hears of may already be the second).
                late = [primary.put("params/late", torch.tensor([k])) for k in (1, 2)]
                seen = [_next_event(events, "params/late")["version"]]
                while seen[-1] < late[-1]:
                    seen.append(_next_event(events, "params/late")["version"])
                assert late == [1, 2] and seen in ([1, 2], [2]), seen
                assert reader.peek("params/late").tolist() == [2]


@pytest.mark.timeout(60)
def test_a_relay_on_unix_sockets_serves_a_reader_on_its_socket(tmp_path: Path) -> None:
    # The relay of a primary reached over unix:// serves, on a Unix socket of its own only,
    # a reader of that socket: the primary's versions and id, large values intact, listen
    # events, and writes refused.
    primary_sock, relay_sock = str(tmp_path / "primary.sock"), str(tmp_path / "relay.sock")
    big = torch.randn(512 * 1024)  # 2 MiB
    with EmbeddedServer(port=0, unix=primary_sock) as srv, \
            Client(f"unix://{primary_sock}", timeout=DEADLINE) as primary:
        assert srv.running
        primary.put("params", big)
        with Relay(f"unix://{primary_sock}", ["params"], port=None, unix=relay_sock,
                   poll=0.2) as relay:
            assert relay.address == f"unix://{relay_sock}"
            assert relay.wait_synced(DEADLINE)
            with Client(f"unix://{relay_sock}", timeout=DEADLINE) as reader:
                got = reader.fetch("params", remove=False)
                assert got.version == 1 and torch.equal(got.value, big)
                assert reader.server_id == primary.server_id
                events: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
                reader.listen("params", events.put)
                v = primary.put("params", big * 2)
                assert _next_event(events, "params")["version"] == v == 2
                got = reader.fetch("params", remove=False, newer_than=1, timeout=DEADLINE)
                assert got.version == v and torch.equal(got.value, big * 2)
                with pytest.raises(PermissionDenied, match=re.escape(primary_sock)):
                    reader.put("params", 1)
            assert relay.downloads == 2


@pytest.mark.timeout(60)
def test_relays_chain_and_a_restarted_relay_resyncs(server: EmbeddedServer) -> None:
    with Client("127.0.0.1", server.port) as primary:
        primary.put("params", torch.zeros(2))
        with Relay(f"127.0.0.1:{server.port}", poll=0.2) as first:
            second = Relay(f"tensorshare://127.0.0.1:{first.port}", poll=0.2)
            try:
                with Client("127.0.0.1", second.port) as reader:
                    got = reader.fetch("params", remove=False, timeout=DEADLINE)
                    assert got.version == 1
                    v = primary.put("params", torch.ones(2))
                    got = reader.fetch("params", remove=False, newer_than=1, timeout=DEADLINE)
                    assert got.version == v == 2  # the primary's number, two hops down
            finally:
                second.stop()
            v = primary.put("params", torch.full((2,), 5.0))  # while the second is down
            again = Relay(f"127.0.0.1:{first.port}", poll=0.2)
            try:
                assert again.wait_synced(DEADLINE)
                with Client("127.0.0.1", again.port) as reader:
                    got = reader.fetch("params", remove=False, newer_than=v - 1,
                                       timeout=DEADLINE)
                    assert got.version == v and got.value.tolist() == [5.0, 5.0]
            finally:
                again.stop()


def _read_each_version(port: int, listening: bool, seen: list[int], size: int,
                       stop: threading.Event, registered: threading.Semaphore) -> None:
    """A reader of the relay on ``port`` until ``stop``: each version of "params" it gets
    (a tensor of ``size`` floats, all equal to the version) goes to ``seen``. It waits with
    ``fetch(newer_than=...)``, or ``listening``, reads each version a listen event names."""
    events: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
    with Client("127.0.0.1", port, timeout=DEADLINE) as c:
        if listening:
            c.listen("params", events.put)
        registered.release()
        last = 0
        while not stop.is_set():
            try:
                if listening:
                    ev = events.get(timeout=0.5)
                    got = c.fetch("params", remove=False)
                    assert got.version == ev["version"], (got.version, ev)
                else:
                    got = c.fetch("params", remove=False, newer_than=last, timeout=0.5)
            except (TimeoutError, queue.Empty):
                continue
            assert got.value.shape == (size,) and got.value[0].item() == got.version
            seen.append(got.version)
            last = got.version


@pytest.mark.timeout(120)
def test_fan_out_through_two_relays_leaves_the_primary_once_per_relay(
        server: EmbeddedServer) -> None:
    # 1 primary, 2 relays, 32 readers (16 per relay; half of them listening and reading
    # each version they hear of, half waiting with newer_than): every reader sees every
    # version in order, and each version crosses the primary's egress once per relay, not
    # once per reader.
    size = 256 * 1024  # floats: 1 MiB per version
    versions = 6
    relays = [Relay(f"127.0.0.1:{server.port}", ["params"], poll=0.2) for _ in range(2)]
    seen: list[list[int]] = [[] for _ in range(32)]
    stop = threading.Event()
    registered = threading.Semaphore(0)

    def read(i: int) -> None:
        _read_each_version(relays[i % 2].port, (i // 2) % 2 == 1, seen[i], size, stop,
                           registered)

    readers = [threading.Thread(target=read, args=(i,)) for i in range(32)]
    try:
        with Client("127.0.0.1", server.port) as primary:
            for t in readers:
                t.start()
            for _ in readers:  # every listener hears of version 1
                assert registered.acquire(timeout=DEADLINE)
            for n in range(1, versions + 1):
                v = primary.put("params", torch.full((size,), float(n)))
                assert v == n
                wait_until(lambda v=v: all(s and s[-1] == v for s in seen), DEADLINE,
                           f"every reader has version {v}")
            egress = primary.stats("params")["bins"]["params"]["bytes_out"]
    finally:
        stop.set()
        for t in readers:
            t.join(DEADLINE)
        for r in relays:
            r.stop()
    assert all(s == list(range(1, versions + 1)) for s in seen), seen
    per_version = size * 4
    # Each relay downloaded each version once (a reader straight from the primary would
    # have made 32 downloads of each).
    assert 2 * versions * per_version <= egress < 3 * versions * per_version, egress
    assert [r.downloads for r in relays] == [versions, versions]


@pytest.mark.timeout(90)
def test_rl_workers_read_parameters_through_a_relay(server: EmbeddedServer) -> None:
    trainer = RLTrainer("127.0.0.1", server.port)
    try:
        net = torch.nn.Linear(3, 2)
        v1 = trainer.publish_parameters(net.state_dict())
        with Relay(f"127.0.0.1:{server.port}", ["rl/parameters"], poll=0.2) as relay:
            assert relay.wait_synced(DEADLINE)
            worker = RLWorker("127.0.0.1", server.port, params_via=relay.address)
            try:
                params = worker.get_parameters()
                assert worker.version == v1 and set(params) == {"weight", "bias"}
                v2 = trainer.publish_parameters(net.state_dict())
                worker.await_new_parameters(timeout=DEADLINE)
                assert worker.version == v2
                worker.add_data(torch.zeros(3))  # rollouts go to the primary
                got = trainer.get_data(return_versions=True, timeout=DEADLINE)
                assert [v for _, v in got] == [v2]
                # The relay served the parameters: the primary sent them once per version.
                assert relay.downloads == 2
            finally:
                worker.stop()
    finally:
        trainer.stop()


@pytest.mark.timeout(60)
def test_the_relay_command(server: EmbeddedServer) -> None:
    import subprocess
    import sys

    with Client("127.0.0.1", server.port) as primary:
        primary.put("params", torch.arange(3.0))
        proc = subprocess.Popen(
            [sys.executable, "-m", "tensorshare", "relay", "--upstream",
             f"127.0.0.1:{server.port}", "--bins", "params*", "--port", "0", "--quiet"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline()
            assert "listening on 127.0.0.1:" in first, first + proc.stderr.read()
            port = int(first.rsplit(":", 1)[1])
            with Client("127.0.0.1", port) as reader:
                got = reader.fetch("params", remove=False, timeout=DEADLINE)
                assert got.version == 1 and got.value.tolist() == [0.0, 1.0, 2.0]
                with pytest.raises(PermissionDenied, match="relay"):
                    reader.put("params", 0)
        finally:
            proc.terminate()
            assert proc.wait(DEADLINE) == 0
