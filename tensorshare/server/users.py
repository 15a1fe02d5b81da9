"""Users: many teams on one server, each with its own token(s), bins and quotas.

A user is a name, the tokens that prove it (one per line of its token file, all valid, so a
new one can be rolled out before the old one goes), glob patterns over bin names it may
``read`` and ``write`` (every kind of bin: value and list bins, streams, services), and
quotas: ``max_memory`` (what its writes hold at once) and ``max_connections``. They come
from one TOML file (``tensorshare serve --users-file PATH``)::

    [users.alice]
    token_file = "alice.token"          # relative to the users file
    read  = ["alice/*", "shared/*"]
    write = ["alice/*"]
    max_memory = "4G"
    max_connections = 64

    [users.dash]
    token_file = "dash.token"
    read = ["*"]

``--token-file`` and ``--read-token-file`` are two built-in users: ``default`` (everything,
``admin``) and ``readonly`` (exactly the read-only token's rights: peek, list, stats and
listen, on every bin). A hello that names no user is ``default`` (or, for clients from before
users, ``readonly`` when its proof is made with that token).

What each op needs is a column of the op table (:attr:`~tensorshare.wire.protocol.Op.access`):
:meth:`Users.admit`, called once per request before it acts, checks it against the
connection's user, answers ``permission_denied`` naming the user, the op and the bin, and
counts requests and denials per user. What a user's writes hold is kept per user
(:class:`Usage`): the items it stored (the store charges each item to its writer until it
leaves its bin), what its sessions hold, its frames still arriving and its connections'
queued output. Over ``max_memory`` a write fails with ``quota_exceeded``, or, when it asked to
``wait_room``, waits here (FIFO per user) until there is room or its timeout runs out.

:meth:`Users.reload` (``SIGHUP``, the ``reload`` op) rereads the users file and every token
file; a file that fails to parse keeps the old users and says why.
"""

from __future__ import annotations

import fnmatch
import math
import os
import re
import tomllib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger

from ..errors import InvalidRequest, PermissionDenied, QuotaExceeded, code_for
from ..wire.auth import check_user_name, tokens_of
from ..wire.messages import Acked, Append, ErrorReply, Put, Reload, Request
from ..wire.protocol import OPS, item_wire_size
from .auth import read_ops_text
from .config import ServerConfig
from .sessions import ServerSession, SessionTable

if TYPE_CHECKING:
    from .connection import ServerProtocol
    from .core import ServerFactory
    from .handlers import Route

__all__ = ["DEFAULT", "READONLY", "Usage", "User", "Users", "load_users", "parse_size"]

log = Logger(namespace="tensorshare.server")

DEFAULT, READONLY = "default", "readonly"
#: What the built-in ``readonly`` user may send: the read-only token's ops, as before users.
READ_ONLY_OPS = frozenset(name for name, op in OPS.items() if op.read)
#: How often writes waiting for room in their user's quota look again (seconds).
ROOM_POLL = 0.02
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_USER_KEYS = frozenset({"token_file", "read", "write", "max_memory", "max_connections",
                        "admin"})


