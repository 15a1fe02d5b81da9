"""Stream bins in the data log and the snapshots (:mod:`.persist`), for :mod:`.streams`.

Log records (``docs/PROTOCOL.md`` §15.3; those caused by a request carry its session ``s``
and ``id``, so that its reply is remembered again: exactly once across a restart or a
failover):

* ``stream_append``: ``bin``, ``producer``, ``position`` (where its first item went:
  checked), ``items``, ``samples``: a producer's append as the stream stored it;
* ``stream_read``: ``bin``, ``consumer``, ``at`` (the position it acknowledged, or nil),
  and for a read that gave items ``read`` (true), ``pos`` (the position asked, nil: the
  cursor), ``max_items``, ``max_bytes`` and ``next`` (checked): replayed on the same
  stream, the read gives the same items;
* ``stream_state``: ``bin``, ``state`` (the stream's bookkeeping, below), and, for the
  request that made the change, ``req_op`` and ``reply`` (its reply's header fields): after
  an open, an epoch's end, a join, a leave, and a lease or a stall that dropped, lost or
  detached a member;
* ``stream_remove``: ``bin``: the stream went (nobody was in it).

Snapshot records (a snapshot file, or a replica's full copy): ``stream_bin`` (``bin``,
``state``) then ``stream_items`` (``bin``, ``rows``: ``[epoch, offset, samples, mark]`` per
entry kept, from ``state.base`` on, and ``items``: the items of the rows whose ``mark`` is
0), at most :data:`~.kinds.SNAP_ITEMS` rows and about :data:`~.kinds.SNAP_BYTES` of items a record. A snapshot holds every stream: loading one
replaces them all.

A ``state`` is a map: ``settings`` (nil, or ``producers``, ``window``, ``on_lag``,
``max_stall``, ``replay``, ``device_ipc``), ``base``, ``head``, ``epoch``, ``epoch_start``,
``epoch_sent``, ``marked`` (``[producer, samples]`` pairs), ``epochs`` (``[epoch, start, end,
samples, aborted]``), ``producers`` (``[index, owner, lease, epoch, sent, hint, state]``),
``consumers`` (``[name, owner, lease, acked, cursor, state, detached, missed, reads]``),
``finished`` and ``version``; an ``owner`` is the member's session id (16 bytes) or nil (a
client without a session: it can never come back as that owner). Nothing read back is
unpickled: items are parsed and checked as items from the network, every field by type and
against the limits the streams already have.
"""

from __future__ import annotations

from collections.abc import Iterator
from operator import itemgetter
from typing import Any

from ..errors import ServerError
from ..wire.protocol import OPS, item_wire_size, items_header, parse_items
from ..wire.streams import (
    LAG_POLICIES,
    MAX_PRODUCERS,
    MAX_WINDOW,
    REPLAY_POLICIES,
    REPLY_HEADERS,
    StreamAppended,
    StreamEnded,
    StreamItems,
    StreamJoined,
    StreamOpened,
)
from .kinds import SNAP_ITEMS, KindLog, snapshot_groups
from .streambook import (
    EPOCHS_KEPT,
    MAX_CONSUMERS,
    Consumer,
    Producer,
    Settings,
    Stream,
    _Entry,
    _Epoch,
)

__all__ = ["StreamLog", "load_state", "state_of"]

_PRODUCER_STATES = ("live", "away", "gone", "done")
_CONSUMER_STATES = ("live", "away", "dropped")
#: The replies a stream op remembers, by the op whose reply parser reads them back.
REPLY_OPS = {StreamOpened: "stream_open", StreamAppended: "stream_append",
             StreamEnded: "stream_end", StreamJoined: "stream_join", StreamItems: "stream_read"}


