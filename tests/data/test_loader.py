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

from tensorshare import Client, ClientOptions, EmbeddedServer, WaitTimeout
from tensorshare.data import (
    Lagged,
    ProducerGone,
    SharedLoader,
    StreamConsumer,
    StreamFinished,
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
        with pytest.raises(StreamFinished) as finished:
            list(loader)  # a fourth pass: the stream is finished, never an empty epoch
        return passes + [len(loader), loader.finished, finished.value]

    runs = {bs: Background(lambda loader=loader: job(loader)) for bs, loader in jobs.items()}
    report = producer.result()
    assert (report.epochs, report.batches, report.samples) == (3, 21, 300)
    for bs, run in runs.items():
        *passes, after, finished, error = run.result()
        for labels, sizes, lens in passes:
            assert labels == list(range(N))
            assert sizes == batches_of(N, bs)
            assert set(lens) == {len(sizes)}  # samples // bs, +1 for the partial last one
        assert after == 0 and finished  # (no pass is left)
        assert (error.stream, error.epochs) == ("s", 3)
        assert "stream 's' is finished" in str(error) and "3 epochs" in str(error)
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
    got, lens = [], set()
    for b in as_is:
        got.append(b)
        lens.add(len(as_is))
    assert [len(b["label"]) for b in got] == [8, 8, 8, 6] and lens == {4}
    assert len(as_is) == 0  # the stream is finished: no pass is left
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
    # That pass is over (its end was missed too): the next one is the next epoch, whole, and
    # len() says so before it starts.
    assert len(slow) == 7
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


def test_len_is_what_each_pass_yields_joining_mid_epoch_after_lagged_and_after(
        server: EmbeddedServer) -> None:
    """A job joins 30% into an epoch, stalls in the next one until it is detached and comes
    back with Lagged, then reads a whole epoch: before and during each pass, ``len()`` is
    the number of batches the pass yields."""
    port, n, k = server.port, 200, 10  # samples an epoch; samples of a producer batch

    def item(epoch: int, i: int) -> torch.Tensor:
        return torch.arange(i * k, (i + 1) * k) + 1000 * epoch  # (labels: epoch, sample)

    p = StreamProducer("len", "127.0.0.1", port, window=4, on_lag="detach", max_stall=0.3,
                       samples_per_epoch=n)
    for i in range(6):
        p.append(item(0, i))  # (nobody reads yet: nothing is kept, nothing held)
    late = SharedLoader("len", "127.0.0.1", port, batch_size=16, name="late", start="now",
                        timeout=TIMEOUT)
    stalled, back = threading.Event(), threading.Event()

    def produce() -> None:
        for e in range(3):
            for i in range(6 if e == 0 else 0, n // k):
                if e == 1 and i == 10:
                    stalled.wait(TIMEOUT)  # the job stops reading: the window fills
                if e == 1 and i == 16:
                    back.wait(TIMEOUT)  # it was detached; the rest comes once it is back
                p.append(item(e, i))
            p.end_epoch(last=e == 2)

    producer = Background(produce)
    # 1. It joined 60 samples (30%) into epoch 0: its first pass is the other 140.
    assert len(late) == 9
    labels, sizes, lens = [], [], []
    for batch in late:
        labels += batch.tolist()
        sizes.append(len(batch))
        lens.append(len(late))
    assert labels == list(range(60, n)) and sizes == [16] * 8 + [12] and set(lens) == {9}
    # 2. Epoch 1: two batches, then it stalls until the stream detached it and went on.
    assert len(late) == 13
    it = iter(late)
    got = [int(x) for _ in range(2) for x in next(it)]
    stalled.set()

    def stream() -> dict[str, Any]:
        with Client("127.0.0.1", port) as c:
            return c.stats("len")["bins"]["len"]["stream"]  # type: ignore[no-any-return]

    wait_until(lambda: stream()["consumers"]["late"]["state"] == "detached", TIMEOUT,
               "the stalled job to be detached")
    wait_until(lambda: stream()["base"] == 21 + 16, TIMEOUT, "epoch 1 to go on without it")
    with pytest.raises(Lagged) as lagged:
        for batch in it:  # (what its reads in flight had brought, then the news)
            got += batch.tolist()
    assert got == list(range(1000, 1000 + len(got)))
    missed = lagged.value.missed
    assert missed and len(got) + missed * k <= 160  # (the rest of what it read, it holds)
    # 3. The pass after Lagged: the rest of epoch 1 (what the job still held, and items
    # 16-19), as len() says before and during it.
    expected = len(late)
    back.set()
    labels, lens = [], []
    for batch in late:
        labels += batch.tolist()
        lens.append(len(late))
    assert labels[-40:] == list(range(1160, 1200)) and len(lens) == expected
    assert set(lens) == {expected}
    epoch1 = got + labels  # every sample of epoch 1 read or missed, once, in order
    assert epoch1 == sorted(set(epoch1)) and len(epoch1) + missed * k == n
    # 4. The next epoch, whole; then the stream is finished.
    assert len(late) == 13
    labels, lens = [], []
    for batch in late:
        labels += batch.tolist()
        lens.append(len(late))
    assert labels == list(range(2000, 2000 + n)) and set(lens) == {13} and len(lens) == 13
    with pytest.raises(StreamFinished, match="after 3 epochs"):
        list(late)
    producer.result()
    p.close()
    late.close()


def test_a_job_that_comes_after_the_stream_finished_gets_stream_finished(
        server: EmbeddedServer) -> None:
    report = serve_loader(data(), "over", "127.0.0.1", server.port, epochs=2)
    assert report.epochs == 2  # nobody read it: it finished with nobody in it...
    with Client("127.0.0.1", server.port) as c:
        assert c.stats("over")["bins"]["over"]["stream"]["finished"]  # ...and stays listed
    job = SharedLoader("over", "127.0.0.1", server.port, batch_size=10, name="late",
                       timeout=2.0)
    assert job.finished and len(job) == 0
    for _ in range(2):  # every pass says so: never a silent empty epoch, never a wait
        with pytest.raises(StreamFinished, match=r"stream 'over' is finished: .* after 2 "
                                                 r"epochs and job 'late'") as finished:
            for _ in job:
                pass
        assert (finished.value.stream, finished.value.epochs) == ("over", 2)
    job.close()


def test_serve_loader_says_how_it_is_going(server: EmbeddedServer,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    job = SharedLoader("p", "127.0.0.1", server.port, batch_size=25, name="job",
                       timeout=TIMEOUT)
    lines: list[str] = []
    producer = Background(lambda: serve_loader(data(), "p", "127.0.0.1", server.port,
                                               epochs=2, wait_for=1, progress=lines.append))
    for _ in range(2):
        assert len(one_pass(job)[0]) == N
    report = producer.result()
    assert len(lines) == 4, lines  # it starts, each epoch, the end
    assert lines[0].startswith("serve_loader 'p': producing 2 epochs as producer 0")
    assert "waiting for 1 consumers" in lines[0]
    for e in (1, 2):
        assert lines[e].startswith(f"serve_loader 'p': epoch {e}/2 sent: 7 batches, 100 "
                                   f"samples in "), lines[e]
        assert "held back by the consumers" in lines[e]
    assert lines[3].startswith(f"serve_loader 'p': done: 2 epochs, 14 batches, 200 samples "
                               f"in {report.seconds:.1f} s")
    # progress=True prints the same lines to stderr; False prints nothing.
    serve_loader(data(), "q", "127.0.0.1", server.port, progress=True)
    serve_loader(data(), "r", "127.0.0.1", server.port, progress=False)
    err = capsys.readouterr().err
    assert "serve_loader 'q': epoch 1/1 sent: 7 batches" in err and "'r'" not in err
    job.close()


def test_a_job_closes_at_once_after_its_server_went_away() -> None:
    """Once the stream ended and its server stopped (a producer that hosted it, say), closing
    the job neither waits for the server nor raises: there is nothing left to leave."""
    srv = EmbeddedServer(port=0)
    try:
        job = SharedLoader("gone", "127.0.0.1", srv.port, batch_size=10, name="j",
                           timeout=TIMEOUT)
        produced = Background(lambda: serve_loader(data(), "gone", "127.0.0.1", srv.port,
                                                   epochs=1, wait_for=1))
        assert sum(len(y) for _, y in job) == N
        produced.result()
    finally:
        srv.stop()
    wait_until(lambda: not job._consumer.client.connected, what="the client to see it go")
    done = Background(job.close)
    done.result(timeout=5.0)  # (before: a leave that waited out the client's timeout)


def test_the_loaders_take_client_options_and_the_keywords_they_type() -> None:
    """``options=ClientOptions(...)`` and its fields as keywords reach the client a producer
    or a job makes (here: the server's token, a compression, the client's name); the wing's
    own ``timeout`` and ``lease`` still set the client's timeout and heartbeat."""
    with EmbeddedServer(port=0, token="data-token") as srv:
        opts = ClientOptions(token="data-token", name="job-client")
        job = SharedLoader("typed", "127.0.0.1", srv.port, name="job", timeout=TIMEOUT,
                           lease=3.0, options=opts, compress="lz4")
        client = job.consumer.client
        assert client.options.name == "job-client" and client.options.compress == "lz4"
        assert client.options.timeout == TIMEOUT and client.options.heartbeat == 1.0
        producer = Background(lambda: serve_loader(
            data(32), "typed", "127.0.0.1", srv.port, epochs=1, window=4, wait_for=1,
            timeout=TIMEOUT, progress=False, token="data-token"))
        labels, _, _ = one_pass(job)
        assert labels == list(range(32))
        assert producer.result().samples == 32
        job.close()
        with StreamProducer("plain", "127.0.0.1", srv.port, timeout=TIMEOUT,
                            options=ClientOptions(token="data-token", heartbeat=0.5)) as p:
            # (options that give a heartbeat or a name keep them)
            assert p.client.options.heartbeat == 0.5
            assert p.client.options.name == "tensorshare-data"
        bogus: dict[str, Any] = {"tokn": "data-token"}
        with pytest.raises(TypeError, match="tokn"):
            SharedLoader("typed", "127.0.0.1", srv.port, timeout=TIMEOUT, **bogus)
