"""Replay bins on a real server (127.0.0.1, port 0) through the clients' replay ops and
:class:`tensorshare.rl.ReplayBuffer`: the sampler's distribution over the wire, the rate
limiter's waits and timeouts (and that a waiting request holds up nobody else), removers,
``max_times_sampled``, exactly once through cut connections, the sharded client, the stats."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tensorshare import Client, EmbeddedServer, InvalidRequest, WaitTimeout
from tensorshare.client.sharded import ShardedClient
from tensorshare.errors import BinNotFound, LimitExceeded
from tensorshare.rl import ReplayBuffer, Sample
from tensorshare.server import ServerConfig
from tests.chaos import ChaosProxy, Faults
from tests.conftest import wait_until
from tests.server.test_persist_kill import Server, free_port

DEADLINE = 10.0


@pytest.fixture
def client(server: EmbeddedServer) -> Iterator[Client]:
    with Client("127.0.0.1", server.port, timeout=DEADLINE) as c:
        yield c


def _chi_square(counts: Counter[int], expected: dict[int, float], n: int) -> float:
    return sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in expected.items())


# 99.9% quantile of chi-square with 9 degrees of freedom (10 items): a fixed seed makes the
# draw the same on every run, so this is no flake, and a wrong distribution is far above it.
CHI2_9_999 = 27.877


def _draw(c: Client, name: str, n: int, batch: int = 4000) -> Counter[int]:
    counts: Counter[int] = Counter()
    for _ in range(n // batch):
        counts.update(c.replay_sample(name, batch).keys.tolist())
    return counts


# -- the ops --------------------------------------------------------------------------------
def test_insert_sample_update_and_info_over_the_wire(client: Client) -> None:
    opened = client.replay_open("r", max_size=100, seed=7)
    assert (opened.created, opened.size, opened.config["seed"]) == (True, 0, 7)
    keys = client.replay_insert("r", [torch.full((3,), float(i)) for i in range(5)],
                                [1, 2, 3, 4, 5])
    assert keys == [1, 2, 3, 4, 5]
    s = client.replay_sample("r", 8)
    items, k, probs, size = s  # unpacks as the 4-tuple
    assert isinstance(s, Sample) and items.shape == (8, 3) and size == 5
    assert k.dtype == torch.int64 and probs.dtype == torch.float64
    for row, key, p in zip(items, k.tolist(), probs.tolist(), strict=True):
        assert row.tolist() == [float(key - 1)] * 3  # each item is its key's
        assert p == pytest.approx(key ** 0.6 / sum(i ** 0.6 for i in range(1, 6)))
    assert client.replay_update("r", [1, 2, 99], [10.0, 10.0, 1.0]) == 2
    info = client.replay_info("r")
    assert (info.size, info.stats["inserts"], info.stats["samples"]) == (5, 5, 8)
    assert info.total == pytest.approx(2 * 10 ** 0.6 + 3 ** 0.6 + 4 ** 0.6 + 5 ** 0.6)
    again = client.replay_open("r", max_size=100)  # seed None matches the bin's
    assert (again.created, again.size) == (False, 5)


def test_items_are_stacked_as_the_issue_says(client: Client) -> None:
    client.replay_open("d", max_size=10, sampler="fifo")
    client.replay_insert("d", [{"obs": torch.ones(2), "r": torch.tensor(1.0)}], [1.0])
    s = client.replay_sample("d", 3)
    assert set(s.items) == {"obs", "r"} and s.items["obs"].shape == (3, 2)
    assert s.items["r"].tolist() == [1.0] * 3 and s.probabilities.tolist() == [1.0] * 3
    client.replay_open("o", max_size=10, sampler="uniform", seed=1)
    client.replay_insert("o", [torch.ones(2), torch.ones(3)], [1.0, 1.0])
    mixed = client.replay_sample("o", 20)  # both shapes: not stacked, a list
    assert isinstance(mixed.items, list) and {t.shape[0] for t in mixed.items} == {2, 3}


def test_configuration_is_checked_and_names_are_of_one_kind(client: Client) -> None:
    client.replay_open("r", max_size=10, samples_per_insert=2.0, error_buffer=4.0)
    with pytest.raises(InvalidRequest, match="another configuration"):
        client.replay_open("r", max_size=11, samples_per_insert=2.0, error_buffer=4.0)
    with pytest.raises(InvalidRequest, match="sampler"):
        client.replay_open("bad", max_size=10, sampler="random")
    with pytest.raises(BinNotFound):
        client.replay_sample("nothing", 1)
    with pytest.raises(BinNotFound):
        client.replay_open("nothing", max_size=1, create=False)
    client.put("value", torch.ones(1))
    with pytest.raises(InvalidRequest, match="value or list bin"):
        client.replay_open("value", max_size=10)
    with pytest.raises(InvalidRequest):
        client.put("r", torch.ones(1))
    with pytest.raises(InvalidRequest, match="rate limiter"):  # more than half the window
        client.replay_insert("r", [torch.ones(1)] * 5, [1.0] * 5)
    with pytest.raises(ValueError):
        client.replay_insert("r", [torch.ones(1)], [float("nan")])
    assert client.replay_info("r").size == 0  # nothing of the refused ones went in


# -- the sampler's distribution -------------------------------------------------------------
def test_prioritized_samples_match_p_alpha_over_the_sum(client: Client) -> None:
    priorities = [0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 20.0]
    client.replay_open("p", max_size=100, priority_exponent=0.6, seed=1234)
    keys = client.replay_insert("p", [torch.tensor(float(i)) for i in range(10)], priorities)
    weights = [p ** 0.6 for p in priorities]
    expected = {k: w / sum(weights) for k, w in zip(keys, weights, strict=True)}
    n = 200_000
    counts = _draw(client, "p", n)
    assert sum(counts.values()) == n
    assert _chi_square(counts, expected, n) < CHI2_9_999
    # A priority update changes the next samples: key 1 now weighs as much as all others.
    client.replay_update("p", [keys[0]], [sum(weights) ** (1 / 0.6)])
    after = _draw(client, "p", 40_000)
    assert after[keys[0]] / 40_000 == pytest.approx(0.5, abs=0.02)


def test_uniform_samples_are_uniform(client: Client) -> None:
    client.replay_open("u", max_size=100, sampler="uniform", seed=99)
    keys = client.replay_insert("u", [torch.tensor(float(i)) for i in range(10)],
                                [float(i) for i in range(10)])  # priorities do not matter
    n = 200_000
    counts = _draw(client, "u", n)
    assert _chi_square(counts, {k: 0.1 for k in keys}, n) < CHI2_9_999


def test_a_seed_makes_the_samples_reproducible(server: EmbeddedServer) -> None:
    drawn = []
    for name in ("s1", "s2"):
        with ReplayBuffer(name, "127.0.0.1", server.port, max_size=50, seed=5) as buf:
            buf.insert_many([torch.tensor(float(i)) for i in range(20)],
                            torch.arange(1.0, 21.0))
            drawn.append(buf.sample(64).keys.tolist())
    assert drawn[0] == drawn[1]


# -- removal --------------------------------------------------------------------------------
@pytest.mark.parametrize("remover, kept", [
    ("fifo", {3, 4, 5}), ("lifo", {1, 2, 3}), ("min_priority", {2, 4, 5})])
def test_max_size_keeps_what_the_remover_says(client: Client, remover: str,
                                              kept: set[int]) -> None:
    client.replay_open("m", max_size=3, remover=remover, sampler="uniform", seed=3)
    client.replay_insert("m", [torch.tensor(float(i)) for i in range(5)],
                         [1.0, 5.0, 0.5, 6.0, 7.0])
    info = client.replay_info("m")
    assert info.size == 3 and info.stats["evicted"] == 2
    assert set(client.replay_sample("m", 300).keys.tolist()) == kept


def test_max_times_sampled_1_gives_each_item_to_exactly_one_sample(client: Client) -> None:
    client.replay_open("q", max_size=100, max_times_sampled=1, seed=11)
    client.replay_insert("q", [torch.tensor(float(i)) for i in range(50)],
                         [float(1 + i % 7) for i in range(50)])
    seen: list[int] = []
    for _ in range(10):
        s = client.replay_sample("q", 5, timeout=0)
        assert s.items.tolist() == [float(k - 1) for k in s.keys.tolist()]
        seen += s.keys.tolist()
    assert sorted(seen) == list(range(1, 51))
    with pytest.raises(WaitTimeout):
        client.replay_sample("q", 1, timeout=0)
    assert client.replay_info("q").stats["expired"] == 50


# -- the rate limiter -----------------------------------------------------------------------
def _spi_bin(c: Client, name: str) -> None:
    c.replay_open(name, max_size=10_000, samples_per_insert=4.0, min_size_to_sample=2,
                  error_buffer=8.0, sampler="uniform", seed=2)


def _diff(c: Client, name: str) -> float:
    return c.replay_info(name).stats["limiter"]["diff"]


@pytest.mark.parametrize("slow", ["inserter", "sampler"])
def test_the_ratio_stays_within_the_error_buffer(server: EmbeddedServer, slow: str) -> None:
    # samples_per_insert=4, min_size_to_sample=2, error_buffer=8: the diff (inserts * 4 -
    # samples) stays in [0, 16]; each side waits for the other and goes on.
    with Client("127.0.0.1", server.port, timeout=DEADLINE) as a, \
            Client("127.0.0.1", server.port, timeout=DEADLINE) as b:
        _spi_bin(a, "lim")
        diffs: list[float] = []
        n_inserts = 30

        def insert() -> None:
            for i in range(n_inserts):
                a.replay_insert("lim", [torch.tensor(float(i))], [1.0], timeout=DEADLINE)
                if slow == "inserter":
                    time.sleep(0.005)

        def sample() -> None:
            for _ in range(n_inserts * 4 // 2 - 4):
                b.replay_sample("lim", 2, timeout=DEADLINE)
                diffs.append(_diff(b, "lim"))
                if slow == "sampler":
                    time.sleep(0.005)

        threads = [threading.Thread(target=insert), threading.Thread(target=sample)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(3 * DEADLINE)
        assert not any(t.is_alive() for t in threads)
        info = a.replay_info("lim").stats
        assert info["inserts"] == n_inserts and info["samples"] == n_inserts * 4 - 8
        assert all(0 <= d <= 16 for d in diffs), diffs


def test_a_held_insert_times_out_and_a_held_sample_resumes(client: Client) -> None:
    _spi_bin(client, "lim")
    for _ in range(2):  # (2 at most per insert: half the window over samples_per_insert)
        client.replay_insert("lim", [torch.tensor(0.0)] * 2, [1.0] * 2)  # diff 16: the top
    t0 = time.monotonic()
    with pytest.raises(WaitTimeout, match="nothing was inserted"):
        client.replay_insert("lim", [torch.tensor(1.0)], [1.0], timeout=0.2)
    assert time.monotonic() - t0 >= 0.2
    assert client.replay_info("lim").size == 4
    for _ in range(8):
        client.replay_sample("lim", 2, timeout=0)  # diff 16 -> 0
    with pytest.raises(WaitTimeout, match="nothing was drawn"):
        client.replay_sample("lim", 1, timeout=0.1)
    result: list[Sample] = []
    t = threading.Thread(target=lambda: result.append(
        client.replay_sample("lim", 1, timeout=DEADLINE)))
    t.start()
    wait_until(lambda: client.replay_info("lim").stats["waiting_samples"] == 1, DEADLINE,
               "the sample to wait")
    client.replay_insert("lim", [torch.tensor(2.0)], [1.0])
    t.join(DEADLINE)
    assert len(result) == 1 and result[0].size == 5


def test_a_waiting_sample_blocks_no_other_bin(server: EmbeddedServer) -> None:
    with Client("127.0.0.1", server.port, timeout=DEADLINE) as waiter, \
            Client("127.0.0.1", server.port, timeout=DEADLINE) as other:
        waiter.replay_open("empty", max_size=10)
        other.replay_open("busy", max_size=100)
        got: list[Sample] = []
        t = threading.Thread(target=lambda: got.append(
            waiter.replay_sample("empty", 1, timeout=DEADLINE)))
        t.start()
        wait_until(lambda: other.replay_info("empty").stats["waiting_samples"] == 1,
                   DEADLINE, "the sample to wait")
        for i in range(20):  # all answered while the sample waits
            other.put("v", torch.tensor(float(i)))
            other.replay_insert("busy", [torch.tensor(float(i))], [1.0])
            assert other.replay_sample("busy", 2).size == i + 1
            assert other.get("v").item() == float(i)
        assert t.is_alive() and not got
        assert other.stats("empty")["bins"]["empty"]["waiters"] == 1
        other.replay_insert("empty", [torch.tensor(7.0)], [1.0])
        t.join(DEADLINE)
        assert got[0].items.tolist() == [7.0]


def test_a_sample_whose_reply_could_be_too_large_is_refused() -> None:
    with EmbeddedServer(port=0) as srv, \
            Client("127.0.0.1", srv.port, timeout=DEADLINE) as c:
        srv.factory.max_reply_bytes = 1 << 20  # (a frame's limit less its header's room)
        c.replay_open("big", max_size=10)
        c.replay_insert("big", [torch.zeros(40_000)], [1.0])  # 160 KB
        c.replay_sample("big", 6)
        with pytest.raises(LimitExceeded, match="sample fewer"):
            c.replay_sample("big", 7)


# -- exactly once, sharding, the buffer -----------------------------------------------------
def test_inserts_and_updates_through_cut_connections_happen_exactly_once() -> None:
    with EmbeddedServer(port=0, config=ServerConfig(session_ttl=60.0)) as srv, \
            ChaosProxy(("127.0.0.1", srv.port), faults=Faults(
                cut_after_bytes=(2_000, 40_000), reset_probability=0.5),
                first=(Faults(cut_after_bytes=(2_000, 10_000), reset_probability=0.5),)
            ) as proxy:
        port = proxy.open_port()
        n = 200
        with Client("127.0.0.1", port, timeout=30.0) as c:
            c.replay_open("x", max_size=10_000, sampler="fifo", max_times_sampled=1)
            keys = []
            for i in range(n):
                keys += c.replay_insert("x", [torch.full((64,), float(i))], [1.0])
            for k in keys:
                c.replay_update("x", [k], [float(k)])
        assert proxy.stats(port)["accepted"] > 1, "the proxy cut nothing: the test proved nothing"
        with Client("127.0.0.1", srv.port) as c:
            info = c.replay_info("x")
            assert (info.size, info.stats["inserts"]) == (n, n)
            assert keys == list(range(1, n + 1))
            s = c.replay_sample("x", n)
            assert s.items[:, 0].tolist() == [float(i) for i in range(n)]  # each once
            hist = info.stats["priority_histogram"]["counts"]
            assert sum(hist) == n and info.total == n  # fifo: the total is the size


def test_a_sharded_bin_samples_shards_by_total_priority() -> None:
    with EmbeddedServer(port=0) as s1, EmbeddedServer(port=0) as s2:
        servers = f"127.0.0.1:{s1.port},127.0.0.1:{s2.port}"
        with ReplayBuffer("sh", servers, max_size=1000, priority_exponent=1.0, seed=4) as buf:
            assert isinstance(buf.client, ShardedClient)
            first = buf.insert_many([torch.tensor(1.0)] * 10, [3.0] * 10)  # shard 0: 30
            second = buf.insert_many([torch.tensor(2.0)] * 10, [1.0] * 10)  # shard 1: 10
            assert {k % 2 for k in first} == {0} and {k % 2 for k in second} == {1}
            assert len(buf) == 20
            n = 0
            on_first = 0.0
            for _ in range(20):
                s = buf.sample(500)
                on_first += float((s.items == 1.0).sum())
                n += 500
                assert s.size == 20
                assert s.probabilities.tolist() == pytest.approx(
                    [0.075 if v == 1.0 else 0.025 for v in s.items.tolist()])
            assert on_first / n == pytest.approx(0.75, abs=0.02)
            assert buf.update_priorities(first[:2] + second[:1], [0.0, 0.0, 0.0]) == 3
            assert buf.stats()["total_weight"] == pytest.approx(24.0 + 9.0)


def test_replay_buffer_api(server: EmbeddedServer) -> None:
    with ReplayBuffer("rl/replay", f"127.0.0.1:{server.port}", max_size=100,
                      sampler="prioritized", priority_exponent=0.6, remover="fifo",
                      max_times_sampled=None, samples_per_insert=None,
                      min_size_to_sample=2, error_buffer=None, seed=1, timeout=5.0) as buf:
        with pytest.raises(WaitTimeout):
            buf.sample(4, timeout=0.1)  # below min_size_to_sample
        assert buf.insert({"x": torch.ones(2)}, 1.0) == 1
        assert buf.insert_many([{"x": torch.zeros(2)}] * 3, torch.tensor([1.0, 2.0, 3.0])) \
            == [2, 3, 4]
        batch = buf.sample(16, timeout=1.0)
        assert batch.items["x"].shape == (16, 2) and len(buf) == 4
        assert buf.update_priorities(batch.keys, torch.ones(16)) == 16
        stats = buf.stats()
        assert stats["size"] == 4 and stats["inserts"] == 4 and stats["samples"] == 16
        assert "limiter" in stats and "priority_histogram" in stats


# -- the data log and snapshots -------------------------------------------------------------
@pytest.mark.parametrize("snapshots", ["log only", "snapshots too"])
def test_kill_9_with_a_data_dir_keeps_every_insert_once_and_the_counters(
        tmp_path: Path, snapshots: str) -> None:
    # An actor inserts through one elastic client while the server is killed (SIGKILL) and
    # started again on its data directory: every insert is there exactly once (resent ones
    # answered from the remembered replies), and the items, priorities, counters and
    # limiter counters a restart finds are those the server had.
    args = ("--fsync", "always", "--quiet")
    if snapshots == "snapshots too":
        args += ("--snapshot-log-bytes", "8K")  # several snapshots during the run
    server = Server(tmp_path / "data", free_port(), *args)
    server.start()
    n = 150
    errors: list[BaseException] = []
    done = threading.Event()
    acked: list[int] = []

    def actor() -> None:
        try:
            with Client("127.0.0.1", server.port, timeout=60.0) as c:
                for i in range(n):
                    c.replay_insert("kept", [{"x": torch.full((16,), float(i))}],
                                    [float(1 + i % 5)])
                    acked.append(i)
                    if i % 3 == 0:
                        c.replay_update("kept", [i + 1], [float(10 + i % 7)])
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    try:
        with Client("127.0.0.1", server.port, timeout=DEADLINE) as c:
            c.replay_open("kept", max_size=1000, sampler="fifo", max_times_sampled=1,
                          samples_per_insert=1.0, error_buffer=1000.0, seed=21)
        t = threading.Thread(target=actor)
        t.start()
        for k in (1, 2):  # (some inserts acknowledged before each kill: the session is in
            # the log; a kill before its first write was logged loses the session, and the
            # client is told: SessionLost)
            wait_until(lambda k=k: len(acked) >= 20 * k, 60.0, "inserts to be acknowledged")
            server.kill()
            server.start()
        t.join(120)
        assert done.is_set() and not errors, (errors, server.stderr)
        with Client("127.0.0.1", server.port, timeout=DEADLINE) as c:
            before = c.replay_info("kept").stats
        server.kill()
        server.start()
        with Client("127.0.0.1", server.port, timeout=DEADLINE) as c:
            after = c.replay_info("kept").stats
            for key in ("size", "inserts", "samples", "evicted", "priority_histogram",
                        "total_weight", "draws_left", "seed", "limiter"):
                assert after[key] == before[key], key
            assert (after["size"], after["inserts"]) == (n, n)
            s = c.replay_sample("kept", n)  # fifo, once each: every insert, in order
            assert [float(v[0]) for v in s.items["x"]] == [float(i) for i in range(n)]
    finally:
        server.stop()


def test_a_restarted_server_draws_what_the_first_would_have(tmp_path: Path) -> None:
    """The random state is in the log and the snapshots: two servers, one killed and started
    again, the other not, give the same samples afterwards."""
    drawn = []
    for kill in (False, True):
        server = Server(tmp_path / f"data-{kill}", free_port(), "--fsync", "always", "--quiet",
                        "--snapshot-log-bytes", "2K")
        server.start()
        try:
            with Client("127.0.0.1", server.port, timeout=DEADLINE) as c:
                c.replay_open("same", max_size=30, seed=5)
                for i in range(40):
                    c.replay_insert("same", [torch.tensor(float(i))], [float(1 + i % 4)])
                    c.replay_sample("same", 3)
            if kill:
                server.kill()
                server.proc = None
                server.start()
            with Client("127.0.0.1", server.port, timeout=DEADLINE) as c:
                drawn.append([c.replay_sample("same", 16).keys.tolist() for _ in range(3)])
        finally:
            server.stop()
    assert drawn[0] == drawn[1]


def test_an_rl_worker_inserts_into_a_replay_bin_beside_its_rollouts(
        server: EmbeddedServer) -> None:
    from tensorshare.rl import RLWorker

    with RLWorker("127.0.0.1", server.port, timeout=DEADLINE) as worker:
        buf = worker.replay_buffer("rl/replay", max_size=10, sampler="fifo")
        assert buf.insert_many([torch.ones(3)] * 2, [1.0, 1.0]) == [1, 2]
        worker.add_data(torch.zeros(1))
        buf.close()  # (the worker's connection: left open)
        assert len(buf) == 2
    with ReplayBuffer("rl/replay", "127.0.0.1", server.port, max_size=10,
                      sampler="fifo") as learner:
        assert learner.sample(2).items.tolist() == [[1.0] * 3] * 2


def test_a_sharded_clients_replay_ops_are_refused_in_a_pipeline() -> None:
    with EmbeddedServer(port=0) as s1, EmbeddedServer(port=0) as s2, \
            ShardedClient([f"127.0.0.1:{s1.port}", f"127.0.0.1:{s2.port}"]) as c:
        c.replay_open("p", max_size=10)
        with pytest.raises(ValueError, match="not in a pipeline"):
            c.begin.replay_insert("p", [torch.ones(1)], [1.0])
        assert c.replay_info("p").size == 0
