"""A client over several servers: each bin lives on one of them.

Which server holds a bin is decided by rendezvous (highest-random-weight) hashing of the
bin's key over the servers' addresses: every client computes the same owner without asking
anyone, and adding a server moves only the bins whose highest weight is now the new
server's, about 1/N of them. A bin's key is its name, or the part between the first ``{``
and the next ``}`` when that part is not empty (as in Redis Cluster), so that
``"{run7}params"`` and ``"{run7}rollouts"`` live on the same server.

Every op of :class:`~.ops.Ops` that names a bin (stream ops included) goes to that bin's
server through an ordinary :class:`~.blocking.Client` (one per server, made on first use,
each with its own elastic session); ``list``, ``stats`` and ``ping`` ask every server and
merge the answers. A pipeline sends each server its share of the requests in one write and
waits for all of them.

With ``relay=`` (a :mod:`tensorshare.relay` of the shard holding ``relay_bins``, typically
the one on this machine), the *reads* of those bins (peek, ``fetch(remove=False)``, waiting
or not, listen) go to the relay, and everything else still to the shards: parameter fan-out
without changing the code that reads them.

The owner is a function of the address *as written*: every client of a job must list the
same addresses. Stable names (a Kubernetes StatefulSet's pod names behind its headless
Service, ``shard-0.shards:7000``) keep bins where they are across restarts; addresses that
change (a pod's IP) move that server's bins.

Replicated shards. A shard may be several addresses, a primary and its replicas
(``ShardedClient([["a:7000", "b:7000"], ["c:7000", "d:7000"]])``, or as one string
``"a:7000|b:7000,c:7000|d:7000"``: ``|`` between a shard's addresses, ``,`` between shards):
each shard's client is a :class:`~.blocking.Client` over that address list, which connects to
whichever of them says it is the primary and follows a promotion (README: Replication and
failover). Then a bin's shard is a function of the shard's *index* in the list, not of its
addresses (which change roles, and may move): every client must list the shards in the same
order. When every shard is one address, the addresses decide, as before.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import socket
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Unpack

from ..errors import (
    BinNotFound,
    ConnectError,
    ConnectionLost,
    ShardsUnavailable,
    TensorShareError,
    TransportError,
)
from ..wire.address import Address, parse_address
from ..wire.messages import (
    Append,
    Fetch,
    Item,
    Limits,
    ListBins,
    Listen,
    Ping,
    Put,
    Stats,
    Unlisten,
)
from .blocking import Begin, Client, PendingCall, Pipeline
from .closing import Closing
from .connection import outcomes_of
from .ops import BLOCK_SHARE, BinClient, Command, _version
from .options import AllOptionFields, ClientOptions, OptionFields
from .replay import REPLAY_REQUESTS, ShardedReplayOps

__all__ = ["SERVERS_ENV", "ShardedClient", "bin_key", "connect", "expand_servers",
           "expand_shards", "owner", "servers_from_env", "shard_keys"]

#: Comma-separated server addresses when a ShardedClient is given none (``|`` between the
#: addresses of one replicated shard).
SERVERS_ENV = "TENSORSHARE_SERVERS"

#: What separates the addresses of one shard (a primary and its replicas) in a string.
REPLICA_SEP = "|"

Shard = str | Sequence[str]

Resolver = Callable[[str, int], Sequence[str]]

#: The index :meth:`ShardedClient._route` gives a read that goes to the relay.
RELAY = -1


def bin_key(name: str) -> str:
    """What decides a bin's server: the text of its first non-empty ``{tag}``, else the name."""
    start = name.find("{")
    if start >= 0:
        end = name.find("}", start + 1)
        if end > start + 1:
            return name[start + 1:end]
    return name


