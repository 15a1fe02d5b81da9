"""tensorshare.ray on a local two-node Ray cluster: shards spread over the nodes, a killed
shard comes back with its bins, RL workers as Ray actors on both nodes train and read the
parameters through their own node's relay (as does ``shards.client()``), a killed relay
comes back where its readers find it, and nothing is left running at the end."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e \".[ray]\")")

import tensorshare.ray as tsray  # noqa: E402
from tensorshare import RLTrainer, RLWorker  # noqa: E402
from tests.conftest import wait_until  # noqa: E402

# One cluster for the module, on one worker of a parallel run (``--dist loadgroup``).
# (240 s: the first test also starts the module's two-node cluster, beside a parallel run)
pytestmark = [pytest.mark.long, pytest.mark.timeout(240), pytest.mark.xdist_group("ray")]

MB = 1 << 20
# How often a wait asks the cluster (Shards.info() and state() are calls to the keeper actor,
# which asks every member): every 5 ms, the polls took the CPU that the restarting members
# wait for.
RAY_POLL = 0.1


def _descendants(pid: int) -> set[int]:
    """The processes below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.add(pid)
        except OSError:
            pass
    return out


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """Two Ray nodes on this machine, 2 CPUs each, small object stores, no dashboard; at the
    end: shut down, and no process this test started is left."""
    from ray.cluster_utils import Cluster

    before = _descendants(os.getpid())
    sigterm = signal.getsignal(signal.SIGTERM)  # ray.init installs its own
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "object_store_memory": 80 * MB, "include_dashboard": False})
    c.add_node(num_cpus=2, object_store_memory=80 * MB)
    ray.init(address=c.address, log_to_driver=False)
    started = _alive(_descendants(os.getpid()) - before)
    assert started  # (the check at the end sees the cluster's processes)
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        signal.signal(signal.SIGTERM, sigterm)
        deadline = time.monotonic() + 20
        left = _alive(_descendants(os.getpid()) - before)
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = _alive(_descendants(os.getpid()) - before)
        assert not left, f"processes left after the Ray cluster shut down: {sorted(left)}"


@pytest.fixture(scope="module")
def shards(cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tsray.Shards]:
    data_dir = tmp_path_factory.mktemp("ray-shards")
    with tsray.start_shards(2, data_dir=data_dir, max_memory=64 * MB, snapshot_every=None,
                            relays=True) as s:
        yield s
    assert not any(tsray.reachable(s.addresses)), "a shard still listens after shutdown"
    assert not any(tsray.reachable(list(s.relays.values()))), "a relay still listens"


def test_arguments_checked_before_anything_starts(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="at least one"):
        tsray.start_shards(0, data_dir=tmp_path)
    with pytest.raises(ValueError, match="0 or more"):
        tsray.start_shards(1, data_dir=tmp_path, replicas=-1)
    with pytest.raises(ValueError, match="not built yet"):
        tsray.start_shards(1, data_dir=tmp_path, replicas=1, relays=True)


def _retrying(call: Any, deadline: float = 60.0) -> Any:
    """``call()``, again while it is refused with ``NotEnoughReplicas`` (nothing applied, or
    applied once in this session: safe to retry) until ``deadline`` seconds passed."""
    from tensorshare.errors import NotEnoughReplicas

    until = time.monotonic() + deadline
    while True:
        try:
            return call()
        except NotEnoughReplicas:
            if time.monotonic() > until:
                raise
            time.sleep(0.05)


def _on_shard(client: Any, shard: int, prefix: str) -> str:
    """A bin name that lives on ``shard``."""
    return next(f"{prefix}{k}" for k in range(1000) if client.shard_of(f"{prefix}{k}") == shard)


