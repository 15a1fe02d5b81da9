"""Every request, reply and notification as a frozen dataclass.

These are the values the rest of the code passes around; the string-keyed msgpack maps they
become on the wire are built and parsed only in :mod:`tensorshare.protocol`, through its one
table of ops. A value carried by a message is an :class:`~tensorshare.codec.Encoded`
(msgpack bytes plus raw buffers): the server stores and returns it without ever decoding a
tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from .codec import Encoded

__all__ = [
    "Acked",
    "Append",
    "Auth",
    "Bye",
    "Cancel",
    "Challenge",
    "Changed",
    "Configure",
    "Configured",
    "Delete",
    "Deleted",
    "ErrorReply",
    "Fetch",
    "FetchSpec",
    "Fetched",
    "Hello",
    "HelloReply",
    "Item",
    "Limits",
    "ListBins",
    "Listen",
    "Listening",
    "Listing",
    "Message",
    "Ping",
    "Put",
    "Reply",
    "Request",
    "Stats",
    "StatsReply",
    "Stored",
    "Unlisten",
]


class _Record:
    """What a message is beside its fields, as a frozen dataclass would give it: equality and
    a hash over the compared fields, and a repr. The messages of every request are written
    out by hand (the rest are dataclasses) so that the compiled twin can make them cdef
    classes with declared attributes (``messages_c.pxd``): constructed with no dict and no
    ``object.__setattr__`` per field. Treat them as immutable (the twin enforces it)."""

    __slots__ = ()
    _fields: tuple[str, ...] = ()  # compared and hashed, in order
    _shown: tuple[str, ...] = ()  # in the repr (default: the compared ones)

    def _values(self) -> tuple[Any, ...]:
        return tuple([getattr(self, f) for f in self._fields])

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined]

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        shown = self._shown or self._fields
        args = ", ".join([f"{f}={getattr(self, f)!r}" for f in shown])
        return f"{type(self).__name__}({args})"


@dataclass(frozen=True, slots=True)
class Limits:
    """Hard limits of a connection. The server's values are sent to the client in the handshake.

    Attributes:
        max_frame_bytes: largest frame (prefix, header, padding and payload).
        max_header_bytes: largest msgpack header of a frame.
        max_depth: deepest nesting of containers inside one value.
        max_name_bytes: longest bin name, in UTF-8 bytes.
    """

    max_frame_bytes: int = 1 << 30
    max_header_bytes: int = 64 << 20
    max_depth: int = 64
    max_name_bytes: int = 1024

    def __post_init__(self) -> None:
        for name in ("max_frame_bytes", "max_header_bytes", "max_depth", "max_name_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_header_bytes > self.max_frame_bytes:
            raise ValueError("max_header_bytes cannot exceed max_frame_bytes")


class Item(_Record):
    """One stored value as it travels: the encoded value and an optional integer tag.

    The tag is opaque to the server except for ``min_tag`` filtering; the RL wrappers put
    the parameter version a rollout was made with there.
    """

    __slots__ = ("value", "tag")
    _fields = ("value", "tag")

    def __init__(self, value: Encoded, tag: int | None = None) -> None:
        self.value = value
        self.tag = tag


class FetchSpec(_Record):
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


# -- requests (client -> server) --------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Hello:
    """The first request of every connection.

    Attributes:
        nonce: a client with a token sends a fresh random nonce (32 bytes): a server that
            requires a token answers with a :class:`Challenge` (see
            :mod:`tensorshare.wire.auth`); ``None``: no token.
        session: the client's session id (16 random bytes), or ``None`` for a connection
            without a session (no exactly-once replay; e.g. a one-shot command-line tool).
        resume: the client has used this session before (on an earlier connection) and
            asks the server to carry it on.
    """

    id: int
    versions: tuple[int, ...]
    client: str = ""
    nonce: bytes | None = None
    session: bytes | None = None
    resume: bool = False
    shm: bool = False  # the client can pass large buffers as sealed memfds (Unix socket)


@dataclass(frozen=True, slots=True)
class Auth:
    """The second step of a handshake with a token: the client's proof (see
    :mod:`tensorshare.wire.auth`). Answered by the :class:`HelloReply`."""

    id: int
    proof: bytes


class Put(_Record):
    """Replace a bin's content with ``item``.

    ``min_version``: the bin's new version is at least this (``max(current + 1,
    min_version)``): a bin moved to another server keeps its version (``rebalance``).
    """

    __slots__ = ("id", "bin", "item", "min_version")
    _fields = __slots__

    def __init__(self, id: int, bin: str, item: Item, min_version: int | None = None) -> None:
        self.id = id
        self.bin = bin
        self.item = item
        self.min_version = min_version


class Append(_Record):
    """Add items to a bin: ``item``, then those in ``rest``, all or none, as one change.

    ``timeout``: how long an append to a full ``block`` bin may wait for room (``None``:
    until the client cancels it or disconnects). ``min_version``: as :class:`Put`'s.
    """

    __slots__ = ("id", "bin", "item", "timeout", "rest", "min_version")
    _fields = __slots__

    def __init__(self, id: int, bin: str, item: Item, timeout: float | None = None,
                 rest: tuple[Item, ...] = (), min_version: int | None = None) -> None:
        self.id = id
        self.bin = bin
        self.item = item
        self.timeout = timeout
        self.rest = rest
        self.min_version = min_version

    @property
    def items(self) -> tuple[Item, ...]:
        """Every item of the append, in order."""
        return (self.item, *self.rest) if self.rest else (self.item,)


class Fetch(_Record):
    """Return the content of a bin, removing it (get) or not (peek); see :class:`FetchSpec`."""

    __slots__ = ("id", "bin", "spec")
    _fields = __slots__

    def __init__(self, id: int, bin: str, spec: FetchSpec) -> None:
        self.id = id
        self.bin = bin
        self.spec = spec


@dataclass(frozen=True, slots=True)
class ListBins:
    id: int


@dataclass(frozen=True, slots=True)
class Delete:
    id: int
    bin: str


@dataclass(frozen=True, slots=True)
class Listen:
    id: int
    bin: str


@dataclass(frozen=True, slots=True)
class Unlisten:
    id: int
    bin: str


@dataclass(frozen=True, slots=True)
class Ping:
    id: int


@dataclass(frozen=True, slots=True)
class Bye:
    """The client is done: end its session now (as if it had expired) and close.

    The items of gets it has not acknowledged go back to their bins; acknowledgements that
    ride on this request are applied first, so a client that got its replies loses nothing.
    """

    id: int


@dataclass(frozen=True, slots=True)
class Cancel:
    """Give up on a request: a waiting get/peek stops waiting; the items a get already took
    for this session (its reply was not acknowledged) go back to the front of their bin."""

    id: int
    target: int


@dataclass(frozen=True, slots=True)
class Stats:
    """Ask for the server's statistics and a summary of every bin (or those matching ``glob``)."""

    id: int
    glob: str | None = None


