"""The wire of stream bins (tensorshare.wire.streams): each op and reply through the two
sans-I/O sides and back, the checks of every field, the op table's flags, and that the
module stays sans-I/O.

A ``WireClient`` encodes requests and parses replies (it knows each reply's op from the
request it sent); a ``ServerWire`` parses requests and encodes replies.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import msgpack
import pytest
import torch

from tensorshare import errors
from tensorshare.errors import InvalidRequest, LimitExceeded
from tensorshare.wire import codec
from tensorshare.wire.frames import encode_frame
from tensorshare.wire.messages import Acked, Item, Limits
from tensorshare.wire.protocol import OPS, BadRequest, op_name
from tensorshare.wire.streams import (
    Lagged,
    ProducerGone,
    StreamAppend,
    StreamAppended,
    StreamEnd,
    StreamEnded,
    StreamItems,
    StreamJoin,
    StreamJoined,
    StreamLeave,
    StreamOpen,
    StreamOpened,
    StreamRead,
)
from tests.rawwire import ServerWire, WireClient


def server_side() -> ServerWire:
    conn = ServerWire(Limits())
    conn.handshake_done()
    return conn


def roundtrip_request(msg: Any) -> Any:
    """``msg`` encoded by a client and parsed by a server."""
    out = server_side().receive_data(WireClient().frame(msg))
    assert len(out) == 1, out
    return out[0]


def roundtrip_reply(request: Any, reply: Any) -> Any:
    """``reply`` to ``request`` encoded by a server and parsed by the client that sent it."""
    client = WireClient()
    client.frame(request)
    data = b"".join(server_side().send(reply))
    out = client.receive_data(data)
    assert len(out) == 1, out
    return out[0]


def raw(header: dict[str, Any]) -> Any:
    """A hand-built request frame (any header) as the server parses it."""
    frame = b"".join(encode_frame(msgpack.packb(header, use_bin_type=True), []))
    out = server_side().receive_data(frame)
    assert len(out) == 1, out
    return out[0]


def item(value: Any) -> Item:
    return Item(codec.encode(value))


def test_every_stream_op_is_in_the_table_with_its_flags() -> None:
    names = {"stream_open", "stream_append", "stream_end", "stream_join", "stream_read",
             "stream_leave"}
    assert names <= set(OPS)
    remembered = {n for n in names if OPS[n].mutating}
    assert remembered == names - {"stream_leave"}
    assert not any(OPS[n].read for n in names), "no stream op is for the read-only token"


@pytest.mark.parametrize("msg", [
    StreamOpen(1, "s", 2, 3, 16, "detach", 2.5, "epoch", 4.0, 100),
    StreamOpen(2, "s"),
    StreamOpen(3, "s", device_ipc=True),
    StreamEnd(3, "s", 1, 4, 77, True, 5.0),
    StreamEnd(4, "s", 0, 0, 0),
    StreamJoin(5, "s", "lr=0.1", "epoch_start", 3.0, False),
    StreamJoin(6, "s", "j"),
    StreamRead(7, "s", "j", 12, 4, 1.5),
    StreamRead(8, "s", "j", None, None, 0.0),
    StreamLeave(9, "s", "j"),
])
def test_requests_without_items_round_trip(msg: Any) -> None:
    assert roundtrip_request(msg) == msg
    assert op_name(msg) == OPS[op_name(msg)].name


def test_append_round_trips_with_its_items_and_samples() -> None:
    msg = StreamAppend(3, "s", 1, 2, item(torch.arange(4)), (item({"x": torch.ones(2)}),),
                       (4, 2), 2.0)
    got = roundtrip_request(msg)
    assert (got.bin, got.producer, got.epoch, got.samples, got.timeout) == ("s", 1, 2, (4, 2), 2.0)
    assert torch.equal(codec.decode(got.items[0].value), torch.arange(4))
    assert torch.equal(codec.decode(got.items[1].value)["x"], torch.ones(2))


def test_replies_round_trip() -> None:
    cases: list[tuple[Any, Any]] = [
        (StreamOpen(1, "s"), StreamOpened(1, 3, 40, 12, 2, True)),
        (StreamAppend(2, "s", 0, 0, item(1)), StreamAppended(2, 7, 8)),
        (StreamEnd(3, "s", 0, 0, 5), StreamEnded(3, 1, True, False)),
        (StreamJoin(4, "s", "j"), StreamJoined(4, None, 2, 0, None, 9, False)),
        (StreamJoin(5, "s", "j"), StreamJoined(5, 4, 1, 48, 100, 9, True)),
        (StreamLeave(6, "s", "j"), Acked(6, True)),
    ]
    for request, reply in cases:
        assert roundtrip_reply(request, reply) == reply


def test_items_reply_round_trips_with_and_without_items() -> None:
    full = StreamItems(1, (item(torch.arange(3)), item(torch.zeros(2))), 5, 8, 2, 10, 30,
                       30, False, 4, False)
    got = roundtrip_reply(StreamRead(1, "s", "j"), full)
    assert (got.first, got.next, got.epoch, got.offset, got.epoch_samples, got.end,
            got.aborted, got.missed, got.finished) == (5, 8, 2, 10, 30, 30, False, 4, False)
    assert torch.equal(codec.decode(got.items[0].value), torch.arange(3))
    # At an epoch's end (or the stream's), a reply may carry no item: no "items" key at all.
    empty = StreamItems(2, (), 9, 10, 3, 20, 20, 20, True, 0, True)
    assert roundtrip_reply(StreamRead(2, "s", "j"), empty) == empty
    header = msgpack.unpackb(bytes(b"".join(server_side().send(empty)))[16:], raw=False)
    assert "items" not in header and header["aborted"] is True and header["finished"] is True


@pytest.mark.parametrize("extra", [{}, {"timeout": None}])
def test_a_read_without_a_timeout_answers_at_once(extra: dict[str, Any]) -> None:
    frame = encode_frame(msgpack.packb({"op": "stream_read", "id": 3, "bin": "s",
                                        "consumer": "j", **extra}))
    (msg,) = server_side().receive_data(b"".join(bytes(c) for c in frame))
    assert msg == StreamRead(3, "s", "j", None, None, 0.0)


def test_optional_fields_are_left_out_when_unset() -> None:
    header = msgpack.unpackb(WireClient().frame(StreamRead(1, "s", "j"))[16:], raw=False)
    assert header == {"op": "stream_read", "id": 1, "bin": "s", "consumer": "j",
                      "timeout": 0.0}
    items = msgpack.unpackb(bytes(b"".join(server_side().send(
        StreamItems(3, (), 1, 2, 0, 0, None, 5))))[16:], raw=False)
    assert "missed" not in items and "aborted" not in items and "finished" not in items


@pytest.mark.parametrize("header, code", [
    ({"op": "stream_open", "id": 1, "bin": "s", "producers": 0}, InvalidRequest.code),
    ({"op": "stream_open", "id": 1, "bin": "s", "producers": 2, "producer": 2},
     InvalidRequest.code),
    ({"op": "stream_open", "id": 1, "bin": "s", "window": 0}, InvalidRequest.code),
    ({"op": "stream_open", "id": 1, "bin": "s", "window": True}, InvalidRequest.code),
    ({"op": "stream_open", "id": 1, "bin": "s", "on_lag": "drop"}, InvalidRequest.code),
    ({"op": "stream_open", "id": 1, "bin": "s", "replay": "all"}, InvalidRequest.code),
    ({"op": "stream_open", "id": 1, "bin": "s", "lease": 0}, InvalidRequest.code),
    ({"op": "stream_open", "id": 1, "bin": "s", "lease": float("nan")}, InvalidRequest.code),
    ({"op": "stream_open", "id": 1, "bin": "s", "lease": 1e9}, InvalidRequest.code),
    ({"op": "stream_open", "id": 1, "bin": "s", "max_stall": -1}, InvalidRequest.code),
    ({"op": "stream_open", "id": 1, "bin": "s", "samples": -1}, InvalidRequest.code),
    ({"op": "stream_end", "id": 1, "bin": "s", "producer": 0, "epoch": 0},
     InvalidRequest.code),
    ({"op": "stream_end", "id": 1, "bin": "s", "producer": 0, "epoch": -1, "samples": 0},
     InvalidRequest.code),
    ({"op": "stream_join", "id": 1, "bin": "s"}, InvalidRequest.code),
    ({"op": "stream_join", "id": 1, "bin": "s", "consumer": ""}, InvalidRequest.code),
    ({"op": "stream_join", "id": 1, "bin": "s", "consumer": "x" * 2000},
     LimitExceeded.code),
    ({"op": "stream_join", "id": 1, "bin": "s", "consumer": "j", "start": "later"},
     InvalidRequest.code),
    ({"op": "stream_join", "id": 1, "bin": "s", "consumer": "j", "resume": 1},
     InvalidRequest.code),
    ({"op": "stream_read", "id": 1, "bin": "s", "consumer": "j", "at": -1},
     InvalidRequest.code),
    ({"op": "stream_read", "id": 1, "bin": "s", "consumer": "j", "max_items": 0},
     InvalidRequest.code),
    ({"op": "stream_read", "id": 1, "bin": "s", "consumer": "j", "timeout": -1},
     InvalidRequest.code),
    ({"op": "stream_leave", "id": 1, "bin": "", "consumer": "j"}, InvalidRequest.code),
])
def test_malformed_fields_get_an_error_reply(header: dict[str, Any], code: str) -> None:
    got = raw(header)
    assert type(got) is BadRequest and got.code == code, got


def test_append_checks_its_items_and_samples() -> None:
    base = {"op": "stream_append", "id": 1, "bin": "s", "producer": 0, "epoch": 0}
    value, _ = codec.encode(5).value, None
    one = [[value, [], None]]
    assert type(raw({**base, "items": []})) is BadRequest
    assert type(raw({**base, "items": one, "samples": [1, 2]})) is BadRequest
    assert type(raw({**base, "items": one, "samples": [-1]})) is BadRequest
    assert type(raw({**base, "items": one, "samples": [True]})) is BadRequest
    assert type(raw({**base, "items": [[b"\xc1", [], None]]})) is BadRequest  # not msgpack
    ok = raw({**base, "items": one, "samples": [3]})
    assert type(ok) is StreamAppend and ok.samples == (3,)


def test_the_errors_are_server_errors_with_codes_the_clients_know() -> None:
    for cls, code in ((Lagged, "lagged"), (ProducerGone, "producer_gone")):
        assert issubclass(cls, errors.ServerError) and cls.code == code
        assert errors.ERROR_CODES[code] is cls
        assert type(errors.error_from_code(code, "m")) is cls
    assert Lagged("m", missed=3).missed == 3


PROBE = textwrap.dedent(
    """
    import sys
    before = set(sys.modules)
    import tensorshare.wire.streams
    added = sorted({n.split('.')[0] for n in set(sys.modules) - before})
    print(' '.join(added))
    """
)


def test_the_stream_wire_is_sans_io() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert not set(out) & {"twisted", "socket", "threading", "torch", "select"}, out
