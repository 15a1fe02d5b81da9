"""The Twisted server: :func:`run_server` (blocking, as the seed calls it), :class:`EmbeddedServer`
(a server on a private reactor in a background thread) and :class:`ServerConfig`.

Inside, by what each part does (each imports only those above it in the import graph:
``parts`` declares what the others may use of the server and of a connection):

    config       ServerConfig: everything a server can be told
    embedded     EmbeddedServer and run_server
    core         ServerFactory: the server's state (store, sessions, listeners, data log)
                 and where its parts meet (notifications, sessions' life, the stats reply)
    connection   one client connection: one pass per read, the one owner of its output
                 (every reply is answered there), limits, backpressure, the handshake
    parts        the server's parts as the others see them (typing.Protocol classes), Route
    handlers     what each request of the store does; the effects shared with replay
    kinds        what every kind of bin checks (streams, services: beside the store's)
    streams      stream bins: one sequence, a cursor per consumer, epochs, leases
    services     service bins: calls queued per service, batches leased to hosts
    replay       the replay table under replay bins (pure data structure)
    accounts     who the users are (the users file, rights, quotas) and what each holds
    users        the one check of every request, writes waiting for room, reload
    auth         protected mode, failed attempts per address
    store        the bins (pure data structure)
    sessions     the exactly-once bookkeeping (pure data structure)
    persist      the data log and snapshots
    stats        counters, latency histograms
    transports   zero-copy TCP and Unix transports for Twisted
    reactor      the lean epoll reactor
    tls          TLS around the TCP port (imported only with a certificate)
    metrics      the Prometheus exporter
"""

from __future__ import annotations

from .config import ServerConfig
from .embedded import EmbeddedServer, run_server

__all__ = ["EmbeddedServer", "ServerConfig", "run_server"]
