"""The inspection commands of ``tensorshare``: ``ls``, ``peek``, ``watch``, ``monitor``, ``stats``.

Each ``run_*`` function takes the parsed arguments of its command (see :mod:`tensorshare.cli`)
and returns the exit status. They talk to a server through the blocking
:class:`~tensorshare.client.Client` (``stats`` requests, peeks, listens) and render with
``rich``. Failures that are the user's or the network's raise :class:`ToolError` or a
:class:`~tensorshare.errors.TensorShareError`; ``cli`` prints those as one line.

``rich`` and ``torch`` are imported inside the commands, so that importing this module (and
``tensorshare``) stays cheap, and ``ls``/``watch``/``monitor``/``stats`` never import torch.
"""

from __future__ import annotations

import argparse
import json
import math
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..client.rates import RATES as _RATES
from ..client.rates import Rates, quantile
from ..errors import Timeout, TransportError

if TYPE_CHECKING:
    from rich.console import Console, JustifyMethod, RenderableType
    from rich.tree import Tree

    from ..client.blocking import Client

__all__ = [
    "ToolError",
    "fmt_age",
    "fmt_bytes",
    "run_ls",
    "run_monitor",
    "run_peek",
    "run_stats",
    "run_watch",
    "sparkline",
    "tensor_stats",
]


class ToolError(Exception):
    """A failure explained in one line (printed as ``tensorshare COMMAND: message``)."""


# --------------------------------------------------------------------------- formatting


def fmt_bytes(n: float) -> str:
    """A byte count for people, in binary units, as the server counts its limits
    (``--max-memory``, quotas): ``36 B``, ``4.0 KiB``, ``1.2 GiB``. (Rates stay MB/s.)"""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1023.95 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def fmt_age(seconds: float) -> str:
    """A duration, shortest first: ``0.4s``, ``12s``, ``3m05s``, ``2h05m``, ``3d04h``."""
    s = max(seconds, 0.0)
    if s < 10:
        return f"{s:.1f}s"
    if s < 60:
        return f"{int(s)}s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d{h:02d}h"


_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int) -> str:
    """The last ``width`` values as bars scaled to their maximum, newest on the right.

    Zero (or a missing sample) is a blank, so an idle rate shows as nothing.
    """
    values = values[-width:]
    top = max(values, default=0.0)
    bars = "".join(" " if v <= 0 or top <= 0 else _BARS[min(7, max(0, round(v / top * 7)))]
                   for v in values)
    return bars.rjust(width)


def _num(x: float | int) -> str:
    if isinstance(x, int):
        return str(x)
    return f"{x:.4g}"


def _console() -> Console:
    from rich.console import Console

    # No highlighting: numbers and names print as they are (and tests read them as such).
    return Console(highlight=False)


def _print(console: Console, renderable: RenderableType) -> None:
    """Print on a terminal as wide as it is; elsewhere (a pipe, a file) as wide as the
    content needs, so that scripts and pasted output never see wrapped rows."""
    if not console.is_terminal:
        from rich.measure import Measurement

        need = Measurement.get(console, console.options.update_width(100_000), renderable)
        console.width = max(need.maximum, 20)
        with console.capture() as capture:
            console.print(renderable)
        # Without the padding rich gives the last column: clean to diff, grep and paste.
        console.file.write("".join(ln.rstrip() + "\n" for ln in capture.get().splitlines()))
        console.file.flush()
        return
    console.print(renderable)


def _client(args: argparse.Namespace, *, reconnect: bool = False) -> Client:
    """A client for a command. One-shot commands do not reconnect and keep no session, so a
    missing server fails at once with one line; watch and monitor ride out restarts."""
    from ..client.blocking import Client

    try:
        return Client(args.host, args.port, timeout=args.timeout, reconnect=reconnect,
                      session=False, name=f"tensorshare-{args.command}", tls=args.tls,
                      tls_ca=args.tls_ca, token_file=args.token_file,
                      user=getattr(args, "user", None))
    except (ValueError, OSError) as exc:  # an address or a token file the client cannot use
        raise ToolError(str(exc)) from None


def _where(args: argparse.Namespace) -> str:
    """The server's address as the command was told it (or the environment says)."""
    from ..client.endpoint import resolve

    try:
        return str(resolve(args.host, args.port, tls=args.tls))
    except ValueError:
        return f"{args.host}:{args.port}"


