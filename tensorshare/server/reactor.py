"""The server's event loop: Twisted's epoll reactor, with less Python per read event.

For every ready descriptor, the stock :meth:`EPollReactor.doPoll` runs
``log.callWithLogger(selectable, _doReadOrWrite, ...)``: it asks the selectable for its log
prefix, copies the log context and pushes it on a thread-local stack, then checks
``fileno()`` before calling ``doRead``: about a dozen Python calls around each read, which on a
small request cost a sizeable share of what the server does for it (twisted#2534 measured
15% of a UDP echo). :class:`LeanEPollReactor` calls ``doRead`` directly for a plain read event
on one of tensorshare's own transports (:mod:`.transports`), with the stock handling of what
it returns or raises; every other event (a write, a hang-up, another kind of selectable) takes
the stock path. Only the legacy log context (``twisted.python.log``'s prefix) is not set
around those reads: tensorshare logs through ``twisted.logger``, which does not use it.

The lean path leans on four privates of Twisted's epoll reactor (``_poller``, ``_selectables``,
``_doReadOrWrite``, ``_disconnectSelectable``), which any Twisted release may change. So the
server builds its reactor with :func:`make_reactor`, which first checks, once per process and
on a throwaway reactor, that they exist and behave as the lean path expects (a reader on a
socket pair is registered, polled, read through the stock path and through the lean one, and
disconnected); where they do not, the server runs Twisted's own :class:`EPollReactor` and says
why in one log line. ``setup.py`` names the Twisted releases this was verified on
(``tests/server/test_reactor.py`` runs the server's tests on the oldest as well).
"""

from __future__ import annotations

import errno
import functools
import socket
import sys
from collections.abc import Callable
from select import EPOLLIN
from typing import Any

import twisted
from twisted.internet.epollreactor import EPollReactor
from twisted.internet.error import ConnectionDone
from twisted.logger import Logger
from twisted.python import log

from .transports import FastServer, FastUnixServer

__all__ = ["LeanEPollReactor", "lean_unsupported", "make_reactor"]

_log = Logger(namespace="tensorshare.server")

# The selectables whose doRead the lean path calls directly: tensorshare's own transports.
_LEAN_TYPES = frozenset({FastServer, FastUnixServer})


class LeanEPollReactor(EPollReactor):
    """An epoll reactor whose plain read events on tensorshare's transports skip Twisted's
    per-event log context (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._in_poll = False  # handling the events of one poll (see after_poll)
        self._after: list[Callable[[], None]] = []

    def after_poll(self, work: Callable[[], None]) -> bool:
        """Run ``work`` once every event of the poll being handled now is handled, before
        the reactor polls again (no timer, no other turn of the reactor in between): a
        service's calls read from many connections in one poll go to its host as one
        batch. Returns ``False``, keeping nothing, outside the handling of a poll's events
        (the caller then does its work at once)."""
        if not self._in_poll:
            return False
        self._after.append(work)
        return True

    def doPoll(self, timeout: float | None) -> None:  # noqa: N802 (Twisted's name)
        if timeout is None:
            timeout = -1  # wait indefinitely
        try:
            events = self._poller.poll(timeout, len(self._selectables))
        except OSError as err:
            if err.errno == errno.EINTR:
                return
            raise
        selectables = self._selectables
        self._in_poll = True
        try:
            for fd, event in events:
                selectable = selectables.get(fd)
                if selectable is None:
                    continue
                if event == EPOLLIN and type(selectable) in _LEAN_TYPES:
                    self._lean_read(selectable)
                else:
                    log.callWithLogger(selectable, self._doReadOrWrite, selectable, fd, event)
        finally:
            self._in_poll = False
            if self._after:
                self._run_after()

    def _run_after(self) -> None:
        """The work :meth:`after_poll` kept, in order (a failure is logged, the rest runs)."""
        after, self._after = self._after, []
        for work in after:
            try:
                work()
            except Exception:  # application code: logged, the reactor goes on
                log.err()

    doIteration = doPoll

    def _lean_read(self, selectable: Any) -> None:
        """``doRead``, and what the stock ``_doReadOrWrite`` does with its outcome."""
        try:
            why = selectable.doRead()
        except BaseException:  # application code: logged, and the connection dropped
            why = sys.exc_info()[1]
            log.err()
        if why:
            self._disconnectSelectable(selectable, why, True)


def make_reactor() -> EPollReactor:
    """A new reactor for a server: a :class:`LeanEPollReactor` where this Twisted has what its
    lean path uses (:func:`lean_unsupported`), else Twisted's own :class:`EPollReactor`, with
    one log line saying why."""
    why = lean_unsupported()
    if why is None:
        return LeanEPollReactor()
    _log.warn("the lean reactor cannot run on Twisted {version} ({why}): running Twisted's own "
              "epoll reactor (correct, a little slower per request)",
              version=twisted.__version__, why=why)
    return EPollReactor()


@functools.cache
def lean_unsupported() -> str | None:
    """Why :class:`LeanEPollReactor` cannot run on the Twisted imported here, or ``None``
    where it can: checked once per process, on a throwaway reactor (see the module
    docstring)."""
    try:
        reactor = LeanEPollReactor()
    except Exception as e:  # (any failure is a reason)
        return f"LeanEPollReactor() raised {type(e).__name__}: {e}"
    try:
        return _check(reactor)
    except Exception as e:  # (a private gone or changed: any error)
        return f"{type(e).__name__}: {e}"
    finally:
        _close(reactor)


class _Probe:
    """A reader on one end of a socket pair, as the check drives it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reads = 0
        self.lost: Any = None
        self.done = False  # the next doRead says the connection is done

    def fileno(self) -> int:
        return self.sock.fileno()

    def logPrefix(self) -> str:  # noqa: N802 (Twisted's name)
        return "tensorshare-reactor-check"

    def doRead(self) -> Any:  # noqa: N802 (Twisted's name)
        self.sock.recv(16)
        self.reads += 1
        return ConnectionDone() if self.done else None

    def connectionLost(self, reason: Any) -> None:  # noqa: N802 (Twisted's name)
        self.lost = reason


def _check(reactor: LeanEPollReactor) -> str | None:
    """Drives a :class:`_Probe` through the privates the lean path uses (see
    :func:`lean_unsupported`)."""
    mine, theirs = socket.socketpair()
    try:
        probe = _Probe(mine)
        fd = probe.fileno()
        reactor.addReader(probe)
        if reactor._selectables.get(fd) is not probe:
            return "_selectables does not map a reader's descriptor to it"
        theirs.send(b"x")
        reactor.doIteration(0)  # (the stock path: the probe is not a lean type)
        if probe.reads != 1:
            return "_poller.poll and _doReadOrWrite did not read a readable descriptor"
        theirs.send(b"x")
        probe.done = True
        reactor._lean_read(probe)  # (which calls _disconnectSelectable)
        if probe.reads != 2 or probe.lost is None or fd in reactor._selectables:
            return "_disconnectSelectable did not remove and close a finished reader"
        return None
    finally:
        reactor.removeReader(probe)
        mine.close()
        theirs.close()


def _close(reactor: EPollReactor) -> None:
    """Give back a reactor's descriptors (its waker and its epoll)."""
    waker = getattr(reactor, "waker", None)  # (not in Twisted's types)
    try:
        if waker is not None:
            waker.connectionLost(None)
        reactor._poller.close()
    except (AttributeError, OSError):
        pass
