"""Same host: Unix socket addresses, and large tensors through sealed memfds.

The shared-memory path must give the same values as the socket, keep readers' tensors
independent, refuse descriptors that are not sealed memfds, and leave nothing behind: memfds
have no name, so a killed client or server frees them with its descriptors; /dev/shm stays
as it was.
"""

from __future__ import annotations

import array
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorshare import Client, EmbeddedServer
from tensorshare.memory import shm as shm_module
from tensorshare.wire.codec import Buffer, Encoded, encode
from tensorshare.wire.messages import Hello, Item, Put
from tests.conftest import wait_until
from tests.rawwire import WireClient

pytestmark = pytest.mark.skipif(not shm_module.available(), reason="needs Linux memfd seals")

MiB = 1 << 20
WAIT = 30.0


@pytest.fixture
def unix_server(tmp_path: Path) -> Any:
    path = str(tmp_path / "ts.sock")
    with EmbeddedServer(port=0, unix=path) as srv:
        yield srv, path


def memfds(pid: int) -> int:
    """How many distinct memfds process ``pid`` holds (by descriptor or mapping)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:"):
                inodes.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except OSError:
            pass
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if "/memfd:" in line:
                inodes.add(int(line.split()[4]))
    return len(inodes)


def test_unix_addresses_work_for_both_clients_and_the_server_lists_them(
        unix_server: Any) -> None:
    srv, path = unix_server
    assert srv.addresses == [f"127.0.0.1:{srv.port}", f"unix://{path}"]
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"  # only its owner may connect
    with Client(f"unix://{path}") as c, Client("127.0.0.1", srv.port) as tcp:
        assert c.address == f"unix://{path}" and c.shared_memory
        assert c.put("w", {"a": torch.arange(4)}) == 1
        assert torch.equal(tcp.get("w")["a"], torch.arange(4))
    with Client(f"tensorshare://127.0.0.1:{srv.port}") as c:
        assert not c.shared_memory and c.list() == {}


def test_large_tensors_go_through_shared_memory_and_come_back_exact(unix_server: Any) -> None:
    srv, path = unix_server
    x = torch.randn(4 * MiB // 4)
    small = torch.arange(10)
    with Client(f"unix://{path}") as c, Client("127.0.0.1", srv.port) as tcp:
        c.put("v", {"big": x, "small": small})
        stored = srv.call(lambda: srv.factory.bin_stats()["v"]["first"])
        assert stored == "{big: float32[1048576], small: int64[10]}"
        # The server holds the big buffer as a mapped memfd, the small one as bytes.
        item = srv.call(lambda: next(iter(srv.factory.store.entries()))[3][0][0])
        kinds = [b.shm is not None for b in item.value.buffers]
        assert kinds == [True, False]
        got = c.peek("v")
        assert torch.equal(got["big"], x) and torch.equal(got["small"], small)
        got["big"][0] = 1e9  # the reader's copy-on-write tensor: the stored value stays
        assert torch.equal(c.peek("v")["big"], x)
        assert torch.equal(tcp.peek("v")["big"], x)  # TCP readers get the bytes
        tcp.put("t", x)  # and what TCP clients store, shm readers get as bytes
        assert torch.equal(c.get("t"), x)


def _in_memfd(t: torch.Tensor) -> bool:
    """Whether tensor ``t``'s memory lies in a mapped memfd of this process."""
    ptr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return "/memfd:" in line
    return False


