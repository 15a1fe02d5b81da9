"""What each request does, apart from the connection that carries it.

The connection (:mod:`.connection`) parses, enforces limits and backpressure, and hands each
request to the :class:`Responder`, which routes it by type to one handler: the store's here,
the other kinds' (:mod:`.streams`, :mod:`.services`) and the users' ``reload``
(:mod:`.users`) from their modules. Every handler acts on the server's parts (typed by
:mod:`.parts`) and *returns* its reply; the connection alone remembers, encodes and writes it.
A request answered later (a waiting get, a held append) returns ``None`` and is answered
through the connection's ``answer`` when it is served; what must follow a reply is handed to
the connection's ``then``.

The effects that change the store (:data:`EFFECTS`) are written once and used twice: by the
handlers, and by the data log's replay at start-up (:mod:`.persist`), which turns each logged
record back into the request it was and runs it through the same table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from twisted.logger import Logger

from ..errors import (
    BinFull,
    InvalidRequest,
    LimitExceeded,
    NotEnoughReplicas,
    PermissionDenied,
    ServerError,
    StorageUnavailable,
    WaitTimeout,
    code_for,
)
from ..wire.messages import (
    Bye,
    Cancel,
    Configure,
    Configured,
    Delete,
    Deleted,
    Hello,
    ListBins,
    Listen,
    Listening,
    Listing,
    Ping,
    Reply,
    Request,
    Stats,
    StatsReply,
    Unlisten,
)
from ..wire.protocol import OPS, item_wire_size, op_name, stored_frame
from ..wire.records import (
    Acked,
    Append,
    ErrorReply,
    Fetch,
    Fetched,
    Put,
    Stored,
)
from .auth import read_ops_text
from .parts import Route
from .sessions import Remembered
from .store import BinConfig, Store, Written

if TYPE_CHECKING:
    from .parts import AnyReply, Conn, Handler, Kind, Server

__all__ = ["EFFECTS", "Responder"]

log = Logger(namespace="tensorshare.server")

Ctx = Any  # what ties a store effect to its request: (session id, request id) or None


# -- effects: the changes to the store, shared with the data log's replay --------------------
def put_effect(store: Store, msg: Put, ctx: Ctx = None, owner: Any = None) -> Stored:
    """Replace a bin's content with the put's item (charged to ``owner``, a user's usage)."""
    w = _put_written(store, msg, ctx, owner)
    return Stored(msg.id, w.version, w.n_items)


def _put_written(store: Store, msg: Put, ctx: Ctx, owner: Any) -> Written:
    item = msg.item
    return store.put(msg.bin, item, item_wire_size(item), item.tag, ctx, msg.min_version,
                     owner)


def append_effect(store: Store, msg: Append, ctx: Ctx = None) -> Stored:
    """Append the items now (a replayed append, or one to a bin that does not block)."""
    entries = [(it, item_wire_size(it), it.tag) for it in msg.items]
    return _stored(msg.id, store.append_many(msg.bin, entries, ctx, msg.min_version))


def delete_effect(store: Store, msg: Delete, ctx: Ctx = None) -> Deleted:
    """Delete a bin."""
    existed, version = store.delete(msg.bin, ctx)
    return Deleted(msg.id, existed, version)


def configure_effect(store: Store, msg: Configure, ctx: Ctx = None) -> Configured:
    """Set a bin's limits.

    Raises:
        InvalidRequest: the limits are not valid.
    """
    try:
        cfg = BinConfig(msg.max_items, msg.max_bytes, msg.overflow)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    cfg = store.configure(msg.bin, cfg, ctx)
    return Configured(msg.id, cfg.max_items, cfg.max_bytes, cfg.overflow)


def _log_size(msg: Request) -> int:
    """About what a write adds to the data log."""
    if type(msg) is Put:
        return item_wire_size(msg.item) + 256
    if type(msg) is Append:
        return sum(item_wire_size(it) for it in msg.items) + 256
    return 256


def _stored(rid: int, w: Written) -> Stored:
    return Stored(rid, w.version, w.n_items, w.dropped)


# The requests on a value or list bin (a bin of another kind refuses them).
_STORE_OPS = frozenset({Put, Append, Fetch, Delete, Configure})


#: Request type -> its effect on the store (see the module docstring).
EFFECTS: dict[type, Callable[[Store, Any, Ctx], Reply]] = {
    Put: put_effect, Append: append_effect, Delete: delete_effect, Configure: configure_effect,
}


class Responder:
    """Routes requests to their handlers; one per server.

    Args:
        server: the server's parts.
    """

    def __init__(self, server: Server) -> None:
        self.server = server
        self._handlers: dict[type, Handler] = {
            Put: self._put, Append: self._append, Fetch: self._fetch, ListBins: self._list,
            Delete: self._delete, Listen: self._listen, Unlisten: self._unlisten,
            Ping: self._ping, Cancel: self._cancel, Stats: self._stats,
            Configure: self._configure, Hello: self._hello_again, Bye: self._bye,
        }
        owner: dict[type, Kind] = {}  # request type -> the kind whose handler serves it
        for kind in server.kinds:
            mine = kind.handlers()
            self._handlers.update(mine)
            owner.update(dict.fromkeys(mine, kind))
        self._handlers.update(server.users.handlers())
        self._users = server.users
        # A store request naming a bin of another kind is refused: the kinds' tables are
        # looked in (dict lookups: no call per request), and the one that has it names its
        # kind (by the table's identity).
        self._tables = [kind.table for kind in server.kinds]
        self._kind_of = {id(kind.table): kind for kind in server.kinds}
        #: The primary this server relays (read-only), or ``None``.
        self.relay_of = server.config.relay_of
        #: What refuses requests before their handlers (a relay's or a replica's writes),
        #: ``None`` when nothing does: ``fence(msg, route)`` returns the refusal or ``None``.
        self.fence: Callable[[Any, Route], Any] | None = (
            self._relay_fence if self.relay_of is not None else None)
        self._routes: dict[type, Route] = {}
        #: Op name -> the kind told of its refused requests (see :meth:`refused`).
        self._refusals: dict[str, Kind] = {}
        for op in OPS.values():
            if op.request is not Fetch:
                self._routes[op.request] = self._route_of(op.name, op.request)
            if op.request in owner:
                self._refusals[op.name] = owner[op.request]
        self._get = self._route_of("get", Fetch)
        self._peek = self._route_of("peek", Fetch)

    def _route_of(self, name: str, cls: type) -> Route:
        op = OPS[name]
        return Route(name, self._handlers.get(cls, self._unexpected), op.mutating, op.read,
                     cls in _STORE_OPS, cls in EFFECTS or name == "get", op.access)

    def route(self, msg: Any) -> Route:
        """How ``msg`` is served (one dict lookup: asked for every request and reply)."""
        cls = type(msg)
        if cls is Fetch:
            return self._get if msg.spec.remove else self._peek
        return self._routes[cls]

    def handle(self, conn: Conn, msg: Any, route: Route | None = None
               ) -> AnyReply | bytes | None:
        """Serve one request of ``conn`` (after its handshake): the reply to send, or ``None``
        when it is answered later (a waiting get, a held append, a write waiting for room in
        its user's quota). Never raises: a failure costs this request an error reply, never
        the connection or the server.

        A resent request whose reply is remembered gets that reply again (the connection
        knows it for one: it remembers nothing twice). The connection alone remembers,
        encodes and writes replies (``ServerProtocol.answer``).
        """
        if route is None:
            route = self.route(msg)
        if self.fence is not None:
            refusal = self.fence(msg, route)
            if refusal is not None:
                # A write short of --min-replicas that this session's earlier try applied
                # (its reply is remembered): not "refused, nothing applied" but that reply,
                # held like any write's until enough replicas have it (or answered
                # not_enough_replicas, "it may have been applied", after --replica-timeout).
                if refusal.code == NotEnoughReplicas.code:
                    return self._remembered(conn, msg, route) or refusal
                return refusal
        # What it may do (see .users): one check, skipped for a user who may do all without a
        # quota. (A connection has its user and usage from its hello on: none is routed before.)
        user = conn.user
        conn.usage.requests += 1  # type: ignore[union-attr]  # set at hello, see above
        if not user.unrestricted:  # type: ignore[union-attr]  # set at hello, see above
            verdict = self._users.admit(conn, route, msg)
            if verdict is not True:  # refused (the reply), or waiting for room (None)
                return None if verdict is False else verdict
        old = self._remembered(conn, msg, route)
        if old is not None:  # ran before the connection dropped: answer the same again
            return old
        try:
            if route.store:
                name = msg.bin
                for table in self._tables:
                    if name in table:
                        raise self._other_kind(msg, table)
            if route.logged and self.server.persist is not None:
                why = self.server.storage_refuses(_log_size(msg))
                if why is not None:
                    raise StorageUnavailable(why)
            return route.handler(conn, msg)
        except ServerError as exc:
            return ErrorReply(msg.id, code_for(exc), str(exc))
        except Exception:  # a bug must cost one request, never the server
            log.failure("internal error serving {op} from {peer}", op=op_name(msg),
                        peer=conn.peer)
            return ErrorReply(msg.id, ServerError.code, "internal server error; see the server log")

    def _remembered(self, conn: Conn, msg: Any, route: Route) -> AnyReply | bytes | None:
        """The remembered reply of a write this session sent before (counted as replayed)."""
        s = conn.session
        if s is None or not route.mutating:
            return None
        old = s.replies.get(msg.id)
        if old is None:
            return None
        self.server.stats.counters["replayed"] += 1
        return old if isinstance(old, bytes) else old.reply  # (a put's: its frame)

    def refused(self, conn: Conn, op: str, header: Mapping[str, Any], why: str) -> None:
        """A request of ``op`` was refused before it was parsed (the connection answered it
        with ``why``): the kind whose op it is settles what it names (a service's batch
        fails)."""
        kind = self._refusals.get(op)
        if kind is not None:
            kind.refused(conn, op, header, why)

    def _other_kind(self, msg: Any, table: Mapping[str, Any]) -> InvalidRequest:
        """The refusal of a store request naming a bin of the kind whose ``table`` has it."""
        kind = self._kind_of[id(table)]
        return InvalidRequest(f"bin {msg.bin!r} is a {kind.name} bin: {op_name(msg)} is for "
                              f"value and list bins (use the {kind.name}'s own operations)")

    def _relay_fence(self, msg: Any, route: Route) -> ErrorReply | None:
        return None if route.read else self._refuse_write(msg, route.op)

    def _refuse_write(self, msg: Any, op: str) -> ErrorReply:
        """The answer to a write that a relay does not allow."""
        return ErrorReply(msg.id, PermissionDenied.code, (
            f"{op} is not allowed on a relay: it serves the bins of {self.relay_of} "
            f"read-only ({read_ops_text()}); write to that primary"))

    # -- writes -----------------------------------------------------------------------------
    def _put(self, conn: Conn, msg: Put) -> bytes:
        # Answered as its frame, remembered as it is (a put's reply is no object).
        w = _put_written(self.server.store, msg, conn.ctx(msg), conn.usage)
        return stored_frame(msg.id, w.version, w.n_items)

    def _append(self, conn: Conn, msg: Append) -> Reply | None:
        store = self.server.store
        entries = [(it, item_wire_size(it), it.tag) for it in msg.items]
        rid = msg.id

        def stored(w: Written | BaseException) -> None:
            conn.stop_waiting(rid)
            conn.answer(msg, _stored(rid, w) if isinstance(w, Written)
                        else ErrorReply(rid, code_for(w), str(w)))

        result = store.append_or_wait(msg.bin, entries, stored, conn.ctx(msg), msg.min_version,
                                      conn.usage)
        if isinstance(result, Written):
            return _stored(rid, result)
        # A full "block" bin: wait for room, up to the append's timeout (a cancel or a
        # disconnect withdraws it too).
        conn.wait(rid, result, msg.timeout, lambda: self._block_timed_out(conn, msg))
        return None

    def _block_timed_out(self, conn: Conn, msg: Append) -> None:
        conn.answer(msg, ErrorReply(msg.id, BinFull.code,
                                    f"bin {msg.bin!r} stayed full for {msg.timeout:g} s "
                                    f"(overflow='block'); nothing was stored"))

    def _delete(self, conn: Conn, msg: Delete) -> Reply:
        return delete_effect(self.server.store, msg, conn.ctx(msg))

    def _configure(self, conn: Conn, msg: Configure) -> Reply:
        return configure_effect(self.server.store, msg, conn.ctx(msg))

    # -- reads ------------------------------------------------------------------------------
    def _fetch(self, conn: Conn, msg: Fetch) -> Reply | None:
        f = self.server
        spec = msg.spec
        max_bytes = f.max_reply_bytes
        s = conn.session
        if spec.remove and s is not None:
            # What a get takes stays held for the session until acknowledged: keep within
            # the session's allowance (at least one item is still returned).
            room = f.sessions.max_session_bytes - s.held
            if room <= 0:
                raise LimitExceeded(
                    f"this client's session holds {s.held} bytes of items from gets it has "
                    f"not acknowledged, its max_session_bytes={f.sessions.max_session_bytes}")
            max_bytes = min(max_bytes, room)
        if not spec.wait:  # (no closure here: nothing allocated beyond the reply)
            store: Store = f.store
            return _fetched(msg, store.fetch(msg.bin, spec, max_bytes, conn.ctx(msg)))
        return self._fetch_or_wait(conn, msg, max_bytes)

    def _fetch_or_wait(self, conn: Conn, msg: Fetch, max_bytes: int) -> Reply | None:
        """A fetch that waits for data (``wait``): served now, or kept waiting on ``conn``."""
        rid = msg.id
        now: list[Fetched] = []  # served while fetch_or_wait runs: returned, not answered

        def served(taken: Fetched) -> None:
            if not waits:
                now.append(taken)
                return
            conn.stop_waiting(rid)
            conn.answer(msg, _fetched(msg, taken))

        waits = False
        result = self.server.store.fetch_or_wait(msg.bin, msg.spec, served, max_bytes,
                                                 conn.ctx(msg))
        if isinstance(result, Fetched):
            return _fetched(msg, result)
        if now:  # served at once, behind earlier waiters the store served first
            return _fetched(msg, now[0])
        waits = True
        conn.wait(rid, result, msg.spec.timeout, lambda: self._timed_out(conn, msg))
        return None

    def _timed_out(self, conn: Conn, msg: Fetch) -> None:
        what = "newer data" if msg.spec.newer_than is not None else "data"
        conn.answer(msg, ErrorReply(msg.id, WaitTimeout.code,
                                    f"no {what} in bin {msg.bin!r} within "
                                    f"{msg.spec.timeout or 0.0:g} s"))

    def _list(self, conn: Conn, msg: ListBins) -> Reply:
        return Listing(msg.id, self._users.readable(conn, self.server.store.list()))

    def _stats(self, conn: Conn, msg: Stats) -> Reply:
        f = self.server  # (a user who may not read every bin sees its own: see .users)
        return StatsReply(msg.id, *self._users.stats(conn, f.server_stats,
                                                      f.bin_stats(msg.glob)))

    # -- listeners and the rest -------------------------------------------------------------
    def _listen(self, conn: Conn, msg: Listen) -> Reply:
        store = self.server.store
        conn.listening.add(msg.bin)
        self.server.subscribe(msg.bin, conn)
        return Listening(msg.id, store.version(msg.bin), store.n_items(msg.bin))

    def _unlisten(self, conn: Conn, msg: Unlisten) -> Reply:
        was = msg.bin in conn.listening
        conn.listening.discard(msg.bin)
        self.server.unsubscribe(msg.bin, conn)
        return Acked(msg.id, was)

    def _unexpected(self, conn: Conn, msg: Any) -> Reply:
        return ErrorReply(msg.id, InvalidRequest.code,
                          f"{op_name(msg)} is not expected after the handshake")

    def _hello_again(self, conn: Conn, msg: Hello) -> Reply:
        return ErrorReply(msg.id, InvalidRequest.code, "handshake already done")

    def _bye(self, conn: Conn, msg: Bye) -> Reply:
        s, conn.session = conn.session, None
        if s is not None:
            self.server.end_session(s)
        conn.then(conn.close)  # after its ``ok``
        return Acked(msg.id, s is not None)

    def _ping(self, conn: Conn, msg: Ping) -> Reply:
        return Acked(msg.id, True)

    def _cancel(self, conn: Conn, msg: Cancel) -> Reply:
        f = self.server
        target = msg.target
        cancelled = conn.cancel_wait(target)
        if cancelled is not None:
            return Acked(msg.id, cancelled)
        # A get that already ran, whose reply the client will not take: its items go back.
        # (Other remembered replies stay: a resent put must still not run twice.)
        s = conn.session
        done = s.replies.get(target) if s is not None else None
        if s is not None and type(done) is Remembered and done.bin is not None and \
                isinstance(done.reply, Fetched):
            if f.persist is not None:
                f.persist.session_record("forget", s.id, id=target)
            f.sessions.forget(s, target)
            f.restore(done.bin, done.reply, logged=True, owner=s.usage)
            return Acked(msg.id, True)
        return Acked(msg.id, False)


def _fetched(msg: Fetch, taken: Fetched) -> Fetched:
    """The store's record of a fetch as the reply to ``msg`` (the store's has ``id`` 0)."""
    # (positional: the generic ``Record._replace`` costs more than the rest of this per fetch)
    return Fetched(msg.id, taken.kind, taken.items, taken.version, taken.n_items,
                   taken.dropped, taken.unchanged, taken.tags, taken.nbytes)
