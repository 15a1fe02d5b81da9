"""Without ``--min-replicas`` a failover may lose the last acknowledged writes: at most what the
replica's lag in ``stats`` said (README: Replication and failover).

A primary and one asynchronous replica, real processes; the replica follows through the chaos
proxy, which holds every piece back a while, so it is really behind. Producers append and stop;
the primary's ``stats`` say how far behind the replica is (``lag_bytes``: bytes of records it
has not acknowledged); at once the primary is killed with ``kill -9`` and the replica promoted.
What the promoted replica lacks is within that lag: its offset is at most ``lag_bytes`` short
of the primary's, and the acknowledged appends missing there are no more records than fit in
those bytes. Nothing waits on a sleep.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from tensorshare import Client
from tensorshare.errors import TensorShareError
from tests.chaos import HOST, ChaosProxy, Faults, ServerProcess
from tests.conftest import wait_until

TIMEOUT = 20.0
PRODUCERS = 4


@pytest.fixture
def primary() -> Iterator[ServerProcess]:
    p = ServerProcess(0)
    try:
        yield p
    finally:
        p.close()


def _value(k: int, i: int) -> torch.Tensor:
    """Producer ``k``'s ``i``-th append: 1 KiB, the same size every time (so is its record,
    but for the growing numbers in it), its identity in its first element."""
    t = torch.zeros(256, dtype=torch.float32)
    t[0] = k * 1_000_000 + i
    return t


def test_a_failover_without_min_replicas_loses_at_most_the_lag_stats_showed(
        primary: ServerProcess) -> None:
    with ChaosProxy(primary.address, faults=Faults(delay_seconds=(0.3, 0.3))) as proxy:
        replica = ServerProcess(0, "--replica-of", f"{HOST}:{proxy.port}")
        try:
            _run(primary, replica)
        finally:
            replica.close()


def _run(primary: ServerProcess, replica: ServerProcess) -> None:
    c = Client(HOST, primary.port, timeout=TIMEOUT)
    r = Client(HOST, replica.port, timeout=TIMEOUT)
    wait_until(lambda: r.stats()["server"]["replication"]["synced"], TIMEOUT, "in sync")
    # The fewest bytes an append's record takes in the log (its numbers only grow).
    record = []
    for i in range(5):
        before = c.stats()["server"]["replication"]["offset"]
        c.append("q", _value(9, i))
        record.append(c.stats()["server"]["replication"]["offset"] - before)
    smallest = min(record)
    assert smallest > 1024, record
    clients = [Client(HOST, primary.port, timeout=TIMEOUT) for _ in range(PRODUCERS)]
    acked: list[list[int]] = [[] for _ in range(PRODUCERS)]

    def produce(n: int) -> None:
        """Each producer appends ``n`` more, all at once."""

        def run(k: int) -> None:
            for _ in range(n):
                i = len(acked[k])
                clients[k].append("q", _value(k, i))
                acked[k].append(k * 1_000_000 + i)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(PRODUCERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
            assert not t.is_alive()

    # A first part the replica acknowledges (so that what is lost is a part, not all) ...
    start = c.stats()["server"]["replication"]["offset"]
    produce(50)

    def replica_has_some() -> bool:
        (link,) = c.stats()["server"]["replication"]["replicas"]
        return bool(link["offset"] >= start + 100 * smallest)

    wait_until(replica_has_some, TIMEOUT, "the replica following the writes")
    # ... then a burst that the proxy still holds back when the primary dies.
    produce(100)
    # Every producer is done: what stats says now is what a kill loses at most.
    info = c.stats()["server"]["replication"]
    primary.kill()
    offset, (link,) = info["offset"], info["replicas"]
    lag = link["lag_bytes"]
    assert lag == offset - link["offset"] and link["lag_s"] >= 0
    assert lag >= 4 * smallest, f"the replica was not behind ({lag} bytes): nothing tested"
    applied = r.stats()["server"]["replication"]["offset"]  # the replica's, before promotion
    assert offset - lag <= applied <= offset
    assert r.promote() == 1
    have = [int(t[0]) for t in r.peek("q", max_items=None)]
    assert len(have) == len(set(have)), "an append applied twice"
    missing = {x for xs in acked for x in xs} - set(have)
    # The missing appends are the records after the replica's offset: within the lag.
    assert len(missing) * smallest <= offset - applied <= lag, (len(missing), lag)
    # ... and they are each producer's last ones (the log's order): none older is missing.
    for xs in acked:
        lost = [x for x in xs if x in missing]
        assert lost == xs[len(xs) - len(lost):]
    for x in clients + [c, r]:
        try:
            x.close()
        except TensorShareError:
            pass
