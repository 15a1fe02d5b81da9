"""Turn a Python value into wire bytes (a msgpack value tree plus raw tensor buffers) and back.

Wire format (the spec another-language client implements)
=========================================================

An encoded value is one msgpack byte string (the *value tree*) plus an ordered list of
raw byte buffers. The tree is packed with the msgpack "bin" type for bytes and "str"
(UTF-8) for text:

* ``nil``, ``bool``, ``int`` (fits in int64 or uint64), ``float`` (float64), ``str``,
  ``bin`` (bytes) are themselves.
* array -> list; map -> dict whose keys are all ``str``.
* ext type 3 (``EXT_TUPLE``): the ext data is a msgpack array whose items follow these
  same rules; it stands for a tuple.
* ext type 1 (``EXT_TENSOR``, a torch tensor) and ext type 2 (``EXT_NDARRAY``, a numpy
  array): the ext data is the msgpack array ``[dtype, shape, buffer_index]`` where
  ``dtype`` is one of ``DTYPES`` (str), ``shape`` is an array of non-negative ints and
  ``buffer_index`` an int in ``[0, len(buffers))``. The buffer holds the elements in
  C (row-major) order, little-endian, ``prod(shape) * itemsize`` bytes. ``bool`` is one
  byte per element (0 or 1); ``bfloat16`` is the upper half of a float32; complex is
  (real, imag) pairs. Each buffer is referenced by at most one tensor. ``bfloat16`` is
  not allowed for ext 2 (numpy has no such dtype).
* ext type 4 (``EXT_CUDA_IPC``, a CUDA tensor in another process's GPU memory on this
  host): the ext data is a msgpack map of exactly the keys of :data:`CUDA_IPC_FIELDS`
  (docs/PROTOCOL.md §5.2): where the memory is (GPU UUID, boot id, producer pid, the
  CUDA IPC handle and its storage), the tensor's dtype, shape, strides and offset, and the
  ring slot and generation it was written with. It refers to no buffer. Only a client on
  the producer's host (over ``unix://``) can read it; a server checks and stores it as it is.
* No other ext type (including the msgpack timestamp, -1) is allowed. Containers (array,
  map, tuple) nest at most ``max_depth`` deep (64 by default); the root container is at
  depth 1, tensors do not count.

A buffer travels either raw or compressed with LZ4 *block* format (no frame, no size
prefix); its header (outside this module) then carries ``codec="lz4"`` and the raw size.

Only msgpack is imported with this module: lz4 is imported on first compression, torch and
numpy only when a value to send already holds one of their objects or a decoded tree holds
one, so a server can call :func:`validate` without ever importing torch.
"""

from __future__ import annotations

import math
import reprlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from ..errors import CodecError, NestingTooDeep, TensorShareError, UnsupportedType
from .records import Buffer, Encoded, encoded_of, raw_buffer
from .tensors import (
    BIG_ENDIAN_HOST,
    DTYPES,
    EXT_TENSOR,
    ITEMSIZE,
    decode_tensor,
    encode_tensor,
    known,
    lone_of,
    lz4,
    make_tensor,
    remember,
    swap_bytes,
    torch_dtype,
    torch_dtypes,
    writable_raw,
)

__all__ = [
    "DEFAULT_MAX_DEPTH",
    "DTYPES",
    "CUDA_IPC_FIELDS",
    "EXT_CUDA_IPC",
    "EXT_NDARRAY",
    "EXT_TENSOR",
    "EXT_TUPLE",
    "CUDA_IPC_REMOTE",
    "Buffer",
    "Encoded",
    "check_cuda_ipc",
    "decode",
    "decode_stacked",
    "decode_many",
    "describe",
    "encode",
    "encode_lone_tensors",
    "encoded_of",
    "raw_buffer",
    "validate",
]

DEFAULT_MAX_DEPTH = 64
EXT_NDARRAY = 2
EXT_TUPLE = 3
EXT_CUDA_IPC = 4

#: The keys of a CUDA IPC descriptor (ext 4) and what each must be: ``bin``/N: bytes of
#: exactly N (``bin<=N``: 1 to N) bytes; ``int``: an int >= 0 (``int>0``: >= 1); ``dims``: a
#: list of at most 64 ints >= 0. See docs/PROTOCOL.md §5.2.
CUDA_IPC_FIELDS: dict[str, str] = {
    "v": "int>0",  # the descriptor's version: 1
    "uuid": "bin16",  # the GPU's UUID (the same GPU, whatever CUDA_VISIBLE_DEVICES says)
    "boot": "bin16",  # the host's boot id (/proc/sys/kernel/random/boot_id): the same host
    "pid": "int>0",  # the producer's process id
    "ring": "bin16",  # the producer's ring, a random id
    "gfd": "int",  # the descriptor of the ring's generation table in the producer
    "h": "bin<=256",  # the CUDA IPC memory handle of the ring's storage (opaque)
    "ssize": "int",  # the storage's size in bytes
    "soff": "int",  # the storage's offset in the memory the handle exports
    "ev": "bin64",  # the interprocess event recorded after this item was written
    "dtype": "dtype",  # a wire dtype name
    "shape": "dims",
    "stride": "dims",  # in elements, one per dimension
    "off": "int",  # the tensor's first element in the storage, in elements
    "slot": "int",  # the ring slot it is in
    "gen": "int>0",  # the generation it was written with (the slot's when it is valid)
}

# Wire dtype name -> bytes per element (the table lives in .tensors), in DTYPES' order.
_ITEMSIZE = ITEMSIZE
# numpy has no native bfloat16, so arrays may use every wire dtype but that one.
_NUMPY_DTYPES = frozenset(DTYPES) - {"bfloat16"}

