"""The inspection commands (ls, peek, stats, watch, monitor) against a live server holding
known tensors: what they print is parsed and checked against what the server holds.

ls, peek and stats run in this process (``cli.main``, output captured); watch and monitor
run as subprocesses, so that they can be stopped with a real SIGINT (Ctrl+C).
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tensorshare import Client, EmbeddedServer
from tensorshare.cli.main import main
from tensorshare.cli.tools import fmt_bytes, sparkline, tensor_stats
from tests.conftest import wait_until

W = torch.arange(12, dtype=torch.float32).reshape(3, 4) - 5.5
ODD = torch.tensor([1.0, float("nan"), 3.0, float("inf"), -float("inf")], dtype=torch.float16)


@pytest.fixture
def loaded(server: EmbeddedServer) -> Iterator[tuple[EmbeddedServer, Client]]:
    """A server holding known bins, and a client that listens to ``queue``."""
    with Client("127.0.0.1", server.port) as c:
        c.put("weights", {"w": W, "b": torch.zeros(4), "step": 7})
        for i in range(3):
            c.append("queue", {"obs": torch.full((2, 2), float(i)), "id": i})
        c.put("odd", ODD)
        c.put("mask", torch.tensor([True, False, True, True]))
        c.listen("queue", lambda ev: None)
        yield server, c


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out = capsys.readouterr()
    return status, out.out, out.err


# --------------------------------------------------------------------------- ls


def test_sizes_are_printed_in_binary_units_as_the_server_counts_its_limits() -> None:
    """A 64 KiB quota reads 64.0 KiB, never 65.5 kB (the server's --max-memory and quotas
    are binary: one unit for both)."""
    assert [fmt_bytes(n) for n in (0, 1023, 1024, 64 << 10, 3 << 29, 5 << 40, 1 << 52)] == [
        "0 B", "1023 B", "1.0 KiB", "64.0 KiB", "1.5 GiB", "5.0 TiB", "4096.0 TiB"]
    assert fmt_bytes((1 << 20) - 1) == "1.0 MiB"  # (rounds up into the next unit)


def test_ls_shows_kind_items_bytes_contents_version_listeners_and_totals(
        loaded: tuple[EmbeddedServer, Client], capsys: pytest.CaptureFixture[str]) -> None:
    server, c = loaded
    status, out, _ = _run(capsys, "ls", "--port", str(server.port))
    assert status == 0
    lines = out.splitlines()
    header = lines[0].split()
    assert header == ["bin", "kind", "items", "bytes", "version", "listeners", "changed",
                      "value", "/", "first", "item", "last", "item"]
    assert set(lines[1]) == {"─"} and set(lines[-2]) == {"─"}
    bins = c.stats()["bins"]
    row = re.compile(r"(\S+) +(value|list) +(\d+) +(\d+(?:\.\d)? (?:[KMG]i)?B) +(\d+) +(\d+) +"
                     r"([\d.]+[smhd][\d]*[smh]? ago) +(.*)$")
    rows = {}
    for line in lines[2:-2]:
        m = row.fullmatch(line)
        assert m, line
        rows[m[1]] = m.groups()[1:]
    assert list(rows) == ["mask", "odd", "queue", "weights"]  # sorted by name
    for name, (kind, items, nbytes, version, listeners, *_) in rows.items():
        b = bins[name]
        assert (kind, int(items), nbytes, int(version), int(listeners)) == (
            b["kind"], b["n_items"], fmt_bytes(b["nbytes"]), b["version"], b["listeners"])
    assert rows["weights"][-1] == "{w: float32[3,4], b: float32[4], step: int}"
    assert rows["odd"][-1] == "float16[5]"
    # A list bin shows its first and its last item (here: of the same structure).
    assert re.split(r" {2,}", rows["queue"][-1]) == ["{obs: float32[2,2], id: int}",
                                                     "same as first"]
    assert rows["queue"][4] == "1"  # the fixture's listener
    total = lines[-1].split()
    n_bytes = sum(b["nbytes"] for b in bins.values())
    assert total[:3] == ["total", "4", "bins"]
    assert total[3] == "6" and " ".join(total[4:6]) == fmt_bytes(n_bytes) and total[6] == "1"


def test_ls_with_a_glob_and_as_json(loaded: tuple[EmbeddedServer, Client],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    server, c = loaded
    status, out, _ = _run(capsys, "ls", "[mq]*", "--json", "--port", str(server.port))
    assert status == 0
    data = json.loads(out)
    assert list(data["bins"]) == ["mask", "queue"]
    q = data["bins"]["queue"]
    assert (q["kind"], q["n_items"], q["version"], q["listeners"]) == ("list", 3, 3, 1)
    assert q["first"] == q["last"] == "{obs: float32[2,2], id: int}"
    assert data["totals"] == {"bins": 2, "items": 4, "listeners": 1,
                              "nbytes": data["bins"]["mask"]["nbytes"] + q["nbytes"]}
    assert data["bins"] == c.stats("[mq]*")["bins"]  # the server's summaries, unchanged


def test_ls_of_an_empty_server(server: EmbeddedServer,
                               capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "ls", "--port", str(server.port))
    assert status == 0
    assert out.splitlines()[-1].split() == ["total", "0", "bins", "0", "0", "B", "0"]


# --------------------------------------------------------------------------- peek

_TENSOR = re.compile(r"(?:(?P<key>\S+): |\[\d+\] )?(?P<dtype>[a-z0-9]+)\[(?P<shape>[\d,]*)\]  "
                     r"(?P<bytes>\S+ (?:[KMG]i)?B)(?:  (?P<stats>.*))?")


def _tensor_lines(out: str) -> dict[str, dict[str, str]]:
    """``key -> {dtype, shape, bytes, min, max, ...}`` for each tensor line of a peek tree
    (``root`` for a tensor that is the bin's whole value)."""
    found = {}
    for i, line in enumerate(out.splitlines()):
        # The first line is "BIN: KIND bin, version V, SIZE: <the value's own line>".
        text = line.split(": ", 2)[2] if i == 0 else line.lstrip("│├└─ ")
        m = _TENSOR.fullmatch(text)
        if m:
            d = {k: v for k, v in m.groupdict().items() if k != "stats" and v is not None}
            d.update(kv.split("=") for kv in (m["stats"] or "").split())
            found[m["key"] or "root"] = d
    return found


def _close(text: str, value: float) -> bool:
    return float(text) == pytest.approx(value, rel=1e-3, abs=1e-6)


def test_peek_shows_the_value_as_a_tree_with_tensor_statistics(
        loaded: tuple[EmbeddedServer, Client], capsys: pytest.CaptureFixture[str]) -> None:
    server, _ = loaded
    status, out, _ = _run(capsys, "peek", "weights", "--port", str(server.port))
    assert status == 0
    lines = out.splitlines()
    assert lines[0].startswith("weights: value bin, version 1, ")
    assert lines[0].endswith(": dict (3 keys)")
    assert lines[-1] == "└── step: int 7"
    t = _tensor_lines(out)
    w = t["w"]
    assert (w["dtype"], w["shape"], w["bytes"]) == ("float32", "3,4", "48 B")
    assert _close(w["min"], -5.5) and _close(w["max"], 5.5) and _close(w["mean"], 0.0)
    assert _close(w["std"], float(W.std())) and (w["nan"], w["inf"]) == ("0", "0")
    assert (t["b"]["min"], t["b"]["max"], t["b"]["std"]) == ("0", "0", "0")
    # The server's copy is untouched: peek removes nothing.
    assert loaded[1].list()["weights"] == 1


def test_peek_counts_nan_and_inf_and_skips_what_does_not_apply(
        loaded: tuple[EmbeddedServer, Client], capsys: pytest.CaptureFixture[str]) -> None:
    server, _ = loaded
    _, out, _ = _run(capsys, "peek", "odd", "--port", str(server.port))
    odd = _tensor_lines(out)["root"]
    assert (odd["dtype"], odd["shape"], odd["nan"], odd["inf"]) == ("float16", "5", "1", "2")
    # min/max/mean/std are over the finite values (1 and 3).
    assert (odd["min"], odd["max"], odd["mean"]) == ("1", "3", "2")
    _, out, _ = _run(capsys, "peek", "mask", "--port", str(server.port))
    mask = _tensor_lines(out)["root"]
    assert (mask["min"], mask["max"], mask["mean"]) == ("0", "1", "0.75")
    assert "std" not in mask and "nan" not in mask  # bool: no std, no NaN


def test_peek_values_and_one_item_of_a_list(loaded: tuple[EmbeddedServer, Client],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    server, _ = loaded
    port = str(server.port)
    status, out, _ = _run(capsys, "peek", "queue", "--port", port)
    assert status == 0
    lines = out.splitlines()
    assert lines[0].startswith("queue: list bin, version 3, 3 items, ")
    assert [ln for ln in lines if "] dict" in ln] == [
        f"{'└' if i == 2 else '├'}── [{i}] dict (2 keys)" for i in range(3)]
    status, out, _ = _run(capsys, "peek", "queue", "--item", "-1", "--values", "--port", port)
    assert status == 0
    assert "; item 2: dict (2 keys)" in out.splitlines()[0]
    assert "id: int 2" in out
    # --values prints the tensor as torch does.
    printed = "\n".join(ln.lstrip("│├└─ ") for ln in out.splitlines())
    for line in str(torch.full((2, 2), 2.0)).splitlines():
        assert line.strip() in printed
    status, out, _ = _run(capsys, "peek", "queue", "--limit", "1", "--port", port)
    assert out.splitlines()[-1] == "└── … 2 more items (--item N shows one, --limit K the " \
                                   "first K)"


def test_peek_failures_are_one_line(loaded: tuple[EmbeddedServer, Client],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    server, _ = loaded
    port = str(server.port)
    for argv, message in (
            (["peek", "nothing"], "tensorshare peek: bin 'nothing' does not exist or is empty"),
            (["peek", "queue", "--item", "3"],
             "tensorshare peek: bin 'queue' has 3 items; there is no item 3"),
            (["peek", "weights", "--item", "0"], "tensorshare peek: bin 'weights' holds one "
             "value (put), not a list: --item is for bins written by append")):
        status, out, err = _run(capsys, *argv, "--port", port)
        assert (status, out, err) == (1, "", message + "\n")


def test_tensor_stats_of_integers_complex_and_empty_tensors() -> None:
    ints = tensor_stats(torch.tensor([[1, 5], [-3, 9]], dtype=torch.int16))
    assert ints == {"dtype": "int16", "shape": [2, 2], "nbytes": 8, "min": -3, "max": 9,
                    "mean": 3.0}
    cplx = tensor_stats(torch.tensor([1 + 1j, complex("nan")]))
    assert (cplx["nan"], cplx["inf"]) == (1, 0) and "min" not in cplx
    assert tensor_stats(torch.zeros(0, 3)) == {"dtype": "float32", "shape": [0, 3], "nbytes": 0}
    half = tensor_stats(torch.full((1000,), 60000.0, dtype=torch.float16))
    assert half["mean"] == 60000.0  # summed in float64: no float16 overflow


# --------------------------------------------------------------------------- stats


def test_stats_shows_uptime_connections_memory_and_counters(
        loaded: tuple[EmbeddedServer, Client], capsys: pytest.CaptureFixture[str]) -> None:
    server, c = loaded
    with pytest.raises(LookupError):
        c.get("nothing")
    status, out, _ = _run(capsys, "stats", "--port", str(server.port))
    assert status == 0
    info = dict(line.split(None, 1) for line in out.split("\n\n")[0].splitlines())
    assert info["server"].startswith(f"tensorshare/0.1.0 at 127.0.0.1:{server.port} (id ")
    assert re.fullmatch(r"[\d.]+s|\d+m\d\ds", info["uptime"])
    # The fixture's client and this command's.
    assert info["connections"].startswith("2 open, 2 since start, 0 refused")
    assert info["listeners"] == "1"
    assert info["bins"] == "4 holding 6 items"
    stored = c.stats()["server"]["memory"]["stored"]
    size = r"\d+(?:\.\d)? (?:[KMG]i)?B"
    # The total counts what the fixture's session holds too (its remembered replies).
    limit = re.escape(fmt_bytes(c.stats()["server"]["memory"]["max_memory"]))
    assert re.fullmatch(rf"{size} of max_memory {limit}: stored {re.escape(fmt_bytes(stored))}, "
                        rf"sessions {size}, output {size}, receiving 0 B", info["memory"]), \
        info["memory"]
    ops = {ln.split()[0]: ln.split() for ln in out.split("\n\n")[1].splitlines()[2:]}
    assert ops["put"][1] == "3" and ops["append"][1] == "3" and ops["get"][1] == "1"
    assert ops["listen"][1] == "1"
    counters = {ln.rsplit(None, 1)[0]: ln.rsplit(None, 1)[1]
                for ln in out.split("\n\n")[2].splitlines()[2:]}
    assert counters["connections_total"] == "2"
    assert counters["errors: bin_not_found"] == "1"


def test_stats_as_json(loaded: tuple[EmbeddedServer, Client],
                       capsys: pytest.CaptureFixture[str]) -> None:
    server, _ = loaded
    status, out, _ = _run(capsys, "stats", "--json", "--port", str(server.port))
    assert status == 0
    data = json.loads(out)
    assert set(data) == {"server", "bins"}
    assert data["server"]["requests"]["put"] == 3 and data["server"]["bins"] == 4
    assert data["server"]["server_id"] == server.factory.server_id


# --------------------------------------------------------------------------- watch / monitor


class _Proc:
    """A CLI subprocess whose stdout is collected by a thread."""

    def __init__(self, *argv: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tensorshare", *argv],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, encoding="utf-8")
        self.out: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.out.append(line.rstrip("\n"))

    def interrupt(self) -> tuple[int, str]:
        """Ctrl+C; the exit status and stderr."""
        self.proc.send_signal(signal.SIGINT)
        status = self.proc.wait(15)
        self._thread.join(5)
        assert self.proc.stderr is not None
        return status, self.proc.stderr.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


_WATCH = re.compile(r"\d\d:\d\d:\d\d\.\d{3}  (?P<bin>\S+) +(?P<op>\w+) +version=(?P<version>\d+)"
                    r"  items=(?P<items>\d+)  bytes=(?P<bytes>\?|\d+(?:\.\d)? (?:[KMG]i)?B)")


def test_watch_prints_one_line_per_change_and_stops_on_ctrl_c(
        loaded: tuple[EmbeddedServer, Client]) -> None:
    server, c = loaded
    w = _Proc("watch", "weights", "queue*", "--interval", "0.1", "--port", str(server.port))
    try:
        def listeners() -> dict[str, int]:
            return {n: b["listeners"] for n, b in c.stats()["bins"].items()}

        # Listening to weights, and to queue (found by the pattern) besides the fixture.
        wait_until(lambda: listeners()["weights"] == 1 and listeners()["queue"] == 2,
                   what="watch to listen")

        def changes() -> list[dict[str, str]]:
            matches = [_WATCH.fullmatch(line) for line in w.out]
            assert all(matches), w.out
            return [m.groupdict() for m in matches if m]

        expected = []
        # One change at a time, each awaited, so each line's size is read before the next.
        for change in (lambda: c.put("weights", {"w": torch.zeros(10)}),
                       lambda: c.append("queue", 3), lambda: c.get("queue", max_items=2),
                       lambda: c.delete("weights"), lambda: c.append("queue2", W)):
            change()
            n = len(expected) + 1
            wait_until(lambda n=n: len(changes()) >= n, what="a line")  # type: ignore[misc]
            expected.append(changes()[-1])
        bins = c.stats()["bins"]
        got = [(e["bin"], e["op"], int(e["version"]), int(e["items"])) for e in expected]
        assert got == [("weights", "put", 2, 1), ("queue", "append", 4, 4),
                       ("queue", "get", 5, 2), ("weights", "delete", 3, 0),
                       ("queue2", "new", 1, 1)]  # found by the pattern after it appeared
        assert expected[2]["bytes"] == fmt_bytes(bins["queue"]["nbytes"])
        assert expected[3]["bytes"] == "0 B"
        assert expected[4]["bytes"] == fmt_bytes(bins["queue2"]["nbytes"])
        wait_until(lambda: c.stats()["bins"]["queue2"]["listeners"] == 1, what="listen")
        c.append("queue2", 1)
        wait_until(lambda: len(changes()) == 6, what="a line")
        assert changes()[-1]["bin"] == "queue2" and changes()[-1]["op"] == "append"
        status, err = w.interrupt()
        assert status == 0, err
        assert "Traceback" not in err
        assert err.strip() == "watching weights, queue* (Ctrl+C to stop)"
    finally:
        w.kill()


def _frames(lines: list[str]) -> list[list[str]]:
    """The complete frames monitor printed (a frame ends with its 'every ...' line)."""
    frames, current = [], []
    for line in lines:
        if line.startswith("tensorshare/"):
            current = [line]
        elif current:
            current.append(line)
            if line.startswith("every "):
                frames.append(current)
                current = []
    return frames


def _rows(frame: list[str]) -> dict[str, list[str]]:
    """bin -> [items, bytes, listeners, put/s, append/s, get/s, in MB/s, out MB/s] (each
    rate cell is its history and then its number: the number is the last word)."""
    header = frame[1]
    starts = [header.index(col) for col in ("items", "bytes", "listeners", "put/s",
                                            "append/s", "get/s", "in MB/s", "out MB/s")]
    rows = {}
    for line in frame[3:]:
        if not line.strip() or set(line) == {"─"} or line.startswith("every "):
            continue
        name = line.split()[0]
        # Right-aligned cells end where their header ends.
        ends = [s + len(col) for s, col in zip(starts, ("items", "bytes", "listeners",
                "put/s", "append/s", "get/s", "in MB/s", "out MB/s"), strict=True)]
        cells, start = [], len(name)
        for end in ends:
            cells.append(line[start:end].strip())
            start = end
        rows[name] = cells
    return rows


def _rate(cell: str) -> float:
    """The number of a rate cell ('-' before the first rate is known: -1)."""
    number = cell.split()[-1]
    return -1.0 if number == "-" else float(number.replace(",", ""))


def test_monitor_prints_rates_items_and_listeners_and_stops_on_ctrl_c(
        loaded: tuple[EmbeddedServer, Client]) -> None:
    server, c = loaded
    m = _Proc("monitor", "--interval", "0.1", "--history", "4", "--port", str(server.port))
    try:
        wait_until(lambda: len(_frames(m.out)) >= 1, what="a frame")
        first = _frames(m.out)[0]
        assert first[0].startswith(f"tensorshare/0.1.0 at 127.0.0.1:{server.port}  up ")
        rows = _rows(first)
        assert list(rows) == ["mask", "odd", "queue", "weights", "server"]
        bins = c.stats()["bins"]
        for name in ("mask", "odd", "queue", "weights"):
            assert rows[name][:3] == [str(bins[name]["n_items"]),
                                      fmt_bytes(bins[name]["nbytes"]),
                                      str(bins[name]["listeners"])]
            assert rows[name][3:] == ["-"] * 5  # no rate before a second look
        stored = c.stats()["server"]["memory"]["stored"]
        assert rows["server"][:3] == ["6", fmt_bytes(stored), "1"]

        def appending() -> bool:
            # Keep appending and taking until a frame shows queue's rates as non-zero.
            c.append("queue", torch.zeros(1000))
            c.get("queue", max_items=1)
            rows = _rows(_frames(m.out)[-1])
            return all(_rate(rows["queue"][k]) > 0 for k in (4, 5, 6, 7))

        wait_until(appending, what="non-zero rates")
        rows = _rows(_frames(m.out)[-1])
        assert _rate(rows["queue"][3]) == 0  # no put
        assert _rate(rows["weights"][4]) == 0  # nothing appended there
        # A non-zero rate comes with its history (at least the bar of this sample).
        assert rows["queue"][4].split()[0][-1] in "▁▂▃▄▅▆▇█"
        # The server row counts requests: here only queue's appends.
        assert _rate(rows["server"][4]) == _rate(rows["queue"][4])
        status, err = m.interrupt()
        assert status == 0, err
        assert err == ""
    finally:
        m.kill()


def test_monitor_redraws_in_place_on_a_terminal(loaded: tuple[EmbeddedServer, Client]) -> None:
    import pty

    server, _ = loaded
    primary, secondary = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "tensorshare", "monitor", "--interval", "0.1",
                             "--port", str(server.port)], stdin=secondary, stdout=secondary,
                            stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "160"})
    os.close(secondary)
    screen = bytearray()

    def read() -> None:
        while select.select([primary], [], [], 0)[0]:
            try:
                screen.extend(os.read(primary, 65536))
            except OSError:  # the terminal closed
                return

    try:
        def redrawn() -> bool:
            read()
            return screen.count(b"tensorshare/0.1.0 at") >= 3

        wait_until(redrawn, what="three redraws")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0
        read()
        assert proc.stderr is not None
        assert proc.stderr.read() == b""
        assert screen.startswith(b"\x1b[?25l")  # cursor hidden while drawing ...
        assert screen.rstrip().endswith(b"\x1b[?25h")  # ... and shown again on Ctrl+C
        assert b"\x1b[2K" in screen and b"\x1b[1A" in screen  # each frame erases the last
        assert b"queue" in screen
    finally:
        os.close(primary)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _snap(uptime: float, appends: int, present: bool = True) -> dict[str, Any]:
    """A stats reply with one bin 'q' (listed only when ``present``)."""
    q = {"n_items": 1, "nbytes": 10, "listeners": 0, "ops": {"append": appends},
         "bytes_in": 10 * appends, "bytes_out": 0}
    return {"server": {"server_id": "s1", "uptime": uptime,
                       "requests": {"append": appends}, "bytes_in": {"append": 100 * appends},
                       "bytes_out": {}},
            "bins": {"q": q} if present else {}}


def test_monitor_rates_ride_out_a_bin_that_is_empty_between_samples() -> None:
    from tensorshare.cli.tools import _Rates

    rates = _Rates(history=4)
    rates.update(_snap(10.0, 0))
    assert rates.cell("q", "append") == "-"  # one look: no rate yet
    rates.update(_snap(11.0, 10, present=False))  # drained when this sample was taken
    assert rates.missing == {"q": 1}
    assert rates.cell("q", "append").split()[-1] == "-"
    assert rates.cell("", "append").split()[-1] == "10.0"  # the server row never misses it
    rates.update(_snap(12.0, 30))
    # Back: 30 appends in the 2 s since it was last seen fill both samples.
    assert rates.cell("q", "append") == "  ██    15.0"
    assert list(rates.hist["q"]["append"]) == [15.0, 15.0]
    assert rates.missing == {}
    for t in range(13, 18):  # gone for longer than the history: dropped
        rates.update(_snap(float(t), 30, present=False))
    assert "q" not in rates.seen and "q" not in rates.hist
    rates.update(_snap(1.0, 0) | {"server": _snap(1.0, 0)["server"] | {"server_id": "s2"}})
    assert rates.hist == {} and rates.cell("", "append") == "-"  # a new server: start again


def test_sparkline_scales_to_the_largest_value_and_leaves_zero_blank() -> None:
    assert sparkline([0, 1, 2, 4], 6) == "   ▃▅█"
    assert sparkline([], 3) == "   "
    assert sparkline([5, 5], 2) == "██"


# --------------------------------------------------------------------------- streams


def test_ls_and_stats_show_each_streams_head_producers_consumers_and_lag(
        server: EmbeddedServer, capsys: pytest.CaptureFixture[str]) -> None:
    from tensorshare.data import StreamConsumer, StreamProducer

    with StreamProducer("train", "127.0.0.1", server.port, window=8, samples_per_epoch=40) as p, \
            StreamConsumer("train", "lr=0.1", "127.0.0.1", server.port, timeout=5) as fast, \
            StreamConsumer("train", "lr=0.2", "127.0.0.1", server.port, timeout=5):
        for _ in range(5):
            p.append(torch.zeros(8, 4))
        assert len(fast.read(5).items) == 5
        with Client("127.0.0.1", server.port) as c:
            stats = c.stats()
        st = stats["bins"]["train"]["stream"]
        assert stats["server"]["bins"] == 1
        assert stats["server"]["memory"]["stored"] >= 5 * 8 * 4 * 4  # the stream's items
        for command in ("ls", "stats"):
            status, out, _ = _run(capsys, command, "--port", str(server.port))
            assert status == 0
            table = out[out.index("streams\n"):].splitlines()
            assert table[1].split()[:4] == ["stream", "head", "epoch", "member"]
            assert table[3].split()[:3] == ["train", "5", "0"]
            assert table[4].split()[:4] == ["0", "producer", "0", "live"]
            rows = {ln.split()[0]: ln.split()[1:] for ln in table[5:7]}
            # The slow job acknowledged nothing yet (its cursor is where it joined).
            assert rows["lr=0.2"][:3] == ["live", "0", "5"]
            assert rows["lr=0.1"][0] == "live"
        assert st["consumers"]["lr=0.2"]["lag"] == 5


def _stream_rows(lines: list[str]) -> dict[str, list[str]]:
    """The rows of a streams table (after its rule) by their first word: the stream, the
    producer's index, or the consumer's name."""
    return {ln.split()[0]: ln.split()[1:] for ln in lines}


def _three_calls_one_batch_answered(caller: Client, host: Client) -> list[Any]:
    """Three calls to service "policy"; once the server queued all three, a host takes a
    batch of two and answers it. Returns the three calls' futures (the first two answered,
    the third still queued)."""
    futs = [caller._submit_future(caller.service_call_command("policy", torch.zeros(1, 4)))
            for _ in range(3)]
    # (The calls are sent without waiting: a take before they all arrived would get fewer.)
    wait_until(lambda: caller.stats("policy")["bins"].get("policy", {}).get(
        "service", {}).get("queue") == 3, what="three calls queued")
    b = host.service_take("policy", max_wait_ms=0, max_batch=2, timeout=5)
    assert len(b.values) == 2
    host.service_reply("policy", b.batch, b.values)
    return futs


def _check_kinds_frame(frame: list[str], bins: dict[str, Any]) -> None:
    """A monitor frame of the server below: a stream "train" (head 5, one producer, two
    consumers) and a service "policy" (one call queued, two answered)."""
    streams, services = frame.index("streams"), frame.index("services")
    # The bins' table lists both, with what they hold, then the server's totals.
    rows = _rows(frame[:streams] + frame[-1:])
    assert list(rows) == ["policy", "train", "server"]
    for name in ("policy", "train"):
        assert rows[name][:3] == [str(bins[name]["n_items"]), fmt_bytes(bins[name]["nbytes"]),
                                  "0"]
    assert rows["train"][0] == "5"
    # Then each stream: its head, epoch (samples sent of those announced), window, its
    # producer, and each consumer with its position, lag and stall times.
    assert frame[streams + 1].split() == ["stream", "head", "epoch", "member", "state",
                                          "position", "lag", "stalled", "stall", "total",
                                          "missed"]
    assert _stream_rows(frame[streams + 3:services]) == {
        "train": ["5", "0", "(40/40)", "8", "window,", "on_lag=wait"],
        "0": ["producer", "0", "live", "40"],
        "lr=0.1": ["live", "5", "0", "0.0s", "0.0s", "0"],
        "lr=0.2": ["live", "0", "5", "0.0s", "0.0s", "0"]}, frame
    # And each service: its queue, hosts, calls answered, failed, timed out, mean batch.
    assert frame[services + 1].split()[:3] == ["service", "queue", "hosts"]
    row = frame[services + 3].split()
    assert row[:3] == ["policy", "1", "1"] and row[4:8] == ["2", "0", "0", "2"]


def test_monitor_shows_each_streams_members_and_each_services_queue_live(
        server: EmbeddedServer) -> None:
    from tensorshare.data import StreamConsumer, StreamProducer
    from tensorshare.errors import WaitTimeout

    port = server.port
    with StreamProducer("train", "127.0.0.1", port, window=8, samples_per_epoch=40) as p, \
            StreamConsumer("train", "lr=0.1", "127.0.0.1", port, timeout=5) as fast, \
            StreamConsumer("train", "lr=0.2", "127.0.0.1", port, timeout=5), \
            Client("127.0.0.1", port) as caller, Client("127.0.0.1", port) as host:
        for _ in range(5):
            p.append(torch.zeros(8, 4))
        assert len(fast.read(5).items) == 5
        with pytest.raises(WaitTimeout):
            fast.read(timeout=0)  # (it acknowledges the five; nothing more yet)
        futs = _three_calls_one_batch_answered(caller, host)
        assert [f.result(5).value.shape for f in futs[:2]] == [(1, 4), (1, 4)]
        bins = caller.stats()["bins"]
        m = _Proc("monitor", "--interval", "0.1", "--port", str(port))
        try:
            wait_until(lambda: len(_frames(m.out)) >= 1, what="a frame")
            _check_kinds_frame(_frames(m.out)[0], bins)
            # It is a live view: the next frames show the stream move on.
            p.append(torch.zeros(8, 4))

            def moved() -> bool:
                last = _frames(m.out)[-1]
                table = _stream_rows(last[last.index("streams") + 3:last.index("services")])
                return table["train"][0] == "6" and table["lr=0.2"][:3] == ["live", "0", "6"]

            wait_until(moved, what="a frame with the new head")
            status, err = m.interrupt()
            assert status == 0, err
            assert err == ""
        finally:
            m.kill()


# --------------------------------------------------------------------------- services


def test_ls_shows_each_services_queue_hosts_and_batches(
        server: EmbeddedServer, capsys: pytest.CaptureFixture[str]) -> None:
    with Client("127.0.0.1", server.port) as caller, Client("127.0.0.1", server.port) as host:
        futs = _three_calls_one_batch_answered(caller, host)
        assert [f.result(5).value.shape for f in futs[:2]] == [(1, 4), (1, 4)]
        status, out, _ = _run(capsys, "ls", "--port", str(server.port))
        assert status == 0
        table = out[out.index("services\n"):].splitlines()
        assert table[1].split() == ["service", "queue", "hosts", "calls/s", "answered", "failed",
                                    "timed", "out", "mean", "batch", "latency"]
        row = table[3].split()
        assert row[:3] == ["policy", "1", "1"] and row[4:8] == ["2", "0", "0", "2"]