class Orphan:
    """The owner of a member that had no session (read back: it never comes back)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<a client without a session, before a restart or a failover>"


def _owner_of(owner: Any) -> bytes | None:
    return owner if isinstance(owner, bytes) else None


def state_of(st: Stream) -> dict[str, Any]:
    """The bookkeeping of ``st`` as a ``state`` map (see the module docstring)."""
    s = st.settings
    return {
        "settings": None if s is None else {
            "producers": s.producers, "window": s.window, "on_lag": s.on_lag,
            "max_stall": s.max_stall, "replay": s.replay, "device_ipc": s.device_ipc},
        "base": st.base, "head": st.head, "epoch": st.epoch, "epoch_start": st.epoch_start,
        "epoch_sent": st.epoch_sent, "marked": [[i, n] for i, n in st.marked.items()],
        "epochs": [[e, i.start, i.end, i.samples, i.aborted] for e, i in st.epochs.items()],
        "producers": [[p.index, _owner_of(p.owner), p.lease, p.epoch, p.sent, p.hint, p.state]
                      for p in st.producers.values()],
        "consumers": [[c.name, _owner_of(c.owner), c.lease, c.acked, c.cursor, c.state,
                       c.detached, c.missed, c.reads] for c in st.consumers.values()],
        "finished": st.finished, "version": st.version,
    }


# -- reading a state back (every field checked) ---------------------------------------------
def _int(v: Any, what: str, lo: int = 0, hi: int | None = None, none: bool = False
         ) -> Any:
    if v is None and none:
        return None
    if type(v) is not int or v < lo or (hi is not None and v > hi):
        raise TypeError(f"{what!r} must be an int in [{lo}, {hi if hi is not None else ''}]")
    return v


def _num(v: Any, what: str, none: bool = False) -> Any:
    if v is None and none:
        return None
    if type(v) not in (int, float) or not 0 <= v < 1e9:
        raise TypeError(f"{what!r} must be a number of seconds")
    return float(v)


def _bool(v: Any, what: str) -> bool:
    if type(v) is not bool:
        raise TypeError(f"{what!r} must be a bool")
    return v


def _choice(v: Any, what: str, choices: tuple[str, ...]) -> str:
    if v not in choices:
        raise ValueError(f"{what!r} must be one of {choices}")
    return str(v)


def _rows(v: Any, what: str, width: int, most: int) -> list[list[Any]]:
    if not isinstance(v, list) or len(v) > most or \
            any(not isinstance(r, list) or len(r) != width for r in v):
        raise TypeError(f"{what!r} must be a list of at most {most} rows of {width}")
    return v


def _settings(d: Any) -> Settings | None:
    if d is None:
        return None
    if not isinstance(d, dict):
        raise TypeError("'settings' must be a map or nil")
    producers = _int(d["producers"], "producers", 1, MAX_PRODUCERS)
    return Settings(producers, _int(d["window"], "window", 1, MAX_WINDOW),
                    _choice(d["on_lag"], "on_lag", LAG_POLICIES),
                    _num(d.get("max_stall"), "max_stall", True),
                    _choice(d["replay"], "replay", REPLAY_POLICIES),
                    _bool(d.get("device_ipc", False), "device_ipc"))


def _owner(v: Any, orphan: Any) -> Any:
    if v is None:
        return orphan
    if not isinstance(v, bytes) or len(v) != 16:
        raise TypeError("an 'owner' must be a session id (16 bytes) or nil")
    return v


def _members(st: Stream, d: dict[str, Any], now: float, orphan: Any) -> None:
    producers: dict[int, Producer] = {}
    for i, owner, lease, epoch, sent, hint, state in _rows(d["producers"], "producers", 7,
                                                           MAX_PRODUCERS):
        i = _int(i, "index", 0, MAX_PRODUCERS - 1)
        producers[i] = Producer(i, _owner(owner, orphan), _num(lease, "lease"), now,
                                _int(epoch, "epoch"), _int(sent, "sent"),
                                _int(hint, "hint", none=True),
                                _choice(state, "state", _PRODUCER_STATES))
    consumers: dict[str, Consumer] = {}
    for row in _rows(d["consumers"], "consumers", 9, MAX_CONSUMERS):
        name, owner, lease, acked, cursor, state, detached, missed, reads = row
        if not isinstance(name, str) or not name:
            raise TypeError("a consumer's name must be a str")
        consumers[name] = Consumer(
            name, _owner(owner, orphan), _num(lease, "lease"), now,
            _int(acked, "acked", none=True), _int(cursor, "cursor", none=True),
            _choice(state, "state", _CONSUMER_STATES), _bool(detached, "detached"),
            missed=_int(missed, "missed"), reads=_int(reads, "reads"))
    st.producers, st.consumers = producers, consumers


def load_state(st: Stream, d: Any, now: float, orphan: Any) -> None:
    """Set the bookkeeping of ``st`` from a ``state`` map (its entries are the caller's:
    ``base`` and ``head`` must match them).

    Raises:
        KeyError, TypeError, ValueError: a field is missing or out of its range.
    """
    if not isinstance(d, dict):
        raise TypeError("'state' must be a map")
    epochs: dict[int, _Epoch] = {}
    for e, start, end, samples, aborted in _rows(d["epochs"], "epochs", 5, EPOCHS_KEPT + 1):
        epochs[_int(e, "epoch")] = _Epoch(_int(start, "start"), _int(end, "end", none=True),
                                          _int(samples, "samples", none=True),
                                          _bool(aborted, "aborted"))
    st.settings = _settings(d["settings"])
    st.epoch, st.epoch_start = _int(d["epoch"], "epoch"), _int(d["epoch_start"], "epoch_start")
    st.epoch_sent = _int(d["epoch_sent"], "epoch_sent")
    st.marked = {_int(i, "producer", 0, MAX_PRODUCERS - 1): _int(n, "samples")
                 for i, n in _rows(d["marked"], "marked", 2, MAX_PRODUCERS)}
    st.epochs = epochs
    st.aborted = {e for e, info in epochs.items() if info.aborted}
    _members(st, d, now, orphan)
    st.finished = _bool(d["finished"], "finished")
    st.version = max(st.version, _int(d["version"], "version"))


def _marks(d: Any) -> dict[int, _Entry]:
    """The epoch marks a ``state`` names, by position."""
    out: dict[int, _Entry] = {}
    for e, _, end, samples, aborted in _rows(d["epochs"], "epochs", 5, EPOCHS_KEPT + 1):
        if end is not None:
            out[_int(end, "end")] = _Entry(None, 0, _int(e, "epoch"),
                                           _int(samples, "samples"), 0, _bool(aborted, "aborted"))
    return out


class StreamLog(KindLog):
    """Reads the stream records back into ``kind`` (a :class:`~.streams.StreamKind`), and
    captures its streams for a snapshot."""

    def __init__(self, kind: Any, max_depth: int) -> None:
        self.kind = kind
        self.max_depth = max_depth
        self.orphan = Orphan()
        # Streams of the snapshot being loaded: name -> (state, rows, items).
        self._loading: dict[str, tuple[Any, list[Any], list[Any]]] = {}

    replies = REPLY_OPS

    def readers(self) -> dict[str, Any]:
        """The stream records' readers (see :meth:`.kinds.KindLog.register`)."""
        return {"stream_state": self._state, "stream_append": self._append,
                "stream_read": self._read, "stream_remove": self._remove,
                "stream_bin": self._bin, "stream_items": self._items}

    def register(self, p: Any) -> None:
        """Make the data log ``p`` read and write stream records; a promotion or a loaded
        log hands the streams over (``took_over``)."""
        super().register(p)
        p.kind_opened.append(self.kind.took_over)
        self.limits = p.limits

    # -- the log --------------------------------------------------------------------------
    def _stream(self, h: dict[str, Any]) -> Stream:
        st: Stream = self.named(self.kind.streams, h,
                                "a stream never described (no stream_state)")
        return st

    def _state(self, h: dict[str, Any], payload: bytearray) -> Any:
        name, d = h["bin"], h["state"]
        kind = self.kind
        st = kind.streams.get(name)
        if st is None:
            st = kind.adopt(Stream(name, kind._now()))
        if not isinstance(d, dict):
            raise TypeError("'state' must be a map")
        head, base = _int(d["head"], "head"), _int(d["base"], "base")
        marks = _marks(d)
        while st.head < head:  # (only epoch marks come without a record of their own)
            mark = marks.get(st.head)
            if mark is None:
                raise ValueError(f"position {st.head} of stream {name!r} is neither an item "
                                 f"logged before nor an epoch mark of its state")
            st.entries.append(mark)
            st.head += 1
        if st.head != head:
            raise ValueError(f"stream {name!r} is at {st.head}, its state at {head}")
        _free(st, base)
        load_state(st, d, kind._now(), self.orphan)
        kind.followed(st, None, True)
        req_op = h.get("req_op")
        if req_op is None or "reply" not in h:
            return None
        if req_op not in REPLY_OPS.values() or not isinstance(h["reply"], dict):
            raise ValueError(f"a stream_state record's reply of {req_op!r}")
        return OPS[req_op].parse_reply(h.get("id", 0), h["reply"], bytearray(), self.limits)

    def _append(self, h: dict[str, Any], payload: bytearray) -> StreamAppended:
        st = self._stream(h)
        items = parse_items(h, payload, self.max_depth)
        samples = h.get("samples") or [1] * len(items)
        if not isinstance(samples, list) or len(samples) != len(items):
            raise ValueError("a stream_append record needs one sample count per item")
        producer, position = h["producer"], h["position"]
        if producer not in st.producers or position != st.head:
            raise ValueError(f"an append of producer {producer!r} at {position!r} to stream "
                             f"{st.name!r}, whose head is {st.head}")
        entries = [(it, item_wire_size(it), _int(n, "samples")) for it, n in
                   zip(items, samples, strict=True)]
        st.append(producer, entries, self.kind._now())
        self.kind.followed(st, "append")
        return StreamAppended(h.get("id", 0), position, st.head)

    def _read(self, h: dict[str, Any], payload: bytearray) -> StreamItems | None:
        st = self._stream(h)
        c = st.consumers.get(h["consumer"])
        if c is None:
            raise ValueError(f"consumer {h['consumer']!r} is not in stream {st.name!r}")
        now = self.kind._now()
        at = _int(h.get("at"), "at", 0, st.head, none=True)
        c.state = "live"
        moved = isinstance(h.get("s"), bytes) and c.owner != h["s"]
        if moved:
            c.owner = h["s"]
        st.ack(c, at, now)
        reply = None
        if h.get("read"):
            try:
                res = st.read(c.name, _int(h.get("pos"), "pos", none=True),
                              _int(h.get("max_items"), "max_items", 1, none=True),
                              _int(h["max_bytes"], "max_bytes", 1), now)
            except ServerError as exc:
                raise ValueError(f"the logged read of stream {st.name!r} fails: {exc}") from None
            if res is None or res.next != h["next"]:
                raise ValueError(f"the read of stream {st.name!r} ends at "
                                 f"{None if res is None else res.next}, not the logged "
                                 f"{h['next']!r}")
            reply = _with_id(res, h.get("id", 0))
        self.kind.followed(st, "lag" if reply is not None and reply.missed else None, moved)
        return reply

    def _remove(self, h: dict[str, Any], payload: bytearray) -> None:
        st = self.kind.streams.get(h["bin"])
        if st is not None:
            self.kind._remove(st, logged=False)

    # -- snapshots ------------------------------------------------------------------------
    def capture(self) -> Iterator[tuple[dict[str, Any], list[Any]]]:
        """Every stream as it is now (on the server's thread); the records come from the
        writing thread (the items are immutable: only references are kept)."""
        bins = []
        for name, st in sorted(self.kind.streams.items()):
            entries = [([e.epoch, e.offset, e.n, 0 if e.item is not None else 2 if e.aborted
                         else 1], e.item, e.nbytes) for e in st.entries]
            bins.append((name, state_of(st), entries))
        return _records(bins)

    def _bin(self, h: dict[str, Any], payload: bytearray) -> None:
        if not isinstance(h["state"], dict):
            raise TypeError("'state' must be a map")
        self._loading[h["bin"]] = (h["state"], [], [])

    def _items(self, h: dict[str, Any], payload: bytearray) -> None:
        _, rows, items = self._loading[h["bin"]]
        got = parse_items(h, payload, self.max_depth) if h.get("items") is not None else []
        new = _rows(h["rows"], "rows", 4, SNAP_ITEMS)
        if sum(1 for r in new if r[3] == 0) != len(got):
            raise ValueError("a stream_items record needs one item per item row")
        rows.extend(new)
        items.extend(got)

    def loaded(self) -> None:
        """The snapshot is read: its streams replace every stream (the log replayed after it
        changes them)."""
        loading = dict(self._loading)
        self._loading.clear()
        kind, now = self.kind, self.kind._now()
        built = [_build(name, state, rows, items, now, self.orphan)
                 for name, (state, rows, items) in loading.items()]
        for st in [s for n, s in kind.streams.items() if n not in loading]:
            kind._remove(st, logged=False)
        for st in built:
            old = kind.streams.get(st.name)
            if old is not None:
                st.version = max(st.version, old.version)
                kind._remove(old, logged=False)
            kind.adopt(st)
            kind.followed(st, None, True)


