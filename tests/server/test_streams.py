"""Stream bins on the server: the pure bookkeeping (:class:`Stream`, time passed in) and the
kind that serves them (:class:`StreamKind`) on in-memory connections.

The kind's tests drive a ``ServerFactory`` on a ``MemoryReactorClock``: every connection is
a ``ServerProtocol`` on a ``StringTransport``, requests are frames a ``WireClient`` builds,
and leases and timeouts run when the test advances the clock. Nothing sleeps. The last
section runs end to end: a real server on 127.0.0.1 (port 0) and real clients, waiting for
conditions with deadlines.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.logger import globalLogPublisher
from twisted.python.failure import Failure

from tensorshare import Client, EmbeddedServer
from tensorshare.data import Lagged, StreamConsumer, StreamProducer
from tensorshare.errors import BinNotFound, InvalidRequest, LimitExceeded
from tensorshare.server import ServerConfig
from tensorshare.server.connection import ServerProtocol
from tensorshare.server.core import ServerFactory
from tensorshare.server.streams import FINISHED_TTL, MAX_CONSUMERS, Settings, Stream
from tensorshare.wire import codec
from tensorshare.wire.messages import (
    Acked,
    Append,
    Changed,
    ErrorReply,
    Hello,
    HelloReply,
    Item,
    Listen,
    Listening,
    Put,
    Stats,
    StatsReply,
)
from tensorshare.wire.protocol import PROTOCOL_VERSIONS, item_wire_size
from tensorshare.wire.streams import (
    ProducerGone,
    StreamAppend,
    StreamAppended,
    StreamEnd,
    StreamEnded,
    StreamItems,
    StreamJoin,
    StreamJoined,
    StreamLeave,
    StreamOpen,
    StreamOpened,
    StreamRead,
)
from tests.conftest import wait_until
from tests.rawwire import WireClient

# ------------------------------------------------------------------------ the pure structure

P, Q = "producer-session", "other-session"  # owners: what the kind passes (session ids)


def entries(*values: int, n: int = 1) -> list[tuple[Any, int, int]]:
    return [(Item(codec.encode(v)), 100, n) for v in values]


def values(res: StreamItems | None) -> list[int]:
    assert res is not None
    return [codec.decode(it.value) for it in res.items]


def opened(window: int = 4, producers: int = 1, **kw: Any) -> Stream:
    st = Stream("s", 0.0)
    settings = Settings(producers, window, kw.pop("on_lag", "wait"), kw.pop("max_stall", None),
                        kw.pop("replay", "none"))
    for i in range(producers):
        st.open(i, f"{P}{i}", settings, 2.0, kw.get("samples"), 0.0)
    return st


def append(st: Stream, *vals: int, producer: int = 0, now: float = 0.0) -> int:
    p = st.producers[producer]
    st.check_append(producer, p.owner, p.epoch, len(vals), now)
    assert st.append_ready(producer, len(vals))
    return st.append(producer, entries(*vals), now)


def end(st: Stream, producer: int = 0, last: bool = False, now: float = 0.0) -> Any:
    p = st.producers[producer]
    return st.end(producer, p.owner, p.epoch, p.sent, last, now)[0]


def read(st: Stream, name: str, at: int | None = None, max_items: int | None = None,
         now: float = 0.0) -> StreamItems | None:
    c, _ = st.consumer(name, st.consumers[name].owner, now)
    st.ack(c, at, now)
    return st.read(name, None, max_items, 1 << 30, now)


def test_every_consumer_gets_every_item_in_order_and_items_go_once_all_have_them() -> None:
    st = opened(window=8)
    st.join("a", "A", "now", 5.0, True, 0.0)
    st.join("b", "B", "now", 5.0, True, 0.0)
    append(st, 0, 1, 2)
    assert values(read(st, "a", 0, max_items=2)) == [0, 1]
    assert values(read(st, "a", 2)) == [2]
    assert st.n_items == 3  # b has acknowledged nothing
    assert values(read(st, "b", 0)) == [0, 1, 2]
    assert st.n_items == 3 and st.base == 0  # reading acknowledges nothing by itself...
    read(st, "a", 3)
    assert st.base == 0
    read(st, "b", 3)  # ...reading from a position acknowledges what is before it
    assert (st.base, st.n_items, st.nbytes) == (3, 0, 0)


def test_the_producer_is_held_once_the_window_is_full_of_unacknowledged_items() -> None:
    st = opened(window=3)
    st.join("slow", "S", "now", 5.0, True, 0.0)
    append(st, 0, 1, 2)
    assert not st.append_ready(0, 1)
    assert "consumer 'slow' is 3 positions behind" in st.why_held(0)
    read(st, "slow", 0)
    assert not st.append_ready(0, 1)  # read but not acknowledged
    read(st, "slow", 1)
    assert st.append_ready(0, 1) and not st.append_ready(0, 2)
    with pytest.raises(InvalidRequest, match="can never fit its window=3"):
        st.check_append(0, st.producers[0].owner, 0, 4, 0.0)


def test_without_consumers_nothing_is_kept_unless_the_epoch_is_replayed() -> None:
    st = opened(window=2)
    append(st, 0, 1)
    append(st, 2, 3)  # never held: nobody to wait for
    assert st.n_items == 0
    kept = opened(window=2, replay="epoch")
    append(kept, 0, 1)
    append(kept, 2, 3)
    assert kept.n_items == 4
    joined, _ = kept.join("late", "L", "epoch_start", 5.0, True, 0.0)
    assert (joined.position, joined.offset) == (0, 0)
    assert values(read(kept, "late")) == [0, 1, 2, 3]
    end(kept)
    read(kept, "late", 5)
    assert kept.n_items == 0  # the epoch is over: nothing is kept for it any more
    with pytest.raises(InvalidRequest, match="replay='epoch' keeps it"):
        append(st, 4)
        st.join("late", "L", "epoch_start", 5.0, True, 0.0)


def test_a_read_stops_at_the_epoch_mark_and_says_how_many_samples_the_epoch_had() -> None:
    st = opened(window=10, samples=8)
    st.join("a", "A", "now", 5.0, True, 0.0)
    st.append(0, entries(0, 1, n=4), 0.0)
    assert end(st).complete
    st.append(0, entries(2, n=4), 0.0)
    got = read(st, "a", 0)
    assert values(got) == [0, 1]
    assert got is not None and (got.epoch, got.offset, got.end, got.next) == (0, 0, 8, 3)
    got = read(st, "a", got.next)
    assert values(got) == [2]
    assert got is not None and (got.epoch, got.offset, got.end, got.epoch_samples) == \
        (1, 0, None, 8)


def test_an_epoch_ends_when_every_producer_marked_it_and_consumers_get_the_union() -> None:
    st = opened(window=10, producers=2)
    st.join("a", "A", "next_epoch", 5.0, True, 0.0)
    append(st, 10, producer=0)
    append(st, 20, 21, producer=1)
    assert not end(st, 0).complete
    # Producer 0 is ahead: its next epoch waits for producer 1 to end this one.
    assert not st.append_ready(0, 1) and "other producers to end epoch 0" in st.why_held(0)
    append(st, 22, producer=1)
    ended = end(st, 1)
    assert ended.complete and ended.epoch == 1
    assert st.append_ready(0, 1)
    got = read(st, "a")
    assert sorted(values(got)) == [10, 20, 21, 22] and got is not None and got.end == 4


def test_joining_for_the_next_epoch_waits_for_it_without_holding_anyone() -> None:
    st = opened(window=2, samples=6)
    append(st, 0)
    joined, _ = st.join("a", "A", "next_epoch", 5.0, True, 0.0)
    assert joined.position is None and joined.epoch == 1 and joined.epoch_samples == 6
    append(st, 1, 2)  # not held: "a" holds nothing yet
    assert read(st, "a") is None
    end(st)
    assert st.consumers["a"].cursor == 4
    append(st, 3)
    assert values(read(st, "a")) == [3]
    now, _ = st.join("b", "B", "now", 5.0, True, 0.0)
    assert (now.position, now.epoch, now.offset) == (5, 1, 1)  # mid-epoch: 1 sample before


def test_a_consumer_whose_connection_is_gone_is_dropped_after_its_lease() -> None:
    st = opened(window=2)
    st.join("dead", "D", "now", 3.0, True, 0.0)
    st.join("live", "L", "now", 3.0, True, 0.0)
    append(st, 0, 1)
    assert not st.append_ready(0, 1)
    st.lost(lambda owner: owner == "D", 1.0)
    assert st.next_deadline() == 2.0  # the producer's lease (2 s from when it was seen)

    def heard(owner: Any) -> float | None:  # D has no connection; the others were just heard
        return None if owner == "D" else 0.0

    assert st.check(3.5, heard) == []  # D's lease runs from its connection's end: until 4.0
    assert st.consumers["live"].seen == 3.5
    assert st.check(4.0, heard) == [("leave", 0)]
    read(st, "live", 2)
    assert st.append_ready(0, 1) and st.consumers["dead"].state == "dropped"
    # It comes back: it learns what it missed, and goes on from the oldest item kept.
    append(st, 2)
    got = read(st, "dead", 0)
    assert got is not None and got.missed == 2 and values(got) == [2]


def test_a_member_whose_connection_falls_silent_is_dropped_one_lease_after_it_was_heard(
        ) -> None:
    st = opened(window=2)
    st.join("mute", "M", "now", 3.0, True, 0.0)
    last_heard = 2.5  # its last heartbeat; then its machine is gone, its connection open

    def heard(now: float) -> Callable[[Any], float | None]:
        return lambda owner: now - last_heard if owner == "M" else 0.0

    assert st.check(3.0, heard(3.0)) == []  # its lease ran out, but it was heard 0.5 s ago
    # Its lease now runs from that heartbeat, not from this check: it is dropped 3 s after
    # it was last heard (at 5.5), not up to a whole lease later (6.0).
    mute = st.consumers["mute"]
    assert mute.seen + mute.lease == 5.5
    assert st.check(5.49, heard(5.49)) == []
    assert st.check(5.5, heard(5.5)) == [("leave", 0)]
    assert mute.state == "dropped"


def test_a_gone_producer_breaks_its_epoch_until_a_producer_opens_the_stream_again() -> None:
    st = opened(window=10)
    st.join("a", "A", "now", 5.0, True, 0.0)
    append(st, 0)
    end(st)
    append(st, 1, 2)
    st.lost(lambda owner: owner == f"{P}0", 1.0)
    assert st.check(3.0, lambda owner: None) == [("gone", 0)]
    assert st.broken
    assert values(read(st, "a", 0)) == [0]  # a complete epoch is still served
    with pytest.raises(ProducerGone, match="producer 0 .* is gone"):
        read(st, "a", 2)
    # It comes back (a new process): the broken epoch ends as aborted; a new one starts.
    reply, events = st.open(0, "new-session", st.cfg, 2.0, None, 4.0)
    assert not reply.broken and reply.epoch == 2 and ("epoch", 0) in events
    got = read(st, "a", 2)
    assert got is not None and values(got) == [1, 2] and got.end == 2 and got.aborted
    with pytest.raises(ProducerGone, match="epoch 1 .* was aborted"):
        st.check_append(0, "new-session", 1, 1, 4.0)


def producer_gone_in_last_epoch(survivor_alive: bool) -> tuple[Stream, int]:
    """Two producers: producer 1 ends its last epoch, then producer 0 dies in it and a new
    producer 0 opens the stream (the epoch is aborted). Returns the stream and where the
    consumer "a" reads the new epoch."""
    st = opened(window=10, producers=2)
    st.join("a", "A", "now", 60.0, True, 0.0)
    append(st, 0, producer=0)
    append(st, 1000, producer=1)
    assert not end(st, 1, last=True).complete
    assert st.ended(f"{P}0", 1.0) == [("gone", 0)]  # its client said goodbye: gone at once
    with pytest.raises(ProducerGone, match="producer 0 .* is gone"):
        read(st, "a", 0, now=1.0)
    _, events = st.open(0, "new-0", st.cfg, 2.0, None, 2.0)
    assert ("epoch", 0) in events  # epoch 0 ends as aborted...
    # ...and producer 1's last epoch with it: it is no longer done, it must send it again.
    assert st.producers[1].state != "done" and st.producers[1].epoch == 1
    got = read(st, "a", 0, now=2.0)
    assert got is not None and sorted(values(got)) == [0, 1000] and got.aborted
    append(st, 1, producer=0, now=2.0)
    reply = end(st, 0, last=True, now=2.0)
    assert not reply.complete and not reply.finished  # producer 1 has not ended epoch 1
    if survivor_alive:
        assert st.check(2.0 + 60.0, lambda owner: 0.0) == []
    return st, got.next


def test_a_producer_that_ended_its_last_epoch_sends_it_again_when_another_dies_in_it() -> None:
    st, at = producer_gone_in_last_epoch(survivor_alive=True)
    p1 = st.producers[1]
    # It learns (its next append is to epoch 1, as its end's reply said) and sends it again.
    assert p1.epoch == 1
    append(st, 1001, producer=1, now=70.0)
    reply = end(st, 1, last=True, now=70.0)
    assert reply.complete and reply.finished
    got = read(st, "a", at, now=70.0)
    assert got is not None and sorted(values(got)) == [1, 1001] and got.end == 2
    assert got.finished and not got.aborted


def test_a_producer_that_ended_its_last_epoch_and_left_is_gone_once_that_epoch_is_aborted(
        ) -> None:
    st, at = producer_gone_in_last_epoch(survivor_alive=False)
    assert read(st, "a", at, now=2.0) is not None  # (the new producer 0's item)
    assert st.next_deadline() == 4.0  # producer 1's lease (2 s) runs from the repair
    assert st.check(4.0, lambda owner: None) == [("gone", 0)]
    assert st.broken
    with pytest.raises(ProducerGone, match="producer 1 .* is gone"):  # never a silent wait
        read(st, "a", None, now=4.0)
    # A new producer 1 takes its place: epoch 1 is aborted too, both send the next one.
    st.open(1, "new-1", st.cfg, 2.0, None, 5.0)
    assert st.producers[0].epoch == st.producers[1].epoch == 2
    append(st, 2, producer=0, now=5.0)
    append(st, 1002, producer=1, now=5.0)
    assert not end(st, 0, last=True, now=5.0).complete
    assert end(st, 1, last=True, now=5.0).finished


def test_an_unknown_producer_of_a_stream_made_anew_gets_producer_gone() -> None:
    st = Stream("s", 0.0)  # (as after a server restart: a consumer made it, empty)
    st.join("a", "A", "now", 60.0, True, 0.0)
    with pytest.raises(ProducerGone, match="producer 0 is not open .* open the stream again"):
        st.check_append(0, P, 3, 1, 0.0)
    with pytest.raises(ProducerGone, match="producer 0 is not open"):
        st.end(0, P, 3, 7, False, 0.0)


def test_epoch_marks_are_held_by_the_window_like_items() -> None:
    st = opened(window=3)
    st.join("slow", "S", "now", 60.0, True, 0.0)
    ended = 0
    for _ in range(10_000):  # empty epochs, the consumer reading nothing
        if not st.end_ready(0):
            break
        end(st)
        ended += 1
    assert ended == 3 and len(st.entries) == 3 and st.head == 3
    read(st, "slow", 1)  # it acknowledges one mark: room for one more
    assert st.end_ready(0)
    end(st)
    assert not st.end_ready(0) and st.head - st.base == 3
    # With two producers only the end that puts the mark is held.
    two = opened(window=1, producers=2)
    two.join("slow", "S", "now", 60.0, True, 0.0)
    append(two, 5, producer=0)
    assert two.end_ready(0)
    end(two, 0)
    assert not two.end_ready(1)
    read(two, "slow", 1)
    assert two.end_ready(1) and end(two, 1).complete


def test_under_detach_a_stalled_consumer_stops_holding_the_others_and_learns_it_lagged() -> None:
    st = opened(window=2, on_lag="detach", max_stall=5.0)
    st.join("slow", "S", "now", 60.0, True, 0.0)
    st.join("fast", "F", "now", 60.0, True, 0.0)
    append(st, 0, 1, now=1.0)
    read(st, "fast", 2, now=1.0)
    assert not st.append_ready(0, 1)
    assert st.check(5.9, lambda owner: 0.0) == []
    assert st.check(6.0, lambda owner: 0.0) == [("lag", 2)]
    assert st.append_ready(0, 2)
    append(st, 2, 3, now=6.0)
    read(st, "fast", 4, now=6.0)
    assert st.base == 4  # what only the detached consumer needed is freed
    got = read(st, "slow", 0, now=7.0)
    assert got is not None and got.missed == 4 and got.items == () and got.first == 4
    assert st.consumers["slow"].detached is False  # caught up: it counts again
    described = st.describe(7.0)["stream"]["consumers"]["slow"]
    assert described["missed"] == 4 and described["stall_total_s"] == 5.0


def test_under_detach_a_consumer_that_reads_again_holds_the_window_like_the_others() -> None:
    st = opened(window=4, on_lag="detach", max_stall=1.0)
    st.join("slow", "S", "now", 60.0, True, 0.0)
    st.join("fast", "F", "now", 60.0, True, 0.0)
    append(st, 0, 1, 2, 3)
    read(st, "fast", 4)
    assert st.check(1.0, lambda owner: 0.0) == [("lag", 4)]  # it stalls a second: detached
    append(st, 4, 5, 6, 7, now=1.0)
    read(st, "fast", 8, now=1.0)
    append(st, 8, 9, 10, 11, now=1.0)  # the window is full again, for the fast consumer
    got = read(st, "slow", now=2.0)  # it is back: what was freed is skipped...
    assert got is not None and got.missed == 8 and values(got) == [8, 9, 10, 11]
    slow = st.consumers["slow"]
    assert slow.holds and not slow.detached  # ...and it holds the window again at once,
    read(st, "fast", 12, now=2.0)
    assert not st.append_ready(0, 1)  # so the producer waits for it, not only for the other
    read(st, "slow", 12, now=2.1)
    assert st.append_ready(0, 4)
    assert st.describe(2.1)["stream"]["consumers"]["slow"]["state"] == "live"


def test_under_wait_a_stalled_consumer_holds_everyone_forever() -> None:
    st = opened(window=1)
    st.join("slow", "S", "now", 60.0, True, 0.0)
    append(st, 0)
    assert st.check(1000.0, lambda owner: 0.0) == []
    assert not st.append_ready(0, 1)
    assert st.describe(1000.0)["stream"]["consumers"]["slow"]["stalled_s"] == 1000.0


def test_an_end_must_count_the_samples_the_stream_received() -> None:
    st = opened()
    st.append(0, entries(0, n=3), 0.0)
    with pytest.raises(InvalidRequest, match="says it sent 2 samples .* received 3"):
        st.end(0, st.producers[0].owner, 0, 2, False, 0.0)
    with pytest.raises(InvalidRequest, match="is in epoch 0, not 1"):
        st.end(0, st.producers[0].owner, 1, 3, False, 0.0)
    with pytest.raises(InvalidRequest, match="not open by this client"):
        st.end(0, "someone else", 0, 3, False, 0.0)


def test_the_stream_finishes_when_every_producer_ended_its_last_epoch() -> None:
    st = opened(producers=2)
    st.join("a", "A", "now", 5.0, True, 0.0)
    append(st, 1, producer=1)
    end(st, 0, last=True)
    assert not st.finished
    assert end(st, 1, last=True).finished
    got = read(st, "a")
    assert got is not None and values(got) == [1] and got.end == 1 and got.finished
    again = read(st, "a", got.next)
    assert again is not None and again.finished and again.items == ()
    # A producer that opens it again starts a new run that everyone sees.
    st.open(0, "new", st.cfg, 2.0, None, 1.0)
    assert not st.finished and read(st, "a", got.next) is None


def test_a_stream_keeps_at_most_max_consumers_dropping_the_oldest_dropped_first() -> None:
    st = opened()
    for i in range(MAX_CONSUMERS):
        st.join(f"c{i}", i, "now", 5.0, True, 0.0)
    with pytest.raises(LimitExceeded, match="MAX_CONSUMERS"):
        st.join("one more", -1, "now", 5.0, True, 0.0)
    st.ended(3, 0.0)  # c3's session ended: it is dropped, and may go first
    st.join("one more", -1, "now", 5.0, True, 0.0)
    assert "c3" not in st.consumers and len(st.consumers) == MAX_CONSUMERS


def test_a_known_consumer_resumes_at_what_it_acknowledged() -> None:
    st = opened(window=10)
    st.join("a", "A", "now", 5.0, True, 0.0)
    append(st, 0, 1, 2)
    read(st, "a", 1)  # has item 0; was sent 1 and 2
    again, _ = st.join("a", "A2", "now", 5.0, True, 1.0)
    assert again.resumed and again.position == 1
    fresh, _ = st.join("a", "A2", "now", 5.0, False, 1.0)
    assert not fresh.resumed and fresh.position == 3


def test_open_refuses_other_settings_while_other_producers_are_live() -> None:
    st = opened(producers=2)
    with pytest.raises(InvalidRequest, match="other settings"):
        st.open(1, f"{P}1", Settings(2, 99), 2.0, None, 0.0)


# ------------------------------------------------------------------------ the kind, on a wire


class Peer:
    """One client connection (with a session) to the factory, over a StringTransport."""

    _ports = iter(range(50000, 60000))

    def __init__(self, factory: ServerFactory, session: bytes | None = None,
                 resume: bool = False) -> None:
        self.factory = factory
        addr = IPv4Address("TCP", "127.0.0.1", next(self._ports))
        self.proto: ServerProtocol = factory.buildProtocol(addr)
        self.transport = StringTransport(peerAddress=addr)
        self.proto.makeConnection(self.transport)
        self.conn = WireClient()
        self.session = session or os.urandom(16)
        reply = self.request(Hello(self.rid(), PROTOCOL_VERSIONS, "t", None, self.session,
                                   resume))
        assert type(reply) is HelloReply, reply

    def rid(self) -> int:
        return self.conn.next_id()

    def send(self, msg: Any) -> None:
        self.proto.dataReceived(b"".join(self.conn.send(msg)))

    def received(self) -> list[Any]:
        data = self.transport.value()
        self.transport.clear()
        return self.conn.receive_data(data)

    def request(self, msg: Any) -> Any:
        self.send(msg)
        out = [m for m in self.received() if type(m) is not Changed]
        assert len(out) == 1, out
        return out[0]

    def lose(self) -> None:
        self.proto.connectionLost(Failure(ConnectionDone()))


@pytest.fixture
def clock() -> MemoryReactorClock:
    return MemoryReactorClock()


@pytest.fixture
def factory(clock: MemoryReactorClock) -> ServerFactory:
    return ServerFactory(clock, config=ServerConfig(max_memory=1 << 30))


@pytest.fixture(autouse=True)
def no_logged_failures() -> Iterator[None]:
    """Every test must finish without the server logging an internal error."""
    events: list[dict[str, Any]] = []

    def observer(event: dict[str, Any]) -> None:
        if "log_failure" in event:
            events.append(event)

    globalLogPublisher.addObserver(observer)
    try:
        yield
    finally:
        globalLogPublisher.removeObserver(observer)
    assert not events, [e["log_failure"].getTraceback() for e in events]


def tensor_item(i: int) -> Item:
    return Item(codec.encode(torch.full((2,), float(i))))


def got_values(reply: Any) -> list[float]:
    assert type(reply) is StreamItems, reply
    return [float(codec.decode(it.value)[0]) for it in reply.items]


def open_stream(peer: Peer, **kw: Any) -> StreamOpened:
    reply = peer.request(StreamOpen(peer.rid(), "s", **kw))
    assert type(reply) is StreamOpened, reply
    return reply


def append_to(peer: Peer, i: int, epoch: int = 0) -> Any:
    return peer.request(StreamAppend(peer.rid(), "s", 0, epoch, tensor_item(i), timeout=5.0))


def test_a_held_append_goes_through_when_the_slow_consumer_acknowledges(
        factory: ServerFactory) -> None:
    prod, cons = Peer(factory), Peer(factory)
    assert type(cons.request(StreamJoin(cons.rid(), "s", "slow", "now"))) is StreamJoined
    open_stream(prod, window=2)
    reply = append_to(prod, 0)
    assert type(reply) is StreamAppended and (reply.position, reply.head) == (0, 1)
    assert type(append_to(prod, 1)) is StreamAppended
    rid = prod.rid()
    prod.send(StreamAppend(rid, "s", 0, 0, tensor_item(2), timeout=5.0))
    assert prod.received() == []  # held: the consumer acknowledged nothing
    assert factory.bin_stats()["s"]["blocked"] == 1
    got = cons.request(StreamRead(cons.rid(), "s", "slow", 0, 1))
    assert got_values(got) == [0.0] and prod.received() == []
    cons.send(StreamRead(cons.rid(), "s", "slow", 1, 1))  # acknowledges item 0
    assert got_values([m for m in cons.received() if type(m) is StreamItems][0]) == [1.0]
    assert prod.received() == [StreamAppended(rid, 2, 3)]


def test_a_held_append_times_out_with_bin_full_and_stores_nothing(
        factory: ServerFactory, clock: MemoryReactorClock) -> None:
    prod, cons = Peer(factory), Peer(factory)
    cons.request(StreamJoin(cons.rid(), "s", "slow", "now", 60.0))
    open_stream(prod, window=1)
    append_to(prod, 0)
    rid = prod.rid()
    prod.send(StreamAppend(rid, "s", 0, 0, tensor_item(1), timeout=2.0))
    clock.advance(2.0)
    [reply] = prod.received()
    assert type(reply) is ErrorReply and reply.code == "bin_full"
    assert "consumer 'slow' is 1 positions behind (window=1)" in reply.message
    assert factory.bin_stats()["s"]["stream"]["head"] == 1


def test_a_waiting_read_is_served_by_the_next_append_or_times_out(
        factory: ServerFactory, clock: MemoryReactorClock) -> None:
    prod, cons = Peer(factory), Peer(factory)
    open_stream(prod)
    cons.request(StreamJoin(cons.rid(), "s", "a"))
    rid = cons.rid()
    cons.send(StreamRead(rid, "s", "a", 0, None, 10.0))
    assert cons.received() == []
    append_to(prod, 7)
    [got] = cons.received()
    assert got.id == rid and got_values(got) == [7.0]
    rid = cons.rid()
    cons.send(StreamRead(rid, "s", "a", 1, None, 1.5))
    clock.advance(1.5)
    [reply] = cons.received()
    assert type(reply) is ErrorReply and reply.code == "timeout"
    reply = cons.request(StreamRead(cons.rid(), "s", "a", 1, None, 0.0))
    assert type(reply) is ErrorReply and reply.code == "timeout"


def test_a_consumer_that_disconnects_holds_the_others_for_its_lease_only(
        factory: ServerFactory, clock: MemoryReactorClock) -> None:
    prod, dead, live = Peer(factory), Peer(factory), Peer(factory)
    watcher = Peer(factory)
    assert type(watcher.request(Listen(watcher.rid(), "s"))) is Listening
    dead.request(StreamJoin(dead.rid(), "s", "dead", "now", 3.0))
    live.request(StreamJoin(live.rid(), "s", "live", "now", 3.0))
    open_stream(prod, window=1)
    append_to(prod, 0)
    rid = prod.rid()
    prod.send(StreamAppend(rid, "s", 0, 0, tensor_item(1), timeout=20.0))
    live.request(StreamRead(live.rid(), "s", "live", 1))
    dead.lose()
    clock.advance(2.9)
    assert prod.received() == []
    clock.advance(0.2)  # the lease is over: the others carry on at once
    assert [type(m) for m in prod.received()] == [StreamAppended]
    events = [m.op for m in watcher.received() if type(m) is Changed]
    assert events[:2] == ["join", "join"] and "leave" in events
    described = factory.bin_stats()["s"]["stream"]["consumers"]
    assert described["dead"]["state"] == "dropped" and described["live"]["state"] == "live"


def test_a_silent_connection_counts_as_gone_after_the_lease(
        factory: ServerFactory, clock: MemoryReactorClock) -> None:
    prod, cons = Peer(factory), Peer(factory)
    cons.request(StreamJoin(cons.rid(), "s", "mute", "now", 2.0))
    open_stream(prod, window=1)
    append_to(prod, 0)
    clock.advance(2.1)  # the connection was heard from just now: kept
    assert factory.bin_stats()["s"]["stream"]["consumers"]["mute"]["state"] == "live"
    cons.proto.last_rx -= 100.0  # ...and now it has been silent for 100 s
    clock.advance(2.1)
    assert factory.bin_stats()["s"]["stream"]["consumers"]["mute"]["state"] == "dropped"


def test_a_reconnecting_consumer_keeps_its_place_within_its_lease(
        factory: ServerFactory, clock: MemoryReactorClock) -> None:
    prod = Peer(factory)
    session = os.urandom(16)
    cons = Peer(factory, session)
    cons.request(StreamJoin(cons.rid(), "s", "a", "now", 3.0))
    open_stream(prod, window=1)
    append_to(prod, 0)
    cons.lose()
    clock.advance(1.0)
    back = Peer(factory, session, resume=True)
    back.conn._next = 10  # a resumed session keeps numbering its requests
    clock.advance(5.0)  # past the lease: the session is attached again, so it stays
    assert factory.bin_stats()["s"]["stream"]["consumers"]["a"]["state"] == "live"
    assert got_values(back.request(StreamRead(back.rid(), "s", "a", 0))) == [0.0]


def test_a_producer_that_dies_gives_waiting_consumers_producer_gone_within_its_lease(
        factory: ServerFactory, clock: MemoryReactorClock) -> None:
    prod, cons = Peer(factory), Peer(factory)
    cons.request(StreamJoin(cons.rid(), "s", "a"))
    open_stream(prod, lease=2.0)
    append_to(prod, 0)
    got_values(cons.request(StreamRead(cons.rid(), "s", "a", 0)))
    rid = cons.rid()
    cons.send(StreamRead(rid, "s", "a", 1, None, 30.0))
    prod.lose()
    clock.advance(2.01)
    [reply] = cons.received()
    assert (type(reply), reply.id, reply.code) == (ErrorReply, rid, "producer_gone")
    # A producer comes back: the broken epoch ends as aborted, a new one begins.
    again = Peer(factory)
    reopened = open_stream(again, lease=2.0)
    assert reopened.epoch == 1 and not reopened.broken
    rejoined = cons.request(StreamJoin(cons.rid(), "s", "a", "next_epoch", resume=False))
    assert rejoined.position == 2 and rejoined.epoch == 1


def test_a_replayed_request_is_answered_from_memory_not_run_again(
        factory: ServerFactory) -> None:
    prod, cons = Peer(factory), Peer(factory)
    cons.request(StreamJoin(cons.rid(), "s", "a"))
    open_stream(prod)
    msg = StreamAppend(prod.rid(), "s", 0, 0, tensor_item(5))
    first = prod.request(msg)
    assert prod.request(msg) == first  # the same id again: the remembered reply
    read_msg = StreamRead(cons.rid(), "s", "a", 0)
    assert got_values(cons.request(read_msg)) == [5.0]
    assert got_values(cons.request(read_msg)) == [5.0]
    assert factory.bin_stats()["s"]["stream"]["head"] == 1
    assert factory.stats.counters["replayed"] == 2


def test_stream_names_and_value_names_do_not_mix(factory: ServerFactory) -> None:
    peer = Peer(factory)
    peer.request(Put(peer.rid(), "v", Item(codec.encode(1))))
    reply = peer.request(StreamOpen(peer.rid(), "v"))
    assert type(reply) is ErrorReply and reply.code == InvalidRequest.code
    open_stream(peer)
    reply = peer.request(Append(peer.rid(), "s", Item(codec.encode(1))))
    assert type(reply) is ErrorReply and "is a stream bin" in reply.message
    reply = peer.request(StreamRead(peer.rid(), "nope", "a"))
    assert type(reply) is ErrorReply and reply.code == BinNotFound.code
    reply = peer.request(StreamRead(peer.rid(), "s", "never-joined"))
    assert type(reply) is ErrorReply and reply.code == BinNotFound.code
    rid = peer.rid()
    assert peer.request(StreamLeave(rid, "s", "never-joined")) == Acked(rid, False)


def test_appends_count_against_the_memory_limit(clock: MemoryReactorClock) -> None:
    factory = ServerFactory(clock, config=ServerConfig(max_memory=200_000))
    peer = Peer(factory)
    open_stream(peer)
    big = Item(codec.encode(torch.zeros(60_000)))
    reply = peer.request(StreamAppend(peer.rid(), "s", 0, 0, big))
    assert type(reply) is ErrorReply and reply.code == "memory_limit"
    assert factory.kinds[0].nbytes < 200_000


def test_stats_describe_each_stream(factory: ServerFactory) -> None:
    prod, cons = Peer(factory), Peer(factory)
    cons.request(StreamJoin(cons.rid(), "s", "a", "now", 4.0))
    open_stream(prod, window=3, samples=10)
    append_to(prod, 1)
    reply = prod.request(Stats(prod.rid(), "s*"))
    assert type(reply) is StatsReply
    b = reply.bins["s"]
    assert b["kind"] == "stream" and b["n_items"] == 1
    assert b["nbytes"] == item_wire_size(tensor_item(1))
    for key in ("version", "changed_at", "ops", "bytes_in", "bytes_out", "waiters", "blocked",
                "listeners", "limits", "first", "last"):
        assert key in b
    s = b["stream"]
    assert (s["head"], s["base"], s["epoch"], s["window"], s["epoch_samples"]) == (1, 0, 0, 3, 10)
    assert s["producers"]["0"]["state"] == "live" and s["producers"]["0"]["sent"] == 1
    a = s["consumers"]["a"]
    assert (a["state"], a["position"], a["lag"], a["lease"]) == ("live", 0, 1, 4.0)


def test_end_waits_for_the_other_producers_and_a_finished_stream_stays_listed_a_while(
        factory: ServerFactory, clock: MemoryReactorClock) -> None:
    p0, p1, cons = Peer(factory), Peer(factory), Peer(factory)
    cons.request(StreamJoin(cons.rid(), "s", "a", "now", 3.0))
    open_stream(p0, producer=0, producers=2)
    open_stream(p1, producer=1, producers=2)
    rid = p0.rid()
    assert p0.request(StreamEnd(rid, "s", 0, 0, 0)) == StreamEnded(rid, 1, False, False)
    rid = p0.rid()
    p0.send(StreamEnd(rid, "s", 0, 1, 0, True, 5.0))  # epoch 1 before epoch 0 ended: held
    assert p0.received() == []
    assert p1.request(StreamEnd(p1.rid(), "s", 1, 0, 0)).complete
    assert p0.received() == [StreamEnded(rid, 2, False, False)]
    assert p1.request(StreamEnd(p1.rid(), "s", 1, 1, 0, True)).finished
    p0.lose()
    p1.lose()
    clock.advance(15.0)
    assert factory.kinds[0].owns("s")  # a consumer is still in it
    cons.lose()
    clock.advance(3.01)
    kind = factory.kinds[0]
    # Nobody is left in it, but it is finished: it stays listed for FINISHED_TTL, so that a
    # job that comes late learns that it is finished (and after how many epochs).
    assert kind.owns("s") and factory.bin_stats()["s"]["stream"]["finished"]
    late = Peer(factory)
    joined = late.request(StreamJoin(late.rid(), "s", "late", "next_epoch", 3.0))
    assert type(joined) is StreamJoined and joined.finished and joined.epoch == 2
    got = late.request(StreamRead(late.rid(), "s", "late", joined.position, timeout=5.0))
    assert type(got) is StreamItems and got.finished and got.items == () and got.epoch == 2
    late.request(StreamLeave(late.rid(), "s", "late"))
    clock.advance(FINISHED_TTL - 1.0)
    assert kind.owns("s")
    clock.advance(1.01)
    assert not kind.owns("s") and kind.nbytes == 0  # then it is gone


def test_at_most_max_finished_streams_stay_listed_the_oldest_go_first(
        factory: ServerFactory, clock: MemoryReactorClock,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorshare.server import streams as streams_module

    monkeypatch.setattr(streams_module, "MAX_FINISHED_STREAMS", 3)
    prod = Peer(factory)
    for i in range(5):
        prod.request(StreamOpen(prod.rid(), f"f{i}"))
        assert prod.request(StreamEnd(prod.rid(), f"f{i}", 0, 0, 0, True)).finished
        clock.advance(1.0)
    prod.request(StreamOpen(prod.rid(), "live"))  # (not finished: stays while it is open)
    prod.lose()
    clock.advance(10.01)  # the producers' leases: every stream is empty now
    kind = factory.kinds[0]
    assert sorted(kind.streams) == ["f2", "f3", "f4"]
    assert kind.nbytes == sum(st.cost for st in kind.streams.values())


def test_an_end_whose_mark_has_no_room_in_the_window_is_held_until_a_consumer_reads_on(
        factory: ServerFactory, clock: MemoryReactorClock) -> None:
    prod, cons = Peer(factory), Peer(factory)
    cons.request(StreamJoin(cons.rid(), "s", "slow", "now", 60.0))
    open_stream(prod, window=2)
    for e in range(2):  # two empty epochs: their marks fill the window
        rid = prod.rid()
        assert prod.request(StreamEnd(rid, "s", 0, e, 0)) == StreamEnded(rid, e + 1, True)
    rid = prod.rid()
    prod.send(StreamEnd(rid, "s", 0, 2, 0, False, 2.0))
    assert prod.received() == []  # held: no room for its mark
    assert factory.bin_stats()["s"]["blocked"] == 1
    clock.advance(2.0)
    [reply] = prod.received()
    assert type(reply) is ErrorReply and reply.code == "timeout"
    assert "consumer 'slow' is 2 positions behind (window=2)" in reply.message
    assert factory.bin_stats()["s"]["stream"]["head"] == 2  # nothing was marked
    rid = prod.rid()
    prod.send(StreamEnd(rid, "s", 0, 2, 0, False, 5.0))
    assert prod.received() == []
    cons.send(StreamRead(cons.rid(), "s", "slow", 1))  # acknowledges the first mark
    cons.received()
    assert prod.received() == [StreamEnded(rid, 3, True)]


# ------------------------------------------------------------------------ end to end


def test_a_listener_hears_joins_leaves_and_lag_end_to_end(server: EmbeddedServer) -> None:
    host, port, patience = "127.0.0.1", server.port, 20.0
    events: list[dict[str, Any]] = []  # (appended on the listening client's event thread)

    def heard(*ops: str) -> list[tuple[str, int]]:
        return [(e["op"], e.get("dropped", 0)) for e in list(events) if e["op"] in ops]

    with Client(host, port, timeout=patience) as watcher:
        watcher.listen("ev", events.append)
        p = StreamProducer("ev", host, port, window=2, on_lag="detach", max_stall=0.3,
                           timeout=patience)
        fast = StreamConsumer("ev", "fast", host, port, timeout=patience)
        slow = StreamConsumer("ev", "slow", host, port, timeout=patience)
        wait_until(lambda: heard("join") == [("join", 0)] * 2, patience, "two joins")
        reads: list[int] = []

        def read_on() -> None:
            while True:
                batch = fast.read()
                reads.extend(int(x) for x in batch.items)
                if batch.finished:
                    return

        reader = threading.Thread(target=read_on, daemon=True)
        reader.start()

        def stream() -> dict[str, Any]:
            return watcher.stats("ev")["bins"]["ev"]["stream"]  # type: ignore[no-any-return]

        def fast_acked(position: int) -> None:  # (so that it never holds the window full)
            wait_until(lambda: stream()["consumers"]["fast"]["position"] == position,
                       patience, f"the fast reader to acknowledge {position}")

        p.append(torch.tensor(0))
        fast_acked(1)
        p.append(torch.tensor(1))  # the window is full: "slow" acknowledged nothing
        # It holds the window full for max_stall: it is detached, 2 positions behind.
        wait_until(lambda: heard("lag") == [("lag", 2)], patience, "the detach")
        p.append(torch.tensor(2))  # (no longer held by it)
        fast_acked(3)
        p.append(torch.tensor(3))
        fast_acked(4)  # all four read and acknowledged: with "slow" detached, none is kept
        assert reads == [0, 1, 2, 3] and stream()["base"] == 4
        with pytest.raises(Lagged) as lagged:
            slow.read()
        assert lagged.value.missed == 4
        wait_until(lambda: heard("lag") == [("lag", 2), ("lag", 4)], patience, "the misses")
        slow.close(leave=True)  # it leaves...
        p.end_epoch(last=True)
        reader.join(patience)
        assert not reader.is_alive()
        fast.close()  # ...and this one is dropped as its client ends its session
        p.close()
        wait_until(lambda: len(heard("leave")) == 2, patience, "two leaves")
        assert heard("join", "leave", "lag") == [("join", 0), ("join", 0), ("lag", 2),
                                                 ("lag", 4), ("leave", 0), ("leave", 0)]
        assert {e["bin"] for e in events} == {"ev"}


# ------------------------------------------------------------------------ many bins


class Looks:
    """Counts how often the server looks at a stream's deadline and cost, and at a
    service's cost: what an op or a tick costs in the number of bins it looks at."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from tensorshare.server.services import Service

        self.n = 0
        for cls, attr in ((Stream, "next_deadline"), (Stream, "cost"), (Service, "cost")):
            original = cls.__dict__[attr]
            if isinstance(original, property):
                monkeypatch.setattr(cls, attr, property(self._counted(original.fget)))
            else:
                monkeypatch.setattr(cls, attr, self._counted(original))

    def _counted(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any) -> Any:
            self.n += 1
            return fn(*args)
        return counted

    def __call__(self, action: Callable[[], Any]) -> int:
        """How many looks ``action`` took."""
        self.n = 0
        action()
        return self.n


