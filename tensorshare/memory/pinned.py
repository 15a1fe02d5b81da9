"""Pinned (page-locked) host memory for copies to and from a GPU, reused rather than made anew.

A copy between host memory and a GPU runs at full speed, and asynchronously, only from
page-locked memory; from ordinary (pageable) memory the driver first copies through a staging
buffer of its own. Pinning costs about as much as one copy of the memory (pytorch#32167), so
it pays only for memory that is used again: this pool pins its buffers once and reuses them.

:class:`PinnedPool` stands beside the receive pool (:mod:`.pool`), with the same size
classes. Its rules:

* **Pinned on its way back, never on first use.** A fresh buffer is an ordinary anonymous
  mapping (a peer that announces much and sends little costs what it sent, as in
  :mod:`.pool`). It is pinned when it comes back for reuse, and only if it held a complete
  value that went to a device (:meth:`PinnedPool.staged`): a frame a peer announced and did
  not send is never decoded, so never staged, so never pinned (pinning would fault in, and
  lock, every page of it).
* **In flight until its copy completed.** A buffer whose asynchronous copy was issued is
  held (:meth:`PinnedPool.hold`) until that copy's event says it is done.
* **Unpinned before unmapped**, whenever a buffer leaves the pool (:meth:`~PinnedPool.trim`,
  the limit).
* **A forked child starts empty**: CUDA state does not survive ``fork``; the child forgets
  the parent's buffers (its copy-on-write copies are unmapped, never unpinned).
* **Bounded**: at most ``limit`` bytes idle, and at most ``limit`` bytes pinned;
  ``TENSORSHARE_PINNED_POOL`` sets the limit of the process's pool (default 256 MiB),
  ``0`` turns it off.

Who pins is a *registrar* (``register(address, nbytes)``, ``unregister(address)``): by
default :class:`CudaRegistrar` (``cudaHostRegister`` through ``torch.cuda.cudart()``, as
torch's own ``_pin_memory_utils`` does); the tests inject a fake and check the bookkeeping
on any machine. This module imports neither torch nor the wire.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .pool import size_class

__all__ = ["PINNED_POOL_ENV", "CudaRegistrar", "PinnedPool", "Registrar", "pinned_pool",
           "reset_pinned_pool"]

log = logging.getLogger("tensorshare.memory")

#: The environment variable with the process's pinned-pool limit in bytes (0: no pool).
PINNED_POOL_ENV = "TENSORSHARE_PINNED_POOL"
_PINNED_POOL_DEFAULT = 256 << 20
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context


class Registrar(Protocol):
    """What pins host memory: ``register`` raises if it cannot."""

    def register(self, address: int, nbytes: int) -> None: ...

    def unregister(self, address: int) -> None: ...


class CudaRegistrar:
    """``cudaHostRegister`` / ``cudaHostUnregister`` through ``torch.cuda.cudart()`` (CUDA
    only; the one place this module touches torch)."""

    def register(self, address: int, nbytes: int) -> None:
        import torch

        err = int(torch.cuda.cudart().cudaHostRegister(address, nbytes,
                                                        _HOST_REGISTER_PORTABLE))
        if err != 0:
            raise OSError(f"cudaHostRegister of {nbytes} bytes failed (cudaError {err})")

    def unregister(self, address: int) -> None:
        import torch

        err = int(torch.cuda.cudart().cudaHostUnregister(address))
        if err != 0:
            raise OSError(f"cudaHostUnregister failed (cudaError {err})")


@dataclass(eq=False)
class _Map:
    """One mapping of the pool and what the pool knows of it."""

    mm: mmap.mmap
    cls: int  # its size (a size class)
    address: int
    staged: bool = False  # it held a complete value on its way to a device
    pinned: bool = False


def _address_of(mm: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


class PinnedPool:
    """Reusable host buffers that are pinned once they prove worth it (see the module
    docstring). Thread-safe.

    Args:
        limit: the most idle bytes kept, and the most bytes pinned at once.
        registrar: what pins (default :class:`CudaRegistrar`).
        background: pin in a background thread (default) or at once, in the thread that
            gave the buffer back (``False``: for tests).
    """

    def __init__(self, limit: int = _PINNED_POOL_DEFAULT, registrar: Registrar | None = None,
                 *, background: bool = True) -> None:
        self.limit = limit
        self.registrar: Registrar = registrar if registrar is not None else CudaRegistrar()
        self.background = background
        self._lock = threading.Lock()
        self._free: dict[int, list[_Map]] = {}  # by class; pinned ones last (taken first)
        self._live: dict[int, _Map] = {}  # address -> the mappings handed out
        self._in_flight: list[tuple[Any, Any]] = []  # (event, what it keeps alive)
        self._jobs: queue.SimpleQueue[_Map | None] | None = None
        self.idle = 0  # bytes (by class) waiting in the free lists
        self.pinned_bytes = 0  # bytes pinned now (idle or in use)
        self.registered = 0  # registrations made (statistics)
        self.reused = 0  # buffers served from the free lists
        self.fresh = 0  # buffers served from new mappings
        self.failed = False  # pinning failed once: no more tries
        _POOLS.add(self)

    # -- taking and giving back -------------------------------------------------------------
    def take(self, n: int) -> memoryview:
        """``n`` writable bytes, given back when the returned view and every view of it are
        gone (a pinned one when one of the class waits)."""
        import numpy as np  # (the weakly referencable owner, as in pool.BufferPool)

        cls = size_class(n)
        self.poll()
        with self._lock:
            free = self._free.get(cls)
            m = free.pop() if free else None
            if m is not None:
                self.idle -= cls
                self.reused += 1
            else:
                self.fresh += 1
        if m is None:
            mm = mmap.mmap(-1, cls, flags=mmap.MAP_PRIVATE)
            m = _Map(mm, cls, _address_of(mm))
        with self._lock:
            self._live[m.address] = m
        owner = np.frombuffer(m.mm, dtype=np.uint8)
        weakref.finalize(owner, self._give_back, m)
        return owner.data[:n]

    def staged(self, address: int) -> bool:
        """Mark the buffer holding ``address`` as one that held a complete value on its way
        to (or from) a device: it is pinned when it comes back. Returns whether the address
        is in one of this pool's buffers."""
        with self._lock:
            for m in self._live.values():
                if m.address <= address < m.address + m.cls:
                    m.staged = True
                    return True
        return False

    def is_pinned(self, address: int) -> bool:
        """Whether ``address`` lies in a buffer of this pool that is pinned now."""
        with self._lock:
            return any(m.pinned and m.address <= address < m.address + m.cls
                       for m in self._live.values())

    def _give_back(self, m: _Map) -> None:
        with self._lock:
            self._live.pop(m.address, None)
            keep = self.idle + m.cls <= self.limit
            pin = keep and m.staged and not m.pinned and not self.failed and \
                self.pinned_bytes + m.cls <= self.limit
            if pin:
                self.pinned_bytes += m.cls  # (reserved now: the limit holds meanwhile)
        if not keep:
            self._drop(m)
        elif pin:
            if self.background:
                self._queue().put(m)
            else:
                self._pin(m)
        else:
            self._shelve(m)

    def _shelve(self, m: _Map) -> None:
        with self._lock:
            if self.idle + m.cls <= self.limit:
                lst = self._free.setdefault(m.cls, [])
                # pinned ones at the end: take() pops them first
                lst.append(m) if m.pinned else lst.insert(0, m)
                self.idle += m.cls
                return
        self._drop(m)

    def _pin(self, m: _Map) -> None:
        try:
            self.registrar.register(m.address, m.cls)
            m.pinned = True
            with self._lock:
                self.registered += 1
        except Exception as exc:  # (no CUDA after all, a driver refusal): stay pageable
            with self._lock:
                self.pinned_bytes -= m.cls
                self.failed = True
            log.warning("tensorshare: pinning host memory failed (%s); copies to the GPU go "
                        "from pageable memory", exc)
        self._shelve(m)

    def _drop(self, m: _Map) -> None:
        """Unpin (first), then unmap."""
        if m.pinned:
            try:
                self.registrar.unregister(m.address)
            except Exception as exc:
                log.warning("tensorshare: unpinning host memory failed: %s", exc)
            m.pinned = False
            with self._lock:
                self.pinned_bytes -= m.cls
        try:
            m.mm.close()
        except BufferError:  # a view was taken just now: it unmaps when that goes
            pass

    def _queue(self) -> queue.SimpleQueue[_Map | None]:
        with self._lock:
            if self._jobs is None:
                self._jobs = queue.SimpleQueue()
                threading.Thread(target=self._pinner, args=(self._jobs,), daemon=True,
                                 name="tensorshare-pinner").start()
            return self._jobs

    def _pinner(self, jobs: queue.SimpleQueue[_Map | None]) -> None:
        while True:
            m = jobs.get()
            if m is None or jobs is not self._jobs:
                return
            self._pin(m)

    # -- copies in flight -------------------------------------------------------------------
    def hold(self, keep: Any, event: Any) -> None:
        """Keep ``keep`` (the source tensors of an asynchronous copy) alive until
        ``event.query()`` says the copy completed: their buffers come back only then."""
        with self._lock:
            self._in_flight.append((event, keep))

    def poll(self) -> int:
        """Let go of the copies that completed. Returns how many are still in flight."""
        with self._lock:
            flights = self._in_flight
            if not flights:
                return 0
            done: list[tuple[Any, Any]] = []
            left_: list[tuple[Any, Any]] = []
            for f in flights:
                (done if f[0].query() else left_).append(f)
            self._in_flight = left_
            left = len(left_)
        del done  # (the sources go here, outside the lock: their finalizers take it)
        return left

    @property
    def in_flight(self) -> int:
        """Copies whose sources are held until they complete."""
        return len(self._in_flight)

    # -- the rest ---------------------------------------------------------------------------
    def trim(self, keep: int = 0) -> int:
        """Unpin and unmap idle buffers until at most ``keep`` idle bytes are left.

        Returns:
            The bytes (by class) given back.
        """
        dropped: list[_Map] = []
        with self._lock:
            for cls in sorted(self._free, reverse=True):
                lst = self._free[cls]
                while lst and self.idle > keep:
                    dropped.append(lst.pop(0))
                    self.idle -= cls
            self._free = {c: lst for c, lst in self._free.items() if lst}
        for m in dropped:
            self._drop(m)
        return sum(m.cls for m in dropped)

    def stats(self) -> dict[str, int]:
        """``pinned_bytes``, ``idle``, ``registered``, ``reused``, ``fresh``, ``in_flight``."""
        return {"pinned_bytes": self.pinned_bytes, "idle": self.idle,
                "registered": self.registered, "reused": self.reused, "fresh": self.fresh,
                "in_flight": self.in_flight}

    def _forked(self) -> None:
        """In a forked child: nothing the parent pinned is pinned here, its thread did not
        come along, its lock may have been held. Forget it all (unmapping our copies)."""
        maps = [m for lst in self._free.values() for m in lst]
        self._lock = threading.Lock()
        self._free, self._live, self._in_flight, self._jobs = {}, {}, [], None
        self.idle = self.pinned_bytes = self.registered = self.reused = self.fresh = 0
        for m in maps:
            try:
                m.mm.close()
            except BufferError:
                pass


