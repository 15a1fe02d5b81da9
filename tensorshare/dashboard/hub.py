"""The dashboard's live side: one read-only client per server, polled every tick, and the
event streams of the browsers that watch.

* :class:`Upstream`: a :class:`~tensorshare.client.twisted.TxClient` to one server, with the
  read-only token. Each tick it asks ``stats`` once (never while the last one is still
  unanswered), keeps the rates as ``tensorshare monitor`` computes them
  (:class:`~tensorshare.client.rates.Rates`) and listens to the bins it saw, so that their
  changes reach the browsers as they happen. It reconnects by itself; before the first
  handshake it starts again every :data:`RETRY` seconds.
* :class:`Hub`: the ticks, the snapshot of every server (built once per tick, encoded once
  for all streams), the coalesced change events, and the streams (:class:`Subscriber`).
* :class:`Subscriber`: one browser tab's event stream. It is the push producer of its HTTP
  request: while the browser does not read (the transport's buffer is full) nothing more is
  written, and once it reads again it gets the latest snapshot only, with its history.
  A stream paused longer than ``max_paused`` is closed (the browser reconnects by itself).

The dashboard's memory is bounded whatever browsers and servers do: the bins shown and
listened to per server (``max_bins``, :data:`MAX_LISTENS`), the history per rate, the
pending changes (one per listened bin), the streams (``max_streams``), and what is queued
per stream (one transport buffer plus one snapshot).
"""

from __future__ import annotations

import itertools
import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from .._version import __version__
from ..client.endpoint import with_token_hint
from ..client.rates import Rates
from ..client.twisted import TxClient
from ..errors import AuthenticationError, TensorShareError, UnsupportedVersion
from .snapshot import bin_rows, ops_table, relay_lag, roles, server_view

__all__ = ["MAX_LISTENS", "RETRY", "Hub", "Subscriber", "Upstream"]

log = Logger(namespace="tensorshare.dashboard")

#: The most bins of one server the dashboard listens to (changes pushed as they happen);
#: the others are updated by the ticks alone.
MAX_LISTENS = 1000
#: Seconds between attempts to reach a server that never answered yet.
RETRY = 2.0
#: Samples of a server's requests/s and MB/s kept for its charts (5 minutes at 1 s).
SERVER_HISTORY = 300
#: Samples of a bin's rates kept for its sparkline.
BIN_HISTORY = 60
#: Seconds a bin this dashboard listens to may stay empty before it stops listening (its
#: listen is what keeps a drained queue listed by the server).
LINGER = 60.0
#: Change events are sent at most this often (seconds): changes in between are coalesced,
#: the latest per bin.
CHANGE_EVERY = 0.25
#: A comment line this often (seconds) keeps proxies from closing a quiet stream.
PING_EVERY = 15.0


def server_url(text: str) -> str:
    """``HOST:PORT``, ``HOST`` or a URL as a client address (``HOST:PORT`` gets its scheme;
    a bare host the default port 8000)."""
    text = text.strip()
    if "://" in text:
        return text
    if ":" not in text.rsplit("]", 1)[-1]:
        text += ":8000"
    return f"tensorshare://{text}"


#: How the dashboard is given its token, in a refusal's message.
READ_TOKEN_HINT = ("give the dashboard the servers' read-only token with --read-token-file PATH "
                   "(or TENSORSHARE_TOKEN_FILE / TENSORSHARE_TOKEN in its environment)")


def _message(failure: Failure) -> str:
    exc = failure.value
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text


