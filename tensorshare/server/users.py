"""The server's users: the one check of every request, writes waiting for room in a quota,
what a user sees, and reload.

Who the users are and what each holds is :mod:`.accounts` (:class:`~.accounts.User`, the
users file, :class:`~.accounts.Usage`). Here is what the server does with them:

What each op needs is a column of the op table (:attr:`~tensorshare.wire.protocol.Op.access`):
:meth:`Users.admit`, called once per request before it acts, checks it against the
connection's user, refuses it with ``permission_denied`` naming the user, the op and the bin,
and counts requests and denials per user. Over its user's ``max_memory`` a write fails with
``quota_exceeded`` (:meth:`~.accounts.Usage.check_room`), or, when it asked to ``wait_room``
(a put or an append), waits here (FIFO per user) until there is room or its timeout runs out.

:meth:`Users.reload` (``SIGHUP``, the ``reload`` op) rereads the users file and every token
file; a file that fails to parse keeps the old users and says why.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from twisted.logger import Logger

from ..errors import AuthenticationError, InvalidRequest, PermissionDenied, QuotaExceeded, code_for
from ..wire.messages import Acked, Append, ErrorReply, Put, Reload, Request
from ..wire.protocol import item_wire_size
from .accounts import DEFAULT, READONLY, Usage, User, UserBudget, load_users
from .auth import read_ops_text

if TYPE_CHECKING:
    from .parts import Conn, Handler, Route, Server

__all__ = ["ROOM_POLL", "Users"]

log = Logger(namespace="tensorshare.server")

#: How often writes waiting for room in their user's quota look again (seconds).
ROOM_POLL = 0.02


@dataclass(eq=False)
class _Parked:
    """A write waiting for room in its user's quota. Waits on its connection like a blocked
    append (``conn.wait``: its timeout, a ``cancel`` and the connection's end withdraw it);
    ``name`` is empty, which no bin is, so the store's ``cancel`` finds no queue of its own."""

    conn: Conn
    msg: Put | Append
    size: int
    name: str = ""
    active: bool = True
    counted: bool = True


def _waits(msg: Request) -> bool:
    """Whether ``msg`` is a write that asked to wait for room in its user's quota."""
    if isinstance(msg, Put):
        return msg.room is not None
    return isinstance(msg, Append) and msg.wait_room


def _wait_of(msg: Put | Append) -> float | None:
    """How long a write may wait for room (``None``: no limit)."""
    if isinstance(msg, Put):
        return None if msg.room is None or msg.room == math.inf else msg.room
    return msg.timeout


def _size_of(msg: Put | Append) -> int:
    if isinstance(msg, Put):
        return item_wire_size(msg.item)
    return sum(item_wire_size(it) for it in msg.items)


# -- the server's users --------------------------------------------------------------------------
class Users:
    """The users of one server: who they are, what they may do, what they hold.

    Args:
        server: the server (its ``config`` names the users file and the token files).

    Raises:
        ValueError: the configuration's users cannot be loaded (see :func:`load_users`).
    """

    def __init__(self, server: Server) -> None:
        self.server = server
        self.table: dict[str, User] = load_users(server.config)
        self.usage: dict[str, Usage] = {}
        #: Every connection's user on a server without tokens: everything, no quota.
        self.anonymous = User(DEFAULT, (), ("*",), ("*",), admin=True)
        self._releasing: Request | None = None  # see _poll

    @property
    def authenticating(self) -> bool:
        """Whether clients must prove a user's token (else everyone is ``default``)."""
        return bool(self.table)

    def candidates(self, name: str | None) -> list[User]:
        """The users a hello that names ``name`` may prove (none named: ``default``, then, for
        clients from before users, ``readonly``)."""
        if name is not None:
            user = self.table.get(name)
            return [] if user is None else [user]
        return [u for u in (self.table.get(DEFAULT), self.table.get(READONLY)) if u is not None]

    def usage_of(self, name: str) -> Usage:
        """The bookkeeping of user ``name`` (made on first use)."""
        u = self.usage.get(name)
        if u is None:
            u = self.usage[name] = Usage(name)
            user = self.table.get(name)
            u.max_memory = None if user is None else user.max_memory
        return u

    # -- the handshake ------------------------------------------------------------------------
    def refuse(self, conn: Conn, user: User, sid: bytes | None
               ) -> PermissionDenied | QuotaExceeded | None:
        """Why ``conn`` may not start as ``user`` with session ``sid`` (``None``: it may)."""
        s = self.server.sessions.get(sid) if sid is not None else None
        owner = getattr(s, "usage", None)
        if owner is not None and owner.name != user.name:
            return PermissionDenied(
                f"the session this client names belongs to another user: a session can be "
                f"resumed or taken over only by the user that opened it (this is user "
                f"{user.name!r})")
        limit = user.max_connections
        if limit is None:
            return None
        u = self.usage_of(user.name)
        live = u.live()
        taken = s is not None and s.attached in live  # it will be closed: one replaces it
        if len(live) - taken >= limit:
            u.refusals += 1
            return QuotaExceeded(f"user {user.name!r} has {len(live)} connections open, its "
                                 f"quota max_connections={limit} (the server's users file); "
                                 f"close one or raise the quota")
        return None

    def bind(self, conn: Conn, user: User) -> None:
        """``conn`` authenticated as ``user``: count it, its frames and its session for it."""
        u = self.usage_of(user.name)
        conn.user, conn.usage = user, u
        u.conns.add(conn)
        decoder = conn.conn.decoder
        if decoder.budget is not None and not decoder.reserved:
            decoder.budget = UserBudget(decoder.budget, u)
        s = conn.session
        if s is not None and s.usage is None:
            s.usage = u  # what it holds counts for u (see Usage.sessions)
            u.owned.add(s)

    # -- the one check of every request ---------------------------------------------------------
    def admit(self, conn: Conn, route: Route, msg: Any) -> bool | ErrorReply:
        """Whether ``msg`` may act now: ``True``; its refusal, to answer it with
        (``permission_denied``); or ``False``, a write that asked to wait for room in a full
        quota, kept until there is room (then served and answered: ``Conn.serve_later``).

        The responder asks it for every request (once it counted it for its user) unless
        the user may do everything without a quota (:attr:`User.unrestricted`)."""
        if msg is self._releasing:  # a write that waited for room, let go by _poll
            return True
        user = conn.user
        if user is None or user.unrestricted:
            return True
        if not user.may(route.access, route.op, getattr(msg, "bin", None)):
            return self._deny(conn, route, msg)
        if user.max_memory is not None and _waits(msg):
            return self._room_or_wait(conn, msg)
        return True

    def _deny(self, conn: Conn, route: Route, msg: Any) -> ErrorReply:
        user, op = conn.user, route.op
        assert user is not None and conn.usage is not None
        conn.usage.denials += 1
        self.server.stats.counters["denials"] += 1
        name = getattr(msg, "bin", None)
        if user.ops is not None and op not in user.ops:
            why = (f"{op} is not allowed with the read-only token (it may {read_ops_text()}); "
                   f"use the read-write token")
        elif route.access == "admin":
            why = (f"user {user.name!r} may not {op}: only a user with admin = true in the "
                   f"server's users file may")
        else:
            need = {"read": "read", "write": "write"}.get(route.access, "read and write")
            pats = {"read": user.read, "write": user.write}
            have = "; ".join(f"it may {k} {', '.join(v) if v else 'no bins'}"
                             for k, v in pats.items() if k in need)
            why = (f"user {user.name!r} may not {op} bin {name!r}: {op} needs {need} "
                   f"permission on it ({have})")
        return ErrorReply(msg.id, PermissionDenied.code, why)

    # -- writes waiting for room in their user's quota -----------------------------------------
    def _growth(self, usage: Usage, msg: Put | Append, size: int) -> int:
        """What ``msg`` would add to what ``usage`` holds (a put replaces its own value)."""
        if type(msg) is Put:
            return size - self.server.store.owned_by(msg.bin, usage)
        return size

    def _room_or_wait(self, conn: Conn, msg: Put | Append) -> bool | ErrorReply:
        u = conn.usage
        assert u is not None and u.max_memory is not None
        size = _size_of(msg)
        if u.held() + self._growth(u, msg, size) <= u.max_memory and not u.parked:
            return True
        if size > u.max_memory or u.waiting + size > u.max_memory:
            return True  # can never fit, or too much waits already: refused at once
        p = _Parked(conn, msg, size)
        try:
            conn.wait(msg.id, p, _wait_of(msg), lambda: self._wait_ran_out(p))
        except InvalidRequest as exc:
            return ErrorReply(msg.id, code_for(exc), str(exc))
        u.parked.append(p)
        u.waiting += size
        self.server.budget.receiving += size  # held here: the server's memory counts it
        self._poll_soon(u)
        return False

    def _release(self, u: Usage, p: _Parked) -> None:
        p.active = False
        if p.counted:
            p.counted = False
            u.waiting -= p.size
            self.server.budget.receiving -= p.size

    def _wait_ran_out(self, p: _Parked) -> None:
        u = p.conn.usage
        assert u is not None
        self._release(u, p)
        u.refusals += 1
        msg = p.msg
        what = "a put" if type(msg) is Put else "an append"
        p.conn.answer(msg, ErrorReply(msg.id, QuotaExceeded.code, (
            f"{what} of {p.size} bytes to bin {msg.bin!r} waited {_wait_of(msg) or 0:g} s for "
            f"room, but user {u.name!r} stayed at its quota max_memory={u.max_memory} (the "
            f"server's users file); nothing was stored")))

    def _poll_soon(self, u: Usage) -> None:
        if u.timer is None or not u.timer.active():
            u.timer = self.server.reactor.callLater(ROOM_POLL, self._poll, u)

    def _poll(self, u: Usage) -> None:
        """Let waiting writes go, oldest first, while their user has room."""
        u.timer = None
        served = False
        while u.parked:
            p = u.parked[0]
            if not p.active or p.conn.closed:
                u.parked.popleft()
                self._release(u, p)
                continue
            limit = u.max_memory
            if limit is not None and u.held() + self._growth(u, p.msg, p.size) > limit:
                break
            u.parked.popleft()
            self._release(u, p)
            p.conn.stop_waiting(p.msg.id)
            self._releasing = p.msg
            u.requests -= 1  # (counted when it came: the responder counts it again)
            try:
                p.conn.serve_later(p.msg)
            finally:
                self._releasing = None
            served = True
        if served:
            self.server.commit()  # (the data log, then the replies that wait for it)
        if u.parked:
            self._poll_soon(u)

    # -- what a user sees ----------------------------------------------------------------------
    def readable(self, conn: Conn, bins: dict[str, Any]) -> dict[str, Any]:
        """The entries of ``bins`` (by name) that ``conn``'s user may read."""
        user = conn.user
        if user is None or user.reads_all:
            return bins
        return {name: b for name, b in bins.items() if user.may_read(name)}

    def describe(self) -> dict[str, dict[str, Any]]:
        """Every user's entry in the stats (``users``)."""
        names = sorted(set(self.table) | set(self.usage))
        return {name: self.usage_of(name).describe(self.table.get(name)) for name in names}

    def stats(self, conn: Conn, server: Callable[[], dict[str, Any]],
              bins: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The ``stats`` reply's two maps for ``conn``: the whole server for a user who may
        read every bin, else only its own bins and its own totals."""
        user, u = conn.user, conn.usage
        assert user is not None and u is not None
        full = server()
        full["user"] = u.describe(user)
        if user.reads_all:
            return full, bins
        mine = self.readable(conn, bins)
        return _own_stats(full, u, len(mine), self._sessions_of(u)), mine

    @staticmethod
    def _sessions_of(u: Usage) -> tuple[int, int]:
        return len(u.owned), sum(1 for s in u.owned if s.attached is None)

    # -- reloading ---------------------------------------------------------------------------
    def reload(self) -> list[str]:
        """Reread the users file and every token file, and apply them: connections already
        authenticated keep going under their user's new rights and quotas (listens on bins
        it may no longer read end); a user no longer defined is disconnected.

        Returns:
            The users now defined.

        Raises:
            ValueError: the new configuration does not load; the old one stays (the
                message, also logged, says why).
        """
        try:
            table = load_users(self.server.config)
            if self.table and not table:
                raise ValueError("it defines no user at all: the server would then accept "
                                 "every client without a token")
        except ValueError as exc:
            log.error("reloading the users failed, the old users stay: {error}", error=exc)
            raise
        self.table = table
        for name, u in self.usage.items():
            user = table.get(name)
            u.max_memory = None if user is None else user.max_memory
        for conn in list(self.server.connections):
            self._rebind(conn, table)
        log.info("reloaded the users: {names}", names=", ".join(sorted(table)) or "none")
        return sorted(table)

    def _rebind(self, conn: Conn, table: dict[str, User]) -> None:
        old = conn.user
        if old is None or old is self.anonymous or conn.closed:
            return
        new = table.get(old.name)
        if new is None:
            conn.fail(AuthenticationError(f"user {old.name!r} was removed from the server's "
                                          f"users file"))
            return
        conn.user = new
        for name in [n for n in conn.listening if not new.may_read(n)]:
            conn.listening.discard(name)
            self.server.unsubscribe(name, conn)

    def handlers(self) -> dict[type, Handler]:
        """The ``reload`` op's handler (for the responder's table)."""
        return {Reload: self._reload_op}

    def _reload_op(self, conn: Conn, msg: Reload) -> ErrorReply | Acked:
        try:
            self.reload()
        except ValueError as exc:
            return ErrorReply(msg.id, InvalidRequest.code,
                              f"reload failed, the old users stay: {exc}")
        return Acked(msg.id, True)


def _own_stats(full: dict[str, Any], u: Usage, n_bins: int,
               sessions: tuple[int, int]) -> dict[str, Any]:
    """The server map of a ``stats`` reply for a user who may not see the whole server: the
    same keys, with its own totals (its connections, bins, memory against its quota)."""
    mine = full["user"]
    mem = mine["memory"]
    conns = u.live()
    return {
        "server": full["server"], "server_id": full["server_id"], "time": full["time"],
        "uptime": full["uptime"], "connections": len(conns),
        "listeners": sum(len(c.listening) for c in conns), "sessions": sessions[0],
        "sessions_detached": sessions[1], "persistence": None, "bins": n_bins,
        "memory": {"stored": mem["stored"], "sessions": mem["sessions"],
                   "output": mem["output"], "receiving": mem["receiving"],
                   "total": mem["total"], "max_memory": mem["max_memory"], "pool_idle": 0},
        "waiting": {"fetches": 0, "appends": 0}, "counters": {}, "errors": {},
        "requests": {}, "bytes_in": {}, "bytes_out": {},
        "latency": {"buckets": full["latency"]["buckets"], "ops": {}, "sum_us": {}},
        "user": mine,
    }

