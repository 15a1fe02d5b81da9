"""The Twisted server: :func:`run_server` (blocking, as the seed calls it), :class:`EmbeddedServer`
(a server on a private reactor in a background thread) and :class:`ServerConfig`.

Inside: ``connection`` (one client connection: parsing, limits, backpressure), ``store`` (the
bins), ``sessions`` (exactly-once bookkeeping), ``persist`` (data log and snapshots),
``transports`` (zero-copy TCP and Unix transports), ``metrics`` (the Prometheus exporter).
"""

from __future__ import annotations

from .connection import EmbeddedServer, ServerConfig, run_server

__all__ = ["EmbeddedServer", "ServerConfig", "run_server"]
