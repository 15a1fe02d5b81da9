"""AsyncInferenceClient: an asyncio program's handle on a model an ``InferenceHost`` serves
(an inference gateway's handlers, say), built like
:class:`~tensorshare.inference.InferenceClient`: the same arguments, the same call (one
place, :func:`~tensorshare.inference.client.predict_command`), awaited."""

from __future__ import annotations

from typing import Any

from ..client.services import check_compress
from ..inference.client import predict_command
from ..memory.device import check_device, want_pinned
from .client import AsyncClient

__all__ = ["AsyncInferenceClient"]


class AsyncInferenceClient:
    """Calls the model an ``InferenceHost`` serves on service bin ``name``, from asyncio.

    Usage::

        async with AsyncInferenceClient("policy", "tensorshare://127.0.0.1:8000") as model:
            action = await model.predict(obs)

    Every task may call :meth:`predict` at once: the calls share one connection and are
    batched on the host with everyone else's, as :class:`~tensorshare.inference.
    InferenceClient`'s are.

    Args:
        name, host, port, timeout, wait_room, compress, device: as for
            :class:`~tensorshare.inference.InferenceClient` (one server: several servers
            need the blocking client's ``ShardedClient``).
        client: an :class:`~.client.AsyncClient` to use instead of connecting (not closed
            by :meth:`aclose`).
        client_options: more arguments of the client (``token``, ``tls_ca``, ...).
    """

    def __init__(self, name: str, host: str | None = None, port: int | None = None, *,
                 timeout: float = 5.0, wait_room: bool = True, compress: str | None = "auto",
                 client: AsyncClient | None = None, device: Any = None,
                 **client_options: Any) -> None:
        self.device = check_device(device)
        want_pinned(self.device)
        self.name = name
        self.timeout = timeout
        self.wait_room = bool(wait_room)
        self.compress = check_compress(compress)
        self._own = client is None
        if host is not None and "," in host:
            raise ValueError("AsyncInferenceClient connects to one server; for a service on "
                             "several, use InferenceClient (a ShardedClient)")
        # The client's own timeout leaves the server time to say WaitTimeout first.
        self.client = AsyncClient(host, port, max(timeout * 1.25, timeout + 1.0),
                                  **client_options) if client is None else client

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
        cmd = predict_command(self.client, self.name, inputs, batched=batched,
                              return_version=return_version,
                              wait_room=self.wait_room if wait_room is None
                              else bool(wait_room),
                              timeout=self.timeout, compress=self.compress,
                              device=self.device)
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
