"""The wire of replay bins: their messages, and the rows they add to the op table
(:data:`ROWS`, :data:`REPLY_HEADERS`, :data:`ITEMS_OF`; :mod:`.protocol` builds the table).

A replay bin is a table of prioritized experience replay (as DeepMind's Reverb has): items
inserted with a priority, sampled (without being removed) by a sampler, their priorities
updated, under a rate limiter that makes inserts and samples wait. See ``docs/PROTOCOL.md``
(replay bins) for every field and what the server does, and
:mod:`tensorshare.server.replay` for the table itself.

Ops (all carry ``bin``):

* ``replay_open``: create the bin with its configuration, or check it against the bin's;
* ``replay_insert``: insert items, one priority each (held while the rate limiter says so);
  the reply gives their keys;
* ``replay_sample``: draw ``batch_size`` items (held while the bin is empty or the rate
  limiter says so); the reply gives them with their keys, probabilities and the bin's size;
* ``replay_update``: set the priorities of items by key;
* ``replay_info``: the bin's size, total weight and statistics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import LimitExceeded
from .fields import (
    InvalidField,
    Op,
    check_bin,
    check_bool,
    check_int,
    check_timeout,
    is_int,
    kind_op,
    opt_int,
    read_items,
)
from .frames import Payload
from .messages import Batch, Item, Limits, OfBin

__all__ = [
    "CONFIG_FIELDS",
    "MAX_REPLAY_BATCH",
    "ReplayInfo",
    "ReplayInfoReply",
    "ReplayInsert",
    "ReplayInserted",
    "ReplayOpen",
    "ReplayOpened",
    "ReplaySample",
    "ReplaySampled",
    "ReplayUpdate",
    "ReplayUpdated",
]

#: The most items one insert carries, one sample draws and one update names (the table's
#: ``MAX_BATCH``); more is ``limit_exceeded``.
MAX_REPLAY_BATCH = 1 << 16
#: The fields of a replay bin's configuration, as ``replay_open`` carries them.
CONFIG_FIELDS = ("max_size", "sampler", "priority_exponent", "remover", "max_times_sampled",
                 "samples_per_insert", "min_size_to_sample", "error_buffer", "seed")


# -- messages -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ReplayOpen(OfBin):
    """Create replay bin ``bin`` with ``config`` (the :data:`CONFIG_FIELDS` given), or check
    that the bin has it (``seed`` ``None`` matches any seed); ``create=False`` only checks
    (``bin_not_found`` if there is no such bin)."""

    config: dict[str, Any]
    create: bool = True


@dataclass(frozen=True, slots=True)
class ReplayInsert(OfBin, Batch):
    """Insert ``item`` (then ``rest``) with ``priorities`` (one per item, finite, >= 0).

    ``timeout``: how long the insert may wait for the rate limiter (``None``: no limit;
    ``0``: not at all) before the error ``timeout``, nothing inserted."""

    item: Item
    rest: tuple[Item, ...] = ()
    priorities: tuple[float, ...] = ()
    timeout: float | None = None


@dataclass(frozen=True, slots=True)
class ReplaySample(OfBin):
    """Draw ``batch_size`` items; ``timeout`` as for :class:`ReplayInsert` (an empty bin
    waits too)."""

    batch_size: int
    timeout: float | None = None


@dataclass(frozen=True, slots=True)
class ReplayUpdate(OfBin):
    """Set the priorities of the items ``keys`` (keys no longer in the bin are skipped)."""

    keys: tuple[int, ...]
    priorities: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class ReplayInfo(OfBin):
    """Ask for the bin's size, total weight and statistics."""



@dataclass(frozen=True, slots=True)
class ReplayOpened:
    """Reply to replay_open: whether this open created the bin, its size, its configuration
    (as the server holds it: a seed it chose included)."""

    id: int
    created: bool
    size: int
    config: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ReplayInserted:
    """Reply to replay_insert: the items' keys, in order, and the bin's size after it."""

    id: int
    keys: tuple[int, ...]
    size: int


@dataclass(frozen=True, slots=True)
class ReplaySampled:
    """Reply to replay_sample: one entry per draw, in the order drawn.

    Attributes:
        items: the items (``Item`` on the wire, decoded values in a client's hands).
        keys, probabilities: each draw's key and probability when drawn.
        size: the bin's size when the first item was drawn.
        total: the bin's total weight after the sample (what a sharded sample weighs the
            bin by: the sum of ``priority ** priority_exponent``, or the size).
        nbytes: the items' bytes (server side; not sent).
    """

    id: int
    items: tuple[Any, ...]
    keys: tuple[int, ...]
    probabilities: tuple[float, ...]
    size: int
    total: float = 0.0
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class ReplayUpdated:
    """Reply to replay_update: how many keys were updated and how many skipped (gone)."""

    id: int
    updated: int
    skipped: int


