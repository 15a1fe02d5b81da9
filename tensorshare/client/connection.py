"""The engine under the blocking :class:`~.blocking.Client`: one connection to a server, its
session, the reader thread, the read election, and the path of every request.

A :class:`Connection` is what a client face *holds* (the face adds the op surface of
:mod:`.ops`; the connection sends its :class:`~.ops.Command` objects): tests and other faces
may hold one on their own. Any number of threads may call it at once: each request is added
to the session's table and written whole under a send lock, and a reader thread hands each
reply to the thread waiting for it, so replies may come back in any order. Tensor bytes are
not copied on the way out (``sendmsg`` of the header and the tensor's own memory) and are
read on the way in with ``recv_into`` straight into the buffer the received tensors will
live in.

The connection is elastic: if it drops, the reader thread connects again (with backoff and
jitter), resumes the session and resends what had no reply; the server answers requests it
already ran with the reply it remembered, so nothing is lost or applied twice. Calls made
meanwhile wait for the connection within their own timeout.

Listen callbacks run on a separate dispatcher thread, in the order events arrived, so a slow
callback never delays replies to other requests.

It is a compiled twin (see :mod:`tensorshare._ext`), typed by ``connection.pxd``.
"""

from __future__ import annotations

import array
import builtins
import logging
import os
import queue
import select
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from time import monotonic
from typing import TYPE_CHECKING, Any

from ..errors import (
    ConnectError,
    ConnectionLost,
    ServerError,
    TensorShareError,
    error_from_code,
)
from ..memory.fdpass import ANC_SPACE, MAX_FDS_PER_MESSAGE, fds_of
from ..wire.frames import BytesLike, skip_sent
from ..wire.records import ErrorReply
from .command import Command, gc_paused
from .election import CHECK_BACK, Caller, ReadElection, ReaderDo
from .endpoint import Endpoint
from .facts import Refused, connect_failed, dropped, reconnected, try_again
from .options import ClientOptions
from .session import Call, Done, Drop, Notify, Ready, Send

if TYPE_CHECKING:
    from .pipeline import Pipeline


__all__ = ["Connection", "PendingCall", "outcomes_of"]

log = logging.getLogger("tensorshare.client")

_MAX_IOV = 512  # buffers per sendmsg call; well below IOV_MAX (1024 on Linux)
_PLAIN = socket.socket  # (neither TLS nor a test's wrapper: the one-call send is for it)
_READ_CHUNK = 256 * 1024
# A pipeline's requests go out in writes of at least this many items (see _run_pipeline).
PIPELINE_FLUSH_ITEMS = 10_000

class _Slot:
    """Where the reading thread leaves one reply for the thread waiting on it.

    Its lock is made by the first thread that waits on it (most calls never do: a lone caller
    reads its own reply). ``done`` is set before the lock is looked at and the lock is made
    before ``done`` is looked at again, so a waiter either sees ``done`` or has its lock
    released; should two first waiters race, the loser finds it at its next check (every
    wait is a bounded one, see ``Connection._wait_slot``)."""

    __slots__ = ("_lock", "reply", "error", "done")

    def __init__(self) -> None:
        self._lock: threading.Lock | None = None
        self.reply: Any = None
        self.error: BaseException | None = None
        self.done = False

    def resolve(self, reply: Any, error: BaseException | None = None) -> None:
        """Called exactly once (the session finishes each call once)."""
        self.reply, self.error = reply, error
        self.done = True
        lock = self._lock
        if lock is not None:
            lock.release()

    def wait(self, timeout: float | None) -> bool:
        """Wait until resolved; any number of threads may wait, any number of times."""
        if self.done:
            return True
        lock = self._lock
        if lock is None:
            lock = threading.Lock()
            lock.acquire()
            self._lock = lock
            if self.done:
                return True
        if timeout is None or timeout >= threading.TIMEOUT_MAX:  # "forever", in lock terms
            ok = lock.acquire()
        else:
            ok = lock.acquire(timeout=max(timeout, 0.0))
        if ok:
            lock.release()  # stay "resolved" for every later wait
        return ok or self.done


class _FutureSlot(_Slot):
    """A slot that also completes a ``concurrent.futures.Future`` with the converted result
    (in the thread that read the reply: the future's callbacks run there)."""

    __slots__ = ("future", "call")

    def __init__(self, future: Future[Any]) -> None:
        _Slot.__init__(self)  # (named: a compiled twin's cpdef override has no super() cell)
        self.future = future
        self.call: Call | None = None

    def resolve(self, reply: Any, error: BaseException | None = None) -> None:
        _Slot.resolve(self, reply, error)
        assert self.call is not None
        ok, value = _outcome(self, self.call)
        if self.future.set_running_or_notify_cancel():
            if ok:
                self.future.set_result(value)
            else:
                self.future.set_exception(value)


