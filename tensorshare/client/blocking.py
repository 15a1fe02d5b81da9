"""The blocking, thread-safe client: a socket and a reader thread over :mod:`.session`.

One connection per client. Any number of threads may call it at once: each request is added
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
"""

from __future__ import annotations

import array
import builtins
import gc
import logging
import math
import os
import queue
import select
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..errors import (
    ConnectError,
    ConnectionLost,
    LimitExceeded,
    TensorShareError,
    error_from_code,
)
from ..wire.codec import Buffer, Encoded, decode, encode
from ..wire.frames import BytesLike
from ..wire.messages import (
    Append,
    Configure,
    Configured,
    Delete,
    ErrorReply,
    Fetch,
    Fetched,
    FetchSpec,
    Item,
    Limits,
    ListBins,
    Listen,
    Ping,
    Put,
    Request,
    Stats,
    Unlisten,
)
from ..wire.protocol import check_bin_name
from .session import Call, ClientSession, Done, Drop, Notify, Ready

__all__ = ["NOWAIT", "BinLimits", "Client", "FetchResult", "PendingCall", "Pipeline"]

log = logging.getLogger("tensorshare.client")


class _NoWait:
    """Sentinel: do not wait for data (the default of get/peek)."""

    def __repr__(self) -> str:
        return "NOWAIT"


NOWAIT: Any = _NoWait()
_MAX_IOV = 512  # buffers per sendmsg call; well below IOV_MAX (1024 on Linux)
_READ_CHUNK = 256 * 1024
# Frame overhead beyond the value itself: the prefix, the header fields, the padding.
_FRAME_SLACK = 4096
# The share of the client's timeout an append may wait for room in a full "block" bin.
BLOCK_SHARE = 0.8


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


@dataclass(frozen=True, slots=True)
class BinLimits:
    """A bin's limits as the server applies them (see :meth:`Client.configure`)."""

    max_items: int | None
    max_bytes: int | None
    overflow: str


class _Slot:
    """Where the reading thread leaves one reply for the thread waiting on it."""

    __slots__ = ("_lock", "reply", "error", "done")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self.reply: Any = None
        self.error: BaseException | None = None
        self.done = False

    def resolve(self, reply: Any, error: BaseException | None = None) -> None:
        """Called exactly once (the session finishes each call once)."""
        self.reply, self.error = reply, error
        self.done = True
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
    """A request that was sent (or queued while reconnecting) and whose reply may not have
    arrived yet.

    ``result()`` waits for the reply (up to the client's timeout, plus the wait time of a
    waiting get/peek) and returns what the blocking method would return, or raises its error.
    """

    __slots__ = ("_client", "_call", "_slot", "_outcome")

    def __init__(self, client: Client | None, call: Call | None, slot: _Slot | None) -> None:
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
        if slot.error is not None:
            return False, slot.error
        reply = slot.reply
        if type(reply) is ErrorReply:
            return False, error_from_code(reply.code, reply.message)
        try:
            return True, call.convert(reply) if call.convert is not None else reply
        except TensorShareError as exc:  # e.g. a malformed value from a peer
            return False, exc


def _version(reply: Any) -> int:
    return int(reply.version)


def _none(reply: Any) -> None:
    return None


@dataclass(frozen=True, slots=True)
class Address:
    """Where a server listens: TCP ``host:port`` or a Unix socket ``path``."""

    host: str = "127.0.0.1"
    port: int = 8000
    path: str | None = None

    def __str__(self) -> str:
        return f"unix://{self.path}" if self.path is not None else f"{self.host}:{self.port}"


def parse_address(host: str, port: int) -> Address:
    """``host`` and ``port`` as given to a client: a host name and a port, or one URL:
    ``tensorshare://HOST:PORT`` or ``unix://PATH`` (``unix:///tmp/ts.sock``).

    Raises:
        ValueError: an unknown scheme, or a URL without a port.
    """
    if "://" not in host:
        return Address(host, port)
    scheme, rest = host.split("://", 1)
    if scheme == "unix":
        if not rest:
            raise ValueError(f"no socket path in {host!r}")
        return Address(path=rest)
    if scheme == "tensorshare":
        name, _, number = rest.rstrip("/").rpartition(":")
        if not name or not number.isdigit():
            raise ValueError(f"expected tensorshare://HOST:PORT, got {host!r}")
        return Address(name.strip("[]"), int(number))
    raise ValueError(f"unknown address scheme {scheme!r} in {host!r} (use tensorshare:// or "
                     f"unix://)")


