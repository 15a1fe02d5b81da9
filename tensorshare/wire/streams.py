"""The wire of stream bins: their messages, and the rows they add to the op table
(:data:`ROWS`, :data:`REPLY_HEADERS`, :data:`ITEMS_OF`; :mod:`.protocol` builds the table).

A stream bin is an append-only sequence with positions the server assigns (0, 1, 2, ...) that
every consumer of the stream receives, each reading with its own cursor. Producers append
items and mark the end of each epoch with the number of samples they sent; the server puts an
*epoch mark* in the sequence (it takes a position too) once every producer marked the epoch.
See ``docs/PROTOCOL.md`` (stream bins) for every field and what the server does.

Ops (all carry ``bin``):

* ``stream_open``: a producer opens the stream (creating it) with the stream's settings;
* ``stream_append``: a producer appends items to its epoch (held on the server while the
  stream is ``window`` positions ahead of its slowest consumer);
* ``stream_end``: a producer marks the end of its epoch;
* ``stream_join``: a consumer joins (or resumes) by name;
* ``stream_read``: a consumer reads up to ``max_items`` items from a position, which also
  acknowledges everything before it;
* ``stream_leave``: a consumer leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import Lagged, LimitExceeded, ProducerGone
from .fields import (
    MAX_APPEND_ITEMS,
    InvalidField,
    Op,
    check_bin,
    check_bool,
    check_int,
    check_name,
    check_timeout,
    is_int,
    kind_op,
    opt_int,
    parse_acked,
    read_items,
)
from .frames import Payload
from .messages import Batch, Item, Limits, OfBin

__all__ = [
    "LAG_POLICIES",
    "MAX_PRODUCERS",
    "MAX_WINDOW",
    "REPLAY_POLICIES",
    "STARTS",
    "Lagged",
    "ProducerGone",
    "StreamAppend",
    "StreamAppended",
    "StreamEnd",
    "StreamEnded",
    "StreamItems",
    "StreamJoin",
    "StreamJoined",
    "StreamLeave",
    "StreamOpen",
    "StreamOpened",
    "StreamRead",
]

#: What a stream does about a consumer that holds everyone back (see StreamOpen).
LAG_POLICIES = ("wait", "detach")
#: Which items a stream keeps for consumers that join later (see StreamOpen).
REPLAY_POLICIES = ("none", "epoch")
#: Where a consumer that joins starts reading (see StreamJoin).
STARTS = ("now", "next_epoch", "epoch_start")
#: The largest ``window`` a stream may have (positions a producer may run ahead).
MAX_WINDOW = 65_536
#: The most producers one stream may have (``producers``).
MAX_PRODUCERS = 256
#: The longest ``lease`` (seconds) a producer or consumer may ask for.
MAX_LEASE = 3600.0


# -- messages -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StreamOpen(OfBin):
    """A producer opens a stream (creating it if needed) with the stream's settings.

    Attributes:
        producer: this producer's index, ``0 <= producer < producers``.
        producers: how many producers feed the stream (an epoch ends when each marked it).
        window: a producer's append is held while the stream holds more than this many
            positions the slowest live consumer has not acknowledged.
        on_lag: ``"wait"`` (everyone keeps the slowest consumer's pace) or ``"detach"`` (a
            consumer that held the window full longer than ``max_stall`` stops counting
            until it reads again).
        max_stall: with ``on_lag="detach"``: seconds; ``None``: 10 s.
        replay: ``"epoch"`` keeps the current epoch's items for consumers that join at
            ``"epoch_start"``; ``"none"`` frees items once every consumer read them.
        lease: seconds this producer may be unreachable before it counts as gone.
        samples: how many samples this producer expects to send per epoch (``None``:
            unknown); consumers use it to tell their number of batches before the end.
        device_ipc: the items are CUDA IPC descriptors: consumers must be on the server's
            host (a Unix socket); ``replay="epoch"`` is refused.
    """

    producer: int = 0
    producers: int = 1
    window: int = 32
    on_lag: str = "wait"
    max_stall: float | None = None
    replay: str = "none"
    lease: float = 10.0
    samples: int | None = None
    device_ipc: bool = False


@dataclass(frozen=True, slots=True)
class StreamAppend(OfBin, Batch):
    """A producer appends items (``item``, then ``rest``) to its epoch ``epoch``.

    ``samples``: the samples each item holds (one int per item); ``None``: 1 each.
    ``timeout``: how long the append may be held (window, or an epoch not yet ended by the
    other producers) before the error ``bin_full``; ``None``: no limit.
    """

    producer: int
    epoch: int
    item: Item
    rest: tuple[Item, ...] = ()
    samples: tuple[int, ...] | None = None
    timeout: float | None = None


@dataclass(frozen=True, slots=True)
class StreamEnd(OfBin):
    """A producer marks the end of its epoch ``epoch``, in which it sent ``samples`` samples;
    ``last``: it will send no more epochs (the stream finishes once every producer said so).

    ``timeout``: how long the end may be held (this producer ended the previous epoch and
    the others have not yet) before the error ``timeout``; ``None``: no limit.
    """

    producer: int
    epoch: int
    samples: int
    last: bool = False
    timeout: float | None = None


@dataclass(frozen=True, slots=True)
class StreamJoin(OfBin):
    """A consumer joins the stream under the name ``consumer`` (creating the stream if needed).

    Attributes:
        start: ``"now"`` (the next item appended), ``"next_epoch"`` (the start of the next
            epoch; of the current one if nothing of it was appended yet) or ``"epoch_start"``
            (the start of the current epoch, if its items are still kept).
        lease: seconds this consumer may be unreachable before it is dropped (it then no
            longer holds anyone back).
        resume: a consumer of that name that the stream knows keeps its position
            (``False``: it moves to ``start``).
    """

    consumer: str
    start: str = "now"
    lease: float = 10.0
    resume: bool = True


@dataclass(frozen=True, slots=True)
class StreamRead(OfBin):
    """A consumer reads up to ``max_items`` items from position ``at`` (``None``: from where
    its last read ended), which acknowledges every position before ``at``.

    ``timeout``: seconds to wait on the server when nothing is there yet (``0``, the
    default, and absent or nil on the wire: answer at once).
    """

    consumer: str
    at: int | None = None
    max_items: int | None = None
    timeout: float = 0.0


@dataclass(frozen=True, slots=True)
class StreamLeave(OfBin):
    """A consumer leaves the stream (it no longer holds anyone back)."""

    consumer: str


@dataclass(frozen=True, slots=True)
class StreamOpened:
    """Reply to stream_open: the epoch this producer appends to, the stream's next position,
    the samples this producer already sent in that epoch (a reopen by the same session), the
    live consumers, whether the stream is still broken after this open (a producer is gone),
    and the epoch this open ended as aborted, if it ended one (``None``: none)."""

    id: int
    epoch: int
    head: int
    sent: int = 0
    consumers: int = 0
    broken: bool = False
    aborted: int | None = None


@dataclass(frozen=True, slots=True)
class StreamAppended:
    """Reply to stream_append: the position of its first item and the stream's next one."""

    id: int
    position: int
    head: int


