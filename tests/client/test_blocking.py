"""Integration tests: the blocking Client against a real server on loopback.

Most tests run an ``EmbeddedServer(port=0)`` (a private reactor in a daemon thread) and real
``Client`` objects on 127.0.0.1; two start ``python -m tensorshare serve`` in a separate
process. Nothing waits on a sleep: threads hand results over through Events, Conditions and
queues, each with a generous deadline that is never reached when things work.
"""

from __future__ import annotations

import gc
import math
import os
import queue
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from tensorshare.client.blocking import Client
from tensorshare.errors import (
    BinNotFound,
    ConnectError,
    ConnectionLost,
    FrameTooLarge,
    LimitExceeded,
    MemoryLimitExceeded,
    ServerError,
    Timeout,
    TransportError,
    UnsupportedType,
)
from tensorshare.server import EmbeddedServer
from tensorshare.wire.messages import Hello, Limits
from tests.conftest import wait_until
from tests.rawwire import WireClient

WAIT = 20.0  # safety deadline; never reached when things work
HOST = "127.0.0.1"
MiB = 1 << 20

# ------------------------------------------------------------------------------- fixtures


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    s = EmbeddedServer(port=0)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def connect() -> Iterator[Callable[..., Client]]:
    """Make clients that are all closed at the end of the test."""
    clients: list[Client] = []

    def make(srv: EmbeddedServer | int, **kw: Any) -> Client:
        port = srv if isinstance(srv, int) else srv.port
        kw.setdefault("timeout", WAIT)
        c = Client(HOST, port, **kw)
        clients.append(c)
        return c

    try:
        yield make
    finally:
        for c in clients:
            c.close()


@pytest.fixture
def client(server: EmbeddedServer, connect: Callable[..., Client]) -> Client:
    return connect(server)


# ------------------------------------------------------------------------------- helpers


class Events:
    """A listen callback that records events and lets the test wait for a count."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.items: list[dict[str, Any]] = []

    def __call__(self, event: dict[str, Any]) -> None:
        with self.cond:
            self.items.append(event)
            self.cond.notify_all()

    def wait_for(self, n: int) -> list[dict[str, Any]]:
        with self.cond:
            ok = self.cond.wait_for(lambda: len(self.items) >= n, WAIT)
            assert ok, f"only {len(self.items)} of {n} events arrived: {self.items}"
            return list(self.items)


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, threading.Event, list[Any]]:
    """Run ``fn`` in a daemon thread; the list gets ("ok", result) or ("err", exception)."""
    done = threading.Event()
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(("ok", fn()))
        except BaseException as exc:
            box.append(("err", exc))
        finally:
            done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done, box


class _WaiterRegistered:
    """Becomes set when the server's store holds more waiting fetches than it did when this
    was made (a condition polled with a deadline, read in the server's own thread)."""

    def __init__(self, server: EmbeddedServer) -> None:
        self.server = server
        self.store = server.factory.store
        self.before = server.call(lambda: self.store.n_waiters)

    def is_set(self) -> bool:
        return bool(self.server.call(lambda: self.store.n_waiters) > self.before)

    def wait(self, timeout: float | None = None) -> bool:
        try:
            wait_until(self.is_set, 30.0 if timeout is None else timeout,
                       "the server to register a waiting fetch")
        except AssertionError:
            return False
        return True


def waiter_registered(server: EmbeddedServer) -> _WaiterRegistered:
    """Set once the server's store next registers a waiting fetch."""
    return _WaiterRegistered(server)


def server_state(server: EmbeddedServer) -> tuple[dict[str, int], int, int]:
    store = server.factory.store
    return server.call(lambda: (store.list(), store.nbytes, store.n_waiters))


def as_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8).numpy())


def assert_bit_exact(got: Any, want: torch.Tensor) -> None:
    assert isinstance(got, torch.Tensor)
    assert got.dtype == want.dtype and got.shape == want.shape, (got, want)
    assert as_bytes(got) == as_bytes(want)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def recv_until_closed(sock: socket.socket) -> bytes:
    """Everything the peer sends until it closes; fails if it does not close within WAIT."""
    sock.settimeout(WAIT)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


# ------------------------------------------------------------------------------- basic API


