"""tensorshare on Ray: shard servers as Ray actors, spread over the cluster's nodes.

Usage::

    import ray, tensorshare.ray
    ray.init()
    with tensorshare.ray.start_shards(4, data_dir="/mnt/ts", relays=True) as shards:
        client = shards.client(timeout=30)          # a tensorshare.ShardedClient
        worker = RLWorker(host=shards.servers,      # "h1:p1,h2:p2,...": RLWorker unchanged
                          params_via=shards.params_via())

Each shard is one Ray actor (scheduling strategy ``SPREAD``, ``max_restarts=-1``) running a
:class:`~tensorshare.server.EmbeddedServer` with its own data directory,
``DATA_DIR/shard-{i}``. When the actor dies (its process or its node), Ray restarts it and
the server loads that directory again: the shard comes back with its bins, and clients
reconnect by themselves (elastic sessions).

Addresses. A bin's shard is a function of the shards' addresses as written, so a shard that
comes back should come back where it was. Each shard remembers its address in
``DATA_DIR/shard-{i}/ray-shard.json``; restarted on the same node, it listens on the same
port again (it waits up to ``rebind_timeout`` seconds for the port to be free). If it cannot
(another process took the port, or Ray restarted it on another node, whose address differs or
whose disk does not hold that directory), it listens on a free port and logs a warning;
:meth:`Shards.refresh` then says which shards moved. Clients made before still point at the
old address: make them anew (:meth:`Shards.client`) and move the bins to the shards that own
them now with ``shards.client().rebalance()`` (or ``tensorshare rebalance --servers ...``).
A restart on another node finds its bins only if ``data_dir`` is on storage every node sees;
on node-local disks it starts empty there (its bins stay on the old node's disk). With
``SPREAD`` Ray may restart a shard on any node; ``start_shards(..., sticky=True)`` pins shard
``i`` to node ``i mod nodes`` instead (hard node affinity: Ray's soft affinity does not keep
a restarted actor on its node), so that a shard whose process died comes back on its own node,
with the same address and its data on that node's disk. A sticky shard whose node is gone
does not come back anywhere (its calls raise Ray's ``ActorDiedError`` or stay unschedulable):
with node-local disks its bins went with the node anyway. On storage every node sees, prefer
``SPREAD`` and let the shard come back elsewhere (on a new address: see above).

Loopback. When every node of the cluster is this machine (a local cluster), the servers bind
127.0.0.1 and need no token. Otherwise each binds its node's IP, and the server refuses that
without a token (protected mode): pass ``token=...`` (or set ``TENSORSHARE_TOKEN`` where
``start_shards`` runs); ``shards.client()`` uses the same token. The token travels to the
actors as a constructor argument (Ray keeps those in its control store).

Relays. ``start_shards(..., relays=True)`` (or the names of the parameter bins, which must
live on one shard) also starts one :class:`~tensorshare.relay.Relay` actor per node, pinned
to it: it downloads each new version of the parameters once from their shard and serves it
to the workers of its node, with the shard's version numbers. In a Ray task or actor (or the
driver), ``shards.client()`` is a sharded client whose reads of those bins (peek,
``fetch(remove=False)``, listen) go to the relay of the node it runs on, and everything else
(writes, gets, the other bins) to the shards; ``shards.client(via_relay=False)`` reads from
the shards. An ``RLWorker`` reads through its own node's relay with
``RLWorker(host=shards.servers, params_via=shards.params_via())``; its rollouts still go to
the shards. A relay keeps nothing: restarted, it downloads the current version again, on
the same port when it can (it remembers it in ``DATA_DIR/relay-{node id}.json``), so that
clients of it reconnect by themselves. A relay's upstream is the shard's address at the
start: if that shard moves (see above), start the shards' relays again.

Replicas. ``start_shards(n, replicas=1, min_replicas=1, ...)`` makes each shard a primary
and a replica (each a Ray actor, the replica on another node when there is one), and a
keeper actor that watches them (:mod:`tensorshare.ray.failover`): when Ray reports the
primary's actor dead, it promotes the replica (a new term) and starts the dead one again as
the replica of the new primary. :attr:`Shards.servers` is then ``"a|b,c|d"``: each shard's
address list, which ``ShardedClient``, ``RLWorker(host=...)`` and ``TENSORSHARE_SERVERS``
take; their calls go to each shard's primary and follow a promotion, and bins are placed by
the shard's index, so nothing moves. ``min_replicas=1`` (default 0) acknowledges a write once
the replica has it: a failover loses nothing acknowledged; with 0 it may lose the last
moments' writes. Not built yet with replicas: ``relays`` and ``sticky``.

Ray is an optional dependency (``pip install "tensorshare[ray]"``), imported when first
needed.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Sequence
from typing import Any, Unpack

from twisted.internet.error import BindError

from ..client.options import AllOptionFields, ClientOptions
from ..client.sharded import ShardedClient
from ..server import EmbeddedServer, ServerConfig
from ..server.config import env_token

__all__ = ["Shards", "start_shards"]

log = logging.getLogger("tensorshare.ray")

#: The file, in each shard's data directory, that remembers where the shard listens.
STATE_FILE = "ray-shard.json"


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError("tensorshare.ray needs Ray: pip install \"tensorshare[ray]\" "
                          "(or pip install ray)") from exc
    return ray


def _bind(host: str, port: int, config: ServerConfig, wait: float) -> EmbeddedServer:
    """A server on ``host:port``, trying for up to ``wait`` seconds while the port is in use
    (a dying predecessor may still hold it)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            return EmbeddedServer(port, host=host, config=config)
        except (OSError, BindError):  # the port is in use (CannotListenError)
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def _listen_again(host: str, node_ip: str, state_path: str, port: int, config: ServerConfig,
                  rebind_timeout: float, what: str) -> EmbeddedServer:
    """A server for ``what`` on ``host``, on the port ``state_path`` remembers when this is a
    restart on the same node (waiting up to ``rebind_timeout`` for it to be free), else on
    ``port`` (0: a free one); then remember where it listens.

    A restart that cannot have its old port (taken, or another node) takes a free one and
    logs a warning: its address changes.
    """
    previous: dict[str, Any] = {}
    try:
        with open(state_path, encoding="utf-8") as f:
            previous = json.load(f)
    except (OSError, ValueError):
        pass
    wanted = port
    if previous.get("host") == host and previous.get("port") and previous.get("node_ip") \
            == node_ip:
        wanted = int(previous["port"])  # a restart on the same node: the same address
    try:
        server = _bind(host, wanted, config, rebind_timeout if wanted else 0.0)
    except (OSError, BindError):
        if not previous:
            raise  # first start on an explicit port that is taken: say so
        log.warning("tensorshare %s could not listen on %s:%d again; it listens on a free "
                    "port: its address changes (see tensorshare.ray)", what, host, wanted)
        server = EmbeddedServer(0, host=host, config=config)
    address = f"{host}:{server.port}"
    if previous and f"{previous.get('host')}:{previous.get('port')}" != address:
        log.warning("tensorshare %s moved from %s:%s to %s", what, previous.get("host"),
                    previous.get("port"), address)
    tmp = state_path + ".new"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"host": host, "port": server.port, "node_ip": node_ip}, f)
    os.replace(tmp, state_path)
    return server


