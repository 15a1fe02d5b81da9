"""The prepared pieces (tensorshare.wire.prepared) against the general encoder and parser.

Every header written from pieces must be the bytes ``encode_message`` writes for the same
message, and every reply (client) or request (server) read from its fixed layout must be what
the general parser makes of it; a layout that differs in any way must be left to the general
parser (``None``). Checked
over many values with hypothesis, on the pure and the compiled path (tests/test_ext.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorshare.wire import prepared
from tensorshare.wire.codec import encode
from tensorshare.wire.frames import FrameDecoder
from tensorshare.wire.messages import Changed
from tensorshare.wire.protocol import (
    OPS,
    AckInfo,
    ClientConnection,
    encode_message,
    encode_reply,
)
from tensorshare.wire.records import (
    Acked,
    Append,
    ErrorReply,
    Fetch,
    Fetched,
    FetchSpec,
    Item,
    Put,
    Stored,
)
from tensorshare.wire.replies import ReplyReader

ids = st.integers(1, (1 << 63) - 1)
uints = st.integers(0, (1 << 64) - 1)
tags = st.none() | st.integers(-(1 << 63), (1 << 63) - 1)
names = st.text(min_size=1, max_size=40)
acks = st.none() | st.tuples(st.integers(0, (1 << 62)),
                             st.lists(st.integers(1, 1 << 40), max_size=3).map(tuple))
values = st.sampled_from([torch.ones(1), torch.arange(7, dtype=torch.int16), torch.zeros(0),
                          torch.randn(3, 4, dtype=torch.float64), b"bytes", "a str", 7,
                          {"x": torch.ones(2)}, [1, 2, 3], None])


def _joined(chunks: list[Any]) -> bytes:
    return b"".join(bytes(c) for c in chunks)


def _general(msg: Any, ack: tuple[int, tuple[int, ...]] | None) -> bytes:
    """The general encoder's frame (the acknowledgement fields as the connection adds them);
    and the connection's own frame (prepared where it can) must be the same bytes."""
    extra: dict[str, Any] | None = None
    if ack is not None:
        extra = {"ack": ack[0], **({"open": list(ack[1])} if ack[1] else {})}
    general = _joined(encode_message(msg, extra)[0])
    info = None if ack is None else AckInfo(ack[0], ack[1])
    assert _joined(ClientConnection().send(msg, info)) == general
    return general


def _ack_args(ack: tuple[int, tuple[int, ...]] | None) -> tuple[int, tuple[int, ...]]:
    return (-1, ()) if ack is None else ack


def _one_buffer(item: Item) -> Any:
    bufs = item.value.buffers
    return bufs[0].data if bufs else None


@settings(max_examples=300, deadline=None)
@given(rid=ids, name=names, value=values, tag=tags, ack=acks,
       timeout=st.none() | st.floats(0, 1e6))
def test_a_put_and_an_append_from_pieces_are_the_general_encoders_bytes(
        rid: int, name: str, value: Any, tag: int | None, ack: Any, timeout: Any) -> None:
    item = Item(encode(value), tag)
    header = prepared.put_header("put", rid, name, item, None, *_ack_args(ack))
    if len(item.value.buffers) > 1:
        assert header is None
        return
    assert header is not None
    assert _joined(prepared.frame_chunks(header, _one_buffer(item))) == \
        _general(Put(rid, name, item), ack)
    header = prepared.put_header("append", rid, name, item, timeout, *_ack_args(ack))
    assert header is not None
    assert _joined(prepared.frame_chunks(header, _one_buffer(item))) == \
        _general(Append(rid, name, item, timeout), ack)


@settings(max_examples=300, deadline=None)
@given(rid=ids, name=names, remove=st.booleans(), ack=acks,
       max_items=st.none() | st.integers(1, 1 << 40), wait=st.booleans(),
       timeout=st.none() | st.floats(0, 1e6), min_items=st.integers(1, 1000),
       min_tag=st.none() | st.integers(-(1 << 63), (1 << 63) - 1),
       newer_than=st.none() | st.integers(0, (1 << 63) - 1))
def test_a_fetch_from_pieces_is_the_general_encoders_bytes_and_the_server_reads_it_back(
        rid: int, name: str, remove: bool, ack: Any, max_items: Any, wait: bool,
        timeout: Any, min_items: int, min_tag: Any, newer_than: Any) -> None:
    spec = FetchSpec(remove, max_items, wait, timeout, min_tag, newer_than,
                     min_items if wait else 1)
    header = prepared.fetch_header(remove, rid, name, spec, *_ack_args(ack))
    raw = _general(Fetch(rid, name, spec), ack)
    assert _joined(prepared.frame_chunks(header, None)) == raw
    # the server reads it from its layout: what the general parse reads (see _agree below)
    _agree(raw, fast=True)


