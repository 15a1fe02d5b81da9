"""``SharedLoader(device=, prefetch=)`` on any machine: the arguments are checked before the
job joins; ``device="cpu"`` yields what ``device=None`` does; with a (faked) CUDA device the
copy of each batch is issued ``prefetch`` batches ahead of the one yielded, in order, with a
true ``len()``, and what was read before an error comes out before it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tensorshare import DeviceCopyFailed, EmbeddedServer
from tensorshare.data import SharedLoader, serve_loader
from tensorshare.data import loader as loader_mod
from tensorshare.memory.device import InFlight
from tests.data.test_loader import TIMEOUT, Background, batches_of, data, one_pass

NO_CUDA = not torch.cuda.is_available()


@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal of a torch without CUDA")
def test_a_cuda_device_without_cuda_is_refused_before_joining(server: EmbeddedServer) -> None:
    with pytest.raises(ValueError, match=r"torch.cuda.is_available\(\) is False"):
        SharedLoader("s", "127.0.0.1", server.port, device="cuda")
    with EmbeddedServer(port=0) as other:
        from tensorshare import Client

        with Client("127.0.0.1", other.port) as c:
            assert c.stats()["bins"] == {}  # (the one above never connected anywhere)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_prefetch_must_be_a_count(server: EmbeddedServer, bad: Any) -> None:
    with pytest.raises(ValueError, match="prefetch"):
        SharedLoader("s", "127.0.0.1", server.port, prefetch=bad)


def test_device_cpu_yields_what_none_does(server: EmbeddedServer) -> None:
    jobs = [SharedLoader("s", "127.0.0.1", server.port, batch_size=16, name=f"j{d}",
                         device=d, timeout=TIMEOUT) for d in (None, "cpu")]
    producer = Background(lambda: serve_loader(data(), "s", "127.0.0.1", server.port,
                                               window=4, wait_for=2))
    runs = [Background(lambda j=j: one_pass(j)) for j in jobs]
    results = [r.result() for r in runs]
    producer.result()
    assert results[0] == results[1]
    assert results[0][0] == list(range(100)) and results[0][1] == batches_of(100, 16)
    for j in jobs:
        j.close()


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """``device="cuda"`` passes the check; each copy is recorded when issued and taken."""
    events: list[tuple[str, int]] = []

    class Recorded(InFlight):
        def take(self) -> Any:
            events.append(("take", int(self.value[1][0])))
            return self.value

    def copy_async(value: Any, device: Any) -> InFlight:
        events.append(("issue", int(value[1][0])))
        return Recorded(value)

    monkeypatch.setattr(loader_mod, "check_device", lambda d: torch.device("cuda", 0))
    monkeypatch.setattr(loader_mod, "want_pinned", lambda d: None)
    monkeypatch.setattr(loader_mod, "copy_async", copy_async)
    return events


@pytest.mark.parametrize("prefetch", [0, 2])
def test_copies_are_issued_prefetch_batches_ahead_in_order(
        server: EmbeddedServer, fake_cuda: list[tuple[str, int]], prefetch: int) -> None:
    job = SharedLoader("s", "127.0.0.1", server.port, batch_size=10, device="cuda",
                       prefetch=prefetch, timeout=TIMEOUT, name="j")
    producer = Background(lambda: serve_loader(data(), "s", "127.0.0.1", server.port,
                                               window=4, wait_for=1))
    labels, sizes, lens = one_pass(job)
    producer.result()
    assert labels == list(range(100)) and sizes == [10] * 10 and lens == [10] * 10
    firsts = list(range(0, 100, 10))
    assert [n for op, n in fake_cuda if op == "take"] == firsts
    assert [n for op, n in fake_cuda if op == "issue"] == firsts
    for k, first in enumerate(firsts):  # when batch k is taken, k + prefetch was issued
        taken_at = fake_cuda.index(("take", first))
        ahead = min(k + prefetch, len(firsts) - 1)
        assert fake_cuda.index(("issue", firsts[ahead])) < taken_at
        if k + prefetch + 1 < len(firsts):
            assert fake_cuda.index(("issue", firsts[k + prefetch + 1])) > taken_at
    job.close()


def test_a_copy_that_fails_carries_its_batch_after_the_batches_before_it(
        server: EmbeddedServer, fake_cuda: list[tuple[str, int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = loader_mod.copy_async

    def failing(value: Any, device: Any) -> InFlight:
        if int(value[1][0]) == 30:
            raise DeviceCopyFailed("out of memory", value=value, device=device)
        return real(value, device)

    monkeypatch.setattr(loader_mod, "copy_async", failing)
    job = SharedLoader("s", "127.0.0.1", server.port, batch_size=10, device="cuda",
                       prefetch=2, timeout=TIMEOUT, name="j")
    producer = Background(lambda: serve_loader(data(), "s", "127.0.0.1", server.port,
                                               window=4, wait_for=1))
    got = []
    with pytest.raises(DeviceCopyFailed) as info:
        for _, y in job:
            got.append(int(y[0]))
    assert got == [0, 10, 20]  # every batch read before it, in order
    assert info.value.value[1].tolist() == list(range(30, 40))  # its batch, on the CPU
    job.close()
    producer.result()
