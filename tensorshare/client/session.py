"""The client session: one sans-I/O core under every client.

:class:`ClientSession` owns everything a client knows about its conversation with the server:
request ids, the one table of pending requests (what each is, how to describe it in errors,
when it times out), the listeners and the last version each has seen, what must be resent
after a reconnect, the acknowledgements that let the server forget remembered replies, and
failing everything at once. It never touches a socket, a thread or a clock: the I/O shells
(:class:`tensorshare.Client` with a socket and a reader thread, the Twisted client with
``callLater`` and Deferreds) pass the time in and do what the returned events say.

A shell's life::

    session = ClientSession(address="host:8000", timeout=30.0, reconnect=True)
    transport.write(session.connection_made(now))           # hello
    call = session.call(Put(0, "w", item), "put to bin 'w'", now, token=slot)
    transport.write(session.pop_sendable(now))              # once connected, in id order
    for event in session.receive_data(data, now): ...       # Done, Notify, Ready, Drop
    for event in session.tick(now): ...                     # timeouts and heartbeats
    session.connection_lost("reset by peer", now)           # keep calls, or fail them all

Exactly once: every connection opens with ``hello`` carrying the session id. Requests are
numbered; each carries an acknowledgement of the replies received so far. After a reconnect
that the server resumes, every request without a reply is sent again and the server answers
the ones it already ran with the remembered reply. If the server does not know the session
(restarted without persistence), requests whose outcome cannot be known fail with
:class:`~tensorshare.errors.SessionLost`; requests that change nothing are simply resent.
"""

from __future__ import annotations

import heapq
import os
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

from ..errors import (
    AuthenticationError,
    ConnectError,
    ConnectionLost,
    ReplyTimeout,
    ServerError,
    SessionLost,
    SessionTakenOver,
    TensorShareError,
    error_from_code,
)
from ..wire.auth import client_proof, new_nonce, server_proof, verify
from ..wire.frames import BytesLike
from ..wire.messages import (
    Auth,
    Bye,
    Cancel,
    Challenge,
    Hello,
    HelloReply,
    Limits,
    Listen,
    Listening,
    Ping,
    Reply,
    Request,
)
from ..wire.protocol import (
    MAX_OPEN_ACKS,
    OPS,
    PROTOCOL_VERSIONS,
    REPLY_EXPECTS,
    SESSION_ID_BYTES,
    ClientConnection,
    Orphan,
    ProtocolViolation,
    op_name,
)
from ..wire.records import (
    Append,
    Changed,
    ErrorReply,
    Fetch,
    Fetched,
    Put,
)
from ..wire.replies import ReplyReader

__all__ = [
    "Call",
    "ClientSession",
    "Done",
    "Drop",
    "Notify",
    "Ready",
    "Send",
    "event_dict",
]

# Call states.
QUEUED = "queued"  # made, not sent on the current connection (maybe sent on an earlier one)
SENT = "sent"  # sent on the current connection, no reply yet
ABANDONED = "abandoned"  # the caller gave up; kept until the server confirmed a cancel
FINISHED = "finished"

# How long a closing client waits for the server to answer its bye.
BYE_WAIT = 1.0
# Backoff between reconnect attempts: BASE * 2**attempt, at most CAP, times a random factor
# in [0.5, 1] so that dozens of workers that lost the same server do not return in lockstep.
BACKOFF_BASE = 0.05
BACKOFF_CAP = 2.0
# A get's items stay held on the server for the session (counted against its user's quota)
# until the client acknowledges the reply, which rides on its next request. A client that
# sends nothing for this long after a get's reply sends a ping to carry the acknowledgement
# (see ClientSession.ack_due): a writer of the same user waiting for room in its quota is not
# held back by items already delivered.
ACK_DELAY = 0.2


class Call:
    """One request of the session (made by the user, or internal: heartbeats, cancels,
    listens renewed after a reconnect).

    Attributes:
        id: the request id (unique for the life of the session).
        request: the message as it will be (re)sent.
        op: its wire op.
        what: how errors name it, e.g. ``"get on bin 'q'"``.
        token: the shell's handle (a slot to wake, a Deferred to fire); ``None`` if internal.
        convert: turns the reply into the caller's result (used by the shell).
        timeout: seconds the server has to answer (after any server-side wait).
        wait: server-side wait of a waiting fetch: seconds, or ``None`` (no limit); only
            meaningful when ``waiting``.
        waiting: whether this is a waiting get/peek.
        started: when the call was made.
        deadline: when it times out (``None``: never; a wait without limit).
        state: queued, sent, abandoned or finished.
        sent_on: the connection number it was last sent on (0: never sent).
        extra: per-op bookkeeping (the callback a listen registers, a cancel's target).
    """

    __slots__ = ("id", "request", "op", "what", "token", "convert", "timeout", "wait",
                 "waiting", "started", "deadline", "state", "sent_on", "extra")

    def __init__(self, id: int, request: Request, op: str, what: str, token: Any,
                 convert: Callable[[Any], Any] | None, timeout: float, wait: float | None,
                 waiting: bool, started: float, deadline: float | None, state: str = QUEUED,
                 sent_on: int = 0, extra: Any = None) -> None:
        self.id = id
        self.request = request
        self.op = op
        self.what = what
        self.token = token
        self.convert = convert
        self.timeout = timeout
        self.wait = wait
        self.waiting = waiting
        self.started = started
        self.deadline = deadline
        self.state = state
        self.sent_on = sent_on
        self.extra = extra

    def __repr__(self) -> str:
        return f"Call({self.id}, {self.what!r}, {self.state})"


