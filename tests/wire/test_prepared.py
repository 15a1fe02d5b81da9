"""The prepared pieces (tensorshare.wire.prepared) against the general encoder and parser.

Every header written from pieces must be the bytes ``encode_message`` writes for the same
message, and every reply read from its fixed layout must be what the general parser makes of
it; a layout that differs in any way must be left to the general parser (``None``). Checked
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
def test_a_fetch_from_pieces_is_the_general_encoders_bytes(
        rid: int, name: str, remove: bool, ack: Any, max_items: Any, wait: bool,
        timeout: Any, min_items: int, min_tag: Any, newer_than: Any) -> None:
    spec = FetchSpec(remove, max_items, wait, timeout, min_tag, newer_than,
                     min_items if wait else 1)
    header = prepared.fetch_header(remove, rid, name, spec, *_ack_args(ack))
    assert _joined(prepared.frame_chunks(header, None)) == _general(Fetch(rid, name, spec), ack)


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
    protocol.REPLY_EXPECTS.clear()  # (read_reply then leaves every reply to the parser)
    try:
        (msg,) = ClientConnection().receive_data(frame.raw, lambda rid: op)
    finally:
        protocol.REPLY_EXPECTS.update(saved)
    return msg


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
        got = prepared.read_reply(frame.header, frame.payload, lambda r, op=op: op, EXPECTS)
        assert got is not None, reply
        _same(got, _general_reply(frame, op))
    # dropped items: another layout, left to the general parser
    frame = _frame(encode_reply(Stored(rid, version, n, dropped or 1)))
    assert prepared.read_reply(frame.header, frame.payload, lambda r: "put", EXPECTS) is None


@settings(max_examples=200, deadline=None)
@given(rid=ids, value=values, tag=tags, version=uints, n=uints, dropped=uints,
       kind=st.sampled_from(["value", "list"]), op=st.sampled_from(["get", "peek"]))
def test_a_fetched_item_read_from_its_layout_is_what_the_parser_reads(
        rid: int, value: Any, tag: Any, version: int, n: int, dropped: int, kind: str,
        op: str) -> None:
    reply = Fetched(rid, kind, (Item(encode(value), tag),), version, n, dropped)
    frame = _frame(encode_reply(reply))
    got = prepared.read_reply(frame.header, frame.payload, lambda r, op=op: op, EXPECTS)
    if len(reply.items[0].value.buffers) > 1:
        assert got is None
    else:
        assert got is not None
        _same(got, _general_reply(frame, op))


def test_a_reply_for_another_op_or_nobody_is_left_to_the_general_parser() -> None:
    stored = _frame(encode_reply(Stored(5, 2, 1)))
    assert prepared.read_reply(stored.header, stored.payload, lambda r: "get", EXPECTS) is None
    assert prepared.read_reply(stored.header, stored.payload, lambda r: None, EXPECTS) is None
    two = _frame(encode_reply(Fetched(5, "list", (Item(encode(1)), Item(encode(2))), 3, 0)))
    assert prepared.read_reply(two.header, two.payload, lambda r: "get", EXPECTS) is None


@pytest.mark.parametrize("cut", [1, 3, 8])
def test_a_header_cut_or_padded_is_left_to_the_general_parser(cut: int) -> None:
    frame = _frame(encode_reply(Stored(5, 2, 1)))
    assert prepared.read_reply(frame.header[:-cut], b"", lambda r: "put", EXPECTS) is None
    assert prepared.read_reply(frame.header + b"\x00" * cut, b"", lambda r: "put",
                               EXPECTS) is None


@settings(max_examples=200, deadline=None)
@given(name=names, event=st.sampled_from(["put", "append", "get", "delete"]), n=uints,
       version=uints)
def test_a_notification_read_from_its_layout(name: str, event: str, n: int,
                                            version: int) -> None:
    frame = _frame(encode_message(Changed(name, event, n, version))[0])
    assert prepared.read_notify(frame.header) == (name, event, n, version)
    frame = _frame(encode_message(Changed(name, event, n, version, 3))[0])
    assert prepared.read_notify(frame.header) is None


def test_the_ops_the_readers_expect_are_those_of_the_op_table() -> None:
    from tensorshare.wire.protocol import REPLY_EXPECTS

    for op, cls in REPLY_EXPECTS.items():
        assert op in OPS
        assert cls in (Stored, Acked, Fetched)
    assert REPLY_EXPECTS["put"] is Stored and REPLY_EXPECTS["get"] is Fetched
