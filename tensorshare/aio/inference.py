"""AsyncInferenceClient: an asyncio program's handle on a model an ``InferenceHost`` serves
(an inference gateway's handlers, say), built like
:class:`~tensorshare.inference.InferenceClient`: the same arguments, the same call (one
place, :class:`~tensorshare.inference.client.InferenceCaller`), awaited."""

from __future__ import annotations

from typing import Any, Unpack

from ..client.options import ClientOptions, TransportFields
from ..inference.client import InferenceCaller
from .client import AsyncClient

__all__ = ["AsyncInferenceClient"]


class AsyncInferenceClient(InferenceCaller):
    """Calls the model an ``InferenceHost`` serves on service bin ``name``, from asyncio.

    Usage::

        async with AsyncInferenceClient("policy", "tensorshare://127.0.0.1:8000") as model:
            action = await model.predict(obs)

    Every task may call :meth:`predict` at once: the calls share one connection and are
    batched on the host with everyone else's, as :class:`~tensorshare.inference.
    InferenceClient`'s are.

    Args:
        name, host, port, timeout, wait_room, compress, device: as for
            :class:`~tensorshare.inference.InferenceClient` (one server, or a list of a
            primary and its replicas, ``["a:7000", "b:7000"]``: several shards need the
            blocking client's ``ShardedClient``).
        client: an :class:`~.client.AsyncClient` to use instead of connecting (not closed
            by :meth:`aclose`).
        options, client_options: the new client's :class:`~tensorshare.ClientOptions`, and
            fields of it as keywords (``token``, ``tls_ca``, ...), as for
            ``InferenceClient``.
    """

    def __init__(self, name: str, host: str | list[str] | None = None,
                 port: int | None = None, *,
                 timeout: float = 5.0, wait_room: bool = True, compress: str | None = "auto",
                 client: AsyncClient | None = None, device: Any = None,
                 options: ClientOptions | None = None,
                 **client_options: Unpack[TransportFields]) -> None:
        super().__init__(name, timeout, wait_room, compress, device, client is None)
        if isinstance(host, str) and "," in host:
            raise ValueError("AsyncInferenceClient connects to one server; for a service on "
                             "several, use InferenceClient (a ShardedClient)")
        self.client = AsyncClient(host, port, self.client_timeout, options=options,
                                  **client_options) if client is None else client
        self._shard = self.client

    async def connect(self) -> AsyncInferenceClient:
        """Connect the client this object made (``async with`` does it)."""
        if self._own:
            await self.client.connect()
        return self

    async def predict(self, inputs: Any, *, batched: bool = False,
                      return_version: bool = False, wait_room: bool | None = None) -> Any:
        """The model's output for ``inputs`` (its row; with ``batched``, its rows), as
        ``InferenceClient.predict``: the same keywords, results and errors (``WaitTimeout``,
        ``ServiceFailed``, ``BinFull``)."""
        cmd = self._command(inputs, batched, return_version, wait_room)
        return await self.client._execute(cmd)

    async def aclose(self) -> None:
        """Close the client (if this object made it)."""
        if self._own:
            await self.client.aclose()

    async def __aenter__(self) -> AsyncInferenceClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<AsyncInferenceClient {self.name!r}>"
