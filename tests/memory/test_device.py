"""``device=`` on every read, on any machine: every face of the client reads as before with
``device=None`` / ``"cpu"``; a device this torch cannot use is refused before anything is
sent (the bin keeps its items and its version); only tensor leaves are copied; a copy that
fails after a get took the items raises ``DeviceCopyFailed`` carrying them, bit-exact."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import tensorshare
from tensorshare import Client, DeviceCopyFailed, EmbeddedServer, ShardedClient
from tensorshare.client import ops
from tensorshare.client.twisted import connect
from tensorshare.memory import device as devmod
from tensorshare.memory import trees
from tests.client.test_both_clients import Reactor
from tests.client.test_matrix import same

WAIT = 30.0
FACES = ["direct", "begin", "pipeline", "sharded", "sharded-begin", "sharded-pipeline",
         "twisted", "twisted-pipeline", "unix"]
NO_CUDA = not torch.cuda.is_available()


def value() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.arange(6).bfloat16(),
            "big": torch.randn(1 << 19, generator=g),  # 2 MiB: a pooled part, a memfd
            "mask": np.array([1, 0, 1], dtype=np.uint8), "step": 7, "name": "run",
            "pair": (torch.tensor(True), 2.5)}


class Faces:
    def __init__(self, tmp: str) -> None:
        self.servers = [EmbeddedServer(port=0, unix=f"{tmp}/d.sock"), EmbeddedServer(port=0)]
        self.client = Client("127.0.0.1", self.servers[0].port, timeout=WAIT)
        self.unix = Client(f"unix://{tmp}/d.sock", timeout=WAIT)
        self.sharded = ShardedClient([f"127.0.0.1:{s.port}" for s in self.servers],
                                     timeout=WAIT)
        self.reactor = Reactor()
        self.tx = self.reactor.call(connect, self.reactor.reactor, "127.0.0.1",
                                    self.servers[0].port, timeout=WAIT)

    def close(self) -> None:
        self.reactor.call(self.tx.close)
        self.reactor.stop()
        for c in (self.client, self.unix, self.sharded):
            c.close()
        for s in self.servers:
            s.stop()

    def plain(self, face: str) -> Any:
        """The blocking client that face reads through (for setting up and checking)."""
        return {"sharded": self.sharded, "unix": self.unix}.get(face.split("-")[0],
                                                                 self.client)

    def read(self, face: str, op: str, name: str, **kw: Any) -> Any:
        """``op`` (get, peek or fetch) of bin ``name`` through ``face``."""
        if op == "fetch":
            kw.setdefault("remove", False)
        if face.startswith("twisted"):
            return self.reactor.call(self._tx_read, face, op, name, kw)
        client = self.plain(face)
        if face.endswith("pipeline"):
            with client.pipeline() as p:
                getattr(p, op)(name, **kw)
            return p.results[0]
        if face.endswith("begin"):
            return getattr(client.begin, op)(name, **kw).result()
        return getattr(client, op)(name, **kw)

    def _tx_read(self, face: str, op: str, name: str, kw: dict[str, Any]) -> Any:
        if face == "twisted":
            return getattr(self.tx, op)(name, **kw)
        p = self.tx.pipeline()
        getattr(p, op)(name, **kw)
        return p.execute().addCallback(lambda results: results[0])


@pytest.fixture(scope="module")
def faces(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faces]:
    made = Faces(str(tmp_path_factory.mktemp("device")))
    try:
        yield made
    finally:
        made.close()


def tensors_of(x: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    trees.collect(x, torch.Tensor, out)
    return out


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
@pytest.mark.parametrize("op", ["get", "peek", "fetch"])
@pytest.mark.parametrize("face", FACES)
def test_device_none_or_cpu_reads_exactly_as_before(faces: Faces, face: str, op: str,
                                                    device: Any) -> None:
    name = f"{face}/{op}/{device}"
    v = value()
    faces.plain(face).put(name, v)
    got = faces.read(face, op, name, device=device)
    if op == "fetch":
        got = got.value
    assert same(got, v)
    assert all(t.device.type == "cpu" for t in tensors_of(got))
    assert type(got["mask"]) is np.ndarray


@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal of a torch without CUDA")
@pytest.mark.parametrize("op", ["get", "peek", "fetch"])
@pytest.mark.parametrize("face", FACES)
def test_a_cuda_device_on_a_torch_without_cuda_is_refused_before_sending(
        faces: Faces, face: str, op: str) -> None:
    name = f"refused/{face}/{op}"
    client = faces.plain(face)
    client.append(name, torch.arange(4))
    before = client.fetch(name, remove=False)
    for device in ("cuda", "cuda:0", torch.device("cuda", 1)):
        with pytest.raises(ValueError, match=r"torch.cuda.is_available\(\) is False"):
            faces.read(face, op, name, device=device)
    after = client.fetch(name, remove=False)  # nothing left its bin, nothing changed it
    assert after.version == before.version and same(after.value, before.value)
    assert client.list()[name] == 1


@pytest.mark.parametrize("bad", [3.5, True, "nonsense", "meta", "cuda:x", b"cuda"])
def test_a_bad_device_argument_is_a_clear_value_error(faces: Faces, bad: Any) -> None:
    faces.client.put("bad-device", 1)
    with pytest.raises(ValueError, match="device"):
        faces.client.get("bad-device", device=bad)
    assert faces.client.get("bad-device") == 1  # still there


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[list[torch.Tensor]]:
    """Reads with ``device="cuda"`` pass the check and copy through a fake copy function
    that records what it was given (and marks its results), on any machine."""
    seen: list[list[torch.Tensor]] = []

    def copy(tensors: list[torch.Tensor], device: Any, non_blocking: bool) -> list[Any]:
        seen.append(list(tensors))
        return [t.clone() + 0 if t.dtype.is_floating_point else t.clone() for t in tensors]

    monkeypatch.setattr(ops, "check_device", lambda d: torch.device("cuda", 0))
    monkeypatch.setattr(ops, "want_pinned", lambda d: None)
    monkeypatch.setattr(devmod, "_copy_tensors", copy)
    return seen


@pytest.mark.parametrize("face", ["direct", "begin", "pipeline", "sharded", "twisted",
                                  "unix"])
def test_only_tensor_leaves_go_to_the_device(faces: Faces, face: str,
                                             fake_cuda: list[list[torch.Tensor]]) -> None:
    name = f"leaves/{face}"
    v = value()
    faces.plain(face).put(name, v)
    got = faces.read(face, "get", name, device="cuda")
    assert same(got, v)
    assert [t.shape for t in fake_cuda[-1]] == [t.shape for t in tensors_of(v)]
    assert type(got["mask"]) is np.ndarray and got["name"] == "run" and got["step"] == 7


def _failing_copy(tensors: list[torch.Tensor], device: Any, non_blocking: bool) -> Any:
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 MiB")


@pytest.mark.parametrize("face", ["direct", "begin", "pipeline", "sharded", "twisted",
                                  "unix"])
def test_a_copy_that_fails_after_a_get_gives_back_the_cpu_value(
        faces: Faces, face: str, fake_cuda: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devmod, "_copy_tensors", _failing_copy)
    name = f"failing/{face}"
    v = value()
    client = faces.plain(face)
    client.append(name, v)
    client.append(name, torch.arange(3))
    with pytest.raises(DeviceCopyFailed) as info:
        faces.read(face, "get", name, device="cuda")
    assert "out of memory" in str(info.value) and ".value" in str(info.value)
    assert info.value.device == torch.device("cuda", 0)
    assert same(info.value.value, [v, torch.arange(3)])  # every item taken, bit-exact
    assert name not in client.list()  # (the get took them: they are in the error)
    assert isinstance(info.value, tensorshare.TensorShareError)


def test_a_failing_fetch_carries_the_whole_record(faces: Faces, fake_cuda: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devmod, "_copy_tensors", _failing_copy)
    faces.client.append("failing/fetch", torch.ones(3), tag=4)
    with pytest.raises(DeviceCopyFailed) as info:
        faces.client.fetch("failing/fetch", remove=True, device="cuda")
    res = info.value.value
    assert isinstance(res, tensorshare.FetchResult) and res.tags == (4,)
    assert same(res.value, [torch.ones(3)]) and res.n_items == 0


def test_non_blocking_is_passed_to_the_copy(faces: Faces, monkeypatch: pytest.MonkeyPatch,
                                            fake_cuda: Any) -> None:
    flags: list[bool] = []

    def copy(tensors: list[torch.Tensor], device: Any, non_blocking: bool) -> list[Any]:
        flags.append(non_blocking)
        return list(tensors)

    monkeypatch.setattr(devmod, "_copy_tensors", copy)
    faces.client.put("nb", torch.ones(2))
    faces.client.peek("nb", device="cuda", non_blocking=True)
    faces.client.peek("nb", device="cuda")
    assert flags == [True, False]


def test_a_value_without_tensors_is_not_copied(faces: Faces, fake_cuda: Any) -> None:
    faces.client.put("no-tensors", {"a": np.ones(2), "b": "x"})
    got = faces.client.get("no-tensors", device="cuda")
    assert fake_cuda == [] and same(got, {"a": np.ones(2), "b": "x"})
