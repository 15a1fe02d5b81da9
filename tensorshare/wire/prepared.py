"""The common messages from prepared pieces, both ways, and read back from their fixed layouts.

A tiny put or get spends most of its time on things that are the same every time: the keys of
its header, packed by msgpack's generic packer from a fresh dict, and parsed back by its
generic unpacker into another dict. The messages every request and reply of the common shapes
are made of have a fixed layout: the same keys, in the order the general encoder writes them
(``wire/protocol.encode_message``), with a few integers, a name and an item spliced in. This
module writes those from pre-packed pieces, and reads them back by matching the pieces and
reading the values between them, without a dict:

* requests (the client): ``put``, ``append`` of one item, ``get``/``peek`` and a fetch of the
  common shapes (:func:`put_header`, :func:`fetch_header`), with the acknowledgement fields;
* requests (the server reads): those requests read back from their layouts
  (:func:`read_request`);
* replies and notifications (the server writes): a ``Fetched`` of one item in one plain buffer
  (:func:`fetched_chunks`) and the ``notify`` of a change (:func:`notify_chunks`: encoded once
  and written to every listener). The client reads the common replies from their layouts in
  :mod:`.replies`.

Every prepared header is the same bytes the general encoder writes for the same message
(``tests/wire/test_prepared.py`` checks that byte for byte over many values), and what the
readers accept is exactly what the general parser would make of it: anything else (another
key order, a field a peer added, a value of another type) is not matched, and the caller
takes the general path, which checks it and says what is wrong. No module of the wire imports
this one back.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import msgpack

from .codec import validate
from .frames import ALIGN, FORMAT_VERSION, MAGIC, PREFIX, BytesLike
from .records import (
    Append,
    Changed,
    Fetch,
    Fetched,
    FetchSpec,
    Item,
    Put,
    encoded_of,
    raw_buffer,
)

__all__ = ["MAX_OPEN_ACKS", "fetch_header", "fetched_chunks", "frame_chunks", "packed_int",
           "notify_chunks", "packed_name", "put_header", "read_request"]

# At most this many request ids below ``ack`` may be listed as still open (see
# ``protocol.AckInfo``).
MAX_OPEN_ACKS = 64

_packb = msgpack.Packer(use_bin_type=True).pack
_FRAME_HEAD = struct.Struct("<2sBBIQ")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_I8 = struct.Struct(">b")
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")
_F64 = struct.Struct(">d")
_ZEROS = bytes(ALIGN)

# -- the pieces ------------------------------------------------------------------------------
_K_OP = _packb("op")
_K_ID = _packb("id")
_K_BIN = _packb("bin")
_K_ITEMS = _packb("items")
_K_ACK = _packb("ack")
_K_OPEN = _packb("open")
_REPLY_ID = _K_OP + _packb("reply") + _K_ID
#: After a reply's id, a fetch's ``ok: true`` and the key that follows it.
_OK_KIND = _packb("ok") + b"\xc3" + _packb("kind")
_K_N_ITEMS = _packb("n_items")
_K_DROPPED = _packb("dropped")
_K_VERSION = _packb("version")
_K_UNCHANGED = _packb("unchanged")
_NOTIFY_BIN = _K_OP + _packb("notify") + _K_BIN
_K_EVENT = _packb("event")
_K_SKIPPED = _packb("skipped")
#: A put's and an append's header up to the id, and a fetch's, by its op.
_OP_ID = {op: _K_OP + _packb(op) + _K_ID for op in ("put", "append", "get", "peek")}
#: One item of one plain buffer at offset 0: ``[[value, [[0, nbytes]], tag]]`` up to ``value``.
_ONE_ITEM = b"\x91\x93"
_ONE_BUFFER_AT_0 = b"\x91\x92\x00"

#: Every byte, and the integers 128-255 and the high byte of 256-65535 packed (``uint 8``,
#: ``uint 16``); 0-127 pack as their own byte (a positive fixint).
_BYTES = tuple(bytes((i,)) for i in range(256))
_CC = tuple(b"\xcc" + b for b in _BYTES)
_CD = tuple(b"\xcd" + b for b in _BYTES)


def packed_int(v: int) -> bytes:
    """``v`` packed as a msgpack integer (as the general encoder packs it: the shortest
    form, unsigned for a positive one)."""
    if 0 <= v < 0x10000:  # (ids and versions: no call into the packer)
        n = v
        if n < 0x80:
            return _BYTES[n]
        if n < 0x100:
            return _CC[n]
        return _CD[n >> 8] + _BYTES[n & 0xFF]
    return _packb(v)


#: Names packed once (a client sends to a few bins, again and again).
_NAMES: dict[str, bytes] = {}
_NAMES_MAX = 4096


def packed_name(name: str) -> bytes:
    """``name`` packed as a msgpack str, remembered for the next request."""
    packed = _NAMES.get(name)
    if packed is None:
        packed = _packb(name)
        if len(_NAMES) < _NAMES_MAX:
            _NAMES[name] = packed
    return packed


# -- requests ----------------------------------------------------------------------------------
def _ack_fields(through: int, open_ids: tuple[int, ...]) -> tuple[int, bytes]:
    """The acknowledgement fields (``through`` < 0: none) and how many they are."""
    if through < 0:
        return 0, b""
    if not open_ids:
        return 1, _K_ACK + _packb(through)
    return 2, _K_ACK + _packb(through) + _K_OPEN + _packb(list(open_ids))


def put_header(op: str, rid: int, name: str, item: Item, timeout: float | None,
               through: int, open_ids: tuple[int, ...]) -> bytes | None:
    """The header of a ``put`` or an ``append`` of one item with no field but the bin (and,
    for an append, its ``timeout``), ``through``/``open_ids`` the acknowledgement (-1: none),
    when ``item`` is one plain buffer or none; ``None`` for any other (the general encoder
    writes it then)."""
    value = item.value
    buffers = value.buffers
    if len(buffers) > 1:
        return None
    if buffers:
        b = buffers[0]
        if b.codec is not None or b.shm is not None:
            return None
        descs = _ONE_BUFFER_AT_0 + _packb(len(b.data))
    else:
        descs = b"\x90"
    tag = item.tag
    n, ack = _ack_fields(through, open_ids)
    extra = b""
    if timeout is not None:
        extra = _K_TIMEOUT + _packb(timeout)
        n += 1
    return b"".join((bytes((0x84 + n,)), _OP_ID[op], _packb(rid), _K_BIN, packed_name(name),
                     extra, ack, _K_ITEMS, _ONE_ITEM, _packb(value.value), descs,
                     b"\xc0" if tag is None else _packb(tag)))


def fetch_header(remove: bool, rid: int, name: str, spec: Any, through: int,
                 open_ids: tuple[int, ...]) -> bytes:
    """The header of a ``get`` (``remove``) or ``peek`` of ``spec`` (a ``FetchSpec``), with
    the acknowledgement fields (``through`` -1: none)."""
    n = 3
    parts = [b"", _OP_ID["get" if remove else "peek"], _packb(rid), _K_BIN, packed_name(name)]
    if spec.max_items is not None:
        parts.append(_K_MAX_ITEMS + _packb(spec.max_items))
        n += 1
    if spec.wait:
        parts.append(_K_WAIT_TRUE + _packb(spec.timeout))
        n += 2
        if spec.min_items != 1:
            parts.append(_K_MIN_ITEMS + _packb(spec.min_items))
            n += 1
    if spec.min_tag is not None:
        parts.append(_K_MIN_TAG + _packb(spec.min_tag))
        n += 1
    if spec.newer_than is not None:
        parts.append(_K_NEWER_THAN + _packb(spec.newer_than))
        n += 1
    k, ack = _ack_fields(through, open_ids)
    parts[0] = bytes((0x80 + n + k,))
    parts.append(ack)
    return b"".join(parts)


_K_TIMEOUT = _packb("timeout")
_K_MAX_ITEMS = _packb("max_items")
_K_WAIT_TRUE = _packb("wait") + b"\xc3" + _K_TIMEOUT
_K_MIN_ITEMS = _packb("min_items")
_K_MIN_TAG = _packb("min_tag")
_K_NEWER_THAN = _packb("newer_than")


def frame_chunks(header: bytes, data: BytesLike | None) -> list[BytesLike]:
    """A frame of ``header`` and at most one buffer (``data``, at offset 0), as chunks."""
    if data is None:
        return [_FRAME_HEAD.pack(MAGIC, FORMAT_VERSION, 0, len(header), 0) + header]
    n = len(data)
    if n == 0:
        return [_FRAME_HEAD.pack(MAGIC, FORMAT_VERSION, 0, len(header), 0) + header]
    pad = -(PREFIX + len(header)) & (ALIGN - 1)
    return [b"".join((_FRAME_HEAD.pack(MAGIC, FORMAT_VERSION, 0, len(header), n), header,
                      _ZEROS[:pad])), data]


# -- reading what was written so -----------------------------------------------------------------
def _int_at(h: bytes, i: int) -> tuple[int, int]:
    """The msgpack integer at ``h[i]`` and the index after it (raises IndexError, ValueError:
    not an integer there)."""
    b = h[i]
    if b < 0x80:
        return b, i + 1
    if b >= 0xE0:
        return b - 0x100, i + 1
    if b == 0xCC:
        return h[i + 1], i + 2
    if b == 0xCD:
        return _U16.unpack_from(h, i + 1)[0], i + 3
    if b == 0xCE:
        return _U32.unpack_from(h, i + 1)[0], i + 5
    if b == 0xCF:
        return _U64.unpack_from(h, i + 1)[0], i + 9
    if b == 0xD0:
        return _I8.unpack_from(h, i + 1)[0], i + 2
    if b == 0xD1:
        return _I16.unpack_from(h, i + 1)[0], i + 3
    if b == 0xD2:
        return _I32.unpack_from(h, i + 1)[0], i + 5
    if b == 0xD3:
        return _I64.unpack_from(h, i + 1)[0], i + 9
    raise ValueError("not an integer")


def _str_at(h: bytes, i: int) -> tuple[str, int]:
    """The msgpack str at ``h[i]`` and the index after it."""
    b = h[i]
    if 0xA0 <= b <= 0xBF:
        n, i = b - 0xA0, i + 1
    elif b == 0xD9:
        n, i = h[i + 1], i + 2
    elif b == 0xDA:
        n, i = _U16.unpack_from(h, i + 1)[0], i + 3
    elif b == 0xDB:
        n, i = _U32.unpack_from(h, i + 1)[0], i + 5
    else:
        raise ValueError("not a str")
    end = i + n
    if end > len(h):
        raise ValueError("a str past the end")
    return h[i:end].decode("utf-8"), end


def _bin_at(h: bytes, i: int) -> tuple[bytes, int]:
    """The msgpack bin at ``h[i]`` and the index after it."""
    b = h[i]
    if b == 0xC4:
        n, i = h[i + 1], i + 2
    elif b == 0xC5:
        n, i = _U16.unpack_from(h, i + 1)[0], i + 3
    elif b == 0xC6:
        n, i = _U32.unpack_from(h, i + 1)[0], i + 5
    else:
        raise ValueError("not a bin")
    end = i + n
    if end > len(h):
        raise ValueError("a bin past the end")
    return h[i:end], end


# -- replies the server writes from prepared pieces ---------------------------------------------
_FETCHED_HEAD = b"\x88" + _REPLY_ID


def fetched_chunks(rid: int, reply: Fetched) -> list[BytesLike] | None:
    """The frame of a get/peek reply of one item in one plain buffer (or none), as the
    general encoder writes it (``protocol._fetched_reply``); ``None`` for any other."""
    items = reply.items
    if len(items) != 1 or reply.unchanged:
        return None
    it: Item = items[0]
    value = it.value
    buffers = value.buffers
    data: Any = None
    if len(buffers) == 1:
        b = buffers[0]
        if b.codec is not None or b.shm is not None:
            return None
        data = b.data
        descs = _ONE_BUFFER_AT_0 + packed_int(len(data))
    elif buffers:
        return None
    else:
        descs = b"\x90"
    tag = it.tag
    header = b"".join((_FETCHED_HEAD, packed_int(rid), _OK_KIND, packed_name(reply.kind),
                       _K_VERSION, packed_int(reply.version), _K_N_ITEMS,
                       packed_int(reply.n_items), _K_DROPPED, packed_int(reply.dropped),
                       _K_ITEMS, _ONE_ITEM, _packb(value.value), descs,
                       b"\xc0" if tag is None else packed_int(tag)))
    return frame_chunks(header, data)


def notify_chunks(msg: Changed) -> list[BytesLike]:
    """The frame of change notification ``msg``, as the general encoder writes it
    (``protocol._header_of``'s ``Changed`` row: ``skipped`` and ``dropped`` only when not 0),
    from prepared pieces: built once per change and written to every listener."""
    n = 0x85
    parts = [b"", _NOTIFY_BIN, packed_name(msg.bin), _K_EVENT, packed_name(msg.op),
             _K_N_ITEMS, packed_int(msg.n_items), _K_VERSION, packed_int(msg.version)]
    if msg.skipped:
        n += 1
        parts.append(_K_SKIPPED)
        parts.append(packed_int(msg.skipped))
    if msg.dropped:
        n += 1
        parts.append(_K_DROPPED)
        parts.append(packed_int(msg.dropped))
    parts[0] = _BYTES[n]
    header = b"".join(parts)
    return [_FRAME_HEAD.pack(MAGIC, FORMAT_VERSION, 0, len(header), 0) + header]


# -- requests the server reads from their fixed layouts ---------------------------------------
_PUT_ID = _OP_ID["put"]
_APPEND_ID = _OP_ID["append"]
_GET_ID = _OP_ID["get"]
_PEEK_ID = _OP_ID["peek"]
_K_WAIT = _packb("wait")
_ITEMS_ONE = _K_ITEMS + _ONE_ITEM
_BAD = (IndexError, ValueError, struct.error, UnicodeDecodeError)
#: The values a put or an append carried that passed ``codec.validate``, with what they were
#: checked with: ``(buffer bytes, buffers, max_depth)`` (small ones, a bounded number).
_VALID: dict[bytes, tuple[int, int, int]] = {}
_VALID_MAX = 4096
_VALID_MAX_BYTES = 512


def read_request(h: bytes, payload: Any, limits: Any) -> tuple[Any, int, tuple[int, ...],
                                                              str] | None:
    """A put, an append of one item, a get or a peek in header ``h`` (and ``payload``), read
    from the fixed layout the client's prepared pieces write (:func:`put_header`,
    :func:`fetch_header`): ``(request, through, open, op)`` with the acknowledgement as
    ``protocol.ServerConnection.parse`` returns it, exactly what the op table's general parse
    makes of the same bytes; ``None`` for anything else (another key order, another field,
    a value of another type, or one the general parse refuses: it then says what is wrong).
    """
    if len(h) < 8 or h[0] & 0xF0 != 0x80:
        return None
    try:
        if h.startswith(_PUT_ID, 1):
            return _read_store(h, 1 + len(_PUT_ID), False, payload, limits)
        if h.startswith(_GET_ID, 1):
            return _read_fetch(h, 1 + len(_GET_ID), True, payload, limits)
        if h.startswith(_PEEK_ID, 1):
            return _read_fetch(h, 1 + len(_PEEK_ID), False, payload, limits)
        if h.startswith(_APPEND_ID, 1):
            return _read_store(h, 1 + len(_APPEND_ID), True, payload, limits)
    except _BAD:
        return None
    return None


def _id_and_bin(h: bytes, i: int, limits: Any) -> tuple[int, str, int]:
    """The request id (>= 1) and the bin name after the op, and the index after them
    (raises ValueError: another layout, or a value the general parse would refuse)."""
    rid, i = _int_at(h, i)
    if rid < 1 or not h.startswith(_K_BIN, i):
        raise ValueError("no id and bin")
    name, i = _str_at(h, i + len(_K_BIN))
    if not name or len(name) * 4 > limits.max_name_bytes:  # (check_bin's own short cut)
        raise ValueError("a name the general check reads")
    return rid, name, i


def _timeout_at(h: bytes, i: int) -> tuple[float | None, int]:
    """A ``timeout`` value as ``fields.check_timeout`` takes it: nil, or a finite number >= 0
    (a float64 or an integer)."""
    b = h[i]
    if b == 0xC0:
        return None, i + 1
    if b == 0xCB:
        t = _F64.unpack_from(h, i + 1)[0]
        if not math.isfinite(t) or t < 0:
            raise ValueError("a timeout the general check refuses")
        return t, i + 9
    v, i = _int_at(h, i)
    if v < 0:
        raise ValueError("a negative timeout")
    return float(v), i


def _ack_at(h: bytes, i: int) -> tuple[int, tuple[int, ...], int, int]:
    """The acknowledgement fields at ``h[i]``, if any: ``(through, open, index after, how many
    fields)`` (``through`` -1: none). Only the well-formed ones: the general parse reads the
    others (and ignores them)."""
    if not h.startswith(_K_ACK, i):
        return -1, (), i, 0
    through, i = _int_at(h, i + len(_K_ACK))
    if through < 0:
        raise ValueError("a malformed ack")
    if not h.startswith(_K_OPEN, i):
        return through, (), i, 1
    i += len(_K_OPEN)
    b = h[i]
    if 0x90 <= b <= 0x9F:
        n, i = b - 0x90, i + 1
    elif b == 0xDC:
        n, i = _U16.unpack_from(h, i + 1)[0], i + 3
    else:
        raise ValueError("a malformed open list")
    if n > MAX_OPEN_ACKS:
        raise ValueError("too many open ids")
    ids = []
    for _ in range(n):
        v, i = _int_at(h, i)
        ids.append(v)
    return through, tuple(ids), i, 2


def _read_store(h: bytes, i: int, append: bool, payload: Any, limits: Any
                ) -> tuple[Any, int, tuple[int, ...], str] | None:
    rid, name, i = _id_and_bin(h, i, limits)
    n = 4  # op, id, bin, items
    timeout = None
    if append and h.startswith(_K_TIMEOUT, i):
        timeout, i = _timeout_at(h, i + len(_K_TIMEOUT))
        n += 1
    through, open_ids, i, k = _ack_at(h, i)
    if h[0] != 0x80 + n + k or not h.startswith(_ITEMS_ONE, i):
        return None
    value, i = _bin_at(h, i + len(_ITEMS_ONE))
    size = len(payload)
    if h.startswith(_ONE_BUFFER_AT_0, i):
        nb, i = _int_at(h, i + 3)
        if nb != size:
            return None
        buffers: tuple[Any, ...] = (raw_buffer(memoryview(payload)[0:nb], nb),)
        raw_sizes = [nb]
    elif h[i] == 0x90 and size == 0:
        nb, i, buffers, raw_sizes = 0, i + 1, (), []
    else:
        return None
    if h[i] == 0xC0:
        tag, i = None, i + 1
    else:
        tag, i = _int_at(h, i)
    if i != len(h):
        return None
    depth = limits.max_depth
    seen = _VALID.get(value)  # (a stream of like tensors sends the same value bytes)
    if seen is None or seen[0] != nb or seen[1] != len(buffers) or seen[2] != depth:
        validate(value, len(buffers), max_depth=depth, raw_sizes=raw_sizes)
        if len(value) <= _VALID_MAX_BYTES:
            if len(_VALID) >= _VALID_MAX:
                _VALID.clear()
            _VALID[value] = (nb, len(buffers), depth)
    item = Item(encoded_of(value, buffers, len(value) + nb), tag)
    if append:
        return Append(rid, name, item, timeout, (), None, False), through, open_ids, "append"
    return Put(rid, name, item), through, open_ids, "put"


def _field_int(h: bytes, i: int, key: bytes, minimum: int | None
               ) -> tuple[int | None, int, int]:
    """An optional integer field ``key`` at ``h[i]`` (at least ``minimum``, if given):
    ``(value or None, index after, 1 if present else 0)``."""
    if not h.startswith(key, i):
        return None, i, 0
    v, i = _int_at(h, i + len(key))
    if minimum is not None and v < minimum:
        raise ValueError("a value the general check refuses")
    return v, i, 1


def _read_fetch(h: bytes, i: int, remove: bool, payload: Any, limits: Any
                ) -> tuple[Any, int, tuple[int, ...], str] | None:
    rid, name, i = _id_and_bin(h, i, limits)
    if len(payload):
        return None
    max_items, i, n = _field_int(h, i, _K_MAX_ITEMS, 1)
    n += 3
    timeout = None
    wait = False
    if h.startswith(_K_WAIT, i):
        b = h[i + len(_K_WAIT)]
        if b != 0xC3 and b != 0xC2:
            return None
        wait, i = b == 0xC3, i + len(_K_WAIT) + 1
        n += 1
    if h.startswith(_K_TIMEOUT, i):
        timeout, i = _timeout_at(h, i + len(_K_TIMEOUT))
        n += 1
    min_items, i, k = _field_int(h, i, _K_MIN_ITEMS, 1)
    n += k
    min_tag, i, k = _field_int(h, i, _K_MIN_TAG, None)
    n += k
    newer_than, i, k = _field_int(h, i, _K_NEWER_THAN, None)
    n += k
    through, open_ids, i, k = _ack_at(h, i)
    if h[0] != 0x80 + n + k or i != len(h):
        return None
    spec = FetchSpec(remove, max_items, wait, timeout, min_tag, newer_than,
                     1 if min_items is None else min_items)
    return Fetch(rid, name, spec), through, open_ids, "get" if remove else "peek"