@dataclass(frozen=True, slots=True)
class ReplayInfoReply:
    """Reply to replay_info: the bin's size, total weight, and its statistics (the map
    ``stats`` shows under ``replay``)."""

    id: int
    size: int
    total: float
    stats: dict[str, Any]


# -- field readers --------------------------------------------------------------------------
def _number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def _numbers(h: dict[str, Any], key: str, count: int) -> tuple[float, ...]:
    v = h.get(key)
    if not isinstance(v, list) or len(v) != count or not all(_number(x) and x >= 0 for x in v):
        raise InvalidField(f"{key!r} must be a list of {count} finite numbers >= 0")
    return tuple(float(x) for x in v)


def _count(h: dict[str, Any], key: str, what: str) -> int:
    v = check_int(h, key)
    if v < 1:
        raise InvalidField(f"{key!r} must be at least 1")
    if v > MAX_REPLAY_BATCH:
        raise InvalidField(f"{what} of {v} exceeds MAX_REPLAY_BATCH={MAX_REPLAY_BATCH}",
                           LimitExceeded.code)
    return v


def _config(h: dict[str, Any]) -> dict[str, Any]:
    """The configuration fields present, each of the right type (the server checks values)."""
    out: dict[str, Any] = {"max_size": check_int(h, "max_size")}
    for key in ("sampler", "remover"):
        if h.get(key) is not None:
            if not isinstance(h[key], str):
                raise InvalidField(f"{key!r} must be a str")
            out[key] = h[key]
    for key in ("priority_exponent", "samples_per_insert"):
        if h.get(key) is not None:
            if not _number(h[key]):
                raise InvalidField(f"{key!r} must be a finite number")
            out[key] = float(h[key])
    for key in ("max_times_sampled", "min_size_to_sample", "seed"):
        if h.get(key) is not None:
            out[key] = opt_int(h, key)
    buffer = h.get("error_buffer")
    if buffer is not None:
        pair = isinstance(buffer, list) and len(buffer) == 2 and all(map(_number, buffer))
        if not (pair or _number(buffer)):
            raise InvalidField("'error_buffer' must be a finite number or a pair of them")
        out["error_buffer"] = [float(x) for x in buffer] if pair else float(buffer)
    return out


# -- replay_open ----------------------------------------------------------------------------
def _open_header(m: ReplayOpen) -> dict[str, Any]:
    h = {k: v for k, v in m.config.items() if v is not None}
    h["bin"] = m.bin
    h["create"] = m.create
    return h