class _Shard:
    """One shard server inside a Ray actor (see :func:`start_shards`)."""

    def __init__(self, index: int, shard_dir: str, port: int, loopback: bool,
                 options: dict[str, Any], rebind_timeout: float,
                 local_ip: str | None = None, replicated: bool = False) -> None:
        ray = _ray()
        self.index = index
        self.token: str | None = options.get("token")
        self.replicated = replicated  # a member of a replicated shard: info() says its role
        node_ip = ray.util.get_node_ip_address()
        if local_ip is not None and node_ip != local_ip:
            raise RuntimeError(
                f"tensorshare shard {index} was placed on node {node_ip}, but the shards were "
                f"started for a cluster on one machine ({local_ip}), bound to 127.0.0.1: no "
                f"one else could reach it. Start them with loopback=False and a token")
        host = "127.0.0.1" if loopback else node_ip
        os.makedirs(shard_dir, exist_ok=True)
        self.server = _listen_again(host, node_ip, os.path.join(shard_dir, STATE_FILE), port,
                                    ServerConfig(data_dir=shard_dir, **options),
                                    rebind_timeout, f"shard {index}")
        self.address = f"{host}:{self.server.port}"

    def info(self) -> dict[str, Any]:
        """Where this shard runs: ``address``, ``node_id``, ``node_ip``, ``pid``; with
        replication (``start_shards(..., replicas=...)``) also its ``role`` and ``term``, and
        ``synced`` (a replica: whether it has its full copy)."""
        ray = _ray()
        out = {"index": self.index, "address": self.address, "pid": os.getpid(),
               "node_id": ray.get_runtime_context().get_node_id(),
               "node_ip": ray.util.get_node_ip_address(), "running": self.server.running}
        if self.replicated:
            with self._client() as client:
                server = client.stats()["server"]
            out.update(role=server["role"], term=server["term"],
                       synced=bool(server["replication"].get("synced", True)))
        return out

    def _client(self) -> Any:
        from ..client.blocking import Client

        return Client(self.address, token=self.token, timeout=30, reconnect=False)

    def ping(self) -> bool:
        """Nothing: an answer says the actor lives (the keeper's watch)."""
        return True

    def promote(self) -> int:
        """Make this replica the primary (the ``promote`` op, as ``tensorshare promote``):
        the new term."""
        with self._client() as client:
            return int(client.promote())

    def stop(self) -> None:
        """Stop the server (final snapshot written, port closed)."""
        self.server.stop()