_POOLS: weakref.WeakSet[PinnedPool] = weakref.WeakSet()


class _Process:
    """The process's pool, made on first use from ``TENSORSHARE_PINNED_POOL``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pool: PinnedPool | None = None
        self.off = False
        self.make: Callable[[int], PinnedPool] = PinnedPool


_PROCESS = _Process()


def pinned_pool() -> PinnedPool | None:
    """The process's pinned pool (``None`` when ``TENSORSHARE_PINNED_POOL=0``), made on
    first use. A read with a CUDA ``device=`` receives its large parts into it (see
    :func:`tensorshare.memory.pool.receive_pool`); a put of a CUDA tensor over TCP copies
    into it before sending."""
    p = _PROCESS
    with p.lock:
        if p.pool is None and not p.off:
            try:
                limit = int(os.environ.get(PINNED_POOL_ENV, _PINNED_POOL_DEFAULT))
            except ValueError:
                limit = _PINNED_POOL_DEFAULT
            if limit <= 0:
                p.off = True
            else:
                p.pool = p.make(limit)
        return p.pool


def reset_pinned_pool(make: Callable[[int], PinnedPool] | None = None) -> None:
    """Forget the process's pool (trimmed first), so the next :func:`pinned_pool` reads the
    environment again and builds it with ``make`` (for tests: a fake registrar)."""
    p = _PROCESS
    with p.lock:
        old, p.pool, p.off = p.pool, None, False
        p.make = make if make is not None else PinnedPool
    if old is not None:
        old.trim()


def _after_fork_in_child() -> None:
    _PROCESS.lock = threading.Lock()
    for pool in list(_POOLS):
        pool._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)