def _produce(servers: str, name: str, acked: list[int], refused: list[int],
             errors: list[BaseException], stop: Any) -> None:
    """Append 0, 1, 2, ... to ``name``; each acknowledged one goes to ``acked``, each
    refused with ``NotEnoughReplicas`` to ``refused`` (not retried: see the test)."""
    from tensorshare import ShardedClient
    from tensorshare.errors import NotEnoughReplicas

    try:
        with ShardedClient(servers, timeout=30) as c:
            i = 0
            while not stop.is_set():
                try:
                    c.append(name, i)
                    acked.append(i)
                except NotEnoughReplicas:
                    refused.append(i)
                    time.sleep(0.05)
                i += 1
    except BaseException as exc:  # reported by the test
        errors.append(exc)


def test_replicated_shards_fail_over_when_a_primary_dies_and_nothing_acknowledged_is_lost(
        cluster: Any, tmp_path: Any) -> None:
    # (before the module's shards take a CPU of each node: the replicas find room on the
    # other node than their primary's)
    import threading

    with tsray.start_shards(2, data_dir=tmp_path, replicas=1, min_replicas=1,
                            max_memory=32 * MB, actor_options={"num_cpus": 0}) as two:
        for shard in two.info():
            members = shard["members"]
            assert sorted(m["role"] for m in members) == ["primary", "replica"]
            assert len({m["node_id"] for m in members}) == 2  # the replica on the other node
        assert two.servers == ",".join(two.addresses) and two.servers.count("|") == 2
        policy = torch.nn.Linear(8, 2)
        with RLTrainer(host=two.servers, timeout=30) as trainer, \
                RLWorker(host=two.servers, timeout=30) as worker, two.client(timeout=30) as c:
            v1 = trainer.publish_parameters(policy.state_dict())
            assert worker.await_new_parameters(timeout=30) is not None and worker.version == v1
            victim = c.shard_of(PARAMS)
            queue = _on_shard(c, victim, "{q}")
            acked: list[int] = []
            refused: list[int] = []
            errors: list[BaseException] = []
            stop = threading.Event()
            producer = threading.Thread(target=_produce, args=(
                two.servers, queue, acked, refused, errors, stop))
            producer.start()
            try:
                wait_until(lambda: len(acked) >= 50 or bool(errors), 30, "appends under way")
                old = two.state()["primary"][victim]
                ray.kill(two.primary_actor(victim), no_restart=True)
                wait_until(lambda: bool(two.state()["failovers"]), 30, "the promotion", RAY_POLL)
                (failover,) = two.state()["failovers"]
                assert (failover["shard"], failover["from"], failover["term"]) == \
                    (victim, old, 1) and failover["to"] != old
                # The worker carries on: new parameters, published on the promoted replica.
                with torch.no_grad():
                    policy.weight.fill_(2.0)
                v2 = _retrying(lambda: trainer.publish_parameters(policy.state_dict()))
                params = worker.await_new_parameters(timeout=30)
                assert worker.version == v2 and torch.equal(params["weight"], policy.weight)
                _retrying(lambda: worker.add_data({"after": torch.ones(2)}))
                now = len(acked)
                wait_until(lambda: len(acked) >= now + 50 or bool(errors), 30,
                           "appends on the promoted replica")
            finally:
                stop.set()
                producer.join(60)
            assert not producer.is_alive() and not errors, errors
            items = c.peek(queue, max_items=None)
            assert len(items) == len(set(items)), "an item is there twice"
            assert not set(acked) - set(items), "an acknowledged item was lost"
            # (The appends refused while the promoted replica had no replica in sync are not
            # asserted absent: the one in flight at the kill, already on the replica, is
            # refused when its client resends it although it was applied, because the
            # server's fence answers before the session's remembered reply.)

            # The dead member comes back as the replica of the new primary, on its address.
            def whole() -> bool:
                members = two.info()[victim]["members"]
                return all(m is not None for m in members) and sorted(
                    (m["role"], m["synced"], m["term"]) for m in members) == [
                    ("primary", True, 1), ("replica", True, 1)]

            wait_until(whole, 60, "the dead member back as a replica", RAY_POLL)
            assert two.refresh() == []
            # A replica that dies comes back as a replica: no promotion, writes go on.
            other = 1 - victim
            state = two.state()
            replica = 1 - state["primary"][other]
            members = two.info()[other]["members"]
            ray.kill(ray.get(two.keeper.member.remote(other, replica), timeout=30),
                     no_restart=True)
            wait_until(lambda: two.info()[other]["members"][replica] is not None and
                       two.info()[other]["members"][replica]["pid"] != members[replica]["pid"]
                       and two.info()[other]["members"][replica]["synced"], 60,
                       "the replica back", RAY_POLL)
            assert two.state()["primary"] == state["primary"]
            assert len(two.state()["failovers"]) == 1 and two.refresh() == []
            name = _on_shard(c, other, "after")
            _retrying(lambda: c.put(name, 7))
            assert c.peek(name) == 7


