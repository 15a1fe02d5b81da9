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

from .records import (
    Acked,
    Append,
    Changed,
    ErrorReply,
    Fetch,
    Fetched,
    FetchSpec,
    Item,
    Put,
    Stored,
)

__all__ = [
    "Acked",
    "Append",
    "Auth",
    "Batch",
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
    "OfBin",
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
class ListBins:
    id: int


@dataclass(frozen=True, slots=True)
class OfBin:
    """A request on one bin: its id and the bin's name, the fields every request that names
    one bin starts with (``delete``, ``listen`` and ``unlisten`` carry nothing else; the
    requests of streams and replay bins add their own)."""

    id: int
    bin: str


class Batch:
    """A request that carries ``item``, then ``rest``: its :attr:`items` (mixed into the
    writes of the bin kinds: ``stream_append``, ``replay_insert``)."""

    __slots__ = ()
    item: Item
    rest: tuple[Item, ...]

    @property
    def items(self) -> tuple[Item, ...]:
        """Every item of the request, in order."""
        return (self.item, *self.rest) if self.rest else (self.item,)


@dataclass(frozen=True, slots=True)
class Delete(OfBin):
    """Delete the bin."""


@dataclass(frozen=True, slots=True)
class Listen(OfBin):
    """Hear of each change of the bin (``Changed``), from now on."""


@dataclass(frozen=True, slots=True)
class Unlisten(OfBin):
    """Hear no more of the bin's changes."""


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


Reply = Union[HelloReply, Challenge, Stored, Fetched, Listing, Deleted, Listening, Acked, StatsReply,
              Configured, ErrorReply]
Message = Union[Request, Reply, Changed]
