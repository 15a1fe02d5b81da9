"""Replay tables: the data structure under a replay bin (prioritized experience replay).

A :class:`ReplayTable` holds *items*, each with a key the table assigns (int64, unique,
increasing: 1, 2, 3, ... never reused, not even after :meth:`~ReplayTable.reset`), an opaque
payload (the server keeps an encoded item there; the table never looks inside, it is told
the payload's byte size), a priority (a finite float >= 0), how many times it was sampled,
and its place in insertion order (its key). As in DeepMind's Reverb, a table has:

* a **sampler**: ``uniform``, ``prioritized`` (item i with probability
  ``p_i ** priority_exponent / sum_j p_j ** priority_exponent``, on a :class:`SumTree`: a
  draw and a priority update each cost O(log n)), ``fifo`` (the oldest item), ``lifo`` (the
  newest), ``max_priority`` (the highest priority; ties go to the item least recently
  inserted or updated, as Reverb's heap does);
* a **remover** for ``max_size``: after an item is inserted into a full table the remover's
  choice among *all* items, the new one included, is removed (Reverb's order): ``fifo`` (the
  oldest), ``lifo`` (the newest: a full table keeps its items and drops each new one at
  once), ``min_priority`` (the lowest priority, ties as above: the table keeps the
  ``max_size`` highest priorities);
* ``max_times_sampled``: an item is removed by its k-th sample (``None``: never);
* a **rate limiter**, :class:`RateLimiter`: Reverb's ``SampleToInsertRatio``
  (``samples_per_insert``, ``min_size_to_sample``, ``error_buffer``) or, without
  ``samples_per_insert``, its ``MinSize``.

A sample of ``batch_size`` draws its items independently, with replacement, as Reverb does,
except that an item with ``max_times_sampled`` is never given more times than it has left,
within one batch too (an item removed by a draw cannot be drawn again). Each draw reports the
item's key, its payload (valid even when that draw removed the item), its probability at the
time of the draw (``prioritized``: ``p_i ** alpha / sum``, or ``1 / size`` while every
priority is zero, as Reverb does; ``uniform``: ``1 / size``; ``fifo``, ``lifo`` and
``max_priority`` choose deterministically: ``1.0``, as Reverb reports) and the table's size
when it was drawn (before that draw's removal, if any).

**Requests are whole.** An insert of k items and a sample of a batch of n each proceed
entirely or wait entirely (a request is one message of one client: applying half of it and
then timing out would lose or double what was applied). Reverb takes its requests one item
at a time; the rules below are Reverb's generalised to a whole request, the same as Reverb's
for k = n = 1:

* an insert of k may proceed while the table holds fewer than ``min_size_to_sample`` items
  (Reverb's "stage 1", where inserts are free), or when
  ``(inserts + k) * samples_per_insert - samples <= max_diff``;
* a sample of n may proceed when the table holds at least ``min_size_to_sample`` items,
  ``inserts * samples_per_insert - samples - n >= min_diff``, and (with
  ``max_times_sampled``) its items have at least n samples left between them.

**No deadlock.** Let ``W = max_diff - min_diff`` (``2 * error_buffer``). :meth:`~ReplayTable.
check_sample` refuses a batch with ``n > W / 2`` and :meth:`~ReplayTable.check_insert` an
insert with ``k * samples_per_insert > W / 2`` (``InvalidRequest``; with the usual scalar
``error_buffer``: a batch may be at most ``error_buffer``, an insert at most
``error_buffer / samples_per_insert`` items). Then a waiting sample and a waiting insert can
never both be held by the ratio (that needs ``W < n + k * samples_per_insert``). A sample held
by the table's content instead (too few items, or too few samples left under
``max_times_sampled``) lets inserts through: the server passes the smallest waiting batch as
``can_insert(k, sample_waiting=n)``, the way Reverb lets inserts through below
``min_size_to_sample``. So whenever a sample and an insert both wait, one of them can proceed.

The table is a pure data structure: no I/O, no threads, no clock; its randomness is a
``random.Random`` seeded by the configuration's ``seed``, so that a table's samples are
reproducible, and :meth:`~ReplayTable.state` / :meth:`~ReplayTable.from_state` carry it, the
items' keys, priorities and counts, and the limiter's counters as plain data (payloads are the
caller's to keep). The server kind over it (requests that wait, timeouts, the data log) is
built on top; it asks again after every insert, sample, removal, and newly waiting request.
"""

from __future__ import annotations

import math
import random
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from ..errors import InvalidRequest

__all__ = ["HISTOGRAM_EDGES", "MAX_BATCH", "MAX_WEIGHT", "REMOVERS", "SAMPLERS",
           "STATE_VERSION", "Drawn", "ExtremeTree", "RateLimiter", "ReplayConfig",
           "ReplayItem", "ReplayTable", "SumTree", "histogram_bucket"]

