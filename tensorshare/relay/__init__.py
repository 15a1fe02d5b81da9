"""Relays: parameter fan-out past one server's egress.

A relay is a tensorshare server that serves another server's bins read-only. It listens to
the bins of its *upstream* (the primary, or another relay) that match its globs, downloads
each new version **once**, and serves it to any number of local readers **with the upstream
version number**: ``get(newer_than=...)``, ``await_new_parameters``, ``listen`` and the RL
staleness filter behave as on the primary, and the relay reports the primary's ``server_id``.
A 100 MB policy read by 256 workers through 8 relays leaves the primary 8 times per
version, not 256 times.

::

    tensorshare relay --upstream tensorshare://trainer:7000 --bins 'rl/parameters' --port 7100

    from tensorshare.relay import Relay
    with Relay("tensorshare://trainer:7000", ["rl/parameters"], port=7100) as relay:
        ...                                  # workers read from relay.address

* **Read-only.** Every request that would change something (put, append, get, delete,
  configure, streams, services) is refused with ``PermissionDenied`` naming the primary.
* **Value bins.** A relay copies value bins (what ``put`` writes: parameters); list bins
  matching its globs are skipped (a get on a relay could not take items from the primary).
* **Chains.** A relay's upstream may be another relay: relays form trees.
* **Restarts.** A relay keeps nothing on disk: one that restarts downloads the current
  versions again. When the upstream's ``server_id`` changes (it restarted without its data,
  and its versions started again), the relay forgets its bins and takes the new id, so that
  readers notice as they would on the primary.
* New bins upstream are found by listing the upstream every ``poll`` seconds; a new version
  of a bin already relayed arrives by notification at once.
"""

from __future__ import annotations

import fnmatch
import logging
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Unpack

from ..client.blocking import Client
from ..client.closing import Closing
from ..client.ops import Command
from ..client.options import ClientOptions, OptionFields
from ..errors import TensorShareError
from ..server.config import ServerConfig
from ..server.embedded import EmbeddedServer
from ..wire.codec import Buffer, Encoded, validate
from ..wire.messages import Fetch, FetchSpec, Item
from ..wire.protocol import item_wire_size

__all__ = ["Relay"]

log = logging.getLogger(__name__)


def _own(item: Item) -> Item:
    """A copy of a received item whose buffers are its own (the relay keeps it)."""
    value = item.value
    return Item(Encoded(value.value, tuple(Buffer(bytes(b.data), b.codec, b.raw_nbytes)
                                           for b in value.buffers)), item.tag)


