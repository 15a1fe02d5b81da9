"""The blocking, thread-safe client. Plain sockets and the sans-I/O protocol; no Twisted.

One TCP connection per client. Any number of threads may call it at once: each request gets an
id, its frame is written whole under a send lock, and a reader thread hands each reply to the
thread waiting for it, so replies may come back in any order. Tensor bytes are not copied on
the way out (``sendmsg`` of the header and the tensor's own memory) and are read on the way in
with ``recv_into`` straight into the buffer the received tensors will live in.

Listen callbacks run on a separate dispatcher thread, in the order events arrived, so a slow
callback never delays replies to other requests.
"""

from __future__ import annotations

import logging
import math
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .codec import decode, encode
from .errors import (
    ConnectError,
    ConnectionLost,
    ProtocolError,
    TensorShareError,
    Timeout,
    TransportError,
    error_from_code,
)
from .frames import BytesLike
from .messages import (
    Append,
    Cancel,
    Changed,
    Delete,
    ErrorReply,
    Fetched,
    Get,
    Hello,
    HelloReply,
    Item,
    Limits,
    ListBins,
    Listen,
    Message,
    Peek,
    Ping,
    Put,
    Unlisten,
)
from .protocol import CLIENT, PROTOCOL_VERSIONS, Connection, ProtocolViolation, check_bin_name

__all__ = ["NOWAIT", "Client", "FetchResult", "PendingCall"]

log = logging.getLogger("tensorshare.client")


class _NoWait:
    """Sentinel: do not wait for data (the default of get/peek)."""

    def __repr__(self) -> str:
        return "NOWAIT"


NOWAIT: Any = _NoWait()
_MAX_IOV = 512  # buffers per sendmsg call; well below IOV_MAX (1024 on Linux)
_READ_CHUNK = 256 * 1024


@dataclass(frozen=True, slots=True)
class FetchResult:
    """What :meth:`Client.fetch` returns.

    Attributes:
        value: the value of a put bin, or the list of items of an appended bin;
            ``None`` when ``unchanged``.
        kind: ``"value"`` or ``"list"``.
        tags: the items' tags (``None`` for untagged items), oldest first.
        version: the bin's version after the operation.
        n_items: items left in the bin.
        dropped: items dropped (get) or skipped (peek) for being tagged below ``min_tag``.
        unchanged: ``newer_than`` was given and the bin was not newer.
    """

    value: Any
    kind: str
    tags: tuple[int | None, ...]
    version: int
    n_items: int
    dropped: int = 0
    unchanged: bool = False


class _Slot:
    """Where the reader thread leaves one reply for the thread waiting on it."""

    __slots__ = ("_lock", "reply", "error", "what")

    def __init__(self, what: str) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self.reply: Message | None = None
        self.error: BaseException | None = None
        self.what = what  # e.g. "get on bin 'x'", for error messages

    def resolve(self, reply: Message | None, error: BaseException | None = None) -> None:
        """Called exactly once, by whoever popped the slot from the pending table."""
        self.reply, self.error = reply, error
        self._lock.release()

    def wait(self, timeout: float | None) -> bool:
        """Wait until resolved; any number of threads may wait, any number of times."""
        if timeout is None or timeout >= threading.TIMEOUT_MAX:  # "forever", in lock terms
            ok = self._lock.acquire()
        else:
            ok = self._lock.acquire(timeout=max(timeout, 0.0))
        if ok:
            self._lock.release()  # stay "resolved" for every later wait
        return ok


