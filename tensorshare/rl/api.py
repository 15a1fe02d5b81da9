"""RLTrainer / RLWorker: versioned parameters and version-tagged rollouts for distributed RL.

The trainer publishes parameters into one bin; the server's version of that bin *is* the
parameter version, so it lives with the parameters: a restarted trainer continues the count,
and every worker agrees on it. Workers append rollouts tagged with the version they were made
with; the trainer fetches with ``min_tag`` so stale rollouts are dropped on the server and
never shipped.

* ``get_parameters()`` asks the server for parameters newer than the ones it already has: an
  unchanged version costs one tiny round trip and no download.
* ``await_new_parameters(timeout)`` is a server-side wait for a version above the last one
  returned, so there is no window in which a publish can be missed.
* The end of a run is said explicitly, not by closing a connection (clients reconnect, so a
  vanished server is not an end): ``RLTrainer.signal_stop()`` puts the last parameter version
  into a small control bin (``<data_bin>/stop``); every ``RLWorker`` listens to that bin, so the
  news costs the workers nothing until it comes, and then every call they are making or will
  make raises :class:`TrainerStopped` at once. A trainer that hosts the server signals this
  itself when it stops.
* Both sides ride out connection drops and server restarts (the client reconnects). If the
  server came back *without* its data (no ``--data-dir``), parameter versions start again:
  a worker notices (the server's id changed), forgets its version, so it downloads the next
  parameters whatever their number, and tags rollouts made meanwhile with no version (stale to
  a filtering trainer). A call caught in flight by such a restart is settled without doubling
  anything: a rollout whose append cannot be known to have landed is dropped (it was made with
  parameters the new server never saw; ``add_data`` returns 0 and ``lost_rollouts`` counts
  it), a publish is made again (a put replaces, so that is safe), a ``get_data`` returns
  nothing, and a parameter fetch is asked again.

Both classes work as plain blocking objects (``with RLWorker(host, port) as w: ...``) from
any thread; ``start()`` / ``stop()`` keep the original API, where ``start()`` blocks until
``stop()``.
"""

from __future__ import annotations

import functools
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar, Unpack

from ..client.blocking import NOWAIT
from ..client.ops import BinClient
from ..client.options import UNSET, ClientOptions, OptionFields, Unset
from ..client.sharded import ShardedClient, connect
from ..errors import (
    BinNotFound,
    ConnectionLost,
    SessionLost,
    Timeout,
    TransportError,
    is_server_timeout,
)
from ..memory.device import check_device, load_into, want_pinned
from .replay import ReplayBuffer

__all__ = ["DATA_BIN", "PARAMS_BIN", "RLTrainer", "RLWorker", "TrainerStopped", "stop_bin_for"]

_T = TypeVar("_T")

log = logging.getLogger("tensorshare.rl")

# How many times one call is asked again after a server restart caught it in flight (each try
# has the client's own timeout; a server that restarts this often in one call is broken).
_RESTART_RETRIES = 3
# Over several servers, how long get_data waits on one rollout bin before looking at all.
_SPREAD_WAIT = 0.05

PARAMS_BIN = "rl/parameters"
DATA_BIN = "rl/rollouts"


def _again_after_restart(call: Callable[[], _T], what: str) -> _T:
    """``call()``, made again when a server restart caught it in flight (``SessionLost``).

    Only for calls that are safe to repeat (a read, a put that replaces).
    """
    for _ in range(_RESTART_RETRIES):
        try:
            return call()
        except SessionLost:
            log.warning("%s again: the server restarted meanwhile", what)
    return call()


class TrainerStopped(ConnectionLost):
    """The trainer signalled the end of the run (:meth:`RLTrainer.signal_stop`).

    A :class:`ConnectionLost`, so code written for the days when a stopping trainer only
    closed the server still catches it.
    """


def stop_bin_for(data_bin: str) -> str:
    """The control bin through which the trainer of ``data_bin`` signals the end of a run."""
    return f"{data_bin}/stop"


def _local(host: str) -> str:
    return "127.0.0.1" if host == "localhost" else host


