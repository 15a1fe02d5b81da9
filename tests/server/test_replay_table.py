"""The replay table on its own (tensorshare.server.replay): samplers, removers, the rate
limiter, priority updates, state for persistence, and the trees' invariants."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorshare.errors import InvalidRequest
from tensorshare.server.replay import (
    HISTOGRAM_EDGES,
    MAX_BATCH,
    REMOVERS,
    SAMPLERS,
    ExtremeTree,
    ReplayConfig,
    ReplayTable,
    SumTree,
    histogram_bucket,
)

# Critical values of the chi-square distribution at the 0.001 level (scipy is not a
# dependency): chi2.ppf(0.999, df), checked against the regularized incomplete gamma
# function (1 - CDF = 0.00100 at each). A right distribution fails this 1 time in 1000; the
# seeds are fixed, so each test is deterministic.
CHI2_999 = {8: 26.124, 9: 27.877, 19: 43.820}
DRAWS = 200_000


def table(**options: Any) -> ReplayTable:
    options.setdefault("max_size", 1000)
    options.setdefault("seed", 7)
    return ReplayTable(ReplayConfig(**options))


def fill(t: ReplayTable, priorities: Sequence[float]) -> list[int]:
    return t.insert([f"item{i}" for i in range(len(priorities))], list(priorities),
                    [10] * len(priorities))


def chi_square(counts: Counter[int], expected: dict[int, float], draws: int) -> float:
    assert set(counts) <= set(expected), "drew an item of probability 0"
    return sum((counts[k] - draws * p) ** 2 / (draws * p) for k, p in expected.items() if p)


def draw(t: ReplayTable, total: int, batch: int = 1000) -> Counter[int]:
    counts: Counter[int] = Counter()
    for _ in range(total // batch):
        counts.update(t.sample(batch).keys)
    return counts


# -- samplers ----------------------------------------------------------------------------


def test_prioritized_draws_match_p_alpha_over_sum() -> None:
    alpha = 0.6
    priorities = [0.05 * (i + 1) ** 1.5 for i in range(20)]
    t = table(sampler="prioritized", priority_exponent=alpha)
    keys = fill(t, priorities)
    weights = [p ** alpha for p in priorities]
    expected = {k: w / sum(weights) for k, w in zip(keys, weights, strict=True)}
    first = t.sample(64)
    for key, probability, size in zip(first.keys, first.probabilities, first.sizes,
                                      strict=True):
        assert probability == pytest.approx(expected[key], rel=1e-12)
        assert size == 20
    counts = draw(t, DRAWS)
    assert chi_square(counts, expected, DRAWS) < CHI2_999[19]
    # The test has the power to fail: the same draws are far from p / sum (alpha = 1).
    wrong = {k: p / sum(priorities) for k, p in zip(keys, priorities, strict=True)}
    assert chi_square(counts, wrong, DRAWS) > 20 * CHI2_999[19]


def test_uniform_draws_are_uniform_whatever_the_priorities() -> None:
    t = table(sampler="uniform")
    keys = fill(t, [0.0, 1.0, 5.0, 100.0, 0.5, 2.0, 3.0, 4.0, 7.0, 9.0])
    first = t.sample(10)
    assert first.probabilities == [0.1] * 10 and first.sizes == [10] * 10
    counts = draw(t, DRAWS)
    assert chi_square(counts, dict.fromkeys(keys, 0.1), DRAWS) < CHI2_999[9]
    skewed = {k: (0.2 if i == 0 else 0.8 / 9) for i, k in enumerate(keys)}
    assert chi_square(counts, skewed, DRAWS) > 20 * CHI2_999[9]


def test_zero_priority_is_never_drawn_and_all_zero_is_uniform() -> None:
    t = table(sampler="prioritized", priority_exponent=0.0)
    keys = fill(t, [0.0, 3.0, 0.0, 1.0])
    counts = draw(t, 20_000)
    assert set(counts) == {keys[1], keys[3]}  # exponent 0: 0 stays 0, the others equal
    assert abs(counts[keys[1]] - 10_000) < 500
    t.update_priorities([keys[1], keys[3]], [0.0, 0.0])
    drawn = t.sample(1000)
    assert set(drawn.probabilities) == {0.25} and set(drawn.keys) == set(keys)


def test_update_priorities_changes_the_next_draws() -> None:
    t = table(sampler="prioritized", priority_exponent=1.0)
    keys = fill(t, [1.0] * 10)
    assert t.update_priorities([keys[0], keys[1], 12345], [0.0, 10.0, 1.0]) == 1  # unknown key
    expected = {k: (0.0 if i == 0 else 10 / 18 if i == 1 else 1 / 18)
                for i, k in enumerate(keys)}
    counts = draw(t, DRAWS)
    assert counts[keys[0]] == 0
    assert chi_square(counts, expected, DRAWS) < CHI2_999[8]  # 9 items of probability > 0
    assert t.sample(1).probabilities[0] in (pytest.approx(10 / 18), pytest.approx(1 / 18))


def test_update_priorities_is_all_or_nothing_and_last_wins() -> None:
    t = table(sampler="prioritized")
    keys = fill(t, [1.0, 2.0])
    for bad in (math.nan, -1.0, math.inf, "3", True):
        with pytest.raises(InvalidRequest):
            t.update_priorities(keys, [5.0, bad])
        assert [i.priority for i in t.items()] == [1.0, 2.0]
    with pytest.raises(InvalidRequest):
        t.update_priorities(keys, [1.0])
    assert t.update_priorities([keys[0], keys[0]], [4.0, 6.0]) == 0
    assert t.get(keys[0]) is not None and t.get(keys[0]).priority == 6.0  # type: ignore[union-attr]


def test_deterministic_samplers_draw_with_replacement() -> None:
    priorities = [2.0, 9.0, 1.0, 9.0, 3.0]
    expect = {"fifo": 0, "lifo": 4, "max_priority": 1}  # max ties: least recently set
    for sampler, index in expect.items():
        t = table(sampler=sampler)
        keys = fill(t, priorities)
        drawn = t.sample(3)
        assert drawn.keys == [keys[index]] * 3 and drawn.probabilities == [1.0] * 3
    t = table(sampler="max_priority")
    keys = fill(t, priorities)
    t.update_priorities([keys[1]], [9.0])  # now keys[3] is the less recently set of the 9s
    assert t.sample(1).keys == [keys[3]]


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_max_times_sampled_1_gives_each_item_to_exactly_one_sample(sampler: str) -> None:
    t = table(sampler=sampler, max_times_sampled=1)
    priorities = [random.Random(3).uniform(0.1, 5.0) for _ in range(500)]
    keys = fill(t, priorities)
    seen: list[int] = []
    payloads: list[Any] = []
    while len(t):
        batch = min(7, len(t))
        assert t.can_sample(batch) and not t.can_sample(len(t) + 1)
        drawn = t.sample(batch)
        assert drawn.removed == batch
        assert drawn.sizes == list(range(drawn.sizes[0], drawn.sizes[0] - batch, -1))
        seen += drawn.keys
        payloads += drawn.payloads
    assert sorted(seen) == keys  # each exactly once
    assert payloads == [f"item{k - 1}" for k in seen]  # removed items' payloads come back
    if sampler == "fifo":
        assert seen == keys  # a queue
    if sampler == "max_priority":
        assert [priorities[k - 1] for k in seen] == sorted(priorities, reverse=True)
    assert t.stats()["expired"] == 500 and t.nbytes == 0
    with pytest.raises(InvalidRequest):
        t.sample(1)


def test_max_times_sampled_holds_within_one_batch() -> None:
    t = table(sampler="fifo", max_times_sampled=3)
    keys = fill(t, [1.0, 1.0])
    assert t.draws_left() == 6 and not t.can_sample(7)
    assert t.sample(5).keys == [keys[0]] * 3 + [keys[1]] * 2
    assert len(t) == 1 and t.draws_left() == 1
    t2 = table(sampler="prioritized", max_times_sampled=2)
    fill(t2, [1.0, 100.0, 1.0])
    assert max(Counter(t2.sample(6).keys).values()) == 2


# -- removers ----------------------------------------------------------------------------


def test_removers_keep_the_right_items() -> None:
    priorities = [5.0, 1.0, 3.0, 1.0, 4.0, 2.0, 0.5]
    t = table(max_size=4, remover="fifo")
    keys = fill(t, priorities)
    assert [i.key for i in t.items()] == keys[3:]
    t = table(max_size=4, remover="lifo")  # a full table drops each new item (as Reverb)
    keys = fill(t, priorities)
    assert [i.key for i in t.items()] == keys[:4]
    assert t.update_priorities(keys, [1.0] * 7) == 3  # the dropped ones' keys are unknown
    t = table(max_size=4, remover="min_priority")  # keeps the highest priorities
    keys = fill(t, priorities)
    assert sorted(i.priority for i in t.items()) == [2.0, 3.0, 4.0, 5.0]
    assert t.stats()["evicted"] == 3 and t.nbytes == 40 and len(t) == 4


def test_min_priority_remover_ties_go_to_the_least_recently_set() -> None:
    t = table(max_size=3, remover="min_priority")
    keys = fill(t, [1.0, 1.0, 1.0])
    t.update_priorities([keys[0]], [1.0])  # keys[0] is now the most recently set
    (new,) = fill(t, [1.0])
    assert [i.key for i in t.items()] == [keys[0], keys[2], new]


def test_delete_and_reset() -> None:
    t = table(samples_per_insert=1.0, min_size_to_sample=2, error_buffer=10.0)
    keys = fill(t, [1.0, 2.0, 3.0])
    assert t.delete([keys[1], 999, keys[1]]) == 1 and len(t) == 2
    assert t.limiter.deletes == 1 and t.limiter.inserts == 3
    t.sample(2)
    t.reset()
    assert len(t) == 0 and t.nbytes == 0 and t.limiter.diff() == 0.0
    assert t.limiter.inserts == t.limiter.samples == t.limiter.deletes == 0
    assert fill(t, [1.0]) == [4]  # keys are never reused
    assert t.stats()["inserts"] == 4 and t.stats()["samples"] == 2  # lifetime counts


# -- the rate limiter --------------------------------------------------------------------


def run_limiter(t: ReplayTable, insert_every: int, sample_every: int, k: int, n: int,
                steps: int) -> tuple[int, int, int, int]:
    """A sampler of batches of n and an inserter of k items, each trying every so many
    steps; returns (inserts, samples, insert waits, sample waits) and checks the diff."""
    inserts = samples = insert_waits = sample_waits = 0
    limiter = t.limiter
    for step in range(steps):
        if step % insert_every == 0:
            if t.can_insert(k, sample_waiting=n):
                fill(t, [1.0] * k)
                inserts += k
            else:
                insert_waits += 1
        if step % sample_every == 0:
            if t.can_sample(n):
                t.sample(n)
                samples += n
            else:
                sample_waits += 1
        if len(t) >= limiter.min_size_to_sample:
            assert limiter.min_diff <= limiter.diff() <= limiter.max_diff
    return inserts, samples, insert_waits, sample_waits


@pytest.mark.parametrize(("insert_every", "sample_every"), [(7, 1), (1, 7)])
def test_sample_to_insert_ratio_holds_fast_and_slow(insert_every: int,
                                                    sample_every: int) -> None:
    t = table(max_size=100_000, sampler="uniform", samples_per_insert=4.0,
              min_size_to_sample=10, error_buffer=40.0)
    assert t.limiter.min_diff == 0.0 and t.limiter.max_diff == 80.0
    inserts, samples, insert_waits, sample_waits = run_limiter(
        t, insert_every, sample_every, k=2, n=8, steps=20_000)
    assert samples > 1000 and inserts > 200  # both sides went on
    fast_waits, slow_waits = ((sample_waits, insert_waits) if insert_every > sample_every
                              else (insert_waits, sample_waits))
    # The fast side waits for the slow one; the slow side never waits (the sampler's first
    # try comes before min_size_to_sample items are in).
    assert fast_waits > 1000 and slow_waits <= 1
    assert abs(inserts * 4.0 - samples - 40.0) <= 40.0  # the ratio: 4 samples per insert


def test_inserts_are_free_until_min_size_to_sample() -> None:
    t = table(samples_per_insert=2.0, min_size_to_sample=5, error_buffer=4.0)
    assert not t.can_sample(1)
    for _ in range(4):
        assert t.can_insert(1) and not t.can_sample(1)
        fill(t, [1.0])
    assert t.can_insert(3)  # stage 1: a whole insert goes while fewer than 5 are in
    fill(t, [1.0])
    assert t.limiter.diff() == 10.0 and not t.can_insert(3) and t.can_insert(2)
    assert t.can_sample(4) and not t.can_sample(7)
    stats = t.stats()["limiter"]
    assert stats["kind"] == "sample_to_insert_ratio" and stats["diff"] == 10.0
    assert (stats["min_diff"], stats["max_diff"]) == (6.0, 14.0)
    assert not stats["inserts_blocked"] and not stats["samples_blocked"]
    t.sample(4)
    assert not t.can_sample(1) and t.stats()["limiter"]["samples_blocked"]


def test_min_size_limiter_never_holds_inserts() -> None:
    t = table(min_size_to_sample=3)
    assert t.stats()["limiter"]["kind"] == "min_size"
    fill(t, [1.0, 1.0])
    assert not t.can_sample(1) and t.can_insert(MAX_BATCH)
    fill(t, [1.0])
    assert t.can_sample(MAX_BATCH)
    t.check_sample(MAX_BATCH)
    t.check_insert(MAX_BATCH)


def test_limiter_configurations_follow_reverbs_rules() -> None:
    good = ReplayConfig(max_size=100, samples_per_insert=4.0, min_size_to_sample=10)
    assert good.diff_bounds() == (0.0, 80.0)  # the default error_buffer: spi * min_size
    assert ReplayConfig(max_size=10, samples_per_insert=0.5,
                        error_buffer=(-2.0, 3.0)).diff_bounds() == (-2.0, 3.0)
    bad = [
        {"samples_per_insert": 0.0},
        {"samples_per_insert": 4.0, "error_buffer": 3.9},  # window under 2 * max(1, spi)
        {"samples_per_insert": 1.0, "min_size_to_sample": 5, "error_buffer": (6.0, 10.0)},
        {"error_buffer": 5.0},  # without samples_per_insert
        {"min_size_to_sample": 0}, {"min_size_to_sample": 101},
        {"max_size": 0}, {"sampler": "random"}, {"remover": "uniform"},
        {"priority_exponent": -1.0}, {"max_times_sampled": 0}, {"seed": 1.5},
    ]
    for options in bad:
        options.setdefault("max_size", 100)
        with pytest.raises(InvalidRequest):
            ReplayConfig(**options)


def test_requests_too_big_for_the_window_are_refused() -> None:
    t = table(samples_per_insert=4.0, min_size_to_sample=10, error_buffer=100.0)
    t.check_sample(100)
    with pytest.raises(InvalidRequest, match="raise error_buffer to at least 101"):
        t.check_sample(101)
    t.check_insert(25)
    with pytest.raises(InvalidRequest, match="insert fewer"):
        t.check_insert(26)
    for count in (0, MAX_BATCH + 1, 1.0):
        with pytest.raises(InvalidRequest):
            t.check_sample(count)  # type: ignore[arg-type]
    small = table(max_size=4, max_times_sampled=2)
    small.check_sample(8)
    with pytest.raises(InvalidRequest, match="could never give"):
        small.check_sample(9)


@settings(max_examples=60, deadline=None)
@given(spi=st.sampled_from([0.25, 1.0, 3.0]), min_size=st.integers(1, 6),
       buffer=st.integers(0, 30), max_times=st.sampled_from([None, 1, 2]),
       max_size=st.integers(6, 40), remover=st.sampled_from(REMOVERS),
       ops=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 40)), max_size=120))
def test_a_waiting_insert_and_a_waiting_sample_never_block_each_other(
        spi: float, min_size: int, buffer: int, max_times: int | None, max_size: int,
        remover: str, ops: list[tuple[int, int]]) -> None:
    buffer_ = max(float(buffer), max(1.0, spi))
    t = table(max_size=max_size, sampler="uniform", remover=remover, samples_per_insert=spi,
              min_size_to_sample=min_size, error_buffer=buffer_, max_times_sampled=max_times)
    for op, size in ops:
        n = min(size, math.floor(t.limiter.max_sample()), max_size * (max_times or 1))
        k = max(1, min(size, math.floor(t.limiter.max_insert())))
        t.check_sample(n)
        t.check_insert(k)
        assert t.can_sample(n) or t.can_insert(k, sample_waiting=n), t.stats()
        if op == 0 and t.can_insert(k, sample_waiting=n):
            fill(t, [1.0] * k)
        elif op == 1 and t.can_sample(n):
            t.sample(n)
        elif op == 2 and len(t):
            t.delete([next(t.items()).key])
        elif op == 3 and t.can_insert(k):
            fill(t, [1.0] * k)
        elif op == 4 and t.can_sample(1):
            t.sample(1)
        assert t.limiter.inserts - t.limiter.deletes == len(t)


# -- state for persistence ---------------------------------------------------------------


def busy_table(sampler: str, remover: str, max_times: int | None) -> ReplayTable:
    t = table(max_size=50, sampler=sampler, remover=remover, max_times_sampled=max_times,
              samples_per_insert=2.0, min_size_to_sample=5, error_buffer=200.0, seed=11)
    rng = random.Random(5)
    for _ in range(30):
        keys = fill(t, [rng.uniform(0.0, 4.0) for _ in range(4)])
        if len(t) >= 5 and t.can_sample(3):
            t.sample(3)
        t.update_priorities(keys[:2], [rng.uniform(0.0, 4.0), 2.0])
        if rng.random() < 0.2:
            t.delete([keys[-1]])
    return t


@pytest.mark.parametrize(("sampler", "remover", "max_times"),
                         [(s, r, m) for s in SAMPLERS for r in REMOVERS for m in (None, 3)])
def test_state_round_trip_gives_the_same_next_samples(sampler: str, remover: str,
                                                      max_times: int | None) -> None:
    t = busy_table(sampler, remover, max_times)
    state = json.loads(json.dumps(t.state()))  # plain data
    back = ReplayTable.from_state(state, {item.key: item.payload for item in t.items()})
    assert back.stats() == t.stats() and back.state() == t.state()
    for _ in range(5):
        batch = int(min(4, t.draws_left()))
        a, b = t.sample(batch), back.sample(batch)
        assert (a.keys, a.probabilities, a.sizes, a.payloads) == \
            (b.keys, b.probabilities, b.sizes, b.payloads)
        assert fill(t, [1.5]) == fill(back, [1.5])
    assert back.state() == t.state()


def test_from_state_refuses_what_state_could_not_have_written() -> None:
    t = busy_table("prioritized", "fifo", None)
    payloads = {item.key: item.payload for item in t.items()}
    good = t.state()
    cases: list[dict[str, Any]] = []
    for change in ("version", "dup", "key", "limiter", "priority", "rng", "config", "int64"):
        state = json.loads(json.dumps(good))
        if change == "version":
            state["version"] = 99
        elif change == "dup":
            state["items"][1][0] = state["items"][0][0]
        elif change == "key":
            state["items"][0][0] = state["next_key"]
        elif change == "limiter":
            state["limiter"]["deletes"] += 1
        elif change == "priority":
            state["items"][0][1] = -1.0
        elif change == "rng":
            state["rng"][1] = [1, 2]
        elif change == "int64":
            state["counters"]["samples"] = 2 ** 63  # keys and counts are int64
        else:
            state["config"]["sampler"] = "nope"
        cases.append(state)
    for state in cases:
        with pytest.raises(InvalidRequest):
            ReplayTable.from_state(state, payloads)
    with pytest.raises(InvalidRequest, match="no payload for key"):
        ReplayTable.from_state(good, {})  # payloads are the caller's


# -- the trees ---------------------------------------------------------------------------


def check_invariants(t: ReplayTable) -> None:
    """Every structure of the table agrees with its items."""
    slots = t._slots
    assert len(slots) == len(t._items) == t.limiter.inserts - t.limiter.deletes
    assert list(t._items) == sorted(t._items)  # insertion order is key order
    for slot, item in enumerate(slots):
        assert item.slot == slot and t._items[item.key] is item
    tree = t._sum
    if tree is not None:
        cap, nodes = tree.capacity, tree.nodes
        assert cap >= len(slots)
        for slot, item in enumerate(slots):
            weight = item.priority ** t._alpha if item.priority else 0.0
            assert nodes[cap + slot] == weight
        assert all(nodes[cap + s] == 0.0 for s in range(len(slots), cap))
        assert all(nodes[i] == nodes[2 * i] + nodes[2 * i + 1] for i in range(1, cap))
        assert tree.total() == pytest.approx(math.fsum(nodes[cap:]), rel=1e-9, abs=1e-300)
    for heap, highest in ((t._high, True), (t._low, False)):
        if heap is not None:
            sign = 1.0 if highest else -1.0
            best = max(slots, key=lambda i: (sign * i.priority, -i.seq)) if slots else None
            assert heap.top() == (best.slot if best else -1)
    hist = [0] * len(HISTOGRAM_EDGES)
    for item in slots:
        hist[histogram_bucket(item.priority)] += 1
    assert t._hist == hist
    assert t.nbytes == sum(item.nbytes for item in slots)
    if t._max_times:
        assert t._draws_left == sum(t._max_times - i.times_sampled for i in slots)


priority = st.one_of(st.just(0.0), st.floats(1e-8, 1e6), st.sampled_from([1.0, 2.0, 0.5]))


@settings(max_examples=80, deadline=None)
@given(sampler=st.sampled_from(["prioritized", "max_priority"]),
       remover=st.sampled_from(REMOVERS), alpha=st.sampled_from([0.0, 0.6, 1.0, 2.0]),
       max_times=st.sampled_from([None, 1, 3]),
       ops=st.lists(st.tuples(st.integers(0, 4), st.lists(priority, min_size=1, max_size=9)),
                    max_size=60))
def test_trees_stay_true_under_inserts_removes_and_updates(
        sampler: str, remover: str, alpha: float, max_times: int | None,
        ops: list[tuple[int, list[float]]]) -> None:
    t = table(max_size=37, sampler=sampler, remover=remover, priority_exponent=alpha,
              max_times_sampled=max_times)
    t._grow(2)  # start small so that the trees grow under the test
    rng = random.Random(len(ops))
    for op, priorities in ops:
        keys = [i.key for i in t.items()]
        if op <= 1:
            t.insert([None] * len(priorities), priorities, [len(priorities)] * len(priorities))
        elif op == 2 and keys:
            chosen = [rng.choice(keys) for _ in priorities]
            t.update_priorities(chosen + [10 ** 9], priorities + [1.0])
        elif op == 3 and keys:
            t.delete(rng.sample(keys, min(len(keys), len(priorities))))
        elif op == 4 and len(t) and t.draws_left() >= len(priorities):
            t.sample(len(priorities))
        check_invariants(t)


def test_sum_tree_find_never_lands_on_an_empty_slot() -> None:
    tree = SumTree(8)
    for slot, weight in enumerate([0.1, 0.0, 0.2, 0.0, 0.3]):
        tree.set(slot, weight)
    total = tree.total()
    assert tree.find(0.0) == 0 and tree.find(0.1) == 2 and tree.find(0.35) == 4
    assert tree.find(total) == 4  # at or past the total (rounding): the last non-empty slot
    assert tree.find(math.nextafter(total, 0.0)) == 4
    tree.grow(1000)
    assert tree.capacity == 1024 and tree.total() == total and tree.find(0.15) == 2
    heap = ExtremeTree(True, 2)
    assert heap.top() == -1
    heap.set(0, 1.0, 5)
    heap.set(1, 1.0, 3)
    heap.grow(5)
    assert heap.top() == 1
    heap.clear(1)
    assert heap.top() == 0


def test_histogram_buckets_and_priority_checks() -> None:
    assert [histogram_bucket(p) for p in (0.0, 5e-7, 1e-6, 0.99, 1.0, 9.99, 1e6, 1e300)] == \
        [0, 0, 1, 6, 7, 7, 13, 13]
    for i, edge in enumerate(HISTOGRAM_EDGES[1:], start=1):
        assert histogram_bucket(edge) == i and histogram_bucket(math.nextafter(edge, 0)) == i - 1
    t = table(sampler="prioritized", priority_exponent=2.0)
    for bad in (math.nan, math.inf, -0.5, "1", None, 1e200):  # 1e200 ** 2 overflows
        with pytest.raises(InvalidRequest):
            t.insert(["x"], [bad], [1])  # type: ignore[list-item]
    with pytest.raises(InvalidRequest):
        t.insert(["x", "y"], [1.0], [1, 1])
    with pytest.raises(InvalidRequest):
        t.insert(["x"], [1.0], [-1])
    assert len(t) == 0 and t.next_key == 1  # nothing half done
    fill(t, [0.0, 0.5, 2.0, 2.0])
    counts = t.stats()["priority_histogram"]["counts"]
    assert counts[0] == 1 and counts[6] == 1 and counts[7] == 2
