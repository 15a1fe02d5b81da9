"""Runs of like tensors as one buffer (wire/runs.py, docs/PROTOCOL.md §3.3.3.1): what the server
writes for a get/peek reply when the handshake agreed on runs, what the client reads back, and
that it is what the item-by-item form gives, bit for bit: every wire dtype, 0-d and empty shapes,
runs mixed with other items, and malformed runs refused."""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import pytest
import torch

from tensorshare.client.ops import decode_fetched
from tensorshare.errors import CodecError
from tensorshare.wire import codec
from tensorshare.wire.frames import PREFIX, encode_frame
from tensorshare.wire.messages import Hello, HelloReply, Limits
from tensorshare.wire.protocol import (
    BadRequest,
    ProtocolViolation,
    encode_fetched_parts,
    encode_fetched_with_id,
    encode_message,
)
from tensorshare.wire.records import Fetched, Item
from tensorshare.wire.runs import RUN_ITEM_MAX, RUN_MAX_BYTES, Run
from tensorshare.wire.tensors import DTYPES
from tests.rawwire import Get, ServerWire, WireClient

SHAPES = [(), (1,), (3,), (2, 3), (1, 2, 1, 2)]


def like(name: str, shape: tuple[int, ...], n: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` tensors of wire dtype ``name`` and ``shape`` with random bit patterns (NaNs and
    denormals included), each its own."""
    dtype = getattr(torch, name)
    size = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    count = n * max(1, int(torch.tensor(shape).prod()) if shape else 1)
    raw = torch.randint(0, 2 if name == "bool" else 256, (count * size,), generator=g,
                        dtype=torch.uint8)
    whole = raw.view(dtype).reshape(n, *shape)
    return [whole[i].clone() for i in range(n)]


def bits(t: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], bytes]:
    """What bit-exact means: the dtype, the shape and every byte."""
    return t.dtype, tuple(t.shape), bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def items_of(values: list[Any], tags: list[int | None] | None = None) -> tuple[Item, ...]:
    tags = tags or [None] * len(values)
    return tuple(Item(codec.encode(v), t) for v, t in zip(values, tags, strict=True))


def through_the_wire(items: tuple[Item, ...], runs: bool) -> tuple[dict[str, Any], Fetched]:
    """A get reply of ``items`` as the server writes it (``runs``: to a client that agreed),
    read by a client: its header, and the reply decoded."""
    client = WireClient()
    client.send(Get(1, "q", max_items=len(items)))
    chunks = encode_fetched_with_id(1, *encode_fetched_parts(Fetched(1, "list", items, 7, 0),
                                                             None, runs))
    frame = b"".join(bytes(c) for c in chunks)
    (got,) = client.receive_data(frame)
    assert type(got) is Fetched, got
    header_len = struct.unpack_from("<I", frame, 4)[0]
    header = msgpack.unpackb(frame[PREFIX:PREFIX + header_len])
    return header, decode_fetched(got, 64)


def shapes_of(header: dict[str, Any]) -> list[Any]:
    """Each element of the header's items: a run's count, or "item"."""
    return [e["run"] if isinstance(e, dict) else "item" for e in header["items"]]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", DTYPES)
def test_a_run_of_every_dtype_and_shape_is_the_items_bit_for_bit(name: str,
                                                                  shape: tuple[int, ...]) -> None:
    values = like(name, shape, 5, seed=len(shape))
    tags = [None, 3, None, -1, 2**63 - 1]
    header, res = through_the_wire(items_of(values, tags), True)
    assert shapes_of(header) == [5]
    _, plain = through_the_wire(items_of(values, tags), False)
    assert [bits(v) for v in res.items] == [bits(v) for v in plain.items] == \
        [bits(v) for v in values]
    assert res.tags == plain.tags == tuple(tags)
    assert (res.kind, res.version, res.n_items, res.value is not None) == ("list", 7, 0, True)
    # The rows of one tensor: one storage, each row its own bytes, writable.
    assert len({v.untyped_storage().data_ptr() for v in res.items}) == 1
    assert all(v.is_contiguous() for v in res.items)
    first = bits(res.items[1])
    res.items[0].reshape(-1).view(torch.uint8).fill_(0x01)
    assert bits(res.items[1]) == first
    assert bytes(res.items[0].reshape(-1).view(torch.uint8).numpy()) == \
        b"\x01" * res.items[0].nbytes


@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 3)], ids=str)
def test_empty_tensors_travel_as_items(shape: tuple[int, ...]) -> None:
    values = [torch.empty(shape, dtype=torch.float32) for _ in range(4)]
    header, res = through_the_wire(items_of(values), True)
    assert shapes_of(header) == ["item"] * 4
    assert [bits(v) for v in res.items] == [bits(v) for v in values]


def test_runs_cover_what_they_can_and_the_other_items_keep_their_places() -> None:
    a = like("float32", (2,), 7, seed=1)
    b = like("int64", (2,), 3, seed=2)
    big = like("uint8", (RUN_ITEM_MAX + 1,), 2, seed=3)
    a_np = [x.numpy() for x in like("float32", (2,), 2, seed=4)]  # ndarrays: not a run
    values: list[Any] = [*a[:3], b[0], *a[3:5], {"x": a[5]}, {"x": a[6]}, *big, b[1],
                         *a_np, b[2], a[6]]
    tags = [i if i % 3 else None for i in range(len(values))]
    items = items_of(values, tags)
    # One more whose buffer is compressed: an item, even beside its like.
    lz = Item(codec.encode(torch.zeros(1 << 17, dtype=torch.int64), compress="lz4",
                           compress_min_bytes=0), 9)
    items = (*items, lz, lz)
    header, res = through_the_wire(items, True)
    assert shapes_of(header) == [3, "item", 2, "item", "item", "item", "item", "item",
                                 "item", "item", "item", "item", "item", "item"]
    _, plain = through_the_wire(items, False)
    assert res.tags == plain.tags == (*tags, 9, 9)
    assert len(res.items) == len(values) + 2
    for got, want in zip(res.items, plain.items, strict=True):
        if isinstance(want, torch.Tensor):
            assert bits(got) == bits(want)
        elif isinstance(want, dict):
            assert bits(got["x"]) == bits(want["x"])
        else:
            assert type(got) is type(want) and got.tobytes() == want.tobytes()
    assert res.items[-1].equal(torch.zeros(1 << 17, dtype=torch.int64))


def test_a_long_stretch_is_several_runs_of_at_most_a_mebibyte() -> None:
    n = 2 * RUN_MAX_BYTES // RUN_ITEM_MAX + 3  # items of RUN_ITEM_MAX bytes each
    values = like("uint8", (RUN_ITEM_MAX,), n)
    header, res = through_the_wire(items_of(values), True)
    per_run = RUN_MAX_BYTES // RUN_ITEM_MAX
    assert shapes_of(header) == [per_run, per_run, 3]
    assert all(isinstance(e, dict) and e["tags"] is None for e in header["items"])
    assert [bits(v) for v in res.items] == [bits(v) for v in values]


def test_without_the_capability_a_reply_is_item_by_item_byte_for_byte() -> None:
    items = items_of(like("float32", (3,), 4))
    off = b"".join(bytes(c) for c in encode_fetched_with_id(
        2, *encode_fetched_parts(Fetched(2, "list", items, 5, 1), None)))
    general = b"".join(bytes(c) for c in encode_message(Fetched(2, "list", items, 5, 1))[0])
    assert off == general
    assert shapes_of(through_the_wire(items, False)[0]) == ["item"] * 4


def test_a_single_item_and_a_value_bin_are_never_a_run() -> None:
    (one,) = like("float32", (3,), 1)
    header, res = through_the_wire(items_of([one]), True)
    assert shapes_of(header) == ["item"] and bits(res.items[0]) == bits(one)


def test_the_hello_offers_runs_and_its_reply_agrees() -> None:
    server = ServerWire()
    for offered in (True, False):
        frame = b"".join(bytes(c) for c in encode_message(Hello(1, (1,), "me", runs=offered))[0])
        (hello,) = server.receive_data(frame)
        assert type(hello) is Hello and hello.runs is offered
    client = WireClient()
    client.send(Hello(1, (1,), "me", runs=True))
    for agreed in (True, False):
        frame = b"".join(bytes(c) for c in encode_message(
            HelloReply(1, 1, "s", Limits(), runs=agreed))[0])
        (reply,) = client.receive_data(frame)
        assert type(reply) is HelloReply and reply.runs is agreed
        client.send(Hello(1, (1,), "me", runs=True))


# -- malformed runs ---------------------------------------------------------------------------
TREE = codec.encode(torch.tensor([1.0])).value  # float32 [1]
GOOD = {"run": 3, "value": TREE, "buffer": [0, 12], "tags": None}


def reply_frame(items: list[Any], payload: bytes, rid: int = 1) -> bytes:
    header = msgpack.packb({"op": "reply", "id": rid, "ok": True, "kind": "list",
                            "version": 1, "n_items": 0, "dropped": 0, "items": items})
    return b"".join(bytes(c) for c in encode_frame(header, [payload] if payload else []))


def read_back(items: list[Any], payload: bytes) -> Any:
    client = WireClient()
    client.send(Get(1, "q", max_items=10))
    (got,) = client.receive_data(reply_frame(items, payload))
    return got


def test_a_well_formed_run_is_read_as_a_run() -> None:
    got = read_back([GOOD], struct.pack("<3f", 1, 2, 3))
    assert type(got) is Fetched and [type(i) for i in got.items] == [Run]
    assert [v.item() for v in decode_fetched(got, 64).items] == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("change", [
    {"run": 0}, {"run": -1}, {"run": True}, {"run": None}, {"run": 5}, {"run": 13},
    {"value": "text"}, {"value": None},
    {"buffer": [0]}, {"buffer": [0, 12, "lz4", 12]}, {"buffer": [1, 12]}, {"buffer": [0, 11]},
    {"buffer": [64, 12]}, {"buffer": [0, 24]}, {"buffer": [-64, 12]}, {"buffer": None},
    {"tags": [1, 2]}, {"tags": [1, 2, "x"]}, {"tags": [1, 2, 3.5]}, {"tags": 3},
], ids=str)
def test_a_malformed_run_is_a_protocol_violation(change: dict[str, Any]) -> None:
    got = read_back([{**GOOD, **change}], struct.pack("<3f", 1, 2, 3))
    assert type(got) is ProtocolViolation, got


def test_a_run_that_overlaps_the_item_before_is_a_protocol_violation() -> None:
    item = [TREE, [[0, 4]], None]
    payload = struct.pack("<f", 0) + bytes(60) + struct.pack("<3f", 1, 2, 3)
    assert type(read_back([item, {**GOOD, "buffer": [64, 12]}], payload)) is Fetched
    got = read_back([item, {**GOOD, "buffer": [0, 12]}], payload)
    assert type(got) is ProtocolViolation


@pytest.mark.parametrize("value", [
    codec.encode(torch.tensor([1.0, 2.0])).value,  # 8 bytes each, not 4
    codec.encode(torch.tensor(1, dtype=torch.int16)).value,  # 2 bytes each, not 4
    codec.encode(torch.tensor([], dtype=torch.float32)).value,  # empty
    codec.encode([torch.tensor([1.0]), 2]).value,  # its tensor's buffer is 4 bytes, not 2
    b"\xc1",  # not msgpack
], ids=["size", "smaller", "empty", "other-size", "garbage"])
def test_a_run_whose_value_is_not_its_buffers_fails_that_call(value: bytes) -> None:
    payload = struct.pack("<3f", 1, 2, 3)
    run = {**GOOD, "value": value}
    if value.startswith(b"\x92"):
        run = {**run, "run": 6}  # 2 bytes each
    got = read_back([run], payload)
    assert type(got) is Fetched  # (the connection is fine)
    with pytest.raises(CodecError):
        decode_fetched(got, 64)


def test_a_run_of_another_tree_than_a_tensor_decodes_item_by_item() -> None:
    """A run's value read with each item's slice as its buffer 0: what §3.3.3.1 says, even
    for a tree the Python server never sends as a run (an ndarray, a map)."""
    nd = codec.encode(torch.tensor([1.0]).numpy()).value
    mapped = codec.encode({"x": torch.tensor([1.0])}).value
    payload = struct.pack("<2f", 1, 2) + bytes(56) + struct.pack("<2f", 3, 4)
    got = read_back([{**GOOD, "run": 2, "value": nd, "buffer": [0, 8]},
                     {**GOOD, "run": 2, "value": mapped, "buffer": [64, 8], "tags": [1, None]}],
                    payload)
    res = decode_fetched(got, 64)
    assert [float(v[0]) for v in res.items[:2]] == [1.0, 2.0]
    assert [float(v["x"][0]) for v in res.items[2:]] == [3.0, 4.0]
    assert res.tags == (None, None, 1, None)


def test_the_server_refuses_a_run_in_a_request() -> None:
    server = ServerWire()
    server.handshake_done()
    header = msgpack.packb({"op": "append", "id": 3, "bin": "q", "items": [GOOD]})
    out = server.receive_data(b"".join(bytes(c) for c in encode_frame(
        header, [struct.pack("<3f", 1, 2, 3)])))
    assert [type(m) for m in out] == [BadRequest] and out[0].code == "invalid_request"