#: The sampler names, and the remover names (``max_size``).
SAMPLERS = ("uniform", "prioritized", "fifo", "lifo", "max_priority")
REMOVERS = ("fifo", "lifo", "min_priority")
#: The most items one insert or one sample may carry.
MAX_BATCH = 1 << 16
#: The largest ``priority ** priority_exponent`` accepted (so that no sum overflows).
MAX_WEIGHT = 1e280
#: Lower bounds of the priority histogram's buckets (the last bucket is open above): bucket
#: 0 holds priorities below 1e-6 (zero included), bucket i those in [EDGES[i], EDGES[i+1]).
HISTOGRAM_EDGES = (0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6)
#: The layout version of :meth:`ReplayTable.state`.
STATE_VERSION = 1
#: Keys, counts and byte sizes are int64.
_INT64 = 1 << 63
#: The first capacity of the trees (they double as the table grows).
_FIRST_CAPACITY = 1024

# Sampler and remover codes (ints, so that the hot path branches without strings).
_UNIFORM, _PRIORITIZED, _FIFO, _LIFO, _MAX_PRIORITY, _MIN_PRIORITY = range(6)
_SAMPLER_CODES = {"uniform": _UNIFORM, "prioritized": _PRIORITIZED, "fifo": _FIFO,
                  "lifo": _LIFO, "max_priority": _MAX_PRIORITY}
_REMOVER_CODES = {"fifo": _FIFO, "lifo": _LIFO, "min_priority": _MIN_PRIORITY}


def histogram_bucket(priority: float) -> int:
    """The bucket of :data:`HISTOGRAM_EDGES` that ``priority`` (>= 0) falls in."""
    if priority < 1e-6:
        return 0
    last = len(HISTOGRAM_EDGES) - 1
    i = min(max(math.floor(math.log10(priority)) + 7, 1), last)
    if i < last and priority >= HISTOGRAM_EDGES[i + 1]:
        i += 1
    elif priority < HISTOGRAM_EDGES[i]:
        i -= 1
    return i


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_count(value: object) -> bool:
    """An int in [0, 2**63): what a key, a count or a byte size may be."""
    return _is_int(value) and 0 <= value < _INT64


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_priority(priority: object, exponent: float) -> tuple[float, float]:
    """``(priority, priority ** exponent)`` as floats, or ``InvalidRequest``."""
    if not _is_number(priority):
        raise InvalidRequest(f"a priority must be a number, not {type(priority).__name__}")
    p = float(priority)
    if not math.isfinite(p) or p < 0.0:
        raise InvalidRequest(f"a priority must be finite and not negative, not {p!r}")
    if p == 0.0:
        return 0.0, 0.0  # zero priority, zero probability, even with exponent 0 (as Reverb)
    try:
        weight = p ** exponent
    except OverflowError:
        weight = math.inf
    if not weight <= MAX_WEIGHT:
        raise InvalidRequest(f"priority {p!r} ** priority_exponent {exponent!r} is over "
                             f"{MAX_WEIGHT:g}")
    return p, weight


# ----------------------------------------------------------------------------------------
# Trees over slots 0..size-1 (the table keeps its items dense: a removed item's slot takes
# the last item). Leaves at [capacity, 2 * capacity) of one flat array, node i's children at
# 2i and 2i + 1, the root at 1. Every inner node is recomputed from its children, never
# adjusted by a difference, so no rounding error builds up and a tree is a function of its
# leaves alone (the same leaves give the same tree, bit for bit, whatever the history).
# ----------------------------------------------------------------------------------------


def _capacity_for(size: int) -> int:
    capacity = 1
    while capacity < size:
        capacity *= 2
    return capacity


class SumTree:
    """Sums of non-negative weights over slots: set a weight and find the slot that holds a
    point of the cumulative sum, each in O(log capacity)."""

    __slots__ = ("capacity", "nodes")

    def __init__(self, capacity: int = 1) -> None:
        self.capacity = _capacity_for(capacity)
        self.nodes = array("d", bytes(16 * self.capacity))

    def total(self) -> float:
        """The sum of every weight."""
        return self.nodes[1]  # the root (the only leaf when capacity is 1)

    def value(self, slot: int) -> float:
        """The weight at ``slot``."""
        return self.nodes[self.capacity + slot]

    def set(self, slot: int, weight: float) -> None:
        """Set the weight at ``slot`` (0 clears it)."""
        nodes = self.nodes
        i = self.capacity + slot
        nodes[i] = weight
        while i > 1:
            nodes[i >> 1] = nodes[i] + nodes[i ^ 1]  # (a + b == b + a, exactly)
            i >>= 1

    def find(self, target: float) -> int:
        """The slot where the cumulative sum passes ``target`` (0 <= target < total() > 0).

        Never a slot of weight zero: at each node it goes right only into a subtree of
        positive sum, so rounding (``target`` at or past a sum) cannot land it on an empty
        slot."""
        nodes = self.nodes
        capacity = self.capacity
        i = 1
        while i < capacity:
            i <<= 1  # the left child
            left = nodes[i]
            if target >= left and nodes[i + 1] > 0.0:
                target -= left
                i += 1
        return i - capacity

    def grow(self, capacity: int) -> None:
        """Make room for ``capacity`` slots (weights kept; O(new capacity))."""
        capacity = _capacity_for(capacity)
        if capacity <= self.capacity:
            return
        old = self.nodes
        old_capacity = self.capacity
        nodes = array("d", bytes(16 * capacity))
        nodes[capacity:capacity + old_capacity] = old[old_capacity:2 * old_capacity]
        for i in range(capacity - 1, 0, -1):
            nodes[i] = nodes[2 * i] + nodes[2 * i + 1]
        self.nodes = nodes
        self.capacity = capacity


