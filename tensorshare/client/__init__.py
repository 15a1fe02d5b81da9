"""Clients: the blocking, thread-safe :class:`Client` (and its :class:`Pipeline`), the Twisted
client (:mod:`tensorshare.client.twisted`, also importable as ``tensorshare.txclient``) and the
seed's callback API (:class:`TensorShare`), all over one sans-I/O :class:`ClientSession`.

Public here: ``Client``, ``Pipeline``, ``PendingCall``, ``FetchResult``, ``BinLimits``,
``NOWAIT``. Everything else in this package is internal.
"""

from __future__ import annotations

from .blocking import NOWAIT, BinLimits, Client, FetchResult, PendingCall, Pipeline

__all__ = ["NOWAIT", "BinLimits", "Client", "FetchResult", "PendingCall", "Pipeline"]
