"""Unit tests of tensorshare.codec: the wire format, round trips, refusals and limits."""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

import lz4.block
import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorshare.errors import CodecError, UnsupportedType
from tensorshare.wire import codec
from tensorshare.wire.codec import (
    DEFAULT_MAX_DEPTH,
    DTYPES,
    EXT_NDARRAY,
    EXT_TENSOR,
    EXT_TUPLE,
    Buffer,
    Encoded,
    decode,
    encode,
    validate,
)

ROOT = Path(__file__).resolve().parents[2]

# Hand-written msgpack of the tensor descriptor ext for torch.tensor([1.0, 2.0]):
#   c7 0c 01          ext 8, 12 data bytes, type 1 (EXT_TENSOR)
#   93                array of 3
#   a7 "float32"      fixstr of 7
#   91 02             [2]
#   00                buffer index 0
F32_PAIR_EXT = "c70c01 93 a7666c6f61743332 9102 00"

ITEMSIZE = {
    "float16": 2, "float32": 4, "float64": 8, "bfloat16": 2, "int8": 1, "int16": 2,
    "int32": 4, "int64": 8, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
    "uint16": 2, "uint32": 4, "uint64": 8,
}  # fmt: skip
TORCH_DTYPES = [n for n in DTYPES if isinstance(getattr(torch, n, None), torch.dtype)]
NUMPY_DTYPES = [n for n in DTYPES if n != "bfloat16"]
SHAPES = [(), (0,), (3, 0, 2), (5,), (2, 3, 4)]


def roundtrip(value: Any, **kw: Any) -> Any:
    return decode(encode(value, **kw))


