"""Shared memory for large tensors between processes on one machine.

Over a Unix socket, a buffer of at least ``shm_min_bytes`` can travel as a **sealed memfd**
instead of through the socket: the sender writes the bytes once into an anonymous memory
file (``memfd_create``), seals it (no writing, growing or shrinking, ever again) and passes
its file descriptor along with the frame (``SCM_RIGHTS``); the receiver maps it. The server
keeps the mapping as the stored item and passes the same descriptor to readers, who map it
copy-on-write: a get costs no copy at all, a put one write into the memfd.

Nothing is ever named in ``/dev/shm``: a memfd lives exactly as long as some process holds
its descriptor or a mapping of it, so whatever happens (a bin changes, a client is killed,
the server crashes) the kernel frees it with the last holder. The seals are checked before
anything is mapped, so no peer can shrink a file under a mapping (which would crash the
reader with SIGBUS) or change a stored value afterwards.

Linux only (memfd and file seals); elsewhere :func:`available` is false and everything
travels through the socket.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import sys
import weakref
from typing import Any

__all__ = ["SharedMemory", "available", "new_memfd", "receive", "sealed", "share"]

_SEALS = 0
if sys.platform.startswith("linux") and hasattr(os, "memfd_create"):
    _SEALS = (getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0)
              | getattr(fcntl, "F_SEAL_WRITE", 0) | getattr(fcntl, "F_SEAL_SEAL", 0))


def available() -> bool:
    """Whether this platform can pass sealed memfds (Linux)."""
    return _SEALS != 0 and hasattr(fcntl, "F_ADD_SEALS")


class SharedMemory:
    """A sealed memfd and a mapping of it; the descriptor closes when this object goes.

    Attributes:
        fd: the descriptor (pass it with ``SCM_RIGHTS``; do not close it yourself).
        size: bytes in the file.
        view: a memoryview of the mapping (read-only, or copy-on-write writable).
    """

    __slots__ = ("fd", "size", "view", "_map", "__weakref__")

    def __init__(self, fd: int, size: int, writable: bool) -> None:
        self.fd = fd
        self.size = size
        self._map: mmap.mmap | None = None
        if size:
            if writable:  # private: the caller's writes never reach the shared file
                self._map = mmap.mmap(fd, size, mmap.MAP_PRIVATE,
                                      mmap.PROT_READ | mmap.PROT_WRITE)
                self.view = memoryview(self._map)
            else:
                self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
                self.view = memoryview(self._map).toreadonly()
        else:
            self.view = memoryview(b"")
        weakref.finalize(self, os.close, fd)


def new_memfd() -> int:
    """An empty, unsealed memfd (close-on-exec, sealable)."""
    return os.memfd_create("tensorshare", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)


def share(data: Any, fd: int | None = None) -> SharedMemory:
    """Write ``data`` (bytes-like) into a sealed memfd and map it read-only.

    Args:
        fd: an unsealed memfd of at least the data's size to use (its pages allocated
            already: see :class:`~tensorshare.memory.pool.MemfdPool`); taken over. Default: a new one.

    Raises:
        OSError: the memfd could not be made (e.g. out of memory).
    """
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    n = len(view)
    if fd is None:
        fd = new_memfd()
    try:
        os.ftruncate(fd, n)  # (a pooled memfd shrinks to the size: its tail pages go)
        done = 0
        while done < n:  # one copy, by the kernel; no page faults in this process
            done += os.pwrite(fd, view[done:], done)
    except BaseException:
        os.close(fd)
        raise
    return sealed(fd, n)


def sealed(fd: int, n: int) -> SharedMemory:
    """Seal memfd ``fd`` (its ``n`` bytes written, no writable mapping of it left) and map it
    read-only. Takes ownership of ``fd`` (closed at once on error).

    Raises:
        OSError: it cannot be sealed (a writable mapping of it is still there).
    """
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        return SharedMemory(fd, n, writable=False)
    except BaseException:
        os.close(fd)
        raise


def receive(fd: int, size: int, *, writable: bool) -> SharedMemory:
    """Adopt a descriptor a peer passed: check that it is a sealed memfd of ``size`` bytes,
    then map it (``writable``: copy-on-write, for a tensor the caller may change).

    Takes ownership of ``fd`` (it is closed when the result goes, or at once on error).

    Raises:
        ValueError: not a memfd sealed against writing, growing and shrinking, or not
            ``size`` bytes long.
    """
    try:
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            raise ValueError("a shared buffer's descriptor is not a sealable memfd") from None
        if seals & _SEALS != _SEALS:
            raise ValueError("a shared buffer's memfd is not sealed against writing, growing "
                             "and shrinking")
        actual = os.fstat(fd).st_size
        if actual != size:
            raise ValueError(f"a shared buffer's memfd holds {actual} bytes, not {size}")
        return SharedMemory(fd, size, writable)
    except BaseException:
        os.close(fd)
        raise

