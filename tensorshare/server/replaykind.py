"""Replay bins: prioritized experience replay as a kind of bin (Reverb's tables, served).

Each replay bin is a :class:`~.replay.ReplayTable` (items with priorities, a sampler, a
remover, ``max_times_sampled`` and Reverb's rate limiter) whose payloads are the items as
they arrived (encoded, never decoded here). The ops (:mod:`tensorshare.wire.replay`):

* ``replay_open`` creates the bin with its configuration (a bin created without a ``seed``
  gets one the server draws, so that its samples can be replayed from the data log), or
  checks an existing bin's configuration against the one given;
* ``replay_insert`` and ``replay_sample`` each proceed whole or wait whole: while the rate
  limiter (or an empty bin) holds it, a request waits on its connection, in arrival order
  (an insert behind the inserts that wait, a sample behind the samples), until a later op
  lets it through, its ``timeout`` runs out (the error ``timeout``, nothing done) or its
  connection goes; a waiting request holds nothing else up: every other bin, and every
  other kind of request on this one, is served meanwhile;
* ``replay_update`` sets priorities by key; ``replay_info`` answers the bin's size, total
  weight and statistics.

Inserts, samples and updates are remembered for their session (exactly once across
reconnects). Items' bytes count against ``max_memory`` and their user's quota until they
leave the bin. With a data directory, each op that changed a bin is a record of the data
log and every bin is in the snapshots (:mod:`.replaylog`); the same records and snapshots
make a replica's replay bins follow its primary's (:mod:`.replication`): a replica answers
``replay_info`` and refuses the other ops (``read_only_replica``) until it is promoted.
"""

from __future__ import annotations

import fnmatch
import secrets
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import (
    BinNotFound,
    InvalidRequest,
    LimitExceeded,
    ServerError,
    WaitTimeout,
    code_for,
)
from ..wire.messages import ErrorReply
from ..wire.protocol import item_wire_size, items_header
from ..wire.replay import (
    ReplayInfo,
    ReplayInfoReply,
    ReplayInsert,
    ReplayInserted,
    ReplayOpen,
    ReplayOpened,
    ReplaySample,
    ReplaySampled,
    ReplayUpdate,
    ReplayUpdated,
)
from .kinds import Rates, check_memory, claim_name
from .replay import ReplayConfig, ReplayTable
from .replaylog import Entry, ReplayLog

if TYPE_CHECKING:
    from .parts import AnyReply, Conn, Handler, Server

__all__ = ["BIN_COST", "ITEM_COST", "ReplayBin", "ReplayKind"]

#: What one replay bin is counted as against ``max_memory`` (its trees), besides its items.
BIN_COST = 16384
#: What one item's record is counted as, besides its bytes.
ITEM_COST = 160


@dataclass(eq=False, slots=True)
class _Waiting:
    """An insert or a sample waiting for the rate limiter. ``name`` is empty (never a bin of
    the store's): the connection's cancel only marks it inactive."""

    conn: Conn
    msg: Any
    nbytes: tuple[int, ...] = ()
    name: str = ""
    active: bool = True