def received(enc: Encoded) -> Encoded:
    """What a receiver sees: every buffer in a fresh writable bytearray."""
    return Encoded(
        bytes(enc.value),
        tuple(Buffer(bytearray(b.data), b.codec, b.raw_nbytes) for b in enc.buffers),
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, for bit-exact comparison (NaN payloads included)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def random_tensor(name: str, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of random bit patterns (so floats include NaNs, infs and subnormals)."""
    n = math.prod(shape)
    g = torch.Generator().manual_seed(seed)
    if name == "bool":
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (n * ITEMSIZE[name],), dtype=torch.uint8, generator=g)
    return raw.view(getattr(torch, name)).reshape(shape)


def random_array(name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    if name == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    return rng.integers(0, 256, n * ITEMSIZE[name], dtype=np.uint8).view(name).reshape(shape)


def same(a: Any, b: Any) -> bool:
    """Strict structural equality: container and scalar types must match too."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


# --------------------------------------------------------------------------- golden bytes


def test_constants() -> None:
    assert (EXT_TENSOR, EXT_NDARRAY, EXT_TUPLE) == (1, 2, 3)
    assert DEFAULT_MAX_DEPTH == 64
    assert DTYPES == tuple(ITEMSIZE)
    assert set(codec.__all__) >= {"Buffer", "Encoded", "encode", "decode", "validate", "DTYPES"}


def test_golden_tensor() -> None:
    enc = encode(torch.tensor([1.0, 2.0], dtype=torch.float32))
    assert enc.value == bytes.fromhex(F32_PAIR_EXT)
    assert len(enc.buffers) == 1
    assert bytes(enc.buffers[0].data) == struct.pack("<2f", 1, 2)
    assert enc.buffers[0].codec is None and enc.buffers[0].raw_nbytes == 8
    assert enc.nbytes == 15 + 8


def test_golden_two_tensors_and_0d() -> None:
    enc = encode({"a": torch.tensor([1.0, 2.0]), "b": torch.tensor(7, dtype=torch.int8)})
    # 82 map of 2; "a" -> tensor ext; "b" -> fixext 8 (d7), type 1, [ "int8", [], 1 ]
    assert enc.value == bytes.fromhex("82 a161" + F32_PAIR_EXT + "a162 d701 93 a4696e7438 90 01")
    assert [bytes(b.data) for b in enc.buffers] == [struct.pack("<2f", 1, 2), b"\x07"]


def test_golden_ndarray() -> None:
    enc = encode(np.array([1, 2], dtype=np.int16))
    # ext 8 (c7), 10 bytes, type 2: [ "int16", [2], 0 ]
    assert enc.value == bytes.fromhex("c70a02 93 a5696e743136 9102 00")
    assert bytes(enc.buffers[0].data) == b"\x01\x00\x02\x00"


def test_golden_tuple() -> None:
    # fixext 4 (d6), type 3, data = [1, "a"]
    assert encode((1, "a")).value == bytes.fromhex("d603 92 01 a161")
    # fixext 1 (d4), type 3, data = []
    assert encode(()).value == bytes.fromhex("d40390")


def test_golden_dict_and_scalars() -> None:
    assert encode({"a": 1, "b": [True, None]}).value == bytes.fromhex("82a16101a16292c3c0")
    assert encode([2**64 - 1, -(2**63), 1.5, "é"]).value == bytes.fromhex(
        "94 cfffffffffffffffff d38000000000000000 cb3ff8000000000000 a2c3a9"
    )
    assert encode(b"\x00\x01").value == bytes.fromhex("c4020001")
    assert encode(None).value == b"\xc0"


def test_golden_nested() -> None:
    enc = encode({"x": (torch.tensor([1.0, 2.0]),), "y": b"\x00\x01"})
    # "x" -> fixext 16 (d8) type 3 holding [tensor ext] (1 + 15 bytes); "y" -> bin 8
    assert enc.value == bytes.fromhex("82 a178 d803 91" + F32_PAIR_EXT + "a179 c4020001")
    out = decode(enc)
    assert type(out["x"]) is tuple and torch.equal(out["x"][0], torch.tensor([1.0, 2.0]))
    assert out["y"] == b"\x00\x01"


def test_decode_hand_written_bytes() -> None:
    """A client in another language produces exactly these bytes; we must read them."""
    value = bytes.fromhex("82 a174 d603 92 01 a161 a177" + F32_PAIR_EXT)
    out = decode(Encoded(value, (Buffer(struct.pack("<2f", 3, 4)),)))
    assert out["t"] == (1, "a")
    assert out["w"].dtype == torch.float32 and out["w"].tolist() == [3.0, 4.0]


# --------------------------------------------------------------------------- tensors


@pytest.mark.parametrize("name", TORCH_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_torch_dtypes_bit_exact(name: str, shape: tuple[int, ...]) -> None:
    src = random_tensor(name, shape)
    enc = encode(src)
    assert msgpack.unpackb(enc.value).data == msgpack.packb([name, list(shape), 0])
    assert enc.buffers[0].nbytes == math.prod(shape) * ITEMSIZE[name]
    for e in (enc, received(enc)):
        out = decode(e)
        assert type(out) is torch.Tensor and out.dtype == src.dtype
        assert out.shape == src.shape and out.device.type == "cpu"
        assert torch.equal(bits(out), bits(src))


@pytest.mark.parametrize("name", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_numpy_dtypes_bit_exact(name: str, shape: tuple[int, ...]) -> None:
    src = random_array(name, shape)
    enc = encode(src)
    assert msgpack.unpackb(enc.value).code == EXT_NDARRAY
    for e in (enc, received(enc)):
        out = decode(e)
        assert type(out) is np.ndarray and out.dtype == np.dtype(name)
        assert out.shape == shape and out.flags.writeable
        assert out.tobytes() == src.tobytes()


def test_nan_payloads_and_specials_bit_exact() -> None:
    patterns = [0x7FC00000, 0x7FC00001, 0xFFC12345, 0x7F800001, 0x7F800000, 0x80000000, 1]
    src = torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)
    out = roundtrip(src)
    assert out.view(torch.int32).tolist() == src.view(torch.int32).tolist()
    bf = torch.tensor([0x7FC1, 0xFF80, 1, 0x3F80], dtype=torch.int32).to(torch.int16)
    bf = bf.view(torch.bfloat16)
    assert torch.equal(roundtrip(bf).view(torch.int16), bf.view(torch.int16))


def test_complex_bit_exact_and_conj_resolved() -> None:
    src = torch.tensor([1 + 2j, -3.5 - 0.25j], dtype=torch.complex128)
    assert torch.equal(roundtrip(src), src)
    conj = src.conj()  # a lazy view with the conj bit set
    assert conj.is_conj()
    out = roundtrip(conj)
    assert not out.is_conj() and torch.equal(out, torch.tensor([1 - 2j, -3.5 + 0.25j]).to(src))
    neg = torch._neg_view(src)
    assert torch.equal(roundtrip(neg), -src)
    c64 = torch.tensor([float("nan") + 1j], dtype=torch.complex64)
    assert torch.equal(roundtrip(c64).view(torch.int32), c64.view(torch.int32))


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t.t(),
        lambda t: t[:, ::2],
        lambda t: t[::3, 1::2],
        lambda t: t.permute(1, 0)[2:5],
        lambda t: t.expand(3, 4, 6)[1],  # stride-0 dimension
    ],
)
def test_non_contiguous(make: Any) -> None:
    base = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    view = make(base)
    enc = encode(view)
    assert enc.buffers[0].nbytes == view.numel() * 8  # only the viewed elements
    out = decode(enc)
    assert out.shape == view.shape and out.is_contiguous() and torch.equal(out, view)


def test_slice_of_big_tensor_sends_only_the_slice() -> None:
    big = torch.arange(1_000_000, dtype=torch.float32)
    part = big[1000:1010]
    enc = encode(part)
    assert enc.buffers[0].nbytes == 40 and enc.nbytes == len(enc.value) + 40
    assert decode(enc).tolist() == list(range(1000, 1010))
    rows = torch.zeros(1000, 1000)[10:12]  # contiguous rows of a 2-D tensor
    assert encode(rows).buffers[0].nbytes == 2 * 1000 * 4
    strided = big[::100_000]
    assert encode(strided).buffers[0].nbytes == 10 * 4
    arr = np.arange(1_000_000, dtype=np.float64)[5:8]
    assert encode(arr).buffers[0].nbytes == 24


def test_encode_is_zero_copy_and_read_only() -> None:
    src = torch.zeros(4)
    buf = encode(src).buffers[0]
    assert isinstance(buf.data, memoryview) and buf.data.readonly
    src[0] = 1.5  # the buffer views the tensor's memory, no copy was made
    assert struct.unpack("<f", bytes(buf.data[:4]))[0] == 1.5


def test_received_tensors_are_writable_and_independent() -> None:
    a, b = torch.arange(4.0), torch.arange(4.0)
    value = {"a": a, "b": [b, a.clone()], "n": np.arange(3)}
    for enc in (encode(value), received(encode(value))):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch warns on non-writable buffers
            out = decode(enc)
        out["a"] += 10
        out["b"][0][0] = -1
        out["n"][0] = 99
        assert out["b"][0].tolist() == [-1, 1, 2, 3]
        assert out["b"][1].tolist() == [0, 1, 2, 3]
        assert out["a"].tolist() == [10, 11, 12, 13]
        assert a.tolist() == [0, 1, 2, 3] and b.tolist() == [0, 1, 2, 3]


def test_decode_builds_on_writable_buffers_without_copying() -> None:
    enc = received(encode(torch.arange(4, dtype=torch.int32)))
    out = decode(enc)
    out[1] = 77  # writes through to the receive buffer: no copy was made
    assert bytes(enc.buffers[0].data[4:8]) == struct.pack("<i", 77)
    # A slice of one receive buffer, at an unaligned offset: still correct.
    frame = bytearray(b"\xff" + struct.pack("<2d", 1.5, 2.5))
    enc = encode(torch.zeros(2, dtype=torch.float64))
    out = decode(Encoded(enc.value, (Buffer(memoryview(frame)[1:]),)))
    assert out.tolist() == [1.5, 2.5]
    assert out.data_ptr() % 8 == 0


def test_tensor_details() -> None:
    p = torch.nn.Parameter(torch.ones(2, 2))
    out = roundtrip({"p": p, "g": torch.ones(3, requires_grad=True) * 2})
    assert type(out["p"]) is torch.Tensor and not out["p"].requires_grad
    assert torch.equal(out["g"], torch.full((3,), 2.0))
    assert roundtrip(torch.tensor(True)).item() is True
    zero_d = roundtrip(torch.tensor(2.5, dtype=torch.float64))
    assert zero_d.shape == () and zero_d.item() == 2.5
    empty = roundtrip(torch.empty(3, 0, 2, dtype=torch.bfloat16))
    assert empty.shape == (3, 0, 2) and empty.dtype == torch.bfloat16


def test_numpy_layouts_and_byte_order() -> None:
    be = np.arange(6, dtype=">i4").reshape(2, 3)
    enc = encode(be)
    assert bytes(enc.buffers[0].data) == np.arange(6, dtype="<i4").tobytes()  # wire is LE
    out = decode(enc)
    assert out.dtype == np.dtype("int32") and (out == be).all()
    fortran = np.asfortranarray(np.arange(6.0).reshape(2, 3))
    assert (decode(encode(fortran)) == fortran).all()
    be_fortran = np.asfortranarray(np.arange(6, dtype=">f8").reshape(2, 3))
    assert (decode(encode(be_fortran)) == be_fortran).all()
    assert (decode(encode(np.arange(10)[::3])) == [0, 3, 6, 9]).all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        matrix = np.matrix([[1, 2], [3, 4]], dtype=np.int8)
    out = decode(encode(matrix))
    assert type(out) is np.ndarray and out.shape == (2, 2) and out.tolist() == [[1, 2], [3, 4]]
    zero_d = decode(encode(np.array(2.0, dtype=np.float32)))
    assert type(zero_d) is np.ndarray and zero_d.shape == () and zero_d == 2.0


def test_swap_bytes_helper() -> None:
    """The big-endian path: element bytes reverse, complex parts keep their order."""
    u8 = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8], dtype=torch.uint8)
    assert codec.swap_bytes(u8, "int32").tolist() == [4, 3, 2, 1, 8, 7, 6, 5]
    assert codec.swap_bytes(u8, "complex64").tolist() == [4, 3, 2, 1, 8, 7, 6, 5]
    assert codec.swap_bytes(u8, "int16").tolist() == [2, 1, 4, 3, 6, 5, 8, 7]
    assert codec.swap_bytes(u8, "uint8") is u8


