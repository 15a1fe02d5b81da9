"""The options of a connection, in one place: :class:`ClientOptions`.

Every face (:class:`~.blocking.Client`, :class:`~.twisted.TxClient` and its ``connect``,
:class:`~.sharded.ShardedClient` and its ``connect``, ``TensorShare``) accepts
``options=ClientOptions(...)`` beside its keywords (which stay as they were: a keyword given
beside ``options`` overrides that field), builds one :class:`ClientOptions` and reads from
it. Here are the options' defaults and their checks, once.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Final, TypedDict

from ..memory.pool import receive_pool
from .command import check_reconnect, check_timeout
from .endpoint import Endpoint, resolve
from .session import ClientSession

__all__ = ["UNSET", "AllOptionFields", "ClientOptions", "ConnectFields", "OptionFields",
           "TransportFields", "Unset"]

COMPRESSIONS = (None, "lz4", "auto")


class Unset(enum.Enum):
    """The type of :data:`UNSET`: a face's positional ``timeout`` that was not given."""

    UNSET = "UNSET"

    def __repr__(self) -> str:
        return "UNSET"


#: Not given (the value of ``options``, or the default, holds).
UNSET: Final = Unset.UNSET


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientOptions:
    """How a client connects and talks to its server(s); checked once, when made.

    ``options.replace(timeout=5)`` derives a variant (checked again). Every client face
    takes ``options=`` and the same names as keywords; a keyword overrides the field.

    Attributes:
        timeout: seconds the server has to answer a request (a get/peek that waits for data
            gets its wait on top); also how long the first connection may take.
        reconnect: ``True``: when the connection drops, reconnect with backoff and carry on
            where it stopped (calls wait within their own timeout); a number: give up after
            that many seconds without a connection; ``False``: fail every call at the first
            drop, as a plain socket would.
        compress: ``"lz4"`` to compress large tensor buffers before sending; ``"auto"``:
            only large integer and bool buffers that shrink by an eighth (frames, masks;
            never floats); ``None``: never.
        compress_min_bytes: buffers smaller than this are never compressed.
        name: how this client introduces itself in the server's log (``None``: the face's
            own, ``"tensorshare-python"`` or ``"tensorshare-twisted"``).
        session: ``True``: exactly-once replay across reconnects. ``False``: no session (a
            tool that sends one request does not need one).
        heartbeat: seconds of silence after which a ping checks that the server is still
            there (a dead peer is noticed, and acknowledgements reach the server); ``None``:
            a third of ``timeout``, at most 5 s.
        shm: over a Unix socket (``unix://PATH``, Linux), pass tensors of at least
            ``shm_min_bytes`` through shared memory instead of the socket: a put writes them
            once into a sealed memfd, a get maps the server's with no copy at all.
        shm_min_bytes: the smallest buffer worth sharing (below, the socket is faster).
        tls: connect with TLS (``None``: as the URL or ``TENSORSHARE_URL`` says).
        tls_ca: the CA that signed the server's certificate (``None``:
            ``TENSORSHARE_TLS_CA``, else the system's); the server's host name is checked too.
        token, token_file: the server's token (``None``: ``TENSORSHARE_TOKEN`` or the file
            ``TENSORSHARE_TOKEN_FILE`` names); it never crosses the wire (nor the repr).
        user: the user that token is for, on a server with a users file (``None``:
            ``TENSORSHARE_USER``; neither: the user ``default``).

    Raises:
        ValueError: a ``timeout`` that is not a positive number of seconds, a ``reconnect``
            that is neither a bool nor one, or a ``compress`` other than None/lz4/auto.
        TypeError: a name that is not an option.
    """

    timeout: float = 30.0
    reconnect: bool | float = True
    compress: str | None = None
    compress_min_bytes: int = 64 * 1024
    name: str | None = None
    session: bool = True
    heartbeat: float | None = None
    shm: bool = True
    shm_min_bytes: int = 1 << 20
    tls: bool | None = None
    tls_ca: str | None = None
    token: str | bytes | None = field(default=None, repr=False)
    token_file: str | None = None
    user: str | None = None

    def __post_init__(self) -> None:
        if self.compress not in COMPRESSIONS:
            raise ValueError(f"compress must be None, 'lz4' or 'auto', not {self.compress!r}")
        object.__setattr__(self, "timeout", check_timeout(self.timeout))
        object.__setattr__(self, "reconnect", check_reconnect(self.reconnect))

    def replace(self, **changes: Any) -> ClientOptions:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes) if changes else self

    @classmethod
    def of(cls, options: ClientOptions | None, **changes: Any) -> ClientOptions:
        """``options`` (default: all defaults) with the keywords a face was given (those
        given as :data:`UNSET` left out: a face's ``timeout`` that was not given)."""
        if UNSET in changes.values():
            changes = {k: v for k, v in changes.items() if v is not UNSET}
        if options is None:
            return cls(**changes)
        if not isinstance(options, ClientOptions):
            raise TypeError(f"options must be a ClientOptions, not {type(options).__name__}")
        return options.replace(**changes)

    def endpoint(self, host: str | None, port: int | None) -> Endpoint:
        """Where to connect and how to prove who this is (see :mod:`.endpoint`).

        Raises:
            ValueError, OSError: as :func:`~.endpoint.resolve`.
        """
        return resolve(host, port, tls=self.tls, tls_ca=self.tls_ca, token=self.token,
                       token_file=self.token_file, user=self.user)

    def new_session(self, endpoint: Endpoint, name: str, own_transport: bool) -> ClientSession:
        """A connection's session, named ``name`` unless :attr:`name` says otherwise; shared
        memory is offered over a Unix socket the client opens itself (``own_transport``)."""
        session = ClientSession(address=str(endpoint), timeout=self.timeout,
                                reconnect=self.reconnect, name=self.name or name,
                                session=self.session, heartbeat=self.heartbeat,
                                token=endpoint.token, user=endpoint.user)
        if self.shm and own_transport and endpoint.address.path is not None:
            from ..memory import shm

            session.shm = shm.available()
        pool = receive_pool()
        if pool is not None:  # large values land in memory a dropped value gave back
            session.allocate = pool.take
        return session


class TransportFields(TypedDict, total=False):
    """The fields of :class:`ClientOptions` but ``timeout``, ``name`` and ``compress``: how
    a connection reaches its server and keeps its session, as the keywords of a wing whose
    own ``timeout``, ``name`` and ``compress`` mean something else (``InferenceHost``,
    ``InferenceClient``: the client's own go in ``options=``)."""

    reconnect: bool | float
    compress_min_bytes: int
    session: bool
    heartbeat: float | None
    shm: bool
    shm_min_bytes: int
    tls: bool | None
    tls_ca: str | None
    token: str | bytes | None
    token_file: str | None
    user: str | None


class ConnectFields(TransportFields, total=False):
    """The fields of :class:`ClientOptions` but ``timeout`` and ``name``, as the keywords of
    a wing whose own ``timeout`` and ``name`` mean something else (``serve_loader``'s
    stream, ``SharedLoader``'s job: the client's name goes in ``options=``)."""

    compress: str | None


class OptionFields(ConnectFields, total=False):
    """The fields of :class:`ClientOptions` but ``timeout`` as a face's keywords (for type
    checkers; a face whose ``timeout`` is positional takes it on its own)."""

    name: str


class AllOptionFields(OptionFields, total=False):
    """Every field of :class:`ClientOptions` as a face's keywords (for type checkers)."""

    timeout: float