def _host(port: int, host: str, options: ClientOptions, insecure: bool) -> tuple[Any, str]:
    """A server in this process for :class:`RLTrainer` (``host_server=True``), on ``host``
    and ``port`` or where a ``tensorshare://`` URL ``host`` says, and the host its client
    connects to (a URL then names the port the server took): the token the trainer's client
    is given is the server's too (else ``TENSORSHARE_TOKEN``, as for any server), and so is
    ``TENSORSHARE_TLS_CERT``/``_KEY``'s TLS; ``insecure``: beyond loopback without a token.

    Raises:
        ValueError: a ``unix://`` address (the hosted server listens on TCP).
    """
    from ..server import EmbeddedServer, ServerConfig

    where = options.endpoint(host, port).address
    if where.path is not None:
        raise ValueError(f"host_server=True listens on TCP: give a host and port or a "
                         f"tensorshare:// URL, not {host!r}")
    token = options.token
    if token is None and options.token_file:
        with open(options.token_file, encoding="utf-8") as f:
            token = f.read()
    if isinstance(token, bytes):
        token = token.decode()
    config = ServerConfig(token=token) if token is not None else None
    server = EmbeddedServer(where.port, host=_local(where.host), config=config,
                            insecure=insecure)
    return server, replace(where, port=server.port).url if "://" in host else host


