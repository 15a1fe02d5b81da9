"""Same-host CUDA IPC: a producer's CUDA tensors read by other processes on its host and GPU
without a trip through host memory. Opt-in (``serve_loader(..., device_ipc=True)``, or a
:class:`CudaIpcRing` of your own for explicit puts); the server never touches CUDA.

**The producer** owns a ring of ``slots`` slots in one dedicated GPU allocation (from a
private memory pool where torch has one, so no neighbouring allocation is exposed). Its CUDA
IPC handle is made once, for the whole ring. Each :meth:`CudaIpcRing.export` copies an item's
CUDA tensors into the next slot (on the caller's current stream), records a fresh
interprocess event after the copy, and replaces each tensor by an :class:`IpcTensor`: the
descriptor that travels as the codec's ext 4 (docs/PROTOCOL.md §5.2: handle bytes, offsets,
the GPU's UUID and the host's boot id, the slot and its generation; no pickle).

**A consumer** (:func:`copy_out`, which the client hands the codec on a ``unix://``
connection) checks that it is on the producer's host (boot id) and finds the GPU by its UUID
(not by index: ``CUDA_VISIBLE_DEVICES`` renumbers), opens the ring once (cached), makes its
current stream wait on the item's event, copies the tensor into memory it owns and waits for
that copy, all before the read returns, so before its next read acknowledges the item. A
dead consumer therefore costs the producer nothing.

**Slot reuse.** A stream's producer reuses a slot only after the stream's window proved every
live consumer past it (``slots = window + 2``). A consumer that is not held to the window (a
detached laggard, a plain bin read late) is caught by the **generation table**: a small memfd
of the producer (one int64 per slot, read through ``/proc/<pid>/fd/<n>``) that the producer
bumps *before* it writes a slot again. The consumer checks the slot's generation before and
after its copy: a change means the slot was reused, and the read gives ``Lagged``, never
wrong data.

**When IPC cannot work** (no CUDA; WSL2; ``expandable_segments`` in
``PYTORCH_CUDA_ALLOC_CONF``; a sandbox where another process cannot open the handle;
``TENSORSHARE_CUDA_IPC=0``), the ring's first export finds out (a probe: a child process
opens a small pattern through the ring and checks it), says so once in the log, and every
item travels through host memory as without IPC.

This module imports torch lazily and only ``errors`` of the package. The functions that touch
CUDA are small and marked "CUDA only"; nothing here runs on a machine without a GPU except
the bookkeeping the tests check.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import struct
import subprocess
import sys
import threading
import uuid
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any

from ..errors import CodecError, Lagged, ProducerGone
from .trees import collect, replace

__all__ = ["IPC_ENV", "CudaIpcRing", "IpcTensor", "SlotReused", "boot_id", "copy_out",
           "ipc_stats"]

log = logging.getLogger("tensorshare.memory")

#: ``TENSORSHARE_CUDA_IPC=0`` turns CUDA IPC off (every item through host memory);
#: ``=fail-probe`` makes the probe fail (to test the fallback).
IPC_ENV = "TENSORSHARE_CUDA_IPC"
_ALIGN = 256  # each tensor of a slot starts at a multiple of this many bytes
_HEADER = 16  # the generation table starts with the ring's id
_PROBE_GEN = 1  # the probe's generation; items get 2, 3, ...
_PROBE_BYTES = 4096
_PROBE_TIMEOUT = 120.0
_MAX_OPEN = 16  # rings a consumer process keeps open


class SlotReused(Lagged):
    """A cuda-ipc item's slot was written again before this reader copied it out (it read
    too late). ``samples``: the first dimension of the tensor it was reading."""

    def __init__(self, message: str, *, samples: int | None = None) -> None:
        super().__init__(message, missed=1)
        self.samples = samples


class IpcTensor:
    """A CUDA tensor in a :class:`CudaIpcRing` slot, as it travels: its descriptor (the
    codec packs it as ext 4)."""

    __slots__ = ("fields",)

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def __tensorshare_cuda_ipc__(self) -> dict[str, Any]:
        return self.fields

    def __repr__(self) -> str:
        f = self.fields
        return f"<IpcTensor {f['dtype']}{f['shape']} slot {f['slot']} gen {f['gen']}>"


# -- this host, these GPUs ------------------------------------------------------------------

_BOOT: bytes | None = None


def boot_id() -> bytes:
    """This host's boot id (16 bytes; zeros where the kernel does not say)."""
    global _BOOT
    if _BOOT is None:
        try:
            text = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
            _BOOT = uuid.UUID(text).bytes
        except (OSError, ValueError):
            _BOOT = bytes(16)
    return _BOOT