# --------------------------------------------------------------------------- plain values


def test_tuples_lists_dicts() -> None:
    value = {
        "t": (1, (2, [3, (4,)]), ()),
        "l": [[], {}, ()],
        "d": {"x": {"y": {"z": [1.5, None, True, "s"]}}},
        "": "empty key",
    }
    out = roundtrip(value)
    assert same(out, value)
    assert type(out["t"]) is tuple and type(out["t"][1][1]) is list


def test_bytes_like() -> None:
    out = roundtrip([b"ab", bytearray(b"cd"), memoryview(b"ef"), b""])
    assert out == [b"ab", b"cd", b"ef", b""] and all(type(x) is bytes for x in out)
    grid = np.arange(6, dtype=np.uint16).reshape(2, 3)
    assert roundtrip(memoryview(grid)) == grid.tobytes()
    assert roundtrip(memoryview(grid[:, ::2])) == grid[:, ::2].tobytes()


def test_int_limits() -> None:
    for n in (2**64 - 1, 2**63, 2**63 - 1, -(2**63), 0, -1):
        assert same(roundtrip(n), n)
    for n in (2**64, -(2**63) - 1, 10**100):
        with pytest.raises(CodecError, match=r"value\['k'\]\[1\]: int") as info:
            encode({"k": [0, n]})
        assert not isinstance(info.value, UnsupportedType)


