"""Chaos tests of elastic sessions: real clients through a fault-injecting proxy.

Every client reaches the server through :class:`tests.chaos.ChaosProxy`, which cuts its
connections at random moments, in both directions and in the middle of frames. The tests check
the promise of sessions from the outside: every item arrives exactly once while connections
drop; when the server itself dies (SIGKILL, no persistence) nothing is delivered twice, the
only errors are ``SessionLost`` for calls in flight at the kill, and only items the dead server
held are missing; a listener that was away gets one ``resync`` event; ``reconnect=False``
still fails at the first cut.

Each run prints its seed in assertion messages; ``TENSORSHARE_CHAOS_SEED=<seed>`` replays the
same faults. Nothing waits on a sleep: conditions are polled with deadlines, every thread is
joined with a deadline, every process is killed in ``finally``.
"""

from __future__ import annotations

import collections
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tensorshare import Client, EmbeddedServer
from tensorshare.errors import ConnectionLost, SessionLost, WaitTimeout
from tests.chaos import HOST, ChaosProxy, Faults, ServerProcess, chaos_seed
from tests.conftest import wait_until
from tests.system.conftest import closed_after

BIN = "q"
DEADLINE = 90.0  # for a whole run (joins, polls); far above its ~5 s, below pytest's 120 s
GET_WAIT = 0.25  # a consumer's get waits this long for data


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture
def seed() -> int:
    return chaos_seed()


@pytest.fixture
def proxies(seed: int) -> Iterator[Callable[[tuple[str, int]], ChaosProxy]]:
    yield from closed_after(lambda target: ChaosProxy(target, seed=seed))


# ------------------------------------------------------------------------------ helpers


def start_thread(fn: Callable[..., None], *args: Any, name: str) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, name=name, daemon=True)
    t.start()
    return t


def join_all(threads: list[threading.Thread], deadline: float, what: str,
             info: Callable[[], str]) -> None:
    """Join ``threads`` by ``deadline``; fail with ``info()`` and the stuck threads' stacks."""
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.0))
    alive = [t for t in threads if t.is_alive()]
    if alive:
        frames = sys._current_frames()
        stacks = "\n".join(
            f"--- {t.name}:\n" + "".join(traceback.format_stack(frames[t.ident])[-6:])
            for t in alive[:3] if t.ident in frames)
        raise AssertionError(f"{what} still running after the deadline: "
                             f"{[t.name for t in alive]}; {info()}\n{stacks}")


@dataclass
class Ledger:
    """What producers and consumers saw, recorded from many threads.

    Attributes:
        started: calls begun so far, by op ("append", "get").
        acked: ``(item, version, t0, t1)`` for each append that returned.
        lost_appends: ``(item, t0, t1)`` for each append that raised SessionLost.
        lost_gets: ``(t0, t1)`` for each get that raised SessionLost.
        delivered: every item a get returned (duplicates kept).
        errors: every other exception, described.
    """

    lock: threading.Lock = field(default_factory=threading.Lock)
    started: collections.Counter[str] = field(default_factory=collections.Counter)
    acked: list[tuple[int, int, float, float]] = field(default_factory=list)
    lost_appends: list[tuple[int, float, float]] = field(default_factory=list)
    lost_gets: list[tuple[float, float]] = field(default_factory=list)
    delivered: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    producers_done: threading.Event = field(default_factory=threading.Event)

    def summary(self) -> str:
        with self.lock:
            return (f"begun={dict(self.started)} acked={len(self.acked)} "
                    f"delivered={len(self.delivered)} lost_appends={len(self.lost_appends)} "
                    f"lost_gets={len(self.lost_gets)} errors={self.errors[:5]}")

    def begin(self, op: str) -> float:
        with self.lock:
            self.started[op] += 1
        return time.monotonic()


def item_value(producer: int, item: int) -> torch.Tensor:
    return torch.tensor([producer, item])


