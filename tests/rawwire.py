"""Wire helpers for tests: a bare client side that numbers requests and parses replies, and
the server's side of a connection driven as the server drives it.

Tests that speak the protocol by hand (a raw socket, a server on a StringTransport) use
:class:`WireClient`; tests that play the server (a scripted peer for a client, the parser's
own tests) use :class:`ServerWire`; ``Get``/``Peek`` build the one fetch message the protocol
has.
"""

from __future__ import annotations

from typing import Any

from tensorshare.errors import ProtocolError
from tensorshare.wire.frames import BytesLike, Frame, OversizedFrame
from tensorshare.wire.messages import Fetch, FetchSpec, Limits, Message, Request
from tensorshare.wire.protocol import (
    AckInfo,
    ClientConnection,
    ProtocolViolation,
    ServerConnection,
    encode_reply,
    op_name,
)

__all__ = ["Get", "Peek", "ServerWire", "WireClient", "replaced", "server_frames"]


def replaced(msg: Any, **changes: Any) -> Any:
    """``msg`` with ``changes``: ``dataclasses.replace`` for a dataclass message, ``_replace``
    for the records of every request (see tensorshare.wire.records)."""
    import dataclasses

    if dataclasses.is_dataclass(msg):
        return dataclasses.replace(msg, **changes)
    return msg._replace(**changes)


def Get(rid: int, name: str, max_items: int | None = None, wait: bool = False,  # noqa: N802
        timeout: float | None = None, min_tag: int | None = None,
        newer_than: int | None = None, min_items: int = 1) -> Fetch:
    """A get request (the fields of :class:`FetchSpec`, positionally as they used to be)."""
    return Fetch(rid, name, FetchSpec(True, max_items, wait, timeout, min_tag, newer_than,
                                      min_items))


def Peek(rid: int, name: str, max_items: int | None = None, wait: bool = False,  # noqa: N802
         timeout: float | None = None, min_tag: int | None = None,
         newer_than: int | None = None, min_items: int = 1) -> Fetch:
    """A peek request."""
    return Fetch(rid, name, FetchSpec(False, max_items, wait, timeout, min_tag, newer_than,
                                      min_items))


class WireClient:
    """The client side of a connection without a session: ids, ops, frames.

    ``send`` remembers each request's op so that ``receive_data`` can parse its reply.
    """

    def __init__(self, limits: Limits | None = None) -> None:
        self.conn = ClientConnection(limits)
        self.ops: dict[int, str] = {}
        self._next = 0

    @property
    def limits(self) -> Limits:
        return self.conn.limits

    def set_limits(self, limits: Limits) -> None:
        self.conn.set_limits(limits)

    def next_id(self) -> int:
        self._next += 1
        return self._next

    def send(self, msg: Request, ack: AckInfo | None = None) -> list[BytesLike]:
        chunks = self.conn.send(msg, ack)
        self.ops[msg.id] = op_name(msg)
        return chunks

    def frame(self, msg: Request, ack: AckInfo | None = None) -> bytes:
        return b"".join(self.send(msg, ack))

    def forget(self, rid: int) -> None:
        self.ops.pop(rid, None)

    def receive_data(self, data: BytesLike) -> list[Any]:
        return self.conn.receive_data(data, self.ops.get)


class ServerWire:
    """The server's side of one connection, driven as ``server/connection.py`` drives it:
    :meth:`ServerConnection.frames` (or ``buffered``), then :meth:`ServerConnection.parse`
    frame by frame; replies and notifications encoded by :func:`encode_reply`.

    ``receive_data`` returns what the server would act on, in order: each request (or
    ``BadRequest``) preceded by the ``AckInfo`` it carried, and a ``ProtocolViolation`` last
    when the peer broke the wire format. Other attributes are the ``ServerConnection``'s.
    """

    def __init__(self, limits: Limits | None = None, **kw: Any) -> None:
        self.conn = ServerConnection(limits, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)

    def receive_data(self, data: BytesLike) -> list[Any]:
        return self._events(*self.conn.frames(data))

    def buffer_updated(self, nbytes: int) -> list[Any]:
        return self._events(*self.conn.buffered(nbytes))

    def send(self, msg: Message) -> list[BytesLike]:
        return encode_reply(msg)  # (notifications and errors take the general path)

    def _events(self, frames: list[Frame | OversizedFrame],
                error: ProtocolError | None) -> list[Any]:
        out: list[Any] = []
        try:
            for frame in frames:
                msg, through, open_ids = self.conn.parse(frame)
                if through >= 0:
                    out.append(AckInfo(through, open_ids))
                out.append(msg)
        except ProtocolError as exc:
            error = exc
        if error is not None:
            out.append(ProtocolViolation(str(error)))
        return out


def server_frames(*msgs: Any) -> bytes:
    """Frames as the server would send them."""
    return b"".join(b"".join(encode_reply(m)) for m in msgs)
