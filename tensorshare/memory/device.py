"""Values to and from a device: ``device=`` on every read, and CUDA tensors on their way out.

Reads (:func:`check_device`, :func:`to_device`): the client checks the device *before* it
sends the request (a CPU-only torch gets a ``ValueError`` and nothing leaves its bin), decodes
the reply on the host as always, then copies each ``torch.Tensor`` leaf to the device (numpy
arrays, strings, numbers stay where they are). A copy that fails raises
:class:`~tensorshare.errors.DeviceCopyFailed` carrying the CPU value, so a get loses nothing.

* ``non_blocking=False`` (default): the call returns when the copies are done.
* ``non_blocking=True`` (CUDA): the copies are issued on a side stream, and the caller's
  *current* stream waits on an event recorded after them (``record_stream`` keeps the
  allocator from reusing the memory early). Work the caller then queues on its current stream
  sees the data; work on *another* stream must wait on the current one first. The host
  buffers are held until the event completes (:meth:`~.pinned.PinnedPool.hold`).

Once a read asked for a CUDA device, the process's receive pool takes its large parts from
the pinned pool (:mod:`.pinned`): a buffer that carried a value to the GPU is pinned when it
comes back, so the next value of its size is copied by DMA from page-locked memory.

Puts (:func:`download`): a CUDA tensor is copied once, synchronously, into the memory it is
sent from: a ready memfd of the send pool over ``unix://`` (it then travels as a descriptor),
else a buffer of the pinned pool (pinned once it came back), else (no pool) ``t.cpu()``.

torch is imported lazily; like the rest of ``memory``, this module imports only ``errors``
of the package.
"""

from __future__ import annotations

import math
import mmap
import os
import sys
import threading
from typing import Any

from ..errors import DeviceCopyFailed
from . import shm
from .pinned import pinned_pool
from .pool import receive_pool, send_pool
from .trees import collect, replace

__all__ = ["InFlight", "Stager", "check_device", "copy_async", "download", "host_tensor",
           "load_into", "mark_staged", "memory_stats", "moves", "stage_batch", "to_device", "upload",
           "want_pinned"]


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ValueError("device= needs torch, which is not installed") from None
    return torch