def test_put_returns_increasing_versions(client: Client) -> None:
    versions = [client.put("v", i) for i in range(5)]
    assert versions == [1, 2, 3, 4, 5]
    assert client.put("other", 0) == 1
    assert client.peek("v") == 4


def test_put_then_get_and_peek(client: Client) -> None:
    w = torch.randn(8, 3)
    client.put("w", {"w": w, "step": 3})
    got = client.peek("w")
    assert torch.equal(got["w"], w) and got["step"] == 3
    got = client.get("w")
    assert torch.equal(got["w"], w)
    with pytest.raises(BinNotFound):
        client.get("w")


def test_append_then_get_and_peek_a_list(client: Client) -> None:
    assert client.append("q", torch.ones(2)) == 1
    assert client.append("q", [1, 2]) == 2  # a list is one item
    assert client.append("q", "three") == 3
    items = client.peek("q")
    assert isinstance(items, list) and len(items) == 3
    assert torch.equal(items[0], torch.ones(2)) and items[1:] == [[1, 2], "three"]
    assert client.peek("q", max_items=2)[1] == [1, 2]
    assert client.list() == {"q": 3}
    assert [x if not isinstance(x, torch.Tensor) else "t" for x in client.get("q")] == [
        "t", [1, 2], "three"]
    assert client.list() == {}


def test_append_to_a_put_bin_makes_a_list(client: Client) -> None:
    client.put("b", "first")
    client.append("b", "second")
    assert client.get("b") == ["first", "second"]


def test_get_max_items_is_fifo(client: Client) -> None:
    for i in range(10):
        client.append("fifo", i)
    assert client.get("fifo", max_items=3) == [0, 1, 2]
    assert client.peek("fifo", max_items=2) == [3, 4]
    assert client.get("fifo", max_items=4) == [3, 4, 5, 6]
    assert client.get("fifo", max_items=100) == [7, 8, 9]
    assert client.list() == {}


def test_list_and_delete(client: Client) -> None:
    assert client.list() == {}
    client.put("a", 1)
    client.append("b", 1)
    client.append("b", 2)
    assert client.list() == {"a": 1, "b": 2}
    assert client.delete("a") is True
    assert client.delete("a") is False
    assert client.delete("never") is False
    assert client.list() == {"b": 2}
    with pytest.raises(BinNotFound):
        client.peek("a")
    assert client.put("a", 2) == 3  # versions continue after a delete


def test_list_counts_items_never_versions(client: Client) -> None:
    """What the README and the docstring say: list() maps a bin to how many items it holds
    (1 for a put bin), not to its version; stats() has both."""
    for i in range(5):
        client.put("weights", i)  # version 5, one item
    for i in range(3):
        client.append("queue", i)  # version 3, three items
    client.get("queue", max_items=1)  # version 4, two items
    assert client.list() == {"weights": 1, "queue": 2}
    bins = client.stats()["bins"]
    assert (bins["weights"]["version"], bins["weights"]["n_items"]) == (5, 1)
    assert (bins["queue"]["version"], bins["queue"]["n_items"]) == (4, 2)


def test_listen_reports_every_change_in_order_then_unlisten(client: Client) -> None:
    events, sentinel = Events(), Events()
    client.listen("ev", events)
    client.listen("sentinel", sentinel)
    client.put("ev", torch.zeros(3))
    client.append("ev", 1)
    client.get("ev", max_items=1)
    client.delete("ev")
    got = events.wait_for(4)
    assert got == [
        {"status": "OK", "bin": "ev", "op": "put", "n_items": 1, "version": 1},
        {"status": "OK", "bin": "ev", "op": "append", "n_items": 2, "version": 2},
        {"status": "OK", "bin": "ev", "op": "get", "n_items": 1, "version": 3},
        {"status": "OK", "bin": "ev", "op": "delete", "n_items": 0, "version": 4},
    ]
    assert client.unlisten("ev") is True
    assert client.unlisten("ev") is False
    client.put("ev", 1)
    client.put("sentinel", 1)
    sentinel.wait_for(1)  # events arrive in order: one for "ev" would have come first
    assert len(events.items) == 4
    assert len(sentinel.items) == 1


def test_missing_bin_raises_bin_not_found_at_once(client: Client) -> None:
    for call in (client.get, client.peek):
        with pytest.raises(BinNotFound) as info:
            call("missing")
        assert isinstance(info.value, LookupError)
        assert isinstance(info.value, ServerError) and info.value.code == "bin_not_found"
        assert "missing" in str(info.value)
    client.ping()


