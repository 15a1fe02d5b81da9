"""The wire of service bins: their messages, and the rows they add to the op table
(:data:`ROWS`, :data:`REPLY_HEADERS`, :data:`ITEMS_OF`; :mod:`.protocol` builds the table).

A service bin is a queue of *calls* answered by *hosts*. A caller sends ``service_call`` with
one item (its input) and gets, as the reply to that very request, the item a host computed
for it: many calls may be in flight per caller, each answered on its own. A host sends
``service_take`` and gets a *batch*: up to ``max_batch`` rows of calls, oldest first, with an
id; it answers the whole batch with one ``service_reply`` that carries one item per call, in
the batch's order, and the server routes each to its caller. See ``docs/PROTOCOL.md``
(service bins) for every field and what the server does.

The server does not look inside the items: a host stacks the inputs into one batch and
splits its output into one item per call (the Python :mod:`tensorshare.inference` does).

Ops (all carry ``bin``):

* ``service_call``: a caller's call (remembered: a call resent after a reconnect is the same
  call, answered once);
* ``service_take``: a host takes a batch (leased to it for ``lease`` seconds);
* ``service_reply``: a host answers a batch it took (or fails it with ``error``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ServiceFailed
from .fields import (
    MAX_APPEND_ITEMS,
    InvalidField,
    Op,
    check_bin,
    check_bool,
    check_int,
    check_timeout,
    is_int,
    kind_op,
    opt_int,
    parse_acked,
    read_items,
)
from .frames import Payload
from .messages import Item, Limits

__all__ = [
    "DEFAULT_MAX_QUEUE",
    "MAX_BATCH",
    "MAX_LEASE",
    "MAX_QUEUE",
    "MAX_WAIT_MS",
    "ServiceAnswer",
    "ServiceBatch",
    "ServiceCall",
    "ServiceFailed",
    "ServiceReply",
    "ServiceTake",
]

#: The most rows a host may ask for in one batch (``max_batch``); also the most calls a
#: batch holds (a reply carries one item per call: at most MAX_APPEND_ITEMS).
MAX_BATCH = MAX_APPEND_ITEMS
#: The longest ``max_wait_ms`` a host may ask for.
MAX_WAIT_MS = 10_000.0
#: The longest ``lease`` (seconds) a host may hold a batch before it goes back to the queue.
MAX_LEASE = 3600.0
#: The longest queue a host may ask for (``max_queue``), and the default.
MAX_QUEUE = 65_536
DEFAULT_MAX_QUEUE = 4096
#: The longest error message a host may send for a batch (longer ones are cut).
MAX_ERROR_CHARS = 4096


# -- messages -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ServiceCall:
    """A caller's call: ``item`` is its input (a tensor or a dict of tensors, batch dimension
    first, in the Python client). The reply is a :class:`ServiceAnswer`.

    ``timeout``: how long the call may wait on the server (queued, or with a host) before
    the error ``timeout``; ``None``: no limit. ``wait_room``: when the queue is full, wait for
    room (within ``timeout``) rather than fail at once with ``bin_full``.
    ``rows``: the rows the input holds (its batch size), counted against a host's
    ``max_batch``; default 1.
    """

    id: int
    bin: str
    item: Item
    timeout: float | None = None
    wait_room: bool = True
    rows: int = 1

    @property
    def items(self) -> tuple[Item, ...]:
        return (self.item,)


@dataclass(frozen=True, slots=True)
class ServiceTake:
    """A host takes a batch of calls from service ``bin`` (creating the service if needed).

    Attributes:
        max_batch: the most rows (sum of the calls' ``rows``) in the batch; a single call of
            more rows comes alone.
        max_wait_ms: a take that finds fewer than ``max_batch`` rows queued waits for more at
            most this long after the oldest of them was queued (a host that was waiting for
            work gets the first call at once).
        timeout: how long to wait for a first call before the error ``timeout``; ``None``:
            no limit.
        lease: seconds the host may keep the batch; after that (or as soon as the host's
            connection is gone) its calls go back to the front of the queue.
        max_queue: the most calls the service queues (set by its hosts; ``None``: keep it).
    """

    id: int
    bin: str
    max_batch: int = 256
    max_wait_ms: float = 2.0
    timeout: float | None = None
    lease: float = 10.0
    max_queue: int | None = None


@dataclass(frozen=True, slots=True)
class ServiceReply:
    """A host answers batch ``batch``: one item per call, in the batch's order (``item``,
    then ``rest``), and the version of the parameters it used (``None``: no version); or,
    with ``error`` set and no items, every call of the batch fails with ``service_failed``.
    ``failed``: ``(index, message)`` pairs, calls of the batch that fail alone with
    ``service_failed`` (their items are placeholders, e.g. nil).
    The reply is ``ok`` with ``flag``: whether the batch was still this host's (a batch whose
    lease ran out went back to the queue; its late answer is dropped)."""

    id: int
    bin: str
    batch: int
    item: Item | None = None
    rest: tuple[Item, ...] = ()
    version: int | None = None
    error: str | None = None
    failed: tuple[tuple[int, str], ...] = ()

    @property
    def items(self) -> tuple[Item, ...]:
        if self.item is None:
            return ()
        return (self.item, *self.rest) if self.rest else (self.item,)


@dataclass(frozen=True, slots=True)
class ServiceAnswer:
    """Reply to service_call: the host's item for this call (``items`` holds it: the
    decoded value in a client's hands) and the version of the parameters it used."""

    id: int
    items: tuple[Any, ...]
    version: int | None = None