@dataclass(frozen=True, slots=True)
class StreamEnded:
    """Reply to stream_end: the epoch this producer appends to next, whether the epoch it
    ended is complete (every producer marked it), and whether the stream is finished."""

    id: int
    epoch: int
    complete: bool = False
    finished: bool = False


@dataclass(frozen=True, slots=True)
class StreamJoined:
    """Reply to stream_join.

    Attributes:
        position: where the consumer reads next; ``None`` while it waits for the next
            epoch to start (its first read waits for it).
        epoch: the epoch at that position. offset: samples of that epoch before it.
        epoch_samples: the samples that epoch has (exact once ended, else what the
            producers announced; ``None``: unknown).
        head: the stream's next position. resumed: the stream knew the consumer and kept
            its position.
        finished: the stream is finished and the consumer is at its end: nothing is left
            for it to read (until a producer opens the stream again).
    """

    id: int
    position: int | None
    epoch: int
    offset: int = 0
    epoch_samples: int | None = None
    head: int = 0
    resumed: bool = False
    finished: bool = False


@dataclass(frozen=True, slots=True)
class StreamItems:
    """Reply to stream_read: items of one epoch, oldest first (never across an epoch mark).

    Attributes:
        items: the items (``Item`` on the wire, decoded values in a client's hands).
        first: the position of the first entry returned. next: where to read next.
        epoch: the epoch of these items. offset: samples of the epoch before the first item.
        epoch_samples: as in :class:`StreamJoined`.
        end: the reply reached the end of ``epoch``: its exact number of samples (``None``:
            not reached).
        aborted: that end is an abort (a producer died): the epoch has fewer samples.
        missed: items freed before this consumer read them (it lagged); they are skipped.
        finished: every producer sent its last epoch and this consumer read them all.
        tags, nbytes: the items' tags (client side) and bytes (server side; not sent).
    """

    id: int
    items: tuple[Any, ...]
    first: int
    next: int
    epoch: int
    offset: int = 0
    epoch_samples: int | None = None
    end: int | None = None
    aborted: bool = False
    missed: int = 0
    finished: bool = False
    tags: tuple[int | None, ...] = ()
    nbytes: int = 0


