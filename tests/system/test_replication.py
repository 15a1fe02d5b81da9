"""Replication between real server processes: a replica follows its primary's data log.

Each test starts ``tensorshare serve`` processes (:class:`tests.chaos.ServerProcess`), writes
through real clients, and compares the replica with the primary item by item. Nothing waits on
a sleep: conditions are polled with deadlines; every process is killed in ``finally``.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tensorshare import Client
from tensorshare.errors import (
    NotEnoughReplicas,
    ReadOnlyReplica,
    StorageUnavailable,
    TensorShareError,
)
from tests.chaos import HOST, ChaosProxy, ServerProcess
from tests.conftest import wait_until
from tests.system.conftest import fail_over_under

TIMEOUT = 20.0


def repl(c: Client) -> dict[str, Any]:
    return c.stats()["server"]["replication"]


def contents(c: Client) -> dict[str, Any]:
    """Every bin: its version and every item, compared item by item."""
    out: dict[str, Any] = {}
    for name, version in sorted(c.list().items()):
        items = c.peek(name, max_items=None) if c.stats(name)["bins"][name]["kind"] == "list" \
            else c.peek(name)
        out[name] = (version, items)
    return out


def same(a: Client, b: Client) -> bool:
    try:
        return _equal(contents(a), contents(b))
    except TensorShareError:
        return False


def _equal(x: Any, y: Any) -> bool:
    import torch

    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and \
            x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and \
            all(_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and \
            all(_equal(i, j) for i, j in zip(x, y, strict=True))
    return bool(x == y)


def test_a_replica_takes_a_full_copy_follows_and_refuses_writes(
        procs: Callable[..., ServerProcess], clients: Callable[..., Client]) -> None:
    import torch

    primary = procs()
    c = clients(primary.port)
    c.put("params", {"w": torch.arange(6.0).reshape(2, 3), "step": 1})
    for i in range(50):
        c.append("rollouts", {"i": i, "x": torch.full((4,), float(i))})
    c.get("rollouts", max_items=5)  # a get is replicated too (what it took is gone)
    replica = procs("--replica-of", f"{HOST}:{primary.port}")
    r = clients(replica.port)
    wait_until(lambda: same(c, r), TIMEOUT, "the full copy")
    for i in range(50, 80):  # then every record as it is written
        c.append("rollouts", {"i": i, "x": torch.full((4,), float(i))})
    c.put("params", {"w": torch.ones(2, 3), "step": 2})
    c.delete("gone") if "gone" in c.list() else None
    wait_until(lambda: same(c, r), TIMEOUT, "the records after it")
    assert r.stats()["server"]["role"] == "replica"
    # The replica holds the primary's data set: it reports its id (versions go on there).
    assert r.stats()["server"]["server_id"] == c.stats()["server"]["server_id"]
    assert r.peek("params")["step"] == 2
    for write in (lambda: r.put("x", 1), lambda: r.append("rollouts", 1),
                  lambda: r.get("rollouts"), lambda: r.delete("params")):
        with pytest.raises(ReadOnlyReplica) as err:
            write()
        assert err.value.primary == f"tensorshare://{HOST}:{primary.port}"
    with pytest.raises(ReadOnlyReplica):
        r.stream_open("s", producers=1)
    assert same(c, r)  # nothing changed by what was refused
    info = repl(c)
    assert [x["lag_bytes"] for x in info["replicas"]] == [0] or \
        wait_until(lambda: repl(c)["replicas"][0]["lag_bytes"] == 0, TIMEOUT, "lag 0") is None


def test_a_cut_replica_continues_from_its_offset_and_one_past_the_backlog_takes_a_full_copy(
        procs: Callable[..., ServerProcess], clients: Callable[..., Client]) -> None:
    primary = procs("--replica-backlog", "64K")
    c = clients(primary.port)
    with ChaosProxy(primary.address) as proxy:
        replica = procs("--replica-of", f"{HOST}:{proxy.port}")
        r = clients(replica.port)
        c.put("v", 1)
        wait_until(lambda: same(c, r), TIMEOUT, "the first copy")
        assert repl(c)["full_resyncs"] == 1
        proxy.cut_all()
        for i in range(20):  # a little: the backlog still has it
            c.append("q", i)
        wait_until(lambda: repl(c)["partial_resyncs"] >= 1 and same(c, r), TIMEOUT,
                   "a partial resync")
        assert repl(c)["full_resyncs"] == 1
        proxy.pause_accepting()
        proxy.cut_all()
        wait_until(lambda: not repl(c)["replicas"], TIMEOUT, "the replica gone")
        blob = bytes(32 << 10)
        for i in range(8):  # 256K: four times the backlog
            c.append("big", {"i": i, "b": blob})
        proxy.resume_accepting()
        wait_until(lambda: repl(c)["full_resyncs"] == 2 and same(c, r), TIMEOUT,
                   "a full copy again")


def test_kill_9_of_the_primary_with_min_replicas_loses_no_acknowledged_write(
        procs: Callable[..., ServerProcess], clients: Callable[..., Client]) -> None:
    primary = procs("--min-replicas", "1", "--replica-timeout", "5")
    c = clients(primary.port)
    with pytest.raises(NotEnoughReplicas):
        c.put("early", 1)  # no replica in sync: refused at once, not applied
    replica = procs("--replica-of", f"{HOST}:{primary.port}")
    r = clients(replica.port)
    wait_until(lambda: bool(repl(c)["replicas"]) and repl(c)["replicas"][0]["live"], TIMEOUT,
               "the replica in sync")
    assert "early" not in r.list()
    acked: list[list[int]] = [[] for _ in range(4)]
    stop = threading.Event()

    def produce(k: int) -> None:
        try:
            p = Client(HOST, primary.port, timeout=TIMEOUT, reconnect=False)
        except (TensorShareError, OSError):
            return  # (started after the kill)
        try:
            for i in range(100_000):
                if stop.is_set():
                    return
                p.append("q", k * 1_000_000 + i)
                acked[k].append(k * 1_000_000 + i)
        except (TensorShareError, OSError):
            return
        finally:
            p.close()

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: sum(map(len, acked)) >= 400, TIMEOUT, "writes under way")
    primary.kill()
    stop.set()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive()
    assert r.promote() == 1
    items = r.peek("q", max_items=None)
    assert len(items) == len(set(items)), "an item is there twice"
    missing = {x for xs in acked for x in xs} - set(items)
    assert not missing, f"{len(missing)} acknowledged items lost"
    assert r.stats()["server"]["role"] == "primary"
    r.append("q", -1)  # the promoted replica takes writes
    assert r.peek("q", max_items=None)[-1] == -1


def test_the_old_primary_is_fenced_by_the_newer_term_and_can_follow_the_new_one(
        procs: Callable[..., ServerProcess], clients: Callable[..., Client],
        tmp_path: Path) -> None:
    a = procs("--data-dir", str(tmp_path / "a"))
    ca = clients(a.port)
    ca.put("v", 1)
    b = procs("--replica-of", f"{HOST}:{a.port}")
    cb = clients(b.port)
    wait_until(lambda: same(ca, cb), TIMEOUT, "b follows a")
    assert cb.promote() == 1
    cb.put("v", 2)
    # A replica that has seen term 1 asks the old primary: it learns of the newer term.
    c = procs("--replica-of", f"{HOST}:{b.port}", "--data-dir", str(tmp_path / "c"))
    cc = clients(c.port)
    wait_until(lambda: same(cb, cc), TIMEOUT, "c follows b")
    assert cc.stats()["server"]["term"] == 1
    c.close()
    c2 = procs("--replica-of", f"{HOST}:{a.port}", "--data-dir", str(tmp_path / "c"))
    wait_until(lambda: ca.stats()["server"]["role"] == "fenced", TIMEOUT, "a fenced")
    with pytest.raises(ReadOnlyReplica):
        ca.put("v", 3)
    c2.close()
    a.close()
    a2 = procs("--data-dir", str(tmp_path / "a"), "--replica-of", f"{HOST}:{b.port}")
    ca2 = clients(a2.port)
    wait_until(lambda: same(cb, ca2), TIMEOUT, "the old primary follows the new one")
    assert ca2.peek("v") == 2 and ca2.stats()["server"]["term"] == 1


def test_a_replica_with_a_wrong_token_or_without_the_replicate_right_is_refused(
        procs: Callable[..., ServerProcess], clients: Callable[..., Client],
        tmp_path: Path) -> None:
    (tmp_path / "admin.token").write_text("admin-token-123456")
    (tmp_path / "plain.token").write_text("plain-token-123456")
    (tmp_path / "repl.token").write_text("repl-token-1234567")
    (tmp_path / "wrong.token").write_text("wrong-token-123456")
    users = tmp_path / "users.toml"
    users.write_text('[users.admin]\ntoken_file = "admin.token"\nread = ["*"]\nwrite = ["*"]\n'
                     'admin = true\n[users.plain]\ntoken_file = "plain.token"\nread = ["*"]\n'
                     'write = ["*"]\n[users.follower]\ntoken_file = "repl.token"\n'
                     'replicate = true\n')
    primary = procs("--users-file", str(users))
    c = clients(primary.port, token_file=str(tmp_path / "admin.token"), user="admin")
    c.put("v", 1)
    bad = procs("--replica-of", f"{HOST}:{primary.port}", "--upstream-token-file",
                str(tmp_path / "plain.token"), "--upstream-user", "plain")
    wrong = procs("--replica-of", f"{HOST}:{primary.port}", "--upstream-token-file",
                  str(tmp_path / "wrong.token"), "--upstream-user", "follower")
    good = procs("--replica-of", f"{HOST}:{primary.port}", "--upstream-token-file",
                 str(tmp_path / "repl.token"), "--upstream-user", "follower")
    g = clients(good.port)
    wait_until(lambda: same(c, g), TIMEOUT, "the replica with the right")
    wait_until(lambda: "may not replicate" in bad.stderr(), TIMEOUT, "the refusal")
    wait_until(lambda: "authentication_failed" in wrong.stderr(), TIMEOUT, "the wrong token")
    assert len(repl(c)["replicas"]) == 1
    with pytest.raises(StorageUnavailable):  # it never had a full copy: no reads yet
        clients(bad.port).list()


def test_fuzzed_replication_requests_are_refused_and_the_server_serves_on(
        procs: Callable[..., ServerProcess], clients: Callable[..., Client]) -> None:
    import random
    import socket

    import msgpack

    from tensorshare.wire.frames import encode_frame
    from tensorshare.wire.messages import Hello
    from tests.rawwire import WireClient

    primary = procs()
    c = clients(primary.port)
    c.put("v", 1)
    rng = random.Random(39)
    values: list[Any] = [None, -1, 0, 1, 2**64 - 1, "x" * 600, b"\x00", [], {}, 1.5, True, "abc"]
    hello = WireClient().frame(Hello(1, (1,), "fuzz"))
    for _ in range(100):
        op = rng.choice(["psync", "repl_ack", "promote", "wait_replicas"])
        h: dict[str, Any] = {"op": op, "id": rng.randrange(2, 1000)}
        for key in rng.sample(["replid", "offset", "term", "address", "n", "timeout"], 3):
            h[key] = rng.choice(values)
        frame = b"".join(bytes(x) for x in encode_frame(msgpack.packb(h)))
        with socket.create_connection((HOST, primary.port), timeout=TIMEOUT) as s:
            s.sendall(hello + frame)
            s.settimeout(0.05)
            try:
                while s.recv(65536):
                    pass
            except (TimeoutError, OSError):
                pass
    assert primary.running, primary.stderr()[-3000:]
    assert c.peek("v") == 1 and c.ping() is None, primary.stderr()[-3000:]


def test_clients_with_an_address_list_follow_the_promotion_and_resume_exactly_once(
        procs: Callable[..., ServerProcess], clients: Callable[..., Client]) -> None:
    primary = procs("--min-replicas", "1")
    replica = procs("--replica-of", f"{HOST}:{primary.port}")
    both = f"tensorshare://{HOST}:{replica.port},{HOST}:{primary.port}"
    admin = clients(replica.port)
    wait_until(lambda: admin.stats()["server"]["replication"]["synced"], TIMEOUT, "in sync")
    acked: list[list[int]] = [[] for _ in range(6)]
    got: list[list[Any]] = [[] for _ in range(2)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def produce(k: int) -> None:
        try:
            with Client(both, timeout=TIMEOUT) as p:
                assert p._conn._connector.current.address.port == primary.port
                i = 0
                while not stop.is_set():
                    p.append("q", k * 1_000_000 + i)
                    acked[k].append(k * 1_000_000 + i)
                    i += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    def consume(k: int) -> None:
        try:
            with Client(both, timeout=TIMEOUT) as g:
                while not stop.is_set() or g.list().get("q"):
                    try:
                        got[k].extend(g.get("q", max_items=50))
                    except TensorShareError as exc:
                        if type(exc).__name__ != "BinNotFound":
                            raise
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(6)]
    threads += [threading.Thread(target=consume, args=(k,)) for k in range(2)]
    fail_over_under(threads, acked, errors, stop, primary, admin, 300)
    left = admin.peek("q", max_items=None) if "q" in admin.list() else []
    everything = [x for xs in got for x in xs] + list(left)
    assert len(everything) == len(set(everything)), "an item delivered twice"
    missing = {x for xs in acked for x in xs} - set(everything)
    assert not missing, f"{len(missing)} acknowledged items lost"


def _fake_primary_messages(rng: Any) -> list[bytes]:
    """What a broken primary sends after its psync reply: one bad message (each kind)."""
    import msgpack

    from tensorshare.server.persist import _frame, _record
    from tensorshare.wire import codec
    from tensorshare.wire.messages import Item
    from tensorshare.wire.protocol import items_header
    from tensorshare.wire.replication import pushed_frame

    def rec(h: dict[str, Any], items: tuple[Any, ...] = ()) -> list[Any]:
        buffers: list[Any] = []
        if items:
            h["items"] = items_header([Item(codec.encode(v)) for v in items], buffers)
        return _record(_frame(h, buffers))

    def push(h: dict[str, Any], r: list[Any]) -> bytes:
        return b"".join(bytes(c) for c in pushed_frame(h, r, sum(len(c) for c in r)))

    good = rec({"op": "put", "bin": "b"}, (1,))
    flipped = bytearray(b"".join(bytes(c) for c in good))
    flipped[-1] ^= 0xFF
    cases = [
        push({"op": "repl_snap", "term": 0}, [rng.randbytes(rng.randrange(1, 300))]),
        push({"op": "repl_snap", "term": 0}, rec({"op": "frob"})),
        push({"op": "repl_snap", "term": 0}, rec({"op": "items", "bin": "nope"}, (1,))),
        push({"op": "repl", "term": 0, "offset": 10}, [bytes(flipped)]),
        push({"op": "repl", "term": 0}, good),
        push({"op": "repl", "term": 0, "offset": 5}, rec({"op": "put", "bin": 7})),
        push({"op": "repl", "term": 0, "offset": 5}, rec({"op": "take", "bin": "b"})),
        push({"op": "whatever", "term": 0}, good),
        # replay bins in a full copy: a state that is none, rows for a bin never described
        push({"op": "repl_snap", "term": 0}, rec({"op": "replay_bin", "bin": "r",
                                                  "state": {"version": 99}}))
        + push({"op": "repl_snap", "term": 0}, rec({"op": "end"})),
        push({"op": "repl_snap", "term": 0}, rec({"op": "replay_items", "bin": "r",
                                                  "rows": [[1, 1.0, 0, 8, 0]]}, (1,))),
        push({"op": "repl_snap", "term": 0}, rec({"op": "replay_bin", "bin": "r",
                                                  "state": {}, "version": -1})),
        # streams: a state that is none, entries of a stream never described, an append to
        # a stream the replica does not have
        push({"op": "repl_snap", "term": 0}, rec({"op": "stream_bin", "bin": "s",
                                                  "state": {"head": -1}}))
        + push({"op": "repl_snap", "term": 0}, rec({"op": "end"})),
        push({"op": "repl_snap", "term": 0}, rec({"op": "stream_items", "bin": "s",
                                                  "rows": [[0, 0, 1, 0]]}, (1,))),
        push({"op": "repl", "term": 0, "offset": 5}, rec({"op": "stream_append", "bin": "s",
                                                          "producer": 0, "position": 0}, (1,))),
        b"".join(bytes(c) for c in pushed_frame({"op": "repl_ping", "term": 0}))[:-1]
        + b"\xc1",
        bytes(16) + rng.randbytes(64),
        b"".join(bytes(c) for c in _raw_frame(msgpack.packb([1, 2, 3]))),
    ]
    rng.shuffle(cases)
    return cases


def _raw_frame(header: bytes) -> list[Any]:
    from tensorshare.wire.frames import encode_frame

    return encode_frame(header)


def _feed_one(listener: Any, bad: bytes) -> bool:
    """Answer one replica connection's hello and psync, then send ``bad``; wait until the
    replica drops the connection. False if it was reset before ``bad`` was sent."""
    from tensorshare.wire.frames import FrameDecoder
    from tensorshare.wire.messages import HelloReply, Limits
    from tensorshare.wire.protocol import encode_message
    from tensorshare.wire.replication import PsyncReply

    conn, _ = listener.accept()
    with conn:
        conn.settimeout(TIMEOUT)
        decoder = FrameDecoder(1 << 20, 1 << 16)
        seen: list[Any] = []
        try:
            while len(seen) < 2:  # hello, then psync
                data = conn.recv(65536)
                if not data:
                    return False
                seen.extend(decoder.feed(data))
                if len(seen) == 1:
                    conn.sendall(b"".join(bytes(c) for c in encode_message(HelloReply(
                        1, 1, "fake", Limits(), False, "f" * 16))[0]))
            conn.sendall(b"".join(bytes(c) for c in encode_message(
                PsyncReply(2, "full", "fake", 0, 0))[0]) + bad)
        except ConnectionResetError:
            return False
        try:  # the replica drops the connection
            while conn.recv(65536):
                pass
        except ConnectionResetError:
            pass
    return True


def test_a_replica_survives_every_malformed_message_of_its_primary(
        procs: Callable[..., ServerProcess], clients: Callable[..., Client]) -> None:
    """A fake primary answers the handshake and psync, then sends one broken message per
    connection: the replica drops it, stays up, serves its clients, and comes back."""
    import random
    import socket

    rng = random.Random(39)
    cases = _fake_primary_messages(rng)
    with socket.create_server((HOST, 0)) as listener:
        listener.settimeout(TIMEOUT)
        replica = procs("--replica-of", f"{HOST}:{listener.getsockname()[1]}")
        r = clients(replica.port)
        for bad in cases:
            while not _feed_one(listener, bad):  # (a reset before it was sent: again)
                pass
        assert replica.running
        assert r.ping() is None and r.stats()["server"]["role"] == "replica"
        assert "resyncing from the primary" in replica.stderr()


def test_a_replica_that_stops_reading_costs_the_primary_at_most_its_replica_buffer(
        procs: Callable[..., ServerProcess], clients: Callable[..., Client]) -> None:
    import socket

    from tensorshare.wire.messages import Hello
    from tensorshare.wire.protocol import encode_message
    from tensorshare.wire.replication import Psync

    primary = procs("--replica-buffer", "1M")
    c = clients(primary.port)
    with socket.create_connection((HOST, primary.port), timeout=TIMEOUT) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"".join(bytes(x) for x in encode_message(Hello(1, (1,), "stuck"))[0]))
        s.sendall(b"".join(bytes(x) for x in encode_message(Psync(2))[0]))
        wait_until(lambda: bool(repl(c)["replicas"]), TIMEOUT, "the stuck replica")
        blob = bytes(1 << 20)
        for i in range(64):  # far more than the socket buffers and --replica-buffer
            c.put(f"b{i % 4}", blob)
            if repl(c)["replicas_dropped"]:
                break
        wait_until(lambda: repl(c)["replicas_dropped"] == 1 and not repl(c)["replicas"],
                   TIMEOUT, "the stuck replica dropped")
        wait_until(lambda: c.stats()["server"]["memory"]["output"] < 1 << 20, TIMEOUT,
                   "its queued output released")
    assert c.peek("b0") == blob


def test_a_replica_follows_a_primary_over_tls_with_a_token(
        procs: Callable[..., ServerProcess], tmp_path: Path, tls_files: Any) -> None:
    token = tmp_path / "token"
    token.write_text("a-token-for-both-1234")
    primary = procs("--token-file", str(token), "--tls-cert", tls_files.cert, "--tls-key",
                    tls_files.key)
    c = Client(f"tensorshare+tls://localhost:{primary.port}", token_file=str(token),
               tls_ca=tls_files.ca, timeout=TIMEOUT)
    try:
        c.put("v", {"x": 1})
        replica = procs("--token-file", str(token), "--replica-of",
                        f"tensorshare+tls://localhost:{primary.port}", "--upstream-token-file",
                        str(token), "--upstream-tls-ca", tls_files.ca)
        wrong_ca = procs("--replica-of", f"tensorshare+tls://localhost:{primary.port}",
                         "--upstream-token-file", str(token), "--upstream-tls-ca",
                         tls_files.other_ca)
        r = Client(HOST, replica.port, token_file=str(token), timeout=TIMEOUT)
        try:
            wait_until(lambda: same(c, r), TIMEOUT, "the replica over TLS")
        finally:
            r.close()
        wait_until(lambda: "certificate verify failed" in wrong_ca.stderr(), TIMEOUT,
                   "a CA that signed nothing")
        assert len(repl(c)["replicas"]) == 1
    finally:
        c.close()


def test_a_client_that_sees_a_newer_term_fences_the_former_primary(
        procs: Callable[..., ServerProcess], clients: Callable[..., Client]) -> None:
    a = procs()
    b = procs("--replica-of", f"{HOST}:{a.port}")
    ca, cb = clients(a.port), clients(b.port)
    ca.put("v", 1)
    wait_until(lambda: same(ca, cb), TIMEOUT, "b follows a")
    assert cb.promote() == 1  # a still runs, and still says it is the primary (term 0)
    assert ca.stats()["server"]["role"] == "primary"
    both = Client([f"{HOST}:{a.port}", f"{HOST}:{b.port}"],
                  timeout=TIMEOUT)
    try:
        assert both._conn._connector.current.address.port == b.port  # the newer term wins
        both.put("v", 2)
    finally:
        both.close()
    assert ca.stats()["server"]["role"] == "fenced"  # told of term 1 by the client
    with pytest.raises(ReadOnlyReplica):
        ca.put("v", 3)
    assert cb.peek("v") == 2 and ca.peek("v") == 1


def test_a_failover_keeps_streams_and_services_carry_on(
        procs: Callable[..., ServerProcess], clients: Callable[..., Client]) -> None:
    """Streams are replicated, services live in memory on the primary. When it dies and a
    replica is promoted, a stream's consumer waiting in a read and its producer (with
    address lists) carry on where they were on the promoted replica (the read resent there
    gets the next append), and a service's callers and hosts carry on too."""
    primary = procs()
    replica = procs("--replica-of", f"{HOST}:{primary.port}")
    both = f"tensorshare://{HOST}:{primary.port},{HOST}:{replica.port}"
    admin, watch = clients(replica.port), clients(primary.port)
    wait_until(lambda: repl(admin)["synced"], TIMEOUT, "the replica in sync")
    producer, consumer, host, caller = (Client(both, timeout=TIMEOUT) for _ in range(4))
    stop = threading.Event()
    answered: list[int] = []

    def serve() -> None:  # a service host, as an InferenceHost runs
        while not stop.is_set():
            try:
                batch = host.service_take("svc", timeout=0.5)
                host.service_reply("svc", batch.batch, [v * 2 for v in batch.values])
                answered.append(len(batch.values))
            except TensorShareError:
                continue  # (a take that timed out, or the connection lost: take again)

    read: list[Any] = []

    def wait_read() -> None:
        try:
            read.append(consumer.stream_read("s", "c", timeout=TIMEOUT / 2))
        except BaseException as exc:  # checked below
            read.append(exc)

    threads = [threading.Thread(target=serve), threading.Thread(target=wait_read)]
    try:
        opened = producer.stream_open("s")
        consumer.stream_join("s", "c")
        producer.stream_append("s", [1, 2], epoch=opened.epoch)
        assert consumer.stream_read("s", "c").items == [1, 2]
        threads[0].start()
        assert caller.service_call("svc", 21).value == 42
        threads[1].start()
        wait_until(lambda: watch.stats("s")["bins"]["s"]["waiters"] == 1, TIMEOUT,
                   "the consumer's read waiting on the primary")
        wait_until(lambda: admin.stats("s")["bins"]["s"]["stream"]["consumers"]["c"]["cursor"]
                   == 2, TIMEOUT, "the replica has the consumer's cursor")
        primary.kill()
        assert admin.promote() == 1
        assert producer.stream_append("s", [3], epoch=opened.epoch).position == 2
        threads[1].join(TIMEOUT)
        assert not threads[1].is_alive(), "the waiting read hangs after the failover"
        assert read[0].items == [3], read  # (resent on the promoted replica)
        joined = consumer.stream_join("s", "c", resume=True)
        assert (joined.resumed, joined.head) == (True, 3)
        assert caller.service_call("svc", 5).value == 10  # its host follows the primary
    finally:
        stop.set()
        for t in threads:
            if t.ident is not None:  # (started)
                t.join(TIMEOUT)
        for c in (producer, consumer, host, caller):
            c.close()