def _weight(server: str, key: str) -> int:
    digest = hashlib.blake2b(f"{server}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def owner(name: str, servers: Sequence[str]) -> int:
    """The index in ``servers`` of the server that holds bin ``name``."""
    key = bin_key(name)
    return max(range(len(servers)), key=lambda i: _weight(servers[i], key))


def shard_keys(shards: Sequence[Sequence[str]]) -> list[str]:
    """What :func:`owner` hashes for each shard (of :func:`expand_shards`): its address when
    every shard is one server (as written), else its index (``"#0"``, ``"#1"``, ...), so that
    a shard whose primary moved to another address keeps its bins."""
    if all(len(urls) == 1 for urls in shards):
        return [urls[0] for urls in shards]
    return [f"#{i}" for i in range(len(shards))]


def servers_from_env() -> list[str]:
    """The addresses in ``TENSORSHARE_SERVERS`` (comma-separated), or ``[]``."""
    return [s.strip() for s in os.environ.get(SERVERS_ENV, "").split(",") if s.strip()]


def _dns(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def expand_servers(servers: Sequence[str] | str,
                   resolver: Resolver = _dns) -> list[str]:
    """The server addresses of a ShardedClient, as ``tensorshare://`` / ``unix://`` URLs.

    ``servers`` is a list of addresses, or one string of comma-separated ones. A lone TCP
    address whose host name resolves to several addresses (a Kubernetes headless Service)
    stands for all of them, sorted, so that every client lists them alike.

    Raises:
        ValueError: no servers, a malformed address, or the same server twice.
        OSError: a lone host name that does not resolve.
    """
    names = [s.strip() for s in servers.split(",")] if isinstance(servers, str) \
        else [str(s).strip() for s in servers]
    names = [n for n in names if n]
    if not names:
        raise ValueError(f"a ShardedClient needs at least one server (or {SERVERS_ENV})")
    urls = [n if "://" in n else f"tensorshare://{n}" for n in names]
    addresses = [parse_address(url, 0) for url in urls]  # raises ValueError if malformed
    if len(urls) == 1 and addresses[0].path is None:
        one = addresses[0]
        found = resolver(one.host, one.port)
        if len(found) > 1:
            urls = [Address(ip, one.port, tls=one.tls).url for ip in sorted(found)]
    if len(set(urls)) != len(urls):
        raise ValueError(f"a server is named twice in {names}")
    return urls


def _one_shard(shard: Shard) -> list[str]:
    """The URLs of one shard: ``"a:7000"``, ``"a:7000|b:7000"`` or ``["a:7000", "b:7000"]``
    (a scheme written on the first address applies to the others that have none)."""
    parts = [p.strip() for p in shard.split(REPLICA_SEP)] if isinstance(shard, str) \
        else [str(p).strip() for p in shard]
    if not parts or not all(parts):
        raise ValueError(f"an empty address in the shard {shard!r}")
    scheme = parts[0].split("://", 1)[0] if "://" in parts[0] else "tensorshare"
    urls = [p if "://" in p else f"{scheme}://{p}" for p in parts]
    for url in urls:
        parse_address(url, 0)  # raises ValueError if malformed
    return urls


def expand_shards(servers: Sequence[Shard] | str,
                  resolver: Resolver = _dns) -> list[list[str]]:
    """The shards of a ShardedClient, each a list of ``tensorshare://`` / ``unix://`` URLs
    (several: a primary and its replicas).

    ``servers`` is a list whose items are an address, a list of addresses, or a string of
    addresses joined by ``|``; or one string of such shards joined by commas. When every
    shard is one address this is :func:`expand_servers` (a lone host name may stand for
    several servers).

    Raises:
        ValueError: no servers, a malformed address, or the same server twice.
        OSError: a lone host name that does not resolve.
    """
    items: list[Shard] = [s for s in servers.split(",")] if isinstance(servers, str) \
        else list(servers)
    items = [s for s in items if not isinstance(s, str) or s.strip()]
    shards = [_one_shard(s) for s in items]
    if all(len(urls) == 1 for urls in shards):
        return [[url] for url in expand_servers([urls[0] for urls in shards], resolver)]
    every = [url for urls in shards for url in urls]
    if len(set(every)) != len(every):
        raise ValueError(f"a server is named twice in {servers!r}")
    return shards


class ShardedClient(ShardedReplayOps, BinClient, Closing):
    """The API of :class:`~.blocking.Client` over several servers, each bin on one of them.

    Usage::

        c = ShardedClient(["h1:7000", "h2:7000", "h3:7000"], timeout=30)
        c.put("params", state_dict)            # on the server rendezvous hashing picks
        c.append("{run7}rollouts", batch)      # {run7}: on the same server as "{run7}params"
        c.list()                               # every server's bins, merged

    Args:
        servers: addresses (``"host:port"`` or URLs), a comma-separated string of them, or
            one name that resolves to several addresses; default ``TENSORSHARE_SERVERS``.
            A replicated shard is a list of addresses (its primary and replicas, in any
            order), or in a string its addresses joined by ``|``
            (``"a:7000|b:7000,c:7000|d:7000"``): its calls go to whichever says it is the
            primary, and bins are placed by the shards' order (see the module's notes).
        relay: a relay (``"HOST:PORT"`` or a URL) of the shard that holds ``relay_bins``:
            their reads (peek, ``fetch(remove=False)``, listen) go there; writes, gets,
            stats and the other bins still go to the shards.
        relay_bins: names or glob patterns (``fnmatch``) of the value bins read through
            ``relay``, as the relay's own ``bins``.
        options: a :class:`~.options.ClientOptions` for each server's
            :class:`~.blocking.Client` (``timeout``, ``token``, ``tls_ca``, ``reconnect``,
            ...), and the relay's.
        **overrides: any field of :class:`~.options.ClientOptions` as a keyword: overrides
            that field of ``options``.

    A read through the relay sees what the relay serves: the shard's versions, data and
    server id, up to one download behind (a peek right after this client's own put may
    return the version before; ``fetch(newer_than=v, timeout=...)`` waits for ``v``). A bin
    created on the shard appears on the relay at its next listing, a delete there is not
    relayed, and list bins are not relayed at all: name value bins only (parameters).

    ``list``, ``stats`` and ``ping`` ask every server: when some do not answer within the
    timeout they raise :class:`~tensorshare.errors.ShardsUnavailable` (a ``ConnectionLost``)
    carrying the others' answer, merged, as ``result`` and the missing servers as
    ``missing``. The client is made as long as one server can be reached.

    Raises:
        ValueError: no servers, the same one twice, or ``relay`` without ``relay_bins``.
        ConnectError: no server could be reached.
    """

    def __init__(self, servers: Sequence[Shard] | str | None = None, *,
                 relay: str | None = None, relay_bins: Sequence[str] | str = (),
                 options: ClientOptions | None = None,
                 **overrides: Unpack[AllOptionFields]) -> None:
        opts = self.options = ClientOptions.of(options, **overrides)
        #: Each shard's URLs (one, or a primary and its replicas), in shard order.
        self.shards = expand_shards(servers if servers is not None else servers_from_env())
        #: Each shard as one string: its URL, or its URLs joined by ``|``.
        self.servers = [REPLICA_SEP.join(urls) for urls in self.shards]
        self._keys = shard_keys(self.shards)
        self.relay = None if relay is None else \
            relay if "://" in relay else f"tensorshare://{relay}"
        self.relay_bins = [relay_bins] if isinstance(relay_bins, str) else list(relay_bins)
        if self.relay is not None and not self.relay_bins:
            raise ValueError("a ShardedClient with a relay needs relay_bins: the value bins "
                             "to read through it")
        self._clients: dict[int, Client] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._first = 0
        self._first_client()
        self.timeout = opts.timeout
        self.compress, self.compress_min_bytes = opts.compress, opts.compress_min_bytes
        self.begin = _ShardedBegin(self)

    def _first_client(self) -> Client:
        """The client of the first server that can be reached (the client's settings and
        limits are read from it): one server down does not stop the others' use.

        Raises:
            ConnectError: no server can be reached (the first one's error).
        """
        errors: list[ConnectError] = []
        for i in range(len(self.servers)):
            try:
                client = self._client(i)
            except ConnectionLost as exc:
                if not isinstance(exc.__cause__, ConnectError):
                    raise
                errors.append(exc.__cause__)
                continue
            self._first = i
            return client
        raise errors[0]

    def _client(self, index: int) -> Client:
        """The client of server ``index`` (of the relay for :data:`RELAY`), made on first
        use.

        Raises:
            ConnectionLost: this client is closed, or that server cannot be reached (the
                ``ConnectError`` is its cause): a server down before its first use fails
                its bins' calls as one that went down later does.
        """
        with self._lock:
            if self._closed:
                raise ConnectionLost("this ShardedClient is closed")
            client = self._clients.get(index)
        if client is None:
            urls = [self.relay] if index == RELAY and self.relay else self.shards[index]
            try:
                made = Client(urls[0] if len(urls) == 1 else urls, options=self.options)
            except ConnectError as exc:
                raise ConnectionLost(f"{exc} (nothing was sent to it: no connection within "
                                     f"{self.options.timeout:g} s)") from exc
            with self._lock:
                client = self._clients.setdefault(index, made)
            if client is not made:
                made.close()
        return client

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (or every server's client gave up)."""
        with self._lock:
            clients = list(self._clients.values())
        return self._closed or (bool(clients) and all(c.closed for c in clients))

    @property
    def connected(self) -> bool:
        """Whether every client this made (one per server used, and the relay's) is
        connected right now."""
        with self._lock:
            clients = list(self._clients.values())
        return not self._closed and all(c.connected for c in clients)

    @property
    def server_id(self) -> str:
        """The servers' ids, joined: it changes when any of them restarted without
        persistence (and its bins' versions started again)."""
        return ",".join(self._client(i).server_id for i in range(len(self.servers)))

    def owner(self, name: str) -> str:
        """The address of the server that holds bin ``name`` (a replicated shard's addresses
        joined by ``|``)."""
        return self.servers[self.shard_of(name)]

    def shard_of(self, name: str) -> int:
        """The index of the shard that holds bin ``name``."""
        return owner(name, self._keys)

    def spread(self, name: str) -> list[str]:
        """One bin name per server, each held by that server: ``NAME#J`` with the smallest
        ``J`` that lands there. What ``RLWorker`` spreads its rollouts over."""
        out: list[str | None] = [None] * len(self.servers)
        j = 0
        while None in out and j < 1000 * len(self.servers):
            candidate = f"{name}#{j}"
            home = self.shard_of(candidate)
            if out[home] is None:
                out[home] = candidate
            j += 1
        return [n for n in out if n is not None]

    def client_for(self, name: str) -> Client:
        """The client of the server that holds bin ``name``."""
        return self._client(self.shard_of(name))

    def relayed(self, name: str) -> bool:
        """Whether the reads of bin ``name`` go to the relay."""
        return self.relay is not None and any(fnmatch.fnmatchcase(name, g)
                                              for g in self.relay_bins)

    def _route(self, cmd: Command) -> int:
        """The index of the server ``cmd`` goes to (:data:`RELAY`: the relay); ``cmd`` names
        a bin."""
        name = cmd.bin
        assert name is not None
        request = cmd.request
        if type(request) in REPLAY_REQUESTS:
            raise ValueError(f"{cmd.what}: a sharded client's replay ops span its servers "
                             "(keys name a server): call them on the client itself, not "
                             "in a pipeline or through begin")
        if self.relay is not None and (
                (type(request) is Fetch and not request.spec.remove)
                or type(request) in (Listen, Unlisten)) and self.relayed(name):
            return RELAY
        return self.shard_of(name)

    @property
    def limits(self) -> Limits:
        return self._client(self._first).limits

    def _item(self, name: str, value: Any, tag: int | None) -> Item:
        return self.client_for(name)._item(name, value, tag)

    def _items(self, name: str, values: list[Any], tags: list[int | None]) -> list[Item]:
        return self.client_for(name)._items(name, values, tags)

    def _execute(self, cmd: Command) -> Any:
        if cmd.bin is not None:
            return self._client(self._route(cmd))._execute(cmd)
        answers, missing = self._ask_every_server(cmd)
        merged = self._merge(cmd, answers)
        if missing:
            why = "; ".join(f"{where}: {exc}" for where, exc in missing.items())
            raise ShardsUnavailable(
                f"{cmd.what}: {len(missing)} of {len(self.servers)} servers did not answer "
                f"({why}); the answer of the others is this error's .result",
                merged, missing)
        return merged

    def _ask_every_server(self, cmd: Command
                          ) -> tuple[dict[str, Any], dict[str, BaseException]]:
        """Send ``cmd`` to every server at once; ``(answers, missing)`` by address: a server
        that cannot be reached (or does not answer in time) is missing, not fatal."""
        calls: dict[str, PendingCall] = {}
        missing: dict[str, BaseException] = {}
        for i, where in enumerate(self.servers):
            try:
                calls[where] = self._client(i).begin._execute(cmd)
            except TransportError as exc:
                if self._closed:
                    raise
                missing[where] = exc
        answers: dict[str, Any] = {}
        for where, call in calls.items():
            try:
                answers[where] = call.result()
            except TransportError as exc:
                missing[where] = exc
        return answers, missing

    def _merge(self, cmd: Command, answers: dict[str, Any]) -> Any:
        request = cmd.request
        if isinstance(request, ListBins):
            merged: dict[str, int] = {}
            for bins in answers.values():
                merged.update(bins)
            return merged
        if isinstance(request, Stats):
            return {"servers": {where: a["server"] for where, a in answers.items()},
                    "bins": {k: v for a in answers.values() for k, v in a["bins"].items()}}
        if isinstance(request, Ping):
            return None
        return list(answers.values())

    def pipeline(self, *, raise_on_error: bool = True) -> Pipeline:
        """As :meth:`Client.pipeline`: each server gets its share of the requests in one
        write, and the results come back in the order of the calls."""
        return Pipeline(self, raise_on_error)

    def _run_pipeline(self, pipeline: Pipeline, batch: Iterable[tuple[Command, int]]
                      ) -> list[Any]:
        batch = list(batch)
        outcomes: list[Any] = [None] * len(batch)
        shares: dict[int, list[int]] = {}
        for i, (cmd, _) in enumerate(batch):
            if cmd.bin is not None:
                shares.setdefault(self._route(cmd), []).append(i)
                continue
            # list, stats, ping ask every server: after what was queued before them.
            self._send_shares(batch, shares, outcomes)
            shares = {}
            try:
                outcomes[i] = self._execute(cmd)
            except TensorShareError as exc:
                outcomes[i] = exc
        self._send_shares(batch, shares, outcomes)
        return pipeline.finish(outcomes, [n for _, n in batch])

    def _send_shares(self, batch: Sequence[tuple[Command, int]], shares: dict[int, list[int]],
                     outcomes: list[Any]) -> None:
        """Send each server its share of ``batch`` in one write, then wait for them all."""
        sent = {index: self._client(index)._submit_many([batch[i][0] for i in share])
                for index, share in shares.items()}
        for index, share in shares.items():
            for i, outcome in zip(share, outcomes_of(sent[index]), strict=True):
                outcomes[i] = outcome

    def rebalance(self, drain: Sequence[str] | str = (), *,
                  progress: Callable[[int, int, str, str], Any] | None = None
                  ) -> dict[str, str]:
        """Move every value and list bin to the server that owns it now (after servers were
        added or removed: construct this client with the new list). Returns ``{bin: the
        address it moved to}``.

        Args:
            drain: servers leaving the set (before scaling down): their bins move too.
            progress: called as ``progress(done, total, bin, address)`` after each bin
                moved (``tensorshare rebalance`` prints it).

        A bin moves with its version: on its new server it is at least at the version it
        had (a put or append with ``min_version``, docs/PROTOCOL.md §3.2.2), so versions
        never go backwards for a reader (``RLWorker`` waits for a newer one). A value
        moves as peek, put on its new server, delete on the old; a list's items as gets
        and appends of as many as one request carries (their order and tags kept). Run it
        while no one writes to the bins that move: a write in between lands on one side or
        the other. Stream and service bins are not moved (they live as long as their
        members).

        Warns:
            RuntimeWarning: a new server ignored ``min_version`` (an older server): the
                bin moved, but its version started again there.
        """
        leaving = [Client(urls[0] if len(urls) == 1 else urls, options=self.options)
                   for urls in self._drained(drain)]
        try:
            plan = [(here, name, kind) for index, here in
                    [(i, self._client(i)) for i in range(len(self.servers))]
                    + [(None, c) for c in leaving]
                    for name, kind in self._to_move(here, index)]
            moved: dict[str, str] = {}
            for done, (here, name, kind) in enumerate(plan, 1):
                home = self.shard_of(name)
                if self._move(here, self._client(home), name, kind):
                    moved[name] = self.servers[home]
                if progress is not None:
                    progress(done, len(plan), name, self.servers[home])
            return moved
        finally:
            for c in leaving:
                c.close()

    def _drained(self, drain: Sequence[Shard] | str) -> list[list[str]]:
        shards = expand_shards(drain) if drain else []
        mine = {url for urls in self.shards for url in urls}
        for urls in shards:
            if mine & set(urls):
                raise ValueError(f"{REPLICA_SEP.join(urls)} is one of this client's servers: "
                                 f"it cannot be drained")
        return shards

    def _to_move(self, here: Client, index: int | None) -> list[tuple[str, str]]:
        """The value and list bins on ``here`` (server ``index``) that another server owns."""
        return [(name, b["kind"]) for name, b in here.stats()["bins"].items()
                if b["kind"] in ("value", "list") and self.shard_of(name) != index]

    def _move(self, here: Client, there: Client, name: str, kind: str) -> bool:
        """Move bin ``name`` from ``here`` to ``there`` with its version; whether there was
        anything to move (a bin emptied since it was listed is not)."""
        try:
            res = here.fetch(name, remove=kind != "value", max_items=None)
        except BinNotFound:
            return False
        if kind == "value":
            item = there._item(name, res.value, res.tags[0] if res.tags else None)
            self._stored(there, Command(Put(0, name, item, res.version),
                                        f"put to bin {name!r}", _version), name, res.version)
            here.delete(name)
            return True
        while True:
            try:
                self._append_moved(there, name, list(res.value), list(res.tags), res.version)
            except BaseException as exc:
                _give_back(here, name, res, exc)
                raise
            if not res.n_items:
                return True
            res = here.fetch(name, remove=True, max_items=None)

    def _append_moved(self, there: Client, name: str, values: list[Any],
                      tags: list[int | None], version: int) -> None:
        """Append ``values`` to ``there`` in requests of what one carries, the bin at least
        at ``version`` after the first."""
        room, most = there.limits.max_frame_bytes // 2, Pipeline.MAX_BATCH_ITEMS
        items = there._items(name, values, tags) if values else []
        i = 0
        while i < len(items):
            j, size = i + 1, items[i].value.nbytes
            while j < len(items) and j - i < most and size + items[j].value.nbytes < room:
                size += items[j].value.nbytes
                j += 1
            append = Append(0, name, items[i], BLOCK_SHARE * there.timeout,
                            tuple(items[i + 1:j]), version)
            self._stored(there, Command(append, f"append to bin {name!r}", _version), name,
                         version)
            i = j

    @staticmethod
    def _stored(there: Client, cmd: Command, name: str, version: int) -> None:
        got = there._execute(cmd)
        if got < version:
            warnings.warn(f"bin {name!r} moved to {there.address}, whose server ignored "
                          f"min_version (an older server): its version went from {version} "
                          f"to {got}", RuntimeWarning, stacklevel=4)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("begin_") and name != "begin_":
            return getattr(self.begin, name[6:])
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def close(self) -> None:
        """Close every server's client (each ends its session). Idempotent."""
        with self._lock:
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    def __repr__(self) -> str:
        return f"<tensorshare.ShardedClient over {len(self.servers)} servers>"


def _give_back(here: Client, name: str, res: Any, exc: BaseException) -> None:
    """Items a rebalance took from ``here`` and could not store on their new server go back
    to the end of their bin (the exception says whether they could)."""
    values = list(res.value)
    try:
        if values:
            with here.pipeline() as p:
                for value, tag in zip(values, res.tags, strict=True):
                    p.append(name, value, tag=tag)
    except BaseException as again:
        exc.add_note(f"{len(values)} items taken from bin {name!r} could not be stored on "
                     f"either server ({again!r}): they are lost")
        return
    exc.add_note(f"the {len(values)} items taken from bin {name!r} were appended back to "
                 f"its old server")


class _ShardedBegin(Begin):
    """``sharded.begin.put(...)``: the bin's server's ``begin`` face; ``list``, ``stats`` and
    ``ping`` ask every server before they return (an already complete PendingCall)."""

    def _execute(self, cmd: Command) -> PendingCall:
        sharded = self._face
        if cmd.bin is not None:
            return sharded._client(sharded._route(cmd)).begin._execute(cmd)
        return PendingCall.done(sharded._execute(cmd))


def connect(host: str | None = None, port: int | None = None,
            timeout: float | None = None, *, options: ClientOptions | None = None,
            **overrides: Unpack[OptionFields]) -> BinClient:
    """The client for ``host``: a :class:`ShardedClient` when ``host`` names several servers
    (``"h1:7000,h2:7000"``, or replicated shards ``"a:7000|b:7000,c:7000|d:7000"``), or when neither host nor ``TENSORSHARE_URL`` is given and
    ``TENSORSHARE_SERVERS`` is; else a :class:`~.blocking.Client`. What ``RLTrainer``,
    ``RLWorker`` and ``TensorShare`` use, so that each accepts several servers.

    ``options`` (a :class:`~.options.ClientOptions`) and the keywords, which override its
    fields (``timeout`` too, unless ``None``), make the one options object the client gets.

    Raises:
        ValueError, TypeError: a bad option (before any connection is tried).
    """
    changes: dict[str, Any] = dict(overrides)
    if timeout is not None:
        changes["timeout"] = timeout
    opts = ClientOptions.of(options, **changes)
    if host is not None and ("," in host or REPLICA_SEP in host):
        return ShardedClient(host, options=opts)
    if host is None and not os.environ.get("TENSORSHARE_URL") and servers_from_env():
        return ShardedClient(None, options=opts)
    return Client(host, port, options=opts)
