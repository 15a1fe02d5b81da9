"""Sans-I/O connection state: bytes in -> messages out, messages in -> bytes out.

Shared by the Twisted server, the Twisted client and the blocking client. Nothing here touches
a socket, a thread, a clock or Twisted, so it can be tested byte by byte.

There is one table of ops (:data:`OPS`), built here from the rows of every kind of bin: the
core ops' (value and list bins, the handshake, the connection's own ops), those that
:mod:`.streams` and :mod:`.services` export, then the administration ops, which is the order
of ``docs/PROTOCOL.md`` §3.2. Each row (:class:`~.fields.Op`) says how a request becomes a
header and back, how its reply is parsed, and whether the server must remember the reply for
exactly-once replay (``mutating``). Replies and notifications are encoded by their class
(:data:`REPLY_HEADERS`). Adding an op means adding a row (its parse functions read fields with
the checks of :mod:`.fields`), a server handler and a section of ``docs/PROTOCOL.md`` (whose
field tables a test checks against this table).

The server's side of a connection (as ``server/connection.py`` drives it)::

    conn = ServerConnection(limits)
    frames, error = conn.frames(data)        # or conn.buffered(n), after conn.get_buffer()
    for frame in frames:
        request, through, open_ids = conn.parse(frame)   # a request, or a BadRequest
        ...
    ...                                      # error: the peer broke the format, close
    chunks = encode_reply(reply)

The client's side::

    conn = ClientConnection()
    chunks = conn.send(msg, ack)
    for msg in conn.receive_data(data, op_of):   # replies, Changed, Orphan, ...
        ...                                      # (a ProtocolViolation last, if any)

A header is a msgpack map; see ``docs/PROTOCOL.md`` for every field.
"""

from __future__ import annotations

import gc
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union, cast

import msgpack

from ..errors import InvalidRequest, LimitExceeded, MemoryLimitExceeded, ProtocolError
from . import replay, replication, services, streams
from .auth import MECH, NONCE_BYTES, check_user_name
from .fields import (
    ACCESS,
    MAX_APPEND_ITEMS,
    PARSING_FDS,
    Fds,
    InvalidField,
    NameTooLong,
    Op,
    ParseReply,
    ParseRequest,
    check_bin,
    check_bin_name,
    check_bool,
    check_int,
    check_str,
    check_timeout,
    is_int,
    opt_int,
    parse_acked,
    read_items,
)
from .frames import (
    FORMAT_VERSION,
    MAGIC,
    Budget,
    BytesLike,
    Frame,
    FrameDecoder,
    OversizedFrame,
    Payload,
    encode_frame,
    payload_layout,
)
from .messages import (
    Auth,
    Bye,
    Cancel,
    Challenge,
    Configure,
    Configured,
    Delete,
    Deleted,
    Hello,
    HelloReply,
    Limits,
    ListBins,
    Listen,
    Listening,
    Listing,
    Message,
    Ping,
    Reload,
    Reply,
    Request,
    Stats,
    StatsReply,
    Unlisten,
)
from .prepared import (
    MAX_OPEN_ACKS,
    fetch_header,
    fetched_chunks,
    frame_chunks,
    packed_int,
    put_header,
    read_request,
)
from .records import (
    Acked,
    Append,
    Changed,
    ErrorReply,
    Fetch,
    Fetched,
    FetchSpec,
    Item,
    Put,
    Stored,
)
from .replies import ReplyReader
from .runs import items_header as runs_header

__all__ = [
    "ACCESS",
    "MAX_APPEND_ITEMS",
    "MAX_OPEN_ACKS",
    "MAX_VERSION",
    "OPS",
    "OVERFLOW_POLICIES",
    "PRE_HELLO_MAX_BYTES",
    "PROTOCOL_VERSIONS",
    "REPLY_HEADERS",
    "SESSION_ID_BYTES",
    "AckInfo",
    "BadRequest",
    "ClientConnection",
    "NameTooLong",
    "Op",
    "Orphan",
    "ProtocolViolation",
    "ServerConnection",
    "acked_frame",
    "check_bin_name",
    "encode_fetched_parts",
    "encode_fetched_with_id",
    "encode_message",
    "encode_reply",
    "item_wire_size",
    "items_header",
    "op_name",
    "parse_items",
    "stored_frame",
]

PROTOCOL_VERSIONS: tuple[int, ...] = (1,)
REPLY_SLACK = 64 * 1024  # see ClientConnection.set_limits
# Until a connection completes hello, a frame may take at most this many bytes: a peer that
# has not even said who it is cannot make the server reserve a large buffer.
PRE_HELLO_MAX_BYTES = 64 * 1024
SESSION_ID_BYTES = 16
# The largest ``min_version`` a put or append may ask for (a version fits an int64).
MAX_VERSION = (1 << 63) - 1
OVERFLOW_POLICIES = ("reject", "drop_oldest", "block")

_packb = msgpack.Packer(use_bin_type=True).pack


# A header as msgpack >= 1.0 reads it by default: str as str (raw=False), maps only with str
# or bytes keys (strict_map_key=True), arrays as lists (use_list=True), no length over the
# header's own (max_buffer_size). Called without keywords: parsing them cost more than
# unpacking a small header.
_unpackb = msgpack.unpackb


# -- events besides messages ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ProtocolViolation:
    """The peer broke the wire format: the connection must be closed.

    It comes last in the list returned by :meth:`ClientConnection.receive_data`, after every
    message that was complete before the violation, so those are still handled in order.
    """

    message: str


@dataclass(frozen=True, slots=True)
class BadRequest:
    """A request that parsed as a frame but cannot be served; the server answers it with an error.

    The connection stays usable: the frame boundaries were intact. ``op`` and ``header``: its
    op and header fields as they came, when its op is known (a service's refused reply still
    names the batch whose calls then fail); else ``""`` and an empty map.
    """

    id: int
    code: str
    message: str
    op: str = ""
    header: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AckInfo:
    """What a request said about the replies its client has received (exactly-once bookkeeping).

    The client has received the reply of every request with an id up to ``through``, except
    those listed in ``open``. :meth:`ClientConnection.send` writes it into a request; the
    server reads it back from :meth:`ServerConnection.parse` (``through`` and ``open``).
    """

    through: int
    open: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Orphan:
    """A reply to a request the client no longer waits for (it gave up on it)."""

    id: int
    n_items: int