class _Interrupt:
    """Turns SIGINT/SIGTERM into a flag the main loop polls.

    The handler only sets a bool: raising KeyboardInterrupt in the middle of a client call
    could leave the client's locks held and make the clean exit hang. A second Ctrl+C
    interrupts for real.
    """

    def __init__(self) -> None:
        self.flag = False

    def _handle(self, signum: int, frame: Any) -> None:
        if self.flag:
            raise KeyboardInterrupt
        self.flag = True

    def sleep(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; return early (True) once interrupted."""
        deadline = time.monotonic() + seconds
        while not self.flag:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(left, 0.05))
        return self.flag


@contextmanager
def _interruptible() -> Iterator[_Interrupt]:
    stop = _Interrupt()
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, stop._handle)
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _totals(bins: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {"bins": len(bins),
            "items": sum(b["n_items"] for b in bins.values()),
            "nbytes": sum(b["nbytes"] for b in bins.values()),
            "listeners": sum(b["listeners"] for b in bins.values())}


# --------------------------------------------------------------------------- other kinds


def user_table(server: dict[str, Any]) -> list[RenderableType]:
    """The users' table (a server with users): each one's memory held against its quota,
    connections, requests, denials and quota refusals; only the asking user's own row when
    it may not see the whole server."""
    from rich import box
    from rich.table import Table

    users = server.get("users") or ({"(you)": server["user"]} if "user" in server else {})
    if not users or set(users) == {"default"}:  # (no users file: nothing to tell apart)
        return []
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title="users",
                  title_justify="left")
    for col in ("user", "memory", "of quota", "connections", "requests", "denied",
                "over quota"):
        table.add_column(col, justify="left" if col == "user" else "right")
    for name, u in users.items():
        mem, quota = u["memory"], u["memory"]["max_memory"]
        conns = str(u["connections"]) + ("" if u["max_connections"] is None
                                         else f" / {u['max_connections']}")
        table.add_row(name, fmt_bytes(mem["total"]),
                      "-" if quota is None else f"{100 * mem['total'] / quota:.0f}% of "
                                                f"{fmt_bytes(quota)}",
                      conns, str(u["requests"]), str(u["denials"]), str(u["refusals"]))
    return [table]


def replication_table(server: dict[str, Any]) -> list[RenderableType]:
    """The replication table (a server with replicas, or a replica): its role, term, offset
    and resyncs in the title; a primary's row per replica (address, offset, lag in bytes and
    seconds, live), a replica's one row for its primary."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    r = server.get("replication")
    if not r or (server.get("role") == "primary" and not r.get("replicas")
                 and not server.get("term")):
        return []  # (never replicated: nothing to tell)
    fenced = f", fenced by term {r['fenced_by']}" if "fenced_by" in r else ""
    need = f", min_replicas {r['min_replicas']}" if r.get("min_replicas") else ""
    title = (f"replication: {server['role']}, term {server['term']}, offset {r['offset']}"
             f"{need}{fenced}; resyncs {r['full_resyncs']} full, {r['partial_resyncs']} "
             f"partial, {r.get('replicas_dropped', 0)} dropped")
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    if "primary" in r:  # a replica: its primary
        for col in ("primary", "offset", "lag s", "synced"):
            table.add_column(col, justify="left" if col == "primary" else "right")
        lag = "-" if r.get("lag_s") is None else f"{r['lag_s']:.3f}"
        table.add_row(str(r["primary"]), str(r["offset"]), lag, "yes" if r["synced"] else "no")
        return [Text(title), table]
    for col in ("replica", "offset", "lag bytes", "lag s", "live"):
        table.add_column(col, justify="left" if col == "replica" else "right")
    for x in r["replicas"]:
        table.add_row(x["address"] or "-", str(x["offset"]), str(x["lag_bytes"]),
                      f"{x['lag_s']:.3f}", "yes" if x.get("live") else "no")
    return [Text(title), table]


#: The columns of the streams', services' and replay bins' tables, and how each is justified.
_STREAM_COLUMNS: tuple[tuple[str, JustifyMethod], ...] = (
    ("stream", "left"), ("head", "right"), ("epoch", "right"), ("member", "left"),
    ("state", "left"), ("position", "right"), ("lag", "right"), ("stalled", "right"),
    ("stall total", "right"), ("missed", "right"))
_SERVICE_COLUMNS: tuple[tuple[str, JustifyMethod], ...] = (
    ("service", "left"), ("queue", "right"), ("hosts", "right"), ("calls/s", "right"),
    ("answered", "right"), ("failed", "right"), ("timed out", "right"),
    ("mean batch", "right"), ("latency", "right"))
