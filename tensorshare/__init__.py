"""tensorshare: share PyTorch tensors between processes and machines.

A Twisted server keeps named bins in memory; clients put, append, get, peek, list, delete and
listen to them over one TCP connection each. Values travel as a msgpack header plus raw tensor
bytes, never as pickle. Importing this package starts no reactor and imports neither Twisted
nor torch: the names below are loaded on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import _ext  # noqa: F401  (first: TENSORSHARE_NO_EXTENSIONS=1, see tensorshare._ext)
from ._version import __version__
from .errors import (
    AuthenticationError,
    BinFull,
    BinNotFound,
    CodecError,
    ConnectError,
    ConnectionLost,
    DeviceCopyFailed,
    FrameTooLarge,
    InvalidRequest,
    Lagged,
    LimitExceeded,
    MemoryLimitExceeded,
    PermissionDenied,
    ProducerGone,
    ProtocolError,
    QuotaExceeded,
    ReplyTimeout,
    ServerError,
    ServiceFailed,
    SessionLost,
    SessionTakenOver,
    ShardsUnavailable,
    StorageUnavailable,
    StreamFinished,
    TensorShareError,
    Timeout,
    TransportError,
    UnsupportedType,
    UnsupportedVersion,
    WaitTimeout,
)

__all__ = [
    "NOWAIT",
    "AuthenticationError",
    "BinFull",
    "BinNotFound",
    "Client",
    "ClientOptions",
    "CodecError",
    "ConnectError",
    "ConnectionLost",
    "DeviceCopyFailed",
    "EmbeddedServer",
    "FetchResult",
    "FrameTooLarge",
    "InvalidRequest",
    "Lagged",
    "LimitExceeded",
    "Limits",
    "MemoryLimitExceeded",
    "PermissionDenied",
    "ProducerGone",
    "ServiceFailed",
    "ProtocolError",
    "QuotaExceeded",
    "RLTrainer",
    "RLWorker",
    "ReplyTimeout",
    "ServerError",
    "SessionLost",
    "SessionTakenOver",
    "ShardedClient",
    "ShardsUnavailable",
    "StorageUnavailable",
    "StreamFinished",
    "TensorShare",
    "TensorShareError",
    "Timeout",
    "TrainerStopped",
    "TransportError",
    "UnsupportedType",
    "UnsupportedVersion",
    "WaitTimeout",
    "__version__",
    "run_server",
]

# name -> module that defines it; imported on first access (PEP 562).
_LAZY = {
    "NOWAIT": "client",
    "Client": "client",
    "ClientOptions": "client",
    "ShardedClient": "client",
    "FetchResult": "client",
    "EmbeddedServer": "server",
    "run_server": "server",
    "Limits": "wire.messages",
    "TensorShare": "client.compat",
    "RLTrainer": "rl",
    "RLWorker": "rl",
    "TrainerStopped": "rl",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tensorshare' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # The public names (loaded or not) and the module's own dunders; not the helpers this
    # file imports (Any, TYPE_CHECKING, importlib, ...) nor submodules loaded on the way.
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__")})


if TYPE_CHECKING:
    from .client import NOWAIT, Client, ClientOptions, FetchResult, ShardedClient
    from .client.compat import TensorShare
    from .rl import RLTrainer, RLWorker, TrainerStopped
    from .server import EmbeddedServer, run_server
    from .wire.messages import Limits