def test_no_op_and_no_tick_looks_at_every_stream_or_service(
        factory: ServerFactory, clock: MemoryReactorClock,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tensorshare.wire.services import ServiceTake

    owner, other = Peer(factory), Peer(factory)
    n = 300
    for i in range(n):  # each producer's lease ends 10 ms after the one before
        reply = owner.request(StreamOpen(owner.rid(), f"s{i}", lease=5.0))
        assert type(reply) is StreamOpened
        clock.advance(0.01)
    for i in range(n):  # idle services stay listed (with their statistics)
        owner.request(ServiceTake(owner.rid(), f"svc{i}", timeout=0))
    other.request(StreamJoin(other.rid(), "s7", "c", "now", 5.0))
    kinds = factory.kinds
    assert kinds[0].nbytes == sum(st.cost for st in kinds[0].streams.values())
    assert kinds[1].nbytes == sum(svc.cost for svc in kinds[1].services.values())
    looks = Looks(monkeypatch)
    # An op on one stream, a new stream, a write that checks the memory limit, a
    # connection's end: each looks at the bins it concerns, not at the n others.
    assert looks(lambda: owner.request(StreamOpen(owner.rid(), "new"))) <= 4
    assert looks(lambda: owner.request(StreamAppend(owner.rid(), "s3", 0, 0,
                                                    tensor_item(1)))) <= 4
    assert looks(lambda: owner.request(Put(owner.rid(), "v", tensor_item(2)))) <= 2
    assert looks(other.lose) <= 4
    # The leases of the first streams end (the owner's connection was silent): the tick
    # looks at those streams only, each once or twice.
    due = 5.0 - n * 0.01 + 0.05  # (the first six or so)
    assert 0 < looks(lambda: clock.advance(due)) <= 2 * 10
    assert kinds[0].nbytes == sum(st.cost for st in kinds[0].streams.values())
    assert kinds[1].nbytes == sum(svc.cost for svc in kinds[1].services.values())
