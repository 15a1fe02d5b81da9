"""The client ops of replay bins, mixed into every client face (see
:class:`tensorshare.rl.ReplayBuffer`, which is built on them).

A replay bin is a table of prioritized experience replay on the server. The ops, each
written once: :meth:`ReplayOps.replay_open` (create, or check the configuration),
:meth:`~ReplayOps.replay_insert` (items with priorities -> their keys),
:meth:`~ReplayOps.replay_sample` (a :class:`Sample`), :meth:`~ReplayOps.replay_update`
(priorities by key) and :meth:`~ReplayOps.replay_info` (size, total weight, statistics).
The sharded client spreads a replay bin over its servers (:class:`ShardedReplayOps`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..wire.codec import decode, decode_stacked
from ..wire.protocol import check_bin_name
from ..wire.replay import (
    CONFIG_FIELDS,
    MAX_REPLAY_BATCH,
    ReplayInfo,
    ReplayInsert,
    ReplayOpen,
    ReplaySample,
    ReplayUpdate,
)
from .command import BLOCK_SHARE, Command, FaceNeeds, gc_paused

__all__ = ["REPLAY_REQUESTS", "ReplayInfoResult", "ReplayOpenResult", "ReplayOps", "Sample",
           "ShardedReplayOps", "stack_items"]

#: The requests of the replay ops (a sharded client serves them itself, across its servers).
REPLAY_REQUESTS = frozenset({ReplayOpen, ReplayInsert, ReplaySample, ReplayUpdate, ReplayInfo})


@dataclass(frozen=True, slots=True)
class ReplayOpenResult:
    """What :meth:`ReplayOps.replay_open` returns: whether it created the bin, its size, and
    its configuration as the server holds it (a ``seed`` the server chose included)."""

    created: bool
    size: int
    config: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ReplayInfoResult:
    """What :meth:`ReplayOps.replay_info` returns: the bin's size, its total weight (the sum
    of ``priority ** priority_exponent``; the size for the other samplers) and its
    statistics (counts, rates, the rate limiter's state, the priority histogram)."""

    size: int
    total: float
    stats: dict[str, Any]


@dataclass(slots=True, eq=False)
class Sample:
    """A sample of a replay bin: ``items`` (like tensors stacked along a new first
    dimension, dicts of like tensors stacked key by key, anything else a list), ``keys``
    (an int64 tensor), ``probabilities`` (a float64 tensor: each draw's probability when it
    was drawn) and ``size`` (the bin's size when it was drawn: what importance weights
    need); unpacks as that 4-tuple. ``total``: the bin's total weight after the draw (the
    sum of ``priority ** priority_exponent``, or the size for the other samplers: what a
    sharded sample weighs the bin by)."""

    items: Any
    keys: Any
    probabilities: Any
    size: int
    total: float = 0.0

    def __iter__(self) -> Any:
        return iter((self.items, self.keys, self.probabilities, self.size))

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        return f"Sample({len(self.keys)} items, size={self.size})"


def _like(values: Sequence[Any], torch: Any) -> bool:
    first = values[0]
    return type(first) is torch.Tensor and all(
        type(v) is torch.Tensor and v.shape == first.shape and v.dtype == first.dtype
        and v.device == first.device for v in values)


def stack_items(values: Sequence[Any]) -> Any:
    """``values`` as a :class:`Sample`'s ``items``: like tensors stacked along a new first
    dimension, dicts (of the same keys) of like tensors stacked key by key, anything else
    the list itself."""
    import torch

    values = list(values)
    if not values:
        return values
    if _like(values, torch):
        return torch.stack(values)
    first = values[0]
    if isinstance(first, dict) and all(isinstance(v, dict) and v.keys() == first.keys()
                                       for v in values):
        columns = {k: [v[k] for v in values] for k in first}
        if all(_like(col, torch) for col in columns.values()):
            return {k: torch.stack(col) for k, col in columns.items()}
    return values


class _DecodeSample:
    __slots__ = ("max_depth",)

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth

    def __call__(self, reply: Any) -> Sample:
        import torch

        items = reply.items
        stacked = decode_stacked([it.value for it in items], max_depth=self.max_depth)
        if stacked is None:  # (not like tensors, or maps of them: one by one)
            with gc_paused(len(items)):
                stacked = stack_items([decode(it.value, max_depth=self.max_depth)
                                       for it in items])
        return Sample(stacked, torch.tensor(reply.keys, dtype=torch.int64),
                      torch.tensor(reply.probabilities, dtype=torch.float64), reply.size,
                      reply.total)


def _numbers(values: Any, what: str) -> list[float]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    if isinstance(values, (int, float)) and not isinstance(values, bool):
        values = [values]
    out = [float(v) for v in values]
    if not all(math.isfinite(v) and v >= 0 for v in out):
        raise ValueError(f"{what} must be finite numbers >= 0")
    return out


def _keys(keys: Any) -> list[int]:
    if hasattr(keys, "tolist"):
        keys = keys.tolist()
    if isinstance(keys, int) and not isinstance(keys, bool):
        keys = [keys]
    return [int(k) for k in keys]


def _batch(n: Any, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_REPLAY_BATCH:
        raise ValueError(f"{what} must be an int from 1 to {MAX_REPLAY_BATCH}, not {n!r}")
    return n


class ReplayOps(FaceNeeds):
    """Replay ops for :class:`~.ops.Ops` (see :class:`tensorshare.rl.ReplayBuffer`)."""

    #: A pipeline's client, which encodes its items (``None``: this face encodes its own).
    _host: Any = None

    def _replay_wait(self, timeout: float | None) -> float:
        """How long the server may keep a request waiting: ``timeout``, at most 80% of the
        client's (so that the server's answer comes before the client gives up)."""
        most = BLOCK_SHARE * self.timeout
        if timeout is None:
            return most
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
                not 0 <= timeout < math.inf:
            raise ValueError(f"timeout must be a finite number >= 0, not {timeout!r}")
        return min(float(timeout), most)

    def replay_open(self, name: str, *, max_size: int, sampler: str = "prioritized",
                    priority_exponent: float = 0.6, remover: str = "fifo",
                    max_times_sampled: int | None = None,
                    samples_per_insert: float | None = None, min_size_to_sample: int = 1,
                    error_buffer: float | tuple[float, float] | None = None,
                    seed: int | None = None, create: bool = True) -> Any:
        """Create replay bin ``name`` with this configuration, or check that the bin has it
        (a ``seed`` of ``None`` matches any); see :class:`tensorshare.rl.ReplayBuffer` for
        each option. ``create=False``: only check (``BinNotFound`` if there is none).

        Returns:
            A :class:`ReplayOpenResult`.

        Raises:
            InvalidRequest: an option out of range, the bin exists with another
                configuration, or the name is a bin of another kind.
        """
        check_bin_name(name, self.limits.max_name_bytes)
        values = (max_size, sampler, priority_exponent, remover, max_times_sampled,
                  samples_per_insert, min_size_to_sample, error_buffer, seed)
        config: dict[str, Any] = dict(zip(CONFIG_FIELDS, values, strict=True))
        if isinstance(error_buffer, tuple):
            config["error_buffer"] = list(error_buffer)
        for key in ("priority_exponent", "samples_per_insert"):
            if isinstance(config[key], int) and not isinstance(config[key], bool):
                config[key] = float(config[key])
        request: Any = ReplayOpen(0, name, config, bool(create))
        return self._execute(Command(request,
                                     f"replay_open of replay bin {name!r}",
                                     lambda r: ReplayOpenResult(r.created, r.size, r.config)))

    def replay_insert(self, name: str, values: Sequence[Any], priorities: Any, *,
                      timeout: float | None = None) -> Any:
        """Insert ``values`` into replay bin ``name``, one priority each (finite, >= 0), as
        one request: all of them or none.

        Args:
            timeout: seconds the insert may wait for the rate limiter (default and most: 80%
                of the client's timeout); ``0``: do not wait.

        Returns:
            The items' keys (a list of ints), in order.

        Raises:
            WaitTimeout: the rate limiter held the insert for ``timeout`` (nothing inserted).
            BinNotFound: there is no such replay bin (``replay_open`` creates it).
        """
        check_bin_name(name, self.limits.max_name_bytes)
        values = list(values)
        _batch(len(values), "the number of items")
        prios = _numbers(priorities, "priorities")
        if len(prios) != len(values):
            raise ValueError(f"{len(values)} items but {len(prios)} priorities")
        host: Any = self._host or self  # a pipeline encodes as its client
        items = host._items(name, values, [None] * len(values))
        request: Any = ReplayInsert(0, name, items[0], tuple(items[1:]), tuple(prios),
                                    self._replay_wait(timeout))
        return self._execute(Command(request, f"replay_insert into replay bin {name!r}",
                                     lambda r: list(r.keys)))

    def replay_sample(self, name: str, batch_size: int, *,
                      timeout: float | None = None) -> Any:
        """Draw ``batch_size`` items from replay bin ``name`` (independently, with
        replacement, by its sampler).

        Args:
            timeout: seconds the sample may wait while the bin is empty or the rate limiter
                holds it (default and most: 80% of the client's timeout); ``0``: do not wait.

        Returns:
            A :class:`Sample`.

        Raises:
            WaitTimeout: nothing could be drawn within ``timeout`` (nothing was drawn).
        """
        check_bin_name(name, self.limits.max_name_bytes)
        request: Any = ReplaySample(0, name, _batch(batch_size, "batch_size"),
                                    self._replay_wait(timeout))
        return self._execute(Command(request, f"replay_sample of replay bin {name!r}",
                                     _DecodeSample(self.limits.max_depth)))

    def replay_update(self, name: str, keys: Any, priorities: Any) -> Any:
        """Set the priorities of the items ``keys`` of replay bin ``name`` (one request;
        keys of items no longer in the bin are skipped).

        Returns:
            How many items were updated.
        """
        check_bin_name(name, self.limits.max_name_bytes)
        keys = _keys(keys)
        prios = _numbers(priorities, "priorities")
        if len(keys) != len(prios) or len(keys) > MAX_REPLAY_BATCH:
            raise ValueError(f"{len(keys)} keys and {len(prios)} priorities: one priority "
                             f"per key, at most {MAX_REPLAY_BATCH}")
        request: Any = ReplayUpdate(0, name, tuple(keys), tuple(prios))
        return self._execute(Command(request,
                                     f"replay_update of replay bin {name!r}",
                                     lambda r: r.updated))

    def replay_info(self, name: str) -> Any:
        """The size, total weight and statistics of replay bin ``name``
        (a :class:`ReplayInfoResult`)."""
        check_bin_name(name, self.limits.max_name_bytes)
        request: Any = ReplayInfo(0, name)
        return self._execute(Command(request, f"replay_info of replay bin {name!r}",
                                     lambda r: ReplayInfoResult(r.size, r.total, r.stats)))


def _concat(parts: list[Any]) -> Any:
    """The items of several samples' ``items`` together, in order (as :func:`stack_items`
    would have made them of all the values)."""
    import torch

    if len(parts) == 1:
        return parts[0]
    if all(type(p) is torch.Tensor for p in parts) and \
            len({(p.shape[1:], p.dtype) for p in parts}) == 1:
        return torch.cat(parts)
    if all(isinstance(p, dict) for p in parts) and \
            all(p.keys() == parts[0].keys() for p in parts):
        return {k: _concat([p[k] for p in parts]) for k in parts[0]}
    out: list[Any] = []
    for p in parts:
        out.extend(_unstack(p))
    return out


def _unstack(items: Any) -> list[Any]:
    if isinstance(items, list):
        return items
    if isinstance(items, dict):
        n = len(next(iter(items.values())))
        return [{k: v[i] for k, v in items.items()} for i in range(n)]
    return list(items)


class ShardedReplayOps:
    """The replay ops of :class:`~.sharded.ShardedClient`: a replay bin on each server.

    An insert goes whole to one server (the servers in turn), a sample is drawn across the
    servers in proportion to their total weight (each server's sum of ``priority **
    priority_exponent``, or its size for the other samplers, as ``replay_info`` gives them
    just before), and its probabilities are the servers' scaled by that share, so that
    importance weights stay right; ``size`` is the sum of the servers'. A key names its
    server: ``key = server_key * n_servers + server_index``. ``seed`` seeds server ``i``'s
    bin with ``seed + i`` and the choice of servers with ``seed``.
    """

    servers: list[str]
    _replay_turn: int = 0
    _replay_rng: Any = None

    def _client(self, index: int) -> Any:
        raise NotImplementedError

    def replay_open(self, name: str, *, seed: int | None = None, **config: Any) -> Any:
        import random

        results = [self._client(i).replay_open(name, seed=None if seed is None else seed + i,
                                               **config) for i in range(len(self.servers))]
        self._replay_rng = random.Random(seed)
        first = results[0]
        merged = dict(first.config, seed=seed)
        return ReplayOpenResult(any(r.created for r in results),
                                sum(r.size for r in results), merged)

    def replay_insert(self, name: str, values: Sequence[Any], priorities: Any, *,
                      timeout: float | None = None) -> Any:
        n = len(self.servers)
        i = self._replay_turn % n
        self._replay_turn = i + 1
        keys = self._client(i).replay_insert(name, values, priorities, timeout=timeout)
        return [k * n + i for k in keys]

    def replay_info(self, name: str) -> Any:
        infos = [self._client(i).replay_info(name) for i in range(len(self.servers))]
        return ReplayInfoResult(sum(r.size for r in infos), sum(r.total for r in infos),
                                {"shards": {s: r.stats for s, r in zip(self.servers, infos,
                                                                       strict=True)}})

    def replay_update(self, name: str, keys: Any, priorities: Any) -> Any:
        n = len(self.servers)
        keys, prios = _keys(keys), _numbers(priorities, "priorities")
        if len(keys) != len(prios):
            raise ValueError(f"{len(keys)} keys but {len(prios)} priorities")
        by: dict[int, tuple[list[int], list[float]]] = {}
        for k, p in zip(keys, prios, strict=True):
            ks, ps = by.setdefault(k % n, ([], []))
            ks.append(k // n)
            ps.append(p)
        return sum(self._client(i).replay_update(name, ks, ps) for i, (ks, ps) in by.items())

    def _split(self, name: str, batch_size: int) -> tuple[list[int], list[float], int]:
        """How many draws each server gives (a multinomial of the servers' total weights),
        each server's weight, and the size of them all."""
        import random

        infos = [self._client(i).replay_info(name) for i in range(len(self.servers))]
        weights = [r.total for r in infos]
        if not any(w > 0 for w in weights):
            weights = [float(r.size) for r in infos]
        if not any(w > 0 for w in weights):
            weights = [1.0] * len(infos)  # all empty: wait on each alike
        rng = self._replay_rng or random.Random()
        self._replay_rng = rng
        counts = [0] * len(infos)
        for i in rng.choices(range(len(infos)), weights=weights, k=batch_size):
            counts[i] += 1
        return counts, weights, sum(r.size for r in infos)

    def replay_sample(self, name: str, batch_size: int, *,
                      timeout: float | None = None) -> Any:
        import torch

        _batch(batch_size, "batch_size")
        counts, weights, size = self._split(name, batch_size)
        total = sum(weights)
        n = len(self.servers)
        parts, keys, probs = [], [], []
        for i, count in enumerate(counts):
            if count:
                s = self._client(i).replay_sample(name, count, timeout=timeout)
                parts.append(s.items)
                keys.append(s.keys * n + i)
                probs.append(s.probabilities * (weights[i] / total))
        return Sample(_concat(parts), torch.cat(keys), torch.cat(probs), size, total)