def test_replay_inserts_through_a_failover_are_applied_exactly_once(
        procs: Callable[..., ServerProcess], clients: Callable[..., Client]) -> None:
    """With ``--min-replicas 1``, an insert into a replay bin that was in flight when the
    primary died is, retried on the promoted replica in the same session, applied once: the
    bin holds exactly the acknowledged inserts, each key once."""
    primary = procs("--min-replicas", "1")
    replica = procs("--replica-of", f"{HOST}:{primary.port}")
    both = f"tensorshare://{HOST}:{primary.port},{HOST}:{replica.port}"
    admin, watch = clients(replica.port), clients(primary.port)
    wait_until(lambda: repl(admin)["synced"] and repl(watch)["replicas"][0]["live"], TIMEOUT,
               "the replica in sync")
    acked: list[list[int]] = [[], [], []]  # the keys each inserter was given
    errors: list[BaseException] = []
    stop = threading.Event()

    def insert(keys: list[int]) -> None:
        try:
            with Client(both, timeout=TIMEOUT) as p:
                p.replay_open("r", max_size=1_000_000, seed=7)
                for i in itertools.count():
                    if stop.is_set():
                        return
                    keys.extend(p.replay_insert("r", [(i, id(keys))], [1.0]))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=insert, args=(keys,)) for keys in acked]
    fail_over_under(threads, acked, errors, stop, primary, admin, 150)
    keys = [key for keys in acked for key in keys]
    assert len(keys) == len(set(keys)), "one key given twice"
    info = admin.replay_info("r")
    assert info.size == info.stats["inserts"] == len(keys), "an insert lost or applied twice"