class PendingCall:
    """A request that was sent and whose reply may not have arrived yet.

    ``result()`` waits for the reply (up to the client's timeout, plus the wait time of a
    waiting get/peek) and returns what the blocking method would return, or raises its error.
    """

    __slots__ = ("_client", "_rid", "_slot", "_convert", "_timeout", "_cancel", "_outcome")

    def __init__(self, client: Client | None, rid: int, slot: _Slot | None,
                 convert: Callable[[Any], Any], timeout: float | None,
                 cancel_on_timeout: bool) -> None:
        self._client, self._rid, self._slot = client, rid, slot
        self._convert, self._timeout, self._cancel = convert, timeout, cancel_on_timeout
        self._outcome: tuple[bool, Any] | None = None

    @classmethod
    def done(cls, value: Any) -> PendingCall:
        """A call that is already complete with ``value``."""
        call = cls(None, 0, None, _same, None, False)
        call._outcome = (True, value)
        return call

    def result(self) -> Any:
        """Wait for the reply and return the converted result.

        Raises:
            Timeout: no reply within the time allowed (a waiting get/peek is cancelled).
            ConnectionLost: the connection dropped before the reply.
            ServerError and subclasses: the server refused the request.
        """
        if self._outcome is None:
            self._outcome = self._wait()
        ok, value = self._outcome
        if not ok:
            raise value
        return value

    def _wait(self) -> tuple[bool, Any]:
        slot, client = self._slot, self._client
        assert slot is not None and client is not None
        wait = self._timeout
        while not slot.wait(wait):
            assert self._timeout is not None
            idle = time.monotonic() - client._last_rx
            if client._conn.receiving and idle < self._timeout:
                # A frame is streaming in (maybe this reply, maybe one queued before it):
                # the timeout is about silence, so keep waiting while bytes keep coming.
                wait = self._timeout - idle
                continue
            if client._pending.pop(self._rid, None) is not None:
                client._conn.forget(self._rid)
                if self._cancel:
                    client._cancel_quietly(self._rid)
                return False, Timeout(f"no reply from tensorshare server at {client.address} "
                                      f"to {slot.what} within {self._timeout:g} s")
            slot.wait(None)  # whoever popped it resolves it now
            break
        if slot.error is not None:
            return False, slot.error
        reply = slot.reply
        if isinstance(reply, ErrorReply):
            return False, error_from_code(reply.code, reply.message)
        try:
            return True, self._convert(reply)
        except TensorShareError as exc:  # e.g. a malformed value from a peer
            return False, exc


def _same(reply: Any) -> Any:
    return reply


def _none(reply: Any) -> None:
    return None


def _version(reply: Any) -> int:
    return int(reply.version)


def _make_item(name: str, value: Any, tag: int | None, limits: Limits, compress: str | None,
               compress_min_bytes: int) -> Item:
    """Check a put/append locally and encode its value (raises before anything is sent)."""
    check_bin_name(name, limits.max_name_bytes)
    if tag is not None and (not isinstance(tag, int) or isinstance(tag, bool)):
        raise TypeError(f"tag must be an int or None, not {type(tag).__name__}")
    enc = encode(value, compress=compress, compress_min_bytes=compress_min_bytes,
                 max_depth=limits.max_depth)
    return Item(enc, tag)


@dataclass(frozen=True, slots=True)
class _FetchRequest:
    """A checked get/peek, ready for either client to send."""

    build: Callable[[int], Message]
    what: str
    convert: Callable[[Any], Any]
    reply_timeout: float | None
    wait: bool


def _fetch_request(name: str, *, remove: bool, max_items: int | None, timeout: Any,
                   min_tag: int | None, newer_than: int | None, min_items: int,
                   limits: Limits, answer_timeout: float) -> _FetchRequest:
    """Check a get/peek locally and say how to send it and how long to wait for its reply."""
    wait = timeout is not NOWAIT
    if wait and timeout is not None and not 0 <= timeout < math.inf:
        raise ValueError(f"timeout must be a finite number >= 0, or None; got {timeout!r}")
    check_bin_name(name, limits.max_name_bytes)
    cls = Get if remove else Peek
    wait_for = timeout if wait else None
    max_depth = limits.max_depth
    return _FetchRequest(
        lambda rid: cls(rid, name, max_items, wait, wait_for, min_tag, newer_than, min_items),
        f"{'get' if remove else 'peek'} on bin {name!r}",
        lambda reply: _fetch_result(reply, max_depth),
        # The server times a waiting fetch; the client allows its usual answer time on top.
        None if (wait and timeout is None) else answer_timeout + (timeout if wait else 0),
        wait)


def _event(msg: Changed) -> dict[str, Any]:
    """A change notification as listen callbacks get it."""
    return {"status": "OK", "bin": msg.bin, "op": msg.op, "n_items": msg.n_items,
            "version": msg.version}


def _fetch_result(reply: Fetched, max_depth: int) -> FetchResult:
    if reply.unchanged:
        return FetchResult(None, reply.kind, (), reply.version, reply.n_items, reply.dropped, True)
    values = [decode(it.value, max_depth=max_depth) for it in reply.items]
    value = values[0] if reply.kind == "value" else values
    return FetchResult(value, reply.kind, tuple(it.tag for it in reply.items), reply.version,
                       reply.n_items, reply.dropped)