def test_items_that_are_not_one_plain_buffer_are_left_to_the_general_encoder() -> None:
    compressed = Item(encode(torch.zeros(100_000, dtype=torch.int32), compress="lz4"))
    two = Item(encode({"a": torch.ones(1), "b": torch.ones(2)}))
    assert prepared.put_header("put", 1, "x", compressed, None, -1, ()) is None
    assert prepared.put_header("put", 1, "x", two, None, -1, ()) is None


# -- reading replies --------------------------------------------------------------------------
EXPECTS = {name: cls for name, cls in (("put", Stored), ("append", Stored), ("get", Fetched),
                                        ("peek", Fetched), ("ping", Acked), ("unlisten", Acked))}


class _Raw:
    """A frame's header and payload, and its bytes (what the general parser is fed)."""

    def __init__(self, chunks: list[Any]) -> None:
        self.raw = _joined(chunks)
        (frame,) = FrameDecoder(1 << 30, 1 << 30).feed(self.raw)
        self.header, self.payload = frame.header, frame.payload


def _frame(chunks: list[Any]) -> Any:
    return _Raw(chunks)


def _general_reply(frame: Any, op: str) -> Any:
    """What ClientConnection makes of the frame when the fixed layouts are not tried."""
    from tensorshare.wire import protocol

    saved = dict(protocol.REPLY_EXPECTS)
    protocol.REPLY_EXPECTS.clear()  # (the fixed layouts then leave every reply to the parser)
    try:
        (msg,) = ClientConnection().receive_data(frame.raw, lambda rid: op)
    finally:
        protocol.REPLY_EXPECTS.update(saved)
    return msg


def _read(header: Any, payload: Any, op: str | None) -> Any:
    """What ClientConnection (the Twisted and asyncio faces) reads from a reply's fixed layout
    (``wire/replies``) when its request was ``op``, else ``None``."""
    reader = ReplyReader()
    rid = reader.reply_id(bytes(header))
    if rid is None or op is None:
        return None
    return reader.reply(rid, EXPECTS.get(op), payload)


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if type(a) is Fetched:
        assert (a.id, a.kind, a.version, a.n_items, a.dropped, a.unchanged) == \
            (b.id, b.kind, b.version, b.n_items, b.dropped, b.unchanged)
        assert len(a.items) == len(b.items)
        for x, y in zip(a.items, b.items, strict=True):
            assert x.tag == y.tag and x.value.value == y.value.value
            assert [bytes(u.data) for u in x.value.buffers] == \
                [bytes(u.data) for u in y.value.buffers]
            assert x.value.nbytes == y.value.nbytes
        return
    assert a == b


@settings(max_examples=300, deadline=None)
@given(rid=ids, version=uints, n=uints, flag=st.booleans(), code=st.text(max_size=30),
       message=st.text(max_size=300), dropped=st.integers(0, 1 << 40))
def test_the_common_replies_read_from_their_layout_are_what_the_parser_reads(
        rid: int, version: int, n: int, flag: bool, code: str, message: str,
        dropped: int) -> None:
    for op, reply in (("put", Stored(rid, version, n)), ("append", Stored(rid, version, n)),
                      ("ping", Acked(rid, flag)), ("get", ErrorReply(rid, code, message))):
        frame = _frame(encode_reply(reply))
        got = _read(frame.header, frame.payload, op)
        assert got is not None, reply
        _same(got, _general_reply(frame, op))
    # dropped items: another layout, left to the general parser
    frame = _frame(encode_reply(Stored(rid, version, n, dropped or 1)))
    assert _read(frame.header, frame.payload, "put") is None


@settings(max_examples=200, deadline=None)
@given(rid=ids, value=values, tag=tags, version=uints, n=uints, dropped=uints,
       kind=st.sampled_from(["value", "list"]), op=st.sampled_from(["get", "peek"]))
def test_a_fetched_item_read_from_its_layout_is_what_the_parser_reads(
        rid: int, value: Any, tag: Any, version: int, n: int, dropped: int, kind: str,
        op: str) -> None:
    reply = Fetched(rid, kind, (Item(encode(value), tag),), version, n, dropped)
    frame = _frame(encode_reply(reply))
    got = _read(frame.header, frame.payload, op)
    if len(reply.items[0].value.buffers) > 1:
        assert got is None
    else:
        assert got is not None
        _same(got, _general_reply(frame, op))


def test_a_reply_for_another_op_or_nobody_is_left_to_the_general_parser() -> None:
    stored = _frame(encode_reply(Stored(5, 2, 1)))
    assert _read(stored.header, stored.payload, "get") is None
    assert _read(stored.header, stored.payload, None) is None
    two = _frame(encode_reply(Fetched(5, "list", (Item(encode(1)), Item(encode(2))), 3, 0)))
    assert _read(two.header, two.payload, "get") is None