class _Base:
    def __init__(self, host: str, port: int, params_bin: str, data_bin: str,
                 options: ClientOptions) -> None:
        self.host, self.port = host, port
        self.params_bin, self.data_bin = params_bin, data_bin
        self.stop_bin = stop_bin_for(data_bin)
        self._stopped = threading.Event()
        self._server: Any = None
        self.client: BinClient = connect(host, port, options=options)
        # Over several servers, rollouts are spread over one bin per server (workers take
        # turns, the trainer drains them all); the parameters live on one of them.
        self.data_bins = self.client.spread(data_bin) if isinstance(
            self.client, ShardedClient) else [data_bin]

    def start(self) -> None:
        """Block until :meth:`stop` is called (from any thread), as in the original API."""
        self._stopped.wait()

    def stop(self) -> None:
        """Close the connection (and the hosted server, if any); make :meth:`start` return."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.client.close()
        params: Any = getattr(self, "params_client", self.client)
        if params is not self.client:
            params.close()
        if self._server is not None:
            self._server.stop()

    def close(self) -> None:
        """Same as :meth:`stop`."""
        self.stop()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RLTrainer(_Base):
    """The learner side: publishes parameters, collects rollouts.

    Args:
        host, port: the server (``host`` may be a URL, see :class:`~tensorshare.Client`).
            With ``host_server=True`` a server is started in this process on that host and
            port (0 picks a free one; read it back from ``.port``).
        host_server: run the server inside this process. When the trainer stops, it first
            signals the end of the run (:meth:`signal_stop`), then stops the server; connected
            workers get :class:`TrainerStopped` (a ``ConnectionLost``).
        filter_version: keep only rollouts made with the newest published parameters.
        max_version_lag: keep rollouts made with parameters at most this many versions old
            (0 is the same as ``filter_version=True``). Overrides ``filter_version``.
        timeout: seconds to connect and to wait for each reply (default: ``options``', 30).
        params_bin, data_bin: bin names, to run several experiments on one server.
        insecure: with ``host_server``, let the server listen beyond loopback (``host``
            ``"0.0.0.0"``, say) without a token, on a network you trust (as
            ``EmbeddedServer(insecure=True)``); without ``host_server`` a ``ValueError``.
        options, client_options: the client's :class:`~tensorshare.ClientOptions`, and
            fields of it as keywords (``token``, ``token_file``, ``tls_ca``, ...; they
            override ``options``). With ``host_server``, the client's token (``token``,
            ``token_file``) is the server's too.

    Raises:
        ConnectError: the server could not be reached within ``timeout``.
        ValueError: ``host_server`` beyond loopback without a token or ``insecure=True``.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 8000, host_server: bool = False,
                 filter_version: bool = True, *, max_version_lag: int | None = None,
                 timeout: float | Unset = UNSET, params_bin: str = PARAMS_BIN,
                 data_bin: str = DATA_BIN, insecure: bool = False,
                 options: ClientOptions | None = None,
                 **client_options: Unpack[OptionFields]) -> None:
        opts = ClientOptions.of(options, timeout=timeout, **client_options)
        if insecure and not host_server:
            raise ValueError("insecure=True is for a trainer that hosts its server "
                             "(host_server=True): a client needs a token, not insecure")
        server = None
        if host_server:
            server, host = _host(port, host, opts, insecure)
            port = server.port
        try:
            super().__init__(host, port, params_bin, data_bin, opts)
        except BaseException:
            if server is not None:
                server.stop()
            raise
        self._server = server
        self.filter_version = filter_version
        self.max_version_lag = max_version_lag
        self.version: int | None = None  # version of the parameters this trainer published
        self.dropped = 0  # stale rollouts dropped on the server, in total
        self.last_dropped = 0  # ... by the last get_data call
        self.stop_signalled = False

    def signal_stop(self) -> None:
        """Tell every worker of this run that it is over.

        Puts the last published parameter version into :attr:`stop_bin`; workers listening to
        it (every :class:`RLWorker` does, unless ``watch_stop=False``) raise
        :class:`TrainerStopped` from then on. The server and this trainer's connection stay up,
        so the trainer can still read what is left or tidy up its bins.

        Raises:
            TransportError: the server could not be reached within the timeout.
        """
        self.client.put(self.stop_bin, int(self.version or 0))
        self.stop_signalled = True

    def stop(self) -> None:
        """Stop: a trainer that hosts the server first signals the end of the run to the
        workers (best effort), then closes its connection and the server."""
        if self._server is not None and not self._stopped.is_set() and not self.stop_signalled:
            try:
                self.signal_stop()
            except TransportError:
                pass  # the workers will notice the server is gone by their own timeouts
        super().stop()

    def publish_parameters(self, state_dict: Any) -> int:
        """Publish parameters (any state_dict or nested value of tensors).

        Returns:
            The new parameter version, once the server holds the parameters.
        """
        # A put replaces the bin: made again after a restart caught it, it cannot double.
        self.version = _again_after_restart(
            functools.partial(self.client.put, self.params_bin, state_dict),
            "publishing parameters")
        return self.version

    def _min_tag(self) -> int | None:
        # Only publishes change the parameter bin, so versions count publishes.
        if self.version is None:
            return None
        if self.max_version_lag is not None:
            return self.version - self.max_version_lag
        return self.version if self.filter_version else None

    def get_data(self, return_versions: bool = False, *, timeout: float | None = 0.0,
                 min_items: int = 1, max_items: int | None = None) -> list[Any]:
        """Take the rollouts that have arrived.

        Args:
            return_versions: return ``(rollout, version)`` pairs instead of rollouts.
            timeout: 0 (default) returns at once, possibly an empty list. A number waits up
                to that many seconds for ``min_items`` rollouts, then returns what arrived
                (maybe fewer). ``None`` waits until ``min_items`` arrived.
            min_items: how many rollouts to wait for.
            max_items: take at most this many (the rest stay for the next call).

        Returns:
            The rollouts, oldest first. Stale ones (see ``filter_version`` and
            ``max_version_lag``) were dropped on the server; ``self.last_dropped`` says how many.
        """
        if len(self.data_bins) > 1:
            return self._get_spread(return_versions, timeout, min_items, max_items)
        wait: Any = NOWAIT if timeout == 0 else timeout
        self.last_dropped = 0
        try:
            got = self._take(self.data_bin, wait, min_items, max_items)
        except Timeout:
            # Fewer than min_items arrived in time: return the ones that did.
            got = self._take(self.data_bin, NOWAIT, 1, max_items) if min_items > 1 else []
        return got if return_versions else [item for item, _ in got]

    def _take(self, name: str, wait: Any, min_items: int, max_items: int | None
              ) -> list[tuple[Any, int | None]]:
        """Take rollouts from bin ``name``: ``(rollout, version)`` pairs (``[]``: none).

        Raises:
            WaitTimeout: fewer than ``min_items`` (> 1) arrived within ``wait``.
        """
        try:
            res = self.client.fetch(name, remove=True, max_items=max_items, timeout=wait,
                                    min_tag=self._min_tag(), min_items=min_items)
        except SessionLost:
            # The server restarted (or forgot this client) while the get was in flight: the
            # rollouts it took, if any, went with the old server. Nothing to return this time.
            log.warning("get_data: the server restarted while rollouts were being fetched")
            return []
        except (BinNotFound, Timeout) as exc:
            if isinstance(exc, Timeout) and not is_server_timeout(exc):
                raise  # the server did not answer: a failure, not "no data"
            if isinstance(exc, Timeout) and min_items > 1:
                raise
            return []
        self.last_dropped += res.dropped
        self.dropped += res.dropped
        items = res.value if res.kind == "list" else [res.value]
        return list(zip(items, res.tags, strict=True))

    def _get_spread(self, return_versions: bool, timeout: float | None, min_items: int,
                    max_items: int | None) -> list[Any]:
        """get_data over one rollout bin per server: take what each holds; until
        ``min_items`` arrived (or ``timeout``), wait briefly on each bin in turn."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.last_dropped = 0
        got: list[tuple[Any, int | None]] = []
        turn = 0
        while True:
            for name in self.data_bins:
                left = None if max_items is None else max_items - len(got)
                if left == 0:
                    break
                got += self._take(name, NOWAIT, 1, left)
            now = time.monotonic()
            if len(got) >= min_items or timeout == 0 or (deadline is not None and now >= deadline):
                break
            left = None if max_items is None else max_items - len(got)
            wait = _SPREAD_WAIT if deadline is None else min(_SPREAD_WAIT, deadline - now)
            got += self._take(self.data_bins[turn % len(self.data_bins)], wait, 1, left)
            turn += 1
        return got if return_versions else [item for item, _ in got]


class RLWorker(_Base):
    """The actor side: fetches parameters, pushes rollouts tagged with their version.

    Args:
        host, port: the server. timeout: seconds to connect and to wait for each reply
            (default: ``options``', 30).
        params_bin, data_bin: bin names (must match the trainer's).
        watch_stop: listen for the trainer's end-of-run signal (:meth:`RLTrainer.signal_stop`).
            When it comes, the connection is closed and every call made then or later,
            including one waiting in :meth:`await_new_parameters`, raises
            :class:`TrainerStopped`. A worker that connects after the signal was given does
            not see it (a put to the stop bin is an event, not a state).
        params_via: read the parameters from this server instead: a relay of the trainer's
            server (``"HOST:PORT"`` or a URL, see :mod:`tensorshare.relay`), typically the
            one on this worker's machine. Rollouts still go to ``host``.
        device: where the parameters :meth:`get_parameters` and
            :meth:`await_new_parameters` return live (``"cuda"``, ...; checked here, a torch
            without CUDA is a ``ValueError``); ``None``: the CPU. To load them into a model
            that is already on its device, :meth:`load_parameters_into` copies straight
            into the model's own tensors instead.
        options, client_options: the client's :class:`~tensorshare.ClientOptions`, and
            fields of it as keywords (``token``, ``tls_ca``, ...; they override ``options``);
            ``params_via``'s client has the same.

    Raises:
        ConnectError: the server could not be reached within ``timeout``.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 8000, *,
                 timeout: float | Unset = UNSET, params_bin: str = PARAMS_BIN,
                 data_bin: str = DATA_BIN, watch_stop: bool = True,
                 params_via: str | None = None, device: Any = None,
                 options: ClientOptions | None = None,
                 **client_options: Unpack[OptionFields]) -> None:
        opts = ClientOptions.of(options, timeout=timeout, **client_options)
        self.device = check_device(device)  # (before connecting)
        want_pinned(self.device)
        super().__init__(host, port, params_bin, data_bin, opts)
        self.params_client: BinClient = self.client
        if params_via is not None:
            try:
                self.params_client = connect(params_via if "://" in params_via else
                                             f"tensorshare://{params_via}", None, options=opts)
            except BaseException:
                self.client.close()
                raise
        self.version: int | None = None  # version of the parameters last returned
        self.downloads = 0  # parameter versions downloaded (each at most once)
        self.lost_rollouts = 0  # rollouts dropped because a server restart caught them
        self._params: Any = None
        self._server_id = ""  # the server whose versions self.version counts
        self._trainer_stopped = threading.Event()
        self._turn = random.randrange(len(self.data_bins))  # workers start on different servers
        if watch_stop:
            try:
                self.client.listen(self.stop_bin, self._on_stop_event)
            except BaseException:
                self.client.close()
                raise

    @property
    def trainer_stopped(self) -> bool:
        """Whether the trainer signalled the end of the run."""
        return self._trainer_stopped.is_set()

    def _on_stop_event(self, event: dict[str, Any]) -> None:
        # A put is a trainer's signal; a resync with items means one came while this client
        # was reconnecting. Deletes (a trainer tidying up) say nothing.
        op = event.get("op")
        if op == "put" or (op == "resync" and event.get("n_items", 0) > 0):
            self._trainer_stopped.set()
            # Closing fails every waiting call at once. Not from this thread: it is the
            # client's own event thread, which close() winds down.
            threading.Thread(target=self._close_clients, daemon=True,
                             name="tensorshare-rlworker-stop").start()

    def _close_clients(self) -> None:
        self.client.close()
        if self.params_client is not self.client:
            self.params_client.close()

    def _call(self, fn: Callable[[], _T]) -> _T:
        if self._trainer_stopped.is_set():
            raise TrainerStopped(f"the trainer of {self.data_bin!r} signalled the end of the run")
        try:
            return fn()
        except ConnectionLost as exc:
            if self._trainer_stopped.is_set():
                raise TrainerStopped(
                    f"the trainer of {self.data_bin!r} signalled the end of the run") from exc
            raise

    def get_parameters(self) -> Any:
        """Return the latest published parameters, or ``None`` if none were published.

        Downloads only if the server holds a version newer than the one this worker has;
        otherwise returns the parameters it already has.

        Raises:
            TrainerStopped: the trainer signalled the end of the run.
        """
        try:
            res = self._fetch_parameters(None, wait=False)
        except BinNotFound:
            return self._params
        return self._adopt(res)

    def await_new_parameters(self, timeout: float | None = None) -> Any:
        """Wait for parameters newer than the ones last returned, and return them.

        Args:
            timeout: seconds to wait; ``None`` waits without limit.

        Returns:
            The new parameters, or ``None`` if none were published within ``timeout``.

        Raises:
            TrainerStopped: the trainer signalled the end of the run (also while waiting).
        """
        try:
            res = self._fetch_parameters(timeout, wait=True)
        except Timeout as exc:
            if not is_server_timeout(exc):
                raise  # the server did not answer: a failure, not "nothing newer"
            return None
        return self._adopt(res)

    def _check_server(self) -> str:
        """The server's id; forget our parameter version if it is a new server's."""
        sid = self.client.server_id
        if sid and sid != self._server_id:
            if self._server_id and self.version is not None:
                log.warning("the tensorshare server restarted without its data: parameter "
                            "versions start again (this worker had version %d)", self.version)
                self.version = None
            self._server_id = sid
        return sid

    def _fetch_parameters(self, timeout: float | None, *, wait: bool,
                          host: bool = False) -> Any:
        """Fetch parameters newer than ours (waiting up to ``timeout`` with ``wait``), asked
        again when a server restart caught the fetch or made our version meaningless
        (``host``: on the CPU, whatever the worker's device)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        device = None if host else self.device

        def fetch() -> Any:
            for _ in range(_RESTART_RETRIES):
                sid = self._check_server()
                newer = self.version
                if wait:
                    left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                    res = self._call(functools.partial(
                        self.params_client.fetch, self.params_bin, remove=False,
                        newer_than=newer or 0, timeout=left, device=device))
                else:
                    res = self._call(functools.partial(
                        self.params_client.fetch, self.params_bin, remove=False,
                        newer_than=newer, device=device))
                if newer is None or self._check_server() == sid:
                    return res
                # It waited for a reconnect to a new server and compared a version that meant
                # nothing there: ask again, with the version forgotten.
            return res

        return _again_after_restart(fetch, "fetching parameters")  # a read: safe to repeat

    def load_parameters_into(self, model: Any, *, wait: bool = False,
                             timeout: float | None = None) -> bool:
        """Copy the latest parameters straight into ``model``'s own parameters and buffers
        (its ``state_dict()`` tensors, wherever they live: one copy from the received
        host memory, pinned once reused; no second allocation on the device). Only a
        version newer than the one this worker has is downloaded.

        Args:
            model: an ``nn.Module`` whose ``state_dict`` has the names the trainer publishes.
            wait: wait (up to ``timeout``; ``None``: no limit) for a newer version.

        Returns:
            Whether new parameters were loaded (``False``: none newer, or none published,
            or none within ``timeout``). :meth:`get_parameters` then returns the model's
            own tensors.

        Raises:
            KeyError: the published names do not match the model's (nothing is loaded
                partially: the names are checked before any copy).
            TrainerStopped: the trainer signalled the end of the run.
        """
        targets = model.state_dict(keep_vars=False)
        devices = {t.device for t in targets.values()}
        for d in devices:
            want_pinned(d)
        try:
            res = self._fetch_parameters(timeout, wait=wait, host=True)
        except BinNotFound:
            return False
        except Timeout as exc:
            if wait and is_server_timeout(exc):
                return False
            raise
        if res.unchanged:
            return False
        load_into(targets, res.value)
        self._params = targets
        self.version = res.version
        self.downloads += 1
        return True

    def _adopt(self, res: Any) -> Any:
        if not res.unchanged:
            self._params = res.value
            self.version = res.version
            self.downloads += 1
        return self._params

    def replay_buffer(self, name: str = "rl/replay", **config: Any) -> ReplayBuffer:
        """The insert path for off-policy learning, beside :meth:`add_data`'s rollouts: a
        :class:`~.replay.ReplayBuffer` on this worker's connection (over several servers: a
        replay bin on each), the bin opened with ``config`` (``max_size=`` and the other
        arguments of :class:`~.replay.ReplayBuffer`). Insert with its ``insert`` and
        ``insert_many``; closing the worker closes it."""
        return ReplayBuffer.over(self.client, name, **config)

    def add_data(self, x: Any, version: int | None = None) -> int:
        """Send a rollout, tagged with the version of the parameters last returned, or with
        ``version``: the version of the parameters that made it (a worker that acts through
        an ``InferenceClient`` passes the version ``predict(..., return_version=True)``
        returned; the trainer's staleness filter then applies to it).

        Returns:
            The rollout bin's version, once the server holds the rollout; 0 if a server
            restart caught the rollout in flight and it was dropped (see the module's notes;
            ``lost_rollouts`` counts them). Nothing is ever stored twice.

        Raises:
            TrainerStopped: the trainer signalled the end of the run.
        """
        if not self.client.connected:
            # Reconnecting: learn which server comes back before tagging, so that a rollout
            # made for a server that restarted without its data is not tagged with a version
            # that means something else on the new one (waits up to the client's timeout).
            self._call(self.client.ping)
        self._check_server()
        tag = self.version if version is None else int(version)
        name = self.data_bins[self._turn % len(self.data_bins)]  # one server after another
        self._turn += 1
        try:
            return self._call(lambda: self.client.append(name, x, tag=tag))
        except SessionLost:
            # Unknown whether it landed: sending it again could store it twice, and it was
            # made with parameters of a server that is gone. Drop it, loudly.
            self.lost_rollouts += 1
            log.warning("a rollout was dropped: the server restarted while it was being sent")
            return 0