def parse_size(value: object, what: str = "max_memory") -> int:
    """A byte count: an int, or a string such as ``"4G"``, ``"512M"``, ``"64KiB"``
    (K, M, G, T: powers of 1024).

    Raises:
        ValueError: anything else, or less than 1.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(?:i?B)?\s*", value, re.IGNORECASE)
        if m is None:
            raise ValueError(f"{what} must be a number of bytes such as 4G or 512M, "
                             f"not {value!r}")
        n = int(m.group(1)) * _UNITS[m.group(2).upper()]
    else:
        raise ValueError(f"{what} must be a number of bytes such as 4G or 512M, not {value!r}")
    if n < 1:
        raise ValueError(f"{what} must be at least 1 byte")
    return n


def _matcher(patterns: tuple[str, ...]) -> Callable[[str], bool]:
    """One compiled test for a list of shell-style patterns (``*`` matches ``/`` too)."""
    if "*" in patterns:
        return lambda name: True
    if not patterns:
        return lambda name: False
    rx = re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns))
    return lambda name: rx.match(name) is not None


@dataclass(frozen=True, eq=False)
class User:
    """One user, as the users file (or a built-in) defines it.

    Attributes:
        name: the name a client gives (``user=``, ``TENSORSHARE_USER``, ``--user``).
        keys: the keys of its tokens (any of them proves the user).
        read, write: glob patterns over bin names it may read and write.
        max_memory: bytes its writes may hold at once (``None``: no quota).
        max_connections: connections it may have open at once (``None``: no quota).
        admin: it may reload the users (the ``reload`` op).
        ops: the only ops it may send at all (the built-in ``readonly``); ``None``: any.
    """

    name: str
    keys: tuple[bytes, ...] = ()
    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    max_memory: int | None = None
    max_connections: int | None = None
    admin: bool = False
    ops: frozenset[str] | None = None
    may_read: Callable[[str], bool] = field(init=False, repr=False)
    may_write: Callable[[str], bool] = field(init=False, repr=False)
    #: Nothing about it needs checking per request (everything, admin, no quota).
    unrestricted: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "may_read", _matcher(self.read))
        object.__setattr__(self, "may_write", _matcher(self.write))
        object.__setattr__(self, "unrestricted", "*" in self.read and "*" in self.write
                           and self.admin and self.ops is None and self.max_memory is None)

    @property
    def reads_all(self) -> bool:
        """Whether it may read every bin (and so sees the whole server's statistics)."""
        return "*" in self.read

    def may(self, access: str, op: str, name: str | None) -> bool:
        """Whether it may send ``op`` (needing ``access``, see ``Op.access``) on bin ``name``."""
        if self.ops is not None and op not in self.ops:
            return False
        if access == "none":
            return True
        if access == "admin":
            return self.admin
        if name is None:
            return False  # an op that needs a bin but names none: refused, never skipped
        if access == "read":
            return self.may_read(name)
        if access == "write":
            return self.may_write(name)
        return self.may_read(name) and self.may_write(name)  # "take", or anything new

    def role(self) -> str:
        """The hello reply's ``role``: ``"read"`` for a user that may write nothing."""
        return "read" if not self.write else "write"


# -- reading the users file and the token files -------------------------------------------------
def _read_keys(path: str, who: str) -> tuple[bytes, ...]:
    try:
        with open(path, "rb") as f:
            return tuple(tokens_of(f.read()))
    except OSError as exc:
        raise ValueError(f"cannot read the token file of {who} ({path}): "
                         f"{exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"the token file of {who} ({path}): {exc}") from None


def _patterns(spec: dict[str, Any], key: str, who: str) -> tuple[str, ...]:
    value = spec.get(key, [])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
        raise ValueError(f"{who}: {key!r} must be a list of glob patterns (strings), e.g. "
                         f"[\"team/*\"]")
    return tuple(value)


def _user_of(name: str, spec: Any, base: str) -> User:
    """One ``[users.NAME]`` table."""
    who = f"user {name!r}"
    try:
        check_user_name(name)
    except ValueError as exc:
        raise ValueError(f"[users.{name}]: {exc}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"[users.{name}] must be a table")
    unknown = set(spec) - _USER_KEYS
    if unknown:
        raise ValueError(f"{who}: unknown key(s) {', '.join(sorted(unknown))} (known: "
                         f"{', '.join(sorted(_USER_KEYS))})")
    token_file = spec.get("token_file")
    if not isinstance(token_file, str) or not token_file:
        raise ValueError(f"{who} needs a token_file (the file of its token(s), one per line)")
    path = os.path.join(base, os.path.expanduser(token_file))
    max_memory = spec.get("max_memory")
    max_conns = spec.get("max_connections")
    if max_conns is not None and (not isinstance(max_conns, int) or isinstance(max_conns, bool)
                                  or max_conns < 1):
        raise ValueError(f"{who}: max_connections must be a whole number of at least 1")
    admin = spec.get("admin", False)
    if not isinstance(admin, bool):
        raise ValueError(f"{who}: admin must be true or false")
    return User(name, _read_keys(path, who), _patterns(spec, "read", who),
                _patterns(spec, "write", who),
                None if max_memory is None else parse_size(max_memory, f"{who}: max_memory"),
                max_conns, admin)


def _read_users_file(path: str) -> list[User]:
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise ValueError(f"cannot read the users file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"the users file {path} is not valid TOML: {exc}") from None
    extra = set(doc) - {"users"}
    if extra:
        raise ValueError(f"the users file {path}: unknown top-level key(s) "
                         f"{', '.join(sorted(extra))} (users are [users.NAME] tables)")
    table = doc.get("users", {})
    if not isinstance(table, dict):
        raise ValueError(f"the users file {path}: 'users' must be a table of [users.NAME]")
    base = os.path.dirname(os.path.abspath(path))
    try:
        return [_user_of(name, spec, base) for name, spec in table.items()]
    except ValueError as exc:
        raise ValueError(f"the users file {path}: {exc}") from None


def _builtin(config: ServerConfig) -> list[User]:
    """``default`` (--token-file) and ``readonly`` (--read-token-file)."""
    out: list[User] = []
    if config.token_file is not None:
        out.append(User(DEFAULT, _read_keys(config.token_file, "--token-file"), ("*",), ("*",),
                        admin=True))
    elif config.token:
        out.append(User(DEFAULT, tuple(tokens_of(config.token)), ("*",), ("*",), admin=True))
    read_keys: tuple[bytes, ...] = ()
    if config.read_token_file is not None:
        read_keys = _read_keys(config.read_token_file, "--read-token-file")
    elif config.read_token:
        read_keys = tuple(tokens_of(config.read_token))
    if read_keys:
        if not out and config.users_file is None:
            raise ValueError("a read-only token needs a read-write token too (--token-file)")
        out.append(User(READONLY, read_keys, ("*",), (), ops=READ_ONLY_OPS))
    return out


def load_users(config: ServerConfig) -> dict[str, User]:
    """Every user the configuration defines (empty: the server requires no token).

    Raises:
        ValueError: a file cannot be read or parsed, a user is defined twice, two users (or
            the read-write and the read-only token) share a token; the message says which.
    """
    users: dict[str, User] = {}
    builtin = _builtin(config)
    from_file = _read_users_file(config.users_file) if config.users_file is not None else []
    for user in builtin + from_file:
        if user.name in users:
            raise ValueError(f"user {user.name!r} is defined twice (--token-file defines "
                             f"'default', --read-token-file 'readonly')")
        users[user.name] = user
    owner: dict[bytes, str] = {}
    for user in users.values():
        for key in user.keys:
            other = owner.setdefault(key, user.name)
            if other != user.name:
                if {other, user.name} == {DEFAULT, READONLY}:
                    raise ValueError("the read-only token must differ from the read-write "
                                     "token")
                raise ValueError(f"users {other!r} and {user.name!r} have the same token: "
                                 f"each user needs its own")
    return users


# -- what each user holds and does ---------------------------------------------------------------
class _QuotaReason(str):
    """Why a user's frame was refused: the error code goes with the text (the frame decoder
    hands a budget's reason to the connection, which answers with its ``code``)."""

    code = QuotaExceeded.code


class Usage:
    """What one user holds and does, kept by name for the server's life (across reloads).

    Attributes:
        stored: bytes of the items its writes put in bins (charged by the store to the
            item's writer until it leaves its bin).
        sessions: bytes its sessions hold: items of unacknowledged gets, remembered replies,
            the sessions themselves (summed over ``owned`` when asked: nothing per request).
        receiving: bytes reserved by its frames still arriving.
        waiting: bytes of its writes waiting for room in its quota (``wait_room``).
        max_memory: its quota (``None``: none), as the users file says now.
        conns: its open connections (each leaves when it closes).
        requests, denials, refusals: requests it sent, those refused ``permission_denied``,
            and writes or connections refused ``quota_exceeded``.
    """

    __slots__ = ("name", "stored", "owned", "receiving", "waiting", "max_memory", "conns",
                 "requests", "denials", "refusals", "parked", "timer")

    def __init__(self, name: str) -> None:
        self.name = name
        self.stored = self.receiving = self.waiting = 0
        self.owned: set[ServerSession] = set()  # its sessions (the session table drops them)
        self.max_memory: int | None = None
        self.conns: set[ServerProtocol] = set()
        self.requests = self.denials = self.refusals = 0
        self.parked: deque[_Parked] = deque()
        self.timer: IDelayedCall | None = None

    def live(self) -> list[ServerProtocol]:
        """Its open connections (a connection leaves ``conns`` when it closes: see
        ``Connection._release``)."""
        return list(self.conns)

    def output(self) -> int:
        """Bytes queued for its connections and not yet sent."""
        total = 0
        for c in self.live():
            st = getattr(c, "_st", None)
            if st is not None:
                total += st.queued_bytes
        return total

    @property
    def sessions(self) -> int:
        """Bytes its sessions hold (as the session table counts them)."""
        cost = SessionTable.SESSION_COST
        return sum(s.held + s.remembered_bytes + cost for s in self.owned)

    def held(self) -> int:
        """What counts against its ``max_memory``: stored, sessions, receiving, output."""
        return self.stored + self.sessions + self.receiving + self.output()

    def check_room(self, growth: int, what: str) -> None:
        """Refuse ``growth`` more bytes over the quota (the store asks before a write).

        Raises:
            QuotaExceeded: naming the user, its quota, and what it holds.
        """
        limit = self.max_memory
        if limit is None or growth <= 0:
            return
        held = self.held()
        if held + growth > limit:
            self.refusals += 1
            raise QuotaExceeded(
                f"{what} would take user {self.name!r} to {held + growth} bytes, over its "
                f"quota max_memory={limit} (the server's users file); nothing was stored. "
                f"Free some (get or delete what it stored), or write with wait_room=True")

    def describe(self, user: User | None) -> dict[str, Any]:
        """Its entry in the stats (``user``: as the users file defines it now)."""
        output, sessions = self.output(), self.sessions
        total = self.stored + sessions + self.receiving + output
        return {
            "memory": {"stored": self.stored, "sessions": sessions, "output": output,
                       "receiving": self.receiving, "waiting": self.waiting, "total": total,
                       "max_memory": self.max_memory},
            "connections": len(self.live()),
            "max_connections": None if user is None else user.max_connections,
            "requests": self.requests, "denials": self.denials, "refusals": self.refusals,
        }


class UserBudget:
    """A connection's frame budget once its user is known: the server's, and the frames in
    flight counted for the user (refused only when they alone would exceed its quota:
    ``wait_room`` writes still get to wait for room)."""

    __slots__ = ("inner", "usage")

    def __init__(self, inner: Any, usage: Usage) -> None:
        self.inner, self.usage = inner, usage

    def reserve(self, nbytes: int) -> str | None:
        why: str | None = self.inner.reserve(nbytes)
        if why is not None:
            return why
        u = self.usage
        limit = u.max_memory
        if limit is not None and u.receiving + nbytes > limit:
            self.inner.release(nbytes)
            u.refusals += 1
            return _QuotaReason(f"user {u.name!r} would have {u.receiving + nbytes} bytes "
                                f"of frames arriving, over its quota max_memory={limit}")
        u.receiving += nbytes
        return None

    def release(self, nbytes: int) -> None:
        self.inner.release(nbytes)
        self.usage.receiving -= nbytes


@dataclass(eq=False)
class _Parked:
    """A write waiting for room in its user's quota. Waits on its connection like a blocked
    append (``conn.wait``: its timeout, a ``cancel`` and the connection's end withdraw it);
    ``name`` is empty, which no bin is, so the store's ``cancel`` finds no queue of its own."""

    conn: ServerProtocol
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

    def __init__(self, server: ServerFactory) -> None:
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
    def refuse(self, conn: ServerProtocol, user: User, sid: bytes | None
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

    def bind(self, conn: ServerProtocol, user: User) -> None:
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
    def admit(self, conn: ServerProtocol, route: Route, msg: Request) -> bool:
        """Whether ``msg`` may act now. If not, it is answered (``permission_denied``) or,
        a write that asked to wait for room in a full quota, kept until there is room.

        The responder asks it for every request (once it counted it for its user) unless
        the user may do everything without a quota (:attr:`User.unrestricted`)."""
        if msg is self._releasing:  # a write that waited for room, let go by _poll
            return True
        user = conn.user
        if user is None or user.unrestricted:
            return True
        if not user.may(route.access, route.op, getattr(msg, "bin", None)):
            self._deny(conn, route, msg)
            return False
        if user.max_memory is not None and _waits(msg):
            return self._room_or_wait(conn, msg)  # type: ignore[arg-type]
        return True

    def _deny(self, conn: ServerProtocol, route: Route, msg: Request) -> None:
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
        conn.reply(msg, ErrorReply(msg.id, PermissionDenied.code, why))

    # -- writes waiting for room in their user's quota -----------------------------------------
    def _growth(self, usage: Usage, msg: Put | Append, size: int) -> int:
        """What ``msg`` would add to what ``usage`` holds (a put replaces its own value)."""
        if type(msg) is Put:
            return size - self.server.store.owned_by(msg.bin, usage)
        return size

    def _room_or_wait(self, conn: ServerProtocol, msg: Put | Append) -> bool:
        u = conn.usage
        assert u is not None and u.max_memory is not None
        size = _size_of(msg)
        if u.held() + self._growth(u, msg, size) <= u.max_memory and not u.parked:
            return True
        if size > u.max_memory or u.waiting + size > u.max_memory:
            return True  # can never fit, or too much waits already: refused at once
        p = _Parked(conn, msg, size)
        try:
            conn.wait(msg.id, p, _wait_of(msg), lambda: self._wait_ran_out(p))  # type: ignore[arg-type]
        except InvalidRequest as exc:
            conn.reply(msg, ErrorReply(msg.id, code_for(exc), str(exc)))
            return False
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
        p.conn.reply(msg, ErrorReply(msg.id, QuotaExceeded.code, (
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
            if not p.active or p.conn._closed:
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
                reply = self.server.responder.handle(p.conn, p.msg)
                if reply is not None:
                    p.conn.answer(p.msg, reply)
            finally:
                self._releasing = None
            served = True
        if served:
            self.server.commit()  # (the data log, then the replies that wait for it)
        if u.parked:
            self._poll_soon(u)

    # -- what a user sees ----------------------------------------------------------------------
    def readable(self, conn: ServerProtocol, bins: dict[str, Any]) -> dict[str, Any]:
        """The entries of ``bins`` (by name) that ``conn``'s user may read."""
        user = conn.user
        if user is None or user.reads_all:
            return bins
        return {name: b for name, b in bins.items() if user.may_read(name)}

    def describe(self) -> dict[str, dict[str, Any]]:
        """Every user's entry in the stats (``users``)."""
        names = sorted(set(self.table) | set(self.usage))
        return {name: self.usage_of(name).describe(self.table.get(name)) for name in names}

    def stats(self, conn: ServerProtocol, server: Callable[[], dict[str, Any]],
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

    def _rebind(self, conn: ServerProtocol, table: dict[str, User]) -> None:
        old = conn.user
        if old is None or old is self.anonymous or conn._closed:
            return
        new = table.get(old.name)
        if new is None:
            from ..errors import AuthenticationError

            conn.fail(AuthenticationError(f"user {old.name!r} was removed from the server's "
                                          f"users file"))
            return
        conn.user = new
        for name in [n for n in conn.listening if not new.may_read(n)]:
            conn.listening.discard(name)
            self.server.unsubscribe(name, conn)

    def handlers(self) -> dict[type, Callable[[ServerProtocol, Any], None]]:
        """The ``reload`` op's handler (for the responder's table)."""
        return {Reload: self._reload_op}

    def _reload_op(self, conn: ServerProtocol, msg: Reload) -> None:
        try:
            self.reload()
        except ValueError as exc:
            conn.reply(msg, ErrorReply(msg.id, InvalidRequest.code,
                                       f"reload failed, the old users stay: {exc}"))
            return
        conn.reply(msg, Acked(msg.id, True))


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


def describe_users(users: Iterable[User]) -> str:
    """One line for the server's start-up: who may connect."""
    names = [u.name for u in users]
    return ", ".join(names) if names else "none"