@pytest.mark.parametrize("cut", [1, 3, 8])
def test_a_header_cut_or_padded_is_left_to_the_general_parser(cut: int) -> None:
    frame = _frame(encode_reply(Stored(5, 2, 1)))
    assert _read(frame.header[:-cut], b"", "put") is None
    assert _read(frame.header + b"\x00" * cut, b"", "put") is None


@settings(max_examples=200, deadline=None)
@given(name=names, event=st.sampled_from(["put", "append", "get", "delete"]), n=uints,
       version=uints)
def test_a_notification_read_from_its_layout(name: str, event: str, n: int,
                                            version: int) -> None:
    frame = _frame(encode_message(Changed(name, event, n, version))[0])
    assert ReplyReader().notify(bytes(frame.header)) == Changed(name, event, n, version)
    frame = _frame(encode_message(Changed(name, event, n, version, 3))[0])
    assert ReplyReader().notify(bytes(frame.header)) is None


def test_the_ops_the_readers_expect_are_those_of_the_op_table() -> None:
    from tensorshare.wire.protocol import REPLY_EXPECTS

    for op, cls in REPLY_EXPECTS.items():
        assert op in OPS
        assert cls in (Stored, Acked, Fetched)
    assert REPLY_EXPECTS["put"] is Stored and REPLY_EXPECTS["get"] is Fetched


# -- the server: replies from pieces, requests read from their fixed layouts -------------------
@settings(max_examples=300, deadline=None)
@given(rid=ids, value=values, tag=tags, version=uints, n=uints, dropped=uints,
       kind=st.sampled_from(["value", "list"]))
def test_a_fetched_reply_from_pieces_is_the_general_encoders_bytes(
        rid: int, value: Any, tag: Any, version: int, n: int, dropped: int, kind: str) -> None:
    reply = Fetched(rid, kind, (Item(encode(value), tag),), version, n, dropped)
    chunks = prepared.fetched_chunks(rid, reply)
    if len(reply.items[0].value.buffers) > 1:
        assert chunks is None
        return
    assert chunks is not None
    assert _joined(chunks) == _joined(encode_message(reply)[0])
    assert _joined(encode_reply(reply)) == _joined(encode_message(reply)[0])


@settings(max_examples=400, deadline=None)
@given(name=names, event=st.sampled_from(["put", "append", "get", "delete", "restore"]) | names,
       n=uints, version=uints, skipped=st.integers(0, 1 << 40) | st.just(0),
       dropped=uints | st.just(0))
def test_a_notification_from_pieces_is_the_general_encoders_bytes(
        name: str, event: str, n: int, version: int, skipped: int, dropped: int) -> None:
    msg = Changed(name, event, n, version, skipped, dropped)
    chunks = prepared.notify_chunks(msg)
    assert _joined(chunks) == _joined(encode_message(msg)[0])
    # and the client reads the usual one (neither skipped nor dropped) from its layout
    expected = Changed(name, event, n, version) if not (skipped or dropped) else None
    assert ReplyReader().notify(bytes(_frame(chunks).header)) == expected


def _server_frame(raw: bytes) -> Any:
    (frame,) = FrameDecoder(1 << 30, 1 << 30).feed(raw)
    return frame


def _agree(raw: bytes, limits: Any = None, *, fast: bool | None = None) -> None:
    """The fixed-layout reader gives exactly what the general parse gives, or declines.
    ``fast``: whether it must read it (True) or decline (False)."""
    from tensorshare.errors import ProtocolError
    from tensorshare.wire.messages import Limits
    from tensorshare.wire.protocol import BadRequest, ServerConnection

    limits = limits or Limits()
    frame = _server_frame(raw)
    got = prepared.read_request(frame.header, frame.payload, limits)
    if fast is not None:
        assert (got is not None) == fast, (raw, got)
    if got is None:
        return
    conn = ServerConnection(limits)
    try:
        general = conn.parse_general(frame)
    except ProtocolError as exc:  # the reader read what the general parse refuses
        raise AssertionError(f"read {got!r}; the general parse refuses it: {exc}") from None
    assert not isinstance(general[0], BadRequest), (got, general)
    assert got[:3] == general
    assert got[3] == (general[0].spec.op if type(general[0]) is Fetch
                      else "put" if type(general[0]) is Put else "append")
    assert conn.bytes_in == {got[3]: len(frame.header) + len(frame.payload) + 16}


dtypes = st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16,
                          torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
                          torch.bool, torch.complex64])
shapes = st.lists(st.integers(0, 4), max_size=4).map(tuple)


@settings(max_examples=400, deadline=None)
@given(rid=ids, name=names, dtype=dtypes, shape=shapes, tag=tags, ack=acks,
       timeout=st.none() | st.floats(0, 1e6) | st.integers(0, 1 << 40))
