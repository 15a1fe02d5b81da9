"""The client ops of stream bins, mixed into every client face (see :mod:`tensorshare.data`,
which builds ``serve_loader`` and ``SharedLoader`` on them).

A stream bin is one sequence of items that every consumer receives, each with its own
position kept on the server under its name. The ops, each written once here:

* producers: :meth:`StreamOps.stream_open`, :meth:`~StreamOps.stream_append`,
  :meth:`~StreamOps.stream_end`;
* consumers: :meth:`~StreamOps.stream_join`, :meth:`~StreamOps.stream_read`,
  :meth:`~StreamOps.stream_leave`.

Their results are the small records below. ``Lagged`` and ``ProducerGone`` are re-exported
here for :mod:`tensorshare.data`, which may import only the clients and the errors.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..wire.codec import decode
from ..wire.messages import Item
from ..wire.protocol import check_bin_name
from ..wire.streams import (
    LAG_POLICIES,
    MAX_LEASE,
    MAX_PRODUCERS,
    MAX_WINDOW,
    REPLAY_POLICIES,
    STARTS,
    Lagged,
    ProducerGone,
    StreamAppend,
    StreamEnd,
    StreamJoin,
    StreamLeave,
    StreamOpen,
    StreamRead,
)
from .command import BLOCK_SHARE, NOWAIT, Command, FaceNeeds, cuda_ipc_reader, gc_paused

__all__ = [
    "LAG_POLICIES",
    "REPLAY_POLICIES",
    "STARTS",
    "Lagged",
    "ProducerGone",
    "StreamAppendResult",
    "StreamBatch",
    "StreamEndResult",
    "StreamJoinResult",
    "StreamOpenResult",
    "StreamOps",
]


@dataclass(frozen=True, slots=True)
class StreamOpenResult:
    """What :meth:`StreamOps.stream_open` returns.

    Attributes:
        epoch: the epoch this producer appends to now (pass it to append and end).
        head: the stream's next position.
        sent: samples this producer already appended to ``epoch`` (a reopen of the same
            client; 0 otherwise).
        consumers: consumers in the stream now.
        broken: after this open, a producer of the stream is still gone: appends raise
            ``ProducerGone`` until it opens the stream again.
        aborted: the epoch this open ended as aborted (a producer had died in it), if it
            ended one: every producer sends ``epoch`` from its start.
    """

    epoch: int
    head: int
    sent: int
    consumers: int
    broken: bool
    aborted: int | None = None


@dataclass(frozen=True, slots=True)
class StreamAppendResult:
    """What :meth:`StreamOps.stream_append` returns: the position of the first item
    appended and the stream's next position."""

    position: int
    head: int


@dataclass(frozen=True, slots=True)
class StreamEndResult:
    """What :meth:`StreamOps.stream_end` returns: the epoch this producer appends to next,
    whether the epoch it ended is complete (every producer ended it), and whether the stream
    is finished (every producer ended its last epoch)."""

    epoch: int
    complete: bool
    finished: bool


@dataclass(frozen=True, slots=True)
class StreamJoinResult:
    """What :meth:`StreamOps.stream_join` returns.

    Attributes:
        position: where the consumer reads next (``None``: it waits for the next epoch to
            begin; read with ``at=None``).
        epoch: the epoch at that position. offset: the samples of that epoch before it.
        epoch_samples: the samples that epoch has (``None``: not known yet).
        head: the stream's next position.
        resumed: the stream knew this consumer; it goes on from what it acknowledged.
        finished: the stream is finished and this consumer is at its end: nothing is left
            for it (until a producer opens the stream again).
    """

    position: int | None
    epoch: int
    offset: int
    epoch_samples: int | None
    head: int
    resumed: bool
    finished: bool = False


