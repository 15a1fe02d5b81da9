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
"""

from __future__ import annotations

import errno
import sys
from select import EPOLLIN
from typing import Any

from twisted.internet.epollreactor import EPollReactor
from twisted.python import log

from .transports import FastServer, FastUnixServer

__all__ = ["LeanEPollReactor"]

# The selectables whose doRead the lean path calls directly: tensorshare's own transports.
_LEAN_TYPES = frozenset({FastServer, FastUnixServer})


class LeanEPollReactor(EPollReactor):
    """An epoll reactor whose plain read events on tensorshare's transports skip Twisted's
    per-event log context (see the module docstring)."""

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
        for fd, event in events:
            selectable = selectables.get(fd)
            if selectable is None:
                continue
            if event == EPOLLIN and type(selectable) in _LEAN_TYPES:
                self._lean_read(selectable)
            else:
                log.callWithLogger(selectable, self._doReadOrWrite, selectable, fd, event)

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
