"""The sharded client: rendezvous placement, routing (reads of relayed bins to a relay),
pipelines and fan-out over real servers, and what one shard's failures do: the
elastic-sessions chaos run through a chaos proxy in front of each shard, a SIGKILLed shard."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorshare import Client, EmbeddedServer
from tensorshare.client.sharded import (
    ShardedClient,
    bin_key,
    expand_servers,
    expand_shards,
    owner,
    shard_keys,
)
from tensorshare.errors import (
    BinNotFound,
    ConnectError,
    ConnectionLost,
    ShardsUnavailable,
    WaitTimeout,
)
from tests.chaos import HOST, ChaosProxy, Faults, ServerProcess, chaos_seed
from tests.conftest import wait_until

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


def test_replicated_shards_from_lists_or_a_string_are_placed_by_their_index() -> None:
    listed = expand_shards([["a:1", "b:1"], "c:1|tensorshare://d:1"])
    assert listed == [["tensorshare://a:1", "tensorshare://b:1"],
                      ["tensorshare://c:1", "tensorshare://d:1"]]
    assert expand_shards("a:1|b:1, c:1|d:1") == listed  # TENSORSHARE_SERVERS's form
    assert expand_shards("tensorshare+tls://a:1|b:1") == [["tensorshare+tls://a:1",
                                                          "tensorshare+tls://b:1"]]
    assert shard_keys(listed) == ["#0", "#1"]
    # The addresses of a shard do not place its bins: its index does (a promotion, or a
    # member restarted on another port, moves no bin).
    moved = expand_shards([["a:1", "b:2"], ["c:1", "e:9"]])
    names = [f"bin{i}" for i in range(200)]
    assert [owner(n, shard_keys(listed)) for n in names] == \
        [owner(n, shard_keys(moved)) for n in names]
    assert {owner(n, shard_keys(listed)) for n in names} == {0, 1}
    # One address per shard: the addresses, as before.
    assert shard_keys(expand_shards("a:1,c:1")) == ["tensorshare://a:1", "tensorshare://c:1"]
    with pytest.raises(ValueError, match="named twice"):
        expand_shards([["a:1", "b:1"], ["b:1", "c:1"]])
    with pytest.raises(ValueError, match="empty address"):
        expand_shards(["a:1|", "c:1"])


def test_a_sharded_client_over_replicated_shards_follows_a_promotion(tmp_path: Path) -> None:
    primaries = [EmbeddedServer(port=0) for _ in range(2)]
    replicas = [EmbeddedServer(port=0, replica_of=f"tensorshare://127.0.0.1:{p.port}")
                for p in primaries]
    try:
        shards = [[f"127.0.0.1:{r.port}", f"127.0.0.1:{p.port}"]
                  for p, r in zip(primaries, replicas, strict=True)]
        with ShardedClient(shards, timeout=TIMEOUT) as c, \
                Client(shards[0][0], timeout=TIMEOUT) as admin:
            assert c.servers == ["|".join(f"tensorshare://{a}" for a in s) for s in shards]
            for i in range(20):
                c.put(f"v{i}", i)
            on_first = [f"v{i}" for i in range(20) if c.shard_of(f"v{i}") == 0]
            assert on_first and c.owner(on_first[0]) == c.servers[0]
            with Client(shards[0][1], timeout=TIMEOUT) as primary:
                assert set(primary.list()) == set(on_first)

            def copied() -> bool:
                return set(admin.list()) == set(on_first)

            wait_until(copied, TIMEOUT, "the replica's copy")
            primaries[0].stop()
            assert admin.promote() == 1
            # The same client: shard 0's calls go to its promoted replica, shard 1's as before.
            assert [c.peek(f"v{i}") for i in range(20)] == list(range(20))
            c.put(on_first[0], -1)
            assert admin.peek(on_first[0]) == -1
    finally:
        for s in (*primaries, *replicas):
            s.stop()


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


# --------------------------------------------------------------------------- elastic sessions


# The fault mix of the elastic-sessions run (tests/system/test_chaos.py): cuts by bytes in
# both directions (mid-frame), by time (quiet connections, waiting gets), resets and plain
# closes, half-open closes, and bytes forwarded in small delayed pieces.
CHAOS = Faults(cut_after_bytes=(1_000, 20_000), cut_after_seconds=(0.5, 3.0),
               reset_probability=0.5, half_open_probability=0.2, chunk_bytes=(1, 4096),
               delay_seconds=(0.0, 0.001))
CHAOS_DEADLINE = 90.0  # for the whole run; far above what it takes, below pytest's 120 s
GET_WAIT = 0.1  # a consumer's waiting get on one bin


@dataclass
class _Ledger:
    """What the producers and consumers of a sharded chaos run saw, from many threads."""

    bins: list[str]  # item i goes to bins[i % len(bins)]
    n_producers: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    acked: list[int] = field(default_factory=list)  # every item whose append returned
    delivered: list[int] = field(default_factory=list)  # every item a get returned
    errors: list[str] = field(default_factory=list)
    producers_done: threading.Event = field(default_factory=threading.Event)

    def bin_of(self, item: int) -> str:
        return self.bins[item % len(self.bins)]

    def error(self, text: str) -> None:
        with self.lock:
            self.errors.append(text)

    def summary(self) -> str:
        with self.lock:
            return (f"acked={len(self.acked)} delivered={len(self.delivered)} "
                    f"errors={self.errors[:5]}")


def _produce(c: ShardedClient, ledger: _Ledger, producer: int, items: range,
             deadline: float) -> None:
    """Append each item (a tensor ``[producer, item]``) to its bin, one call at a time."""
    for item in items:
        if time.monotonic() > deadline:
            ledger.error(f"producer {producer} gave up at item {item} (deadline)")
            return
        try:
            c.append(ledger.bin_of(item), torch.tensor([producer, item]))
        except Exception as exc:  # noqa: BLE001 (every exception is a failure here)
            ledger.error(f"producer {producer}: append of item {item} raised {exc!r}")
        else:
            with ledger.lock:
                ledger.acked.append(item)


def _take(c: ShardedClient, ledger: _Ledger, consumer: int, name: str) -> bool:
    """One waiting get on bin ``name``; record what it took. Whether it took anything.

    A ``WaitTimeout`` is the server's answer to a waiting get that found no data in time:
    how a consumer learns that a bin is empty, not a failure.
    """
    try:
        batch = c.get(name, max_items=16, timeout=GET_WAIT)
    except WaitTimeout:
        return False
    except Exception as exc:  # noqa: BLE001 (every other exception is a failure here)
        ledger.error(f"consumer {consumer}: get on {name} raised {exc!r}")
        return False
    got = []
    for t in batch:
        producer, item = (int(x) for x in t.tolist())
        if item % ledger.n_producers != producer or ledger.bin_of(item) != name:
            ledger.error(f"consumer {consumer}: item {t.tolist()} came from bin {name}")
        got.append(item)
    with ledger.lock:
        ledger.delivered.extend(got)
    return True


def _consume(c: ShardedClient, ledger: _Ledger, consumer: int, deadline: float) -> None:
    """Sweep every bin (each consumer from its own start) until, after every producer
    finished, a whole sweep finds them all empty."""
    start = consumer % len(ledger.bins)
    order = ledger.bins[start:] + ledger.bins[:start]
    while time.monotonic() < deadline:
        finished = ledger.producers_done.is_set()
        took = [_take(c, ledger, consumer, name) for name in order]
        if finished and not any(took):
            return  # empty everywhere after the last append: nothing more will come
    ledger.error(f"consumer {consumer} gave up (deadline)")


def _join(threads: list[threading.Thread], deadline: float, info: Callable[[], str]) -> None:
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.0))
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"still running after the deadline: {alive}; {info()}"


def _bins_on_every_shard(servers: list[str], per_shard: int) -> list[str]:
    """``per_shard`` bin names owned by each server, interleaved (so consecutive items go
    to different servers)."""
    found: list[list[str]] = [[] for _ in servers]
    j = 0
    while any(len(f) < per_shard for f in found):
        name = f"q{j}"
        home = found[owner(name, servers)]
        if len(home) < per_shard:
            home.append(name)
        j += 1
    return [found[k][i] for i in range(per_shard) for k in range(len(servers))]


def _start(target: Callable[..., None], *args: Any, name: str) -> threading.Thread:
    t = threading.Thread(target=target, args=args, name=name, daemon=True)
    t.start()
    return t


@pytest.mark.long
def test_elastic_sessions_through_a_sharded_client_every_item_exactly_once() -> None:
    """The elastic-sessions chaos run (tests/system/test_chaos.py) through ShardedClients:
    3 shard servers, each behind its own chaos proxy with that run's faults; 16 producers
    and 4 consumers, each its own ShardedClient; 10,000 numbered items over 9 bins, 3 on
    each shard. Every item arrives exactly once, from its own bin, no call raises, every
    shard was cut in every way and resumed sessions, and the servers agree at the end."""
    n_producers, n_consumers, n_items = 16, 4, 10_000
    seed = chaos_seed()
    procs = [ServerProcess(0) for _ in range(3)]
    proxies: list[ChaosProxy] = []
    clients: list[ShardedClient] = []
    try:
        proxies += [ChaosProxy(p.address, seed=seed + k) for k, p in enumerate(procs)]
        addresses = [f"{HOST}:{p.port}" for p in proxies]
        for _ in range(n_producers + n_consumers):
            clients.append(ShardedClient(addresses, timeout=30.0))
            # Connect to every shard before any fault: a first handshake that fails is a
            # ConnectError by design.
            clients[-1].ping()
        ledger = _Ledger(_bins_on_every_shard(clients[0].servers, 3), n_producers)
        for proxy in proxies:
            proxy.set_faults(CHAOS)

        def info() -> str:
            shards = "; ".join(f"shard {k}: {p.describe()}" for k, p in enumerate(proxies))
            return f"{shards}; {ledger.summary()}"

        deadline = time.monotonic() + CHAOS_DEADLINE
        producers = [_start(_produce, clients[p], ledger, p, range(p, n_items, n_producers),
                            deadline, name=f"producer-{p}") for p in range(n_producers)]
        consumers = [_start(_consume, clients[n_producers + k], ledger, k, deadline,
                            name=f"consumer-{k}") for k in range(n_consumers)]
        _join(producers, deadline, info)
        ledger.producers_done.set()
        _join(consumers, deadline, info)
        for proxy in proxies:
            proxy.set_faults(Faults())
        text = info()
        assert not ledger.errors, f"{text}: {ledger.errors[:10]}"
        assert sorted(ledger.acked) == list(range(n_items)), text
        counts = collections.Counter(ledger.delivered)
        twice = sorted(item for item, n in counts.items() if n > 1)
        assert not twice, f"{text}: delivered more than once: {twice[:20]}"
        missing = sorted(set(range(n_items)) - set(counts))
        assert not missing, f"{text}: {len(missing)} never delivered: {missing[:20]}"
        _check_every_shard_was_cut(proxies, len(clients), text)
        _check_the_servers_agree(clients[0], procs, ledger, text)
    finally:
        for c in clients:
            c.close()
        for proxy in proxies:
            proxy.close()
        for proc in procs:
            proc.close()


def _check_every_shard_was_cut(proxies: list[ChaosProxy], n_clients: int, info: str) -> None:
    """Every shard's connections were cut, and came back, many times and in every way."""
    for k, proxy in enumerate(proxies):
        s = proxy.stats()
        where = f"shard {k}: {info}"
        assert s["accepted"] >= 2 * n_clients, where  # each client came back to it
        assert s["cuts"] >= 2 * n_clients, where
        assert s["mid_stream"] >= 5, where  # cut by a byte budget: inside a frame
        assert 1 <= s["resets"] < s["cuts"], where  # resets and plain closes
        assert s["half_open"] >= 1, where


