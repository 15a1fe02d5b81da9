"""What every client face (blocking, asyncio, Twisted) says of its connection: the server's
handshake and whether the client is connected or closed, read from its sans-I/O
:class:`~.session.ClientSession`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .session import Done, Drop, Notify, Ready, Send

if TYPE_CHECKING:
    from ..wire.messages import Limits
    from .session import ClientSession

__all__ = ["SessionEvents", "SessionFacts"]


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


class SessionEvents:
    """A mixin of the asyncio and Twisted clients: :meth:`_process` hands each event of their
    session to the client's own handler of its kind."""

    __slots__ = ()

    _finish: Callable[[Done], None]
    _notify: Callable[[Notify], None]
    _on_ready: Callable[[Ready], None]
    _drop: Callable[[str], None]
    _send: Callable[[Any], None]

    def _process(self, events: list[Any]) -> None:
        for ev in events:
            cls = type(ev)
            if cls is Done:
                self._finish(ev)
            elif cls is Notify:
                self._notify(ev)
            elif cls is Ready:
                self._on_ready(ev)
            elif cls is Drop:
                self._drop(ev.reason)
            elif cls is Send:
                self._send(ev.chunks)
