"""Every request, reply and notification as a frozen dataclass.

These are the values the rest of the code passes around; the string-keyed msgpack maps they
become on the wire are built and parsed only in :mod:`tensorshare.protocol`.
A value carried by a message is an :class:`~tensorshare.codec.Encoded` (msgpack bytes plus
raw buffers): the server stores and returns it without ever decoding a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from .codec import Encoded

__all__ = [
    "Acked",
    "Append",
    "Cancel",
    "Changed",
    "Delete",
    "Deleted",
    "ErrorReply",
    "Fetched",
    "Get",
    "Hello",
    "HelloReply",
    "Item",
    "Limits",
    "ListBins",
    "Listen",
    "Listening",
    "Listing",
    "Message",
    "Peek",
    "Ping",
    "Put",
    "Reply",
    "Request",
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


# -- requests (client -> server) --------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Hello:
    id: int
    versions: tuple[int, ...]
    client: str = ""
    auth: str | None = None  # reserved for token auth; servers today ignore it


@dataclass(frozen=True, slots=True)
class Put:
    id: int
    bin: str
    item: Item


@dataclass(frozen=True, slots=True)
class Append:
    id: int
    bin: str
    item: Item


@dataclass(frozen=True, slots=True)
class Get:
    """Return and remove the content of a bin (see :class:`Peek` for the fields)."""

    id: int
    bin: str
    max_items: int | None = None
    wait: bool = False
    timeout: float | None = None  # only with wait; None waits without limit
    min_tag: int | None = None  # items tagged below this are dropped on the server
    newer_than: int | None = None  # only data of a bin whose version is above this counts
    min_items: int = 1  # with wait: wait until at least this many items are available


@dataclass(frozen=True, slots=True)
class Peek:
    """Return the content of a bin without removing it."""

    id: int
    bin: str
    max_items: int | None = None
    wait: bool = False
    timeout: float | None = None
    min_tag: int | None = None
    newer_than: int | None = None
    min_items: int = 1


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
class Cancel:
    """Give up on a waiting get/peek (the client timed out on it)."""

    id: int
    target: int


Request = Union[Hello, Put, Append, Get, Peek, ListBins, Delete, Listen, Unlisten, Ping, Cancel]


# -- replies and notifications (server -> client) ---------------------------------------------
@dataclass(frozen=True, slots=True)
class HelloReply:
    id: int
    version: int
    server: str
    limits: Limits


@dataclass(frozen=True, slots=True)
class Stored:
    """Reply to put/append: the bin's new version and item count."""

    id: int
    version: int
    n_items: int


@dataclass(frozen=True, slots=True)
class Fetched:
    """Reply to get/peek.

    Attributes:
        kind: ``"value"`` for a put bin (one item), ``"list"`` for an appended bin.
        items: the items returned, oldest first.
        version: the bin's version after the operation.
        n_items: items left in the bin.
        dropped: items removed because their tag was below ``min_tag``.
        unchanged: ``newer_than`` was given and the bin is not newer (no items sent).
    """

    id: int
    kind: str
    items: tuple[Item, ...]
    version: int
    n_items: int
    dropped: int = 0
    unchanged: bool = False


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
class ErrorReply:
    """A request failed. ``id`` is 0 for a connection-level error sent before closing."""

    id: int
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Changed:
    """Notification: a bin the connection listens to changed."""

    bin: str
    op: str  # "put", "append", "get" or "delete"
    n_items: int
    version: int


Reply = Union[HelloReply, Stored, Fetched, Listing, Deleted, Listening, Acked, ErrorReply]
Message = Union[Request, Reply, Changed]