def _check_the_servers_agree(c: ShardedClient, procs: list[ServerProcess], ledger: _Ledger,
                             info: str) -> None:
    """Each server took the appends of its own bins and resumed sessions; at the end no
    bin is left anywhere, and each server's own list agrees with the sharded client's."""
    routed = collections.Counter(owner(ledger.bin_of(i), c.servers) for i in ledger.acked)
    markers = [f"end{i}" for i in range(12)]
    for name in markers:
        c.put(name, 1)
    lists = []
    for k, proc in enumerate(procs):
        with Client(HOST, proc.port, timeout=TIMEOUT) as direct:
            server = direct.stats()["server"]
            lists.append(direct.list())
        assert server["requests"].get("append", 0) >= routed[k] > 0, f"shard {k}: {info}"
        assert server["counters"].get("sessions_resumed", 0) >= 1, f"shard {k}: {info}"
        assert set(lists[k]) == {n for n in markers if owner(n, c.servers) == k}, info
    assert c.list() == {n: 1 for n in markers} == {n: v for b in lists for n, v in b.items()}


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


def test_reads_of_relayed_bins_go_to_the_relay_and_everything_else_to_the_shards(
        three: list[EmbeddedServer]) -> None:
    import queue

    from tensorshare.relay import Relay

    addresses = _addresses(three)
    servers = expand_servers(addresses)
    home = three[owner("{p}policy", servers)]  # "{p}...": the parameters, on one shard
    size = 64 * 1024  # floats: 256 KiB per version
    with pytest.raises(ValueError, match="relay_bins"):
        ShardedClient(addresses, relay=f"127.0.0.1:{home.port}")
    with Relay(f"127.0.0.1:{home.port}", ["{p}*"], poll=0.2) as relay, \
            ShardedClient(addresses, relay=relay.address, relay_bins=["{p}*"],
                          timeout=TIMEOUT) as c:
        assert c.relayed("{p}policy") and not c.relayed("other")
        events: queue.SimpleQueue[dict[str, object]] = queue.SimpleQueue()
        c.listen("{p}policy", events.put)  # on the relay: the bin is not there yet
        v1 = c.put("{p}policy", torch.full((size,), 1.0))  # to the shard (a relay refuses)
        got = c.fetch("{p}policy", remove=False, newer_than=0, timeout=TIMEOUT)
        assert got.version == v1 == 1 and events.get(timeout=TIMEOUT)["version"] == 1
        v2 = c.put("{p}policy", torch.full((size,), 2.0))
        assert events.get(timeout=TIMEOUT)["version"] == v2  # the shard's number
        for _ in range(5):  # reads, in every form: none of them leaves the shard
            assert c.peek("{p}policy")[0].item() == 2.0
            assert c.begin.fetch("{p}policy", remove=False).result().version == v2
            with c.pipeline() as p:
                p.peek("{p}policy")
                p.put("other", 1)  # a write in the same pipeline goes to its shard
            assert p.results[0][0].item() == 2.0 and p.results[1] >= 1
        egress = c.client_for("{p}policy").stats("{p}policy")["bins"]["{p}policy"]
        # The shard sent each version once, to the relay (not 16 times to this client).
        assert relay.downloads == 2
        assert 2 * size * 4 <= egress["bytes_out"] < 3 * size * 4, egress
        assert c.get("{p}policy")[0].item() == 2.0  # a get takes it from the shard
        assert "{p}policy" not in c.client_for("{p}policy").list()
        assert c.list() == {"other": 1}  # list asks the shards (the relay still has it)
        assert c.peek("{p}policy")[0].item() == 2.0  # (a relay keeps the last version)


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


