"""Replay bins on a replica: in its full copy, following the records, through a partial
resync, in its own data directory, and serving from the copied state once promoted.

Real servers in this process (:class:`EmbeddedServer`, 127.0.0.1, port 0) and real clients;
the tables are compared whole (every item's key, priority, times sampled and size, the
counters, the rate limiter's counts and the random state), read in each server's own reactor
thread. Nothing waits on a sleep: conditions are polled with deadlines.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorshare import Client, EmbeddedServer
from tensorshare.errors import ReadOnlyReplica
from tensorshare.server import ServerConfig
from tensorshare.server.replaykind import ReplayKind
from tests.chaos import ChaosProxy
from tests.conftest import wait_until

TIMEOUT = 20.0


def replays(srv: EmbeddedServer) -> dict[str, Any]:
    """Every replay bin of ``srv``: its version and its table's whole state, and the bytes
    the kind counts."""
    def read() -> dict[str, Any]:
        (kind,) = [k for k in srv.factory.kinds if isinstance(k, ReplayKind)]
        out: dict[str, Any] = {n: (b.version, b.table.state()) for n, b in kind.bins.items()}
        out["nbytes"] = kind.nbytes
        return out

    return srv.call(read)


def remembered(srv: EmbeddedServer) -> set[tuple[bytes, int, str]]:
    """The replay replies each session of ``srv`` remembers (exactly once on a retry)."""
    return srv.call(lambda: {(s.id, rid, type(r.reply).__name__)
                             for s in srv.factory.sessions for rid, r in s.replies.items()
                             if type(r.reply).__name__.startswith("Replay")})


def synced(a: EmbeddedServer, b: EmbeddedServer) -> bool:
    return replays(a) == replays(b)


def repl(c: Client) -> dict[str, Any]:
    return c.stats()["server"]["replication"]


def following(servers: Callable[..., EmbeddedServer], clients: Callable[..., Client],
              tmp_path: Path, replica_dir: str | None = None
              ) -> tuple[EmbeddedServer, Client, EmbeddedServer]:
    """A primary with a data directory and a replay bin ``r`` of 8 items, and a replica of
    it (with its own data directory ``replica_dir``) that has its full copy."""
    primary = servers(config=ServerConfig(data_dir=str(tmp_path / "a")))
    c = clients(primary.port)
    c.replay_open("r", max_size=50, seed=5)
    fill(c, "r", 0, 8)
    replica = servers(config=ServerConfig(
        data_dir=None if replica_dir is None else str(tmp_path / replica_dir),
        replica_of=f"127.0.0.1:{primary.port}"))
    wait_until(lambda: synced(primary, replica), TIMEOUT, "the full copy")
    return primary, c, replica


def fill(c: Client, name: str, first: int, n: int) -> list[int]:
    return list(c.replay_insert(name, [torch.full((3,), float(i)) for i in range(first, first + n)],
                                [1.0 + i % 5 for i in range(first, first + n)]))


def test_a_replica_copies_and_follows_replay_bins_and_serves_them_once_promoted(
        servers: Callable[..., EmbeddedServer], clients: Callable[..., Client]) -> None:
    primary = servers()
    c = clients(primary.port)
    c.replay_open("r", max_size=40, sampler="prioritized", remover="fifo",
                  samples_per_insert=2.0, min_size_to_sample=2, error_buffer=100.0)
    c.replay_open("u", max_size=10, sampler="uniform", max_times_sampled=2)
    fill(c, "r", 0, 30)
    fill(c, "u", 0, 6)
    c.replay_sample("r", 8)
    c.replay_sample("u", 4)
    # The replica connects after: its full copy has both bins as they are.
    replica = servers(replica_of=f"127.0.0.1:{primary.port}")
    r = clients(replica.port)
    wait_until(lambda: synced(primary, replica), TIMEOUT, "the full copy of the replay bins")
    assert set(replays(replica)) == {"r", "u", "nbytes"}
    # The remembered replies of the replay ops came with it (a retry is answered once).
    mine = remembered(primary)
    assert "ReplaySampled" in {x[2] for x in mine}  # (the ones not yet acknowledged)
    assert remembered(replica) == mine
    events: list[dict[str, Any]] = []
    r.listen("r", events.append)  # a listener on the replica hears each change, in order
    # Then it follows: inserts (some evicting), updates, samples (some expiring items).
    keys = fill(c, "r", 30, 20)  # past max_size: the fifo remover evicts
    assert c.replay_update("r", keys[:5] + [1], [9.0] * 6) == 5
    c.replay_sample("r", 16)
    c.replay_sample("u", 6)  # max_times_sampled=2: items leave
    wait_until(lambda: synced(primary, replica), TIMEOUT, "the records after it")
    # (acknowledgements that release no items are not records: a replica, like a restart,
    # may remember more than its primary still does, never less)
    assert remembered(primary) <= remembered(replica)
    version = replays(primary)["r"][0]
    wait_until(lambda: len(events) == 3, TIMEOUT, "the replica's listener's events")
    assert [(e["op"], e["version"]) for e in events] == [
        ("replay_insert", version - 2), ("replay_update", version - 1),
        ("replay_sample", version)]
    state = replays(replica)["r"][1]
    assert sorted(row[0] for row in state["items"]) == list(range(11, 51))  # the item ids
    assert {row[0]: row[1] for row in state["items"]}[keys[0]] == 9.0  # the priority update
    assert state["limiter"] == replays(primary)["r"][1]["limiter"]
    # replay_info changes nothing: served, as the primary would; everything else is refused.
    info = r.replay_info("r")
    assert (info.size, info.total) == (40, c.replay_info("r").total)
    for op in (lambda: r.replay_sample("r", 2), lambda: r.replay_insert("r", [1], [1.0]),
               lambda: r.replay_update("r", [11], [1.0]),
               lambda: r.replay_open("new", max_size=4)):
        with pytest.raises(ReadOnlyReplica):
            op()
    assert synced(primary, replica)  # nothing moved by what was refused
    # Promoted, it samples from the copied state: the same draw as the (old) primary's next.
    assert r.promote() == 1
    promoted_draw = r.replay_sample("r", 12)
    primary_draw = c.replay_sample("r", 12)
    assert promoted_draw.keys.tolist() == primary_draw.keys.tolist()
    assert torch.equal(promoted_draw.items, primary_draw.items)
    assert fill(r, "r", 100, 2) == [51, 52]  # it inserts where the primary would have
    assert r.replay_info("r").stats["inserts"] == c.replay_info("r").stats["inserts"] + 2


def test_a_cut_replica_resyncs_its_replay_bins_partially_then_fully(
        servers: Callable[..., EmbeddedServer], clients: Callable[..., Client]) -> None:
    primary = servers(config=ServerConfig(replica_backlog=64 << 10))
    c = clients(primary.port)
    c.replay_open("r", max_size=100, seed=3)
    fill(c, "r", 0, 10)
    with ChaosProxy(("127.0.0.1", primary.port)) as proxy:
        replica = servers(replica_of=f"127.0.0.1:{proxy.port}")
        wait_until(lambda: synced(primary, replica), TIMEOUT, "the first copy")
        assert repl(c)["full_resyncs"] == 1
        proxy.cut_all()
        keys = fill(c, "r", 10, 10)  # a little: the backlog still has it
        c.replay_update("r", keys, [0.5] * 10)
        c.replay_sample("r", 5)
        wait_until(lambda: repl(c)["partial_resyncs"] >= 1 and synced(primary, replica),
                   TIMEOUT, "a partial resync")
        assert repl(c)["full_resyncs"] == 1
        proxy.pause_accepting()
        proxy.cut_all()
        wait_until(lambda: not repl(c)["replicas"], TIMEOUT, "the replica gone")
        blob = torch.zeros(8 << 10)  # 32 KiB an item: past the backlog
        c.replay_open("big", max_size=4)
        for i in range(12):
            c.replay_insert("big", [blob + i], [1.0])
        c.replay_sample("r", 7)
        proxy.resume_accepting()
        wait_until(lambda: repl(c)["full_resyncs"] == 2 and synced(primary, replica),
                   TIMEOUT, "a full copy again")


def test_a_replica_keeps_the_replay_bins_in_its_own_data_directory(
        servers: Callable[..., EmbeddedServer], clients: Callable[..., Client],
        tmp_path: Path) -> None:
    primary, c, replica = following(servers, clients, tmp_path, "b")
    keys = fill(c, "r", 8, 5)  # records after its copy's snapshot: in its data log
    c.replay_update("r", keys, [4.0] * 5)
    c.replay_sample("r", 3)
    wait_until(lambda: synced(primary, replica), TIMEOUT, "the records")
    want = replays(primary)
    replica.stop()
    # Started again without a primary, from its own directory: the same bins.
    alone = servers(config=ServerConfig(data_dir=str(tmp_path / "b")))
    assert replays(alone) == want
    a = clients(alone.port)
    assert a.replay_sample("r", 4).keys.tolist() == c.replay_sample("r", 4).keys.tolist()


def test_the_old_primary_made_a_replica_takes_the_new_primarys_replay_bins_whole(
        servers: Callable[..., EmbeddedServer], clients: Callable[..., Client],
        tmp_path: Path) -> None:
    a, ca, b = following(servers, clients, tmp_path)
    cb = clients(b.port)
    assert cb.promote() == 1
    fill(cb, "r", 8, 3)  # on the new primary only
    # Writes that the old primary took after the failover (nobody told it): they go.
    ca.replay_open("only_a", max_size=5)
    fill(ca, "r", 100, 6)
    a.stop()
    old = servers(config=ServerConfig(data_dir=str(tmp_path / "a"),
                                      replica_of=f"127.0.0.1:{b.port}"))
    wait_until(lambda: synced(b, old), TIMEOUT, "the old primary follows the new one")
    assert set(replays(old)) == {"r", "nbytes"}  # its own bin is gone, its cost with it
    assert sorted(row[0] for row in replays(old)["r"][1]["items"]) == list(range(1, 12))


def test_a_primary_short_of_replicas_refuses_replay_writes_and_answers_replay_info(
        servers: Callable[..., EmbeddedServer], clients: Callable[..., Client]) -> None:
    from tensorshare.errors import NotEnoughReplicas

    primary = servers(config=ServerConfig(min_replicas=1, replica_timeout=5.0))
    c = clients(primary.port)
    with pytest.raises(NotEnoughReplicas):
        c.replay_open("r", max_size=10)  # no replica in sync: refused, not applied
    replica = servers(replica_of=f"127.0.0.1:{primary.port}")
    wait_until(lambda: c.wait_replicas(1, 1.0) == 1, TIMEOUT, "the replica in sync")
    c.replay_open("r", max_size=10, seed=2)
    fill(c, "r", 0, 4)  # each answered once the replica has it
    assert synced(primary, replica)
    replica.stop()
    wait_until(lambda: not repl(c)["replicas"], TIMEOUT, "the replica gone")
    with pytest.raises(NotEnoughReplicas):
        c.replay_sample("r", 2)
    assert c.replay_info("r").size == 4  # a read: it goes on
    assert replays(primary)["r"][1]["counters"]["samples"] == 0
