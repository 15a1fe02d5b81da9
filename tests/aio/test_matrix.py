"""The face x value matrix of tests/client/test_matrix.py extended to the asyncio face: the
:class:`~tensorshare.aio.AsyncClient` and its pipeline, over TCP and over a Unix socket
(large tensors there through shared memory), each on asyncio's loop and on uvloop's; every
kind of value, put and append, read back bit-exact (by the same face, and by the blocking
client). The servers, loops and clients are made once for the module."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from tensorshare import Client, EmbeddedServer
from tensorshare.aio import AsyncClient
from tests.aio.conftest import LOOPS, loop_factory, running_loop_kind
from tests.client.test_matrix import VALUES, same

WAIT = 30.0
FACES = ["aio", "aio-pipeline", "aio-unix", "aio-unix-pipeline"]


class AsyncFaces:
    """One server (TCP and a Unix socket); per kind of loop, a loop kept for the module and
    an AsyncClient over each address."""

    def __init__(self, tmp: str) -> None:
        self.server = EmbeddedServer(port=0, unix=f"{tmp}/s.sock")
        self.blocking = Client("127.0.0.1", self.server.port, timeout=WAIT)
        self.runners: dict[str, asyncio.Runner] = {}
        self.clients: dict[tuple[str, str], AsyncClient] = {}
        for kind in LOOPS:
            runner = self.runners[kind] = asyncio.Runner(loop_factory=loop_factory(kind))
            for where, url in (("tcp", f"tensorshare://127.0.0.1:{self.server.port}"),
                               ("unix", f"unix://{tmp}/s.sock")):
                self.clients[kind, where] = runner.run(
                    AsyncClient(url, timeout=WAIT).connect())

    def close(self) -> None:
        for (kind, _), client in self.clients.items():
            self.runners[kind].run(client.aclose())
        for runner in self.runners.values():
            runner.close()
        self.blocking.close()
        self.server.stop()

    def run(self, kind: str, face: str, op: str, name: str, value: Any) -> Any:
        """``op`` of ``value`` to bin ``name`` through ``face`` on a loop of ``kind``, then
        the value read back by the same client."""
        client = self.clients[kind, "unix" if "unix" in face else "tcp"]

        async def scenario() -> tuple[Any, Any]:
            assert running_loop_kind() == kind
            if face.endswith("pipeline"):
                async with client.pipeline() as p:
                    getattr(p, op)(name, value)
                assert p.results is not None
                version = p.results[0]
            else:
                version = await getattr(client, op)(name, value)
            got = await client.peek(name)
            return version, got

        return self.runners[kind].run(asyncio.wait_for(scenario(), WAIT))


@pytest.fixture(scope="module")
def faces(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AsyncFaces]:
    made = AsyncFaces(str(tmp_path_factory.mktemp("aio-matrix")))
    try:
        yield made
    finally:
        made.close()


@pytest.mark.parametrize("kind", list(VALUES))
@pytest.mark.parametrize("op", ["put", "append"])
@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("loop", LOOPS)
def test_a_value_sent_through_an_async_face_reads_back_bit_exact(
        faces: AsyncFaces, loop: str, face: str, op: str, kind: str) -> None:
    value = VALUES[kind]()
    name = f"{loop}/{face}/{op}/{kind}"
    version, got = faces.run(loop, face, op, name, value)
    assert version == 1  # a new bin's first version
    expected = value if op == "put" else [value]
    assert same(got, expected), f"sent {value!r}, read back {got!r} (async peek)"
    # The blocking client reads the same bits (and empties the bin).
    back = faces.blocking.get(name)
    assert same(back, expected), f"sent {value!r}, read back {back!r} (blocking get)"


def test_the_unix_faces_pass_shared_memory_and_the_tcp_ones_do_not(faces: AsyncFaces) -> None:
    for kind in LOOPS:
        assert faces.clients[kind, "unix"].shared_memory
        assert not faces.clients[kind, "tcp"].shared_memory
