"""The wire of replication: its requests, and the rows they add to the op table
(:data:`ROWS`, :data:`REPLY_HEADERS`, :data:`ITEMS_OF`; :mod:`.protocol` builds the table),
and the messages a primary pushes to a replica.

A replica is a client of its primary. After the handshake it sends ``psync`` with the
replication id and offset it has (none the first time) and its term; the primary answers
``mode: "continue"`` when its backlog still holds every record after that offset, else
``mode: "full"`` with the offset its full copy is taken at. Then the primary pushes, on the
same connection and without ids:

* ``repl_snap`` (a full copy only): one snapshot record per message, the last one ``end``;
* ``repl``: one data-log record per message, with ``offset``, the replication offset just
  after it;
* ``repl_ping``: about every second, the primary's ``offset``, ``term`` and ``time``.

The payload of ``repl_snap`` and ``repl`` is one record exactly as the data log and the
snapshot files hold it (``u32 len | u32 crc32 | frame``, docs/PROTOCOL.md §12). The replica
acknowledges what it applied with ``repl_ack`` (its offset). ``promote`` makes a replica the
primary under a new term; ``wait_replicas`` is Redis's ``WAIT``. See docs/PROTOCOL.md §15.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from .fields import (
    InvalidField,
    Op,
    check_int,
    is_int,
    kind_op,
    opt_int,
    parse_acked,
)
from .frames import FORMAT_VERSION, MAGIC, PREFIX, BytesLike, Payload, aligned
from .messages import Item, Limits

__all__ = [
    "PUSHED",
    "Promote",
    "Psync",
    "PsyncReply",
    "ReplAck",
    "ReplicaCount",
    "WaitReplicas",
    "pushed_frame",
]

#: The ops a primary pushes to a replica after ``psync`` (no ``id``).
PUSHED = ("repl_snap", "repl", "repl_ping")
MAX_REPLID = 64
MAX_ADDRESS = 512
#: Offsets and terms stay below this (a larger one is refused).
MAX_COUNTER = (1 << 62) - 1
_PREFIX = struct.Struct("<2sBBIQ")
_ZEROS = bytes(64)
_packb = msgpack.Packer(use_bin_type=True).pack


@dataclass(frozen=True, slots=True)
class Psync:
    """A replica asks for the records after ``offset`` of the log ``replid`` ("" and 0: a
    full copy). ``term``: the newest term it knows; ``address``: where its clients reach it
    (shown in the primary's stats)."""

    id: int
    replid: str = ""
    offset: int = 0
    term: int = 0
    address: str = ""


@dataclass(frozen=True, slots=True)
class PsyncReply:
    """``mode``: ``"full"`` (a full copy follows, then the records after ``offset``) or
    ``"continue"`` (the records after the replica's offset follow)."""

    id: int
    mode: str
    replid: str
    offset: int
    term: int
    server_id: str = ""


@dataclass(frozen=True, slots=True)
class ReplAck:
    """A replica has applied every record up to ``offset``."""

    id: int
    offset: int


@dataclass(frozen=True, slots=True)
class Promote:
    """Make this replica the primary, under a new term."""

    id: int


@dataclass(frozen=True, slots=True)
class WaitReplicas:
    """Wait until ``n`` replicas have every write made before this request, or ``timeout``."""

    id: int
    n: int
    timeout: float


@dataclass(frozen=True, slots=True)
class ReplicaCount:
    """How many replicas have every write made before the ``wait_replicas``; on a
    ``promote``, the new term."""

    id: int
    replicas: int
    term: int


def _opt_str(h: dict[str, Any], key: str, limit: int) -> str:
    v = h.get(key)
    if v is None:
        return ""
    if not isinstance(v, str) or len(v) > limit:
        raise InvalidField(f"{key!r} must be a str of at most {limit} characters")
    return v


def _bounded(h: dict[str, Any], key: str) -> int:
    v = opt_int(h, key, 0) or 0
    if v > MAX_COUNTER:
        raise InvalidField(f"{key!r} must be below 2**62")
    return v


def _parse_psync(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Psync:
    return Psync(rid, _opt_str(h, "replid", MAX_REPLID), _bounded(h, "offset"),
                 _bounded(h, "term"), _opt_str(h, "address", MAX_ADDRESS))


def _psync_header(m: Psync) -> dict[str, Any]:
    return {"replid": m.replid, "offset": m.offset, "term": m.term, "address": m.address}


def _reply_psync(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> PsyncReply:
    mode = h.get("mode")
    if mode not in ("full", "continue"):
        raise InvalidField("'mode' must be 'full' or 'continue'")
    replid = _opt_str(h, "replid", MAX_REPLID)
    return PsyncReply(rid, mode, replid, check_int(h, "offset"), check_int(h, "term"),
                      _opt_str(h, "server_id", MAX_REPLID))


def _parse_ack(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> ReplAck:
    check_int(h, "offset")
    return ReplAck(rid, _bounded(h, "offset"))


def _parse_wait(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> WaitReplicas:
    n = check_int(h, "n")
    t = h.get("timeout")
    if n < 0 or n > 1024:
        raise InvalidField("'n' must be from 0 to 1024")
    if not (is_int(t) or isinstance(t, float)) or not 0 <= t <= 3600:
        raise InvalidField("'timeout' must be a number of seconds from 0 to 3600")
    return WaitReplicas(rid, n, float(t))


def _reply_count(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> ReplicaCount:
    return ReplicaCount(rid, check_int(h, "replicas"), check_int(h, "term"))


#: The rows of the op table for replication, in the order of docs/PROTOCOL.md §3.2.26-29
#: (:data:`.protocol.OPS` puts them last). Nothing here is remembered: a resent psync starts
#: a new stream, an ack or a wait is asked again, a resent promote finds the server promoted
#: already. None is open to the read-only token. psync checks the user's ``replicate`` right
#: itself.
ROWS: tuple[Op, ...] = (
    kind_op("psync", Psync, _psync_header, _parse_psync, _reply_psync, False, "none",
            "replid", "offset", "term", "address"),
    kind_op("repl_ack", ReplAck, lambda m: {"offset": m.offset}, _parse_ack, parse_acked,
            False, "none", "offset"),
    kind_op("promote", Promote, lambda m: {}, lambda rid, h, p, lim: Promote(rid), _reply_count,
            False, "admin"),
    kind_op("wait_replicas", WaitReplicas, lambda m: {"n": m.n, "timeout": m.timeout},
            _parse_wait, _reply_count, False, "none", "n", "timeout"),
)
#: Reply class -> its ``ok`` header fields (joins :data:`.protocol.REPLY_HEADERS`).
REPLY_HEADERS: dict[type, Callable[[Any], dict[str, Any]]] = {
    PsyncReply: lambda m: {"mode": m.mode, "replid": m.replid, "offset": m.offset,
                           "term": m.term, "server_id": m.server_id},
    ReplicaCount: lambda m: {"replicas": m.replicas, "term": m.term},
}
#: Message class -> the items its payload carries (none: records travel as raw payloads).
ITEMS_OF: dict[type, Callable[[Any], Sequence[Item]]] = {}


def pushed_frame(header: dict[str, Any], record: Sequence[BytesLike] = (),
                 nbytes: int = 0) -> list[BytesLike]:
    """A pushed message's frame chunks: ``header`` (with its ``op``), then ``record`` (the
    chunks of one record, ``nbytes`` in all) as the payload, not copied."""
    head = _packb(header)
    if not nbytes:
        return [_PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(head), 0) + head]
    end = PREFIX + len(head)
    pad = _ZEROS[: aligned(end) - end]
    return [_PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(head), nbytes) + head + pad, *record]
