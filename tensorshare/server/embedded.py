"""A server inside any program: :class:`EmbeddedServer` runs one on a private reactor in a
daemon thread, so a trainer or a test can host a server without giving up its main thread or
the global reactor; :func:`run_server` is the blocking form the seed used.
"""

from __future__ import annotations

import gc
import threading
from dataclasses import replace
from typing import Any

from twisted.logger import Logger

from .._reactor import ReactorThread
from ..wire.messages import Limits
from .auth import check_exposure
from .config import ServerConfig
from .core import ServerFactory
from .reactor import make_reactor
from .transports import listen_fast_tcp, listen_fast_unix

__all__ = ["EmbeddedServer", "run_server"]

log = Logger(namespace="tensorshare.server")


class EmbeddedServer(ReactorThread):
    """A server running on a private reactor in a daemon thread.

    Usage::

        with EmbeddedServer(port=0) as server:
            client = Client("127.0.0.1", server.port)

        # reachable from other machines: clients need the same token
        EmbeddedServer(8000, host="0.0.0.0", token_file="/etc/tensorshare/token")

    Args:
        port: TCP port; 0 picks a free one (read it back from ``.port``); ``None``: no TCP
            (then ``unix`` must be given).
        host: interface to bind; 127.0.0.1 unless you mean to accept other machines (then
            give it a token, or ``insecure=True``: protected mode refuses otherwise).
        limits: hard limits (see :class:`~tensorshare.messages.Limits`).
        max_memory: refuse values that would take the bytes held above this.
        config: every other setting (:class:`ServerConfig`).
        unix: also listen on this Unix socket path (same-host clients: ``unix://PATH``;
            they may pass large tensors through shared memory). Readable and writable by
            its owner only; removed when the server stops.
        token: the token every client must prove it knows (the handshake never sends it);
            default: ``config.token``, which defaults to ``TENSORSHARE_TOKEN`` or the file
            ``TENSORSHARE_TOKEN_FILE`` names.
        token_file: read the token from this file instead (surrounding whitespace is not
            part of it).
        insecure: listen beyond loopback without a token (on a network you trust).
        replica_of: follow that primary (a URL) as a replica: reads served, writes refused
            until ``tensorshare promote`` (sets ``config.replica_of``; the upstream token and
            user are ``config``'s ``upstream_*``).

    Raises:
        OSError: the port or path could not be bound (e.g. it is in use), or ``token_file``
            cannot be read.
        ValueError: protected mode (``host`` reaches other machines, no token, not
            ``insecure``; the message says what to pass), both ``token`` and ``token_file``,
            or an empty token.
    """

    _what = "server"

    def __init__(self, port: int | None = 0, *, host: str = "127.0.0.1",
                 limits: Limits | None = None, max_memory: int | None = None,
                 config: ServerConfig | None = None, unix: str | None = None,
                 token: str | None = None, token_file: str | None = None,
                 insecure: bool = False, replica_of: str | None = None) -> None:
        if port is None and unix is None:
            raise ValueError("give a TCP port, a Unix socket path, or both")
        config = secured(config, token, token_file, insecure)
        if replica_of is not None:
            config = replace(config or ServerConfig(), replica_of=replica_of)
        if port is not None:
            check_exposure(host, config or ServerConfig())
        self.host = host
        self.unix = unix
        self._ports: list[Any] = []
        self.reactor = make_reactor()
        self._stopping = False
        try:
            self.factory = ServerFactory(self.reactor, limits, max_memory, config=config)
            if port is not None:
                served: Any = self.factory
                if {self.factory.config.tls_cert, self.factory.config.tls_key} != {None}:
                    from .tls import tls_wrapped  # (OpenSSL only for a server that uses it)
                    served = tls_wrapped(self.factory, self.factory.config, self.reactor)
                self._ports.append(listen_fast_tcp(self.reactor, port, served, interface=host))
            if unix is not None:
                self._ports.append(listen_fast_unix(self.reactor, unix, self.factory))
        except BaseException:
            for p in self._ports:
                p.stopListening()
            if getattr(self, "factory", None) is not None:
                self.factory.close_persistence()
            self._close_reactor()
            raise
        # The TCP port (0 if there is none).
        self.port = self._ports[0].getHost().port if port is not None else 0
        self._start_thread(f"tensorshare-server-{self.port}")
        log.info("tensorshare server listening on {where}", where=", ".join(self.addresses))

    @property
    def addresses(self) -> list[str]:
        """Where clients connect: ``HOST:PORT`` and/or ``unix://PATH``."""
        out = [f"{self.host}:{self.port}"] if self.port else []
        if self.unix is not None:
            out.append(f"unix://{self.unix}")
        return out

    def _shutdown(self) -> None:
        if self._stopping or not self.reactor.running:
            return
        self._stopping = True
        for p in self._ports:
            p.stopListening()  # a Unix socket's file goes with it
        for proto in list(self.factory.connections):
            proto.transport.abortConnection()
        # With a data directory: the log is flushed and a final snapshot written, so that
        # the next start loads quickly.
        self.factory.close_persistence()
        self.reactor.callLater(0, self.reactor.stop)

    def stop(self, timeout: float | None = None) -> None:
        """Close the port and every connection, write the final snapshot (with a data
        directory), stop the reactor and join its thread.

        Args:
            timeout: seconds to wait (default 10 s, or 10 minutes with a data directory:
                the final snapshot writes everything the server holds).
        """
        if timeout is None:
            timeout = 600.0 if self.factory.config.data_dir else 10.0
        super().stop(timeout)

    def _stopped(self) -> None:
        self.factory.close_persistence()  # if the reactor ended some other way