def check_timeout(timeout: Any, what: str = "timeout") -> float:
    """A client timeout: a positive, finite number of seconds."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not 0 < timeout < math.inf:
        raise ValueError(f"{what} must be a positive number of seconds, not {timeout!r}")
    return float(timeout)


def check_reconnect(reconnect: Any) -> bool | float:
    """``True``, ``False`` or a positive number of seconds."""
    if isinstance(reconnect, bool):
        return reconnect
    return check_timeout(reconnect, "reconnect")


def make_item(name: str, value: Any, tag: int | None, limits: Limits, compress: str | None,
              compress_min_bytes: int, share_min_bytes: int | None = None) -> Item:
    """Check a put/append locally and encode its value (raises before anything is sent).

    With ``share_min_bytes`` (a connection that passes shared memory), every uncompressed
    buffer of at least that many bytes is written once into a sealed memfd, which then
    travels instead of the bytes (see :mod:`tensorshare.shm`).

    Raises:
        TypeError, ValueError: a bad bin name or tag.
        UnsupportedType: the value holds a type that cannot be sent.
        LimitExceeded: the value is larger than the server's frame limit.
    """
    check_bin_name(name, limits.max_name_bytes)
    if tag is not None and (not isinstance(tag, int) or isinstance(tag, bool)):
        raise TypeError(f"tag must be an int or None, not {type(tag).__name__}")
    enc = encode(value, compress=compress, compress_min_bytes=compress_min_bytes,
                 max_depth=limits.max_depth)
    if enc.nbytes + _FRAME_SLACK > limits.max_frame_bytes:
        size = enc.nbytes + 64 * (len(enc.buffers) + 1)
        if size > limits.max_frame_bytes:
            raise LimitExceeded(f"value for bin {name!r} not sent: it takes about {size} "
                                f"bytes, over the server's max_frame_bytes="
                                f"{limits.max_frame_bytes}")
    if share_min_bytes is not None and any(
            b.codec is None and b.nbytes >= share_min_bytes for b in enc.buffers):
        from ..memory import shm

        buffers = []
        for b in enc.buffers:
            if b.codec is None and b.nbytes >= share_min_bytes:
                mem = shm.share(b.data)
                b = Buffer(mem.view, None, mem.size, mem)
            buffers.append(b)
        enc = Encoded(enc.value, tuple(buffers))
    return Item(enc, tag)


def fetch_request(name: str, *, remove: bool, max_items: int | None, timeout: Any,
                  min_tag: int | None, newer_than: int | None, min_items: int,
                  limits: Limits) -> tuple[Fetch, str]:
    """Check a get/peek locally; return the message and how errors name it."""
    wait = timeout is not NOWAIT
    if wait and timeout is not None and (isinstance(timeout, bool) or not 0 <= timeout < math.inf):
        raise ValueError(f"timeout must be a finite number >= 0, or None; got {timeout!r}")
    check_bin_name(name, limits.max_name_bytes)
    spec = FetchSpec(remove, max_items, wait, float(timeout) if wait and timeout is not None
                     else None, min_tag, newer_than, min_items)
    return Fetch(0, name, spec), f"{spec.op} on bin {name!r}"


@contextmanager
def gc_paused(n: int) -> Iterator[None]:
    """Pause Python's cyclic garbage collector while ``n`` (many) objects are made at once.

    Building tens of thousands of small objects (the items of a batch) otherwise triggers
    collections that scan every live object again and again: that, not the work itself,
    cost three quarters of the time of a 50,000-item batch. Nothing made meanwhile is a
    cycle, and the collector runs again right after.
    """
    if n < 1000 or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def fetch_result(reply: Fetched, max_depth: int) -> FetchResult:
    """Decode a get/peek reply."""
    if reply.unchanged:
        return FetchResult(None, reply.kind, (), reply.version, reply.n_items, reply.dropped, True)
    with gc_paused(len(reply.items)):
        values = [decode(it.value, max_depth=max_depth) for it in reply.items]
    value = values[0] if reply.kind == "value" else values
    return FetchResult(value, reply.kind, tuple(it.tag for it in reply.items), reply.version,
                       reply.n_items, reply.dropped)


class Client:
    """A blocking, thread-safe connection to a tensorshare server that rides out drops.

    Args:
        host: server address (a host name or IP), or a URL: ``tensorshare://HOST:PORT`` or
            ``unix://PATH`` for a server on this machine's Unix socket (faster, and large
            tensors may travel through shared memory, see ``shm``).
        port: server port (ignored for a URL).
        timeout: seconds the server has to answer a request (a get/peek that waits for data
            gets its wait on top); also how long the first connection may take.
        reconnect: ``True`` (default): when the connection drops, reconnect with backoff and
            carry on where it stopped (calls wait within their own timeout); a number: give
            up after that many seconds without a connection; ``False``: fail every call at
            the first drop, as a plain socket would.
        compress: ``"lz4"`` to compress large tensor buffers before sending, or ``None``.
        compress_min_bytes: buffers smaller than this are never compressed.
        name: how this client introduces itself in the server's log.
        session: ``True`` (default): exactly-once replay across reconnects. ``False``: no
            session (a tool that sends one request does not need one).
        heartbeat: seconds of silence after which a ping checks that the server is still
            there (a dead peer is noticed, and acknowledgements reach the server); default
            a third of ``timeout``, at most 5 s.
        connector: returns a new connected socket each time it is called, instead of a TCP
            connection to ``host:port`` (custom transports; tests use a socketpair).
        shm: over a Unix socket (``unix://PATH``, Linux), pass tensors of at least
            ``shm_min_bytes`` through shared memory instead of the socket: a put writes them
            once into a sealed memfd, a get maps the server's with no copy at all.
        shm_min_bytes: the smallest buffer worth sharing (below, the socket is faster).

    Raises:
        ConnectError: no server answered within ``timeout`` (with ``reconnect`` on, it
            keeps trying until then: workers may start before their server), or the
            handshake failed.

    Example::

        with Client("127.0.0.1", 8000) as c:
            c.put("weights", {"w": torch.randn(3, 3)})
            print(c.peek("weights"))
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 8000, timeout: float = 30.0, *,
                 reconnect: bool | float = True, compress: str | None = None,
                 compress_min_bytes: int = 64 * 1024, name: str = "tensorshare-python",
                 session: bool = True, heartbeat: float | None = None,
                 connector: Callable[[], socket.socket] | None = None, shm: bool = True,
                 shm_min_bytes: int = 1 << 20) -> None:
        if compress not in (None, "lz4"):
            raise ValueError(f"compress must be None or 'lz4', not {compress!r}")
        self.timeout = check_timeout(timeout)
        self.reconnect = check_reconnect(reconnect)
        where = parse_address(host, port)
        self.host, self.port, self.path = where.host, where.port, where.path
        self.compress, self.compress_min_bytes = compress, compress_min_bytes
        self.address = str(where)
        self._connector = connector
        self._session = ClientSession(address=self.address, timeout=self.timeout,
                                      reconnect=self.reconnect, name=name, session=session,
                                      heartbeat=heartbeat)
        if shm and self.path is not None and connector is None:
            from ..memory import shm as _shm

            self._session.shm = _shm.available()
        self.shm_min_bytes = shm_min_bytes
        self._lock = threading.Lock()  # the session, and who reads (below)
        self._cv = threading.Condition(self._lock)
        self._send_lock = threading.Lock()  # the socket's write side; taken before _lock
        # Reading (see _serve): who reads the socket now (None, _READER or a caller), how
        # many callers wait for replies, whether a lone caller asked the reader thread to
        # step aside (set until that caller leads or is done), whether the reader thread is
        # in poll(), when a caller last stopped reading.
        self._leader: object | None = None
        self._waiting = 0
        self._yield = False
        self._polling = False
        self._last_exit = 0.0
        self._lead_start = 0.0  # when the current leading caller took the lead
        self._broken: str | None = None  # a leading caller saw the connection end
        self._reader: _Reader | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sock: socket.socket | None = None
        self._events: queue.SimpleQueue[tuple[list[Any], dict[str, Any], str] | None] | None = None
        self._dispatcher: threading.Thread | None = None
        self._closing = False
        self._ready = threading.Event()
        self._wakeup = threading.Event()  # interrupts the reader's backoff sleep (close)
        self._attempt = 0  # reconnect attempts since the last handshake (for the backoff)
        self._lost_at: float | None = None  # when the current outage began
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"tensorshare-reader-{self.address}")
        self._thread.start()
        if not self._ready.wait(self.timeout + 5.0) or self._session.server is None:
            error = self._session.closed
            self.close()
            if isinstance(error, ConnectError):
                raise error
            raise ConnectError(f"cannot connect to tensorshare server at {self.address}: "
                               f"{error or 'no answer'}")

    # -- what the server said ---------------------------------------------------------------
    @property
    def limits(self) -> Limits:
        """The server's limits (from the last handshake)."""
        return self._session.limits

    @property
    def server_version(self) -> str:
        """The server's software and version, e.g. ``"tensorshare/0.2.0"``."""
        hello = self._session.server
        return hello.server if hello else ""

    @property
    def protocol_version(self) -> int:
        hello = self._session.server
        return hello.version if hello else 0

    @property
    def server_id(self) -> str:
        """Random per server data set: it changes when the server restarted without
        persistence (bin versions then started again)."""
        hello = self._session.server
        return hello.server_id if hello else ""

    @property
    def connected(self) -> bool:
        """Whether the client is connected right now (``False`` while reconnecting)."""
        return self._session.connected and self._session.closed is None

    @property
    def closed(self) -> bool:
        """Whether the client is closed (or gave up reconnecting): every call fails."""
        return self._session.closed is not None

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
            BinFull: the bin is configured with ``max_bytes`` and the value does not fit.
            ReplyTimeout, ConnectionLost, SessionLost: no confirmation from the server (the
                message says whether the put may have taken effect).
        """
        return self.begin_put(name, value, tag=tag).result()  # type: ignore[no-any-return]

    def append(self, name: str, value: Any, *, tag: int | None = None) -> int:
        """Append ``value`` as one item to bin ``name`` (a list is one item, never flattened).

        Appending to a bin that holds a put value turns it into ``[value, new]``. On a bin
        configured with ``overflow="block"`` that is full, this waits on the server for a
        get to make room (up to 80% of the client's timeout, then ``BinFull``).

        Returns:
            The bin's new version. Raises: as :meth:`put`, and ``BinFull`` for a full bin.
        """
        return self.begin_append(name, value, tag=tag).result()  # type: ignore[no-any-return]

    def get(self, name: str, *, max_items: int | None = None, timeout: Any = NOWAIT) -> Any:
        """Return the content of bin ``name`` and remove it.

        Args:
            name: the bin.
            max_items: for an appended bin, take at most this many items from the front
                (FIFO) and leave the rest.
            timeout: by default, do not wait. A number: wait up to that many seconds for
                data. ``None``: wait without limit (across reconnects).

        Returns:
            The value of a put bin, or the list of items of an appended bin.

        Raises:
            BinNotFound: the bin is missing or empty (when not waiting).
            WaitTimeout: no data arrived within ``timeout`` (a :class:`Timeout`).
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

    def configure(self, name: str, max_items: int | None = None, max_bytes: int | None = None,
                  overflow: str = "reject") -> BinLimits:
        """Bound bin ``name``: at ``max_items`` items or ``max_bytes`` bytes it is full.

        Args:
            overflow: what an append to a full bin does: ``"reject"`` raises ``BinFull``;
                ``"drop_oldest"`` removes the oldest items to make room (listeners' events
                say how many in ``dropped``); ``"block"`` waits on the server until a get
                makes room (backpressure for producers that outrun their consumers).

        Returns:
            The limits as the server now applies them (they persist with the bin's name).
        """
        check_bin_name(name, self.limits.max_name_bytes)
        return self._begin(Configure(0, name, max_items, max_bytes, overflow),  # type: ignore[no-any-return]
                           f"configure of bin {name!r}", _limits).result()

    def stats(self, glob: str | None = None) -> dict[str, Any]:
        """The server's statistics and a summary of every bin (matching ``glob``).

        Returns:
            ``{"server": {...}, "bins": {name: {...}}}`` (see docs/PROTOCOL.md, ``stats``).
        """
        return self._begin(Stats(0, glob), "stats",  # type: ignore[no-any-return]
                           lambda r: {"server": r.server, "bins": r.bins}).result()

    def listen(self, name: str, callback: Callable[[dict[str, Any]], Any]) -> None:
        """Call ``callback(event)`` on every change of bin ``name``.

        ``event`` is a dict: ``{'status': 'OK', 'bin': name, 'op': 'put'|'append'|'get'|
        'delete'|'restore', 'n_items': n, 'version': v}``. After a reconnect, a bin that
        changed meanwhile gives one ``op: 'resync'`` event with its current version and item
        count (``'restarted': True`` if the server restarted without persistence). Callbacks
        run on this client's dispatcher thread, one at a time, in the order the changes
        happened; a slow callback delays later events, never replies. Returns once the
        server has registered the listener; if it refuses, the callback is forgotten.
        """
        self.begin_listen(name, callback).result()

    def unlisten(self, name: str) -> bool:
        """Stop listening to bin ``name``. Returns whether this client was listening."""
        return self.begin_unlisten(name).result()  # type: ignore[no-any-return]

    def ping(self) -> None:
        """Round-trip to the server (raises if it does not answer within ``timeout``)."""
        self._begin(Ping(0), "ping", _none).result()

    def pipeline(self, *, raise_on_error: bool = True) -> Pipeline:
        """Queue many requests and send them together, without waiting for each reply.

        Usage::

            with client.pipeline() as p:
                for rollout in rollouts:
                    p.append("rollouts", rollout)
                p.put("step", 10)
            p.results  # what each call returns (a version, a value, ...), in order

        Consecutive appends to the same bin travel as one request (all or none, one new
        version), so tens of thousands of small items per second go through one client.
        Other calls are sent back to back in one write. Local mistakes raise at the call;
        the requests go out when the ``with`` block ends (or at :meth:`Pipeline.execute`).

        Args:
            raise_on_error: after every reply is in, raise the first error (the others and
                every result stay in ``results``); ``False``: only put errors in ``results``.
        """
        return Pipeline(self, raise_on_error)

    # -- non-blocking halves: send now, collect the result later -----------------------------
    def begin_put(self, name: str, value: Any, *, tag: int | None = None) -> PendingCall:
        """Send a put now; ``.result()`` of the returned call gives what :meth:`put` returns.

        Local mistakes (a bad name, an unsupported type) raise here, before anything is sent.
        Do not modify the tensors of ``value`` until the call has completed: they are sent
        from their own memory (and sent again if the connection drops meanwhile).
        """
        item = self._item(name, value, tag)
        return self._begin(Put(0, name, item), f"put to bin {name!r}", _version)

    def begin_append(self, name: str, value: Any, *, tag: int | None = None) -> PendingCall:
        """Send an append now (see :meth:`begin_put`)."""
        item = self._item(name, value, tag)
        # On a full "block" bin the server waits for room; it gives up a little before we
        # would, so that the caller hears BinFull rather than a timeout.
        return self._begin(Append(0, name, item, BLOCK_SHARE * self.timeout),
                           f"append to bin {name!r}", _version)

    def begin_fetch(self, name: str, *, remove: bool, max_items: int | None = None,
                    timeout: Any = NOWAIT, min_tag: int | None = None,
                    newer_than: int | None = None, min_items: int = 1) -> PendingCall:
        """Send a get/peek now; ``.result()`` gives the :class:`FetchResult`."""
        msg, what = fetch_request(name, remove=remove, max_items=max_items, timeout=timeout,
                                  min_tag=min_tag, newer_than=newer_than, min_items=min_items,
                                  limits=self.limits)
        max_depth = self.limits.max_depth
        return self._begin(msg, what, lambda r: fetch_result(r, max_depth))

    def begin_list(self) -> PendingCall:
        """Send a list request now."""
        return self._begin(ListBins(0), "list", lambda r: dict(r.bins))

    def begin_delete(self, name: str) -> PendingCall:
        """Send a delete now."""
        self._check_name(name)
        return self._begin(Delete(0, name), f"delete of bin {name!r}", lambda r: r.existed)

    def begin_listen(self, name: str, callback: Callable[[dict[str, Any]], Any], *,
                     inline: bool = False) -> PendingCall:
        """Register ``callback`` and send the listen request now (see :meth:`listen`).

        Args:
            inline: run ``callback`` on the reader thread, before any reply that arrives
                after the event is handed over. Only for callbacks that return at once (e.g.
                put the event on a queue): a slow inline callback stalls every reply.
        """
        self._check_name(name)
        if not callable(callback):
            raise TypeError("callback must be callable")
        if not inline:
            self._start_dispatcher()
        entry = (callback, inline)
        with self._lock:
            first = self._session.add_listener(name, entry)
            if not first:
                return PendingCall.done(None)
            call, slot = self._call(Listen(0, name), f"listen to bin {name!r}", _none, entry)
        self._flush()
        return PendingCall(self, call, slot)

    def begin_unlisten(self, name: str) -> PendingCall:
        """Drop this bin's listen callbacks and tell the server (see :meth:`unlisten`)."""
        self._check_name(name)
        with self._lock:
            if not self._session.remove_listener(name):
                return PendingCall.done(False)
            call, slot = self._call(Unlisten(0, name), f"unlisten from bin {name!r}",
                                    lambda r: True)
        self._flush()
        return PendingCall(self, call, slot)

    def close(self) -> None:
        """Close the connection. Pending calls fail with ConnectionLost. Idempotent."""
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
        with self._cv:
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

    def _wake(self) -> None:
        """Interrupt the reader thread's poll() (it then checks what changed)."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # full (already woken) or closed
            pass

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("connected" if self.connected else "reconnecting")
        return f"<tensorshare.Client {self.address} {state}>"

    # -- requests -----------------------------------------------------------------------------
    def _check_name(self, name: str) -> None:
        check_bin_name(name, self.limits.max_name_bytes)

    def _item(self, name: str, value: Any, tag: int | None) -> Item:
        conn = self._session.conn
        share = self.shm_min_bytes if conn is not None and conn.shm else None
        return make_item(name, value, tag, self.limits, self.compress, self.compress_min_bytes,
                         share)

    @property
    def shared_memory(self) -> bool:
        """Whether large tensors travel through shared memory on this connection."""
        conn = self._session.conn
        return conn is not None and conn.shm

    def _call(self, msg: Request, what: str, convert: Callable[[Any], Any],
              extra: Any = None) -> tuple[Call, _Slot]:
        slot = _Slot()
        call = self._session.call(msg, what, time.monotonic(), token=slot, convert=convert,
                                  extra=extra)
        return call, slot

    def _begin(self, msg: Request, what: str, convert: Callable[[Any], Any]) -> PendingCall:
        """Add one request to the session and send what can be sent now."""
        with self._lock:
            call, slot = self._call(msg, what, convert)
        self._flush()
        return PendingCall(self, call, slot)

    def _flush(self) -> None:
        """Write every request not yet sent on the current connection, in id order."""
        with self._send_lock:
            with self._lock:
                sock = self._sock
                chunks = self._session.pop_sendable(time.monotonic()) if sock else []
                shared = self._session.take_shared()
                failed = self._session.take_finished()
            self._process(failed)  # type: ignore[arg-type]
            if not chunks or sock is None:
                return
            try:
                _sendall(sock, chunks, [m.fd for m in shared] if shared else None,
                         self.timeout)
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
        caller waiting (no thread handoff), else let the reading thread hand it over."""
        cv = self._cv
        me = threading.get_ident()
        asked = False  # this caller asked the reader thread to step aside
        with cv:
            self._waiting += 1
        try:
            while not slot.done:
                lead = False
                with cv:
                    if slot.done:
                        break
                    if (self._waiting == 1 and self._reader is not None
                            and self._broken is None and self._session.connected):
                        if self._leader is None:
                            self._leader = me
                            self._yield = False
                            self._lead_start = time.monotonic()
                            lead = True
                        elif self._leader is _READER:
                            # The reader thread is in poll(): ask it to step aside (it
                            # leaves _yield set, so it does not take the lead back first).
                            self._yield = True
                            if self._polling:
                                self._wake()
                            asked = True
                            cv.wait(0.05)
                            continue
                if lead:
                    asked = False
                    self._lead(call, slot)
                    continue
                deadline = call.deadline
                wait = None if deadline is None else deadline - time.monotonic() + 0.002
                # Check back now and then: we may be able to read for ourselves later (say,
                # once a reconnect completes, or when the other waiting callers are done).
                wait = 0.05 if wait is None else min(wait, 0.05)
                if slot.wait(wait):
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    # Our deadline passed and nobody expired us yet: ask the session
                    # ourselves. Exactly one of us finishes the call.
                    self._expire(call)
        finally:
            with cv:
                self._waiting -= 1
                if asked and self._yield and self._leader is not me:
                    self._yield = False  # done without leading: the reader may read again
                    cv.notify_all()

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
                if ev.call.token is not None:
                    ev.call.token.resolve(ev.reply, ev.error)
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

    # -- the reader thread ------------------------------------------------------------------
    def _run(self) -> None:
        session = self._session
        start = time.monotonic()
        try:
            while not self._closing and session.closed is None:
                try:
                    sock = self._connect()
                except OSError as exc:
                    now = time.monotonic()
                    if session.server is None:  # never connected yet
                        if not self.reconnect or now - start >= self.timeout:
                            with self._lock:
                                events = session.close(ConnectError(
                                    f"cannot connect to tensorshare server at {self.address}"
                                    f": {exc}"))
                            self._process(events)
                            break
                    elif session.give_up_due(now):
                        self._give_up(now)
                        break
                    session.last_loss = f"cannot connect: {exc}"
                    self._sleep(session.backoff(self._attempt))
                    self._attempt += 1
                    continue
                reason = self._serve(sock)
                with self._cv:
                    while self._leader not in (None, _READER):  # a caller still reads it
                        self._cv.wait(1.0)
                    self._leader = None
                    self._yield = False  # a request to step aside is about this connection
                    self._broken = None
                    self._sock = None
                    self._reader = None
                    events = session.connection_lost(reason, time.monotonic())
                _close_socket(sock)
                self._process(events)
                if self._closing or session.closed is not None:
                    break
                if self._lost_at is None:
                    self._lost_at = time.monotonic()
                    log.warning("lost connection to tensorshare server at %s (%s); "
                                "reconnecting", self.address, reason)
                self._sleep(session.backoff(self._attempt))
                self._attempt += 1
        except BaseException:  # never leave callers waiting
            log.exception("tensorshare reader thread for %s failed", self.address)
            with self._lock:
                events = session.close(ConnectionLost(
                    f"the reader thread of the client for {self.address} failed"))
            self._process(events)
        finally:
            self._ready.set()
            if self._events is not None:
                self._events.put(None)

    def _give_up(self, now: float) -> None:
        session = self._session
        since = session.disconnected_since or now
        with self._lock:
            events = session.close(ConnectionLost(
                f"the tensorshare server at {self.address} has been unreachable for "
                f"{now - since:.1f} s ({session.last_loss}); gave up (reconnect="
                f"{self.reconnect:g})"))
        self._process(events)
        log.warning("gave up reconnecting to tensorshare server at %s", self.address)

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
        elif self.path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(self.timeout)
                sock.connect(self.path)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Non-blocking from here on: reads already wait in poll (Python's own poll before every
        # recv and send on a socket with a timeout would be one more system call each), and
        # _sendall waits for room itself, up to the timeout (a server that stops reading).
        sock.setblocking(False)
        return sock

    def _serve(self, sock: socket.socket) -> str:
        """Handshake, then read (or let a caller read) until the connection ends; return why.

        Who reads the socket: normally this thread. But a caller that is the only one waiting
        for a reply reads it itself (see :meth:`PendingCall._wait`), which saves a thread
        handoff per request; this thread then stays parked until no caller has read for
        ``LINGER`` seconds, so that back-to-back calls never wake it.
        """
        session = self._session
        with self._send_lock:
            with self._lock:
                if self._closing:
                    return "closed"
                self._sock = sock
                self._reader = _Reader(sock)
                hello = session.connection_made(time.monotonic())
            try:
                _sendall(sock, hello, None, self.timeout)
            except OSError as exc:
                return f"handshake failed: {exc}"
        reader = self._reader
        assert reader is not None
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        cv = self._cv
        while True:
            # Wait for our turn to read (a caller may be reading its own reply).
            with cv:
                while True:
                    if self._broken is not None:
                        return self._broken
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
                    if self._leader is None and not (self._yield and self._waiting == 1
                                                     and session.connected):
                        # A caller waiting alone reads for itself; with more waiting, or
                        # none for a while, or during the handshake, this thread reads. So
                        # it does when a lone caller did not take the lead within LINGER
                        # (it waits on its slot, say, having called while we reconnected).
                        resume = self._last_exit + LINGER
                        if self._waiting > 1 or now >= resume or not session.connected:
                            self._leader = _READER
                            break
                        due = min(due, resume)
                    elif self._leader is not None and now - self._lead_start > LINGER:
                        # A caller has led for a while (a long wait): it wakes us when it
                        # is done (see _lead), so sleep until then.
                        pass
                    else:
                        # A caller leads (or is about to): look again after LINGER rather
                        # than be woken at the end of every call; a thread wake-up per
                        # short request costs more than the request.
                        due = min(due, now + LINGER)
                    cv.wait(min(max(due - now, 0.0), 60.0))
                self._polling = True
            try:
                ready = poller.poll(min(max((due - time.monotonic()) * 1000.0, 1.0), 60e3))
            finally:
                with cv:
                    self._polling = False
            if any(fd == self._wake_r for fd, _ in ready):
                _drain(self._wake_r)
            reason: str | None = None
            if any(fd != self._wake_r for fd, _ in ready):
                reason = self._read_once(reader)
            with cv:
                self._leader = None  # _yield stays set: the caller that asked leads next
                cv.notify_all()
            if reason is not None:
                return reason

    def _read_once(self, reader: _Reader) -> str | None:
        """One ``recv`` from the current socket and everything it completes, handled.

        Called by whoever leads (holds ``_leader``). Returns why the connection must end, or
        ``None``.
        """
        session = self._session
        fds: list[int] = []
        try:
            direct = session.get_buffer()
            target = direct if direct is not None else reader.scratch
            if reader.unix:
                n, ancdata, _, _ = reader.sock.recvmsg_into([target], _ANC_SPACE)
                if ancdata:
                    fds = _fds_of(ancdata)
            else:
                n = reader.sock.recv_into(target)
        except (BlockingIOError, InterruptedError, TimeoutError):
            return None
        except OSError as exc:
            return str(exc) or type(exc).__name__
        if not n:
            for fd in fds:
                os.close(fd)
            return "the server closed the connection"
        with self._lock:
            now = time.monotonic()
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
                events = session.receive_data(reader.view[:n], now)
            nxt = session.next_deadline()
            ticked = nxt is not None and nxt <= now
            if ticked:
                events.extend(session.tick(now))
                ticked = session.has_sendable
        if self._handle(events):
            return self._drop_reason(events)
        if ticked:
            self._flush_soon()
        return None

    def _lead(self, call: Call, slot: _Slot) -> None:
        """Read the socket in this (calling) thread until ``slot`` is resolved or the call's
        deadline passes; then give the lead back."""
        reader = self._reader
        reason: str | None = None
        try:
            if reader is None:
                return
            poll = reader.poll
            while not slot.done:
                deadline = call.deadline
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    self._expire(call)
                    if slot.done:
                        return
                    deadline = call.deadline
                wait = 60.0 if deadline is None else min(max(deadline - now, 0.0) + 0.001, 60.0)
                if not poll.poll(wait * 1000.0):
                    continue
                reason = self._read_once(reader)
                if reason is not None:
                    return
        finally:
            with self._cv:
                self._leader = None
                now = time.monotonic()
                self._last_exit = now
                if reason is not None and self._broken is None:
                    self._broken = reason
                # The reader thread sleeps through a long lead (see _serve): wake it. After
                # a short one it looks again by itself within LINGER.
                if reason is not None or self._waiting > 1 or now - self._lead_start > LINGER:
                    self._cv.notify_all()

    def _handle(self, events: builtins.list[Any]) -> bool:
        """Act on events from the reader thread; return whether the connection must go."""
        drop = False
        for ev in events:
            cls = type(ev)
            if cls is Ready:
                self._ready_event(ev)
            elif cls is Drop:
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
            away = time.monotonic() - self._lost_at if self._lost_at is not None else 0.0
            self._lost_at = None
            how = "session resumed" if ev.resumed else \
                "new session: the server did not know ours"
            log.warning("reconnected to tensorshare server at %s after %.1f s (%s)",
                        self.address, away, how)
        self._flush_soon()

    # -- listen dispatch ----------------------------------------------------------------------
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


class Pipeline:
    """Requests queued locally and sent together (see :meth:`Client.pipeline`).

    Each method returns the index its result will have in :attr:`results`.

    Attributes:
        results: after :meth:`execute`, what each call returned, in order; a call that
            failed holds its exception instead.
    """

    #: Most items one append request carries (more go in the next one).
    MAX_BATCH_ITEMS = 10_000

    def __init__(self, client: Client, raise_on_error: bool = True) -> None:
        self._client = client
        self._raise = raise_on_error
        self._ops: builtins.list[tuple[str, Any, Any, Any]] = []  # (kind, name/msg, item, what)
        self.results: builtins.list[Any] | None = None

    def __len__(self) -> int:
        return len(self._ops)

    def _add(self, kind: str, a: Any, b: Any = None, c: Any = None) -> int:
        if self.results is not None:
            raise RuntimeError("this pipeline was executed already; make a new one")
        self._ops.append((kind, a, b, c))
        return len(self._ops) - 1

    def put(self, name: str, value: Any, *, tag: int | None = None) -> int:
        """Queue a put (see :meth:`Client.put`)."""
        return self._add("put", name, self._client._item(name, value, tag))

    def append(self, name: str, value: Any, *, tag: int | None = None) -> int:
        """Queue an append (see :meth:`Client.append`)."""
        torch = sys.modules.get("torch")
        if torch is not None and type(value) is torch.Tensor and value.is_cpu \
                and (tag is None or (type(tag) is int)):
            # A lone CPU tensor (the common batch item) is encoded at execute(), many at a
            # time with the garbage collector paused; its name is checked now.
            self._client._check_name(name)
            return self._add("append", name, None, (value, tag))
        return self._add("append", name, self._client._item(name, value, tag))

    def fetch(self, name: str, *, remove: bool, max_items: int | None = None,
              timeout: Any = NOWAIT, min_tag: int | None = None,
              newer_than: int | None = None, min_items: int = 1) -> int:
        """Queue a get/peek; its result is a :class:`FetchResult` (see :meth:`Client.fetch`)."""
        msg, what = fetch_request(name, remove=remove, max_items=max_items, timeout=timeout,
                                  min_tag=min_tag, newer_than=newer_than,
                                  min_items=min_items, limits=self._client.limits)
        return self._add("fetch", msg, what)

    def get(self, name: str, *, max_items: int | None = None, timeout: Any = NOWAIT) -> int:
        """Queue a get; its result is what :meth:`Client.get` returns."""
        return self._add("value", *fetch_request(
            name, remove=True, max_items=max_items, timeout=timeout, min_tag=None,
            newer_than=None, min_items=1, limits=self._client.limits))

    def peek(self, name: str, *, max_items: int | None = None, timeout: Any = NOWAIT) -> int:
        """Queue a peek; its result is what :meth:`Client.peek` returns."""
        return self._add("value", *fetch_request(
            name, remove=False, max_items=max_items, timeout=timeout, min_tag=None,
            newer_than=None, min_items=1, limits=self._client.limits))

    def delete(self, name: str) -> int:
        """Queue a delete; its result says whether the bin existed."""
        self._client._check_name(name)
        return self._add("delete", name)

    def execute(self) -> builtins.list[Any]:
        """Send every queued request, wait for every reply, and return :attr:`results`.

        Raises:
            the first error among the results (with ``raise_on_error``, the default).
        """
        if self.results is not None:
            return self.results
        with gc_paused(len(self._ops)):
            return self._execute()

    def _execute(self) -> builtins.list[Any]:
        client = self._client
        ops = self._ops
        for i, (kind, a, b, c) in enumerate(ops):
            if kind == "append" and b is None:  # deferred (see append)
                ops[i] = (kind, a, client._item(a, c[0], c[1]), None)
        timeout = BLOCK_SHARE * client.timeout
        max_depth = client.limits.max_depth
        room = client.limits.max_frame_bytes // 2
        groups: builtins.list[tuple[Request, str, Callable[[Any], Any], int]] = []
        i, n = 0, len(ops)
        while i < n:
            kind, a, b, c = ops[i]
            if kind == "append":
                items = [b]
                size = b.value.nbytes
                i += 1
                while (i < n and ops[i][0] == "append" and ops[i][1] == a
                       and len(items) < self.MAX_BATCH_ITEMS
                       and size + ops[i][2].value.nbytes < room):
                    items.append(ops[i][2])
                    size += ops[i][2].value.nbytes
                    i += 1
                msg: Request = Append(0, a, items[0], timeout, tuple(items[1:]))
                what = (f"append to bin {a!r}" if len(items) == 1
                        else f"append of {len(items)} items to bin {a!r}")
                groups.append((msg, what, _version, len(items)))
                continue
            i += 1
            if kind == "put":
                groups.append((Put(0, a, b), f"put to bin {a!r}", _version, 1))
            elif kind == "fetch":
                groups.append((a, b, lambda r: fetch_result(r, max_depth), 1))
            elif kind == "value":
                groups.append((a, b, lambda r: fetch_result(r, max_depth).value, 1))
            else:  # delete
                groups.append((Delete(0, a), f"delete of bin {a!r}", lambda r: r.existed, 1))
        calls = []
        with client._lock:
            for msg, what, convert, count in groups:
                call, slot = client._call(msg, what, convert)
                calls.append((PendingCall(client, call, slot), count))
        client._flush()
        results: builtins.list[Any] = []
        for pending, count in calls:
            try:
                value = pending.result()
            except TensorShareError as exc:
                value = exc
            results.extend([value] * count)
        self.results = results
        self._ops = []
        if self._raise:
            first = next((r for r in results if isinstance(r, BaseException)), None)
            if first is not None:
                raise first
        return results

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.execute()


def _limits(reply: Configured) -> BinLimits:
    return BinLimits(reply.max_items, reply.max_bytes, reply.overflow)


def _call_listener(callback: Callable[[dict[str, Any]], Any], event: dict[str, Any],
                   name: str) -> None:
    try:
        callback(dict(event))  # a copy each: one callback cannot change what another sees
    except Exception:
        log.exception("listen callback for bin %r raised", name)


class _Reader:
    """What reading one connection needs: its socket, a poll object and a scratch buffer.

    Only the thread that leads (see ``Client._serve``) uses it, so one is enough.
    """

    __slots__ = ("sock", "poll", "scratch", "view", "unix")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.unix = sock.family == socket.AF_UNIX
        self.poll = select.poll()
        self.poll.register(sock, select.POLLIN)
        self.scratch = bytearray(_READ_CHUNK)
        self.view = memoryview(self.scratch)


_READER = object()  # the reader thread, as the leader of reading
# How long the reader thread stays parked after a caller read its own reply: calls made
# back to back never wake it; a change notification arriving between two calls waits at most
# this long (a caller that is reading handles them at once).
LINGER = 0.005


_ANC_SPACE = socket.CMSG_SPACE(253 * array.array("i").itemsize)


def _fds_of(ancdata: Any) -> builtins.list[int]:
    fds: builtins.list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[: len(data) - len(data) % arr.itemsize])
            fds.extend(arr)
    return fds


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass


def _sendall(sock: socket.socket, chunks: Sequence[BytesLike], fds: list[int] | None = None,
             timeout: float | None = None) -> None:
    """Send every chunk on a non-blocking socket, waiting up to ``timeout`` seconds each time
    it is full; ``fds`` (a Unix socket) go along, at most 200 per ``sendmsg``.

    Raises:
        TimeoutError: the socket stayed full for ``timeout`` seconds (the peer stopped reading).
        OSError: the send failed.
    """
    views = [c if isinstance(c, memoryview) else memoryview(c) for c in chunks]
    i = 0
    pending = list(fds) if fds else []
    poller = None
    while i < len(views):
        try:
            if pending:
                sent = sock.sendmsg(views[i : i + _MAX_IOV], [(
                    socket.SOL_SOCKET, socket.SCM_RIGHTS,
                    array.array("i", pending[:200]).tobytes())])
                pending = pending[200:]
            else:
                sent = sock.sendmsg(views[i : i + _MAX_IOV])
        except (BlockingIOError, InterruptedError):
            if poller is None:
                poller = select.poll()
                poller.register(sock, select.POLLOUT)
            if not poller.poll(None if timeout is None else timeout * 1000.0):
                raise TimeoutError(f"the server did not read for {timeout:g} s") from None
            continue
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


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _close_socket(sock: socket.socket) -> None:
    _shutdown(sock)
    sock.close()
