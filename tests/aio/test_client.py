"""The asyncio face against a real server: the same results and errors as the blocking
client, many tasks on one connection, pipelines, cancellation and timeouts, closing,
reconnecting, addresses (TLS, a token, a Unix socket with shared memory, TENSORSHARE_URL).
Each test runs on asyncio's loop and on uvloop's."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from tensorshare import (
    AuthenticationError,
    BinNotFound,
    Client,
    ConnectError,
    ConnectionLost,
    EmbeddedServer,
    InvalidRequest,
    UnsupportedType,
    WaitTimeout,
)
from tensorshare.aio import NOWAIT, AsyncClient, AsyncPipeline
from tensorshare.client.ops import BinLimits
from tensorshare.server import ServerConfig
from tensorshare.wire.records import Fetched
from tests.aio.conftest import Run
from tests.chaos import HOST, ChaosProxy
from tests.client.test_matrix import same
from tests.conftest import TlsFiles

TOKEN = "a-long-random-write-token"


def url(server: EmbeddedServer) -> str:
    return f"tensorshare://{HOST}:{server.port}"


def plain(x: Any) -> Any:
    """A result made comparable: records as dicts (without their request id), tensors kept."""
    if isinstance(x, Fetched):
        return {"kind": x.kind, "value": plain(x.value), "version": x.version,
                "n_items": x.n_items, "dropped": x.dropped, "unchanged": x.unchanged,
                "tags": x.tags}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {k: plain(v) for k, v in dataclasses.asdict(x).items()}
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(plain(v) for v in x)
    return x


# Every op once (streams included), in an order whose results depend on what came before.
SCRIPT: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("put", ("a", torch.arange(3)), {}),
    ("put", ("a", {"w": np.ones(2), "s": "x"}), {"tag": 4}),
    ("append", ("q", 1), {}),
    ("append", ("q", torch.zeros(2)), {"tag": 5}),
    ("peek", ("a",), {}),
    ("fetch", ("q",), {"remove": False, "min_tag": 5}),
    ("fetch", ("a",), {"remove": False, "newer_than": 2}),
    ("get", ("q",), {"max_items": 1}),
    ("list", (), {}),
    ("configure", ("q",), {"max_items": 3, "overflow": "drop_oldest"}),
    ("delete", ("a",), {}),
    ("delete", ("a",), {}),
    ("ping", (), {}),
    ("stream_open", ("s",), {}),
    ("stream_join", ("s", "c1"), {}),
    ("stream_append", ("s", [torch.ones(2), torch.zeros(2)]), {"epoch": 0}),
    ("stream_end", ("s",), {"epoch": 0, "samples": 2, "last": True}),
    ("stream_read", ("s", "c1"), {}),
    ("stream_leave", ("s", "c1"), {}),
    ("unlisten", ("a",), {}),
]


def test_every_op_returns_what_the_blocking_client_returns(run: Run) -> None:
    with EmbeddedServer(port=0) as one, EmbeddedServer(port=0) as two:
        with Client(HOST, one.port, timeout=10) as c:
            expected = [plain(getattr(c, op)(*args, **kw)) for op, args, kw in SCRIPT]

        async def scenario() -> list[Any]:
            async with AsyncClient(url(two), timeout=10) as a:
                return [plain(await getattr(a, op)(*args, **kw)) for op, args, kw in SCRIPT]

        got = run(scenario())
    for (op, _, _), want, have in zip(SCRIPT, expected, got, strict=True):
        assert same(have, want), f"{op}: the blocking client {want!r}, the async one {have!r}"
    configured = next(r for (op, _, _), r in zip(SCRIPT, got, strict=True) if op == "configure")
    assert configured == plain(BinLimits(3, None, "drop_oldest"))


FAILING: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("get", ("missing",), {}),
    ("peek", ("missing",), {"timeout": NOWAIT}),
    ("get", ("missing",), {"timeout": 0.05}),
    ("stream_append", ("not-opened", [1]), {"epoch": 0}),
    ("stream_read", ("not-opened", "c"), {}),
    ("configure", ("b",), {"overflow": "sideways"}),
]


def test_the_same_errors_as_the_blocking_client(run: Run, server: EmbeddedServer) -> None:
    def outcome(method: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> tuple[type, str]:
        try:
            method(*args, **kw)
        except Exception as exc:
            return type(exc), str(exc)
        raise AssertionError("did not fail")

    with Client(HOST, server.port, timeout=10) as b:
        expected = [outcome(getattr(b, op), args, kw) for op, args, kw in FAILING]

    async def scenario() -> list[tuple[type, str]]:
        got = []
        async with AsyncClient(url(server), timeout=10) as c:
            for op, args, kw in FAILING:
                try:
                    await getattr(c, op)(*args, **kw)
                except Exception as exc:
                    got.append((type(exc), str(exc)))
            # Local mistakes raise at the call, before anything is sent (nothing to await).
            with pytest.raises(ValueError):
                c.get("q", timeout=-1)
            with pytest.raises(UnsupportedType):
                c.put("q", object())
            with pytest.raises(TypeError):
                c.put("q", 1, tag="x")  # type: ignore[arg-type]
            with pytest.raises(ValueError):
                c.listen("q", max_queue=0)
            assert await c.list() == {}
        return got

    assert run(scenario()) == expected
    assert [t for t, _ in expected] == [BinNotFound, BinNotFound, WaitTimeout, BinNotFound,
                                        BinNotFound, InvalidRequest]


def test_many_tasks_share_one_connection_with_their_calls_in_flight_together(
        run: Run, server: EmbeddedServer) -> None:
    async def scenario() -> None:
        async with AsyncClient(url(server), timeout=10) as c:
            # A get that waits does not hold up anyone: no lock per call.
            waiting = asyncio.create_task(c.get("late", timeout=None))
            puts = await asyncio.gather(*[c.put(f"b{i}", torch.full((4,), i)) for i in
                                          range(200)])
            assert puts == [1] * 200
            got = await asyncio.gather(*[c.get(f"b{i}") for i in range(200)])
            assert all(torch.equal(g, torch.full((4,), i)) for i, g in enumerate(got))
            assert not waiting.done()
            stats = await c.stats()
            assert stats["server"]["connections"] == 1
            assert stats["server"]["waiting"]["fetches"] == 1
            await c.put("late", "here")
            assert await waiting == "here"

    run(scenario())


def test_a_pipeline_queues_and_sends_the_group_at_the_end_of_the_block(
        run: Run, server: EmbeddedServer) -> None:
    async def scenario() -> None:
        async with AsyncClient(url(server), timeout=10) as c:
            async with c.pipeline() as p:
                assert isinstance(p, AsyncPipeline)
                for i in range(1000):
                    assert p.append("q", torch.tensor([i])) == i
                assert p.put("v", 1) == 1000
                assert p.get("q") == 1001
                assert await c.list() == {}  # nothing went out yet
            assert p.results is not None
            assert p.results[:1000] == [1] * 1000  # one request: one new version
            assert [int(t) for t in p.results[1001]] == list(range(1000))
            assert await p.execute() is p.results  # executed once
            p2 = c.pipeline(raise_on_error=False)
            p2.get("missing")
            p2.ping()
            results = await p2.execute()
            assert isinstance(results[0], BinNotFound) and results[1] is None
            p3 = c.pipeline()
            p3.get("missing")
            with pytest.raises(BinNotFound):
                await p3.execute()
            with pytest.raises(TypeError, match="async with"), c.pipeline():
                pass

    run(scenario())


def test_cancelling_a_waiting_get_withdraws_it_on_the_server(
        run: Run, server: EmbeddedServer) -> None:
    async def waiters(c: AsyncClient) -> int:
        return int((await c.stats())["server"]["waiting"]["fetches"])

    async def scenario() -> None:
        async with AsyncClient(url(server), timeout=10) as c:
            task = asyncio.create_task(c.get("q", timeout=None))
            while await waiters(c) != 1:
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            while await waiters(c) != 0:
                await asyncio.sleep(0.005)
            # asyncio.timeout() around a call is the same cancellation.
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.1):
                    await c.get("q", timeout=None)
            while await waiters(c) != 0:
                await asyncio.sleep(0.005)
            await c.append("q", 1)
            assert await c.peek("q") == [1]  # nobody took it

    run(scenario())


class RacingClient(AsyncClient):
    """Cancels the task awaiting a get right after its reply came, before the task could
    take it (the moment a cancellation can come between the two)."""

    victim: asyncio.Task[Any] | None = None

    def _finish(self, ev: Any) -> None:
        super()._finish(ev)
        if ev.call.op == "get" and self.victim is not None:
            self.victim.cancel()
            self.victim = None


def test_a_get_cancelled_after_its_reply_came_gives_its_items_back_in_order(
        run: Run, server: EmbeddedServer) -> None:
    async def scenario() -> None:
        async with RacingClient(url(server), timeout=10) as c:
            for i in range(5):
                await c.append("q", i)
            task = asyncio.create_task(c.get("q", max_items=3))
            c.victim = task
            with pytest.raises(asyncio.CancelledError):
                await task
            # The cancel went out, the server put the items back at the front.
            deadline = asyncio.get_running_loop().time() + 10
            while await c.peek("q") != [0, 1, 2, 3, 4]:
                assert asyncio.get_running_loop().time() < deadline, await c.peek("q")
                await asyncio.sleep(0.005)
            assert not c._session.held
            assert await c.get("q") == [0, 1, 2, 3, 4]

    run(scenario())


def test_a_pipeline_cancelled_after_its_replies_came_gives_every_get_back(
        run: Run, server: EmbeddedServer) -> None:
    async def scenario() -> None:
        async with RacingClient(url(server), timeout=10) as c:
            for i in range(4):
                await c.append(f"q{i}", i)
            p = c.pipeline()
            for i in range(4):
                p.get(f"q{i}")
            task = asyncio.create_task(p.execute())
            c.victim = task
            with pytest.raises(asyncio.CancelledError):
                await task
            while await c.list() != {f"q{i}": 1 for i in range(4)}:
                await asyncio.sleep(0.005)
            assert [await c.get(f"q{i}") for i in range(4)] == [[i] for i in range(4)]

    run(scenario())


def test_closing_fails_pending_calls_and_every_later_one(run: Run, server: EmbeddedServer
                                                         ) -> None:
    async def scenario() -> None:
        c = AsyncClient(url(server), timeout=10)
        with pytest.raises(ConnectError, match="not connected"):
            await c.ping()
        assert await c.connect() is c
        pending = asyncio.create_task(c.get("q", timeout=None))
        await asyncio.sleep(0.05)
        await c.aclose()
        with pytest.raises(ConnectionLost, match="closed"):
            await pending
        with pytest.raises(ConnectionLost):
            await c.ping()
        assert c.closed and not c.connected
        await c.aclose()  # idempotent
        with Client(HOST, server.port, timeout=10) as b:  # bye ended our session at once
            assert b.stats()["server"]["sessions"] == 1  # (the one of b)

    run(scenario())


def test_connecting_to_nothing_is_a_connect_error(run: Run, free_port: int) -> None:
    async def scenario() -> None:
        with pytest.raises(ConnectError, match=f"{HOST}:{free_port}"):
            await AsyncClient(HOST, free_port, timeout=1, reconnect=False).connect()
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(ConnectError):
            async with AsyncClient(HOST, free_port, timeout=0.5):
                pass
        assert asyncio.get_running_loop().time() - t0 < 5

    run(scenario())


def test_a_dropped_connection_is_resumed_and_nothing_runs_twice(
        run: Run, server: EmbeddedServer) -> None:
    async def scenario() -> None:
        with ChaosProxy((HOST, server.port)) as proxy:
            async with AsyncClient(HOST, proxy.port, timeout=10) as c:
                events = c.listen("n")
                await events.start()
                for i in range(50):
                    await c.append("n", i)
                    if i % 10 == 5:
                        proxy.cut_all()
                assert proxy.stats()["accepted"] >= 2
                assert c.connected or await c.ping() is None
                assert await c.get("n") == list(range(50))  # each append exactly once
                seen: list[int] = []
                async for ev in events:  # every change seen, once, in order (or a resync)
                    seen.append(ev["version"])
                    if ev["version"] == 51:
                        break
                assert seen == sorted(set(seen)) and seen[-1] == 51

    run(scenario())


def test_without_reconnect_a_drop_fails_the_calls_with_connection_lost(
        run: Run, server: EmbeddedServer) -> None:
    async def scenario() -> None:
        with ChaosProxy((HOST, server.port)) as proxy:
            async with AsyncClient(HOST, proxy.port, timeout=10, reconnect=False) as c:
                task = asyncio.create_task(c.get("q", timeout=None))
                await asyncio.sleep(0.05)
                proxy.cut_all()
                with pytest.raises(ConnectionLost):
                    await task
                assert c.closed

    run(scenario())


def test_a_token_and_the_environment_url(run: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    with EmbeddedServer(port=0, config=ServerConfig(token=TOKEN)) as srv:
        async def scenario() -> None:
            with pytest.raises(AuthenticationError, match="wrong token"):
                await AsyncClient(HOST, srv.port, timeout=10, token="guess").connect()
            async with AsyncClient(timeout=10, token=TOKEN) as c:  # from TENSORSHARE_URL
                assert c.port == srv.port
                await c.put("w", 1)
                assert await c.peek("w") == 1

        monkeypatch.setenv("TENSORSHARE_URL", f"tensorshare://{HOST}:{srv.port}")
        run(scenario())


def test_tls_with_a_test_ca(run: Run, tls_files: TlsFiles) -> None:
    config = ServerConfig(token=TOKEN, tls_cert=tls_files.cert, tls_key=tls_files.key)
    big = torch.randn(1 << 20)
    with EmbeddedServer(port=0, config=config) as srv:
        async def scenario() -> None:
            async with AsyncClient(f"tensorshare+tls://localhost:{srv.port}", timeout=10,
                                   tls_ca=tls_files.ca, token=TOKEN) as c:
                await c.put("big", big)
                assert torch.equal(await c.get("big"), big)
            with pytest.raises(ConnectError, match="certificate does not check out"):
                await AsyncClient("localhost", srv.port, timeout=10, tls=True,
                                  tls_ca=tls_files.other_ca, token=TOKEN).connect()

        run(scenario())


def test_over_a_unix_socket_large_tensors_travel_through_shared_memory_both_ways(
        run: Run, tmp_path: Any) -> None:
    """A put stores the memfd the client wrote (no bytes in the socket), a get maps the
    server's, a pipeline of 100 shared appends (more descriptors than one message passes)
    arrives whole, and the blocking client reads what the async one wrote."""
    path = str(tmp_path / "s.sock")
    big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    with EmbeddedServer(port=None, unix=path) as srv:
        async def scenario() -> tuple[Any, ...]:
            async with AsyncClient(f"unix://{path}", timeout=10) as c:
                assert c.shared_memory
                await c.put("big", big)
                stored = srv.call(lambda: [b.shm is not None for b in srv.factory.store
                                           ._bins["big"].entries[0].item.value.buffers])
                got = await c.peek("big")
                async with c.pipeline() as p:
                    for i in range(100):
                        p.append("many", torch.full((1 << 18,), float(i)))
                many = await c.get("many", max_items=100)
                return stored, got, many

        stored, got, many = run(scenario())
        assert stored == [True]  # kept as the memfd the client wrote
        assert torch.equal(got, big)
        assert [float(t[0]) for t in many] == [float(i) for i in range(100)]
        with Client(f"unix://{path}", timeout=10) as blocking:
            assert torch.equal(blocking.peek("big"), big)


def test_the_library_sets_no_loop_policy(run: Run) -> None:
    before = type(asyncio.get_event_loop_policy())

    async def scenario() -> None:
        AsyncClient(HOST, 1, timeout=1)

    run(scenario())
    assert type(asyncio.get_event_loop_policy()) is before
    assert before is asyncio.DefaultEventLoopPolicy


def test_importing_the_face_imports_neither_torch_nor_twisted() -> None:
    import subprocess
    import sys

    code = ("import sys, tensorshare.aio as a; a.AsyncClient; "
            "print(sorted(m for m in ('torch', 'twisted', 'tensorshare.inference') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
