"""Listening as an async iterator: :class:`ListenEvents`, what ``AsyncClient.listen(name)``
returns.

The events are the dicts the callbacks of every client get (``{'status': 'OK', 'bin': name,
'op': 'put', 'n_items': n, 'version': v}``, one ``'resync'`` after a reconnect that missed
changes), queued between the connection and the consumer in a bounded queue: a consumer
that falls behind by more than ``max_queue`` events loses the newest ones, and gets in their
place one event ``{'status': 'OK', 'op': 'missed', 'bin': name, 'missed': n}`` saying how
many, where they would have been. Memory stays bounded whatever the consumer does.
"""

from __future__ import annotations

import asyncio
import collections
import weakref
from collections.abc import Generator
from typing import Any, Protocol

__all__ = ["DEFAULT_MAX_QUEUE", "ListenEvents"]

class Owner(Protocol):
    """What an iterator uses of its :class:`~.client.AsyncClient` (declared here, so this
    module needs nothing above it)."""

    _loop: asyncio.AbstractEventLoop | None
    _inboxes: weakref.WeakSet[Any]

    def _check_name(self, name: str) -> None: ...

    def listen(self, name: str, callback: Any = None) -> Any: ...

    def _forget_listener(self, name: str, callback: Any) -> None: ...


#: How many events a listen iterator queues at most by default.
DEFAULT_MAX_QUEUE = 1024


def missed_event(name: str, n: int) -> dict[str, Any]:
    """The event in place of ``n`` events a slow consumer did not get."""
    return {"status": "OK", "op": "missed", "bin": name, "missed": n}


class _Inbox:
    """The queue of one iterator, and the listener callback the session holds (the inbox,
    not the iterator: an iterator nobody holds any more is collected, and its collection
    unlistens)."""

    __slots__ = ("name", "max_queue", "events", "missed", "waiter", "ended", "error",
                 "__weakref__")

    def __init__(self, name: str, max_queue: int) -> None:
        self.name, self.max_queue = name, max_queue
        self.events: collections.deque[dict[str, Any]] = collections.deque()
        self.missed = 0  # events dropped since the last "missed" event was queued
        self.waiter: asyncio.Future[None] | None = None
        self.ended = False
        self.error: BaseException | None = None

    def push(self, event: dict[str, Any]) -> None:
        events = self.events
        if self.missed and len(events) < self.max_queue:
            events.append(missed_event(self.name, self.missed))
            self.missed = 0
        if len(events) < self.max_queue:
            events.append(event)
        else:
            self.missed += 1
        self._wake()

    __call__ = push

    def pop(self) -> dict[str, Any] | None:
        if self.events:
            return self.events.popleft()
        if self.missed:
            n, self.missed = self.missed, 0
            return missed_event(self.name, n)
        return None

    def end(self, error: BaseException | None) -> None:
        """No more events: the iteration stops (or raises ``error``) once the queue is
        read."""
        if not self.ended:
            self.ended, self.error = True, error
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class ListenEvents:
    """The events of bin ``name`` as an async iterator (see the module docstring).

    ``async for event in client.listen(name):`` registers the listen with the server before
    it waits for the first event, and leaving the loop (``break``, an exception, the end of
    the task) unlistens once the iterator is gone (as it is right after a loop written that
    way); ``await events.aclose()`` does it at once. ``async with client.listen(name) as
    events:`` is live before its body runs and unlistens when the block ends. Several
    iterators (and callbacks) may listen to one bin; the server is told to stop when the
    last goes. ``client.unlisten(name)`` ends every iterator of the bin.

    The iteration ends when the client is closed, and raises ``ConnectionLost`` when the
    client gave up reconnecting. Registering raises as ``Client.listen`` does
    (``PermissionDenied``, ...).

    Args:
        max_queue: the most events queued for a consumer that falls behind (default 1024);
            beyond, one ``'missed'`` event counts what was dropped.
    """

    def __init__(self, client: Owner, name: str, max_queue: int = DEFAULT_MAX_QUEUE
                 ) -> None:
        client._check_name(name)
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue must be an int of at least 1, not {max_queue!r}")
        self._client = client
        self._inbox = _Inbox(name, max_queue)
        self._state = "new"  # "starting", "live", "closed"
        self._started: asyncio.Future[None] | None = None

    @property
    def name(self) -> str:
        return self._inbox.name

    @property
    def queued(self) -> int:
        """Events waiting to be read (at most ``max_queue``)."""
        return len(self._inbox.events)

    @property
    def missed(self) -> int:
        """Events dropped since the last ``'missed'`` event was queued."""
        return self._inbox.missed

    async def start(self) -> ListenEvents:
        """Register the listen with the server (done by the first ``__anext__`` or by
        ``async with``). Idempotent."""
        if self._state == "new":
            self._state = "starting"
            loop = asyncio.get_running_loop()
            self._started = loop.create_future()
            try:
                self._client._inboxes.add(self._inbox)
                await self._client.listen(self._inbox.name, self._inbox)
            except BaseException as exc:
                self._state = "closed"
                self._client._inboxes.discard(self._inbox)
                self._started.set_exception(exc)
                self._started.exception()
                raise
            self._state = "live"
            self._started.set_result(None)
        elif self._state == "starting":
            assert self._started is not None
            await asyncio.shield(self._started)
        return self

    def __await__(self) -> Generator[Any, None, ListenEvents]:
        """``events = await client.listen(name)``: registered, then iterated later."""
        return self.start().__await__()

    def __aiter__(self) -> ListenEvents:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._state != "live":
            await self.start()
        inbox = self._inbox
        while True:
            event = inbox.pop()
            if event is not None:
                return event
            if inbox.ended or self._state == "closed":
                self._leave()
                if inbox.error is not None:
                    raise inbox.error
                raise StopAsyncIteration
            waiter = inbox.waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                inbox.waiter = None

    async def __aenter__(self) -> ListenEvents:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop listening (unlisten when this was the bin's last listener). Idempotent."""
        self._leave()

    def _leave(self) -> None:
        if self._state == "closed":
            return
        was_live = self._state in ("live", "starting")
        self._state = "closed"
        self._inbox.end(None)
        self._client._inboxes.discard(self._inbox)
        if was_live:
            self._client._forget_listener(self._inbox.name, self._inbox)

    def __del__(self) -> None:
        if getattr(self, "_state", "closed") not in ("live", "starting"):
            return
        client, inbox = self._client, self._inbox
        loop = client._loop
        if loop is None or loop.is_closed():
            return
        inbox.end(None)
        try:
            loop.call_soon_threadsafe(client._forget_listener, inbox.name, inbox)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def __repr__(self) -> str:
        return f"<ListenEvents {self._inbox.name!r} {self._state}, {self.queued} queued>"