class ExtremeTree:
    """The slot of the highest (``highest=True``) or lowest priority, ties going to the
    smallest sequence number (the item least recently inserted or updated): a tournament
    tree whose nodes hold the winning slot (-1: none), O(log capacity) per change, O(1) to
    read the winner."""

    __slots__ = ("capacity", "highest", "priorities", "seqs", "winners")

    def __init__(self, highest: bool, capacity: int = 1) -> None:
        self.highest = highest
        self.capacity = _capacity_for(capacity)
        self.priorities = array("d", bytes(8 * self.capacity))
        self.seqs = array("q", bytes(8 * self.capacity))
        self.winners = array("q", [-1]) * (2 * self.capacity)

    def top(self) -> int:
        """The winning slot, or -1 when every slot is empty."""
        return self.winners[1]

    def _beats(self, a: int, b: int) -> bool:
        pa = self.priorities[a]
        pb = self.priorities[b]
        if pa != pb:
            return (pa > pb) == self.highest
        return self.seqs[a] < self.seqs[b]

    def _winner(self, a: int, b: int) -> int:
        if a < 0:
            return b
        if b < 0 or self._beats(a, b):
            return a
        return b

    def _climb(self, i: int) -> None:
        winners = self.winners
        i >>= 1
        while i > 0:
            winners[i] = self._winner(winners[2 * i], winners[2 * i + 1])
            i >>= 1

    def set(self, slot: int, priority: float, seq: int) -> None:
        """Put ``priority`` with sequence number ``seq`` at ``slot``."""
        self.priorities[slot] = priority
        self.seqs[slot] = seq
        i = self.capacity + slot
        self.winners[i] = slot
        self._climb(i)

    def clear(self, slot: int) -> None:
        """Empty ``slot``."""
        i = self.capacity + slot
        self.winners[i] = -1
        self._climb(i)

    def grow(self, capacity: int) -> None:
        """Make room for ``capacity`` slots (entries kept; O(new capacity))."""
        capacity = _capacity_for(capacity)
        if capacity <= self.capacity:
            return
        old = self.capacity
        priorities = array("d", bytes(8 * capacity))
        seqs = array("q", bytes(8 * capacity))
        winners = array("q", [-1]) * (2 * capacity)
        priorities[:old] = self.priorities[:old]
        seqs[:old] = self.seqs[:old]
        winners[capacity:capacity + old] = self.winners[old:2 * old]
        self.priorities = priorities
        self.seqs = seqs
        self.winners = winners
        self.capacity = capacity
        for i in range(capacity - 1, 0, -1):
            winners[i] = self._winner(winners[2 * i], winners[2 * i + 1])


# ----------------------------------------------------------------------------------------
# The rate limiter and the configuration
# ----------------------------------------------------------------------------------------


