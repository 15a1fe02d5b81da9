"""Unit tests for tensorshare.protocol: the op table and the two sans-I/O sides, no sockets.

A ``ClientConnection`` and a ``ServerWire`` (the server's ``ServerConnection`` driven as the
server drives it: ``frames`` then ``parse``, replies through ``encode_reply``; see
tests/rawwire.py) talk to each other by handing the joined chunks of one side's ``send()`` to
the other side's ``receive_data()``; the client side learns
the op of each reply's request from ``op_of`` (here a ``WireClient`` keeps that table).
Malformed requests are built by hand (``encode_frame`` of a hand-packed msgpack header) to
reach every check of the server-side parser.
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

from tensorshare.errors import LimitExceeded
from tensorshare.wire import codec
from tensorshare.wire.codec import Buffer, Encoded
from tensorshare.wire.frames import DIRECT_READ_MIN, BytesLike, encode_frame
from tensorshare.wire.messages import (
    Acked,
    Append,
    Auth,
    Bye,
    Cancel,
    Challenge,
    Changed,
    Configure,
    Configured,
    Delete,
    Deleted,
    ErrorReply,
    Fetch,
    Fetched,
    FetchSpec,
    Hello,
    HelloReply,
    Item,
    Limits,
    ListBins,
    Listen,
    Listening,
    Listing,
    Ping,
    Put,
    Reload,
    Stats,
    StatsReply,
    Stored,
    Unlisten,
)
from tensorshare.wire.protocol import (
    ACK_FIELDS,
    MAX_OPEN_ACKS,
    OPS,
    OVERFLOW_POLICIES,
    PRE_HELLO_MAX_BYTES,
    REPLY_HEADERS,
    SESSION_ID_BYTES,
    AckInfo,
    BadRequest,
    ClientConnection,
    NameTooLong,
    Orphan,
    ProtocolViolation,
    check_bin_name,
    encode_message,
    op_name,
)
from tests.rawwire import Get, Peek, ServerWire, WireClient

#: The ops of value and list bins (the other kinds' are tested in their own wire tests).
CORE_OPS = {name: op for name, op in OPS.items()  # (the messages module, and its records)
            if op.request.__module__ in (Put.__module__, Hello.__module__)}

# ------------------------------------------------------------------------------- helpers

SESSION = bytes(range(SESSION_ID_BYTES))


def wire(chunks: Sequence[BytesLike]) -> bytes:
    return b"".join(chunks)


def greeted(limits: Limits | None = None) -> ServerWire:
    """A server side past the handshake: its full limits apply."""
    conn = ServerWire(limits)
    conn.handshake_done()
    return conn


def c2s(client: WireClient, server: ServerWire, msg: Any,
        ack: AckInfo | None = None) -> list[Any]:
    """Send ``msg`` from the client side and return what the server side parses."""
    return server.receive_data(client.frame(msg, ack))


def s2c(server: ServerWire, client: WireClient, msg: Any) -> list[Any]:
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


def assert_usable(server: ServerWire, rid: int = 99) -> None:
    """The server side still parses the next frame on the same connection."""
    assert server.receive_data(raw_frame({"op": "ping", "id": rid})) == [Ping(rid)]


def assert_bad(server: ServerWire, data: bytes, rid: int, code: str,
               match: str) -> BadRequest:
    bad = one(server.receive_data(data))
    assert isinstance(bad, BadRequest), bad
    assert bad.id == rid
    assert bad.code == code, bad
    assert match in bad.message, bad.message
    assert_usable(server)
    return bad


def fatal(conn: ServerWire | ClientConnection, data: bytes) -> str:
    """The connection-fatal error ``data`` causes, as a message (never an exception)."""
    if isinstance(conn, ClientConnection):
        out: list[Any] = conn.receive_data(data, lambda rid: None)
    else:
        out = conn.receive_data(data)
    assert out, "no error for a broken wire format"
    last = out[-1]
    assert type(last) is ProtocolViolation, out
    return last.message


def both_sides() -> list[ServerWire | ClientConnection]:
    return [greeted(), ClientConnection()]


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
def pair() -> tuple[WireClient, ServerWire]:
    return WireClient(), greeted()


# ------------------------------------------------------------------------------- the op table


def test_op_table_rows_are_consistent() -> None:
    for name, op in OPS.items():
        assert op.name == name
        assert op.fields[:2] == ("op", "id"), name
        assert len(set(op.fields)) == len(op.fields), name
        assert not set(op.fields) & set(ACK_FIELDS), name
    assert ACK_FIELDS == ("ack", "open")


def test_remembered_ops_are_exactly_the_ones_that_change_something() -> None:
    """Exactly-once replay (docs/PROTOCOL.md §9.4) depends on this column."""

    core = {name for name, op in OPS.items()
            if op.mutating and not name.startswith(("stream_", "service_", "replay_"))}
    assert core == {"put", "append", "get", "delete", "configure"}
    # A call is answered once across reconnects; a take and a reply are not remembered (a
    # batch whose host is gone goes back to the queue; a resent reply finds it answered).
    services = {name for name, op in OPS.items() if op.mutating and name.startswith("service_")}
    assert services == {"service_call"}
    streams = {name for name, op in OPS.items() if op.mutating and name.startswith("stream_")}
    # A stream's leave is not remembered: leaving twice is leaving once.
    assert streams == {"stream_open", "stream_append", "stream_end", "stream_join",
                       "stream_read"}
    # Inserting, sampling (it counts draws and moves the random state) and updating are
    # remembered; opening twice checks, and asking changes nothing.
    replay = {name for name, op in OPS.items() if op.mutating and name.startswith("replay_")}
    assert replay == {"replay_insert", "replay_sample", "replay_update"}


def test_op_name_of_every_request_class() -> None:
    assert op_name(Get(1, "b")) == "get"
    assert op_name(Peek(1, "b")) == "peek"
    for name, op in CORE_OPS.items():
        if op.request is not Fetch:
            assert OPS[op_name(SAMPLE_REQUESTS[name])] is op


def test_constants() -> None:
    assert (SESSION_ID_BYTES, MAX_OPEN_ACKS, PRE_HELLO_MAX_BYTES) == (16, 64, 65536)
    assert OVERFLOW_POLICIES == ("reject", "drop_oldest", "block")


@pytest.mark.parametrize("name", ["x", "with space", "a|b", "a/b/c", "ünï©ødé ✓", "名前"])
def test_check_bin_name_accepts_any_characters(name: str) -> None:
    assert check_bin_name(name, 1024) == name


def test_check_bin_name_counts_utf8_bytes() -> None:
    assert check_bin_name("é" * 4, 8) == "é" * 4  # 8 bytes, 4 characters
    with pytest.raises(NameTooLong, match="max_name_bytes=8"):
        check_bin_name("é" * 4 + "x", 8)
    assert issubclass(NameTooLong, ValueError)
    with pytest.raises(ValueError) as info:
        check_bin_name("", 8)
    assert type(info.value) is ValueError  # empty is malformed, not a limit
    with pytest.raises(TypeError):
        check_bin_name(b"bytes", 8)


# ------------------------------------------------------------------------------- requests

ITEM = Item(codec.encode([1, "a", b"b"]), tag=5)
NONCE = bytes(range(32))
# One request per op, with every optional field set where the op has any.
SAMPLE_REQUESTS: dict[str, Any] = {
    "hello": Hello(1, (1, 2), "me", NONCE, SESSION, True, False, "alice"),
    "put": Put(2, "w", ITEM, 7, 2.5),
    "append": Append(3, "w", ITEM, 2.5, (), 7, True),
    "get": Get(4, "w", 2, True, 1.5, 1, 4, 2),
    "peek": Peek(5, "w", 2, True, 1.5, 1, 4, 2),
    "list": ListBins(6),
    "delete": Delete(7, "w"),
    "listen": Listen(8, "w"),
    "unlisten": Unlisten(9, "w"),
    "ping": Ping(10),
    "cancel": Cancel(11, 4),
    "stats": Stats(12, "w*"),
    "configure": Configure(13, "w", 5, 1 << 20, "drop_oldest"),
    "bye": Bye(14),
    "auth": Auth(15, b"p" * 32),
    "reload": Reload(16),
}

REQUESTS: list[Any] = [
    Hello(1, (1,)),
    Hello(1, (1, 2, 7), "my-client", NONCE),
    Hello(1, (1,), "c", None, SESSION),
    Hello(1, (1,), "c", None, SESSION, True),
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
    Stats(1),
    Stats(1, "rollouts/*"),
    Configure(1, "bin"),
    Configure(1, "bin", 5, 1024, "drop_oldest"),
    Configure(1, "bin", None, 7, "block"),
    *[m for m in SAMPLE_REQUESTS.values() if type(m) not in (Put, Append)],
]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: op_name(m))
def test_request_round_trips_into_the_same_dataclass(pair: tuple[WireClient, ServerWire],
                                                     msg: Any) -> None:
    client, server = pair
    got = one(c2s(client, server, msg))
    assert type(got) is type(msg)
    assert got == msg


def test_every_op_has_a_round_trip_case() -> None:
    assert set(SAMPLE_REQUESTS) == set(CORE_OPS)
    assert {op_name(m) for m in REQUESTS} | {"put", "append"} == set(CORE_OPS)


def test_timeouts_travel_as_floats(pair: tuple[WireClient, ServerWire]) -> None:
    client, server = pair
    got = one(c2s(client, server, Get(1, "b", wait=True, timeout=3)))
    assert got.spec.timeout == 3.0 and type(got.spec.timeout) is float
    got = one(c2s(client, server, Append(2, "b", item_of(1), 4)))
    assert got.timeout == 4.0 and type(got.timeout) is float


@pytest.mark.parametrize("timeout", [None, 0.0, 0.25, 30.0])
def test_append_timeout_round_trips(pair: tuple[WireClient, ServerWire],
                                    timeout: float | None) -> None:
    client, server = pair
    got = one(c2s(client, server, Append(3, "b", item_of([1, 2]), timeout)))
    assert type(got) is Append and got.timeout == timeout
    assert codec.decode(got.item.value) == [1, 2]


def test_append_without_timeout_writes_no_timeout_key() -> None:
    header = msgpack.unpackb(wire(encode_message(Append(1, "b", item_of(1)))[0])[16:],
                             raw=False)
    assert "timeout" not in header


def test_hello_resume_needs_a_session(pair: tuple[WireClient, ServerWire]) -> None:
    client, server = pair
    # The client side drops it: no session, nothing to resume.
    got = one(c2s(client, server, Hello(1, (1,), "c", None, None, True)))
    assert got == Hello(1, (1,), "c") and got.resume is False
    # And the server ignores one sent anyway.
    got = one(server.receive_data(raw_frame({"op": "hello", "id": 2, "versions": [1],
                                             "resume": True})))
    assert got.session is None and got.resume is False


def test_hello_session_travels_as_msgpack_bin() -> None:
    data = WireClient().frame(Hello(1, (1,), "c", None, SESSION))
    assert b"\xa7session\xc4\x10" + SESSION in data


@pytest.mark.parametrize("cls", [Put, Append])
def test_store_request_with_tensors_round_trips(pair: tuple[WireClient, ServerWire],
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


def test_store_request_with_lz4_buffers_round_trips(
        pair: tuple[WireClient, ServerWire]) -> None:
    client, server = pair
    value = torch.zeros(100_000, dtype=torch.float32)
    item = item_of(value, compress="lz4", compress_min_bytes=0)
    assert item.value.buffers[0].codec == "lz4"
    got = one(c2s(client, server, Put(1, "z", item)))
    buf = got.item.value.buffers[0]
    assert (buf.codec, buf.raw_nbytes) == ("lz4", 400_000)
    assert same_value(codec.decode(got.item.value), value)


def test_item_without_buffers_and_empty_buffers(
        pair: tuple[WireClient, ServerWire]) -> None:
    client, server = pair
    for value in (None, "text", [1, 2.5, True], torch.empty(0, 3),
                  [torch.empty(0), torch.ones(1)]):
        got = one(c2s(client, server, Put(1, "b", item_of(value))))
        assert same_value(codec.decode(got.item.value), value)


def test_requests_split_across_chunks_and_batched(
        pair: tuple[WireClient, ServerWire]) -> None:
    client, server = pair
    msgs = [Put(1, "a", item_of(torch.arange(50))), Ping(2), Get(3, "a", max_items=2)]
    data = b"".join(client.frame(m) for m in msgs)
    out: list[Any] = []
    for i in range(len(data)):  # one byte at a time
        out.extend(server.receive_data(data[i : i + 1]))
    assert [type(m) for m in out] == [Put, Ping, Fetch]
    assert out[1:] == msgs[1:]
    assert [type(m) for m in server.receive_data(data)] == [Put, Ping, Fetch]  # all at once


def test_large_frame_through_the_zero_copy_path() -> None:
    """``get_buffer``/``buffer_updated``: the I/O layer reads a large payload in place."""
    server = greeted()
    value = torch.arange(100_000, dtype=torch.int32)
    data = WireClient().frame(Put(1, "big", item_of(value)))
    assert server.receive_data(data[:200]) == []
    assert server.receiving
    view = server.get_buffer()
    assert view is not None and len(view) >= DIRECT_READ_MIN
    rest = data[200:]
    view[: len(view)] = rest[: len(view)]
    out = server.buffer_updated(len(view))
    if len(view) < len(rest):
        out += server.receive_data(rest[len(view):])
    got = one(out)
    assert type(got) is Put and same_value(codec.decode(got.item.value), value)
    assert not server.receiving


# ------------------------------------------------------------------------------- acknowledgements


def ack_frame(ack: Any, open_ids: Any = None, *, rid: int = 7, op: str = "ping") -> bytes:
    header: dict[str, Any] = {"op": op, "id": rid, "ack": ack}
    if open_ids is not None:
        header["open"] = open_ids
    return raw_frame(header)


def test_ack_is_reported_before_the_request_that_carries_it(
        pair: tuple[WireClient, ServerWire]) -> None:
    client, server = pair
    assert c2s(client, server, Ping(5), AckInfo(4)) == [AckInfo(4), Ping(5)]
    assert c2s(client, server, Ping(9), AckInfo(8, (2, 6))) == [AckInfo(8, (2, 6)), Ping(9)]
    assert c2s(client, server, Ping(10), AckInfo(0)) == [AckInfo(0), Ping(10)]
    assert c2s(client, server, Ping(11)) == [Ping(11)]  # no ack: no AckInfo


def test_client_writes_open_only_when_there_are_open_ids() -> None:
    def header(ack: AckInfo | None) -> dict[str, Any]:
        return msgpack.unpackb(WireClient().frame(Ping(3), ack)[16:], raw=False)

    assert header(None) == {"op": "ping", "id": 3}
    assert header(AckInfo(2)) == {"op": "ping", "id": 3, "ack": 2}
    assert header(AckInfo(2, (1,))) == {"op": "ping", "id": 3, "ack": 2, "open": [1]}


def test_ack_rides_on_any_request(pair: tuple[WireClient, ServerWire]) -> None:
    client, server = pair
    for msg in SAMPLE_REQUESTS.values():
        out = c2s(client, server, msg, AckInfo(3, (1,)))
        assert out[0] == AckInfo(3, (1,)) and len(out) == 2, out


def test_ack_on_an_unknown_op_still_counts() -> None:
    server = greeted()
    out = server.receive_data(ack_frame(5, op="frobnicate"))
    assert out[0] == AckInfo(5)
    assert isinstance(out[1], BadRequest) and out[1].code == "invalid_request"


def test_at_most_max_open_acks_open_ids() -> None:
    server = greeted()
    ids = list(range(1, MAX_OPEN_ACKS + 1))
    assert server.receive_data(ack_frame(100, ids)) == [AckInfo(100, tuple(ids)), Ping(7)]
    # One more and the whole acknowledgement is ignored; the request is still served.
    assert server.receive_data(ack_frame(100, [*ids, 65])) == [Ping(7)]


@pytest.mark.parametrize(
    ("ack", "open_ids"),
    [(-1, None), (True, None), (1.0, None), ("3", None), (None, None), ([3], None),
     (5, "1,2"), (5, [1, "2"]), (5, [1, True]), (5, {"1": 1})],
    ids=["negative", "bool", "float", "str", "nil", "list", "open-str", "open-str-id",
         "open-bool-id", "open-map"],
)
def test_malformed_ack_is_ignored(ack: Any, open_ids: Any) -> None:
    server = greeted()
    assert server.receive_data(ack_frame(ack, open_ids)) == [Ping(7)]
    assert_usable(server)


def test_empty_open_is_the_same_as_none() -> None:
    assert greeted().receive_data(ack_frame(5, [])) == [AckInfo(5), Ping(7)]


def test_ack_before_the_handshake_is_reported() -> None:
    """The server applies an ack that rides on the hello once the session is attached."""
    conn = ServerWire()
    out = conn.receive_data(WireClient().frame(Hello(9, (1,), "c", None, SESSION, True),
                                               AckInfo(8, (3,))))
    assert out == [AckInfo(8, (3,)), Hello(9, (1,), "c", None, SESSION, True)]


# ------------------------------------------------------------------------------- replies


def reply_round_trip(request: Any, reply: Any) -> Any:
    client, server = WireClient(), greeted()
    assert one(c2s(client, server, request)) is not None
    return one(s2c(server, client, reply))


LIMITS = Limits(max_frame_bytes=1 << 20, max_header_bytes=1 << 16, max_depth=9,
                max_name_bytes=77)
STATS_SERVER = {"server": "tensorshare/9.9", "server_id": "00ff", "uptime": 1.5,
                "connections": 2, "memory": {"stored": 10, "max_memory": None},
                "counters": {"requests": 3}, "errors": {}}
STATS_BINS = {"b": {"kind": "list", "n_items": 2, "changed_at": 17.25,
                    "limits": {"max_items": 2, "max_bytes": None, "overflow": "block"},
                    "first": "int", "last": None}}
REPLIES: list[tuple[Any, Any]] = [
    (Hello(1, (1,)), HelloReply(1, 1, "tensorshare/9.9", LIMITS)),
    (Hello(1, (1,), "c", None, SESSION, True),
     HelloReply(1, 1, "tensorshare/9.9", LIMITS, True, "0123456789abcdef")),
    (Hello(1, (1,), "c", NONCE), Challenge(1, b"n" * 32)),
    (Auth(2, b"p" * 32), HelloReply(2, 1, "t/1", LIMITS, False, "ab", False, b"q" * 32, "read")),
    (Auth(2, b"p" * 32), HelloReply(2, 1, "t/1", LIMITS, False, "ab", False, b"q" * 32, "write",
                                    "alice")),
    (Reload(3), Acked(3, True)),
    (Put(2, "b", item_of(1)), Stored(2, 5, 1)),
    (Append(3, "b", item_of(1)), Stored(3, 6, 2)),
    (Append(3, "b", item_of(1), 1.0), Stored(3, 9, 4, dropped=3)),
    (ListBins(4), Listing(4, {"a": 1, "b b|/ü": 3})),
    (ListBins(4), Listing(4, {})),
    (Delete(5, "b"), Deleted(5, True, 8)),
    (Delete(5, "b"), Deleted(5, False, 0)),
    (Listen(6, "b"), Listening(6, 3, 2)),
    (Unlisten(7, "b"), Acked(7, True)),
    (Unlisten(7, "b"), Acked(7, False)),
    (Cancel(8, 3), Acked(8, False)),
    (Cancel(8, 3), Acked(8, True)),
    (Ping(9), Acked(9, True)),
    (Get(10, "b", newer_than=4), Fetched(10, "value", (), 4, 1, 0, True)),
    (Peek(11, "b"), ErrorReply(11, "bin_not_found", "bin 'b' does not exist or is empty")),
    (Get(12, "b", wait=True, timeout=1), ErrorReply(12, "timeout", "no data")),
    (Append(13, "b", item_of(1)), ErrorReply(13, "bin_full", "bin 'b' is full")),
    (Stats(14), StatsReply(14, STATS_SERVER, STATS_BINS)),
    (Stats(14, "zz*"), StatsReply(14, STATS_SERVER, {})),
    (Configure(15, "b", 2, None, "block"), Configured(15, 2, None, "block")),
    (Configure(15, "b"), Configured(15, None, None, "reject")),
    (Configure(15, "b", 3, 99, "drop_oldest"), Configured(15, 3, 99, "drop_oldest")),
]


@pytest.mark.parametrize(("request_", "reply"), REPLIES, ids=lambda m: type(m).__name__)
def test_reply_round_trips_into_the_same_dataclass(request_: Any, reply: Any) -> None:
    got = reply_round_trip(request_, reply)
    assert type(got) is type(reply)
    assert got == reply


def test_every_reply_class_has_a_round_trip_case() -> None:
    core = {cls for cls in REPLY_HEADERS if cls.__module__ in (Put.__module__, Hello.__module__)}
    assert {type(reply) for _, reply in REPLIES} >= core - {Fetched}


def test_hello_reply_without_the_session_fields_is_accepted() -> None:
    """An older server sends neither ``resumed`` nor ``server_id``: new session, no id."""
    client = WireClient()
    client.send(Hello(1, (1,)))
    header = {"op": "reply", "id": 1, "ok": True, "version": 1, "server": "old",
              "limits": {"max_frame_bytes": 4096, "max_header_bytes": 1024, "max_depth": 8,
                         "max_name_bytes": 16}}
    got = one(client.receive_data(raw_frame(header)))
    assert got == HelloReply(1, 1, "old", Limits(4096, 1024, 8, 16), False, "")


def test_stored_writes_dropped_only_when_non_zero() -> None:
    def keys(msg: Any) -> set[str]:
        return set(msgpack.unpackb(wire(encode_message(msg)[0])[16:], raw=False))

    assert "dropped" not in keys(Stored(1, 2, 3))
    assert "dropped" in keys(Stored(1, 2, 3, 1))
    assert not {"skipped", "dropped"} & keys(Changed("b", "put", 1, 1))
    assert {"skipped", "dropped"} <= keys(Changed("b", "append", 1, 1, 2, 3))


@pytest.mark.parametrize("op", [Get, Peek])
def test_fetched_reply_with_tensors_round_trips(op: Any) -> None:
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


@pytest.mark.parametrize(
    "msg",
    [Changed("b|x", "append", 3, 17), Changed("b", "restore", 2, 9),
     Changed("b", "append", 5, 30, 0, 2), Changed("b", "put", 1, 31, 4, 0),
     Changed("b", "delete", 0, 32)],
    ids=["append", "restore", "dropped", "skipped", "delete"],
)
def test_notifications_need_no_request(msg: Changed) -> None:
    assert one(s2c(ServerWire(), WireClient(), msg)) == msg


def test_connection_error_needs_no_request() -> None:
    for code in ("protocol_error", "limit_exceeded"):
        msg = ErrorReply(0, code, "bye")
        assert one(s2c(ServerWire(), WireClient(), msg)) == msg


def test_replies_out_of_order_are_matched_by_id() -> None:
    client, server = WireClient(), greeted()
    for msg in (ListBins(1), Ping(2), Delete(3, "d"), Configure(4, "c")):
        c2s(client, server, msg)
    replies = [Configured(4, None, None, "reject"), Deleted(3, True, 2), Acked(2), Listing(1)]
    data = b"".join(wire(server.send(m)) for m in replies)
    assert client.receive_data(data) == replies


def test_reply_to_a_request_nobody_waits_for_is_an_orphan() -> None:
    client, server = WireClient(), greeted()
    c2s(client, server, Get(1, "b", wait=True, timeout=None))
    client.forget(1)
    items = (item_of(torch.ones(2)), item_of("x"))
    assert one(s2c(server, client, Fetched(1, "list", items, 3, 0))) == Orphan(1, 2)
    assert one(s2c(server, client, Stored(7, 1, 1))) == Orphan(7, 0)  # never sent at all
    # An error reply needs no parsing by op: it is reported as such, whoever waits.
    assert one(s2c(server, client, ErrorReply(8, "timeout", "x"))) == ErrorReply(
        8, "timeout", "x")


def test_orphan_items_are_not_parsed() -> None:
    """A reply to an abandoned request is skipped, even one whose items the client could not
    parse: it is none of its business any more."""
    header = {"op": "reply", "id": 4, "ok": True, "kind": "list", "version": 1, "n_items": 0,
              "dropped": 0, "items": [["not", "an", "item"]]}
    assert ClientConnection().receive_data(raw_frame(header), lambda rid: None) == [
        Orphan(4, 1)]
    out = ClientConnection().receive_data(raw_frame(header), lambda rid: "get")
    assert [type(m) for m in out] == [ProtocolViolation] and "item" in out[0].message


def test_client_refuses_an_unexpected_server_op() -> None:
    assert "unexpected message op 'put'" in fatal(ClientConnection(),
                                                  raw_frame({"op": "put", "id": 1}))


@pytest.mark.parametrize(
    ("op", "header"),
    [
        ("hello", {"version": 1, "server": "evil",
                   "limits": {"max_frame_bytes": 0, "max_header_bytes": 0, "max_depth": 0,
                              "max_name_bytes": 0}}),
        ("hello", {"version": 1, "server": "evil", "limits": [1, 2, 3, 4]}),
        ("hello", {"version": 1, "server": "x", "limits": {"max_frame_bytes": 1 << 20,
                   "max_header_bytes": 1024, "max_depth": 4, "max_name_bytes": 9},
                   "resumed": "yes"}),
        ("put", {"version": "1", "n_items": 1}),
        ("list", {"bins": {"a": "1"}}),
        ("stats", {"stats": {}, "bins": []}),
        ("configure", {"max_items": None, "max_bytes": None}),
        ("cancel", {"flag": 1}),
    ],
    ids=["impossible-limits", "limits-not-a-map", "resumed-not-bool", "version-str",
         "bins-values", "stats-bins-list", "configure-no-overflow", "flag-int"],
)
def test_malformed_reply_is_a_protocol_violation(op: str, header: dict[str, Any]) -> None:
    """A malformed reply from the server must be a ProtocolViolation, never an exception.

    The client's reader only handles ProtocolViolation (and socket errors); anything else
    would kill it without failing the pending calls.
    """
    data = raw_frame({"op": "reply", "id": 1, "ok": True, **header})
    out = ClientConnection().receive_data(data, lambda rid: op)
    assert [type(m) for m in out] == [ProtocolViolation], out


# ------------------------------------------------------------------------------- bad requests


@pytest.fixture
def sconn() -> ServerWire:
    return greeted(Limits(max_name_bytes=8, max_depth=4))


def test_unknown_op_keeps_the_id(sconn: ServerWire) -> None:
    assert_bad(sconn, raw_frame({"op": "frobnicate", "id": 31}), 31, "invalid_request",
               "unknown op 'frobnicate'")
    assert_bad(sconn, raw_frame({"id": 32}), 32, "invalid_request", "unknown op")
    assert_bad(sconn, raw_frame({"op": 5, "id": 33}), 33, "invalid_request", "unknown op")


BIN_OPS = sorted(name for name, op in CORE_OPS.items() if "bin" in op.fields)


def test_bin_ops() -> None:
    assert BIN_OPS == ["append", "configure", "delete", "get", "listen", "peek", "put",
                       "unlisten"]


@pytest.mark.parametrize("op", BIN_OPS)
@pytest.mark.parametrize(
    ("name", "code", "match"),
    [
        ("", "invalid_request", "empty"),
        (None, "invalid_request", "must be a str"),
        (7, "invalid_request", "must be a str"),
        (b"bytes", "invalid_request", "must be a str"),
        ("123456789", "limit_exceeded", "max_name_bytes=8"),  # NameTooLong
        ("éééé!", "limit_exceeded", "max_name_bytes=8"),  # 5 characters, 9 bytes
    ],
)
def test_bad_bin_name(sconn: ServerWire, op: str, name: Any, code: str,
                      match: str) -> None:
    if op in ("put", "append"):
        data = raw_put([], b"", op=op, bin=name, rid=4)
    else:
        data = raw_frame({"op": op, "id": 4, "bin": name})
    assert_bad(sconn, data, 4, code, match)


def test_missing_bin_name(sconn: ServerWire) -> None:
    assert_bad(sconn, raw_frame({"op": "get", "id": 4}), 4, "invalid_request", "must be a str")


def test_name_of_exactly_max_name_bytes_is_accepted(sconn: ServerWire) -> None:
    assert one(sconn.receive_data(raw_frame({"op": "delete", "id": 1, "bin": "éééé"}))) == (
        Delete(1, "éééé"))


def test_buffer_offset_not_a_multiple_of_64(sconn: ServerWire) -> None:
    assert_bad(sconn, raw_put([[1, 1]], b"\0\x07", value=tensor_value(1)), 5,
               "invalid_request", "not a multiple of 64")


def test_overlapping_buffers(sconn: ServerWire) -> None:
    payload = bytes(128)
    assert_bad(sconn, raw_put([[0, 100], [64, 1]], payload, value=tensor_value(2)), 5,
               "invalid_request", "overlaps")
    assert_bad(sconn, raw_put([[64, 1], [0, 1]], payload[:65], value=tensor_value(2)), 5,
               "invalid_request", "overlaps")
    assert_bad(sconn, raw_put([[0, 1], [0, 1]], payload[:1], value=tensor_value(2)), 5,
               "invalid_request", "overlaps")


def test_buffer_out_of_bounds(sconn: ServerWire) -> None:
    assert_bad(sconn, raw_put([[0, 200]], bytes(128), value=tensor_value(1)), 5,
               "invalid_request", "outside")
    assert_bad(sconn, raw_put([[128, 1]], bytes(128), value=tensor_value(1)), 5,
               "invalid_request", "outside")
    assert_bad(sconn, raw_put([[0, 1]], b"", value=tensor_value(1)), 5,
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
def test_malformed_buffer_descriptor(sconn: ServerWire, desc: Any, match: str) -> None:
    assert_bad(sconn, raw_put([desc], b"\1", value=tensor_value(1)), 5, "invalid_request", match)


def test_payload_beyond_the_last_buffer(sconn: ServerWire) -> None:
    assert_bad(sconn, raw_put([[0, 1]], bytes(2), value=tensor_value(1)), 5,
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
def test_malformed_value_is_invalid_request(sconn: ServerWire, value: bytes) -> None:
    with pytest.raises(ValueError):
        codec.validate(value, 1)
    assert_bad(sconn, raw_put([[0, 1]], b"\1", value=value), 5, "invalid_request",
               "malformed value")


def test_value_too_deep_in_tuples_is_limit_exceeded(sconn: ServerWire) -> None:
    deep = codec.encode(((((((1,),),),),),)).value  # 5 tuples, max_depth=4
    assert_bad(sconn, raw_put([], b"", value=deep), 5, "limit_exceeded", "depth")


def test_value_too_deep_in_lists_is_limit_exceeded(sconn: ServerWire) -> None:
    deep = msgpack.packb([[[[[1]]]]])  # 5 levels, max_depth=4
    assert_bad(sconn, raw_put([], b"", value=deep), 5, "limit_exceeded", "depth")


@pytest.mark.parametrize(
    ("items", "match"),
    [
        (None, "'items' must be a list"),
        ("x", "'items' must be a list"),
        ([], "at least one item"),
        ([[b"\xc0", []]], "[value, buffers, tag]"),
        ([["nil", [], None]], "[bin value, list of buffers, tag]"),
        ([[b"\xc0", None, None]], "[bin value, list of buffers, tag]"),
        ([[b"\xc0", [], "tag"]], "tag must be an integer"),
        ([[b"\xc0", [], True]], "tag must be an integer"),
        ([[b"\xc0", [], 1.5]], "tag must be an integer"),
    ],
)
def test_malformed_items(sconn: ServerWire, items: Any, match: str) -> None:
    header: dict[str, Any] = {"op": "append", "id": 6, "bin": "b"}
    if items is not None:
        header["items"] = items
    assert_bad(sconn, raw_frame(header), 6, "invalid_request", match)


def test_a_put_carries_exactly_one_item_an_append_one_or_more(sconn: ServerWire) -> None:
    two = [[b"\xc0", [], None], [b"\xc2", [], 7]]
    header: dict[str, Any] = {"op": "put", "id": 6, "bin": "b", "items": two}
    assert_bad(sconn, raw_frame(header), 6, "invalid_request", "exactly one item")
    (msg,) = sconn.receive_data(raw_frame({"op": "append", "id": 7, "bin": "b",
                                           "items": two}))
    assert type(msg) is Append and [it.tag for it in msg.items] == [None, 7]


def test_an_append_over_max_append_items_is_limit_exceeded(sconn: ServerWire) -> None:
    from tensorshare.wire.protocol import MAX_APPEND_ITEMS

    items = [[b"\xc0", [], None]] * (MAX_APPEND_ITEMS + 1)
    header: dict[str, Any] = {"op": "append", "id": 8, "bin": "b", "items": items}
    assert_bad(sconn, raw_frame(header), 8, "limit_exceeded", "MAX_APPEND_ITEMS")


def test_a_malformed_field_is_a_value_error_outside_a_connection() -> None:
    """What the data log reads back (its items, its remembered replies) is checked by the
    same rows; a malformed field is a ``ValueError`` (``InvalidField``) it reports as a
    corrupt record, with the code a connection would answer."""
    from tensorshare.wire.fields import InvalidField
    from tensorshare.wire.protocol import parse_items

    with pytest.raises(ValueError, match="'items' must be a list"):
        parse_items({"items": 3}, b"", 8)
    with pytest.raises(InvalidField, match="'version' must be an integer") as caught:
        OPS["put"].parse_reply(1, {"version": "1", "n_items": 1}, b"", Limits())
    assert isinstance(caught.value, ValueError) and caught.value.code == "invalid_request"
    deep = msgpack.packb([[[[1]]]])
    with pytest.raises(InvalidField, match="malformed value") as caught:
        parse_items({"items": [[deep, [], None]]}, b"", 2)
    assert caught.value.code == "limit_exceeded"


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
def test_wrong_field_types(sconn: ServerWire, op: str, field: str, value: Any,
                           match: str) -> None:
    header = {"op": op, "id": 8, "bin": "b", "wait": True, field: value}
    assert_bad(sconn, raw_frame(header), 8, "invalid_request", match)


@pytest.mark.parametrize("timeout", [math.nan, -math.inf, math.inf])
@pytest.mark.parametrize("op", ["get", "append"])
def test_timeout_that_is_not_a_finite_non_negative_number(sconn: ServerWire, op: str,
                                                          timeout: float) -> None:
    """NaN compares False with everything, so ``timeout < 0`` does not catch it.

    A NaN timeout would reach the server's ``reactor.callLater(nan)``, which raises after
    the waiter was registered in the store: the waiter would leak and later eat a put.
    """
    if op == "get":
        data = raw_frame({"op": "get", "id": 8, "bin": "b", "wait": True, "timeout": timeout})
    else:
        data = raw_frame({"op": "append", "id": 8, "bin": "b", "timeout": timeout,
                          "items": [[msgpack.packb(1), [], None]]})
    assert_bad(sconn, data, 8, "invalid_request", "'timeout'")


def test_nil_means_absent_for_optional_fields(sconn: ServerWire) -> None:
    got = one(sconn.receive_data(raw_frame(
        {"op": "get", "id": 3, "bin": "b", "wait": None, "timeout": None, "max_items": None,
         "min_items": None, "min_tag": None, "newer_than": None})))
    assert got == Get(3, "b")
    got = one(sconn.receive_data(raw_frame(
        {"op": "append", "id": 4, "bin": "b", "timeout": None,
         "items": [[msgpack.packb(1), [], None]]})))
    assert type(got) is Append and got.timeout is None
    got = one(sconn.receive_data(raw_frame({"op": "stats", "id": 5, "glob": None})))
    assert got == Stats(5, None)
    got = one(sconn.receive_data(raw_frame(
        {"op": "configure", "id": 6, "bin": "b", "max_items": None, "max_bytes": None})))
    assert got == Configure(6, "b", None, None, "reject")


@pytest.mark.parametrize(
    ("header", "match"),
    [
        ({"overflow": "evict"}, "'overflow' must be one of reject, drop_oldest, block"),
        ({"overflow": None}, "'overflow'"),
        ({"overflow": 1}, "'overflow'"),
        ({"max_items": 0}, "'max_items' must be at least 1"),
        ({"max_items": True}, "'max_items' must be an integer"),
        ({"max_bytes": 0}, "'max_bytes' must be at least 1"),
        ({"max_bytes": 1.5}, "'max_bytes' must be an integer"),
    ],
)
def test_malformed_configure(sconn: ServerWire, header: dict[str, Any],
                             match: str) -> None:
    assert_bad(sconn, raw_frame({"op": "configure", "id": 9, "bin": "b", **header}), 9,
               "invalid_request", match)


@pytest.mark.parametrize("glob", [1, b"w*", ["w*"], True])
def test_malformed_stats(sconn: ServerWire, glob: Any) -> None:
    assert_bad(sconn, raw_frame({"op": "stats", "id": 9, "glob": glob}), 9,
               "invalid_request", "'glob'")


def test_other_malformed_requests(sconn: ServerWire) -> None:
    assert_bad(sconn, raw_frame({"op": "cancel", "id": 9}), 9, "invalid_request", "target")
    assert_bad(sconn, raw_frame({"op": "cancel", "id": 9, "target": "1"}), 9,
               "invalid_request", "target")
    assert_bad(sconn, raw_frame({"op": "cancel", "id": 9, "target": True}), 9,
               "invalid_request", "target")
    assert_bad(sconn, raw_frame({"op": "hello", "id": 9}), 9, "invalid_request", "versions")
    assert_bad(sconn, raw_frame({"op": "hello", "id": 9, "versions": 1}), 9,
               "invalid_request", "versions")
    assert_bad(sconn, raw_frame({"op": "hello", "id": 9, "versions": [True]}), 9,
               "invalid_request", "versions")


@pytest.mark.parametrize(
    "session",
    [SESSION[:15], SESSION + b"!", b"", "0123456789abcdef", 16, [0] * 16],
    ids=["15-bytes", "17-bytes", "empty", "str", "int", "list"],
)
def test_hello_with_a_malformed_session(sconn: ServerWire, session: Any) -> None:
    assert_bad(sconn, raw_frame({"op": "hello", "id": 9, "versions": [1], "session": session}),
               9, "invalid_request", "'session' must be 16 bytes (msgpack bin)")


def test_hello_resume_must_be_a_bool(sconn: ServerWire) -> None:
    assert_bad(sconn, raw_frame({"op": "hello", "id": 9, "versions": [1], "session": SESSION,
                                 "resume": 1}), 9, "invalid_request", "'resume' must be a bool")


def test_hello_tolerates_odd_optional_fields(sconn: ServerWire) -> None:
    got = one(sconn.receive_data(raw_frame(
        {"op": "hello", "id": 1, "versions": [1, 2], "client": 5, "auth": None,
         "session": None, "resume": None})))
    assert got == Hello(1, (1, 2), "", None, None, False)


@pytest.mark.parametrize("auth", [7, "token", {"mech": "md5", "nonce": b"x" * 32},
                                  {"mech": "hmac-sha256", "nonce": b"short"}])
def test_hello_refuses_a_malformed_auth(sconn: ServerWire, auth: Any) -> None:
    got = one(sconn.receive_data(raw_frame({"op": "hello", "id": 1, "versions": [1],
                                            "auth": auth})))
    assert isinstance(got, BadRequest) and "auth" in got.message


# ------------------------------------------------------------------------------- fatal errors


@pytest.mark.parametrize(
    "header",
    [b"\xc1", b"\x92\x01", b"\x81\xa2op", b"\x82\xa2id\x01\xa2id\x02\xff"],
    ids=["never-used", "truncated", "truncated-map", "trailing"],
)
def test_header_not_msgpack_is_fatal(header: bytes) -> None:
    for conn in both_sides():
        assert "not valid msgpack" in fatal(conn, raw_frame(header))


def test_header_with_non_str_keys_is_fatal() -> None:
    for conn in both_sides():
        assert "msgpack" in fatal(conn, raw_frame(msgpack.packb({1: 2})))


@pytest.mark.parametrize("header", [[1, 2], "ping", 5, None, b"bytes"])
def test_header_not_a_map_is_fatal(header: Any) -> None:
    data = raw_frame(msgpack.packb(header, use_bin_type=True))
    for conn in both_sides():
        assert "not a msgpack map" in fatal(conn, data)


@pytest.mark.parametrize("rid", [None, "1", 1.0, True, -1, 0, [1]],
                         ids=["missing", "str", "float", "bool", "negative", "zero", "list"])
def test_request_without_a_valid_id_is_fatal(rid: Any) -> None:
    header: dict[str, Any] = {"op": "ping"}
    if rid is not None:
        header["id"] = rid
    assert "'id'" in fatal(greeted(), raw_frame(header))


def test_unknown_op_without_an_id_is_fatal() -> None:
    assert "'id'" in fatal(greeted(), raw_frame({"op": "frobnicate"}))


def test_bad_magic_is_fatal() -> None:
    assert "magic" in fatal(ServerWire(), b"GET / HTTP/1.1\r\n\r\n")
    assert "magic" in fatal(ClientConnection(), b"HTTP/1.1 200 OK\r\n\r\n")


def test_messages_before_a_violation_in_the_same_chunk_still_parse() -> None:
    client, server = WireClient(), greeted()
    data = client.frame(Ping(1)) + client.frame(ListBins(2)) + b"garbage" * 3
    out = server.receive_data(data)
    assert out[:2] == [Ping(1), ListBins(2)]
    assert len(out) == 3 and type(out[2]) is ProtocolViolation


def test_replies_before_a_violation_in_the_same_chunk_still_parse() -> None:
    client, server = WireClient(), greeted()
    client.send(Ping(1))
    data = wire(server.send(Acked(1))) + wire(server.send(Changed("b", "put", 1, 1))) + b"junk"
    out = client.receive_data(data + bytes(16))
    assert out[:2] == [Acked(1), Changed("b", "put", 1, 1)]
    assert len(out) == 3 and type(out[2]) is ProtocolViolation


# ------------------------------------------------------------------------------- the pre-hello cap

SMALL = Limits(max_frame_bytes=4096, max_header_bytes=1024)


def big_put(rid: int = 11, n: int = 100_000) -> bytes:
    return WireClient().frame(Put(rid, "big", item_of(torch.zeros(n, dtype=torch.uint8))))


def test_before_the_handshake_a_frame_over_64_kib_is_fatal() -> None:
    data = big_put()
    assert PRE_HELLO_MAX_BYTES < len(data) < Limits().max_frame_bytes
    message = fatal(ServerWire(), data)
    assert "before the handshake" in message and f"at most {PRE_HELLO_MAX_BYTES}" in message


def test_before_the_handshake_a_header_over_64_kib_is_fatal() -> None:
    data = WireClient().frame(Put(1, "b", item_of(b"x" * PRE_HELLO_MAX_BYTES)))
    assert "max_header_bytes=65536" in fatal(ServerWire(), data)


def test_before_the_handshake_a_frame_of_64_kib_is_fine() -> None:
    n = PRE_HELLO_MAX_BYTES - 256  # the header and padding take the rest
    data = big_put(n=n)
    assert len(data) <= PRE_HELLO_MAX_BYTES
    got = one(ServerWire().receive_data(data))
    assert type(got) is Put


def test_after_the_handshake_the_configured_limits_apply() -> None:
    conn = ServerWire()
    assert not conn.greeted
    conn.handshake_done()
    assert conn.greeted
    got = one(conn.receive_data(big_put()))
    assert type(got) is Put and got.item.value.buffers[0].nbytes == 100_000


def test_after_the_handshake_an_oversized_frame_is_a_bad_request() -> None:
    conn = greeted(SMALL)
    bad = one(conn.receive_data(big_put(11)))
    assert isinstance(bad, BadRequest)
    assert (bad.id, bad.code) == (11, "limit_exceeded")
    assert "max_frame_bytes=4096" in bad.message


def test_pre_hello_cap_is_never_above_the_frame_limit() -> None:
    conn = ServerWire(SMALL)
    assert "at most 4096 bytes" in fatal(conn, big_put(n=5000))
    conn = ServerWire(pre_hello_max_bytes=1000)
    assert "at most 1000 bytes" in fatal(conn, big_put(n=2000))


def test_large_frame_pipelined_right_behind_the_hello_is_fatal() -> None:
    """Frames that arrive with the hello are checked before the server handles the hello,
    so a client must wait for the hello reply before sending anything over 64 KiB
    (docs/PROTOCOL.md §2.3)."""
    client = WireClient()
    data = client.frame(Hello(1, (1,), "c")) + big_put(2)
    out = ServerWire().receive_data(data)
    assert out[0] == Hello(1, (1,), "c") and type(out[1]) is ProtocolViolation


# ------------------------------------------------------------------------------- oversized frames


def test_oversized_frame_is_a_bad_request_and_the_next_frame_parses() -> None:
    client, server = WireClient(), greeted(SMALL)
    big = client.frame(Put(11, "big", item_of(torch.zeros(10_000, dtype=torch.uint8))))
    assert len(big) > SMALL.max_frame_bytes
    bad = one(server.receive_data(big))
    assert isinstance(bad, BadRequest)
    assert (bad.id, bad.code) == (11, "limit_exceeded")
    assert "max_frame_bytes=4096" in bad.message
    assert one(c2s(client, server, Ping(12))) == Ping(12)
    put = one(c2s(client, server, Put(13, "small", item_of(torch.ones(10)))))
    assert type(put) is Put and same_value(codec.decode(put.item.value), torch.ones(10))


def test_oversized_frame_then_another_in_the_same_chunk() -> None:
    client, server = WireClient(), greeted(SMALL)
    data = (client.frame(Append(1, "big", item_of(torch.zeros(5000))))
            + client.frame(ListBins(2)))
    out = server.receive_data(data)
    assert [type(m) for m in out] == [BadRequest, ListBins]
    assert out[0].id == 1 and out[0].code == "limit_exceeded"
    server = greeted(SMALL)  # and byte by byte
    out = []
    for i in range(len(data)):
        out.extend(server.receive_data(data[i : i + 1]))
    assert [type(m) for m in out] == [BadRequest, ListBins]


def test_oversized_frame_carries_no_ack() -> None:
    server = greeted(SMALL)
    data = WireClient().frame(Put(3, "b", item_of(torch.zeros(5000))), AckInfo(2))
    assert [type(m) for m in server.receive_data(data)] == [BadRequest]


def test_oversized_frame_is_fatal_on_the_client_side() -> None:
    """The client allows the server's limit plus 64 KiB of slack, then nothing more."""
    server, client = greeted(), ClientConnection(SMALL)
    value = torch.zeros(20_000)  # 80 kB: over 4096 + 65536
    data = wire(server.send(Fetched(1, "value", (item_of(value),), 1, 0)))
    out = client.receive_data(data, lambda rid: "get")
    assert [type(m) for m in out] == [ProtocolViolation]
    assert "exceeds" in out[0].message


