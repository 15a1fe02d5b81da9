"""The server's session table: what makes a client's requests take effect exactly once.

A client opens a session (a random id sent in ``hello``) and numbers its requests. For each
session the server remembers the replies to requests that changed something (put, append,
delete, configure, get) until the client acknowledges them; a resent request whose reply is
remembered gets that reply again instead of running twice. The items a get took stay held
here, referenced by the remembered reply, until acknowledged: if the client never comes back
(the session expires) or gives up on the get (cancel), they go back to the front of their bin.

Sessions whose connection is gone wait for their client in the order they were detached
(:meth:`SessionTable.detach`), so the server needs one timer for all of them (the earliest
deadline, :meth:`SessionTable.next_expiry`) and a full table can make room by ending the
session that has waited longest (:meth:`SessionTable.longest_detached`).

Pure data structure: no sockets, no timers (the server owns the one expiry timer), no bytes.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, cast

from ..wire.frames import PREFIX
from ..wire.messages import Reply
from ..wire.records import (
    Fetched,
    Stored,
)
from ..wire.replies import ReplyReader

__all__ = ["Remembered", "ServerSession", "SessionTable"]


class Remembered:
    """One remembered reply.

    Attributes:
        reply: the reply as it was sent.
        bin: for a get that returned items, the bin they came from (else ``None``).
        held: bytes of items this reply holds (they left the bin and wait for an ack).
    """

    __slots__ = ("reply", "bin", "held")

    def __init__(self, reply: Reply, bin: str | None = None, held: int = 0) -> None:
        self.reply = reply
        self.bin = bin
        self.held = held

    def __repr__(self) -> str:
        return f"Remembered({self.reply!r}, bin={self.bin!r}, held={self.held})"


#: Reads remembered put replies back (the reactor's thread only, as every session).
_READER = ReplyReader()


def reply_of(r: Remembered | bytes) -> Reply:
    """The reply a remembered entry holds: a put's is kept as the frame it was sent in
    (``bytes``, no object per put), read back here when asked (a snapshot, a lookup)."""
    if type(r) is bytes:
        rid = _READER.reply_id(r[PREFIX:])
        reply = _READER.reply(rid, Stored, b"") if rid is not None else None
        if reply is None:  # (only what protocol.stored_frame wrote is remembered so)
            raise ValueError("a remembered reply frame that is not a put's")
        return cast(Reply, reply)
    return cast(Remembered, r).reply


class ServerSession:
    """One client session.

    Attributes:
        id: the 16-byte session id the client chose.
        replies: request id -> remembered reply, in the order they were made: a
            :class:`Remembered`, or for a put the bytes of its reply's frame (see
            :func:`reply_of`).
        held: bytes of get items held for this session.
        attached: the connection currently serving the session (opaque), or ``None``.
        remembered_bytes: rough size of the remembered replies themselves.
        usage: the bookkeeping of the user the session belongs to (see
            :mod:`~tensorshare.server.accounts`): what the session holds counts for it (summed
            when asked, not per request); only that user may resume the session. ``None``
            until a connection binds it.
        order: the ids of ``replies`` as a min-heap, so an ack finds what it releases
            without scanning every remembered reply (a pipelining client may have
            thousands in flight). Entries of replies dropped another way are skipped when
            they surface.
    """

    __slots__ = ("id", "replies", "held", "attached", "remembered_bytes", "usage", "order")

    def __init__(self, id: bytes) -> None:
        self.id = id
        self.replies: dict[int, Remembered | bytes] = {}
        self.held = 0
        self.attached: Any = None
        self.remembered_bytes = 0
        self.usage: Any = None
        self.order: list[int] = []

    def __repr__(self) -> str:
        return (f"ServerSession({self.id.hex()}, {len(self.replies)} replies, "
                f"held={self.held})")

    def lookup(self, rid: int) -> Reply | None:
        """The remembered reply to request ``rid``, if it ran already."""
        r = self.replies.get(rid)
        return None if r is None else reply_of(r)

    def remembered(self) -> list[tuple[int, Reply, str | None, int]]:
        """Every remembered reply as ``(id, reply, bin, held)``, in order (a snapshot's)."""
        return [(rid, r.reply, r.bin, r.held) if type(r) is Remembered else
                (rid, reply_of(r), None, 0) for rid, r in self.replies.items()]


class SessionTable:
    """Every session the server knows, with the bytes they hold.

    Args:
        max_sessions: how many sessions may exist at once (attached or not).
        max_session_bytes: the most bytes of unacknowledged get items one session may hold.
    """

    #: What one remembered reply without items is counted as (its objects and table slot).
    REPLY_COST = 200
    #: What a session itself is counted as: measured, a server's resident memory grows by
    #: about 1.6 kB per session that holds one remembered reply.
    SESSION_COST = 1_500

    def __init__(self, max_sessions: int = 10_000, max_session_bytes: int = 1 << 30) -> None:
        self.max_sessions = max_sessions
        self.max_session_bytes = max_session_bytes
        self.sessions: dict[bytes, ServerSession] = {}
        self.held = 0  # bytes of get items held, all sessions together
        self.remembered = 0  # bytes counted for remembered replies (REPLY_COST each)
        # Sessions whose connection is gone: id -> when they expire, oldest first.
        self.detached: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self.sessions)

    def __iter__(self) -> Iterator[ServerSession]:
        return iter(list(self.sessions.values()))

    @property
    def nbytes(self) -> int:
        """Everything the sessions hold: get items, the remembered replies, themselves."""
        return self.held + self.remembered + self.SESSION_COST * len(self.sessions)

    @property
    def full(self) -> bool:
        """Whether a new session needs room first."""
        return len(self.sessions) >= self.max_sessions

    def detach(self, s: ServerSession, expires: float) -> None:
        """The connection of ``s`` is gone; it expires at ``expires`` unless resumed."""
        self.detached.pop(s.id, None)
        self.detached[s.id] = expires

    def reattach(self, s: ServerSession) -> None:
        """A connection took ``s`` up again."""
        self.detached.pop(s.id, None)

    def next_expiry(self) -> float | None:
        """When the session that has waited longest expires (``None``: none waits)."""
        return next(iter(self.detached.values()), None)

    def longest_detached(self) -> ServerSession | None:
        """The session that has waited longest for its client, if any."""
        sid = next(iter(self.detached), None)
        return None if sid is None else self.sessions.get(sid)

    def get(self, sid: bytes) -> ServerSession | None:
        """The session with this id, if the server knows it."""
        return self.sessions.get(sid)

    def open(self, sid: bytes) -> ServerSession:
        """Create a session (the id is the client's).

        Raises:
            OverflowError: ``max_sessions`` sessions exist already (the server ends a
                detached one first, see :meth:`longest_detached`).
        """
        if self.full:
            raise OverflowError(f"the server holds {len(self.sessions)} sessions, all of them "
                                f"with a connection, its max_sessions={self.max_sessions}")
        s = self.sessions[sid] = ServerSession(sid)
        return s

    def remember(self, s: ServerSession, rid: int, reply: Reply | bytes,
                 bin: str | None = None, held: int = 0) -> None:
        """Remember the reply to ``rid`` (a get that returned items names its bin and size;
        a put's comes as the bytes of its frame, kept as they are); a reply remembered
        already (a resent request answered again) stays as it was."""
        replies = s.replies
        if rid in replies:
            return
        heapq.heappush(s.order, rid)
        if type(reply) is bytes:
            replies[rid] = reply
        else:
            replies[rid] = Remembered(cast(Reply, reply), bin, held)
            s.held += held
            self.held += held
        s.remembered_bytes += self.REPLY_COST
        self.remembered += self.REPLY_COST

    def ack(self, s: ServerSession, through: int, open_ids: tuple[int, ...] = ()) -> int:
        """Forget the replies the client says it has (ids up to ``through`` not in ``open``).

        Returns:
            How many bytes of held items this released.
        """
        replies, order = s.replies, s.order
        if not order or order[0] > through:
            return 0  # (the usual case between two requests: nothing this old is remembered)
        gone: list[int] = []
        kept: list[int] = []
        while order and order[0] <= through:
            rid = heapq.heappop(order)
            if rid in replies:
                (kept if rid in open_ids else gone).append(rid)
        for rid in kept:
            heapq.heappush(order, rid)
        return self._drop(s, gone) if gone else 0

    def forget(self, s: ServerSession, rid: int) -> Remembered | bytes | None:
        """Drop one remembered reply and return it (cancel: the client gave up on it)."""
        r = s.replies.get(rid)
        if r is not None:
            self._drop(s, [rid])
        return r

    def close(self, s: ServerSession) -> list[tuple[str, Fetched, int]]:
        """Remove a session (expired or never resumed).

        Returns:
            ``(bin, reply, held)`` for every get whose items were never acknowledged, in
            the order the gets ran: the caller puts them back at the front of their bins.
        """
        restore = [(r.bin, r.reply, r.held) for r in s.replies.values()
                   if type(r) is Remembered and r.bin is not None
                   and isinstance(r.reply, Fetched)]
        self._drop(s, list(s.replies))
        s.order.clear()
        if s.usage is not None:  # (no longer one of its user's: see users.Usage.sessions)
            s.usage.owned.discard(s)
        self.sessions.pop(s.id, None)
        self.detached.pop(s.id, None)
        return restore

    def _drop(self, s: ServerSession, rids: list[int]) -> int:
        freed = 0
        n = 0
        for rid in rids:
            r = s.replies.pop(rid, None)
            if r is not None:
                if type(r) is Remembered:
                    freed += r.held
                n += 1
        s.held -= freed
        self.held -= freed
        cost = self.REPLY_COST * n
        s.remembered_bytes -= cost
        self.remembered -= cost
        return freed