class RateLimiter:
    """Reverb's rate limiter: ``SampleToInsertRatio`` where ``samples_per_insert`` is set,
    else ``MinSize`` (ratio 1.0 with unbounded diffs, as Reverb builds it).

    It counts inserts, samples (one per drawn item) and deletes (every removal: by the
    remover, by ``max_times_sampled``, by ``delete``); ``inserts - deletes`` is the table's
    size. The *diff* is ``inserts * samples_per_insert - samples``; requests are whole (see
    the module's doc): :meth:`can_insert` and :meth:`can_sample` answer for k items at once.
    """

    __slots__ = ("deletes", "inserts", "max_diff", "min_diff", "min_size_to_sample",
                 "ratio", "samples", "samples_per_insert")

    def __init__(self, samples_per_insert: float | None, min_size_to_sample: int,
                 min_diff: float = -math.inf, max_diff: float = math.inf) -> None:
        self.ratio = samples_per_insert is not None
        self.samples_per_insert = 1.0 if samples_per_insert is None else samples_per_insert
        self.min_size_to_sample = min_size_to_sample
        self.min_diff = min_diff if self.ratio else -math.inf
        self.max_diff = max_diff if self.ratio else math.inf
        self.inserts = 0
        self.samples = 0
        self.deletes = 0

    def diff(self) -> float:
        """``inserts * samples_per_insert - samples``."""
        return self.inserts * self.samples_per_insert - self.samples

    def can_insert(self, count: int) -> bool:
        """Whether an insert of ``count`` items may proceed now."""
        if self.inserts - self.deletes < self.min_size_to_sample:
            return True  # stage 1: the table cannot be sampled yet, inserts are free
        return (self.inserts + count) * self.samples_per_insert - self.samples <= self.max_diff

    def can_sample(self, count: int) -> bool:
        """Whether a sample of ``count`` draws may proceed now (as far as the ratio and the
        size go; the table also checks that its items have ``count`` draws left)."""
        if self.inserts - self.deletes < self.min_size_to_sample:
            return False
        return self.inserts * self.samples_per_insert - self.samples - count >= self.min_diff

    def max_sample(self) -> float:
        """The largest batch a sample may ask for: half the window (inf for ``MinSize``)."""
        return (self.max_diff - self.min_diff) / 2.0

    def max_insert(self) -> float:
        """The most items one insert may carry: half the window in inserts."""
        return self.max_sample() / self.samples_per_insert

    def reset(self) -> None:
        """Forget every count (Reverb's reset)."""
        self.inserts = 0
        self.samples = 0
        self.deletes = 0

    def info(self) -> dict[str, Any]:
        """The limiter's state as plain data (``None`` for a ``MinSize``'s unbounded diff)."""
        return {
            "kind": "sample_to_insert_ratio" if self.ratio else "min_size",
            "samples_per_insert": self.samples_per_insert if self.ratio else None,
            "min_size_to_sample": self.min_size_to_sample,
            "min_diff": self.min_diff if self.ratio else None,
            "max_diff": self.max_diff if self.ratio else None,
            "diff": self.diff() if self.ratio else None,
            "inserts": self.inserts,
            "samples": self.samples,
            "deletes": self.deletes,
        }


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    """A replay table's configuration; invalid values raise ``InvalidRequest``.

    ``error_buffer`` (with ``samples_per_insert`` only) is Reverb's: a number e puts the
    diff's bounds at ``samples_per_insert * min_size_to_sample -/+ e``, a pair is
    ``(min_diff, max_diff)`` as it is. Left out, it is
    ``max(samples_per_insert * min_size_to_sample, max(1.0, samples_per_insert))``: the
    learner never samples more than ``samples_per_insert`` times what was inserted (the
    lower bound is 0), actors run up to ``min_size_to_sample`` items ahead. Reverb's rules
    hold: the window is at least ``2 * max(1.0, samples_per_insert)`` wide, and its lower
    bound is not above ``samples_per_insert * min_size_to_sample`` (it would deadlock once
    ``min_size_to_sample`` items are in)."""

    max_size: int
    sampler: str = "prioritized"
    priority_exponent: float = 0.6
    remover: str = "fifo"
    max_times_sampled: int | None = None
    samples_per_insert: float | None = None
    min_size_to_sample: int = 1
    error_buffer: float | tuple[float, float] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        _check_shape(self)
        _check_limiter(self)

    def diff_bounds(self) -> tuple[float, float]:
        """``(min_diff, max_diff)`` of the rate limiter (infinite without a ratio)."""
        spi = self.samples_per_insert
        if spi is None:
            return -math.inf, math.inf
        buffer = self.error_buffer
        if buffer is None:
            buffer = max(spi * self.min_size_to_sample, max(1.0, spi))
        if isinstance(buffer, tuple):
            return float(buffer[0]), float(buffer[1])
        offset = spi * self.min_size_to_sample
        return offset - buffer, offset + buffer

    def limiter(self) -> RateLimiter:
        """A fresh rate limiter of this configuration."""
        min_diff, max_diff = self.diff_bounds()
        return RateLimiter(self.samples_per_insert, self.min_size_to_sample, min_diff, max_diff)

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain data (a pair ``error_buffer`` as a list)."""
        buffer = self.error_buffer
        return {
            "max_size": self.max_size, "sampler": self.sampler,
            "priority_exponent": self.priority_exponent, "remover": self.remover,
            "max_times_sampled": self.max_times_sampled,
            "samples_per_insert": self.samples_per_insert,
            "min_size_to_sample": self.min_size_to_sample,
            "error_buffer": list(buffer) if isinstance(buffer, tuple) else buffer,
            "seed": self.seed,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReplayConfig:
        """The configuration :meth:`to_dict` gave (unknown fields are an error)."""
        if not isinstance(data, Mapping):
            raise InvalidRequest("a replay configuration must be a mapping")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise InvalidRequest(f"unknown replay options: {', '.join(sorted(map(str, unknown)))}")
        fields = dict(data)
        if isinstance(fields.get("error_buffer"), list):
            fields["error_buffer"] = tuple(fields["error_buffer"])
        try:
            return cls(**fields)
        except TypeError as exc:  # a required field left out
            raise InvalidRequest(f"replay configuration: {exc}") from None


def _check_shape(config: ReplayConfig) -> None:
    """The table's own options (not the limiter's)."""
    if not _is_int(config.max_size) or config.max_size < 1:
        raise InvalidRequest(f"max_size must be an int >= 1, not {config.max_size!r}")
    if config.sampler not in _SAMPLER_CODES:
        raise InvalidRequest(f"sampler must be one of {', '.join(SAMPLERS)}, "
                             f"not {config.sampler!r}")
    if config.remover not in _REMOVER_CODES:
        raise InvalidRequest(f"remover must be one of {', '.join(REMOVERS)}, "
                             f"not {config.remover!r}")
    alpha = config.priority_exponent
    if not _is_number(alpha) or not math.isfinite(alpha) or alpha < 0:
        raise InvalidRequest(f"priority_exponent must be a finite number >= 0, not {alpha!r}")
    times = config.max_times_sampled
    if times is not None and (not _is_int(times) or times < 1):
        raise InvalidRequest(f"max_times_sampled must be None or an int >= 1, not {times!r}")
    if config.seed is not None and not _is_int(config.seed):
        raise InvalidRequest(f"seed must be None or an int, not {config.seed!r}")


def _check_limiter(config: ReplayConfig) -> None:
    """Reverb's rules for ``SampleToInsertRatio`` and ``MinSize``, and ours on top."""
    size = config.min_size_to_sample
    if not _is_int(size) or size < 1:
        raise InvalidRequest(f"min_size_to_sample must be an int >= 1, not {size!r}")
    if size > config.max_size:
        raise InvalidRequest(f"min_size_to_sample {size} is over max_size {config.max_size}: "
                             "the table could never be sampled")
    spi = config.samples_per_insert
    buffer = config.error_buffer
    if spi is None:
        if buffer is not None:
            raise InvalidRequest("error_buffer needs samples_per_insert")
        return
    if not _is_number(spi) or not math.isfinite(spi) or spi <= 0:
        raise InvalidRequest(f"samples_per_insert must be a finite number > 0, not {spi!r}")
    if isinstance(buffer, tuple):
        if len(buffer) != 2 or not all(_is_number(b) and math.isfinite(b) for b in buffer):
            raise InvalidRequest("an error_buffer pair must be two finite numbers "
                                 "(min_diff, max_diff)")
    elif buffer is not None and (not _is_number(buffer) or not math.isfinite(buffer)
                                 or buffer < 0):
        raise InvalidRequest(f"error_buffer must be a finite number >= 0 or a pair, "
                             f"not {buffer!r}")
    min_diff, max_diff = config.diff_bounds()
    if max_diff - min_diff < 2 * max(1.0, spi):
        raise InvalidRequest(
            f"the error_buffer window [{min_diff:g}, {max_diff:g}] must be at least "
            f"2 * max(1.0, samples_per_insert) = {2 * max(1.0, spi):g} wide: a narrower one "
            "could block inserts or samples for good")
    if min_diff > spi * size:
        raise InvalidRequest(
            f"the error_buffer window's lower bound {min_diff:g} is above samples_per_insert "
            f"* min_size_to_sample = {spi * size:g}: sampling would deadlock as soon as "
            "min_size_to_sample items are in")


