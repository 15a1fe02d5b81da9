"""Persistence: what the server held comes back after a restart, exactly.

A ServerFactory on a fake clock with a data directory (tmp_path) is driven through every kind
of effect; a second factory then loads the same directory and must hold the same state:
bins, items, tags, versions, limits, and the sessions' remembered replies. Damaged files are
handled as documented: a record cut short at the end is cut off with a warning; anything
else refuses to start, naming the file and offset.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.testing import MemoryReactorClock

from tensorshare.server import ServerConfig
from tensorshare.server.core import ServerFactory
from tensorshare.server.persist import DataError
from tensorshare.wire import codec
from tensorshare.wire.messages import (
    Acked,
    Append,
    Cancel,
    Configure,
    Fetched,
    Item,
    Ping,
    Put,
    Stored,
)
from tensorshare.wire.protocol import AckInfo
from tests.rawwire import Get
from tests.server.test_connection import Peer, values

SID = b"P" * 16
OTHER = b"Q" * 16


def factory_at(path: Path, **kw: Any) -> ServerFactory:
    kw.setdefault("fsync", "always")
    return ServerFactory(MemoryReactorClock(), config=ServerConfig(data_dir=str(path), **kw))


def state(f: ServerFactory) -> dict[str, Any]:
    """Everything that must survive a restart, as plain values."""
    store = f.store
    bins = {}
    for name, version, cfg, drops in store.metas():
        d = store.describe(name)
        items = []
        for item, _, tag in (next((e for n, _, _, e in store.entries() if n == name), [])):
            items.append((codec.decode(item.value), tag))
        bins[name] = (version, cfg, drops, d["kind"], items)
    sessions = {}
    for s in f.sessions:
        replies = {}
        for rid, reply, held_bin, held in s.remembered():
            if isinstance(reply, Fetched):
                replies[rid] = ("fetched", reply.kind, [codec.decode(i.value) for i in reply.items],
                                reply.version, reply.n_items, held_bin, held)
            else:
                replies[rid] = (type(reply).__name__, reply)
        sessions[s.id] = replies
    return {"bins": bins, "sessions": sessions, "held": f.sessions.held,
            "nbytes": store.nbytes}


def restart(f: ServerFactory, path: Path, **kw: Any) -> ServerFactory:
    """Stop ``f`` the way a SIGKILL would (no final snapshot), then load the directory."""
    assert f.persist is not None
    f.persist._close_fd()  # the log is written (fsync always); nothing else happens
    f.persist.close()
    f.persist = None
    return factory_at(path, **kw)


def busy_history(f: ServerFactory) -> None:
    """Every kind of effect, with sessions, waiters and a blocked append."""
    writer = Peer(f, session=OTHER)
    peer = Peer(f, session=SID)
    for i in range(6):
        writer.request(Append(writer.rid(), "q", Item(codec.encode(i), i)))
    writer.put("v", {"w": [1.5, 2.5]})
    # A get with min_tag drops stale items; the reply stays remembered (no ack yet).
    assert values(peer.request(Get(peer.rid(), "q", max_items=2, min_tag=2))) == [2, 3]
    # A waiting get, served later by an append (its effect comes after the append's).
    waiting = peer.rid()
    peer.send(Get(waiting, "later", wait=True, timeout=None))
    writer.request(Append(writer.rid(), "later", Item(codec.encode("x"))))
    assert values(peer.received()[0]) == ["x"]
    # A bounded bin: drop_oldest, then block with an append waiting for room.
    rid = writer.rid()
    writer.request(Configure(rid, "b", 2, None, "drop_oldest"))
    for i in range(4):
        writer.request(Append(writer.rid(), "b", Item(codec.encode(i))))
    writer.request(Configure(writer.rid(), "blk", 1, None, "block"))
    writer.request(Append(writer.rid(), "blk", Item(codec.encode("first"))))
    blocked = writer.rid()
    writer.send(Append(blocked, "blk", Item(codec.encode("second")), 30.0))
    assert writer.received() == []
    assert values(peer.request(Get(peer.rid(), "blk"))) == ["first"]
    (stored,) = writer.received()
    assert type(stored) is Stored and stored.id == blocked
    # A get the client gives up on: cancelled, its items go back.
    give_up = peer.rid()
    assert values(peer.request(Get(give_up, "q", max_items=1))) == [4]
    cancel = peer.rid()
    assert peer.request(Cancel(cancel, give_up)) == Acked(cancel, True)
    # An ack that releases a get's items for good.
    got = peer.rid()
    assert values(peer.request(Get(got, "v"))) == [{"w": [1.5, 2.5]}]
    peer.write(peer.conn.frame(Ping(peer.rid()), AckInfo(got, (waiting,))))
    peer.received()
    writer.request(Put(writer.rid(), "v", Item(codec.encode("again"))))
    f.commit()


def test_a_restart_brings_back_exactly_what_was_there(tmp_path: Path) -> None:
    f = factory_at(tmp_path)
    busy_history(f)
    before = state(f)
    assert before["sessions"][SID] and before["held"] > 0
    g = restart(f, tmp_path)
    assert g.loaded is not None and g.loaded.snapshot is None and g.loaded.records > 20
    assert state(g) == before
    assert g.server_id == f.server_id  # clients can tell: the same data set


def test_a_snapshot_plus_the_log_after_it_is_the_same(tmp_path: Path) -> None:
    f = factory_at(tmp_path)
    busy_history(f)
    f.snapshot(wait=True)
    # More history after the snapshot, in the new log segment.
    w = Peer(f)
    w.request(Append(w.rid(), "q", Item(codec.encode("tail"), 99)))
    f.commit()
    before = state(f)
    names = sorted(os.listdir(tmp_path))
    assert [n for n in names if n.startswith("snapshot-")] == ["snapshot-000000000001.tss"]
    assert [n for n in names if n.startswith("log-")] == ["log-000000000002.tsl"]
    g = restart(f, tmp_path)
    assert g.loaded is not None and g.loaded.snapshot is not None
    assert g.loaded.records == 1
    assert state(g) == before


def test_a_min_version_is_kept_across_a_restart(tmp_path: Path) -> None:
    f = factory_at(tmp_path)
    w = Peer(f)
    assert w.request(Put(w.rid(), "v", Item(codec.encode(1)), 40)).version == 40
    assert w.request(Append(w.rid(), "q", Item(codec.encode(1)), None, (), 9)).version == 9
    assert w.request(Append(w.rid(), "q", Item(codec.encode(2)), None, (), 3)).version == 10
    # A blocked append keeps its min_version until it is stored.
    w.request(Configure(w.rid(), "blk", 1, None, "block"))
    w.request(Append(w.rid(), "blk", Item(codec.encode("first"))))
    blocked = w.rid()
    w.send(Append(blocked, "blk", Item(codec.encode("second")), 30.0, (), 50))
    assert w.received() == []
    w.send(Get(w.rid(), "blk"))
    stored, got = w.received()  # the get made room: the blocked append is stored
    assert values(got) == ["first"]
    assert type(stored) is Stored and stored.id == blocked and stored.version == 50
    f.commit()
    before = state(f)
    g = restart(f, tmp_path)
    assert state(g) == before
    assert [(n, v) for n, v, _, _ in g.store.metas() if n in ("v", "q", "blk")] == \
        [("v", 40), ("q", 10), ("blk", 50)]


def test_resumed_sessions_answer_from_memory_after_a_restart(tmp_path: Path) -> None:
    f = factory_at(tmp_path)
    peer = Peer(f, session=SID)
    rid = peer.rid()
    frame = peer.conn.frame(Append(rid, "q", Item(codec.encode(1))))
    peer.write(frame)
    (first,) = peer.received()
    f.commit()
    g = restart(f, tmp_path)
    again = Peer(g, session=SID, resume=True, conn=peer.conn)
    assert again.hello is not None and again.hello.resumed
    again.conn.ops[rid] = "append"
    again.write(frame)
    (second,) = again.received()
    assert second == first and g.store.n_items("q") == 1


def test_a_restarted_sessions_unacknowledged_gets_go_back_when_it_expires(
        tmp_path: Path) -> None:
    f = factory_at(tmp_path)
    writer, peer = Peer(f), Peer(f, session=SID)
    for i in range(3):
        writer.append("q", i)
    assert values(peer.request(Get(peer.rid(), "q", max_items=2))) == [0, 1]
    f.commit()
    g = restart(f, tmp_path)
    assert g.store.n_items("q") == 1
    clock = g.reactor
    clock.advance(g.config.session_ttl + 1)  # its client never came back
    w = Peer(g)
    assert values(w.request(Get(w.rid(), "q"))) == [0, 1, 2]


def test_with_fsync_always_no_reply_leaves_before_its_record_is_written(
        tmp_path: Path) -> None:
    f = factory_at(tmp_path)
    peer = Peer(f)
    written: list[int] = []
    real = f.persist.flush  # type: ignore[union-attr]

    def flush() -> None:
        written.append(len(peer.transport.value()))
        real()

    f.persist.flush = flush  # type: ignore[union-attr, method-assign]
    before = len(peer.transport.value())
    peer.put("x", 1)
    assert written == [before]  # at the flush, the reply had not been written yet


def test_a_record_cut_short_at_the_end_is_cut_off_with_a_warning(tmp_path: Path) -> None:
    f = factory_at(tmp_path)
    w = Peer(f)
    for i in range(3):
        w.append("q", i)
    f.commit()
    log = tmp_path / "log-000000000001.tsl"
    size = log.stat().st_size
    # A crash in the middle of writing the last record: its end never reached the file.
    f.persist._close_fd()  # type: ignore[union-attr]
    f.persist.close()  # type: ignore[union-attr]
    with open(log, "r+b") as fh:
        fh.truncate(size - 5)
    g = factory_at(tmp_path)
    assert g.loaded is not None and g.loaded.warning is not None
    assert "cut short" in g.loaded.warning and str(log) in g.loaded.warning
    assert g.store.n_items("q") == 2  # the records before it
    assert os.path.getsize(log) < size - 5  # the torn record is gone from the file
    assert restart(g, tmp_path).loaded.warning is None  # type: ignore[union-attr]


def test_a_corrupt_record_in_the_middle_refuses_to_start(tmp_path: Path) -> None:
    f = factory_at(tmp_path)
    w = Peer(f)
    for i in range(3):
        w.append("q", i)
    f.commit()
    restart(f, tmp_path).persist.close()  # type: ignore[union-attr]
    log = tmp_path / "log-000000000001.tsl"
    data = bytearray(log.read_bytes())
    data[60] ^= 0xFF  # inside the first record
    log.write_bytes(bytes(data))
    with pytest.raises(DataError) as info:
        factory_at(tmp_path)
    message = str(info.value)
    assert str(log) in message and "offset 8" in message and "--truncate-corrupt-log" in message
    g = factory_at(tmp_path, truncate_corrupt_log=True)
    assert g.store.n_items("q") == 0 and g.loaded is not None and g.loaded.warning


def test_a_snapshot_with_a_flipped_byte_refuses_to_start_naming_it(tmp_path: Path) -> None:
    f = factory_at(tmp_path)
    Peer(f).put("w", list(range(100)))
    f.snapshot(wait=True)
    snap = tmp_path / "snapshot-000000000001.tss"
    restart(f, tmp_path).persist.close()  # type: ignore[union-attr]
    data = bytearray(snap.read_bytes())
    data[len(data) // 2] ^= 0x01
    snap.write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"snapshot {snap} is corrupt at offset"):
        factory_at(tmp_path)


def test_one_directory_one_server(tmp_path: Path) -> None:
    f = factory_at(tmp_path)
    with pytest.raises(DataError, match="in use by another tensorshare server"):
        factory_at(tmp_path)
    f.close_persistence()
    factory_at(tmp_path).close_persistence()