@dataclass(frozen=True, slots=True)
class StreamBatch:
    """What :meth:`StreamOps.stream_read` returns: items of one epoch, oldest first.

    Attributes:
        items: the decoded values.
        first: the position of the first entry returned; next: where to read next (pass it
            as ``at``: that acknowledges these items).
        epoch: their epoch. offset: the samples of the epoch before the first item.
        epoch_samples: the samples the epoch has (exact once ended; else as announced by
            the producers; ``None``: unknown).
        end: the read reached the end of the epoch: its exact number of samples (else
            ``None``). aborted: that end is an abort (a producer died mid-epoch).
        missed: items that were freed before this consumer read them (it lagged).
        finished: the producers sent their last epoch and this consumer read all of it.
        tags: the items' tags.
    """

    items: list[Any]
    first: int
    next: int
    epoch: int
    offset: int
    epoch_samples: int | None
    end: int | None
    aborted: bool
    missed: int
    finished: bool
    tags: tuple[int | None, ...] = ()

    @property
    def ended(self) -> bool:
        """Whether this read reached the end of its epoch."""
        return self.end is not None


def _opened(reply: Any) -> StreamOpenResult:
    return StreamOpenResult(reply.epoch, reply.head, reply.sent, reply.consumers, reply.broken,
                            reply.aborted)


def _appended(reply: Any) -> StreamAppendResult:
    return StreamAppendResult(reply.position, reply.head)


def _ended(reply: Any) -> StreamEndResult:
    return StreamEndResult(reply.epoch, reply.complete, reply.finished)


def _joined(reply: Any) -> StreamJoinResult:
    return StreamJoinResult(reply.position, reply.epoch, reply.offset, reply.epoch_samples,
                            reply.head, reply.resumed, reply.finished)


def _left(reply: Any) -> bool:
    return bool(reply.flag)


class _DecodeBatch:
    """Converts a stream_read reply: its items decoded (cuda-ipc ones copied out, see
    :mod:`tensorshare.memory.ipc`), then, with a device, their tensors copied there."""

    __slots__ = ("max_depth", "cuda_ipc", "device", "non_blocking")

    def __init__(self, max_depth: int, cuda_ipc: Any = None, device: Any = None,
                 non_blocking: bool = False) -> None:
        self.max_depth, self.cuda_ipc = max_depth, cuda_ipc
        self.device, self.non_blocking = device, non_blocking

    def __call__(self, reply: Any) -> StreamBatch:
        from ..memory.device import moves, to_device

        items: tuple[Item, ...] = reply.items
        with gc_paused(len(items)):
            if self.cuda_ipc is None:
                values = [decode(it.value, max_depth=self.max_depth) for it in items]
                batch = StreamBatch(values, reply.first, reply.next, reply.epoch,
                                    reply.offset, reply.epoch_samples, reply.end,
                                    reply.aborted, reply.missed, reply.finished,
                                    tuple(it.tag for it in items))
            else:
                batch = self._with_ipc(reply, items)
        if moves(self.device) and batch.items:
            moved = to_device(batch.items, self.device, non_blocking=self.non_blocking,
                              whole=batch)
            batch = dataclasses.replace(batch, items=moved)
        return batch

    def _with_ipc(self, reply: Any, items: tuple[Item, ...]) -> StreamBatch:
        """Decode items that may be cuda-ipc ones. An item whose slot its producer wrote
        again before it was copied out (it was read too late) is lost: it and every item
        before it count as ``missed`` (what follows is whole), so the consumer gets
        ``Lagged``, never wrong data."""
        from ..memory.ipc import SlotReused

        values: list[Any] = []
        lost, lost_samples = 0, 0
        for it in items:
            try:
                values.append(decode(it.value, max_depth=self.max_depth,
                                     cuda_ipc=self.cuda_ipc))
            except SlotReused as exc:
                lost_samples += sum(_samples(v) for v in values) + (exc.samples or 1)
                lost += len(values) + 1
                values = []
        tags = tuple(it.tag for it in items)[lost:]
        return StreamBatch(values, reply.first + lost, reply.next, reply.epoch,
                           reply.offset + lost_samples, reply.epoch_samples, reply.end,
                           reply.aborted, reply.missed + lost, reply.finished, tags)


def is_array(x: Any) -> bool:
    """Whether ``x`` is a torch tensor or a numpy array (what holds samples along dimension 0)."""
    module = type(x).__module__
    return (module.startswith("torch") and hasattr(x, "shape")) or \
        (module == "numpy" and hasattr(x, "shape"))


