"""What every client face (blocking, asyncio, Twisted) says of its connection: the server's
handshake and whether the client is connected or closed, read from its sans-I/O
:class:`~.session.ClientSession`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..wire.messages import Limits
    from .session import ClientSession

__all__ = ["SessionFacts"]


class SessionFacts:
    """A mixin of the clients: properties read from the session :meth:`_client_session`
    gives (each client holds its own)."""

    __slots__ = ()

    shm_min_bytes: int

    def _client_session(self) -> ClientSession:
        raise NotImplementedError

    @property
    def limits(self) -> Limits:
        """The server's limits (from the last handshake)."""
        return self._client_session().limits

    @property
    def server_version(self) -> str:
        """The server's software and version, e.g. ``"tensorshare/0.2.0"``."""
        hello = self._client_session().server
        return hello.server if hello else ""

    @property
    def protocol_version(self) -> int:
        hello = self._client_session().server
        return hello.version if hello else 0

    @property
    def server_id(self) -> str:
        """Random per server data set: it changes when the server restarted without
        persistence (bin versions then started again)."""
        hello = self._client_session().server
        return hello.server_id if hello else ""

    @property
    def connected(self) -> bool:
        """Whether the client is connected right now (``False`` while reconnecting)."""
        session = self._client_session()
        return session.connected and session.closed is None

    @property
    def closed(self) -> bool:
        """Whether the client is closed (or gave up reconnecting): every call fails."""
        return self._client_session().closed is not None

    @property
    def shared_memory(self) -> bool:
        """Whether large tensors travel through shared memory on this connection."""
        conn = self._client_session().conn
        return conn is not None and conn.shm

    def _share_min_bytes(self) -> int | None:
        conn = self._client_session().conn
        return self.shm_min_bytes if conn is not None and conn.shm else None
