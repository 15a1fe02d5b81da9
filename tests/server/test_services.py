"""Service bins on a real server (127.0.0.1, port 0) through the blocking client's ops:
batching rules, leases, exactly one answer per call, the bounded queue, sessions across
cut connections (the chaos proxy), and what the stats say."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import msgpack
import pytest
import torch
from twisted.internet.testing import MemoryReactorClock

from tensorshare import BinFull, Client, EmbeddedServer, InvalidRequest, ServiceFailed, WaitTimeout
from tensorshare.server import ServerConfig
from tensorshare.server.core import ServerFactory
from tensorshare.server.services import CALL_COST, SERVICE_COST
from tensorshare.wire import codec
from tensorshare.wire.frames import encode_frame
from tensorshare.wire.messages import Acked, ErrorReply, Item
from tensorshare.wire.protocol import item_wire_size
from tensorshare.wire.services import (
    MAX_BATCH,
    ServiceBatch,
    ServiceCall,
    ServiceReply,
    ServiceTake,
)
from tests.chaos import ChaosProxy, Faults
from tests.conftest import wait_until
from tests.server.test_connection import Peer

DEADLINE = 10.0
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def clients(server: EmbeddedServer) -> Iterator[tuple[Client, Client]]:
    """A caller and a host on one server."""
    with Client("127.0.0.1", server.port, timeout=DEADLINE) as caller, \
            Client("127.0.0.1", server.port, timeout=DEADLINE) as host:
        yield caller, host


def _calls(c: Client, name: str, values: list[torch.Tensor], **kw: float) -> list[Future]:
    return [c._submit_future(c.service_call_command(name, v, **kw)) for v in values]


def _service(c: Client, name: str) -> dict:
    """The service's summary in the stats (``{}`` while no request has made it)."""
    return c.stats(name)["bins"].get(name, {})


@pytest.mark.timeout(30)
def test_a_call_gets_the_answer_the_host_made_for_it(clients: tuple[Client, Client]) -> None:
    caller, host = clients
    fut = _calls(caller, "svc", [torch.arange(3.0)])[0]
    b = host.service_take("svc", timeout=5)
    assert [v.tolist() for v in b.values] == [[0.0, 1.0, 2.0]] and b.rows == (1,)
    assert host.service_reply("svc", b.batch, [b.values[0] * 10], version=4) is True
    res = fut.result(DEADLINE)
    assert res.value.tolist() == [0.0, 10.0, 20.0] and res.version == 4
    st = _service(caller, "svc")
    assert st["kind"] == "service" and st["service"]["answered"] == 1


@pytest.mark.timeout(30)
def test_a_host_that_waited_takes_the_first_call_at_once(clients: tuple[Client, Client]) -> None:
    caller, host = clients
    got: list = []
    t = threading.Thread(target=lambda: got.append(
        host.service_take("svc", max_batch=64, max_wait_ms=5000, timeout=8)))
    t.start()
    # (The take comes on the host's connection: the service may not exist yet.)
    wait_until(lambda: _service(caller, "svc").get("waiters") == 1, DEADLINE, "the take waits")
    start = time.monotonic()
    _calls(caller, "svc", [torch.zeros(1)])
    t.join(DEADLINE)
    # max_wait_ms is 5 s: a lone call that found a waiting host did not wait for a batch.
    assert got and len(got[0].values) == 1 and time.monotonic() - start < 4.0


@pytest.mark.timeout(30)
def test_queued_calls_come_in_batches_of_at_most_max_batch_rows(
        clients: tuple[Client, Client]) -> None:
    caller, host = clients
    futs = _calls(caller, "svc", [torch.full((1,), float(i)) for i in range(10)])
    wait_until(lambda: _service(caller, "svc")["n_items"] == 10, DEADLINE, "10 queued")
    sizes, seen = [], []
    while len(seen) < 10:
        b = host.service_take("svc", max_batch=4, max_wait_ms=0, timeout=5)
        sizes.append(len(b.values))
        seen += [int(v.item()) for v in b.values]
        host.service_reply("svc", b.batch, [v + 100 for v in b.values])
    assert sizes == [4, 4, 2] and seen == list(range(10))  # oldest first
    assert [int(f.result(DEADLINE).value.item()) for f in futs] == list(range(100, 110))