def test_client_accepts_replies_up_to_the_limit_plus_slack() -> None:
    server, client = greeted(), ClientConnection(SMALL)
    value = torch.zeros(10_000)  # 40 kB: over 4096, within the slack
    data = wire(server.send(Fetched(1, "value", (item_of(value),), 1, 0)))
    got = one(client.receive_data(data, lambda rid: "get"))
    assert type(got) is Fetched and same_value(codec.decode(got.items[0].value), value)


def test_oversized_header_is_fatal() -> None:
    data = WireClient().frame(Put(1, "b", item_of(b"x" * 2000)))  # bytes live in the header
    assert "max_header_bytes" in fatal(greeted(SMALL), data)


def test_client_refuses_to_send_over_the_servers_limits() -> None:
    client = ClientConnection()
    client.set_limits(SMALL)
    with pytest.raises(LimitExceeded, match="put of bin 'b' not sent.*max_frame_bytes=4096"):
        client.send(Put(1, "b", item_of(torch.zeros(5000))))
    with pytest.raises(LimitExceeded, match="its header takes .* max_header_bytes=1024"):
        client.send(Put(2, "b", item_of(b"x" * 2000)))
    with pytest.raises(LimitExceeded, match="stats not sent.*max_header_bytes=1024"):
        client.send(Stats(3, "*" * 2000))
    assert wire(client.send(Ping(4)))  # still usable


