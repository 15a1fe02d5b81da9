"""A full disk refuses writes with a typed error and keeps serving reads (issue "Safe on a
shared network": before, a server whose data directory filled up stopped itself, and a restart
on the same full disk stopped again at the first write, a crash loop under Kubernetes).

The data directory lives on a 30 MB tmpfs the test mounts (root, or CAP_SYS_ADMIN, needed).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tensorshare import Client, StorageUnavailable
from tests.chaos import HOST, ServerProcess
from tests.conftest import wait_until

MiB = 1 << 20


@pytest.fixture
def small_fs() -> Iterator[Path]:
    """A 30 MB tmpfs, mounted for the test and unmounted after it."""
    where = Path(tempfile.mkdtemp(prefix="tensorshare-fullfs-"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(where)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root or CAP_SYS_ADMIN): "
                    f"{mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        where.rmdir()


def _fill_until_refused(c: Client, start: int) -> tuple[int, StorageUnavailable]:
    """Append 1 MiB items until the server refuses; return how many it acknowledged."""
    n = start
    while True:
        try:
            c.append("q", torch.full((MiB // 4,), float(n)))
        except StorageUnavailable as exc:
            return n, exc
        n += 1
        assert n < start + 200, "the disk never filled"


def test_a_full_disk_refuses_writes_keeps_serving_reads_and_recovers(small_fs: Path) -> None:
    data = small_fs / "data"
    filler = small_fs / "filler"
    filler.write_bytes(os.urandom(6 * MiB))  # room the test gives back later
    with ServerProcess(0, "--data-dir", str(data), "--fsync", "always",
                       "--snapshot-log-bytes", str(1 << 40)) as server:
        c = Client(HOST, server.port, timeout=10)
        events: list[dict[str, object]] = []
        watcher = Client(HOST, server.port, timeout=10)
        watcher.listen("q", events.append)
        acked, exc = _fill_until_refused(c, 0)
        assert acked >= 10
        assert str(data) in str(exc) and "No space left on device" in str(exc), exc
        assert "reads, listens and stats go on" in str(exc)
        # Reads, listens and stats are served; writes of any kind are refused.
        assert c.list() == {"q": acked}
        assert float(c.peek("q", max_items=1)[0][0]) == 0.0
        stats = c.stats()["server"]["persistence"]
        assert stats["writable"] is False and "No space left" in stats["error"]
        with pytest.raises(StorageUnavailable):
            c.put("w", torch.zeros(10))
        with pytest.raises(StorageUnavailable):
            c.get("q", max_items=1)
        wait_until(lambda: len(events) == acked, what="every acknowledged append's event")
        # Space comes back: the server accepts writes again by itself.
        filler.unlink()
        wait_until(lambda: c.stats()["server"]["persistence"]["writable"],
                   what="the server to accept writes again")
        c.append("q", torch.full((MiB // 4,), float(acked)))
        acked += 1
        more, _ = _fill_until_refused(c, acked)
        c.close()
        watcher.close()
        # SIGKILL while the disk is full, and start again on the same full disk: it starts,
        # refuses writes, serves reads, and lost nothing it acknowledged.
        server.restart()
        with Client(HOST, server.port, timeout=10) as again:
            got = again.peek("q")
            assert [float(t[0]) for t in got] == [float(i) for i in range(more)]
            with pytest.raises(StorageUnavailable):
                again.append("q", torch.full((MiB // 4,), -1.0))
            assert again.stats()["server"]["persistence"]["writable"] is False