def test_a_replicated_shard_whose_members_all_die_starts_again_from_its_primarys_data(
        cluster: Any, tmp_path: Any) -> None:
    with tsray.start_shards(1, data_dir=tmp_path, replicas=1, max_memory=16 * MB,
                            actor_options={"num_cpus": 0}) as one, \
            one.client(timeout=30) as c:
        for i in range(8):
            c.put(f"v{i}", i)
        old = one.state()
        primary = old["primary"][0]
        before = {m["pid"] for m in one.info()[0]["members"]}
        for j in (1 - primary, primary):  # no replica left to promote
            ray.kill(ray.get(one.keeper.member.remote(0, j), timeout=30), no_restart=True)

        def whole() -> bool:
            members = one.info()[0]["members"]
            return all(m is not None and m["pid"] not in before for m in members) and \
                sorted((m["role"], m["synced"]) for m in members) == [
                    ("primary", True), ("replica", True)]

        wait_until(whole, 60, "both members started again", RAY_POLL)
        assert one.state()["primary"] == old["primary"] and one.state()["failovers"] == []
        assert [c.peek(f"v{i}") for i in range(8)] == list(range(8))  # from its data dir
        assert one.refresh() == []


def test_shards_spread_over_both_nodes_and_serve(cluster: Any, shards: tsray.Shards) -> None:
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    info = shards.info()
    assert len(nodes) == 2
    assert {i["node_id"] for i in info} == nodes  # one shard on each node (SPREAD)
    assert [i["address"] for i in info] == shards.addresses
    assert all(a.startswith("127.0.0.1:") for a in shards.addresses)  # a local cluster
    assert shards.servers == ",".join(shards.addresses)

    with shards.client(timeout=30) as client:
        values = {f"t{i}": torch.arange(i + 1, dtype=torch.float32) for i in range(16)}
        for name, value in values.items():
            client.put(name, value)
        assert {client.owner(n) for n in values} == {f"tensorshare://{a}"
                                                     for a in shards.addresses}
        for name, value in values.items():
            assert torch.equal(client.peek(name), value)
        assert set(values) <= set(client.list())

    @ray.remote(num_cpus=0)
    def in_a_task(shards: tsray.Shards) -> list[float]:  # a Shards travels to tasks
        with shards.client(timeout=30) as c:
            c.put("from-a-task", torch.tensor([1.0, 2.0]))
            return list(c.peek("t3").tolist())

    assert ray.get(in_a_task.remote(shards), timeout=60) == [0.0, 1.0, 2.0, 3.0]
    with shards.client(timeout=30) as client:
        assert client.peek("from-a-task").tolist() == [1.0, 2.0]


def test_beyond_loopback_needs_a_token(cluster: Any, tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="token"):
        tsray.start_shards(1, data_dir=tmp_path, loopback=False, token=None)
    with tsray.start_shards(1, data_dir=tmp_path, loopback=False, token="s3cret",
                            max_memory=16 * MB) as one:
        ip = one.info()[0]["node_ip"]
        assert one.addresses[0].startswith(f"{ip}:") and one.token == "s3cret"
        with one.client(timeout=30) as client:  # with the shards' token
            client.put("x", torch.ones(3))
            assert client.peek("x").tolist() == [1.0, 1.0, 1.0]
    assert not any(tsray.reachable(one.addresses))