def produce(c: Client, ledger: Ledger, producer: int, items: range, deadline: float) -> None:
    """Append ``items`` (each a tensor ``[producer, item]``) one at a time; record outcomes."""
    for item in items:
        if time.monotonic() > deadline:
            with ledger.lock:
                ledger.errors.append(f"producer {producer} gave up at item {item} (deadline)")
            return
        t0 = ledger.begin("append")
        try:
            version = c.append(BIN, item_value(producer, item))
        except SessionLost:
            with ledger.lock:
                ledger.lost_appends.append((item, t0, time.monotonic()))
        except Exception as exc:
            with ledger.lock:
                ledger.errors.append(f"producer {producer}: append of item {item} raised "
                                     f"{exc!r}")
        else:
            with ledger.lock:
                ledger.acked.append((item, version, t0, time.monotonic()))


def consume(c: Client, ledger: Ledger, consumer: int, max_items: int, n_producers: int,
            deadline: float) -> None:
    """Get batches until, after every producer finished, a get finds the bin empty.

    A ``WaitTimeout`` is the server's ordinary answer to a waiting get that found no data in
    time; it is how a consumer learns that the bin is drained, not a failure.
    """
    while time.monotonic() < deadline:
        finished = ledger.producers_done.is_set()
        t0 = ledger.begin("get")
        try:
            batch = c.get(BIN, max_items=max_items, timeout=GET_WAIT)
        except WaitTimeout:
            if finished:
                return  # empty after the last append: nothing more will come
            continue
        except SessionLost:
            with ledger.lock:
                ledger.lost_gets.append((t0, time.monotonic()))
            continue
        except Exception as exc:
            with ledger.lock:
                ledger.errors.append(f"consumer {consumer}: get raised {exc!r}")
            continue
        got = []
        for t in batch:
            producer, item = (int(x) for x in t.tolist())
            if item % n_producers != producer:
                with ledger.lock:
                    ledger.errors.append(f"consumer {consumer}: corrupt item {t!r}")
            got.append(item)
        with ledger.lock:
            ledger.delivered.extend(got)
    with ledger.lock:
        ledger.errors.append(f"consumer {consumer} gave up (deadline)")


def duplicates(delivered: list[int]) -> dict[int, int]:
    return {item: n for item, n in collections.Counter(delivered).items() if n > 1}


def sample(items: set[int] | dict[int, int], n: int = 20) -> list[Any]:
    return sorted(items)[:n] if isinstance(items, set) else sorted(items.items())[:n]


# ------------------------------------------------------------------------------ the harness


def test_the_proxy_forwards_in_order_and_cuts_exactly_at_the_byte_budget(seed: int) -> None:
    """The harness itself: chunked, delayed bytes arrive intact; a budget cut comes after
    exactly that many bytes; refused and cut connections are counted."""
    with socket.create_server((HOST, 0)) as backend:
        backend.settimeout(DEADLINE)
        target = backend.getsockname()[:2]
        with ChaosProxy(target, seed=seed, faults=Faults(
                chunk_bytes=(1, 700), delay_seconds=(0.0, 0.002))) as proxy:
            data = bytes(range(256)) * 200
            with socket.create_connection(proxy.address, timeout=DEADLINE) as c:
                s, _ = backend.accept()
                with s:
                    s.settimeout(DEADLINE)
                    c.sendall(data)
                    got = b""
                    while len(got) < len(data):
                        got += s.recv(65536)
                    assert got == data, proxy.describe()
                    proxy.set_faults(Faults(cut_after_bytes=(1000, 1000), reset_probability=0))
                    s.sendall(data[:5000])  # only the first 1000 bytes get through, then EOF
                    c.settimeout(DEADLINE)
                    back = b""
                    while chunk := c.recv(65536):
                        back += chunk
                    assert back == data[:1000], proxy.describe()
            stats = proxy.stats()
            assert stats["cuts"] == stats["mid_stream"] == 1 and stats["accepted"] == 1, stats
            proxy.pause_accepting()
            # Reset by the proxy: seen at the first read, or already at the connect when the
            # reset arrives before connect() returns.
            with pytest.raises(ConnectionResetError):
                with socket.create_connection(proxy.address, timeout=DEADLINE) as c:
                    c.settimeout(DEADLINE)
                    while c.recv(1):
                        pass
            assert proxy.stats()["refused"] == 1
            assert proxy.live() == 0
            # Half-open: the client's side is cut, the server's stays open until cut_all.
            proxy.resume_accepting()
            proxy.set_faults(Faults(cut_after_bytes=(10, 10), reset_probability=0,
                                    half_open_probability=1))
            with socket.create_connection(proxy.address, timeout=DEADLINE) as c:
                s, _ = backend.accept()
                with s:
                    s.settimeout(DEADLINE)
                    c.settimeout(DEADLINE)
                    c.sendall(data[:100])
                    got = b""
                    while len(got) < 10:
                        got += s.recv(65536)
                    assert got == data[:10]
                    assert c.recv(1) == b""  # the client sees the end
                    assert proxy.stats()["half_open"] == 1 and proxy.live() == 1
                    s.sendall(data[:100])  # still open on the server's side
                    assert proxy.cut_all() == 1
                    try:
                        assert s.recv(100) == b""
                    except ConnectionResetError:
                        pass
            assert proxy.live() == 0