def _torch() -> Any:
    import torch

    return torch


def gpu_uuid(index: int) -> bytes:
    """CUDA only: the UUID of this process's CUDA device ``index`` (16 bytes)."""
    props = _torch().cuda.get_device_properties(index)
    return bytes(props.uuid.bytes)


def local_index(gpu: bytes) -> int | None:
    """CUDA only: this process's index of the GPU with UUID ``gpu`` (``None``: not seen)."""
    torch = _torch()
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == gpu:
            return i
    return None


def why_not(device_type: str = "cuda") -> str | None:
    """Why CUDA IPC cannot be used in this process (``None``: nothing known against it; the
    probe has the last word)."""
    if os.environ.get(IPC_ENV, "") == "0":
        return f"{IPC_ENV}=0"
    if not sys.platform.startswith("linux"):
        return "not Linux"
    if device_type != "cuda":
        return f"a {device_type!r} device (CUDA IPC is for CUDA devices)"
    try:
        torch = _torch()
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} has no CUDA here"
    try:
        if "microsoft" in Path("/proc/version").read_text().lower():
            return "WSL2 (its CUDA has no IPC)"
    except OSError:
        pass
    if "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").lower(
    ).replace(" ", ""):
        return ("PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True (its memory cannot be "
                "shared with a CUDA IPC handle everywhere)")
    return None


# -- the producer ---------------------------------------------------------------------------

_WARNED: set[str] = set()
_PROBED: dict[Any, str | None] = {}  # device -> why the probe failed (None: it passed)
_RINGS: weakref.WeakSet[CudaIpcRing] = weakref.WeakSet()
_RINGS_LOCK = threading.Lock()


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        log.warning("tensorshare: CUDA IPC is not used (%s); GPU tensors travel through host "
                    "memory instead", reason)


class _GenTable:
    """The ring's generation table: a memfd of ``16 + 8 * slots`` bytes (the ring's id, then
    one little-endian int64 per slot), shared with consumers through ``/proc``."""

    def __init__(self, ring_id: bytes, slots: int) -> None:
        self.fd = os.memfd_create("tensorshare-ipc-gen", os.MFD_CLOEXEC)
        size = _HEADER + 8 * slots
        os.ftruncate(self.fd, size)
        self.map = mmap.mmap(self.fd, size, mmap.MAP_SHARED,
                             mmap.PROT_READ | mmap.PROT_WRITE)
        self.map[:_HEADER] = ring_id

    def set(self, slot: int, gen: int) -> None:
        struct.pack_into("<q", self.map, _HEADER + 8 * slot, gen)

    def close(self) -> None:
        """Mark the ring closed (a consumer holding the table open sees its id gone), then
        let go of it."""
        self.map[:] = bytes(len(self.map))
        self.map.close()
        os.close(self.fd)


