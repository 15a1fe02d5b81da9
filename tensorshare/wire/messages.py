"""Every request, reply and notification as a frozen dataclass.

These are the values the rest of the code passes around; the string-keyed msgpack maps they
become on the wire are built and parsed only in :mod:`tensorshare.protocol`, through its one
table of ops. A value carried by a message is an :class:`~tensorshare.codec.Encoded`
(msgpack bytes plus raw buffers): the server stores and returns it without ever decoding a
tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, Union

from .codec import Encoded

T = TypeVar("T")

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
    "Reload",
    "Reply",
    "Request",
    "Stats",
    "StatsReply",
    "Stored",
    "Unlisten",
]


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


@dataclass(frozen=True, slots=True)
class Item:
    """One stored value as it travels: the encoded value and an optional integer tag.

    The tag is opaque to the server except for ``min_tag`` filtering; the RL wrappers put
    the parameter version a rollout was made with there.
    """

    value: Encoded
    tag: int | None = None


@dataclass(frozen=True, slots=True)
class FetchSpec:
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

    remove: bool
    max_items: int | None = None
    wait: bool = False
    timeout: float | None = None
    min_tag: int | None = None
    newer_than: int | None = None
    min_items: int = 1

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
        user: the user the client authenticates as (its token is that user's; the name is
            bound into the proof); ``None``: the user ``default``.
    """

    id: int
    versions: tuple[int, ...]
    client: str = ""
    nonce: bytes | None = None
    session: bytes | None = None
    resume: bool = False
    shm: bool = False  # the client can pass large buffers as sealed memfds (Unix socket)
    user: str | None = None


@dataclass(frozen=True, slots=True)
class Auth:
    """The second step of a handshake with a token: the client's proof (see
    :mod:`tensorshare.wire.auth`). Answered by the :class:`HelloReply`."""

    id: int
    proof: bytes


@dataclass(frozen=True, slots=True)
class Put:
    """Replace a bin's content with ``item``.

    ``room``: when the user's ``max_memory`` has no room for it, wait up to this many seconds
    for room (``math.inf``: until cancelled or disconnected); ``None``: fail at once. (One
    field, not two: a put is made on every write.)
    """

    id: int
    bin: str
    item: Item
    room: float | None = None


@dataclass(frozen=True, slots=True)
class Append:
    """Add items to a bin: ``item``, then those in ``rest``, all or none, as one change.

    ``timeout``: how long an append to a full ``block`` bin may wait for room (``None``:
    until the client cancels it or disconnects); with ``wait_room``, also how long it may wait
    for room in its user's ``max_memory`` (else it fails at once when there is none).
    """

    id: int
    bin: str
    item: Item
    timeout: float | None = None
    rest: tuple[Item, ...] = ()
    wait_room: bool = False

    @property
    def items(self) -> tuple[Item, ...]:
        """Every item of the append, in order."""
        return (self.item, *self.rest) if self.rest else (self.item,)


@dataclass(frozen=True, slots=True)
class Fetch:
    """Return the content of a bin, removing it (get) or not (peek); see :class:`FetchSpec`."""

    id: int
    bin: str
    spec: FetchSpec


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


@dataclass(frozen=True, slots=True)
class Reload:
    """Reread the server's users file and token files (what ``SIGHUP`` does); only for a user
    allowed to (``admin``)."""

    id: int


Request = Union[Hello, Put, Append, Fetch, ListBins, Delete, Listen, Unlisten, Ping, Cancel,
                Stats, Configure, Bye, Auth, Reload]


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
        role: what the connection may do: ``"write"`` or ``"read"`` (the read-only token's
            user, or a user that may write nothing).
        user: the user the connection acts as (``"default"`` unless the hello named another).
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
    user: str = "default"


@dataclass(frozen=True, slots=True)
class Challenge:
    """The server requires a token: the answer to a ``hello`` that carried a nonce, with the
    server's own fresh nonce. The client answers with :class:`Auth`."""

    id: int
    nonce: bytes


@dataclass(frozen=True, slots=True)
class Stored:
    """Reply to put/append: the bin's new version and item count (and items dropped to make
    room, for a bin configured with ``overflow="drop_oldest"``)."""

    id: int
    version: int
    n_items: int
    dropped: int = 0


@dataclass(frozen=True, slots=True)
class Fetched(Generic[T]):
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

    id: int
    kind: str
    items: tuple[T, ...]
    version: int
    n_items: int
    dropped: int = 0
    unchanged: bool = False
    tags: tuple[int | None, ...] = field(default=(), compare=False)
    nbytes: int = field(default=0, compare=False)

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


@dataclass(frozen=True, slots=True)
class Acked:
    """Reply to unlisten (was listening), cancel (was cancelled) and ping (always True)."""

    id: int
    flag: bool = True


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


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """A request failed. ``id`` is 0 for a connection-level error sent before closing."""

    id: int
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Changed:
    """Notification: a bin the connection listens to changed.

    ``op`` is ``"put"``, ``"append"``, ``"get"``, ``"delete"``, ``"restore"`` (items a lost
    client had taken went back to the bin) or, client-side only, ``"resync"``. ``skipped``
    counts earlier changes folded into this one for a listener that read too slowly, and
    ``dropped`` the items an append pushed out of a full ``drop_oldest`` bin.
    """

    bin: str
    op: str
    n_items: int
    version: int
    skipped: int = 0
    dropped: int = 0


Reply = Union[HelloReply, Challenge, Stored, Fetched, Listing, Deleted, Listening, Acked, StatsReply,
              Configured, ErrorReply]
Message = Union[Request, Reply, Changed]