@dataclass(frozen=True, slots=True)
class Configure:
    """Set a bin's limits. ``None`` means no limit; ``overflow`` is what a full bin does."""

    id: int
    bin: str
    max_items: int | None = None
    max_bytes: int | None = None
    overflow: str = "reject"


Request = Union[Hello, Put, Append, Fetch, ListBins, Delete, Listen, Unlisten, Ping, Cancel,
                Stats, Configure, Bye, Auth]


# -- replies and notifications (server -> client) ---------------------------------------------
@dataclass(frozen=True, slots=True)
class HelloReply:
    """The server's answer to hello.

    Attributes:
        resumed: the server knew the session and carries it on (it answers resent requests
            from the replies it remembered); ``False`` for a new session.
        server_id: random per server data set: it changes when a server restarts without
            persistence, so a client can tell that versions started again.
        shm: buffers may travel as sealed memfds on this connection, both ways.
        proof: after a challenge, the server's proof that it knows the token too.
        role: what the connection may do: ``"write"`` (everything) or ``"read"`` (the
            read-only token: the ops the op table marks ``read``).
    """

    id: int
    version: int
    server: str
    limits: Limits
    resumed: bool = False
    server_id: str = ""
    shm: bool = False
    proof: bytes | None = None
    role: str = "write"


@dataclass(frozen=True, slots=True)
class Challenge:
    """The server requires a token: the answer to a ``hello`` that carried a nonce, with the
    server's own fresh nonce. The client answers with :class:`Auth`."""

    id: int
    nonce: bytes


class Stored(_Record):
    """Reply to put/append: the bin's new version and item count (and items dropped to make
    room, for a bin configured with ``overflow="drop_oldest"``)."""

    __slots__ = ("id", "version", "n_items", "dropped")
    _fields = __slots__

    def __init__(self, id: int, version: int, n_items: int, dropped: int = 0) -> None:
        self.id = id
        self.version = version
        self.n_items = n_items
        self.dropped = dropped


class Fetched(_Record):
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


@dataclass(frozen=True, slots=True)
class Listing:
    id: int
    bins: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Deleted:
    id: int
    existed: bool
    version: int


@dataclass(frozen=True, slots=True)
class Listening:
    id: int
    version: int
    n_items: int


class Acked(_Record):
    """Reply to unlisten (was listening), cancel (was cancelled) and ping (always True)."""

    __slots__ = ("id", "flag")
    _fields = __slots__

    def __init__(self, id: int, flag: bool = True) -> None:
        self.id = id
        self.flag = flag


@dataclass(frozen=True, slots=True)
class StatsReply:
    """Reply to stats: ``server`` (uptime, connections, memory, counters) and ``bins``
    (name -> summary), as plain msgpack maps documented in docs/PROTOCOL.md."""

    id: int
    server: dict[str, Any]
    bins: dict[str, dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Configured:
    """Reply to configure: the bin's limits as the server now applies them."""

    id: int
    max_items: int | None
    max_bytes: int | None
    overflow: str


class ErrorReply(_Record):
    """A request failed. ``id`` is 0 for a connection-level error sent before closing."""

    __slots__ = ("id", "code", "message")
    _fields = __slots__

    def __init__(self, id: int, code: str, message: str) -> None:
        self.id = id
        self.code = code
        self.message = message


class Changed(_Record):
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


Reply = Union[HelloReply, Challenge, Stored, Fetched, Listing, Deleted, Listening, Acked, StatsReply,
              Configured, ErrorReply]
Message = Union[Request, Reply, Changed]
