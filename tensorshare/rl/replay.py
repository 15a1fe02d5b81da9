"""Prioritized experience replay over a tensorshare server: :class:`ReplayBuffer`.

Many actors insert transitions with priorities, learners sample batches in proportion to
priority and update the priorities after each step, and a rate limiter keeps the ratio of
samples to inserts (DeepMind's Reverb's tables, for PyTorch). The buffer lives on the
server (a replay bin), so any number of processes on any machines share it::

    buf = ReplayBuffer("rl/replay", host="learner:7000", max_size=1_000_000,
                       samples_per_insert=4.0, min_size_to_sample=1000)
    buf.insert_many(transitions, priorities)                  # an actor
    batch = buf.sample(256)                                   # the learner
    items, keys, probabilities, size = batch
    weights = (size * probabilities) ** -beta                 # importance weights
    buf.update_priorities(keys, td_errors.abs())
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Unpack

from ..client.options import ClientOptions, OptionFields
from ..client.replay import ReplayInfoResult, Sample
from ..client.sharded import connect
from ..errors import WaitTimeout

__all__ = ["ReplayBuffer", "Sample"]


class ReplayBuffer:
    """A replay bin on a server (or on each of several servers), as a buffer.

    Args:
        name: the bin's name.
        host, port: the server (``host`` also takes ``HOST:PORT``, a URL, or several
            servers ``"h1:7000,h2:7000"``: a replay bin on each, sampled in proportion to
            their total priority).
        max_size: the most items the bin holds; beyond, ``remover`` chooses which go.
        sampler: ``"prioritized"`` (item i with probability ``p_i ** priority_exponent /
            sum``), ``"uniform"``, ``"fifo"``, ``"lifo"`` or ``"max_priority"``.
        priority_exponent: alpha of the prioritized sampler.
        remover: ``"fifo"``, ``"lifo"`` or ``"min_priority"``.
        max_times_sampled: an item leaves after this many samples (``None``: never).
        samples_per_insert: the rate limiter's ratio (Reverb's ``SampleToInsertRatio``;
            ``None``: only ``min_size_to_sample``, Reverb's ``MinSize``).
        min_size_to_sample: samples wait until the bin holds this many items.
        error_buffer: how far (in samples) the ratio may drift, around
            ``samples_per_insert * min_size_to_sample``; a pair is ``(min_diff,
            max_diff)``; ``None``: ``max(samples_per_insert * min_size_to_sample,
            max(1, samples_per_insert))``.
        seed: makes the bin's sampling reproducible (``None``: the server draws one).
        options, client_options: the client's :class:`~tensorshare.ClientOptions`, and
            fields of it as keywords (``timeout``, ``token``, ...).

    The bin is created with this configuration, or checked against it when it exists
    (``InvalidRequest`` if it differs).
    """

    def __init__(self, name: str, /, host: str = "127.0.0.1", port: int | None = None, *,
                 max_size: int, sampler: str = "prioritized", priority_exponent: float = 0.6,
                 remover: str = "fifo", max_times_sampled: int | None = None,
                 samples_per_insert: float | None = None, min_size_to_sample: int = 1,
                 error_buffer: float | tuple[float, float] | None = None,
                 seed: int | None = None, options: ClientOptions | None = None,
                 **client_options: Unpack[OptionFields]) -> None:
        self.name = name
        self.client: Any = connect(host, port, options=options, **client_options)
        self._owned = True
        try:
            self._open(max_size=max_size, sampler=sampler, priority_exponent=priority_exponent,
                       remover=remover, max_times_sampled=max_times_sampled,
                       samples_per_insert=samples_per_insert,
                       min_size_to_sample=min_size_to_sample, error_buffer=error_buffer,
                       seed=seed)
        except BaseException:
            self.client.close()
            raise

    @classmethod
    def over(cls, client: Any, name: str, **config: Any) -> ReplayBuffer:
        """A buffer on ``client``'s connection (a :class:`~tensorshare.Client` or
        ``ShardedClient`` the caller keeps; :meth:`close` leaves it open), the bin opened
        with ``config`` (``max_size=`` and the other arguments of :class:`ReplayBuffer`)."""
        buf = cls.__new__(cls)
        buf.name, buf.client, buf._owned = name, client, False
        buf._open(**config)
        return buf

    def _open(self, **config: Any) -> None:
        self.config: dict[str, Any] = self.client.replay_open(self.name, **config).config

    def insert(self, item: Any, priority: float, timeout: float | None = None) -> int:
        """Insert ``item`` (a tensor, a dict of tensors, any value the client sends) with
        ``priority`` (finite, >= 0); its key. ``timeout``: as for :meth:`insert_many`."""
        return int(self.insert_many([item], [priority], timeout=timeout)[0])

    def insert_many(self, items: Sequence[Any], priorities: Any,
                    timeout: float | None = None) -> list[int]:
        """Insert ``items``, one priority each, as one request (all or none); their keys.

        ``timeout``: seconds the insert may wait while the rate limiter holds it (``None``:
        the client's timeout); then :class:`~tensorshare.errors.WaitTimeout`, nothing
        inserted."""
        return self._waiting(lambda wait: self.client.replay_insert(
            self.name, items, priorities, timeout=wait), timeout)

    def sample(self, batch_size: int, timeout: float | None = None) -> Sample:
        """Draw ``batch_size`` items (independently, with replacement): a :class:`Sample`
        (``items, keys, probabilities, size``). An empty or rate-limited bin waits up to
        ``timeout`` seconds (``None``: the client's timeout), then
        :class:`~tensorshare.errors.WaitTimeout`."""
        return self._waiting(lambda wait: self.client.replay_sample(
            self.name, batch_size, timeout=wait), timeout)

    def _waiting(self, op: Any, timeout: float | None) -> Any:
        """``op(wait)`` retried on ``WaitTimeout`` until ``timeout`` is spent: a request
        waits on the server at most 80% of the client's timeout, a caller may wait longer
        (each try that timed out did nothing)."""
        if timeout is None:
            return op(None)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
                not 0 <= timeout < float("inf"):
            raise ValueError(f"timeout must be a finite number >= 0 or None, not {timeout!r}")
        deadline = time.monotonic() + timeout
        while True:
            left = max(deadline - time.monotonic(), 0.0)
            try:
                return op(left)
            except WaitTimeout:
                if deadline - time.monotonic() <= 0.001:
                    raise

    def update_priorities(self, keys: Any, priorities: Any) -> int:
        """Set the priorities of the items ``keys`` (a sample's ``keys``; items that left
        the bin meanwhile are skipped) as one request; how many were updated."""
        return int(self.client.replay_update(self.name, keys, priorities))

    def __len__(self) -> int:
        return int(self.client.replay_info(self.name).size)

    def stats(self) -> dict[str, Any]:
        """The bin's statistics: size, inserts, samples, evictions, inserts/s and
        samples/s, the rate limiter's state and a priority histogram (over several servers:
        each one's under ``shards``)."""
        info: ReplayInfoResult = self.client.replay_info(self.name)
        return dict(info.stats, size=info.size, total_weight=info.total)

    def close(self) -> None:
        """Close the connection, if this buffer made it (the bin stays on the server)."""
        if self._owned:
            self.client.close()

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
