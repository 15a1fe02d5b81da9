"""Reusable memory for the large parts of received frames.

Fresh memory is expensive: every page of it is a page fault the first time it is written (on
the 2-core VMs this project runs on, filling 16 MiB of fresh memory takes eight times as long
as filling 16 MiB that was used before). And memory taken the ordinary way (a ``bytearray``)
is zeroed as it is allocated, so a peer that announces a 900 MiB frame and sends 2 MiB of it
would make the receiver hold 900 MiB.

:class:`BufferPool` answers both. A part is taken from a free list of anonymous mappings of
its size class (already faulted in when it was used before), or from a new mapping whose
pages the kernel provides only as they are written (so a peer that announces much and sends
little costs what it sent). When the last view of a part goes (the item was got, deleted,
replaced), its mapping goes back to the free list, up to ``limit`` idle bytes; beyond that,
and whenever :meth:`trim` is asked to make room, idle mappings are given back to the OS.

Size classes have four steps per power of two (at most 25% rounding); a part only touches the
pages it uses, so the rounding costs address space, not memory.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from typing import Any

from . import shm

__all__ = ["RECEIVE_POOL_ENV", "SEND_POOL_ENV", "BufferPool", "MemfdPool", "receive_pool",
           "send_pool", "size_class"]

MIN_PART = 64 * 1024
#: The idle bytes a client process keeps for reuse (see :func:`receive_pool`); 0: none.
RECEIVE_POOL_ENV = "TENSORSHARE_RECEIVE_POOL"
_RECEIVE_POOL_DEFAULT = 128 << 20


def size_class(n: int) -> int:
    """The mapping size that holds ``n`` bytes: ``n`` rounded up to a quarter power of two."""
    if n <= MIN_PART:
        return MIN_PART
    step = 1 << max(n.bit_length() - 3, 12)
    return (n + step - 1) // step * step


class BufferPool:
    """Reusable anonymous memory (see the module docstring). Thread-safe.

    Args:
        limit: the most idle bytes (by size class) kept for reuse.
    """

    def __init__(self, limit: int = 256 << 20) -> None:
        self.limit = limit
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()
        self.idle = 0  # bytes (by class) of mappings waiting to be reused
        self.reused = 0  # parts served from the free lists (statistics)
        self.fresh = 0  # parts served from new mappings
        # Where parts come from instead, while set (the process's receive pool sends them to
        # the pinned pool once a read asked for a CUDA device: memory.pinned).
        self.divert: Any = None

    def take(self, n: int) -> memoryview:
        """``n`` writable bytes (of unspecified content), given back to the pool when the
        returned view and every view of it are gone."""
        import numpy as np  # only for the weakly referencable buffer owner (see below)

        divert = self.divert
        if divert is not None:
            part: memoryview = divert(n)
            return part
        cls = size_class(n)
        with self._lock:
            free = self._free.get(cls)
            if free:
                mm = free.pop()
                self.idle -= cls
                self.reused += 1
            else:
                mm = None
                self.fresh += 1
        if mm is None:
            # Private: a forked child's writes to a received tensor stay in the child (a
            # shared mapping would carry them into the parent's tensor, and back).
            mm = mmap.mmap(-1, cls, flags=mmap.MAP_PRIVATE)
        # A numpy array over the mapping owns the buffer every view of the part refers to,
        # and it can be weakly referenced: when it goes, the mapping is free again.
        owner = np.frombuffer(mm, dtype=np.uint8)
        weakref.finalize(owner, self._give_back, cls, mm)
        return owner.data[:n]

    def _give_back(self, cls: int, mm: mmap.mmap) -> None:
        with self._lock:
            if self.idle + cls <= self.limit:
                self._free.setdefault(cls, []).append(mm)
                self.idle += cls
        # Otherwise the mapping is dropped: it is unmapped once the array lets go of it.

    def trim(self, keep: int = 0) -> int:
        """Give idle mappings back to the OS until at most ``keep`` idle bytes are left.

        Returns:
            The bytes (by class) given back.
        """
        dropped: list[Any] = []
        with self._lock:
            freed = 0
            for cls in sorted(self._free, reverse=True):
                lst = self._free[cls]
                while lst and self.idle > keep:
                    dropped.append(lst.pop())
                    self.idle -= cls
                    freed += cls
            self._free = {c: lst for c, lst in self._free.items() if lst}
        for mm in dropped:
            try:
                mm.close()
            except BufferError:  # a view was taken just now: it unmaps when that goes
                pass
        return freed


class _OnePerProcess:
    """A pool made on first use from its limit in the environment (``0``: none, and the
    environment is not read again), shared by the whole process."""

    def __init__(self, env: str, default: int, make: Any) -> None:
        self.env, self.default, self.make = env, default, make
        self.lock = threading.Lock()
        self.pool: Any = None
        self.off = False

    def get(self) -> Any:
        with self.lock:
            if self.pool is None and not self.off:
                try:
                    limit = int(os.environ.get(self.env, self.default))
                except ValueError:
                    limit = self.default
                if limit <= 0:
                    self.off = True
                else:
                    self.pool = self.make(limit)
            return self.pool


_RECEIVE = _OnePerProcess(RECEIVE_POOL_ENV, _RECEIVE_POOL_DEFAULT, BufferPool)


def receive_pool() -> BufferPool | None:
    """The process's pool for the large parts a client receives (``None`` when
    ``TENSORSHARE_RECEIVE_POOL=0``), made on first use and shared by every client of the
    process.

    A received tensor lives in its part's memory; when the caller drops it, the part goes
    back here, so the next value of that size (a new version of the parameters, the next
    batch) lands in memory that is already faulted in instead of fresh, zeroed pages. At
    most ``TENSORSHARE_RECEIVE_POOL`` bytes (default 128 MiB) wait idle.
    """
    pool: BufferPool | None = _RECEIVE.get()
    return pool


class MemfdPool:
    """Memfds whose pages are allocated before a put needs them.

    A put through shared memory copies its tensor into a sealed memfd, which then belongs to
    the server (a sealed file cannot be written again): every put needs a new one. Made on
    the spot, the kernel allocates (and zeroes) each page as the copy reaches it, which took
    more time than the copy itself. This pool keeps, for each size class a put has used, one
    memfd whose pages a background thread allocated (``posix_fallocate``) while the process
    did other things: a put takes it, shrinks it to its size, copies into pages that exist,
    seals it, and the thread makes the next one.

    Bounded: at most ``limit`` bytes wait in ready memfds (the classes used longest ago
    give way). A forked child never takes its parent's memfds (one file in both
    processes): it starts an empty pool. Nothing is named in ``/dev/shm``; the kernel
    frees a memfd with the last process that holds it.

    Args:
        limit: the most bytes kept ready, all classes together.
    """

    def __init__(self, limit: int = 256 << 20) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._ready: dict[int, int] = {}  # size class -> a memfd of that size, pages allocated
        self._wanted: list[int] = []  # classes to fill, most recently used last
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.hits = 0  # puts that found a ready memfd (statistics)
        self.misses = 0
        _POOLS.add(self)

    def share(self, data: Any) -> shm.SharedMemory:
        """:func:`~tensorshare.memory.shm.share`, into a ready memfd when one of the data's
        size class waits."""
        n = memoryview(data).nbytes
        cls = size_class(n)
        fd = self._take(cls)
        return shm.share(data, fd)

    def take_fd(self, n: int) -> int | None:
        """A ready memfd for ``n`` bytes (to fill and seal: :func:`~.shm.sealed`), or ``None``
        when none of its class waits (the next one will)."""
        return self._take(size_class(n))

    def _take(self, cls: int) -> int | None:
        with self._lock:
            fd = self._ready.pop(cls, None)
            if fd is None:
                self.misses += 1
            else:
                self.hits += 1
            if cls <= self.limit:
                if cls in self._wanted:
                    self._wanted.remove(cls)
                self._wanted.append(cls)
                self._trim()
            if self._thread is None:
                self._thread = threading.Thread(target=self._fill, daemon=True,
                                                name="tensorshare-memfd-pool")
                self._thread.start()
        self._wake.set()
        return fd

    def _trim(self) -> None:
        """Keep the wanted classes within ``limit`` (held: ``_lock``)."""
        while sum(self._wanted) > self.limit:
            cls = self._wanted.pop(0)
            fd = self._ready.pop(cls, None)
            if fd is not None:
                os.close(fd)

    def _forked(self) -> None:
        """In a forked child: the parent's memfds are not ours, its thread did not come
        along, and its lock may have been held by that thread when the fork happened."""
        for fd in self._ready.values():
            os.close(fd)  # our copy of the descriptor only: the parent keeps its own
        self._lock = threading.Lock()
        self._ready, self._wanted, self._thread = {}, [], None
        self._wake = threading.Event()

    def _fill(self) -> None:
        """The background thread: make a ready memfd for every wanted class lacking one."""
        wake = self._wake
        while True:
            wake.wait()
            wake.clear()
            while True:
                with self._lock:
                    todo = [c for c in self._wanted if c not in self._ready]
                    if not todo:
                        break
                    cls = todo[-1]
                fd = self._made(cls)
                if fd is None:
                    break
                with self._lock:
                    if cls in self._wanted and cls not in self._ready:
                        self._ready[cls] = fd
                        fd = None
                if fd is not None:
                    os.close(fd)

    @staticmethod
    def _made(cls: int) -> int | None:
        """A memfd of ``cls`` bytes with its pages allocated, or None (out of memory)."""
        fd = shm.new_memfd()
        try:
            os.posix_fallocate(fd, 0, cls)
            return fd
        except OSError:
            os.close(fd)
            return None

    def close(self) -> None:
        """Give the ready memfds back (the pool may be used again)."""
        with self._lock:
            for fd in self._ready.values():
                os.close(fd)
            self._ready = {}
            self._wanted = []


_POOLS: weakref.WeakSet[MemfdPool] = weakref.WeakSet()

SEND_POOL_ENV = "TENSORSHARE_SEND_POOL"
_SEND_POOL_DEFAULT = 256 << 20
_SEND = _OnePerProcess(SEND_POOL_ENV, _SEND_POOL_DEFAULT, MemfdPool)


def send_pool() -> MemfdPool | None:
    """The process's :class:`MemfdPool` (made on first use), which a client's shared-memory
    puts are written into; at most ``TENSORSHARE_SEND_POOL`` bytes (default 256 MiB) wait
    ready, ``0`` turns it off (``None``: each put makes its memfd on the spot)."""
    pool: MemfdPool | None = _SEND.get()
    return pool


def _after_fork_in_child() -> None:
    for one in (_RECEIVE, _SEND):  # (a lock held by a thread the fork did not copy)
        one.lock = threading.Lock()
    for pool in list(_POOLS):
        pool._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)
