"""The lower-level pieces of shared data loading: a producer that appends to a stream bin and
marks its epochs, and a consumer that reads it under its own name.

:func:`~tensorshare.data.serve_loader` and :class:`~tensorshare.data.SharedLoader` are built
on these two; use them directly for data that does not come from a DataLoader::

    with StreamProducer("frames", "host", 8000, window=16) as p:
        for epoch in range(3):
            for batch in make_batches():
                p.append(batch)              # held while a consumer is 16 items behind
            p.end_epoch(last=epoch == 2)

    with StreamConsumer("frames", "job-1", "host", 8000, start="next_epoch") as c:
        while True:
            got = c.read(8)                  # up to 8 items of one epoch
            use(got.items)
            if got.finished:
                break

Every wait has a timeout: a read raises ``WaitTimeout`` after ``timeout`` seconds without
an item, a producer's append is retried while the server holds it (see ``hold_timeout``).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Unpack

from ..client import Client, ClientOptions, PendingCall
from ..client.options import ConnectFields, OptionFields
from ..client.streams import (
    Lagged,
    ProducerGone,
    StreamBatch,
    StreamEndResult,
    StreamJoinResult,
    StreamOpenResult,
)
from ..errors import (
    BinFull,
    BinNotFound,
    ConnectionLost,
    InvalidRequest,
    SessionLost,
    Timeout,
    WaitTimeout,
)
from ..memory.ipc import CudaIpcRing
from .batching import sample_count

__all__ = ["StreamConsumer", "StreamProducer", "connect"]

# Each server-side wait takes this share of the client's timeout (as the client's own ops).
_WAIT_SHARE = 0.8


def connect(host: str | None, port: int | None, timeout: float, lease: float,
            options: ClientOptions | None = None, **overrides: Unpack[OptionFields]) -> Client:
    """A client for a stream member: its heartbeat well within the member's lease (unless
    the options give one), so that an idle but live member is never taken for dead.

    Args:
        timeout: the member's patience; the client's own reply timeout is derived from it
            (at most 30 s, at least 1 s), whatever ``options.timeout`` says.
        options, overrides: the client's :class:`~tensorshare.ClientOptions`, and fields of
            it as keywords (they override ``options``); named ``"tensorshare-data"`` unless
            ``name`` says otherwise.
    """
    opts = ClientOptions.of(options, **overrides)
    changes: dict[str, Any] = {"timeout": max(min(timeout, 30.0), 1.0)}
    if opts.heartbeat is None:
        changes["heartbeat"] = max(min(lease / 3, 5.0), 0.05)
    if opts.name is None:
        changes["name"] = "tensorshare-data"
    return Client(host, port, options=opts.replace(**changes))


def _pause(seconds: float) -> None:
    threading.Event().wait(seconds)  # (never set: a plain wait that a signal can interrupt)


def _server_of(client: Any, name: str) -> Any:
    """The client of the server that holds bin ``name`` (one of a sharded client's)."""
    pick = getattr(client, "client_for", None)
    return pick(name) if pick is not None else client


def _server_id(client: Any, name: str) -> str:
    """The id of the server that holds bin ``name``: it changes when that server restarted
    without its data (without a data directory streams are in memory only: they are gone
    then; with one, or after a failover to a replica, the id stays and so do the streams)."""
    return str(_server_of(client, name).server_id)


def _glob_of(name: str) -> str:
    """A ``stats`` glob that matches exactly ``name``."""
    return "".join(f"[{ch}]" if ch in "*?[" else ch for ch in name)


class StreamProducer:
    """One producer of stream bin ``name`` (opening it creates it).

    Args:
        name: the stream's bin name.
        host, port: the server (as for :class:`~tensorshare.client.Client`).
        producer, producers: this producer's index among the stream's ``producers`` (an
            epoch ends once each of them ended it).
        window, on_lag, max_stall, replay, lease: the stream's settings (see
            :meth:`~tensorshare.client.Client.stream_open`; every producer gives the same).
        samples_per_epoch: the samples this producer sends per epoch, if known (consumers
            then know their number of batches before an epoch ends).
        timeout: seconds to connect, and the client's timeout (at most 30 s).
        hold_timeout: seconds an append may be held by the stream in all (the slowest
            consumer is ``window`` behind) before ``BinFull``; ``None``: as long as it takes
            (under ``on_lag="wait"`` the producer keeps the slowest live consumer's pace).
        client: a client to use (not closed by :meth:`close`) instead of a new one.
        device_ipc: send CUDA tensors as CUDA IPC descriptors into a ring of this
            producer's GPU memory (``window + 2`` slots) instead of their bytes: consumers
            must be on this host (``unix://``) and see the GPU; where IPC cannot work, the
            first batch says so once in the log and every batch travels through host memory
            (:mod:`tensorshare.memory.ipc`). Not with ``replay="epoch"``.
        options, client_options: the new client's :class:`~tensorshare.ClientOptions`, and
            fields of it as keywords (``token``, ``tls_ca``, ...; they override ``options``);
            its ``timeout`` comes from ``timeout`` (see :func:`connect`).

    Raises:
        ConnectError: no server within ``timeout``.
        InvalidRequest: the stream is open with other settings by live producers.
    """

    def __init__(self, name: str, host: str | None = None, port: int | None = None, *,
                 producer: int = 0, producers: int = 1, window: int = 32, on_lag: str = "wait",
                 max_stall: float | None = None, replay: str = "none", lease: float = 10.0,
                 samples_per_epoch: int | None = None, timeout: float = 60.0,
                 hold_timeout: float | None = None, client: Client | None = None,
                 device_ipc: bool = False, options: ClientOptions | None = None,
                 **client_options: Unpack[ConnectFields]) -> None:
        self.name = name
        self.producer = producer
        self.hold_timeout = hold_timeout
        self._settings: dict[str, Any] = dict(
            producer=producer, producers=producers, window=window, on_lag=on_lag,
            max_stall=max_stall, replay=replay, lease=lease, samples=samples_per_epoch,
            device_ipc=bool(device_ipc))
        self.lease = lease
        # CUDA IPC: a ring of window + 2 slots, so that a slot is written again only after
        # the window proved every live consumer past its item (memory.ipc).
        self.ring: CudaIpcRing | None = None
        if device_ipc:
            if replay == "epoch":
                raise ValueError("device_ipc=True cannot keep an epoch for late joiners "
                                 "(replay='epoch'): the ring's slots are reused long before")
            self.ring = CudaIpcRing(window + 2)
        self._own = client is None
        self.client = client if client is not None else connect(
            host, port, timeout, lease, options, **client_options)
        self.epoch = 0  # the epoch this producer appends to
        self.sent = 0  # samples it appended to it
        self._server_id = ""  # the server it opened the stream on (a restart changes it)
        try:
            self.opened = self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> StreamOpenResult:
        r: StreamOpenResult = self.client.stream_open(self.name, **self._settings)
        self.epoch, self.sent = r.epoch, r.sent
        self._server_id = _server_id(self.client, self.name)
        return r

    def _gone(self, exc: Exception) -> ProducerGone | None:
        """The ``ProducerGone`` an error of an append or end means, if it means one: the
        server lost this client's session, forgot the stream, or restarted without a data
        directory (its streams were in memory only): this producer's epoch is lost on the
        server either way."""
        restarted = _server_id(self.client, self.name) != self._server_id
        if isinstance(exc, (SessionLost, BinNotFound)) or (
                isinstance(exc, InvalidRequest) and restarted):
            return ProducerGone(f"stream {self.name!r}: {exc}")
        return None

    def reopen(self, timeout: float = 60.0) -> StreamOpenResult:
        """Open the stream again after ``ProducerGone`` and wait until it is whole (every
        producer back); then restart the epoch from its first sample.

        Raises:
            ProducerGone: a producer stayed gone for ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            r = self._open()
            if not r.broken:
                return r
            if time.monotonic() >= deadline:
                raise ProducerGone(f"a producer of stream {self.name!r} stayed gone for "
                                   f"{timeout:g} s")
            _pause(0.1)

    def wait_for_consumers(self, n: int, timeout: float = 60.0) -> int:
        """Wait until at least ``n`` consumers are in the stream. Returns how many are.

        Raises:
            WaitTimeout: fewer joined within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            have = self._open().consumers
            if have >= n:
                return have
            if time.monotonic() >= deadline:
                raise WaitTimeout(f"{have} of {n} consumers joined stream {self.name!r} "
                                  f"within {timeout:g} s")
            _pause(0.05)

    def append(self, value: Any, *, samples: int | None = None) -> int:
        """Append one item (a batch) to this producer's epoch; returns its position.

        Args:
            samples: the samples it holds (default: the size of dimension 0 of its first
                tensor, else 1).

        Raises:
            ProducerGone: another producer is gone, or this one counted as gone (its
                connection was lost for longer than its lease): :meth:`reopen`, then
                restart the epoch.
            BinFull: held longer than ``hold_timeout``.
        """
        return self.extend([value], samples=None if samples is None else [samples])

    def extend(self, values: Sequence[Any], *, samples: Sequence[int] | None = None) -> int:
        """Append several items at once (all or none; with ``device_ipc``, one after the
        other: each must wait for its ring slot); returns the first one's position."""
        counts = list(samples) if samples is not None else \
            [sample_count(v) or 1 for v in values]
        if self.ring is not None:
            if len(values) > 1:
                first = self.extend(values[:1], samples=counts[:1])
                for v, n in zip(values[1:], counts[1:], strict=True):
                    self.extend([v], samples=[n])
                return first
            values = [self.ring.export(values[0])]
        deadline = None if self.hold_timeout is None else time.monotonic() + self.hold_timeout
        while True:
            try:
                r = self.client.stream_append(self.name, values, epoch=self.epoch,
                                              producer=self.producer, samples=counts)
                break
            except BinFull:  # held for the client's share of time: nothing stored, again
                if deadline is not None and time.monotonic() >= deadline:
                    raise
            except (SessionLost, BinNotFound, InvalidRequest) as exc:
                # The server lost this client's session or the stream (it restarted, or we
                # were away past the session's life): this epoch is lost on the server.
                gone = self._gone(exc)
                if gone is None:
                    raise
                raise gone from None
        self.sent += sum(counts)
        return int(r.position)

    def end_epoch(self, *, last: bool = False) -> StreamEndResult:
        """Mark the end of this producer's epoch (``last``: no more epochs from it).

        Raises:
            ProducerGone: as for :meth:`append`.
        """
        while True:
            try:
                r: StreamEndResult = self.client.stream_end(
                    self.name, epoch=self.epoch, samples=self.sent, producer=self.producer,
                    last=last)
                break
            except WaitTimeout:  # held (the others end the previous epoch, or the
                continue         # window has no room for the epoch's mark): again
            except (SessionLost, BinNotFound, InvalidRequest) as exc:
                gone = self._gone(exc)
                if gone is None:
                    raise
                raise gone from None
        self.epoch, self.sent = r.epoch, 0
        return r

    def wait_finished(self, timeout: float | None = None) -> None:
        """After this producer ended its last epoch: wait until the stream is finished
        (every producer ended its last epoch), or the stream is gone because nobody is in it
        any more. It waits as long as the other producers are live (they may still be
        sending their part of the epoch), or up to ``timeout`` seconds.

        Raises:
            ProducerGone: that epoch cannot complete (another producer died in it), or was
                aborted after all (a producer took the dead one's place), or the server
                restarted without a data directory (its streams were in memory only):
                :meth:`reopen`, then send the epoch again.
            WaitTimeout: not finished within ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        gap = 0.02
        while True:
            bins = _server_of(self.client, self.name).stats(_glob_of(self.name))["bins"]
            if _server_id(self.client, self.name) != self._server_id:
                raise ProducerGone(f"the server of stream {self.name!r} restarted without a "
                                   f"data directory (its streams were in memory only): its "
                                   f"last epoch is lost")
            info = bins.get(self.name)
            if info is None or info.get("kind") != "stream":
                return  # it finished and everyone left: the stream was removed
            st = info["stream"]
            me = st["producers"].get(str(self.producer))
            if st["finished"] or me is None:
                return  # (None: it finished, and a new run began without this producer)
            if me["state"] != "done" or st["broken"]:
                raise ProducerGone(f"epoch {self.epoch - 1} of stream {self.name!r}, which "
                                   f"producer {self.producer} ended as its last, cannot "
                                   f"complete (another producer died in it): open the "
                                   f"stream again and send the epoch again")
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"stream {self.name!r} did not finish within {timeout:g} s "
                                  f"(other producers are still in their last epoch)")
            _pause(gap)
            gap = min(gap * 1.5, 0.25)

    def close(self, drain: float | None = None) -> None:
        """Close the client (if this producer made it). A producer closed before it ended
        its last epoch counts as gone at once: consumers get ``ProducerGone``.

        With ``device_ipc``, the ring's GPU memory is freed after the live consumers read
        every item of it (:meth:`wait_drained`, up to ``drain`` seconds: default three
        leases)."""
        try:
            if self.ring is not None and self.ring.exported and not self.client.closed:
                self.wait_drained(3 * self.lease if drain is None else drain)
        finally:
            if self.ring is not None:
                self.ring.close()
            if self._own:
                self.client.close()

    def wait_drained(self, timeout: float) -> bool:
        """Wait (up to ``timeout`` seconds) until every live consumer of the stream was sent
        everything in it, or left. Returns whether they were."""
        deadline = time.monotonic() + timeout
        gap = 0.02
        while True:
            try:
                info = _server_of(self.client, self.name).stats(_glob_of(self.name))[
                    "bins"].get(self.name)
            except Exception:  # (the server is gone: nobody reads the ring any more)
                return False
            if info is None or info.get("kind") != "stream":
                return True
            st = info["stream"]
            busy = [c for c in st["consumers"].values() if c["state"] in ("live", "detached")
                    and (c["cursor"] is None or c["cursor"] < st["head"])]
            if not busy:
                _pause(0.5)  # (the last reply may still be copied out on its way)
                return True
            if time.monotonic() >= deadline:
                return False
            _pause(gap)
            gap = min(gap * 1.5, 0.25)

    def __enter__(self) -> StreamProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StreamConsumer:
    """One consumer of stream bin ``name``, under the name ``consumer`` (joining creates the
    stream if no producer opened it yet: joining never waits).

    Args:
        name: the stream's bin name. consumer: this consumer's name in the stream: a
            consumer that joins again under the same name goes on from where it was.
        host, port: the server.
        start: ``"now"``, ``"next_epoch"`` or ``"epoch_start"`` (see
            :meth:`~tensorshare.client.Client.stream_join`).
        lease: seconds this consumer may be unreachable before the stream drops it.
        resume: a consumer of that name the stream knows goes on from where it was.
        timeout: seconds :meth:`read` waits for an item (and to connect).
        prefetch: keep one read in flight: the next items travel while the caller works on
            the last ones.
        device: copy the items' tensors to this device as they are read (see
            ``Client.get``; a ``device_ipc`` stream's items arrive on their GPU anyway).
        client, options, client_options: as for :class:`StreamProducer`.

    Raises:
        ConnectError: no server within ``timeout``.
    """

    def __init__(self, name: str, consumer: str, host: str | None = None,
                 port: int | None = None, *, start: str = "now", lease: float = 10.0,
                 resume: bool = True, timeout: float = 60.0, prefetch: bool = False,
                 client: Client | None = None, device: Any = None,
                 options: ClientOptions | None = None,
                 **client_options: Unpack[ConnectFields]) -> None:
        self.device = device  # (checked by the client's reads)
        self.name, self.consumer, self.start = name, consumer, start
        self.lease, self.timeout, self.prefetch = lease, timeout, prefetch
        self._own = client is None
        self.client = client if client is not None else connect(
            host, port, timeout, lease, options, **client_options)
        self.position: int | None = None  # where the next read starts (None: the server's)
        self.epoch = 0  # the epoch at that position
        self.offset = 0  # samples of that epoch before it
        self.epoch_samples: int | None = None  # samples that epoch has, if known
        self.expected: int | None = None  # samples of an epoch, as the producers announced
        self.last_epoch_samples: int | None = None  # samples of the last epoch that ended
        self.finished = False
        self._stash: StreamBatch | None = None  # a batch held back to raise Lagged first
        self._pending: tuple[int, int | None, PendingCall] | None = None  # (pid, at, call)
        self._pid = os.getpid()
        self._server_id = ""  # the server it joined the stream on (a restart changes it)
        try:
            self.joined = self._join(resume, start)
        except BaseException:
            self.close()
            raise

    def _join(self, resume: bool, start: str) -> StreamJoinResult:
        r: StreamJoinResult = self.client.stream_join(self.name, self.consumer, start=start,
                                                      lease=self.lease, resume=resume)
        self._pending = None
        self._server_id = _server_id(self.client, self.name)
        self.position, self.epoch, self.offset = r.position, r.epoch, r.offset
        self.epoch_samples = r.epoch_samples
        if r.epoch_samples is not None:
            self.expected = r.epoch_samples
        self.finished = r.finished
        return r

    def refresh(self) -> StreamJoinResult:
        """Ask the stream again what it knows of this consumer's epoch (the samples the
        producers announced, say, when they opened the stream after this consumer joined).
        Its position does not change."""
        r: StreamJoinResult = self.client.stream_join(self.name, self.consumer,
                                                      start=self.start, lease=self.lease)
        if r.epoch_samples is not None:
            self.expected = r.epoch_samples
            if self.epoch_samples is None and r.epoch == self.epoch:
                self.epoch_samples = r.epoch_samples
        return r

    def rejoin(self, start: str = "next_epoch") -> StreamJoinResult:
        """Move to ``start`` (after ``ProducerGone``: the next epoch a producer starts)."""
        self._stash = None
        return self._join(False, start)

    def read(self, max_items: int | None = None, *, timeout: float | None = None
             ) -> StreamBatch:
        """Up to ``max_items`` items of one epoch, from where the last read ended (which
        acknowledges everything before). Waits up to ``timeout`` (default: the consumer's)
        for at least one item.

        Returns:
            A :class:`~tensorshare.client.streams.StreamBatch`; it may hold no item when it
            ends the epoch (``end``) or the stream (``finished``).

        Raises:
            WaitTimeout: no item within ``timeout``.
            Lagged: items were freed before this consumer read them (``missed``: how many);
                the next read returns what comes after them.
            ProducerGone: the epoch can never complete (a producer died, or the server
                restarted without a data directory: its streams were in memory only):
                :meth:`rejoin`.
        """
        if self._pid != os.getpid():
            # A forked process (a DataLoader worker): it goes on from what the stream knows
            # this consumer acknowledged, not from what the parent (or a previous worker,
            # whose reads this copy never saw) had read.
            self._pid, self._pending, self._stash = os.getpid(), None, None
            self._join(True, self.start)
        if self._stash is not None:
            stashed, self._stash = self._stash, None
            return stashed
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            got = self._one(max_items, deadline)
            if got is not None:
                break
            if time.monotonic() >= deadline:
                raise WaitTimeout(f"no item in stream {self.name!r} for consumer "
                                  f"{self.consumer!r} within {limit:g} s")
        self._advance(got, max_items)
        if got.missed:
            self._stash = dataclasses.replace(got, missed=0)
            raise Lagged(f"consumer {self.consumer!r} of stream {self.name!r} missed "
                         f"{got.missed} items (freed before it read them); it goes on from "
                         f"the oldest item still kept", missed=got.missed)
        return got

    def _one(self, max_items: int | None, deadline: float) -> StreamBatch | None:
        """One read (the one in flight, if it is for this position): the batch, or ``None``
        if the server had nothing within its wait."""
        pending, self._pending = self._pending, None
        try:
            if pending is not None and pending[0] == os.getpid() and pending[1] == self.position:
                return pending[2].result()
            wait = max(min(deadline - time.monotonic(), _WAIT_SHARE * self.client.timeout), 0.0)
            return self.client.stream_read(
                self.name, self.consumer, at=self.position, max_items=max_items, timeout=wait,
                device=self.device)
        except WaitTimeout:
            return None
        except SessionLost:
            return None  # the read's outcome is unknown; reading from our position is safe
        except BinNotFound:
            if _server_id(self.client, self.name) != self._server_id:
                # The server restarted without a data directory: its streams were in
                # memory only, so the epoch this consumer was in is cut short, as when a
                # producer dies.
                self._stash = None
                raise ProducerGone(f"the server of stream {self.name!r} restarted without a "
                                   f"data directory (its streams were in memory only): the "
                                   f"epoch in progress is lost; rejoin at 'next_epoch'"
                                   ) from None
            # The stream forgot this consumer (dropped and removed while it was away):
            # join again; a position it still keeps goes on.
            at = self.position
            r = self._join(True, self.start)
            if at is not None and at <= r.head:
                self.position = at
            return None

    def _advance(self, got: StreamBatch, max_items: int | None) -> None:
        self.position = got.next
        if got.end is not None:
            self.last_epoch_samples = got.end
            self.epoch, self.offset, self.epoch_samples = got.epoch + 1, 0, self.expected
        else:
            if got.epoch_samples is not None:
                self.expected = got.epoch_samples
            self.epoch, self.epoch_samples = got.epoch, got.epoch_samples
            self.offset = got.offset + sum(sample_count(x) or 1 for x in got.items)
        self.finished = got.finished
        if self.prefetch and not got.finished:
            wait = _WAIT_SHARE * self.client.timeout
            call = self.client.begin.stream_read(self.name, self.consumer, at=got.next,
                                                 max_items=max_items, timeout=wait,
                                                 device=self.device)
            self._pending = (os.getpid(), got.next, call)

    @property
    def stashed(self) -> StreamBatch | None:
        """The batch the next :meth:`read` returns without asking the server: one given back
        (:meth:`unread`), or the one that follows the items missed after ``Lagged``."""
        return self._stash

    def unread(self, batch: StreamBatch) -> None:
        """Give a batch back: the next :meth:`read` returns it again."""
        self._stash = batch

    def leave(self) -> bool:
        """Leave the stream (it stops holding anyone back). Returns whether it was in it."""
        self._pending = None
        return bool(self.client.stream_leave(self.name, self.consumer))

    def close(self, leave: bool = False) -> None:
        """Close the client (if this consumer made it); ``leave`` first if asked.

        Closing without leaving drops the consumer at once (it holds nobody back) but the
        stream remembers it: joining again under its name goes on from where it was, as
        long as the items after that are still kept. Leaving is a courtesy: with no
        connection to the server (it stopped, say, once its stream ended) there is nothing
        to leave, and the server drops the consumer after its lease anyway."""
        try:
            if leave and not self.client.closed and self.client.connected:
                try:
                    self.leave()
                except (ConnectionLost, Timeout):
                    pass  # (the server went away meanwhile: nothing held to give back)
        finally:
            if self._own:
                self.client.close()

    def __enter__(self) -> StreamConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(leave=True)