class CudaIpcRing:
    """A producer's ring of GPU slots for same-host CUDA IPC (see the module docstring).

    Args:
        slots: how many items may be in flight (a stream: ``window + 2``).
        device: the CUDA device of the tensors it carries (default: the current one).
        slot_bytes: each slot's size (default: the first item's CUDA bytes, plus a quarter,
            rounded up to 1 MiB). An item whose CUDA tensors need more travels through host
            memory (counted in ``fallbacks``).
        probe: check once per process, with a child process, that another process can open
            the ring (default); ``False`` trusts :func:`why_not` alone.
    """

    def __init__(self, slots: int, *, device: Any = None, slot_bytes: int | None = None,
                 probe: bool = True) -> None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be a positive int, not {slots!r}")
        if slot_bytes is not None and (not isinstance(slot_bytes, int) or slot_bytes < 1):
            raise ValueError(f"slot_bytes must be a positive int, not {slot_bytes!r}")
        self.slots, self.slot_bytes, self.probe = slots, slot_bytes, probe
        self.device = device
        self.ring_id = secrets.token_bytes(16)
        self.reason: str | None = None  # why IPC is not used (set: every item goes by host)
        self.exported = 0  # items exported through the ring
        self.fallbacks = 0  # items that went through host memory instead
        self._buf: Any = None  # the ring's GPU memory (uint8)
        self._pool: Any = None  # its private memory pool, if torch has them
        self._share: tuple[Any, ...] | None = None  # the handle's fields, made once
        self._table: _GenTable | None = None
        self._events: list[Any] = [None] * slots  # the event of each slot's item
        self._common: dict[str, Any] = {}

    # -- export -----------------------------------------------------------------------------
    def export(self, value: Any) -> Any:
        """``value`` with each CUDA tensor (of the ring's device) copied into the next slot
        and replaced by its :class:`IpcTensor`; the rest as it is. ``value`` as it is when
        IPC is not used (see ``reason``) or the item does not fit a slot."""
        torch = sys.modules.get("torch")
        if torch is None or self.reason is not None and self._buf is None:
            return self._fallback(value)
        found: list[Any] = []
        collect(value, torch.Tensor, found, cuda_only=True)
        if not found:
            return value
        sizes = [_aligned(t.numel() * t.element_size()) for t in found]
        if not self._ready(sum(sizes), found[0].device):
            return self._fallback(value)
        if sum(sizes) > self._slot_bytes():
            _warn_once(f"an item of {sum(sizes)} bytes does not fit the ring's slots of "
                       f"{self._slot_bytes()} bytes (slot_bytes=)")
            return self._fallback(value)
        descs = self._write(found, sizes)
        it = iter(descs)
        return replace(value, torch.Tensor, it, cuda_only=True)

    def _fallback(self, value: Any) -> Any:
        self.fallbacks += 1
        return value

    def _slot_bytes(self) -> int:
        assert self.slot_bytes is not None
        return self.slot_bytes

    def _ready(self, need: int, device: Any) -> bool:
        """The ring exists, or is made now (and probed): whether IPC is used."""
        if self._buf is not None:
            return True
        if self.reason is not None:
            return False
        reason = why_not(device.type)
        if reason is None:
            if self.slot_bytes is None:
                self.slot_bytes = -(-max(need * 5 // 4, 1) // (1 << 20)) * (1 << 20)
            try:
                self._make(device)
                reason = self._probed()
            except Exception as exc:  # (an allocator or driver refusal)
                reason = f"the ring could not be shared: {type(exc).__name__}: {exc}"
        if reason is not None:
            self.reason = reason
            self._release()
            _warn_once(reason)
            return False
        return True

    def _make(self, device: Any) -> None:
        """CUDA only: allocate the ring (its own pool), make its handle once, the table."""
        torch = _torch()
        self.device = device if self.device is None else torch.device(self.device)
        total = self.slots * self._slot_bytes() + _PROBE_BYTES
        with torch.cuda.device(self.device):
            mem_pool = getattr(torch.cuda, "MemPool", None)
            use = getattr(torch.cuda, "use_mem_pool", None)
            if mem_pool is not None and use is not None:
                self._pool = mem_pool()
                with use(self._pool):
                    self._buf = torch.empty(total, dtype=torch.uint8, device=self.device)
            else:
                self._buf = torch.empty(total, dtype=torch.uint8, device=self.device)
            self._share = self._buf.untyped_storage()._share_cuda_()
        self._table = _GenTable(self.ring_id, self.slots + 1)  # (+1: the probe's slot)
        _dev, handle, ssize, soff, rc, rco = self._share[:6]
        # torch counts the share as one reader that will let go, and keeps the memory of a
        # shared storage whose count is not exactly 0 when it is freed ("limbo", until this
        # process exits). Our readers copy out and never report back (they open the ring
        # with a counter name that does not exist: _UNCOUNTED), and the ring is freed only
        # after the stream drained: give the one count back now, so that close() frees the
        # ring whatever happened to the readers (seen on an H100, torch 2.11: a killed or a
        # second reader otherwise leaves it allocated).
        torch.UntypedStorage._release_ipc_counter_cuda(bytes(rc), int(rco))
        self._common = {"v": 1, "uuid": gpu_uuid(self.device.index or 0), "boot": boot_id(),
                        "pid": os.getpid(), "ring": self.ring_id, "gfd": self._table.fd,
                        "h": bytes(handle), "ssize": int(ssize), "soff": int(soff)}
        with _RINGS_LOCK:
            _RINGS.add(self)

    def _write(self, tensors: list[Any], sizes: list[int]) -> list[IpcTensor]:
        """CUDA only: the item's tensors into the next slot, on the current stream."""
        torch = _torch()
        assert self._table is not None and self._buf is not None
        slot = self.exported % self.slots
        gen = self.exported + 2
        self.exported += 1
        self._table.set(slot, gen)  # before anything is written into the slot again
        at = slot * self._slot_bytes()
        descs = []
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device)
            for t, size in zip(tensors, sizes, strict=True):
                n = t.numel() * t.element_size()
                if n:
                    self._buf[at:at + n].view(t.dtype).view(t.shape).copy_(t)
                descs.append(self._desc(t, at, slot, gen))
                at += size
            ev = torch.cuda.Event(interprocess=True)
            ev.record(stream)
        self._events[slot] = ev  # (the slot's previous item's event goes now)
        handle = bytes(ev.ipc_handle())
        for d in descs:
            d.fields["ev"] = handle
        return descs

    def _desc(self, t: Any, at: int, slot: int, gen: int) -> IpcTensor:
        shape = list(t.shape)
        stride, acc = [0] * len(shape), 1
        for i in range(len(shape) - 1, -1, -1):
            stride[i] = acc
            acc *= max(shape[i], 1)
        return IpcTensor({**self._common, "ev": b"", "dtype": _wire_dtype(t.dtype),
                          "shape": shape, "stride": stride, "off": at // t.element_size(),
                          "slot": slot, "gen": gen})

    # -- the probe --------------------------------------------------------------------------
    def _probed(self) -> str | None:
        """Why another process cannot read this ring (``None``: it can), checked once per
        process and device by a child that opens a pattern written into the probe slot."""
        key = (str(self.device), self.probe)
        if key in _PROBED:
            return _PROBED[key]
        if os.environ.get(IPC_ENV, "") == "fail-probe":
            reason: str | None = f"the probe was made to fail ({IPC_ENV}=fail-probe)"
        elif not self.probe:
            reason = None
        else:
            reason = self._run_probe()
        _PROBED[key] = reason
        return reason

    def _run_probe(self) -> str | None:
        """CUDA only: write a pattern into the probe slot; a child copies it out."""
        import msgpack

        torch = _torch()
        assert self._table is not None and self._buf is not None
        at = self.slots * self._slot_bytes()
        pattern = torch.arange(_PROBE_BYTES, dtype=torch.int64, device=self.device) % 251
        self._table.set(self.slots, _PROBE_GEN)
        with torch.cuda.device(self.device):
            self._buf[at:at + _PROBE_BYTES].copy_(pattern.to(torch.uint8))
            ev = torch.cuda.Event(interprocess=True)
            ev.record(torch.cuda.current_stream(self.device))
        fields = {**self._common, "ev": bytes(ev.ipc_handle()), "dtype": "uint8",
                  "shape": [_PROBE_BYTES], "stride": [1], "off": at, "slot": self.slots,
                  "gen": _PROBE_GEN}
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [root, *filter(None, [os.environ.get("PYTHONPATH")])]))
        try:
            done = subprocess.run([sys.executable, "-c", _PROBE_CHILD],
                                  input=msgpack.packb(fields, use_bin_type=True),
                                  capture_output=True, timeout=_PROBE_TIMEOUT, env=env)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"the probe could not run: {exc}"
        out = done.stdout.decode(errors="replace").strip()
        if done.returncode != 0 or out != "ok":
            tail = (out or done.stderr.decode(errors="replace")).strip().splitlines()
            return f"another process could not read the ring ({tail[-1] if tail else '?'})"
        return None

    # -- the rest ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """``slots``, ``slot_bytes``, ``exported``, ``fallbacks``, and ``reason`` (why IPC
        is not used, or ``None``)."""
        return {"slots": self.slots, "slot_bytes": self.slot_bytes or 0,
                "exported": self.exported, "fallbacks": self.fallbacks, "reason": self.reason}

    def _release(self) -> None:
        self._events = [None] * self.slots
        self._buf = self._share = self._pool = None
        if self._table is not None:
            self._table.close()
            self._table = None
        with _RINGS_LOCK:
            _RINGS.discard(self)

    def close(self) -> None:
        """Free the ring (consumers reading it later get ``ProducerGone``). Idempotent."""
        had = self._buf is not None
        self._release()
        if had:
            torch = _torch()
            torch.cuda.synchronize(self.device)
            torch.cuda.ipc_collect()

    def __enter__(self) -> CudaIpcRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_PROBE_CHILD = """