def _build(name: str, state: Any, rows: list[Any], items: list[Any], now: float,
           orphan: Any) -> Stream:
    st = Stream(name, now)
    base, head = _int(state["base"], "base"), _int(state["head"], "head")
    if head != base + len(rows):
        raise ValueError(f"stream {name!r} keeps {len(rows)} entries from {base}, its head "
                         f"is {head}")
    it = iter(items)
    for epoch, offset, n, mark in rows:
        _int(mark, "mark", 0, 2)
        item = next(it) if mark == 0 else None
        nbytes = item_wire_size(item) if item is not None else 0
        st.entries.append(_Entry(item, nbytes, _int(epoch, "epoch"), _int(offset, "offset"),
                                 _int(n, "samples"), mark == 2))
        st.nbytes += nbytes
        st.n_items += item is not None
    st.base, st.head = base, head
    load_state(st, state, now, orphan)
    return st


def _free(st: Stream, base: int) -> None:
    """Free the entries of ``st`` before ``base`` (as the primary did)."""
    entries = st.entries
    while st.base < base and entries:
        e = entries.popleft()
        st.nbytes -= e.nbytes
        if e.item is not None:
            st.n_items -= 1
        st.base += 1


def _with_id(res: StreamItems, rid: int) -> StreamItems:
    return StreamItems(rid, res.items, res.first, res.next, res.epoch, res.offset,
                       res.epoch_samples, res.end, res.aborted, res.missed, res.finished)


def reply_fields(reply: Any) -> dict[str, Any]:
    """A remembered reply of a stream op as the ``reply`` of a ``stream_state`` record."""
    return REPLY_HEADERS[type(reply)](reply)


def _records(bins: list[tuple[str, dict[str, Any], list[tuple[list[int], Any, int]]]]
             ) -> Iterator[tuple[dict[str, Any], list[Any]]]:
    for name, state, entries in bins:
        yield {"op": "stream_bin", "bin": name, "state": state}, []
        for group in snapshot_groups(entries, itemgetter(2)):  # (row, item or None, nbytes)
            yield _items_record(name, [e[0] for e in group],
                                [e[1] for e in group if e[1] is not None])


def _items_record(name: str, rows: list[list[int]], items: list[Any]
                  ) -> tuple[dict[str, Any], list[Any]]:
    buffers: list[Any] = []
    h: dict[str, Any] = {"op": "stream_items", "bin": name, "rows": rows}
    if items:
        h["items"] = items_header(items, buffers)
    return h, buffers