# ----------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------


class ReplayItem:
    """One item of a table (read its fields; the table changes them)."""

    __slots__ = ("key", "nbytes", "payload", "priority", "seq", "slot", "times_sampled")

    def __init__(self, key: int, payload: Any, nbytes: int, priority: float, slot: int,
                 seq: int, times_sampled: int = 0) -> None:
        self.key = key
        self.payload = payload
        self.nbytes = nbytes
        self.priority = priority
        self.slot = slot  # its place in the dense slots (and the trees' leaves)
        self.seq = seq  # when it was inserted or its priority last set (ties of the heaps)
        self.times_sampled = times_sampled


@dataclass(frozen=True, slots=True)
class Drawn:
    """What a sample drew, one entry per draw, in the order drawn: the item's key, its
    payload, its probability when drawn, and the table's size when drawn; ``removed`` counts
    the items that their last allowed sample removed (their payloads are here all the
    same)."""

    keys: list[int]
    payloads: list[Any]
    probabilities: list[float]
    sizes: list[int]
    removed: int


class ReplayTable:
    """The items, sampler, remover and rate limiter of one replay bin (see the module)."""

    __slots__ = ("_alpha", "_capacity", "_deleted", "_draws_left", "_evicted", "_expired",
                 "_high", "_hist", "_inserted", "_items", "_low", "_max_size", "_max_times",
                 "_nbytes", "_next_key", "_remover", "_rng", "_sampled", "_sampler", "_seq",
                 "_slots", "_sum", "config", "limiter", "released")

    def __init__(self, config: ReplayConfig) -> None:
        self.config = config
        self.limiter = config.limiter()
        #: A list the caller drains, or None: the payloads of items removed (evicted,
        #: sampled their last time, deleted), so that it can release what they held.
        self.released: list[Any] | None = None
        self._sampler = _SAMPLER_CODES[config.sampler]
        self._remover = _REMOVER_CODES[config.remover]
        self._alpha = float(config.priority_exponent)
        self._max_size = config.max_size
        self._max_times = config.max_times_sampled or 0  # 0: unlimited
        self._rng = random.Random(config.seed)
        self._next_key = 1
        self._seq = 0
        self._inserted = 0
        self._sampled = 0
        self._evicted = 0
        self._expired = 0
        self._deleted = 0
        self._clear()

    def _clear(self) -> None:
        self._items: OrderedDict[int, ReplayItem] = OrderedDict()  # by key: insertion order
        self._slots: list[ReplayItem] = []
        self._capacity = _FIRST_CAPACITY
        prioritized = self._sampler == _PRIORITIZED
        self._sum = SumTree(self._capacity) if prioritized else None
        highest = self._sampler == _MAX_PRIORITY
        self._high = ExtremeTree(True, self._capacity) if highest else None
        lowest = self._remover == _MIN_PRIORITY
        self._low = ExtremeTree(False, self._capacity) if lowest else None
        self._hist = [0] * len(HISTOGRAM_EDGES)
        self._nbytes = 0
        self._draws_left = 0

    # -- what is in it ------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    @property
    def nbytes(self) -> int:
        """The payloads' byte sizes, added up (as the inserts gave them)."""
        return self._nbytes

    @property
    def next_key(self) -> int:
        """The key the next inserted item gets."""
        return self._next_key

    def get(self, key: int) -> ReplayItem | None:
        """The item of ``key``, or None."""
        return self._items.get(key)

    def items(self) -> Iterator[ReplayItem]:
        """The items, oldest first."""
        return iter(self._items.values())

    def draws_left(self) -> float:
        """How many more samples the items can give (``inf`` without ``max_times_sampled``)."""
        return self._draws_left if self._max_times else math.inf

    def total_weight(self) -> float:
        """What a sharded sample weighs this table by: the sum of ``priority **
        priority_exponent`` for ``prioritized``, the size for the other samplers."""
        if self._sum is not None:
            return self._sum.total()
        return float(len(self._slots))

    # -- may a request proceed now? -----------------------------------------------------

    def check_insert(self, count: int) -> None:
        """``InvalidRequest`` if an insert of ``count`` items could never proceed."""
        _check_request(count, "an insert", self.limiter.max_insert(),
                       f"an insert of {count} items", "carry", " over samples_per_insert",
                       "insert fewer at a time or raise error_buffer")

    def check_sample(self, batch_size: int) -> None:
        """``InvalidRequest`` if a sample of ``batch_size`` could never proceed."""
        _check_request(batch_size, "a sample", self.limiter.max_sample(),
                       f"a sample of {batch_size}", "draw", "",
                       f"raise error_buffer to at least {batch_size} or sample smaller batches")
        if self._max_times and batch_size > self._max_size * self._max_times:
            raise InvalidRequest(
                f"a sample of {batch_size} is more than max_size * max_times_sampled = "
                f"{self._max_size * self._max_times}: the table could never give that many")

    def can_insert(self, count: int, sample_waiting: int = 0) -> bool:
        """Whether an insert of ``count`` items may proceed now. ``sample_waiting``: the
        smallest batch a waiting sample asks for (0: none); while the table's content holds
        that sample (too few items, or too few draws left), inserts go through."""
        if self.limiter.can_insert(count):
            return True
        return sample_waiting > 0 and self._starved(sample_waiting)

    def can_sample(self, batch_size: int) -> bool:
        """Whether a sample of ``batch_size`` may proceed now."""
        if self._max_times and self._draws_left < batch_size:
            return False
        return self.limiter.can_sample(batch_size) and len(self._slots) > 0

    def _starved(self, batch_size: int) -> bool:
        if len(self._slots) < self.limiter.min_size_to_sample:
            return True
        return self._max_times > 0 and self._draws_left < batch_size

    # -- the operations (the caller asked can_insert / can_sample first; they do not ask
    #    the limiter again, so that a data log's replay applies them as they were) --------

    def insert(self, payloads: Sequence[Any], priorities: Sequence[float],
               nbytes: Sequence[int]) -> list[int]:
        """Insert items (all or none: everything is checked first); their keys, in order.

        Each insert into a full table removes the remover's choice, which may be an item of
        this very insert (``lifo``, or ``min_priority`` with a low priority): its key is
        returned all the same, and it is gone."""
        count = len(payloads)
        _check_batch(count, "an insert")
        if len(priorities) != count or len(nbytes) != count:
            raise InvalidRequest(f"an insert of {count} items needs {count} priorities and "
                                 "byte sizes")
        checked = [_check_priority(p, self._alpha) for p in priorities]
        for size in nbytes:
            if not _is_count(size):
                raise InvalidRequest(f"an item's byte size must be an int64 >= 0, not {size!r}")
        keys = []
        for i in range(count):
            priority, weight = checked[i]
            key = self._next_key
            self._next_key = key + 1
            item = ReplayItem(key, payloads[i], nbytes[i], priority, len(self._slots), self._seq)
            self._seq += 1
            self._items[key] = item
            self._place(item, weight)
            self.limiter.inserts += 1
            keys.append(key)
            if len(self._slots) > self._max_size:
                self._remove(self._removers_choice())
                self._evicted += 1
        self._inserted += count
        return keys

    def sample(self, batch_size: int) -> Drawn:
        """Draw ``batch_size`` items (see the module); ``InvalidRequest`` if the table cannot
        give that many now (empty, or too few draws left)."""
        _check_batch(batch_size, "a sample")
        if not self._slots or (self._max_times and self._draws_left < batch_size):
            raise InvalidRequest(f"a sample of {batch_size} cannot be drawn now: the table "
                                 f"holds {len(self._slots)} items, {self.draws_left()} draws")
        keys: list[int] = []
        payloads: list[Any] = []
        probabilities: list[float] = []
        sizes: list[int] = []
        removed = 0
        max_times = self._max_times
        for _ in range(batch_size):
            sizes.append(len(self._slots))
            item = self._select(probabilities)
            item.times_sampled += 1
            keys.append(item.key)
            payloads.append(item.payload)
            if max_times:
                self._draws_left -= 1
                if item.times_sampled >= max_times:
                    self._remove(item)
                    removed += 1
        self.limiter.samples += batch_size
        self._sampled += batch_size
        self._expired += removed
        return Drawn(keys, payloads, probabilities, sizes, removed)

    def update_priorities(self, keys: Sequence[int], priorities: Sequence[float]) -> int:
        """Set the priorities of ``keys`` (all checked first; a key given twice takes its
        last priority); keys of items no longer here are skipped: how many were."""
        if len(keys) != len(priorities):
            raise InvalidRequest(f"{len(keys)} keys but {len(priorities)} priorities")
        if len(keys) > MAX_BATCH:
            raise InvalidRequest(f"at most {MAX_BATCH} priorities per update, not {len(keys)}")
        for key in keys:
            if not _is_int(key):
                raise InvalidRequest(f"a key must be an int, not {type(key).__name__}")
        checked = [_check_priority(p, self._alpha) for p in priorities]
        skipped = 0
        for i in range(len(keys)):
            item = self._items.get(keys[i])
            if item is None:
                skipped += 1
                continue
            priority, weight = checked[i]
            self._hist[histogram_bucket(item.priority)] -= 1
            self._hist[histogram_bucket(priority)] += 1
            item.priority = priority
            item.seq = self._seq
            self._seq += 1
            self._set_slot(item.slot, item, weight)
        return skipped

    def delete(self, keys: Iterable[int]) -> int:
        """Remove the items of ``keys``; how many were here (others are skipped)."""
        keys = list(keys)
        for key in keys:
            if not _is_int(key):
                raise InvalidRequest(f"a key must be an int, not {type(key).__name__}")
        deleted = 0
        for key in keys:
            item = self._items.get(key)
            if item is not None:
                self._remove(item)
                deleted += 1
        self._deleted += deleted
        return deleted

    def reset(self) -> None:
        """Remove every item and zero the limiter's counts (Reverb's reset); keys go on
        from where they were, so that no old key ever names a new item."""
        self._clear()
        self.limiter.reset()

    # -- the hot path's parts -----------------------------------------------------------

    def _select(self, probabilities: list[float]) -> ReplayItem:
        """The sampler's choice (its probability appended to ``probabilities``)."""
        code = self._sampler
        slots = self._slots
        if code == _PRIORITIZED and self._sum is not None:
            tree = self._sum
            total = tree.total()
            if total > 0.0:
                slot = tree.find(self._rng.random() * total)
                probabilities.append(tree.value(slot) / total)
                return slots[slot]
        if code == _PRIORITIZED or code == _UNIFORM:  # (prioritized: every priority is 0)
            size = len(slots)
            probabilities.append(1.0 / size)
            return slots[min(int(self._rng.random() * size), size - 1)]
        probabilities.append(1.0)
        if code == _FIFO:
            return next(iter(self._items.values()))
        if code == _LIFO:
            return next(reversed(self._items.values()))
        assert self._high is not None
        return slots[self._high.top()]

    def _removers_choice(self) -> ReplayItem:
        code = self._remover
        if code == _FIFO:
            return next(iter(self._items.values()))
        if code == _LIFO:
            return next(reversed(self._items.values()))
        assert self._low is not None
        return self._slots[self._low.top()]

    def _place(self, item: ReplayItem, weight: float) -> None:
        """Put ``item`` (already in ``_items``) in the next slot."""
        slot = len(self._slots)
        if slot >= self._capacity:
            self._grow(slot + 1)
        item.slot = slot
        self._slots.append(item)
        self._set_slot(slot, item, weight)
        self._hist[histogram_bucket(item.priority)] += 1
        self._nbytes += item.nbytes
        if self._max_times:
            self._draws_left += self._max_times - item.times_sampled

    def _set_slot(self, slot: int, item: ReplayItem, weight: float) -> None:
        if self._sum is not None:
            self._sum.set(slot, weight)
        if self._high is not None:
            self._high.set(slot, item.priority, item.seq)
        if self._low is not None:
            self._low.set(slot, item.priority, item.seq)

    def _remove(self, item: ReplayItem) -> None:
        """Take ``item`` out: the last slot's item moves into its slot."""
        del self._items[item.key]
        slots = self._slots
        last = slots.pop()
        end = len(slots)
        if last is not item:
            slot = item.slot
            slots[slot] = last
            last.slot = slot
            weight = self._sum.value(end) if self._sum is not None else 0.0
            self._set_slot(slot, last, weight)
        if self._sum is not None:
            self._sum.set(end, 0.0)
        if self._high is not None:
            self._high.clear(end)
        if self._low is not None:
            self._low.clear(end)
        self._hist[histogram_bucket(item.priority)] -= 1
        self._nbytes -= item.nbytes
        if self._max_times:
            self._draws_left -= self._max_times - item.times_sampled
        self.limiter.deletes += 1
        if self.released is not None:
            self.released.append(item.payload)

    def _grow(self, needed: int) -> None:
        capacity = max(_capacity_for(needed), 2 * self._capacity)
        for tree in (self._sum, self._high, self._low):
            if tree is not None:
                tree.grow(capacity)
        self._capacity = capacity

    # -- statistics and state -----------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Sizes, counts, the limiter's state and the priority histogram (O(buckets))."""
        limiter = self.limiter.info()
        limiter["inserts_blocked"] = not self.can_insert(1)
        limiter["samples_blocked"] = not self.can_sample(1)
        config = self.config
        return {
            "size": len(self._slots), "max_size": self._max_size, "nbytes": self._nbytes,
            "sampler": config.sampler, "remover": config.remover,
            "priority_exponent": config.priority_exponent,
            "max_times_sampled": config.max_times_sampled,
            "inserts": self._inserted, "samples": self._sampled,
            "evicted": self._evicted, "expired": self._expired, "deleted": self._deleted,
            "draws_left": self._draws_left if self._max_times else None,
            "limiter": limiter,
            "priority_histogram": {"edges": list(HISTOGRAM_EDGES), "counts": list(self._hist)},
        }

    def state(self) -> dict[str, Any]:
        """The table as plain data (ints, floats, strings, lists, dicts, None): what
        :meth:`from_state` needs, payloads aside. ``items`` lists ``[key, priority,
        times_sampled, nbytes, seq]`` in slot order (the order uniform draws index)."""
        version, internal, gauss = self._rng.getstate()
        return {
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "next_key": self._next_key,
            "seq": self._seq,
            "counters": {"inserts": self._inserted, "samples": self._sampled,
                         "evicted": self._evicted, "expired": self._expired,
                         "deleted": self._deleted},
            "limiter": {"inserts": self.limiter.inserts, "samples": self.limiter.samples,
                        "deletes": self.limiter.deletes},
            "rng": [version, list(internal), gauss],
            "items": [[item.key, item.priority, item.times_sampled, item.nbytes, item.seq]
                      for item in self._slots],
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any], payloads: Mapping[int, Any]) -> ReplayTable:
        """The table :meth:`state` described, its payloads looked up by key in ``payloads``:
        the same items, priorities, counts and randomness, so the same next samples.
        ``InvalidRequest`` if the state is not one :meth:`state` could have written."""
        try:
            return _restore(cls, state, payloads)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            if isinstance(exc, InvalidRequest):
                raise
            raise InvalidRequest(f"not a replay table's state: {exc!r}") from None


