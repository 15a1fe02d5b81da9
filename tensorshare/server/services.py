"""Service bins: calls answered by hosts that take them in batches.

A caller's ``service_call`` is queued in its service; the reply to it is the answer a host
computed for it. A host's ``service_take`` gets a batch of queued calls, oldest first:

* at once when ``max_batch`` rows wait, or when the host was waiting for work (a lone caller
  never waits for a batch to fill);
* otherwise at most ``max_wait_ms`` after the oldest queued call arrived (the host came back
  from a batch and a few calls wait: a little patience makes the next batch larger).

The batch is *leased* to its host: the host's ``service_reply`` (one item per call) is split
and each item routed to its caller. If the host's connection is gone, or the lease runs out
first, the batch's calls go back to the front of the queue for another host; a late answer
is dropped. Every call is answered exactly once (an answer, ``service_failed``, or
``timeout``): a call answered is marked done and forgotten, whoever comes later.

Calls belong to their caller's session: a caller whose connection drops keeps its calls
queued, and the call it resends after reconnecting (same request id) is the same call; an
answer that comes while it is away is remembered in its session (the resend gets it). A
session that ends withdraws its calls. The queue is bounded (``max_queue``, set by the
hosts): a call to a full queue waits for room (within its timeout) or fails with
``bin_full``, as the caller chose. Calls' bytes count against ``max_memory``.

The server does not look inside the items: the host stacks the inputs and splits its output
(see :mod:`tensorshare.inference`). Services live in memory only (not in the data log).
"""

from __future__ import annotations

import fnmatch
import itertools
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from twisted.internet.interfaces import IDelayedCall

from ..errors import (
    BinFull,
    InvalidRequest,
    ServiceFailed,
    WaitTimeout,
)
from ..wire.messages import Acked, ErrorReply
from ..wire.protocol import item_wire_size
from ..wire.services import (
    DEFAULT_MAX_QUEUE,
    MAX_BATCH,
    ServiceAnswer,
    ServiceBatch,
    ServiceCall,
    ServiceReply,
    ServiceTake,
)
from .kinds import Rates, check_memory, claim_name

if TYPE_CHECKING:
    from .parts import AnyReply, Conn, Handler, Server

__all__ = ["CALL_COST", "SERVICE_COST", "Service", "ServiceKind"]

#: What one service is counted as against ``max_memory`` (its tables), besides its calls.
SERVICE_COST = 4096
#: What one call's record is counted as, besides its item.
CALL_COST = 256
#: Idle services (no call, no host) kept listed with their statistics; beyond, the longest
#: idle are forgotten.
MAX_IDLE_SERVICES = 1024


@dataclass(eq=False, slots=True)
class _Call:
    """One call, from its arrival until it is answered."""

    owner: Any  # the caller's session id, or its connection (a client without a session)
    rid: int
    item: Any
    nbytes: int
    rows: int
    at: float  # when it was queued (reactor seconds)
    attach: _Attach | None = None
    done: bool = False
    usage: Any = None  # the caller's user (its Usage), which the call counts for until done
    service: Service | None = None  # the service it counts for until done (see Service.held)


@dataclass(eq=False, slots=True)
class _Attach:
    """A call's reply slot on one connection (the waiter the connection keeps: a timeout or
    a disconnect withdraws it; ``name`` is empty, never a bin of the store's). ``conn`` is
    ``None`` once that connection is gone: the call then waits for its session to come
    back, and holds nothing of the connection meanwhile."""

    call: _Call
    conn: Conn | None
    msg: ServiceCall
    active: bool = True
    name: str = ""


@dataclass(eq=False, slots=True)
class _Take:
    """A host's take, waiting for calls. While its handler runs (``now``), a batch given to
    it at once is kept in ``batch`` (the handler returns it); later, it is answered."""

    conn: Conn
    msg: ServiceTake
    idle: bool  # the queue was empty when it came: the first call goes at once
    active: bool = True
    name: str = ""
    now: bool = True
    batch: ServiceBatch | None = None


