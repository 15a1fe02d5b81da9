"""The blocking, thread-safe client: :class:`Client`, a face over one connection.

A :class:`Client` holds its connection (the engine: the session, the reader thread, the read
election, the path of every request; see :mod:`.connection`) and adds the op surface, written
once in :mod:`.ops` for every client face: each op makes a :class:`~.ops.Command` and hands it
to the connection's ``_execute``, bound once when the client is made (no extra call per
request). Any number of threads may call one client at once; a dropped connection is made
again by itself (see :mod:`.connection`).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Unpack

from ..wire.messages import Limits
from ..wire.records import Item
from .connection import Connection, PendingCall, open_socket
from .facts import SessionFacts
from .failover import PrimaryFinder, addresses
from .ops import (
    NOWAIT,
    BinClient,
    BinLimits,
    Command,
    FetchResult,
    Ops,
)
from .options import UNSET, ClientOptions, OptionFields, Unset
from .pipeline import Pipeline
from .session import ClientSession

__all__ = ["NOWAIT", "BinLimits", "Client", "FetchResult", "PendingCall", "Pipeline"]


class Client(SessionFacts, BinClient):
    """A blocking, thread-safe connection to a tensorshare server that rides out drops.

    Args:
        host: server address (a host name or IP), or a URL: ``tensorshare://HOST:PORT``,
            ``tensorshare+tls://HOST:PORT``, or ``unix://PATH`` for a server on this
            machine's Unix socket (faster, and large tensors may travel through shared
            memory, see ``shm``; a bare path is refused: write ``unix:///tmp/x.sock``).
            A list of addresses (``["a:7000", "b:7000"]``, or one string with commas,
            ``"tensorshare://a:7000,b:7000"``): a primary and its replicas; the client
            connects to the one that says it is the primary (the higher term wins), and
            again after every drop, so it follows a promotion (README: Replication and
            failover).
            Neither host nor port: ``TENSORSHARE_URL``, else ``127.0.0.1:8000`` (see
            :mod:`tensorshare.client.endpoint`).
        port: server port (ignored for a URL; default 8000).
        timeout: seconds the server has to answer a request (a get/peek that waits for data
            gets its wait on top); also how long the first connection may take (default
            30).
        options: a :class:`~.options.ClientOptions` (``reconnect``, ``compress``, ``name``,
            ``session``, ``heartbeat``, ``shm``, ``tls``, ``token``, ``user``, ...: each
            described there, with its default); default: all defaults.
        connector: returns a new connected socket each time it is called, instead of a TCP
            connection to ``host:port`` (custom transports; tests use a socketpair).
        **overrides: any field of :class:`~.options.ClientOptions` as a keyword
            (``Client(timeout=5, compress="lz4")``): overrides that field of ``options``.

    Raises:
        ValueError, FileNotFoundError: a bad address or option, or a ``tls_ca`` that names no
            CA file (before anything is tried; see :func:`~.endpoint.resolve`).
        ConnectError: no server answered within ``timeout`` (with ``reconnect`` on, it
            keeps trying until then, through connections dropped mid-handshake: workers may
            start before their server), or TLS failed (a wrong CA or host name, a server
            that does not speak TLS or one that only does).
        AuthenticationError, UnsupportedVersion, LimitExceeded: the server refused the
            handshake (a missing or wrong token, no common version, no room); never retried.

    Example::

        with Client("127.0.0.1", 8000) as c:
            c.put("weights", {"w": torch.randn(3, 3)})
            print(c.peek("weights"))
    """

    #: The engine this face holds (see :mod:`.connection`).
    _conn: Connection
    # The engine's entry points (and _execute), bound when the client is made.
    _submit: Callable[[Command], PendingCall]
    _submit_future: Callable[[Command], Future[Any]]
    _submit_many: Callable[[Iterable[Command]], list[PendingCall]]
    _run_pipeline: Callable[[Pipeline, Iterable[tuple[Command, int]]], list[Any]]

    def __init__(self, host: str | list[str] | None = None, port: int | None = None,
                 timeout: float | Unset = UNSET, *, options: ClientOptions | None = None,
                 connector: Callable[[], socket.socket] | None = None,
                 **overrides: Unpack[OptionFields]) -> None:
        opts = ClientOptions.of(options, timeout=timeout, **overrides)
        hosts = addresses(host) if connector is None else None
        if hosts is not None:  # a primary and its replicas: connect to the primary
            endpoints = [opts.endpoint(h, port) for h in hosts]
            endpoint = endpoints[0]
            connector = PrimaryFinder(endpoints, opts.timeout, open_socket)
        else:
            endpoint = opts.endpoint(host if not isinstance(host, list) else host[0], port)
        conn = self._conn = Connection(endpoint, opts, connector)
        # The connection's entry points, bound once: a call is one step from its op to the
        # engine, as when the client was its connection.
        self._execute = conn._execute
        self._submit, self._submit_future = conn._submit, conn._submit_future
        self._submit_many, self._run_pipeline = conn._submit_many, conn._run_pipeline
        self.timeout, self.reconnect = opts.timeout, opts.reconnect
        self.endpoint, self.address = endpoint, conn.address
        self.host, self.port, self.path = conn.host, conn.port, conn.path
        self.compress, self.compress_min_bytes = opts.compress, opts.compress_min_bytes
        self.shm_min_bytes = opts.shm_min_bytes
        self.begin = Begin(self)
        conn.wait_connected()

    if TYPE_CHECKING:
        @property
        def limits(self) -> Limits:
            """The server's limits (from the last handshake)."""
    else:  # (read on every request: a getter in C, no Python frame)
        limits = property(attrgetter("_conn._session.limits"),
                          doc="The server's limits (from the last handshake).")

    # (server_version, protocol_version, server_id, connected, closed and shared_memory:
    # SessionFacts)
    def _client_session(self) -> ClientSession:
        return self._conn._session

    @property
    def options(self) -> ClientOptions:
        """The options this client was made with: ``Client(options=c.options.replace(
        timeout=5))`` is another like it."""
        return self._conn._options

    def pipeline(self, *, raise_on_error: bool = True) -> Pipeline:
        """Queue many requests and send them together, without waiting for each reply.

        Usage::

            with client.pipeline() as p:
                for rollout in rollouts:
                    p.append("rollouts", rollout)
                p.put("step", 10)
            p.results  # what each call returns (a version, a value, ...), in order

        Consecutive appends to the same bin travel as one request (all or none, one new
        version), so tens of thousands of small items per second go through one client.
        Other calls are sent back to back in one write. Local mistakes raise at the call;
        the requests go out when the ``with`` block ends (or at :meth:`Pipeline.execute`).

        Args:
            raise_on_error: after every reply is in, raise the first error (the others and
                every result stay in ``results``); ``False``: only put errors in ``results``.
        """
        return Pipeline(self, raise_on_error)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the session on the server (``bye``, waiting at most a second for its answer)
        and close the connection. Pending calls fail with ConnectionLost. Idempotent."""
        self._conn.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("connected" if self.connected else "reconnecting")
        return f"<tensorshare.Client {self.address} {state}>"



class Begin(Ops):
    """The ops of a face that send at once and return a :class:`PendingCall`
    (``client.begin.put(...)``; ``client.begin_put(...)`` is the same): the face's options,
    limits and encoding, its own way to submit."""

    def __init__(self, face: Any) -> None:
        self._face = face
        self.timeout = face.timeout
        self.compress, self.compress_min_bytes = face.compress, face.compress_min_bytes

    @property
    def limits(self) -> Limits:
        return self._face.limits

    def _item(self, name: str, value: Any, tag: int | None) -> Item:
        return self._face._item(name, value, tag)

    def _items(self, name: str, values: list[Any], tags: list[int | None]) -> list[Item]:
        return self._face._items(name, values, tags)

    def _execute(self, cmd: Command) -> PendingCall:
        return self._face._submit(cmd)


def _older_name(op: str) -> property:
    def get(client: Client) -> Any:
        return getattr(client.begin, op)

    return property(get, doc=f"The same as ``begin.{op}`` (an older name).")


# begin_put, begin_fetch, ...: the same as begin.put, begin.fetch, ... (older names). Made
# properties, not a __getattr__: a class with one makes every attribute of its instances
# slower to find, and a request reads a dozen.
for _op in [n for n in dir(Begin) if not n.startswith("_") and callable(getattr(Begin, n))]:
    setattr(Client, f"begin_{_op}", _older_name(_op))
del _op


