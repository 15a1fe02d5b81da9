"""Replay bins in the data log and the snapshots (:mod:`.persist`), for :mod:`.replaykind`.

Log records (each a request as the server executed it, with its session ``s`` and ``id`` so
that the replies are remembered again; see ``docs/PROTOCOL.md`` §12 and §15.3):

* ``replay_open``: ``bin``, ``config`` (the configuration, the seed the server drew
  included);
* ``replay_insert``: ``bin``, ``items``, ``priorities``, ``keys`` (what it gave: checked when
  replayed);
* ``replay_sample``: ``bin``, ``batch_size``, ``keys``: replayed on the same random state,
  the table draws the same items (checked);
* ``replay_update``: ``bin``, ``keys``, ``priorities``.

Snapshot records: ``replay_bin`` (``bin``, ``state``: the table's
:meth:`~.replay.ReplayTable.state` but its items, and ``version``: the bin's version) and
``replay_items`` (``bin``, ``rows``: the state's item rows, in slot order, and ``items``: their
payloads), at most :data:`~.kinds.SNAP_ITEMS` and about :data:`~.kinds.SNAP_BYTES` of items a record. A snapshot (a file, or a replica's full copy:
:mod:`.replication`) holds every replay bin: loading one replaces them all. The same rows
apply a replica's records as they arrive, so a replica's bins follow its primary's (their
versions too: each insert, sample and update counts one, as on the primary). Nothing read
back is unpickled: items are parsed and checked as items from the network, the state by
:meth:`~.replay.ReplayTable.from_state`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..wire.protocol import item_wire_size, items_header, parse_items
from ..wire.replay import ReplayInserted, ReplaySampled, ReplayUpdated
from .kinds import KindLog, snapshot_groups
from .replay import ReplayConfig, ReplayTable

__all__ = ["Entry", "ReplayLog"]


class Entry:
    """An item's payload in its table: the item, its bytes, the user it counts for."""

    __slots__ = ("item", "nbytes", "usage")

    def __init__(self, item: Any, nbytes: int, usage: Any) -> None:
        self.item = item
        self.nbytes = nbytes
        self.usage = usage