def test_a_put_and_an_append_read_from_their_layout_are_what_the_general_parse_reads(
        rid: int, name: str, dtype: Any, shape: Any, tag: Any, ack: Any, timeout: Any) -> None:
    item = Item(encode(torch.zeros(shape, dtype=dtype)), tag)
    _agree(_general(Put(rid, name, item), ack), fast=True)
    _agree(_general(Append(rid, name, item, timeout), ack), fast=True)


def _packed(h: dict[str, Any], payload: bytes = b"") -> bytes:
    """A request frame of any header (keys in the dict's order) and payload."""
    import msgpack

    from tensorshare.wire.frames import encode_frame

    return _joined(encode_frame(msgpack.packb(h, use_bin_type=True), [payload] if payload
                                else []))


_VALUE = encode(torch.ones(2)).value
_DATA = bytes(8)
_FIELDS = st.sampled_from([
    ("op", "put"), ("op", "get"), ("op", "peek"), ("op", "append"), ("op", "delete"), ("op", 1),
    ("id", 5), ("id", 0), ("id", -1), ("id", True), ("id", 1.0), ("id", 1 << 63),
    ("bin", "x"), ("bin", ""), ("bin", b"x"), ("bin", "é" * 40), ("bin", None), ("bin", 3),
    ("ack", 0), ("ack", 4), ("ack", -1), ("ack", None), ("ack", True),
    ("open", []), ("open", [1, 2]), ("open", list(range(65))), ("open", [True]), ("open", 1),
    ("items", [[_VALUE, [[0, 8]], None]]), ("items", [[_VALUE, [[0, 8]], 3]]),
    ("items", [[_VALUE, [[0, 8]], True]]), ("items", [[_VALUE, [[0, 7]], None]]),
    ("items", [[_VALUE, [[64, 8]], None]]), ("items", [[_VALUE, [], None]]),
    ("items", [[_VALUE, [[0, 8, "lz4", 8]], None]]), ("items", []),
    ("items", [[_VALUE, [[0, 8]], None], [_VALUE, [], None]]), ("items", [[b"\xc1", [], None]]),
    ("items", [["str", [[0, 8]], None]]), ("items", [[_VALUE, [[0, 8]]]]),
    ("timeout", 1.5), ("timeout", 2), ("timeout", -1.0), ("timeout", float("inf")),
    ("timeout", float("nan")), ("timeout", None), ("timeout", True), ("timeout", "1"),
    ("max_items", 1), ("max_items", 0), ("max_items", None), ("max_items", 2.0),
    ("wait", True), ("wait", False), ("wait", None), ("wait", 1),
    ("min_items", 3), ("min_items", 0), ("min_tag", -4), ("min_tag", None),
    ("newer_than", 9), ("newer_than", "9"), ("wait_room", True), ("min_version", 3),
    ("extra", 1)])


@settings(max_examples=1500, deadline=None)
@given(fields=st.lists(_FIELDS, max_size=9), payload=st.sampled_from([b"", _DATA, bytes(7)]),
       max_name=st.sampled_from([255, 8]))
def test_any_header_is_read_as_the_general_parse_reads_it_or_left_to_it(
        fields: list[tuple[str, Any]], payload: bytes, max_name: int) -> None:
    from tensorshare.wire.messages import Limits

    h: dict[str, Any] = {}
    for k, v in fields:  # (a key again moves nowhere: dicts keep the first place)
        h[k] = v
    _agree(_packed(h, payload), Limits(max_name_bytes=max_name))


@pytest.mark.parametrize("msg", [
    Put(3, "bin", Item(encode(torch.ones(3)), 2)),
    Append(4, "bin", Item(encode(torch.ones(0))), 1.0),
    Fetch(5, "bin", FetchSpec(True, 4, True, 2.0, 1, 2, 3)),
    Fetch(6, "bin", FetchSpec(False)),
])
def test_a_cut_or_altered_request_is_read_as_the_general_parse_reads_it_or_left_to_it(
        msg: Any) -> None:
    raw = _general(msg, (7, (2, 3)))
    _agree(raw, fast=True)
    frame = _server_frame(raw)
    head = 16 + len(frame.header)  # (the prefix, then the header, then the payload)
    for i in range(16, head):
        for b in (0x00, 0x01, 0x7F, 0x80, 0x90, 0xA0, 0xC0, 0xC2, 0xC3, 0xCB, 0xCC, 0xD0,
                  0xD9, 0xDC, 0xE0, 0xFF, raw[i] ^ 1):
            altered = raw[:i] + bytes((b,)) + raw[i + 1:]
            try:
                _server_frame(altered)
            except Exception:  # noqa: BLE001  # (no longer a frame: nothing to compare)
                continue
            _agree(altered)
