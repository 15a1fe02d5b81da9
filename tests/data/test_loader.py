"""serve_loader and SharedLoader (tensorshare.data) against a real server on 127.0.0.1.

Producers and jobs run in threads of the test process (the fault-injection runs, with
separate processes, SIGKILL and a chaos proxy, are in tests/system/test_streams_faults.py).
Each checks what a training job sees: every sample of every epoch exactly once and in order,
at its own batch size, with a ``len()`` that says how many batches the pass has.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from tensorshare import Client, EmbeddedServer, WaitTimeout
from tensorshare.data import (
    Lagged,
    ProducerGone,
    SharedLoader,
    StreamConsumer,
    StreamProducer,
    serve_loader,
)
from tests.conftest import wait_until

N = 100  # samples per epoch
TIMEOUT = 20.0


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    srv = EmbeddedServer(port=0)
    try:
        yield srv
    finally:
        srv.stop()


def data(n: int = N, batch_size: int = 16, **kw: Any) -> DataLoader[Any]:
    ds = TensorDataset(torch.arange(n).float().unsqueeze(1).repeat(1, 3), torch.arange(n))
    return DataLoader(ds, batch_size=batch_size, shuffle=False, **kw)


class Background:
    """Run ``fn`` in a thread; ``result()`` joins it (with a deadline) and re-raises."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.value = fn()
            except BaseException as exc:  # handed to the test
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self, timeout: float = 60.0) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "still running after the deadline"
        if self.error is not None:
            raise self.error
        return self.value


def one_pass(loader: SharedLoader) -> tuple[list[int], list[int], list[int]]:
    """Iterate one pass: (labels in order, each batch's size, len() seen at each batch)."""
    labels, sizes, lens = [], [], []
    for _, y in loader:
        labels += y.tolist()
        sizes.append(len(y))
        lens.append(len(loader))
    return labels, sizes, lens


