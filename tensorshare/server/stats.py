"""The server's statistics: named counters and a latency histogram per op.

Counters are plain dict entries bumped in place on the hot path; everything else (sums,
summaries) is built only when someone asks, so statistics cost a request almost nothing. The
two maps of the ``stats`` reply (server-wide and per bin; docs/PROTOCOL.md §3.3.8 lists every
field) are built where the server's parts meet: ``core.ServerFactory.server_stats`` and
``bin_stats``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LATENCY_BUCKETS", "Counters", "ServerStats"]

# Upper bounds (seconds) of the request latency histogram's buckets (the last is +Inf).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0, float("inf"))


_getitem = dict.__getitem__


class Counters(dict[str, int]):
    """Named counters that start at 0."""

    def __missing__(self, key: str) -> int:
        return 0


class ServerStats:
    """Counters and per-op latency histograms of one server.

    Attributes:
        counters: named counters (``requests``, ``replayed``, ``errors.CODE``, ``op.OP``,
            ``bytes_in.OP``, ``bytes_out.OP``, ...).
        latency: op -> a count per :data:`LATENCY_BUCKETS` bound, then the sum in µs.
    """

    def __init__(self) -> None:
        self.counters = Counters()
        self.latency: dict[str, list[int]] = {}
        # op -> its counters' names and its latency histogram (looked up once per pass)
        self._keys: dict[str, tuple[str, str, list[int]]] = {}

    def count_error(self, code: str) -> None:
        """Count one error reply by its wire code."""
        self.counters[f"errors.{code}"] += 1

    def observe(self, op: str, bytes_out: int, seconds: float) -> None:
        """Count one answered request: by op, its reply's bytes and its latency."""
        self.observe_many(op, 1, bytes_out, seconds)

    def observe_many(self, op: str, n: int, bytes_out: int, seconds: float) -> None:
        """Count ``n`` requests of one op answered together (one pass over a read: they
        arrived together and their replies left together, so they share one latency)."""
        keys = self._keys.get(op)
        if keys is None:
            keys = self._op_keys(op)
        c = self.counters
        # (``dict.__getitem__`` itself, not ``c[k]``: a dict subclass's subscript is looked up
        # as a Python-level ``__getitem__`` on every use; ``__missing__`` still answers 0)
        k = keys[0]
        c[k] = _getitem(c, k) + n
        k = keys[1]
        c[k] = _getitem(c, k) + bytes_out
        h = keys[2]
        i = 0
        for bound in LATENCY_BUCKETS:  # (bisect_left over 17 bounds, without a call)
            if seconds <= bound:
                break
            i += 1
        h[i] += n
        h[-1] += int(seconds * 1e6) * n

    def _op_keys(self, op: str) -> tuple[str, str, list[int]]:
        """An op's first count: its counters' names and its histogram."""
        h = self.latency[op] = [0] * (len(LATENCY_BUCKETS) + 1)
        keys = self._keys[op] = (f"op.{op}", f"bytes_out.{op}", h)
        return keys

    def add_bytes_in(self, by_op: dict[str, int]) -> None:
        """Fold a connection's received bytes (by op) into the totals, and clear them."""
        for op, n in by_op.items():
            self.counters[f"bytes_in.{op}"] += n
        by_op.clear()

    def _prefixed(self, prefix: str) -> dict[str, int]:
        n = len(prefix)
        return {k[n:]: v for k, v in self.counters.items() if k.startswith(prefix)}

    def report(self) -> dict[str, Any]:
        """Counters, errors, requests, bytes out and latency, as the stats reply has them."""
        return {
            "counters": {k: v for k, v in self.counters.items() if "." not in k},
            "errors": self._prefixed("errors."),
            "requests": self._prefixed("op."),
            "bytes_out": self._prefixed("bytes_out."),
            "latency": {"buckets": [b for b in LATENCY_BUCKETS if b != float("inf")],
                        "ops": {op: h[:-1] for op, h in self.latency.items()},
                        "sum_us": {op: h[-1] for op, h in self.latency.items()}},
        }

    def bytes_in(self, open_connections: dict[str, int]) -> dict[str, int]:
        """Request bytes received, by op: closed connections' and ``open_connections``'."""
        out = self._prefixed("bytes_in.")
        for op, n in open_connections.items():
            out[op] = out.get(op, 0) + n
        return out

