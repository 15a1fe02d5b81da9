"""Rates from successive ``stats`` replies: what ``tensorshare monitor`` and the dashboard
show, computed once.

Pure code over the dicts :meth:`~tensorshare.client.ops.Ops.stats` returns: no I/O, no
clock (the server's ``uptime`` is the time base, so a late reply never makes a rate jump).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

__all__ = ["RATES", "Rates", "quantile"]

#: The rates kept per bin and for the server: ops/s of three ops, then MB/s in and out.
RATES = ("put", "append", "get", "in", "out")


class Rates:
    """Per-bin and server-wide rates from successive stats snapshots, with a short history.

    The server lists only bins that hold something, so a queue that its consumers drain
    comes and goes between snapshots. Such a bin stays known (as empty) for ``history``
    samples; when it is back, its rate over the whole gap is known again (the bin's counters
    kept counting) and fills the samples it missed. The server's rates (key ``""``) come
    from the server's own per-op counters: all bins, never missing one.

    Attributes:
        rates: bin (``""``: the server) -> rate name (:data:`RATES`) -> per second, from the
            last two snapshots; a bin seen for the first time has none yet.
        hist: bin -> rate name -> the last ``history`` rates, oldest first.
        missing: bin -> snapshots since it was last listed.
        req_rate: the server's requests per second (every op), or ``None`` before two
            snapshots of the same server.
    """

    def __init__(self, history: int) -> None:
        self.history = history
        self.server_id: str | None = None
        self.seen: dict[str, tuple[float, dict[str, float]]] = {}  # bin -> (uptime, counts)
        self.missing: dict[str, int] = {}
        self.rates: dict[str, dict[str, float]] = {}
        self.hist: dict[str, dict[str, deque[float]]] = {}
        self.req_rate: float | None = None

    @staticmethod
    def _bin_counts(b: dict[str, Any]) -> dict[str, float]:
        ops = b["ops"]
        return {"put": ops.get("put", 0), "append": ops.get("append", 0),
                "get": ops.get("get", 0), "in": b["bytes_in"] / 1e6,
                "out": b["bytes_out"] / 1e6}

    @staticmethod
    def _server_counts(s: dict[str, Any]) -> dict[str, float]:
        req, b_in, b_out = s["requests"], s["bytes_in"], s["bytes_out"]
        return {"put": req.get("put", 0), "append": req.get("append", 0),
                "get": req.get("get", 0),
                "in": (b_in.get("put", 0) + b_in.get("append", 0)) / 1e6,
                "out": (b_out.get("get", 0) + b_out.get("peek", 0)) / 1e6,
                "requests": sum(req.values())}

    def _record(self, name: str, rates: dict[str, float], samples: int = 1) -> None:
        self.rates[name] = rates
        hist = self.hist.setdefault(name, {k: deque(maxlen=self.history) for k in RATES})
        for k in RATES:
            hist[k].extend([rates[k]] * min(samples, self.history))

    def update(self, snap: dict[str, Any]) -> None:
        """Take in one ``stats()`` result."""
        server, bins = snap["server"], snap["bins"]
        up = server["uptime"]
        if server["server_id"] != self.server_id or up < self.seen.get("", (0.0, {}))[0]:
            # First look, or another server (a restart): counters start again.
            self.server_id = server["server_id"]
            self.seen, self.missing, self.hist = {}, {}, {}
            self.req_rate = None
        self.rates = {}
        for name, counts in [("", self._server_counts(server))] + [
                (n, self._bin_counts(b)) for n, b in bins.items()]:
            last = self.seen.get(name)
            if last is not None and up > last[0]:
                dt = up - last[0]
                rates = {k: max(counts[k] - last[1][k], 0) / dt for k in counts}
                self._record(name, rates, samples=self.missing.pop(name, 0) + 1)
                if not name:
                    self.req_rate = rates["requests"]
            self.seen[name] = (up, counts)
        for name in list(self.seen):
            if name and name not in bins:
                self.missing[name] = gone = self.missing.get(name, 0) + 1
                if gone > self.history:  # deleted for good, most likely: drop it
                    for table in (self.seen, self.missing, self.hist):
                        table.pop(name, None)


def quantile(bounds: list[float], counts: list[int], q: float) -> float | None:
    """The upper bound of the histogram bucket holding the ``q`` quantile (``math.inf``
    past the last bound; ``None`` for an empty histogram), as the ``stats`` reply's
    ``latency`` gives them: ``bounds`` in seconds, one more count than bounds."""
    total = sum(counts)
    if not total:
        return None
    seen = 0
    for i, n in enumerate(counts):
        seen += n
        if seen >= q * total:
            return bounds[i] if i < len(bounds) else math.inf
    return math.inf
