"""The common replies read from their layouts (tensorshare.wire.replies) against the general decoder.

Every reply and notification read from its fixed layout must be what the general decoder (the
frame decoder, msgpack's unpacker and the op table's parsers) makes of the same bytes, and
anything else must be declined (``None``, or a frame not taken) and left to it. Checked over
many values with hypothesis, on the pure and the compiled path (tests/test_ext.py); then the
session's pass is checked against the general path over streams cut anywhere.
"""

from __future__ import annotations

import random
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorshare.client.session import ClientSession, Done, Notify
from tensorshare.wire.codec import encode
from tensorshare.wire.frames import FrameDecoder
from tensorshare.wire.messages import Changed, Limits
from tensorshare.wire.protocol import (
    OPS,
    REPLY_EXPECTS,
    encode_message,
    encode_reply,
)
from tensorshare.wire.records import Acked, ErrorReply, Fetch, Fetched, FetchSpec, Item, Put, Stored
from tensorshare.wire.replies import ReplyReader

BIG = 1 << 30
rids = st.integers(1, (1 << 63) - 1)
u64 = st.integers(0, (1 << 64) - 1)
tags = st.none() | st.integers(-(1 << 63), (1 << 63) - 1)
texts = st.text(max_size=300)
stored_ops = st.sampled_from(sorted(op for op, cls in REPLY_EXPECTS.items() if cls is Stored))
acked_ops = st.sampled_from(sorted(op for op, cls in REPLY_EXPECTS.items() if cls is Acked))
fetch_ops = st.sampled_from(sorted(op for op, cls in REPLY_EXPECTS.items() if cls is Fetched))
contents = st.sampled_from([torch.ones(1), torch.arange(5, dtype=torch.int64), torch.zeros(0),
                            torch.randn(2, 3, dtype=torch.float16), b"raw", "text", 3, None,
                            {"k": torch.ones(3)}, [torch.ones(1), torch.zeros(2)]])


def _bytes(chunks: list[Any]) -> bytes:
    return b"".join(bytes(c) for c in chunks)


def _decoded(raw: bytes, op: str | None) -> Any:
    """What the general decoder makes of the one frame in ``raw`` (``op``: its request's)."""
    (frame,) = FrameDecoder(BIG, BIG).feed(raw)
    h = msgpack.unpackb(frame.header)
    if h["op"] == "notify":
        return Changed(h["bin"], h["event"], h["n_items"], h["version"], h.get("skipped") or 0,
                       h.get("dropped") or 0)
    if not h["ok"]:
        return ErrorReply(h["id"], h["code"], h["message"])
    assert op is not None
    return OPS[op].parse_reply(h["id"], h, frame.payload, Limits())


def _read(raw: bytes, op: str | None) -> Any:
    """What the reader makes of it (``None``: declined)."""
    reader, data = ReplyReader(), bytearray(raw)
    end = reader.frame_at(data, 0, len(data), BIG, BIG)
    assert end == len(data)
    rid = reader.reply_id(reader.h)
    if rid is None:
        return reader.notify(reader.h) if reader.start == end else None
    return reader.reply(rid, REPLY_EXPECTS.get(op) if op else None, data[reader.start:end])


def _check(raw: bytes, op: str | None) -> None:
    got = _read(raw, op)
    assert got is not None
    assert type(got) is type(_decoded(raw, op))
    assert got == _decoded(raw, op)


@settings(max_examples=150, deadline=None)
@given(rid=rids, version=u64, n=u64, flag=st.booleans(), code=texts, message=texts,
       put_op=stored_ops, ack_op=acked_ops, any_op=st.sampled_from(sorted(OPS)))
def test_stored_acked_and_errors_read_from_their_layout_are_what_the_decoder_reads(
        rid: int, version: int, n: int, flag: bool, code: str, message: str, put_op: str,
        ack_op: str, any_op: str) -> None:
    _check(_bytes(encode_reply(Stored(rid, version, n))), put_op)
    _check(_bytes(encode_reply(Acked(rid, flag))), ack_op)
    _check(_bytes(encode_reply(ErrorReply(rid, code, message))), any_op)