def _outcome(slot: _Slot, call: Call) -> tuple[bool, Any]:
    """What a resolved call returns: ``(True, result)`` or ``(False, error)``."""
    if slot.error is not None:
        return False, slot.error
    reply = slot.reply
    if type(reply) is ErrorReply:
        return False, error_from_code(reply.code, reply.message)
    try:
        return True, call.convert(reply) if call.convert is not None else reply
    except TensorShareError as exc:  # e.g. a malformed value from a peer
        return False, exc


class PendingCall:
    """A request that was sent (or queued while reconnecting) and whose reply may not have
    arrived yet.

    ``result()`` waits for the reply (up to the client's timeout, plus the wait time of a
    waiting get/peek) and returns what the blocking method would return, or raises its error.
    """

    __slots__ = ("_client", "_call", "_slot", "_outcome")

    def __init__(self, client: Connection | None, call: Call | None, slot: _Slot | None) -> None:
        self._client, self._call, self._slot = client, call, slot
        self._outcome: tuple[bool, Any] | None = None

    @classmethod
    def done(cls, value: Any) -> PendingCall:
        """A call that is already complete with ``value``."""
        call = cls(None, None, None)
        call._outcome = (True, value)
        return call

    def result(self) -> Any:
        """Wait for the reply and return the converted result.

        Raises:
            ReplyTimeout: no reply within the time allowed (a waiting get/peek is cancelled).
            ConnectionLost: no connection to the server within the time allowed.
            SessionLost: the server lost this client's session; the outcome is unknown.
            ServerError and subclasses: the server refused the request.
        """
        if self._outcome is None:
            self._outcome = self._wait()
        ok, value = self._outcome
        if not ok:
            raise value
        return value

    def _wait(self) -> tuple[bool, Any]:
        slot, client, call = self._slot, self._client, self._call
        assert slot is not None and client is not None and call is not None
        if not slot.done:
            client._await(call, slot)
        # (_outcome, inlined for the common case: one call fewer per request)
        if slot.error is None and type(slot.reply) is not ErrorReply:
            try:
                return True, call.convert(slot.reply) if call.convert is not None else slot.reply
            except TensorShareError as exc:  # e.g. a malformed value from a peer
                return False, exc
        return _outcome(slot, call)