def sample_count(batch: Any) -> int | None:
    """The samples of ``batch``: the size of dimension 0 of its first tensor (``None``: it
    holds no tensor with a dimension). A batch is a tensor (or numpy array), or a tuple,
    list or dict of batches; ``tensorshare.data.sample_count`` is this."""
    if is_array(batch):
        return int(batch.shape[0]) if len(batch.shape) else None
    if isinstance(batch, dict):
        values: Any = batch.values()
    elif isinstance(batch, (tuple, list)):
        values = batch
    else:
        return None
    for v in values:
        n = sample_count(v)
        if n is not None:
            return n
    return None


def _samples(batch: Any) -> int:
    """The samples of a batch as a stream counts them (:func:`sample_count`, or
    1): dimension 0 of its first tensor."""
    n = sample_count(batch)
    return 1 if n is None else n


def _check_int(value: Any, what: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or \
            (high is not None and value > high):
        bound = f" and {high}" if high is not None else ""
        raise ValueError(f"{what} must be an int between {low}{bound}, not {value!r}")
    return value


def _check_seconds(value: Any, what: str, *, positive: bool = True,
                   maximum: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not (0 < value if positive else 0 <= value) or value > maximum or \
            not math.isfinite(value):
        raise ValueError(f"{what} must be a finite {'positive' if positive else 'non-negative'} "
                         f"number of seconds (at most {maximum:g}), not {value!r}")
    return float(value)


def _check_choice(value: Any, what: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{what} must be one of {', '.join(map(repr, choices))}, not "
                         f"{value!r}")
    return str(value)


class StreamOps(FaceNeeds):
    """Stream ops for :class:`~.ops.Ops` (see :mod:`tensorshare.data`).

    A face provides what :class:`~.ops.Ops` asks for (``limits``, ``timeout``, ``_item``,
    ``_execute``); each op here checks its arguments, builds its request and hands the face
    a ``Command``.
    """

    def _stream_call(self, request: Any, what: str, convert: Any) -> Any:

        return self._execute(Command(request, what, convert))

    def _stream_name(self, name: str) -> str:
        return check_bin_name(name, self.limits.max_name_bytes)

    def _consumer_name(self, consumer: str) -> str:
        try:
            return check_bin_name(consumer, self.limits.max_name_bytes)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"consumer name: {exc}") from None

    def _stream_items(self, name: str, values: Sequence[Any]) -> list[Item]:
        items = []
        for value in values:
            item = self._item(name, value, None)
            if type(item) is not Item:
                # A pipeline defers encoding lone tensors (for its merged appends); a stream
                # append goes as it is, so encode it now the way the pipeline's client does.
                host: Any = getattr(self, "_host", None)
                item = host._item(name, value, None)
            items.append(item)
        return items

    # -- producers --------------------------------------------------------------------------
    def stream_open(self, name: str, *, producer: int = 0, producers: int = 1,
                    window: int = 32, on_lag: str = "wait", max_stall: float | None = None,
                    replay: str = "none", lease: float = 10.0,
                    samples: int | None = None, device_ipc: bool = False) -> Any:
        """Open stream ``name`` as producer ``producer`` of ``producers`` (creating it).

        Args:
            window: appends are held on the server while the stream holds more than this
                many positions its slowest live consumer has not acknowledged.
            on_lag: ``"wait"``: everyone keeps the slowest consumer's pace; ``"detach"``: a
                consumer that held the window full for ``max_stall`` seconds (default 10)
                stops holding the others back; its next read skips what was freed (it
                gets ``Lagged``) and it holds the window again from there.
            replay: ``"epoch"`` keeps the current epoch's items for consumers that join at
                ``"epoch_start"``; ``"none"`` frees items once every consumer has them.
            lease: seconds this producer may be unreachable before it counts as gone (its
                consumers then get ``ProducerGone``).
            samples: the samples this producer expects to send per epoch, if known (lets
                consumers tell their number of batches before the epoch ends).
            device_ipc: the stream carries CUDA IPC descriptors (its items point into the
                producer's GPU memory, :mod:`tensorshare.memory.ipc`): the server refuses
                consumers that are not on its host (not over ``unix://``) and
                ``replay="epoch"`` (a late joiner would read slots long reused).

        Returns:
            A :class:`StreamOpenResult` (``epoch``: pass it to append and end).

        Raises:
            ValueError: an argument is out of range (nothing was sent).
            InvalidRequest: the name is a bin of another kind, or the stream's live
                producers opened it with other settings.
        """
        self._stream_name(name)
        producers = _check_int(producers, "producers", 1, MAX_PRODUCERS)
        request = StreamOpen(0, name, _check_int(producer, "producer", 0, producers - 1),
                             producers, _check_int(window, "window", 1, MAX_WINDOW),
                             _check_choice(on_lag, "on_lag", LAG_POLICIES),
                             None if max_stall is None else
                             _check_seconds(max_stall, "max_stall", positive=False),
                             _check_choice(replay, "replay", REPLAY_POLICIES),
                             _check_seconds(lease, "lease", maximum=MAX_LEASE),
                             None if samples is None else _check_int(samples, "samples", 0),
                             bool(device_ipc))
        if request.device_ipc and request.replay == "epoch":
            raise ValueError("device_ipc=True cannot keep an epoch for late joiners "
                             "(replay='epoch'): the ring's slots are reused long before")
        return self._stream_call(request, f"stream_open of stream {name!r}", _opened)

    def stream_append(self, name: str, values: Sequence[Any], *, epoch: int,
                      producer: int = 0, samples: Sequence[int] | None = None,
                      timeout: float | None = None) -> Any:
        """Append ``values`` (one item each, in order, all or none) to epoch ``epoch``.

        The server holds the append while the stream is ``window`` positions ahead of its
        slowest consumer, or while the other producers have not ended the previous epoch.

        Args:
            samples: the samples each value holds (default 1 each), for the epoch's count.
            timeout: how long the server may hold it (default and most: 80% of the
                client's timeout, so that the error comes before the client gives up).

        Returns:
            A :class:`StreamAppendResult`.

        Raises:
            BinFull: it was held for ``timeout`` seconds (retry: nothing was stored).
            ProducerGone: another producer is gone (this epoch cannot complete), or this
                one counted as gone: open the stream again and restart the epoch.
            InvalidRequest: not opened by this client, or another epoch than its own.
            MemoryLimitExceeded: the server's memory limit would be exceeded.
        """

        self._stream_name(name)
        values = list(values)
        if not values:
            raise ValueError("stream_append needs at least one value")
        counts = None if samples is None else tuple(
            _check_int(n, "samples", 0) for n in samples)
        if counts is not None and len(counts) != len(values):
            raise ValueError(f"samples has {len(counts)} counts for {len(values)} values")
        most = BLOCK_SHARE * self.timeout
        wait = most if timeout is None else min(_check_seconds(timeout, "timeout",
                                                               positive=False), most)
        items = self._stream_items(name, values)
        request = StreamAppend(0, name, _check_int(producer, "producer", 0),
                               _check_int(epoch, "epoch", 0), items[0], tuple(items[1:]),
                               counts, wait)
        return self._stream_call(request, f"stream_append to stream {name!r}", _appended)

    def stream_end(self, name: str, *, epoch: int, samples: int, producer: int = 0,
                   last: bool = False, timeout: float | None = None) -> Any:
        """Mark the end of this producer's epoch ``epoch``, in which it sent ``samples``
        samples (``last``: it sends no more epochs).

        An end of an epoch that follows one the other producers have not ended yet is held
        on the server (up to ``timeout``: by default and at most 80% of the client's).

        Returns:
            A :class:`StreamEndResult` (``epoch``: the one to append to next).

        Raises:
            InvalidRequest: ``samples`` is not what the stream received from this producer.
            WaitTimeout: it was held for ``timeout`` (nothing was marked: try again).
            ProducerGone: as for :meth:`stream_append`.
        """

        self._stream_name(name)
        most = BLOCK_SHARE * self.timeout
        wait = most if timeout is None else min(_check_seconds(timeout, "timeout",
                                                               positive=False), most)
        request = StreamEnd(0, name, _check_int(producer, "producer", 0),
                            _check_int(epoch, "epoch", 0), _check_int(samples, "samples", 0),
                            bool(last), wait)
        return self._stream_call(request, f"stream_end of stream {name!r}", _ended)

    # -- consumers --------------------------------------------------------------------------
    def stream_join(self, name: str, consumer: str, *, start: str = "now", lease: float = 10.0,
                    resume: bool = True) -> Any:
        """Join stream ``name`` as consumer ``consumer`` (creating the stream if needed).

        Args:
            start: ``"now"``, ``"next_epoch"`` (the next epoch's start, or the current one's
                if nothing of it was sent yet) or ``"epoch_start"`` (the current epoch's
                start: the producer must keep it, ``replay="epoch"``).
            lease: seconds this consumer may be unreachable before the stream drops it
                (the others then go on without it).
            resume: a consumer of that name the stream knows goes on from what it
                acknowledged (``False``: it moves to ``start``).

        Returns:
            A :class:`StreamJoinResult`.

        Raises:
            InvalidRequest: ``"epoch_start"`` but the epoch's first items are not kept.
            LimitExceeded: the stream has the most consumers it may have.
        """
        self._stream_name(name)
        request = StreamJoin(0, name, self._consumer_name(consumer),
                             _check_choice(start, "start", STARTS),
                             _check_seconds(lease, "lease", maximum=MAX_LEASE), bool(resume))
        return self._stream_call(request, f"stream_join of stream {name!r}", _joined)

    def stream_read(self, name: str, consumer: str, *, at: int | None = None,
                    max_items: int | None = None, timeout: Any = None, device: Any = None,
                    non_blocking: bool = False) -> Any:
        """Read up to ``max_items`` items of one epoch from position ``at``.

        Reading from ``at`` acknowledges every position before it (the server may free
        those items once every consumer acknowledged them).

        Args:
            at: the position to read from (``next`` of the last read; ``None``: where the
                consumer's last read ended, or its first position after a join).
            max_items: the most items returned (default: as many as fit one reply, up to
                the epoch's end).
            timeout: seconds to wait on the server when nothing is there yet (default:
                do not wait); at most 80% of the client's timeout (read again to wait
                longer).
            device, non_blocking: copy the items' tensors to this device, as for ``get``
                (checked before anything is sent). Items of a ``device_ipc`` stream arrive
                on their GPU, copied out of the producer's ring (``unix://`` only).

        Returns:
            A :class:`StreamBatch` (it may hold no item: at the end of an epoch, when the
            stream finished, or with ``missed`` items: also those of a ``device_ipc``
            stream whose slots were written again before this consumer copied them out).

        Raises:
            WaitTimeout: nothing to read within ``timeout``.
            ProducerGone: the epoch at that position can never complete.
            BinNotFound: no such stream, or the consumer is not in it (join again).
            InvalidRequest: ``at`` is beyond the stream's head.
        """
        from ..memory.device import check_device, want_pinned

        dev = None if device is None else check_device(device)
        self._stream_name(name)
        consumer = self._consumer_name(consumer)
        if at is not None:
            _check_int(at, "at", 0)
        if max_items is not None:
            _check_int(max_items, "max_items", 1)
        most = BLOCK_SHARE * self.timeout
        wait = 0.0 if timeout is None or timeout is NOWAIT else \
            _check_seconds(timeout, "timeout", positive=False)
        if wait > most:
            raise ValueError(f"a stream read waits on the server at most 80% of the client's "
                             f"timeout ({most:g} s), not {wait:g} s: read again to wait longer")
        request = StreamRead(0, name, consumer, at, max_items, wait)
        want_pinned(dev)
        convert = _DecodeBatch(self.limits.max_depth, cuda_ipc_reader(self, name, dev), dev,
                               bool(non_blocking))
        return self._stream_call(request, f"stream_read of stream {name!r}", convert)

    def stream_leave(self, name: str, consumer: str) -> Any:
        """Leave stream ``name`` as ``consumer``. Returns whether it was in the stream."""
        self._stream_name(name)
        request = StreamLeave(0, name, self._consumer_name(consumer))
        return self._stream_call(request, f"stream_leave of stream {name!r}", _left)