@pytest.mark.parametrize("read", ["get", "peek", "fetch"])
def test_a_read_over_the_unix_socket_maps_the_servers_memfd(unix_server: Any,
                                                             read: str) -> None:
    """Every read of a value held in shared memory passes its memfd, whatever path encodes
    the reply (a get's came from the prepared pieces of a Fetched and sent the bytes)."""
    srv, path = unix_server
    x = torch.randn(4 * MiB // 4)
    with Client(f"unix://{path}") as c:
        c.put("m", x)
        got = c.fetch("m", remove=True).value if read == "fetch" else getattr(c, read)("m")
        assert torch.equal(got, x)
        assert _in_memfd(got), f"{read} of a shared value came as bytes"
        c.put("s", torch.arange(10))  # small values still travel as bytes
        assert not _in_memfd(c.get("s"))


def test_shm_can_be_turned_off_and_small_tensors_never_use_it(unix_server: Any) -> None:
    srv, path = unix_server
    with Client(f"unix://{path}", shm=False) as c:
        assert not c.shared_memory
        c.put("x", torch.ones(MiB))
        item = srv.call(lambda: next(iter(srv.factory.store.entries()))[3][0][0])
        assert item.value.buffers[0].shm is None


def test_a_descriptor_that_is_not_a_sealed_memfd_is_refused(unix_server: Any,
                                                          tmp_path: Path) -> None:
    srv, path = unix_server
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(WAIT)
    sock.connect(path)
    wire = WireClient()
    sock.sendall(wire.frame(Hello(wire.next_id(), (1,), "hostile", None, None, False, True)))
    (hello,) = wire.receive_data(sock.recv(65536))
    assert hello.shm
    unsealed = os.memfd_create("x")
    os.ftruncate(unsealed, 16)
    mem = shm_module.SharedMemory(os.dup(unsealed), 16, writable=False)
    item = Item(Encoded(encode(torch.zeros(4)).value, (Buffer(mem.view, None, 16, mem),)))
    shared: list[Any] = []
    msg = Put(wire.next_id(), "x", item)
    wire.ops[msg.id] = "put"
    wire.conn.shm = True
    chunks = wire.conn.send(msg, None, shared)
    assert shared == [mem]  # the buffer travels as a descriptor: send one that is not sealed
    sock.sendmsg(chunks, [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                           array.array("i", [unsealed]).tobytes())])
    (reply,) = wire.receive_data(sock.recv(65536))
    assert reply.code == "invalid_request" and "not sealed" in reply.message
    with Client(f"unix://{path}") as good:  # the server serves on
        assert good.list() == {}
    sock.close()
    os.close(unsealed)


@pytest.mark.alone  # /dev/shm is the machine's: no other test beside this one
def test_killed_processes_leave_no_shared_memory_behind(tmp_path: Path) -> None:
    path = str(tmp_path / "ts.sock")
    before = set(os.listdir("/dev/shm"))
    server = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        from tensorshare.server import run_server
        run_server(None, unix={path!r}, ready=lambda s: print("listening", flush=True))
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and "listening" in server.stdout.readline()
        writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
            import sys, torch
            from tensorshare import Client
            c = Client("unix://{path}")
            assert c.shared_memory
            for i in range(3):
                c.put(f"b{{i}}", torch.full((4 << 18,), float(i)))
            print("stored", flush=True)
            sys.stdin.read()
            """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert writer.stdout is not None and writer.stdout.readline().strip() == "stored"
        assert memfds(server.pid) == 3  # the server holds the three values' memfds
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(WAIT)
        with Client(f"unix://{path}") as c:
            assert torch.equal(c.peek("b1")[:3], torch.ones(3))  # data outlives its writer
            c.delete("b0")
            c.put("b1", 5)  # replaced
            wait_until(lambda: memfds(server.pid) == 1, timeout=WAIT,
                       what="the server to let go of the deleted and replaced values")
        os.kill(server.pid, signal.SIGKILL)
        server.wait(WAIT)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(WAIT)
    assert set(os.listdir("/dev/shm")) == before


def _shmem() -> int:
    """The machine's shared memory in use (memfd and tmpfs pages), in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no Shmem in /proc/meminfo")


_WARM_WRITER = """
import sys, time, torch
from tensorshare import Client
from tensorshare.memory.pool import send_pool
c = Client("unix://{path}")
assert c.shared_memory
c.put("v", torch.ones(12 << 20))  # 48 MiB: a memfd of that class is made ready after it
deadline = time.monotonic() + 30
while not send_pool()._ready and time.monotonic() < deadline:
    time.sleep(0.01)
print("ready" if send_pool()._ready else "not ready", flush=True)
sys.stdin.read()
"""