def test_a_moved_bin_keeps_its_version_and_a_reader_waiting_for_newer_waits_on(
        three: list[EmbeddedServer]) -> None:
    first_two = _addresses(three[:2])
    with ShardedClient(first_two, timeout=TIMEOUT) as old, \
            ShardedClient(_addresses(three), timeout=TIMEOUT) as new:
        moving = [n for n in (f"w{i}" for i in range(60)) if new.owner(n) == new.servers[2]]
        lists = [n for n in (f"q{i}" for i in range(60)) if new.owner(n) == new.servers[2]]
        name, queue = moving[0], lists[0]
        for step in range(3):
            old.put(name, torch.tensor([step]), tag=step)  # version 3
        for step in range(5):
            old.append(queue, step, tag=step)
        old.get(queue, max_items=1)  # version 6, four items left
        seen: list[tuple[int, int, str, str]] = []
        moved = new.rebalance(progress=lambda *a: seen.append(a))
        assert moved == {name: new.servers[2], queue: new.servers[2]}
        assert [s[:2] for s in seen] == [(1, 2), (2, 2)]
        res = new.fetch(name, remove=False)
        assert res.version == 3 and res.value.tolist() == [2] and list(res.tags) == [2]
        # A reader that had version 3 on the old server has it already: nothing newer.
        assert new.fetch(name, remove=False, newer_than=3).unchanged
        new.put(name, torch.tensor([3]))
        assert new.fetch(name, remove=False, newer_than=3).version == 4
        res = new.fetch(queue, remove=False, max_items=None)
        assert res.value == [1, 2, 3, 4] and list(res.tags) == [1, 2, 3, 4]
        assert res.version >= 6  # at least where it was: never backwards