_REPLAY_COLUMNS: tuple[tuple[str, JustifyMethod], ...] = (
    ("replay", "left"), ("size", "right"), ("sampler", "left"), ("inserts", "right"),
    ("samples", "right"), ("inserts/s", "right"), ("samples/s", "right"),
    ("limiter", "left"), ("waiting", "right"))


def _kind_table(bins: dict[str, dict[str, Any]], kind: str, title: str,
                columns: Sequence[tuple[str, JustifyMethod]],
                rows: Callable[[str, dict[str, Any]], Iterator[tuple[str, ...]]]
                ) -> list[RenderableType]:
    """The table titled ``title`` of the bins of ``kind`` (none where no bin is of that kind):
    ``columns`` (``(heading, justify)``), the ``rows(name, summary)`` of each bin."""
    from rich import box
    from rich.table import Table

    found = {n: b[kind] for n, b in bins.items() if b.get("kind") == kind}
    if not found:
        return []
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  title=title, title_justify="left")
    for col, justify in columns:
        table.add_column(col, justify=justify)
    for name, summary in found.items():
        for row in rows(name, summary):
            table.add_row(*row)
    return [table]


def kind_tables(bins: dict[str, dict[str, Any]]) -> list[RenderableType]:
    """The tables of the bins of other kinds (streams: their consumers), after the main one."""
    return (_kind_table(bins, "stream", "streams", _STREAM_COLUMNS, _stream_rows)
            + _kind_table(bins, "service", "services", _SERVICE_COLUMNS, _service_rows)
            + _kind_table(bins, "replay", "replay bins", _REPLAY_COLUMNS, _replay_rows))


def _stream_rows(name: str, st: dict[str, Any]) -> Iterator[tuple[str, ...]]:
    """A stream: its head and epoch, then a row per producer and per consumer."""
    epoch = f"{st['epoch']} ({st['epoch_sent']}/{st['epoch_samples'] or '?'})"
    yield (name, str(st["head"]), epoch, f"{st['window']} window, "
           f"on_lag={st['on_lag']}", "finished" if st["finished"] else
           ("broken" if st["broken"] else ""), "", "", "", "", "")
    for idx, p in st["producers"].items():
        yield ("", "", str(p["epoch"]), f"producer {idx}", p["state"],
               str(p["sent"]), "", "", "", "")
    for cname, c in st["consumers"].items():
        yield ("", "", "", cname, c["state"], _dash(c["position"]), _dash(c["lag"]),
               f"{c['stalled_s']:.1f}s", f"{c['stall_total_s']:.1f}s", str(c["missed"]))


def _service_rows(name: str, sv: dict[str, Any]) -> Iterator[tuple[str, ...]]:
    """A service: queue, hosts, calls/s, mean batch and latency."""
    yield (name, str(sv["queue"]), str(sv["hosts"]), f"{sv['calls_per_s']:g}",
           str(sv["answered"]), str(sv["failed"]), str(sv["timed_out"]),
           f"{sv['mean_batch']:g}", f"{sv['latency_mean_ms']:.2f} ms")


def _replay_rows(name: str, rp: dict[str, Any]) -> Iterator[tuple[str, ...]]:
    """A replay bin: size, inserts/s and samples/s, the rate limiter, what waits."""
    lim = rp["limiter"]
    held = [side for side in ("inserts", "samples") if lim[f"{side}_blocked"]]
    limiter = f"{lim['kind']}" + (f" diff {lim['diff']:g}" if lim["diff"] is not None
                                  else "") + (f", {'+'.join(held)} held" if held else "")
    yield (name, f"{rp['size']} / {rp['max_size']}", rp["sampler"],
           str(rp["inserts"]), str(rp["samples"]), f"{rp['inserts_per_s']:g}",
           f"{rp['samples_per_s']:g}", limiter,
           f"{rp['waiting_inserts']} in, {rp['waiting_samples']} out")


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


# --------------------------------------------------------------------------- ls


