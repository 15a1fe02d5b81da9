"""``TensorShare``: the callback API of the original tensorshare, on top of :class:`Client`.

Every call returns at once and is safe from any thread. Callbacks get dicts
(``{'status': 'OK', 'data': ...}`` or ``{'status': 'ERR', 'msg': ...}``) and run on ONE
callback thread, the thread that called :meth:`TensorShare.start`, in the order the requests
were made. Unlike the original design, ``start()`` need not run in the main thread, several
objects may live in one process, requests made before ``start()`` are sent once it runs, and
``stop()`` delivers every request already made before ``start()`` returns.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Unpack

from ..errors import CodecError, TensorShareError
from .blocking import PendingCall
from .ops import BinClient
from .options import UNSET, ClientOptions, OptionFields, Unset
from .sharded import connect

__all__ = ["TensorShare"]

log = logging.getLogger("tensorshare.compat")

Callback = Callable[[dict[str, Any]], Any]
_STOP = object()


def _ok(data: Any) -> dict[str, Any]:
    return {"status": "OK", "data": data}


def _err(exc: BaseException) -> dict[str, Any]:
    return {"status": "ERR", "msg": str(exc) or type(exc).__name__, "error": type(exc).__name__}


class TensorShare:
    """Callback-style access to a tensorshare server (the API of the original project).

    Args:
        host: server address ("localhost" works). port: server port.
        timeout: seconds to connect and to wait for each reply (default 30, or that of
            ``options``).
        options: a :class:`~.options.ClientOptions` for the client.
        **client_options: any field of :class:`~.options.ClientOptions` as a keyword (e.g.
            ``compress="lz4"``): overrides that field of ``options``.

    Raises:
        ValueError, TypeError: a bad option (at once, not at :meth:`start`).

    Example::

        ts = TensorShare("localhost", 8000)
        ts.put("data_bin", {"a": torch.randn(2, 2)})
        ts.peek("data_bin", lambda r: print(r["data"]))
        ts.list(lambda r: ts.stop())
        ts.start()  # runs the callbacks until stop(); any thread may call it
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 8000,
                 timeout: float | Unset = UNSET, *, options: ClientOptions | None = None,
                 **client_options: Unpack[OptionFields]) -> None:
        changes: dict[str, Any] = dict(client_options)
        if timeout is not UNSET and timeout is not None:  # (None: the default, as before)
            changes["timeout"] = timeout
        self.options = ClientOptions.of(options, **changes)
        self.host, self.port, self.timeout = host, port, self.options.timeout
        self._client: BinClient | None = None
        self._lock = threading.Lock()
        # Requests made before start(): (send it, deliver its outcome), in order.
        self._before_start: list[tuple[Callable[[BinClient], PendingCall], _Deliver]] = []
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stopping = False
        self._finished = threading.Event()
        self._loop_thread: threading.Thread | None = None

    # -- requests ---------------------------------------------------------------------------
    def put(self, bin: str, value: Any, callback: Callback | None = None) -> None:
        """Store ``value`` in ``bin`` (replacing it). Callback data: the bin's new version."""
        self._request(lambda c: c.begin.put(bin, value), callback)

    def append(self, bin: str, value: Any, callback: Callback | None = None) -> None:
        """Append ``value`` to ``bin`` as one item. Callback data: the bin's new version."""
        self._request(lambda c: c.begin.append(bin, value), callback)

    def get(self, bin: str, callback: Callback | None = None) -> None:
        """Return and remove the content of ``bin``. Callback data: the value (or list)."""
        self._request(lambda c: c.begin.fetch(bin, remove=True), callback, _value)

    def peek(self, bin: str, callback: Callback | None = None) -> None:
        """Return the content of ``bin`` without removing it. Callback data: the value."""
        self._request(lambda c: c.begin.fetch(bin, remove=False), callback, _value)

    def list(self, callback: Callback | None = None) -> None:
        """Callback data: ``{bin: n_items}`` for every non-empty bin: how many items each
        holds (1 for a put bin), not its version."""
        self._request(lambda c: c.begin.list(), callback)

    def delete(self, bin: str, callback: Callback | None = None) -> None:
        """Delete ``bin``. Callback data: whether it existed."""
        self._request(lambda c: c.begin.delete(bin), callback)

    def listen(self, bin: str, callback: Callback) -> None:
        """Call ``callback`` on every change of ``bin``.

        Events are ``{'status': 'OK', 'bin': name, 'n_items': n, 'op': ..., 'version': v}``
        and run on the callback thread, like every other callback. If the listen request
        itself fails, ``callback`` gets one ``{'status': 'ERR', ...}``.
        """

        def forward(event: dict[str, Any]) -> None:
            self._queue.put((None, callback, event))

        # The confirmation is not passed to the callback: it only ever sees change events.
        # forward() runs on the reader thread and only queues the event, so events are queued
        # the moment they arrive, in order: every event that arrived before stop() is
        # delivered before start() returns. (A request's callback is queued when the request
        # is made, so it may run before an event that reached us earlier than its reply.)
        self._request(lambda c: c.begin.listen(bin, forward, inline=True), callback, None,
                      errors_only=True)

    def ignore(self, bin: str, callback: Callback | None = None) -> None:
        """Stop listening to ``bin``. Callback data: whether this object was listening."""
        self._request(lambda c: c.begin.unlisten(bin), callback)

    # -- lifetime ---------------------------------------------------------------------------
    def start(self) -> None:
        """Connect, send requests made so far, and run callbacks until :meth:`stop`.

        Blocks; any thread may call it (not only the main thread).

        Raises:
            ConnectError: the server cannot be reached within ``timeout``.
            RuntimeError: ``start()`` is already running.
        """
        with self._lock:
            if self._loop_thread is not None:
                raise RuntimeError("TensorShare.start() is already running")
            self._loop_thread = threading.current_thread()
        try:  # connect outside the lock: requests made meanwhile still return at once
            client = connect(self.host, self.port, options=self.options)
        except BaseException:
            with self._lock:
                self._loop_thread = None
            raise
        try:
            with self._lock:
                self._client = client
                queued, self._before_start = self._before_start, []
                for begin, deliver in queued:
                    # Nobody is left to raise to: a local mistake becomes an ERR callback.
                    self._enqueue(begin, deliver, raise_local=False)
                if self._stopping:  # stop() came before we connected: after the queued ones
                    self._queue.put(_STOP)
            self._run_callbacks()
        finally:
            client.close()
            self._finished.set()

    def stop(self, timeout: float | None = None) -> None:
        """Deliver every request already made, then make :meth:`start` return.

        Requests made after ``stop()`` raise ``RuntimeError``. Called from a callback, it
        returns at once (the remaining callbacks run after it); from another thread it waits
        until ``start()`` has finished (up to ``timeout`` seconds, if given).
        """
        with self._lock:
            if not self._stopping:
                self._stopping = True
                if self._client is not None:  # else start() adds it after the queued requests
                    self._queue.put(_STOP)
            running = self._loop_thread
        if running is None or running is threading.current_thread():
            return
        self._finished.wait(timeout)

    # -- internals --------------------------------------------------------------------------
    def _request(self, begin: Callable[[BinClient], PendingCall], callback: Callback | None,
                 convert: Callable[[Any], Any] | None = None, *, errors_only: bool = False) -> None:
        entry = (begin, _Deliver(callback, convert, errors_only))
        with self._lock:
            if self._stopping:
                raise RuntimeError("TensorShare.stop() was called; no new requests are accepted")
            if self._client is None:
                self._before_start.append(entry)
                return
            self._enqueue(*entry)

    def _enqueue(self, begin: Callable[[BinClient], PendingCall], deliver: Any, *,
                 raise_local: bool = True) -> None:
        """Send now (under the lock, so the queue order is the request order)."""
        assert self._client is not None
        try:
            call: PendingCall | BaseException = begin(self._client)
        except (CodecError, TypeError, ValueError) as exc:  # a bad value or bin name
            if raise_local:
                raise  # tell the caller at once
            call = exc
        except TensorShareError as exc:
            call = exc  # e.g. the connection is gone: an ERR callback, never silence
        self._queue.put((call, deliver, None))

    def _run_callbacks(self) -> None:
        while True:
            entry = self._queue.get()
            if entry is _STOP:
                # Events that reached us while the last requests completed (read together
                # with their replies) are delivered too, before start() returns.
                while True:
                    try:
                        rest = self._queue.get_nowait()
                    except queue.Empty:
                        return
                    if rest is not _STOP and rest[0] is None:
                        _safe(rest[1], rest[2])
            call, deliver, event = entry
            if call is None:  # a listen event, forwarded from the client's dispatcher
                _safe(deliver, event)
                continue
            if isinstance(call, BaseException):
                deliver.error(call)
                continue
            try:
                result = call.result()
            except TensorShareError as exc:
                deliver.error(exc)
            else:
                deliver.ok(result)

    def __repr__(self) -> str:
        return f"<tensorshare.TensorShare {self.host}:{self.port}>"


class _Deliver:
    """How one request's outcome reaches its callback."""

    __slots__ = ("callback", "convert", "errors_only")

    def __init__(self, callback: Callback | None, convert: Callable[[Any], Any] | None,
                 errors_only: bool) -> None:
        self.callback, self.convert, self.errors_only = callback, convert, errors_only

    def ok(self, result: Any) -> None:
        if self.callback is None or self.errors_only:
            return
        _safe(self.callback, _ok(self.convert(result) if self.convert else result))

    def error(self, exc: BaseException) -> None:
        if self.callback is None:
            log.warning("tensorshare request failed (no callback to tell): %s", exc)
            return
        _safe(self.callback, _err(exc))


def _value(result: Any) -> Any:
    return result.value


def _safe(callback: Callback, arg: dict[str, Any]) -> None:
    try:
        callback(arg)
    except Exception:
        log.exception("tensorshare callback %r raised", callback)