def test_subclasses_and_numpy_scalars() -> None:
    class Point(NamedTuple):
        x: int
        y: int

    value = [Point(1, 2), OrderedDict(a=1), np.float32(1.5), np.int64(-3), np.bool_(True)]
    out = roundtrip(value)
    assert same(out, [(1, 2), {"a": 1}, 1.5, -3, True])
    assert roundtrip(float("nan")) != roundtrip(float("nan"))  # NaN survives as a float


@pytest.mark.parametrize(
    ("value", "type_name", "path"),
    [
        ({"a": [0, {1, 2}]}, "'set'", "value['a'][1]"),
        ([object()], "'object'", "value[0]"),
        ({"x": {1: "one"}}, "'int'", "value['x']"),
        ((1, 2j), "'complex'", "value[1]"),
        ({"arr": np.array([None, 1], dtype=object)}, "'object'", "value['arr']"),
        ([np.array(["a"])], "'<U1'", "value[0]"),
        ([[np.complex64(1j)]], "'numpy.complex64'", "value[0][0]"),
        (len, "'builtin_function_or_method'", "value"),
        ({"s": torch.eye(2).to_sparse()}, "sparse_coo", "value['s']"),
        ([1, torch.empty(2, device="meta")], "meta", "value[1]"),
    ],
)
def test_refusals_name_type_and_path(value: Any, type_name: str, path: str) -> None:
    with pytest.raises(UnsupportedType) as info:
        encode(value)
    msg = str(info.value)
    assert type_name in msg and f"cannot send {path}:" in msg


