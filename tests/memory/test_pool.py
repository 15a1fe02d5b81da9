"""The buffer pool: size classes, reuse of memory whose views are gone, limits, trimming;
the memfd pool: ready memfds for the next shared-memory put, bounded, fork-safe."""

from __future__ import annotations

import gc
import os

import pytest

from tensorshare.memory import shm
from tensorshare.memory.pool import MIN_PART, BufferPool, MemfdPool, size_class
from tests.conftest import wait_until

MiB = 1 << 20
WAIT = 30.0
needs_memfd = pytest.mark.skipif(not shm.available(), reason="needs Linux memfd seals")


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


@needs_memfd
def test_a_fork_while_the_pool_is_busy_leaves_the_child_a_working_pool_of_its_own() -> None:
    """The fork happens while the pool's lock is held (as its thread holds it a moment for
    each memfd it makes ready): the child gets a fresh lock and none of the parent's
    memfds, and shares through its own."""
    pool = MemfdPool(limit=8 * MiB)
    pool.share(b"x" * MiB)
    wait_until(lambda: bool(pool._ready), timeout=WAIT, what="a memfd made ready")
    with pool._lock:
        pid = os.fork()
        if pid == 0:  # the child: exit code 0 only if all holds
            ok = False
            try:
                ok = not pool._ready and bytes(pool.share(b"y" * MiB).view) == b"y" * MiB
            finally:
                os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pool._ready  # the parent's ready memfd is still there, and still its own
    assert bytes(pool.share(b"z" * MiB).view) == b"z" * MiB
    assert pool.hits == 1
    pool.close()


@needs_memfd
def test_the_memfd_pool_keeps_one_ready_per_class_within_its_limit() -> None:
    """Each put takes its class's ready memfd when there is one (its value stored as
    written, sealed), and the pool makes the next; classes beyond ``limit`` give way, the
    least recently used first."""
    pool = MemfdPool(limit=6 * MiB)
    for i in range(3):
        mem = pool.share(bytes([i]) * (2 * MiB))
        assert bytes(mem.view) == bytes([i]) * (2 * MiB) and mem.size == 2 * MiB
        assert fcntl_seals(mem.fd) != 0  # sealed: nobody writes it again
        wait_until(lambda: size_class(2 * MiB) in pool._ready, timeout=WAIT,
                   what="the next memfd of the class made ready")
    assert (pool.misses, pool.hits) == (1, 2)
    pool.share(b"b" * (4 * MiB))  # 2 + 4 MiB wanted: both fit
    wait_until(lambda: len(pool._ready) == 2, timeout=WAIT, what="both classes ready")
    pool.share(b"c" * (3 * MiB))  # 2 + 4 + 3 > 6 MiB: the 2 MiB class goes
    assert size_class(2 * MiB) not in pool._ready
    assert sum(pool._wanted) <= pool.limit
    pool.close()
    assert not pool._ready


def fcntl_seals(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, getattr(fcntl, "F_GET_SEALS", 1034))