class Relay(Closing):
    """A read-only server that mirrors the value bins of ``upstream`` matching ``bins``.

    Args:
        upstream: the server to relay: ``tensorshare://HOST:PORT``, ``HOST:PORT``,
            ``tensorshare+tls://...`` or ``unix://PATH`` (a primary or another relay).
        bins: glob patterns of the bins to relay (``fnmatch``; default every bin).
        host, port, unix: where the relay listens (as :class:`~tensorshare.EmbeddedServer`).
        config: the relay server's settings (token, TLS, limits...); ``relay_of`` is set.
        server: serve on this running server instead of starting one (its config must have
            ``relay_of`` set; what ``tensorshare relay`` does).
        poll: seconds between listings of the upstream (to find new bins).
        timeout: the upstream client's timeout.
        options, upstream_options: the upstream client's
            :class:`~tensorshare.ClientOptions`, and fields of it as keywords (``token``,
            ``user``, ``tls_ca``...; they override ``options``): the relay reads the
            upstream as its own user, never through shared memory, named
            ``"tensorshare-relay"`` unless ``name`` says otherwise.

    Raises:
        ValueError, TypeError: a bad upstream option (before the relay's server starts).
    """

    def __init__(self, upstream: str, bins: Sequence[str] | str = ("*",), *,
                 host: str = "127.0.0.1", port: int | None = 0, unix: str | None = None,
                 config: ServerConfig | None = None, server: EmbeddedServer | None = None,
                 poll: float = 1.0, timeout: float = 10.0, options: ClientOptions | None = None,
                 **upstream_options: Unpack[OptionFields]) -> None:
        given = ClientOptions.of(options, **upstream_options)
        self._options = given.replace(timeout=timeout, shm=False,
                                      name=given.name or "tensorshare-relay")
        if "://" not in upstream:
            upstream = f"tensorshare://{upstream}"
        self.upstream = upstream
        self.globs = [bins] if isinstance(bins, str) else list(bins)
        self.poll = poll
        self._own_server = server is None
        if server is None:
            config = replace(config or ServerConfig(), relay_of=upstream)
            server = EmbeddedServer(port, host=host, unix=unix, config=config)
        elif server.factory.config.relay_of is None:
            raise ValueError("the server of a relay must be started with relay_of set")
        self.server = server
        self.versions: dict[str, int] = {}  # bin -> the upstream version the relay serves
        self.downloads = 0  # versions downloaded from upstream
        self._newer: set[str] = set()
        self._skipped: set[str] = set()
        self._wake = threading.Condition()
        self._stopping = False
        self.client: Client | None = None  # connected by the relay's thread (it retries)
        self._server_id = ""
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"tensorshare-relay-{server.port}")
        self._synced = threading.Event()
        self._thread.start()

    # -- where readers connect --------------------------------------------------------------
    @property
    def port(self) -> int:
        return self.server.port

    @property
    def address(self) -> str:
        """``HOST:PORT`` (or ``unix://PATH``) of the relay."""
        return self.server.addresses[0]

    def wait_synced(self, timeout: float = 10.0) -> bool:
        """Wait until the relay has listed the upstream and copied what it found."""
        return self._synced.wait(timeout)

    # -- the sync loop ----------------------------------------------------------------------
    def _connect(self) -> Client | None:
        """The upstream client: an upstream that is not there yet (a relay started before
        its primary) is tried again every second until it is, or the relay stops."""
        while not self._stopping:
            try:
                return Client(self.upstream, options=self._options)
            except (TensorShareError, OSError) as exc:
                log.warning("relay: cannot reach %s (%s); trying again", self.upstream, exc)
                with self._wake:
                    self._wake.wait(1.0)
        return None

    def _run(self) -> None:
        import time

        client = self._connect()
        if client is None:
            return
        self.client = client
        if self._stopping:
            client.close()
            return
        next_listing = 0.0
        while not self._stopping:
            try:
                now = time.monotonic()
                if now >= next_listing:
                    self._check_server()
                    self._discover()
                    next_listing = now + self.poll
                    self._synced.set()
                with self._wake:
                    if not self._newer and not self._stopping:
                        self._wake.wait(max(next_listing - time.monotonic(), 0.0))
                    names, self._newer = self._newer, set()
                for name in sorted(names):
                    self._copy(name)
            except TensorShareError as exc:
                if self._stopping or client.closed:
                    return
                log.warning("relay of %s: %s; retrying", self.upstream, exc)
                next_listing = 0.0
                with self._wake:
                    self._wake.wait(min(self.poll, 1.0))
            except Exception:
                if self._stopping:
                    return
                log.exception("relay of %s failed; retrying", self.upstream)
                with self._wake:
                    self._wake.wait(1.0)

    @property
    def _up(self) -> Client:
        assert self.client is not None
        return self.client

    def _check_server(self) -> None:
        """Take the upstream's server id; forget everything if it changed (it restarted
        without its data: versions started again)."""
        self._up.ping()
        sid = self._up.server_id
        if sid == self._server_id:
            return
        if self._server_id:
            log.warning("relay: the upstream %s restarted without its data (server id %s -> "
                        "%s): forgetting its bins", self.upstream, self._server_id, sid)
            names = list(self.versions)
            self.versions.clear()
            self.server.call(self._forget, names)
        self._server_id = sid
        self.server.call(setattr, self.server.factory, "server_id", sid)

    def _forget(self, names: list[str]) -> None:
        store = self.server.factory.store
        for name in names:
            store.forget(name)

    def _matches(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, g) for g in self.globs)

    def _discover(self) -> None:
        for name in sorted(self._up.list()):
            if name in self.versions or name in self._skipped or not self._matches(name):
                continue
            self._up.listen(name, self._on_change, inline=True)
            self._copy(name)

    def _on_change(self, event: dict[str, Any]) -> None:
        name = event.get("bin")
        version = event.get("version")
        if not isinstance(name, str) or not isinstance(version, int):
            return
        if version > self.versions.get(name, 0) or event.get("op") == "resync":
            with self._wake:
                self._newer.add(name)
                self._wake.notify()

    def _copy(self, name: str) -> None:
        """Download the bin's version if it is newer than ours, and serve it."""
        have = self.versions.get(name)
        spec = FetchSpec(False, None, False, None, None, have, 1)
        try:
            reply = self._up._execute(Command(Fetch(0, name, spec), f"relay peek of {name!r}",
                                                 lambda r: r))
        except LookupError:
            return  # empty or deleted upstream: readers keep the last version
        if reply.unchanged or (have is not None and reply.version <= have):
            return
        if reply.kind != "value":
            self._skipped.add(name)
            log.warning("relay: bin %r upstream is a list bin; a relay copies value bins only",
                        name)
            return
        item = _own(reply.items[0])
        limits = self.server.factory.limits
        validate(item.value.value, len(item.value.buffers), max_depth=limits.max_depth,
                 raw_sizes=[b.raw_nbytes for b in item.value.buffers])
        self.server.call(self._store, name, item, reply.version)
        self.versions[name] = reply.version
        self.downloads += 1

    def _store(self, name: str, item: Item, version: int) -> None:
        store = self.server.factory.store
        if version > store.version(name):
            store.put_version(name, item, item_wire_size(item), version, item.tag)

    # -- stopping ---------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop relaying; close the upstream client and the server (if the relay started
        it)."""
        self._stopping = True
        with self._wake:
            self._wake.notify_all()
        if self.client is not None:
            self.client.close()
        self._thread.join(10.0)
        if self.client is not None:  # connected while stopping
            self.client.close()
        if self._own_server:
            self.server.stop()

    close = stop

    def __repr__(self) -> str:
        return f"<Relay of {self.upstream} at {self.address}: {len(self.versions)} bins>"