def secured(config: ServerConfig | None, token: str | None, token_file: str | None,
            insecure: bool) -> ServerConfig | None:
    """``config`` with the token and ``insecure`` given as arguments (they win over its
    own); ``config`` itself when none is given.

    Raises:
        ValueError: both ``token`` and ``token_file``. OSError: the file cannot be read.
    """
    if token is None and token_file is None and not insecure:
        return config
    if token is not None and token_file is not None:
        raise ValueError("give the server's token as token= or token_file=, not both")
    if token_file is not None:
        with open(token_file, encoding="utf-8") as f:
            token = f.read()
    changes: dict[str, Any] = {"insecure": True} if insecure else {}
    if token is not None:
        changes["token"] = token
    return replace(config or ServerConfig(), **changes)


def run_server(port: int | None = 8000, host: str = "127.0.0.1", *,
               limits: Limits | None = None, max_memory: int | None = None, ready: Any = None,
               config: ServerConfig | None = None, unix: str | None = None,
               token: str | None = None, token_file: str | None = None,
               insecure: bool = False, replica_of: str | None = None) -> None:
    """Run a server until interrupted (Ctrl+C). This blocks, as in the seed
    (``run_server(8000)``, ``run_server(8000, "0.0.0.0", token_file=...)``).

    Args:
        port: TCP port (0 picks a free one; it is logged and passed to ``ready``).
        host: interface to bind; 127.0.0.1 by default, ``0.0.0.0`` to accept other machines
            (with ``token``/``token_file``, or ``insecure=True``).
        limits, max_memory, config, unix, token, token_file, insecure, replica_of: see
            :class:`EmbeddedServer`.
        ready: optional callable ``ready(server)`` called once the port is bound.
    """
    server = EmbeddedServer(port, host=host, limits=limits, max_memory=max_memory, config=config,
                            unix=unix, token=token, token_file=token_file, insecure=insecure,
                            replica_of=replica_of)
    # This process is the server: tune the cyclic garbage collector for it. What is loaded
    # at start (a data directory) is frozen out of every collection, and collections come
    # less often: a batch of 50,000 small items would otherwise trigger hundreds, each
    # scanning every stored object. Nothing the server makes per request forms cycles.
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
    previous = None
    if threading.current_thread() is threading.main_thread():
        import signal

        def terminate(signum: int, frame: Any) -> None:
            raise KeyboardInterrupt  # SIGTERM stops the server the way Ctrl+C does

        previous = signal.signal(signal.SIGTERM, terminate)
    try:
        if ready is not None:
            ready(server)
        while server.running:
            server._done.wait(0.5)  # short waits keep Ctrl+C responsive
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        if previous is not None:
            import signal

            signal.signal(signal.SIGTERM, previous)