class Connection:
    """One connection to a server that rides out drops: its session, the reader thread and
    the read election, and the path of every request (typed for the compiler: a cdef class
    in the compiled twin, see ``connection.pxd``). A face (:class:`~.blocking.Client`) holds
    one and adds the op surface; the connection executes the face's commands.

    Making one starts its reader thread, which connects (and keeps connecting within
    ``options.timeout``); :meth:`wait_connected` waits for the first handshake.

    Args:
        endpoint: where the server is and how to prove who this is (see :mod:`.endpoint`).
        options: the connection's options (``timeout``, ``reconnect``, the session's).
        connector: returns a new connected socket each time it is called, instead of a
            connection to the endpoint's address (custom transports; tests use a socketpair).
    """

    timeout: float
    reconnect: bool | float
    endpoint: Endpoint
    address: str
    host: str | None
    port: int | None
    path: str | None
    _connector: Callable[[], socket.socket] | None
    _options: ClientOptions

    def __init__(self, endpoint: Endpoint, options: ClientOptions,
                 connector: Callable[[], socket.socket] | None = None) -> None:
        self._options = options
        self.timeout, self.reconnect = options.timeout, options.reconnect
        self.endpoint = endpoint
        where = endpoint.address
        self.host, self.port, self.path = where.host, where.port, where.path
        self.address = str(endpoint)
        self._connector = connector
        self._start()
        _CONNECTIONS.add(self)

    def wait_connected(self) -> None:
        """Wait for the first handshake (up to the timeout and 5 s more).

        Raises:
            ConnectError: no server answered within the timeout, or TLS failed.
            ServerError: the server refused the handshake (a typed refusal keeps its type:
                ``AuthenticationError``, ``UnsupportedVersion``, ``LimitExceeded``).
            The connection is closed then.
        """
        if self._ready.wait(self.timeout + 5.0) and self._session.server is not None:
            return
        error = self._session.closed
        self.close()
        if isinstance(error, (ConnectError, ServerError)):  # a typed refusal keeps its type
            raise error
        raise ConnectError(f"cannot connect to tensorshare server at {self.address}: "
                           f"{error or 'no answer'}")

    def _start(self) -> None:
        """Make the session and the threads' state, and start the reader thread (which
        connects). Also run in a forked child, which must not share its parent's socket or
        session."""
        self._pid = os.getpid()
        self._forks = _FORKS  # the process it serves: a fork in the child starts it again
        self._session = self._options.new_session(self.endpoint, "tensorshare-python",
                                                  self._connector is None)
        self._lock = threading.Lock()  # the session, and who reads (below)
        # Waits and wake-ups of who reads, on _lock itself: every "with" takes _lock directly
        # (a Condition's own __enter__ is a Python call on every request).
        self._cv = threading.Condition(self._lock)
        self._send_lock = threading.Lock()  # the socket's write side; taken before _lock
        # Who reads the socket (the reader thread or a lone caller): see .election. Every
        # call to it is made holding _lock; its decisions are carried out by _await, _lead
        # and _serve.
        self._election = ReadElection()
        self._reader: _Reader | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sock: socket.socket | None = None
        self._events: queue.SimpleQueue[tuple[list[Any], dict[str, Any], str] | None] | None = None
        self._dispatcher: threading.Thread | None = None
        self._closing = False
        # A bye is on its way: the server closes the connection once it has answered, and
        # the reader must take that end as the client's, not as a drop to recover from.
        self._leaving = False
        self._ready = threading.Event()
        self._wakeup = threading.Event()  # interrupts the reader's backoff sleep (close)
        self._attempt = 0  # reconnect attempts since the last handshake (for the backoff)
        self._lost_at: float | None = None  # when the current outage began
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"tensorshare-reader-{self.address}")
        self._thread.start()

    def _after_fork(self) -> None:
        """In a forked child (a DataLoader worker that inherited this client): leave the
        parent's connection, threads and session alone and open this process's own, as
        redis-py does. Listen callbacks stay with the parent."""
        sock, wake = self._sock, (self._wake_r, self._wake_w)
        if sock is not None:
            sock.close()  # the child's copy of the descriptor only: no shutdown
        for fd in wake:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        closing = self._closing
        self._start()
        if closing:
            self.close()

    def _execute(self, cmd: Command) -> Any:
        if cmd.kind != "call":
            return self._submit(cmd).result()
        # (a call: _submit and PendingCall.result written out, the path of every request)
        if self._forks != _FORKS:
            raise ConnectionLost(f"the client for {self.address} was made in another process")
        slot = _Slot()
        session = self._session
        with self._send_lock:  # (the call made and sent under one taking of each lock)
            with self._lock:
                now = monotonic()
                call = session.call(cmd.request, cmd.what, now, slot, cmd.convert, None,
                                    cmd.listener)
                # Nobody else waits or reads: this thread sends, then reads its own reply.
                reader = self._reader
                lone = reader is not None and self._election.lone_lead(now, session.connected)
                taken = self._take_sendable(now)
            self._write(taken)
        if lone:
            assert reader is not None
            self._lone(reader, call, slot, now)
        elif not slot.done:
            self._await(call, slot)
        if slot.error is None and type(slot.reply) is not ErrorReply:
            return call.convert(slot.reply) if call.convert is not None else slot.reply
        ok, value = _outcome(slot, call)
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """End the session on the server (``bye``, waiting at most a second for its answer)
        and close the connection. Pending calls fail with ConnectionLost. Idempotent."""
        if self._pid == os.getpid():
            self._goodbye()
        with self._lock:
            self._closing = True
            events = self._session.close(ConnectionLost(f"client for {self.address} was closed"))
            sock = self._sock
        if sock is not None:
            try:  # wakes the reader, and a send blocked in another thread fails now
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._wakeup.set()
        with self._lock:
            self._cv.notify_all()
        self._wake()
        self._process(events)
        if self._thread is not threading.current_thread():
            self._thread.join(5)
        if self._events is not None:
            self._events.put(None)
        if not self._thread.is_alive():
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._wake_r = self._wake_w = -1

    def _goodbye(self) -> None:
        """Send ``bye`` and wait (briefly) for its answer: the server then ends our session at
        once instead of keeping it for its session_ttl (pending calls fail meanwhile)."""
        with self._lock:
            if self._closing:
                return
            call = self._session.goodbye(time.monotonic())
            if call is None:
                return
            slot = _Slot()
            call.token = slot
            self._leaving = True
        self._flush()
        with self._lock:  # (a closed session reconnects no more)
            events = self._session.close(
                ConnectionLost(f"client for {self.address} was closed"), keep=call)
        self._process(events)
        PendingCall(self, call, slot)._wait()

    def _wake(self) -> None:
        """Interrupt the reader thread's poll() (it then checks what changed)."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # full (already woken) or closed
            pass

    def _submit(self, cmd: Command) -> PendingCall:
        """Add one request to the session and send what can be sent now."""
        if self._forks != _FORKS:  # (no system call per request)
            raise ConnectionLost(f"the client for {self.address} was made in another process")
        if cmd.kind == "call":
            with self._lock:
                call, slot = self._call(cmd)
        else:
            entry = cmd.listener
            if cmd.kind == "listen" and not entry[1]:
                self._start_dispatcher()
            name = cmd.bin
            assert name is not None
            with self._lock:
                if cmd.kind == "listen":
                    if not self._session.add_listener(name, entry):
                        return PendingCall.done(None)
                elif not self._session.remove_listener(name):
                    return PendingCall.done(False)
                call, slot = self._call(cmd)
        self._flush()
        return PendingCall(self, call, slot)

    def _submit_future(self, cmd: Command) -> Future[Any]:
        """Send one call and return a future of its result, completed by whichever thread
        reads the reply (no thread waits for it). The call keeps the client's timeout."""
        if self._forks != _FORKS:
            raise ConnectionLost(f"the client for {self.address} was made in another process")
        future: Future[Any] = Future()
        slot = _FutureSlot(future)
        with self._lock:
            slot.call = self._session.call(cmd.request, cmd.what, time.monotonic(), token=slot,
                                           convert=cmd.convert)
        self._flush()
        return future

    def _call(self, cmd: Command) -> tuple[Call, _Slot]:
        slot = _Slot()
        call = self._session.call(cmd.request, cmd.what, time.monotonic(), slot,
                                  cmd.convert, None, cmd.listener)
        return call, slot

    def _run_pipeline(self, pipeline: Pipeline, batch: Iterable[tuple[Command, int]]
                      ) -> builtins.list[Any]:
        """Send the batch's requests as the pipeline makes them, in writes of at least
        :data:`PIPELINE_FLUSH_ITEMS` items (a big batch of appends: the server stores one
        request while the next is encoded), then wait for every reply."""
        if self._forks != _FORKS:
            raise ConnectionLost(f"the client for {self.address} was made in another process")
        calls: builtins.list[PendingCall] = []
        counts: builtins.list[int] = []
        pending = 0
        for cmd, n in batch:
            with self._lock:
                call, slot = self._call(cmd)
            calls.append(PendingCall(self, call, slot))
            counts.append(n)
            pending += n
            if pending >= PIPELINE_FLUSH_ITEMS:
                self._flush()
                pending = 0
        self._flush()
        return pipeline.finish(outcomes_of(calls), counts)

    def _submit_many(self, cmds: Iterable[Command]) -> builtins.list[PendingCall]:
        """Add many calls to the session and send them in one write (a pipeline's batch)."""
        calls = []
        with self._lock:
            for cmd in cmds:
                call, slot = self._call(cmd)
                calls.append(PendingCall(self, call, slot))
        self._flush()
        return calls

    def _flush(self) -> None:
        """Write every request not yet sent on the current connection, in id order."""
        with self._send_lock:
            with self._lock:
                taken = self._take_sendable(monotonic())
            self._write(taken)

    def _take_sendable(self, now: float) -> tuple[Any, Any, Any, Any]:
        """Holding both locks: the socket, the frames to write on it, the shared memory that
        goes with them, and the calls that failed before they could be sent."""
        session = self._session
        sock = self._sock
        chunks = session.pop_sendable(now) if sock is not None else None
        shared = session.take_shared() if session._out_shared else None
        failed = session.take_finished() if session._finished_now else None
        return sock, chunks, shared, failed

    def _write(self, taken: tuple[Any, Any, Any, Any]) -> None:
        """Holding the send lock (only): write what :meth:`_take_sendable` took."""
        sock, chunks, shared, failed = taken
        if failed:
            self._process(failed)
        if not chunks or sock is None:
            return
        try:
            _sendall(sock, chunks, [m.fd for m in shared] if shared else None, self.timeout)
        except OSError as exc:
            # A partly written frame leaves the stream unusable: drop the connection; the
            # reader reconnects and the session resends what had no reply.
            log.debug("send to %s failed: %s", self.address, exc)
            _shutdown(sock)

    def _flush_soon(self) -> None:
        """Flush from another thread: the reader must never block on a send."""
        threading.Thread(target=self._flush, daemon=True,
                         name=f"tensorshare-flush-{self.address}").start()

    def _await(self, call: Call, slot: _Slot) -> None:
        """Wait until ``slot`` is resolved: read the reply ourselves when we are the only
        caller waiting (no thread handoff), else let the reading thread hand it over. Who
        reads is the election's call (see :mod:`.election`); this does what it says."""
        cv, election, session = self._cv, self._election, self._session
        lock = self._lock  # (cv's own lock, taken directly: Condition.__enter__ is Python)
        me = threading.get_ident()
        counted = False
        try:
            while True:
                with lock:
                    if not counted:  # (one lock for both: taken on every request)
                        election.caller_waits()
                        counted = True
                    if slot.done:
                        break
                    turn = election.caller_turn(me, time.monotonic(), session.connected)
                    if turn is Caller.WAKE_AND_WAIT or turn is Caller.WAIT:
                        # We asked the reader thread to step aside: we lead next.
                        if turn is Caller.WAKE_AND_WAIT:
                            self._wake()
                        cv.wait(CHECK_BACK)
                        continue
                if turn is Caller.LEAD:
                    self._lead(call, slot)
                else:
                    self._wait_slot(call, slot)
        finally:
            if counted:
                with lock:
                    if election.caller_done(me):
                        cv.notify_all()  # we had asked the reader to step aside: it may read

    def _wait_slot(self, call: Call, slot: _Slot) -> None:
        """Wait on ``slot`` for a while (another thread reads); expire the call when its
        deadline passed and nobody did yet."""
        deadline = call.deadline
        # Check back now and then: we may be able to read for ourselves later (say, once a
        # reconnect completes, or when the other waiting callers are done).
        wait = CHECK_BACK if deadline is None else \
            min(deadline - time.monotonic() + 0.002, CHECK_BACK)
        if slot.wait(wait):
            return
        if deadline is not None and time.monotonic() >= deadline:
            # Our deadline passed and nobody expired us yet: ask the session ourselves.
            # Exactly one of us finishes the call.
            self._expire(call)

    def _expire(self, call: Call) -> None:
        with self._lock:
            events = self._session.expire(call, time.monotonic())
        self._process(events)
        if events:
            self._flush()  # a cancel for a get we gave up on

    def _process(self, events: Sequence[Any]) -> None:
        """Act on session events (any thread; never holding ``_lock``)."""
        for ev in events:
            cls = type(ev)
            if cls is Done:
                done = ev
                token = done.call.token
                try:
                    if type(token) is _Slot:  # (a blocking call's: resolved at C level)
                        slot = token
                        slot.resolve(done.reply, done.error)
                    elif token is not None:
                        token.resolve(done.reply, done.error)
                except Exception:  # a bug: it must not keep the other calls waiting
                    log.exception("resolving %s failed", done.call.what)
            elif cls is Notify:
                self._notify(ev)

    def _notify(self, ev: Notify) -> None:
        queued = False
        for cb, inline in ev.callbacks:
            if inline:
                _call_listener(cb, ev.event, ev.bin)
            else:
                queued = True
        if queued and self._events is not None:
            self._events.put((ev.callbacks, ev.event, ev.bin))

    def _run(self) -> None:
        session = self._session
        start = time.monotonic()
        try:
            while not self._closing and session.closed is None:
                try:
                    sock = self._connect()
                except (Refused, OSError) as exc:
                    if not try_again(self, exc, start):
                        break
                    continue
                reason = self._serve(sock)
                self._connection_ended(sock, reason)
                if self._closing or self._leaving or session.closed is not None:
                    break
                now = time.monotonic()
                if not dropped(self, session, now - start, now, reason, log):
                    break
                self._sleep(session.backoff(self._attempt))
                self._attempt += 1
        except BaseException:  # never leave callers waiting
            log.exception("tensorshare reader thread for %s failed", self.address)
            self._end(ConnectionLost(f"the reader thread of the client for {self.address} failed"))
        finally:
            self._ready.set()
            if self._events is not None:
                self._events.put(None)

    def _end(self, error: TensorShareError) -> None:
        """Close the session with ``error``: every waiting call gets it."""
        with self._lock:
            events = self._session.close(error)
        self._process(events)

    def _connect_failed(self, exc: OSError, start: float) -> bool:
        """A connection attempt failed: wait before the next one and say True, or end the
        session (see :func:`.facts.connect_failed`) and say False."""
        if not connect_failed(self, self._session, exc, start, time.monotonic(), log):
            return False
        self._sleep(self._session.backoff(self._attempt))
        self._attempt += 1
        return True

    def _connection_ended(self, sock: socket.socket, reason: str) -> None:
        with self._lock:
            while not self._election.end_connection():  # a caller still reads it
                self._cv.wait(1.0)
            self._sock = None
            self._reader = None
            events = self._session.connection_lost(reason, time.monotonic())
        _close_socket(sock)
        self._process(events)

    def _sleep(self, seconds: float) -> None:
        """Wait before the next connection attempt, expiring calls meanwhile."""
        end = time.monotonic() + seconds
        while not self._closing:
            now = time.monotonic()
            with self._lock:
                events = self._session.tick(now)
                nxt = self._session.next_deadline()
            self._process(events)
            if now >= end:
                return
            wake = end if nxt is None else min(end, nxt)
            self._wakeup.wait(max(wake - now, 0.0))

    def _connect(self) -> socket.socket:
        if self._connector is not None:
            sock = self._connector()
        else:
            sock = open_socket(self.endpoint, self.timeout)
        # Non-blocking from here on: reads already wait in poll (Python's own poll before every
        # recv and send on a socket with a timeout would be one more system call each), and
        # _sendall waits for room itself, up to the timeout (a server that stops reading).
        sock.setblocking(False)
        return sock

    def _serve(self, sock: socket.socket) -> str:
        """Handshake, then read (or let a caller read) until the connection ends; return why.

        Who reads the socket: normally this thread. But a caller that is the only one waiting
        for a reply reads it itself (see :meth:`_await`), which saves a thread handoff per
        request; this thread then stays parked (see :mod:`.election`).
        """
        with self._send_lock:
            with self._lock:
                if self._closing:
                    return "closed"
                self._sock = sock
                self._reader = reader = _Reader(sock)
                self._election.connection_made()
                hello = self._session.connection_made(time.monotonic())
            try:
                _sendall(sock, hello, None, self.timeout)
            except OSError as exc:
                return f"handshake failed: {exc}"
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            with self._lock:
                due = self._reader_turn()
            if isinstance(due, str):
                return due
            reason = self._reader_read(poller, reader, due)
            if reason is not None:
                return reason

    def _reader_turn(self) -> float | str:
        """In the reader thread, holding ``_cv``: keep the session's timers, and wait until
        the election says to read. Returns until when to poll, or why the connection ends."""
        session, election, cv = self._session, self._election, self._cv
        while True:
            if self._closing:
                return "closed"
            now = time.monotonic()
            tick = session.tick(now)
            if session.has_sendable:  # a heartbeat, or a cancel for a call given up
                self._flush_soon()
            if tick:
                cv.release()
                try:
                    if self._handle(tick):
                        return self._drop_reason(tick)
                finally:
                    cv.acquire()
                continue
            nxt = session.next_deadline()
            beat = session.heartbeat_due(now) if session.connected else None
            due = min((t for t in (nxt, beat) if t is not None), default=now + 60.0)
            turn = election.reader_turn(now, session.connected)
            if turn.do is ReaderDo.STOP:
                return turn.reason
            if turn.until is not None:  # parked for a linger: it looks again by then anyway
                due = min(due, turn.until)
            else:  # reading, or parked until woken: wake to acknowledge a get's items
                ack = session.ack_due()
                if ack is not None and ack < due:
                    due = ack
            if turn.do is ReaderDo.READ:
                return due
            cv.wait(min(max(due - now, 0.0), 60.0))

    def _reader_read(self, poller: select.poll, reader: _Reader, due: float) -> str | None:
        """In the reader thread, leading: wait in poll() until ``due`` (or data, or a caller
        that wants the lead), read what came, and give the lead back. Returns why the
        connection must end, or ``None``."""
        try:
            ready = poller.poll(min(max((due - time.monotonic()) * 1000.0, 1.0), 60e3))
        finally:
            with self._lock:
                self._election.poll_returned()
        reason: str | None = None
        try:
            if any(fd == self._wake_r for fd, _ in ready):
                _drain(self._wake_r)
            if any(fd != self._wake_r for fd, _ in ready):
                reason = self._read_once(reader, monotonic())
        finally:
            with self._lock:
                self._election.reader_done()  # a caller that asked us to step aside leads next
                self._cv.notify_all()
        return reason

    def _read_once(self, reader: _Reader, now: float) -> str | None:
        """One ``recv`` from the current socket and everything it completes, handled: the
        whole frames of the common replies read, matched to their calls and resolved in one
        pass, under one taking of the lock (``now``: the time, read after poll returned).

        Called by whoever leads (see :mod:`.election`). Returns why the connection must end, or
        ``None``.
        """
        session = self._session
        fds: list[int] = []
        try:
            direct = session.get_buffer()
            target = direct if direct is not None else reader.scratch
            if reader.is_unix:
                n, ancdata, _, _ = reader.sock.recvmsg_into([target], ANC_SPACE)
                if ancdata:
                    fds = fds_of(ancdata)
            elif reader.tls:
                n = _tls_recv_into(reader.sock, target)
            else:
                n = reader.sock.recv_into(target)
        except (BlockingIOError, InterruptedError, TimeoutError, ssl.SSLWantReadError,
                ssl.SSLWantWriteError):
            return None
        except OSError as exc:
            return str(exc) or type(exc).__name__
        if not n:
            for fd in fds:
                os.close(fd)
            return "the server closed the connection"
        with self._lock:
            if fds:
                if session.conn is not None and session.conn.shm:
                    session.conn.add_fds(fds)
                else:
                    for fd in fds:  # not agreed: nobody will take them
                        os.close(fd)
            if direct is not None:
                # The end of a large message may complete thousands of items at once.
                with gc_paused(len(direct) if n == len(direct) else 0):
                    events = session.buffer_updated(n, now)
            else:
                events = session.receive_read(reader.scratch, reader.view, n, now)
            nxt = session.next_deadline()
            ticked = nxt is not None and nxt <= now
            if ticked:
                events.extend(session.tick(now))
                ticked = session.has_sendable
        if self._handle(events):
            return self._drop_reason(events)
        if ticked:
            self._flush_soon()
        sock = reader.sock  # (TLS may hold bytes it decrypted, which poll() cannot see)
        if reader.tls and isinstance(sock, ssl.SSLSocket) and sock.pending():
            return self._read_once(reader, monotonic())
        return None

    def _lone(self, reader: _Reader, call: Call, slot: _Slot, now: float) -> None:
        """Lead as the lone caller (see ``ReadElection.lone_lead``): read until ``slot`` is
        resolved or the call's deadline passes, give the lead back, and wait the usual way
        if the reply is not in (the connection dropped: it comes after the reconnect)."""
        reason: str | None = None
        try:
            reason = self._lead_read(reader, call, slot, now)
        finally:
            with self._lock:
                if self._election.lone_done(monotonic(), reason):
                    self._cv.notify_all()
        if not slot.done:
            self._await(call, slot)

    def _lead(self, call: Call, slot: _Slot) -> None:
        """Read the socket in this (calling) thread until ``slot`` is resolved or the call's
        deadline passes; then give the lead back (and wake the reader thread if the
        election says so)."""
        reason: str | None = None
        try:
            reader = self._reader
            if reader is not None:
                reason = self._lead_read(reader, call, slot, monotonic())
        finally:
            with self._lock:
                if self._election.lead_ended(time.monotonic(), reason):
                    self._cv.notify_all()

    def _lead_read(self, reader: _Reader, call: Call, slot: _Slot, now: float) -> str | None:
        """Leading: read until ``slot`` is resolved or the call's deadline passes (``now``:
        the time, just read). Returns why the connection must end, or ``None``."""
        poll = reader.poll
        while not slot.done:
            deadline = call.deadline
            if deadline is not None and now >= deadline:
                self._expire(call)
                if slot.done:
                    return None
                deadline = call.deadline
            wait = 60.0 if deadline is None else min(max(deadline - now, 0.0) + 0.001, 60.0)
            ready = poll.poll(wait * 1000.0)
            now = monotonic()
            if not ready:
                continue
            reason = self._read_once(reader, now)
            if reason is not None:
                return reason
        return None

    def _handle(self, events: builtins.list[Any]) -> bool:
        """Act on events from the reader thread; return whether the connection must go."""
        drop = False
        for ev in events:
            cls = type(ev)
            if cls is Ready:
                self._ready_event(ev)
            elif cls is Drop:
                drop = True
            elif cls is Send:  # the next step of the handshake (only the reader reads then)
                with self._send_lock:
                    sock = self._sock
                    if sock is not None:
                        try:
                            _sendall(sock, ev.chunks, None, self.timeout)
                        except OSError:
                            drop = True
        self._process(events)
        return drop

    @staticmethod
    def _drop_reason(events: builtins.list[Any]) -> str:
        return next(ev.reason for ev in events if type(ev) is Drop)

    def _ready_event(self, ev: Ready) -> None:
        self._attempt = 0
        if ev.first:
            self._ready.set()
        else:
            reconnected(self, ev, time.monotonic(), log)
        self._flush_soon()

    def _start_dispatcher(self) -> None:
        with self._lock:
            if self._dispatcher is not None:
                return
            self._events = queue.SimpleQueue()
            self._dispatcher = threading.Thread(target=self._dispatch_loop, daemon=True,
                                                name=f"tensorshare-events-{self.address}")
            self._dispatcher.start()

    def _dispatch_loop(self) -> None:
        assert self._events is not None
        while True:
            entry = self._events.get()
            if entry is None:
                return
            callbacks, event, name = entry
            for cb, inline in callbacks:
                if not inline:
                    _call_listener(cb, event, name)


