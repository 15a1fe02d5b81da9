"""Clients: the blocking, thread-safe :class:`Client` (and its :class:`Pipeline`), the Twisted
client (:mod:`tensorshare.client.twisted`, also importable as ``tensorshare.txclient``) and the
seed's callback API (:class:`TensorShare`), all over one sans-I/O :class:`ClientSession`.

Public here: ``Client``, ``ShardedClient`` (a client over several servers, each bin on one of
them), ``BinClient`` (what both are: the type the rest of the package depends on),
``ClientOptions`` (the connection options every face shares), ``Pipeline``, ``PendingCall``,
``FetchResult``, ``BinLimits``, ``NOWAIT``. Everything else in
this package is internal.
"""

from __future__ import annotations

from .blocking import NOWAIT, BinLimits, Client, FetchResult, PendingCall, Pipeline
from .ops import BinClient
from .options import ClientOptions
from .sharded import ShardedClient

__all__ = ["NOWAIT", "BinClient", "BinLimits", "Client", "ClientOptions", "FetchResult",
           "PendingCall", "Pipeline", "ShardedClient"]