def test_refuses_quantized_tensor() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated in torch
        q = torch.quantize_per_tensor(torch.tensor([1.0]), 0.1, 0, torch.qint8)
    with pytest.raises(UnsupportedType, match=r"value\['q'\]: .*torch\.qint8"):
        encode({"q": q})


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="compress"):
        encode(1, compress="zstd")
    with pytest.raises(ValueError):
        encode(1, max_depth=-1)


# --------------------------------------------------------------------------- depth


def nested_list(depth: int) -> Any:
    v: Any = 0
    for _ in range(depth):
        v = [v]
    return v


def test_depth_limit_on_encode() -> None:
    assert roundtrip(nested_list(64)) == nested_list(64)
    with pytest.raises(CodecError, match=r"value(\[0\]){64}: .*max_depth=64"):
        encode(nested_list(65))
    deep_tuple: Any = 0
    for _ in range(5):
        deep_tuple = (deep_tuple,)
    assert encode(deep_tuple, max_depth=5)
    with pytest.raises(CodecError, match=r"value\['a'\](\[0\]){4}: .*max_depth=5"):
        encode({"a": deep_tuple}, max_depth=5)  # the dict makes it 6 deep
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    with pytest.raises(CodecError, match="max_depth"):
        encode(cyclic)
    with pytest.raises(CodecError):
        encode(nested_list(5000), max_depth=10_000)  # beyond Python's recursion limit
    assert encode(torch.zeros(1), max_depth=0).buffers  # tensors are not containers


def test_depth_limit_on_decode_and_validate() -> None:
    ok = b"\x91" * 63 + b"\x90"  # 64 nested arrays
    validate(ok, 0)
    expected: Any = []
    for _ in range(63):
        expected = [expected]
    assert decode(Encoded(ok)) == expected
    too_deep = b"\x91" * 65 + b"\xc0"
    for fn in (lambda v: validate(v, 0), lambda v: decode(Encoded(v))):
        with pytest.raises(CodecError, match="max_depth=64"):
            fn(too_deep)
        with pytest.raises(CodecError):
            fn(b"\x91" * 100_000 + b"\xc0")  # beyond msgpack's own stack
    validate(b"\x81\xa1a\x91\x91\xc0", 0, max_depth=3)  # {"a": [[None]]}: 3 deep
    with pytest.raises(CodecError, match="max_depth=3"):
        validate(b"\x81\xa1a\x91\x91\x90", 0, max_depth=3)  # {"a": [[[]]]}: 4 deep
    # tuples count as containers: [(([],),)] is 4 deep, written by hand with ext 3
    t1 = bytes.fromhex("d503 9190")  # fixext 2, type 3: ([],)
    t2 = bytes.fromhex("c70503 91") + t1  # ext 8, 5 data bytes, type 3: (([],),)
    value = b"\x91" + t2
    validate(value, 0, max_depth=4)
    with pytest.raises(CodecError, match="max_depth=3"):
        validate(value, 0, max_depth=3)
    assert decode(Encoded(value)) == [(([],),)]


def test_hostile_tuple_chain_is_bounded() -> None:
    v = msgpack.packb(0)
    for _ in range(3000):  # would exhaust the Python stack if unpacked recursively
        v = msgpack.packb(msgpack.ExtType(EXT_TUPLE, b"\x91" + v))
    with pytest.raises(CodecError, match="max_depth"):
        validate(v, 0)
    with pytest.raises(CodecError, match="max_depth"):
        decode(Encoded(v))


# --------------------------------------------------------------------------- lz4


