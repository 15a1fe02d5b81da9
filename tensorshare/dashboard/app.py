""":class:`Dashboard`: the dashboard on a private reactor in a daemon thread, what
``tensorshare dashboard`` and ``tensorshare serve --dashboard-port`` run, and what a
program or a test starts beside its own work."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from twisted.logger import Logger

from .._reactor import ReactorThread
from .hub import Hub, Upstream
from .web import Auth, DashboardResource, DashboardSite, is_loopback

__all__ = ["Dashboard", "split_servers"]

log = Logger(namespace="tensorshare.dashboard")


def split_servers(servers: Sequence[str] | str) -> list[str]:
    """``--server`` as given: repeated, comma-separated, or both."""
    items = [servers] if isinstance(servers, str) else list(servers)
    out = [part.strip() for item in items for part in item.split(",") if part.strip()]
    if not out:
        raise ValueError("no server to watch: give --server HOST:PORT (or a URL)")
    return out


def check_exposure(host: str, token: str | None, insecure: bool) -> None:
    """Refuse an address other machines can reach without a token (as ``serve`` does).

    Raises:
        ValueError: ``host`` is not loopback, there is no token and not ``insecure``.
    """
    if is_loopback(host) or token is not None or insecure:
        return
    raise ValueError(f"refusing to serve the dashboard on {host} without a token: anyone who "
                     f"can reach it would see every bin's name and size. Give the server's "
                     f"read-only token (--read-token-file), or pass --insecure on a trusted "
                     f"network")


class Dashboard(ReactorThread):
    """A read-only dashboard of one or more tensorshare servers, served over HTTP.

    Usage::

        with Dashboard("tensorshare://127.0.0.1:8000", read_token=None, port=0) as dash:
            print(dash.url)

    Args:
        servers: the servers to watch (``HOST:PORT`` or URLs; a list, or comma-separated).
            Several: their bins side by side, a relay shown beside its primary.
        port: the HTTP port (0 picks a free one: read ``.port``).
        host: the interface to bind (loopback by default).
        read_token: the servers' read-only token: the dashboard connects with it, and
            browsers log in with it once (``/?token=...``). ``None``: the client's default
            (``TENSORSHARE_TOKEN``...), which must then not be a token that may write, and
            no browser login (loopback only).
        tls_ca: the CA of the servers' certificates (``tensorshare+tls://``).
        timeout: seconds a server has to answer.
        interval: seconds between snapshots.
        insecure: serve beyond loopback without a token.
        max_bins: bins shown per server (the first ones by name).
        max_streams: event streams (browser tabs) served at once.

    Raises:
        ValueError: an open address without a token, no server, a bad interval.
        OSError: the port could not be bound.
    """

    _what = "dashboard"

    def __init__(self, servers: Sequence[str] | str, *, port: int = 8080,
                 host: str = "127.0.0.1", read_token: str | None = None,
                 tls_ca: str | None = None, timeout: float = 5.0, interval: float = 1.0,
                 insecure: bool = False, max_bins: int = 1000, max_streams: int = 64,
                 max_paused: float = 30.0) -> None:
        from twisted.internet.epollreactor import EPollReactor

        addresses = split_servers(servers)
        if not 0 < interval < float("inf"):
            raise ValueError(f"interval must be positive and finite: {interval!r}")
        check_exposure(host, read_token, insecure)
        self.host = host
        self.reactor = EPollReactor()
        self.upstreams = [Upstream(self.reactor, i, a, token=read_token, tls_ca=tls_ca,
                                   timeout=timeout, max_bins=max_bins,
                                   on_change=self._changed)
                          for i, a in enumerate(addresses)]
        self.hub = Hub(self.reactor, self.upstreams, interval=interval,
                       max_streams=max_streams, max_paused=max_paused)
        self._auth_token = read_token
        self.auth = Auth(read_token, port)
        self.site = DashboardSite(DashboardResource(self.hub, self.auth))
        try:
            self._port = self.reactor.listenTCP(port, self.site, interface=host)
        except BaseException:
            self._close_reactor()
            raise
        self.port = self._port.getHost().port
        self.auth.port = self.port
        self.reactor.callWhenRunning(self.hub.start)
        self._start_thread(f"tensorshare-dashboard-{self.port}")

    @property
    def url(self) -> str:
        """Where a browser opens the dashboard (without the token)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        if host in ("0.0.0.0", "[::]"):
            host = "127.0.0.1"
        return f"http://{host}:{self.port}/"

    @property
    def login_url(self) -> str:
        """:attr:`url` with the token, to open once (the token is then dropped from it)."""
        if self._auth_token is None:
            return self.url
        from urllib.parse import quote

        return f"{self.url}?token={quote(self._auth_token.strip(), safe='')}"

    def _changed(self, index: int, event: dict[str, Any]) -> None:
        self.hub.changed(index, event)

    def first_contact(self, timeout: float) -> list[str | None]:
        """Wait (up to ``timeout``) for the first attempt to reach each server; return each
        one's error then (``None``: it answered)."""
        done = threading.Event()

        def watch() -> None:
            from twisted.internet.defer import gatherResults

            gatherResults([u.first for u in self.upstreams]).addBoth(lambda _: done.set())

        self.reactor.callFromThread(watch)
        done.wait(timeout)
        return self.call(lambda: [u.error for u in self.upstreams])

    def _shutdown(self) -> None:
        self.hub.stop()
        self._port.stopListening()
        self.reactor.callLater(0.05, self.reactor.stop)
