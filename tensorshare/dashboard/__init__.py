"""The dashboard: a read-only web page of one or more tensorshare servers, live.

``tensorshare dashboard --server URL --read-token-file F --port 8080`` (or ``tensorshare
serve --dashboard-port P``, beside the server) serves one static page (its script and style
ship as package data: no build step, no CDN) and one server-sent event stream per browser
tab: a snapshot every second from each server's ``stats`` (rates as ``tensorshare monitor``
computes them), and each listened bin's changes as they happen.

A wing over the clients (:mod:`tensorshare.client`), never the server: it connects with the
server's read-only token, so even a bug of it cannot write. See :mod:`.hub` (the servers,
the snapshots, the streams), :mod:`.web` (HTTP, authentication, the security headers) and
:mod:`.app` (:class:`Dashboard`: all of it on a private reactor thread).
"""

from __future__ import annotations

from .app import Dashboard, split_servers

__all__ = ["Dashboard", "split_servers"]
