"""What every op of every face builds on, below :mod:`.ops` and its mixins: a request as
the faces send it (:class:`Command`), the checks and encoding of a put's or append's value
(:func:`make_item`), the client's timeouts, and the garbage collector's pause for many
objects at once.

:mod:`.ops`, :mod:`.streams` and :mod:`.services` import this module and nothing of each
other below :mod:`.ops` (no import circle: an import-linter contract checks siblings).
"""

from __future__ import annotations

import enum
import gc
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from ..errors import FrameTooLarge
from ..memory.device import Stager
from ..wire.codec import encode, encode_lone_tensors
from ..wire.messages import Limits, Request
from ..wire.protocol import check_bin_name
from ..wire.records import Buffer, Encoded, Item

__all__ = [
    "BLOCK_SHARE",
    "BULK_MAX_BYTES",
    "NOWAIT",
    "Command",
    "FaceNeeds",
    "NoWait",
    "Wait",
    "check_reconnect",
    "check_timeout",
    "cuda_ipc_reader",
    "gc_paused",
    "make_item",
    "make_items",
]


class NoWait(enum.Enum):
    """The type of :data:`NOWAIT`: a get/peek that does not wait for data."""

    NOWAIT = "NOWAIT"

    def __repr__(self) -> str:
        return "NOWAIT"


#: Do not wait for data (the default ``timeout`` of get/peek).
NOWAIT: Final = NoWait.NOWAIT
#: A get/peek's ``timeout``: :data:`NOWAIT`, seconds to wait, or ``None`` (no limit).
Wait: TypeAlias = "float | None | NoWait"

# The share of the client's timeout an append may wait for room in a full "block" bin: the
# server gives up a little before the client would, so the caller hears BinFull.
BLOCK_SHARE = 0.8
# Frame overhead beyond the value itself: the prefix, the header fields, the padding.
_FRAME_SLACK = 4096


@dataclass(frozen=True, slots=True)
class Command:
    """One request as every face sends it.

    Attributes:
        request: the message (its id is given by the session).
        what: how errors name it, e.g. ``"get on bin 'q'"``.
        convert: turns the server's reply into the caller's result.
        kind: ``"call"``; ``"listen"`` / ``"unlisten"`` also (un)register ``listener``.
        listener: for a listen: ``(callback, inline)``.
    """

    request: Request
    what: str
    convert: Callable[[Any], Any]
    kind: str = "call"
    listener: Any = None

    @property
    def bin(self) -> str | None:
        """The bin the request is about (``None`` for list, stats, ping)."""
        return getattr(self.request, "bin", None)


class FaceNeeds:
    """What a face provides the op mixins (:class:`~.ops.Ops`, ``StreamOps``,
    ``ServiceOps``), declared once for the type checker: its ``timeout``, the server's
    ``limits``, ``_item`` (a value as an item) and ``_execute`` (send a :class:`Command`)."""

    timeout: float

    if TYPE_CHECKING:
        @property
        def limits(self) -> Limits: ...

        _execute: Callable[[Command], Any]

        def _item(self, name: str, value: Any, tag: int | None) -> Item: ...


def check_timeout(timeout: Any, what: str = "timeout") -> float:
    """A client timeout: a positive, finite number of seconds.

    Raises:
        ValueError: anything else.
    """
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not 0 < timeout < math.inf:
        raise ValueError(f"{what} must be a positive number of seconds, not {timeout!r}")
    return float(timeout)


def check_reconnect(reconnect: Any) -> bool | float:
    """``True``, ``False`` or a positive number of seconds.

    Raises:
        ValueError: anything else.
    """
    if isinstance(reconnect, bool):
        return reconnect
    return check_timeout(reconnect, "reconnect")


#: Tensors up to this size are encoded many at a time (see :func:`make_items`): copying them
#: once together costs less than a view of each.
BULK_MAX_BYTES = 16 * 1024


def make_items(name: str, values: list[Any], tags: list[int | None], limits: Limits,
               compress: str | None, compress_min_bytes: int,
               share_min_bytes: int | None = None) -> list[Item]:
    """:func:`make_item` for each of ``values`` (a batch of appends to bin ``name``): small
    tensors of one dtype and shape are encoded at once (:func:`~tensorshare.wire.codec.
    encode_lone_tensors`), the same bytes as one by one; anything else one by one.

    Raises:
        as :func:`make_item`, for the first value that fails.
    """
    first = values[0]
    torch = sys.modules.get("torch")
    small = min(BULK_MAX_BYTES, compress_min_bytes if compress is not None else BULK_MAX_BYTES,
                share_min_bytes if share_min_bytes is not None else BULK_MAX_BYTES)
    if len(values) > 1 and torch is not None and type(first) is torch.Tensor and \
            first.numel() * first.element_size() < small and \
            all(t is None or type(t) is int for t in tags):
        check_bin_name(name, limits.max_name_bytes)
        encs = encode_lone_tensors(values)
        if encs is not None and encs[0].nbytes + _FRAME_SLACK <= limits.max_frame_bytes:
            return [Item(e, t) for e, t in zip(encs, tags, strict=True)]
    return [make_item(name, v, t, limits, compress, compress_min_bytes, share_min_bytes)
            for v, t in zip(values, tags, strict=True)]


