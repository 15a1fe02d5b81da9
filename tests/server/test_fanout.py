"""Parameter fan-out: one version read by many listening clients, encoded once by the server."""

from __future__ import annotations

import threading
from typing import Any

import torch

from tensorshare import Client, EmbeddedServer
from tests.conftest import wait_until

WAIT = 30.0


def test_32_readers_each_fetch_every_version_once_and_the_server_encodes_it_once(
        server: EmbeddedServer) -> None:
    readers = [Client("127.0.0.1", server.port, timeout=WAIT) for _ in range(32)]
    writer = Client("127.0.0.1", server.port, timeout=WAIT)
    got: list[list[tuple[int, float]]] = [[] for _ in readers]
    lock = threading.Lock()
    try:
        for i, r in enumerate(readers):
            last = {"version": 0}

            def fetch(ev: dict[str, Any], r: Client = r, i: int = i,
                      last: dict[str, int] = last) -> None:
                # Listen callbacks run on the client's own thread: fetch from there.
                res = r.fetch("params", remove=False, newer_than=last["version"])
                if not res.unchanged:
                    last["version"] = res.version
                    with lock:
                        got[i].append((res.version, float(res.value[0])))

            r.listen("params", fetch)
        before = server.call(lambda: dict(server.factory.stats.counters))
        for v in range(1, 4):
            writer.put("params", torch.full((1 << 20,), float(v)))  # 4 MiB
            wait_until(lambda v=v: all(g and g[-1][0] == v for g in got), timeout=WAIT,  # type: ignore[misc]
                       what=f"every reader to hold version {v}")
        after = server.call(lambda: dict(server.factory.stats.counters))
        for g in got:
            assert g == [(1, 1.0), (2, 2.0), (3, 3.0)]  # each version once, the right one
        encodes = after.get("reply_encodes", 0) - before.get("reply_encodes", 0)
        reuses = after.get("reply_reuses", 0) - before.get("reply_reuses", 0)
        assert encodes == 3 and reuses == 3 * 31
    finally:
        for c in [writer, *readers]:
            c.close()