def run_ls(args: argparse.Namespace) -> int:
    """``tensorshare ls [GLOB] [--json]``: every bin with what it holds, then the totals."""
    with _client(args) as c:
        bins = c.stats(args.glob)["bins"]
    totals = _totals(bins)
    if args.json:
        print(json.dumps({"bins": bins, "totals": totals}, indent=2))
        return 0
    from rich import box
    from rich.table import Table

    # Ages are measured against this machine's clock (changed_at is the server's): with
    # both on one machine, or clocks in sync, they are exact.
    now = time.time()
    latest = max((b["changed_at"] for b in bins.values()), default=0.0)
    n = totals["bins"]
    # The totals are the table's footer, under a rule.
    table = Table(box=box.SIMPLE, show_edge=False, pad_edge=False, show_footer=True)
    columns: tuple[tuple[str, JustifyMethod, str], ...] = (
        ("bin", "left", "total"), ("kind", "left", f"{n} bin{'' if n == 1 else 's'}"),
        ("items", "right", str(totals["items"])),
        ("bytes", "right", fmt_bytes(totals["nbytes"])), ("version", "right", ""),
        ("listeners", "right", str(totals["listeners"])),
        ("changed", "right", fmt_age(now - latest) + " ago" if latest else ""),
        ("value / first item", "left", ""), ("last item", "left", ""))
    for name, justify, footer in columns:
        table.add_column(name, justify=justify, footer=footer)
    for name, b in bins.items():
        changed = b["changed_at"]
        table.add_row(name, b["kind"], str(b["n_items"]), fmt_bytes(b["nbytes"]),
                      str(b["version"]), str(b["listeners"]),
                      fmt_age(now - changed) + " ago" if changed else "never",
                      b["first"] or "",
                      # Most lists hold items of one shape: say so rather than repeat it.
                      "same as first" if b["last"] and b["last"] == b["first"] else
                      b["last"] or "")
    from rich.console import Group

    _print(_console(), Group(table, *kind_tables(bins)))
    return 0


# --------------------------------------------------------------------------- peek


def tensor_stats(t: Any) -> dict[str, Any]:
    """dtype, shape and bytes of a tensor, and what of min/max/mean/std/nan/inf applies.

    Floating tensors: NaN and Inf counts, and min/max/mean/std of their finite values
    (computed in float64, so float16/bfloat16 neither overflow nor lose the mean). Integer
    and bool tensors: min, max, mean (no std, no NaN). Complex tensors: NaN/Inf counts only.
    Empty tensors: no statistics.
    """
    import torch

    out: dict[str, Any] = {"dtype": str(t.dtype).removeprefix("torch."),
                           "shape": list(t.shape), "nbytes": t.numel() * t.element_size()}
    if t.numel() == 0:
        return out
    t = t.detach()
    try:
        if t.is_floating_point():
            x = t.to(torch.float64).flatten()
            nan = int(torch.isnan(x).sum())
            inf = int(torch.isinf(x).sum())
            finite = x[torch.isfinite(x)] if nan or inf else x
            if finite.numel():
                out.update(min=float(finite.min()), max=float(finite.max()),
                           mean=float(finite.mean()))
                if finite.numel() > 1:
                    out["std"] = float(finite.std())
            out.update(nan=nan, inf=inf)
        elif t.is_complex():
            out.update(nan=int(torch.isnan(t).sum()), inf=int(torch.isinf(t).sum()))
        else:  # integers and bool
            x = t.to(torch.int64)
            out.update(min=int(x.min()), max=int(x.max()),
                       mean=float(x.to(torch.float64).mean()))
    except (RuntimeError, TypeError):  # a dtype torch cannot reduce: show what we have
        pass
    return out


def _tensor_line(st: dict[str, Any]) -> str:
    shape = ",".join(str(d) for d in st["shape"])
    parts = [f"{st['dtype']}[{shape}]", fmt_bytes(st["nbytes"])]
    stats = " ".join(f"{k}={_num(st[k])}" for k in ("min", "max", "mean", "std", "nan", "inf")
                     if k in st)
    if stats:
        parts.append(stats)
    return "  ".join(parts)


def _scalar(value: Any) -> str:
    if value is None:
        return "None"
    if type(value) is IpcShown:
        return repr(value)
    text = repr(value)
    if len(text) > 60:
        text = text[:59] + "…"
    return f"{type(value).__name__} {text}"


def _label(value: Any) -> str:
    """One line for a value: a tensor's dtype, shape, bytes and statistics; a container's
    type and size; a scalar's type and repr."""
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor | np.ndarray):
        t = torch.from_numpy(value) if isinstance(value, np.ndarray) else value
        prefix = "ndarray " if isinstance(value, np.ndarray) else ""
        return prefix + _tensor_line(tensor_stats(t))
    if isinstance(value, dict | list | tuple):
        n = len(value)
        what = "key" if isinstance(value, dict) else "item"
        return f"{type(value).__name__} ({n} {what}{'' if n == 1 else 's'})"
    return _scalar(value)