def make_item(name: str, value: Any, tag: int | None, limits: Limits, compress: str | None,
              compress_min_bytes: int, share_min_bytes: int | None = None) -> Item:
    """Check a put/append locally and encode its value (raises before anything is sent).

    With ``share_min_bytes`` (a connection that passes shared memory), every uncompressed
    buffer of at least that many bytes is written once into a sealed memfd, which then
    travels instead of the bytes (see :mod:`tensorshare.memory.shm`).

    Raises:
        TypeError, ValueError: a bad bin name or tag.
        UnsupportedType: the value holds a type that cannot be sent.
        FrameTooLarge: the value is larger than the server's frame limit (a ``ValueError``
            and a ``LimitExceeded``; nothing was sent).
    """
    check_bin_name(name, limits.max_name_bytes)
    if tag is not None and (not isinstance(tag, int) or isinstance(tag, bool)):
        raise TypeError(f"tag must be an int or None, not {type(tag).__name__}")
    enc = encode(value, compress=compress, compress_min_bytes=compress_min_bytes,
                 max_depth=limits.max_depth, stage=_stager(share_min_bytes))
    if enc.nbytes + _FRAME_SLACK > limits.max_frame_bytes:
        size = enc.nbytes + 64 * (len(enc.buffers) + 1)
        if size > limits.max_frame_bytes:
            raise FrameTooLarge(f"value for bin {name!r} not sent: it takes about {size} "
                                f"bytes, over the server's max_frame_bytes="
                                f"{limits.max_frame_bytes} (refused by this client; nothing "
                                f"was sent)")
    if share_min_bytes is not None and any(
            b.codec is None and b.shm is None and b.nbytes >= share_min_bytes
            for b in enc.buffers):
        enc = _shared(enc, share_min_bytes)
    return Item(enc, tag)


_STAGERS: dict[int | None, Stager] = {}


def _stager(share_min_bytes: int | None) -> Stager:
    """How a put copies a CUDA tensor to the host (into a memfd over ``unix://`` with shared
    memory, else into pinned memory): see :mod:`tensorshare.memory.device`."""
    stager = _STAGERS.get(share_min_bytes)
    if stager is None:
        stager = _STAGERS[share_min_bytes] = Stager(share_min_bytes)
    return stager


def _shared(enc: Encoded, share_min_bytes: int) -> Encoded:
    from ..memory import shm
    from ..memory.pool import send_pool

    buffers = []
    for b in enc.buffers:
        if b.codec is None and b.shm is None and b.nbytes >= share_min_bytes:
            pool = send_pool()  # (into pages allocated beforehand)
            mem = shm.share(b.data) if pool is None else pool.share(b.data)
            b = Buffer(mem.view, None, mem.size, mem)
        buffers.append(b)
    return Encoded(enc.value, tuple(buffers))


class _GcPause:
    """Disables the cyclic garbage collector for a ``with`` block (see :func:`gc_paused`)."""

    __slots__ = ()

    def __enter__(self) -> None:
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        gc.enable()


class _NoPause:
    """A ``with`` block that changes nothing (few objects: the collector may run)."""

    __slots__ = ()

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        pass


_PAUSE, _NO_PAUSE = _GcPause(), _NoPause()


def gc_paused(n: int) -> _GcPause | _NoPause:
    """Pause Python's cyclic garbage collector while ``n`` (many) objects are made at once.

    Building tens of thousands of small objects (the items of a batch) otherwise triggers
    collections that scan every live object again and again: that, not the work itself,
    cost three quarters of the time of a 50,000-item batch. Nothing made meanwhile is a
    cycle, and the collector runs again right after. (Classes, not a generator: this is
    on every request's path.)
    """
    if n < 1000 or not gc.isenabled():
        return _NO_PAUSE
    return _PAUSE


def cuda_ipc_reader(face: Any, name: str, device: Any) -> Any:
    """What a cuda-ipc item read by ``face`` from bin ``name`` becomes: a copy of the tensor
    (:func:`tensorshare.memory.ipc.copy_out`, on ``device`` if given) where the bin's server
    is reached over ``unix://`` (this host), else ``None`` (the codec refuses it, saying
    why)."""
    if not face._same_host(name):
        return None
    reader = _IPC_READERS.get(device)
    if reader is None:
        import functools

        from ..memory.ipc import copy_out

        reader = _IPC_READERS[device] = functools.partial(copy_out, device=device)
    return reader


_IPC_READERS: dict[Any, Any] = {}