def test_get_with_timeout_on_an_empty_bin_raises_timeout(server: EmbeddedServer,
                                                         client: Client) -> None:
    with pytest.raises(Timeout) as info:
        client.get("empty", timeout=0.3)
    assert isinstance(info.value, TimeoutError)
    with pytest.raises(TimeoutError):
        client.peek("empty", timeout=0.0)
    assert server_state(server)[2] == 0
    client.put("empty", 1)  # stays in the bin: no waiter is left to take it
    assert client.peek("empty") == 1


@pytest.mark.parametrize("timeout", [5.0, None], ids=["timeout=5", "timeout=None"])
def test_waiting_get_served_by_a_put_from_another_thread(server: EmbeddedServer,
                                                         client: Client,
                                                         timeout: float | None) -> None:
    registered = waiter_registered(server)
    value = {"x": torch.arange(1000), "t": (1, 2)}

    def writer() -> int:
        assert registered.wait(WAIT)
        return client.put("later", value)  # the same client, from another thread

    t, done, box = in_thread(writer)
    got = client.get("later", timeout=timeout)
    assert done.wait(WAIT)
    assert box == [("ok", 1)]
    assert torch.equal(got["x"], value["x"]) and got["t"] == (1, 2)
    assert server_state(server) == ({}, 0, 0)


@pytest.mark.parametrize("timeout", [math.inf, 1e10], ids=["inf", "1e10"])
def test_get_with_a_huge_timeout_waits_or_refuses_and_loses_no_data(
        server: EmbeddedServer, connect: Callable[..., Client], timeout: float) -> None:
    """``timeout=inf`` (or beyond threading.TIMEOUT_MAX) must not strand a server waiter.

    Either the call waits and gets the data, or it is refused with a ValueError (locally,
    or InvalidRequest from the server) and the next put stays in the bin.
    """
    c, writer = connect(server), connect(server)
    registered = waiter_registered(server)
    t, done, box = in_thread(lambda: c.get("huge", timeout=timeout))
    # Polled here, not in a thread of its own: nothing asks the server once the test is over.
    wait_until(lambda: done.is_set() or registered.is_set(), WAIT,
               "the get to end or the server to register it as a waiting fetch")
    writer.put("huge", 42)
    if done.is_set() and box[0][0] == "err":
        exc = box[0][1]
        try:
            left = writer.peek("huge")
        except BinNotFound:
            left = None
        fate = "stayed in the bin" if left == 42 else "was taken by a stranded server waiter"
        assert isinstance(exc, ValueError) and left == 42, f"get raised {exc!r}; the put {fate}"
    else:
        assert done.wait(WAIT)
        assert box == [("ok", 42)]


def test_get_with_nan_timeout_loses_no_data(server: EmbeddedServer,
                                            connect: Callable[..., Client]) -> None:
    """A NaN timeout must be refused and must leave nothing behind on the server.

    Today the request is sent; the server registers a waiter, then ``callLater(nan)``
    raises (internal error); the waiter stays and takes the next put of that bin.
    """
    c, other = connect(server), connect(server)
    with pytest.raises(ValueError):
        c.get("nan", timeout=math.nan)
    other.put("nan", 1)
    assert server_state(server)[2] == 0, "a waiter was left on the server"
    assert other.peek("nan") == 1, "the put was taken by a stranded waiter"


# ------------------------------------------------------------------------------- values