@pytest.mark.alone  # /dev/shm and the shared memory in use are the machine's
def test_a_killed_writer_frees_the_memfds_its_pool_made_ready(tmp_path: Path) -> None:
    """The memfds a client's pool makes ready for its next put (pages allocated) have no
    name and belong to the process: a SIGKILL frees them, nothing is left in /dev/shm or in
    memory; the value it stored stays with the server until the bin goes."""
    path = str(tmp_path / "ts.sock")
    files = set(os.listdir("/dev/shm"))
    value = 48 * MiB
    with EmbeddedServer(port=None, unix=path) as srv:
        base = _shmem()
        writer = subprocess.Popen([sys.executable, "-c", _WARM_WRITER.format(path=path)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
            assert _shmem() - base >= 2 * value - 8 * MiB  # the stored value and a ready memfd
        finally:
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait(WAIT)
        wait_until(lambda: _shmem() - base < value + 8 * MiB, timeout=WAIT,
                   what="the killed writer's ready memfd to be freed")
        assert memfds(os.getpid()) >= 1  # (the server, in this process, holds the value)
        with Client(f"unix://{path}") as c:
            assert c.delete("v")
        wait_until(lambda: _shmem() - base < 8 * MiB, timeout=WAIT,
                   what="the deleted value's memfd to be freed")
        assert srv.running
    assert set(os.listdir("/dev/shm")) == files


def test_a_forked_child_never_writes_into_its_parents_ready_memfd(unix_server: Any) -> None:
    """One memfd is one file in both processes after a fork: the child starts its own pool,
    so the parent's next put (into the memfd made ready for it) and the child's are both
    stored as written."""
    srv, path = unix_server
    code = textwrap.dedent(f"""
        import os, time, torch
        from tensorshare import Client
        from tensorshare.memory.pool import send_pool
        c = Client("unix://{path}")
        c.put("warm", torch.zeros(4 << 20))
        deadline = time.monotonic() + 30
        while not send_pool()._ready and time.monotonic() < deadline:
            time.sleep(0.01)
        assert send_pool()._ready, "no memfd made ready"
        twos = torch.full((4 << 20,), 2.0)  # (made before the fork: torch's thread pool is
        pid = os.fork()                      # not usable in a forked child)
        if pid == 0:
            c.put("child", twos)  # its own connection and memfds
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        c.put("parent", torch.full((4 << 20,), 1.0))
        assert send_pool().hits >= 1
        print("done", flush=True)
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr
    with Client(f"unix://{path}") as c:
        assert torch.equal(c.peek("parent"), torch.full((4 << 20,), 1.0))
        assert torch.equal(c.peek("child"), torch.full((4 << 20,), 2.0))


def test_send_pool_zero_turns_it_off_and_puts_still_go_through_shared_memory(
        unix_server: Any) -> None:
    _, path = unix_server
    code = textwrap.dedent(f"""
        import torch
        from tensorshare import Client
        from tensorshare.memory.pool import send_pool
        assert send_pool() is None
        with Client("unix://{path}") as c:
            assert c.shared_memory
            c.put("off", torch.arange(1 << 20))
            assert torch.equal(c.peek("off"), torch.arange(1 << 20))
        print("done", flush=True)
        """)
    env = {**os.environ, "TENSORSHARE_SEND_POOL": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr


def test_more_memfds_in_one_frame_than_one_message_passes_all_arrive(unix_server: Any) -> None:
    """A frame may use more descriptors than one message passes (64): an append of 300
    shared tensors in one pipeline and a get of all 300 in one reply pass them over several
    messages, none left behind, each matched to its item; so do several replies queued at
    once."""
    _, path = unix_server
    with Client(f"unix://{path}", timeout=WAIT) as c:
        assert c.shared_memory
        with c.pipeline() as p:
            for i in range(300):
                p.append("many", torch.full((1 << 18,), float(i)))  # 1 MiB each: shared
        got = c.get("many", max_items=300)
        assert [float(t[0]) for t in got] == [float(i) for i in range(300)]
        assert all(t.numel() == 1 << 18 and bool((t == t[0]).all()) for t in got)
        # Replies of 40 descriptors each, queued together: no two fit one message, so each
        # message stops where the next reply's data begins.
        with c.pipeline() as p:
            for b in range(5):
                for i in range(40):
                    p.append(f"q{b}", torch.full((1 << 18,), float(100 * b + i)))
        with c.pipeline() as p:
            for b in range(5):
                p.peek(f"q{b}", max_items=40)
        assert p.results is not None
        for b, values in enumerate(p.results):
            assert [float(t[0]) for t in values] == [float(100 * b + i) for i in range(40)]