def batches_of(n: int, size: int) -> list[int]:
    return [size] * (n // size) + ([n % size] if n % size else [])


def test_jobs_with_their_own_batch_sizes_get_every_sample_once_per_epoch_with_a_true_len(
        server: EmbeddedServer) -> None:
    jobs = {bs: SharedLoader("s", "127.0.0.1", server.port, batch_size=bs, name=f"bs={bs}",
                             timeout=TIMEOUT) for bs in (7, 16, 40)}
    producer = Background(lambda: serve_loader(data(), "s", "127.0.0.1", server.port, epochs=3,
                                               window=4, wait_for=3))

    def job(loader: SharedLoader) -> list[Any]:
        passes = [one_pass(loader) for _ in range(3)]
        return passes + [len(loader), loader.finished, list(loader)]

    runs = {bs: Background(lambda loader=loader: job(loader)) for bs, loader in jobs.items()}
    report = producer.result()
    assert (report.epochs, report.batches, report.samples) == (3, 21, 300)
    for bs, run in runs.items():
        *passes, after, finished, more = run.result()
        for labels, sizes, lens in passes:
            assert labels == list(range(N))
            assert sizes == batches_of(N, bs)
            assert set(lens) == {len(sizes)}  # samples // bs, +1 for the partial last one
        assert after == len(batches_of(N, bs)) and finished and more == []
        jobs[bs].close()


def test_a_job_that_joins_mid_epoch_gets_the_rest_and_len_says_so(
        server: EmbeddedServer) -> None:
    with StreamProducer("s", "127.0.0.1", server.port, window=64, samples_per_epoch=N) as p:
        early = SharedLoader("s", "127.0.0.1", server.port, batch_size=10, name="early",
                             start="now", timeout=TIMEOUT)
        batches = list(data())
        for b in batches[:3]:  # 48 samples
            p.append(b)
        late = SharedLoader("s", "127.0.0.1", server.port, batch_size=10, name="late",
                            start="now", timeout=TIMEOUT)
        assert len(late) == 6  # 52 samples left in this epoch
        for b in batches[3:]:
            p.append(b)
        p.end_epoch()
        for b in batches:
            p.append(b)
        p.end_epoch(last=True)
        labels, sizes, lens = one_pass(late)
        assert labels == list(range(48, N)) and sizes == [10] * 5 + [2] and set(lens) == {6}
        assert len(late) == 10  # the next pass is a whole epoch
        labels, sizes, _ = one_pass(late)
        assert labels == list(range(N)) and len(sizes) == 10
        assert one_pass(early)[0] == list(range(N))
        early.close()
        late.close()


def test_a_job_joining_at_the_epoch_start_gets_the_whole_epoch_the_producer_kept(
        server: EmbeddedServer) -> None:
    with StreamProducer("s", "127.0.0.1", server.port, window=4, replay="epoch",
                        samples_per_epoch=N) as p:
        for b in list(data())[:5]:
            p.append(b)  # nobody reads, yet nothing is held: nobody is behind
        late = SharedLoader("s", "127.0.0.1", server.port, batch_size=25, name="late",
                            start="epoch_start", timeout=TIMEOUT)
        rest = Background(lambda: [p.append(b) for b in list(data())[5:]] and p.end_epoch())
        labels, sizes, lens = one_pass(late)
        rest.result()
        assert labels == list(range(N)) and sizes == [25] * 4 and set(lens) == {4}
        late.close()


class Dicts(Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"image": torch.full((2, 2), float(i)), "label": torch.tensor(i)}


def test_dict_batches_and_the_producers_own_batches(server: EmbeddedServer) -> None:
    as_is = SharedLoader("d", "127.0.0.1", server.port, name="as-is", timeout=TIMEOUT)
    split = SharedLoader("d", "127.0.0.1", server.port, batch_size=4, name="split",
                         timeout=TIMEOUT)
    producer = Background(lambda: serve_loader(DataLoader(Dicts(), batch_size=8), "d",
                                               "127.0.0.1", server.port, wait_for=2))
    got = list(as_is)
    assert [len(b["label"]) for b in got] == [8, 8, 8, 6] and len(as_is) == 4
    assert torch.cat([b["label"] for b in got]).tolist() == list(range(30))
    small = list(split)
    assert [len(b["label"]) for b in small] == [4] * 7 + [2]
    assert small[1]["image"].shape == (4, 2, 2) and small[1]["image"][0, 0, 0] == 4.0
    producer.result()
    as_is.close()
    split.close()


def test_several_producers_feed_one_stream_and_jobs_get_the_union(
        server: EmbeddedServer) -> None:
    job = SharedLoader("u", "127.0.0.1", server.port, batch_size=9, name="job",
                       timeout=TIMEOUT)
    halves = [data(N)] * 2
    producers = [Background(lambda i=i: serve_loader(
        DataLoader(TensorDataset(torch.arange(i, 2 * N, 2)), batch_size=8), "u", "127.0.0.1",
        server.port, epochs=2, producers=2, producer=i, window=8, wait_for=1))
        for i in range(2)]
    del halves
    for _ in range(2):
        got = torch.cat([b[0] for b in job]).tolist()
        assert sorted(got) == list(range(2 * N))  # the union, each sample once
    for p in producers:
        assert p.result().epochs == 2
    assert job.finished
    job.close()


def test_a_producer_that_dies_mid_epoch_ends_the_pass_with_producer_gone(
        server: EmbeddedServer) -> None:
    job = SharedLoader("g", "127.0.0.1", server.port, batch_size=16, name="job",
                       timeout=TIMEOUT)
    p = StreamProducer("g", "127.0.0.1", server.port, lease=1.0)
    for b in list(data())[:3]:
        p.append(b)
    p.close()  # before ending its epoch: it is gone at once (its client said goodbye)
    seen: list[int] = []
    with pytest.raises(ProducerGone, match="producer 0 .* is gone"):
        for _, y in job:
            seen += y.tolist()
    assert seen == [] or seen == list(range(len(seen)))
    # A producer comes back: the next pass is its first epoch, whole.
    producer = Background(lambda: serve_loader(data(), "g", "127.0.0.1", server.port))
    labels, _, _ = one_pass(job)
    assert labels == list(range(N))
    producer.result()
    job.close()


def test_under_detach_a_job_that_stalls_gets_lagged_then_goes_on(
        server: EmbeddedServer) -> None:
    fast = SharedLoader("l", "127.0.0.1", server.port, batch_size=16, name="fast",
                        timeout=TIMEOUT)
    slow = SharedLoader("l", "127.0.0.1", server.port, batch_size=16, name="slow",
                        timeout=TIMEOUT)
    batches = list(data())  # 7 batches an epoch
    p = StreamProducer("l", "127.0.0.1", server.port, window=2, on_lag="detach",
                       max_stall=1.0, samples_per_epoch=N)
    p.append(batches[0])
    p.append(batches[1])
    it = iter(slow)
    first = next(it)[1].tolist()  # then it stalls, holding the window full

    def produce() -> None:
        for b in batches[2:]:
            p.append(b)  # held until the slow job is detached, 1 s on
        p.end_epoch()

    producer = Background(produce)
    assert one_pass(fast)[0] == list(range(N))  # the fast job is not held for long
    producer.result()
    with pytest.raises(Lagged) as lagged:
        for _, y in it:
            first += y.tolist()
    # What it had read (whatever its last read in flight brought) and what it missed make
    # the whole epoch: nothing else is lost, nothing is doubled.
    assert first == list(range(len(first))) and len(first) % 16 == 0
    missed = lagged.value.missed
    assert missed and len(first) // 16 + missed == 7
    assert [y for _, y in slow] == []  # that pass is over: its end was missed too
    ending = Background(lambda: [p.append(b) for b in batches] and p.end_epoch(last=True))
    # Both read the next epoch side by side (one left idle would stall and be detached too).
    fast_pass = Background(lambda: one_pass(fast)[0])
    assert one_pass(slow)[0] == list(range(N))  # the next epoch, whole
    ending.result()
    assert fast_pass.result() == list(range(N))
    stats = Client("127.0.0.1", server.port).stats("l")["bins"]["l"]["stream"]
    assert stats["consumers"]["slow"]["missed"] == missed
    p.close()
    fast.close()
    slow.close()


def test_the_lower_level_pieces_without_a_dataloader(server: EmbeddedServer) -> None:
    with StreamProducer("w", "127.0.0.1", server.port, window=3) as p, \
            StreamConsumer("w", "reader", "127.0.0.1", server.port, start="next_epoch",
                           timeout=TIMEOUT) as c:
        words = ["alpha", "beta", "gamma", "delta", "epsilon"]
        producer = Background(lambda: ([p.append(w) for w in words], p.end_epoch(last=True)))
        got: list[str] = []
        while True:
            batch = c.read(2)
            got += batch.items
            assert len(batch.items) <= 2
            if batch.ended:
                assert batch.end == len(words) and batch.finished
                break
        producer.result()
        assert got == words and c.finished
        with pytest.raises(ValueError, match="at most 80% of the client's timeout"):
            c.client.stream_read("w", "reader", timeout=1000)


def test_joining_never_waits_for_a_producer_and_a_read_times_out(
        server: EmbeddedServer) -> None:
    with StreamConsumer("nobody", "j", "127.0.0.1", server.port, timeout=0.3) as c:
        assert c.joined.position == 0 and c.joined.epoch_samples is None
        with pytest.raises(WaitTimeout, match="within 0.3 s"):
            c.read()
    # and the stream of a consumer that left goes away with it
    wait_until(lambda: "nobody" not in Client("127.0.0.1", server.port).stats()["bins"],
               what="the stream to go")


def test_a_producer_that_ended_its_last_epoch_waits_for_the_others_to_finish(
        server: EmbeddedServer) -> None:
    port = server.port
    with StreamConsumer("fin", "j", "127.0.0.1", port, timeout=TIMEOUT) as c, \
            StreamProducer("fin", "127.0.0.1", port, producer=0, producers=2) as p0, \
            StreamProducer("fin", "127.0.0.1", port, producer=1, producers=2) as p1:
        p0.append(torch.tensor([0]))
        assert not p0.end_epoch(last=True).finished
        with pytest.raises(WaitTimeout, match="did not finish within 0.2 s"):
            p0.wait_finished(timeout=0.2)  # producer 1 is still in its last epoch
        waiting = Background(lambda: p0.wait_finished(timeout=TIMEOUT))
        p1.append(torch.tensor([1]))
        assert p1.end_epoch(last=True).finished
        waiting.result()
        batch = c.read()
        assert sorted(int(x[0]) for x in batch.items) == [0, 1] and batch.finished