@pytest.mark.timeout(30)
def test_a_host_back_from_a_batch_waits_at_most_max_wait_ms_for_more(
        clients: tuple[Client, Client]) -> None:
    caller, host = clients
    _calls(caller, "svc", [torch.zeros(1)])
    wait_until(lambda: _service(caller, "svc")["n_items"] == 1, DEADLINE, "1 queued")
    start = time.monotonic()
    b = host.service_take("svc", max_batch=8, max_wait_ms=300, timeout=5)
    took = time.monotonic() - start
    # One call queued before the take (not a waiting host): the take waited for more, but no
    # longer than 300 ms after the call came.
    assert len(b.values) == 1 and took < 3.0
    host.service_reply("svc", b.batch, [b.values[0]])


@pytest.mark.timeout(30)
def test_a_batch_whose_lease_runs_out_goes_to_another_host_and_is_answered_once(
        server: EmbeddedServer) -> None:
    with Client("127.0.0.1", server.port) as caller, Client("127.0.0.1", server.port) as h1, \
            Client("127.0.0.1", server.port) as h2:
        fut = _calls(caller, "svc", [torch.ones(2)])[0]
        b1 = h1.service_take("svc", lease=0.3, timeout=5)
        b2 = h2.service_take("svc", timeout=5)  # after the lease: the same call again
        assert [v.tolist() for v in b2.values] == [[1.0, 1.0]] and b2.batch != b1.batch
        assert h2.service_reply("svc", b2.batch, [torch.full((2,), 2.0)]) is True
        assert h1.service_reply("svc", b1.batch, [torch.full((2,), 1.0)]) is False  # late
        assert fut.result(DEADLINE).value.tolist() == [2.0, 2.0]
        st = _service(caller, "svc")["service"]
        assert st["answered"] == 1 and st["requeued"] == 1


@pytest.mark.timeout(30)
def test_a_host_whose_connection_drops_gives_its_calls_back_at_once(
        server: EmbeddedServer) -> None:
    with Client("127.0.0.1", server.port) as caller, Client("127.0.0.1", server.port) as h2:
        fut = _calls(caller, "svc", [torch.ones(1)])[0]
        h1 = Client("127.0.0.1", server.port)
        h1.service_take("svc", lease=600, timeout=5)
        h1.close()  # before answering: a 600 s lease must not keep the call
        b = h2.service_take("svc", timeout=5)
        h2.service_reply("svc", b.batch, [b.values[0] * 3])
        assert fut.result(DEADLINE).value.tolist() == [3.0]


# A host in its own process: takes one batch of two calls and holds it until it is killed.
HOLDING_HOST = textwrap.dedent("""
    import sys
    from tensorshare import Client
    c = Client("127.0.0.1", int(sys.argv[1]), timeout=30)
    b = c.service_take("svc", max_batch=2, max_wait_ms=0, timeout=20, lease=600)
    print("TOOK", *[int(v.item()) for v in b.values], flush=True)
    sys.stdin.readline()  # holds the batch (never answered) until SIGKILL
""")


def _take_in_order(host: Client, n: int) -> list[list[int]]:
    """Take batches of at most 2 calls until ``n`` calls came; answer each with value + 100;
    return each batch's values."""
    batches: list[list[int]] = []
    while sum(map(len, batches)) < n:
        b = host.service_take("svc", max_batch=2, max_wait_ms=0, timeout=5)
        batches.append([int(v.item()) for v in b.values])
        host.service_reply("svc", b.batch, [v + 100 for v in b.values])
    return batches


