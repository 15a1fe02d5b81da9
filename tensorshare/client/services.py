"""The client ops of service bins, mixed into every client face (see
:mod:`tensorshare.inference`, which builds ``InferenceHost`` and ``InferenceClient`` on them).

A service bin is a queue of calls that hosts answer in batches. The ops, each written once:

* callers: :meth:`ServiceOps.service_call` (one input in, the host's answer for it out);
* hosts: :meth:`~ServiceOps.service_take` (a batch of calls) and
  :meth:`~ServiceOps.service_reply` (one answer per call, in the batch's order).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..wire.codec import decode, decode_many
from ..wire.messages import Item
from ..wire.protocol import check_bin_name
from ..wire.services import (
    MAX_BATCH,
    MAX_LEASE,
    MAX_QUEUE,
    MAX_WAIT_MS,
    ServiceCall,
    ServiceFailed,
    ServiceReply,
    ServiceTake,
)
from .command import BLOCK_SHARE, Command, FaceNeeds, gc_paused, make_item

__all__ = ["CLIENT_COMPRESS", "COMPRESS_CHOICES", "ServiceAnswerResult", "ServiceBatchResult",
           "ServiceFailed", "ServiceOps"]

#: ``compress`` of the service ops: encode the item as the client does (its own ``compress``).
CLIENT_COMPRESS = "client"
#: What ``compress`` may be: the client's setting, never, every large buffer, or only where it
#: pays (``"auto"``: large integer and bool buffers that shrink by an eighth; never floats).
COMPRESS_CHOICES = (CLIENT_COMPRESS, None, "lz4", "auto")


def check_compress(compress: Any) -> str | None:
    """``compress`` if it is one of :data:`COMPRESS_CHOICES`.

    Raises:
        ValueError: anything else.
    """
    if compress not in COMPRESS_CHOICES:
        raise ValueError(f"compress must be one of {COMPRESS_CHOICES}, not {compress!r}")
    return None if compress is None else str(compress)


@dataclass(frozen=True, slots=True)
class ServiceAnswerResult:
    """What :meth:`ServiceOps.service_call` returns: the host's answer for this call and the
    version of the parameters it used (``None``: the host has no version)."""

    value: Any
    version: int | None


@dataclass(frozen=True, slots=True)
class ServiceBatchResult:
    """What :meth:`ServiceOps.service_take` returns: the batch's id (answer it with
    :meth:`ServiceOps.service_reply`), each call's input, oldest first, and each call's rows
    (its batch size, as the caller said)."""

    batch: int
    values: list[Any]
    rows: tuple[int, ...]


class _Decoder:
    """A reply's conversion that decodes its items (nested at most ``max_depth`` deep)."""

    __slots__ = ("max_depth",)

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth


class _DecodeAnswer(_Decoder):
    __slots__ = ()

    def value(self, reply: Any) -> Any:
        """The answer's value, decoded (``None``: the reply carries no item)."""
        items = reply.items
        return decode(items[0].value, max_depth=self.max_depth) if items else None

    def __call__(self, reply: Any) -> ServiceAnswerResult:
        return ServiceAnswerResult(self.value(reply), reply.version)


class _DecodeBatch(_Decoder):
    __slots__ = ()

    def __call__(self, reply: Any) -> ServiceBatchResult:

        items = reply.items
        with gc_paused(len(items)):
            values = decode_many([it.value for it in items], max_depth=self.max_depth)
        return ServiceBatchResult(reply.batch, values, reply.rows)