class Done:
    """A call finished: ``reply`` is the server's reply (maybe an :class:`ErrorReply`), or
    ``error`` says why there is none."""

    __slots__ = ("call", "reply", "error")

    def __init__(self, call: Call, reply: Reply | None = None,
                 error: TensorShareError | None = None) -> None:
        self.call = call
        self.reply = reply
        self.error = error

    def __repr__(self) -> str:
        return f"Done({self.call!r}, reply={self.reply!r}, error={self.error!r})"


class Notify:
    """Deliver ``event`` (a dict) to each of ``callbacks`` (opaque to the session)."""

    __slots__ = ("bin", "event", "callbacks")

    def __init__(self, bin: str, event: dict[str, Any], callbacks: list[Any]) -> None:
        self.bin = bin
        self.event = event
        self.callbacks = callbacks

    def __repr__(self) -> str:
        return f"Notify({self.bin!r}, {self.event!r})"


class Ready:
    """The handshake of a connection completed.

    Attributes:
        hello: the server's reply.
        first: it is the session's first connection.
        resumed: the server carried the session on (no request was lost or doubled).
    """

    __slots__ = ("hello", "first", "resumed")

    def __init__(self, hello: HelloReply, first: bool, resumed: bool) -> None:
        self.hello = hello
        self.first = first
        self.resumed = resumed

    def __repr__(self) -> str:
        return f"Ready(first={self.first}, resumed={self.resumed})"


