"""The asyncio face of tensorshare: :class:`AsyncClient`, every op of :class:`tensorshare.Client`
awaitable, on the caller's event loop (asyncio's own or uvloop's).

* :class:`AsyncClient`: ``async with AsyncClient("tensorshare://host:8000") as c:`` then
  ``await c.put(...)``, ``await c.get(...)``, ...; ``async for event in c.listen(name)``;
  ``async with c.pipeline() as p``.
* :class:`AsyncInferenceClient`: ``await predict(x)`` against an ``InferenceHost`` (loaded on
  first use: it imports torch).

Importing this package imports neither torch nor Twisted.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..client.ops import NOWAIT, FetchResult
from .client import AsyncClient
from .listen import ListenEvents
from .pipeline import AsyncPipeline

__all__ = ["NOWAIT", "AsyncClient", "AsyncInferenceClient", "AsyncPipeline", "FetchResult",
           "ListenEvents"]


def __getattr__(name: str) -> Any:
    if name == "AsyncInferenceClient":
        value = importlib.import_module(".inference", __name__).AsyncInferenceClient
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tensorshare.aio' has no attribute {name!r}")


if TYPE_CHECKING:
    from .inference import AsyncInferenceClient