class _RelayNode:
    """One relay on one node (see :func:`start_shards` ``relays``): a read-only server that
    downloads each new version of the parameter bins once from their shard and serves it to
    the workers of its node. Restarted by Ray (on its node), it listens on its port again
    (``state_dir/relay-{node id}.json`` remembers it), so that its readers reconnect."""

    def __init__(self, upstream: str, bins: list[str], loopback: bool,
                 options: dict[str, Any], state_dir: str, rebind_timeout: float = 10.0
                 ) -> None:
        from ..relay import Relay

        ray = _ray()
        node_ip = ray.util.get_node_ip_address()
        host = "127.0.0.1" if loopback else node_ip
        config = ServerConfig(**options, relay_of=upstream)
        node = ray.get_runtime_context().get_node_id()
        os.makedirs(state_dir, exist_ok=True)
        self.server = _listen_again(host, node_ip, os.path.join(state_dir, f"relay-{node}.json"),
                                    0, config, rebind_timeout, f"relay on node {node}")
        try:
            self.relay = Relay(upstream, bins, server=self.server, poll=0.5, token=config.token)
        except BaseException:
            self.server.stop()
            raise
        self.address = self.relay.address

    def info(self) -> dict[str, Any]:
        """Where this relay serves: ``address``, ``node_id``, ``upstream``, ``downloads``,
        ``versions`` (bin: the upstream version it serves), ``pid``."""
        ray = _ray()
        return {"address": self.address, "node_id": ray.get_runtime_context().get_node_id(),
                "upstream": self.relay.upstream, "downloads": self.relay.downloads,
                "versions": dict(self.relay.versions), "pid": os.getpid()}

    def stop(self) -> None:
        """Stop relaying and close the relay's port."""
        self.relay.stop()
        self.server.stop()


def _is_local_cluster(ray: Any) -> bool:
    """Whether every alive node of the cluster is this machine."""
    here = ray.util.get_node_ip_address()
    ips = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    return ips <= {here}


