"""A lone tensor on the wire, without detours: one table of dtypes, its value tree made once per
dtype and shape, its bytes sent from its own memory and received into a tensor of the buffer.

Most values are one plain CPU tensor (parameters, an observation, a rollout step). The general
codec (:mod:`.codec`) walks a value, builds its tree and packs it; for a lone tensor this
module does the same in a few steps, with the same bytes (``tests/wire/test_codec.py`` checks
the two against each other):

* :func:`encode_tensor`: the tree of its (dtype, shape), made once and kept; the buffer a
  read-only view of the tensor's own memory (no copy);
* :func:`decode_tensor`: a tree seen before (:func:`remember`) gives the dtype, the shape and
  the size at once; the tensor is built on the received buffer (no copy when it is
  writable, one copy when it is not).

The table of wire dtypes (:data:`ITEMSIZE`, :func:`torch_dtypes`) lives here and is the
codec's. torch is imported by neither module: it is found in ``sys.modules`` when a value
holds a tensor, or imported when a received tree holds one.
"""

from __future__ import annotations

import sys
from typing import Any

import msgpack

from ..errors import CodecError
from .records import Buffer, Encoded, encoded_of, raw_buffer

__all__ = ["DTYPES", "EXT_TENSOR", "ITEMSIZE", "decode_tensor", "encode_tensor", "remember",
           "torch_dtype", "torch_dtypes", "writable_raw"]

EXT_TENSOR = 1

#: Wire dtype name -> bytes per element, in the documented order of :data:`DTYPES`.
ITEMSIZE: dict[str, int] = {
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "bfloat16": 2,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
}
DTYPES: tuple[str, ...] = tuple(ITEMSIZE)

BIG_ENDIAN_HOST = sys.byteorder == "big"
# One LZ4 input byte can never expand to more than 255 output bytes, so a claimed raw size
# above this is a lie; checked before allocating the output buffer.
LZ4_MAX_RATIO = 255

# The value trees of lone tensors, by (dtype, shape) (one tensor of the same kind again and
# again is the common case, and its tree is the same bytes), and the other way, for decoding:
# tree -> (wire dtype, shape, elements, itemsize, torch dtype or None until first needed);
# None: a small tree known not to be a lone tensor.
_TREES: dict[tuple[Any, Any], bytes] = {}
_SHAPES: dict[bytes, list[Any] | None] = {}
TREES_MAX = 4096

_dtype_maps: tuple[dict[Any, str], dict[str, Any]] | None = None


def torch_dtypes(torch: Any) -> tuple[dict[Any, str], dict[str, Any]]:
    """(torch dtype -> wire name, wire name -> torch dtype), built once.

    Built lazily because torch must not be imported with the wire; dtypes this torch lacks
    (old builds without uint16/32/64) are simply missing from both maps.
    """
    global _dtype_maps
    if _dtype_maps is None:
        to_name: dict[Any, str] = {}
        for name in DTYPES:
            dt = getattr(torch, name, None)
            if isinstance(dt, torch.dtype):
                to_name[dt] = name
        _dtype_maps = (to_name, {v: k for k, v in to_name.items()})
    return _dtype_maps


def encode_tensor(x: Any) -> Encoded | None:
    """Encode ``x`` (a ``torch.Tensor``, not a subclass) when it is one plain contiguous CPU
    tensor of a wire dtype other than bfloat16, with elements; ``None`` otherwise (the
    general codec encodes it then, and says why it cannot be sent if it cannot)."""
    tree = _TREES.get((x.dtype, x.shape))
    if tree is None:
        tree = _tree_of(x)
        if tree is None:
            return None
    try:
        # numpy() refuses what must not be sent from its memory as it is (a tensor that
        # requires grad, one with the conjugate or negative bit, one not on the CPU, a
        # sparse one), and a cast to bytes refuses a view that is not contiguous.
        view = memoryview(x.numpy()).cast("B").toreadonly()
    except (RuntimeError, TypeError, ValueError):
        return None
    n = len(view)
    return encoded_of(tree, (raw_buffer(view, n),), len(tree) + n)


def _tree_of(x: Any) -> bytes | None:
    """The tree of a lone tensor of ``x``'s dtype and shape (kept for the next), or
    ``None`` when ``x`` is not one this module sends."""
    if BIG_ENDIAN_HOST or not x.numel():
        return None
    torch = sys.modules["torch"]
    name = torch_dtypes(torch)[0].get(x.dtype)
    if name is None or name == "bfloat16":
        return None
    shape = list(x.shape)
    tree: bytes = msgpack.packb(msgpack.ExtType(EXT_TENSOR, msgpack.packb([name, shape, 0])),
                                use_bin_type=True)
    if len(_TREES) < TREES_MAX:
        _TREES[(x.dtype, x.shape)] = tree
    return tree


def remember(tree: bytes, name: str | None, shape: tuple[int, ...]) -> None:
    """Note what ``tree`` is: a lone tensor of ``name`` and ``shape`` (checked by the codec),
    or (``name`` None) a small tree that is not one."""
    if len(_SHAPES) >= TREES_MAX:
        return
    if name is None:
        _SHAPES[tree] = None
        return
    n = 1
    for d in shape:
        n *= d
    _SHAPES[tree] = [name, shape, n, ITEMSIZE[name], None]