import sys, msgpack, torch
from tensorshare.memory import ipc
fields = msgpack.unpackb(sys.stdin.buffer.read(), raw=False)
t = ipc.copy_out(fields).cpu()
want = torch.arange(t.numel(), dtype=torch.int64) % 251
print("ok" if torch.equal(t.to(torch.int64), want) else "the pattern read back was wrong")
"""


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _wire_dtype(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


# -- the consumer ---------------------------------------------------------------------------


class _Opened:
    """A producer's ring as a consumer process holds it open: its storage, its table."""

    def __init__(self, storage: Any, table: mmap.mmap, ring_id: bytes = b"") -> None:
        self.storage, self.table, self.ring_id = storage, table, ring_id

    def gen(self, slot: int) -> int:
        """The slot's generation now (``ProducerGone`` once the producer closed the ring)."""
        if _HEADER + 8 * (slot + 1) > len(self.table):
            raise CodecError(f"cuda-ipc slot {slot} is beyond its ring's table")
        if self.ring_id and self.table[:_HEADER] != self.ring_id:
            raise ProducerGone("the producer of a cuda-ipc item closed its ring")
        return int(struct.unpack_from("<q", self.table, _HEADER + 8 * slot)[0])


_OPEN: OrderedDict[tuple[int, bytes], _Opened] = OrderedDict()
_OPEN_LOCK = threading.Lock()


