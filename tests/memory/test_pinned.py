"""The pinned pool's bookkeeping, on any machine, with a fake registrar in place of
``cudaHostRegister``: a buffer is pinned once, when it comes back after carrying a complete
value to a device, never for a frame a peer announced and did not send; unpinned before it is
unmapped; held while its copy is in flight; a forked child starts empty; ``0`` turns it off;
idle and pinned bytes stay within the limit."""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest
import torch

from tensorshare import Client
from tensorshare.memory import device as devmod
from tensorshare.memory import pinned, pool
from tensorshare.memory.pinned import PinnedPool, pinned_pool, reset_pinned_pool
from tensorshare.memory.pool import size_class
from tensorshare.wire.frames import FrameDecoder, encode_frame

MiB = 1 << 20


class FakeRegistrar:
    """Records what was pinned; checks that nothing is unpinned twice or unmapped pinned."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, int]] = []
        self.pinned: set[int] = set()
        self.fail = fail

    def register(self, address: int, nbytes: int) -> None:
        if self.fail:
            raise OSError("cudaHostRegister failed (cudaError 2)")
        assert address not in self.pinned, "pinned twice"
        self.pinned.add(address)
        self.calls.append(("register", address))

    def unregister(self, address: int) -> None:
        assert address in self.pinned, "unpinned what was not pinned"
        self.pinned.remove(address)
        self.calls.append(("unregister", address))


def make(limit: int = 64 * MiB, **kw: Any) -> tuple[PinnedPool, FakeRegistrar]:
    reg = FakeRegistrar(**kw)
    return PinnedPool(limit, reg, background=False), reg


def address(view: memoryview) -> int:
    return devmod._address(view)


def test_a_buffer_is_pinned_once_when_it_comes_back_after_a_complete_value() -> None:
    p, reg = make()
    part = p.take(3 * MiB)
    where = address(part)
    part[:] = b"\x01" * len(part)  # (a whole value arrived)
    assert p.staged(where + 100)  # it went to a device
    assert reg.calls == []  # never pinned on first use
    del part
    gc.collect()
    assert reg.calls == [("register", where)] and p.pinned_bytes == size_class(3 * MiB)
    again = p.take(3 * MiB - 5)  # the same class: the same, pinned memory
    assert address(again) == where and p.is_pinned(where) and p.reused == 1
    p.staged(where)
    del again
    gc.collect()
    assert [c for c, _ in reg.calls] == ["register"]  # pinned once per mapping
    assert p.registered == 1


def test_a_buffer_that_never_carried_a_value_to_a_device_is_not_pinned() -> None:
    p, reg = make()
    part = p.take(2 * MiB)
    del part
    gc.collect()
    assert reg.calls == [] and p.idle == size_class(2 * MiB) and p.pinned_bytes == 0
    assert not p.staged(12345)  # (not an address of the pool)


def receive(dec: FrameDecoder, data: bytes) -> list[Any]:
    """Feed ``data`` the way a client's reader does: small pieces through ``feed``, a large
    payload with ``recv_into`` straight into the decoder's buffer."""
    out: list[Any] = []
    i = 0
    while i < len(data):
        buf = dec.get_buffer()
        if buf is None:
            out += dec.feed(data[i:i + 1])
            i += 1
            continue
        n = min(len(buf), len(data) - i)
        buf[:n] = data[i:i + n]
        i += n
        out += dec.buffer_updated(n)
    return out


