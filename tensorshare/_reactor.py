"""A private Twisted reactor run by a daemon thread: what
:class:`~tensorshare.server.embedded.EmbeddedServer` and
:class:`~tensorshare.dashboard.app.Dashboard` are built on, written once: starting the thread,
calling into the reactor from another thread, stopping it within a timeout and giving back
its descriptors.

It imports nothing of the package (the server and the dashboard, which may not import each
other's rooms, both build on it).
"""

from __future__ import annotations

import threading
from typing import Any, Self

__all__ = ["ReactorThread"]


class ReactorThread:
    """A private reactor (``self.reactor``) run by a daemon thread.

    A subclass makes its reactor and what runs on it, binds its port (``self.port``: 0 for
    none), then calls :meth:`_start_thread`; it writes ``_shutdown``, which :meth:`stop` runs
    in the reactor's thread and which stops the reactor once what runs on it is closed.
    """

    #: What the errors call it ("the server's reactor did not answer").
    _what = "reactor"
    reactor: Any
    port: int
    _reactor_closed = False

    def _start_thread(self, name: str) -> None:
        # Liveness is this event, not Thread.is_alive(): a join() interrupted by Ctrl+C can
        # leave a thread marked as stopped while it runs on (CPython 3.11).
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.reactor.run(installSignalHandlers=False)
        finally:
            self._done.set()

    def call(self, fn: Any, *args: Any, timeout: float = 10.0) -> Any:
        """Run ``fn(*args)`` in the reactor's thread and return its result (or raise what it
        raised).

        Raises:
            TimeoutError: the reactor did not run it within ``timeout`` seconds.
        """
        done = threading.Event()
        box: list[tuple[bool, Any]] = []

        def run() -> None:
            try:
                box.append((True, fn(*args)))
            except BaseException as exc:  # handed back to the caller below
                box.append((False, exc))
            done.set()

        self.reactor.callFromThread(run)
        if not done.wait(timeout):
            raise TimeoutError(f"the {self._what}'s reactor did not answer")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def _shutdown(self) -> None:
        """In the reactor's thread: close what runs on it, then stop the reactor."""
        raise NotImplementedError

    def _stopped(self) -> None:
        """After the reactor's thread ended, before its descriptors are given back."""

    def stop(self, timeout: float | None = None) -> None:
        """Run ``_shutdown`` in the reactor's thread, join the thread and give back the
        reactor's descriptors.

        Args:
            timeout: seconds to wait for the reactor to stop (``None``: 10 s).

        Raises:
            TimeoutError: the reactor did not stop within ``timeout``.
        """
        timeout = 10.0 if timeout is None else timeout
        if not self._done.is_set():
            self.reactor.callFromThread(self._shutdown)
            if not self._done.wait(timeout):
                raise TimeoutError(f"the {self._what} on port {self.port} did not stop within "
                                   f"{timeout:g} s")
        self._thread.join(timeout)
        self._stopped()
        self._close_reactor()

    def _close_reactor(self) -> None:
        # A private reactor is never used again: give back its epoll and waker descriptors,
        # or a process that starts many of them (a test suite) runs out of them.
        if self._reactor_closed:
            return
        self._reactor_closed = True
        try:
            self.reactor.waker.connectionLost(None)
            self.reactor._poller.close()
        except (AttributeError, OSError):  # another reactor type, or already closed
            pass

    @property
    def running(self) -> bool:
        """Whether the reactor's thread has not ended."""
        return not self._done.is_set()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