def _parse_open(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    return ReplayOpen(rid, check_bin(h, limits), _config(h), check_bool(h, "create", True))


def _reply_opened(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    config = h.get("config")
    if not isinstance(config, dict):
        raise InvalidField("'config' must be a map")
    return ReplayOpened(rid, check_bool(h, "created"), check_int(h, "size"), config)


# -- replay_insert --------------------------------------------------------------------------
def _insert_header(m: ReplayInsert) -> dict[str, Any]:
    return {"bin": m.bin, "priorities": list(m.priorities), "timeout": m.timeout}


def _parse_insert(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    name = check_bin(h, limits)
    raw = h.get("items")
    if isinstance(raw, list) and len(raw) > MAX_REPLAY_BATCH:
        raise InvalidField(f"an insert of {len(raw)} items exceeds MAX_REPLAY_BATCH="
                           f"{MAX_REPLAY_BATCH}", LimitExceeded.code)
    items = read_items(h, payload, limits.max_depth, True)
    if not items:
        raise InvalidField("replay_insert carries at least one item")
    return ReplayInsert(rid, name, items[0], tuple(items[1:]),
                        _numbers(h, "priorities", len(items)), check_timeout(h))


def _reply_inserted(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    keys = h.get("keys")
    if not isinstance(keys, list) or not all(is_int(k) for k in keys):
        raise InvalidField("'keys' must be a list of integers")
    return ReplayInserted(rid, tuple(keys), check_int(h, "size"))


# -- replay_sample --------------------------------------------------------------------------
def _parse_sample(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    return ReplaySample(rid, check_bin(h, limits), _count(h, "batch_size", "a sample"),
                        check_timeout(h))


def _reply_sampled(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    items = tuple(read_items(h, payload, limits.max_depth, False))
    keys, probs = h.get("keys"), h.get("probabilities")
    if not isinstance(keys, list) or len(keys) != len(items) or \
            not all(is_int(k) for k in keys):
        raise InvalidField("'keys' must be a list of integers, one per item")
    total = h.get("total", 0.0)
    if not _number(total):
        raise InvalidField("'total' must be a finite number")
    return ReplaySampled(rid, items, tuple(keys), _numbers(h, "probabilities", len(items))
                         if probs is not None else (), check_int(h, "size"), float(total))


# -- replay_update --------------------------------------------------------------------------
def _parse_update(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    name = check_bin(h, limits)
    keys = h.get("keys")
    if not isinstance(keys, list) or not all(is_int(k) for k in keys):
        raise InvalidField("'keys' must be a list of integers")
    if len(keys) > MAX_REPLAY_BATCH:
        raise InvalidField(f"an update of {len(keys)} keys exceeds MAX_REPLAY_BATCH="
                           f"{MAX_REPLAY_BATCH}", LimitExceeded.code)
    return ReplayUpdate(rid, name, tuple(keys), _numbers(h, "priorities", len(keys)))


def _reply_updated(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    return ReplayUpdated(rid, check_int(h, "updated"), check_int(h, "skipped"))


# -- replay_info ----------------------------------------------------------------------------
def _reply_info(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    stats, total = h.get("stats"), h.get("total", 0.0)
    if not isinstance(stats, dict) or not _number(total):
        raise InvalidField("'stats' must be a map and 'total' a finite number")
    return ReplayInfoReply(rid, check_int(h, "size"), float(total), stats)


def _parse_info(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    return ReplayInfo(rid, check_bin(h, limits))


# -- the rows, exported for the op table ------------------------------------------------------
#: The rows of the op table for replay bins, in the order of docs/PROTOCOL.md §3.2.26-30
#: (:data:`.protocol.OPS` puts them last). Remembered (mutating): inserting, sampling (it
#: counts the draws, may remove items and moves the bin's random state) and updating.
#: Opening twice is harmless (the second checks), and so is asking for the info. A user
#: needs write on the bin to open it, insert and update, read to sample and ask. None is open
#: to the read-only token (a sample moves the bin's counts).
ROWS: tuple[Op, ...] = (
    kind_op("replay_open", ReplayOpen, _open_header, _parse_open, _reply_opened, False,
            "write", "bin", "create", *CONFIG_FIELDS),
    kind_op("replay_insert", ReplayInsert, _insert_header, _parse_insert, _reply_inserted, True,
            "write", "bin", "items", "priorities", "timeout"),
    kind_op("replay_sample", ReplaySample,
            lambda m: {"bin": m.bin, "batch_size": m.batch_size, "timeout": m.timeout},
            _parse_sample, _reply_sampled, True, "read", "bin", "batch_size", "timeout"),
    kind_op("replay_update", ReplayUpdate,
            lambda m: {"bin": m.bin, "keys": list(m.keys), "priorities": list(m.priorities)},
            _parse_update, _reply_updated, True, "write", "bin", "keys", "priorities"),
    kind_op("replay_info", ReplayInfo, lambda m: {"bin": m.bin},
            _parse_info, _reply_info, False, "read", "bin"),
)

#: Reply class -> its ``ok`` header fields (joins :data:`.protocol.REPLY_HEADERS`).
REPLY_HEADERS: dict[type, Callable[[Any], dict[str, Any]]] = {
    ReplayOpened: lambda m: {"created": m.created, "size": m.size, "config": m.config},
    ReplayInserted: lambda m: {"keys": list(m.keys), "size": m.size},
    ReplaySampled: lambda m: {"keys": list(m.keys), "probabilities": list(m.probabilities),
                              "size": m.size, "total": m.total},
    ReplayUpdated: lambda m: {"updated": m.updated, "skipped": m.skipped},
    ReplayInfoReply: lambda m: {"size": m.size, "total": m.total, "stats": m.stats},
}
#: Message class -> the items its payload carries, in order (requests and replies).
ITEMS_OF: dict[type, Callable[[Any], Sequence[Item]]] = {
    ReplayInsert: lambda m: m.items,
    ReplaySampled: lambda m: m.items,
}
