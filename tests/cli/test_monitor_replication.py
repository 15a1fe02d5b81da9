"""``tensorshare monitor`` and ``tensorshare stats`` on a primary and on its replica: the role,
term, offset and resyncs, each replica's offset and lag (on the primary), the primary and the
lag (on the replica). Real servers, the real command in a subprocess."""

from __future__ import annotations

import pytest
import torch

from tensorshare import Client, EmbeddedServer
from tensorshare.cli.main import main
from tests.cli.test_tools import _frames, _Proc
from tests.conftest import wait_until

WAIT = 20.0


def _replication(frame: list[str]) -> tuple[str, list[list[str]]]:
    """The replication table of a monitor frame: its title, and its rows' cells."""
    at = next(i for i, line in enumerate(frame) if line.startswith("replication: "))
    rows = []
    for line in frame[at + 3:]:  # (the title, the header, a rule)
        if not line.strip() or line.startswith("every "):
            break
        rows.append(line.split())
    return frame[at], rows


def _monitor_frame(port: int, ready: object) -> tuple[str, list[list[str]]]:
    """The replication table of the first monitor frame for which ``ready(title, rows)``."""
    m = _Proc("monitor", "--interval", "0.1", "--port", str(port))
    seen: list[tuple[str, list[list[str]]]] = []

    def found() -> bool:
        frames = _frames(m.out)
        if frames and any(x.startswith("replication: ") for x in frames[-1]):
            seen.append(_replication(frames[-1]))
            return bool(ready(*seen[-1]))  # type: ignore[operator]
        return False

    try:
        wait_until(found, WAIT, "a frame with the replication table")
        status, err = m.interrupt()
        assert status == 0 and err == "", err
    finally:
        m.kill()
    return seen[-1]


def test_monitor_and_stats_show_the_role_term_replicas_lag_and_resyncs_on_both_sides(
        capsys: pytest.CaptureFixture[str]) -> None:
    with EmbeddedServer(0) as primary:
        c = Client("127.0.0.1", primary.port, timeout=WAIT)
        c.put("w", torch.zeros(256))
        with EmbeddedServer(0, replica_of=f"127.0.0.1:{primary.port}") as replica:
            r = Client("127.0.0.1", replica.port, timeout=WAIT)
            wait_until(lambda: r.stats()["server"]["replication"]["synced"], WAIT, "in sync")
            c.append("q", torch.ones(64))
            offset = c.stats()["server"]["replication"]["offset"]
            wait_until(lambda: c.stats()["server"]["replication"]["replicas"][0]["offset"]
                       == offset, WAIT, "the replica caught up")
            title, rows = _monitor_frame(primary.port, lambda t, rows: len(rows) == 1)
            assert title.startswith(f"replication: primary, term 0, offset {offset}; "
                                    f"resyncs 1 full, 0 partial, 0 dropped")
            (address, at, lag_bytes, lag_s, live), = rows
            assert address == c.stats()["server"]["replication"]["replicas"][0]["address"]
            assert (at, lag_bytes, float(lag_s), live) == (str(offset), "0", 0.0, "yes")
            title, rows = _monitor_frame(replica.port, lambda t, rows: bool(rows))
            assert title.startswith(f"replication: replica, term 0, offset {offset}; "
                                    f"resyncs 1 full, 0 partial")
            (upstream, at, lag_s, synced), = rows
            assert upstream == f"127.0.0.1:{primary.port}"  # (as --replica-of named it)
            assert at == str(offset) and float(lag_s) >= 0 and synced == "yes"
            # tensorshare stats shows the same table.
            for port, title in ((primary.port, "replication: primary, term 0"),
                                (replica.port, "replication: replica, term 0")):
                assert main(["stats", "--port", str(port)]) == 0
                out = capsys.readouterr().out.splitlines()
                at = out.index(next(x for x in out if x.startswith(title)))
                assert out[at + 1].split()[:2] in (["replica", "offset"], ["primary", "offset"])
                assert out[at + 3].split()[1] == str(offset)
            r.close()
        c.close()


def test_monitor_of_a_server_that_never_replicated_shows_no_replication_table(
        server: EmbeddedServer) -> None:
    m = _Proc("monitor", "--interval", "0.1", "--port", str(server.port))
    try:
        wait_until(lambda: len(_frames(m.out)) >= 1, WAIT, "a frame")
        assert not any(x.startswith("replication") for x in _frames(m.out)[0])
        m.interrupt()
    finally:
        m.kill()
