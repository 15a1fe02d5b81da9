"""Relays on real servers (127.0.0.1, port 0): upstream versions, read-only with the
primary named, chains, restarts, and parameter fan-out that leaves the primary once per
relay (its stats count it)."""

from __future__ import annotations

import threading

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


@pytest.mark.timeout(120)
def test_fan_out_through_two_relays_leaves_the_primary_once_per_relay(
        server: EmbeddedServer) -> None:
    # 1 primary, 2 relays, 32 readers (16 per relay) waiting for each new version: every
    # reader sees every version in order, and each version crosses the primary's egress
    # once per relay, not once per reader.
    size = 256 * 1024  # floats: 1 MiB per version
    versions = 6
    relays = [Relay(f"127.0.0.1:{server.port}", ["params"], poll=0.2) for _ in range(2)]
    seen: list[list[int]] = [[] for _ in range(32)]
    stop = threading.Event()

    def read(i: int) -> None:
        with Client("127.0.0.1", relays[i % 2].port, timeout=DEADLINE) as c:
            last = 0
            while not stop.is_set():
                try:
                    got = c.fetch("params", remove=False, newer_than=last, timeout=0.5)
                except TimeoutError:
                    continue
                assert got.value.shape == (size,) and got.value[0].item() == got.version
                seen[i].append(got.version)
                last = got.version

    readers = [threading.Thread(target=read, args=(i,)) for i in range(32)]
    try:
        with Client("127.0.0.1", server.port) as primary:
            for t in readers:
                t.start()
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