# -- field readers --------------------------------------------------------------------------
def _choice(h: dict[str, Any], key: str, choices: tuple[str, ...], default: str) -> str:
    v = h.get(key)
    if v is None:
        return default
    if v not in choices:
        raise InvalidField(f"{key!r} must be one of {', '.join(choices)}")
    return str(v)


def _seconds(h: dict[str, Any], key: str, default: float, *, positive: bool = False,
             maximum: float | None = None) -> float:
    v = h.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v == v) or v < 0 or \
            v == float("inf") or (positive and v == 0) or (maximum is not None and v > maximum):
        bound = f" and at most {maximum:g}" if maximum is not None else ""
        raise InvalidField(f"{key!r} must be a finite {'positive' if positive else 'non-negative'} "
                       f"number of seconds{bound}")
    return float(v)


def _range_int(h: dict[str, Any], key: str, low: int, high: int | None = None) -> int:
    v = check_int(h, key)
    if v < low or (high is not None and v > high):
        raise InvalidField(f"{key!r} must be between {low} and {high}" if high is not None
                       else f"{key!r} must be at least {low}")
    return v


# -- stream_open ----------------------------------------------------------------------------
def _open_header(m: StreamOpen) -> dict[str, Any]:
    h = {"bin": m.bin, "producer": m.producer, "producers": m.producers, "window": m.window,
         "on_lag": m.on_lag, "max_stall": m.max_stall, "replay": m.replay, "lease": m.lease,
         "samples": m.samples}
    if m.device_ipc:
        h["device_ipc"] = True
    return h


