"""Runs of like tensors (docs/PROTOCOL.md §3.3.3.1) through the asyncio face: a drained queue
of like tensors comes back as rows of one tensor, the other items in their places, on
asyncio's loop and on uvloop's."""

from __future__ import annotations

import torch

from tensorshare import EmbeddedServer
from tensorshare.aio import AsyncClient
from tests.aio.conftest import Run
from tests.chaos import HOST


def test_a_drain_comes_back_as_rows_of_one_tensor(server: EmbeddedServer, run: Run) -> None:
    like = [torch.arange(6, dtype=torch.int16).reshape(2, 3) + i for i in range(100)]
    values = [*like[:60], torch.tensor(0.5), *like[60:]]
    tags = [i if i % 3 else None for i in range(len(values))]

    async def scenario() -> tuple[object, object]:
        async with AsyncClient(f"tensorshare://{HOST}:{server.port}", timeout=10) as c:
            for v, t in zip(values, tags, strict=True):
                await c.append("q", v, tag=t)
            peeked = await c.fetch("q", remove=False, max_items=500)
            got = await c.fetch("q", remove=True, max_items=500)
            return peeked, got

    for res in run(scenario()):
        assert res.tags == tuple(tags) and len(res.items) == len(values)
        assert all(torch.equal(a, b) and a.dtype == b.dtype
                   for a, b in zip(res.items, values, strict=True))
        assert len({v.untyped_storage().data_ptr() for v in res.items[:60]}) == 1
        res.items[0][0, 0] = 100  # writable, and its own row
        assert int(res.items[1][0, 0]) == 1