# -- the core rows ----------------------------------------------------------------------------
def _store_header(m: Put | Append) -> dict[str, Any]:
    h: dict[str, Any] = {"bin": m.bin}
    if isinstance(m, Append):
        if m.timeout is not None:
            h["timeout"] = m.timeout
        if m.wait_room:
            h["wait_room"] = True
    elif m.room is not None:  # (a put: its wait for room in the user's quota)
        h["wait_room"] = True
        if m.room != math.inf:
            h["timeout"] = m.room
    if m.min_version is not None:
        h["min_version"] = m.min_version
    return h


def _min_version(h: dict[str, Any]) -> int | None:
    v = opt_int(h, "min_version", minimum=1)
    if v is not None and v > MAX_VERSION:
        raise InvalidField(f"'min_version' must be at most {MAX_VERSION}")
    return v


def _parse_store(cls: type[Put] | type[Append]) -> ParseRequest:
    def parse(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Request:
        name = check_bin(h, limits)
        raw = h.get("items")
        if cls is Append and isinstance(raw, list) and len(raw) > MAX_APPEND_ITEMS:
            raise InvalidField(f"an append of {len(raw)} items exceeds MAX_APPEND_ITEMS="
                           f"{MAX_APPEND_ITEMS}", LimitExceeded.code)
        items = read_items(h, payload, limits.max_depth, True)
        wait_room = check_bool(h, "wait_room") if "wait_room" in h else False
        if cls is Append:
            if not items:
                raise InvalidField("append carries at least one item")
            return Append(rid, name, items[0], check_timeout(h), tuple(items[1:]),
                          _min_version(h), wait_room)
        if len(items) != 1:
            raise InvalidField(f"put carries exactly one item, got {len(items)}")
        if wait_room:
            room = check_timeout(h)
            return Put(rid, name, items[0], _min_version(h),
                       math.inf if room is None else room)
        return Put(rid, name, items[0], _min_version(h))
    return parse


def _fetch_header(m: Fetch) -> dict[str, Any]:
    s = m.spec
    h: dict[str, Any] = {"bin": m.bin}
    if s.max_items is not None:
        h["max_items"] = s.max_items
    if s.wait:
        h["wait"] = True
        h["timeout"] = s.timeout
        if s.min_items != 1:
            h["min_items"] = s.min_items
    if s.min_tag is not None:
        h["min_tag"] = s.min_tag
    if s.newer_than is not None:
        h["newer_than"] = s.newer_than
    return h


def _parse_fetch(remove: bool) -> ParseRequest:
    def parse(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Request:
        name = check_bin(h, limits)
        spec = FetchSpec(remove, opt_int(h, "max_items", minimum=1), check_bool(h, "wait"),
                         check_timeout(h),
                         opt_int(h, "min_tag"), opt_int(h, "newer_than"),
                         opt_int(h, "min_items", minimum=1) or 1)
        return Fetch(rid, name, spec)
    return parse


def _reply_fetched(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Reply:
    unchanged = bool(h.get("unchanged", False))
    items = () if unchanged else tuple(read_items(h, payload, limits.max_depth, False))
    return Fetched(rid, check_str(h, "kind"), items, check_int(h, "version"), check_int(h, "n_items"),
                   check_int(h, "dropped"), unchanged)


def _reply_stored(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Reply:
    return Stored(rid, check_int(h, "version"), check_int(h, "n_items"), opt_int(h, "dropped") or 0)


def _bin_header(m: Delete | Listen | Unlisten) -> dict[str, Any]:
    return {"bin": m.bin}


def _parse_bin_only(cls: type[Delete] | type[Listen] | type[Unlisten]) -> ParseRequest:
    def parse(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Request:
        return cls(rid, check_bin(h, limits))
    return parse


def _hello_header(m: Hello) -> dict[str, Any]:
    h: dict[str, Any] = {"versions": list(m.versions), "client": m.client}
    if m.nonce is not None:
        h["auth"] = {"mech": MECH, "nonce": m.nonce}
    if m.session is not None:
        h["session"] = m.session
        if m.resume:
            h["resume"] = True
    if m.shm:
        h["shm"] = True
    if m.user is not None:
        h["user"] = m.user
    if m.runs:
        h["runs"] = True
    return h


def _parse_hello(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Request:
    versions = h.get("versions")
    if not isinstance(versions, list) or not all(is_int(v) for v in versions):
        raise InvalidField("hello needs 'versions', a list of integers")
    client, session = h.get("client", ""), h.get("session")
    if session is not None and (not isinstance(session, bytes)
                                or len(session) != SESSION_ID_BYTES):
        raise InvalidField(f"'session' must be {SESSION_ID_BYTES} bytes (msgpack bin)")
    user = h.get("user")
    if user is not None:
        try:
            check_user_name(user)
        except ValueError as exc:
            raise InvalidField(f"'user': {exc}") from None
    return Hello(rid, tuple(versions), client if isinstance(client, str) else "",
                 _hello_nonce(h.get("auth")), session,
                 check_bool(h, "resume") and session is not None, check_bool(h, "shm"), user,
                 check_bool(h, "runs"))


def _hello_nonce(auth: Any) -> bytes | None:
    if auth is None:
        return None
    if not isinstance(auth, dict) or auth.get("mech") != MECH:
        raise InvalidField(f"'auth' must be a map with 'mech': {MECH!r} and a 'nonce'")
    nonce = auth.get("nonce")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise InvalidField(f"the auth 'nonce' must be {NONCE_BYTES} bytes (msgpack bin)")
    return nonce


def _reply_hello(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Reply:
    challenge = h.get("challenge")
    if challenge is not None:
        if not isinstance(challenge, dict) or challenge.get("mech") != MECH or \
                not isinstance(challenge.get("nonce"), bytes):
            raise InvalidField(f"'challenge' must be a map with 'mech': {MECH!r} and a 'nonce'")
        return Challenge(rid, challenge["nonce"])
    lim = h.get("limits")
    if not isinstance(lim, dict):
        raise InvalidField("'limits' must be a map")
    try:
        server_limits = Limits(check_int(lim, "max_frame_bytes"), check_int(lim, "max_header_bytes"),
                               check_int(lim, "max_depth"), check_int(lim, "max_name_bytes"))
    except ValueError as exc:
        raise InvalidField(f"impossible limits in the handshake: {exc}") from None
    server_id, proof, role = h.get("server_id", ""), h.get("proof"), h.get("role", "write")
    user = h.get("user", "default")
    return HelloReply(rid, check_int(h, "version"), check_str(h, "server"), server_limits,
                      check_bool(h, "resumed"), server_id if isinstance(server_id, str) else "",
                      check_bool(h, "shm"), proof if isinstance(proof, bytes) else None,
                      role if role in ("read", "write") else "write",
                      user if isinstance(user, str) else "default", check_bool(h, "runs"))


def _parse_auth(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Request:
    proof = h.get("proof")
    if not isinstance(proof, bytes):
        raise InvalidField("auth needs a 'proof' (msgpack bin)")
    return Auth(rid, proof)


def _reply_listing(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Reply:
    bins = h.get("bins")
    if not isinstance(bins, dict) or not all(is_int(v) for v in bins.values()):
        raise InvalidField("'bins' must be a map of str to int")
    return Listing(rid, bins)


def _reply_deleted(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Reply:
    return Deleted(rid, check_bool(h, "existed"), check_int(h, "version"))


def _reply_listening(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Reply:
    return Listening(rid, check_int(h, "version"), check_int(h, "n_items"))


def _parse_cancel(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Request:
    target = opt_int(h, "target")
    if target is None:
        raise InvalidField("cancel needs an integer 'target'")
    return Cancel(rid, target)


def _parse_stats(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Request:
    glob = h.get("glob")
    if glob is not None and not isinstance(glob, str):
        raise InvalidField("'glob' must be a string or nil")
    return Stats(rid, glob)


def _stats_header(m: Stats) -> dict[str, Any]:
    return {} if m.glob is None else {"glob": m.glob}


def _reply_stats(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Reply:
    server, bins = h.get("stats"), h.get("bins")
    if not isinstance(server, dict) or not isinstance(bins, dict):
        raise InvalidField("'stats' and 'bins' must be maps")
    return StatsReply(rid, server, bins)


def _configure_header(m: Configure) -> dict[str, Any]:
    return {"bin": m.bin, "max_items": m.max_items, "max_bytes": m.max_bytes,
            "overflow": m.overflow}


def _parse_configure(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Request:
    name = check_bin(h, limits)
    overflow = h.get("overflow", "reject")
    if overflow not in OVERFLOW_POLICIES:
        raise InvalidField(f"'overflow' must be one of {', '.join(OVERFLOW_POLICIES)}")
    return Configure(rid, name, opt_int(h, "max_items", minimum=1),
                     opt_int(h, "max_bytes", minimum=1), overflow)


def _reply_configured(rid: int, h: dict[str, Any], payload: Payload, limits: Limits) -> Reply:
    overflow = check_str(h, "overflow")
    return Configured(rid, opt_int(h, "max_items"), opt_int(h, "max_bytes"), overflow)


def _no_fields(m: Any) -> dict[str, Any]:
    return {}


def _op(name: str, request: type, header: Callable[[Any], dict[str, Any]], parse: ParseRequest,
        parse_reply: ParseReply, mutating: bool, *fields: str) -> Op:
    return Op(name, request, header, parse, parse_reply, mutating, ("op", "id", *fields),
              name in _READ_OPS, _ACCESS[name])


# What a connection with the read-only token may send: nothing that changes what others see.
_READ_OPS = frozenset({"hello", "auth", "peek", "list", "listen", "unlisten", "ping", "cancel",
                       "stats", "bye"})
# What each op needs of a user on its bin (see Op.access). ``list`` and ``stats`` answer
# with what the user may read; ``unlisten``, ``cancel`` and ``bye`` only undo the
# connection's own doing.
_ACCESS = {"hello": "none", "auth": "none", "put": "write", "append": "write", "get": "take",
           "peek": "read", "list": "none", "delete": "write", "listen": "read",
           "unlisten": "none", "ping": "none", "cancel": "none", "stats": "none",
           "configure": "write", "bye": "none", "reload": "admin"}


_FETCH_FIELDS = ("bin", "max_items", "wait", "timeout", "min_items", "min_tag", "newer_than")

# The core ops: value and list bins, the handshake, the connection's own (§3.2.1-15).
_CORE_ROWS = (
    _op("hello", Hello, _hello_header, _parse_hello, _reply_hello, False,
        "versions", "client", "auth", "session", "resume", "shm", "user", "runs"),
    _op("put", Put, _store_header, _parse_store(Put), _reply_stored, True, "bin", "items",
        "timeout", "wait_room", "min_version"),
    _op("append", Append, _store_header, _parse_store(Append), _reply_stored, True,
        "bin", "items", "timeout", "wait_room", "min_version"),
    _op("get", Fetch, _fetch_header, _parse_fetch(True), _reply_fetched, True, *_FETCH_FIELDS),
    _op("peek", Fetch, _fetch_header, _parse_fetch(False), _reply_fetched, False,
        *_FETCH_FIELDS),
    _op("list", ListBins, _no_fields, lambda rid, h, p, lim: ListBins(rid), _reply_listing,
        False),
    _op("delete", Delete, _bin_header, _parse_bin_only(Delete), _reply_deleted, True, "bin"),
    _op("listen", Listen, _bin_header, _parse_bin_only(Listen), _reply_listening, False, "bin"),
    _op("unlisten", Unlisten, _bin_header, _parse_bin_only(Unlisten), parse_acked, False,
        "bin"),
    _op("ping", Ping, _no_fields, lambda rid, h, p, lim: Ping(rid), parse_acked, False),
    _op("cancel", Cancel, lambda m: {"target": m.target}, _parse_cancel, parse_acked, False,
        "target"),
    _op("stats", Stats, _stats_header, _parse_stats, _reply_stats, False, "glob"),
    _op("configure", Configure, _configure_header, _parse_configure, _reply_configured, True,
        "bin", "max_items", "max_bytes", "overflow"),
    _op("bye", Bye, _no_fields, lambda rid, h, p, lim: Bye(rid), parse_acked, False),
    _op("auth", Auth, lambda m: {"proof": m.proof}, _parse_auth, _reply_hello, False, "proof"),
)
# The administration ops, after every kind's (§3.2.25).
_ADMIN_ROWS = (
    _op("reload", Reload, _no_fields, lambda rid, h, p, lim: Reload(rid), parse_acked, False),
)


def _table(*groups: Sequence[Op]) -> dict[str, Op]:
    """The op table from groups of rows, in order (no two rows may share a name)."""
    table: dict[str, Op] = {}
    for rows in groups:
        for op in rows:
            if op.name in table:
                raise ValueError(f"op {op.name!r} has two rows")
            table[op.name] = op
    return table


#: The op table: wire op -> how to encode, parse and reply to it. In the order of
#: docs/PROTOCOL.md §3.2: the core ops, the stream bins' (:data:`.streams.ROWS`), the service
#: bins' (:data:`.services.ROWS`), the administration ops, the replay bins'
#: (:data:`.replay.ROWS`), then replication's (:data:`.replication.ROWS`).
OPS: dict[str, Op] = _table(_CORE_ROWS, streams.ROWS, services.ROWS, _ADMIN_ROWS,
                            replay.ROWS, replication.ROWS)
#: The ops whose replies the client reads from their fixed layouts (:mod:`.prepared`), and
#: the reply each expects: those the op table parses as a Stored, a Fetched or an Acked.
REPLY_EXPECTS: dict[str, type] = {
    name: cls for name, op in OPS.items()
    for parse, cls in ((_reply_stored, Stored), (_reply_fetched, Fetched),
                       (parse_acked, Acked))
    if op.parse_reply is parse}
# Every request may also carry these (see AckInfo).
ACK_FIELDS = ("ack", "open")
_OP_OF_CLASS: dict[type, str] = {op.request: op.name for op in OPS.values()
                                 if op.request is not Fetch}


def op_name(msg: Request) -> str:
    """The wire op of a request (``"get"`` or ``"peek"`` for a :class:`Fetch`)."""
    if type(msg) is Fetch:
        return msg.spec.op
    return _OP_OF_CLASS[type(msg)]


def _hello_reply_header(m: HelloReply) -> dict[str, Any]:
    lim = m.limits
    return {"version": m.version, "server": m.server, "limits": {
        "max_frame_bytes": lim.max_frame_bytes, "max_header_bytes": lim.max_header_bytes,
        "max_depth": lim.max_depth, "max_name_bytes": lim.max_name_bytes},
        "resumed": m.resumed, "server_id": m.server_id, **({"shm": True} if m.shm else {}),
        **({"proof": m.proof} if m.proof is not None else {}),
        **({"role": m.role} if m.role != "write" else {}),
        **({"user": m.user} if m.user != "default" else {}),
        **({"runs": True} if m.runs else {})}


def _fetched_header(f: Fetched) -> dict[str, Any]:
    h: dict[str, Any] = {"kind": f.kind, "version": f.version, "n_items": f.n_items,
                         "dropped": f.dropped}
    if f.unchanged:
        h["unchanged"] = True
    return h


def _stored_header(m: Stored) -> dict[str, Any]:
    h: dict[str, Any] = {"version": m.version, "n_items": m.n_items}
    if m.dropped:
        h["dropped"] = m.dropped
    return h


#: Reply class -> its ``ok`` header fields (besides ``op``, ``id``, ``ok`` and ``items``).
REPLY_HEADERS: dict[type, Callable[[Any], dict[str, Any]]] = {
    HelloReply: _hello_reply_header,
    Challenge: lambda m: {"challenge": {"mech": MECH, "nonce": m.nonce}},
    Stored: _stored_header,
    Fetched: _fetched_header,
    Listing: lambda m: {"bins": m.bins},
    Deleted: lambda m: {"existed": m.existed, "version": m.version},
    Listening: lambda m: {"version": m.version, "n_items": m.n_items},
    Acked: lambda m: {"flag": m.flag},
    StatsReply: lambda m: {"stats": m.server, "bins": m.bins},
    Configured: lambda m: {"max_items": m.max_items, "max_bytes": m.max_bytes,
                           "overflow": m.overflow},
    **streams.REPLY_HEADERS,
    **services.REPLY_HEADERS,
    **replay.REPLY_HEADERS,
    **replication.REPLY_HEADERS,
}
#: Message class -> the items it carries in the payload (in order).
_ITEMS_OF: dict[type, Callable[[Any], Sequence[Item]]] = {
    Put: lambda m: (m.item,), Append: lambda m: m.items, Fetched: lambda m: m.items,
    **streams.ITEMS_OF,
    **services.ITEMS_OF,
    **replay.ITEMS_OF,
    **replication.ITEMS_OF,
}


# -- encoding ---------------------------------------------------------------------------------
def _stored_reply(m: Stored) -> tuple[dict[str, Any], Sequence[Item]]:
    h: dict[str, Any] = {"op": "reply", "id": m.id, "ok": True, "version": m.version,
                         "n_items": m.n_items}
    if m.dropped:
        h["dropped"] = m.dropped
    return h, ()


def _fetched_reply(m: Fetched) -> tuple[dict[str, Any], Sequence[Item]]:
    h: dict[str, Any] = {"op": "reply", "id": m.id, "ok": True, "kind": m.kind,
                         "version": m.version, "n_items": m.n_items, "dropped": m.dropped}
    if m.unchanged:
        h["unchanged"] = True
    return h, m.items


def _put_request(m: Put) -> tuple[dict[str, Any], Sequence[Item]]:
    if m.min_version is not None or m.room is not None:
        return {"op": "put", "id": m.id, **_store_header(m)}, (m.item,)
    return {"op": "put", "id": m.id, "bin": m.bin}, (m.item,)


#: The most common messages, each header built in one step (the others: see _header_of).
_FAST_HEADERS: dict[type, Callable[[Any], tuple[dict[str, Any], Sequence[Item]]]] = {
    Stored: _stored_reply, Fetched: _fetched_reply, Put: _put_request,
    Acked: lambda m: ({"op": "reply", "id": m.id, "ok": True, "flag": m.flag}, ()),
}


def _header_of(msg: Message) -> tuple[dict[str, Any], Sequence[Item]]:
    cls = type(msg)
    fast = _FAST_HEADERS.get(cls)
    if fast is not None:
        return fast(msg)
    if isinstance(msg, Changed):  # (no subclasses: as exact as cls is Changed)
        h = {"op": "notify", "bin": msg.bin, "event": msg.op, "n_items": msg.n_items,
             "version": msg.version}
        if msg.skipped:
            h["skipped"] = msg.skipped
        if msg.dropped:
            h["dropped"] = msg.dropped
        return h, ()
    if type(msg) is ErrorReply:
        if msg.id == 0:
            return {"op": "error", "code": msg.code, "message": msg.message}, ()
        return {"op": "reply", "id": msg.id, "ok": False, "code": msg.code,
                "message": msg.message}, ()
    items = _ITEMS_OF.get(cls)
    reply = REPLY_HEADERS.get(cls)
    if reply is not None:
        h = {"op": "reply", "id": msg.id, "ok": True}
        h.update(reply(msg))
        return h, (items(msg) if items is not None else ())
    name = op_name(msg)  # type: ignore[arg-type]  # every reply has a REPLY_HEADERS row
    h = {"op": name, "id": msg.id}
    h.update(OPS[name].header(msg))
    return h, (items(msg) if items is not None else ())


_PACKED_REPLY_OK = _packb("op") + _packb("reply") + _packb("id")
_NOTIFY_OP = _packb("op") + _packb("notify")


def encode_fetched_parts(reply: Fetched, shared: list[Any] | None, runs: bool = False
                         ) -> tuple[bytes, list[BytesLike], int]:
    """The parts of a get/peek reply that do not depend on its request id, encoded once
    (``runs``: with runs of like tensors where they apply, :mod:`.runs`).

    Returns:
        ``(tail, buffers, fields)``: the packed header fields after ``op`` and ``id``, the
        payload buffers, and how many header fields there are in all; give them to
        :func:`encode_fetched_with_id` for each request.
    """
    header: dict[str, Any] = {"ok": True}
    header.update(_fetched_header(reply))
    buffers: list[BytesLike] = []
    header["items"] = (runs_header if runs else _items_header)(reply.items, buffers, shared)
    packed = _packb(header)
    fields = len(header) + 2
    if fields > 15 or packed[0] & 0xF0 != 0x80:  # not a fixmap: never with these fields
        raise AssertionError("a get reply header has too many fields for a fixmap")
    return packed[1:], buffers, fields


def encode_fetched_with_id(rid: int, tail: bytes, buffers: list[BytesLike],
                           fields: int) -> list[BytesLike]:
    """A get/peek reply frame from :func:`encode_fetched_parts`, for request ``rid``."""
    header = bytes((0x80 | fields,)) + _PACKED_REPLY_OK + _packb(rid) + tail
    return encode_frame(header, buffers)


# -- replies from prepared pieces ---------------------------------------------------------------
# The most common replies are written from pre-packed msgpack pieces: the fixed keys once, the
# integers packed per reply, the frame prefix in the same step. The keys come in the order the
# general encoder writes them, so the bytes are the same (tests/wire/test_protocol.py checks it
# byte for byte against encode_message's dict path, for any id and version).
_FRAME_HEAD = struct.Struct("<2sBBIQ")
_STORED_OK = (_packb("op") + _packb("reply") + _packb("id"), _packb("ok") + b"\xc3"
              + _packb("version"), _packb("n_items"), _packb("dropped"))
_ACKED_OK = (b"\x84" + _PACKED_REPLY_OK, _packb("ok") + b"\xc3" + _packb("flag"))


def stored_frame(rid: int, version: int, n_items: int, dropped: int = 0) -> bytes:
    """The frame of a :class:`Stored` reply (what a put or an append answers)."""
    head, mid, n_key, d_key = _STORED_OK
    if dropped:
        header = b"".join((b"\x86", head, packed_int(rid), mid, packed_int(version), n_key,
                           packed_int(n_items), d_key, packed_int(dropped)))
    else:
        header = b"".join((b"\x85", head, packed_int(rid), mid, packed_int(version), n_key,
                           packed_int(n_items)))
    return _FRAME_HEAD.pack(MAGIC, FORMAT_VERSION, 0, len(header), 0) + header


def acked_frame(rid: int, flag: bool) -> bytes:
    """The frame of an :class:`Acked` reply (ping, cancel, unlisten, bye)."""
    head, mid = _ACKED_OK
    header = b"".join((head, _packb(rid), mid, b"\xc3" if flag else b"\xc2"))
    return _FRAME_HEAD.pack(MAGIC, FORMAT_VERSION, 0, len(header), 0) + header


def encode_reply(msg: Reply, shared: list[Any] | None = None) -> list[BytesLike]:
    """A reply's frame chunks: the common ones from prepared pieces, the others through
    :func:`encode_message`."""
    if type(msg) is Stored:
        return [stored_frame(msg.id, msg.version, msg.n_items, msg.dropped)]
    if type(msg) is Acked:
        return [acked_frame(msg.id, msg.flag)]
    if type(msg) is Fetched and shared is None and msg.items:
        chunks = fetched_chunks(msg.id, msg)  # (one item: the usual get)
        if chunks is not None:
            return chunks
        tail, buffers, fields = encode_fetched_parts(msg, None)
        return encode_fetched_with_id(msg.id, tail, buffers, fields)
    return encode_message(msg, None, shared)[0]


def encode_message(msg: Message, extra: dict[str, Any] | None = None,
                   shared: list[Any] | None = None) -> tuple[list[BytesLike], int]:
    """Serialise one message into frame chunks (buffers are not copied).

    Args:
        msg: any request, reply or notification.
        extra: more header fields (the acknowledgement fields of a request).
        shared: when given (a connection that passes memfds), buffers that live in shared
            memory travel as ``memfd`` descriptors instead of bytes; their
            :class:`~tensorshare.shm.SharedMemory` objects are appended here, in order,
            and their descriptors must be sent with the frame.

    Returns:
        ``(chunks, header_len)``: chunks for ``sendmsg`` / ``writeSequence``, in order, and
        the size of the packed msgpack header.
    """
    header, items = _header_of(msg)
    if extra:
        header.update(extra)
    buffers: list[BytesLike] = []
    if items:
        header["items"] = _items_header(items, buffers, shared)
    packed = _packb(header)
    return encode_frame(packed, buffers), len(packed)


def _items_header(items: Sequence[Item], buffers: list[BytesLike],
                  shared: list[Any] | None) -> list[list[Any]]:
    """Describe items for the header and collect their buffers in payload order."""
    if len(items) == 1 and shared is None:
        value = items[0].value
        if len(value.buffers) == 1 and value.buffers[0].codec is None:
            data = value.buffers[0].data  # (one tensor, as sent: the usual put)
            buffers.append(data)
            return [[value.value, [[0, len(data)]], items[0].tag]]
    if shared is None:
        sizes = [len(b.data) for it in items for b in it.value.buffers]
    else:
        sizes = [0 if b.shm is not None else len(b.data) for it in items
                 for b in it.value.buffers]
    offsets, _ = payload_layout(sizes)
    k = 0
    out = []
    for it in items:
        descs: list[list[Any]] = []
        for b in it.value.buffers:
            off = offsets[k]
            k += 1
            if shared is not None and b.shm is not None:
                # In a sealed memfd: the descriptor travels with the frame, not the bytes.
                shared.append(b.shm)
                buffers.append(b"")
                descs.append([off, 0, "memfd", b.raw_nbytes])
                continue
            data = b.data
            buffers.append(data)
            if b.codec is None:
                descs.append([off, len(data)])
            else:
                descs.append([off, len(data), b.codec, b.raw_nbytes])
        out.append([it.value.value, descs, it.tag])
    return out


def item_wire_size(item: Item) -> int:
    """Bytes an item takes in a frame: its value and buffers, plus padding and descriptors.

    The store counts this per item, for the memory limit and to keep every reply within
    the frame limit (a get of a long list bin returns the items that fit; the rest stay).
    """
    return item.value.nbytes + 64 * (len(item.value.buffers) + 1)


def items_header(items: Sequence[Item], buffers: list[BytesLike]) -> list[list[Any]]:
    """Describe items for a header (``[value, buffers, tag]`` each) and collect their buffers
    in payload order; what a put/append/get frame carries (also used by the data log)."""
    return _items_header(items, buffers, None)


def parse_items(h: dict[str, Any], payload: Payload, max_depth: int) -> list[Item]:
    """Parse and check the ``items`` of a header against its payload, as the server does
    (the data log reads its records with it).

    Raises:
        ValueError: the items, their buffers or their values are malformed
            (:class:`~.fields.InvalidField`).
    """
    return read_items(h, payload, max_depth, True)


# -- parsing helpers --------------------------------------------------------------------------
# A frame whose header is at least this large (a batch of about 1,000 items or more) is
# parsed with the cyclic garbage collector paused: tens of thousands of new small objects (the
# header's lists, then the items) otherwise trigger collections that scan every live object
# again and again (a third of a 50,000-item drain's time). None of them is a cycle.
_GC_PAUSE_HEADER = 16 * 1024


class _GcPaused:
    """Pauses the cyclic garbage collector over a ``with`` block (if it was on)."""

    __slots__ = ("on",)

    def __enter__(self) -> None:
        self.on = gc.isenabled()
        if self.on:
            gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self.on:
            gc.enable()


def _header_map(frame: Frame | OversizedFrame) -> dict[str, Any]:
    try:
        header = _unpackb(frame.header)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"frame header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("frame header is not a msgpack map")
    return header


def _ack_of(h: dict[str, Any]) -> tuple[int, tuple[int, ...]]:
    """A request's acknowledgement fields as ``(through, open)``; ``through`` is -1 when they
    are malformed (ignored: replies are kept a little longer)."""
    through, open_ids = h["ack"], h.get("open")
    if type(through) is not int or through < 0:
        return -1, ()
    if open_ids is None or open_ids == []:  # (the usual case: nothing below it is still open)
        return through, ()
    if type(open_ids) is not list or len(open_ids) > MAX_OPEN_ACKS:
        return -1, ()
    for i in open_ids:
        if type(i) is not int:
            return -1, ()
    return through, tuple(open_ids)


# -- the two sides ----------------------------------------------------------------------------
ClientEvent = Union[Reply, Changed, Orphan, ProtocolViolation]


class _Side:
    """What both sides share: the frame decoder and its two ways of being fed, and the
    descriptors a peer passed on a Unix socket."""

    fds: Fds

    def __init__(self, max_frame_bytes: int, max_header_bytes: int, *,
                 allocate: Callable[[int], Payload] | None = None,
                 budget: Budget | None = None) -> None:
        self._decoder = FrameDecoder(max_frame_bytes, max_header_bytes, allocate=allocate,
                                     budget=budget)

    def close(self) -> None:
        """The connection ended: release a frame's reservation and unused descriptors."""
        self._decoder.close()
        self.fds.close()

    def add_fds(self, fds: list[int]) -> None:
        """Descriptors the peer passed (Unix socket): for the ``memfd`` buffers to come."""
        self.fds.queue.extend(fds)

    @property
    def receiving(self) -> bool:
        """Whether a frame is partly received (its rest is still to come)."""
        return self._decoder.in_frame

    @property
    def reserved(self) -> int:
        """Bytes the frame being received holds of the receiver's budget."""
        return self._decoder.reserved

    @property
    def decoder(self) -> FrameDecoder:
        """The frame decoder (its ``reserved`` is a plain attribute: read on every read)."""
        return self._decoder

    def get_buffer(self) -> memoryview | None:
        """A writable view to ``recv_into`` directly, when a large frame part is expected."""
        return self._decoder.get_buffer()

    def _frames(self, data: BytesLike | None, nbytes: int
                ) -> tuple[list[Frame | OversizedFrame], ProtocolError | None]:
        try:
            if data is None:
                return self._decoder.buffer_updated(nbytes), None
            return self._decoder.feed(data), None
        except ProtocolError as exc:
            return getattr(exc, "frames", []), exc


class ServerConnection(_Side):
    """The server side of one connection: bytes in -> frames (:meth:`frames`,
    :meth:`buffered`) -> requests (:meth:`parse`, one frame at a time). Replies and
    notifications become bytes through :func:`encode_reply` and :func:`encode_message`.

    Args:
        limits: the limits applied to received frames and values once the handshake is done.
        pre_hello_max_bytes: the largest frame accepted before :meth:`handshake_done`.
        allocate, budget: where large parts of received frames come from, and the memory
            they may take (see :class:`~.frames.FrameDecoder`).
    """

    def __init__(self, limits: Limits | None = None, *,
                 pre_hello_max_bytes: int = PRE_HELLO_MAX_BYTES,
                 allocate: Callable[[int], Payload] | None = None,
                 budget: Budget | None = None) -> None:
        self.limits = limits or Limits()
        small = min(pre_hello_max_bytes, self.limits.max_frame_bytes)
        super().__init__(small, min(small, self.limits.max_header_bytes), allocate=allocate,
                         budget=budget)
        self.greeted = False
        # Bytes of each complete request frame, by op (statistics), as they are parsed.
        self.bytes_in: dict[str, int] = {}
        # What the server stores, nobody may change; as large as a frame may be.
        self.fds = Fds(writable=False, limit=self.limits.max_frame_bytes)

    def handshake_done(self) -> None:
        """Lift the small pre-hello cap to the configured limits."""
        self.greeted = True
        self._decoder.max_frame_bytes = self.limits.max_frame_bytes
        self._decoder.max_header_bytes = self.limits.max_header_bytes

    def frames(self, data: BytesLike) -> tuple[list[Frame | OversizedFrame],
                                                ProtocolError | None]:
        """Feed received bytes: the frames they complete, and the error that ends the stream
        (after those frames) if the peer broke the format. Each frame is then given to
        :meth:`parse`, in order: the server handles one before parsing the next."""
        return self._frames(data, 0)

    def buffered(self, nbytes: int) -> tuple[list[Frame | OversizedFrame],
                                             ProtocolError | None]:
        """Account for bytes received into :meth:`get_buffer`'s view (see :meth:`frames`)."""
        return self._frames(None, nbytes)

    def parse(self, frame: Frame | OversizedFrame
              ) -> tuple[Request | BadRequest, int, tuple[int, ...]]:
        """One frame's request, and the acknowledgement it carried.

        Returns:
            ``(request, through, open)``: the request (or a :class:`BadRequest` to answer
            with an error), and what the client says it has received: the replies of every
            request up to ``through`` except those in ``open`` (``through`` is -1 when the
            frame says nothing, or says it malformed: then replies are kept a little longer).

        Raises:
            ProtocolError: the frame breaks the format: the connection must be closed.
        """
        fds = self.fds
        token = PARSING_FDS.set(fds) if fds.queue else None
        try:
            if len(frame.header) < _GC_PAUSE_HEADER:
                return self._parse_frame(frame)
            with _GcPaused():
                return self._parse_frame(frame)
        finally:
            if token is not None:
                PARSING_FDS.reset(token)

    def _parse_frame(self, frame: Frame | OversizedFrame
                     ) -> tuple[Request | BadRequest, int, tuple[int, ...]]:
        if type(frame) is Frame:
            # The common requests from their fixed layouts (:mod:`.prepared`), without a dict.
            whole = frame
            header, payload = whole.header, whole.payload
            fast = read_request(header, payload, self.limits)
            if fast is not None:
                msg, through, open_ids, name = fast
                by_op = self.bytes_in
                by_op[name] = by_op.get(name, 0) + len(header) + len(payload) + 16
                return msg, through, open_ids
        return self.parse_general(frame)

    def parse_general(self, frame: Frame | OversizedFrame
                      ) -> tuple[Request | BadRequest, int, tuple[int, ...]]:
        """:meth:`parse` through the op table's general parse (the header unpacked into a
        dict), whatever the layout: what the fixed-layout reader must agree with.

        Raises:
            ProtocolError: the frame breaks the format.
        """
        h = _header_map(frame)
        rid = h.get("id")
        if type(rid) is not int or rid < 1:  # (an int, never a bool: msgpack keeps them apart)
            raise ProtocolError(f"request without a valid 'id' (an integer >= 1; "
                                f"op {h.get('op')!r})")
        if type(frame) is OversizedFrame:
            return self._oversized(rid, frame, h), -1, ()
        assert type(frame) is Frame
        through, open_ids = -1, cast(tuple[int, ...], ())
        if "ack" in h:
            through, open_ids = _ack_of(h)
        op = OPS.get(h.get("op", ""))  # (no op is named "")
        if op is None:
            return BadRequest(rid, InvalidRequest.code, f"unknown op {h.get('op')!r}"), \
                through, open_ids
        name = op.name
        by_op = self.bytes_in
        by_op[name] = by_op.get(name, 0) + len(frame.header) + len(frame.payload) + 16
        try:
            return op.parse(rid, h, frame.payload, self.limits), through, open_ids
        except InvalidField as exc:
            return BadRequest(rid, exc.code, str(exc), name, h), through, open_ids

    def _oversized(self, rid: int, frame: OversizedFrame, h: dict[str, Any]) -> BadRequest:
        """The answer to a request whose payload was refused (over a limit, or no memory)."""
        op = OPS.get(h.get("op", ""))
        name = "" if op is None else op.name
        if frame.reason:
            # (a budget may say which error it is: a user's quota is not the server's memory)
            return BadRequest(rid, getattr(frame.reason, "code", MemoryLimitExceeded.code),
                              f"a request of {frame.payload_len} payload bytes was refused: "
                              f"{frame.reason}; nothing was stored", name, h)
        if not self.greeted:
            raise ProtocolError(f"a frame of {frame.payload_len} payload bytes before the "
                                f"handshake; at most {frame.limit} bytes are accepted "
                                f"until hello")
        return BadRequest(rid, LimitExceeded.code,
                          f"frame of {frame.payload_len} payload bytes exceeds the "
                          f"server's max_frame_bytes={frame.limit}; nothing was stored", name, h)


def _prepared_request(msg: Request, through: int, open_ids: tuple[int, ...]) -> bytes | None:
    """The header of a put, an append of one item or a fetch of the common shapes, from
    prepared pieces (:mod:`.prepared`: the bytes the general encoder writes), ``through``
    and ``open_ids`` the acknowledgement (``through`` -1: none); ``None`` for any other
    request."""
    cls = type(msg)
    if cls is Fetch:
        f: Fetch = msg  # type: ignore[assignment]
        return fetch_header(f.spec.remove, f.id, f.bin, f.spec, through, open_ids)
    if cls is Put:
        p: Put = msg  # type: ignore[assignment]
        if p.min_version is not None or p.room is not None:
            return None
        return put_header("put", p.id, p.bin, p.item, None, through, open_ids)
    if cls is Append:
        a: Append = msg  # type: ignore[assignment]
        if a.rest or a.min_version is not None or a.wait_room:
            return None
        return put_header("append", a.id, a.bin, a.item, a.timeout, through, open_ids)
    return None


def _prepared_chunks(msg: Request, header: bytes) -> list[BytesLike]:
    """The frame of a prepared request's ``header`` and its item's one buffer, if any."""
    if type(msg) is Fetch:
        return frame_chunks(header, None)
    buffers = msg.item.value.buffers  # type: ignore[union-attr]
    return frame_chunks(header, buffers[0].data if buffers else None)


def _over_limits(msg: Request, size: int, header_len: int, limits: Limits) -> None:
    """Raise the error of a request over the server's frame or header limit.

    Raises:
        LimitExceeded: always (nothing was sent).
    """
    bin_name = getattr(msg, "bin", None)
    what = op_name(msg) + (f" of bin {bin_name!r}" if bin_name is not None else "")
    if size > limits.max_frame_bytes:
        raise LimitExceeded(f"{what} not sent: the request takes {size} bytes, over the "
                            f"server's max_frame_bytes={limits.max_frame_bytes}")
    raise LimitExceeded(
        f"{what} not sent: its header takes {header_len} bytes (strings, bytes and "
        f"numbers travel there, tensors do not), over the server's "
        f"max_header_bytes={limits.max_header_bytes}")


class ClientConnection(_Side):
    """The client side of one connection: requests -> bytes; bytes in -> replies and events.

    A reply does not repeat the op of its request; :meth:`receive_data` asks ``op_of(id)``.

    Args:
        limits: the limits to respect (the server's, once known from the handshake).
        allocate: where large parts of received frames come from (see
            :class:`~.frames.FrameDecoder`).
    """

    def __init__(self, limits: Limits | None = None, *,
                 allocate: Callable[[int], Payload] | None = None) -> None:
        self.limits = limits or Limits()
        super().__init__(self.limits.max_frame_bytes + REPLY_SLACK,
                         self.limits.max_frame_bytes + REPLY_SLACK, allocate=allocate)
        self.fds = Fds(writable=True)  # received tensors are the caller's to change
        self.shm = False  # the handshake allowed memfd buffers, both ways
        self._replies = ReplyReader()  # the common replies, read from their fixed layouts

    def set_limits(self, limits: Limits) -> None:
        """Adopt the server's limits (from the handshake).

        They bound what the client sends; what it receives may be a little larger: a reply
        carries a few more header fields than the request that stored the value, and the
        value trees of several items share one reply header. The server keeps each reply's
        items within ``max_frame_bytes``.
        """
        self.limits = limits
        self._decoder.max_frame_bytes = limits.max_frame_bytes + REPLY_SLACK
        self._decoder.max_header_bytes = limits.max_frame_bytes + REPLY_SLACK

    def send(self, msg: Request, ack: AckInfo | None = None,
             shared: list[Any] | None = None) -> list[BytesLike]:
        """Serialise one request, with the acknowledgement fields if given.

        Args:
            shared: with memfd buffers allowed (see :func:`encode_message`), collects the
                shared memory whose descriptors must go with the frame.

        Raises:
            LimitExceeded: the frame or its header is over the server's limit; nothing
                was sent, and the connection stays usable.
        """
        if ack is None:
            return self.send_acked(msg, -1, (), shared)
        return self.send_acked(msg, ack.through, ack.open, shared)

    def send_acked(self, msg: Request, through: int, open_ids: tuple[int, ...],
                   shared: list[Any] | None = None) -> list[BytesLike]:
        """:meth:`send` with the acknowledgement as its two fields (``through`` -1: none):
        what a client session calls for every request, with no :class:`AckInfo` made."""
        header = _prepared_request(msg, through, open_ids)
        if header is not None:
            header_len = len(header)
            chunks = _prepared_chunks(msg, header)
        else:
            extra: dict[str, Any] | None = None
            if through >= 0:
                extra = {"ack": through}
                if open_ids:
                    extra["open"] = list(open_ids)
            chunks, header_len = encode_message(msg, extra, shared if self.shm else None)
        limits = self.limits
        size = 0
        for c in chunks:
            size += len(c)
        if size > limits.max_frame_bytes or header_len > limits.max_header_bytes:
            _over_limits(msg, size, header_len, limits)
        return chunks

    def receive_data(self, data: BytesLike, op_of: Callable[[int], str | None]
                     ) -> list[ClientEvent]:
        """Feed received bytes; return the replies and notifications they complete.

        Args:
            data: the bytes.
            op_of: the op of the request with this id, or ``None`` if nobody waits for it.

        Never raises for bad input: if the server broke the wire format, the last event is
        a :class:`ProtocolViolation` and the connection must be closed.
        """
        frames, error = self._frames(data, 0)
        return self._parse(frames, error, op_of)

    def buffer_updated(self, nbytes: int, op_of: Callable[[int], str | None]
                       ) -> list[ClientEvent]:
        """Account for bytes received into :meth:`get_buffer`'s view."""
        frames, error = self._frames(None, nbytes)
        return self._parse(frames, error, op_of)

    def _parse(self, frames: list[Frame | OversizedFrame], error: ProtocolError | None,
               op_of: Callable[[int], str | None]) -> list[ClientEvent]:
        # What ServerConnection.parse does per frame, with the op lookup of each reply.
        out: list[ClientEvent] = []
        token = PARSING_FDS.set(self.fds) if self.fds.queue else None
        try:
            for frame in frames:
                if isinstance(frame, OversizedFrame):  # (a final class: the same as type() is)
                    raise ProtocolError(f"a message of {frame.payload_len} payload bytes from "
                                        f"the server exceeds {frame.limit} bytes")
                if len(frame.header) < _GC_PAUSE_HEADER:
                    out.append(self._parse_frame(frame, op_of))
                    continue
                with _GcPaused():
                    out.append(self._parse_frame(frame, op_of))
        except ProtocolError as exc:
            error = exc
        finally:
            if token is not None:
                PARSING_FDS.reset(token)
        if error is not None:
            out.append(ProtocolViolation(str(error)))
        return out

    def _parse_frame(self, frame: Frame, op_of: Callable[[int], str | None]) -> ClientEvent:
        header = frame.header
        reader = self._replies
        if header[0] != 0x85 or not header.startswith(_NOTIFY_OP, 1):
            rid = reader.reply_id(header)
            op = op_of(rid) if rid is not None else None
            if op is not None:
                msg = reader.reply(rid, REPLY_EXPECTS.get(op), frame.payload)
                if msg is not None:
                    return msg
        else:
            change = reader.notify(header)
            if change is not None:
                return change
        h = _header_map(frame)
        op = h.get("op")
        try:
            if op == "reply":
                rid = check_int(h, "id")
                if not check_bool(h, "ok"):
                    return ErrorReply(rid, check_str(h, "code"), check_str(h, "message"))
                req_op = op_of(rid)
                if req_op is None:
                    items = h.get("items")
                    return Orphan(rid, len(items) if isinstance(items, list) else 0)
                return OPS[req_op].parse_reply(rid, h, frame.payload, self.limits)
            if op == "notify":
                return Changed(check_str(h, "bin"), check_str(h, "event"), check_int(h, "n_items"),
                               check_int(h, "version"), opt_int(h, "skipped") or 0,
                               opt_int(h, "dropped") or 0)
            if op == "error":
                return ErrorReply(0, check_str(h, "code"), check_str(h, "message"))
        except InvalidField as exc:
            raise ProtocolError(f"malformed message from server: {exc}") from None
        raise ProtocolError(f"unexpected message op {op!r} from server")

