"""The common replies read from their fixed layouts, and (for the blocking client's one-pass
read) whole frames out of a receive buffer. Every face reads replies here: the blocking
client's session per read, the Twisted and asyncio faces' :class:`~.protocol.ClientConnection`
per frame, and the server its remembered put replies (``server/sessions.reply_of``).

Most reads of a busy client bring whole small frames: a ``Stored``, an ``Acked``, an
``ErrorReply``, a ``Fetched`` of one item in one plain buffer, or the ``notify`` of a change.
:meth:`ReplyReader.whole_frames` walks the frames lying whole in the bytes just received
(checking each prefix as :class:`~tensorshare.wire.frames.FrameDecoder` does) and reads each
header by matching the bytes the server's encoder writes for those replies (the keys in its
order, the values between them), with no frame object, no ``msgpack`` map and no dict. At the
first frame it does not read so (another reply, another layout, a frame not whole, anything a
check would refuse) it stops, and the connection's general decoder takes the rest of the
bytes, which checks everything and says what is wrong: what is read here is exactly what the
general parser reads (``tests/wire/test_replies.py`` checks that over many values, and
that what it must decline is declined).

It is a compiled twin (see :mod:`tensorshare._ext`), typed by ``replies.pxd``.
"""

from __future__ import annotations

from typing import Any

from .frames import ALIGN, FORMAT_VERSION, PREFIX
from .records import Acked, Changed, ErrorReply, Fetched, Item, Stored, encoded_of, raw_buffer

__all__ = ["ReplyReader"]

# The pieces of the fixed layouts, as msgpack packs them (every key a fixstr).
_REPLY_ID = b"\xa2op\xa5reply\xa2id"  # after the map byte, up to the reply's id
_OK_VERSION = b"\xa2ok\xc3\xa7version"
_OK_FLAG = b"\xa2ok\xc3\xa4flag"
_OK_FALSE_CODE = b"\xa2ok\xc2\xa4code"
_OK_KIND = b"\xa2ok\xc3\xa4kind"
_NOTIFY_BIN = b"\xa2op\xa6notify\xa3bin"
_N_ITEMS = b"\xa7n_items"
_DROPPED = b"\xa7dropped"
_VERSION = b"\xa7version"
_MESSAGE = b"\xa7message"
_EVENT = b"\xa5event"
_VALUE = b"\xa5value"  # the two kinds of a Fetched, read without decoding them
_LIST = b"\xa4list"
_ITEMS_ONE = b"\xa5items\x91\x93"  # items: [[value, buffers, tag]]
_ONE_BUFFER_AT_0 = b"\x91\x92\x00"  # buffers: [[0, nbytes]]
# The frame's constants, typed in the compiled twin.
_PREFIX_LEN = PREFIX
_ALIGN_MASK = ALIGN - 1
_FRAME_VERSION = FORMAT_VERSION