class Upstream:
    """One server the dashboard watches (see the module docstring).

    Attributes:
        reply: its last ``stats`` reply (bins cut to ``max_bins``), ``None`` before one.
        error: why it does not answer now (``None`` while it does).
        fatal: the error will not go away by retrying (a token refused, or one that may
            write): the dashboard no longer tries this server.
        read_only: whether the connection has the read-only role (``False`` on a server
            without tokens, where every connection may write; the dashboard still only reads).
        listening: the bins listened to -> when they were first seen empty (``None``: not
            empty).
    """

    def __init__(self, reactor: Any, index: int, address: str, *, token: str | None,
                 tls_ca: str | None, timeout: float, max_bins: int,
                 on_change: Callable[[int, dict[str, Any]], None]) -> None:
        self.reactor, self.index, self.address = reactor, index, server_url(address)
        self.token, self.tls_ca, self.timeout, self.max_bins = token, tls_ca, timeout, max_bins
        self.on_change = on_change
        self.client: TxClient | None = None
        self.reply: dict[str, Any] | None = None
        self.total = 0
        self.error: str | None = "connecting"
        self.down_since: float | None = None
        self.fatal = False
        self.read_only = True
        self.rates = Rates(BIN_HISTORY)
        self.ops: dict[str, dict[str, Any]] = {}
        self.history: dict[str, deque[float]] = {
            k: deque(maxlen=SERVER_HISTORY) for k in ("requests", "in", "out")}
        self.listening: dict[str, float | None] = {}
        self.polling = False
        self.first: Deferred[None] = Deferred()  # fires after the first attempt, either way
        self._before: tuple[float, dict[str, int]] | None = None
        self._retry: Any = None
        self._stopped = False

    # -- the connection ----------------------------------------------------------------------
    def start(self) -> None:
        """Connect (again), with the read-only token."""
        self._retry = None
        if self._stopped:
            return
        try:
            client = TxClient(self.reactor, self.address, timeout=self.timeout, reconnect=True,
                              tls_ca=self.tls_ca, token=self.token, session=False, shm=False,
                              name="tensorshare-dashboard")
        except (ValueError, OSError) as exc:  # a malformed address, an unreadable file
            self._fail(str(exc), fatal=True)
            return
        self.client = client
        client.start().addCallbacks(self._ready, self._start_failed)

    def _ready(self, client: TxClient) -> None:
        hello = client.session.server
        role = hello.role if hello is not None else "write"
        if role != "read" and client.endpoint.token is not None:
            # A token that may write: refused, so that no bug of the dashboard could write.
            self._fail("the token given may write; the dashboard only takes the server's "
                       "read-only token (--read-token-file)", fatal=True)
            return
        self.read_only = role == "read"
        self.error, self.down_since = None, None
        self._fired()

    def _start_failed(self, failure: Failure) -> None:
        self.client = None
        # A refused token, or no common protocol version: trying again would not help (and
        # a server slows down a peer that keeps failing to authenticate).
        fatal = failure.check(AuthenticationError, UnsupportedVersion) is not None
        message = _message(failure)
        if failure.check(AuthenticationError) is not None:  # (in the command's terms)
            message = with_token_hint(message, READ_TOKEN_HINT)
        self._fail(message, fatal=fatal)
        if not fatal and not self._stopped:
            self._retry = self.reactor.callLater(RETRY, self.start)

    def _fail(self, error: str, *, fatal: bool) -> None:
        self.error, self.fatal = error, fatal
        if self.down_since is None:
            self.down_since = time.time()
        if fatal:
            log.error("dashboard: {address}: {error}", address=self.address, error=error)
            self._close_client()
        self._fired()

    def _fired(self) -> None:
        if not self.first.called:
            self.first.callback(None)

    def _close_client(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.close()

    def stop(self) -> Deferred[None] | None:
        """Stop polling and close the connection."""
        self._stopped = True
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        client, self.client = self.client, None
        return client.close() if client is not None else None

    # -- polling -----------------------------------------------------------------------------
    def poll(self) -> Deferred[None] | None:
        """Ask ``stats`` once; ``None`` when there is nothing to wait for (not connected,
        or the last one still unanswered)."""
        c = self.client
        if c is None or self.polling:
            return None
        if not c.connected:
            if c.session.server is not None and (self.error is None or self.reply is None):
                # Connected before, reconnecting now (before the first handshake the
                # start's own outcome says what happened).
                self._fail(f"unreachable: {c.session.last_loss or 'reconnecting'}",
                           fatal=False)
            return None
        self.polling = True
        d: Deferred[Any] = c.stats()
        d.addCallbacks(self._got, self._poll_failed)
        d.addBoth(self._polled)
        return d

    def _polled(self, result: Any) -> None:
        self.polling = False

    def _poll_failed(self, failure: Failure) -> None:
        failure.trap(TensorShareError)
        self._fail(_message(failure), fatal=False)

    def _got(self, reply: dict[str, Any]) -> None:
        self.error, self.down_since = None, None
        bins = reply["bins"]
        self.total = len(bins)
        if len(bins) > self.max_bins:  # the first ones by name (the server sorts them)
            bins = dict(itertools.islice(bins.items(), self.max_bins))
            reply = {"server": reply["server"], "bins": bins}
        server = reply["server"]
        last = self.reply["server"] if self.reply is not None else None
        restarted = last is None or last["server_id"] != server["server_id"] \
            or server["uptime"] < last["uptime"]
        self.rates.update(reply)
        self.ops = ops_table(server, None if restarted else self._before)
        self._before = (server["uptime"], dict(server["requests"]))
        now = self.rates.rates.get("")
        if now is not None and self.rates.req_rate is not None:
            for key, value in (("requests", self.rates.req_rate), ("in", now["in"]),
                               ("out", now["out"])):
                self.history[key].append(round(value, 4))
        self.reply = reply
        self._sync_listens(bins, time.monotonic())

    # -- listens -----------------------------------------------------------------------------
    def _sync_listens(self, bins: dict[str, dict[str, Any]], now: float) -> None:
        """Listen to the bins that hold something (up to :data:`MAX_LISTENS`); stop
        listening to those empty for :data:`LINGER` seconds, gone, or past ``max_bins``."""
        for name, b in bins.items():
            empty = b["n_items"] == 0 and b.get("kind") not in ("stream", "service", "replay")
            if name in self.listening:
                since = self.listening[name]
                if not empty:
                    self.listening[name] = None
                elif since is None:
                    self.listening[name] = now
                elif now - since > LINGER:
                    self._unlisten(name)
            elif not empty and len(self.listening) < MAX_LISTENS:
                self._listen(name)
        for name in [n for n in self.listening if n not in bins]:
            self._unlisten(name)

    def _listen(self, name: str) -> None:
        c = self.client
        if c is None:
            return
        self.listening[name] = None

        def changed(event: dict[str, Any]) -> None:
            if event.get("op") == "delete":
                self._unlisten(name)
            self.on_change(self.index, event)

        def refused(failure: Failure) -> None:
            self.listening.pop(name, None)

        try:
            c.listen(name, changed).addErrback(refused)
        except (ValueError, TypeError):  # a name this client would not send: ticks only
            self.listening.pop(name, None)

    def _unlisten(self, name: str) -> None:
        if self.listening.pop(name, 0) == 0:
            return
        c = self.client
        if c is not None and not c.closed:
            c.unlisten(name).addErrback(lambda _: None)

    # -- the snapshot ------------------------------------------------------------------------
    def view(self, *, history: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """This server's part of a snapshot, and its bins' rows."""
        reply = self.reply
        v = server_view(self.index, self.address, reply, self.rates, self.ops,
                        up=self.error is None, error=self.error,
                        shown=len(reply["bins"]) if reply else 0, total=self.total,
                        listening=len(self.listening))
        v["read_only"] = self.read_only
        v["down_since"] = self.down_since
        if history:
            v["history"] = {k: list(d) for k, d in self.history.items()}
        rows = bin_rows(self.index, reply["bins"], self.rates, self.listening,
                        history=history) if reply else []
        return v, rows


@implementer(IPushProducer)
class Subscriber:
    """One browser tab's event stream (see the module docstring)."""

    def __init__(self, hub: Hub, request: Any) -> None:
        self.hub, self.request = hub, request
        self.paused = False
        self.paused_at = 0.0
        self.missed = False  # a tick passed while paused: send everything on resume
        self.fresh = True  # nothing sent yet: the first snapshot carries the history
        self.skipped = 0  # ticks not sent, over the stream's life
        self.closed = False

    def offer(self) -> None:
        """A new snapshot is out: send it, or remember that one was missed."""
        if self.closed:
            return
        if self.paused:
            self.missed = True
            self.skipped += 1
            if self.hub.clock() - self.paused_at > self.hub.max_paused:
                self.drop()
            return
        full = self.fresh or self.missed
        self.fresh = self.missed = False
        self.write(self.hub.encoded(full))

    def write(self, data: bytes) -> None:
        if not self.closed:
            self.request.write(data)

    def pauseProducing(self) -> None:
        if not self.paused:
            self.paused, self.paused_at = True, self.hub.clock()

    def resumeProducing(self) -> None:
        self.paused = False
        if self.missed:
            self.offer()

    def stopProducing(self) -> None:
        self.hub.remove(self)

    def drop(self) -> None:
        """Close the stream (the browser reconnects when it reads again)."""
        self.hub.remove(self)
        transport = getattr(self.request, "transport", None)
        if transport is not None:
            transport.abortConnection()

    def queued(self) -> int:
        """Bytes written to this stream and not yet sent to the browser."""
        return queued_bytes(getattr(self.request, "transport", None))


def queued_bytes(transport: Any) -> int:
    """What a Twisted TCP transport holds unsent (0 for anything else)."""
    if transport is None:
        return 0
    held = len(getattr(transport, "dataBuffer", b"")) - getattr(transport, "offset", 0)
    return max(held, 0) + int(getattr(transport, "_tempDataLen", 0))


def _event(name: str, payload: Any) -> bytes:
    # json.dumps escapes every line break inside strings: one data line per event.
    return f"event: {name}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


class Hub:
    """The ticks and the streams of one dashboard (see the module docstring).

    Args:
        reactor: the dashboard's reactor.
        upstreams: the servers watched, in the order given.
        interval: seconds between ticks.
        max_streams: event streams served at once; more get ``503``.
        max_paused: seconds a stream may stay unread before it is closed.
    """

    def __init__(self, reactor: Any, upstreams: Sequence[Upstream], *, interval: float = 1.0,
                 max_streams: int = 64, max_paused: float = 30.0) -> None:
        self.reactor, self.upstreams = reactor, list(upstreams)
        self.interval, self.max_streams, self.max_paused = interval, max_streams, max_paused
        self.subscribers: set[Subscriber] = set()
        self.seq = 0
        self._cache: dict[bool, bytes] = {}
        self._changes: dict[tuple[int, str], dict[str, Any]] = {}
        self._change_call: Any = None
        self._last_change = 0.0
        self._round = 0
        self._waiting = 0
        self._loops: list[LoopingCall] = []

    def clock(self) -> float:
        return float(self.reactor.seconds())

    def start(self) -> None:
        for u in self.upstreams:
            u.start()
        for fn, every in ((self.tick, self.interval), (self._ping, PING_EVERY)):
            loop = LoopingCall(fn)
            loop.clock = self.reactor
            loop.start(every, now=fn == self.tick).addErrback(
                lambda f: log.failure("dashboard loop failed", f))
            self._loops.append(loop)

    def stop(self) -> None:
        for loop in self._loops:
            if loop.running:
                loop.stop()
        if self._change_call is not None and self._change_call.active():
            self._change_call.cancel()
        for sub in list(self.subscribers):
            sub.drop()
        for u in self.upstreams:
            u.stop()

    # -- ticks -------------------------------------------------------------------------------
    def tick(self) -> None:
        """Ask every server once, and publish when all answered (or at the next tick, with
        the last answer of a server still thinking)."""
        if self._waiting:
            self.publish()
        self._round += 1
        this = self._round
        polls = [d for u in self.upstreams if (d := u.poll()) is not None]
        self._waiting = len(polls)
        if not polls:
            self.publish()
        for d in polls:
            d.addBoth(self._answered, this)

    def _answered(self, result: Any, round_: int) -> None:
        if round_ != self._round or not self._waiting:
            return  # a late answer of a round already published
        self._waiting -= 1
        if not self._waiting:
            self.publish()

    def publish(self) -> None:
        self._waiting = 0
        self.seq += 1
        self._cache.clear()
        for sub in list(self.subscribers):
            sub.offer()

    def snapshot(self, *, history: bool) -> dict[str, Any]:
        """What the page shows now (``history``: with each chart's and sparkline's recent
        samples, for a page that has none or missed some)."""
        servers, rows = [], []
        for u in self.upstreams:
            v, r = u.view(history=history)
            servers.append(v)
            rows.extend(r)
        related = roles([u.reply for u in self.upstreams])
        for v, (role, relay_of) in zip(servers, related, strict=True):
            v["role"], v["relay_of"] = role, relay_of
        lagging = relay_lag(rows, [of for _, of in related])
        for v in servers:
            if v["role"] == "relay":
                v["bins_behind"] = lagging.get(v["index"], 0)
        return {"seq": self.seq, "time": time.time(), "interval": self.interval,
                "version": __version__, "history": history, "servers": servers, "bins": rows}

    def encoded(self, history: bool) -> bytes:
        """This tick's snapshot as an event, encoded once for every stream."""
        data = self._cache.get(history)
        if data is None:
            data = self._cache[history] = _event("snapshot", self.snapshot(history=history))
        return data

    # -- changes -----------------------------------------------------------------------------
    def changed(self, index: int, event: dict[str, Any]) -> None:
        """A listened bin changed: send it within :data:`CHANGE_EVERY` (the latest per bin)."""
        name = event.get("bin")
        if not isinstance(name, str):
            return
        self._changes[(index, name)] = {
            "server": index, "bin": name, "op": event.get("op"),
            "n_items": event.get("n_items"), "version": event.get("version")}
        if self._change_call is None:
            wait = max(self._last_change + CHANGE_EVERY - self.clock(), 0.0)
            self._change_call = self.reactor.callLater(wait, self._send_changes)

    def _send_changes(self) -> None:
        self._change_call = None
        self._last_change = self.clock()
        changes, self._changes = list(self._changes.values()), {}
        data = _event("change", changes)
        for sub in list(self.subscribers):
            if not sub.paused:  # a paused stream gets the whole snapshot when it reads again
                sub.write(data)

    def _ping(self) -> None:
        for sub in list(self.subscribers):
            if not sub.paused:
                sub.write(b": ping\n\n")

    # -- streams -----------------------------------------------------------------------------
    def add(self, request: Any) -> Subscriber | None:
        """A new stream on ``request`` (its headers already set); ``None`` when full."""
        if len(self.subscribers) >= self.max_streams:
            return None
        sub = Subscriber(self, request)
        self.subscribers.add(sub)
        request.registerProducer(sub, True)
        request.write(b"retry: 2000\n\n")
        if self.seq:
            sub.offer()  # the latest snapshot at once
        request.notifyFinish().addBoth(lambda _: self.remove(sub))
        return sub

    def remove(self, sub: Subscriber) -> None:
        if sub.closed:
            return
        sub.closed = True
        self.subscribers.discard(sub)

    def queued_bytes(self) -> int:
        """Bytes written to every stream and not yet sent to the browsers."""
        return sum(sub.queued() for sub in self.subscribers)
