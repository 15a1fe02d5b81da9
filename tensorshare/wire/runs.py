"""Runs of like tensors as one buffer: a get/peek reply's items that are lone tensors of one
dtype and shape travel as one descriptor and one buffer (``docs/PROTOCOL.md`` §3.3.3.1).

A drained queue of small tensors (rollout steps, observations) is the same tree bytes again
and again, each with a buffer of a few bytes. Item by item, each costs the server a header
entry and a padded buffer, and the reader a parsed entry and a tensor of its own. As a run, the
server writes one map (``{"run": count, "value": tree, "buffer": [offset, nbytes], "tags":
...}``) and the items' bytes back to back; the reader makes one tensor of shape ``[count,
*shape]`` on that buffer and splits it into views (bit-exact and writable, as the tensors of
the item-by-item form are).

Both sides say ``runs: true`` in the handshake (§3.2.1, §3.3.1): a server sends runs only to a
client that offered them, and a client that did not gets today's form. The server makes
runs where they apply (:func:`items_header`) and writes the other items as before, in order;
the client reads a run into a :class:`Run` (:func:`read_run`, from ``fields.read_items``) and
decodes the reply's items, runs and others, in order (:func:`decode_items`).

No I/O; compiled with the wire (``runs.pxd``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..errors import CodecError
from .codec import _remember_lone_tensor, decode_many
from .frames import ALIGN, BytesLike, aligned
from .records import Item, encoded_of, raw_buffer
from .tensors import known, lone_of, make_tensor, torch_dtype, writable_raw

__all__ = ["RUN_ITEM_MAX", "RUN_MAX_BYTES", "RUN_MIN", "Run", "decode_items", "items_header",
           "read_run", "run_count"]

#: The fewest like items the server sends as a run.
RUN_MIN = 2
#: The largest item (bytes) the server puts in a run: larger ones gain nothing from it, and
#: their bytes would be copied into the run's buffer.
RUN_ITEM_MAX = 64 << 10
#: A run's buffer is at most this many bytes (a longer stretch of like items: several runs).
RUN_MAX_BYTES = 1 << 20
_ALIGN_MASK = ALIGN - 1
#: The largest item a reply's buffer may decompress to (as ``client/ops``).
_MAX_RAW_BYTES = 1 << 40


def _lone(tree: bytes) -> list[Any] | None:
    """``[dtype, shape, elements, itemsize, torch dtype or None]`` when ``tree`` is a lone
    tensor (ext 1 of buffer 0), else ``None`` (also where the codec's table is full)."""
    lone = lone_of(tree)
    if lone is None and not known(tree):
        _remember_lone_tensor(tree)
        lone = lone_of(tree)
    return lone


# -- the server: runs where they apply ----------------------------------------------------------
def _run_end(items: Sequence[Item], i: int, shared: list[Any] | None) -> int:
    """Where the run of like items that starts at ``items[i]`` ends (``i + 1``: none)."""
    n = len(items)
    if i + 1 >= n:
        return i + 1
    first = items[i].value
    tree = first.value
    if len(first.buffers) != 1 or items[i + 1].value.value != tree:
        return i + 1
    b = first.buffers[0]
    size = len(b.data)
    if b.codec is not None or (shared is not None and b.shm is not None) or \
            not 0 < size <= RUN_ITEM_MAX or _lone(tree) is None:
        return i + 1
    stop = min(n, i + max(RUN_MAX_BYTES // size, RUN_MIN))
    k = i + 1
    while k < stop:
        e = items[k].value
        if e.value != tree or len(e.buffers) != 1:
            break
        b = e.buffers[0]
        if b.codec is not None or len(b.data) != size or (shared is not None and
                                                            b.shm is not None):
            break
        k += 1
    return k


def items_header(items: Sequence[Item], buffers: list[BytesLike],
                 shared: list[Any] | None) -> list[Any]:
    """The ``items`` of a get/peek reply to a client that agreed on runs: runs of like lone
    tensors as one map and one buffer each, the other items as ``[value, buffers, tag]``, in
    order; their buffers are appended to ``buffers`` in payload order (each laid out at the
    next multiple of 64, as ``frames.encode_frame`` writes them). ``shared``: as
    ``protocol.encode_message``'s (a memfd buffer is never in a run)."""
    out: list[Any] = []
    end = 0
    i, n = 0, len(items)
    while i < n:
        j = _run_end(items, i, shared)
        if j - i >= RUN_MIN:
            run = items[i:j]
            joined = b"".join([it.value.buffers[0].data for it in run])
            off = aligned(end)
            end = off + len(joined)
            buffers.append(joined)
            tags = [it.tag for it in run]
            out.append({"run": j - i, "value": run[0].value.value, "buffer": [off, len(joined)],
                        "tags": tags if tags.count(None) != len(tags) else None})
            i = j
            continue
        it = items[i]
        descs: list[list[Any]] = []
        for b in it.value.buffers:
            off = aligned(end)
            if shared is not None and b.shm is not None:  # in a sealed memfd, passed beside
                shared.append(b.shm)
                buffers.append(b"")
                descs.append([off, 0, "memfd", b.raw_nbytes])
                end = off
                continue
            data = b.data
            buffers.append(data)
            end = off + len(data)
            descs.append([off, len(data)] if b.codec is None else
                         [off, len(data), b.codec, b.raw_nbytes])
        out.append([it.value.value, descs, it.tag])
        i += 1
    return out


# -- the client: a run read, and the items decoded ------------------------------------------------
class Run:
    """``count`` items of one reply sent as a run: each is ``value`` (a lone tensor's tree)
    with its ``size`` bytes (``len(data) // count``), back to back in ``data``; ``tags``:
    each item's tag."""

    __slots__ = ("value", "data", "count", "tags")

    def __init__(self, value: bytes, data: memoryview, count: int,
                 tags: tuple[int | None, ...]) -> None:
        self.value, self.data, self.count, self.tags = value, data, count, tags

    def __repr__(self) -> str:
        return f"Run(count={self.count}, nbytes={len(self.data)})"


def read_run(raw: dict[str, Any], view: memoryview, end: int) -> tuple[Run, int]:
    """The run ``raw`` (an element of a reply's ``items``, a map) on the payload ``view``,
    whose buffers so far end at ``end``; and where its buffer ends.

    Raises:
        ValueError: the run is malformed (a protocol violation of the server).
    """
    count, value, desc, tags = raw.get("run"), raw.get("value"), raw.get("buffer"), \
        raw.get("tags")
    if type(count) is not int or count < 1:
        raise ValueError("a run's 'run' must be an integer >= 1")
    if type(value) is not bytes:
        raise ValueError("a run's 'value' must be a bin")
    if type(desc) is not list or len(desc) != 2 or type(desc[0]) is not int or \
            type(desc[1]) is not int:
        raise ValueError("a run's 'buffer' must be [offset, nbytes]")
    off, nbytes = desc
    if off < end or off & _ALIGN_MASK or off + nbytes > len(view):
        raise ValueError(f"a run's buffer at offset {off} is not aligned, overlaps the one "
                         f"before (ends at {end}) or lies outside the payload")
    if nbytes < count or nbytes % count:
        raise ValueError(f"a run of {count} items cannot hold {nbytes} bytes")
    if tags is None:
        got: tuple[int | None, ...] = (None,) * count
    elif type(tags) is not list or len(tags) != count or \
            not all([t is None or type(t) is int for t in tags]):
        raise ValueError(f"a run's 'tags' must be nil or {count} integers or nils")
    else:
        got = tuple(tags)
    return Run(value, view[off:off + nbytes], count, got), off + nbytes


def run_count(items: Sequence[Any]) -> int:
    """How many values a reply's parsed ``items`` stand for when any is a :class:`Run`; 0
    when none is (the usual form: decode them as such)."""
    total = 0
    runs = False
    for it in items:
        if type(it) is Run:
            total += it.count
            runs = True
        else:
            total += 1
    return total if runs else 0


def decode_items(items: Sequence[Any], max_depth: int,
                 cuda_ipc: Callable[[dict[str, Any]], Any] | None = None
                 ) -> tuple[tuple[Any, ...], tuple[int | None, ...]]:
    """The values and tags of a reply's parsed ``items``, runs (:class:`Run`) and items
    (decoded as ``codec.decode_many`` does), in order.

    Raises:
        CodecError: a value is malformed (a run's tree, or a size that is not its tensor's).
    """
    values: list[Any] = []
    tags: list[int | None] = []
    plain: list[Any] = []
    for it in items:
        if type(it) is not Run:
            plain.append(it)
            continue
        if plain:
            _decode_plain(plain, max_depth, cuda_ipc, values, tags)
            plain = []
        values.extend(_decode_run(it, max_depth))
        tags.extend(it.tags)
    if plain:
        _decode_plain(plain, max_depth, cuda_ipc, values, tags)
    return tuple(values), tuple(tags)


def _decode_plain(items: list[Item], max_depth: int, cuda_ipc: Any, values: list[Any],
                  tags: list[int | None]) -> None:
    values.extend(decode_many([it.value for it in items], max_depth=max_depth,
                              cuda_ipc=cuda_ipc))
    tags.extend([it.tag for it in items])


def _decode_run(run: Run, max_depth: int) -> Sequence[Any]:
    """The values of ``run``: one tensor of its buffer split into views, when its tree is a
    lone tensor; else each item decoded on its slice (which says what is wrong, if
    anything)."""
    data = run.data
    count = run.count
    lone = _lone(run.value)
    if lone is not None:
        name, shape, n, itemsize, dtype = lone
        if n * itemsize * count != len(data):
            raise CodecError(f"a run of {count} {name} tensors of shape {list(shape)} needs "
                             f"{n * itemsize * count} bytes, not {len(data)}")
        raw = writable_raw(raw_buffer(data, len(data)), len(data), _MAX_RAW_BYTES)
        if dtype is None:
            dtype = lone[4] = torch_dtype(name)
        whole = make_tensor(dtype, name, [count, *shape], n * count, itemsize, raw)
        return whole.unbind(0)  # type: ignore[no-any-return]
    size = len(data) // count
    tree = run.value
    return decode_many([encoded_of(tree, (raw_buffer(data[k * size:(k + 1) * size], size),),
                                   len(tree) + size) for k in range(count)],
                       max_depth=max_depth)
