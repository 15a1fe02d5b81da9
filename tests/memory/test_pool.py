"""The buffer pool: size classes, reuse of memory whose views are gone, limits, trimming."""

from __future__ import annotations

import gc

from tensorshare.memory.pool import MIN_PART, BufferPool, size_class


def test_size_classes_round_up_by_at_most_a_quarter() -> None:
    assert size_class(1) == MIN_PART and size_class(MIN_PART) == MIN_PART
    for n in (MIN_PART + 1, 100_000, 1 << 20, (1 << 20) + 1, 3_000_000, 900 << 20):
        cls = size_class(n)
        assert n <= cls < n * 1.25 + 4096, (n, cls)
        assert size_class(cls) == cls  # a class holds itself


def test_a_part_comes_back_to_the_pool_when_its_last_view_goes() -> None:
    pool = BufferPool(limit=64 << 20)
    part = pool.take(1 << 20)
    assert len(part) == 1 << 20 and not part.readonly
    part[:5] = b"hello"
    view = part[2:4]  # a slice keeps the memory alive
    del part
    gc.collect()
    assert pool.idle == 0
    assert bytes(view) == b"ll"
    view.release()
    del view
    assert pool.idle == size_class(1 << 20)
    again = pool.take((1 << 20) - 100)  # the same class: the same memory, reused
    assert pool.reused == 1 and pool.fresh == 1 and pool.idle == 0
    assert bytes(again[:5]) == b"hello"  # (content is unspecified; here it is the old one)


def test_idle_memory_beyond_the_limit_is_given_back_and_trim_makes_room() -> None:
    pool = BufferPool(limit=3 << 20)
    parts = [pool.take(1 << 20) for _ in range(5)]
    del parts
    assert pool.idle == 3 * size_class(1 << 20)  # the other two were unmapped
    assert pool.trim(keep=1 << 20) == 2 * size_class(1 << 20)
    assert pool.idle == size_class(1 << 20)
    assert pool.trim() == size_class(1 << 20) and pool.idle == 0