def test_set_limits_applies_to_the_client_decoder() -> None:
    server, client = greeted(), ClientConnection()
    value = torch.zeros(20_000)
    data = wire(server.send(Fetched(1, "value", (item_of(value),), 1, 0)))
    assert type(one(client.receive_data(data, lambda rid: "get"))) is Fetched
    client.set_limits(SMALL)
    assert client.limits == SMALL
    assert type(client.receive_data(data, lambda rid: "get")[-1]) is ProtocolViolation


# ------------------------------------------------------------------------------- encoded buffers


def test_buffers_are_not_copied_on_send() -> None:
    t = torch.arange(1000, dtype=torch.int64)
    chunks = ClientConnection().send(Put(1, "b", item_of(t)))
    views = [c for c in chunks if isinstance(c, memoryview)]
    assert any(len(v) == t.numel() * 8 for v in views)
    reply_chunks = ServerWire().send(Fetched(1, "value", (item_of(t),), 1, 0))
    assert any(isinstance(c, memoryview) and len(c) == t.numel() * 8 for c in reply_chunks)


def test_encode_message_reports_the_header_size_and_takes_extra_fields() -> None:
    chunks, header_len = encode_message(Ping(3), {"ack": 2})
    data = wire(chunks)
    assert int.from_bytes(data[4:8], "little") == header_len == len(data) - 16
    assert msgpack.unpackb(data[16:], raw=False) == {"op": "ping", "id": 3, "ack": 2}