# ------------------------------------------------------------------------------ a. exactly once


@pytest.mark.long
def test_every_item_arrives_exactly_once_through_a_cutting_proxy(
        server: EmbeddedServer, proxies: Callable[[tuple[str, int]], ChaosProxy],
        clients: Callable[..., Client]) -> None:
    n_producers, n_consumers, n_items, max_items = 16, 4, 10_000, 16
    proxy = proxies((HOST, server.port))
    # One proxy port per client, so that the counters say how often each one was cut.
    ports = [proxy.port] + [proxy.open_port() for _ in range(n_producers + n_consumers - 1)]
    # Connect before any fault: a first handshake that fails is a ConnectError by design.
    conns = [clients(port) for port in ports]
    # Mostly cuts by bytes, so that the number of cuts follows the work done, not the speed
    # of the machine; cuts by time catch the quiet moments (a consumer's waiting get).
    proxy.set_faults(Faults(cut_after_bytes=(1_000, 20_000), cut_after_seconds=(0.5, 3.0),
                            reset_probability=0.5, half_open_probability=0.2,
                            chunk_bytes=(1, 4096)))
    ledger = Ledger()
    deadline = time.monotonic() + DEADLINE
    producers = [start_thread(produce, conns[p], ledger, p, range(p, n_items, n_producers),
                              deadline, name=f"producer-{p}") for p in range(n_producers)]
    consumers = [start_thread(consume, conns[n_producers + k], ledger, k, max_items,
                              n_producers, deadline, name=f"consumer-{k}")
                 for k in range(n_consumers)]

    def progress() -> str:
        return f"{proxy.describe()} {ledger.summary()}"

    join_all(producers, deadline, "producers", progress)
    ledger.producers_done.set()
    join_all(consumers, deadline, "consumers", progress)
    proxy.set_faults(Faults())
    per_client = [proxy.stats(port) for port in ports]
    info = proxy.describe()

    assert not ledger.errors, f"{info}: {ledger.errors[:10]}"
    assert not ledger.lost_appends and not ledger.lost_gets, info
    assert len(ledger.acked) == n_items, info
    dup = duplicates(ledger.delivered)
    assert not dup, f"{info}: items delivered more than once (item: times): {sample(dup)}"
    missing = set(range(n_items)) - set(ledger.delivered)
    assert not missing, f"{info}: {len(missing)} items never delivered: {sample(missing)}"
    assert len(ledger.delivered) == n_items, info
    # Every client was cut and came back several times.
    assert min(s["accepted"] for s in per_client) >= 4, f"{info}: {per_client}"
    assert sum(s["cuts"] for s in per_client) >= 4 * len(ports), info
    assert sum(s["mid_stream"] for s in per_client) >= len(ports), info
    assert sum(s["half_open"] for s in per_client) >= 1, info
    # The server agrees: the bin is gone, seen directly and through the proxy.
    direct = clients(server.port)
    assert BIN not in direct.list(), info
    assert BIN not in conns[0].list(), info


# ------------------------------------------------------------------------------ b. server killed