def _check_number(value: Any, what: str, low: float, high: float, *,
                  positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or not low <= value <= high or (positive and value == 0):
        raise ValueError(f"{what} must be a number between {low:g} and {high:g}"
                         f"{' (not 0)' if positive else ''}, not {value!r}")
    return float(value)


def _check_int(value: Any, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what} must be an int between {low} and {high}, not {value!r}")
    return value


class ServiceOps(FaceNeeds):
    """Service ops for :class:`~.ops.Ops` (see :mod:`tensorshare.inference`).

    A face provides what :class:`~.ops.Ops` asks for (``limits``, ``timeout``, ``_item``,
    ``_execute``); each op checks its arguments, builds its request and hands the face a
    ``Command``.
    """

    #: A pipeline's client (it encodes as its client); ``None`` on a client (a class
    #: attribute: asking a client for an attribute it lacks costs its ``__getattr__``).
    _host: Any = None

    def _service_item(self, name: str, value: Any, compress: str | None = CLIENT_COMPRESS
                      ) -> Item:
        """``value`` encoded for a call or an answer: as the client encodes (shared memory
        included), or with compression ``compress`` (see :data:`COMPRESS_CHOICES`); a
        connection that passes shared memory compresses nothing (no bytes to save)."""
        host: Any = self._host or self  # a pipeline encodes as its client
        torch = sys.modules.get("torch")
        if check_compress(compress) == CLIENT_COMPRESS or (
                torch is not None and type(value) is torch.Tensor
                and value.nbytes < host.compress_min_bytes):
            # (a tensor too small for any compression: encoded as the client encodes it,
            # whatever compress says: a lone tensor then takes the client's own fast path)
            item = self._item(name, value, None)
            if type(item) is not Item:  # a pipeline defers encoding: encode now
                item = host._item(name, value, None)
            return item

        share = host.shm_min_bytes if getattr(host, "shared_memory", False) else None
        return make_item(name, value, None, host.limits, None if share else compress,
                         host.compress_min_bytes, share)

    def _service_items(self, name: str, values: Sequence[Any], compress: str | None
                       ) -> list[Item]:
        """:meth:`_service_item` of each of ``values`` (a host's answers): tensors too small
        for any compression are encoded together when they are alike (the same bytes)."""
        host: Any = self._host or self
        torch = sys.modules.get("torch")
        small = host.compress_min_bytes
        if torch is not None and len(values) > 1 and all(
                type(v) is torch.Tensor and v.nbytes < small for v in values):
            check_compress(compress)
            return host._items(name, list(values), [None] * len(values))
        return [self._service_item(name, v, compress) for v in values]

    def _server_wait(self, timeout: float | None) -> float:
        """How long the server may keep a request waiting: ``timeout``, at most 80% of the
        client's (so that the server's answer comes before the client gives up)."""

        most = BLOCK_SHARE * self.timeout
        if timeout is None:
            return most
        return min(_check_number(timeout, "timeout", 0.0, math.inf), most)

    def service_call_command(self, name: str, value: Any, *, rows: int = 1,
                             timeout: float | None = None, wait_room: bool = True,
                             compress: str | None = CLIENT_COMPRESS) -> Command:
        """The request :meth:`service_call` sends (for faces that send it their own way:
        :class:`tensorshare.inference.InferenceClient` turns it into a future)."""

        check_bin_name(name, self.limits.max_name_bytes)
        rows = _check_int(rows, "rows", 1, 1 << 31)
        request: Any = ServiceCall(0, name, self._service_item(name, value, compress),
                              self._server_wait(timeout), bool(wait_room), rows)
        return Command(request, f"service_call of service {name!r}",
                       _DecodeAnswer(self.limits.max_depth))

    def service_call(self, name: str, value: Any, *, rows: int = 1,
                     timeout: float | None = None, wait_room: bool = True,
                     compress: str | None = CLIENT_COMPRESS) -> Any:
        """Call service ``name`` with ``value`` and return a host's answer for it.

        Args:
            value: the input (what the hosts of this service expect: a tensor or a dict of
                tensors with the batch dimension first, for an ``InferenceHost``).
            rows: the rows ``value`` holds (counted against the hosts' ``max_batch``).
            timeout: seconds the call may wait on the server, queued or with a host
                (default and most: 80% of the client's timeout).
            wait_room: a full queue makes the call wait for room (within ``timeout``);
                ``False``: fail at once with ``BinFull``.
            compress: how ``value``'s buffers travel: ``"client"`` (the client's own
                ``compress``), ``None``, ``"lz4"`` or ``"auto"`` (see
                :data:`COMPRESS_CHOICES`).

        Returns:
            A :class:`ServiceAnswerResult`: the answer and the parameter version it used.

        Raises:
            WaitTimeout: no host answered within ``timeout`` (the call gets no answer later).
            ServiceFailed: the host failed this call (its model raised).
            BinFull: the queue was full (and ``wait_room=False``).
            InvalidRequest: the name is a bin of another kind.
        """
        return self._execute(self.service_call_command(name, value, rows=rows,
                                                       timeout=timeout, wait_room=wait_room,
                                                       compress=compress))

    def service_take_command(self, name: str, *, max_batch: int = 256,
                             max_wait_ms: float = 2.0, timeout: float | None = None,
                             lease: float = 10.0, max_queue: int | None = None) -> Command:
        """The request :meth:`service_take` sends (a host pipelines it with its answer to
        the previous batch)."""

        check_bin_name(name, self.limits.max_name_bytes)
        request: Any = ServiceTake(0, name, _check_int(max_batch, "max_batch", 1, MAX_BATCH),
                              _check_number(max_wait_ms, "max_wait_ms", 0.0, MAX_WAIT_MS),
                              self._server_wait(timeout),
                              _check_number(lease, "lease", 0.0, MAX_LEASE, positive=True),
                              None if max_queue is None else
                              _check_int(max_queue, "max_queue", 1, MAX_QUEUE))
        return Command(request, f"service_take of service {name!r}",
                       _DecodeBatch(self.limits.max_depth))

    def service_take(self, name: str, *, max_batch: int = 256, max_wait_ms: float = 2.0,
                     timeout: float | None = None, lease: float = 10.0,
                     max_queue: int | None = None) -> Any:
        """Take a batch of calls from service ``name`` (as one of its hosts).

        Args:
            max_batch: the most rows in the batch (a single larger call comes alone).
            max_wait_ms: with fewer than ``max_batch`` rows queued, wait for more at most this
                long after the oldest queued call came (a take that waited for work gets the
                first call at once).
            timeout: seconds to wait for a first call (default and most: 80% of the client's
                timeout); ``0``: do not wait.
            lease: seconds this host may keep the batch before its calls go back to the queue
                (they go back at once if this client's connection drops).
            max_queue: the most calls the service queues (``None``: keep the current, 4096
                by default).

        Returns:
            A :class:`ServiceBatchResult`; answer it with :meth:`service_reply`.

        Raises:
            WaitTimeout: no call came within ``timeout``.
        """
        return self._execute(self.service_take_command(
            name, max_batch=max_batch, max_wait_ms=max_wait_ms, timeout=timeout, lease=lease,
            max_queue=max_queue))

    def service_reply_command(self, name: str, batch: int,
                              values: Sequence[Any] | None = None, *,
                              version: int | None = None, error: str | None = None,
                              failed: dict[int, str] | None = None,
                              compress: str | None = CLIENT_COMPRESS) -> Command:
        """The request :meth:`service_reply` sends (a host pipelines it with its next
        take); ``compress`` as for :meth:`service_call`."""

        check_bin_name(name, self.limits.max_name_bytes)
        if (values is None) == (error is None):
            raise ValueError("service_reply takes values (one per call) or an error")
        if version is not None:
            version = _check_int(version, "version", 0, 1 << 62)
        request: Any
        if error is not None:
            request = ServiceReply(0, name, int(batch), None, (), version, str(error))
        else:
            assert values is not None
            items = self._service_items(name, values, compress)
            if not items:
                raise ValueError("service_reply needs one value per call of the batch")
            bad = tuple(sorted((int(i), str(why)) for i, why in (failed or {}).items()))
            if any(not 0 <= i < len(items) for i, _ in bad):
                raise ValueError(f"failed names calls outside the batch of {len(items)}")
            request = ServiceReply(0, name, int(batch), items[0], tuple(items[1:]), version,
                                   None, bad)
        return Command(request, f"service_reply of service {name!r}",
                       lambda reply: bool(reply.flag))

    def service_reply(self, name: str, batch: int, values: Sequence[Any] | None = None, *,
                      version: int | None = None, error: str | None = None,
                      failed: dict[int, str] | None = None,
                      compress: str | None = CLIENT_COMPRESS) -> Any:
        """Answer batch ``batch`` of service ``name``: ``values`` holds one answer per call,
        in the batch's order; or ``error`` fails every call of the batch (``ServiceFailed``
        for its callers).

        Returns:
            Whether the batch was still this host's (``False``: its lease ran out or this
            client's connection dropped, and the calls went to another host; this answer
            was dropped).

        ``failed`` maps indexes of calls that fail alone (``ServiceFailed`` for their
        callers) to why; their values are placeholders (``None``). ``compress`` as for
        :meth:`service_call`.
        """
        return self._execute(self.service_reply_command(name, batch, values, version=version,
                                                        error=error, failed=failed,
                                                        compress=compress))