def test_sticky_shards_restart_on_their_own_node(cluster: Any, tmp_path: Any) -> None:
    with tsray.start_shards(2, data_dir=tmp_path, sticky=True, max_memory=16 * MB,
                            actor_options={"num_cpus": 0}) as two:
        before = two.info()
        assert len({i["node_id"] for i in before}) == 2
        with two.client(timeout=30) as client:
            for i in range(8):
                client.put(f"s{i}", torch.tensor([float(i)]))
            for victim in (0, 1):
                ray.kill(two.actors[victim], no_restart=False)
                deadline = time.monotonic() + 60
                while True:
                    try:
                        now = ray.get(two.actors[victim].info.remote(), timeout=30)
                        if now["pid"] != before[victim]["pid"]:
                            break
                    except ray.exceptions.RayActorError:
                        pass
                    assert time.monotonic() < deadline, "the killed shard did not come back"
                    time.sleep(0.1)
                assert now["node_id"] == before[victim]["node_id"]  # on its own node
                assert now["address"] == before[victim]["address"]
            assert [client.peek(f"s{i}").tolist() for i in range(8)] == [[float(i)]
                                                                          for i in range(8)]


def test_a_shard_keeps_its_port_when_it_can(cluster: Any, tmp_path: Any) -> None:
    # The actor's body in this process: restarts are new _Shard objects on the same directory.
    first = tsray._Shard(0, str(tmp_path), 0, True, {"max_memory": 16 * MB}, 0.5)
    address = first.address
    first.stop()
    again = tsray._Shard(0, str(tmp_path), 0, True, {"max_memory": 16 * MB}, 0.5)
    assert again.address == address  # the same port again
    again.stop()
    host, port = tsray.node_address(address)
    import socket

    with socket.socket() as taken:  # another process took the port meanwhile
        taken.bind((host, port))
        taken.listen()
        moved = tsray._Shard(0, str(tmp_path), 0, True, {"max_memory": 16 * MB}, 0.5)
        try:
            assert moved.address != address  # a free port: the address changes
        finally:
            moved.stop()
    last = tsray._Shard(0, str(tmp_path), 0, True, {"max_memory": 16 * MB}, 0.5)
    assert last.address == moved.address  # what it remembers now
    last.stop()


def test_killed_shard_comes_back_with_its_bins(shards: tsray.Shards) -> None:
    client = shards.client(timeout=30)
    try:
        names = [f"k{i}" for i in range(24)]
        for i, name in enumerate(names):
            client.put(name, torch.full((4,), float(i)))
        client.append("{q}list", torch.ones(2))
        victim = 0
        on_victim = [n for n in names if client.owner(n) == f"tensorshare://"
                     f"{shards.addresses[victim]}"]
        assert on_victim
        before = shards.info()[victim]
        versions = {n: client.fetch(n, remove=False).version for n in on_victim}

        ray.kill(shards.actors[victim], no_restart=False)  # its process dies; Ray restarts it
        deadline = time.monotonic() + 60
        while True:
            try:
                now = ray.get(shards.actors[victim].info.remote(), timeout=30)
                if now["pid"] != before["pid"]:
                    break
            except ray.exceptions.RayActorError:
                pass  # restarting
            assert time.monotonic() < deadline, "the killed shard did not come back"
            time.sleep(0.1)
        # The same port again (with SPREAD it may have come back on the other node: on one
        # machine that is the same IP, and the same data directory).
        assert now["address"] == before["address"]
        assert shards.refresh() == []

        # The same client carries on: the bins are there, with their versions.
        for i, name in enumerate(names):
            assert torch.equal(client.peek(name), torch.full((4,), float(i)))
        for name, version in versions.items():
            assert client.fetch(name, remove=False).version == version
        client.append("{q}list", torch.zeros(2))
        got = client.fetch("{q}list", remove=True, max_items=None)
        assert [t.tolist() for t in got.value] == [[1.0, 1.0], [0.0, 0.0]]
        client.put(on_victim[0], torch.tensor([42.0]))
        assert client.peek(on_victim[0]).tolist() == [42.0]
    finally:
        client.close()