def test_a_frame_announced_and_not_sent_is_never_pinned() -> None:
    """Through the wire's own decoder, the receive pool's user: the payload's buffer of a
    half-sent frame goes back unpinned; a complete one, once staged, comes back pinned."""
    p, reg = make()
    header = b"\x81\xa2op\xa3put"
    payload = bytes(range(256)) * (8 * MiB // 256)
    frame = b"".join(bytes(c) for c in encode_frame(header, [payload]))
    dec = FrameDecoder(1 << 30, 1 << 20, allocate=p.take)
    assert receive(dec, frame[:len(frame) // 2]) == [] and dec.in_frame
    del dec  # the peer went away mid-frame
    gc.collect()
    assert reg.calls == [] and p.fresh == 1 and p.idle == size_class(8 * MiB)
    dec = FrameDecoder(1 << 30, 1 << 20, allocate=p.take)
    (got,) = receive(dec, frame)
    assert bytes(got.payload) == payload and p.reused == 1
    t = torch.frombuffer(got.payload, dtype=torch.uint8)  # decoded, on its way to a GPU
    assert p.staged(t.data_ptr())
    del got, t, dec
    gc.collect()
    assert len(reg.calls) == 1 and p.pinned_bytes == size_class(8 * MiB)


def test_trim_unpins_before_it_unmaps(monkeypatch: pytest.MonkeyPatch) -> None:
    p, reg = make()
    parts = [p.take(2 * MiB) for _ in range(3)]
    addrs = [address(part) for part in parts]
    for a in addrs:
        p.staged(a)
    unmapped: list[int] = []
    del parts
    gc.collect()
    maps = [m for lst in p._free.values() for m in lst]
    for m in maps:  # watch each unmap: it must come after that mapping's unpinning
        real = m.mm

        class Watch:
            def __init__(self, real: Any, m: Any) -> None:
                self.real, self.m = real, m

            def close(self) -> None:
                assert ("unregister", self.m.address) in reg.calls, "unmapped while pinned"
                unmapped.append(self.m.address)
                self.real.close()

        m.mm = Watch(real, m)  # type: ignore[assignment]
    assert p.trim() == 3 * size_class(2 * MiB)
    assert sorted(unmapped) == sorted(addrs) and reg.pinned == set()
    assert p.pinned_bytes == 0 and p.idle == 0


def test_a_buffer_is_held_until_its_copy_completes() -> None:
    p, reg = make()

    class FakeEvent:
        done = False

        def query(self) -> bool:
            return self.done

    part = p.take(2 * MiB)
    p.staged(address(part))
    src = torch.frombuffer(part, dtype=torch.uint8)
    del part
    ev = FakeEvent()
    p.hold([src], ev)  # an asynchronous copy from it was issued
    del src
    gc.collect()
    assert p.in_flight == 1 and p.poll() == 1 and p.idle == 0 and reg.calls == []
    ev.done = True
    assert p.poll() == 0
    gc.collect()
    assert p.idle == size_class(2 * MiB) and len(reg.calls) == 1


def test_idle_and_pinned_bytes_stay_within_the_limit() -> None:
    p, reg = make(limit=6 * MiB)
    parts = [p.take(2 * MiB) for _ in range(8)]
    for a in [address(part) for part in parts]:
        p.staged(a)
    del parts
    gc.collect()
    assert p.idle <= 6 * MiB and p.pinned_bytes <= 6 * MiB
    assert len(reg.calls) == p.registered <= 3
    big = p.take(100 * MiB)  # larger than the limit: used, never kept
    p.staged(address(big))
    del big
    gc.collect()
    assert p.idle <= 6 * MiB and p.pinned_bytes <= 6 * MiB


def test_a_registrar_that_fails_leaves_the_memory_pageable_and_is_not_asked_again(
        caplog: pytest.LogCaptureFixture) -> None:
    p, reg = make(fail=True)
    for _ in range(3):
        part = p.take(2 * MiB)
        p.staged(address(part))
        del part
        gc.collect()
    assert p.pinned_bytes == 0 and p.failed and p.idle == size_class(2 * MiB)
    assert sum("pinning host memory failed" in r.message for r in caplog.records) == 1


def test_a_forked_child_starts_with_an_empty_pool() -> None:
    p, reg = make()
    part = p.take(2 * MiB)
    p.staged(address(part))
    del part
    gc.collect()
    assert p.pinned_bytes and p.idle
    pid = os.fork()
    if pid == 0:
        ok = False
        try:
            ok = (p.idle == 0 and p.pinned_bytes == 0 and not p._free and
                  p.take(2 * MiB) is not None and p.fresh == 1 and reg.calls[-1][0] ==
                  "register")  # (the child never unpinned the parent's memory)
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert p.idle and p.pinned_bytes  # the parent's are still its own


def test_a_forked_child_does_not_write_into_its_parents_received_tensors() -> None:
    """(The receive pool's mappings are private: a child's writes stay in the child.)"""
    for pl in (pool.BufferPool(), make()[0]):
        v = pl.take(1 * MiB)
        v[:4] = b"AAAA"
        pid = os.fork()
        if pid == 0:
            v[:4] = b"BBBB"
            os._exit(0)
        os.waitpid(pid, 0)
        assert bytes(v[:4]) == b"AAAA"


@pytest.fixture
def env_pool(monkeypatch: pytest.MonkeyPatch) -> Any:
    yield monkeypatch
    reset_pinned_pool()


def test_zero_turns_the_process_pool_off(env_pool: pytest.MonkeyPatch) -> None:
    env_pool.setenv(pinned.PINNED_POOL_ENV, "0")
    reset_pinned_pool()
    assert pinned_pool() is None
    env_pool.setenv(pinned.PINNED_POOL_ENV, str(8 * MiB))
    reset_pinned_pool(lambda limit: PinnedPool(limit, FakeRegistrar(), background=False))
    made = pinned_pool()
    assert made is not None and made.limit == 8 * MiB and pinned_pool() is made


def test_a_read_for_a_cuda_device_receives_into_the_pinned_pool_and_pins_it_for_the_next(
        server: Any, env_pool: pytest.MonkeyPatch) -> None:
    """End to end, on any machine: a get with a (faked) CUDA device receives its large part
    into the pinned pool, which pins it on its way back; the next get of that size lands in
    pinned memory (what makes the copy a DMA)."""
    reg = FakeRegistrar()
    env_pool.setenv(pinned.PINNED_POOL_ENV, str(64 * MiB))
    reset_pinned_pool(lambda limit: PinnedPool(limit, reg, background=False))
    rp = pool.receive_pool()
    if rp is None:
        pytest.skip("TENSORSHARE_RECEIVE_POOL=0: no receive pool to stand beside")
    env_pool.setattr(rp, "divert", None)
    seen: list[bool] = []

    def copies(tensors: list[torch.Tensor], device: Any, nb: bool, pl: Any) -> list[Any]:
        seen.append(pl.is_pinned(tensors[0].data_ptr()))
        return [t.clone() for t in tensors]

    env_pool.setattr(devmod, "_copies", copies)
    env_pool.setattr(devmod, "check_device", lambda d: torch.device("cuda", 0))
    from tensorshare.client import ops
    env_pool.setattr(ops, "check_device", lambda d: torch.device("cuda", 0))
    with Client("127.0.0.1", server.port, timeout=30) as c:
        for i in range(3):
            c.put("params", torch.full((1 << 20,), float(i)))  # 4 MiB
            got = c.get("params", device="cuda")
            assert torch.equal(got, torch.full((1 << 20,), float(i)))
            del got
            gc.collect()
    pp = pinned_pool()
    assert pp is not None and rp.divert == pp.take
    assert seen == [False, True, True] and pp.registered == 1 and pp.reused >= 2
    stats = devmod.memory_stats()
    assert stats["pinned"]["registered"] == 1 and stats["pinned"]["pinned_bytes"] > 0
    assert stats["ipc"]["rings"] == 0 and stats["ipc"]["slots"] == 0