class Drop:
    """The shell must drop the current connection (then report it with ``connection_lost``)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"Drop({self.reason!r})"


class Send:
    """The shell must write ``chunks`` now (the next step of a handshake)."""

    __slots__ = ("chunks",)

    def __init__(self, chunks: list[BytesLike]) -> None:
        self.chunks = chunks


Event = Done | Notify | Ready | Drop | Send


def event_dict(msg: Changed) -> dict[str, Any]:
    """A change notification as listen callbacks get it."""
    ev: dict[str, Any] = {"status": "OK", "bin": msg.bin, "op": msg.op, "n_items": msg.n_items,
                          "version": msg.version}
    if msg.skipped:
        ev["skipped"] = msg.skipped
    if msg.dropped:
        ev["dropped"] = msg.dropped
    return ev


class _Listen:
    __slots__ = ("callbacks", "version")

    def __init__(self, callbacks: list[Any] | None = None) -> None:
        self.callbacks: list[Any] = [] if callbacks is None else callbacks
        self.version: int | None = None  # the last version delivered or learned


def _with_id(request: Request, rid: int) -> Request:
    """``request`` numbered ``rid`` (the op surface makes requests with id 0)."""
    if type(request) is Put:  # (the most common: one call instead of dataclasses.replace's)
        return Put(rid, request.bin, request.item, request.min_version, request.room)
    if type(request) is Fetch:
        return Fetch(rid, request.bin, request.spec)
    if type(request) is Append:
        return Append(rid, request.bin, request.item, request.timeout, request.rest,
                      request.min_version, request.wait_room)
    # (the other requests are dataclasses; mypy cannot tell them from the records above)
    return replace(request, id=rid)  # type: ignore[type-var]  # a dataclass: see above

_NO_ACK: tuple[int, tuple[int, ...]] = (-1, ())  # (ClientSession._ack: nothing new to say)
_EXPECTS = REPLY_EXPECTS  # (typed a dict in the compiled twin)


class ClientSession:
    """The state of one client, across any number of connections. Not thread-safe.

    Args:
        address: ``host:port`` (or a path), for messages.
        timeout: seconds the server has to answer a request; also the heartbeat's answer time.
        reconnect: ``True``: ride out connection loss for as long as it takes (each call
            still times out on its own); a number: give up after that many seconds without
            a connection; ``False``: fail everything at the first connection loss.
        name: how the client introduces itself in the server's log.
        session: ``True`` (default) for exactly-once replay with a random session id, or a
            16-byte id; ``False`` for no session (nothing is remembered on the server).
        heartbeat: seconds of silence after which a ping checks the connection and carries
            acknowledgements; ``None``: a third of ``timeout``, at most 5 s.
        rng: random numbers for the backoff jitter.
        token, user: the key of the token to prove, and the user it is for (named in the
            hello and bound into the proof; ``None``: the user ``default``).
    """

    def __init__(self, *, address: str, timeout: float = 30.0, reconnect: bool | float = True,
                 name: str = "tensorshare-python", session: bool | bytes = True,
                 heartbeat: float | None = None, rng: random.Random | None = None,
                 token: bytes | None = None, user: str | None = None) -> None:
        self.address = address
        self.token = token  # the key of the token to prove (see tensorshare.wire.auth)
        self.user = user  # the user that token is for (None: the hello names none)
        self._nonce: bytes | None = None  # this connection's hello nonce
        self._server_nonce = b""  # the server's challenge on this connection
        self.timeout = timeout
        self.reconnect = reconnect
        self.name = name
        if session is True:
            self.session_id: bytes | None = os.urandom(SESSION_ID_BYTES)
        elif session is False:
            self.session_id = None
        else:
            self.session_id = bytes(session)
        self.heartbeat = heartbeat if heartbeat is not None else min(timeout / 3, 5.0)
        self.rng = rng or random.Random()
        self.limits = Limits()
        self.server: HelloReply | None = None  # the last handshake's answer
        self.conn: ClientConnection | None = None
        self.generation = 0  # connections made so far
        self.connected = False  # the current connection completed its handshake
        self.closed: TensorShareError | None = None  # set once no call can succeed any more
        self.disconnected_since: float | None = None
        self.server_said: str | None = None
        self.calls: dict[int, Call] = {}  # id order: ids are given out in increasing order
        self.listeners: dict[str, _Listen] = {}
        self._next_id = 0
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, id); stale entries
        self._through = 0  # highest id whose reply arrived
        # The acknowledgement the last request carried (``_last_through`` -1: none yet).
        self._last_through = -1
        self._last_open: tuple[int, ...] = ()
        self._last_tx = 0.0
        self._last_rx = 0.0
        # When a get's reply arrived that no request sent since acknowledged (0.0: none).
        self._held_at = 0.0
        self._ping: Call | None = None  # the heartbeat in flight
        self._hello: Call | None = None
        self._queue: list[Call] = []  # calls to send on the current connection, in id order
        self._out_shared: list[Any] = []  # see take_shared
        self.shm = False  # ask for memfd buffers in the handshake (a Unix socket shell)
        # Where the large parts of received messages go (the shell's choice: a pool of
        # reusable memory; None: a bytearray each).
        self.allocate: Callable[[int], Any] | None = None
        self._finished_now: list[Done] = []
        self.last_loss = ""  # why the last connection was lost, for messages
        # Replies the shell got and has not handed to their caller yet (see hold): kept
        # open in the acknowledgements, so that a get's items can still be given back.
        self.held: dict[int, Call] = {}
        self._replies = ReplyReader()

    # -- ids and the table ------------------------------------------------------------------
    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    @property
    def pending(self) -> int:
        """How many calls wait for a reply (internal ones included)."""
        return len(self.calls)

    def op_of(self, rid: int) -> str | None:
        """The op of pending request ``rid`` (the reply parser needs it), or ``None``."""
        c = self.calls.get(rid)
        if c is None or c.state == ABANDONED:
            # A reply to a call we gave up on (its cancel is on the way): the parser
            # reports it as an Orphan, without decoding its items.
            return "hello" if (self._hello is not None and self._hello.id == rid) else None
        return c.op

    # -- making calls -----------------------------------------------------------------------
    def call(self, request: Request, what: str, now: float, token: Any = None,
             convert: Callable[[Any], Any] | None = None, timeout: float | None = None,
             extra: Any = None) -> Call:
        """Add a request to the table; it goes out with the next :meth:`pop_sendable`.

        Args:
            request: the message; its ``id`` is replaced by a fresh one.
            what: how errors name the request.
            now: the current time.
            token, convert: the shell's (see :class:`Call`).
            timeout: seconds the server has to answer (default: the session's timeout).
            extra: per-op bookkeeping kept with the call.

        Raises:
            ConnectionLost: the session is closed (the message says why).
        """
        if self.closed is not None:
            raise type(self.closed)(f"cannot send {what}: {self.closed}")
        rid = self._new_id()
        request = _with_id(request, rid)
        cls = type(request)
        op = "put" if cls is Put else op_name(request)
        answer = self.timeout if timeout is None else timeout
        waiting, wait = False, None
        if type(request) is Fetch and request.spec.wait:
            waiting, wait = True, request.spec.timeout
        if waiting and wait is None:
            deadline = None
        else:
            deadline = now + answer + (wait or 0.0)
        c = Call(rid, request, op, what, token, convert, answer, wait, waiting, now, deadline,
                 QUEUED, 0, extra)  # (positional: the fast call)
        self.calls[rid] = c
        self._queue.append(c)
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, rid))
        return c

    def pop_sendable(self, now: float) -> list[BytesLike]:
        """The frames of every call not yet sent on the current connection, in id order.

        Empty until the handshake is done. The calls count as sent once this returns: the
        shell must write the chunks (a failed write is a lost connection).
        """
        if not self.connected or self.conn is None:
            return []
        out: list[BytesLike] = []
        gen = self.generation
        queue, self._queue = self._queue, []
        shared = self._out_shared if self.conn.shm else None
        for c in queue:
            if c.state != QUEUED or c.id not in self.calls:
                continue
            request = c.request
            if c.sent_on and c.waiting and c.wait is not None and c.deadline is not None:
                # Resent after a reconnect: wait only for what is left of its time.
                left = max(c.deadline - c.timeout - now, 0.0)
                if left != c.wait:
                    assert type(request) is Fetch
                    request = Fetch(request.id, request.bin, request.spec.with_timeout(left))
            try:
                through, opened = self._ack()
                out.extend(self.conn.send_acked(request, through, opened, shared))
            except TensorShareError as exc:
                # Over the server's limits (learned since the call was made): fail it alone.
                c.state = FINISHED
                del self.calls[c.id]
                self._finished_now.append(Done(c, error=exc))
                continue
            c.state = SENT
            c.sent_on = gen
        if out:
            self._last_tx = now
        return out

    def take_shared(self) -> list[Any]:
        """The shared memory (sealed memfds) whose descriptors must go with the frames that
        :meth:`pop_sendable` returned last, in order."""
        out, self._out_shared = self._out_shared, []
        return out

    @property
    def has_sendable(self) -> bool:
        """Whether :meth:`pop_sendable` would return something now."""
        return self.connected and bool(self._queue)

    @property
    def has_shared(self) -> bool:
        """Whether :meth:`take_shared` would return something."""
        return bool(self._out_shared)

    @property
    def has_finished(self) -> bool:
        """Whether :meth:`take_finished` would return something."""
        return bool(self._finished_now)

    def take_finished(self) -> list[Done]:
        """Calls that :meth:`pop_sendable` had to fail locally (say, over a limit)."""
        done, self._finished_now = self._finished_now, []
        return done

    def _ack(self) -> tuple[int, tuple[int, ...]]:
        """The acknowledgement for the request sent now as ``(through, open_ids)``, or
        :data:`_NO_ACK` (through -1) when it would say what the last one said: two fields,
        not an :class:`AckInfo` (asked for every request sent)."""
        if self.session_id is None:
            return _NO_ACK
        through = self._through
        open_ids: list[int] = []
        for rid in self.calls:  # id order: stop at the first id at or above ``through``
            if rid >= through:
                break
            open_ids.append(rid)
            if len(open_ids) > MAX_OPEN_ACKS:
                through = open_ids[0] - 1
                open_ids = []
                break
        if through == self._through:
            self._held_at = 0.0  # (every reply in is acknowledged by what is sent now, but
            #                       the held ones: their release arms it again)
        if self.held or through in self.calls:
            through, open_ids = self._held_ack(through, open_ids)
        if not open_ids:
            if through == self._last_through and not self._last_open:
                return _NO_ACK  # (compared before making anything: asked per request sent)
            self._last_through, self._last_open = through, ()
            return through, ()
        opened = tuple(open_ids)
        if through == self._last_through and opened == self._last_open:
            return _NO_ACK
        self._last_through, self._last_open = through, opened
        return through, opened

    def _held_ack(self, through: int, open_ids: list[int]) -> tuple[int, list[int]]:
        """The acknowledgement ``(through, open_ids)`` with the held ids left open: an ack
        covers its own id, so it goes below a held one, or a pending one (a get given up
        on whose late reply was the last to come: its cancel is not answered yet)."""
        held, calls = self.held, self.calls
        while through in held or through in calls:
            through -= 1
        ids = sorted({rid for rid in open_ids if rid < through}.union(
            rid for rid in held if rid < through))
        if len(ids) > MAX_OPEN_ACKS:
            return ids[0] - 1, []
        return through, ids

    def hold(self, call: Call) -> None:
        """Keep finished ``call``'s id open in the acknowledgements: its reply came, but the
        shell hands it to its caller only later (an asyncio task resumes on a later turn
        of its loop, and may be cancelled meanwhile). Until :meth:`release`, the server
        keeps what a get took for the session."""
        self.held[call.id] = call

    def release(self, call: Call, now: float, undo: bool = False) -> None:
        """The caller of held ``call`` took its reply (acknowledged from now on) or, with
        ``undo``, is gone without it: a ``cancel`` gives the items of a get back to the
        front of their bin (docs/PROTOCOL.md §6.7), and the id stays open until the cancel
        is answered. Nothing for a call that is not held."""
        if self.held.pop(call.id, None) is None:
            return
        if self.closed is not None or self.session_id is None:
            return
        if undo:
            call.state = ABANDONED
            self.held[call.id] = call
            self.call(Cancel(0, call.id), "cancel", now, None, None, None, call.id)
        elif self._held_at == 0.0:
            self._held_at = now  # to be acknowledged soon (see ack_due)

    def goodbye(self, now: float) -> Call | None:
        """End the session on the server (a ``bye``, sent with the current acknowledgements):
        its detached session would otherwise wait ``session_ttl`` for us. The shell sends it,
        waits a moment for the answer, then closes.

        Returns:
            The call, or ``None`` when there is nothing to end (not connected, no session).
        """
        if self.closed is not None or not self.connected or self.session_id is None:
            return None
        return self.call(Bye(0), "goodbye", now, None, None, min(self.timeout, BYE_WAIT))

    # -- listeners ----------------------------------------------------------------------------
    def add_listener(self, name: str, callback: Any) -> bool:
        """Register a callback; return whether it is the bin's first (a Listen must be sent)."""
        entry = self.listeners.get(name)
        if entry is None:
            self.listeners[name] = _Listen([callback])
            return True
        entry.callbacks.append(callback)
        return False

    def remove_listener(self, name: str, callback: Any = None) -> bool:
        """Forget one callback (or all of the bin's); return whether the bin had any."""
        entry = self.listeners.get(name)
        if entry is None:
            return False
        if callback is None:
            del self.listeners[name]
            return True
        entry.callbacks = [cb for cb in entry.callbacks if cb is not callback]
        if not entry.callbacks:
            del self.listeners[name]
        return True

    def listener_callbacks(self, name: str) -> list[Any]:
        entry = self.listeners.get(name)
        return list(entry.callbacks) if entry else []

    # -- the connection -----------------------------------------------------------------------
    def connection_made(self, now: float) -> list[BytesLike]:
        """A new connection is up: return the hello to write first."""
        self.conn = ClientConnection(self.limits, allocate=self.allocate)
        self.generation += 1
        self.connected = False
        self.server_said = None
        self._last_through, self._last_open = 0, ()  # nothing to acknowledge: no field
        self._last_rx = self._last_tx = now
        for c in self.calls.values():
            if c.state == SENT:
                c.state = QUEUED  # sent on a dead connection: the resume decides
        self._queue = [c for c in self.calls.values() if c.state == QUEUED]
        self._nonce = new_nonce() if self.token is not None else None
        hello = Hello(self._new_id(), PROTOCOL_VERSIONS, self.name, self._nonce,
                      self.session_id, self.generation > 1 and self.session_id is not None,
                      self.shm, self.user if self.token is not None else None, True)
        self._out_shared = []
        c = Call(hello.id, hello, "hello", "handshake", None, None, self.timeout, None, False,
                 now, now + self.timeout, state=SENT, sent_on=self.generation)
        self._hello = c
        heapq.heappush(self._deadlines, (now + self.timeout, hello.id))
        through, opened = self._ack()
        chunks = self.conn.send_acked(hello, through, opened)
        return chunks

    def connection_lost(self, reason: str, now: float) -> list[Event]:
        """The current connection is gone.

        Returns:
            With ``reconnect`` off (or the session closed): a :class:`Done` with
            :class:`~tensorshare.errors.ConnectionLost` for every call. Otherwise nothing:
            calls wait for the next connection (each within its own timeout).
        """
        if self.server_said:
            reason = f"{reason}; the server said: {self.server_said}"
        if self.conn is not None:
            self.conn.fds.close()
        self.conn = None
        self.connected = False
        self._hello = None
        self._ping = None
        if self.disconnected_since is None:
            self.disconnected_since = now
        if self.closed is not None:
            return []
        if not self.reconnect:
            # A drop, even during the first handshake, is a blip the shell retries (within
            # its first connection's timeout, or the reconnect budget); without reconnect,
            # there is nothing to ride out.
            return self.close(ConnectionLost(
                f"connection to tensorshare server at {self.address} lost: {reason}"))
        self.last_loss = reason
        return []

    def give_up_due(self, now: float) -> bool:
        """Whether a numeric ``reconnect`` has run out (the shell should then :meth:`close`)."""
        r = self.reconnect
        if r is True or r is False or self.disconnected_since is None:
            return False
        return now - self.disconnected_since > float(r)

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before reconnect attempt ``attempt`` (0, 1, ...), with jitter."""
        return min(BACKOFF_CAP, BACKOFF_BASE * 2 ** min(attempt, 16)) * self.rng.uniform(0.5, 1)

    def close(self, error: TensorShareError, keep: Call | None = None) -> list[Event]:
        """Fail every call with ``error`` and refuse new ones. Idempotent.

        Args:
            keep: a call already sent whose answer is still awaited (a closing client's
                ``bye``): it stays, so its reply can be read.
        """
        if self.closed is None:
            self.closed = error
        calls, self.calls = self.calls, {}
        self._deadlines.clear()
        self.held.clear()
        out: list[Event] = []
        for c in calls.values():
            if c is keep:
                self.calls[c.id] = c
                if c.deadline is not None:
                    heapq.heappush(self._deadlines, (c.deadline, c.id))
            elif c.token is not None and c.state != ABANDONED:
                out.append(Done(c, error=type(error)(f"{c.what} failed: {error}")))
        self.connected = False
        return out

    # -- receiving ----------------------------------------------------------------------------
    @property
    def receiving(self) -> bool:
        """Whether a message is partly received."""
        return self.conn is not None and self.conn.receiving

    def get_buffer(self) -> memoryview | None:
        """Where to ``recv_into`` next, when a large message part is expected."""
        conn = self.conn
        if conn is None or not conn._decoder._state:  # (no frame begun: no large part)
            return None
        return conn.get_buffer()

    def receive_data(self, data: BytesLike, now: float) -> list[Event]:
        """Feed received bytes; return what the shell must do."""
        assert self.conn is not None
        self._last_rx = now
        return self._events(self.conn.receive_data(data, self.op_of), now)

    def receive_read(self, data: bytearray, view: memoryview, n: int, now: float
                     ) -> list[Event]:
        """Feed the ``n`` bytes just received into ``data`` (a reused buffer; ``view``: a
        view of it), in one pass: every whole frame of the common replies read from its fixed
        layout (see :mod:`~tensorshare.wire.replies`), the rest fed to the connection's general decoder."""
        conn = self.conn
        assert conn is not None
        self._last_rx = now
        msgs: list[Any] = []
        i = 0
        decoder = conn._decoder
        if not conn.fds.queue and not decoder._state and not decoder._prefix:
            i = self._whole_replies(data, n, decoder.max_header_bytes, decoder.max_frame_bytes,
                                    msgs)
        if i < n:
            msgs.extend(conn.receive_data(view[i:n], self.op_of))
        return self._events(msgs, now)

    def _whole_replies(self, data: bytearray, n: int, max_header: int, max_frame: int,
                       out: list[Any]) -> int:
        """Read the whole frames at the start of ``data[:n]`` that :mod:`~tensorshare.wire.replies` reads,
        into ``out``; return where the first one it does not read starts."""
        reader = self._replies
        i = 0
        while True:
            end = reader.frame_at(data, i, n, max_header, max_frame)
            if not end:
                return i
            start = reader.start
            rid = reader.reply_id(reader.h)
            if rid is None:
                msg = reader.notify(reader.h) if start == end else None
            else:
                op = self.op_of(rid)
                msg = None if op is None else reader.reply(
                    rid, _EXPECTS.get(op), data[start:end] if start != end else b"")
            if msg is None:
                return i
            out.append(msg)
            i = end

    def buffer_updated(self, nbytes: int, now: float) -> list[Event]:
        """Account for bytes received into :meth:`get_buffer`'s view."""
        assert self.conn is not None
        self._last_rx = now
        return self._events(self.conn.buffer_updated(nbytes, self.op_of), now)

    def _events(self, msgs: list[Any], now: float) -> list[Event]:
        out: list[Event] = []
        for msg in msgs:
            cls = type(msg)
            if cls is Changed:
                self._notify(msg, out)
            elif cls is ProtocolViolation:
                out.append(Drop(f"protocol error: {msg.message}"))
                break
            elif cls is Orphan:
                self._orphan(msg)
            elif cls is ErrorReply and msg.id == 0:
                self.server_said = f"{msg.message} ({msg.code})"
                if self._hello is not None and not self.connected:
                    # Refused before the handshake completed (no room for a connection, a
                    # TLS server reached without TLS): not a blip, so not retried.
                    error = error_from_code(
                        msg.code, f"tensorshare server at {self.address}: {msg.message}")
                    if not isinstance(error, ServerError):
                        error = ConnectError(str(error))
                    self._refused(error, out)
                    break
                if msg.code == SessionTakenOver.code:
                    # Another live connection uses our session id: reconnecting would only
                    # take it back (and be taken again). Stop, and say why.
                    out.extend(self.close(SessionTakenOver(
                        f"tensorshare server at {self.address}: {msg.message}")))
                    out.append(Drop(f"session taken over: {msg.message}"))
                    break
            else:
                self._reply(msg, out, now)
        return out

    def _notify(self, msg: Changed, out: list[Event]) -> None:
        entry = self.listeners.get(msg.bin)
        if entry is None:
            return  # an event that was on the way when we stopped listening
        if entry.version is not None and msg.version <= entry.version:
            return  # never deliver a version that is not newer than one already seen
        entry.version = msg.version
        out.append(Notify(msg.bin, event_dict(msg), list(entry.callbacks)))

    def _orphan(self, msg: Orphan) -> None:
        if msg.id > self._through:
            self._through = msg.id

    def _reply(self, msg: Reply, out: list[Event], now: float) -> None:
        rid = msg.id
        c = self.calls.get(rid)
        if c is None:
            if self._hello is not None and self._hello.id == rid:
                self._handshake(msg, out, now)
            return
        if rid > self._through:
            self._through = rid
        if c.state == ABANDONED:
            return  # the server still answered; the cancel's reply settles it
        c.state = FINISHED
        del self.calls[rid]
        if c.token is not None:
            if type(msg) is Fetched:
                if c.op == "get" and self._held_at == 0.0 and self.session_id is not None:
                    self._held_at = now  # its items are held for us until acknowledged
            elif type(msg) is ErrorReply and c.op == "listen":
                self.remove_listener(cast(Listen, c.request).bin, c.extra)
            elif type(msg) is Listening:
                self._listening(cast(Listen, c.request).bin, msg, None, out)
            out.append(Done(c, msg))  # (positional: the fast call)
            return
        self._internal_done(c, msg, out)

    def _internal_done(self, c: Call, msg: Reply, out: list[Event]) -> None:
        if c is self._ping:
            self._ping = None
        elif c.op == "cancel":
            self.held.pop(c.extra, None)
            target = self.calls.get(c.extra)
            if target is not None and target.state == ABANDONED:
                del self.calls[target.id]
        elif c.op == "listen":
            if type(msg) is Listening:
                self._listening(cast(Listen, c.request).bin, msg, c.extra, out)

    def _listening(self, name: str, msg: Listening, renewed: Any, out: list[Event]) -> None:
        """A listen was registered (``renewed``: after a reconnect, with the server's id then)."""
        entry = self.listeners.get(name)
        if entry is None:
            return
        if renewed is None:
            if entry.version is None:
                entry.version = msg.version
            return
        restarted = renewed is not None and renewed[1]
        if entry.version is not None and (msg.version != entry.version or restarted):
            # Changes happened while we were away: one event with the current state, so
            # that no change goes unnoticed.
            ev: dict[str, Any] = {"status": "OK", "bin": name, "op": "resync",
                                  "n_items": msg.n_items, "version": msg.version}
            if restarted:
                ev["restarted"] = True
            out.append(Notify(name, ev, list(entry.callbacks)))
        entry.version = msg.version

    # -- handshake ----------------------------------------------------------------------------
    def _handshake(self, msg: Reply, out: list[Event], now: float) -> None:
        hello = self._hello
        self._hello = None
        if type(msg) is Challenge and self.token is not None and hello is not None \
                and hello.op == "hello":
            self._answer_challenge(msg, hello, out, now)
            return
        if type(msg) is not HelloReply:
            # A typed refusal (a wrong token, no common version, a full server) is not a
            # network blip: it fails at once, with its own error, and is never retried.
            error = (error_from_code(msg.code, f"tensorshare server at {self.address}: "
                                               f"{msg.message}") if type(msg) is ErrorReply
                     else ConnectError(f"handshake with tensorshare server at {self.address} "
                                       f"failed: unexpected reply {type(msg).__name__}"))
            self._refused(error, out)
            return
        why = self._unproven(msg)
        if why is not None:
            self._refused(AuthenticationError(why), out)
            return
        first = self.server is None
        restarted = not first and self.server is not None and \
            msg.server_id != self.server.server_id
        self.server = msg
        self.limits = msg.limits
        assert self.conn is not None
        self.conn.set_limits(msg.limits)
        self.conn.shm = self.shm and msg.shm
        self.connected = True
        self.disconnected_since = None
        resumed = msg.resumed
        if not first:
            self._after_reconnect(resumed, restarted, out, now)
        out.append(Ready(msg, first, resumed))

    def _answer_challenge(self, msg: Challenge, hello: Call, out: list[Event],
                          now: float) -> None:
        """Prove we know the token (the next step of the handshake)."""
        assert self.token is not None and self.conn is not None
        self._server_nonce = msg.nonce
        proof = client_proof(self.token, self._nonce or b"", msg.nonce, self.session_id,
                             self.name, self.user)
        auth = Auth(self._new_id(), proof)
        c = Call(auth.id, auth, "auth", "authentication", None, None, self.timeout, None,
                 False, now, hello.deadline, state=SENT, sent_on=self.generation)
        self._hello = c
        if c.deadline is not None:
            heapq.heappush(self._deadlines, (c.deadline, c.id))
        out.append(Send(self.conn.send(auth, None)))

    def _unproven(self, msg: HelloReply) -> str | None:
        """Why the server did not prove it knows our token (``None``: it did, or no token)."""
        if self.token is None:
            return None
        if msg.proof is None:
            return (f"the tensorshare server at {self.address} did not ask for a token, so it "
                    f"cannot prove that it knows this client's token: is it the server you "
                    f"meant? (start it with --token-file, or connect without a token)")
        expected = server_proof(self.token, self._nonce or b"", self._server_nonce,
                                self.session_id, self.name, self.user)
        if not verify(expected, msg.proof):
            return (f"the tensorshare server at {self.address} does not know this client's "
                    f"token (its proof does not match)")
        return None

    def _refused(self, error: TensorShareError, out: list[Event]) -> None:
        out.extend(self.close(error))
        out.append(Drop(f"handshake refused: {error}"))

    def _after_reconnect(self, resumed: bool, restarted: bool, out: list[Event],
                         now: float) -> None:
        if not resumed:
            self.held.clear()  # that server keeps nothing of ours to give back
        for c in list(self.calls.values()):
            if c.sent_on == 0 or c.state == FINISHED:
                continue  # never sent: it simply goes out now
            if c.state == ABANDONED:
                if not resumed:
                    del self.calls[c.id]  # that server has nothing to give back
                continue
            if c.op == "cancel" and not resumed:
                del self.calls[c.id]
                continue
            if resumed or not OPS[c.op].mutating:
                continue  # resent: replayed or re-run by the server
            del self.calls[c.id]
            c.state = FINISHED
            if c.token is not None:
                why = ("the server was restarted without persistence" if restarted
                       else "the server no longer knows this client's session")
                out.append(Done(c, error=SessionLost(
                    f"{c.what} was sent before the connection to {self.address} dropped, and "
                    f"{why}: it may or may not have taken effect")))
        # Listen again to every bin; each reply tells whether the bin changed meanwhile.
        for name in self.listeners:
            self.call(Listen(0, name), f"listen to bin {name!r}", now, None, None, None,
                      (name, restarted))

    # -- time ---------------------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        """When :meth:`tick` next has something to do (a call's deadline), if ever."""
        heap = self._deadlines
        while heap and (heap[0][1] not in self.calls and not (
                self._hello is not None and self._hello.id == heap[0][1])):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def heartbeat_due(self, now: float) -> float:
        """When a heartbeat ping is next due (the shell may wake then and :meth:`tick`)."""
        return max(self._last_tx, self._last_rx) + self.heartbeat

    def ack_due(self) -> float | None:
        """When a ping must carry the acknowledgement of a get's reply, if one is waiting for
        it (:data:`ACK_DELAY` after the reply, unless a request carries it first): the shell
        wakes then and :meth:`tick` sends it. ``None`` while a ping is on its way: its
        answer wakes the shell anyway, and a time already past would spin it."""
        if self._held_at == 0.0 or not self.connected or self._ping is not None:
            return None
        return self._held_at + ACK_DELAY

    def tick(self, now: float) -> list[Event]:
        """Time has passed: expire calls, and send a heartbeat when the line was quiet.

        Returns:
            :class:`Done` events for calls that timed out, and :class:`Drop` when the
            connection must be given up (the handshake or a heartbeat went unanswered).
        """
        out: list[Event] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, rid = heapq.heappop(heap)
            c = self.calls.get(rid)
            if c is None:
                if self._hello is not None and self._hello.id == rid and not self.connected:
                    out.append(Drop(f"no answer to the handshake within {self.timeout:g} s"))
                continue
            self._expire(c, now, out)
        if self.connected and self._ping is None and (
                now >= self.heartbeat_due(now)
                or (self._held_at != 0.0 and now >= self._held_at + ACK_DELAY)):
            self._ping = self.call(Ping(0), "heartbeat", now)
        return out

    def expire(self, call: Call, now: float) -> list[Event]:
        """Check one call against its deadline (a waiting caller woke up); see :meth:`tick`."""
        out: list[Event] = []
        if call.deadline is not None and now >= call.deadline and call.id in self.calls:
            self._expire(call, now, out)
        return out

    def _expire(self, c: Call, now: float, out: list[Event]) -> None:
        if c.deadline is None or c.state in (ABANDONED, FINISHED):
            return
        if now < c.deadline:
            heapq.heappush(self._deadlines, (c.deadline, c.id))  # moved later meanwhile
            return
        if self.connected and c.state == SENT and self.receiving and \
                now - self._last_rx < c.timeout:
            # A message is streaming in (maybe this reply, maybe one queued before it): the
            # timeout is about silence, so keep waiting while bytes keep coming.
            c.deadline = self._last_rx + c.timeout
            heapq.heappush(self._deadlines, (c.deadline, c.id))
            return
        if c.token is None:
            if c is self._ping or c.op == "listen":
                del self.calls[c.id]
                if c is self._ping:
                    self._ping = None
                if self.connected:
                    out.append(Drop(f"no answer to a {c.what} within {c.timeout:g} s"))
            return
        out.append(Done(c, error=self._timeout_error(c, now)))
        self._give_up(c, now)

    def _give_up(self, c: Call, now: float) -> None:
        live = self.connected and c.state == SENT
        if (c.sent_on != 0 and c.op == "get") or (live and (c.op == "append" or c.waiting)):
            # The server may hold items this get took (it keeps them for the session until
            # we acknowledge the reply), or have a waiting get/peek or a blocked append of
            # ours: ask for the items back / the wait withdrawn. Until the cancel is answered
            # the id stays open in our acknowledgements, so the server cannot forget them.
            c.state = ABANDONED
            self.call(Cancel(0, c.id), "cancel", now, None, None, None, c.id)
        else:
            c.state = FINISHED
            del self.calls[c.id]

    def _timeout_error(self, c: Call, now: float) -> TensorShareError:
        took = c.timeout + (c.wait or 0.0)
        if self.connected and c.state == SENT:
            maybe = " (it may or may not have taken effect)" if OPS[c.op].mutating else ""
            return ReplyTimeout(f"no reply from tensorshare server at {self.address} to "
                                f"{c.what} within {took:g} s{maybe}")
        since = self.disconnected_since if self.disconnected_since is not None else c.started
        away = max(now - since, 0.0)
        cause = f" ({self.last_loss})" if self.last_loss else ""
        if c.sent_on == 0:
            return ConnectionLost(f"{c.what} not sent: the tensorshare server at "
                                  f"{self.address} has been unreachable for {away:.1f} s"
                                  f"{cause}")
        maybe = "; it may or may not have taken effect" if OPS[c.op].mutating else ""
        return ConnectionLost(f"no reply to {c.what}: the connection to {self.address} "
                              f"dropped and the server has been unreachable for "
                              f"{away:.1f} s{cause}{maybe}")

    def abandon(self, call: Call, now: float) -> None:
        """The caller gave up on ``call`` (e.g. a cancelled Deferred): forget it, and ask the
        server to undo a get or withdraw a wait."""
        if call.id in self.calls and call.state not in (ABANDONED, FINISHED):
            self._give_up(call, now)