DTYPES = [torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
          torch.uint16, torch.uint32, torch.uint64]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaNs, infinities, -0.0 included) of the given dtype."""
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = math.prod(shape)
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def test_every_dtype_round_trips_bit_exact(client: Client) -> None:
    value = {str(dt): random_tensor(dt, (7, 5), i) for i, dt in enumerate(DTYPES)}
    value["special"] = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, -0.0, 5e-324])
    client.put("dtypes", value)
    got = client.get("dtypes")
    assert set(got) == set(value)
    for key, want in value.items():
        assert_bit_exact(got[key], want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_odd_shapes_round_trip_bit_exact(client: Client, dtype: torch.dtype) -> None:
    base = random_tensor(dtype, (6, 8), 3)
    cases = {
        "scalar": random_tensor(dtype, (), 1),
        "empty": torch.empty(0, dtype=dtype),
        "empty2d": torch.empty(3, 0, 2, dtype=dtype),
        "transposed": base.t(),
        "strided": base[1::2, ::3],
        "expanded": base[0].expand(4, 8),
        "column": base[:, 5],
    }
    if dtype.is_complex:
        cases["conj"] = base.conj()
    if dtype is torch.float32:
        cases["grad"] = base.clone().requires_grad_()
    client.put("shapes", cases)
    got = client.get("shapes")
    for key, want in cases.items():
        assert_bit_exact(got[key], want.detach())
        assert got[key].is_contiguous()


def test_received_tensors_are_writable_and_independent(client: Client) -> None:
    t = torch.arange(10)
    client.put("w", [t, t])
    a, b = client.get("w")
    a += 1
    assert torch.equal(b, torch.arange(10)) and torch.equal(t, torch.arange(10))


def test_a_64_mib_tensor_round_trips(client: Client) -> None:
    big = torch.randn(16 * MiB)  # 64 MiB of float32
    assert big.numel() * 4 == 64 * MiB
    client.put("big", big)
    got = client.get("big")
    assert got.shape == big.shape and torch.equal(got, big)


def test_numpy_arrays_come_back_as_numpy(client: Client) -> None:
    arrays = {
        "f32": np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32),
        "i64": np.arange(12, dtype=np.int64).reshape(3, 4),
        "bool": np.array([True, False, True]),
        "c128": np.array([1 + 2j, -3.5j]),
        "f16": np.array([1.5, -2.0], dtype=np.float16),
        "u16": np.array([1, 65535], dtype=np.uint16),
        "scalar": np.array(3.25),
        "empty": np.empty((0, 4), dtype=np.int8),
        "strided": np.arange(20, dtype=np.float64).reshape(4, 5)[:, ::2],
        "big_endian": np.arange(4, dtype=">i4"),
    }
    client.put("np", arrays)
    got = client.get("np")
    for key, want in arrays.items():
        assert type(got[key]) is np.ndarray, key
        assert got[key].shape == want.shape and got[key].dtype.name == want.dtype.name, key
        np.testing.assert_array_equal(got[key], want)
    assert got["big_endian"].dtype.isnative


def test_tuples_stay_tuples_and_nesting_survives(client: Client) -> None:
    value = {
        "t": (1, "a", (2.5, None), []),
        "l": [(1,), [2, (3, [4])]],
        "d": {"inner": {"deeper": {"t": torch.tensor([1, 2]), "b": b"\x00\xff", "n": None}}},
        "scalars": [True, False, 0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 1.5, "ünï"],
        "empty": {"l": [], "t": (), "d": {}},
    }
    client.put("nested", value)
    got = client.get("nested")
    assert got["t"] == (1, "a", (2.5, None), [])
    assert type(got["t"]) is tuple and type(got["t"][2]) is tuple
    assert got["l"] == [(1,), [2, (3, [4])]] and type(got["l"][1][1]) is tuple
    inner = got["d"]["inner"]["deeper"]
    assert torch.equal(inner["t"], torch.tensor([1, 2]))
    assert inner["b"] == b"\x00\xff" and inner["n"] is None
    assert got["scalars"] == value["scalars"]
    assert got["empty"] == {"l": [], "t": (), "d": {}} and type(got["empty"]["t"]) is tuple
    client.put("tuple", (torch.ones(1), 2))
    got = client.get("tuple")
    assert type(got) is tuple and got[1] == 2


@pytest.mark.parametrize(
    ("value", "path", "type_name"),
    [
        ({"a": {1, 2}}, "value['a']", "set"),
        ({"a": [0, {"b": (1, {1: 2})}]}, "value['a'][1]['b'][1]", "int"),
        ([1, 2, object()], "value[2]", "object"),
        ({"f": lambda: 1}, "value['f']", "function"),
        (torch.zeros(2).to_sparse(), "value", "layout"),
    ],
)
def test_unsupported_type_is_refused_before_sending(server: EmbeddedServer, client: Client,
                                                    value: Any, path: str,
                                                    type_name: str) -> None:
    client.put("keep", 1)
    before = server_state(server)
    for call in (client.put, client.append):
        with pytest.raises(UnsupportedType) as info:
            call("x", value)
        assert f"cannot send {path}:" in str(info.value)
        assert type_name in str(info.value)
        assert isinstance(info.value, TypeError)
    assert server_state(server) == before
    assert server.call(server.factory.store.version, "x") == 0
    assert client.list() == {"keep": 1}


@pytest.mark.parametrize("name", ["with space", "a|b", "a/b/c", "ünï©ødé ✓ 名前", " ", "\x00",
                                  "emoji 🎉"])
def test_bin_names_with_any_characters(client: Client, name: str) -> None:
    events = Events()
    client.listen(name, events)
    assert client.put(name, name) == 1
    assert client.list() == {name: 1}
    assert client.peek(name) == name
    assert client.get(name) == name
    client.append(name, 1)
    assert client.delete(name) is True
    assert [e["bin"] for e in events.wait_for(4)] == [name] * 4
    assert client.unlisten(name) is True


def test_bin_name_length_limit(server: EmbeddedServer, client: Client) -> None:
    limit = client.limits.max_name_bytes
    assert limit == Limits().max_name_bytes
    exact = "é" * (limit // 2)  # two bytes each
    assert len(exact.encode()) == limit
    assert client.put(exact, 1) == 1
    assert client.peek(exact) == 1
    assert client.list() == {exact: 1}
    too_long = exact + "x"
    before = server_state(server)
    calls: list[Callable[[], Any]] = [
        lambda: client.put(too_long, 1), lambda: client.append(too_long, 1),
        lambda: client.get(too_long), lambda: client.peek(too_long),
        lambda: client.get(too_long, timeout=1), lambda: client.delete(too_long),
        lambda: client.listen(too_long, print), lambda: client.unlisten(too_long),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=f"max_name_bytes={limit}") as info:
            call()
        assert not isinstance(info.value, ServerError)  # refused locally
    assert server_state(server) == before
    with pytest.raises(ValueError):
        client.put("", 1)
    with pytest.raises(TypeError):
        client.put(b"bytes", 1)  # type: ignore[arg-type]
    client.ping()


# ------------------------------------------------------------------------------- concurrency


def test_16_threads_share_one_client(server: EmbeddedServer, client: Client) -> None:
    n_threads, rounds = 16, 50
    start = threading.Barrier(n_threads)
    errors: list[str] = []

    def work(i: int) -> None:
        start.wait(WAIT)
        name = f"thread-{i}"
        for j in range(rounds):
            t = torch.full((257 + i,), float(i * 1000 + j), dtype=torch.float64)
            v = client.put(name, {"t": t, "ij": (i, j)})
            if v != 2 * j + 1:
                errors.append(f"{name}: put {j} gave version {v}")
            got = client.get(name)
            if got["ij"] != (i, j) or not torch.equal(got["t"], t):
                errors.append(f"{name}: round {j} got {got['ij']}")

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT * 3)
        assert not t.is_alive()
    assert errors == []
    assert client.list() == {}
    assert server_state(server) == ({}, 0, 0)


def test_one_client_listens_while_another_writes(server: EmbeddedServer,
                                                 connect: Callable[..., Client]) -> None:
    listener, writer = connect(server), connect(server)
    events = Events()
    listener.listen("stream", events)
    ops = []
    for i in range(60):
        if i % 3 == 0:
            writer.put("stream", torch.full((4,), i))
            ops.append("put")
        else:
            writer.append("stream", i)
            ops.append("append")
        if i % 10 == 9:
            writer.get("stream", max_items=1)
            ops.append("get")
    writer.delete("stream")
    ops.append("delete")
    got = events.wait_for(len(ops))
    assert [e["op"] for e in got] == ops
    versions = [e["version"] for e in got]
    assert all(a < b for a, b in zip(versions, versions[1:], strict=False))
    assert versions == list(range(1, len(ops) + 1))
    assert all(e["bin"] == "stream" and e["status"] == "OK" for e in got)
    assert got[-1]["n_items"] == 0


def test_a_slow_listen_callback_does_not_stall_requests(client: Client) -> None:
    entered, release = threading.Event(), threading.Event()
    later = Events()

    def slow(event: dict[str, Any]) -> None:
        entered.set()
        assert release.wait(WAIT)
        later(event)

    client.listen("slow", slow)
    client.put("slow", 1)
    assert entered.wait(WAIT)
    # the callback is blocked now; requests (and more events) still go through
    for i in range(20):
        assert client.put("slow", i) == i + 2
        assert client.peek("slow") == i
        client.append("other", torch.ones(1000))
    assert len(client.get("other")) == 20
    assert client.list() == {"slow": 1}
    assert not later.items
    release.set()
    got = later.wait_for(21)
    assert [e["version"] for e in got] == list(range(1, 22))


def test_many_outstanding_calls_complete_out_of_order(client: Client) -> None:
    waiting = client.begin_fetch("late", remove=True, timeout=WAIT)
    calls = [client.begin_put(f"b{i}", i) for i in range(50)]
    assert [c.result() for c in calls] == [1] * 50
    client.put("late", "done")
    assert waiting.result().value == "done"


# ------------------------------------------------------------------------------- hostile peers


def test_garbage_on_a_raw_socket_closes_it_and_others_keep_working(
        server: EmbeddedServer, client: Client) -> None:
    client.put("keep", torch.arange(5))
    with socket.create_connection((HOST, server.port), timeout=WAIT) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        client.put("during", 1)
        data = recv_until_closed(raw)
    assert data == b"" or data.startswith(b"TS")  # an error frame, then the close
    if data:
        (err,) = WireClient().receive_data(data)
        assert err.code == "protocol_error"
    assert torch.equal(client.get("keep"), torch.arange(5))
    assert client.get("during") == 1


def test_huge_announced_payload_gets_an_error_or_a_close(connect: Callable[..., Client]) -> None:
    """A peer announces a 2**40-byte payload: it must hear back without sending 1 TiB.

    The server's limits are small. The header (a put with an id) is complete, so the server
    knows the frame is oversized and which request it is as soon as the header is in.
    """
    limits = Limits(max_frame_bytes=64 * 1024, max_header_bytes=4096)
    with EmbeddedServer(port=0, limits=limits) as srv:
        other = connect(srv)
        with socket.create_connection((HOST, srv.port), timeout=WAIT) as raw:
            conn = WireClient()
            raw.sendall(b"".join(conn.send(Hello(conn.next_id(), (1,)))))
            header = msgpack.packb({"op": "put", "id": 2, "bin": "x",
                                    "items": [[msgpack.packb(None), [[0, 2**40]], None]]})
            cut = False
            try:
                raw.sendall(struct.pack("<2sBBIQ", b"TS", 1, 0, len(header), 2**40) + header
                            + bytes(-(16 + len(header)) % 64) + bytes(1 * MiB))
            except (BrokenPipeError, ConnectionResetError):
                cut = True  # the server closed before the 1 MiB was all sent: allowed
            # the server keeps serving everyone else meanwhile
            assert other.put("fine", torch.ones(3)) == 1
            assert torch.equal(other.get("fine"), torch.ones(3))
            raw.settimeout(5.0)
            received = b""
            closed = cut
            try:
                while True:
                    chunk = raw.recv(65536)
                    if not chunk:
                        closed = True
                        break
                    received += chunk
                    msgs = conn.receive_data(chunk)
                    if any(getattr(m, "id", None) == 2 for m in msgs):
                        break
            except ConnectionResetError:
                closed = True
            except TimeoutError:
                pass
            msgs = WireClient().receive_data(received)
            errors = [m for m in msgs if getattr(m, "code", None) is not None]
            assert closed or errors, (
                "the server neither answered nor closed a connection that announced a "
                "2**40-byte payload over max_frame_bytes; it waits for all of it")
            if errors:
                assert errors[-1].code in ("limit_exceeded", "protocol_error")
        other.ping()


def test_oversized_put_raises_limit_exceeded_and_the_client_keeps_working(
        connect: Callable[..., Client]) -> None:
    with EmbeddedServer(port=0, limits=Limits(max_frame_bytes=64 * 1024,
                                              max_header_bytes=4096)) as srv:
        c = connect(srv)
        with pytest.raises(LimitExceeded) as info:
            c.put("big", torch.zeros(100_000))
        # Refused by the client, before anything is sent: a local error that says so, and
        # the LimitExceeded the server would have answered (except LimitExceeded works).
        assert type(info.value) is FrameTooLarge and isinstance(info.value, ValueError)
        assert info.value.code == "limit_exceeded" and "nothing was sent" in str(info.value)
        with pytest.raises(FrameTooLarge):
            c.append("big", torch.zeros(100_000))
        counters = srv.call(lambda: dict(srv.factory.stats.counters))
        assert not counters.get("op.put") and not counters.get("op.append")  # none arrived
        assert c.list() == {}
        assert c.put("small", torch.zeros(100)) == 1


# ------------------------------------------------------------------------------- failures


def test_without_reconnect_server_stop_fails_a_waiting_get_promptly(
        server: EmbeddedServer, connect: Callable[..., Client]) -> None:
    client = connect(server, reconnect=False)
    registered = waiter_registered(server)
    t, done, box = in_thread(lambda: client.get("never", timeout=None))
    assert registered.wait(WAIT)
    server.stop()
    t.join(WAIT)
    assert not t.is_alive(), "the waiting get did not end when the server stopped"
    assert box[0][0] == "err" and isinstance(box[0][1], ConnectionLost), box
    assert client.closed
    for call in (client.ping, client.list, lambda: client.put("x", 1),
                 lambda: client.get("x", timeout=None)):
        with pytest.raises(ConnectionLost):
            call()


def test_connect_to_a_port_where_nothing_listens(connect: Callable[..., Client]) -> None:
    port = free_port()
    with pytest.raises(ConnectError) as info:
        Client(HOST, port, timeout=1.0)  # (it retries for its timeout: the server may be late)
    assert isinstance(info.value, TransportError) and isinstance(info.value, ConnectionError)
    assert str(port) in str(info.value)


def test_max_memory_refusal_keeps_earlier_data(connect: Callable[..., Client]) -> None:
    with EmbeddedServer(port=0, max_memory=64 * 1024) as srv:
        c = connect(srv)
        first = torch.arange(1000, dtype=torch.float32)  # 4 KB
        assert c.put("a", first) == 1
        c.append("q", 1)
        before = server_state(srv)
        for call in (lambda: c.put("a", torch.zeros(100_000)),
                     lambda: c.append("q", torch.zeros(100_000)),
                     lambda: c.put("new", torch.zeros(100_000))):
            with pytest.raises(MemoryLimitExceeded) as info:
                call()
            assert isinstance(info.value, LimitExceeded) and info.value.code == "memory_limit"
        assert server_state(srv) == before
        assert torch.equal(c.peek("a"), first)
        assert c.list() == {"a": 1, "q": 1}
        assert c.put("a", torch.zeros(10)) == 2  # within the limit: still accepted


# ------------------------------------------------------------------------------- separate process


class ServerProcess:
    """``python -m tensorshare serve`` in a child process; reads back where it listens."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tensorshare", "serve", *args],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            text=True, env=env)
        lines: queue.Queue[str] = queue.Queue()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.put(line)
            lines.put("")

        threading.Thread(target=read, daemon=True).start()
        try:
            self.line = lines.get(timeout=WAIT)
        except queue.Empty:
            self.close()
            raise AssertionError("the server process printed nothing") from None
        m = re.search(r"listening on (\S+):(\d+)$", self.line.strip())
        assert m, f"unexpected first line: {self.line!r}"
        self.host, self.port = m.group(1), int(m.group(2))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(WAIT)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def server_process() -> Iterator[Callable[..., ServerProcess]]:
    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        p = ServerProcess(*args)
        started.append(p)
        return p

    try:
        yield start
    finally:
        for p in started:
            p.close()