_INT_MIN = -(1 << 63)  # int64 min
_UINT_MAX = (1 << 64) - 1  # uint64 max
_DIM_MAX = (1 << 63) - 1  # a dimension must fit an int64 on every receiver
_MAX_NDIM = 64  # numpy 2's limit; far above any real tensor, and bounds descriptor work
# LZ4 block compression refuses inputs above LZ4_MAX_INPUT_SIZE; such buffers stay raw.
_LZ4_MAX_INPUT = 0x7E000000
# compress="auto" compresses only buffers of these dtypes (integers, bool: frames, masks,
# token ids compress; float noise does not) and keeps a result only when it saves at least
# one eighth of the bytes.
_AUTO_DTYPES = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                          "uint64", "bool"})
_BIG_ENDIAN_HOST = BIG_ENDIAN_HOST

_SUPPORTED = (
    "None, bool, int, float, str, bytes, list, tuple, dict with str keys, "
    "torch.Tensor, numpy.ndarray"
)
# Types packed as they are: they need no conversion and cannot nest.
_PLAIN: frozenset[type] = frozenset({str, float, bool, type(None), bytes, bytearray})
# Leaf types a numpy scalar's .item() may give that we accept.
_NUMPY_ITEM_OK: frozenset[type] = frozenset({bool, int, float, str, bytes})

_short_repr = reprlib.Repr()
_short_repr.maxstring = 40
_short_repr.maxother = 40


# --------------------------------------------------------------------------- helpers


def _type_name(obj: object) -> str:
    """``'set'`` for builtins, ``'numpy.ndarray'`` for anything else."""
    cls = type(obj)
    mod = cls.__module__
    return cls.__qualname__ if mod == "builtins" else f"{mod}.{cls.__qualname__}"


_torch_dtypes = torch_dtypes