def test_a_list_too_large_for_one_request_moves_in_several_keeping_order_and_version(
        three: list[EmbeddedServer], monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorshare.client.pipeline import Pipeline

    monkeypatch.setattr(Pipeline, "MAX_BATCH_ITEMS", 7)  # (the rebalance's per-request cap)
    with ShardedClient(_addresses(three[:2]), timeout=TIMEOUT) as old, \
            ShardedClient(_addresses(three), timeout=TIMEOUT) as new:
        queue = next(n for n in (f"q{i}" for i in range(60)) if new.owner(n) == new.servers[2])
        for i in range(30):
            old.append(queue, torch.tensor([i]), tag=i)
        assert new.rebalance() == {queue: new.servers[2]}
        res = new.fetch(queue, remove=False, max_items=None)
        assert [int(t) for t in res.value] == list(range(30)) and list(res.tags) == list(range(30))
        assert res.version >= 31  # 30 appends and the get that took them


def test_a_bin_gone_before_its_turn_is_skipped_not_an_error(
        three: list[EmbeddedServer]) -> None:
    with ShardedClient(_addresses(three[:2]), timeout=TIMEOUT) as old, \
            ShardedClient(_addresses(three), timeout=TIMEOUT) as new:
        names = [n for n in (f"w{i}" for i in range(60)) if new.owner(n) == new.servers[2]][:2]
        for name in names:
            old.put(name, 1)
        seen: list[tuple[int, int, str, str]] = []

        def progress(*report: Any) -> None:
            seen.append(report)
            for name in names:
                old.delete(name)  # what had not moved yet is gone

        moved = new.rebalance(progress=progress)
        assert len(moved) == 1 and [s[:2] for s in seen] == [(1, 2), (2, 2)]


def test_the_rebalance_command_drains_a_shard_before_it_leaves(
        three: list[EmbeddedServer], capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorshare.cli.main import _Progress, main

    monkeypatch.setattr(_Progress, "every", 0.0)  # (a line per bin: as if each took long)

    with ShardedClient(_addresses(three), timeout=TIMEOUT) as old:
        for i in range(30):
            old.put(f"v{i}", torch.tensor([i]))
        leaving = [n for n in (f"v{i}" for i in range(30)) if old.owner(n) == old.servers[2]]
    assert leaving
    staying = ",".join(_addresses(three[:2]))
    assert main(["rebalance", "--servers", staying, "--drain",
                 _addresses(three[2:])[0]]) == 0
    printed = capsys.readouterr()
    assert f"moved {len(leaving)} bins" in printed.out
    progress = [line for line in printed.err.splitlines() if "bins moved" in line]
    assert [line.split()[2] for line in progress] == \
        [f"{i}/{len(leaving)}" for i in range(1, len(leaving) + 1)]
    with ShardedClient(staying, timeout=TIMEOUT) as new:
        for i in range(30):
            assert torch.equal(new.peek(f"v{i}"), torch.tensor([i]))
    with Client("127.0.0.1", three[2].port) as gone:
        assert gone.list() == {}  # nothing left on the shard that leaves


def test_with_a_shard_down_list_and_stats_answer_from_the_others_and_name_it(
        three: list[EmbeddedServer]) -> None:
    addresses = _addresses(three)
    with ShardedClient(addresses, timeout=TIMEOUT) as c:
        for i in range(30):
            c.put(f"v{i}", i)
        gone = c.servers[0]
        living = {f"v{i}": 1 for i in range(30) if c.owner(f"v{i}") != gone}
        assert 0 < len(living) < 30
    three[0].stop()  # its port closed, every connection cut
    # (a short timeout: a server that is down costs each call that long; long enough that
    # the live ones answer within it on a loaded machine)
    with ShardedClient(addresses, timeout=2.0) as c:  # made while the first is down
        answers = {}
        for call in (c.list, c.stats, c.begin.list):
            with pytest.raises(ShardsUnavailable) as info:
                call()
            err = info.value
            assert isinstance(err, ConnectionLost)  # what a down server gave before
            assert list(err.missing) == [gone] and gone in str(err)
            answers[call.__name__] = err.result
        assert answers["list"] == living
        assert set(answers["stats"]["servers"]) == set(c.servers[1:])
        assert set(answers["stats"]["bins"]) == set(living)
        assert c.peek(next(iter(living))) is not None  # the live shards serve on


def test_a_shard_down_before_its_first_use_fails_its_bins_calls_with_connection_lost(
        three: list[EmbeddedServer]) -> None:
    """As the README says of a server that is down: its bins' calls raise ConnectionLost,
    also when it was down before this client first used it (then nothing was sent, and the
    ConnectError is the cause); the other servers serve on."""
    addresses = _addresses(three)
    down_port = three[0].port
    three[0].stop()
    with ShardedClient(addresses, timeout=0.5) as c:  # made while the first is down
        gone = c.servers[0]
        names = [f"v{i}" for i in range(60)]
        on_gone = next(n for n in names if c.owner(n) == gone)
        living = next(n for n in names if c.owner(n) != gone)
        for call in (lambda: c.put(on_gone, 1), lambda: c.peek(on_gone),
                     lambda: c.begin.append(on_gone, 2).result()):
            with pytest.raises(ConnectionLost) as info:
                call()
            assert isinstance(info.value.__cause__, ConnectError)
            assert str(down_port) in str(info.value) and "nothing was sent" in str(info.value)
        assert c.put(living, 3) >= 1 and c.peek(living) == 3


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