def known(tree: bytes) -> bool:
    """Whether :func:`remember` was told about ``tree``."""
    return tree in _SHAPES


def lone_of(tree: bytes) -> list[Any] | None:
    """``[dtype name, shape, elements, itemsize, torch dtype or None]`` of a lone tensor's
    ``tree`` seen before, else ``None``."""
    return _SHAPES.get(tree)


def decode_tensor(enc: Encoded, max_raw_bytes: int) -> Any:
    """The tensor of ``enc`` when its tree is a lone tensor seen before (:func:`remember`)
    with one buffer, else ``None`` (the general codec decodes it then).

    Raises:
        CodecError: the buffer does not hold the tensor's bytes (or cannot be decompressed).
    """
    lone = _SHAPES.get(enc.value)
    if lone is None or len(enc.buffers) != 1:
        return None
    name, shape, n, itemsize, dtype = lone
    raw = writable_raw(enc.buffers[0], n * itemsize, max_raw_bytes)
    if dtype is None:
        dtype = lone[4] = torch_dtype(name)
    return make_tensor(dtype, name, shape, n, itemsize, raw)


def torch_dtype(name: str) -> Any:
    """The torch dtype of wire dtype ``name`` (:class:`CodecError` where torch is missing or
    lacks it)."""
    try:
        import torch
    except ImportError:
        raise CodecError("the value holds a torch tensor but torch is not installed") from None
    dtype = torch_dtypes(torch)[1].get(name)
    if dtype is None:
        raise CodecError(f"this torch has no dtype {name!r}")
    return dtype


def make_tensor(dtype: Any, name: str, shape: Any, n: int, itemsize: int, raw: Any) -> Any:
    """A tensor of ``shape`` on ``raw`` (writable, ``n * itemsize`` bytes)."""
    torch = sys.modules["torch"]
    if n == 0:
        return torch.empty(shape, dtype=dtype)  # frombuffer refuses count=0
    if BIG_ENDIAN_HOST and itemsize > 1:
        u8 = swap_bytes(torch.frombuffer(raw, dtype=torch.uint8), name)
        return u8.view(dtype).reshape(shape)
    t = torch.frombuffer(raw, dtype=dtype, count=n)
    if itemsize > 1 and t.data_ptr() % itemsize:
        # A buffer slice at an odd offset: some kernels assume aligned elements.
        t = t.clone()
    return t if len(shape) == 1 else t.reshape(shape)


def swap_bytes(u8: Any, name: str) -> Any:
    """Byte-swap every element of a flat uint8 torch tensor holding ``name`` elements.

    Only needed on big-endian hosts (the wire is little-endian). Complex numbers are
    swapped per component so real and imaginary parts keep their places.
    """
    group = ITEMSIZE[name] // 2 if name.startswith("complex") else ITEMSIZE[name]
    if group == 1:
        return u8
    return u8.reshape(-1, group).flip(-1).reshape(-1).contiguous()


def writable_raw(buf: Buffer, expected: int, max_raw_bytes: int) -> Any:
    """The buffer's decompressed bytes in writable memory (``bytearray`` or memoryview).

    A writable buffer is used as it is (zero copy); read-only data is copied once.

    Raises:
        CodecError: it does not hold ``expected`` bytes, or cannot be decompressed.
    """
    if buf.raw_nbytes != expected:
        raise CodecError(f"buffer holds {buf.raw_nbytes} bytes but the tensor needs {expected}")
    data = buf.data
    if type(data) is memoryview and buf.codec is None and not data.readonly and \
            data.format == "B" and data.ndim == 1 and len(data) == expected:
        return data  # (the usual case: a received buffer, as it is)
    if buf.codec is None:
        if len(data) != expected:
            raise CodecError(f"raw buffer holds {len(data)} bytes but claims {buf.raw_nbytes}")
        if type(data) is bytearray:
            return data
        if type(data) is not memoryview:
            data = memoryview(data)
        if data.readonly:
            return bytearray(data)
        if data.ndim != 1 or data.format != "B":
            data = data.cast("B")
        return data
    if buf.codec == "lz4":
        return _lz4_raw(data, expected, max_raw_bytes)
    raise CodecError(f"unknown buffer codec {buf.codec!r}")


def _lz4_raw(data: Any, expected: int, max_raw_bytes: int) -> bytearray:
    if expected > max_raw_bytes:
        raise CodecError(f"buffer of {expected} bytes exceeds max_raw_bytes={max_raw_bytes}")
    if expected > LZ4_MAX_RATIO * len(data) + LZ4_MAX_RATIO:
        raise CodecError(f"lz4 buffer of {len(data)} bytes cannot hold {expected} bytes")
    if expected == 0:
        return bytearray()
    lz4_block = lz4()
    try:
        out: bytearray = lz4_block.decompress(data, uncompressed_size=expected,
                                              return_bytearray=True)
    except lz4_block.LZ4BlockError as exc:
        raise CodecError(f"corrupt lz4 buffer: {exc}") from None
    if len(out) != expected:
        raise CodecError(f"lz4 buffer decompressed to {len(out)} bytes, not {expected}")
    return out


def lz4() -> Any:
    """``lz4.block``, imported on first use (it is only needed with compression)."""
    try:
        import lz4.block
    except ImportError as exc:  # pragma: no cover - lz4 is a dependency
        raise CodecError("lz4 compression needs the 'lz4' package") from exc
    return lz4.block