class _Refusal(Exception):
    """Internal: a value was refused; carries the path back up to :func:`encode`.

    Containers append their key while the exception unwinds, so the happy path pays
    nothing for path tracking.
    """

    def __init__(self, kind: type[CodecError], detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail
        self.parts: list[str] = []

    def error(self) -> CodecError:
        path = "value" + "".join(reversed(self.parts))
        return self.kind(f"cannot send {path}: {self.detail}")


# --------------------------------------------------------------------------- encode


class _Encoder:
    """Walks a value, turning it into a tree msgpack can pack, collecting buffers."""

    __slots__ = (
        "buffers",
        "compress",
        "min_bytes",
        "max_depth",
        "torch",
        "tensor_type",
        "np",
        "ndarray_type",
        "stage",
    )

    def __init__(self, compress: str | None, min_bytes: int, max_depth: int,
                 stage: Callable[[Any], Any] | None = None) -> None:
        self.stage = stage
        self.buffers: list[Buffer] = []
        self.compress = compress
        self.min_bytes = min_bytes
        self.max_depth = max_depth
        # If torch/numpy were never imported, no value can hold their objects: looking in
        # sys.modules avoids importing them (and keeps this module light).
        self.torch = sys.modules.get("torch")
        self.tensor_type = getattr(self.torch, "Tensor", None)
        self.np = sys.modules.get("numpy")
        self.ndarray_type: Any = getattr(self.np, "ndarray", None)

    def walk(self, x: Any, depth: int) -> Any:
        """Convert ``x`` (at container depth ``depth``) into a packable tree."""
        t = type(x)
        if t in _PLAIN:
            return x
        if t is int:
            if _INT_MIN <= x <= _UINT_MAX:
                return x
            raise _Refusal(
                CodecError,
                f"int needs {x.bit_length()} bits (must fit in int64 or uint64)",
            )
        if t is dict:
            return self.walk_dict(x, depth + 1)
        if t is list:
            return self.walk_seq(x, depth + 1)
        if t is tuple:
            return msgpack.ExtType(
                EXT_TUPLE, msgpack.packb(self.walk_seq(x, depth + 1), use_bin_type=True)
            )
        return self.walk_other(x, depth)

    def check_depth(self, depth: int) -> None:
        if depth > self.max_depth:
            raise _Refusal(NestingTooDeep, f"nesting deeper than max_depth={self.max_depth} containers")

    def walk_seq(self, x: list[Any] | tuple[Any, ...], depth: int) -> list[Any]:
        self.check_depth(depth)
        out: list[Any] = []
        append = out.append
        plain = _PLAIN
        i = 0
        try:
            for i, v in enumerate(x):  # noqa: B007 - i is read by the except clause
                append(v if type(v) in plain else self.walk(v, depth))
        except _Refusal as e:
            e.parts.append(f"[{i}]")
            raise
        return out

    def walk_dict(self, x: dict[Any, Any], depth: int) -> dict[str, Any]:
        self.check_depth(depth)
        out: dict[str, Any] = {}
        plain = _PLAIN
        for k, v in x.items():
            if type(k) is not str:
                if not isinstance(k, str):
                    raise _Refusal(
                        UnsupportedType,
                        f"dict key {_short_repr.repr(k)} has type {_type_name(k)!r}; "
                        "only str keys are supported",
                    )
                k = str(k)  # a str subclass (e.g. StrEnum) travels as a plain str
            try:
                out[k] = v if type(v) in plain else self.walk(v, depth)
            except _Refusal as e:
                e.parts.append(f"[{k!r}]")
                raise
        return out

    def walk_other(self, x: Any, depth: int) -> Any:
        """The slow path: tensors, arrays, memoryviews, numpy scalars, subclasses."""
        if self.tensor_type is not None and isinstance(x, self.tensor_type):
            return self.tensor(x)
        if self.np is not None:
            if isinstance(x, self.ndarray_type):
                return self.ndarray(x)
            if isinstance(x, self.np.generic):
                item = x.item()
                if type(item) not in _NUMPY_ITEM_OK:
                    raise _Refusal(
                        UnsupportedType,
                        f"type {_type_name(x)!r} is not supported (supported: {_SUPPORTED})",
                    )
                return self.walk(item, depth)
        ipc = getattr(type(x), "__tensorshare_cuda_ipc__", None)
        if ipc is not None:  # a tensor in a CUDA IPC ring (tensorshare.memory.ipc)
            fields = ipc(x)
            try:
                check_cuda_ipc(fields)
            except CodecError as exc:
                raise _Refusal(CodecError, str(exc)) from None
            return msgpack.ExtType(EXT_CUDA_IPC, msgpack.packb(fields, use_bin_type=True))
        if isinstance(x, memoryview):
            # msgpack takes any C-contiguous buffer as raw bytes; others need a copy.
            return x if x.c_contiguous else x.tobytes()
        # Subclasses of supported types travel as their base type (a namedtuple arrives
        # as a tuple, an OrderedDict as a dict, an IntEnum as an int).
        if isinstance(x, int):
            return self.walk(int(x), depth)
        if isinstance(x, float):
            return float(x)
        if isinstance(x, str):
            return str(x)
        if isinstance(x, (bytes, bytearray)):
            return bytes(x)
        if isinstance(x, dict):
            return self.walk_dict(x, depth + 1)
        if isinstance(x, list):
            return self.walk_seq(x, depth + 1)
        if isinstance(x, tuple):
            return self.walk(tuple(x), depth)
        raise _Refusal(
            UnsupportedType,
            f"type {_type_name(x)!r} is not supported (supported: {_SUPPORTED})",
        )

    def tensor(self, x: Any) -> msgpack.ExtType:
        torch = self.torch
        assert torch is not None
        if (type(x) is torch.Tensor and x.is_cpu and not x.requires_grad
                and x.layout is torch.strided and x.is_contiguous() and not x.is_conj()
                and not x.is_neg() and not _BIG_ENDIAN_HOST and x.numel()):
            # The common case (a plain contiguous CPU tensor) in a third of the time: its
            # numpy view already spans exactly its own bytes.
            name = _torch_dtypes(torch)[0].get(x.dtype)
            if name is not None and name != "bfloat16":  # numpy has no bfloat16
                view = memoryview(x.numpy()).cast("B")
                return self.add_buffer(EXT_TENSOR, name, list(x.shape), view)
        t = x.detach()
        if t.layout is not torch.strided:
            raise _Refusal(
                UnsupportedType,
                f"torch.Tensor with layout {t.layout} is not supported (only dense, "
                "strided tensors are; call .to_dense() first)",
            )
        to_name = _torch_dtypes(torch)[0]
        name = to_name.get(t.dtype)
        if name is None:
            raise _Refusal(
                UnsupportedType,
                f"torch.Tensor dtype {t.dtype} is not supported "
                f"(supported: {', '.join(to_name.values())})",
            )
        if not t.is_cpu:
            if t.is_meta:
                raise _Refusal(UnsupportedType, "a meta tensor has no data to send")
            # Data always travels from host memory; the receiver gets a CPU tensor (a read
            # with device= moves it to a device again). ``stage`` copies it once into the
            # memory it is sent from (memory.device: a memfd or pinned memory).
            if self.stage is not None and not _BIG_ENDIAN_HOST:
                t = t.resolve_conj().resolve_neg().contiguous()
                staged = self.stage(t)
                if staged is not None:
                    view, shared = staged
                    return self.add_buffer(EXT_TENSOR, name, list(t.shape), view, shared)
            t = t.cpu()
        # Materialise lazy conjugate/negative views: the bytes must be the real values.
        t = t.resolve_conj().resolve_neg()
        if not t.is_contiguous():
            t = t.contiguous()  # copies only the viewed elements
        shape = list(t.shape)
        # reshape(-1) is a view for a contiguous tensor (and makes 0-d tensors 1-d);
        # viewing as uint8 first lets numpy expose dtypes it lacks (bfloat16). The
        # numpy array keeps the tensor alive and only spans this tensor's elements,
        # not the whole storage of a sliced tensor.
        u8 = t.reshape(-1).view(torch.uint8)
        if _BIG_ENDIAN_HOST:
            u8 = swap_bytes(u8, name)
        try:
            data: memoryview | bytes = memoryview(u8.numpy())
        except (RuntimeError, TypeError):
            # torch without numpy: fall back to one copy of the bytes.
            import ctypes

            data = ctypes.string_at(u8.data_ptr(), u8.numel()) if u8.numel() else b""
        return self.add_buffer(EXT_TENSOR, name, shape, data)

    def ndarray(self, x: Any) -> msgpack.ExtType:
        np = self.np
        assert np is not None
        ma = sys.modules.get("numpy.ma")  # numpy 2 imports numpy.ma lazily; avoid it
        if ma is not None and isinstance(x, ma.MaskedArray):
            raise _Refusal(
                UnsupportedType, "numpy masked arrays are not supported (the mask would be lost)"
            )
        if type(x) is not np.ndarray:
            x = x.view(np.ndarray)  # e.g. np.matrix, whose reshape(-1) stays 2-D
        dt = x.dtype
        name = dt.name
        if name not in _NUMPY_DTYPES or dt.fields is not None:
            raise _Refusal(
                UnsupportedType,
                f"numpy.ndarray dtype {str(dt)!r} is not supported "
                f"(supported: {', '.join(n for n in DTYPES if n in _NUMPY_DTYPES)})",
            )
        shape = list(x.shape)
        if dt.byteorder == ">" or (dt.byteorder == "=" and _BIG_ENDIAN_HOST):
            x = x.astype(dt.newbyteorder("<"), order="C")  # the wire is little-endian
        elif not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        data = memoryview(x.reshape(-1).view(np.uint8))
        return self.add_buffer(EXT_NDARRAY, name, shape, data)

    def add_buffer(
        self, code: int, name: str, shape: list[int], data: memoryview | bytes,
        shared: Any = None,
    ) -> msgpack.ExtType:
        if shared is not None:  # in a sealed memfd already: it travels as it is
            index = len(self.buffers)
            self.buffers.append(Buffer(data, None, len(data), shared))
            return msgpack.ExtType(code, msgpack.packb([name, shape, index]))
        if type(data) is memoryview:
            # Read-only: nobody may write into the sender's tensor through the buffer,
            # and decode() copies read-only buffers, so an in-process round trip never
            # aliases the original.
            data = data.toreadonly()
        n = data.nbytes if type(data) is memoryview else len(data)
        buf = None
        auto = self.compress == "auto"
        if self.compress is not None and self.min_bytes <= n <= _LZ4_MAX_INPUT and \
                (not auto or name in _AUTO_DTYPES):
            packed = _lz4_block().compress(data, store_size=False)
            if len(packed) < (n - (n >> 3) + 1 if auto else n):  # keep it only when it pays
                buf = Buffer(packed, "lz4", n)
        index = len(self.buffers)
        self.buffers.append(buf if buf is not None else Buffer(data, None, n))
        return msgpack.ExtType(code, msgpack.packb([name, shape, index]))


def encode_lone_tensors(tensors: Sequence[Any]) -> list[Encoded] | None:
    """Encode tensors of one dtype and shape as :func:`encode` encodes each lone one (the
    same trees, the same bytes), their data copied once, together, into one buffer that the
    results' buffers are views of: for many small tensors (a batch of appends), far cheaper
    than a view of each.

    Returns:
        One :class:`Encoded` per tensor, or ``None`` when they are not all plain CPU tensors
        of the first one's dtype and shape (encode them one by one then).
    """
    torch = sys.modules.get("torch")
    if torch is None or not tensors or type(tensors[0]) is not torch.Tensor:
        return None
    first = tensors[0]
    dtype, shape = first.dtype, first.shape
    for t in tensors:
        if type(t) is not torch.Tensor or t.dtype is not dtype or t.shape != shape:
            return None
    lone = encode_tensor(first)  # checks the first fully, and gives the tree
    if lone is None:
        return None
    try:
        stacked = torch.stack(list(tensors))  # one copy of them all
    except (RuntimeError, TypeError):  # another device among them, say
        return None
    if not stacked.is_cpu or stacked.requires_grad or stacked.layout is not torch.strided:
        return None
    tree = lone.value
    n = lone.buffers[0].raw_nbytes
    view = memoryview(stacked.reshape(-1).numpy()).cast("B").toreadonly()
    size = len(tree) + n
    return [encoded_of(tree, (raw_buffer(view[i * n:(i + 1) * n], n),), size)
            for i in range(len(tensors))]


_lz4_block = lz4


def _bad_options(compress: str | None) -> ValueError:
    """:func:`encode`'s error for options it does not take (a rare branch, kept out of its
    way)."""
    if compress not in (None, "lz4", "auto"):
        return ValueError(f"unknown compress {compress!r} (use None, 'lz4' or 'auto')")
    return ValueError("compress_min_bytes and max_depth must be >= 0")


def _too_deep(max_depth: int) -> CodecError:
    """:func:`encode`'s error for a value nested deeper than Python's recursion allows."""
    return CodecError(f"cannot send value: nested too deeply for max_depth={max_depth}")


def encode(
    value: Any,
    *,
    compress: str | None = None,
    compress_min_bytes: int = 65536,
    max_depth: int = DEFAULT_MAX_DEPTH,
    stage: Callable[[Any], Any] | None = None,
) -> Encoded:
    """Encode a value for the wire.

    Tensor and array data is not copied when it is already contiguous on the CPU: the
    buffers are read-only memoryviews that keep the source alive. Do not modify the
    source tensors until the buffers have been sent.

    Args:
        value: None, bool, int, float, str, bytes-like, list, tuple, dict with str
            keys, torch.Tensor or numpy.ndarray, nested freely (up to ``max_depth``).
            Numpy scalars travel as Python scalars; subclasses of the builtin types
            travel as the base type. Tensors lose ``requires_grad`` and their device
            (they arrive on the CPU).
        compress: ``None``; ``"lz4"``: compress each buffer of at least
            ``compress_min_bytes`` bytes, keeping the result only when it is smaller;
            ``"auto"``: the same, only for buffers of integer and bool dtypes, keeping the
            result only when it saves at least an eighth (floats are never compressed).
        compress_min_bytes: the smallest buffer worth compressing.
        max_depth: the deepest container nesting allowed (the root container is 1).
        stage: for a tensor that is not on the CPU: ``stage(t)`` (``t`` contiguous) copies
            it into host memory it is sent from and returns ``(view, shared)`` (``shared``:
            the sealed memfd holding it, or ``None``), or returns ``None`` (then ``t.cpu()``;
            see :class:`tensorshare.memory.device.Stager`).

    Returns:
        The :class:`Encoded` value tree and buffers.

    Raises:
        UnsupportedType: a type, dict key type, or tensor dtype/layout that cannot be
            sent; the message names it and where it was, e.g. ``value['a'][1]``.
        CodecError: nesting deeper than ``max_depth``, or an int outside int64/uint64.
        ValueError: an unknown ``compress`` value or a negative limit.
    """
    if compress not in (None, "lz4", "auto") or compress_min_bytes < 0 or max_depth < 0:
        raise _bad_options(compress)
    torch = sys.modules.get("torch")
    if (torch is not None and type(value) is torch.Tensor
            and (compress is None or value.nbytes < compress_min_bytes)):
        fast = encode_tensor(value)
        if fast is not None:
            return fast
    enc = _Encoder(compress, compress_min_bytes, max_depth, stage)
    try:
        tree = enc.walk(value, 0)
    except _Refusal as e:
        raise e.error() from None
    except RecursionError:
        raise _too_deep(max_depth) from None
    try:
        packed = msgpack.packb(tree, use_bin_type=True)
    except (ValueError, TypeError, OverflowError) as exc:  # pragma: no cover - walk checks
        raise CodecError(f"cannot send value: {exc}") from exc
    return Encoded(packed, tuple(enc.buffers))


# --------------------------------------------------------------------------- decode


def _parse_descriptor(code: int, data: bytes, n_buffers: int) -> tuple[str, list[int], int]:
    """Check a tensor/array ext's ``[dtype, shape, buffer_index]`` and return it."""
    what = "tensor" if code == EXT_TENSOR else "ndarray"
    try:
        # No ext_hook: an ext inside a descriptor comes back as ExtType and is refused.
        desc = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:
        raise CodecError(f"malformed {what} descriptor: {exc}") from None
    if type(desc) is not list or len(desc) != 3:
        raise CodecError(f"{what} descriptor must be [dtype, shape, buffer_index]")
    name, shape, index = desc
    if type(name) is not str or name not in _ITEMSIZE:
        raise CodecError(f"{what} has unknown dtype {_short_repr.repr(name)}")
    if code == EXT_NDARRAY and name not in _NUMPY_DTYPES:
        raise CodecError(f"ndarray dtype {name!r} does not exist in numpy")
    if (
        type(shape) is not list
        or len(shape) > _MAX_NDIM
        or not all(type(d) is int and 0 <= d <= _DIM_MAX for d in shape)
    ):
        raise CodecError(
            f"{what} shape must be a list of at most {_MAX_NDIM} non-negative ints, "
            f"got {_short_repr.repr(shape)}"
        )
    if type(index) is not int or not 0 <= index < n_buffers:
        raise CodecError(
            f"{what} buffer index {_short_repr.repr(index)} is out of range ({n_buffers} buffers)"
        )
    return name, shape, index


def check_cuda_ipc(fields: Any) -> dict[str, Any]:
    """Check a CUDA IPC descriptor (ext 4's map) and return it.

    Every key of :data:`CUDA_IPC_FIELDS` and no other, each of its type; ``v`` is 1;
    ``stride`` has one int per dimension of ``shape``; the elements it spans lie within the
    storage (``(off + extent) * itemsize <= ssize``).

    Raises:
        CodecError: it is malformed (the message says how).
    """
    if type(fields) is not dict:
        raise CodecError("cuda-ipc descriptor must be a map")
    if fields.keys() != CUDA_IPC_FIELDS.keys():
        extra = sorted(set(fields) - set(CUDA_IPC_FIELDS), key=str)
        missing = sorted(set(CUDA_IPC_FIELDS) - set(fields))
        raise CodecError(f"cuda-ipc descriptor has keys {_short_repr.repr(extra)} it must not "
                         f"have and lacks {missing}")
    for key, kind in CUDA_IPC_FIELDS.items():
        if not _ipc_field_ok(fields[key], kind):
            raise CodecError(f"cuda-ipc descriptor field {key!r} must be {kind}, not "
                             f"{_short_repr.repr(fields[key])}")
    if fields["v"] != 1:
        raise CodecError(f"cuda-ipc descriptor version {fields['v']} is not known (1 is)")
    shape, stride = fields["shape"], fields["stride"]
    if len(stride) != len(shape):
        raise CodecError(f"cuda-ipc descriptor has {len(stride)} strides for {len(shape)} "
                         f"dimensions")
    extent = 0 if 0 in shape else 1 + sum((d - 1) * st for d, st in
                                          zip(shape, stride, strict=True))
    if extent and (fields["off"] + extent) * _ITEMSIZE[fields["dtype"]] > fields["ssize"]:
        raise CodecError(f"cuda-ipc tensor {fields['dtype']}{shape} at element {fields['off']} "
                         f"reaches beyond its storage of {fields['ssize']} bytes")
    return fields


def _ipc_field_ok(v: Any, kind: str) -> bool:
    if kind.startswith("bin"):
        if type(v) is not bytes:
            return False
        return 1 <= len(v) <= int(kind[5:]) if kind.startswith("bin<=") else \
            len(v) == int(kind[3:])
    if kind == "int" or kind == "int>0":
        return type(v) is int and (1 if kind == "int>0" else 0) <= v <= _DIM_MAX
    if kind == "dtype":
        return type(v) is str and v in _ITEMSIZE
    return type(v) is list and len(v) <= _MAX_NDIM and \
        all(type(d) is int and 0 <= d <= _DIM_MAX for d in v)


def _parse_cuda_ipc(data: bytes) -> dict[str, Any]:
    try:
        fields = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:
        raise CodecError(f"malformed cuda-ipc descriptor: {exc}") from None
    return check_cuda_ipc(fields)


#: What a client reading a CUDA IPC item over a connection that cannot (TCP) hears.
CUDA_IPC_REMOTE = ("it is a CUDA tensor in another process's GPU memory (cuda-ipc, "
                   "docs/PROTOCOL.md §5.2): only a client on the producer's host, connected "
                   "over unix://, can read it; read it there, or have the producer send host "
                   "copies (device_ipc=False)")

_MakeFn = Callable[[int, str, list[int], int], Any]


class _Unpacker:
    """One decode/validate pass: the ext hook and the buffer bookkeeping."""

    __slots__ = ("max_depth", "n_buffers", "used", "make", "nesting", "ipc")

    def __init__(self, n_buffers: int, max_depth: int, make: _MakeFn,
                 ipc: Callable[[dict[str, Any]], Any] | None = None) -> None:
        self.max_depth = max_depth
        self.n_buffers = n_buffers
        self.used = bytearray(n_buffers)  # 1 once a buffer has been claimed
        self.make = make
        self.nesting = 0  # tuple exts being unpacked right now (bounds recursion)
        self.ipc = ipc  # what a checked cuda-ipc descriptor becomes (None: refused)

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code == EXT_TENSOR or code == EXT_NDARRAY:
            name, shape, index = _parse_descriptor(code, data, self.n_buffers)
            if self.used[index]:
                raise CodecError(f"buffer {index} is referenced by more than one tensor")
            self.used[index] = 1
            return self.make(code, name, shape, index)
        if code == EXT_TUPLE:
            # Each tuple is a container, so ext nesting beyond max_depth is already too
            # deep; stopping here keeps a hostile chain from recursing without bound.
            if self.nesting >= self.max_depth:
                raise NestingTooDeep(f"value nests deeper than max_depth={self.max_depth}")
            self.nesting += 1
            try:
                items = msgpack.unpackb(
                    data, raw=False, strict_map_key=True, ext_hook=self.ext_hook
                )
            finally:
                self.nesting -= 1
            if type(items) is not list:
                raise CodecError("tuple ext must hold a msgpack array")
            return tuple(items)
        if code == EXT_CUDA_IPC:
            fields = _parse_cuda_ipc(data)
            if self.ipc is None:
                raise CodecError(f"cannot read {fields['dtype']}{fields['shape']} here: "
                                 f"{CUDA_IPC_REMOTE}")
            return self.ipc(fields)
        raise CodecError(f"unknown ext type code {code}")

    def unpack(self, value: bytes) -> Any:
        try:
            obj = msgpack.unpackb(value, raw=False, strict_map_key=True, ext_hook=self.ext_hook)
        except (TensorShareError, MemoryError):  # (Lagged: a cuda-ipc slot was reused)
            raise
        except msgpack.ExtraData as exc:
            raise CodecError(
                f"malformed value: {len(exc.extra)} trailing bytes after the msgpack data"
            ) from None
        except msgpack.StackError:
            raise CodecError("malformed value: msgpack nesting too deep") from None
        except msgpack.FormatError:
            raise CodecError("malformed value: invalid msgpack") from None
        except Exception as exc:
            # msgpack reports truncation, bad UTF-8, bad map keys, bad timestamps...
            # as ValueError and friends; a failure building a tensor lands here too.
            raise CodecError(f"malformed value: {exc}") from exc
        _check_tree(obj, self.max_depth)
        return obj


_CONTAINERS: frozenset[type] = frozenset({list, dict, tuple})


def _check_tree(obj: Any, max_depth: int) -> None:
    """Check depth, str map keys and the absence of msgpack timestamps.

    msgpack itself has no depth limit we can set, and it decodes ext -1 (timestamp)
    without calling the ext hook, so one pass over the containers is needed. It is
    iterative so a hostile tree cannot exhaust the Python stack.
    """
    t = type(obj)
    if t not in _CONTAINERS:
        if t is msgpack.Timestamp:
            raise CodecError("unknown ext type code -1 (msgpack timestamp)")
        return
    containers = _CONTAINERS
    timestamp = msgpack.Timestamp
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise NestingTooDeep(f"value nests deeper than max_depth={max_depth}")
        if type(node) is dict:
            for k in node:
                if type(k) is not str:
                    raise CodecError(f"map key {_short_repr.repr(k)} is not a str")
            node = node.values()
        for c in node:
            tc = type(c)
            if tc in containers:
                stack.append((c, depth + 1))
            elif tc is timestamp:
                raise CodecError("unknown ext type code -1 (msgpack timestamp)")


_writable_raw = writable_raw


def decode(
    enc: Encoded,
    *,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_raw_bytes: int = 1 << 40,
    cuda_ipc: Callable[[dict[str, Any]], Any] | None = None,
) -> Any:
    """Decode a value received from the wire.

    Tensors and arrays are built on writable buffers (a writable memoryview or
    bytearray) without copying; read-only buffers (``bytes``) are copied once so the
    result is always writable. Each result tensor owns distinct memory.

    Args:
        enc: the value tree and its buffers.
        max_depth: the deepest container nesting accepted.
        max_raw_bytes: the largest decompressed size accepted for one compressed buffer,
            checked before decompressing.
        cuda_ipc: what a (checked) cuda-ipc descriptor becomes: ``cuda_ipc(fields)``
            (:func:`tensorshare.memory.ipc.copy_out` on a ``unix://`` connection); ``None``:
            a value holding one is refused with a ``CodecError`` that says why.

    Returns:
        The value: lists, dicts, tuples, bytes, scalars, CPU torch tensors, numpy arrays
        (and whatever ``cuda_ipc`` made).

    Raises:
        CodecError: the tree or a buffer is malformed, too deep, refers to a missing or
            reused buffer, a size does not match, or torch/numpy is needed but missing.
    """
    buffers = enc.buffers
    lone = decode_tensor(enc, max_raw_bytes)  # a lone tensor whose tree was seen before
    if lone is not None:
        return lone
    np_dtypes: dict[str, Any] = {}

    def make(code: int, name: str, shape: list[int], index: int) -> Any:
        itemsize = _ITEMSIZE[name]
        n = math.prod(shape)
        raw = _writable_raw(buffers[index], n * itemsize, max_raw_bytes)
        if code == EXT_TENSOR:
            return _make_tensor(name, shape, n, itemsize, raw)
        return _make_ndarray(name, shape, n, raw, np_dtypes)

    value = _Unpacker(len(buffers), max_depth, make, cuda_ipc).unpack(enc.value)
    if len(enc.value) <= 64 and len(buffers) == 1 and not known(enc.value):
        _remember_lone_tensor(enc.value)
    return value


class _Stacking:
    """A tensor of a tree being stacked (:func:`decode_stacked`): its buffer's index."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def decode_stacked(encs: Sequence[Encoded], *, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """Like values decoded as one, each tensor stacked along a new first dimension: what
    ``torch.stack`` of :func:`decode` of each would give, built once from the values'
    buffers joined (a replay sample's items).

    Applies where every value has the same tree bytes (so the same dtypes and shapes) and
    that tree is a tensor or a map of tensors, none of whose buffers is compressed; returns
    ``None`` otherwise (decode them one by one), and for a buffer whose size is not its
    tensor's (:func:`decode` then says why).
    """
    if not encs or not encs[0].buffers:
        return None
    tree, nbuf = encs[0].value, len(encs[0].buffers)
    for e in encs:
        if e.value != tree or len(e.buffers) != nbuf or \
                any(b.codec is not None for b in e.buffers):
            return None
    leaves: dict[int, tuple[str, list[int]]] = {}

    def make(code: int, name: str, shape: list[int], index: int) -> Any:
        if code != EXT_TENSOR:
            raise CodecError("not a tensor")
        leaves[index] = (name, shape)
        return _Stacking(index)

    try:
        value = _Unpacker(nbuf, max_depth, make).unpack(tree)
    except CodecError:
        return None
    if type(value) is _Stacking:
        return _stacked(encs, value.index, *leaves[value.index])
    if type(value) is not dict or not all(type(v) is _Stacking for v in value.values()):
        return None
    out = {k: _stacked(encs, v.index, *leaves[v.index]) for k, v in value.items()}
    return None if any(t is None for t in out.values()) else out


def _stacked(encs: Sequence[Encoded], index: int, name: str, shape: list[int]) -> Any:
    itemsize = _ITEMSIZE[name]
    n = math.prod(shape)
    size = n * itemsize
    raw = bytearray(size * len(encs))
    view = memoryview(raw)
    for i, e in enumerate(encs):
        data = e.buffers[index].data
        if len(data) != size:
            return None
        view[i * size:(i + 1) * size] = data
    return _make_tensor(name, [len(encs), *shape], n * len(encs), itemsize, raw)


def decode_many(encs: Sequence[Encoded], *, max_depth: int = DEFAULT_MAX_DEPTH,
                max_raw_bytes: int = 1 << 40,
                cuda_ipc: Callable[[dict[str, Any]], Any] | None = None) -> list[Any]:
    """Decode several values (the items of one reply), as :func:`decode` does each.

    A run of items that are lone tensors of one dtype and shape (a drained queue of like
    items: the same tree bytes) is decoded with the dtype looked up once and each tensor
    built straight on its buffer.
    """
    out: list[Any] = []
    i, n = 0, len(encs)
    while i < n:
        enc = encs[i]
        lone = lone_of(enc.value) if len(enc.buffers) == 1 else None
        if lone is None or lone[2] == 0 or _BIG_ENDIAN_HOST:
            out.append(decode(enc, max_depth=max_depth, max_raw_bytes=max_raw_bytes,
                              cuda_ipc=cuda_ipc))
            i += 1
            continue
        i = _decode_run(encs, i, lone, max_raw_bytes, out)
    return out


def _decode_run(encs: Sequence[Encoded], i: int, lone: list[Any], max_raw_bytes: int,
                out: list[Any]) -> int:
    """Decode the items from ``encs[i]`` on that share its lone-tensor tree; return where the
    run ends."""
    name, shape, count, itemsize = lone[0], lone[1], lone[2], lone[3]
    tree, expected = encs[i].value, count * itemsize
    import torch

    dtype = _torch_dtypes(torch)[1].get(name)
    if dtype is None:
        raise CodecError(f"this torch has no dtype {name!r}")
    frombuffer = torch.frombuffer
    reshape = len(shape) != 1
    n = len(encs)
    while i < n:
        enc = encs[i]
        if enc.value != tree or len(enc.buffers) != 1:
            break
        raw = _writable_raw(enc.buffers[0], expected, max_raw_bytes)
        t = frombuffer(raw, dtype=dtype, count=count)
        if itemsize > 1 and t.data_ptr() % itemsize:
            t = t.clone()  # (as make_tensor: keep elements aligned)
        out.append(t.reshape(shape) if reshape else t)
        i += 1
    return i


def _remember_lone_tensor(tree: bytes) -> None:
    """If ``tree`` (already checked) is a lone tensor ext, remember its dtype and shape."""
    try:
        ext = msgpack.unpackb(tree, ext_hook=lambda code, data: (code, data))
        if type(ext) is tuple and ext[0] == EXT_TENSOR:
            name, shape, index = _parse_descriptor(EXT_TENSOR, ext[1], 1)
            remember(tree, name, tuple(shape))
            return
    except (CodecError, ValueError, TypeError):
        pass
    remember(tree, None, ())  # not a lone tensor


def _make_tensor(
    name: str, shape: list[int], n: int, itemsize: int, raw: bytearray | memoryview
) -> Any:
    return make_tensor(torch_dtype(name), name, shape, n, itemsize, raw)


def _make_ndarray(
    name: str, shape: list[int], n: int, raw: bytearray | memoryview, cache: dict[str, Any]
) -> Any:
    try:
        import numpy as np
    except ImportError:
        raise CodecError("the value holds a numpy array but numpy is not installed") from None
    dtype = cache.get(name)
    if dtype is None:
        dtype = cache[name] = np.dtype(name).newbyteorder("<")
    if n == 0:
        return np.empty(shape, dtype=dtype.newbyteorder("="))
    arr = np.frombuffer(raw, dtype=dtype, count=n).reshape(shape)
    if _BIG_ENDIAN_HOST:
        return arr.astype(dtype.newbyteorder("="))
    if not arr.flags.aligned:
        arr = arr.copy()  # same reason as for tensors: keep elements aligned
    return arr


def validate(value: bytes, n_buffers: int, *, max_depth: int = DEFAULT_MAX_DEPTH,
             raw_sizes: Sequence[int] | None = None) -> None:
    """Check a received value tree without building tensors (never imports torch).

    Checks that ``value`` is one complete msgpack value of this format: only known ext
    codes, well-formed tensor/array descriptors (dtype in ``DTYPES``, shape of
    non-negative ints, buffer index in ``[0, n_buffers)``), each buffer referenced at
    most once, str map keys, nesting at most ``max_depth``, no trailing bytes. With
    ``raw_sizes`` (the uncompressed size of each buffer), each tensor's buffer must hold
    exactly ``prod(shape) * itemsize`` bytes, so whatever the server stores, readers can
    decode.

    Args:
        value: the msgpack bytes of the value tree.
        n_buffers: how many buffers travel with it.
        max_depth: the deepest container nesting accepted.
        raw_sizes: the uncompressed byte size of each buffer, or ``None`` to skip the check.

    Raises:
        CodecError: the value is malformed.
    """

    def make(code: int, name: str, shape: list[int], index: int) -> None:
        if raw_sizes is not None:
            expected = math.prod(shape) * _ITEMSIZE[name]
            if raw_sizes[index] != expected:
                raise CodecError(f"buffer {index} holds {raw_sizes[index]} bytes but its "
                                 f"{name} tensor of shape {shape} needs {expected}")
        return None

    if len(value) <= _VALID_TREE_MAX and raw_sizes is not None:
        # A tree is valid or not whatever its buffers hold: remember the small ones that
        # were (a stream of like items sends the same tree bytes each time).
        key = (value, n_buffers, max_depth, tuple(raw_sizes))
        if key in _VALID_TREES:
            return
        _Unpacker(max(n_buffers, 0), max_depth, make, _ipc_checked).unpack(value)
        if len(_VALID_TREES) >= _VALID_TREES_MAX:
            _VALID_TREES.clear()
        _VALID_TREES[key] = True
        return
    _Unpacker(max(n_buffers, 0), max_depth, make, _ipc_checked).unpack(value)


def _ipc_checked(fields: dict[str, Any]) -> None:
    """validate: a cuda-ipc descriptor was checked; nothing to build."""
    return None


_VALID_TREE_MAX = 512  # bytes
_VALID_TREES_MAX = 4096
_VALID_TREES: dict[tuple[bytes, int, int, tuple[int, ...]], bool] = {}


class _Leaf:
    """A tensor or array seen by :func:`describe`: only its dtype and shape."""

    __slots__ = ("text",)

    def __init__(self, code: int, name: str, shape: list[int]) -> None:
        dims = ",".join(str(d) for d in shape)
        self.text = f"{'ndarray ' if code == EXT_NDARRAY else ''}{name}[{dims}]"

    def __repr__(self) -> str:
        return self.text


def _ipc_leaf(fields: dict[str, Any]) -> _Leaf:
    leaf = _Leaf(EXT_TENSOR, fields["dtype"], fields["shape"])
    leaf.text = f"cuda-ipc {leaf.text} on GPU-{fields['uuid'].hex()[:8]}"
    return leaf


def describe(value: bytes, limit: int = 80) -> str:
    """A one-line summary of an encoded value tree, e.g. ``{w: float32[3,3], step: int}``.

    Tensors show their dtype and shape, scalars their type, containers their content (long
    lists are shortened). Nothing is decoded into tensors and torch is never imported, so
    the server can describe what it stores.

    Args:
        value: the msgpack bytes of a value tree (as stored).
        limit: the longest summary returned; longer ones end with an ellipsis.

    Returns:
        The summary, or ``"<malformed>"`` for bytes that are not a valid value tree.
    """
    try:
        tree = _Unpacker(1 << 20, DEFAULT_MAX_DEPTH,
                         lambda code, name, shape, index: _Leaf(code, name, shape),
                         _ipc_leaf).unpack(value)
    except CodecError:
        return "<malformed>"
    text = _summary(tree, limit)
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _summary(x: Any, budget: int) -> str:
    t = type(x)
    if t is _Leaf:
        return str(x.text)
    if t is dict:
        parts = []
        used = 2
        for k, v in x.items():
            part = f"{k}: {_summary(v, budget - used)}"
            parts.append(part)
            used += len(part) + 2
            if used > budget:
                break
        return "{" + ", ".join(parts) + "}"
    if t is list or t is tuple:
        open_, close = ("[", "]") if t is list else ("(", ")")
        if len(x) > 4 and all(type(v) is not _Leaf and type(v) not in _CONTAINERS for v in x):
            return f"{open_}{len(x)} {type(x[0]).__name__}s{close}"
        shown = [_summary(v, budget // 2) for v in x[:4]]
        if len(x) > 4:
            shown.append(f"... {len(x) - 4} more")
        return open_ + ", ".join(shown) + close
    if x is None:
        return "None"
    if t is str:
        return _short_repr.repr(x)
    if t is bytes:
        return f"bytes[{len(x)}]"
    return t.__name__