@settings(max_examples=150, deadline=None)
@given(rid=rids, value=contents, tag=tags, version=u64, n=u64, dropped=u64,
       kind=st.sampled_from(["value", "list"]), op=fetch_ops)
def test_a_fetched_item_read_from_its_layout_is_what_the_decoder_reads(
        rid: int, value: Any, tag: Any, version: int, n: int, dropped: int, kind: str,
        op: str) -> None:
    item = Item(encode(value), tag)
    raw = _bytes(encode_reply(Fetched(rid, kind, (item,), version, n, dropped)))
    if len(item.value.buffers) > 1:
        assert _read(raw, op) is None  # more than one buffer: another layout
    else:
        _check(raw, op)
        got = _read(raw, op)
        for buf in got.items[0].value.buffers:
            if buf.raw_nbytes:  # tensors made from it are writable
                assert not memoryview(buf.data).readonly


@settings(max_examples=150, deadline=None)
@given(name=st.text(min_size=1, max_size=80), event=st.sampled_from(["put", "append", "get"]),
       n=u64, version=u64)
def test_a_notification_read_from_its_layout_is_what_the_decoder_reads(
        name: str, event: str, n: int, version: int) -> None:
    _check(_bytes(encode_message(Changed(name, event, n, version))[0]), None)
    # skipped or dropped: another layout, declined
    assert _read(_bytes(encode_message(Changed(name, event, n, version, 2))[0]), None) is None
    assert _read(_bytes(encode_message(Changed(name, event, n, version, 0, 1))[0]),
                 None) is None


def test_replies_of_another_layout_or_for_another_op_are_declined() -> None:
    stored = _bytes(encode_reply(Stored(5, 2, 1)))
    assert _read(stored, "get") is None  # a get expects a Fetched
    assert _read(stored, None) is None  # nobody waits for it: the decoder says Orphan
    assert _read(_bytes(encode_reply(Stored(5, 2, 1, 3))), "put") is None  # dropped
    assert _read(_bytes(encode_reply(Acked(5, True))), "put") is None
    two = Fetched(5, "list", (Item(encode(1)), Item(encode(2))), 3, 2, 0)
    assert _read(_bytes(encode_reply(two)), "get") is None
    assert _read(_bytes(encode_reply(Fetched(5, "value", (), 3, 0, 0, True))), "peek") is None
    assert _read(_bytes(encode_reply(Fetched(5, "value", (), 3, 0, 0))), "peek") is None
    fetched = _bytes(encode_reply(Fetched(5, "value", (Item(encode(1)),), 3, 1, 0)))
    assert _read(fetched, "put") is None
    assert _read(_bytes(encode_message(Changed("b", "put", -1, 2))[0]), None) == \
        _decoded(_bytes(encode_message(Changed("b", "put", -1, 2))[0]), None)


def _framed(header: bytes, payload: bytes = b"") -> bytes:
    from tensorshare.wire.frames import encode_frame

    return _bytes(encode_frame(header, [payload] if payload else []))


@pytest.mark.parametrize("header", [
    msgpack.packb({"op": "reply", "id": 5, "ok": True, "version": -1, "n_items": 0}),
    msgpack.packb({"op": "reply", "id": 5, "ok": True, "version": 1, "n_items": True}),
    msgpack.packb({"op": "reply", "id": 5, "ok": True, "version": 1.5, "n_items": 0}),
    msgpack.packb({"op": "reply", "id": 5, "ok": True, "n_items": 0, "version": 1}),
    msgpack.packb({"op": "reply", "id": 5, "ok": True, "version": 1, "n_items": 0, "x": 1}),
    msgpack.packb({"op": "reply", "id": -5, "ok": True, "version": 1, "n_items": 0}),
    msgpack.packb({"op": "reply", "id": "5", "ok": True, "version": 1, "n_items": 0}),
    msgpack.packb({"op": "reply", "id": 5, "ok": True, "version": 1, "n_items": 0})[:-1],
    msgpack.packb({"op": "reply", "id": 5, "ok": True, "version": 1, "n_items": 0}) + b"\xc0",
    msgpack.packb({"op": "reply", "id": 5, "ok": False, "code": "x", "message": b"m"}),
    msgpack.packb({"op": "reply", "id": 5, "ok": False, "code": "x"}),
    msgpack.packb({"op": "reply", "id": 5, "ok": False, "code": b"\xff", "message": "m"},
                  use_bin_type=False),
    msgpack.packb({"op": "notify", "bin": "b", "event": "put", "n_items": 1}),
    msgpack.packb([1, 2, 3]),
])
def test_headers_the_layouts_do_not_match_exactly_are_declined(header: bytes) -> None:
    assert _read(_framed(header), "put") is None