class ReplyReader:
    """Reads headers from their fixed layouts; one per session (it keeps where it is in the
    header it reads: not thread-safe, used under the client's lock)."""

    __slots__ = ("h", "i", "start")

    def __init__(self) -> None:
        self.h = b""  # the header being read
        self.i = 0  # where in it
        self.start = 0  # where the payload of the last frame frame_at found starts

    # -- the values between the pieces ------------------------------------------------------
    def _at(self, piece: bytes) -> bool:
        """Whether ``piece`` comes next (then step past it)."""
        if self.h.startswith(piece, self.i):
            self.i += len(piece)
            return True
        return False

    def _int(self) -> Any:
        """The msgpack integer that comes next (ValueError: none there; IndexError: cut)."""
        h, i = self.h, self.i
        b = h[i]
        if b < 0x80:
            self.i = i + 1
            return b
        if b >= 0xE0:
            self.i = i + 1
            return b - 0x100
        if b == 0xCC:
            self.i = i + 2
            return h[i + 1]
        if b == 0xCD:
            self.i = i + 3
            return h[i + 1] << 8 | h[i + 2]
        size = 4 if b == 0xCE or b == 0xD2 else 8 if b == 0xCF or b == 0xD3 else \
            1 if b == 0xD0 else 2 if b == 0xD1 else 0
        if not size or i + 1 + size > len(h):
            raise ValueError("not an integer")
        self.i = i + 1 + size
        return int.from_bytes(h[i + 1:i + 1 + size], "big", signed=b >= 0xD0)

    def _len(self, short: int, one: int) -> int:
        """The length of the str (``short``: its fix form's first byte, ``one``: its one-byte
        length form) or bin (``short`` 0) that comes next; the index moves past it."""
        h, i = self.h, self.i
        b = h[i]
        if short and short <= b < short + 32:
            n, i = b - short, i + 1
        elif b == one:
            n, i = h[i + 1], i + 2
        elif b == one + 1:
            n, i = h[i + 1] << 8 | h[i + 2], i + 3
        elif b == one + 2:
            n, i = h[i + 1] << 24 | h[i + 2] << 16 | h[i + 3] << 8 | h[i + 4], i + 5
        else:
            raise ValueError("not a str or bin")
        if i + n > len(self.h):
            raise ValueError("past the end")
        self.i = i + n
        return n

    def _after(self, key: bytes) -> Any:
        """The integer after ``key``, which must come next (ValueError: it does not)."""
        if not self._at(key):
            raise ValueError("another key")
        return self._int()

    def _str_after(self, key: bytes) -> str:
        """The str after ``key``, which must come next (ValueError: it does not)."""
        if not self._at(key):
            raise ValueError("another key")
        return self._str()

    def _str(self) -> str:
        n = self._len(0xA0, 0xD9)
        return self.h[self.i - n:self.i].decode("utf-8")

    def _bin(self) -> bytes:
        n = self._len(0, 0xC4)
        return self.h[self.i - n:self.i]

    # -- the headers --------------------------------------------------------------------------
    def reply_id(self, h: bytes) -> Any:
        """The id of reply header ``h`` when it starts as the fixed layouts do, else ``None``
        (then :meth:`notify`); :meth:`reply` reads the rest."""
        self.h, self.i = h, 1
        if len(h) < 16 or not self._at(_REPLY_ID):
            return None
        try:
            rid = self._int()
        except (IndexError, ValueError):
            return None
        return rid if rid >= 0 else None

    def reply(self, rid: Any, kind: Any, payload: Any) -> Any:
        """The rest of the reply :meth:`reply_id` started, when it is the ``kind`` its request
        expects (``Stored``, ``Acked`` or ``Fetched``) or an error, in its fixed layout; else
        ``None``."""
        try:
            if self._at(_OK_VERSION):
                if kind is not Stored or self.h[0] != 0x85 or len(payload):
                    return None
                version = self._int()
                n_items = self._after(_N_ITEMS)
                if self.i != len(self.h) or version < 0 or n_items < 0:
                    return None
                return Stored(rid, version, n_items, 0)
            if self._at(_OK_FLAG):
                b = self.h[self.i]
                if kind is not Acked or self.h[0] != 0x84 or self.i + 1 != len(self.h) or \
                        (b != 0xC3 and b != 0xC2) or len(payload):
                    return None
                return Acked(rid, b == 0xC3)
            if self._at(_OK_FALSE_CODE):
                return self._error(rid, payload)
            if kind is Fetched and self._at(_OK_KIND):
                return self._fetched(rid, payload)
        except (IndexError, ValueError, UnicodeDecodeError):
            return None
        return None

    def _error(self, rid: Any, payload: Any) -> Any:
        if self.h[0] != 0x85 or len(payload):
            return None
        code = self._str()
        message = self._str_after(_MESSAGE)
        return ErrorReply(rid, code, message) if self.i == len(self.h) else None

    def _fetched(self, rid: Any, payload: Any) -> Any:
        """A get/peek reply of one item in one plain buffer (or none), else ``None``."""
        if self.h[0] != 0x88:
            return None
        kind = "value" if self._at(_VALUE) else "list" if self._at(_LIST) else self._str()
        version = self._after(_VERSION)
        n_items = self._after(_N_ITEMS)
        dropped = self._after(_DROPPED)
        if version < 0 or n_items < 0 or dropped < 0 or not self._at(_ITEMS_ONE):
            return None
        value = self._bin()
        size = len(payload)
        if self._at(_ONE_BUFFER_AT_0):
            n = self._int()
            if n != size:
                return None
            buffers: tuple[Any, ...] = (raw_buffer(memoryview(payload), n),) if n else \
                (raw_buffer(b"", 0),)
        elif self._at(b"\x90") and size == 0:
            n, buffers = 0, ()
        else:
            return None
        tag = None if self._at(b"\xc0") else self._int()
        if self.i != len(self.h):
            return None
        item = Item(encoded_of(value, buffers, len(value) + n), tag)
        return Fetched(rid, kind, (item,), version, n_items, dropped, False)

    def notify(self, h: bytes) -> Any:
        """The change notification in header ``h`` (without ``skipped`` or ``dropped``: the
        usual one), else ``None``."""
        self.h, self.i = h, 1
        if len(h) < 16 or h[0] != 0x85 or not self._at(_NOTIFY_BIN):
            return None
        try:
            name = self._str()
            event = self._str_after(_EVENT)
            n_items = self._after(_N_ITEMS)
            version = self._after(_VERSION)
        except (IndexError, ValueError, UnicodeDecodeError):
            return None
        if self.i != len(h):
            return None
        return Changed(name, event, n_items, version, 0, 0)

    # -- the frames ---------------------------------------------------------------------------
    def frame_at(self, data: bytearray, i: int, n: int, max_header: int, max_frame: int) -> int:
        """Where the frame at ``data[i:n]`` ends when it lies there whole and its prefix is
        one the frame decoder accepts (then its header is ``self.h``, its payload
        ``data[self.start:end]``); else 0."""
        if n - i < _PREFIX_LEN or data[i] != 0x54 or data[i + 1] != 0x53 or \
                data[i + 2] != _FRAME_VERSION or data[i + 3] != 0 or data[i + 15] != 0 or \
                data[i + 14] != 0 or data[i + 13] != 0 or data[i + 12] != 0:
            return 0
        header_len = data[i + 4] | data[i + 5] << 8 | data[i + 6] << 16 | data[i + 7] << 24
        payload_len = data[i + 8] | data[i + 9] << 8 | data[i + 10] << 16 | data[i + 11] << 24
        if not header_len or header_len > max_header or payload_len > max_frame:
            return 0
        head_end = i + _PREFIX_LEN + header_len
        start = head_end
        if payload_len:
            start = i + ((_PREFIX_LEN + header_len + _ALIGN_MASK) & ~_ALIGN_MASK)
        end = start + payload_len
        if end - i > max_frame or end > n:
            return 0
        self.h = bytes(data[i + _PREFIX_LEN:head_end])
        self.start = start
        return end