def _check_batch(count: object, what: str) -> None:
    if not _is_int(count) or not 1 <= count <= MAX_BATCH:
        raise InvalidRequest(f"{what} carries 1 to {MAX_BATCH} items, not {count!r}")


def _check_request(count: int, what: str, most: float, request: str, verb: str,
                   over: str, fix: str) -> None:
    """``InvalidRequest`` unless ``count`` items make a batch (:func:`_check_batch`) that
    the rate limiter lets one request move (``most``: half the error_buffer window, ``over``
    what it is taken over), so that inserts and samples can never block each other for
    good; ``request``, ``verb`` and ``fix`` word the refusal."""
    _check_batch(count, what)
    if count > most:
        raise InvalidRequest(
            f"{request} is more than the rate limiter lets one request {verb} "
            f"({math.floor(most)}: half the error_buffer window{over}, so that inserts and "
            f"samples can never block each other for good): {fix}")


def _restore(cls: type[ReplayTable], state: Mapping[str, Any],
             payloads: Mapping[int, Any]) -> ReplayTable:
    if state["version"] != STATE_VERSION:
        raise InvalidRequest(f"replay state version {state['version']!r} is not "
                             f"{STATE_VERSION}")
    table = cls(ReplayConfig.from_dict(state["config"]))
    next_key, seq = state["next_key"], state["seq"]
    rows = state["items"]
    if not (_is_count(next_key) and _is_count(seq) and len(rows) <= table._max_size):
        raise InvalidRequest("replay state: bad next_key, seq or item count")
    if len(rows) > table._capacity:
        table._grow(len(rows))
    max_times = table._max_times
    for row in rows:
        key, priority, times_sampled, nbytes, item_seq = row
        checks = (_is_count(key) and 1 <= key < next_key and key not in table._items,
                  _is_count(times_sampled) and (not max_times or times_sampled < max_times),
                  _is_count(nbytes), _is_count(item_seq) and item_seq < seq)
        if not all(checks):
            raise InvalidRequest(f"replay state: bad item {row!r}")
        if key not in payloads:
            raise InvalidRequest(f"replay state: no payload for key {key}")
        p, weight = _check_priority(priority, table._alpha)
        item = ReplayItem(key, payloads[key], nbytes, p, 0, item_seq, times_sampled)
        table._items[key] = item
        table._place(item, weight)
    for key in sorted(table._items):
        table._items.move_to_end(key)  # insertion order is key order
    table._next_key, table._seq = next_key, seq
    _restore_counters(table, state)
    version, internal, gauss = state["rng"]
    table._rng.setstate((version, tuple(internal), gauss))
    return table


def _restore_counters(table: ReplayTable, state: Mapping[str, Any]) -> None:
    counters = state["counters"]
    limiter = state["limiter"]
    values = [counters[name] for name in ("inserts", "samples", "evicted", "expired",
                                          "deleted")]
    values += [limiter[name] for name in ("inserts", "samples", "deletes")]
    if not all(_is_count(v) for v in values):
        raise InvalidRequest("replay state: counters must be int64s >= 0")
    (table._inserted, table._sampled, table._evicted, table._expired, table._deleted,
     table.limiter.inserts, table.limiter.samples, table.limiter.deletes) = values
    if table.limiter.inserts - table.limiter.deletes != len(table):
        raise InvalidRequest("replay state: the limiter's inserts - deletes is not the size")