@pytest.mark.long
def test_a_server_killed_and_restarted_loses_only_what_it_held(
        procs: Callable[..., ServerProcess],
        proxies: Callable[[tuple[str, int]], ChaosProxy], clients: Callable[..., Client]) -> None:
    """SIGKILL the server in the middle of the run, restart it (no persistence).

    Which server acknowledged each append is read from the version it returned: before any
    client reaches the new server, the test raises the bin's version there above every
    version the old server can have given (each append or get bumps it at most once, a get
    given back by a cancel once more, so ``appends begun + 2 * gets begun`` bounds it). An
    append that returned a version at or below that bound was stored by the old server.
    """
    n_producers, n_consumers, n_items, max_items = 16, 4, 4_000, 16
    srv = procs()
    proxy = proxies(srv.address)
    ports = [proxy.port] + [proxy.open_port() for _ in range(n_producers + n_consumers - 1)]
    conns = [clients(port) for port in ports]
    proxy.set_faults(Faults(cut_after_bytes=(2_000, 40_000), cut_after_seconds=(0.5, 3.0),
                            half_open_probability=0.2, delay_seconds=(0.0, 0.001)))
    ledger = Ledger()
    deadline = time.monotonic() + DEADLINE
    producers = [start_thread(produce, conns[p], ledger, p, range(p, n_items, n_producers),
                              deadline, name=f"producer-{p}") for p in range(n_producers)]
    consumers = [start_thread(consume, conns[n_producers + k], ledger, k, max_items,
                              n_producers, deadline, name=f"consumer-{k}")
                 for k in range(n_consumers)]

    wait_until(lambda: len(ledger.acked) >= n_items // 2, deadline - time.monotonic(),
               "half of the appends")
    proxy.pause_accepting()  # nobody reaches the new server before the versions are raised
    kill_began = time.monotonic()
    srv.kill()
    killed = time.monotonic()
    with ledger.lock:
        bound = ledger.started["append"] + 2 * ledger.started["get"]
    proxy.cut_all()
    # From now on a call is queued until its client reaches the new server: only calls begun
    # before their client noticed the loss were sent to the old server (maybe after it died,
    # on a connection the client still believed in), and only those can end in SessionLost.
    wait_until(lambda: not any(c.connected for c in conns), deadline - time.monotonic(),
               "every client to notice")
    noticed = time.monotonic()
    try:
        srv.restart()  # the same port
    except RuntimeError:  # someone took the port meanwhile: a new one, and retarget
        srv.restart(same_port=False)
        proxy.set_target(srv.address)
    direct = clients(srv.port)
    calls = [direct.begin_put(BIN, 0) for _ in range(bound)]
    assert [c.result() for c in calls][-1] == bound
    assert direct.delete(BIN)
    proxy.resume_accepting()

    def progress() -> str:
        return f"{proxy.describe()} {ledger.summary()}"

    join_all(producers, deadline, "producers", progress)
    ledger.producers_done.set()
    join_all(consumers, deadline, "consumers", progress)
    proxy.set_faults(Faults())
    info = (f"{proxy.describe()} kill at {kill_began:.3f}-{killed:.3f}, all clients "
            f"disconnected at {noticed:.3f}, version bound {bound}")

    assert not ledger.errors, f"{info}: {ledger.errors[:10]}"
    # SessionLost only for calls in flight at the kill: begun before the clients noticed.
    late = [r for r in ledger.lost_appends if r[1] >= noticed]
    late_gets = [r for r in ledger.lost_gets if r[0] >= noticed]
    assert not late and not late_gets, (f"{info}: SessionLost for calls begun after every "
                                        f"client was disconnected: {late[:5]} {late_gets[:5]}")
    assert len(ledger.acked) + len(ledger.lost_appends) == n_items, info
    # The classification by version agrees with time where time is unambiguous.
    old = {item for item, v, _, _ in ledger.acked if v <= bound}
    wrong = [(item, v) for item, v, _, t1 in ledger.acked if t1 < kill_began and v > bound] + \
            [(item, v) for item, v, t0, _ in ledger.acked if t0 > killed and v <= bound]
    assert not wrong, f"{info}: versions contradict the timeline: {wrong[:10]}"
    dup = duplicates(ledger.delivered)
    assert not dup, f"{info}: items delivered more than once (item: times): {sample(dup)}"
    delivered = set(ledger.delivered)
    assert delivered <= set(range(n_items)), info
    missing = set(range(n_items)) - delivered
    may_be_missing = old | {item for item, _, _ in ledger.lost_appends}
    unexplained = missing - may_be_missing
    assert not unexplained, (
        f"{info}: {len(unexplained)} items missing that the old server never held "
        f"(acknowledged by the new server): {sample(unexplained)}")
    # Items taken by a get that raised SessionLost died with the old server's session; the
    # rest of the missing items were in its bin.
    assert len(missing) <= len(old) + len(ledger.lost_appends), info
    assert BIN not in direct.list(), info
    assert BIN not in conns[0].list(), info
    assert proxy.stats()["cuts"] >= len(ports), info