def test_cli_serve_binds_loopback_by_default(server_process: Callable[..., ServerProcess],
                                             connect: Callable[..., Client]) -> None:
    p = server_process("--port", "0")
    assert p.host == "127.0.0.1", p.line
    assert p.port > 0
    c = connect(p.port)
    assert c.put("x", torch.ones(2)) == 1
    assert torch.equal(c.get("x"), torch.ones(2))


def test_without_reconnect_a_killed_server_is_connection_lost(
        server_process: Callable[..., ServerProcess], connect: Callable[..., Client]) -> None:
    p = server_process("--port", "0", "--quiet")
    c = connect(p.port, reconnect=False)
    c.put("keep", torch.ones(3))
    sent = threading.Event()

    def waiting_get() -> Any:
        call = c.begin_fetch("never", remove=True, timeout=None)  # what get() does
        sent.set()
        return call.result()

    t, done, box = in_thread(waiting_get)
    assert sent.wait(WAIT)
    c.ping()  # requests are served in order: the get is now waiting on the server
    assert not done.is_set()
    os.kill(p.proc.pid, signal.SIGKILL)
    assert p.proc.wait(WAIT) == -signal.SIGKILL
    t.join(WAIT)
    assert not t.is_alive(), "the waiting get hangs after the server process died"
    assert box[0][0] == "err" and isinstance(box[0][1], ConnectionLost), box
    with pytest.raises(ConnectionLost):
        c.get("keep")
    with pytest.raises(ConnectionLost):
        c.put("keep", 1)


