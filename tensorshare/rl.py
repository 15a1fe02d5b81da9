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

Both classes work as plain blocking objects (``with RLWorker(host, port) as w: ...``) from
any thread; ``start()`` / ``stop()`` keep the original API, where ``start()`` blocks until
``stop()``.
"""

from __future__ import annotations

import threading
from typing import Any

from .client import NOWAIT, Client
from .errors import BinNotFound, Timeout, is_server_timeout

__all__ = ["DATA_BIN", "PARAMS_BIN", "RLTrainer", "RLWorker"]

PARAMS_BIN = "rl/parameters"
DATA_BIN = "rl/rollouts"


def _local(host: str) -> str:
    return "127.0.0.1" if host == "localhost" else host


class _Base:
    def __init__(self, host: str, port: int, timeout: float, params_bin: str, data_bin: str,
                 client_options: dict[str, Any]) -> None:
        self.host, self.port = host, port
        self.params_bin, self.data_bin = params_bin, data_bin
        self._stopped = threading.Event()
        self._server: Any = None
        self.client = Client(host, port, timeout, **client_options)

    def start(self) -> None:
        """Block until :meth:`stop` is called (from any thread), as in the original API."""
        self._stopped.wait()

    def stop(self) -> None:
        """Close the connection (and the hosted server, if any); make :meth:`start` return."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.client.close()
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
        host, port: the server. With ``host_server=True`` a server is started in this
            process on that port (0 picks a free one; read it back from ``.port``).
        host_server: run the server inside this process. When the trainer stops, so does
            the server, and connected workers get ``ConnectionLost``.
        filter_version: keep only rollouts made with the newest published parameters.
        max_version_lag: keep rollouts made with parameters at most this many versions old
            (0 is the same as ``filter_version=True``). Overrides ``filter_version``.
        timeout: seconds to connect and to wait for each reply.
        params_bin, data_bin: bin names, to run several experiments on one server.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 8000, host_server: bool = False,
                 filter_version: bool = True, *, max_version_lag: int | None = None,
                 timeout: float = 30.0, params_bin: str = PARAMS_BIN, data_bin: str = DATA_BIN,
                 **client_options: Any) -> None:
        server = None
        if host_server:
            from .server import EmbeddedServer

            server = EmbeddedServer(port, _local(host))
            port = server.port
        try:
            super().__init__(host, port, timeout, params_bin, data_bin, client_options)
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

    def publish_parameters(self, state_dict: Any) -> int:
        """Publish parameters (any state_dict or nested value of tensors).

        Returns:
            The new parameter version, once the server holds the parameters.
        """
        self.version = self.client.put(self.params_bin, state_dict)
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
        min_tag = self._min_tag()
        wait: Any = NOWAIT if timeout == 0 else timeout
        try:
            res = self.client.fetch(self.data_bin, remove=True, max_items=max_items,
                                    timeout=wait, min_tag=min_tag, min_items=min_items)
        except (BinNotFound, Timeout) as exc:
            if isinstance(exc, Timeout) and not is_server_timeout(exc):
                raise  # the server did not answer: a failure, not "no data"
            self.last_dropped = 0
            if isinstance(exc, Timeout) and min_items > 1:
                # Fewer than min_items arrived in time: return the ones that did.
                return self.get_data(return_versions, timeout=0, max_items=max_items)
            return []
        self.last_dropped = res.dropped
        self.dropped += res.dropped
        items = res.value if res.kind == "list" else [res.value]
        if return_versions:
            return list(zip(items, res.tags, strict=True))
        return list(items)


class RLWorker(_Base):
    """The actor side: fetches parameters, pushes rollouts tagged with their version.

    Args:
        host, port: the server. timeout: seconds to connect and to wait for each reply.
        params_bin, data_bin: bin names (must match the trainer's).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 8000, *, timeout: float = 30.0,
                 params_bin: str = PARAMS_BIN, data_bin: str = DATA_BIN,
                 **client_options: Any) -> None:
        super().__init__(host, port, timeout, params_bin, data_bin, client_options)
        self.version: int | None = None  # version of the parameters last returned
        self.downloads = 0  # parameter versions downloaded (each at most once)
        self._params: Any = None

    def get_parameters(self) -> Any:
        """Return the latest published parameters, or ``None`` if none were published.

        Downloads only if the server holds a version newer than the one this worker has;
        otherwise returns the parameters it already has.
        """
        try:
            res = self.client.fetch(self.params_bin, remove=False, newer_than=self.version)
        except BinNotFound:
            return self._params
        return self._adopt(res)

    def await_new_parameters(self, timeout: float | None = None) -> Any:
        """Wait for parameters newer than the ones last returned, and return them.

        Args:
            timeout: seconds to wait; ``None`` waits without limit.

        Returns:
            The new parameters, or ``None`` if none were published within ``timeout``.
        """
        try:
            res = self.client.fetch(self.params_bin, remove=False,
                                    newer_than=self.version or 0, timeout=timeout)
        except Timeout as exc:
            if not is_server_timeout(exc):
                raise  # the server did not answer: a failure, not "nothing newer"
            return None
        return self._adopt(res)

    def _adopt(self, res: Any) -> Any:
        if not res.unchanged:
            self._params = res.value
            self.version = res.version
            self.downloads += 1
        return self._params

    def add_data(self, x: Any) -> int:
        """Send a rollout, tagged with the version of the parameters last returned.

        Returns:
            The rollout bin's version, once the server holds the rollout.
        """
        return self.client.append(self.data_bin, x, tag=self.version)