@dataclass(eq=False, slots=True)
class _Batch:
    """Calls leased to a host."""

    id: int
    calls: list[_Call]
    conn: Conn
    timer: IDelayedCall | None = None


@dataclass(eq=False)
class Service:
    """One service bin: its queue, its hosts' takes and batches, and its statistics."""

    name: str
    max_queue: int = DEFAULT_MAX_QUEUE
    queue: deque[_Call] = field(default_factory=deque)
    room: deque[_Call] = field(default_factory=deque)  # calls waiting for room in the queue
    takes: deque[_Take] = field(default_factory=deque)
    batches: dict[int, _Batch] = field(default_factory=dict)
    hosts: dict[Any, float] = field(default_factory=dict)  # host connection -> last take
    timer: IDelayedCall | None = None
    version: int = 0  # batches answered
    changed_at: float = 0.0
    calls: int = 0
    answered: int = 0
    failed: int = 0
    timed_out: int = 0
    requeued: int = 0
    batch_rows: int = 0
    latency_sum: float = 0.0
    latency_max: float = 0.0
    rates: Rates = field(default_factory=lambda: Rates(1))  # calls answered
    counted: int = 0  # its cost as the kind last counted it
    # What its calls cost until they are done (bytes and CALL_COST each), kept as calls come
    # and finish: the cost is asked on every change, never summed over the queue.
    held: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the calls it holds (queued, waiting for room, or with a host)."""
        n = 0
        for c in self.queue:
            n += c.nbytes
        for c in self.room:
            n += c.nbytes
        for b in self.batches.values():
            for c in b.calls:
                n += c.nbytes
        return n

    @property
    def cost(self) -> int:
        """Bytes counted against ``max_memory``: its calls not yet done (queued, waiting for
        room or with a host), each its item's bytes and :data:`CALL_COST`."""
        return SERVICE_COST + self.held

    @property
    def idle(self) -> bool:
        """Nothing in it: no call, no host."""
        return not (self.queue or self.room or self.batches or self.hosts
                    or any(t.active for t in self.takes))

    def describe(self, now: float, listeners: int) -> dict[str, Any]:
        """A summary for the stats (see :meth:`ServiceKind.describe`)."""
        leased = sum(len(b.calls) for b in self.batches.values())
        return {
            "kind": "service", "n_items": len(self.queue), "nbytes": self.nbytes,
            "version": self.version, "changed_at": self.changed_at, "ops": {},
            "bytes_in": 0, "bytes_out": 0,
            "limits": {"max_items": self.max_queue, "max_bytes": None, "overflow": "block"},
            "first": None, "last": None,
            "waiters": sum(1 for t in self.takes if t.active), "blocked": len(self.room),
            "listeners": listeners,
            "service": {
                "queue": len(self.queue), "waiting_for_room": len(self.room),
                "with_hosts": leased, "hosts": len(self.hosts), "max_queue": self.max_queue,
                "calls": self.calls, "answered": self.answered, "failed": self.failed,
                "timed_out": self.timed_out, "requeued": self.requeued,
                "batches": self.version,
                "mean_batch": round(self.batch_rows / self.version, 2) if self.version else 0.0,
                "calls_per_s": self.rates.per_second(now)[0],
                "latency_mean_ms": round(1e3 * self.latency_sum / self.answered, 3)
                if self.answered else 0.0,
                "latency_max_ms": round(1e3 * self.latency_max, 3),
            },
        }


