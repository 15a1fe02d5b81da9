"""The server's parts as the others see them, declared once.

What the responder (:mod:`.handlers`), the kinds of bins (:mod:`.streams`, :mod:`.services`),
the users (:mod:`.users`) and the connection may use of the server, grouped by concern
(:class:`Stores`, :class:`Sessions`, :class:`Statistics`, :class:`Settings`,
:class:`Accounts`, :class:`Kinds`, :class:`Listeners`, :class:`Persistence`; all of them
together: :class:`Server`), and what they may use of one connection (:class:`Conn`, the
connection's face toward handlers). They are :class:`typing.Protocol` classes:
:class:`~.core.ServerFactory` and :class:`~.connection.ServerProtocol` satisfy them without
naming them, and mypy checks it where they are handed over. No module below ``core`` and
``connection`` imports either: the server's import graph is a pyramid.

Also here, because every request meets them: :class:`Route` (how one op is served, looked
up once per request) and :data:`Handler` (what serves it), and :class:`Kind` (what the server
asks of a kind of bins beside the store's).

A handler *returns* its reply; the connection alone remembers, encodes, counts and sends it
(:meth:`Conn.answer`). A handler that answers later (a waiting read, a held append, a take
that waits) returns ``None`` and answers through ``answer`` when it is served. Work that must
follow its reply (a ``bye`` closes the connection after its ``ok``; a stream op notifies and
serves what waits after its own reply) is handed to :meth:`Conn.then`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..errors import TensorShareError
    from ..memory.pool import BufferPool
    from ..wire.frames import BytesLike
    from ..wire.messages import Changed, Fetched, Limits
    from ..wire.protocol import ServerConnection
    from .accounts import Usage, User
    from .auth import FailedAttempts
    from .config import ServerConfig
    from .sessions import ServerSession, SessionTable
    from .stats import ServerStats
    from .store import Store, Waits

__all__ = ["AnyReply", "Conn", "Handler", "Kind", "Route", "Server"]


class AnyReply(Protocol):
    """A reply of any op: the store's (``wire.messages.Reply``) or another kind's (the
    rows the wire's op table is built from name them all)."""

    @property
    def id(self) -> int:
        """The request it answers."""
        ...


#: What serves one request: returns its reply (or, for the common replies, the bytes of its
#: frame: a put's), or ``None`` when it is answered later through the connection's
#: :meth:`Conn.answer`.
Handler = Callable[["Conn", Any], "AnyReply | bytes | None"]


class Route:
    """How the server serves one op, looked up once per request (``Responder.route``).

    Attributes:
        op: the wire op.
        handler: serves the request (see :data:`Handler`).
        mutating: its reply is remembered for the session (exactly once across reconnects).
        read: allowed with the read-only token and on a relay.
        access: what the connection's user needs on the request's bin (``Op.access``).
        store: a request on a value or list bin (a bin of another kind refuses it).
        logged: it writes to the data log, so a full disk refuses it first.
    """

    __slots__ = ("op", "handler", "mutating", "read", "store", "logged", "access")

    def __init__(self, op: str, handler: Handler, mutating: bool, read: bool, store: bool,
                 logged: bool, access: str = "write") -> None:
        self.op = op
        self.handler = handler
        self.mutating = mutating
        self.read = read
        self.store = store
        self.logged = logged
        self.access = access

    def __repr__(self) -> str:
        return f"Route({self.op!r}, mutating={self.mutating}, read={self.read})"


# -- one connection -------------------------------------------------------------------------
class Conn(Protocol):
    """One client connection, as the handlers, the kinds, the users and the server's core
    use it (:class:`~.connection.ServerProtocol`)."""

    #: Its session while attached (``None``: a client without one).
    session: ServerSession | None
    #: The user its handshake proved, and what that user holds (set by ``Users.bind``).
    user: User | None
    usage: Usage | None
    #: The bins it listens to.
    listening: set[str]
    #: ``host:port`` (or the socket's name) of the client.
    peer: str
    #: When bytes last arrived (``time.monotonic()``).
    last_rx: float
    transport: Any
    #: Whether it keeps reading while its output backs up (a replica's link: its
    #: acknowledgements are tiny, and what it is sent is bounded by ``--replica-buffer``).
    keeps_reading: bool
    #: Its sans-I/O side: the frame decoder, the bytes received per op.
    conn: ServerConnection

    @property
    def closed(self) -> bool:
        """Whether it is closed or closing (it answers nothing any more)."""
        ...

    @property
    def queued_bytes(self) -> int:
        """Bytes written to it and not yet sent."""
        ...

    def ctx(self, msg: Any) -> tuple[bytes, int] | None:
        """What ties a store effect to ``msg`` (for the data log's remembered replies)."""
        ...

    def answer(self, msg: Any, reply: Any) -> None:
        """Answer ``msg`` later (a handler returns its reply instead): remembered, encoded,
        counted and sent, as a returned reply is."""
        ...

    def then(self, work: Callable[[], None]) -> None:
        """Run ``work`` once the request being handled now is answered."""
        ...

    def gather(self) -> bool:
        """Gather what is sent to it until :meth:`flush`, for one write (``False``: it
        gathers already, or is closed; do not flush it then)."""
        ...

    def flush(self) -> None:
        """Write what was gathered, in one write."""
        ...

    def wait(self, rid: int, waiter: Waits, timeout: float | None,
             on_timeout: Callable[[], None]) -> None:
        """Keep request ``rid`` waiting until answered, cancelled, timed out (``on_timeout``
        answers it) or the connection ends."""
        ...

    def stop_waiting(self, rid: int) -> None:
        """A waiting request was served: forget it (and its timer)."""
        ...

    def cancel_wait(self, rid: int) -> bool | None:
        """Withdraw a waiting request: whether it was still waiting; ``None``: not ours."""
        ...

    def serve_later(self, msg: Any) -> None:
        """Serve a request kept waiting before it acted (a write waiting for room in its
        user's quota), and answer it."""
        ...

    def notify(self, chunks: Sequence[BytesLike], msg: Changed) -> None:
        """Send a change notification (folded while the client reads slowly)."""
        ...

    def committed(self) -> None:
        """The data log is written: send the replies held for it."""
        ...

    def taken_over(self, by: str) -> None:
        """Another connection (from ``by``) took its session over: say so and close."""
        ...

    def close(self) -> None:
        """Close after what is queued is sent."""
        ...

    def fail(self, error: TensorShareError) -> None:
        """Tell the peer why (a connection-level error), then close."""
        ...


# -- the kinds of bins ----------------------------------------------------------------------
class Kind(Protocol):
    """What the server asks of a kind of bins beside the store's (streams, services)."""

    #: What ``ls`` and the stats call its bins ("stream", "service").
    name: str

    @property
    def table(self) -> Mapping[str, Any]:
        """Its bins by name (what :meth:`owns` looks in), the same mapping for the server's
        life: the responder checks a store request's name against it without a call."""
        ...

    def handlers(self) -> dict[type, Handler]:
        """Its requests' handlers, by request type."""
        ...

    def owns(self, name: str) -> bool:
        """Whether the bin ``name`` is one of this kind's."""
        ...

    def refused(self, conn: Conn, op: str, header: Mapping[str, Any], why: str) -> None:
        """One of its requests was refused before it was parsed (``header``: its fields, as
        they came; ``why``: the error it got): what it names that waits on it (a service's
        batch) is settled now."""
        ...

    def connection_lost(self, conn: Conn) -> None:
        """A connection is gone: what it held (waits, leases) is released or starts to expire."""
        ...

    def session_ended(self, sid: bytes) -> None:
        """A session ended (expired, or said bye)."""
        ...

    def describe(self, glob: str | None) -> dict[str, dict[str, Any]]:
        """Its bins (matching ``glob``) for the stats: each with at least ``kind``,
        ``n_items``, ``nbytes`` and ``version``."""
        ...

    @property
    def nbytes(self) -> int:
        """Bytes its bins hold (counted against max_memory)."""
        ...


# -- the server, by concern -----------------------------------------------------------------
class Receiving(Protocol):
    """The frames still arriving, counted against ``max_memory`` (``core.ReceiveBudget``)."""

    receiving: int

    def reserve(self, nbytes: int) -> str | None: ...

    def release(self, nbytes: int) -> None: ...


class Stores(Protocol):
    """The store and the memory around it."""

    @property
    def store(self) -> Store: ...

    #: The most bytes of items one reply carries.
    max_reply_bytes: int

    @property
    def pool(self) -> BufferPool: ...

    @property
    def budget(self) -> Receiving: ...

    @property
    def ledger(self) -> Any:
        """The bytes queued on every connection's transport (``core.QueuedLedger``)."""
        ...

    def held_bytes(self) -> int:
        """What the server holds for clients outside the bins."""
        ...

    def queued_bytes(self) -> int: ...

    def restore(self, name: str, reply: Fetched, *, logged: bool = False,
                owner: Any = None) -> None:
        """Put the items of a get reply back at the front of their bin."""
        ...

    def encode_peek(self, name: str, reply: Fetched, shared: list[Any] | None,
                    runs: bool = False) -> list[BytesLike]: ...


class Sessions(Protocol):
    """The exactly-once sessions and their life."""

    @property
    def sessions(self) -> SessionTable: ...

    def attach(self, sid: bytes, proto: Conn, resume: bool) -> tuple[ServerSession, bool]: ...

    def detach(self, s: ServerSession, proto: Conn) -> None: ...

    def end_session(self, s: ServerSession) -> None: ...

    def ack(self, s: ServerSession, through: int, open_ids: tuple[int, ...] = ()) -> None: ...


class Statistics(Protocol):
    """Counters, and the two maps of the ``stats`` reply."""

    @property
    def stats(self) -> ServerStats: ...

    server_id: str

    def server_stats(self) -> dict[str, Any]: ...

    def bin_stats(self, glob: str | None = None) -> dict[str, dict[str, Any]]: ...


class Settings(Protocol):
    """Every setting, and the reactor that runs the server's timers."""

    @property
    def config(self) -> ServerConfig: ...

    @property
    def reactor(self) -> Any: ...

    limits: Limits


class Admission(Protocol):
    """What the others use of the server's users (:class:`.users.Users`)."""

    @property
    def authenticating(self) -> bool: ...

    @property
    def anonymous(self) -> User: ...

    def candidates(self, name: str | None) -> list[User]: ...

    def refuse(self, conn: Conn, user: User, sid: bytes | None) -> TensorShareError | None: ...

    def bind(self, conn: Conn, user: User) -> None: ...

    def admit(self, conn: Conn, route: Route, msg: Any) -> bool | AnyReply: ...

    def handlers(self) -> dict[type, Handler]: ...

    def readable(self, conn: Conn, bins: dict[str, Any]) -> dict[str, Any]: ...

    def stats(self, conn: Conn, server: Callable[[], dict[str, Any]],
              bins: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]: ...

    def describe(self) -> dict[str, dict[str, Any]]: ...

    def reload(self) -> list[str]: ...


class Accounts(Protocol):
    """Who may connect, and what each connection's user may do."""

    @property
    def users(self) -> Admission: ...

    @property
    def auth_failures(self) -> FailedAttempts: ...


class Responding(Protocol):
    """Routes requests to their handlers (:class:`.handlers.Responder`)."""

    def route(self, msg: Any) -> Route: ...

    def handle(self, conn: Conn, msg: Any, route: Route | None = None
               ) -> AnyReply | bytes | None: ...

    def refused(self, conn: Conn, op: str, header: Mapping[str, Any], why: str) -> None: ...


class Kinds(Protocol):
    """The kinds of bins, and the responder whose table holds every kind's handlers."""

    @property
    def kinds(self) -> Sequence[Kind]: ...

    @property
    def responder(self) -> Responding: ...


class Listeners(Protocol):
    """The connections, and who listens to which bin."""

    @property
    def connections(self) -> set[Conn]: ...

    def subscribe(self, name: str, proto: Conn) -> None: ...

    def unsubscribe(self, name: str, proto: Conn) -> None: ...

    def listener_count(self, name: str | None = None) -> int: ...

    def listened_bins(self) -> list[str]: ...

    def changed(self, name: str, op: str, n_items: int, version: int, dropped: int) -> None:
        """Bin ``name`` changed: notify its listeners."""
        ...


class DataLog(Protocol):
    """What the others use of the data log (:class:`.persist.Persistence`)."""

    def session_record(self, op: str, sid: bytes, **fields: Any) -> None: ...

    def add(self, header: dict[str, Any], buffers: list[Any] | None = None) -> None:
        """A record of another kind of bin (replay bins)."""
        ...


class Persistence(Protocol):
    """The data log, and the replies that wait for it."""

    @property
    def persist(self) -> DataLog | None: ...

    @property
    def holding(self) -> bool:
        """Whether replies to writes must wait for the data log now."""
        ...

    def hold(self, conn: Conn) -> None:
        """``conn`` holds replies until the data log is written: :meth:`commit` tells it
        (:meth:`Conn.committed`)."""
        ...

    def commit(self) -> None:
        """End of a batch of work: write the data log, then release held output."""
        ...

    def storage_refuses(self, nbytes: int) -> str | None: ...


class Server(Stores, Sessions, Statistics, Settings, Accounts, Kinds, Listeners, Persistence,
             Protocol):
    """The whole server as its parts see it (:class:`~.core.ServerFactory`)."""