@pytest.mark.alone  # (its host process and its queue's order: not beside a parallel run)
@pytest.mark.timeout(60)
def test_a_killed_hosts_calls_go_back_before_the_calls_queued_behind_them(
        clients: tuple[Client, Client]) -> None:
    # Calls 0..5 queued; a host process takes 0 and 1 and is SIGKILLed while 2..5, and then
    # 6 and 7 (queued while it held its batch), wait behind. 0 and 1 go back to the front
    # of the queue: the next host takes them first, then the others in their order.
    caller, host = clients
    # (the calls wait for as long as the test may run: the host process must start first,
    # which on a loaded machine takes more than the client's 10 s)
    futs = _calls(caller, "svc", [torch.full((1,), float(i)) for i in range(6)], timeout=50)
    wait_until(lambda: _service(caller, "svc")["n_items"] == 6, DEADLINE, "6 queued")
    proc = subprocess.Popen([sys.executable, "-c", HOLDING_HOST, str(caller.port)],
                            env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().split() == ["TOOK", "0", "1"]
        futs += _calls(caller, "svc", [torch.full((1,), float(i)) for i in (6, 7)], timeout=50)
        # (the calls' own deadline: on a loaded machine the held host's process is slow)
        try:
            wait_until(lambda: _service(caller, "svc")["n_items"] == 6, 45, "2..7 queued")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the service: {_service(caller, 'svc')}") from None
        assert _service(caller, "svc")["service"]["with_hosts"] == 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(DEADLINE)
        # The lease is 600 s: only the connection's end brings the calls back.
        wait_until(lambda: _service(caller, "svc")["n_items"] == 8, DEADLINE, "0, 1 requeued")
        assert _take_in_order(host, 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    finally:
        proc.kill()
        proc.wait(DEADLINE)
    assert [int(f.result(DEADLINE).value.item()) for f in futs] == list(range(100, 108))
    st = _service(caller, "svc")["service"]
    assert st["requeued"] == 2 and st["answered"] == 8


@pytest.mark.timeout(30)
def test_calls_whose_lease_ran_out_go_back_before_the_calls_queued_behind_them(
        server: EmbeddedServer) -> None:
    with Client("127.0.0.1", server.port) as caller, Client("127.0.0.1", server.port) as h1, \
            Client("127.0.0.1", server.port) as h2:
        futs = _calls(caller, "svc", [torch.full((1,), float(i)) for i in range(5)])
        wait_until(lambda: _service(caller, "svc")["n_items"] == 5, DEADLINE, "5 queued")
        late = h1.service_take("svc", max_batch=2, max_wait_ms=0, lease=0.3, timeout=5)
        assert [int(v.item()) for v in late.values] == [0, 1]
        wait_until(lambda: _service(caller, "svc")["service"]["requeued"] == 2, DEADLINE,
                   "the lease to run out")
        assert _take_in_order(h2, 5) == [[0, 1], [2, 3], [4]]
        assert h1.service_reply("svc", late.batch, late.values) is False  # too late: dropped
        assert [int(f.result(DEADLINE).value.item()) for f in futs] == list(range(100, 105))


@pytest.mark.timeout(30)
def test_errors_fail_only_their_calls(clients: tuple[Client, Client]) -> None:
    caller, host = clients
    futs = _calls(caller, "svc", [torch.zeros(1), torch.ones(1), torch.zeros(1)])
    wait_until(lambda: _service(caller, "svc")["n_items"] == 3, DEADLINE, "3 queued")
    b = host.service_take("svc", max_wait_ms=0, timeout=5)
    assert len(b.values) == 3
    host.service_reply("svc", b.batch, [b.values[0], None, b.values[2]],
                       failed={1: "ValueError: bad input"})
    assert futs[0].result(DEADLINE).value.tolist() == [0.0]
    with pytest.raises(ServiceFailed, match="bad input"):
        futs[1].result(DEADLINE)
    futs = _calls(caller, "svc", [torch.zeros(1)])
    b = host.service_take("svc", timeout=5)
    host.service_reply("svc", b.batch, error="RuntimeError: out of memory")
    with pytest.raises(ServiceFailed, match="out of memory"):
        futs[0].result(DEADLINE)
    # A reply with the wrong number of items is refused, and its calls fail (not hang).
    futs = _calls(caller, "svc", [torch.zeros(1)])
    b = host.service_take("svc", timeout=5)
    with pytest.raises(InvalidRequest, match="one item per call"):
        host.service_reply("svc", b.batch, [b.values[0], b.values[0]])
    with pytest.raises(ServiceFailed):
        futs[0].result(DEADLINE)


@pytest.mark.timeout(30)
def test_a_call_nobody_answers_times_out_once(clients: tuple[Client, Client]) -> None:
    caller, host = clients
    start = time.monotonic()
    with pytest.raises(WaitTimeout, match="no host took it"):
        caller.service_call("svc", torch.zeros(1), timeout=0.3)
    assert time.monotonic() - start < 5.0
    fut = _calls(caller, "svc", [torch.zeros(1)])
    b = host.service_take("svc", timeout=5)
    # A call timed out while its host had it: the host's late answer is dropped.
    caller2 = caller.service_call_command("svc", torch.ones(1), timeout=0.3)
    f2 = caller._submit_future(caller2)
    b2 = host.service_take("svc", timeout=5)
    with pytest.raises(WaitTimeout, match="a host had it"):
        f2.result(DEADLINE)
    assert host.service_reply("svc", b2.batch, [b2.values[0]]) is True
    host.service_reply("svc", b.batch, [b.values[0]])
    assert fut[0].result(DEADLINE).value.tolist() == [0.0]
    assert _service(caller, "svc")["service"]["timed_out"] == 2


@pytest.mark.timeout(30)
def test_a_full_queue_waits_for_room_or_refuses(clients: tuple[Client, Client]) -> None:
    caller, host = clients
    with pytest.raises(WaitTimeout):  # a take with max_queue sets the bound
        host.service_take("svc", max_queue=2, timeout=0)
    first = _calls(caller, "svc", [torch.zeros(1), torch.ones(1)])
    wait_until(lambda: _service(caller, "svc")["n_items"] == 2, DEADLINE, "2 queued")
    with pytest.raises(BinFull, match="max_queue=2"):
        caller.service_call("svc", torch.zeros(1), wait_room=False)
    waiting = caller._submit_future(caller.service_call_command("svc", torch.full((1,), 2.0)))
    wait_until(lambda: _service(caller, "svc")["blocked"] == 1, DEADLINE, "one waits for room")
    got = []
    while len(got) < 3:
        b = host.service_take("svc", max_wait_ms=0, timeout=5)
        got += [v.item() for v in b.values]
        host.service_reply("svc", b.batch, b.values)
    assert got == [0.0, 1.0, 2.0]
    assert [f.result(DEADLINE).value.item() for f in [*first, waiting]] == [0.0, 1.0, 2.0]


@pytest.mark.timeout(30)
def test_a_service_name_is_not_a_value_bin(clients: tuple[Client, Client]) -> None:
    caller, host = clients
    caller.put("v", 1)
    with pytest.raises(InvalidRequest, match="value or list bin"):
        caller.service_call("v", torch.zeros(1), timeout=1)
    _calls(caller, "svc", [torch.zeros(1)])
    wait_until(lambda: _service(caller, "svc")["n_items"] == 1, DEADLINE, "queued")
    with pytest.raises(InvalidRequest, match="service bin"):
        caller.put("svc", 1)


@pytest.mark.timeout(30)
def test_calls_of_a_closed_client_without_a_session_are_withdrawn(
        server: EmbeddedServer) -> None:
    with Client("127.0.0.1", server.port) as host:
        c = Client("127.0.0.1", server.port, session=False)
        _calls(c, "svc", [torch.zeros(1000)])
        wait_until(lambda: _service(host, "svc")["n_items"] == 1, DEADLINE, "queued")
        c.close()
        wait_until(lambda: _service(host, "svc")["n_items"] == 0, DEADLINE, "withdrawn")
        with pytest.raises(WaitTimeout):
            host.service_take("svc", timeout=0)


@pytest.mark.timeout(60)
def test_calls_through_cut_connections_are_answered_exactly_once() -> None:
    # Caller and host both go through a proxy that cuts their connections at random (mid
    # frame, resets, closes). Each call is answered once with its own value: a call resent
    # after a reconnect is the same call; a host cut off gives its batch back.
    with EmbeddedServer(port=0, config=ServerConfig(session_ttl=60.0)) as srv, \
            ChaosProxy(("127.0.0.1", srv.port), faults=Faults(
                cut_after_bytes=(2_000, 60_000), reset_probability=0.5),
                # The first connection of each (the host's and the caller's) is cut for sure:
                # each carries some 50 KB each way, more than this budget.
                first=(Faults(cut_after_bytes=(2_000, 20_000), reset_probability=0.5),) * 2
            ) as proxy:
        hp, cp = proxy.open_port(), proxy.open_port()
        stop = threading.Event()
        computed: list[float] = []

        def serve() -> None:
            with Client("127.0.0.1", hp, timeout=DEADLINE) as h:
                while not stop.is_set():
                    try:
                        b = h.service_take("svc", max_batch=16, timeout=0.5, lease=2.0)
                        computed.extend(v[0].item() for v in b.values)
                        h.service_reply("svc", b.batch, [v * 2 for v in b.values])
                    except (WaitTimeout, ConnectionError, TimeoutError):
                        continue

        t = threading.Thread(target=serve)
        t.start()
        try:
            with Client("127.0.0.1", cp, timeout=30.0) as c:
                n = 300
                futs = _calls(c, "svc", [torch.full((4,), float(i)) for i in range(n)])
                answers = [f.result(60) for f in futs]
        finally:
            stop.set()
            t.join(DEADLINE)
        assert [a.value.tolist() for a in answers] == [[2.0 * i] * 4 for i in range(n)]
        assert proxy.stats(cp)["accepted"] > 1 or proxy.stats(hp)["accepted"] > 1, \
            "the proxy cut nothing: the test proved nothing"
        assert set(computed) >= {2.0 * i / 2 for i in range(n)}
        with Client("127.0.0.1", srv.port) as c:
            st = _service(c, "svc")["service"]
        assert st["answered"] == n and st["calls"] == n


@pytest.mark.parametrize("header", [
    {"items": [0] * (MAX_BATCH + 1)},  # more items than a batch may have
    {"items": [0], "error": 7},  # a field of the wrong type
], ids=["too_many_items", "bad_error_field"])
def test_a_refused_service_reply_fails_every_call_of_its_batch(header: dict) -> None:
    # §3.2.24: a reply the server refuses (invalid_request) still names its batch: every call
    # of the batch fails at once (service_failed), not when the lease runs out.
    f = ServerFactory(MemoryReactorClock())
    caller, host = Peer(f), Peer(f)
    calls = [ServiceCall(caller.rid(), "svc", Item(codec.encode(i))) for i in range(2)]
    for call in calls:
        caller.send(call)
    assert caller.received() == []
    take = ServiceTake(host.rid(), "svc", max_batch=2, lease=60.0)
    batch = host.request(take)
    assert isinstance(batch, ServiceBatch) and len(batch.items) == 2
    rid = host.rid()
    host.conn.ops[rid] = "service_reply"
    host.write(b"".join(encode_frame(msgpack.packb(
        {"op": "service_reply", "id": rid, "bin": "svc", "batch": batch.batch, **header}))))
    (refused,) = host.received()
    assert isinstance(refused, ErrorReply) and refused.id == rid
    assert refused.code == "invalid_request"
    failed = caller.received()
    assert sorted(r.id for r in failed) == [c.id for c in calls]
    assert all(isinstance(r, ErrorReply) and r.code == "service_failed"
               and "service_reply was refused" in r.message for r in failed)
    stats = f.bin_stats("svc")["svc"]["service"]
    assert stats["failed"] == 2 and stats["with_hosts"] == 0 and stats["queue"] == 0
    # The host is still usable, and a late reply to that batch is dropped.
    rid = host.rid()
    late = host.request(ServiceReply(rid, "svc", batch.batch, Item(codec.encode(0)),
                                     (Item(codec.encode(1)),)))
    assert late == Acked(rid, False)


# -- a call in one hop (issue 37) --------------------------------------------------------------
def _writes(peer: Peer) -> list[int]:
    """Counts the writes the server makes to ``peer``'s transport (one per pass that sends)."""
    count = [0]
    t = peer.transport
    write, write_seq = t.write, t.writeSequence

    def counted_write(data: bytes) -> None:
        count[0] += 1
        write(data)

    def counted_seq(seq: list[bytes]) -> None:
        count[0] += 1
        write_seq(seq)

    t.write, t.writeSequence = counted_write, counted_seq  # type: ignore[method-assign]
    return count


def test_a_call_that_finds_a_take_waiting_goes_to_its_host_in_the_pass_that_read_it() -> None:
    # The clock never moves: no timer and no reactor turn stands between the call and the host,
    # nor between the host's answer and the caller.
    clock = MemoryReactorClock()
    f = ServerFactory(clock)
    caller, host = Peer(f), Peer(f)
    host.send(ServiceTake(host.rid(), "svc", max_batch=8, max_wait_ms=5000, timeout=30.0,
                          lease=60.0))
    assert host.received() == []  # waiting for work
    to_host = _writes(host)
    call = ServiceCall(caller.rid(), "svc", Item(codec.encode(torch.arange(3.0))))
    caller.send(call)  # one dataReceived on the caller's connection
    (batch,) = host.received()
    assert isinstance(batch, ServiceBatch) and len(batch.items) == 1 and to_host[0] == 1
    assert codec.decode(batch.items[0].value).tolist() == [0.0, 1.0, 2.0]
    assert caller.received() == []
    host.send(ServiceReply(host.rid(), "svc", batch.batch, Item(codec.encode(torch.ones(2)))))
    (answer,) = caller.received()  # written by the pass that read the host's answer
    assert answer.id == call.id and codec.decode(answer.items[0].value).tolist() == [1.0, 1.0]
    assert clock.seconds() == 0.0


def test_calls_read_in_one_poll_go_to_a_waiting_host_as_one_batch(server: EmbeddedServer) -> None:
    # Three callers' calls wait in their sockets while the reactor is busy; the poll that
    # reads them all hands them to the host's waiting take together (without the end of
    # the poll to wait for, the first call read would go alone).
    with Client("127.0.0.1", server.port, timeout=DEADLINE) as host:
        callers = [Client("127.0.0.1", server.port, timeout=DEADLINE) for _ in range(3)]
        try:
            take = host._submit_future(host.service_take_command("svc", max_batch=8,
                                                                 max_wait_ms=0))
            wait_until(lambda: _service(host, "svc").get("waiters") == 1, DEADLINE)
            gate, busy = threading.Event(), threading.Event()

            def hold() -> None:  # (in the reactor's thread: nothing is read meanwhile)
                busy.set()
                gate.wait(DEADLINE)

            server.reactor.callFromThread(hold)
            assert busy.wait(DEADLINE)
            calls = [_calls(c, "svc", [torch.tensor([float(i)])])[0]
                     for i, c in enumerate(callers)]  # each sent before it returns
            gate.set()
            batch = take.result(DEADLINE)
            assert sorted(v.item() for v in batch.values) == [0.0, 1.0, 2.0]
            assert host.service_reply("svc", batch.batch, [v * 2 for v in batch.values])
            assert sorted(f.result(DEADLINE).value.item() for f in calls) == [0.0, 2.0, 4.0]
        finally:
            for c in callers:
                c.close()


@pytest.mark.parametrize("max_wait_ms", [0.0, 2.0])
def test_a_host_back_from_a_batch_takes_what_queued_meanwhile_in_the_write_of_its_ack(
        max_wait_ms: float) -> None:
    # The InferenceHost's loop: its answer and its next take in one write. With max_wait_ms
    # 0 (the host's default), the calls that queued while its batch ran come back at once, in
    # the same write as the answer's ack; with more, the take waits that long for more calls.
    clock = MemoryReactorClock()
    f = ServerFactory(clock)
    caller, host = Peer(f), Peer(f)
    host.send(ServiceTake(host.rid(), "svc", max_batch=8, max_wait_ms=max_wait_ms, lease=60.0))
    first = ServiceCall(caller.rid(), "svc", Item(codec.encode(0)))
    caller.send(first)
    (batch,) = host.received()  # a host waiting for work takes the first call at once
    assert isinstance(batch, ServiceBatch) and len(batch.items) == 1
    later = [ServiceCall(caller.rid(), "svc", Item(codec.encode(i))) for i in (1, 2, 3)]
    for c in later:  # queued while the host runs its batch
        caller.send(c)
    to_host = _writes(host)
    answer = ServiceReply(host.rid(), "svc", batch.batch, Item(codec.encode(10)))
    take = ServiceTake(host.rid(), "svc", max_batch=8, max_wait_ms=max_wait_ms, lease=60.0)
    host.write(b"".join(host.conn.send(answer)) + b"".join(host.conn.send(take)))
    (answered,) = caller.received()
    assert answered.id == first.id and codec.decode(answered.items[0].value) == 10
    got = host.received()
    if max_wait_ms:
        assert got == [Acked(answer.id, True)]
        clock.advance(max_wait_ms / 1e3)
        got += host.received()
        assert to_host[0] == 2
    else:
        assert to_host[0] == 1  # the ack and the next batch in one write
    assert got[0] == Acked(answer.id, True)
    assert isinstance(got[1], ServiceBatch) and got[1].id == take.id
    assert [codec.decode(it.value) for it in got[1].items] == [1, 2, 3]


def test_the_answers_of_one_batch_to_one_caller_leave_in_one_write() -> None:
    f = ServerFactory(MemoryReactorClock())
    one, other, host = Peer(f), Peer(f), Peer(f)
    calls = [(p, ServiceCall(p.rid(), "svc", Item(codec.encode(i))))
             for i, p in enumerate([one, other, one, one])]
    for p, c in calls:
        p.send(c)
    batch = host.request(ServiceTake(host.rid(), "svc", max_batch=8, max_wait_ms=0, lease=60.0))
    assert isinstance(batch, ServiceBatch) and len(batch.items) == 4
    writes = {id(p): _writes(p) for p in (one, other)}
    items = [Item(codec.encode(10 + i)) for i in range(4)]
    host.send(ServiceReply(host.rid(), "svc", batch.batch, items[0], tuple(items[1:])))
    assert writes[id(one)][0] == 1 and writes[id(other)][0] == 1
    got = {r.id: codec.decode(r.items[0].value) for p in (one, other) for r in p.received()}
    assert got == {c.id: 10 + i for i, (_, c) in enumerate(calls)}


def test_what_a_service_costs_follows_its_calls_until_each_is_done() -> None:
    # Counted as calls come and finish (asked on every write, never summed over the queue).
    clock = MemoryReactorClock()
    f = ServerFactory(clock)
    kind = next(k for k in f.kinds if k.name == "service")
    caller, host = Peer(f), Peer(f)
    items = [Item(codec.encode(torch.zeros(n))) for n in (4, 40, 400)]
    each = [item_wire_size(it) + CALL_COST for it in items]
    calls = [ServiceCall(caller.rid(), "svc", it, timeout=5.0) for it in items]
    for c in calls:
        caller.send(c)
    assert kind.nbytes == SERVICE_COST + sum(each)
    batch = host.request(ServiceTake(host.rid(), "svc", max_batch=2, max_wait_ms=0, lease=60.0))
    assert isinstance(batch, ServiceBatch) and len(batch.items) == 2
    assert kind.nbytes == SERVICE_COST + sum(each)  # leased calls still count
    host.send(ServiceReply(host.rid(), "svc", batch.batch, items[0], (items[0],)))
    assert kind.nbytes == SERVICE_COST + each[2]
    clock.advance(5.0)  # the last call times out
    (*_, timed_out) = caller.received()
    assert isinstance(timed_out, ErrorReply) and timed_out.id == calls[2].id
    assert kind.nbytes == SERVICE_COST
