"""The Twisted client, at the path the README documents (see :mod:`tensorshare.client.twisted`)."""

from __future__ import annotations

from .client.twisted import NOWAIT, FetchResult, TxClient, TxProtocol, connect

__all__ = ["NOWAIT", "FetchResult", "TxClient", "TxProtocol", "connect"]