def _parse_open(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    name = check_bin(h, limits)
    producers = _range_int(h, "producers", 1, MAX_PRODUCERS) if "producers" in h else 1
    producer = _range_int(h, "producer", 0, producers - 1) if "producer" in h else 0
    window = _range_int(h, "window", 1, MAX_WINDOW) if h.get("window") is not None else 32
    max_stall = None if h.get("max_stall") is None else _seconds(h, "max_stall", 0.0)
    replay = _choice(h, "replay", REPLAY_POLICIES, "none")
    device_ipc = check_bool(h, "device_ipc")
    if device_ipc and replay == "epoch":
        raise InvalidField("a stream with device_ipc cannot keep an epoch for late joiners "
                       "(replay='epoch'): its producer's ring slots are reused long before")
    return StreamOpen(rid, name, producer, producers, window,
                      _choice(h, "on_lag", LAG_POLICIES, "wait"), max_stall, replay,
                      _seconds(h, "lease", 10.0, positive=True, maximum=MAX_LEASE),
                      opt_int(h, "samples", minimum=0), device_ipc)


def _reply_opened(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    return StreamOpened(rid, check_int(h, "epoch"), check_int(h, "head"),
                        opt_int(h, "sent") or 0, opt_int(h, "consumers") or 0,
                        check_bool(h, "broken"), opt_int(h, "aborted", minimum=0))


# -- stream_append --------------------------------------------------------------------------
def _append_header(m: StreamAppend) -> dict[str, Any]:
    h: dict[str, Any] = {"bin": m.bin, "producer": m.producer, "epoch": m.epoch}
    if m.samples is not None:
        h["samples"] = list(m.samples)
    h["timeout"] = m.timeout
    return h


def _parse_append(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    name = check_bin(h, limits)
    raw = h.get("items")
    if isinstance(raw, list) and len(raw) > MAX_APPEND_ITEMS:
        raise InvalidField(f"an append of {len(raw)} items exceeds MAX_APPEND_ITEMS="
                       f"{MAX_APPEND_ITEMS}", LimitExceeded.code)
    items = read_items(h, payload, limits.max_depth, True)
    if not items:
        raise InvalidField("stream_append carries at least one item")
    samples = h.get("samples")
    if samples is not None:
        if not isinstance(samples, list) or len(samples) != len(items) or \
                not all(is_int(n) and n >= 0 for n in samples):
            raise InvalidField("'samples' must be a list of non-negative integers, one per item")
        samples = tuple(samples)
    return StreamAppend(rid, name, _range_int(h, "producer", 0),
                        _range_int(h, "epoch", 0), items[0], tuple(items[1:]), samples,
                        check_timeout(h))


def _reply_appended(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    return StreamAppended(rid, check_int(h, "position"), check_int(h, "head"))


# -- stream_end -----------------------------------------------------------------------------
def _end_header(m: StreamEnd) -> dict[str, Any]:
    return {"bin": m.bin, "producer": m.producer, "epoch": m.epoch, "samples": m.samples,
            "last": m.last, "timeout": m.timeout}


def _parse_end(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    return StreamEnd(rid, check_bin(h, limits), _range_int(h, "producer", 0),
                     _range_int(h, "epoch", 0), _range_int(h, "samples", 0), check_bool(h, "last"),
                     check_timeout(h))


def _reply_ended(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    return StreamEnded(rid, check_int(h, "epoch"), check_bool(h, "complete"),
                       check_bool(h, "finished"))


# -- stream_join ----------------------------------------------------------------------------
def _join_header(m: StreamJoin) -> dict[str, Any]:
    return {"bin": m.bin, "consumer": m.consumer, "start": m.start, "lease": m.lease,
            "resume": m.resume}


def _parse_join(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    return StreamJoin(rid, check_bin(h, limits), check_name(h, "consumer", limits),
                      _choice(h, "start", STARTS, "now"),
                      _seconds(h, "lease", 10.0, positive=True, maximum=MAX_LEASE),
                      check_bool(h, "resume", True))


def _reply_joined(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    return StreamJoined(rid, opt_int(h, "position"), check_int(h, "epoch"),
                        opt_int(h, "offset") or 0, opt_int(h, "epoch_samples"),
                        opt_int(h, "head") or 0, check_bool(h, "resumed"), check_bool(h,
            "finished"))


# -- stream_read ----------------------------------------------------------------------------
def _read_header(m: StreamRead) -> dict[str, Any]:
    h: dict[str, Any] = {"bin": m.bin, "consumer": m.consumer}
    if m.at is not None:
        h["at"] = m.at
    if m.max_items is not None:
        h["max_items"] = m.max_items
    h["timeout"] = m.timeout
    return h


def _parse_read(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    # (A read without a timeout answers at once: there is no unlimited wait for it.)
    return StreamRead(rid, check_bin(h, limits), check_name(h, "consumer", limits),
                      opt_int(h, "at", minimum=0), opt_int(h, "max_items", minimum=1),
                      check_timeout(h) or 0.0)


def _read_reply_header(m: StreamItems) -> dict[str, Any]:
    h: dict[str, Any] = {"first": m.first, "next": m.next, "epoch": m.epoch,
                         "offset": m.offset, "epoch_samples": m.epoch_samples}
    if m.end is not None:
        h["end"] = m.end
        if m.aborted:
            h["aborted"] = True
    if m.missed:
        h["missed"] = m.missed
    if m.finished:
        h["finished"] = True
    return h


def _reply_items(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    # (A reply without items, at an epoch's end, has no "items" key: as every frame.)
    items = () if h.get("items") is None else \
        tuple(read_items(h, payload, limits.max_depth, False))
    return StreamItems(rid, items, check_int(h, "first"), check_int(h, "next"),
                       check_int(h, "epoch"), opt_int(h, "offset") or 0,
                       opt_int(h, "epoch_samples"), opt_int(h, "end"), check_bool(h, "aborted"),
                       opt_int(h, "missed") or 0, check_bool(h, "finished"))


# -- stream_leave ---------------------------------------------------------------------------
def _leave_header(m: StreamLeave) -> dict[str, Any]:
    return {"bin": m.bin, "consumer": m.consumer}


def _parse_leave(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    return StreamLeave(rid, check_bin(h, limits), check_name(h, "consumer", limits))


# -- the rows, exported for the op table ------------------------------------------------------
#: The rows of the op table for stream bins, in the order of docs/PROTOCOL.md §3.2.16-21
#: (:data:`.protocol.OPS` puts them after the core ops).
#: Remembered (mutating): opening (it may end a broken epoch), appending, ending an epoch,
#: joining (it places a cursor) and reading (it moves one). Leaving twice is harmless.
#: No stream op is open to the read-only token: each one moves a cursor or changes what the
#: other members of the stream see. A user's patterns: the producers' ops need write on the
#: stream, the consumers' read (as a Kafka consumer needs read on a topic).
ROWS: tuple[Op, ...] = (
    kind_op("stream_open", StreamOpen, _open_header, _parse_open, _reply_opened, True, "write",
            "bin", "producer", "producers", "window", "on_lag", "max_stall", "replay", "lease",
            "samples", "device_ipc"),
    kind_op("stream_append", StreamAppend, _append_header, _parse_append, _reply_appended, True,
            "write",
            "bin", "producer", "epoch", "items", "samples", "timeout"),
    kind_op("stream_end", StreamEnd, _end_header, _parse_end, _reply_ended, True, "write",
            "bin", "producer", "epoch", "samples", "last", "timeout"),
    kind_op("stream_join", StreamJoin, _join_header, _parse_join, _reply_joined, True, "read",
            "bin", "consumer", "start", "lease", "resume"),
    kind_op("stream_read", StreamRead, _read_header, _parse_read, _reply_items, True, "read",
            "bin", "consumer", "at", "max_items", "timeout"),
    kind_op("stream_leave", StreamLeave, _leave_header, _parse_leave, parse_acked, False, "read",
            "bin", "consumer"),
)


def _opened_header(m: StreamOpened) -> dict[str, Any]:
    h: dict[str, Any] = {"epoch": m.epoch, "head": m.head, "sent": m.sent,
                         "consumers": m.consumers, "broken": m.broken}
    if m.aborted is not None:
        h["aborted"] = m.aborted
    return h


def _joined_header(m: StreamJoined) -> dict[str, Any]:
    h: dict[str, Any] = {"position": m.position, "epoch": m.epoch, "offset": m.offset,
                         "epoch_samples": m.epoch_samples, "head": m.head,
                         "resumed": m.resumed}
    if m.finished:
        h["finished"] = True
    return h


#: Reply class -> its ``ok`` header fields (joins :data:`.protocol.REPLY_HEADERS`).
REPLY_HEADERS: dict[type, Callable[[Any], dict[str, Any]]] = {
    StreamOpened: _opened_header,
    StreamAppended: lambda m: {"position": m.position, "head": m.head},
    StreamEnded: lambda m: {"epoch": m.epoch, "complete": m.complete, "finished": m.finished},
    StreamJoined: _joined_header,
    StreamItems: _read_reply_header,
}
#: Message class -> the items its payload carries, in order (requests and replies).
ITEMS_OF: dict[type, Callable[[Any], Sequence[Item]]] = {
    StreamAppend: lambda m: m.items,
    StreamItems: lambda m: m.items,
}
