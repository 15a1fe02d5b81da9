"""Who the server's users are, and what each holds.

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

:class:`User` is one user as defined (:func:`load_users` reads them all); :class:`Usage` is
what one user holds and does (the items it stored, what its sessions hold, its frames still
arriving, its connections' queued output) and refuses a write over its quota. What the
server does with them (the check of every request, writes waiting for room, reload) is
:mod:`.users`. Nothing here knows the server: the store, the session table and the kinds
charge a :class:`Usage` they are handed.
"""

from __future__ import annotations

import fnmatch
import os
import re
import tomllib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twisted.internet.interfaces import IDelayedCall

from ..errors import QuotaExceeded
from ..wire.auth import check_user_name, tokens_of
from ..wire.protocol import OPS
from .config import ServerConfig
from .sessions import ServerSession, SessionTable

__all__ = ["DEFAULT", "READONLY", "READ_ONLY_OPS", "Usage", "User", "UserBudget", "load_users",
           "parse_size"]

DEFAULT, READONLY = "default", "readonly"
#: What the built-in ``readonly`` user may send: the read-only token's ops, as before users.
READ_ONLY_OPS = frozenset(name for name, op in OPS.items() if op.read)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_USER_KEYS = frozenset({"token_file", "read", "write", "max_memory", "max_connections",
                        "admin", "replicate"})


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
        replicate: it may follow this server as a replica (``psync``).
    """

    name: str
    keys: tuple[bytes, ...] = ()
    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    max_memory: int | None = None
    max_connections: int | None = None
    admin: bool = False
    ops: frozenset[str] | None = None
    replicate: bool = False
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
    admin, replicate = spec.get("admin", False), spec.get("replicate", False)
    if not isinstance(admin, bool) or not isinstance(replicate, bool):
        raise ValueError(f"{who}: admin and replicate must be true or false")
    return User(name, _read_keys(path, who), _patterns(spec, "read", who),
                _patterns(spec, "write", who),
                None if max_memory is None else parse_size(max_memory, f"{who}: max_memory"),
                max_conns, admin, replicate=replicate)


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
                        admin=True, replicate=True))
    elif config.token:
        out.append(User(DEFAULT, tuple(tokens_of(config.token)), ("*",), ("*",), admin=True,
                        replicate=True))
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
        # Its open connections (``parts.Conn``; each leaves when it closes).
        self.conns: set[Any] = set()
        self.requests = self.denials = self.refusals = 0
        # Its writes waiting for room (``users._Parked``), oldest first, and their poll.
        self.parked: deque[Any] = deque()
        self.timer: IDelayedCall | None = None

    def live(self) -> list[Any]:
        """Its open connections (a connection leaves ``conns`` when it closes: see
        ``Connection._release``)."""
        return list(self.conns)

    def output(self) -> int:
        """Bytes queued for its connections and not yet sent."""
        total = 0
        for c in self.conns:
            total += c.queued_bytes
        return total

    @property
    def sessions(self) -> int:
        """Bytes its sessions hold (as the session table counts them)."""
        cost = SessionTable.SESSION_COST
        return sum(s.held + s.remembered_bytes + cost for s in self.owned)

    def held(self) -> int:
        """What counts against its ``max_memory``: stored, sessions, receiving, output."""
        return self.stored + self.sessions + self.receiving + self.output()

    def check_room(self, growth: int, what: str, can_wait: bool = False) -> None:
        """Refuse ``growth`` more bytes over the quota (the store asks before a put or an
        append, the kinds before a stream append or a service call).

        ``can_wait``: the write could have waited for room in the quota (a put or an append
        with ``wait_room``): the error says so.

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
                f"Free some (get or delete what it stored)"
                + (", or write with wait_room=True" if can_wait else ""))

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