def _children(node: Tree, value: Any, *, show_values: bool, limit: int) -> None:
    """Add what is inside ``value`` under ``node``: a container's entries (at most
    ``limit``), or a tensor's values with ``show_values``."""
    from rich.text import Text

    if isinstance(value, dict | list | tuple):
        pairs = value.items() if isinstance(value, dict) else enumerate(value)
        for i, (k, v) in enumerate(pairs):
            if i == limit:
                node.add(Text(f"… {len(value) - limit} more (--limit)"))
                break
            label = f"{k}: " if isinstance(value, dict) else f"[{k}] "
            child = node.add(Text(label + _label(v)))
            _children(child, v, show_values=show_values, limit=limit)
    elif show_values and hasattr(value, "shape"):  # a tensor or an array, as torch prints it
        node.add(Text(str(value)))


class IpcShown:
    """A cuda-ipc item as peek shows it (peek never opens another process's GPU memory)."""

    __slots__ = ("fields",)

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def __repr__(self) -> str:
        f = self.fields
        dims = ",".join(str(d) for d in f["shape"])
        return (f"cuda-ipc {f['dtype']}[{dims}] on GPU-{f['uuid'].hex()[:8]} (pid {f['pid']}, "
                f"slot {f['slot']}, generation {f['gen']})")


def _peek_fetch(c: Any, name: str, max_items: int | None) -> Any:
    """A peek of ``name`` whose cuda-ipc items are described, not opened."""
    from ..client.ops import Command, decode_fetched
    from ..wire.messages import Fetch, FetchSpec

    depth = c.limits.max_depth
    return c._execute(Command(Fetch(0, name, FetchSpec(False, max_items)),
                              f"peek on bin {name!r}",
                              lambda reply: decode_fetched(reply, depth, IpcShown)))


def run_peek(args: argparse.Namespace) -> int:
    """``tensorshare peek BIN [--item N] [--values] [--limit K]``: the value as a tree."""
    from rich.text import Text
    from rich.tree import Tree

    from ..errors import BinNotFound

    with _client(args) as c:
        summary = c.stats(_literal_glob(args.bin))["bins"].get(args.bin)
        if summary is None or summary["n_items"] == 0:
            raise BinNotFound(f"bin {args.bin!r} does not exist or is empty")
        n = summary["n_items"]
        item = args.item
        if item is not None:
            if summary["kind"] != "list":
                raise ToolError(f"bin {args.bin!r} holds one value (put), not a list: "
                                "--item is for bins written by append")
            index = item if item >= 0 else n + item
            if not 0 <= index < n:
                raise ToolError(f"bin {args.bin!r} has {n} item{'' if n == 1 else 's'}; "
                                f"there is no item {item}")
            # The protocol fetches from the front: item N comes with the N before it.
            result = _peek_fetch(c, args.bin, index + 1)
            if len(result.value) <= index:
                raise ToolError(f"item {item} of bin {args.bin!r} is beyond what fits in one "
                                f"reply (the first {len(result.value)} items)")
        else:
            result = _peek_fetch(c, args.bin,
                                 args.limit if summary["kind"] == "list" else None)
    opts = {"show_values": args.values, "limit": args.limit}
    head = f"{args.bin}: {result.kind} bin, version {result.version}, "
    if result.kind == "list":
        head += f"{result.n_items} item{'' if result.n_items == 1 else 's'}, "
    head += fmt_bytes(summary["nbytes"])
    # The root is the bin; a value (or the one item asked for) hangs right under it.
    if result.kind == "value" or item is not None:
        value = result.value if result.kind == "value" else result.value[index]
        if item is not None:
            head += f"; item {index}"
        tree = Tree(Text(f"{head}: {_label(value)}"))
        _children(tree, value, **opts)
    else:
        items = result.value
        tree = Tree(Text(head))
        for i, v in enumerate(items):
            _children(tree.add(Text(f"[{i}] {_label(v)}")), v, **opts)
        if result.n_items > len(items):
            more = result.n_items - len(items)
            tree.add(Text(f"… {more} more item{'' if more == 1 else 's'} (--item N shows one, "
                          "--limit K the first K)"))
    _print(_console(), tree)
    return 0


def _literal_glob(name: str) -> str:
    """A stats glob that matches exactly ``name`` (its pattern characters made literal)."""
    return "".join(f"[{ch}]" if ch in "*?[" else ch for ch in name)


