"""The sharded client: rendezvous placement, routing, pipelines and fan-out over real servers,
and what one shard's failures do (a chaos proxy in front of each shard, a SIGKILLed shard)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tensorshare import Client, EmbeddedServer
from tensorshare.client.sharded import ShardedClient, bin_key, expand_servers, owner
from tensorshare.errors import BinNotFound, ConnectionLost, WaitTimeout
from tests.chaos import HOST, ChaosProxy, Faults, ServerProcess, chaos_seed

SERVERS = [f"tensorshare://shard-{i}.tensorshare:7000" for i in range(3)]  # names: no connect
TIMEOUT = 20.0


def test_a_tag_pins_bins_together_and_an_empty_tag_is_no_tag() -> None:
    assert bin_key("{run7}params") == bin_key("{run7}rollouts") == "run7"
    assert bin_key("{}x") == "{}x" and bin_key("plain") == "plain" and bin_key("{open") == "{open"
    assert owner("{run7}params", SERVERS) == owner("{run7}rollouts", SERVERS)


def test_adding_a_server_moves_about_one_bin_in_n_and_only_onto_it() -> None:
    names = [f"bin{i}" for i in range(4000)]
    before = [owner(n, SERVERS) for n in names]
    after = [owner(n, [*SERVERS, "tensorshare://shard-3.tensorshare:7000"]) for n in names]
    moved = [b for b, a in zip(before, after, strict=True) if b != a]
    assert 0.20 < len(moved) / len(names) < 0.30  # 1/4 expected
    assert all(a == 3 for b, a in zip(before, after, strict=True) if b != a)
    assert sorted(set(before)) == [0, 1, 2]


def test_servers_from_a_list_a_string_the_environment_or_one_name_with_many_addresses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert expand_servers("h1:7000, h2:7000") == ["tensorshare://h1:7000", "tensorshare://h2:7000"]
    assert expand_servers(["unix:///tmp/a.sock"]) == ["unix:///tmp/a.sock"]
    # A headless Service's name: every address it resolves to, sorted, so all clients agree.
    found = expand_servers("shards.default.svc:7000",
                           resolver=lambda host, port: ["10.0.0.9", "10.0.0.10", "fd00::1"])
    assert found == ["tensorshare://10.0.0.10:7000", "tensorshare://10.0.0.9:7000",
                     "tensorshare://[fd00::1]:7000"]
    assert expand_servers("tensorshare://127.0.0.1:7000") == ["tensorshare://127.0.0.1:7000"]
    with pytest.raises(ValueError, match="named twice"):
        expand_servers(["h:1", "tensorshare://h:1"])
    with pytest.raises(ValueError, match="at least one server"):
        expand_servers([])
    with pytest.raises(ValueError, match="unknown address scheme"):
        expand_servers(["http://h:1", "h:2"])
    monkeypatch.setenv("TENSORSHARE_SERVERS", "127.0.0.1:1,127.0.0.1:2")
    from tensorshare.client.sharded import servers_from_env

    assert servers_from_env() == ["127.0.0.1:1", "127.0.0.1:2"]


@pytest.fixture
def three() -> Iterator[list[EmbeddedServer]]:
    servers = [EmbeddedServer(port=0) for _ in range(3)]
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()


def _addresses(servers: list[EmbeddedServer]) -> list[str]:
    return [f"127.0.0.1:{s.port}" for s in servers]


def test_each_bin_lives_on_its_owner_and_list_and_stats_merge(
        three: list[EmbeddedServer]) -> None:
    with ShardedClient(_addresses(three), timeout=TIMEOUT) as c:
        for i in range(30):
            c.put(f"b{i}", torch.tensor([i]))
        assert c.list() == {f"b{i}": 1 for i in range(30)}
        per_server = [set(c._client(k).list()) for k in range(3)]
        for i in range(30):
            home = owner(f"b{i}", c.servers)
            assert [f"b{i}" in bins for bins in per_server] == [k == home for k in range(3)]
        assert all(per_server)  # 30 bins spread over all three
        assert torch.equal(c.get("b7"), torch.tensor([7]))
        stats = c.stats()
        assert list(stats["servers"]) == c.servers and len(stats["bins"]) == 29
        c.ping()
        with pytest.raises(BinNotFound):
            c.get("b7")


def test_a_pipeline_sends_each_server_its_share_and_keeps_the_order(
        three: list[EmbeddedServer]) -> None:
    with ShardedClient(_addresses(three), timeout=TIMEOUT) as c:
        with c.pipeline() as p:
            for i in range(60):
                p.append(f"q{i % 6}", torch.tensor([i]))
            p.list()
            for k in range(6):
                p.get(f"q{k}", max_items=100)
        results = p.results
        assert results[60] == {f"q{k}": 10 for k in range(6)}
        for k in range(6):
            assert [int(t) for t in results[61 + k]] == list(range(k, 60, 6))
        # An error in one share is that call's outcome; the others still ran.
        with c.pipeline(raise_on_error=False) as p:
            p.get("missing")
            p.put("ok", 1)
        assert isinstance(p.results[0], BinNotFound) and p.results[1] == 1


def test_begin_listen_and_stream_ops_go_to_the_bins_server(three: list[EmbeddedServer]) -> None:
    from tensorshare.data import StreamConsumer, StreamProducer

    with ShardedClient(_addresses(three), timeout=TIMEOUT) as c:
        calls = [c.begin.put(f"v{i}", i) for i in range(9)]
        assert [call.result() for call in calls] == [1] * 9
        assert c.begin_list().result() == {f"v{i}": 1 for i in range(9)}
        events: list[dict[str, object]] = []
        got = threading.Event()
        c.listen("watched", lambda ev: (events.append(ev), got.set()))
        c.put("watched", torch.zeros(2))
        assert got.wait(TIMEOUT) and events[0]["op"] == "put"
        with StreamProducer("s", client=c) as prod, \
                StreamConsumer("s", "job", client=c, timeout=TIMEOUT) as cons:
            prod.append(torch.ones(3))
            assert torch.equal(cons.read(1).items[0], torch.ones(3))
        home = c.client_for("s")
        assert home.stats("s")["bins"]["s"]["kind"] == "stream"


def test_through_a_chaos_proxy_per_shard_every_item_arrives_exactly_once(
        three: list[EmbeddedServer]) -> None:
    seed = chaos_seed()
    faults = Faults(cut_after_bytes=(2_000, 40_000), cut_after_seconds=(0.2, 1.5))
    proxies = [ChaosProxy((HOST, s.port), seed=seed + k, faults=faults)
               for k, s in enumerate(three)]
    try:
        addresses = [f"{HOST}:{p.port}" for p in proxies]
        bins = [f"q{k}" for k in range(6)]
        n_per_producer, producers = 300, 4
        errors: list[BaseException] = []

        def produce(pid: int) -> None:
            try:
                with ShardedClient(addresses, timeout=TIMEOUT) as c:
                    for i in range(n_per_producer):
                        c.append(bins[i % len(bins)], (pid, i))
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
        for t in threads:
            t.start()
        seen: list[tuple[int, int]] = []
        deadline = time.monotonic() + 90
        with ShardedClient(addresses, timeout=TIMEOUT) as c:
            while len(seen) < producers * n_per_producer and time.monotonic() < deadline:
                for b in bins:
                    try:
                        seen += [tuple(v) for v in c.get(b, max_items=50, timeout=0.05)]
                    except WaitTimeout:
                        pass
        for t in threads:
            t.join(30)
        assert not errors, f"seed {seed}: {errors[:3]}"
        want = {(p, i) for p in range(producers) for i in range(n_per_producer)}
        assert len(seen) == len(want) and set(seen) == want, f"seed {seed}"
        cuts = sum(p.stats()["cuts"] for p in proxies)
        assert cuts >= 3, f"seed {seed}: the proxies cut only {cuts} connections"
    finally:
        for p in proxies:
            p.close()


@pytest.mark.long
def test_a_shard_that_is_killed_fails_only_its_own_bins_and_serves_again_once_back() -> None:
    procs = [ServerProcess(0) for _ in range(3)]
    try:
        addresses = [f"{HOST}:{p.port}" for p in procs]
        with ShardedClient(addresses, timeout=3.0) as c:
            names = [f"w{i}" for i in range(24)]
            for n in names:
                c.put(n, torch.tensor([1.0]))
            dead = procs[0]
            dead.kill()
            lost = [n for n in names if owner(n, c.servers) == 0]
            kept = [n for n in names if owner(n, c.servers) != 0]
            assert lost and kept
            for n in kept:  # the other shards do not notice
                assert torch.equal(c.peek(n), torch.tensor([1.0]))
            with pytest.raises(ConnectionLost):
                c.peek(lost[0])
            dead.restart()  # same port, no data: that shard's bins are gone, typed
            for n in lost:
                with pytest.raises(BinNotFound):
                    c.peek(n)
            c.put(lost[0], torch.tensor([2.0]))
            assert torch.equal(c.peek(lost[0]), torch.tensor([2.0]))
    finally:
        for p in procs:
            p.close()


def test_rl_trainer_and_workers_spread_rollouts_over_every_server_and_drain_them_all(
        three: list[EmbeddedServer]) -> None:
    from tensorshare import RLTrainer, RLWorker

    hosts = ",".join(_addresses(three))
    trainer = RLTrainer(hosts, filter_version=False, timeout=TIMEOUT)
    workers = [RLWorker(hosts, timeout=TIMEOUT) for _ in range(2)]
    try:
        assert isinstance(trainer.client, ShardedClient) and len(trainer.data_bins) == 3
        assert sorted(owner(b, trainer.client.servers) for b in trainer.data_bins) == [0, 1, 2]
        trainer.publish_parameters({"w": torch.ones(2)})
        for w in workers:
            assert torch.equal(w.get_parameters()["w"], torch.ones(2))
            for i in range(6):
                w.add_data(torch.tensor([i]))
        # Every server holds some of the rollouts.
        assert all(sum(n for b, n in s.factory.store.list().items() if "#" in b) > 0
                   for s in three)
        got = trainer.get_data(return_versions=True, timeout=5, min_items=12)
        assert sorted(int(x) for x, _ in got) == sorted(list(range(6)) * 2)
        assert {v for _, v in got} == {trainer.version}
        assert trainer.get_data(timeout=0) == []
        assert trainer.get_data(timeout=0.2, min_items=1) == []  # waits, then nothing
    finally:
        for w in workers:
            w.close()
        trainer.close()


def test_the_callback_api_takes_several_servers(three: list[EmbeddedServer]) -> None:
    from tensorshare import TensorShare

    ts = TensorShare(",".join(_addresses(three)), 0, timeout=TIMEOUT)
    thread = threading.Thread(target=ts.start, daemon=True)
    thread.start()
    done = threading.Event()
    got: list[object] = []
    ts.put("{run}a", torch.ones(1), callback=lambda *a: ts.get("{run}a", callback=lambda r: (
        got.append(r), done.set())))
    assert done.wait(TIMEOUT)
    ts.stop()
    thread.join(TIMEOUT)
    assert got and not thread.is_alive()


def test_rebalance_moves_only_the_bins_whose_owner_changed_and_keeps_their_contents(
        three: list[EmbeddedServer]) -> None:
    first_two = _addresses(three[:2])
    with ShardedClient(first_two, timeout=TIMEOUT) as old:
        for i in range(40):
            old.put(f"v{i}", torch.tensor([i]))
        for i in range(3):
            old.append("{q}log", torch.tensor([i]), tag=i)
    with ShardedClient(_addresses(three), timeout=TIMEOUT) as new:
        moved = new.rebalance()
        assert moved and all(new.owner(n) == a == new.servers[2] for n, a in moved.items())
        assert 5 <= len(moved) <= 25  # about a third of 41
        for i in range(40):
            assert torch.equal(new.peek(f"v{i}"), torch.tensor([i]))
        res = new.fetch("{q}log", remove=False, max_items=None)
        assert [int(t) for t in res.value] == [0, 1, 2] and list(res.tags) == [0, 1, 2]
        assert new.rebalance() == {}  # nothing left to move
        for k in range(2):  # the old servers kept only what they still own
            assert all(new.owner(n) == new.servers[k] for n in new._client(k).list())


def test_the_rebalance_command_drains_a_shard_before_it_leaves(
        three: list[EmbeddedServer], capsys: pytest.CaptureFixture[str]) -> None:
    from tensorshare.cli.main import main

    with ShardedClient(_addresses(three), timeout=TIMEOUT) as old:
        for i in range(30):
            old.put(f"v{i}", torch.tensor([i]))
        leaving = [n for n in (f"v{i}" for i in range(30)) if old.owner(n) == old.servers[2]]
    assert leaving
    staying = ",".join(_addresses(three[:2]))
    assert main(["rebalance", "--servers", staying, "--drain",
                 _addresses(three[2:])[0]]) == 0
    out = capsys.readouterr().out
    assert f"moved {len(leaving)} bins" in out
    with ShardedClient(staying, timeout=TIMEOUT) as new:
        for i in range(30):
            assert torch.equal(new.peek(f"v{i}"), torch.tensor([i]))
    with Client("127.0.0.1", three[2].port) as gone:
        assert gone.list() == {}  # nothing left on the shard that leaves


@pytest.mark.long
def test_a_shard_killed_and_restarted_with_its_data_dir_loses_nothing_acknowledged(
        tmp_path: Path) -> None:
    procs = [ServerProcess(0, "--data-dir", str(tmp_path / f"shard{k}")) for k in range(3)]
    try:
        addresses = [f"{HOST}:{p.port}" for p in procs]
        acked: dict[str, list[int]] = {f"q{k}": [] for k in range(6)}
        with ShardedClient(addresses, timeout=10.0) as c:
            for i in range(60):
                c.put(f"v{i}", torch.tensor([i]))
            for i in range(120):
                name = f"q{i % 6}"
                c.append(name, i)
                acked[name].append(i)
            victim = owner("q0", c.servers)
            procs[victim].kill()
            procs[victim].restart()  # same port, same data directory
            for i in range(60):
                assert torch.equal(c.peek(f"v{i}"), torch.tensor([i]))
            for name, items in acked.items():
                res = c.fetch(name, remove=True, max_items=None)
                assert list(res.value) == items, name
    finally:
        for p in procs:
            p.close()
