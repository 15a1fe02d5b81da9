"""Replicated shards under Ray: a keeper actor that promotes a replica when its primary dies.

``start_shards(n, replicas=1, ...)`` runs each shard as ``1 + replicas`` *members*, each a
Ray actor (:class:`~tensorshare.ray._Shard`) in its own slot: member ``j`` of shard ``i`` keeps
its data in ``DATA_DIR/shard-{i}/m{j}``. One member of each shard is the primary; the others
are its replicas (:attr:`ServerConfig.replica_of <tensorshare.server.ServerConfig.replica_of>`),
placed on another node than the primary when one has room (Ray's soft node affinity, which
falls back to any node when that one is full).

Who watches: one :class:`_Keeper` actor (``num_cpus=0``, on the node of the process that
called ``start_shards``), whose thread pings every member every ``watch_every`` seconds.
Ray's own view of an actor's death is the engine: a ping that raises
:class:`ray.exceptions.ActorDiedError` (the process or its node is gone, or ``ray.kill``) is a
dead member; a slow or unreachable one (no answer yet, or ``ActorUnavailableError``) is left
alone. No vote, no lease of our own. For a dead primary the keeper sends ``promote`` to a
replica that has its full copy (a new term: clients with the shard's address list find it,
docs/PROTOCOL.md §16), then starts the dead slot again as a replica of the new primary (on
its old port when it can: the shard's address list is unchanged). A dead replica is started
again as a replica. A shard with no replica to promote (none had its full copy yet) starts
its primary again in place, from its data directory.

The members are started with ``max_restarts=0``: Ray must not restart a dead primary as a
primary beside the promoted replica (two primaries of two terms). The keeper restarts them
instead, as replicas. The keeper owns the members (Ray's ownership: they end with it), and
runs on the driver's node: its failure domain is the driver's, which ends the job's actors
anyway.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

__all__ = ["MEMBER_DIR"]

log = logging.getLogger("tensorshare.ray")

#: Member ``j`` of a replicated shard keeps its data in ``shard-{i}/m{j}``.
MEMBER_DIR = "m{j}"


def _ray() -> Any:
    import ray

    return ray


class _Keeper:
    """The replicated shards' watcher (a Ray actor): starts the members, notices a dead one
    (Ray's ``ActorDiedError``), promotes a replica, restarts the dead one as a replica."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.n, self.size = spec["n"], 1 + spec["replicas"]
        self.lock = threading.RLock()
        self.members: list[list[Any]] = [[None] * self.size for _ in range(self.n)]
        self.addresses: list[list[str | None]] = [[None] * self.size for _ in range(self.n)]
        self.primary: list[int | None] = [None] * self.n
        self.failovers: list[dict[str, Any]] = []
        self.stopped = threading.Event()
        self.started = False  # ready() started the members: the watch fills empty slots
        self.thread = threading.Thread(target=self._watch, daemon=True,
                                       name="tensorshare-ray-keeper")
        self.thread.start()

    # -- the members --------------------------------------------------------------------
    def _spawn(self, i: int, j: int, replica_of: str | None, avoid: str | None) -> None:
        """Start member ``j`` of shard ``i`` (a replica of ``replica_of``, or a primary), on
        another node than ``avoid`` when there is one."""
        ray = _ray()
        from . import _Shard

        spec = self.spec
        options = dict(spec["options"])
        if replica_of is not None:
            options["replica_of"] = f"tensorshare://{replica_of}"
            if options.get("token") and "upstream_token" not in options:
                options["upstream_token"] = options["token"]
        settings = {**spec["settings"], "max_restarts": 0, "max_task_retries": 0}
        if not settings.get("num_cpus") and not settings.get("num_gpus") and \
                not settings.get("resources"):
            settings["num_cpus"] = 0.001  # Ray places an actor that asks nothing anywhere:
            # its SPREAD and soft node affinity need an ask, however small
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive") and
                       n["NodeID"] != avoid)
        if avoid is not None and nodes and "scheduling_strategy" not in spec["user_settings"]:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            settings["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                nodes[(i + j) % len(nodes)], soft=True, _spill_on_unavailable=True)
        port = spec["port"] + i * self.size + j if spec["port"] else 0
        directory = os.path.join(spec["root"], f"shard-{i}", MEMBER_DIR.format(j=j))
        self.members[i][j] = ray.remote(_Shard).options(**settings).remote(
            i, directory, port, spec["loopback"], options, spec["rebind_timeout"],
            spec["local_ip"], True)

    def _info(self, i: int, j: int, timeout: float) -> dict[str, Any] | None:
        """Member ``(i, j)``'s info (its address remembered), ``None`` if it did not answer."""
        actor = self.members[i][j]
        if actor is None:
            return None
        try:
            info: dict[str, Any] = _ray().get(actor.info.remote(), timeout=timeout)
        except Exception:  # noqa: BLE001 - dead, stuck or starting: the watch decides
            return None
        self.addresses[i][j] = info["address"]
        return info

    # -- keeping every shard whole --------------------------------------------------------
    def _fill(self, timeout: float) -> None:
        """Every shard with a primary and every slot with a member."""
        for i in range(self.n):
            if self.primary[i] is None:
                alive = [j for j in range(self.size) if self.members[i][j] is not None]
                if not alive:
                    self._spawn(i, 0, None, None)
                    alive = [0]
                self.primary[i] = alive[0]
        waiting = [(i, self.primary[i]) for i in range(self.n)]
        for i, p in waiting:
            assert p is not None
            self._info(i, p, timeout)
        for i in range(self.n):
            p = self.primary[i]
            assert p is not None
            where = self.addresses[i][p]
            if where is None:
                continue  # its primary is not listening (yet): its replicas wait
            node = self._node_of(i, p)
            for j in range(self.size):
                if self.members[i][j] is None:
                    self._spawn(i, j, where, node)

    def _node_of(self, i: int, j: int) -> str | None:
        info = self._info(i, j, 30.0)
        return None if info is None else str(info["node_id"])

    def _watch(self) -> None:
        every = float(self.spec["watch_every"])
        while not self.stopped.wait(every):
            try:
                dead = self._dead()
                with self.lock:
                    if dead:
                        self._handle(dead)
                    elif self.started and any(m is None for row in self.members
                                               for m in row):
                        self._fill(5.0)  # a slot a round could not fill (its primary slow)
            except Exception:  # keep watching; the next round tries again
                log.exception("tensorshare.ray: the keeper's round failed")

    def _dead(self) -> list[tuple[int, int]]:
        """The members Ray says are dead (``ActorDiedError``)."""
        ray = _ray()
        with self.lock:
            refs = {self.members[i][j].ping.remote(): (i, j) for i in range(self.n)
                    for j in range(self.size) if self.members[i][j] is not None}
        if not refs:
            return []
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=2.0)
        dead = []
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.ActorDiedError:
                dead.append(refs[ref])
            except Exception:  # noqa: BLE001 - unavailable for now, or busy: not dead
                pass
        return dead

    def _handle(self, dead: list[tuple[int, int]]) -> None:
        """Promote where a primary died, then start every dead slot again."""
        died_at = time.time()
        for i, j in dead:
            self.members[i][j] = None
        for i in sorted({i for i, _ in dead}):
            p = self.primary[i]
            if p is not None and self.members[i][p] is None:
                self._failover(i, died_at)
        self._fill(30.0)

    def _failover(self, i: int, died_at: float) -> None:
        """Shard ``i``'s primary died: promote a replica that has its full copy (else the
        primary starts again in place, from its data directory)."""
        ray = _ray()
        old = self.primary[i]
        for j in range(self.size):
            actor = self.members[i][j]
            if actor is None:
                continue
            try:
                term = ray.get(actor.promote.remote(), timeout=30)
            except Exception as exc:  # noqa: BLE001 - not synced, or gone too: the next
                log.warning("tensorshare.ray: shard %d member %d not promoted: %s", i, j, exc)
                continue
            self.primary[i] = j
            self.failovers.append({"shard": i, "from": old, "to": j, "term": term,
                                   "died_at": died_at, "promoted_at": time.time()})
            log.warning("tensorshare.ray: shard %d: member %d died, member %d promoted "
                        "(term %s)", i, old, j, term)
            return
        log.warning("tensorshare.ray: shard %d: its primary died and no replica could be "
                    "promoted: it starts again in place, from its data directory", i)
        assert old is not None
        self._spawn(i, old, None, None)

    # -- what the Shards handle asks ------------------------------------------------------
    def ping(self) -> bool:
        """Nothing: an answer says the keeper lives."""
        return True

    def ready(self, timeout: float) -> list[list[str]]:
        """Every member listening and every replica with its full copy: the addresses."""
        deadline = time.monotonic() + timeout
        with self.lock:
            self._fill(timeout)
            self.started = True
        while True:
            infos = self.info(max(deadline - time.monotonic(), 0.1))
            with self.lock:
                if all(info is not None and info.get("synced", True) for row in infos
                       for info in row):
                    return [list(map(str, row)) for row in self.addresses]
                self._fill(max(deadline - time.monotonic(), 0.1))
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the replicated shards were not all listening and in "
                                   f"sync within {timeout:g} s: {infos}")
            time.sleep(0.1)

    def state(self) -> dict[str, Any]:
        """The members' addresses, each shard's primary (a member index), the failovers."""
        with self.lock:
            return {"addresses": [list(row) for row in self.addresses],
                    "primary": list(self.primary), "failovers": list(self.failovers)}

    def member(self, i: int, j: int) -> Any:
        """Member ``j`` of shard ``i``'s actor handle (``None``: being started again)."""
        with self.lock:
            return self.members[i][j]

    def info(self, timeout: float) -> list[list[dict[str, Any] | None]]:
        """Each member's info (``None``: it did not answer within ``timeout``, or is being
        started again). Asked of all at once, without holding up the watch."""
        ray = _ray()
        with self.lock:
            refs = [[None if m is None else m.info.remote() for m in row]
                    for row in self.members]
        deadline = time.monotonic() + timeout
        out: list[list[dict[str, Any] | None]] = []
        for i, row in enumerate(refs):
            out.append([])
            for j, ref in enumerate(row):
                try:
                    info = None if ref is None else ray.get(
                        ref, timeout=max(deadline - time.monotonic(), 0.01))
                except Exception:  # noqa: BLE001 - dead, stuck or starting
                    info = None
                if info is not None:
                    with self.lock:
                        self.addresses[i][j] = info["address"]
                out[-1].append(info)
        return out

    def stop(self, timeout: float) -> None:
        """Stop watching; stop every member and kill it for good."""
        ray = _ray()
        self.stopped.set()
        self.thread.join(timeout)
        with self.lock:
            actors = [a for row in self.members for a in row if a is not None]
            self.members = [[None] * self.size for _ in range(self.n)]
        try:
            ray.get([a.stop.remote() for a in actors], timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - a dead or stuck member is killed below
            log.warning("tensorshare.ray: a member did not stop cleanly: %s", exc)
        for actor in actors:
            ray.kill(actor, no_restart=True)