# --------------------------------------------------------------------------- watch


def _is_glob(pattern: str) -> bool:
    return any(ch in pattern for ch in "*?[")


def run_watch(args: argparse.Namespace) -> int:
    """``tensorshare watch BIN|GLOB ...``: one line per change of the bins, as it happens.

    Exact names are listened to at once (they need not exist yet). A glob is looked up with
    ``stats(glob)`` every ``--interval`` seconds and each new bin it matches is listened to;
    it is announced with one ``new`` line showing its state then (the change that created it
    happened before it was found). Lines: ``TIME  BIN  OP  version=V  items=N  bytes=B``;
    ``bytes`` is ``?`` when the bin changed again before its size could be read.
    """
    events: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
    names = [p for p in args.bins if not _is_glob(p)]
    globs = [p for p in args.bins if _is_glob(p)]
    out = _WatchLines(width=max(map(len, names), default=0))
    shown = out.shown

    with _interruptible() as stop, _client(args, reconnect=True) as c:
        for name in names:
            c.listen(name, events.put)
        for pattern in globs:
            for name in c.stats(pattern)["bins"]:
                if name not in shown and name not in names:
                    c.listen(name, events.put)
                    shown[name] = -1
        listened = set(names) | set(shown)
        print(f"watching {', '.join(args.bins)} (Ctrl+C to stop)", file=sys.stderr, flush=True)
        next_scan = time.monotonic() + args.interval
        while not stop.flag:
            batch = _next_events(events)
            if batch:
                out.changes(c, batch)
            if globs and time.monotonic() >= next_scan:
                next_scan = time.monotonic() + args.interval
                for name, b in _scan(c, globs, listened, events.put).items():
                    if b["version"] > shown.get(name, -1):
                        shown[name] = b["version"]
                        out.line(name, "new", b["version"], b["n_items"], b["nbytes"])
    return 0