def test_lz4_roundtrip() -> None:
    zeros = torch.zeros(256, 1024)  # 1 MiB, very compressible
    noise = random_tensor("float32", (256, 1024), seed=1)  # incompressible
    small = torch.zeros(10)
    enc = encode({"z": zeros, "n": noise, "s": small}, compress="lz4")
    bz, bn, bs = enc.buffers
    assert bz.codec == "lz4" and bz.raw_nbytes == 1 << 20 and bz.nbytes < 10_000
    assert bn.codec is None and bn.nbytes == 1 << 20
    assert bs.codec is None and bs.nbytes == 40  # under compress_min_bytes
    for e in (enc, received(enc)):
        out = decode(e)
        assert torch.equal(out["z"], zeros) and torch.equal(bits(out["n"]), bits(noise))
        out["z"][0, 0] = 1  # decompressed tensors are writable
    arr = decode(encode(np.zeros(100_000), compress="lz4"))
    assert arr.flags.writeable and not arr.any()
    tiny = encode(torch.zeros(64), compress="lz4", compress_min_bytes=0)
    assert tiny.buffers[0].codec == "lz4" and torch.equal(decode(tiny), torch.zeros(64))
    assert encode(torch.zeros(0), compress="lz4", compress_min_bytes=0).buffers[0].codec is None


def lz4_tensor(n_floats: int, payload: bytes, raw_nbytes: int) -> Encoded:
    """A float32 tensor of n_floats whose buffer is the lz4 ``payload``."""
    value = desc_ext(["float32", [n_floats], 0])
    return Encoded(value, (Buffer(payload, "lz4", raw_nbytes),))


def test_lz4_size_lies() -> None:
    payload = lz4.block.compress(bytes(4096), store_size=False)
    assert decode(lz4_tensor(1024, payload, 4096)).shape == (1024,)
    with pytest.raises(CodecError, match="decompressed to 4096"):
        decode(lz4_tensor(1025, payload, 4100))  # claims more than it holds
    with pytest.raises(CodecError, match="lz4"):
        decode(lz4_tensor(1023, payload, 4092))  # claims less than it holds
    with pytest.raises(CodecError, match="needs 4096"):
        decode(lz4_tensor(1024, payload, 4092))  # disagrees with the shape
    with pytest.raises(CodecError, match="max_raw_bytes"):
        decode(lz4_tensor(1024, payload, 4096), max_raw_bytes=4000)
    with pytest.raises(CodecError, match="cannot hold"):
        decode(lz4_tensor(2**28, payload, 2**30))  # impossible ratio: refused before alloc
    with pytest.raises(CodecError, match="corrupt lz4"):
        decode(lz4_tensor(1024, b"\xff" * 20, 4096))
    with pytest.raises(CodecError, match="codec"):
        decode(Encoded(lz4_tensor(1, b"", 4).value, (Buffer(b"\0" * 4, "zstd", 4),)))


# --------------------------------------------------------------------------- malformed input


def test_decode_size_and_reference_checks() -> None:
    enc = encode(torch.zeros(4))
    with pytest.raises(CodecError, match="needs 16"):
        decode(Encoded(enc.value, (Buffer(b"\0" * 12),)))
    with pytest.raises(CodecError, match="claims"):
        decode(Encoded(enc.value, (Buffer(b"\0" * 12, None, 16),)))
    with pytest.raises(CodecError, match="out of range"):
        decode(Encoded(enc.value))
    twice = b"\x92" + bytes.fromhex(F32_PAIR_EXT) * 2
    with pytest.raises(CodecError, match="more than one"):
        decode(Encoded(twice, (Buffer(b"\0" * 8),)))
    with pytest.raises(CodecError, match="more than one"):
        validate(twice, 2)


def desc_ext(desc: Any, code: int = EXT_TENSOR) -> bytes:
    return msgpack.packb(msgpack.ExtType(code, msgpack.packb(desc)))


