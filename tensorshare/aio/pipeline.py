"""``async with client.pipeline() as p:``: the :class:`~tensorshare.client.pipeline.Pipeline`
face for an :class:`~.client.AsyncClient`.

Each op queues its command and returns the index its result will have, as on every pipeline
(consecutive appends to one bin travel as one request); the block's end sends the group in
one write and awaits every reply, then :attr:`~AsyncPipeline.results` holds what each call
returned. Cancelling the task meanwhile abandons the calls still waiting (a get whose items
had already come gives them back, as a lone call does).
"""

from __future__ import annotations

from typing import Any, NoReturn

from ..client.pipeline import Pipeline

__all__ = ["AsyncPipeline"]


class AsyncPipeline(Pipeline):
    """Requests queued locally and sent together by an :class:`~.client.AsyncClient`
    (``async with client.pipeline() as p``; see ``Client.pipeline``).

    Attributes:
        results: after the block (or :meth:`execute`), what each call returned, in order; a
            call that failed holds its exception instead.
    """

    async def execute(self) -> list[Any]:
        """Send every queued request and await every reply: ``Pipeline.execute``, awaited
        (what ``async with`` does at the end of its block)."""
        if self.results is not None:
            return self.results
        results: list[Any] = await super().execute()
        return results

    async def __aenter__(self) -> AsyncPipeline:
        return self

    async def __aexit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            await self.execute()

    def __enter__(self) -> NoReturn:
        raise TypeError("an AsyncClient's pipeline is used with 'async with client.pipeline()'")