def _next_events(events: queue.SimpleQueue[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events that came within 50 ms: the first one waited for, the rest already there."""
    try:
        batch = [events.get(timeout=0.05)]
    except queue.Empty:
        return []
    while True:
        try:
            batch.append(events.get_nowait())
        except queue.Empty:
            return batch


class _WatchLines:
    """``watch``'s output: the last version printed of each bin (``shown``) and the width
    bin names are padded to (the longest seen so far)."""

    def __init__(self, width: int) -> None:
        self.shown: dict[str, int] = {}
        self.width = width

    def line(self, name: str, op: str, version: int, n_items: int, nbytes: int | None,
             extra: str = "") -> None:
        self.width = width = max(self.width, len(name))
        stamp = datetime.now().strftime("%H:%M:%S.%f")[:-3]
        size = "?" if nbytes is None else fmt_bytes(nbytes)
        print(f"{stamp}  {name:<{width}}  {op:<7} version={version}  items={n_items}  bytes={size}{extra}",
              flush=True)

    def changes(self, c: Client, batch: list[dict[str, Any]]) -> None:
        """One line per event of ``batch`` not shown yet, with the bin's size if still true."""
        shown = self.shown
        sizes = _sizes(c, {ev["bin"] for ev in batch})
        for ev in batch:
            name, version = ev["bin"], ev["version"]
            if ev.get("restarted"):
                shown.pop(name, None)  # versions start again on a new server
            elif version <= shown.get(name, -1):
                continue  # already shown (a bin found by a glob scan)
            shown[name] = version
            size = sizes.get(name)
            nbytes = 0 if ev["n_items"] == 0 else (
                size[1] if size is not None and size[0] == version else None)
            extra = "".join(f"  {k}={ev[k]}" for k in ("skipped", "dropped")
                            if ev.get(k))
            self.line(name, ev["op"], version, ev["n_items"], nbytes, extra)


def _sizes(c: Client, names: set[str]) -> dict[str, tuple[int, int]]:
    """``bin -> (version, nbytes)`` now, for the bins that exist (best effort)."""
    out: dict[str, tuple[int, int]] = {}
    for name in names:
        try:
            b = c.stats(_literal_glob(name))["bins"].get(name)
        except (TransportError, Timeout):
            return out  # the server is away: sizes unknown, the lines still print
        if b is not None:
            out[name] = (b["version"], b["nbytes"])
    return out


def _scan(c: Client, globs: list[str], listened: set[str],
          callback: Callable[[dict[str, Any]], Any]) -> dict[str, dict[str, Any]]:
    """Listen to the bins matching ``globs`` that are not listened to yet; return their
    summaries read after the listen (so no change falls between the two)."""
    found: dict[str, dict[str, Any]] = {}
    try:
        for pattern in globs:
            for name in c.stats(pattern)["bins"]:
                if name not in listened:
                    c.listen(name, callback)
                    listened.add(name)
                    b = c.stats(_literal_glob(name))["bins"].get(name)
                    if b is not None:
                        found[name] = b
    except (TransportError, Timeout):
        pass  # the server is away: the next scan tries again
    return found


# --------------------------------------------------------------------------- monitor

class _Rates(Rates):
    """:class:`~tensorshare.client.rates.Rates` (shared with the dashboard), drawn as text."""

    def cell(self, name: str, rate: str) -> str:
        """A rate's history, then its value now (``-`` when not known this time)."""
        r = self.rates.get(name, {}).get(rate)
        hist = self.hist.get(name)
        if r is None and hist is None:
            return "-"
        text = "-" if r is None else f"{r:,.1f}" if rate in ("put", "append", "get") else \
            f"{r:,.2f}"
        bars = sparkline(list(hist[rate]) if hist else [], self.history)
        # The history first, ending right where the number starts: bars line up by row.
        return f"{bars} {text:>7}"


def _monitor_view(snap: dict[str, Any] | None, rates: _Rates, address: str,
                  interval: float, problem: str | None, glob: str | None) -> RenderableType:
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    if snap is None:
        return Text(f"tensorshare at {address}: {problem or 'connecting'}")
    s, bins = snap["server"], snap["bins"]
    mem = s["memory"]
    req = "-" if rates.req_rate is None else f"{rates.req_rate:,.1f}"
    held = mem["sessions"] + mem["output"]
    head = (f"{s['server']} at {address}  up {fmt_age(s['uptime'])}  "
            f"connections {s['connections']}  listeners {s['listeners']}  "
            f"bins {s['bins']}  stored {fmt_bytes(mem['stored'])}  "
            f"held for clients {fmt_bytes(held)}  requests/s {req}")
    foot = (f"every {interval:g}s, history of the last {rates.history}; server: all bins, "
            f"from the server's request counters; Ctrl+C quits")
    if problem:
        foot = f"{problem} (showing the last answer); {foot}"
    # The server's totals are the footer, under a rule.
    # (With a glob the reply lists only some bins: the server's item count is not known.)
    items = "" if glob is not None else str(sum(b["n_items"] for b in bins.values()))
    table = Table(box=box.SIMPLE, show_edge=False, pad_edge=False, show_footer=True)
    table.add_column("bin", footer="server")
    for col, footer in (("items", items),
                        ("bytes", fmt_bytes(mem["stored"])), ("listeners", str(s["listeners"])),
                        *zip(("put/s", "append/s", "get/s", "in MB/s", "out MB/s"),
                             (rates.cell("", r) for r in _RATES), strict=True)):
        table.add_column(col, justify="right", no_wrap=True, footer=footer)
    for name in sorted(set(bins) | set(rates.missing)):
        b = bins.get(name)
        if b is None:  # emptied since (or deleted): kept for a while, see _Rates
            row = ["0", "0 B", "-"]
        else:
            row = [str(b["n_items"]), fmt_bytes(b["nbytes"]), str(b["listeners"])]
        table.add_row(name, *row, *(rates.cell(name, r) for r in _RATES))
    return Group(Text(head), table, *kind_tables(bins), *replication_table(s), *user_table(s),
                 Text(foot))


def run_monitor(args: argparse.Namespace) -> int:
    """``tensorshare monitor [GLOB]``: a live table of every bin's rates, redrawn in place.

    On a terminal the table is redrawn in place (``rich.live.Live``); to a pipe or a file
    each refresh is printed after the last one, so a script or a log gets every frame.
    """
    rates = _Rates(args.history)
    console = _console()
    address = _where(args)
    snap: dict[str, Any] | None = None
    problem: str | None = None

    def poll(c: Client) -> None:
        nonlocal snap, problem
        try:
            new = c.stats(args.glob)
        except (TransportError, Timeout) as exc:
            problem = f"no answer: {exc}"
            return
        problem = None
        snap = new
        rates.update(new)

    def view() -> RenderableType:
        return _monitor_view(snap, rates, address, args.interval, problem, args.glob)

    with _interruptible() as stop, _client(args, reconnect=True) as c:
        poll(c)
        if console.is_terminal:
            from rich.live import Live

            # Redrawn from this thread only (no auto refresh): nothing races the client.
            with Live(view(), console=console, auto_refresh=False,
                      redirect_stdout=False, redirect_stderr=False) as live:
                while not stop.sleep(args.interval):
                    poll(c)
                    live.update(view(), refresh=True)
        else:
            _print(console, view())
            while not stop.sleep(args.interval):
                poll(c)
                console.print()
                _print(console, view())
                console.file.flush()
    return 0


# --------------------------------------------------------------------------- stats


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.3g} ms"


#: The columns of ``tensorshare stats``'s table of ops, and how each is justified.
_OP_COLUMNS: tuple[tuple[str, JustifyMethod], ...] = (
    ("op", "left"), ("requests", "right"), ("bytes in", "right"), ("bytes out", "right"),
    ("mean", "right"), ("p50 ≤", "right"), ("p99 ≤", "right"))


def run_stats(args: argparse.Namespace) -> int:
    """``tensorshare stats [--json]``: uptime, connections, memory, counters since start."""
    with _client(args) as c:
        reply = c.stats()
    if args.json:
        print(json.dumps(reply, indent=2))
        return 0
    from rich import box
    from rich.console import Group
    from rich.table import Table

    s, bins = reply["server"], reply["bins"]
    counters = s["counters"]
    info = Table.grid(padding=(0, 2))
    info.add_column()
    info.add_column()
    for key, value in _server_rows(args, s, bins):
        info.add_row(key, value)

    ops = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col, justify in _OP_COLUMNS:
        ops.add_column(col, justify=justify)
    lat = s["latency"]
    bounds: list[float] = lat["buckets"]
    for op in sorted(set(s["requests"]) | set(s["bytes_in"])):
        n = s["requests"].get(op, 0)
        counts = lat["ops"].get(op, [])
        mean = lat["sum_us"].get(op, 0) / 1e6 / n if n else None
        ops.add_row(op, str(n), fmt_bytes(s["bytes_in"].get(op, 0)),
                    fmt_bytes(s["bytes_out"].get(op, 0)), _ms(mean),
                    _bucket(quantile(bounds, counts, 0.5), bounds),
                    _bucket(quantile(bounds, counts, 0.99), bounds))

    events = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    events.add_column("counter")
    events.add_column("since start", justify="right")
    for key in sorted(counters):
        events.add_row(key, str(counters[key]))
    for code in sorted(s["errors"]):
        events.add_row(f"errors: {code}", str(s["errors"][code]))
    _print(_console(), Group(info, "", ops, "", events, *kind_tables(bins),
                             *replication_table(s), *user_table(s)))
    return 0


def _bucket(bound: float | None, bounds: list[float]) -> str:
    if bound is None:
        return "-"
    if bound == math.inf:
        return f"> {_num(bounds[-1] * 1000)} ms"
    return f"{_num(bound * 1000)} ms"


def _server_rows(args: argparse.Namespace, s: dict[str, Any], bins: dict[str, Any]
                 ) -> list[tuple[str, str]]:
    """The ``stats`` view's rows about the server as a whole."""
    mem, waiting, counters = s["memory"], s["waiting"], s["counters"]
    limit = " (no limit)" if mem["max_memory"] is None else \
        f" of max_memory {fmt_bytes(mem['max_memory'])}"
    return [
        ("server", f"{s['server']} at {_where(args)} (id {s['server_id']})"),
        ("uptime", fmt_age(s["uptime"])),
        ("connections", f"{s['connections']} open, {counters.get('connections_total', 0)} "
                        f"since start, {counters.get('connections_refused', 0)} refused"),
        ("listeners", str(s["listeners"])),
        ("sessions", f"{s['sessions']} ({counters.get('sessions_resumed', 0)} resumed, "
                     f"{counters.get('sessions_expired', 0)} expired)"),
        ("bins", f"{s['bins']} holding {sum(b['n_items'] for b in bins.values())} items"),
        ("memory", f"{fmt_bytes(mem['total'])}{limit}: stored {fmt_bytes(mem['stored'])}, "
                   f"sessions {fmt_bytes(mem['sessions'])}, output {fmt_bytes(mem['output'])}, "
                   f"receiving {fmt_bytes(mem.get('receiving', 0))}"),
        ("waiting", f"{waiting['fetches']} fetches, {waiting['appends']} blocked appends"),
    ]
