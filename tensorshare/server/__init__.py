"""The Twisted server: :func:`run_server` (blocking, as the seed calls it), :class:`EmbeddedServer`
(a server on a private reactor in a background thread) and :class:`ServerConfig`.

Inside, by what each part does:

    config       ServerConfig: everything a server can be told
    embedded     EmbeddedServer and run_server
    core         ServerFactory: the server's state (store, sessions, listeners, data log)
    connection   one client connection: parsing, limits, backpressure, the handshake
    handlers     what each request does (the op table), shared with the data log's replay
    store        the bins (pure data structure)
    sessions     the exactly-once bookkeeping (pure data structure)
    persist      the data log and snapshots
    stats        counters, latency, the stats reply
    transports   zero-copy TCP and Unix transports for Twisted
    metrics      the Prometheus exporter
"""

from __future__ import annotations

from .config import ServerConfig
from .embedded import EmbeddedServer, run_server

__all__ = ["EmbeddedServer", "ServerConfig", "run_server"]