def check_device(device: Any) -> Any:
    """``device`` as a ``torch.device`` (``None``: ``None``), checked before anything is sent.

    ``"cuda"`` means the current CUDA device of the calling thread, fixed now (the copy may
    happen on another thread: the client's reader, a reactor).

    Raises:
        ValueError: not a device, a device this torch cannot use (``"cuda"`` on a torch
            without CUDA), an index beyond the devices there are, or ``"meta"``.
    """
    if device is None:
        return None
    torch = _torch()
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise ValueError(f"device must be a str, an int or a torch.device, not "
                         f"{type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"device={device!r} is not a device: {exc}") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "meta":
        raise ValueError("device='meta' holds no data: a read cannot go there")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but torch.cuda.is_available() is False "
                             f"(torch {torch.__version__}): nothing was sent")
        if dev.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} but this process sees "
                             f"{torch.cuda.device_count()} CUDA devices")
        return dev
    backend = getattr(torch, dev.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        raise ValueError(f"device={device!r}: torch {torch.__version__} cannot use "
                         f"{dev.type!r} devices here")
    return dev


def want_pinned(dev: Any) -> None:
    """A read is about to ask for ``dev``: for a CUDA device, let the process's receive
    pool take its large parts from the pinned pool from now on (see the module docstring)."""
    if dev is None or dev.type != "cuda":
        return
    rp, pp = receive_pool(), pinned_pool()
    if rp is not None and pp is not None and rp.divert is None:
        rp.divert = pp.take


def moves(device: Any) -> bool:
    """Whether a read with this (checked) ``device`` copies anything: not for ``None`` and
    not for the CPU (the value is decoded there)."""
    return device is not None and device.type != "cpu"


# -- reads -----------------------------------------------------------------------------------


def to_device(value: Any, device: Any, *, non_blocking: bool = False,
              whole: Any = None) -> Any:
    """``value`` with every ``torch.Tensor`` leaf (in dicts, lists, tuples) copied to the
    checked ``device``; everything else as it is.

    Args:
        whole: what :class:`DeviceCopyFailed` carries if a copy fails (default ``value``):
            the full result of the call (a fetch's record, a stream read's batch).

    Raises:
        DeviceCopyFailed: a copy failed (out of device memory, a device error); its
            ``value`` is ``whole``, on the CPU, complete.
    """
    torch = sys.modules.get("torch")
    if torch is None or not moves(device):
        return value
    found: list[Any] = []
    collect(value, torch.Tensor, found)
    if not found:
        return value
    try:
        outs = _copy_tensors(found, device, non_blocking)
    except Exception as exc:
        raise DeviceCopyFailed(
            f"the value was received but could not be copied to {device} ({type(exc).__name__}:"
            f" {exc}); it is in this error's .value, on the CPU", value=value if whole is None
            else whole, device=device) from exc
    return replace(value, torch.Tensor, iter(outs))


def _copy_tensors(tensors: list[Any], device: Any, non_blocking: bool) -> list[Any]:
    """The copies of ``tensors`` on ``device`` (the one place a read copies; tests replace it
    to inject a failure)."""
    pool = pinned_pool() if device.type == "cuda" else None
    if pool is not None:
        for t in tensors:
            if t.is_cpu and t.numel():
                pool.staged(t.data_ptr())  # (it comes back pinned, if it is the pool's)
    return _copies(tensors, device, non_blocking, pool)


def _copies(tensors: list[Any], device: Any, non_blocking: bool, pool: Any) -> list[Any]:
    if non_blocking and device.type == "cuda":
        return _cuda_async(tensors, device, pool)
    return [t.to(device) for t in tensors]


_SIDE: dict[Any, Any] = {}
_SIDE_LOCK = threading.Lock()


def _cuda_async(tensors: list[Any], device: Any, pool: Any) -> list[Any]:
    """CUDA only: copy on a side stream; the caller's current stream waits for the copies."""
    import torch

    side = _side_stream(device)
    current = torch.cuda.current_stream(device)
    with torch.cuda.stream(side):
        outs = [t.to(device, non_blocking=True) for t in tensors]
        done = torch.cuda.Event()
        done.record(side)
    current.wait_event(done)
    for o in outs:
        o.record_stream(current)
    if pool is not None:
        pool.hold(tensors, done)  # the host buffers come back once the copies are done
    else:
        done.synchronize()  # (no pool to hold them: keep the sources until done)
    return outs


class InFlight:
    """A value whose copies to a device were issued (:func:`copy_async`) and may still run.
    :meth:`take` orders them before the caller's current stream and returns the value."""

    __slots__ = ("value", "event", "outs")

    def __init__(self, value: Any, event: Any = None, outs: list[Any] | None = None) -> None:
        self.value, self.event, self.outs = value, event, outs or []

    def take(self) -> Any:
        """The value on the device; work queued on the current stream from now on sees it."""
        if self.event is not None:
            import torch

            current = torch.cuda.current_stream(self.outs[0].device)
            current.wait_event(self.event)
            for o in self.outs:
                o.record_stream(current)
        return self.value


def copy_async(value: Any, device: Any) -> InFlight:
    """Issue the copies of ``value``'s tensor leaves to (checked) ``device`` and return at
    once: on a CUDA device they run on a side stream while the caller works (what overlaps
    the copy of the next batch with the step on this one); :meth:`InFlight.take` makes the
    current stream wait for them. Other devices copy at once.

    Raises:
        DeviceCopyFailed: issuing a copy failed (its ``value``: ``value``, on the CPU).
    """
    torch = sys.modules.get("torch")
    if torch is None or not moves(device):
        return InFlight(value)
    found: list[Any] = []
    collect(value, torch.Tensor, found)
    if not found or device.type != "cuda":
        return InFlight(to_device(value, device))
    try:
        outs, event = _issue(found, device)
    except Exception as exc:
        raise DeviceCopyFailed(f"a batch could not be copied to {device} ({type(exc).__name__}:"
                               f" {exc}); it is in this error's .value, on the CPU",
                               value=value, device=device) from exc
    return InFlight(replace(value, torch.Tensor, iter(outs)), event, outs)


def _issue(tensors: list[Any], device: Any) -> tuple[list[Any], Any]:
    """CUDA only: the copies on the side stream, and the event after them."""
    import torch

    pool = pinned_pool()
    if pool is not None:
        for t in tensors:
            if t.is_cpu and t.numel():
                pool.staged(t.data_ptr())
    side = _side_stream(device)
    with torch.cuda.stream(side):
        outs = [t.to(device, non_blocking=True) for t in tensors]
        done = torch.cuda.Event()
        done.record(side)
    if pool is not None:
        pool.hold(tensors, done)
    else:
        done.synchronize()
    return outs, done


def _side_stream(device: Any) -> Any:
    import torch

    with _SIDE_LOCK:
        side = _SIDE.get(device)
        if side is None:
            side = _SIDE[device] = torch.cuda.Stream(device)
        return side


def load_into(targets: dict[str, Any], sources: dict[str, Any]) -> None:
    """Copy each tensor of ``sources`` into the tensor of the same name in ``targets`` (a
    model's own parameters and buffers: no second allocation on the device), and wait for
    the copies. The names must match; shapes are checked by ``copy_``.

    Raises:
        KeyError: a name of ``targets`` is missing from ``sources``, or the other way.
        RuntimeError: a shape or dtype that cannot be copied.
    """
    missing = sorted(set(targets) - set(sources))
    extra = sorted(set(sources) - set(targets))
    if missing or extra:
        raise KeyError(f"the parameters do not match the model: missing {missing[:5]}, "
                       f"unexpected {extra[:5]}")
    import torch

    pool = pinned_pool()
    cuda = False
    with torch.no_grad():
        for name, dest in targets.items():
            src = sources[name]
            if dest.device.type == "cuda" and pool is not None and src.is_cpu and src.numel():
                pool.staged(src.data_ptr())
            cuda = cuda or dest.device.type == "cuda"
            dest.copy_(src, non_blocking=dest.device.type == "cuda")
    if cuda:
        torch.cuda.synchronize()  # (the sources go once this returns)


def host_tensor(t: Any) -> Any:
    """A CPU copy of device tensor ``t`` in the pinned pool's memory (pinned once it came
    back), made synchronously; ``t.cpu()`` where there is no pool. For results about to be
    sent (an inference host's outputs)."""
    import torch

    n = t.numel() * t.element_size()
    pool = pinned_pool()
    if t.is_cpu or pool is None or not n or t.device.type != "cuda":
        return t.detach().cpu()
    part = pool.take(n)
    host = torch.frombuffer(part, dtype=torch.uint8, count=n).view(t.dtype).view(t.shape)
    host.copy_(t.detach())
    pool.staged(host.data_ptr())
    return host


def upload(t: Any, device: Any) -> Any:
    """CPU tensor ``t`` on CUDA ``device`` in one copy queued on the current stream (work
    queued after it sees the data); ``t``'s memory is held until the copy completed."""
    import torch

    pool = pinned_pool()
    if pool is not None and t.numel():
        pool.staged(t.data_ptr())
    out = t.to(device, non_blocking=True)
    if pool is not None:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        pool.hold([t], done)
    return out


def mark_staged(value: Any) -> None:
    """Mark the host memory of ``value``'s CPU tensors as carried to a device (the pinned
    pool pins it when it comes back: for a caller that copies them itself)."""
    torch = sys.modules.get("torch")
    pool = pinned_pool()
    if torch is None or pool is None:
        return
    found: list[Any] = []
    collect(value, torch.Tensor, found)
    for t in found:
        if t.is_cpu and t.numel():
            pool.staged(t.data_ptr())


def stage_batch(parts: list[Any]) -> Any:
    """``torch.cat(parts)`` into the pinned pool's memory (the inputs of an inference
    batch, about to be copied to the device in one copy); a plain ``cat`` without a pool."""
    import torch

    first = parts[0]
    shape = (sum(int(p.shape[0]) for p in parts), *first.shape[1:])
    n = math.prod(shape) * first.element_size()
    pool = pinned_pool()
    if pool is None or not n:
        return torch.cat(parts)
    part = pool.take(n)
    out = torch.frombuffer(part, dtype=torch.uint8, count=n).view(first.dtype).view(shape)
    torch.cat(parts, out=out)
    return out


def memory_stats() -> dict[str, Any]:
    """This process's GPU-path memory: ``pinned`` (the pinned pool's ``pinned_bytes``,
    ``idle``, ``registered``, ``reused``, ``fresh``, ``in_flight``; ``None`` when it is off
    or not made yet) and ``ipc`` (its CUDA IPC rings: ``rings``, ``slots``, ``slot_bytes``,
    ``exported``, ``fallbacks``, and ``open``: producers' rings it reads). The server cannot
    see these (they live in the clients): ask each process."""
    from . import pinned
    from .ipc import ipc_stats

    pool = pinned._PROCESS.pool
    return {"pinned": None if pool is None else pool.stats(), "ipc": ipc_stats()}


# -- puts ------------------------------------------------------------------------------------


class Stager:
    """What the codec calls for a tensor that is not on the CPU (a put of a CUDA tensor):
    ``stager(t)`` copies it once into the memory it is sent from and returns ``(view,
    shared)`` (``shared``: the sealed memfd it is in, or ``None``), or ``None`` (the codec
    then does ``t.cpu()``).

    Args:
        share_min_bytes: the connection passes memfds of at least this many bytes
            (``None``: it does not).
    """

    __slots__ = ("share_min_bytes",)

    def __init__(self, share_min_bytes: int | None) -> None:
        self.share_min_bytes = share_min_bytes

    def __call__(self, t: Any) -> tuple[memoryview, Any] | None:
        return download(t, self.share_min_bytes)


def download(t: Any, share_min_bytes: int | None = None) -> tuple[memoryview, Any] | None:
    """Copy contiguous device tensor ``t`` once into host memory it can be sent from (see
    :class:`Stager`)."""
    n = t.numel() * t.element_size()
    if not n or t.device.type != "cuda":
        return None
    if share_min_bytes is not None and n >= share_min_bytes and shm.available():
        mem = _into_memfd(t, n)
        return mem.view, mem
    pool = pinned_pool()
    if pool is None:
        return None
    part = pool.take(n)
    _fill(part, t, n)
    pool.staged(_address(part))
    return part.toreadonly(), None


def _address(view: memoryview) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _fill(dest: Any, t: Any, n: int) -> None:
    """Copy ``t``'s bytes into writable host buffer ``dest`` (synchronously: a
    device-to-host copy read before it completes would send garbage)."""
    import torch

    host = torch.frombuffer(dest, dtype=torch.uint8, count=n)
    host.view(t.dtype).copy_(t.reshape(-1))
    del host


def _into_memfd(t: Any, n: int) -> Any:
    pool = send_pool()
    fd = pool.take_fd(n) if pool is not None else None
    if fd is None:
        fd = shm.new_memfd()
    try:
        os.ftruncate(fd, n)
        mm = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            _fill(mm, t, n)
        finally:
            mm.close()  # (no writable mapping may be left for the seal)
    except BaseException:
        os.close(fd)
        raise
    return shm.sealed(fd, n)