class ReplayBin:
    """One replay bin: its table, what waits on it, its counters for the stats."""

    __slots__ = ("changed_at", "counted", "inserts", "max_item", "name", "rates", "samples",
                 "table", "version")

    def __init__(self, name: str, table: ReplayTable) -> None:
        self.name = name
        self.table = table
        table.released = []
        self.inserts: deque[_Waiting] = deque()
        self.samples: deque[_Waiting] = deque()
        self.version = 0
        self.changed_at = time.time()
        self.counted = 0  # its cost as the kind last counted it
        self.max_item = 0  # the largest item's bytes ever inserted (a sample's reply bound)
        self.rates = Rates(2)  # inserts, samples

    @property
    def cost(self) -> int:
        """Bytes counted against ``max_memory``."""
        return BIN_COST + self.table.nbytes + ITEM_COST * len(self.table)

    def smallest_sample(self) -> int:
        """The smallest batch a waiting sample asks for (0: none waits)."""
        sizes = [w.msg.batch_size for w in self.samples if w.active]
        return min(sizes) if sizes else 0

    def describe(self, now: float, listeners: int) -> dict[str, Any]:
        """A summary for the stats (see :meth:`ReplayKind.describe`)."""
        table = self.table
        stats = table.stats()
        stats["inserts_per_s"], stats["samples_per_s"] = self.rates.per_second(now)
        stats["total_weight"] = table.total_weight()
        stats["waiting_inserts"] = sum(1 for w in self.inserts if w.active)
        stats["waiting_samples"] = sum(1 for w in self.samples if w.active)
        stats["seed"] = table.config.seed
        return {
            "kind": "replay", "n_items": len(table), "nbytes": table.nbytes,
            "version": self.version, "changed_at": self.changed_at, "ops": {},
            "bytes_in": 0, "bytes_out": 0,
            "limits": {"max_items": table.config.max_size, "max_bytes": None,
                       "overflow": table.config.remover},
            "first": None, "last": None, "waiters": stats["waiting_samples"],
            "blocked": stats["waiting_inserts"], "listeners": listeners, "replay": stats,
        }


def config_of(fields: Mapping[str, Any], seed: int | None = None) -> ReplayConfig:
    """The configuration ``fields`` give (``seed`` if they have none).

    Raises:
        InvalidRequest: an unknown field or a value out of range.
    """
    data = {k: v for k, v in fields.items() if v is not None}
    if data.get("seed") is None and seed is not None:
        data["seed"] = seed
    return ReplayConfig.from_dict(data)


