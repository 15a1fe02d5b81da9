"""What every client face (blocking, asyncio, Twisted) says of its connection: the server's
handshake and whether the client is connected or closed, read from its sans-I/O
:class:`~.session.ClientSession`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import ConnectError, ConnectionLost, TensorShareError
from .session import Done, Drop, Notify, Ready, Send

if TYPE_CHECKING:
    from ..wire.messages import Limits
    from .session import ClientSession

__all__ = ["Refused", "SessionEvents", "SessionFacts", "connect_failed", "dropped", "reconnected",
           "try_again"]


class _Reconnecting(Protocol):
    """What :func:`dropped` reads and sets of a face's connection."""

    address: str
    timeout: float
    reconnect: bool | float
    _lost_at: float | None

    def _end(self, error: TensorShareError) -> None: ...

    def _connect_failed(self, exc: OSError, start: float) -> bool: ...


class Refused(Exception):
    """A connection attempt that retrying would not fix (TLS refused it): ``error`` ends the
    session."""

    def __init__(self, error: TensorShareError) -> None:
        super().__init__(str(error))
        self.error = error


def try_again(face: _Reconnecting, exc: OSError | Refused, start: float) -> bool:
    """A face's connection attempt raised ``exc``: ``True`` when it tries again (its
    ``_connect_failed`` says so), ``False`` when the session ended (TLS refused, or the face
    gave up)."""
    if isinstance(exc, Refused):
        face._end(exc.error)
        return False
    return face._connect_failed(exc, start)


def connect_failed(face: _Reconnecting, session: ClientSession, exc: OSError, start: float,
                   now: float, log: logging.Logger) -> bool:
    """A face's connection attempt failed (``start``: its first try): ``False`` when it gives
    up (never connected within its timeout: ``ConnectError``; unreachable past its
    ``reconnect`` time: ``ConnectionLost``; the session is ended with it), else ``True`` (it
    waits, then tries again)."""
    what = exc or type(exc).__name__
    if session.server is None:  # never connected yet
        if not face.reconnect or now - start >= face.timeout:
            face._end(ConnectError(f"cannot connect to tensorshare server at {face.address}: "
                                   f"{what}"))
            return False
    elif session.give_up_due(now):
        since = session.disconnected_since or now
        face._end(ConnectionLost(
            f"the tensorshare server at {face.address} has been unreachable for "
            f"{now - since:.1f} s ({session.last_loss}); gave up (reconnect={face.reconnect:g})"))
        log.warning("gave up reconnecting to tensorshare server at %s", face.address)
        return False
    session.last_loss = f"cannot connect: {what}"
    return True


def dropped(face: _Reconnecting, session: ClientSession, elapsed: float, now: float,
            reason: object, log: logging.Logger) -> bool:
    """A face's connection ended (``elapsed`` seconds after its first try): ``False`` when
    it gives up (its first connection kept dropping mid-handshake until its timeout: it
    ends with ``ConnectError``), else ``True`` (it reconnects; the outage's start is noted
    and logged once)."""
    if session.server is None and elapsed >= face.timeout:
        face._end(ConnectError(
            f"cannot connect to tensorshare server at {face.address}: no handshake within "
            f"{face.timeout:g} s (last: {reason})"))
        return False
    if face._lost_at is None:
        face._lost_at = now
        log.warning("lost connection to tensorshare server at %s (%s); reconnecting",
                    face.address, reason)
    return True


def reconnected(face: _Reconnecting, ev: Ready, now: float, log: logging.Logger) -> None:
    """A face connected again (``ev``: not its first handshake): the outage ends, logged."""
    away = now - face._lost_at if face._lost_at is not None else 0.0
    face._lost_at = None
    how = "session resumed" if ev.resumed else "new session: the server did not know ours"
    log.warning("reconnected to tensorshare server at %s after %.1f s (%s)", face.address,
                away, how)


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
