"""Snapshot records stay bounded in count and bytes for every kind of bin (server/kinds)."""

from __future__ import annotations

from tensorshare.server.kinds import SNAP_BYTES, SNAP_ITEMS, snapshot_groups
from tensorshare.server.replaylog import Entry, _records
from tensorshare.wire import codec
from tensorshare.wire.records import Item


def test_groups_close_at_the_item_count_or_the_bytes() -> None:
    small = list(range(600))
    assert [len(g) for g in snapshot_groups(small, lambda e: 8)] == [SNAP_ITEMS, SNAP_ITEMS, 88]
    big = [40 << 20] * 3  # 40 MiB each: two reach SNAP_BYTES
    assert [len(g) for g in snapshot_groups(big, lambda e: e)] == [2, 1]
    assert SNAP_BYTES == 64 << 20
    assert list(snapshot_groups([], lambda e: 0)) == []
    assert [e for g in snapshot_groups(small, lambda e: 8) for e in g] == small  # in order


def test_a_replay_bins_snapshot_records_are_bounded_in_bytes_too() -> None:
    item = Item(codec.encode(1))
    rows = [[k, 1.0, 0, 40 << 20, k] for k in range(3)]
    entries = [(r, Entry(item, 40 << 20, None)) for r in rows]  # (as if 40 MiB each)
    records = list(_records([("r", 7, {}, entries)]))
    assert records[0][0] == {"op": "replay_bin", "bin": "r", "state": {}, "version": 7}
    got = [h["rows"] for h, _ in records[1:]]
    assert [len(g) for g in got] == [2, 1]
    assert [r for g in got for r in g] == rows
    assert all(h["op"] == "replay_items" and len(h["items"]) == len(h["rows"])
               for h, _ in records[1:])