def _table_of(fields: dict[str, Any]) -> mmap.mmap:
    """The producer's generation table, opened through ``/proc``; ``ProducerGone`` if the
    producer is gone (or the descriptor is not its ring's any more)."""
    path = f"/proc/{fields['pid']}/fd/{fields['gfd']}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ProducerGone(f"the producer (pid {fields['pid']}) of a cuda-ipc item is gone "
                           f"({exc.strerror})") from None
    try:
        table = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
    except (OSError, ValueError) as exc:
        raise ProducerGone(f"the ring of a cuda-ipc item cannot be read: {exc}") from None
    finally:
        os.close(fd)
    if table[:_HEADER] != fields["ring"]:
        table.close()
        raise ProducerGone(f"the ring of a cuda-ipc item of pid {fields['pid']} is closed")
    return table


def _opened(fields: dict[str, Any], index: int) -> _Opened:
    key = (fields["pid"], fields["ring"])
    with _OPEN_LOCK:
        ring = _OPEN.get(key)
        if ring is not None:
            _OPEN.move_to_end(key)
            return ring
    table = _table_of(fields)
    try:
        storage = _open_storage(fields, index)
    except BaseException:
        table.close()
        raise
    ring = _Opened(storage, table, fields["ring"])
    with _OPEN_LOCK:
        _OPEN[key] = ring
        while len(_OPEN) > _MAX_OPEN:
            _OPEN.popitem(last=False)
    return ring


#: The reference-counter name a reader opens a ring with: no such file exists, so torch's
#: "let go" when the reader frees it changes nothing in the producer (see CudaIpcRing._make).
_UNCOUNTED = b"/tensorshare-uncounted"


def _open_storage(fields: dict[str, Any], index: int) -> Any:
    """CUDA only: open the ring's memory (torch keeps one open per handle and process).
    CUDA is initialised first: ``_new_shared_cuda`` in a process that has not touched CUDA
    yet crashes it (seen on an H100, torch 2.11)."""
    torch = _torch()
    torch.cuda.init()
    try:
        return torch.UntypedStorage._new_shared_cuda(
            index, fields["h"], fields["ssize"], fields["soff"], _UNCOUNTED, 0, b"", False)
    except RuntimeError as exc:
        raise CodecError(f"cannot open a cuda-ipc item of pid {fields['pid']} ({exc}): the "
                         f"producer and this process must share the host, the GPU and the "
                         f"PID namespace; or have the producer use device_ipc=False") from None


def forget(pid: int | None = None) -> None:
    """Close the rings this process holds open (of producer ``pid``; default: all)."""
    with _OPEN_LOCK:
        for key in [k for k in _OPEN if pid is None or k[0] == pid]:
            ring = _OPEN.pop(key)
            ring.table.close()