@pytest.mark.parametrize(
    ("value", "n_buffers", "match"),
    [
        (desc_ext(["float32", [2], 1]), 1, "index 1 is out of range"),
        (desc_ext(["float32", [2], -1]), 1, "out of range"),
        (desc_ext(["float32", [2], True]), 1, "out of range"),
        (desc_ext(["float8", [2], 0]), 1, "unknown dtype 'float8'"),
        (desc_ext(["bfloat16", [2], 0], EXT_NDARRAY), 1, "numpy"),
        (desc_ext(["float32", [-1], 0]), 1, "shape"),
        (desc_ext(["float32", [2.0], 0]), 1, "shape"),
        (desc_ext(["float32", 2, 0]), 1, "shape"),
        (desc_ext(["float32", [1] * 65, 0]), 1, "shape"),
        (desc_ext(["float32", [2]]), 1, "descriptor"),
        (desc_ext(["float32", [2], 0, 0]), 1, "descriptor"),
        (desc_ext(["float32", [2], 0]) + b"\x00", 1, "trailing"),
        (msgpack.packb(msgpack.ExtType(7, b"")), 0, "unknown ext type code 7"),
        (msgpack.packb(msgpack.Timestamp(1)), 0, "ext type code -1"),
        (msgpack.packb([1, msgpack.Timestamp(1)]), 0, "ext type code -1"),
        (msgpack.packb(msgpack.ExtType(3, b"\x01")), 0, "tuple"),
        (msgpack.packb(msgpack.ExtType(3, b"\x91")), 0, "malformed"),
        (msgpack.packb({b"k": 1}), 0, "not a str"),
        (b"\x81\x01\x02", 0, "malformed"),
        (b"\x01\x02", 0, "1 trailing bytes"),
        (b"\x93\x01", 0, "malformed"),
        (b"", 0, "malformed"),
        (b"\xc1", 0, "invalid msgpack"),
        (b"\xa1\xff", 0, "malformed"),
    ],
)
def test_validate_rejects(value: bytes, n_buffers: int, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        validate(value, n_buffers)
    buffers = tuple(Buffer(bytes(8)) for _ in range(n_buffers))
    with pytest.raises(CodecError):
        decode(Encoded(value, buffers))


def test_validate_accepts_what_encode_makes() -> None:
    value = {"a": (torch.zeros(2), [np.ones(3)]), "b": [torch.tensor(1), b"x", None, 2**64 - 1]}
    enc = encode(value)
    validate(enc.value, len(enc.buffers))
    validate(enc.value, len(enc.buffers) + 1)  # an unreferenced buffer is not an error
    with pytest.raises(CodecError, match="out of range"):
        validate(enc.value, len(enc.buffers) - 1)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=64))
def test_garbage_raises_only_codec_error(data: bytes) -> None:
    buffers = (Buffer(bytes(8)), Buffer(bytearray(4)))
    for fn in (lambda: decode(Encoded(data, buffers)), lambda: validate(data, 2)):
        try:
            fn()
        except CodecError:
            pass


_VALID = encode({"t": (torch.arange(3.0), np.arange(2, dtype=np.int16)), "l": [1, "x", b"y", None]})


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_mutated_encodings_raise_only_codec_error(data: st.DataObject) -> None:
    value = bytearray(_VALID.value)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(value) - 1))
        value[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(value)))
    for v in (bytes(value), bytes(value[:cut])):
        try:
            decode(Encoded(v, _VALID.buffers))
        except CodecError:
            pass
        try:
            validate(v, 2)
        except CodecError:
            pass


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
_trees = st.recursive(
    _scalars,
    lambda ch: (
        st.lists(ch, max_size=4)
        | st.lists(ch, max_size=4).map(tuple)
        | st.dictionaries(st.text(max_size=4), ch, max_size=4)
    ),
    max_leaves=16,
)


@settings(max_examples=60, deadline=None)
@given(_trees)
def test_roundtrip_property(value: Any) -> None:
    enc = encode(value)
    validate(enc.value, 0)
    assert same(decode(enc), value)


# --------------------------------------------------------------------------- Buffer/Encoded


def test_buffer_and_encoded() -> None:
    b = Buffer(b"abc")
    assert b.raw_nbytes == 3 and b.nbytes == 3 and b.codec is None
    grid = memoryview(np.zeros((2, 3), dtype=np.float32))
    g = Buffer(grid)
    assert isinstance(g.data, memoryview) and g.data.format == "B" and g.nbytes == 24
    assert Buffer(b"xy", "lz4", 100).raw_nbytes == 100
    with pytest.raises(ValueError):
        Buffer(memoryview(np.zeros((2, 3))[:, ::2]))
    if Buffer.__module__.endswith("_c"):  # read-only in the compiled twin (by convention in
        with pytest.raises(AttributeError):  # the .py, which pays no check per field)
            b.codec = "lz4"  # type: ignore[misc]
    enc = Encoded(b"\xc0", (b, Buffer(b"12345")))
    assert enc.nbytes == 1 + 3 + 5
    assert decode(Encoded(memoryview(b"\x92\x01\x02"))) == [1, 2]


# --------------------------------------------------------------------------- imports


def test_validate_does_not_import_torch_or_numpy() -> None:
    enc = encode({"t": torch.ones(2), "n": (np.zeros(3),)})
    script = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import tensorshare.wire.codec as codec