# ------------------------------------------------------------------------------ c. listener resync


def test_a_listener_cut_off_while_the_bin_changed_gets_one_resync_with_the_latest_version(
        server: EmbeddedServer, proxies: Callable[[tuple[str, int]], ChaosProxy],
        clients: Callable[..., Client]) -> None:
    proxy = proxies((HOST, server.port))
    writer = clients(server.port)
    listener = clients(proxy.port)
    cond = threading.Condition()
    events: list[dict[str, Any]] = []

    def on_change(ev: dict[str, Any]) -> None:
        with cond:
            events.append(ev)

    def seen(pred: Callable[[dict[str, Any]], bool]) -> bool:
        with cond:
            return any(pred(e) for e in events)

    writer.put("w", torch.zeros(4))
    listener.listen("w", on_change)
    v = writer.put("w", torch.ones(4))
    wait_until(lambda: seen(lambda e: e["version"] == v), DEADLINE, "the first event")

    proxy.pause_accepting()
    assert proxy.cut_all() == 1, proxy.describe()
    wait_until(lambda: not listener.connected, DEADLINE, "the listener to notice the cut")
    away = [writer.put("w", torch.full((4,), float(k))) for k in range(5)]
    away.append(writer.append("w", torch.zeros(1)))  # the bin now holds two items
    latest = away[-1]
    assert not listener.connected, proxy.describe()
    proxy.resume_accepting()
    wait_until(lambda: seen(lambda e: e["op"] == "resync"), DEADLINE, "the resync event")
    after = writer.put("w", torch.ones(4))
    wait_until(lambda: seen(lambda e: e["version"] == after), DEADLINE, "the next event")

    with cond:
        got = list(events)
    info = f"{proxy.describe()} events={got}"
    resyncs = [e for e in got if e["op"] == "resync"]
    assert len(resyncs) == 1, info
    assert resyncs[0]["version"] == latest and resyncs[0]["n_items"] == 2, info
    assert "restarted" not in resyncs[0], info
    versions = [e["version"] for e in got]
    assert versions == sorted(set(versions)), f"versions went backwards or repeated: {info}"
    assert not set(versions) & set(away[:-1]), f"changes made while away were replayed: {info}"
    assert versions[-1] == after and got[-1]["op"] == "put", info
    assert proxy.stats()["accepted"] >= 2, info


# ------------------------------------------------------------------------------ d. no reconnect


def test_without_reconnect_the_first_cut_is_connection_lost(
        server: EmbeddedServer, proxies: Callable[[tuple[str, int]], ChaosProxy],
        clients: Callable[..., Client]) -> None:
    proxy = proxies((HOST, server.port))
    c = clients(proxy.port, reconnect=False, timeout=10.0)
    c.put("keep", torch.ones(3))
    waiting = c.begin_fetch("never", remove=True, timeout=None)
    c.ping()  # the waiting get is on the server
    proxy.set_faults(Faults(cut_after_bytes=(1, 3_000), reset_probability=0.5))
    with pytest.raises(ConnectionLost) as info:
        for i in range(100_000):
            c.append("y", torch.tensor([i]))
    assert type(info.value) is ConnectionLost, repr(info.value)
    with pytest.raises(ConnectionLost) as info:
        waiting.result()
    assert type(info.value) is ConnectionLost, repr(info.value)
    assert c.closed and not c.connected
    with pytest.raises(ConnectionLost):
        c.get("keep")
    stats = proxy.stats()
    assert stats["accepted"] == 1 and stats["cuts"] == 1, proxy.describe()
    direct = clients(server.port)
    assert torch.equal(direct.get("keep"), torch.ones(3))