class Shards:
    """Shard servers running as Ray actors: what :func:`start_shards` returns.

    It can be passed to Ray tasks and actors (it holds the actors' handles and addresses),
    which then call :meth:`client`. A context manager: leaving it calls :meth:`shutdown`.

    Attributes:
        actors: the shards' Ray actor handles, in shard order.
        addresses: ``"host:port"`` of each shard, in shard order (as of the start, or the
            last :meth:`refresh`).
        token: the servers' token (``None``: none).
        data_dir: the directory holding ``shard-{i}`` for each shard.
    """

    def __init__(self, actors: list[Any], addresses: list[str], token: str | None,
                 data_dir: str) -> None:
        self.actors = actors
        self.addresses = addresses
        self.token = token
        self.data_dir = data_dir
        #: With ``relays``: node id -> ``"host:port"`` of the relay on that node.
        self.relays: dict[str, str] = {}
        #: With ``relays``: the bins they relay.
        self.relay_bins: list[str] = []
        self.relay_actors: list[Any] = []
        #: With ``replicas``: the keeper actor (:mod:`tensorshare.ray.failover`).
        self.keeper: Any = None

    def params_via(self) -> str | None:
        """The relay on the node this is called on (in a Ray task or actor), for
        ``RLWorker(host=shards.servers, params_via=shards.params_via())``; ``None`` without
        relays or when this node has none (then read from the shards)."""
        if not self.relays:
            return None
        return self.relays.get(_ray().get_runtime_context().get_node_id())

    @property
    def servers(self) -> str:
        """The addresses joined by commas: what ``RLWorker(host=...)``, ``RLTrainer``,
        ``TENSORSHARE_SERVERS`` and ``tensorshare --servers`` take."""
        return ",".join(self.addresses)

    def __len__(self) -> int:
        return len(self.actors)

    def client(self, *, via_relay: bool = True, options: ClientOptions | None = None,
               **overrides: Unpack[AllOptionFields]) -> ShardedClient:
        """A :class:`~tensorshare.ShardedClient` over the shards (with their token unless
        ``token`` is given). ``options`` (a :class:`~tensorshare.ClientOptions`) and the
        keywords (``timeout``, ...; they override ``options``) go to each shard's client.

        With relays (``start_shards(..., relays=...)``) and ``via_relay``, the reads of the
        relayed bins (peek, ``fetch(remove=False)``, listen) go to the relay of the node
        this is called on (:meth:`params_via`), with the shard's version numbers; writes,
        gets and every other bin go to the shards. A relay serves the last version it
        downloaded: a read right after a put may see the one before (wait with
        ``fetch(newer_than=...)``). ``via_relay=False``, or a node without a relay: every
        read from the shards."""
        opts = ClientOptions.of(options, **overrides)
        if self.token is not None and opts.token is None:
            opts = opts.replace(token=self.token)
        relay = self.params_via() if via_relay else None
        if relay is not None:
            return ShardedClient(self.addresses, relay=relay, relay_bins=self.relay_bins,
                                 options=opts)
        return ShardedClient(self.addresses, options=opts)

    def info(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Each shard's ``address``, ``node_id``, ``node_ip`` and ``pid`` (waiting for a
        shard that Ray is restarting).

        With ``replicas``: each shard's members (``None``: one being started again, or that
        did not answer within ``timeout``), each with its ``role``, ``term`` and ``synced``;
        ``address`` is then the shard's address list, ``|``-joined."""
        ray = _ray()
        if self.keeper is not None:
            members = ray.get(self.keeper.info.remote(timeout), timeout=timeout * 3 + 30)
            return [{"index": i, "address": "|".join(self.members_of(i)), "members": row}
                    for i, row in enumerate(members)]
        return list(ray.get([a.info.remote() for a in self.actors], timeout=timeout))

    def state(self, timeout: float = 60.0) -> dict[str, Any]:
        """With ``replicas``: ``addresses`` (each shard's members' ``"host:port"``),
        ``primary`` (each shard's primary, a member index) and ``failovers`` (each a
        ``shard``, the member it went ``from`` and ``to``, the new ``term``, and when the
        keeper saw the death, ``died_at``, and promoted, ``promoted_at``: ``time.time()``)."""
        if self.keeper is None:
            raise ValueError("these shards have no replicas (start_shards(..., replicas=1))")
        state: dict[str, Any] = _ray().get(self.keeper.state.remote(), timeout=timeout)
        return state

    def members_of(self, shard: int) -> list[str]:
        """The ``"host:port"`` of shard ``shard``'s members (one without ``replicas``)."""
        return self.addresses[shard].split("|")

    def primary_actor(self, shard: int, timeout: float = 60.0) -> Any:
        """The actor of shard ``shard``'s primary now (without replicas: its actor)."""
        if self.keeper is None:
            return self.actors[shard]
        ray = _ray()
        p = self.state(timeout)["primary"][shard]
        return ray.get(self.keeper.member.remote(shard, p), timeout=timeout)

    def refresh(self, timeout: float = 60.0) -> list[int]:
        """Ask the shards where they listen now; update :attr:`addresses`.

        Returns:
            The indices of the shards whose address changed (see the module's notes:
            make clients anew and rebalance).
        """
        now = ["|".join(map(str, row)) for row in self.state(timeout)["addresses"]] \
            if self.keeper is not None else [i["address"] for i in self.info(timeout)]
        moved = [k for k, (a, b) in enumerate(zip(self.addresses, now, strict=True)) if a != b]
        self.addresses = now
        return moved

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stop every shard (each writes its final snapshot and closes its port), kill the
        actors for good, and wait until Ray reports them dead. Idempotent."""
        ray = _ray()
        keeper, self.keeper = self.keeper, None
        if keeper is not None:
            try:
                ray.get(keeper.stop.remote(timeout), timeout=timeout * 2)
            except Exception as exc:  # its members end with it (Ray's ownership)
                log.warning("tensorshare.ray: the keeper did not stop cleanly: %s", exc)
            ray.kill(keeper, no_restart=True)
            _wait_dead(ray, [keeper, *self.actors], timeout)
            self.actors = []
        relays, self.relay_actors = self.relay_actors, []
        if relays:
            try:
                ray.get([a.stop.remote() for a in relays], timeout=timeout)
            except Exception as exc:
                log.warning("tensorshare.ray: a relay did not stop cleanly: %s", exc)
            for actor in relays:
                ray.kill(actor, no_restart=True)
        if not self.actors:
            return
        actors, self.actors = self.actors, []
        try:
            ray.get([a.stop.remote() for a in actors], timeout=timeout)
        except Exception as exc:  # a dead or stuck shard: it is killed below all the same
            log.warning("tensorshare.ray: a shard did not stop cleanly: %s", exc)
        for actor in actors:
            ray.kill(actor, no_restart=True)
        _wait_dead(ray, actors, timeout)

    def __enter__(self) -> Shards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"<tensorshare.ray.Shards {self.addresses}>"


def _wait_dead(ray: Any, actors: list[Any], timeout: float) -> None:
    """Wait (up to ``timeout``) until Ray reports each of ``actors`` dead."""
    deadline = time.monotonic() + timeout
    for actor in actors:
        while time.monotonic() < deadline:
            try:
                ray.get(actor.ping.remote(), timeout=max(deadline - time.monotonic(), 0.1))
            except ray.exceptions.RayActorError:
                break  # dead
            except ray.exceptions.GetTimeoutError:
                break
            time.sleep(0.05)


def start_shards(n: int, *, data_dir: str | os.PathLike[str], replicas: int = 0,
                 relays: bool | Sequence[str] = False,
                 port: int = 0, loopback: bool | None = None, sticky: bool = False,
                 actor_options: dict[str, Any] | None = None, rebind_timeout: float = 10.0,
                 timeout: float = 120.0, watch_every: float = 0.2,
                 **server_options: Any) -> Shards:
    """Start ``n`` shard servers as Ray actors spread over the cluster's nodes (after
    ``ray.init()`` if this process has not connected to Ray).

    Args:
        n: how many shards.
        data_dir: shard ``i`` keeps its data in ``data_dir/shard-{i}`` (on the disk of the
            node it runs on: storage that every node sees lets a shard restart anywhere);
            with ``replicas``, member ``j`` of it in ``data_dir/shard-{i}/m{j}``.
        replicas: each shard's replicas (default 0: none, the shard restarts in place).
            With 1 or more, a keeper promotes a replica when its primary's actor dies and
            starts the dead one again as a replica (see the module's notes); with
            ``min_replicas=1`` a failover loses no acknowledged write.
        relays: one relay per node for parameter fan-out: ``True`` relays RLTrainer's
            ``"rl/parameters"``, or give the parameter bins' names (on one shard: pin them
            with a ``{tag}``). ``shards.client()`` reads them through its node's relay;
            workers with ``RLWorker(host=shards.servers, params_via=shards.params_via())``.
        port: 0 (default): each shard takes a free port at its first start and keeps it
            across restarts; else shard ``i`` listens on ``port + i`` (with ``replicas``,
            its member ``j`` on ``port + i * (1 + replicas) + j``).
        loopback: bind 127.0.0.1 (``True``) or each node's IP (``False``); default: loopback
            when every node of the cluster is this machine.
        sticky: pin shard ``i`` to node ``i mod nodes`` (hard node affinity) instead of
            ``SPREAD``: Ray restarts it on its own node (its address, its data directory),
            never elsewhere (see the module's notes).
        actor_options: passed to ``ActorClass.options`` (defaults: ``num_cpus=1``,
            ``max_restarts=-1``, ``max_task_retries=-1``, ``scheduling_strategy="SPREAD"``).
        rebind_timeout: how long a restarted shard waits for its old port to be free.
        timeout: seconds to wait for every shard to listen (and replica to be in sync).
        watch_every: with ``replicas``: seconds between the keeper's pings of the members.
        **server_options: :class:`~tensorshare.server.ServerConfig` fields (``token``, by
            default ``TENSORSHARE_TOKEN`` here; ``min_replicas``, ``max_memory``, ...).

    Returns:
        The :class:`Shards`, every one of them listening.

    Raises:
        ValueError: ``n < 1``, ``replicas < 0`` or with ``relays``/``sticky``, relayed bins
            on two shards, or beyond loopback without a token (or ``insecure=True``).
        TypeError: an unknown server option.
        ImportError: Ray is not installed.
    """
    relay_bins = _check_arguments(n, replicas, relays, sticky, server_options)
    ray = _connected()
    options, config, loopback, local_ip = _shard_config(ray, server_options, loopback)
    root = os.path.abspath(os.fspath(data_dir))
    if replicas:
        return _start_replicated(ray, Shards([], [], config.token, root), timeout, dict(
            n=n, replicas=replicas, root=root, port=port, loopback=loopback, options=options,
            rebind_timeout=rebind_timeout, local_ip=local_ip, watch_every=watch_every,
            user_settings=dict(actor_options or {})))
    actors = _spawn_shards(ray, n, root, port, loopback, options, rebind_timeout, local_ip,
                           sticky=sticky, actor_options=actor_options)
    return _listening(ray, Shards(actors, [], config.token, root), relay_bins, loopback,
                      options, timeout)


def _connected() -> Any:
    """The ``ray`` module, connected to a cluster (``ray.init()`` if this process was not)."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init()
    return ray


def _check_arguments(n: int, replicas: int, relays: bool | Sequence[str], sticky: bool,
                     server_options: dict[str, Any]) -> list[str]:
    """The relayed bins; raise for what :func:`start_shards` refuses, before anything
    starts."""
    relay_bins = (["rl/parameters"] if relays is True else
                  [relays] if isinstance(relays, str) else list(relays or []))
    if n < 1:
        raise ValueError(f"start_shards needs at least one shard, not {n}")
    if "data_dir" in server_options:
        raise TypeError("data_dir is start_shards' own argument")
    if replicas < 0:
        raise ValueError(f"replicas must be 0 or more, not {replicas}")
    if replicas and (relay_bins or sticky):
        raise ValueError("start_shards(replicas=...) with relays or sticky is not built yet: "
                         "a relay follows one address, and a sticky shard one node")
    if replicas and "replica_of" in server_options:
        raise TypeError("replica_of is set by start_shards(replicas=...) itself")
    return relay_bins


def _start_replicated(ray: Any, shards: Shards, timeout: float,
                      spec: dict[str, Any]) -> Shards:
    """The keeper (on this node) starts the members; ``shards`` once every replica is in
    sync (on failure everything is shut down and the error raised)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from .failover import _Keeper

    spec["settings"] = {"num_cpus": 1, "scheduling_strategy": "SPREAD",
                        **spec["user_settings"]}

    here = ray.get_runtime_context().get_node_id()
    shards.keeper = ray.remote(_Keeper).options(
        num_cpus=0, max_restarts=0, max_concurrency=4,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote(spec)
    try:
        members = ray.get(shards.keeper.ready.remote(timeout), timeout=timeout * 2 + 30)
        shards.addresses = ["|".join(row) for row in members]
        shards.actors = ray.get([shards.keeper.member.remote(i, 0)
                                 for i in range(spec["n"])], timeout=timeout)
    except BaseException:
        shards.shutdown(timeout)
        raise
    return shards


def _shard_config(ray: Any, server_options: dict[str, Any], loopback: bool | None
                  ) -> tuple[dict[str, Any], ServerConfig, bool, str | None]:
    """The shards' server options (``token`` from the environment by default), their
    config, whether they bind loopback and, when only this machine's nodes may hold a
    shard, its IP."""
    options = dict(server_options)
    if "token" not in options:
        options["token"] = env_token()
    config = ServerConfig(**options)  # an unknown option raises TypeError here, not remotely
    local_ip = None
    if loopback is None:
        loopback = _is_local_cluster(ray)
        if loopback:  # a node that joins later must not get a shard it cannot share
            local_ip = ray.util.get_node_ip_address()
    if not loopback and not config.token and not config.insecure:
        raise ValueError(
            "tensorshare.ray: the cluster spans several machines, so the shards listen on "
            "their nodes' IPs, and a server refuses that without a token: pass token=... (or "
            "set TENSORSHARE_TOKEN), or insecure=True if this network is trusted")
    return options, config, loopback, local_ip


def _spawn_shards(ray: Any, n: int, root: str, port: int, loopback: bool,
                  options: dict[str, Any], rebind_timeout: float, local_ip: str | None, *,
                  sticky: bool, actor_options: dict[str, Any] | None) -> list[Any]:
    """The ``n`` shard actors, each placed as ``start_shards`` describes (not yet ready)."""
    settings: dict[str, Any] = {"num_cpus": 1, "max_restarts": -1, "max_task_retries": -1,
                                "scheduling_strategy": "SPREAD"}
    settings.update(actor_options or {})
    per_shard: list[dict[str, Any]] = [{} for _ in range(n)]
    if sticky:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        nodes = sorted(node["NodeID"] for node in ray.nodes() if node.get("Alive"))
        per_shard = [{"scheduling_strategy": NodeAffinitySchedulingStrategy(
            nodes[i % len(nodes)], soft=False)} for i in range(n)]
    cls = ray.remote(_Shard)
    return [cls.options(**{**settings, **per_shard[i]}).remote(
        i, os.path.join(root, f"shard-{i}"), port + i if port else 0, loopback, options,
        rebind_timeout, local_ip) for i in range(n)]


def _listening(ray: Any, shards: Shards, relay_bins: list[str], loopback: bool,
               options: dict[str, Any], timeout: float) -> Shards:
    """``shards`` once every one listens (and its relays, if any); on failure they are shut
    down and the error raised."""
    try:
        shards.addresses = [i["address"] for i in shards.info(timeout)]
        if relay_bins:
            _start_relays(ray, shards, relay_bins, loopback, options, timeout)
    except BaseException:
        shards.shutdown(timeout)
        raise
    return shards


def _start_relays(ray: Any, shards: Shards, bins: list[str], loopback: bool,
                  options: dict[str, Any], timeout: float) -> None:
    """One relay actor per alive node, relaying ``bins`` from the shard that owns them."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ..client.sharded import expand_servers, owner

    urls = expand_servers(shards.addresses)
    homes = {owner(name, urls) for name in bins}
    if len(homes) != 1:
        raise ValueError(f"tensorshare.ray: the relayed bins {bins} live on {len(homes)} "
                         f"shards; a relay has one upstream: pin them together with a {{tag}} "
                         f"(e.g. '{{params}}policy', '{{params}}value')")
    upstream = urls[homes.pop()]
    cls = ray.remote(_RelayNode)
    nodes = sorted(node["NodeID"] for node in ray.nodes() if node.get("Alive"))
    shards.relay_actors = [cls.options(
        num_cpus=0, max_restarts=-1, max_task_retries=-1,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            upstream, bins, loopback, options, shards.data_dir) for node in nodes]
    infos = ray.get([a.info.remote() for a in shards.relay_actors], timeout=timeout)
    shards.relays = {i["node_id"]: i["address"] for i in infos}
    shards.relay_bins = list(bins)


def node_address(address: str) -> tuple[str, int]:
    """``("host", port)`` of a ``"host:port"`` shard address."""
    host, _, port = address.rpartition(":")
    return host, int(port)


def reachable(addresses: Sequence[str], timeout: float = 1.0) -> list[bool]:
    """Whether a TCP connection to each address succeeds now (for checks and tests)."""
    out = []
    for address in addresses:
        try:
            with socket.create_connection(node_address(address), timeout=timeout):
                out.append(True)
        except OSError:
            out.append(False)
    return out
