"""The pipeline: many requests without waiting for each reply, errors reported per request."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tensorshare import Client, EmbeddedServer
from tensorshare.errors import BinFull, BinNotFound, UnsupportedType
from tensorshare.server import ServerConfig


def test_many_appends_travel_as_batches_and_arrive_in_order(server: EmbeddedServer) -> None:
    with Client("127.0.0.1", server.port) as c:
        events: list[dict[str, Any]] = []
        c.listen("q", events.append)
        with c.pipeline() as p:
            for i in range(25_000):
                p.append("q", torch.tensor([float(i)]), tag=i)
        versions = p.results
        assert versions is not None and len(versions) == 25_000
        # Consecutive appends to one bin went as batches of Pipeline.MAX_BATCH_ITEMS: one
        # version per batch, shared by its items.
        assert sorted(set(versions)) == [1, 2, 3]
        assert versions[0] == 1 and versions[-1] == 3
        got: list[Any] = []
        while len(got) < 25_000:
            res = c.fetch("q", remove=True, max_items=7_000)
            assert list(res.tags) == list(range(len(got), len(got) + len(res.tags)))
            got.extend(res.value)
        assert [int(t) for t in got] == list(range(25_000))
        stats = c.stats("q")["server"]["requests"]
        assert stats["append"] == 3  # three requests, not 25,000


def test_mixed_calls_keep_their_order_and_report_errors_one_by_one(
        server: EmbeddedServer) -> None:
    with Client("127.0.0.1", server.port) as c:
        c.configure("small", max_items=2)
        p = c.pipeline(raise_on_error=False)
        p.put("a", {"x": torch.arange(3)})
        p.append("b", 1)
        p.append("b", 2)
        p.get("missing")
        p.append("small", 1)
        p.append("small", 2)
        p.append("small", 3)  # the batch of three does not fit: all three refused
        p.get("b")
        p.peek("a")
        p.delete("b")
        p.fetch("a", remove=False, newer_than=1)
        results = p.execute()
        assert results[:3] == [1, 1, 1]
        assert isinstance(results[3], BinNotFound)
        assert all(isinstance(r, BinFull) for r in results[4:7])
        assert results[7] == [1, 2]
        assert torch.equal(results[8]["x"], torch.arange(3))
        assert results[9] is False  # the get emptied it
        assert results[10].unchanged
        assert p.execute() is results  # executes once
        with pytest.raises(RuntimeError, match="executed already"):
            p.put("z", 1)


def test_the_first_error_is_raised_after_every_reply_is_in(server: EmbeddedServer) -> None:
    with Client("127.0.0.1", server.port) as c:
        with pytest.raises(BinNotFound):
            with c.pipeline() as p:
                p.put("a", 1)
                p.get("missing")
                p.put("b", 2)
        assert p.results is not None and p.results[0] == 1 and p.results[2] == 1
        assert c.list() == {"a": 1, "b": 1}


def test_local_mistakes_raise_at_the_call_and_nothing_is_sent(server: EmbeddedServer) -> None:
    with Client("127.0.0.1", server.port) as c:
        p = c.pipeline()
        p.put("a", 1)
        with pytest.raises(UnsupportedType):
            p.append("b", {1, 2})
        with pytest.raises(ValueError):
            p.get("")
        assert len(p) == 1 and c.list() == {}
        p.execute()
        assert c.list() == {"a": 1}


def test_a_batch_into_a_block_bin_waits_for_room_for_all_of_it() -> None:
    with EmbeddedServer(port=0, config=ServerConfig()) as srv, \
            Client("127.0.0.1", srv.port, timeout=10) as producer, \
            Client("127.0.0.1", srv.port, timeout=10) as consumer:
        producer.configure("jobs", max_items=4, overflow="block")
        producer.append("jobs", -1)
        import threading

        done: list[Any] = []

        def produce() -> None:
            with producer.pipeline() as p:
                for i in range(4):
                    p.append("jobs", i)
            done.append(p.results)

        t = threading.Thread(target=produce)
        t.start()
        assert consumer.get("jobs", timeout=10) == [-1]
        t.join(10)
        assert done and done[0] == [3, 3, 3, 3]
        assert consumer.get("jobs") == [0, 1, 2, 3]