def test_a_resent_write_that_was_applied_is_not_refused_as_unapplied_short_of_replicas(
        procs: Callable[..., ServerProcess], clients: Callable[..., Client]) -> None:
    """A write applied while its reply waited for the replica, resent by its session once no
    replica is in sync: before, the fence answered ``not_enough_replicas``, "nothing was
    applied" (a retry then doubled it); now the remembered reply is held like any write's
    and leaves once a replica has it: one item, one success."""
    import signal

    primary = procs("--min-replicas", "1", "--replica-timeout", "30")
    replica = procs("--replica-of", f"{HOST}:{primary.port}")
    admin = clients(primary.port)
    wait_until(lambda: [x["live"] for x in repl(admin)["replicas"]] == [True], TIMEOUT,
               "the replica in sync")
    admin.put("warm", 1)  # acknowledged by the replica: in sync
    with ChaosProxy((HOST, primary.port)) as proxy:
        c = Client(HOST, proxy.port, timeout=60.0)
        try:
            assert replica.proc is not None
            os.kill(replica.proc.pid, signal.SIGSTOP)  # applied on the primary, never acked
            out: dict[str, Any] = {}
            t = threading.Thread(target=lambda: out.update(r=_attempt(lambda: c.append("q", 7))))
            t.start()
            wait_until(lambda: admin.list().get("q") == 1, TIMEOUT, "the append applied")
            replica.kill()
            wait_until(lambda: not any(x["live"] for x in repl(admin)["replicas"]), TIMEOUT,
                       "no replica in sync")
            replayed = admin.stats()["server"]["counters"].get("replayed", 0)
            proxy.cut_all()  # the reply never came: the session resends the same request
            wait_until(lambda: admin.stats()["server"]["counters"].get("replayed", 0) > replayed,
                       TIMEOUT, "the resent append answered from its remembered reply")
            assert t.is_alive(), out  # held, not refused: no replica has it yet
            procs("--replica-of", f"{HOST}:{primary.port}")
            t.join(TIMEOUT * 2)
            assert not t.is_alive()
            assert out["r"] is None, out["r"]  # acknowledged once the new replica had it
            assert admin.peek("q", max_items=None) == [7]  # applied once
        finally:
            c.close()


def _attempt(call: Callable[[], Any]) -> BaseException | None:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 (the test reports it)
        return exc
    return None


def test_a_write_short_of_replicas_is_refused_at_once_after_a_replica_left(
        procs: Callable[..., ServerProcess], clients: Callable[..., Client]) -> None:
    """Once a replica has been and gone, the primary has an in-memory log and holds its
    write replies for the replicas; a refusal (nothing applied) is not held with them: it
    comes at once, long before --replica-timeout, with the refusal's own words."""
    primary = procs("--min-replicas", "1", "--replica-timeout", "60")
    replica = procs("--replica-of", f"{HOST}:{primary.port}")
    c = clients(primary.port, timeout=10.0)
    wait_until(lambda: [x["live"] for x in repl(c)["replicas"]] == [True], TIMEOUT,
               "the replica in sync")
    c.put("kept", 1)
    replica.kill()
    wait_until(lambda: not any(x["live"] for x in repl(c)["replicas"]), TIMEOUT,
               "no replica in sync")
    with pytest.raises(NotEnoughReplicas, match="nothing was applied"):
        c.put("refused", 2)  # (held, it would time out in the client first: ReplyTimeout)
    assert "refused" not in c.list()
    assert c.peek("kept") == 1