def test_frames_the_decoder_would_refuse_or_not_yet_whole_are_not_taken() -> None:
    raw = bytearray(_bytes(encode_reply(Stored(5, 2, 1))))
    reader = ReplyReader()
    assert reader.frame_at(raw, 0, len(raw) - 1, BIG, BIG) == 0  # not whole yet
    assert reader.frame_at(raw, 0, 15, BIG, BIG) == 0  # not even its prefix
    assert reader.frame_at(raw, 0, len(raw), len(raw) - 17, BIG) == 0  # header over the limit
    for at, byte in ((0, 0x55), (2, 2), (3, 1), (15, 1)):  # magic, version, flags, length
        bad = bytearray(raw)
        bad[at] = byte
        assert reader.frame_at(bad, 0, len(bad), BIG, BIG) == 0
    with_payload = bytearray(_framed(b"\x80", b"x" * 100))
    assert reader.frame_at(with_payload, 0, len(with_payload), BIG, 150) == 0  # frame limit
    assert reader.frame_at(with_payload, 0, len(with_payload), BIG, 1 << 20) == \
        len(with_payload)


# -- the session's pass ------------------------------------------------------------------------
def _session() -> tuple[ClientSession, list[Any]]:
    """A session with calls in flight (ids 2..): three puts, three gets, a ping."""
    session = ClientSession(address="test", session=False)
    session.connection_made(0.0)
    calls = [session.call(Put(0, "a", Item(encode(torch.ones(2)))), "put", 0.0, token=object())
             for _ in range(3)]
    calls += [session.call(Fetch(0, "a", FetchSpec(True)), "get", 0.0, token=object())
              for _ in range(3)]
    return session, calls


def _stream(calls: list[Any]) -> bytes:
    """Their replies, a notification, an error and replies of other layouts, in one stream."""
    put1, put2, put3, get1, get2, get3 = (c.id for c in calls)
    tensor = Item(encode(torch.arange(6, dtype=torch.float32)), 4)
    replies = [Stored(put1, 1, 1), Fetched(get1, "value", (tensor,), 1, 0, 0),
               Stored(put2, 2, 1, 7), ErrorReply(get2, "BinNotFound", "no bin 'a'"),
               Stored(put3, 3, 1),
               Fetched(get3, "list", (Item(encode(1)), Item(encode(2))), 4, 0, 0),
               Stored(99, 1, 1)]  # nobody waits for 99: the decoder's Orphan
    out = [_bytes(encode_reply(r)) for r in replies]
    out.insert(1, _bytes(encode_message(Changed("a", "put", 1, 1))[0]))
    return b"".join(out)


def _outcomes(events: list[Any]) -> list[Any]:
    return [(ev.call.id, ev.reply) if type(ev) is Done else ("notify", ev.bin, ev.event)
            if type(ev) is Notify else ev for ev in events]


@pytest.mark.parametrize("seed", range(40))
def test_the_sessions_pass_reads_what_the_general_path_reads_cut_anywhere(seed: int) -> None:
    general, calls = _session()
    general.add_listener("a", "cb")
    stream = _stream(calls)
    expected = _outcomes(general.receive_data(stream, 1.0))
    assert len(expected) == 7  # 6 calls answered (99's reply is an Orphan), one notification
    session, _ = _session()
    session.add_listener("a", "cb")
    rng = random.Random(seed)
    scratch = bytearray(1 << 16)
    view = memoryview(scratch)
    got: list[Any] = []
    i = 0
    while i < len(stream):
        n = min(rng.choice([1, 7, 16, 40, 100, 500, 5000]), len(stream) - i)
        scratch[:n] = stream[i:i + n]
        got += _outcomes(session.receive_read(scratch, view, n, 1.0))
        i += n
    assert got == expected
    assert session.pending == general.pending == 0