assert "torch" not in sys.modules, "import"
assert "numpy" not in sys.modules, "import"
codec.validate(bytes.fromhex({enc.value.hex()!r}), {len(enc.buffers)})
assert codec.decode(codec.Encoded(b"\\x92\\x01\\xa1a")) == [1, "a"]
assert "torch" not in sys.modules, "validate"
assert "numpy" not in sys.modules, "validate"
print("ok")
"""
    res = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"},
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_like_tensors_encode_at_once_as_each_would_alone() -> None:
    ts = [torch.arange(6, dtype=torch.float32).reshape(2, 3) + i for i in range(50)]
    encs = codec.encode_lone_tensors(ts)
    assert encs is not None and len(encs) == 50
    for t, e in zip(ts, encs, strict=True):
        alone = encode(t)
        assert e.value == alone.value and e.nbytes == alone.nbytes
        assert [bytes(b.data) for b in e.buffers] == [bytes(b.data) for b in alone.buffers]
        assert all(b.data.readonly and b.codec is None for b in e.buffers)
    before = bytes(encs[0].buffers[0].data)
    ts[0].add_(100)  # the batch was copied once: later changes to a tensor do not show
    assert bytes(encs[0].buffers[0].data) == before
    # Anything else is encoded one by one (None: the caller falls back).
    for odd in ([torch.ones(2), torch.ones(3)],
                [torch.ones(2), torch.ones(2, dtype=torch.float64)],
                [torch.ones(2, requires_grad=True), torch.ones(2)],
                [torch.ones(2), torch.ones(2).requires_grad_()],
                [torch.ones(2), [1.0]],
                [torch.ones(2, dtype=torch.bfloat16)] * 2,
                [torch.ones(0)] * 2, []):
        assert codec.encode_lone_tensors(odd) is None, odd


def test_decode_many_is_decode_of_each_on_fresh_memory() -> None:
    values = [torch.full((3,), float(i)) for i in range(5)] + [
        {"a": torch.ones(2)}, torch.zeros(2, 2, dtype=torch.int64), 7, torch.ones(3),
        torch.ones(3, dtype=torch.float64), np.arange(4)]
    # as a client receives them: each buffer writable memory of its own
    received = [Encoded(e.value, tuple(Buffer(memoryview(bytearray(b.data))) for b in e.buffers))
                for e in (encode(v) for v in values)]
    many = codec.decode_many(received)
    one_by_one = [decode(e) for e in received]
    assert len(many) == len(values)
    for got, each, want in zip(many, one_by_one, values, strict=True):
        assert type(got) is type(want)
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want) and got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(each, want)
        elif isinstance(want, dict):
            assert torch.equal(got["a"], want["a"])
        elif isinstance(want, np.ndarray):
            assert np.array_equal(got, want)
        else:
            assert got == want
    many[0].add_(1)  # each tensor its own memory
    assert torch.equal(many[1], values[1]) and many[0][0] == 1.0


def test_decode_stacked_is_torch_stack_of_each_decode() -> None:
    from tensorshare.wire.codec import decode_stacked

    values = [{"obs": torch.randn(3, 2), "a": torch.tensor(i), "done": torch.tensor(i % 2 == 0)}
              for i in range(5)]
    encs = [codec.encode(v) for v in values]
    stacked = decode_stacked(encs)
    assert set(stacked) == {"obs", "a", "done"}
    for k in stacked:
        expected = torch.stack([codec.decode(e)[k] for e in encs])
        assert stacked[k].dtype == expected.dtype and torch.equal(stacked[k], expected)
    lone = [codec.encode(torch.full((4,), float(i))) for i in range(3)]
    assert torch.equal(decode_stacked(lone), torch.stack([codec.decode(e) for e in lone]))
    # Not like values, or not tensors: None (decoded one by one instead).
    assert decode_stacked([codec.encode(torch.ones(2)), codec.encode(torch.ones(3))]) is None
    assert decode_stacked([codec.encode({"x": 1})] * 2) is None
    assert decode_stacked([codec.encode([torch.ones(2)])] * 2) is None
    assert decode_stacked([]) is None
    short = codec.Encoded(encs[0].value, (codec.Buffer(b"\0" * 4),) + encs[0].buffers[1:])
    assert decode_stacked([encs[0], short]) is None  # a buffer of the wrong size