PARAMS = "rl/parameters"  # RLTrainer's bin, which relays=True relays
WIDTH = 16 * 1024  # the policy's inputs: 128 KiB of parameters per version


class _Actor:
    """An RL worker as a Ray actor: ``tensorshare.RLWorker`` as it is, reading the
    parameters through the relay of its node; beside it, the client ``shards.client()``
    gives it, whose parameter reads go to that relay too."""

    def __init__(self, shards: tsray.Shards) -> None:
        self.node = ray.get_runtime_context().get_node_id()
        self.via = shards.params_via()
        self.worker = RLWorker(host=shards.servers, timeout=30, params_via=self.via)
        self.client = shards.client(timeout=30)

    def where(self) -> tuple[str, str | None, str | None]:
        return self.node, self.via, self.client.relay

    def run(self, steps: int) -> list[tuple[int, int]]:
        """Each step: the next parameters, a rollout made with them; the versions read
        (through RLWorker, through the sharded client)."""
        model = torch.nn.Linear(WIDTH, 2)
        seen = []
        for _ in range(steps):
            params = self.worker.await_new_parameters(timeout=30)
            assert params is not None and self.worker.version is not None
            model.load_state_dict(params)
            got = self.client.fetch(PARAMS, remove=False, newer_than=self.worker.version - 1,
                                    timeout=30)
            assert torch.equal(got.value["weight"], params["weight"])
            obs = torch.randn(4, WIDTH)
            with torch.no_grad():
                actions = model(obs).argmax(dim=1)
            self.worker.add_data({"obs": obs, "actions": actions, "node": self.node})
            seen.append((self.worker.version, got.version))
        return seen

    def close(self) -> None:
        self.worker.close()
        self.client.close()


def _relay_downloads(shards: tsray.Shards) -> dict[str, int]:
    infos = ray.get([a.info.remote() for a in shards.relay_actors], timeout=30)
    return {i["node_id"]: i["downloads"] for i in infos}


def _egress(shards: tsray.Shards) -> int:
    """Bytes the shard that holds the parameters has sent of them."""
    with shards.client(via_relay=False, timeout=30) as c:
        return int(c.client_for(PARAMS).stats(PARAMS)["bins"].get(PARAMS, {}).get(
            "bytes_out", 0))


def _train(trainer: RLTrainer, runs: list[Any], nodes: list[str], steps: int) -> list[int]:
    """The trainer's side: publish, drain one rollout per worker (from both nodes, made
    with that version), learn, publish again. The versions published."""
    model = torch.nn.Linear(WIDTH, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    published = [trainer.publish_parameters(model.state_dict())]
    for step in range(steps):
        got = trainer.get_data(return_versions=True, timeout=60, min_items=len(nodes))
        if len(got) < len(nodes):
            ray.get(ray.wait(runs, timeout=0)[0])  # a worker that failed says why
        assert len(got) == len(nodes)
        assert {v for _, v in got} == {published[-1]}  # tagged with the version they used
        assert {r["node"] for r, _ in got} == set(nodes)  # from both nodes
        obs = torch.cat([r["obs"] for r, _ in got])
        actions = torch.cat([r["actions"] for r, _ in got])
        loss = torch.nn.functional.cross_entropy(model(obs), actions)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step < steps - 1:
            published.append(trainer.publish_parameters(model.state_dict()))
    return published


def test_rl_workers_on_both_nodes_train_reading_parameters_through_their_nodes_relay(
        shards: tsray.Shards) -> None:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    assert sorted(shards.relays) == nodes and len(set(shards.relays.values())) == 2
    here = ray.get_runtime_context().get_node_id()  # the driver's node: the head
    with shards.client(timeout=30) as c, shards.client(via_relay=False, timeout=30) as direct:
        assert c.relay == f"tensorshare://{shards.relays[here]}" and c.relayed(PARAMS)
        assert direct.relay is None
    # No CPUs asked: the killed shard may have come back on the other node (SPREAD) and
    # taken its CPU there; these tiny workers must fit beside it.
    cls = ray.remote(num_cpus=0)(_Actor)
    actors = [cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                          ).remote(shards) for node in nodes]
    for node, via, relay in ray.get([a.where.remote() for a in actors], timeout=60):
        assert via == shards.relays[node] and relay == f"tensorshare://{via}"  # its own node's
    downloads, egress = _relay_downloads(shards), _egress(shards)
    steps = 3
    with RLTrainer(host=shards.servers, timeout=30) as trainer:
        assert len(trainer.data_bins) == 2  # rollouts spread over both shards
        runs = [a.run.remote(steps) for a in actors]
        published = _train(trainer, runs, nodes, steps)
        seen = ray.get(runs, timeout=60)
        trainer.signal_stop()
    assert published == sorted(set(published)) and len(published) == steps
    # Each worker read each version, through RLWorker and through shards.client(), with
    # the shard's version numbers.
    assert seen == [[(v, v) for v in published]] * 2
    # Each relay downloaded each version once, and the shard sent each version once per
    # relay: none of the 4 readers of each version read it from the shard.
    after = _relay_downloads(shards)
    assert {n: after[n] - downloads[n] for n in nodes} == {n: steps for n in nodes}
    size = (WIDTH * 2 + 2) * 4  # the policy's weight and bias, float32
    sent = _egress(shards) - egress
    assert 2 * steps * size <= sent < 2 * steps * size + size // 2, sent
    ray.get([a.close.remote() for a in actors], timeout=30)
    for a in actors:
        ray.kill(a)