class ServiceKind:
    """Service bins on a server (see the module docstring).

    Args:
        server: the server's state (its reactor runs the batch and lease timers).
    """

    name = "service"

    def __init__(self, server: Server) -> None:
        self.server = server
        self.services: dict[str, Service] = {}
        self.table = self.services
        self._calls: dict[tuple[Any, int], _Call] = {}  # (owner, request id) -> call
        # What a session's or a connection's end concerns, so that it looks at those calls
        # and services only (never at every service): the calls of each owner, and the
        # services each connection took batches from. And the cost of every service
        # together, kept as each changes (it is asked on every write).
        self._owned: dict[Any, dict[int, _Call]] = {}
        self._hosting: dict[Any, set[str]] = {}
        self._cost = 0
        self._batch_ids = itertools.count(1)
        self._idle: dict[str, None] = {}  # idle services, the longest idle first
        self._pending: dict[str, Service] = {}  # services pumped at the poll's end

    def handlers(self) -> dict[type, Handler]:
        return {ServiceCall: self._call, ServiceTake: self._take, ServiceReply: self._reply}

    def owns(self, name: str) -> bool:
        return name in self.services

    @property
    def nbytes(self) -> int:
        return self._cost

    def _recount(self, svc: Service) -> None:
        cost = svc.cost if self.services.get(svc.name) is svc else 0
        self._cost += cost - svc.counted
        svc.counted = cost

    # -- helpers ----------------------------------------------------------------------------
    def _now(self) -> float:
        return float(self.server.reactor.seconds())

    @staticmethod
    def _owner(conn: Conn) -> Any:
        return conn.session.id if conn.session is not None else conn

    def _service(self, name: str) -> Service:
        """The service ``name``, made if needed.

        Raises:
            InvalidRequest: the name is a bin of another kind.
            MemoryLimitExceeded: a new service would exceed ``max_memory``.
        """
        svc = self.services.get(name)
        if svc is not None:
            self._idle.pop(name, None)
            return svc
        claim_name(self, self.server, name)
        check_memory(self.server, SERVICE_COST, f"a new service {name!r}", "queued")
        svc = self.services[name] = Service(name, changed_at=time.time())
        return svc

    def _forget_if_idle(self, svc: Service) -> None:
        """A service with nothing in it stays listed (its statistics too, for ``ls`` and the
        metrics) until more than :data:`MAX_IDLE_SERVICES` are idle: the oldest go first."""
        self._recount(svc)
        if not svc.idle or self.services.get(svc.name) is not svc:
            return
        if svc.timer is not None and svc.timer.active():
            svc.timer.cancel()
        svc.timer = None
        idle = self._idle
        idle.pop(svc.name, None)
        idle[svc.name] = None
        while len(idle) > MAX_IDLE_SERVICES:
            name = next(iter(idle))
            del idle[name]
            old = self.services.get(name)
            if old is not None and old.idle:
                del self.services[name]
                self._recount(old)

    # -- callers ----------------------------------------------------------------------------
    def _call(self, conn: Conn, msg: ServiceCall) -> None:
        """Queue a call (answered later, when a host answers it)."""
        owner = self._owner(conn)
        old = self._calls.get((owner, msg.id))
        if old is not None:  # resent after a reconnect: the same call, now on this connection
            self._attach(old, conn, msg)
            return
        svc = self._service(msg.bin)
        nbytes = item_wire_size(msg.item)
        full = len(svc.queue) >= svc.max_queue
        if full and (not msg.wait_room or msg.timeout == 0 or len(svc.room) >= svc.max_queue):
            raise BinFull(f"service {svc.name!r} has {len(svc.queue)} calls queued, its "
                          f"max_queue={svc.max_queue}; the call was not queued")
        usage = conn.usage  # its user's quota first, then the server's memory
        if usage is not None:
            usage.check_room(nbytes + CALL_COST, f"a call to service {svc.name!r}")
        check_memory(self.server, nbytes + CALL_COST, f"a call to service {svc.name!r}", "queued")
        c = _Call(owner, msg.id, msg.item, nbytes, msg.rows, self._now(), usage=usage,
                  service=svc)
        svc.held += nbytes + CALL_COST
        if usage is not None:
            usage.stored += nbytes + CALL_COST
        self._attach(c, conn, msg)
        self._calls[(owner, msg.id)] = c
        self._owned.setdefault(owner, {})[msg.id] = c
        svc.calls += 1
        (svc.room if full else svc.queue).append(c)
        if not (svc.takes and self._after_poll(svc)):
            self._pump(svc)

    def _after_poll(self, svc: Service) -> bool:
        """A call came while a host's take waits: it goes to the host once every event of
        the reactor's poll being handled is handled, with every call read in that poll
        (from any connection), as one batch; ``False`` where the reactor keeps no work for
        the end of its poll (the call goes at once, as alone)."""
        self._recount(svc)
        pending = self._pending
        if not pending:
            after = getattr(self.server.reactor, "after_poll", None)
            if after is None or not after(self._pump_pending):
                return False
        pending[svc.name] = svc
        return True

    def _pump_pending(self) -> None:
        """The end of a poll: the services whose calls waited for it give their batches."""
        pending, self._pending = self._pending, {}
        for svc in pending.values():
            if self.services.get(svc.name) is svc:
                self._pump(svc)

    def _attach(self, c: _Call, conn: Conn, msg: ServiceCall) -> None:
        """Make ``conn`` the connection that gets the call's answer."""
        old = c.attach
        if old is not None and old.active and old.conn is not None:
            old.active = False
            old.conn.stop_waiting(old.msg.id)
        a = c.attach = _Attach(c, conn, msg)
        conn.wait(msg.id, a, msg.timeout, lambda: self._timed_out(a))

    def _timed_out(self, a: _Attach) -> None:
        c = a.call
        a.active = False
        if c.done or a.conn is None:
            return
        svc = self.services.get(a.msg.bin)
        if svc is not None:
            svc.timed_out += 1
            self._unqueue(svc, c)
        self._finish(c)
        where = "a host had it" if svc is not None and self._leased(svc, c) else \
            "no host took it"
        a.conn.answer(a.msg, ErrorReply(a.msg.id, WaitTimeout.code, (
            f"service {a.msg.bin!r} did not answer the call within {a.msg.timeout:g} s "
            f"({where}); this call gets no other answer")))
        if svc is not None:
            self._pump(svc)
            self._forget_if_idle(svc)

    @staticmethod
    def _leased(svc: Service, c: _Call) -> bool:
        return any(c in b.calls for b in svc.batches.values())

    def _unqueue(self, svc: Service, c: _Call) -> None:
        for q in (svc.queue, svc.room):
            try:
                q.remove(c)
                return
            except ValueError:
                pass

    def _finish(self, c: _Call) -> None:
        c.done = True
        svc = c.service
        if svc is not None:  # (it costs its service nothing from now on)
            svc.held -= c.nbytes + CALL_COST
            c.service = None
        if self._calls.pop((c.owner, c.rid), None) is not None:
            owned = self._owned.get(c.owner)
            if owned is not None:
                owned.pop(c.rid, None)
                if not owned:
                    del self._owned[c.owner]
        if c.usage is not None:  # answered, failed or given up: no longer its caller's
            c.usage.stored -= c.nbytes + CALL_COST
            c.usage = None

    def _deliver(self, c: _Call, reply: Any) -> None:
        """Answer a call once: on its connection, else in its session (the resend gets it)."""
        if c.done:
            return
        self._finish(c)
        a = c.attach
        if a is not None and a.active and a.conn is not None and not a.conn.closed:
            a.active = False
            a.conn.stop_waiting(a.msg.id)
            a.conn.answer(a.msg, reply)
            return
        if isinstance(c.owner, bytes):
            s = self.server.sessions.get(c.owner)
            if s is not None and s.lookup(c.rid) is None:
                held = sum(item_wire_size(it) for it in getattr(reply, "items", ()))
                self.server.sessions.remember(s, c.rid, reply, None, held)

    # -- hosts ------------------------------------------------------------------------------
    def _take(self, conn: Conn, msg: ServiceTake) -> AnyReply | None:
        svc = self._service(msg.bin)
        if msg.max_queue is not None:
            svc.max_queue = msg.max_queue
        svc.hosts[conn] = self._now()
        self._hosting.setdefault(conn, set()).add(svc.name)
        t = _Take(conn, msg, idle=not svc.queue)
        svc.takes.append(t)
        try:
            self._pump(svc)  # (a batch given to it now is kept in t.batch)
        finally:
            t.now = False
        if t.batch is not None:
            return t.batch  # at once
        if msg.timeout == 0:
            t.active = False
            svc.takes.remove(t)
            return ErrorReply(msg.id, WaitTimeout.code, f"no call queued in service {svc.name!r}")
        conn.wait(msg.id, t, msg.timeout, lambda: self._take_out(svc, t))
        return None

    def _take_out(self, svc: Service, t: _Take) -> None:
        t.active = False
        try:
            svc.takes.remove(t)
        except ValueError:
            pass
        t.conn.answer(t.msg, ErrorReply(t.msg.id, WaitTimeout.code, (
            f"no call came to service {svc.name!r} within {t.msg.timeout:g} s")))

    def _reply(self, conn: Conn, msg: ServiceReply) -> Acked | ErrorReply:
        svc = self.services.get(msg.bin)
        b = None if svc is None else svc.batches.get(msg.batch)
        if svc is None or b is None or b.conn is not conn:
            # Its lease ran out (or its connection dropped) and its calls went back to the
            # queue: this late answer is dropped (no call is answered twice).
            return Acked(msg.id, False)
        self._close(svc, b)
        now = self._now()
        items = msg.items
        reply: Acked | ErrorReply = Acked(msg.id, True)
        if msg.error is None and len(items) != len(b.calls):
            why = (f"the host answered {len(items)} items for a batch of {len(b.calls)} "
                   f"calls")
            self._fail(svc, b.calls, why, now)
            reply = ErrorReply(msg.id, InvalidRequest.code,
                               f"{why}: service_reply carries one item per call, in the "
                               f"batch's order; its calls failed")
        elif msg.error is not None:
            self._fail(svc, b.calls, f"the host failed: {msg.error}", now)
        else:
            gathering = self._gather(b.calls)
            try:
                self._answer_all(svc, b, msg, now)
            finally:
                for caller in gathering:
                    caller.flush()
        self._done(svc, b)
        conn.then(lambda: self._settle(svc))  # (after its reply: batches for waiting takes)
        return reply

    def _answer_all(self, svc: Service, b: _Batch, msg: ServiceReply, now: float) -> None:
        """Each call of ``b`` gets its item of the host's ``service_reply`` (or fails)."""
        answered = 0
        failed = dict(msg.failed)
        for i, (c, it) in enumerate(zip(b.calls, msg.items, strict=True)):
            bad = failed.get(i)
            if bad is not None:
                self._fail(svc, [c], f"the host failed this call: {bad}", now)
                continue
            if not c.done:
                self._latency(svc, now - c.at)
                answered += 1
            self._deliver(c, ServiceAnswer(c.rid, (it,), msg.version))
        svc.answered += answered
        svc.rates.count(now, answered)

    @staticmethod
    def _gather(calls: list[_Call]) -> list[Conn]:
        """The callers' connections, each gathering what is sent to it until flushed: the
        answers of one batch to one caller leave in one write, in the pass that read them."""
        gathering: list[Conn] = []
        for c in calls:
            a = c.attach
            if a is not None and a.active and a.conn is not None and a.conn.gather():
                gathering.append(a.conn)
        return gathering

    def refused(self, conn: Conn, op: str, header: Mapping[str, Any], why: str) -> None:
        """A ``service_reply`` of ``conn`` was refused before it was parsed (too many items,
        a field of the wrong type, a frame too large): if it names a batch that ``conn``
        holds, every call of that batch fails (``service_failed``), as a reply with another
        number of items makes them."""
        name, bid = header.get("bin"), header.get("batch")
        if op != "service_reply" or not isinstance(name, str) or type(bid) is not int:
            return
        svc = self.services.get(name)
        b = None if svc is None else svc.batches.get(bid)
        if svc is None or b is None or b.conn is not conn:
            return
        self._close(svc, b)
        self._fail(svc, b.calls, f"the host's service_reply was refused: {why}", self._now())
        self._done(svc, b)
        self._settle(svc)

    @staticmethod
    def _close(svc: Service, b: _Batch) -> None:
        """``b`` is answered (or failed): no longer leased."""
        del svc.batches[b.id]
        if b.timer is not None and b.timer.active():
            b.timer.cancel()

    @staticmethod
    def _done(svc: Service, b: _Batch) -> None:
        svc.version += 1
        svc.batch_rows += sum(c.rows for c in b.calls)
        svc.changed_at = time.time()

    def _settle(self, svc: Service) -> None:
        """After a batch was answered: give waiting hosts what is due; forget an idle service."""
        self._pump(svc)
        self._forget_if_idle(svc)

    def _fail(self, svc: Service, calls: list[_Call], why: str, now: float) -> None:
        for c in calls:
            if not c.done:
                svc.failed += 1
                rid = c.attach.msg.id if c.attach is not None else c.rid
                self._deliver(c, ErrorReply(rid, ServiceFailed.code,
                                            f"service {svc.name!r}: {why}"))

    @staticmethod
    def _latency(svc: Service, seconds: float) -> None:
        svc.latency_sum += seconds
        if seconds > svc.latency_max:
            svc.latency_max = seconds

    # -- batching ---------------------------------------------------------------------------
    def _pump(self, svc: Service) -> None:
        """Give waiting hosts the batches that are due; keep the timer for the next one (and
        the count of what the service costs)."""
        self._give_due(svc)
        self._recount(svc)

    def _give_due(self, svc: Service) -> None:
        while svc.room and len(svc.queue) < svc.max_queue:
            svc.queue.append(svc.room.popleft())
        now = self._now()
        while svc.queue:
            while svc.takes and not svc.takes[0].active:
                svc.takes.popleft()
            if not svc.takes:
                break
            self._drop_cancelled(svc)
            if not svc.queue:
                break
            t = svc.takes[0]
            due = svc.queue[0].at + t.msg.max_wait_ms / 1e3
            if not (t.idle or now >= due or self._rows(svc, t.msg.max_batch)):
                self._wake_at(svc, due)
                return
            svc.takes.popleft()
            self._give(svc, t, now)
        if svc.timer is not None and svc.timer.active():
            svc.timer.cancel()
        svc.timer = None

    @staticmethod
    def _rows(svc: Service, max_batch: int) -> bool:
        """Whether ``max_batch`` rows are queued."""
        n = 0
        for c in svc.queue:
            n += c.rows
            if n >= max_batch:
                return True
        return False

    def _drop_cancelled(self, svc: Service) -> None:
        """Drop the calls at the head that are done, or that their caller withdrew (a cancel:
        its slot is gone while its connection is open; the calls of a closed connection wait
        for their session to come back)."""
        q = svc.queue
        while q:
            c = q[0]
            a = c.attach
            if not c.done and (a is None or a.active or a.conn is None or a.conn.closed):
                return
            q.popleft()
            if not c.done:
                self._finish(c)

    def _give(self, svc: Service, t: _Take, now: float) -> None:
        """Lease the oldest calls (up to ``max_batch`` rows and one reply's bytes) to ``t``."""
        t.active = False
        calls: list[_Call] = []
        rows = nbytes = 0
        limit = self.server.max_reply_bytes
        q = svc.queue
        while q and len(calls) < MAX_BATCH:
            c = q[0]
            if calls and (rows + c.rows > t.msg.max_batch or nbytes + c.nbytes > limit):
                break
            q.popleft()
            if c.done:
                continue
            calls.append(c)
            rows += c.rows
            nbytes += c.nbytes
        if not calls:  # all withdrawn meanwhile: the take waits again
            t.active = True
            svc.takes.appendleft(t)
            return
        b = _Batch(next(self._batch_ids), calls, t.conn)
        svc.batches[b.id] = b
        b.timer = self.server.reactor.callLater(t.msg.lease, self._lease_out, svc, b.id)
        svc.hosts[t.conn] = now
        batch = ServiceBatch(t.msg.id, b.id, tuple(c.item for c in calls),
                             tuple(c.rows for c in calls))
        if t.now:  # the take being handled: its handler returns it
            t.batch = batch
            return
        t.conn.stop_waiting(t.msg.id)
        t.conn.answer(t.msg, batch)

    def _wake_at(self, svc: Service, due: float) -> None:
        timer = svc.timer
        if timer is not None and timer.active():
            if abs(timer.getTime() - due) < 1e-4:
                return
            timer.cancel()
        reactor = self.server.reactor
        svc.timer = reactor.callLater(max(due - reactor.seconds(), 0.0), self._due, svc)

    def _due(self, svc: Service) -> None:
        svc.timer = None
        self._pump(svc)

    def _lease_out(self, svc: Service, bid: int) -> None:
        b = svc.batches.pop(bid, None)
        if b is not None:
            self._requeue(svc, b)
            self._pump(svc)

    def _requeue(self, svc: Service, b: _Batch) -> None:
        """A batch's host is gone or late: its calls go back to the front of the queue."""
        if b.timer is not None and b.timer.active():
            b.timer.cancel()
        back = [c for c in b.calls if not c.done]
        svc.requeued += len(back)
        svc.queue.extendleft(reversed(back))

    # -- connections and sessions -----------------------------------------------------------
    def connection_lost(self, conn: Conn) -> None:
        """A host's takes and batches leave with its connection (the batches' calls go back
        to the queue); so do the calls of a caller without a session. A session's calls wait
        for it to come back (or to end), holding nothing of the connection."""
        touched = set(self._hosting.pop(conn, ()))
        for name in touched:
            svc = self.services.get(name)
            if svc is None:
                continue
            svc.hosts.pop(conn, None)
            for t in svc.takes:
                if t.conn is conn:
                    t.active = False
            svc.takes = deque(t for t in svc.takes if t.active)
            for bid in [bid for bid, b in svc.batches.items() if b.conn is conn]:
                self._requeue(svc, svc.batches.pop(bid))
        s = conn.session
        if s is not None:
            for c in self._owned.get(s.id, {}).values():
                a = c.attach
                if a is not None and a.conn is conn:
                    a.active = False
                    a.conn = None
        touched |= self._withdraw_all(conn)
        for name in touched:
            svc = self.services.get(name)
            if svc is not None:
                self._pump(svc)
                self._forget_if_idle(svc)

    def session_ended(self, sid: bytes) -> None:
        for name in self._withdraw_all(sid):
            svc = self.services.get(name)
            if svc is not None:
                self._forget_if_idle(svc)

    def _withdraw_all(self, owner: Any) -> set[str]:
        """Withdraw every call of ``owner``; returns the services they were in."""
        calls = list(self._owned.pop(owner, {}).values())
        for c in calls:
            self._withdraw(c)
        return {c.attach.msg.bin for c in calls if c.attach is not None}

    def _withdraw(self, c: _Call) -> None:
        self._finish(c)
        if c.attach is not None:  # (always: a call is attached as it arrives)
            svc = self.services.get(c.attach.msg.bin)
            if svc is not None:
                self._unqueue(svc, c)
            return
        for svc in self.services.values():
            self._unqueue(svc, c)

    # -- statistics -------------------------------------------------------------------------
    def describe(self, glob: str | None) -> dict[str, dict[str, Any]]:
        """Each service (matching ``glob``): the keys of every bin's summary (``kind`` is
        ``"service"``, ``n_items`` counts the queued calls, ``waiters`` the hosts' waiting
        takes, ``blocked`` the calls waiting for room), and ``service``: its queue, hosts,
        calls answered, failed and timed out, calls/s over the last 10 s, mean batch rows
        and latency (see docs/PROTOCOL.md, service bins)."""
        now = self._now()
        return {name: svc.describe(now, self.server.listener_count(name))
                for name, svc in sorted(self.services.items())
                if glob is None or fnmatch.fnmatchcase(name, glob)}

    def __iter__(self) -> Iterator[Service]:
        return iter(self.services.values())
