"""Runs of like tensors (docs/PROTOCOL.md §3.3.3.1) between real peers: the blocking and the
Twisted client against a real server get and peek a drained queue as rows of one tensor; an
old client (a hello without ``runs``) still gets every item as an item; a new client against
an old server (a reply without ``runs``) still reads item by item. (The asyncio face:
tests/aio/test_runs.py.)"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import torch

from tensorshare import Client, EmbeddedServer
from tensorshare.wire import codec
from tensorshare.wire.frames import PREFIX, aligned
from tensorshare.wire.messages import Acked, Append, Hello, HelloReply, Item
from tensorshare.wire.records import Fetch, Fetched
from tests.client.test_blocking_scripted import Scripted
from tests.client.test_both_clients import kind, make  # noqa: F401  (the two faces' clients)
from tests.rawwire import Get, Peek, WireClient

WAIT = 30.0


def queue() -> tuple[list[Any], list[int | None]]:
    """A queue's worth: a stretch of like tensors, an unlike one, like ones again."""
    g = torch.Generator().manual_seed(7)
    like = [torch.randn(3, generator=g) for _ in range(300)]
    values: list[Any] = [*like[:200], torch.arange(4), *like[200:]]
    tags = [i if i % 7 else None for i in range(len(values))]
    return values, tags


def one_storage(values: list[Any]) -> bool:
    return len({v.untyped_storage().data_ptr() for v in values}) == 1


def test_a_drain_comes_back_as_rows_of_one_tensor(server: EmbeddedServer,
                                                   make: Callable[..., Any]) -> None:  # noqa: F811
    c = make(server.port)
    values, tags = queue()
    for v, t in zip(values, tags, strict=True):
        c.append("q", v, tag=t)
    peeked = c.fetch("q", remove=False, max_items=1000)
    again = c.fetch("q", remove=False, max_items=1000)  # (the server's peek cache)
    got = c.fetch("q", remove=True, max_items=1000)
    for res in (peeked, again, got):
        assert res.kind == "list" and res.tags == tuple(tags)
        assert len(res.items) == len(values)
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in
                   zip(res.items, values, strict=True))
        assert one_storage(res.items[:200]) and one_storage(res.items[201:])
    assert got.n_items == 0
    got.items[0].add_(1)  # writable, and its own row
    assert torch.equal(got.items[0], values[0] + 1) and torch.equal(got.items[1], values[1])
    assert c.stats()["bins"].get("q", {}).get("n_items", 0) == 0


def test_a_value_bin_and_a_lone_item_are_as_before(server: EmbeddedServer,
                                                   make: Callable[..., Any]) -> None:  # noqa: F811
    c = make(server.port)
    c.put("w", torch.ones(4))
    assert torch.equal(c.get("w"), torch.ones(4))
    c.append("q", torch.ones(2))
    assert [t.tolist() for t in c.get("q", max_items=5)] == [[1.0, 1.0]]


def exchange(sock: socket.socket, client: WireClient, msg: Any) -> Any:
    """Send ``msg``; the one reply (read whole, frame by frame)."""
    sock.sendall(b"".join(bytes(c) for c in client.send(msg)))
    while True:
        data = sock.recv(1 << 20)
        assert data, "the server closed the connection"
        out = client.receive_data(data)
        if out:
            (reply,) = out
            return reply


def raw_get(port: int, hello_runs: bool) -> tuple[HelloReply, dict[str, Any], Fetched]:
    """What a client that speaks the wire by hand sees: the hello reply, the header of a get
    of a queue of like tensors, and the reply parsed."""
    client = WireClient()
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        hello = exchange(sock, client, Hello(client.next_id(), (1,), "raw", runs=hello_runs))
        assert type(hello) is HelloReply
        for i in range(10):
            item = Item(codec.encode(torch.full((2,), float(i))))
            exchange(sock, client, Append(client.next_id(), "q", item))
        exchange(sock, client, Peek(client.next_id(), "q", max_items=10))
        rid = client.next_id()
        sock.sendall(b"".join(bytes(c) for c in client.send(Get(rid, "q", max_items=10))))
        frame = b""
        while len(frame) < PREFIX or len(frame) < frame_len(frame):
            data = sock.recv(1 << 20)
            assert data, "the server closed the connection"
            frame += data
        header_len = struct.unpack_from("<I", frame, 4)[0]
        (reply,) = client.receive_data(frame)
    return hello, msgpack.unpackb(frame[PREFIX:PREFIX + header_len]), reply


def frame_len(frame: bytes) -> int:
    header_len, payload_len = struct.unpack_from("<IQ", frame, 4)
    return aligned(PREFIX + header_len) + payload_len if payload_len else PREFIX + header_len


@pytest.mark.parametrize("offered", [False, True])
def test_the_server_sends_runs_only_to_a_client_that_offered_them(server: EmbeddedServer,
                                                                  offered: bool) -> None:
    hello, header, reply = raw_get(server.port, offered)
    assert hello.runs is offered
    kinds = [type(e) for e in header["items"]]
    assert kinds == ([dict] if offered else [list] * 10)
    assert type(reply) is Fetched and len(reply.items) == (1 if offered else 10)


def test_a_new_client_reads_an_old_servers_items(server: EmbeddedServer) -> None:
    """A server that does not answer ``runs`` (scripted: an old one) sends items; the client
    offered runs all the same, and reads them."""
    values = [torch.full((3,), float(i)) for i in range(5)]

    def script(msg: Any, _: Scripted) -> list[Any]:
        if type(msg) is not Fetch:
            return [Acked(msg.id, True)]  # (the close's bye)
        return [Fetched(msg.id, "list", tuple(Item(codec.encode(v)) for v in values), 2, 0)]

    srv = Scripted(script)
    c = Client("scripted", 1, connector=srv.connector, timeout=WAIT, heartbeat=1000.0)
    try:
        got = c.get("q", max_items=5)
    finally:
        c.close()
        srv.cut()
        for t in srv.threads:
            t.join(WAIT)
    assert [t.tolist() for t in got] == [v.tolist() for v in values]
    assert srv.of(Hello)[0].runs is True


def test_over_shared_memory_runs_and_memfd_items_share_a_reply(tmp_path: Any) -> None:
    """On a Unix socket that agreed on memfds, a large tensor travels as a memfd item between
    the runs of small ones (a memfd buffer is never in a run)."""
    small = [torch.full((4,), float(i)) for i in range(20)]
    big = torch.arange(1 << 18, dtype=torch.float64)  # 2 MiB: over shm_min_bytes
    values = [*small[:10], big, *small[10:]]
    with EmbeddedServer(port=None, unix=str(tmp_path / "s.sock")) as srv, \
            Client(f"unix://{srv.unix}", timeout=WAIT, shm_min_bytes=1 << 20) as c:
        for v in values:
            c.append("q", v)
        for remove in (False, True):
            got = c.fetch("q", remove=remove, max_items=100).items
            assert len(got) == len(values)
            assert all(torch.equal(a, b) for a, b in zip(got, values, strict=True))
            assert one_storage(got[:10]) and one_storage(got[11:])