def _stale(fields: dict[str, Any]) -> SlotReused:
    shape = fields["shape"]
    return SlotReused(f"a cuda-ipc item (slot {fields['slot']}, generation {fields['gen']}) "
                      f"was overwritten by its producer before this reader copied it out: it "
                      f"read too late (outside its stream's window)",
                      samples=shape[0] if shape else None)


def copy_out(fields: dict[str, Any], device: Any = None) -> Any:
    """The tensor a (checked) cuda-ipc descriptor stands for, copied into memory this
    process owns, on the GPU it is on (or on ``device``); the copy is complete on return.

    Raises:
        CodecError: another host, a GPU this process does not see, or a handle it cannot
            open (the message says which).
        ProducerGone: the producer (or its ring) is gone.
        SlotReused: (a ``Lagged``) the slot was written again before the copy completed.
    """
    if fields["boot"] != boot_id():
        raise CodecError("a cuda-ipc item from another host (its boot id is not this "
                         "host's): read it over unix:// on the producer's host")
    torch = _torch()
    if not torch.cuda.is_available():
        raise CodecError(f"a cuda-ipc item needs CUDA, and torch {torch.__version__} has "
                         f"none here")
    index = local_index(fields["uuid"])
    if index is None:
        raise CodecError(f"a cuda-ipc item on GPU-{fields['uuid'].hex()[:8]}, which this "
                         f"process does not see (CUDA_VISIBLE_DEVICES?)")
    ring = _opened(fields, index)
    try:
        out = _checked_copy(ring, fields, index)
    except ProducerGone:
        forget(fields["pid"])
        raise
    if device is not None and out.device != device:
        out = out.to(device)
    return out


def _checked_copy(ring: _Opened, fields: dict[str, Any], index: int) -> Any:
    """The copy, between two looks at the slot's generation and the producer's life."""
    slot, gen = fields["slot"], fields["gen"]
    if ring.gen(slot) != gen:
        raise _stale(fields)
    try:
        out = _copy(ring.storage, fields, index)
    except RuntimeError as exc:  # (its event already gone with a reused slot, say)
        _alive(fields)
        if ring.gen(slot) != gen:
            raise _stale(fields) from None
        raise CodecError(f"cannot copy a cuda-ipc item out: {exc}") from None
    _alive(fields)  # (a dead producer's memory is not to be trusted, whatever it held)
    if ring.gen(slot) != gen:  # written again while we copied: what we have may be torn
        raise _stale(fields)
    return out


def _alive(fields: dict[str, Any]) -> None:
    if not os.path.exists(f"/proc/{fields['pid']}/fd/{fields['gfd']}"):
        raise ProducerGone(f"the producer (pid {fields['pid']}) of a cuda-ipc item is gone")




def _copy(storage: Any, fields: dict[str, Any], index: int) -> Any:
    """CUDA only: wait for the item's event, copy it out, wait for the copy."""
    torch = _torch()
    dtype = getattr(torch, fields["dtype"])
    dev = torch.device("cuda", index)
    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream(dev)
        stream.wait_event(torch.cuda.Event.from_ipc_handle(dev, fields["ev"]))
        src = torch.empty(0, dtype=dtype, device=dev).set_(
            storage, fields["off"], fields["shape"], fields["stride"])
        out = torch.empty(fields["shape"], dtype=dtype, device=dev)
        out.copy_(src)
        done = torch.cuda.Event()
        done.record(stream)
        done.synchronize()
    return out


def ipc_stats() -> dict[str, int]:
    """This process's rings: ``rings``, ``slots``, ``slot_bytes`` (all together), items
    ``exported`` and ``fallbacks``; and ``open``: producers' rings it reads."""
    with _RINGS_LOCK:
        rings = list(_RINGS)
    return {"rings": len(rings), "slots": sum(r.slots for r in rings),
            "slot_bytes": sum(r.slots * (r.slot_bytes or 0) for r in rings),
            "exported": sum(r.exported for r in rings),
            "fallbacks": sum(r.fallbacks for r in rings), "open": len(_OPEN)}


def _after_fork_in_child() -> None:
    global _OPEN_LOCK, _RINGS_LOCK
    _OPEN_LOCK, _RINGS_LOCK = threading.Lock(), threading.Lock()
    _OPEN.clear()  # (CUDA state does not survive fork)
    _RINGS.clear()
    _PROBED.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