def test_buffer_dataclass_is_accepted_for_bytes() -> None:
    client, server = WireClient(), greeted()
    tree = msgpack.packb(msgpack.ExtType(codec.EXT_TENSOR, msgpack.packb(["int16", [2], 0])))
    item = Item(Encoded(tree, (Buffer(b"\x01\x00\x02\x00"),)))
    got = one(c2s(client, server, Put(1, "b", item)))
    assert same_value(codec.decode(got.item.value), torch.tensor([1, 2], dtype=torch.int16))


def test_fetch_spec_defaults_write_the_smallest_header() -> None:
    data = WireClient().frame(Fetch(3, "w", FetchSpec(True)))
    assert msgpack.unpackb(data[16:], raw=False) == {"op": "get", "id": 3, "bin": "w"}


# ------------------------------------------------------------------------------- layering

LAYERING_PROBE = textwrap.dedent(
    """
    import sys
    before = set(sys.modules)
    import tensorshare.wire.address, tensorshare.wire.auth, tensorshare.wire.codec
    import tensorshare.wire.fields, tensorshare.wire.frames, tensorshare.wire.messages
    import tensorshare.wire.protocol, tensorshare.wire.services, tensorshare.wire.streams
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

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(codec.__file__))))
    deps = os.path.dirname(os.path.dirname(os.path.abspath(mp.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, deps]))
    before, added = _probe("-S", env=env)
    assert "threading" not in before  # so the check below means something
    assert not _top(added) & set(FORBIDDEN), sorted(added)


ORDER_PROBE = textwrap.dedent(
    """
    import sys
    import tensorshare.wire.replay, tensorshare.wire.services, tensorshare.wire.streams
    # The other kinds' rows are plain data: exporting them needs no protocol.
    assert not any(n.startswith("tensorshare.wire.protocol") for n in sys.modules)
    from tensorshare.wire.protocol import OPS
    print(" ".join(OPS))
    """
)


def test_the_op_table_does_not_depend_on_what_was_imported_first() -> None:
    """A fresh interpreter that imports the stream and service modules before the protocol
    gets the same table, in the same order: core, streams, services, reload, replay, then
    replication's."""
    from tensorshare.wire import replay, replication, services, streams

    out = subprocess.run([sys.executable, "-c", ORDER_PROBE], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == list(OPS)
    kinds = [op.name for op in (*streams.ROWS, *services.ROWS)]
    last = [op.name for op in (*replay.ROWS, *replication.ROWS)]
    assert out[-len(kinds) - 1 - len(last):] == [*kinds, "reload", *last]
    assert out[0] == "hello"
    assert all(OPS[op.name] is op for op in (*streams.ROWS, *services.ROWS, *replay.ROWS))


def test_a_frame_of_many_items_is_parsed_with_the_garbage_collector_paused() -> None:
    """Tens of thousands of items would otherwise trigger collections that scan every live
    object again and again; the collector runs again afterwards, also after a bad frame."""
    import gc

    n = 20_000
    items = [Item(codec.encode(torch.tensor([float(i)])), i) for i in range(n)]
    wire, conn = WireClient(), greeted()
    data = wire.frame(Append(wire.next_id(), "q", items[0], None, tuple(items[1:])))
    # The same items, one of whose buffers is said to lie beyond the payload: refused.
    h = msgpack.unpackb(data[16:16 + int.from_bytes(data[4:8], "little")], raw=False)
    h["id"], h["items"][-1][1][0][0] = 99, 1 << 40
    packed = msgpack.packb(h, use_bin_type=True)
    payload = data[16 + ((int.from_bytes(data[4:8], "little") + 16 + 63) & ~63) - 16:]
    bad = b"".join(bytes(c) for c in encode_frame(packed, [payload]))
    collections: list[int] = []

    def count(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    assert gc.isenabled()
    gc.collect()  # (the counts start from zero: making the items above brought them near)
    gc.callbacks.append(count)
    try:
        (request,) = [e for e in conn.receive_data(data) if type(e) is Append]
        during = len(collections)
        events = conn.receive_data(bytes(bad))
    finally:
        gc.callbacks.remove(count)
    # At most the one that catches up once the pause ends (without it: dozens).
    assert during <= 1 and gc.isenabled()
    assert len(request.items) == n and request.items[-1].tag == n - 1
    assert gc.isenabled() and any(type(e) in (BadRequest, ProtocolViolation) for e in events)


# -- replies from prepared pieces -------------------------------------------------------------
def _general_frame(msg: Any) -> bytes:
    """A reply encoded the general way: its header as the table builds it, then packed."""
    from tensorshare.wire.protocol import _header_of, _items_header

    header, items = _header_of(msg)
    buffers: list[Any] = []
    if items:
        header["items"] = _items_header(items, buffers, None)
    return b"".join(bytes(c) for c in encode_frame(msgpack.packb(header, use_bin_type=True),
                                                     buffers))


_IDS = (1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1)


@pytest.mark.parametrize("rid", _IDS)
@pytest.mark.parametrize("version", (0, 1, 200, 70000, 2**40))
@pytest.mark.parametrize("dropped", (0, 3, 300))
def test_stored_frames_from_prepared_pieces_match_the_general_encoder(
        rid: int, version: int, dropped: int) -> None:
    from tensorshare.wire.protocol import encode_reply, stored_frame

    msg = Stored(rid, version, version % 1000, dropped)
    assert stored_frame(rid, version, version % 1000, dropped) == _general_frame(msg)
    assert b"".join(bytes(c) for c in encode_reply(msg)) == _general_frame(msg)


@pytest.mark.parametrize("rid", _IDS)
@pytest.mark.parametrize("flag", (True, False))
def test_acked_frames_from_prepared_pieces_match_the_general_encoder(rid: int,
                                                                      flag: bool) -> None:
    from tensorshare.wire.protocol import acked_frame, encode_reply

    assert acked_frame(rid, flag) == _general_frame(Acked(rid, flag))
    assert b"".join(bytes(c) for c in encode_reply(Acked(rid, flag))) == \
        _general_frame(Acked(rid, flag))


@pytest.mark.parametrize("rid", (1, 300, 2**40))
@pytest.mark.parametrize("value", [torch.ones(3), {"a": torch.arange(5), "b": "x"}, 7, None])
@pytest.mark.parametrize("n", (1, 3))
def test_fetched_frames_from_prepared_pieces_match_the_general_encoder(
        rid: int, value: Any, n: int) -> None:
    from tensorshare.wire.protocol import encode_reply

    items = tuple(Item(codec.encode(value), tag) for tag in range(n))
    for msg in (Fetched(rid, "list", items, 9, n, 2), Fetched(rid, "value", items[:1], 4, 1, 0),
                Fetched(rid, "value", (), 4, 1, 0, unchanged=True)):
        assert b"".join(bytes(c) for c in encode_reply(msg)) == _general_frame(msg)


def test_min_version_round_trips_on_put_and_append_and_bad_ones_are_refused() -> None:
    client, server = WireClient(), greeted()
    item = item_of(torch.arange(3))
    put = one(c2s(client, server, Put(client.next_id(), "b", item, 7)))
    assert type(put) is Put and put.min_version == 7
    plain = one(c2s(client, server, Put(client.next_id(), "b", item)))
    assert plain.min_version is None
    app = one(c2s(client, server, Append(client.next_id(), "b", item, 1.0, (item,), 9)))
    assert type(app) is Append and app.min_version == 9 and len(app.items) == 2
    for bad, match in ((0, "at least 1"), (True, "integer"), (1.5, "integer"),
                       (1 << 63, "at most")):
        frame = raw_frame({"op": "put", "id": 5, "bin": "b", "min_version": bad,
                           "items": [[msgpack.packb(1), [], None]]})
        assert_bad(server, frame, 5, "invalid_request", match)