def outcomes_of(calls: Sequence[PendingCall]) -> list[Any]:
    """Each call's result, or the error it raised (a pipeline's outcomes)."""
    outcomes: list[Any] = []
    for pending in calls:
        try:
            outcomes.append(pending.result())
        except TensorShareError as exc:
            outcomes.append(exc)
    return outcomes



# Every live connection, so that a forked child can give each client its own.
_CONNECTIONS: weakref.WeakSet[Connection] = weakref.WeakSet()
# Forks this process went through: a connection made before the last one and not started again
# in this process refuses calls (see Connection._submit).
_FORKS = 0


def _after_fork_in_child() -> None:
    global _FORKS
    _FORKS += 1
    for conn in list(_CONNECTIONS):
        conn._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _call_listener(callback: Callable[[dict[str, Any]], Any], event: dict[str, Any],
                   name: str) -> None:
    try:
        callback(dict(event))  # a copy each: one callback cannot change what another sees
    except Exception:
        log.exception("listen callback for bin %r raised", name)


class _Reader:
    """What reading one connection needs: its socket, a poll object and a scratch buffer.

    Only the thread that leads (see ``Connection._serve``) uses it, so one is enough.
    """

    __slots__ = ("sock", "poll", "scratch", "view", "is_unix", "tls")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.is_unix = sock.family == socket.AF_UNIX
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.poll = select.poll()
        self.poll.register(sock, select.POLLIN)
        self.scratch = bytearray(_READ_CHUNK)
        self.view = memoryview(self.scratch)