class ReplayKind:
    """Replay bins on a server (see the module docstring).

    Args:
        server: the server's state (its reactor runs the timeouts).
    """

    name = "replay"

    def __init__(self, server: Server) -> None:
        self.server = server
        self.bins: dict[str, ReplayBin] = {}
        self.table = self.bins
        self._cost = 0
        self._busy: set[str] = set()  # bins with waiting requests

    def handlers(self) -> dict[type, Handler]:
        return {ReplayOpen: self._open, ReplayInsert: self._insert, ReplaySample: self._sample,
                ReplayUpdate: self._update, ReplayInfo: self._info}

    def owns(self, name: str) -> bool:
        return name in self.bins

    @property
    def nbytes(self) -> int:
        return self._cost

    def __iter__(self) -> Iterator[ReplayBin]:
        return iter(self.bins.values())

    # -- helpers ----------------------------------------------------------------------------
    def _now(self) -> float:
        return float(self.server.reactor.seconds())

    def _bin(self, name: str) -> ReplayBin:
        b = self.bins.get(name)
        if b is None:
            claim_name(self, self.server, name)
            raise BinNotFound(f"no replay bin {name!r}: replay_open creates it")
        return b

    def _recount(self, b: ReplayBin) -> None:
        cost = b.cost if self.bins.get(b.name) is b else 0
        self._cost += cost - b.counted
        b.counted = cost

    def _release(self, b: ReplayBin) -> None:
        """What the items that left the table held is no longer their users'."""
        released = b.table.released
        if released:
            for entry in released:
                if entry.usage is not None:
                    entry.usage.stored -= entry.nbytes + ITEM_COST
                    entry.usage = None
            released.clear()
        self._recount(b)

    def _changed(self, b: ReplayBin, op: str) -> None:
        b.version += 1
        b.changed_at = time.time()
        self.server.changed(b.name, op, len(b.table), b.version, 0)

    def _log(self, conn: Conn, msg: Any, header: dict[str, Any], items: Any = ()) -> None:
        """Write a change to the data log (if the server has one): ``header`` with the
        request's session and id, and ``items``."""
        p = self.server.persist
        if p is None:
            return
        ctx = conn.ctx(msg)
        if ctx is not None:
            header["s"], header["id"] = ctx
        buffers: list[Any] = []
        if items:
            header["items"] = items_header(items, buffers)
        p.add(header, buffers)

    # -- the data log (see .replaylog) ------------------------------------------------------
    def persisted(self, p: Any) -> None:
        """The server keeps a data log ``p``: replay bins are in it (called before it loads)."""
        ReplayLog(self, self.server.config.limits.max_depth).register(p)

    def adopt(self, name: str, table: ReplayTable, version: int = 0) -> ReplayBin:
        """Take a table read back from a snapshot (or a replica's full copy) as the bin
        ``name``, in place of the one of that name (its listeners are told)."""
        old = self.bins.get(name)
        b = self.bins[name] = ReplayBin(name, table)
        b.version = version
        if old is not None:
            self._recount(old)  # (no longer in the kind: it counts nothing)
        self.settle(b)
        self.server.changed(name, "put", len(table), version, 0)
        return b

    def drop(self, name: str) -> None:
        """A snapshot (a replica's full copy) has no bin ``name``: it goes (nothing waits on
        a replica's bins: their ops are refused there)."""
        b = self.bins.pop(name)
        self._recount(b)
        self._busy.discard(name)
        self.server.changed(name, "delete", 0, b.version + 1, 0)

    def settle(self, b: ReplayBin) -> None:
        """After ``b``'s table changed: what left it is released, its cost counted."""
        self._release(b)

    def applied(self, b: ReplayBin, op: str) -> None:
        """A record of the data log (a restart's replay, or a replica following its primary)
        changed ``b`` as ``op`` did: settled, its version counted, its listeners told."""
        self.settle(b)
        self._changed(b, op)

    # -- open, info, update -----------------------------------------------------------------
    def _open(self, conn: Conn, msg: ReplayOpen) -> ReplayOpened:
        b = self.bins.get(msg.bin)
        if b is not None:
            _check_same(b, msg.config)
            return ReplayOpened(msg.id, False, len(b.table), b.table.config.to_dict())
        claim_name(self, self.server, msg.bin)
        if not msg.create:
            raise BinNotFound(f"no replay bin {msg.bin!r}")
        config = config_of(msg.config, secrets.randbits(62))
        check_memory(self.server, BIN_COST, f"a new replay bin {msg.bin!r}", "created")
        self.create(msg.bin, config)
        self._log(conn, msg, {"op": "replay_open", "bin": msg.bin, "config": config.to_dict()})
        return ReplayOpened(msg.id, True, 0, config.to_dict())

    def create(self, name: str, config: ReplayConfig) -> ReplayBin:
        """Make the bin ``name`` (checked by the caller)."""
        b = self.bins[name] = ReplayBin(name, ReplayTable(config))
        self._recount(b)
        return b

    def _info(self, conn: Conn, msg: ReplayInfo) -> ReplayInfoReply:
        b = self._bin(msg.bin)
        d = b.describe(self._now(), self.server.listener_count(b.name))
        return ReplayInfoReply(msg.id, len(b.table), b.table.total_weight(), d["replay"])

    def _update(self, conn: Conn, msg: ReplayUpdate) -> ReplayUpdated:
        b = self._bin(msg.bin)
        skipped = b.table.update_priorities(msg.keys, msg.priorities)
        self._log(conn, msg, {"op": "replay_update", "bin": b.name, "keys": list(msg.keys),
                              "priorities": list(msg.priorities)})
        self._changed(b, "replay_update")
        return ReplayUpdated(msg.id, len(msg.keys) - skipped, skipped)

    # -- inserts ----------------------------------------------------------------------------
    def _insert(self, conn: Conn, msg: ReplayInsert) -> AnyReply | None:
        b = self._bin(msg.bin)
        items = msg.items
        b.table.check_insert(len(items))
        w = _Waiting(conn, msg, tuple(item_wire_size(it) for it in items))
        if any(x.active for x in b.inserts) or \
                not b.table.can_insert(len(items), b.smallest_sample()):
            return self._hold(b, w, b.inserts)
        reply = self._store(b, w)
        conn.then(lambda: self._pump(b))
        return reply

    def _store(self, b: ReplayBin, w: _Waiting) -> ReplayInserted:
        """Insert a checked insert that may proceed; its reply.

        Raises:
            QuotaExceeded, MemoryLimitExceeded: it would exceed its user's quota or the
                server's ``max_memory`` (nothing was inserted).
        """
        msg: ReplayInsert = w.msg
        table = b.table
        k = len(w.nbytes)
        incoming = sum(w.nbytes) + ITEM_COST * k
        over = len(table) + k - table.config.max_size
        if over > 0 and len(table):  # what the remover will free, about
            incoming -= min(over, k) * (table.nbytes // len(table) + ITEM_COST)
        usage = w.conn.usage
        what = f"an insert of {k} items into replay bin {b.name!r}"
        if usage is not None:
            usage.check_room(sum(w.nbytes) + ITEM_COST * k, what)
        check_memory(self.server, incoming, what, "inserted")
        entries = [Entry(it, n, usage) for it, n in zip(msg.items, w.nbytes, strict=True)]
        keys = table.insert(entries, msg.priorities, w.nbytes)
        if usage is not None:
            usage.stored += sum(w.nbytes) + ITEM_COST * k
        b.max_item = max(b.max_item, *w.nbytes)
        self._log(w.conn, msg, {"op": "replay_insert", "bin": b.name, "keys": keys,
                                "priorities": list(msg.priorities)}, msg.items)
        b.rates.count(self._now(), k, 0)
        self._release(b)
        self._changed(b, "replay_insert")
        return ReplayInserted(msg.id, tuple(keys), len(table))

    # -- samples ----------------------------------------------------------------------------
    def _sample(self, conn: Conn, msg: ReplaySample) -> AnyReply | None:
        b = self._bin(msg.bin)
        b.table.check_sample(msg.batch_size)
        self._check_reply(b, msg.batch_size)
        w = _Waiting(conn, msg)
        if any(x.active for x in b.samples) or not b.table.can_sample(msg.batch_size):
            return self._hold(b, w, b.samples)
        reply = self._draw(b, w)
        conn.then(lambda: self._pump(b))
        return reply

    def _check_reply(self, b: ReplayBin, n: int) -> None:
        limit = self.server.max_reply_bytes
        if n * b.max_item > limit:
            raise LimitExceeded(
                f"a sample of {n} items of up to {b.max_item} bytes each (the largest item "
                f"replay bin {b.name!r} was given) could exceed the most one reply carries, "
                f"{limit} bytes: sample fewer at a time; nothing was drawn")

    def _draw(self, b: ReplayBin, w: _Waiting) -> ReplaySampled:
        msg: ReplaySample = w.msg
        table = b.table
        drawn = table.sample(msg.batch_size)
        self._log(w.conn, msg, {"op": "replay_sample", "bin": b.name,
                                "batch_size": msg.batch_size, "keys": drawn.keys})
        b.rates.count(self._now(), 0, msg.batch_size)
        self._release(b)
        self._changed(b, "replay_sample")
        items = tuple(e.item for e in drawn.payloads)
        return ReplaySampled(msg.id, items, tuple(drawn.keys), tuple(drawn.probabilities),
                             drawn.sizes[0], table.total_weight(),
                             sum(e.nbytes for e in drawn.payloads))

    # -- what waits -------------------------------------------------------------------------
    def _hold(self, b: ReplayBin, w: _Waiting, queue: deque[_Waiting]) -> AnyReply | None:
        msg = w.msg
        if msg.timeout == 0:
            return ErrorReply(msg.id, WaitTimeout.code, self._why(b, w, "at once"))
        queue.append(w)
        self._busy.add(b.name)
        w.conn.wait(msg.id, w, msg.timeout, lambda: self._timed_out(b, w))
        if queue is b.samples:  # a sample the table's content holds lets inserts through
            w.conn.then(lambda: self._pump(b))
        return None

    def _why(self, b: ReplayBin, w: _Waiting, when: str) -> str:
        info = b.table.limiter.info()
        state = (f"it holds {len(b.table)} items, {info['inserts']} inserted and "
                 f"{info['samples']} sampled (samples_per_insert="
                 f"{b.table.config.samples_per_insert}, min_size_to_sample="
                 f"{b.table.config.min_size_to_sample})")
        if isinstance(w.msg, ReplayInsert):
            return (f"the rate limiter of replay bin {b.name!r} held the insert of "
                    f"{len(w.nbytes)} items {when}: {state}; nothing was inserted")
        return (f"replay bin {b.name!r} could not give a sample of {w.msg.batch_size} "
                f"{when}: {state}; nothing was drawn")

    def _timed_out(self, b: ReplayBin, w: _Waiting) -> None:
        w.active = False
        w.conn.answer(w.msg, ErrorReply(w.msg.id, WaitTimeout.code,
                                        self._why(b, w, f"for {w.msg.timeout:g} s")))
        self._pump(b)

    def _pump(self, b: ReplayBin) -> None:
        """Serve what waits on ``b`` until nothing more can go (samples and inserts each in
        arrival order)."""
        if self.bins.get(b.name) is not b or not (b.samples or b.inserts):
            self._busy.discard(b.name)
            return
        table = b.table
        moved = True
        while moved:
            moved = False
            _prune(b.samples)
            while b.samples and table.can_sample(b.samples[0].msg.batch_size):
                self._serve(b, b.samples.popleft(), self._draw)
                moved = True
                _prune(b.samples)
            _prune(b.inserts)
            while b.inserts and table.can_insert(len(b.inserts[0].nbytes), b.smallest_sample()):
                self._serve(b, b.inserts.popleft(), self._store)
                moved = True
                _prune(b.inserts)
        if not (b.samples or b.inserts):
            self._busy.discard(b.name)

    @staticmethod
    def _serve(b: ReplayBin, w: _Waiting, act: Any) -> None:
        w.active = False
        w.conn.stop_waiting(w.msg.id)
        try:
            reply = act(b, w)
        except ServerError as exc:
            reply = ErrorReply(w.msg.id, code_for(exc), str(exc))
        w.conn.answer(w.msg, reply)

    # -- connections and sessions -----------------------------------------------------------
    def refused(self, conn: Conn, op: str, header: Mapping[str, Any], why: str) -> None:
        """A refused replay request leaves nothing waiting on it."""

    def connection_lost(self, conn: Conn) -> None:
        """Its waiting requests were withdrawn (marked inactive): they leave the queues, and
        what they held up goes (a sample that waited let inserts through)."""
        for name in list(self._busy):
            b = self.bins.get(name)
            if b is not None:
                self._pump(b)

    def session_ended(self, sid: bytes) -> None:
        """Nothing of a replay bin belongs to a session (its remembered replies are the
        session table's)."""

    # -- statistics -------------------------------------------------------------------------
    def describe(self, glob: str | None) -> dict[str, dict[str, Any]]:
        """Each replay bin (matching ``glob``): the keys of every bin's summary (``kind`` is
        ``"replay"``, ``n_items`` its size, ``waiters`` the waiting samples, ``blocked`` the
        waiting inserts), and ``replay``: the table's statistics (sizes, counts, the rate
        limiter's state, the priority histogram) with inserts/s and samples/s over the last
        10 s (see docs/PROTOCOL.md, replay bins)."""
        now = self._now()
        return {name: b.describe(now, self.server.listener_count(name))
                for name, b in sorted(self.bins.items())
                if glob is None or fnmatch.fnmatchcase(name, glob)}


def _prune(queue: deque[_Waiting]) -> None:
    while queue and not queue[0].active:
        queue.popleft()


def _check_same(b: ReplayBin, fields: Mapping[str, Any]) -> None:
    """Refuse an open whose configuration is not the bin's (a seed left out matches)."""
    have = b.table.config.to_dict()
    want = config_of(fields, have["seed"]).to_dict()
    differ = sorted(k for k in have if have[k] != want[k])
    if differ:
        raise InvalidRequest(
            f"replay bin {b.name!r} exists with another configuration: "
            + ", ".join(f"{k}={have[k]!r} (asked {want[k]!r})" for k in differ))