class ReplayLog(KindLog):
    """Reads the replay records back into ``kind`` (a :class:`~.replaykind.ReplayKind`), and
    captures its bins for a snapshot."""

    def __init__(self, kind: Any, max_depth: int) -> None:
        self.kind = kind
        self.max_depth = max_depth
        # Bins of the snapshot being loaded: name -> (state, rows, payloads by key, version).
        self._loading: dict[str, tuple[dict[str, Any], list[Any], dict[int, Any], int]] = {}

    replies = {ReplayInserted: "replay_insert", ReplaySampled: "replay_sample",
               ReplayUpdated: "replay_update"}

    def readers(self) -> dict[str, Any]:
        """The replay records' readers (see :meth:`.kinds.KindLog.register`)."""
        return {"replay_open": self._open, "replay_insert": self._insert,
                "replay_sample": self._sample, "replay_update": self._update,
                "replay_bin": self._bin, "replay_items": self._items}

    # -- the log --------------------------------------------------------------------------
    def _table(self, h: dict[str, Any]) -> Any:
        return self.named(self.kind.bins, h, "a replay bin that was never opened")

    def _open(self, h: dict[str, Any], payload: bytearray) -> None:
        if h["bin"] not in self.kind.bins:
            self.kind.create(h["bin"], ReplayConfig.from_dict(h["config"]))

    def _insert(self, h: dict[str, Any], payload: bytearray) -> ReplayInserted:
        b = self._table(h)
        items = parse_items(h, payload, self.max_depth)
        sizes = [item_wire_size(it) for it in items]
        keys = b.table.insert([Entry(it, n, None) for it, n in zip(items, sizes, strict=True)],
                              h["priorities"], sizes)
        if keys != h["keys"]:
            raise ValueError(f"the insert gave the keys {keys}, not the logged {h['keys']}")
        b.max_item = max(b.max_item, *sizes)
        self.kind.applied(b, "replay_insert")
        return ReplayInserted(h.get("id", 0), tuple(keys), len(b.table))

    def _sample(self, h: dict[str, Any], payload: bytearray) -> ReplaySampled:
        b = self._table(h)
        drawn = b.table.sample(h["batch_size"])
        if drawn.keys != h["keys"]:
            raise ValueError(f"the sample drew the keys {drawn.keys}, not the logged {h['keys']}")
        self.kind.applied(b, "replay_sample")
        return ReplaySampled(h.get("id", 0), tuple(e.item for e in drawn.payloads),
                             tuple(drawn.keys), tuple(drawn.probabilities), drawn.sizes[0],
                             b.table.total_weight(), sum(e.nbytes for e in drawn.payloads))

    def _update(self, h: dict[str, Any], payload: bytearray) -> ReplayUpdated:
        b = self._table(h)
        skipped = b.table.update_priorities(h["keys"], h["priorities"])
        self.kind.applied(b, "replay_update")
        return ReplayUpdated(h.get("id", 0), len(h["keys"]) - skipped, skipped)

    # -- snapshots ------------------------------------------------------------------------
    def capture(self) -> Iterator[tuple[dict[str, Any], list[Any]]]:
        """Every replay bin as it is now (on the server's thread); the records come from the
        writing thread (the items are immutable: only references are kept)."""
        bins = []
        for name, b in sorted(self.kind.bins.items()):
            state = b.table.state()
            rows = state.pop("items")
            entries = [(r, b.table.get(r[0]).payload) for r in rows]
            bins.append((name, b.version, state, entries))
        return _records(bins)

    def _bin(self, h: dict[str, Any], payload: bytearray) -> None:
        state, version = h["state"], h.get("version", 0)
        if not isinstance(state, dict):
            raise TypeError("'state' must be a map")
        if type(version) is not int or version < 0:
            raise TypeError("'version' must be an int >= 0")
        self._loading[h["bin"]] = (state, [], {}, version)

    def _items(self, h: dict[str, Any], payload: bytearray) -> None:
        _, rows, payloads, _ = self._loading[h["bin"]]
        items = parse_items(h, payload, self.max_depth)
        if not isinstance(h["rows"], list) or len(h["rows"]) != len(items):
            raise ValueError("a replay_items record needs one row per item")
        for row, it in zip(h["rows"], items, strict=True):
            rows.append(row)
            payloads[row[0]] = Entry(it, item_wire_size(it), None)

    def loaded(self) -> None:
        """The snapshot is read: its tables replace every replay bin (the log replayed after
        it changes them)."""
        loading = dict(self._loading)
        self._loading.clear()
        tables = {name: (ReplayTable.from_state(dict(state, items=rows), payloads), payloads,
                         version)
                  for name, (state, rows, payloads, version) in loading.items()}
        for name in [n for n in self.kind.bins if n not in tables]:
            self.kind.drop(name)
        for name, (table, payloads, version) in tables.items():
            b = self.kind.adopt(name, table, version)
            b.max_item = max((e.nbytes for e in payloads.values()), default=0)


def _records(bins: list[tuple[str, int, dict[str, Any], list[tuple[Any, Entry]]]]
             ) -> Iterator[tuple[dict[str, Any], list[Any]]]:
    for name, version, state, entries in bins:
        yield {"op": "replay_bin", "bin": name, "state": state, "version": version}, []
        for group in snapshot_groups(entries, _nbytes):  # (row, its Entry)
            buffers: list[Any] = []
            header = items_header([e.item for _, e in group], buffers)
            yield {"op": "replay_items", "bin": name, "rows": [r for r, _ in group],
                   "items": header}, buffers


def _nbytes(entry: tuple[Any, Entry]) -> int:
    return int(entry[1].nbytes)
