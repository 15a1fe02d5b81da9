"""Every face of the client x every kind of value x put/append, each read back bit-exact.

A face is one way to send a request: the blocking client, its pipeline and its ``begin``
view, the sharded client and its pipeline and ``begin`` view, the Twisted client and its
pipeline, and the blocking client and its pipeline over a Unix socket (large tensors there go
through shared memory). Each (face, value, op) is its own test; the servers and clients are
made once for the module and reused, each test using bins of its own.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from tensorshare import Client, EmbeddedServer, ShardedClient
from tensorshare.client.twisted import connect
from tests.client.test_both_clients import Reactor

WAIT = 30.0
LARGE = 1 << 19  # float32 elements: 2 MiB, above the shared-memory threshold (1 MiB)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# Each value is made when its test runs (the large ones are not held by the collection).
VALUES: dict[str, Callable[[], Any]] = {
    "float32": lambda: torch.randn(5, 3, generator=_gen(1)),
    "float64": lambda: torch.randn(7, dtype=torch.float64, generator=_gen(2)),
    "float16": lambda: torch.randn(4, 4, generator=_gen(3)).half(),
    "bfloat16": lambda: torch.randn(6, generator=_gen(4)).bfloat16(),
    "int64": lambda: torch.tensor([-(1 << 63), -1, 0, (1 << 63) - 1]),
    "int32": lambda: torch.arange(-5, 5, dtype=torch.int32),
    "int8": lambda: torch.tensor([-128, 0, 127], dtype=torch.int8),
    "uint8": lambda: torch.arange(256, dtype=torch.uint8).reshape(16, 16),
    "bool": lambda: torch.tensor([True, False, True]),
    "complex64": lambda: torch.randn(3, dtype=torch.complex64, generator=_gen(5)),
    "nan-and-signed-zero": lambda: torch.tensor([math.nan, -0.0, math.inf, -math.inf]),
    "0-d": lambda: torch.tensor(3.25),
    "0-d-int": lambda: torch.tensor(-7),
    "empty": lambda: torch.empty(0, 4),
    "non-contiguous": lambda: torch.randn(4, 6, generator=_gen(6)).t(),
    "large": lambda: torch.randn(LARGE, generator=_gen(7)),
    "numpy": lambda: np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
    "numpy-int16": lambda: np.array([-(1 << 15), 0, (1 << 15) - 1], dtype=np.int16),
    "numpy-0-d": lambda: np.array(2.5),
    "dict": lambda: {"w": torch.randn(3, generator=_gen(8)), "step": 4, "name": "run"},
    "list": lambda: [torch.arange(3), np.ones(2, dtype=np.uint8), "x", 1.5],
    "tuple": lambda: (torch.zeros(2, dtype=torch.bool), (1, 2), None),
    "nested": lambda: {"a": [{"b": (torch.tensor(1.0), b"\x00")}], "c": {}},
    "int": lambda: -(1 << 62),
    "uint64": lambda: (1 << 64) - 1,
    "float": lambda: -0.0,
    "bool-scalar": lambda: True,
    "str": lambda: "naïve ☃",
    "bytes": lambda: bytes(range(256)) * 3,
    "empty-bytes": lambda: b"",
    "none": lambda: None,
}

FACES = ["direct", "pipeline", "begin", "sharded", "sharded-pipeline", "sharded-begin",
         "twisted", "twisted-pipeline", "unix", "unix-pipeline"]


def same(a: Any, b: Any) -> bool:
    """Equal down to the bits: types, dtypes, shapes and every byte (NaN and -0.0 too)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(_bits(a), _bits(b)))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    return bool(a == b)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


class Faces:
    """The servers and clients the module's tests share."""

    def __init__(self, tmp: str) -> None:
        self.servers = [EmbeddedServer(port=0, unix=f"{tmp}/s0.sock"), EmbeddedServer(port=0)]
        main = self.servers[0]
        self.client = Client("127.0.0.1", main.port, timeout=WAIT)
        self.unix = Client(f"unix://{tmp}/s0.sock", timeout=WAIT)
        self.sharded = ShardedClient([f"127.0.0.1:{s.port}" for s in self.servers],
                                     timeout=WAIT)
        self.reactor = Reactor()
        self.tx = self.reactor.call(connect, self.reactor.reactor, "127.0.0.1", main.port,
                                    timeout=WAIT)

    def close(self) -> None:
        self.reactor.call(self.tx.close)
        self.reactor.stop()
        for c in (self.client, self.unix, self.sharded):
            c.close()
        for s in self.servers:
            s.stop()

    def send(self, face: str, op: str, name: str, value: Any) -> Any:
        """``op`` (put or append) of ``value`` to bin ``name`` through ``face``."""
        if face.startswith("twisted"):
            return self.reactor.call(self._tx_send, face, op, name, value)
        client: Any = {"sharded": self.sharded, "unix": self.unix}.get(
            face.split("-")[0], self.client)
        if face.endswith("pipeline"):
            with client.pipeline() as p:
                getattr(p, op)(name, value)
            assert p.results is not None
            return p.results[0]
        if face.endswith("begin"):
            return getattr(client.begin, op)(name, value).result()
        return getattr(client, op)(name, value)

    def _tx_send(self, face: str, op: str, name: str, value: Any) -> Any:
        if face == "twisted":
            return getattr(self.tx, op)(name, value)
        p = self.tx.pipeline()
        getattr(p, op)(name, value)
        return p.execute().addCallback(lambda results: results[0])

    def reader(self, face: str) -> Any:
        return self.sharded if face.startswith("sharded") else self.client


@pytest.fixture(scope="module")
def faces(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faces]:
    made = Faces(str(tmp_path_factory.mktemp("matrix")))
    try:
        yield made
    finally:
        made.close()


@pytest.mark.parametrize("kind", list(VALUES))
@pytest.mark.parametrize("op", ["put", "append"])
@pytest.mark.parametrize("face", FACES)
def test_a_value_sent_through_a_face_reads_back_bit_exact(faces: Faces, face: str, op: str,
                                                          kind: str) -> None:
    value = VALUES[kind]()
    name = f"{face}/{op}/{kind}"
    assert faces.send(face, op, name, value) == 1  # a new bin's first version
    reader = faces.reader(face)
    got = reader.peek(name) if op == "put" else reader.get(name)
    expected = value if op == "put" else [value]
    assert same(got, expected), f"sent {value!r}, read back {got!r}"


def test_the_comparison_tells_apart_what_the_matrix_must_not_confuse(faces: Faces) -> None:
    assert faces.unix.shared_memory  # the Unix faces send "large" through shared memory
    assert not same(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not same(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
    assert not same(torch.zeros(2, 3), torch.zeros(3, 2))
    assert not same(np.zeros(2), torch.zeros(2, dtype=torch.float64))
    assert not same((1, 2), [1, 2]) and not same(0.0, -0.0) and not same(1, True)
    assert same(torch.tensor([math.nan]), torch.tensor([math.nan]))
