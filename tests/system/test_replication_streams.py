"""Stream bins on a replica and across restarts: in the full copy, following the records,
taken over by a promoted replica (a consumer and a producer carry on exactly once), and back
after a restart with ``--data-dir``.

Real servers (:class:`EmbeddedServer` in this process, or ``tensorshare serve`` processes
killed with -9) and real clients; a stream's state is compared whole (its bookkeeping, every
entry, every item), read in each server's own reactor thread. Nothing waits on a sleep:
conditions are polled with deadlines.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from tensorshare import Client, EmbeddedServer
from tensorshare.errors import ReadOnlyReplica
from tensorshare.server import ServerConfig
from tensorshare.server.streamlog import state_of
from tensorshare.server.streams import StreamKind
from tensorshare.wire import codec
from tests.chaos import HOST, ServerProcess
from tests.conftest import wait_until

TIMEOUT = 20.0


def streams(srv: EmbeddedServer) -> dict[str, Any]:
    """Every stream of ``srv``: its bookkeeping (owners, states and leases aside: a taken
    over member is away until its client comes back), and every entry kept with its item's
    value; and the bytes the kind counts."""
    def read() -> dict[str, Any]:
        (kind,) = [k for k in srv.factory.kinds if isinstance(k, StreamKind)]
        out: dict[str, Any] = {}
        for name, st in kind.streams.items():
            state = state_of(st)
            state["producers"] = [r[:1] + r[3:6] for r in state["producers"]]
            state["consumers"] = [r[:1] + r[3:5] + r[6:] for r in state["consumers"]]
            entries = [(e.epoch, e.offset, e.n, e.aborted,
                        None if e.item is None else codec.decode(e.item.value).tolist()
                        if hasattr(codec.decode(e.item.value), "tolist")
                        else codec.decode(e.item.value)) for e in st.entries]
            out[name] = (state, entries, st.nbytes, st.n_items)
        out["nbytes"] = kind.nbytes
        return out

    return srv.call(read)


def synced(a: EmbeddedServer, b: EmbeddedServer) -> bool:
    return streams(a) == streams(b)


def test_a_replica_copies_and_follows_streams_and_serves_them_once_promoted(
        servers: Callable[..., EmbeddedServer]) -> None:
    primary = servers()
    with Client(HOST, primary.port, timeout=TIMEOUT) as c:
        o = c.stream_open("s", window=16, replay="epoch")
        c.stream_join("s", "slow")
        c.stream_append("s", list(range(5)), epoch=o.epoch)
        replica = servers(config=ServerConfig(replica_of=f"{HOST}:{primary.port}"))
        wait_until(lambda: synced(primary, replica), TIMEOUT, "the full copy")
        assert streams(replica)["s"][0]["head"] == 5
        # Following: appends, a join, reads that acknowledge, an epoch's end, a leave.
        c.stream_join("s", "fast", start="epoch_start")
        c.stream_append("s", [5, 6], epoch=o.epoch)
        b = c.stream_read("s", "fast", max_items=3)
        b = c.stream_read("s", "fast", at=b.next)
        assert b.items == [3, 4, 5, 6]
        c.stream_end("s", epoch=o.epoch, samples=7)
        c.stream_append("s", [7], epoch=o.epoch + 1)
        c.stream_join("s", "gone")
        c.stream_leave("s", "gone")
        wait_until(lambda: synced(primary, replica), TIMEOUT, "the records followed")
        with Client(HOST, replica.port, timeout=TIMEOUT) as r:
            with pytest.raises(ReadOnlyReplica):
                r.stream_read("s", "slow")
            with pytest.raises(ReadOnlyReplica):
                r.stream_open("s", window=16, replay="epoch")
            assert r.promote() == 1
            # The promoted replica serves the stream from where the primary had it.
            got = r.stream_read("s", "slow", max_items=100)
            assert got.items == list(range(7)) and got.end == 7
            got = r.stream_read("s", "fast", at=b.next)
            assert got.items == [] and got.end == 7
            assert r.stream_read("s", "fast", at=got.next).items == [7]


def test_a_restart_with_a_data_directory_has_its_streams_back(
        servers: Callable[..., EmbeddedServer], tmp_path: Path) -> None:
    cfg = ServerConfig(data_dir=str(tmp_path / "d"))
    srv = servers(config=cfg)
    c = Client(HOST, srv.port, timeout=TIMEOUT, reconnect=False)
    o = c.stream_open("s", window=8)
    c.stream_join("s", "c")
    c.stream_append("s", [1, 2, 3], epoch=o.epoch)
    b = c.stream_read("s", "c", max_items=2)
    c.stream_append("s", [4], epoch=o.epoch)
    before = streams(srv)
    srv.stop()  # (the client never said goodbye: its session, and the members, go on)
    c.close()
    again = servers(config=cfg)
    assert streams(again) == before
    state = streams(again)["s"][0]
    assert [r[0] for r in state["consumers"]] == ["c"] and state["consumers"][0][2] == b.next
    # The consumer carries on from its cursor (whoever reads it now).
    with Client(HOST, again.port, timeout=TIMEOUT) as c2:
        assert c2.stream_read("s", "c", at=b.next).items == [3, 4]


def test_the_full_copy_holds_what_a_replica_in_a_data_directory_restarts_with(
        servers: Callable[..., EmbeddedServer], tmp_path: Path) -> None:
    primary = servers()
    with Client(HOST, primary.port, timeout=TIMEOUT) as c:
        o = c.stream_open("s", window=600)
        c.stream_join("s", "c")
        c.stream_append("s", list(range(300)), epoch=o.epoch)  # (more than one items record)
        c.stream_read("s", "c", max_items=10)
        cfg = ServerConfig(data_dir=str(tmp_path / "r"), replica_of=f"{HOST}:{primary.port}")
        replica = servers(config=cfg)
        wait_until(lambda: synced(primary, replica), TIMEOUT, "the full copy")
        c.stream_append("s", [300], epoch=o.epoch)
        wait_until(lambda: synced(primary, replica), TIMEOUT, "the records followed")
        want = streams(primary)
        replica.stop()
        assert streams(servers(config=cfg)) == want


def test_a_data_log_cut_in_a_stream_record_loads_up_to_the_last_whole_record(
        servers: Callable[..., EmbeddedServer], tmp_path: Path) -> None:
    d = tmp_path / "d"
    srv = servers(config=ServerConfig(data_dir=str(d), fsync="always"))
    c = Client(HOST, srv.port, timeout=TIMEOUT, reconnect=False)
    o = c.stream_open("s", window=8)
    c.stream_join("s", "c")
    c.stream_append("s", [1, 2], epoch=o.epoch)
    whole = streams(srv)
    (log,) = [p for p in os.listdir(d) if p.startswith("log-")]
    size = os.path.getsize(d / log)
    c.stream_append("s", [3], epoch=o.epoch)  # (written before its reply: fsync="always")
    cut = os.path.getsize(d / log) - 7  # the last record (the append of 3), cut short
    assert cut > size
    copy = tmp_path / "copy"  # (what a kill -9 while writing that record leaves)
    copy.mkdir()
    for name in os.listdir(d):
        if name != "lock":
            data = (d / name).read_bytes()
            (copy / name).write_bytes(data[:cut] if name == log else data)
    c.close()
    again = servers(config=ServerConfig(data_dir=str(copy)))
    assert streams(again) == whole
    assert again.factory.loaded is not None and "cut short" in (again.factory.loaded.warning
                                                                or "")


def test_kill_9_of_the_primary_a_streams_consumer_and_producer_carry_on_exactly_once(
        tmp_path: Path) -> None:
    with ExitStack() as stack:
        primary = stack.enter_context(_proc("--min-replicas", "1"))
        replica = stack.enter_context(_proc("--replica-of", f"{HOST}:{primary.port}"))
        both = f"tensorshare://{HOST}:{replica.port},{HOST}:{primary.port}"
        admin = stack.enter_context(Client(HOST, replica.port, timeout=TIMEOUT))
        wait_until(lambda: admin.stats()["server"]["replication"]["synced"], TIMEOUT,
                   "in sync")
        _fail_over(both, primary, admin)


def _proc(*args: str) -> ServerProcess:
    return ServerProcess(0, *args)


def _fail_over(both: str, primary: ServerProcess, admin: Client) -> None:
    acked: list[int] = []
    got: list[int] = []
    errors: list[BaseException] = []
    joined, stop = threading.Event(), threading.Event()

    def produce() -> None:
        try:
            with Client(both, timeout=TIMEOUT) as p:
                joined.wait(TIMEOUT)
                epoch = p.stream_open("s", window=64, lease=30).epoch
                i = 0
                while not stop.is_set():
                    p.stream_append("s", [i, i + 1], epoch=epoch)
                    acked.extend((i, i + 1))
                    i += 2
                assert p.stream_end("s", epoch=epoch, samples=i, last=True).finished
        except BaseException as exc:  # reported below
            errors.append(exc)

    def consume() -> None:
        try:
            with Client(both, timeout=TIMEOUT) as g:
                at = g.stream_join("s", "c", lease=30).position
                joined.set()
                finished = False
                while not finished and not errors:
                    b = g.stream_read("s", "c", at=at, max_items=7, timeout=1.0)
                    got.extend(b.items)
                    at, finished = b.next, b.finished
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=produce), threading.Thread(target=consume)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(got) >= 300 or bool(errors), TIMEOUT, "items under way")
        primary.kill()
        assert admin.promote() == 1
        before = len(acked)
        wait_until(lambda: len(acked) >= before + 300 or bool(errors), TIMEOUT,
                   "appends on the promoted replica")
    finally:
        stop.set()
        for t in threads:
            t.join(TIMEOUT * 2)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    # Item by item: every acknowledged item delivered, once, in order; nothing else.
    assert got == acked == list(range(len(acked)))


_ODD = (None, -1, 2**70, 1.5, "x", b"\0" * 16, [], {}, [[1, 2]], True)


def _logged(srv: EmbeddedServer, d: Path) -> list[tuple[dict[str, Any], bytearray]]:
    """Every record of the data log in ``d``, then of the snapshot ``srv`` writes as it
    stops."""
    from tensorshare.server.persist import LOG_MAGIC, SNAP_MAGIC, _records

    out = []
    for stop, prefix, magic in ((False, "log-", LOG_MAGIC), (True, "snapshot-", SNAP_MAGIC)):
        if stop:
            srv.stop()
        for name in sorted(os.listdir(d)):
            if name.startswith(prefix):
                out += [(h, p) for _, h, p in _records(str(d / name), magic, 1 << 30)]
    return out


def test_every_stream_record_mangled_is_refused_as_malformed_never_anything_else(
        servers: Callable[..., EmbeddedServer], tmp_path: Path) -> None:
    import random

    from tensorshare.server.persist import SnapshotLoader

    d = tmp_path / "d"
    srv = servers(config=ServerConfig(data_dir=str(d), fsync="always"))
    c = Client(HOST, srv.port, timeout=TIMEOUT, reconnect=False)
    o = c.stream_open("s", window=8, replay="epoch")
    c.stream_join("s", "c", start="epoch_start")
    c.stream_append("s", [1, 2], epoch=o.epoch)
    b = c.stream_read("s", "c")
    c.stream_end("s", epoch=o.epoch, samples=2)
    c.stream_read("s", "c", at=b.next)
    records = [(h, p) for h, p in _logged(srv, d) if h["op"].startswith("stream_")]
    c.close()
    assert {h["op"] for h, _ in records} == {"stream_state", "stream_append", "stream_read",
                                          "stream_bin", "stream_items"}
    rng = random.Random(39)
    target = servers(config=ServerConfig(data_dir=str(tmp_path / "t")))
    f = target.factory
    refused = 0
    for _ in range(400):
        h, payload = rng.choice(records)
        bad = dict(h)
        key = rng.choice(sorted(bad))
        if key != "op":
            if rng.random() < 0.3:
                del bad[key]
            else:
                bad[key] = rng.choice(_ODD)
        if isinstance(bad.get("state"), dict) and bad["state"] and rng.random() < 0.7:
            state = bad["state"] = dict(bad["state"])
            state[rng.choice(sorted(state))] = rng.choice(_ODD)

        def apply(bad: dict[str, Any] = bad, payload: bytearray = payload) -> None:
            if bad["op"] in ("stream_bin", "stream_items"):
                loader = SnapshotLoader(f.persist, f.store, f.sessions)
                loader.feed(bad, payload)
                loader.finish()
            else:
                f.persist._apply(bad, payload, f.store, f.sessions)

        try:
            target.call(apply)
        except (KeyError, TypeError, ValueError, OverflowError):
            refused += 1
    assert refused > 100
    assert Client(HOST, target.port, timeout=TIMEOUT).ping() is None


def test_kill_9_of_a_server_with_a_data_directory_a_producer_and_consumer_carry_on(
        tmp_path: Path) -> None:
    with ServerProcess(0, "--data-dir", str(tmp_path / "d")) as srv, \
            Client(HOST, srv.port, timeout=TIMEOUT) as p, \
            Client(HOST, srv.port, timeout=TIMEOUT) as g:
        epoch = p.stream_open("s", window=64, lease=30).epoch
        at = g.stream_join("s", "c", lease=30).position
        p.stream_append("s", [0, 1, 2], epoch=epoch)
        b = g.stream_read("s", "c", at=at, max_items=2)
        assert b.items == [0, 1]
        srv.restart()  # SIGKILL, and the server again on its data directory
        # Both resume their sessions: the producer in its epoch, the consumer at its cursor.
        assert p.stream_append("s", [3], epoch=epoch).position == 3
        b = g.stream_read("s", "c", at=b.next)
        assert b.items == [2, 3]
        assert p.stream_end("s", epoch=epoch, samples=4, last=True).finished
        b = g.stream_read("s", "c", at=b.next)
        assert (b.items, b.end, b.finished) == ([], 4, True)


def test_a_snapshots_stream_records_hold_at_most_256_entries_or_about_64_mib() -> None:
    from tensorshare.server.streamlog import _records
    from tensorshare.wire.messages import Item

    item = Item(codec.encode(1))
    big = [([0, i, 1, 0], item, 40 << 20) for i in range(3)]  # (as if 40 MiB each)
    small = [([0, i, 1, 0], item, 8) for i in range(600)] + [([0, 600, 0, 1], None, 0)]
    for entries, want in ((big, [2, 1]), (small, [256, 256, 89])):
        records = list(_records([("s", {}, entries)]))
        assert records[0][0]["op"] == "stream_bin"
        rows = [len(h["rows"]) for h, _ in records[1:]]
        assert rows == want and sum(rows) == len(entries)
