"""Length-prefixed framing with hard limits; an incremental decoder fed arbitrary chunks.

A frame on the wire (all integers little-endian)::

    offset  size  field
    0       2     magic b"TS"
    2       1     frame format version (1)
    3       1     flags (0; reserved, a receiver refuses other values)
    4       4     u32 header_len      length of the msgpack header
    8       8     u64 payload_len     length of the payload section (0 if none)
    16      H     header              msgpack map
    16+H    P     zero padding up to the next multiple of 64 (only if payload_len > 0)
    ...     L     payload             raw buffers, each starting at a 64-byte aligned offset

Every length is checked against a limit as soon as the 16-byte prefix is complete, before
anything is allocated. A frame whose *payload* is too large but whose header fits is not
fatal: the header is read, the payload is skipped without being stored, and the decoder
emits :class:`OversizedFrame` so the server can answer that one request with an error and
keep the connection. A bad magic, flags or an oversized header are fatal (``ProtocolError``):
after those the byte stream cannot be trusted.

The decoder supports two ways of being fed: ``feed(chunk)`` (copying what it needs) and
``get_buffer()`` / ``buffer_updated(n)``, which lets the I/O layer ``recv_into`` a large
header or payload straight into its final buffer, with no copy at all.

Memory a peer can make the receiver hold: a header or payload of at least
:data:`LARGE_PART` bytes is asked of an ``allocate`` function (which may hand out lazily
mapped memory, so a peer that announces much and sends little costs what it sent) and, with a
:class:`Budget`, reserved against it first: a payload that does not fit is refused like an
oversized one (the header is read, the request gets an error, the payload is skipped); a
header that does not fit is fatal. What a frame reserved is released when it is complete (the
receiver then owns the bytes) or when the decoder is closed.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import Protocol, Union

from ..errors import ProtocolError

__all__ = [
    "ALIGN",
    "MAGIC",
    "PREFIX",
    "FORMAT_VERSION",
    "Frame",
    "FrameDecoder",
    "Budget",
    "LARGE_PART",
    "OversizedFrame",
    "Payload",
    "aligned",
    "encode_frame",
    "payload_layout",
    "skip_sent",
]

MAGIC = b"TS"
FORMAT_VERSION = 1
ALIGN = 64
_PREFIX = struct.Struct("<2sBBIQ")
PREFIX = _PREFIX.size  # 16
_ZEROS = bytes(ALIGN)

# Below this many missing bytes the I/O layer is better off with an ordinary read, which may
# also bring in the next small frames; above it, recv_into the destination saves a copy.
DIRECT_READ_MIN = 64 * 1024

# Headers and payloads at least this large come from ``allocate`` and are reserved against
# the ``budget`` (smaller ones arrive within one read of the I/O layer anyway).
LARGE_PART = 64 * 1024

BytesLike = Union[bytes, bytearray, memoryview]
#: A received payload: a bytearray, or writable memory from the decoder's ``allocate``.
Payload = Union[bytearray, memoryview]


class Budget(Protocol):
    """Memory a receiver may still commit to frames being received (see the module doc)."""

    def reserve(self, nbytes: int) -> str | None:
        """Reserve ``nbytes``; ``None`` if granted, else why not (for the peer's error)."""
        ...

    def release(self, nbytes: int) -> None:
        """Give back what :meth:`reserve` granted."""
        ...


def aligned(n: int) -> int:
    """Round ``n`` up to a multiple of :data:`ALIGN`."""
    return (n + ALIGN - 1) & ~(ALIGN - 1)


class Frame:
    """One complete frame: the header bytes and the payload section (empty if none)."""

    __slots__ = ("header", "payload")

    def __init__(self, header: bytes, payload: Payload) -> None:
        self.header = header
        self.payload = payload

    def __eq__(self, other: object) -> bool:
        return type(other) is Frame and (self.header, self.payload) == (
            other.header, other.payload)

    __hash__ = None  # type: ignore[assignment]  # unhashable, as a dataclass with eq

    def __repr__(self) -> str:
        return f"Frame(header={self.header!r}, payload={self.payload!r})"


class OversizedFrame:
    """A frame whose payload was refused and skipped, never stored: over the frame limit
    (``limit``), or, with ``reason`` set, over the receiver's memory budget."""

    __slots__ = ("header", "payload_len", "limit", "reason")

    def __init__(self, header: bytes, payload_len: int, limit: int, reason: str = "") -> None:
        self.header = header
        self.payload_len = payload_len
        self.limit = limit
        self.reason = reason

    def __eq__(self, other: object) -> bool:
        return type(other) is OversizedFrame and self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]  # unhashable, as a dataclass with eq

    def _key(self) -> tuple[bytes, int, int, str]:
        return self.header, self.payload_len, self.limit, self.reason

    def __repr__(self) -> str:
        return (f"OversizedFrame(header={self.header!r}, payload_len={self.payload_len}, "
                f"limit={self.limit}, reason={self.reason!r})")