def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass


def _sendall(sock: socket.socket, chunks: Sequence[BytesLike], fds: list[int] | None = None,
             timeout: float | None = None) -> None:
    """Send every chunk on a non-blocking socket, waiting up to ``timeout`` seconds each time
    it is full; ``fds`` (a Unix socket) go along, at most ``MAX_FDS_PER_MESSAGE`` per
    ``sendmsg``.

    Raises:
        TimeoutError: the socket stayed full for ``timeout`` seconds (the peer stopped reading).
        OSError: the send failed.
    """
    sent = 0
    if not fds and type(sock) is _PLAIN and len(chunks) <= _MAX_IOV:
        # The usual case: the socket takes the whole frame in one call (no views, no loop).
        try:
            sent = sock.sendmsg(chunks)
        except (BlockingIOError, InterruptedError):
            sent = 0
        total = 0
        for c in chunks:
            total += len(c)
        if sent == total:
            return
    views = [c if isinstance(c, memoryview) else memoryview(c) for c in chunks]
    i = skip_sent(views, 0, sent)
    pending = list(fds) if fds else []
    poller = None
    tls = isinstance(sock, ssl.SSLSocket)
    while i < len(views):
        try:
            if tls:  # no scatter/gather through TLS: one chunk at a time
                sent = sock.send(views[i])
            elif pending:
                # At most MAX_FDS_PER_MESSAGE with one message; while more wait, a message
                # carries one byte, so none is left behind when the data runs out.
                now = pending[:MAX_FDS_PER_MESSAGE]
                data = views[i : i + _MAX_IOV] if len(pending) == len(now) else [views[i][:1]]
                sent = sock.sendmsg(data, [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                            array.array("i", now).tobytes())])
                pending = pending[len(now):]
            else:
                sent = sock.sendmsg(views[i : i + _MAX_IOV])
        except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError,
                ssl.SSLWantReadError):
            if poller is None:
                poller = select.poll()
                poller.register(sock, select.POLLOUT)
            if not poller.poll(None if timeout is None else timeout * 1000.0):
                raise TimeoutError(f"the server did not read for {timeout:g} s") from None
            continue
        i = skip_sent(views, i, sent)