# ------------------------------------------------------------------------------- compression


def test_lz4_client_round_trips_and_the_server_stores_compressed_bytes(
        server: EmbeddedServer, connect: Callable[..., Client]) -> None:
    c = connect(server, compress="lz4")
    plain = connect(server)
    raw_size = 8 * MiB
    t = torch.arange(raw_size // 4, dtype=torch.int32) % 7  # compressible
    assert t.numel() * t.element_size() == raw_size
    c.put("z", {"t": t})
    stored = server.call(lambda: server.factory.store.nbytes)
    assert 0 < stored < raw_size // 4
    assert torch.equal(c.peek("z")["t"], t)
    assert torch.equal(plain.get("z")["t"], t)  # any client can read it
    # incompressible data stays raw and still round trips
    noise = random_tensor(torch.uint8, (1 * MiB,), 5)
    c.put("noise", noise)
    assert server.call(lambda: server.factory.store.nbytes) >= 1 * MiB
    assert_bit_exact(c.get("noise"), noise)


def test_auto_compression_takes_integer_frames_and_leaves_floats_raw(
        server: EmbeddedServer, connect: Callable[..., Client]) -> None:
    c = connect(server, compress="auto")
    frames = (torch.arange(4 * MiB, dtype=torch.int64) % 3).to(torch.uint8)  # compressible
    c.put("frames", frames)
    assert 0 < server.call(lambda: server.factory.store.nbytes) < MiB
    floats = torch.zeros(MiB // 4)  # compressible too, but floats are never compressed
    c.put("floats", floats)
    assert server.call(lambda: server.factory.store.nbytes) >= MiB
    assert torch.equal(c.get("frames"), frames) and torch.equal(c.get("floats"), floats)
    with pytest.raises(ValueError, match="compress must be"):
        connect(server, compress="zstd")


def test_a_received_value_lands_in_memory_a_dropped_value_gave_back(server: Any) -> None:
    """Large received parts come from the process's receive pool: a part returns when the
    tensor built on it is dropped, and the next value of that size reuses it; a tensor the
    caller still holds is never written by a later receive."""
    from tensorshare.memory.pool import receive_pool

    pool = receive_pool()
    assert pool is not None
    # The pool is the process's: what earlier tests' tensors gave back (the collector frees
    # the last of them now) goes back to the OS, so that this test counts its own parts.
    gc.collect()
    pool.trim(0)
    first, second = torch.arange(1 << 18, dtype=torch.float32), torch.ones(1 << 18)
    with Client("127.0.0.1", server.port) as c:
        c.put("v", first)
        held = c.peek("v")  # 1 MiB: a pooled part
        fresh, reused = pool.fresh, pool.reused
        c.put("v", second)
        other = c.peek("v")  # ``held`` is alive: its memory is not handed out again
        assert pool.reused == reused and pool.fresh == fresh + 1
        assert torch.equal(held, first) and torch.equal(other, second)
        assert held.data_ptr() != other.data_ptr()
        ptr = held.data_ptr()
        del held
        gc.collect()
        again = c.peek("v")  # the part ``held`` gave back
        assert pool.reused == reused + 1
        assert again.data_ptr() == ptr and torch.equal(again, second)
        again.add_(1)  # the caller's own memory: nothing else sees the change
        assert torch.equal(c.peek("v"), second) and torch.equal(other, second)


def test_the_receive_pool_can_be_turned_off() -> None:
    code = ("from tensorshare.memory.pool import receive_pool; "
            "assert receive_pool() is None; print('off')")
    env = {**os.environ, "TENSORSHARE_RECEIVE_POOL": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "off", out.stderr
