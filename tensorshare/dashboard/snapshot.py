"""What one tick of the dashboard shows, built from the servers' ``stats`` replies.

Pure code (no I/O, no clock, no Twisted): :func:`server_view` and :func:`bin_rows` turn one
server's reply and its :class:`~tensorshare.client.rates.Rates` into the JSON-ready parts
of a snapshot; :func:`roles` and :func:`relay_lag` relate several servers to each other.
The server's own maps (``stats`` and each bin's summary) are carried verbatim, so the page
and ``tensorshare stats --json`` show the same fields; what the dashboard adds sits beside
them (``rates``, ``ops``, ``role``, ``behind``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from ..client.rates import Rates, quantile

__all__ = ["WRITE_OPS", "bin_rows", "ops_table", "relay_lag", "roles", "server_view"]

#: Ops that change a server (what a relay refuses): counted to tell a primary from its relays.
WRITE_OPS = ("put", "append", "get", "delete", "configure", "restore", "stream_open",
             "stream_append", "stream_end", "service_call", "service_reply", "replay_open",
             "replay_insert", "replay_sample", "replay_update")


def _ms(seconds: float | None) -> tuple[float | None, bool]:
    """A histogram bound in milliseconds, and whether it is past the last bound (JSON has no
    infinity: the page shows ``> last bound``)."""
    if seconds is None:
        return None, False
    if seconds == math.inf:
        return None, True
    return round(seconds * 1000, 3), False


def ops_table(server: dict[str, Any], before: tuple[float, dict[str, int]] | None
              ) -> dict[str, dict[str, Any]]:
    """Per op: requests since start and per second (against ``before``: the uptime and
    request counts of the previous reply of the same server), bytes in and out, and the
    mean, p50 and p99 latency in ms (p50/p99 as the histogram bucket bound holding them)."""
    lat = server["latency"]
    bounds: list[float] = lat["buckets"]
    up, requests = server["uptime"], server["requests"]
    dt = up - before[0] if before is not None else 0.0
    out: dict[str, dict[str, Any]] = {}
    for op in sorted(set(requests) | set(server["bytes_in"]) | set(server["bytes_out"])):
        n = requests.get(op, 0)
        counts = lat["ops"].get(op, [])
        p50, p50_above = _ms(quantile(bounds, counts, 0.5))
        p99, p99_above = _ms(quantile(bounds, counts, 0.99))
        out[op] = {
            "requests": n,
            "per_s": round(max(n - before[1].get(op, 0), 0) / dt, 3)
            if before is not None and dt > 0 else None,
            "bytes_in": server["bytes_in"].get(op, 0),
            "bytes_out": server["bytes_out"].get(op, 0),
            "mean_ms": round(lat["sum_us"].get(op, 0) / 1000 / n, 3) if n else None,
            "p50_ms": p50, "p50_above": p50_above, "p99_ms": p99, "p99_above": p99_above,
        }
    return out


def _rounded(rates: dict[str, float] | None) -> dict[str, float] | None:
    return None if rates is None else {k: round(v, 4) for k, v in rates.items()}


def server_view(index: int, address: str, reply: dict[str, Any] | None, rates: Rates,
                ops: dict[str, dict[str, Any]], *, up: bool, error: str | None,
                shown: int, total: int, listening: int) -> dict[str, Any]:
    """One server's part of a snapshot: its ``stats`` map verbatim (``None`` before its first
    answer), its rates now, the ops table, whether it answers now and why not, how many of
    its bins are in the snapshot (``shown`` of ``total``), and how many this dashboard
    listens to (they count in its ``listeners``)."""
    return {"index": index, "address": address, "up": up, "error": error,
            "stats": None if reply is None else reply["server"],
            "rates": _rounded(rates.rates.get("")), "requests_per_s":
            None if rates.req_rate is None else round(rates.req_rate, 3),
            "ops": ops, "bins_shown": shown, "bins_total": total, "listening": listening,
            "role": "server", "relay_of": None}


def bin_rows(index: int, bins: dict[str, dict[str, Any]], rates: Rates,
             listening: Iterable[str], *, history: bool) -> list[dict[str, Any]]:
    """A row per bin of one server: its summary verbatim, plus ``name``, ``server`` (the
    server's index), ``rates`` (``None`` until known), ``own_listen`` (this dashboard is one
    of its ``listeners``) and, with ``history``, ``spark``: its recent ops/s (put + append +
    get per sample, oldest first)."""
    own = set(listening)
    rows = []
    for name, b in bins.items():
        row = {**b, "name": name, "server": index, "rates": _rounded(rates.rates.get(name)),
               "own_listen": name in own}
        if history:
            hist = rates.hist.get(name)
            row["spark"] = [] if hist is None else [
                round(p + a + g, 3) for p, a, g in zip(hist["put"], hist["append"], hist["get"],
                                                       strict=True)]
        rows.append(row)
    return rows


def roles(replies: Sequence[dict[str, Any] | None]) -> list[tuple[str, int | None]]:
    """``(role, relay_of)`` per server. A relay reports its primary's ``server_id``, so
    servers sharing one are a primary and its relays: the primary is the one that served
    the most changing requests (a relay refuses them all), the first given on a tie. Any
    other server is a ``"shard"`` when there are several, else ``"server"``; but a server
    whose stats say it is a ``"replica"`` or ``"fenced"`` (replication) is that, and one
    that has replicas is a ``"primary"``."""
    groups: dict[str, list[int]] = {}
    answered: dict[int, dict[str, Any]] = {}
    for i, r in enumerate(replies):
        if r is not None:
            groups.setdefault(r["server"]["server_id"], []).append(i)
            answered[i] = r
    alone = "shard" if len(replies) > 1 else "server"
    out: list[tuple[str, int | None]] = [(alone, None)] * len(replies)
    for members in groups.values():
        if len(members) < 2:
            continue

        def writes(i: int) -> int:
            req = answered[i]["server"]["requests"]
            return sum(req.get(op, 0) for op in WRITE_OPS)

        primary = max(members, key=lambda i: (writes(i), -i))
        for i in members:
            out[i] = ("primary", None) if i == primary else ("relay", primary)
    for i, r in enumerate(replies):
        role = None if r is None else r["server"].get("role")
        if role in ("replica", "fenced") or (
                role == "primary" and r["server"]["replication"].get("replicas")):  # type: ignore[index]
            out[i] = (role, None)
    return out


def relay_lag(rows: list[dict[str, Any]], relay_of: Sequence[int | None]) -> dict[int, int]:
    """Mark each relayed bin with ``behind``: versions the relay is behind its primary (0
    when it keeps up). Returns, per relay, how many of its bins are behind."""
    versions = {(r["server"], r["name"]): r["version"] for r in rows}
    lagging: dict[int, int] = {}
    for r in rows:
        primary = relay_of[r["server"]]
        if primary is None:
            continue
        upstream = versions.get((primary, r["name"]))
        if upstream is None:
            continue
        r["behind"] = max(upstream - r["version"], 0)
        if r["behind"]:
            lagging[r["server"]] = lagging.get(r["server"], 0) + 1
    return lagging