@dataclass(frozen=True, slots=True)
class ServiceBatch:
    """Reply to service_take: batch ``batch`` with one item per call, oldest call first, and
    ``rows``: each call's rows."""

    id: int
    batch: int
    items: tuple[Any, ...]
    rows: tuple[int, ...] = ()


# -- service_call ---------------------------------------------------------------------------
def _call_header(m: ServiceCall) -> dict[str, Any]:
    h: dict[str, Any] = {"bin": m.bin, "timeout": m.timeout}
    if not m.wait_room:
        h["wait_room"] = False
    if m.rows != 1:
        h["rows"] = m.rows
    return h


def _parse_call(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    name = check_bin(h, limits)
    items = read_items(h, payload, limits.max_depth, True)
    if len(items) != 1:
        raise InvalidField("service_call carries exactly one item (its input)")
    rows = opt_int(h, "rows", minimum=1)
    return ServiceCall(rid, name, items[0], check_timeout(h), check_bool(h, "wait_room", True),
                       1 if rows is None else rows)


def _reply_answer(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    items = () if h.get("items") is None else \
        tuple(read_items(h, payload, limits.max_depth, False))
    return ServiceAnswer(rid, items, opt_int(h, "version"))


# -- service_take ---------------------------------------------------------------------------
def _take_header(m: ServiceTake) -> dict[str, Any]:
    h: dict[str, Any] = {"bin": m.bin, "max_batch": m.max_batch, "max_wait_ms": m.max_wait_ms,
                         "timeout": m.timeout, "lease": m.lease}
    if m.max_queue is not None:
        h["max_queue"] = m.max_queue
    return h


def _number(h: dict[str, Any], key: str, default: float, low: float, high: float,
            *, positive: bool = False) -> float:
    v = h.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (low <= v <= high) or \
            (positive and v == 0):
        raise InvalidField(f"{key!r} must be a number between {low:g} and {high:g}"
                       + (" (not 0)" if positive else ""))
    return float(v)


def _parse_take(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    name = check_bin(h, limits)
    max_batch = opt_int(h, "max_batch", minimum=1)
    if max_batch is not None and max_batch > MAX_BATCH:
        raise InvalidField(f"'max_batch' must be between 1 and {MAX_BATCH}")
    max_queue = opt_int(h, "max_queue", minimum=1)
    if max_queue is not None and max_queue > MAX_QUEUE:
        raise InvalidField(f"'max_queue' must be between 1 and {MAX_QUEUE}")
    return ServiceTake(rid, name, 256 if max_batch is None else max_batch,
                       _number(h, "max_wait_ms", 2.0, 0.0, MAX_WAIT_MS), check_timeout(h),
                       _number(h, "lease", 10.0, 0.0, MAX_LEASE, positive=True), max_queue)


def _reply_batch(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    items = () if h.get("items") is None else \
        tuple(read_items(h, payload, limits.max_depth, False))
    rows = h.get("rows")
    if not isinstance(rows, list) or len(rows) != len(items) or \
            not all(is_int(n) and n >= 1 for n in rows):
        raise InvalidField("'rows' must be a list of positive integers, one per item")
    return ServiceBatch(rid, check_int(h, "batch"), items, tuple(rows))


# -- service_reply --------------------------------------------------------------------------
def _reply_header(m: ServiceReply) -> dict[str, Any]:
    h: dict[str, Any] = {"bin": m.bin, "batch": m.batch, "version": m.version}
    if m.error is not None:
        h["error"] = m.error
    if m.failed:
        h["failed"] = [[i, why] for i, why in m.failed]
    return h


def _parse_reply(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Any:
    name = check_bin(h, limits)
    batch = check_int(h, "batch")
    error = h.get("error")
    if error is not None and not isinstance(error, str):
        raise InvalidField("'error' must be a string or nil")
    raw = h.get("items")
    if isinstance(raw, list) and len(raw) > MAX_BATCH:
        raise InvalidField(f"a reply of {len(raw)} items exceeds MAX_BATCH={MAX_BATCH}")
    items = [] if raw is None else read_items(h, payload, limits.max_depth, True)
    if error is None and not items:
        raise InvalidField("service_reply carries one item per call of the batch, or an 'error'")
    if error is not None and items:
        raise InvalidField("service_reply carries items or an 'error', not both")
    failed = h.get("failed")
    if failed is None:
        failed = ()
    elif not isinstance(failed, list) or len(failed) > len(items) or not all(
            isinstance(f, list) and len(f) == 2 and is_int(f[0]) and 0 <= f[0] < len(items)
            and isinstance(f[1], str) for f in failed):
        raise InvalidField("'failed' must be a list of [index, message] pairs, indexes of the "
                       "batch's calls")
    else:
        failed = tuple((int(i), why[:MAX_ERROR_CHARS]) for i, why in failed)
    return ServiceReply(rid, name, batch, items[0] if items else None, tuple(items[1:]),
                        opt_int(h, "version"),
                        None if error is None else error[:MAX_ERROR_CHARS], failed)


# -- the rows, exported for the op table ------------------------------------------------------
#: The rows of the op table for service bins, in the order of docs/PROTOCOL.md §3.2.22-24
#: (:data:`.protocol.OPS` puts them after the stream bins').
#: Remembered (mutating): a call (resent after a reconnect, it is the same call, answered
#: once; its answer is kept for the caller's session until acknowledged). Not remembered: a
#: take (a batch whose host's connection is gone goes back to the queue; a take resent
#: after a reconnect is a new take) and a reply (a batch answers once; a resent reply finds
#: its batch gone and is acknowledged with flag false). No service op is open to the
#: read-only token: a call runs a host's work, a take and a reply answer other clients' calls.
#: A user's patterns: a call needs write on the service (it queues work), hosting (take,
#: reply) read and write ("take": it sees the callers' inputs and answers them), so a caller
#: cannot serve other users' calls.
ROWS: tuple[Op, ...] = (
    kind_op("service_call", ServiceCall, _call_header, _parse_call, _reply_answer, True, "write",
            "bin", "items", "timeout", "wait_room", "rows"),
    kind_op("service_take", ServiceTake, _take_header, _parse_take, _reply_batch, False, "take",
            "bin", "max_batch", "max_wait_ms", "timeout", "lease", "max_queue"),
    kind_op("service_reply", ServiceReply, _reply_header, _parse_reply, parse_acked, False, "take",
            "bin", "batch", "items", "version", "error", "failed"),
)
#: Reply class -> its ``ok`` header fields (joins :data:`.protocol.REPLY_HEADERS`).
REPLY_HEADERS: dict[type, Callable[[Any], dict[str, Any]]] = {
    ServiceAnswer: lambda m: {"version": m.version},
    ServiceBatch: lambda m: {"batch": m.batch, "rows": list(m.rows)},
}
#: Message class -> the items its payload carries, in order (requests and replies).
ITEMS_OF: dict[type, Callable[[Any], Sequence[Item]]] = {
    ServiceCall: lambda m: m.items,
    ServiceReply: lambda m: m.items,
    ServiceAnswer: lambda m: m.items,
    ServiceBatch: lambda m: m.items,
}
