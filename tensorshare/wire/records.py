"""The records every request makes: the buffers and encoded values of the codec, and the
messages of the common requests and replies (the other messages are dataclasses in
:mod:`.messages`, which re-exports these; :mod:`.codec` re-exports the first four).

They are written out by hand over one base, :class:`Record`, rather than as frozen
dataclasses (whose constructors pay an ``object.__setattr__`` per field), so that the
compiled twin of this module (``records_c.pxd``) can make them cdef classes with declared,
read-only attributes that call each other at C level. No I/O; only the standard library.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Acked", "Append", "Buffer", "Changed", "Encoded", "ErrorReply", "Fetch",
           "FetchSpec", "Fetched", "Item", "Put", "Record", "Stored", "encoded_of",
           "raw_buffer"]


class Record:
    """What a record is beside its fields, as a frozen dataclass would give it: equality and
    a hash over the compared fields, and a repr. The records made on every request (the
    messages of the common requests and replies, the codec's buffers) are written out by
    hand over this base so that the compiled twin of this module can make them cdef classes
    with declared, read-only attributes (``records.pxd``, which the other twins cimport):
    made with no dict and no ``object.__setattr__`` per field. Treat them as immutable (the
    twin enforces it)."""

    __slots__ = ()
    _fields: tuple[str, ...] = ()  # compared and hashed, in order
    _shown: tuple[str, ...] = ()  # in the repr (default: the compared ones)

    def _values(self) -> tuple[Any, ...]:
        return tuple([getattr(self, f) for f in self._fields])

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return hash(self._values())

    def _replace(self, **changes: Any) -> Any:
        """A copy with ``changes`` (as ``dataclasses.replace`` does for a dataclass)."""
        fields = self._shown or self._fields
        return type(self)(**{f: changes[f] if f in changes else getattr(self, f)
                             for f in fields})

    def __repr__(self) -> str:
        shown = self._shown or self._fields
        args = ", ".join([f"{f}={getattr(self, f)!r}" for f in shown])
        return f"{type(self).__name__}({args})"


class Buffer(Record):
    """One raw buffer of tensor data as it travels.

    Attributes:
        data: the bytes as sent (compressed when ``codec`` is set); 1-D, C-contiguous,
            itemsize 1. A memoryview of another shape or format is cast to bytes.
        codec: ``None`` (raw) or ``"lz4"`` (LZ4 block format, no size prefix).
        raw_nbytes: the size after decompression; ``-1`` means ``len(data)``.
        shm: the :class:`~tensorshare.shm.SharedMemory` that ``data`` maps, when the buffer
            lives in a sealed memfd (it then travels as a descriptor over a Unix socket
            that allows it, and as bytes anywhere else).
    """

    __slots__ = ("data", "codec", "raw_nbytes", "shm")
    _fields = __slots__

    def __init__(self, data: memoryview | bytes | bytearray, codec: str | None = None,
                 raw_nbytes: int = -1, shm: Any = None) -> None:
        if type(data) is memoryview and (data.ndim != 1 or data.format != "B"):
            if not data.c_contiguous:
                raise ValueError("Buffer data must be C-contiguous")
            data = data.cast("B")
        self.data = data
        self.codec = codec
        self.raw_nbytes = len(data) if raw_nbytes == -1 else raw_nbytes
        self.shm = shm

    @property
    def nbytes(self) -> int:
        """The number of bytes as sent (compressed size when ``codec`` is set)."""
        return len(self.data)


class Encoded(Record):
    """An encoded value: the msgpack value tree and the raw buffers it refers to.

    Attributes:
        value: the msgpack bytes of the value tree.
        buffers: the tensor buffers, indexed by the tensor descriptors in ``value``.
        nbytes: the total bytes sent: ``len(value)`` plus every buffer's ``nbytes``
            (computed once: asked several times per item on the way out and on the way in).
    """

    __slots__ = ("value", "buffers", "nbytes")
    _fields = ("value", "buffers")

    def __init__(self, value: bytes, buffers: tuple[Buffer, ...] = ()) -> None:
        n = len(value)
        for b in buffers:
            n += len(b.data)
        self.value = value
        self.buffers = buffers
        self.nbytes = n


# Fast constructors for trusted inputs, for the paths that make thousands of these a second
# (parsing a batch of items, encoding a batch of tensors): the same objects, without the
# checks of __init__ that these inputs satisfy already.
def raw_buffer(data: memoryview | bytes | bytearray, nbytes: int) -> Buffer:
    """``Buffer(data)``, for ``data`` already flat bytes (a 1-D ``"B"`` memoryview, ``bytes``
    or ``bytearray``) of ``nbytes`` bytes, uncompressed."""
    b = Buffer.__new__(Buffer)
    b.data = data
    b.codec = None
    b.raw_nbytes = nbytes
    b.shm = None
    return b


def encoded_of(value: bytes, buffers: tuple[Buffer, ...], nbytes: int) -> Encoded:
    """``Encoded(value, buffers)``, with ``nbytes`` (``len(value)`` plus the buffers' bytes)
    computed by the caller."""
    e = Encoded.__new__(Encoded)
    e.value = value
    e.buffers = buffers
    e.nbytes = nbytes
    return e


class Item(Record):
    """One stored value as it travels: the encoded value and an optional integer tag.

    The tag is opaque to the server except for ``min_tag`` filtering; the RL wrappers put
    the parameter version a rollout was made with there.
    """

    __slots__ = ("value", "tag")
    _fields = ("value", "tag")

    def __init__(self, value: Encoded, tag: int | None = None) -> None:
        self.value = value
        self.tag = tag


class FetchSpec(Record):
    """What a get or peek asks for. It travels unchanged from the client call to the store.

    Attributes:
        remove: ``True`` for get (take the items), ``False`` for peek.
        max_items: for a list bin, at most this many items (oldest first).
        wait: wait on the server until the bin can satisfy the request.
        timeout: with ``wait``: seconds to wait; ``None`` waits without limit.
        min_tag: skip items tagged below this (a get drops them from the bin).
        newer_than: only a bin whose version is above this counts.
        min_items: with ``wait``: wait until at least this many items are available.
    """

    __slots__ = ("remove", "max_items", "wait", "timeout", "min_tag", "newer_than",
                 "min_items")
    _fields = __slots__

    def __init__(self, remove: bool, max_items: int | None = None, wait: bool = False,
                 timeout: float | None = None, min_tag: int | None = None,
                 newer_than: int | None = None, min_items: int = 1) -> None:
        self.remove = remove
        self.max_items = max_items
        self.wait = wait
        self.timeout = timeout
        self.min_tag = min_tag
        self.newer_than = newer_than
        self.min_items = min_items

    def with_timeout(self, timeout: float | None) -> FetchSpec:
        """The same request, waiting ``timeout`` seconds."""
        return FetchSpec(self.remove, self.max_items, self.wait, timeout, self.min_tag,
                         self.newer_than, self.min_items)

    @property
    def op(self) -> str:
        """The wire op: ``"get"`` or ``"peek"``."""
        return "get" if self.remove else "peek"


class Put(Record):
    """Replace a bin's content with ``item``.

    ``min_version``: the bin's new version is at least this (``max(current + 1,
    min_version)``): a bin moved to another server keeps its version (``rebalance``).
    ``room``: when the user's ``max_memory`` has no room for it, wait up to this many seconds
    for room (``math.inf``: until cancelled or disconnected); ``None``: fail at once.
    """

    __slots__ = ("id", "bin", "item", "min_version", "room")
    _fields = __slots__

    def __init__(self, id: int, bin: str, item: Item, min_version: int | None = None,
                 room: float | None = None) -> None:
        self.id = id
        self.bin = bin
        self.item = item
        self.min_version = min_version
        self.room = room


class Append(Record):
    """Add items to a bin: ``item``, then those in ``rest``, all or none, as one change.

    ``timeout``: how long an append to a full ``block`` bin may wait for room (``None``:
    until the client cancels it or disconnects); with ``wait_room``, also how long it may wait
    for room in its user's ``max_memory`` (else it fails at once when there is none).
    ``min_version``: as :class:`Put`'s.
    """

    __slots__ = ("id", "bin", "item", "timeout", "rest", "min_version", "wait_room")
    _fields = __slots__

    def __init__(self, id: int, bin: str, item: Item, timeout: float | None = None,
                 rest: tuple[Item, ...] = (), min_version: int | None = None,
                 wait_room: bool = False) -> None:
        self.id = id
        self.bin = bin
        self.item = item
        self.timeout = timeout
        self.rest = rest
        self.min_version = min_version
        self.wait_room = wait_room

    @property
    def items(self) -> tuple[Item, ...]:
        """Every item of the append, in order."""
        return (self.item, *self.rest) if self.rest else (self.item,)


class Fetch(Record):
    """Return the content of a bin, removing it (get) or not (peek); see :class:`FetchSpec`."""

    __slots__ = ("id", "bin", "spec")
    _fields = __slots__

    def __init__(self, id: int, bin: str, spec: FetchSpec) -> None:
        self.id = id
        self.bin = bin
        self.spec = spec


class Stored(Record):
    """Reply to put/append: the bin's new version and item count (and items dropped to make
    room, for a bin configured with ``overflow="drop_oldest"``)."""

    __slots__ = ("id", "version", "n_items", "dropped")
    _fields = __slots__

    def __init__(self, id: int, version: int, n_items: int, dropped: int = 0) -> None:
        self.id = id
        self.version = version
        self.n_items = n_items
        self.dropped = dropped


class Fetched(Record):
    r"""The result of a get or peek: one record from the store to the caller.

    The store returns one (``id`` 0, the stored :class:`Item`\ s), the server sends it with the
    request's id, and the client hands it to the caller with the items decoded and their tags
    beside them (the public name of that is ``tensorshare.FetchResult``).

    Attributes:
        id: the request's id (0 until the server answers a request with it).
        kind: ``"value"`` for a put bin (one item), ``"list"`` for an appended bin.
        items: the items returned, oldest first: :class:`Item`\ s on the wire and in the
            server, decoded values in a client's hands.
        version: the bin's version after the operation.
        n_items: items left in the bin.
        dropped: items dropped (get) or skipped (peek) for being tagged below ``min_tag``.
        unchanged: ``newer_than`` was given and the bin is not newer (no items sent).
        tags: in a client's hands, the items' tags (``None`` for untagged items).
        nbytes: in the server, the bytes the items take (not on the wire).
    """

    __slots__ = ("id", "kind", "items", "version", "n_items", "dropped", "unchanged", "tags",
                 "nbytes")
    _fields = ("id", "kind", "items", "version", "n_items", "dropped", "unchanged")
    _shown = __slots__

    def __init__(self, id: int, kind: str, items: tuple[Any, ...], version: int, n_items: int,
                 dropped: int = 0, unchanged: bool = False,
                 tags: tuple[int | None, ...] = (), nbytes: int = 0) -> None:
        self.id = id
        self.kind = kind
        self.items = items
        self.version = version
        self.n_items = n_items
        self.dropped = dropped
        self.unchanged = unchanged
        self.tags = tags
        self.nbytes = nbytes

    def with_id(self, rid: int) -> Fetched:
        """The same record, answering request ``rid``."""
        return Fetched(rid, self.kind, self.items, self.version, self.n_items, self.dropped,
                       self.unchanged, self.tags, self.nbytes)

    @property
    def value(self) -> Any:
        """The value of a put bin, or the list of items of an appended bin (``None`` when
        ``unchanged``)."""
        if self.unchanged:
            return None
        return self.items[0] if self.kind == "value" else list(self.items)


class Acked(Record):
    """Reply to unlisten (was listening), cancel (was cancelled) and ping (always True)."""

    __slots__ = ("id", "flag")
    _fields = __slots__

    def __init__(self, id: int, flag: bool = True) -> None:
        self.id = id
        self.flag = flag


class ErrorReply(Record):
    """A request failed. ``id`` is 0 for a connection-level error sent before closing."""

    __slots__ = ("id", "code", "message")
    _fields = __slots__

    def __init__(self, id: int, code: str, message: str) -> None:
        self.id = id
        self.code = code
        self.message = message


class Changed(Record):
    """Notification: a bin the connection listens to changed.

    ``op`` is ``"put"``, ``"append"``, ``"get"``, ``"delete"``, ``"restore"`` (items a lost
    client had taken went back to the bin) or, client-side only, ``"resync"``. ``skipped``
    counts earlier changes folded into this one for a listener that read too slowly, and
    ``dropped`` the items an append pushed out of a full ``drop_oldest`` bin.
    """

    __slots__ = ("bin", "op", "n_items", "version", "skipped", "dropped")
    _fields = __slots__

    def __init__(self, bin: str, op: str, n_items: int, version: int, skipped: int = 0,
                 dropped: int = 0) -> None:
        self.bin = bin
        self.op = op
        self.n_items = n_items
        self.version = version
        self.skipped = skipped
        self.dropped = dropped
