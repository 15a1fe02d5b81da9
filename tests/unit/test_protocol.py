"""Unit tests for tensorshare.protocol: the sans-I/O connection state, with no sockets.

A ``Connection(CLIENT)`` and a ``Connection(SERVER)`` talk to each other by handing the joined
chunks of one side's ``send()`` to the other side's ``receive_data()``. Malformed requests are
built by hand (``encode_frame`` of a hand-packed msgpack header) to reach every check of the
server-side parser.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

import msgpack
import pytest
import torch

from tensorshare import codec
from tensorshare.codec import Buffer, Encoded
from tensorshare.errors import ProtocolError
from tensorshare.frames import BytesLike, encode_frame
from tensorshare.messages import (
    Acked,
    Append,
    Cancel,
    Changed,
    Delete,
    Deleted,
    ErrorReply,
    Fetched,
    Get,
    Hello,
    HelloReply,
    Item,
    Limits,
    ListBins,
    Listen,
    Listening,
    Listing,
    Peek,
    Ping,
    Put,
    Stored,
    Unlisten,
)
from tensorshare.protocol import CLIENT, SERVER, BadRequest, Connection, check_bin_name

# ------------------------------------------------------------------------------- helpers


def wire(chunks: Sequence[BytesLike]) -> bytes:
    return b"".join(chunks)


def c2s(client: Connection, server: Connection, msg: Any) -> list[Any]:
    """Send ``msg`` from the client side and return what the server side parses."""
    return server.receive_data(wire(client.send(msg)))


def s2c(server: Connection, client: Connection, msg: Any) -> list[Any]:
    """Send ``msg`` from the server side and return what the client side parses."""
    return client.receive_data(wire(server.send(msg)))


def one(msgs: list[Any]) -> Any:
    assert len(msgs) == 1, msgs
    return msgs[0]


def raw_frame(header: Any, buffers: Sequence[bytes] = ()) -> bytes:
    """A frame whose header is any msgpack value (or raw bytes), built by hand."""
    packed = header if isinstance(header, bytes) else msgpack.packb(header, use_bin_type=True)
    return wire(encode_frame(packed, list(buffers)))


def item_of(value: Any, tag: int | None = None, **kw: Any) -> Item:
    return Item(codec.encode(value, **kw), tag)


def raw_put(descs: list[Any], payload: bytes, *, value: bytes | None = None, rid: int = 5,
            tag: Any = None, op: str = "put", bin: Any = "b") -> bytes:
    """A put frame with hand-written buffer descriptors over a payload of ``payload``."""
    if value is None:
        value = msgpack.packb(None)
    header = {"op": op, "id": rid, "bin": bin, "items": [[value, descs, tag]]}
    return raw_frame(header, [payload] if payload else [])


def tensor_value(n_buffers: int) -> bytes:
    """A value tree holding ``n_buffers`` uint8 tensors, referring to buffers 0..n-1."""
    exts = [
        msgpack.ExtType(codec.EXT_TENSOR, msgpack.packb(["uint8", [1], i]))
        for i in range(n_buffers)
    ]
    return msgpack.packb(exts, use_bin_type=True)


def assert_usable(server: Connection, rid: int = 99) -> None:
    """The server side still parses the next frame on the same connection."""
    assert server.receive_data(raw_frame({"op": "ping", "id": rid})) == [Ping(rid)]


def assert_bad(server: Connection, data: bytes, rid: int, code: str, match: str) -> BadRequest:
    bad = one(server.receive_data(data))
    assert isinstance(bad, BadRequest), bad
    assert bad.id == rid
    assert bad.code == code, bad
    assert match in bad.message, bad.message
    assert_usable(server)
    return bad


def fatal(conn: Connection, data: bytes) -> str:
    """The connection-fatal error ``data`` causes, as a message.

    A broken wire format is reported either by ``receive_data`` raising ``ProtocolError`` or
    (newer API) by a trailing ``ProtocolViolation`` event after every complete message.
    """
    try:
        out = conn.receive_data(data)
    except ProtocolError as exc:
        return str(exc)
    assert out, "no error for a broken wire format"
    last = out[-1]
    assert type(last).__name__ == "ProtocolViolation", out
    return str(last.message)


def same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy())
                == bytes(b.contiguous().reshape(-1).view(torch.uint8).numpy()))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(
            same_value(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


@pytest.fixture
def pair() -> tuple[Connection, Connection]:
    return Connection(CLIENT), Connection(SERVER)


# ------------------------------------------------------------------------------- basics


def test_role_is_checked() -> None:
    with pytest.raises(ValueError):
        Connection("peer")


def test_next_id_counts_from_one() -> None:
    c = Connection(CLIENT)
    assert [c.next_id() for _ in range(3)] == [1, 2, 3]


@pytest.mark.parametrize("name", ["x", "with space", "a|b", "a/b/c", "ünï©ødé ✓", "名前"])
def test_check_bin_name_accepts_any_characters(name: str) -> None:
    assert check_bin_name(name, 1024) == name


def test_check_bin_name_counts_utf8_bytes() -> None:
    assert check_bin_name("é" * 4, 8) == "é" * 4  # 8 bytes, 4 characters
    with pytest.raises(ValueError, match="max_name_bytes=8"):
        check_bin_name("é" * 4 + "x", 8)
    with pytest.raises(ValueError):
        check_bin_name("", 8)
    with pytest.raises(TypeError):
        check_bin_name(b"bytes", 8)


# ------------------------------------------------------------------------------- requests

REQUESTS: list[Any] = [
    Hello(1, (1,)),
    Hello(1, (1, 2, 7), "my-client", "token"),
    ListBins(1),
    Delete(1, "bin"),
    Listen(1, "bin"),
    Unlisten(1, "bin"),
    Ping(1),
    Cancel(1, 42),
    Get(1, "bin"),
    Peek(1, "bin"),
    Get(1, "bin", max_items=3, min_tag=-4, newer_than=9),
    Peek(1, "bin", max_items=1, min_tag=0, newer_than=0),
    Get(1, "bin", wait=True, timeout=None),
    Get(1, "bin", wait=True, timeout=2.5, min_items=3),
    Peek(1, "bin", wait=True, timeout=0.0, min_items=2, max_items=5, min_tag=1, newer_than=3),
]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_request_round_trips_into_the_same_dataclass(pair: tuple[Connection, Connection],
                                                     msg: Any) -> None:
    client, server = pair
    got = one(c2s(client, server, msg))
    assert type(got) is type(msg)
    assert got == msg
    assert client.outstanding == 1


def test_timeout_travels_as_a_float(pair: tuple[Connection, Connection]) -> None:
    client, server = pair
    got = one(c2s(client, server, Get(1, "b", wait=True, timeout=3)))
    assert got.timeout == 3.0 and type(got.timeout) is float


@pytest.mark.parametrize("cls", [Put, Append])
def test_store_request_with_tensors_round_trips(pair: tuple[Connection, Connection],
                                                cls: type) -> None:
    client, server = pair
    value = {"w": torch.randn(3, 4), "i": torch.arange(10), "t": (1, "two", b"3"),
             "nested": [torch.ones(2, dtype=torch.bool), {"x": None}]}
    msg = cls(7, "weights", item_of(value, tag=12))
    got = one(c2s(client, server, msg))
    assert type(got) is cls
    assert (got.id, got.bin, got.item.tag) == (7, "weights", 12)
    assert got.item.value.value == msg.item.value.value
    assert [bytes(b.data) for b in got.item.value.buffers] == [
        bytes(b.data) for b in msg.item.value.buffers]
    assert same_value(codec.decode(got.item.value), value)


def test_store_request_with_lz4_buffers_round_trips(pair: tuple[Connection, Connection]) -> None:
    client, server = pair
    value = torch.zeros(100_000, dtype=torch.float32)
    item = item_of(value, compress="lz4", compress_min_bytes=0)
    assert item.value.buffers[0].codec == "lz4"
    got = one(c2s(client, server, Put(1, "z", item)))
    buf = got.item.value.buffers[0]
    assert (buf.codec, buf.raw_nbytes) == ("lz4", 400_000)
    assert same_value(codec.decode(got.item.value), value)


def test_item_without_buffers_and_empty_buffers(pair: tuple[Connection, Connection]) -> None:
    client, server = pair
    for value in (None, "text", [1, 2.5, True], torch.empty(0, 3), [torch.empty(0), torch.ones(1)]):
        got = one(c2s(client, server, Put(1, "b", item_of(value))))
        assert same_value(codec.decode(got.item.value), value)


def test_requests_split_across_chunks_and_batched(pair: tuple[Connection, Connection]) -> None:
    client, server = pair
    msgs = [Put(1, "a", item_of(torch.arange(50))), Ping(2), Get(3, "a", max_items=2)]
    data = b"".join(wire(client.send(m)) for m in msgs)
    out: list[Any] = []
    for i in range(len(data)):  # one byte at a time
        out.extend(server.receive_data(data[i : i + 1]))
    assert [type(m) for m in out] == [Put, Ping, Get]
    assert out[1:] == msgs[1:]
    assert [type(m) for m in server.receive_data(data)] == [Put, Ping, Get]  # all at once


# ------------------------------------------------------------------------------- replies


def reply_round_trip(request: Any, reply: Any) -> Any:
    client, server = Connection(CLIENT), Connection(SERVER)
    assert one(c2s(client, server, request)) is not None
    got = one(s2c(server, client, reply))
    assert client.outstanding == 0
    return got


LIMITS = Limits(max_frame_bytes=1 << 20, max_header_bytes=1 << 16, max_depth=9,
                max_name_bytes=77)
REPLIES: list[tuple[Any, Any]] = [
    (Hello(1, (1,)), HelloReply(1, 1, "tensorshare/9.9", LIMITS)),
    (Put(2, "b", item_of(1)), Stored(2, 5, 1)),
    (Append(3, "b", item_of(1)), Stored(3, 6, 2)),
    (ListBins(4), Listing(4, {"a": 1, "b b|/ü": 3})),
    (ListBins(4), Listing(4, {})),
    (Delete(5, "b"), Deleted(5, True, 8)),
    (Delete(5, "b"), Deleted(5, False, 0)),
    (Listen(6, "b"), Listening(6, 3, 2)),
    (Unlisten(7, "b"), Acked(7, True)),
    (Unlisten(7, "b"), Acked(7, False)),
    (Cancel(8, 3), Acked(8, False)),
    (Ping(9), Acked(9, True)),
    (Get(10, "b", newer_than=4), Fetched(10, "value", (), 4, 1, 0, True)),
    (Peek(11, "b"), ErrorReply(11, "bin_not_found", "bin 'b' does not exist or is empty")),
    (Get(12, "b", wait=True, timeout=1), ErrorReply(12, "timeout", "no data")),
]


@pytest.mark.parametrize(("request_", "reply"), REPLIES, ids=lambda m: type(m).__name__)
def test_reply_round_trips_into_the_same_dataclass(request_: Any, reply: Any) -> None:
    got = reply_round_trip(request_, reply)
    assert type(got) is type(reply)
    assert got == reply


@pytest.mark.parametrize("op", [Get, Peek])
def test_fetched_reply_with_tensors_round_trips(op: type) -> None:
    values = [{"w": torch.randn(4, 4, dtype=torch.float64)}, torch.arange(7),
              (torch.tensor(1.5, dtype=torch.bfloat16), [])]
    items = tuple(item_of(v, tag=i if i else None) for i, v in enumerate(values))
    reply = Fetched(3, "list", items, 12, 4, dropped=2)
    got = reply_round_trip(op(3, "b", max_items=3), reply)
    assert type(got) is Fetched
    assert (got.id, got.kind, got.version, got.n_items, got.dropped, got.unchanged) == (
        3, "list", 12, 4, 2, False)
    assert [it.tag for it in got.items] == [None, 1, 2]
    for it, v in zip(got.items, values, strict=True):
        assert same_value(codec.decode(it.value), v)


def test_fetched_value_reply_with_compressed_buffer() -> None:
    value = torch.full((50_000,), 3, dtype=torch.int16)
    reply = Fetched(1, "value", (item_of(value, compress="lz4"),), 2, 1)
    got = reply_round_trip(Get(1, "b"), reply)
    assert got.items[0].value.buffers[0].codec == "lz4"
    assert same_value(codec.decode(got.items[0].value), value)


def test_notification_and_connection_error_need_no_request() -> None:
    client, server = Connection(CLIENT), Connection(SERVER)
    assert one(s2c(server, client, Changed("b|x", "append", 3, 17))) == Changed(
        "b|x", "append", 3, 17)
    assert one(s2c(server, client, ErrorReply(0, "protocol_error", "bye"))) == ErrorReply(
        0, "protocol_error", "bye")


def test_replies_out_of_order_are_matched_by_id() -> None:
    client, server = Connection(CLIENT), Connection(SERVER)
    for msg in (ListBins(1), Ping(2), Delete(3, "d")):
        c2s(client, server, msg)
    assert client.outstanding == 3
    data = b"".join(wire(server.send(m)) for m in (Deleted(3, True, 2), Acked(2), Listing(1)))
    assert client.receive_data(data) == [Deleted(3, True, 2), Acked(2), Listing(1)]
    assert client.outstanding == 0


def test_reply_to_a_forgotten_request_is_surfaced_as_such() -> None:
    client, server = Connection(CLIENT), Connection(SERVER)
    c2s(client, server, Get(1, "b", wait=True, timeout=None))
    client.forget(1)
    assert client.outstanding == 0
    got = one(s2c(server, client, Fetched(1, "value", (item_of(torch.ones(2)),), 3, 0)))
    assert type(got) is Fetched and got.id == 1 and len(got.items) == 1


def test_client_refuses_an_unexpected_server_op() -> None:
    client = Connection(CLIENT)
    assert "unexpected message op 'put'" in fatal(client, raw_frame({"op": "put", "id": 1}))


def test_client_refuses_a_hello_reply_with_impossible_limits() -> None:
    """A malformed reply from the server must be a ProtocolError, never another exception.

    The blocking client's reader thread only handles ProtocolError/OSError; anything else
    kills it without failing the pending calls.
    """
    client = Connection(CLIENT)
    client.send(Hello(1, (1,)))
    header = {"op": "reply", "id": 1, "ok": True, "version": 1, "server": "evil",
              "limits": {"max_frame_bytes": 0, "max_header_bytes": 0, "max_depth": 0,
                         "max_name_bytes": 0}}
    assert "limits" in fatal(client, raw_frame(header))


# ------------------------------------------------------------------------------- bad requests


@pytest.fixture
def server() -> Connection:
    return Connection(SERVER, Limits(max_name_bytes=8, max_depth=4))


def test_unknown_op_keeps_the_id(server: Connection) -> None:
    assert_bad(server, raw_frame({"op": "frobnicate", "id": 31}), 31, "invalid_request",
               "unknown op 'frobnicate'")
    assert_bad(server, raw_frame({"id": 32}), 32, "invalid_request", "unknown op")
    assert_bad(server, raw_frame({"op": 5, "id": 33}), 33, "invalid_request", "unknown op")


@pytest.mark.parametrize("op", ["put", "append", "get", "peek", "delete", "listen", "unlisten"])
@pytest.mark.parametrize(
    ("name", "code", "match"),
    [
        ("", "invalid_request", "empty"),
        (None, "invalid_request", "must be a str"),
        (7, "invalid_request", "must be a str"),
        (b"bytes", "invalid_request", "must be a str"),
        ("123456789", "limit_exceeded", "max_name_bytes=8"),
        ("éééé!", "limit_exceeded", "max_name_bytes=8"),  # 5 characters, 9 bytes
    ],
)
def test_bad_bin_name(server: Connection, op: str, name: Any, code: str, match: str) -> None:
    if op in ("put", "append"):
        data = raw_put([], b"", op=op, bin=name, rid=4)
    else:
        data = raw_frame({"op": op, "id": 4, "bin": name})
    assert_bad(server, data, 4, code, match)


def test_missing_bin_name(server: Connection) -> None:
    assert_bad(server, raw_frame({"op": "get", "id": 4}), 4, "invalid_request", "must be a str")


def test_name_of_exactly_max_name_bytes_is_accepted(server: Connection) -> None:
    assert one(server.receive_data(raw_frame({"op": "delete", "id": 1, "bin": "éééé"}))) == (
        Delete(1, "éééé"))


def test_buffer_offset_not_a_multiple_of_64(server: Connection) -> None:
    assert_bad(server, raw_put([[1, 1]], b"\0\x07", value=tensor_value(1)), 5,
               "invalid_request", "not a multiple of 64")


def test_overlapping_buffers(server: Connection) -> None:
    payload = bytes(128)
    assert_bad(server, raw_put([[0, 100], [64, 1]], payload, value=tensor_value(2)), 5,
               "invalid_request", "overlaps")
    assert_bad(server, raw_put([[64, 1], [0, 1]], payload[:65], value=tensor_value(2)), 5,
               "invalid_request", "overlaps")
    assert_bad(server, raw_put([[0, 1], [0, 1]], payload[:1], value=tensor_value(2)), 5,
               "invalid_request", "overlaps")


def test_buffer_out_of_bounds(server: Connection) -> None:
    assert_bad(server, raw_put([[0, 200]], bytes(128), value=tensor_value(1)), 5,
               "invalid_request", "outside")
    assert_bad(server, raw_put([[128, 1]], bytes(128), value=tensor_value(1)), 5,
               "invalid_request", "outside")
    assert_bad(server, raw_put([[0, 1]], b"", value=tensor_value(1)), 5,
               "invalid_request", "outside")


@pytest.mark.parametrize(
    ("desc", "match"),
    [
        ([-64, 1], "non-negative"),
        ([0, -1], "non-negative"),
        (["0", 1], "non-negative"),
        ([0], "a buffer must be"),
        ("0,1", "a buffer must be"),
        ([0, 1, "zstd", 1], "unsupported buffer codec"),
        ([0, 1, "lz4", -1], "unsupported buffer codec"),
    ],
)
def test_malformed_buffer_descriptor(server: Connection, desc: Any, match: str) -> None:
    assert_bad(server, raw_put([desc], b"\1", value=tensor_value(1)), 5, "invalid_request", match)


def test_payload_beyond_the_last_buffer(server: Connection) -> None:
    assert_bad(server, raw_put([[0, 1]], bytes(2), value=tensor_value(1)), 5,
               "invalid_request", "buffers end at 1")


@pytest.mark.parametrize(
    "value",
    [
        b"\xc1",  # never-used msgpack byte
        b"\x92\x01",  # truncated array
        msgpack.packb(1) + msgpack.packb(2),  # trailing data
        msgpack.packb(msgpack.ExtType(9, b"")),  # unknown ext type
        msgpack.packb(msgpack.ExtType(codec.EXT_TENSOR, msgpack.packb(["float8", [1], 0]))),
        msgpack.packb(msgpack.ExtType(codec.EXT_TENSOR, msgpack.packb(["uint8", [1], 1]))),
        msgpack.packb([msgpack.ExtType(codec.EXT_TENSOR, msgpack.packb(["uint8", [1], 0]))] * 2),
        msgpack.packb({1: "int key"}),
        msgpack.packb([[[1]]], use_bin_type=True)[:-1],
    ],
)
def test_malformed_value_is_invalid_request(server: Connection, value: bytes) -> None:
    with pytest.raises(ValueError):
        codec.validate(value, 1)
    assert_bad(server, raw_put([[0, 1]], b"\1", value=value), 5, "invalid_request",
               "malformed value")


def test_value_too_deep_is_limit_exceeded(server: Connection) -> None:
    deep = msgpack.packb([[[[[1]]]]])  # 5 levels, max_depth=4
    assert_bad(server, raw_put([], b"", value=deep), 5, "limit_exceeded", "depth")


@pytest.mark.parametrize(
    ("items", "match"),
    [
        (None, "'items' must be a list"),
        ("x", "'items' must be a list"),
        ([], "exactly one item"),
        ([[b"\xc0", [], None]] * 2, "exactly one item"),
        ([[b"\xc0", []]], "[value, buffers, tag]"),
        ([["nil", [], None]], "[bin value, list of buffers, tag]"),
        ([[b"\xc0", None, None]], "[bin value, list of buffers, tag]"),
        ([[b"\xc0", [], "tag"]], "tag must be an integer"),
        ([[b"\xc0", [], True]], "tag must be an integer"),
        ([[b"\xc0", [], 1.5]], "tag must be an integer"),
    ],
)
def test_malformed_items(server: Connection, items: Any, match: str) -> None:
    header: dict[str, Any] = {"op": "append", "id": 6, "bin": "b"}
    if items is not None:
        header["items"] = items
    assert_bad(server, raw_frame(header), 6, "invalid_request", match)


@pytest.mark.parametrize("op", ["get", "peek"])
@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("wait", 1, "'wait' must be a bool"),
        ("wait", "yes", "'wait' must be a bool"),
        ("timeout", -1, "'timeout'"),
        ("timeout", -0.001, "'timeout'"),
        ("timeout", "5", "'timeout'"),
        ("timeout", True, "'timeout'"),
        ("max_items", 0, "'max_items' must be at least 1"),
        ("max_items", -3, "'max_items' must be at least 1"),
        ("max_items", 1.0, "'max_items' must be an integer"),
        ("max_items", True, "'max_items' must be an integer"),
        ("min_items", 0, "'min_items' must be at least 1"),
        ("min_tag", "1", "'min_tag' must be an integer"),
        ("newer_than", 2.5, "'newer_than' must be an integer"),
    ],
)
def test_wrong_field_types(server: Connection, op: str, field: str, value: Any,
                           match: str) -> None:
    header = {"op": op, "id": 8, "bin": "b", "wait": True, field: value}
    assert_bad(server, raw_frame(header), 8, "invalid_request", match)


@pytest.mark.parametrize("timeout", [math.nan, -math.inf])
def test_timeout_that_is_not_a_non_negative_number(server: Connection, timeout: float) -> None:
    """NaN compares False with everything, so ``timeout < 0`` does not catch it.

    A NaN timeout reaches the server's ``reactor.callLater(nan)``, which raises after the
    waiter was registered in the store: the waiter leaks and later eats a put (see
    tests/integration/test_client_server.py::test_get_with_nan_timeout_loses_no_data).
    """
    header = {"op": "get", "id": 8, "bin": "b", "wait": True, "timeout": timeout}
    assert_bad(server, raw_frame(header), 8, "invalid_request", "'timeout'")


def test_other_malformed_requests(server: Connection) -> None:
    assert_bad(server, raw_frame({"op": "cancel", "id": 9}), 9, "invalid_request", "target")
    assert_bad(server, raw_frame({"op": "cancel", "id": 9, "target": "1"}), 9,
               "invalid_request", "target")
    assert_bad(server, raw_frame({"op": "hello", "id": 9}), 9, "invalid_request", "versions")
    assert_bad(server, raw_frame({"op": "hello", "id": 9, "versions": 1}), 9,
               "invalid_request", "versions")
    assert_bad(server, raw_frame({"op": "hello", "id": 9, "versions": [True]}), 9,
               "invalid_request", "versions")


def test_hello_tolerates_odd_optional_fields(server: Connection) -> None:
    got = one(server.receive_data(raw_frame(
        {"op": "hello", "id": 1, "versions": [1, 2], "client": 5, "auth": 7})))
    assert got == Hello(1, (1, 2), "", None)


# ------------------------------------------------------------------------------- fatal errors


@pytest.mark.parametrize(
    "header",
    [b"\xc1", b"\x92\x01", b"\x81\xa2op", b"\x82\xa2id\x01\xa2id\x02\xff"],
    ids=["never-used", "truncated", "truncated-map", "trailing"],
)
def test_header_not_msgpack_is_fatal(header: bytes) -> None:
    for role in (SERVER, CLIENT):
        assert "not valid msgpack" in fatal(Connection(role), raw_frame(header))


def test_header_with_non_str_keys_is_fatal() -> None:
    assert "msgpack" in fatal(Connection(SERVER), raw_frame(msgpack.packb({1: 2})))


@pytest.mark.parametrize("header", [[1, 2], "ping", 5, None, b"bytes"])
def test_header_not_a_map_is_fatal(header: Any) -> None:
    data = raw_frame(msgpack.packb(header, use_bin_type=True))
    for role in (SERVER, CLIENT):
        assert "not a msgpack map" in fatal(Connection(role), data)


@pytest.mark.parametrize("rid", [None, "1", 1.0, True, -1, [1]],
                         ids=["missing", "str", "float", "bool", "negative", "list"])
def test_request_without_an_integer_id_is_fatal(rid: Any) -> None:
    header: dict[str, Any] = {"op": "ping"}
    if rid is not None:
        header["id"] = rid
    assert "'id'" in fatal(Connection(SERVER), raw_frame(header))


def test_unknown_op_without_an_id_is_fatal() -> None:
    assert "'id'" in fatal(Connection(SERVER), raw_frame({"op": "frobnicate"}))


def test_bad_magic_is_fatal() -> None:
    assert "magic" in fatal(Connection(SERVER), b"GET / HTTP/1.1\r\n\r\n")


def test_messages_before_a_violation_in_the_same_chunk_still_parse() -> None:
    client, server = Connection(CLIENT), Connection(SERVER)
    data = wire(client.send(Ping(1))) + wire(client.send(ListBins(2))) + b"garbage" * 3
    try:
        out = server.receive_data(data)
    except ProtocolError:
        pytest.fail("the two complete requests before the garbage were lost")
    assert out[:2] == [Ping(1), ListBins(2)]
    assert len(out) == 3 and type(out[2]).__name__ == "ProtocolViolation"


# ------------------------------------------------------------------------------- oversized frames

SMALL = Limits(max_frame_bytes=4096, max_header_bytes=1024)


def test_oversized_frame_is_a_bad_request_and_the_next_frame_parses() -> None:
    client, server = Connection(CLIENT), Connection(SERVER, SMALL)
    big = wire(client.send(Put(11, "big", item_of(torch.zeros(10_000, dtype=torch.uint8)))))
    assert len(big) > SMALL.max_frame_bytes
    bad = one(server.receive_data(big))
    assert isinstance(bad, BadRequest)
    assert (bad.id, bad.code) == (11, "limit_exceeded")
    assert "max_frame_bytes=4096" in bad.message
    assert one(c2s(client, server, Ping(12))) == Ping(12)
    put = one(c2s(client, server, Put(13, "small", item_of(torch.ones(10)))))
    assert type(put) is Put and same_value(codec.decode(put.item.value), torch.ones(10))


def test_oversized_frame_then_another_in_the_same_chunk() -> None:
    client, server = Connection(CLIENT), Connection(SERVER, SMALL)
    data = (wire(client.send(Append(1, "big", item_of(torch.zeros(5000)))))
            + wire(client.send(ListBins(2))))
    out = server.receive_data(data)
    assert [type(m) for m in out] == [BadRequest, ListBins]
    assert out[0].id == 1 and out[0].code == "limit_exceeded"
    # and byte by byte
    out = []
    for i in range(len(data)):
        out.extend(server.receive_data(data[i : i + 1]))
    assert [type(m) for m in out] == [BadRequest, ListBins]


def test_oversized_frame_is_fatal_on_the_client_side() -> None:
    server, client = Connection(SERVER), Connection(CLIENT, SMALL)
    client.send(Get(1, "b"))
    data = wire(server.send(Fetched(1, "value", (item_of(torch.zeros(5000)),), 1, 0)))
    assert "max_frame_bytes" in fatal(client, data)


def test_oversized_header_is_fatal() -> None:
    client, server = Connection(CLIENT), Connection(SERVER, SMALL)
    data = wire(client.send(Put(1, "b", item_of(b"x" * 2000))))  # bytes live in the header
    assert "max_header_bytes" in fatal(server, data)


def test_set_limits_applies_to_the_decoder() -> None:
    client, server = Connection(CLIENT), Connection(SERVER)
    server.set_limits(SMALL)
    bad = one(c2s(client, server, Put(1, "b", item_of(torch.zeros(5000)))))
    assert isinstance(bad, BadRequest) and bad.code == "limit_exceeded"


# ------------------------------------------------------------------------------- encoded buffers


def test_buffers_are_not_copied_on_send() -> None:
    t = torch.arange(1000, dtype=torch.int64)
    chunks = Connection(CLIENT).send(Put(1, "b", item_of(t)))
    views = [c for c in chunks if isinstance(c, memoryview)]
    assert any(len(v) == t.numel() * 8 for v in views)


def test_buffer_dataclass_is_accepted_for_bytes() -> None:
    client, server = Connection(CLIENT), Connection(SERVER)
    tree = msgpack.packb(msgpack.ExtType(codec.EXT_TENSOR, msgpack.packb(["int16", [2], 0])))
    item = Item(Encoded(tree, (Buffer(b"\x01\x00\x02\x00"),)))
    got = one(c2s(client, server, Put(1, "b", item)))
    assert same_value(codec.decode(got.item.value), torch.tensor([1, 2], dtype=torch.int16))


# ------------------------------------------------------------------------------- layering

LAYERING_PROBE = textwrap.dedent(
    """
    import sys
    before = set(sys.modules)
    import tensorshare.protocol
    added = sorted(set(sys.modules) - before)
    print(repr((sorted(before), added)))
    """
)
FORBIDDEN = ("twisted", "socket", "threading", "torch")


def _probe(*flags: str, env: dict[str, str] | None = None) -> tuple[set[str], set[str]]:
    out = subprocess.run([sys.executable, *flags, "-c", LAYERING_PROBE], capture_output=True,
                         text=True, timeout=60, env=env, check=True).stdout
    before, added = eval(out)  # noqa: S307 - our own repr of two lists of str
    return set(before), set(added)


def _top(names: set[str]) -> set[str]:
    return {n.split(".")[0] for n in names}


def test_import_protocol_pulls_in_no_io_layer() -> None:
    """A fresh interpreter: importing tensorshare.protocol adds none of the I/O modules.

    In this environment ``site`` (a .pth file) already imports ``threading`` before any
    user code, so a plain interpreter can only show that the import does not *add* it; the
    next test checks ``threading`` in an interpreter started without ``site``.
    """
    before, added = _probe()
    assert not _top(added) & set(FORBIDDEN), sorted(added)
    assert not _top(before) & {"twisted", "socket", "torch"}, "startup already imported these"


def test_import_protocol_does_not_import_threading_without_site() -> None:
    import msgpack as mp

    repo = os.path.dirname(os.path.dirname(os.path.abspath(codec.__file__)))
    deps = os.path.dirname(os.path.dirname(os.path.abspath(mp.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, deps]))
    before, added = _probe("-S", env=env)
    assert "threading" not in before  # so the check below means something
    assert not _top(added) & set(FORBIDDEN), sorted(added)