def _restarted(actor: Any, pid: int, deadline: float = 60.0) -> dict[str, Any]:
    """The actor's ``info()`` once Ray has restarted it (a process other than ``pid``)."""
    until = time.monotonic() + deadline
    while True:
        try:
            now: dict[str, Any] = ray.get(actor.info.remote(), timeout=30)
            if now["pid"] != pid:
                return now
        except ray.exceptions.RayActorError:
            pass  # restarting
        assert time.monotonic() < until, "the killed actor did not come back"
        time.sleep(0.1)


def test_a_killed_relay_comes_back_on_its_port_and_its_readers_carry_on(
        shards: tsray.Shards) -> None:
    here = ray.get_runtime_context().get_node_id()
    infos = ray.get([a.info.remote() for a in shards.relay_actors], timeout=30)
    (k,) = [i for i, info in enumerate(infos) if info["node_id"] == here]
    policy = torch.nn.Linear(WIDTH, 2)
    with shards.client(timeout=30) as c, shards.client(via_relay=False, timeout=30) as direct:
        assert c.relay == f"tensorshare://{infos[k]['address']}"
        v1 = direct.put(PARAMS, policy.state_dict())
        assert c.fetch(PARAMS, remove=False, newer_than=v1 - 1, timeout=30).version == v1
        ray.kill(shards.relay_actors[k], no_restart=False)  # its process dies
        now = _restarted(shards.relay_actors[k], infos[k]["pid"])
        assert now["node_id"] == here and now["address"] == infos[k]["address"]
        with torch.no_grad():
            policy.weight.fill_(1.0)
        v2 = direct.put(PARAMS, policy.state_dict())
        # The same client, through the same address: the new relay, with the shard's
        # version, downloaded once more.
        got = c.fetch(PARAMS, remove=False, newer_than=v1, timeout=30)
        assert got.version == v2 and torch.equal(got.value["weight"], policy.weight)
        assert c.relayed(PARAMS) and tsray.reachable([now["address"]]) == [True]
        # (the relay serves a version a moment before its info() counts it: wait for that)
        def counted() -> bool:
            seen.append(ray.get(shards.relay_actors[k].info.remote(), timeout=30))
            return bool(seen[-1]["versions"] == {PARAMS: v2} and seen[-1]["downloads"] >= 1)

        seen: list[dict[str, Any]] = []
        wait_until(counted, timeout=30, what="the relay's info() to count what it served",
                   interval=RAY_POLL)
        again = seen[-1]
        assert again["versions"] == {PARAMS: v2} and 1 <= again["downloads"] <= 2
