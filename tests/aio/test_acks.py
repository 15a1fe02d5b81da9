"""The asyncio face acknowledges a get's items by itself, as the other faces do (a writer of
the same user waiting for room in its quota is not held back by items already delivered:
``client.session.ACK_DELAY``), although it holds each get's reply open until the task that
awaits it took it: a lone get, and a pipeline's gets."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import torch

from tensorshare import EmbeddedServer
from tensorshare.aio import AsyncClient
from tests.aio.conftest import Run
from tests.client.test_quota_acks import CHUNK, WAIT, _alice, _held, server  # noqa: F401
from tests.server.test_users import QUOTA, TOKENS


def _scenario(srv: EmbeddedServer,
              take: Callable[[AsyncClient], Coroutine[Any, Any, list[Any]]]
              ) -> Coroutine[Any, Any, None]:
    async def go() -> None:
        with _alice(srv, WAIT) as producer:
            for _ in range(3):
                producer.append("alice/q", torch.zeros(CHUNK))  # 48 KiB of her 64
        # The heartbeat would carry the acknowledgement only after a minute.
        async with AsyncClient(f"127.0.0.1:{srv.port}", timeout=WAIT, heartbeat=60.0,
                               user="alice", token=TOKENS["alice"]) as consumer:
            assert len(await take(consumer)) == 3
            assert not consumer._session.held
            with _alice(srv, 10.0) as writer:  # (a blocking call: in a thread)
                version = await asyncio.to_thread(
                    writer.put, "alice/w", torch.zeros(CHUNK * 3 // 2), wait_room=True)
            assert version == 1
            assert _held(srv) < QUOTA

    return go()


def test_the_async_client_acknowledges_a_gets_items_by_itself(run: Run,
                                                               server: EmbeddedServer  # noqa: F811
                                                               ) -> None:
    async def take(c: AsyncClient) -> list[Any]:
        return list(await c.get("alice/q"))

    run(_scenario(server, take))


def test_and_a_pipelines_gets_once_every_reply_is_in(run: Run,
                                                     server: EmbeddedServer  # noqa: F811
                                                     ) -> None:
    async def take(c: AsyncClient) -> list[Any]:
        async with c.pipeline() as p:
            p.get("alice/q", max_items=1)
            p.get("alice/q", max_items=2)
            p.ping()
        assert p.results is not None
        return [*p.results[0], *p.results[1]]

    run(_scenario(server, take))
