"""One DataLoader for several training jobs: :func:`serve_loader` and :class:`SharedLoader`.

::

    # producer: one DataLoader feeds any number of training jobs
    serve_loader(loader, "cifar/train", host="trainer", port=8000, epochs=30, window=32)

    # each training job: a one-line swap for the DataLoader
    train = SharedLoader("cifar/train", host="trainer", port=8000, batch_size=128,
                         name=f"lr={lr}", start="next_epoch", timeout=60)
    for epoch in range(30):
        for x, y in train:          # stops exactly at the end of the producer's epoch
            ...

The batches travel once to the server (a stream bin) and from there to every job; each job
reads at its own pace within the stream's ``window`` and re-batches to its own batch size.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Unpack

from ..client import Client, ClientOptions
from ..client.options import ConnectFields
from ..client.streams import Lagged, ProducerGone, StreamBatch
from ..errors import StreamFinished
from ..memory.device import InFlight, check_device, copy_async, moves, want_pinned
from .batching import Rebatcher, sample_count
from .stream import StreamConsumer, StreamProducer

__all__ = ["ServeReport", "SharedLoader", "serve_loader"]

log = logging.getLogger("tensorshare.data")


@dataclass(frozen=True, slots=True)
class ServeReport:
    """What :func:`serve_loader` did: epochs completed, batches and samples sent, epochs
    restarted because a producer died, and the seconds it took."""

    epochs: int
    batches: int
    samples: int
    restarts: int
    seconds: float


def loader_samples(loader: Any) -> int | None:
    """The samples a DataLoader yields per epoch, when it can tell (``None``: it cannot)."""
    try:
        batch_size = getattr(loader, "batch_size", None)
        sampler = getattr(loader, "sampler", None)
        if batch_size is not None and sampler is not None:
            n = len(sampler)
            return n - n % batch_size if getattr(loader, "drop_last", False) else n
        dataset = getattr(loader, "dataset", None)
        if dataset is not None and getattr(loader, "batch_sampler", None) is None:
            return len(dataset)
    except TypeError:  # no len(): an IterableDataset
        return None
    return None


def serve_loader(loader: Iterable[Any], name: str, host: str | None = None,
                 port: int | None = None, *, epochs: int = 1, window: int = 32,
                 on_lag: str = "wait", max_stall: float | None = None, replay: str = "none",
                 producers: int = 1, producer: int = 0, lease: float = 10.0,
                 timeout: float = 60.0, wait_for: int = 0, samples_per_epoch: int | None = None,
                 client: Client | None = None, progress: bool | Callable[[str], None] | None = None,
                 device_ipc: bool = False, options: ClientOptions | None = None,
                 **client_options: Unpack[ConnectFields]) -> ServeReport:
    """Feed the batches of ``loader`` to stream bin ``name`` for ``epochs`` epochs; every
    consumer (:class:`SharedLoader`) of the stream gets every batch. Returns a
    :class:`ServeReport`.

    Args:
        loader: a DataLoader, or any iterable of batches (a tensor, or tuples, lists and
            dicts of tensors); iterated once per epoch.
        name, host, port: the stream's bin name; the server (as for :class:`Client`).
        epochs: how many epochs to send (then the stream is finished).
        window: how far (in batches) this producer may run ahead of the slowest consumer.
        on_lag: ``"wait"``: everyone keeps the slowest consumer's pace (one DataLoader);
            ``"detach"``: a consumer that held the window full for ``max_stall`` seconds
            stops holding the others back; when it reads again it gets ``Lagged`` once and
            holds the window again, like the others.
        replay: ``"epoch"`` keeps the current epoch on the server for consumers that join
            with ``start="epoch_start"`` (it costs an epoch of memory).
        producers, producer: ``producers=k`` means k processes each call this with their
            own ``producer`` index (0 to k-1) and their own part of the data (say, a
            ``DistributedSampler`` of k replicas): consumers get the union, epoch by epoch.
            It returns once the stream finished (every producer ended its last epoch): a
            producer that dies in the last epoch aborts it, and every producer sends it again.
        lease: seconds this producer may be unreachable before consumers get ``ProducerGone``.
        timeout: seconds to connect; also how long to wait for ``wait_for`` consumers and,
            after ``ProducerGone``, for the stream to be whole again.
        wait_for: wait until this many consumers joined before the first epoch.
        samples_per_epoch: samples sent per epoch (default: as the loader's sampler says).
        client, options, client_options: a client to use (not closed at the end), or the
            new one's :class:`~tensorshare.ClientOptions` and fields of it as keywords
            (``token``, ``compress``...: they override ``options``; ``timeout`` is ours).
        progress: where its progress lines go: when it starts, per epoch sent (batches,
            samples, seconds, how long the consumers held it back), every 30 s within a long
            epoch, for an epoch sent again after a producer died, at the end. ``None``
            (default): the logger ``tensorshare.data`` at INFO; ``True``: stderr; a callable:
            called with each line; ``False``: nowhere.
        device_ipc: the batches are CUDA tensors and every consumer is on this host
            (``unix://``) with this GPU: they travel as CUDA IPC handles, TCP consumers are
            refused (see :class:`~tensorshare.data.stream.StreamProducer`, README "GPUs").

    Raises:
        ProducerGone: another producer stayed gone for ``timeout`` seconds.
        WaitTimeout: fewer than ``wait_for`` consumers joined within ``timeout``.
        ConnectError: no server within ``timeout``.
    """
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be a positive int, not {epochs!r}")
    hint = samples_per_epoch if samples_per_epoch is not None else loader_samples(loader)
    say = _Progress(name, epochs, progress, loader)
    prod = StreamProducer(name, host, port, producer=producer, producers=producers,
                          window=window, on_lag=on_lag, max_stall=max_stall, replay=replay,
                          lease=lease, samples_per_epoch=hint, timeout=timeout, client=client,
                          device_ipc=device_ipc, options=options, **client_options)
    return _serve(prod, loader, epochs, wait_for, timeout, say)


def _serve(prod: StreamProducer, loader: Iterable[Any], epochs: int, wait_for: int,
           timeout: float, say: _Progress) -> ServeReport:
    """:func:`serve_loader`'s epochs through ``prod`` (closed at the end)."""
    batches = samples = restarts = 0
    with prod:
        say.start(prod, wait_for)
        if wait_for:
            prod.wait_for_consumers(wait_for, timeout)
        done = 0
        while done < epochs:
            try:
                say.epoch_start(done)
                for batch in loader:
                    t0 = time.monotonic()
                    prod.append(batch)
                    say.batch(time.monotonic() - t0)
                    batches += 1
                sent, last = prod.sent, done == epochs - 1
                if not prod.end_epoch(last=last).finished and last:
                    # The others may still die in this epoch (then it is aborted and sent
                    # again by every producer): it is done once the stream finished.
                    prod.wait_finished()
                samples += sent
                done += 1
                say.epoch_done(sent)
            except ProducerGone as exc:
                # A producer died mid-epoch (this one was away too long, or another, or the
                # server restarted): once the stream is whole again, this epoch starts over;
                # consumers saw it end as aborted (or get ProducerGone).
                restarts += 1
                say.line(f"epoch {done + 1}/{epochs} cut short ({exc}); sending it again once "
                         f"the stream is whole")
                prod.reopen(timeout)
    report = ServeReport(done, batches, samples, restarts, time.monotonic() - say.created)
    say.line(f"done: {report.epochs} epochs, {report.batches} batches, {report.samples} "
             f"samples in {report.seconds:.1f} s ({restarts} epochs sent again)")
    return report


class _Progress:
    """The progress lines of :func:`serve_loader` (see its ``progress``)."""

    EVERY = 30.0  # seconds between lines within an epoch

    def __init__(self, name: str, epochs: int, progress: bool | Callable[[str], None] | None,
                 loader: Any) -> None:
        self.created = time.monotonic()  # (the report's seconds count from here)
        self.name, self.epochs, self.progress = name, epochs, progress
        try:
            self.per_epoch: int | None = len(loader)
        except TypeError:
            self.per_epoch = None
        self.epoch = self.batches = 0
        self.started = self.last = self.held = 0.0

    def line(self, text: str) -> None:
        if self.progress is False:
            return
        text = f"serve_loader {self.name!r}: {text}"
        if self.progress is None:
            log.info("%s", text)
        elif self.progress is True:
            print(text, file=sys.stderr, flush=True)
        else:
            self.progress(text)

    def start(self, prod: StreamProducer, wait_for: int) -> None:
        waits = f"; waiting for {wait_for} consumers" if wait_for else ""
        self.line(f"producing {self.epochs} epochs as producer {prod.producer} (epoch "
                  f"{prod.epoch} of the stream next, {prod.opened.consumers} consumers in "
                  f"it){waits}")

    def epoch_start(self, done: int) -> None:
        self.epoch, self.batches, self.held = done + 1, 0, 0.0
        self.started = self.last = time.monotonic()

    def batch(self, held: float) -> None:
        self.batches += 1
        self.held += held
        now = time.monotonic()
        if now - self.last >= self.EVERY:
            self.last = now
            of = f" of {self.per_epoch}" if self.per_epoch is not None else ""
            self.line(f"epoch {self.epoch}/{self.epochs}: {self.batches}{of} batches in "
                      f"{now - self.started:.0f} s")

    def epoch_done(self, samples: int) -> None:
        took = max(time.monotonic() - self.started, 1e-9)
        self.line(f"epoch {self.epoch}/{self.epochs} sent: {self.batches} batches, {samples} "
                  f"samples in {took:.1f} s ({samples / took:.0f} samples/s; held back by "
                  f"the consumers {self.held:.1f} s)")




class _Pass:
    """One pass of a :class:`SharedLoader` over (the rest of) an epoch: the samples of the
    epoch read so far and what the re-batcher still holds of them."""

    def __init__(self, batch_size: int | None, drop_last: bool, epoch: int, offset: int,
                 epoch_samples: int | None) -> None:
        self.rebatcher = Rebatcher(batch_size, drop_last)
        self.epoch = epoch  # the epoch it goes through
        self.read_to = offset  # samples of the epoch before the next one to read
        self.total = epoch_samples  # samples of the epoch, once known
        self.done = False  # the epoch's end was read

    def add(self, got: StreamBatch) -> None:
        for x in got.items:
            self.rebatcher.add(x)
        self.read_to = got.offset + sum(sample_count(x) or 1 for x in got.items)
        if got.end is not None:
            self.total, self.done, self.read_to = got.end, True, got.end
        elif got.epoch_samples is not None:
            self.total = got.epoch_samples

    @property
    def over(self) -> bool:
        """Its end was read and every batch of it taken."""
        return self.done and not self.rebatcher.held


class SharedLoader:
    """Batches from a stream bin that a :func:`serve_loader` feeds: a one-line swap for a
    DataLoader in each training job that shares one.

    Iterating it yields the producer's batches (re-batched to ``batch_size``) and stops
    exactly at the end of the producer's epoch; the next ``for`` goes on with the next
    epoch. ``len()`` is the number of batches of the pass being iterated, or between
    passes of the next one (``samples // batch_size``, plus one for a last partial batch);
    for a job that joined mid-epoch, its first pass is the rest of that epoch.

    Args:
        stream: the stream's bin name (what ``serve_loader`` was given).
        host, port: the server.
        batch_size: the samples of each batch it yields (the producer's batches are split
            or concatenated along dimension 0, in sample order); ``None``: the producer's.
        name: this job's name in the stream: a job that restarts under the same name goes
            on from where it was. Default: unique to this process.
        start: where a new job starts: ``"next_epoch"`` (default), ``"now"`` (the rest of
            the current epoch is its first pass) or ``"epoch_start"`` (the whole current
            epoch: the producer must keep it, ``replay="epoch"``).
        timeout: seconds to wait for a batch (then ``WaitTimeout``), and to connect.
        lease: seconds this job may be unreachable before the stream goes on without it.
        drop_last: drop a last batch smaller than ``batch_size``.
        max_items: the most producer batches one read fetches (default: as many as there
            are, up to the epoch's end and one reply's size).
        device: yield batches with their tensors on this device (``"cuda"``, ...; checked
            here: a torch without CUDA is a ``ValueError``); numpy arrays and other values
            stay. ``None``: as received (CPU tensors; a ``device_ipc`` stream's on its GPU).
        prefetch: with a CUDA ``device``, how many batches beyond the one yielded have
            their copies already issued (on a side stream, from pinned memory once it is
            reused): the copy of batch k+1 runs while the caller computes on batch k. Each
            yielded batch is ordered before the caller's current stream. 0: each batch is
            copied when it is yielded.
        client: a client to use (not closed by ``close``) instead of a new one.
        options, client_options: the new client's :class:`~tensorshare.ClientOptions`, and
            fields of it as keywords (they override ``options``); its ``timeout`` comes from
            ``timeout``.

    Joining never waits for the producer (it may not have started yet). A ``for`` loop
    raises ``ProducerGone`` when the producer died mid-epoch (the next one starts at the
    next epoch a producer sends), ``Lagged`` when batches were skipped for this job (the
    next one goes on after them), ``WaitTimeout`` after ``timeout`` seconds without a batch.

    It works in a forked process too (a DataLoader worker, a job started by fork): the
    client gives each process its own connection. One process iterates it at a time.
    """

    def __init__(self, stream: str, host: str | None = None, port: int | None = None, *,
                 batch_size: int | None = None, name: str | None = None,
                 start: str = "next_epoch", timeout: float = 60.0, lease: float = 10.0,
                 drop_last: bool = False, max_items: int | None = None,
                 device: Any = None, prefetch: int = 2,
                 client: Client | None = None, options: ClientOptions | None = None,
                 **client_options: Unpack[ConnectFields]) -> None:
        if batch_size is not None and (isinstance(batch_size, bool)
                                       or not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive int or None, not {batch_size!r}")
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, not {prefetch!r}")
        self.device = check_device(device)  # (before anything is joined)
        self.prefetch = prefetch
        want_pinned(self.device)
        self.stream = stream
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.max_items = max_items
        self.name = name or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        # A CPU device goes to the reads (a device_ipc stream's GPU tensors come to the host
        # there); a CUDA one is reached after re-batching, one copy per batch yielded.
        on_read = self.device if self.device is not None and self.device.type == "cpu" \
            else None
        self._consumer = StreamConsumer(stream, self.name, host, port, start=start, lease=lease,
                                        timeout=timeout, prefetch=True, client=client,
                                        device=on_read, options=options, **client_options)
        self._pass: _Pass | None = None
        self._restart = False  # after ProducerGone: the next pass starts at the next epoch
        self._item_samples: int | None = None  # samples of a producer batch (seen)
        self._yielded = 0  # batches the loop under way yielded
        self._draining: int | None = None  # the batches of a pass whose last ones are ahead
        self.passes = 0  # passes completed

    @property
    def consumer(self) -> StreamConsumer:
        """The stream consumer underneath (positions, epochs, the client)."""
        return self._consumer

    @property
    def finished(self) -> bool:
        """Whether the producers sent their last epoch and this job read all of it."""
        return self._consumer.finished

    def __iter__(self) -> Iterator[Any]:
        if moves(self.device) and self.device.type != "cpu":
            return self._on_device(self._iterate())
        return self._iterate()

    def _on_device(self, batches: Iterator[Any]) -> Iterator[Any]:
        """The batches with their copies to the device issued ``prefetch`` ahead. An error
        of the stream (``Lagged``, ``ProducerGone``) comes after the batches read before it;
        a copy that fails raises ``DeviceCopyFailed`` with its batch, after those before."""
        ahead: deque[InFlight] = deque()
        pulled = 0
        while True:
            try:
                batch = next(batches)
                pulled += 1
                ahead.append(copy_async(batch, self.device))
            except StopIteration:
                break
            except BaseException:
                while ahead:
                    yield ahead.popleft().take()
                raise
            while len(ahead) > self.prefetch:
                yield ahead.popleft().take()
        self._draining = pulled  # (the pass ended underneath: len() is still its batches)
        try:
            while ahead:
                yield ahead.popleft().take()
        finally:
            self._draining = None

    def _iterate(self) -> Iterator[Any]:
        cons = self._consumer
        self._yielded = 0  # (what len() counts as taken in this loop)
        try:
            p = self._pass_to_go()
            while True:
                while p.rebatcher.ready:
                    self._yielded += 1
                    yield p.rebatcher.pop()
                if p.done:
                    tail = p.rebatcher.flush()
                    if tail is not None:
                        self._yielded += 1
                        yield tail  # (len() still counts this pass's batches here)
                    self._end_pass()
                    return
                try:
                    got = cons.read(self.max_items)
                except Lagged as exc:
                    tail = self._lagged(p)
                    if tail is not None:
                        self._yielded += 1
                        yield tail  # (what it held of the epoch it lagged out of)
                    raise exc
                if got.items and self._item_samples is None:
                    self._item_samples = sample_count(got.items[0])
                if got.finished and got.end is None and not got.items:
                    self._pass = None  # at the end of a finished stream: nothing will come
                    raise self._finished_error()
                if got.epoch != p.epoch:
                    # The epoch this pass went through ended without its mark reaching this
                    # job (freed before it read it): what came belongs to the next pass.
                    cons.unread(got)
                    p.done = True
                    continue
                p.add(got)
        except ProducerGone:
            self._restart, self._pass = True, None
            raise
        finally:
            self._yielded = 0

    def _pass_to_go(self) -> _Pass:
        """The pass a loop goes through: the one under way (cut short by ``Lagged``, or a
        loop that stopped early), else a new one from where this job is.

        Raises:
            StreamFinished: the stream is finished and this job read all of it.
        """
        cons = self._consumer
        if self._restart:
            self._restart, self._pass = False, None
            cons.rejoin("next_epoch")
        if self._pass is not None and self._pass.over:
            self._end_pass()  # (its last batch was taken by a loop that stopped there)
        if self._pass is None:
            if cons.finished and cons.stashed is None:
                raise self._finished_error()
            self._pass = _Pass(self.batch_size, self.drop_last, *self._start())
        return self._pass

    def _start(self) -> tuple[int, int, int | None]:
        """Where the next pass starts: its epoch, the samples of it before, and how many
        samples the epoch has (``None``: not known yet)."""
        cons = self._consumer
        b = cons.stashed  # (given back, or held back to raise Lagged first)
        if b is not None:
            return b.epoch, b.offset, b.end if b.end is not None else b.epoch_samples
        return cons.epoch, cons.offset, cons.epoch_samples

    def _lagged(self, p: _Pass) -> Any | None:
        """After ``Lagged``: what the next pass is, and what this one still yields."""
        b = self._consumer.stashed  # what comes after the items missed
        self._yielded = 0
        if b is None:
            return None
        if b.epoch == p.epoch:
            # The next loop goes on with this epoch, after the items missed; if nothing of
            # it is left for this job, it goes on with the next epoch instead.
            p.read_to = b.offset
            if not b.items and b.end is not None and not p.rebatcher.held:
                self._consumer.read()  # (the epoch's end, given back: taken)
                self._end_pass()
            return None
        # It lagged out of this pass's epoch: what the pass holds of it ends the pass.
        self._end_pass()
        return p.rebatcher.flush()

    def _finished_error(self) -> StreamFinished:
        cons = self._consumer
        n = cons.epoch
        return StreamFinished(
            f"stream {self.stream!r} is finished: its producers ended it after {n} "
            f"epoch{'' if n == 1 else 's'} and job {self.name!r} has read all of it (a "
            f"producer that opens the stream again starts a new run)",
            stream=self.stream, epochs=n)

    def _end_pass(self) -> None:
        self._pass = None
        self.passes += 1

    def __len__(self) -> int:
        """The batches of the pass being iterated (all of them, those taken included), or,
        between passes, of the next one; 0 once the stream is finished and read."""
        if self._draining is not None:
            return self._draining
        cons = self._consumer
        p = self._pass
        if p is None:
            if cons.finished and cons.stashed is None:
                return 0
            _, read_to, total = self._start()
            held = 0
        else:
            read_to, total, held = p.read_to, p.total, p.rebatcher.held
        if total is None and cons.expected is None:
            cons.refresh()  # the producer may have said since this job joined
        for guess in (cons.expected, cons.last_epoch_samples):
            if total is None:
                total = guess  # as the producers announced it, or as the last epoch was
        if total is None:
            raise TypeError(f"the number of batches of stream {self.stream!r} is not known "
                            f"yet: its producer did not say how many samples an epoch has "
                            f"(serve_loader(samples_per_epoch=...)) and no epoch ended yet")
        return self._yielded + self._batches(held, max(total - read_to, 0))

    def _batches(self, held: int, unread: int) -> int:
        """The batches still to come of ``held`` (samples held; the producer's batches
        held, with ``batch_size=None``) and ``unread`` samples."""
        if self.batch_size is None:
            if not unread:
                return held
            if self._item_samples is None:
                raise TypeError("the number of batches is not known before the first batch "
                                "when batch_size=None (the producer's batches): give "
                                "batch_size")
            return held + math.ceil(unread / self._item_samples)
        n = held + unread
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def close(self, leave: bool = True) -> None:
        """Leave the stream (unless ``leave=False``: the job may come back under its name
        and go on) and close the client (if this loader made it)."""
        self._consumer.close(leave=leave)

    def __enter__(self) -> SharedLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