class Client:
    """A blocking, thread-safe connection to a tensorshare server.

    Args:
        host: server address. port: server port.
        timeout: seconds to wait for the server to answer a request (and to connect).
            A get/peek that waits for data gets its own wait time on top of this.
        compress: ``"lz4"`` to compress large tensor buffers before sending, or ``None``.
        compress_min_bytes: buffers smaller than this are never compressed.
        name: how this client introduces itself in the server's log.

    Raises:
        ConnectError: the server cannot be reached or the handshake failed, within ``timeout``.

    Example::

        with Client("127.0.0.1", 8000) as c:
            c.put("weights", {"w": torch.randn(3, 3)})
            print(c.peek("weights"))
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 8000, timeout: float = 30.0, *,
                 compress: str | None = None, compress_min_bytes: int = 64 * 1024,
                 name: str = "tensorshare-python") -> None:
        if compress not in (None, "lz4"):
            raise ValueError(f"compress must be None or 'lz4', not {compress!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
                not 0 < timeout < math.inf:
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        self.host, self.port, self.timeout = host, port, timeout
        self.compress, self.compress_min_bytes = compress, compress_min_bytes
        self.address = f"{host}:{port}"
        self._conn = Connection(CLIENT)
        self._send_lock = threading.Lock()
        self._pending: dict[int, _Slot] = {}
        # bin -> [(callback, inline)]; inline callbacks run on the reader thread (see begin_listen)
        self._listeners: dict[str, list[tuple[Callable[[dict[str, Any]], Any], bool]]] = {}
        self._listen_lock = threading.Lock()  # the callback table (the reader reads it)
        # Orders listen/unlisten table changes with their requests, so that the server's view
        # and ours agree when threads race; never held by the reader thread.
        self._subscribe_lock = threading.Lock()
        self._events: queue.SimpleQueue[tuple[str, dict[str, Any]] | None] | None = None
        self._dispatcher: threading.Thread | None = None
        self._lost: TransportError | None = None
        self._server_said: str | None = None
        self._closing = False
        self._last_rx = time.monotonic()  # when the reader last got bytes (see PendingCall)
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise ConnectError(
                f"cannot connect to tensorshare server at {self.address}: {exc}") from exc
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # The timeout bounds sends (a server that stops reading); the reader retries on it.
        self._sock.settimeout(timeout)
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"tensorshare-reader-{self.address}")
        self._reader.start()
        try:
            reply = self._begin(lambda rid: Hello(rid, PROTOCOL_VERSIONS, name), "handshake",
                                _same).result()
        except TensorShareError as exc:
            self.close()
            raise ConnectError(f"handshake with {self.address} failed: {exc}") from exc
        assert isinstance(reply, HelloReply)
        self.server_version: str = reply.server
        self.protocol_version: int = reply.version
        self.limits: Limits = reply.limits
        self._conn.set_limits(reply.limits)

    # -- public API ---------------------------------------------------------------------------
    def put(self, name: str, value: Any, *, tag: int | None = None) -> int:
        """Store ``value`` in bin ``name``, replacing whatever it held.

        Args:
            name: the bin (any non-empty str up to the server's name limit).
            value: tensors, numpy arrays, and dict/list/tuple/str/bytes/int/float/bool/None.
            tag: optional integer stored with the item (see ``min_tag`` in :meth:`fetch`).

        Returns:
            The bin's new version; the server holds the value when this returns.

        Raises:
            UnsupportedType: ``value`` holds a type that cannot be sent (nothing was sent).
            MemoryLimitExceeded: the server's memory limit would be exceeded.
            LimitExceeded: the value is larger than the server's frame limit.
            Timeout, ConnectionLost: no confirmation from the server.
        """
        return self.begin_put(name, value, tag=tag).result()  # type: ignore[no-any-return]

    def append(self, name: str, value: Any, *, tag: int | None = None) -> int:
        """Append ``value`` as one item to bin ``name`` (a list is one item, never flattened).

        Appending to a bin that holds a put value turns it into ``[value, new]``.

        Returns:
            The bin's new version. Raises: as :meth:`put`.
        """
        return self.begin_append(name, value, tag=tag).result()  # type: ignore[no-any-return]

    def get(self, name: str, *, max_items: int | None = None, timeout: Any = NOWAIT) -> Any:
        """Return the content of bin ``name`` and remove it.

        Args:
            name: the bin.
            max_items: for an appended bin, take at most this many items from the front
                (FIFO) and leave the rest.
            timeout: by default, do not wait. A number: wait up to that many seconds for
                data. ``None``: wait without limit (a lost connection still ends the wait).

        Returns:
            The value of a put bin, or the list of items of an appended bin.

        Raises:
            BinNotFound: the bin is missing or empty (when not waiting).
            Timeout: no data arrived within ``timeout``.
        """
        return self.fetch(name, remove=True, max_items=max_items, timeout=timeout).value

    def peek(self, name: str, *, max_items: int | None = None, timeout: Any = NOWAIT) -> Any:
        """Like :meth:`get`, but leave the content in the bin."""
        return self.fetch(name, remove=False, max_items=max_items, timeout=timeout).value

    def fetch(self, name: str, *, remove: bool, max_items: int | None = None,
              timeout: Any = NOWAIT, min_tag: int | None = None,
              newer_than: int | None = None, min_items: int = 1) -> FetchResult:
        """The full form of get (``remove=True``) and peek (``remove=False``).

        Args:
            min_tag: skip items tagged below this (and untagged ones); a get also removes
                them from the bin. How many is reported in ``dropped``.
            newer_than: only a bin whose version is above this counts. Without waiting, an
                older bin gives ``unchanged=True`` and no data (nothing is downloaded); when
                waiting, the call returns once the bin is newer.
            min_items: when waiting, wait until at least this many items are available.
            (others as :meth:`get`)

        Returns:
            A :class:`FetchResult`.
        """
        return self.begin_fetch(  # type: ignore[no-any-return]
            name, remove=remove, max_items=max_items, timeout=timeout, min_tag=min_tag,
            newer_than=newer_than, min_items=min_items).result()

    def list(self) -> dict[str, int]:
        """Return ``{bin: n_items}`` for every non-empty bin (1 for a put bin)."""
        return self.begin_list().result()  # type: ignore[no-any-return]

    def delete(self, name: str) -> bool:
        """Delete bin ``name``. Returns whether it existed."""
        return self.begin_delete(name).result()  # type: ignore[no-any-return]

    def listen(self, name: str, callback: Callable[[dict[str, Any]], Any]) -> None:
        """Call ``callback(event)`` on every change of bin ``name``.

        ``event`` is a dict: ``{'status': 'OK', 'bin': name, 'op': 'put'|'append'|'get'|
        'delete', 'n_items': n, 'version': v}``. Callbacks run on this client's dispatcher
        thread, one at a time, in the order the changes happened; a slow callback delays later
        events, never replies. Returns once the server has registered the listener.
        """
        try:
            self.begin_listen(name, callback).result()
        except BaseException:
            with self._listen_lock:  # not registered on the server: forget it here too
                callbacks = self._listeners.get(name, [])
                callbacks[:] = [entry for entry in callbacks if entry[0] is not callback]
                if not callbacks:
                    self._listeners.pop(name, None)
            raise

    def unlisten(self, name: str) -> bool:
        """Stop listening to bin ``name``. Returns whether this client was listening."""
        return self.begin_unlisten(name).result()  # type: ignore[no-any-return]

    def ping(self) -> None:
        """Round-trip to the server (raises if it does not answer within ``timeout``)."""
        self._begin(Ping, "ping", _none).result()

    # -- non-blocking halves: send now, collect the result later -----------------------------
    def begin_put(self, name: str, value: Any, *, tag: int | None = None) -> PendingCall:
        """Send a put now; ``.result()`` of the returned call gives what :meth:`put` returns.

        Local mistakes (a bad name, an unsupported type) raise here, before anything is sent.
        """
        item = self._item(name, value, tag)
        return self._begin(lambda rid: Put(rid, name, item), f"put to bin {name!r}", _version)

    def begin_append(self, name: str, value: Any, *, tag: int | None = None) -> PendingCall:
        """Send an append now (see :meth:`begin_put`)."""
        item = self._item(name, value, tag)
        return self._begin(lambda rid: Append(rid, name, item), f"append to bin {name!r}",
                           _version)

    def begin_fetch(self, name: str, *, remove: bool, max_items: int | None = None,
                    timeout: Any = NOWAIT, min_tag: int | None = None,
                    newer_than: int | None = None, min_items: int = 1) -> PendingCall:
        """Send a get/peek now; ``.result()`` gives the :class:`FetchResult`."""
        req = _fetch_request(name, remove=remove, max_items=max_items, timeout=timeout,
                             min_tag=min_tag, newer_than=newer_than, min_items=min_items,
                             limits=self._conn.limits, answer_timeout=self.timeout)
        return self._begin(req.build, req.what, req.convert, req.reply_timeout,
                           cancel_on_timeout=req.wait)

    def begin_list(self) -> PendingCall:
        """Send a list request now."""
        return self._begin(ListBins, "list", lambda r: dict(r.bins))

    def begin_delete(self, name: str) -> PendingCall:
        """Send a delete now."""
        self._check_name(name)
        return self._begin(lambda rid: Delete(rid, name), f"delete of bin {name!r}",
                           lambda r: r.existed)

    def begin_listen(self, name: str, callback: Callable[[dict[str, Any]], Any], *,
                     inline: bool = False) -> PendingCall:
        """Register ``callback`` and send the listen request now (see :meth:`listen`).

        Args:
            inline: run ``callback`` on the reader thread, before any reply that arrives
                after the event is handed over. Only for callbacks that return at once (e.g.
                put the event on a queue): a slow inline callback stalls every reply.
        """
        self._check_name(name)
        if not inline:
            self._start_dispatcher()
        with self._subscribe_lock:
            with self._listen_lock:
                first = name not in self._listeners
                self._listeners.setdefault(name, []).append((callback, inline))
            if not first:
                return PendingCall.done(None)
            return self._begin(lambda rid: Listen(rid, name), f"listen to bin {name!r}", _none)

    def begin_unlisten(self, name: str) -> PendingCall:
        """Drop this bin's listen callbacks and tell the server (see :meth:`unlisten`)."""
        self._check_name(name)
        with self._subscribe_lock:
            with self._listen_lock:
                was = self._listeners.pop(name, None) is not None
            if not was:
                return PendingCall.done(False)
            return self._begin(lambda rid: Unlisten(rid, name), f"unlisten from bin {name!r}",
                               lambda r: True)

    @property
    def closed(self) -> bool:
        """Whether the connection is closed or lost."""
        return self._lost is not None

    def close(self) -> None:
        """Close the connection. Pending calls fail with ConnectionLost. Idempotent."""
        self._closing = True
        try:  # first, so that a send blocked in another thread fails now and frees the lock
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._fail_all(ConnectionLost(f"client for {self.address} was closed"))
        self._sock.close()
        if self._reader is not threading.current_thread():
            self._reader.join(5)
        if self._events is not None:
            self._events.put(None)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<tensorshare.Client {self.address} {state}>"

    # -- requests -----------------------------------------------------------------------------
    def _check_name(self, name: str) -> None:
        check_bin_name(name, self._conn.limits.max_name_bytes)

    def _item(self, name: str, value: Any, tag: int | None) -> Item:
        return _make_item(name, value, tag, self._conn.limits, self.compress,
                          self.compress_min_bytes)

    def _begin(self, build: Callable[[int], Message], what: str,
               convert: Callable[[Any], Any], timeout: Any = NOWAIT, *,
               cancel_on_timeout: bool = False) -> PendingCall:
        """Send one request now; return the call that will hold its reply."""
        slot = _Slot(what)
        with self._send_lock:
            if self._lost is not None:
                raise type(self._lost)(f"cannot send {what}: {self._lost}")
            rid = self._conn.next_id()
            chunks = self._conn.send(build(rid))  # raises LimitExceeded before anything is sent
            self._pending[rid] = slot
            try:
                self._sendall(chunks)
            except OSError as exc:
                # A partly written frame leaves the stream unusable: drop the connection.
                err = ConnectionLost(f"connection to {self.address} failed while sending "
                                     f"{what}: {exc}")
                self._fail_all(err, locked=True)
                raise err from exc
        return PendingCall(self, rid, slot, convert,
                           self.timeout if timeout is NOWAIT else timeout, cancel_on_timeout)

    def _cancel_quietly(self, target: int) -> None:
        try:
            self._begin(lambda rid: Cancel(rid, target), "cancel", _none)
        except TensorShareError:
            pass

    def _sendall(self, chunks: Sequence[BytesLike]) -> None:
        views = [c if isinstance(c, memoryview) else memoryview(c) for c in chunks]
        i = 0
        sock = self._sock
        while i < len(views):
            sent = sock.sendmsg(views[i : i + _MAX_IOV])
            while sent:
                n = views[i].nbytes
                if sent >= n:
                    sent -= n
                    i += 1
                else:
                    views[i] = views[i][sent:]
                    sent = 0
            while i < len(views) and views[i].nbytes == 0:
                i += 1

    # -- reader thread ------------------------------------------------------------------------
    def _read_loop(self) -> None:
        conn, sock = self._conn, self._sock
        scratch = bytearray(_READ_CHUNK)
        view = memoryview(scratch)
        reason = "the server closed the connection"
        try:
            while True:
                direct = conn.get_buffer()
                try:
                    if direct is not None:
                        n = sock.recv_into(direct)
                        self._last_rx = time.monotonic()
                        msgs = conn.buffer_updated(n) if n else None
                    else:
                        n = sock.recv_into(scratch)
                        self._last_rx = time.monotonic()
                        msgs = conn.receive_data(view[:n]) if n else None
                except TimeoutError:
                    continue  # idle connection: the timeout is for sends
                if msgs is None:
                    break
                for msg in msgs:
                    if type(msg) is ProtocolViolation:
                        raise ProtocolError(msg.message)
                    self._on_message(msg)  # type: ignore[arg-type]  # no BadRequest client-side
        except ProtocolError as exc:
            reason = f"protocol error: {exc}"
        except OSError as exc:
            reason = str(exc) or type(exc).__name__
        except BaseException as exc:  # e.g. MemoryError: never leave callers waiting
            reason = f"the reader thread failed: {exc!r}"
            log.exception("tensorshare reader thread for %s failed", self.address)
        if self._server_said:
            reason = f"{reason}; the server said: {self._server_said}"
        if not self._closing:
            # Loud only if it cost a call; pending calls raise ConnectionLost in any case.
            level = logging.WARNING if self._pending else logging.INFO
            log.log(level, "connection to tensorshare server at %s lost: %s", self.address, reason)
        self._fail_all(ConnectionLost(f"connection to tensorshare server at {self.address} "
                                      f"lost: {reason}"))
        if self._events is not None:
            self._events.put(None)

    def _on_message(self, msg: Message) -> None:
        if isinstance(msg, Changed):
            event = _event(msg)
            with self._listen_lock:
                listeners = list(self._listeners.get(msg.bin, ()))
            for cb, inline in listeners:
                if inline:
                    _call_listener(cb, event, msg.bin)
            if self._events is not None and any(not inline for _, inline in listeners):
                self._events.put((msg.bin, event))
            return
        rid = getattr(msg, "id", 0)
        if rid == 0 and isinstance(msg, ErrorReply):
            self._server_said = f"{msg.message} ({msg.code})"
            return
        slot = self._pending.pop(rid, None)
        if slot is not None:
            slot.resolve(msg)
        elif isinstance(msg, Fetched) and msg.items:
            log.warning("discarded a late reply with %d item(s) to request %d that timed out",
                        len(msg.items), rid)

    def _fail_all(self, error: TransportError, *, locked: bool = False) -> None:
        if not locked:
            with self._send_lock:
                self._fail_all(error, locked=True)
            return
        if self._lost is None:
            self._lost = error
        # Pop each one: the reader thread pops too (without this lock), and a slot must be
        # resolved exactly once, by whoever popped it.
        for rid in list(self._pending):
            slot = self._pending.pop(rid, None)
            if slot is not None:
                slot.resolve(None, type(error)(f"{slot.what} failed: {error}"))

    # -- listen dispatch ----------------------------------------------------------------------
    def _start_dispatcher(self) -> None:
        with self._listen_lock:
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
            name, event = entry
            with self._listen_lock:
                callbacks = [cb for cb, inline in self._listeners.get(name, ()) if not inline]
            for cb in callbacks:
                _call_listener(cb, event, name)


def _call_listener(callback: Callable[[dict[str, Any]], Any], event: dict[str, Any],
                   name: str) -> None:
    try:
        callback(dict(event))  # a copy each: one callback cannot change what another sees
    except Exception:
        log.exception("listen callback for bin %r raised", name)