def payload_layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Place buffers of the given sizes in a payload section.

    Args:
        sizes: byte length of each buffer, in order.

    Returns:
        ``(offsets, payload_len)``: each offset is a multiple of 64 relative to the start of
        the payload section; ``payload_len`` ends with the last buffer (no trailing padding).
    """
    offsets = []
    end = 0
    for size in sizes:
        start = aligned(end)
        offsets.append(start)
        end = start + size
    return offsets, end


def encode_frame(header: bytes, buffers: Sequence[BytesLike] = ()) -> list[BytesLike]:
    """Build the chunks of one frame, ready for ``sendmsg`` / ``writeSequence``.

    The buffers are not copied: the returned list holds them (or views of them) as they are,
    with small padding chunks between them. They must be laid out as
    :func:`payload_layout` says, which is what the header's offsets describe.

    Args:
        header: the packed msgpack header.
        buffers: payload buffers (bytes-like, itemsize 1).

    Returns:
        A list of bytes-like chunks whose concatenation is the frame.
    """
    if not buffers:  # most replies and notifications: one chunk
        return [_PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(header), 0) + header]
    payload_len = 0
    chunks: list[BytesLike] = []
    for buf in buffers:
        start = aligned(payload_len)
        if start != payload_len:
            chunks.append(_ZEROS[: start - payload_len])
        chunks.append(buf)
        payload_len = start + len(buf)
    head_len = PREFIX + len(header)
    pad = aligned(head_len) - head_len if payload_len else 0
    first = b"".join(
        (_PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(header), payload_len), header, _ZEROS[:pad])
    )
    chunks.insert(0, first)
    return chunks


_PREFIX_STATE, _HEADER, _PAD, _PAYLOAD, _SKIP = range(5)


class FrameDecoder:
    """Incremental frame decoder. Not thread-safe: one reader per decoder.

    Args:
        max_frame_bytes: largest whole frame accepted (prefix + header + padding + payload).
        max_header_bytes: largest header accepted; a larger one is a fatal ProtocolError.
        allocate: returns ``n`` writable bytes for a header or payload of at least
            :data:`LARGE_PART` bytes (default: a ``bytearray``).
        budget: reserves memory for such parts before they are allocated (see the module doc).
    """

    def __init__(self, max_frame_bytes: int, max_header_bytes: int, *,
                 allocate: Callable[[int], Payload] | None = None,
                 budget: Budget | None = None) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.max_header_bytes = max_header_bytes
        self._allocate = allocate or bytearray
        self.budget = budget
        #: Bytes the frame being received holds of the budget (0 when none).
        self.reserved = 0
        self._state = _PREFIX_STATE
        self._prefix = bytearray()
        self._target: Payload = bytearray()  # header or payload being filled
        self._pos = 0
        self._remaining_skip = 0  # padding or skipped payload bytes still to drop
        self._header = b""
        self._payload_len = 0
        self._oversized = False

    @property
    def in_frame(self) -> bool:
        """Whether part of a frame has been received and the rest is still to come."""
        return self._state != _PREFIX_STATE or bool(self._prefix)

    # -- zero-copy path -------------------------------------------------------------------
    def get_buffer(self) -> memoryview | None:
        """Return the unfilled part of the current header/payload if it is worth a direct read.

        Returns:
            A writable memoryview to ``recv_into``, or ``None`` when an ordinary read is better.
        """
        if self._state in (_HEADER, _PAYLOAD) and len(self._target) - self._pos >= DIRECT_READ_MIN:
            return memoryview(self._target)[self._pos :]
        return None

    def buffer_updated(self, nbytes: int) -> list[Frame | OversizedFrame]:
        """Account for ``nbytes`` written into the view returned by :meth:`get_buffer`.

        Returns:
            The frames completed by these bytes (zero or one).
        """
        self._pos += nbytes
        out: list[Frame | OversizedFrame] = []
        if self._pos == len(self._target):
            self._target_done(out)
        return out

    # -- copying path ---------------------------------------------------------------------
    def feed(self, data: BytesLike) -> list[Frame | OversizedFrame]:
        """Feed received bytes (any chunking, even one byte at a time).

        The decoder copies what it keeps, so ``data`` may be a reused scratch buffer.

        Returns:
            The frames completed by these bytes, in order.

        Raises:
            ProtocolError: bad magic, version or flags, or a header over the limit.
        """
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        out: list[Frame | OversizedFrame] = []
        if self._state == _PREFIX_STATE and not self._prefix:
            view = self._whole_frames(view, out)
        try:
            self._feed(view, out)
        except ProtocolError as exc:
            # Frames completed earlier in this chunk are good: hand them over with the error,
            # so what a client sent before its garbage is still served (or refused) in order.
            exc.frames = out  # type: ignore[attr-defined]  # read by getattr in the protocol
            raise
        return out

    def _whole_frames(self, view: memoryview, out: list[Frame | OversizedFrame]) -> memoryview:
        """The fast path: take every frame that lies whole in ``view`` (small requests come
        in one piece); return what is left for the state machine. Anything unusual (a bad
        prefix, an oversized or incomplete frame) is left to :meth:`_feed`, which checks it
        exactly as before."""
        i, n = 0, len(view)
        unpack = _PREFIX.unpack_from
        max_header, max_frame = self.max_header_bytes, self.max_frame_bytes
        while n - i >= PREFIX:
            magic, version, flags, header_len, payload_len = unpack(view, i)
            if (magic != MAGIC or version != FORMAT_VERSION or flags or not header_len
                    or header_len > max_header or payload_len > max_frame):
                break
            head_end = i + PREFIX + header_len
            if payload_len:
                start = i + ((PREFIX + header_len + ALIGN - 1) & ~(ALIGN - 1))
                end = start + payload_len
            else:
                start = end = head_end
            if end - i > max_frame or end > n:
                break
            out.append(Frame(bytes(view[i + PREFIX:head_end]),
                             bytearray(view[start:end]) if payload_len else bytearray()))
            i = end
        return view[i:] if i else view

    def _feed(self, view: memoryview, out: list[Frame | OversizedFrame]) -> None:
        i, n = 0, len(view)
        while i < n:
            state = self._state
            if state == _PREFIX_STATE:
                take = min(PREFIX - len(self._prefix), n - i)
                self._prefix += view[i : i + take]
                i += take
                if len(self._prefix) == PREFIX:
                    self._start_frame(out)
            elif state == _HEADER or state == _PAYLOAD:
                take = min(len(self._target) - self._pos, n - i)
                self._target[self._pos : self._pos + take] = view[i : i + take]
                self._pos += take
                i += take
                if self._pos == len(self._target):
                    self._target_done(out)
            else:  # _PAD or _SKIP: drop bytes without storing them
                take = min(self._remaining_skip, n - i)
                self._remaining_skip -= take
                i += take
                if self._remaining_skip == 0:
                    self._skip_done(out)

    # -- state machine --------------------------------------------------------------------
    def _start_frame(self, out: list[Frame | OversizedFrame]) -> None:
        magic, version, flags, header_len, payload_len = _PREFIX.unpack(self._prefix)
        self._prefix = bytearray()
        if magic != MAGIC:
            raise ProtocolError(f"not a tensorshare frame: bad magic {bytes(magic)!r}")
        if version != FORMAT_VERSION:
            raise ProtocolError(f"unsupported frame format version {version}")
        if flags != 0:
            raise ProtocolError(f"unsupported frame flags {flags:#x}")
        if header_len == 0:
            raise ProtocolError("empty frame header")
        if header_len > self.max_header_bytes:
            raise ProtocolError(
                f"frame header of {header_len} bytes exceeds max_header_bytes={self.max_header_bytes}"
            )
        self._payload_len = payload_len
        total = aligned(PREFIX + header_len) + payload_len if payload_len else PREFIX + header_len
        self._oversized = total > self.max_frame_bytes
        if header_len >= LARGE_PART:
            why = self._reserve(header_len)
            if why is not None:
                raise ProtocolError(f"a frame header of {header_len} bytes was refused: {why}")
        self._state = _HEADER
        self._target = self._part(header_len)
        self._pos = 0

    def _part(self, n: int) -> Payload:
        return self._allocate(n) if n >= LARGE_PART else bytearray(n)

    def _reserve(self, n: int) -> str | None:
        if self.budget is None:
            return None
        why = self.budget.reserve(n)
        if why is None:
            self.reserved += n
        return why

    def close(self) -> None:
        """The connection ended: give back what a frame still being received reserved."""
        if self.reserved and self.budget is not None:
            self.budget.release(self.reserved)
        self.reserved = 0
        self._target = bytearray()

    def _target_done(self, out: list[Frame | OversizedFrame]) -> None:
        if self._state == _HEADER:
            self._header = bytes(self._target)
            self._target = bytearray()
            if not self._payload_len:
                if self._oversized:
                    out.append(OversizedFrame(self._header, 0, self.max_frame_bytes))
                    self._reset()
                else:
                    self._emit(out, bytearray())
                return
            if self._oversized:
                # Report it now, so the peer gets its error at once rather than after
                # streaming a payload we will drop anyway.
                out.append(OversizedFrame(self._header, self._payload_len, self.max_frame_bytes))
            elif self._payload_len >= LARGE_PART:
                why = self._reserve(self._payload_len)
                if why is not None:  # refused like an oversized payload: skipped, not stored
                    self._oversized = True
                    out.append(OversizedFrame(self._header, self._payload_len,
                                              self.max_frame_bytes, why))
            head_len = PREFIX + len(self._header)
            self._remaining_skip = aligned(head_len) - head_len
            self._state = _PAD
            if self._remaining_skip == 0:
                self._skip_done(out)
        else:  # payload complete
            payload, self._target = self._target, bytearray()
            self._emit(out, payload)

    def _skip_done(self, out: list[Frame | OversizedFrame]) -> None:
        if self._state == _PAD:
            if self._oversized:
                # Drop the payload as it streams past: never allocate what we refused.
                self._state = _SKIP
                self._remaining_skip = self._payload_len
            else:
                self._state = _PAYLOAD
                self._target = self._part(self._payload_len)
                self._pos = 0
        else:  # skipped an oversized payload (already reported)
            self._reset()

    def _emit(self, out: list[Frame | OversizedFrame], payload: Payload) -> None:
        out.append(Frame(self._header, payload))
        self._reset()

    def _reset(self) -> None:
        if self.reserved:  # the frame is complete (or skipped): its bytes are the caller's
            assert self.budget is not None
            self.budget.release(self.reserved)
            self.reserved = 0
        self._state = _PREFIX_STATE
        self._header = b""
        self._payload_len = 0
        self._oversized = False
        self._pos = 0


def skip_sent(views: list[memoryview], i: int, sent: int) -> int:
    """Advance past ``sent`` bytes from ``views[i]`` on (a partly sent view is re-sliced)
    and past empty views; return the index of the first view with bytes left (what a
    ``send`` or ``writev`` of ``views[i:]`` that wrote ``sent`` bytes leaves)."""
    while sent:
        n = views[i].nbytes
        if sent >= n:
            sent -= n
            i += 1
        else:
            views[i] = views[i][sent:]
            sent = 0
    while i < len(views) and views[i].nbytes == 0:
        i += 1
    return i