def _tls_recv_into(sock: socket.socket, target: memoryview | bytearray) -> int:
    """Decrypt into ``target`` until it is full or nothing more has arrived: one TLS record
    per ``recv_into`` otherwise (16 KiB), each a trip through Python.

    Raises:
        ssl.SSLWantReadError: nothing at all had arrived.
    """
    view = memoryview(target)
    n = 0
    while n < len(view):
        try:
            got = sock.recv_into(view[n:])
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            if n:
                break
            raise
        if not got:
            break
        n += got
    return n


def open_socket(endpoint: Endpoint, timeout: float) -> socket.socket:
    """A socket connected to ``endpoint`` (TCP, TLS over TCP, or a Unix socket), in blocking
    mode with ``timeout``."""
    a = endpoint.address
    if a.path is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(a.path)
        except BaseException:
            sock.close()
            raise
        return sock
    sock = socket.create_connection((a.host, a.port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if endpoint.tls:
        sock = _tls(sock, endpoint, str(endpoint))
    return sock


def _tls(sock: socket.socket, endpoint: Endpoint, address: str) -> socket.socket:
    """Wrap a connected socket in TLS (the handshake within the socket's timeout), checking
    the server's certificate against the endpoint's CA and its host name.

    Raises:
        Refused: the certificate check failed, or the server does not speak TLS.
        OSError: the connection dropped or timed out (a blip: retried).
    """
    ctx = ssl.create_default_context(cafile=endpoint.tls_ca)
    try:
        return ctx.wrap_socket(sock, server_hostname=endpoint.address.host)
    except ssl.SSLCertVerificationError as exc:
        sock.close()
        ca = endpoint.tls_ca or "the system's"
        raise Refused(ConnectError(
            f"TLS with tensorshare server at {address} failed: its certificate does not "
            f"check out ({exc.verify_message}; CA: {ca}): give the CA that signed it with "
            f"tls_ca= or TENSORSHARE_TLS_CA, and connect by a name the certificate holds")) \
            from None
    except ssl.SSLError as exc:
        sock.close()
        raise Refused(ConnectError(
            f"TLS with tensorshare server at {address} failed ({exc.reason or exc}): is the "
            f"server started with --tls-cert? (a plain server: connect with "
            f"tensorshare://)")) from None
    except BaseException:
        sock.close()
        raise


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _close_socket(sock: socket.socket) -> None:
    _shutdown(sock)
    sock.close()
