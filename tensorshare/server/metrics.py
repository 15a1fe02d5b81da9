"""Prometheus metrics of a tensorshare server (``tensorshare serve --metrics-port PORT``).

A :class:`ServerCollector` reads the server's statistics at scrape time (in the server's
reactor thread, through :meth:`EmbeddedServer.call`, so it never races the server) and turns
them into Prometheus metric families; :func:`start_metrics_server` serves them over HTTP with
``prometheus_client``'s own server. Nothing is counted twice: the server keeps its counters
anyway (they answer the ``stats`` request), the exporter only translates them.

Metric names are all prefixed ``tensorshare_`` (the README lists them).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from prometheus_client.metrics_core import Metric

    from .embedded import EmbeddedServer

__all__ = ["MetricsServer", "ServerCollector", "start_metrics_server"]

# The server's event counters (the ``counters`` map of its stats) and what they become. The
# total of requests is left out: tensorshare_requests_total{op} already sums to it.
_COUNTERS: dict[str, tuple[str, str]] = {
    "connections_total": ("connections", "connections accepted since the server started"),
    "connections_refused": ("connections_refused",
                            "connections refused at max_connections"),
    "replayed": ("replayed_replies",
                 "remembered replies sent again to a client that reconnected"),
    "sessions_resumed": ("sessions_resumed", "client sessions resumed after a reconnect"),
    "sessions_expired": ("sessions_expired",
                         "client sessions that ended without their client: expired, ended "
                         "by a bye, or ended early to make room"),
    "sessions_evicted": ("sessions_evicted",
                         "detached client sessions ended early because the session table "
                         "was full (max_sessions)"),
    "sessions_taken_over": ("sessions_taken_over",
                            "sessions taken over by another connection while attached"),
    "frames_refused_memory": ("frames_refused_memory",
                              "large frames refused before they arrived: they did not fit "
                              "in max_memory"),
    "stalled_frames": ("stalled_frames",
                       "connections closed for leaving a large frame half sent"),
    "hello_timeouts": ("hello_timeouts", "connections closed for not saying hello in time"),
    "notifications": ("notifications", "change notifications sent to listeners"),
    "notifications_folded": ("notifications_coalesced",
                             "notifications folded into a later one because the listener's "
                             "connection did not read fast enough"),
    "client_paused": ("client_pauses", "times a connection's output backed up and the "
                      "server stopped reading its requests"),
    "client_buffer_closes": ("slow_client_disconnects",
                             "connections closed with more than max_client_buffer bytes "
                             "waiting for them (their queued replies and notifications "
                             "were dropped)"),
    "snapshots_started": ("snapshots", "snapshots of the data directory started"),
    "storage_failures": ("storage_failures", "times the data log could not be written (a "
                         "full disk, an I/O error) and writes were refused until it could"),
}
_NAME_RE = re.compile(r"[^a-zA-Z0-9_]")


class ServerCollector:
    """Reads a server's statistics at each scrape and yields Prometheus metric families.

    Args:
        server: the server to read, or ``None`` until it runs (then only
            ``tensorshare_up 0`` is exported); set :attr:`server` later.
        per_bin: also export per-bin series (labelled ``bin``). Off for servers with very
            many bins, where one series per bin would be too many for Prometheus.
        timeout: seconds the server's reactor has to answer a scrape.
    """

    def __init__(self, server: EmbeddedServer | None = None, *, per_bin: bool = True,
                 timeout: float = 5.0) -> None:
        self.server = server
        self.per_bin = per_bin
        self.timeout = timeout

    def describe(self) -> Iterable[Metric]:
        """Nothing: registering must not call the server (it may not run yet)."""
        return []

    def collect(self) -> Iterator[Metric]:
        """One scrape: the server's statistics as metric families."""
        up = GaugeMetricFamily("tensorshare_up",
                               "1 if the tensorshare server answered this scrape, else 0")
        snapshot = self._snapshot()
        up.add_metric([], 0 if snapshot is None else 1)
        yield up
        if snapshot is not None:
            yield from _families(*snapshot, per_bin=self.per_bin)

    def _snapshot(self) -> tuple[dict[str, Any], dict[str, dict[str, Any]]] | None:
        server = self.server
        if server is None or not server.running:
            return None
        factory = server.factory
        try:
            # In the reactor thread: the server's state is only ever touched there.
            return server.call(lambda: (factory.server_stats(), factory.bin_stats()),
                               timeout=self.timeout)
        except Exception:  # a stopping or stuck server: the scrape says so with up 0
            return None


def _families(stats: dict[str, Any], bins: dict[str, dict[str, Any]], *,
              per_bin: bool) -> Iterator[Metric]:
    """The metric families of one statistics snapshot (see docs/PROTOCOL.md, ``stats``)."""
    info = InfoMetricFamily("tensorshare_server", "the server's software and data set id")
    info.add_metric([], {"version": str(stats["server"]), "server_id": str(stats["server_id"])})
    yield info
    yield from _state_gauges(stats, bins)
    yield from _memory_gauges(stats)
    yield _by_label("requests", "requests answered, by operation", "op", stats["requests"])
    yield _by_label("request_bytes", "bytes of request frames received, by operation", "op",
                    stats["bytes_in"])
    yield _by_label("reply_bytes", "bytes of reply frames sent, by operation", "op",
                    stats["bytes_out"])
    yield _by_label("errors", "error replies sent, by error code", "code", stats["errors"])
    yield from _counters(stats["counters"])
    yield _latency(stats["latency"])
    yield from _user_families(stats.get("users", {}))
    yield from _replication_families(stats)
    if per_bin:
        yield from _bin_families(bins)
        yield from _stream_families(bins)
        yield from _service_families(bins)
        yield from _replay_families(bins)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"tensorshare_{name}", doc, value=value)


def _state_gauges(stats: dict[str, Any], bins: dict[str, dict[str, Any]]
                  ) -> Iterator[Metric]:
    """Connections, sessions, bins and what waits now."""
    yield _gauge("uptime_seconds", "seconds since the server started", stats["uptime"])
    yield _gauge("connections_open", "connections open now", stats["connections"])
    yield _gauge("listeners", "listens registered now, all connections and bins together",
                 stats["listeners"])
    yield _gauge("sessions", "client sessions kept now, attached or waiting to be resumed",
                 stats["sessions"])
    yield _gauge("sessions_detached", "client sessions waiting for their client to come back",
                 stats.get("sessions_detached", 0))
    yield _gauge("bins", "bins that hold data", stats["bins"])
    yield _gauge("items", "items in all bins together",
                 sum(b["n_items"] for b in bins.values()))
    persistence = stats.get("persistence")
    if persistence is not None:
        yield _gauge("storage_writable", "1 while the data log can be written; 0 while writes "
                     "are refused (a full disk)", 1 if persistence["writable"] else 0)
    waiting = stats["waiting"]
    yield _gauge("waiting_fetches", "get/peek requests waiting for data now",
                 waiting["fetches"])
    yield _gauge("blocked_appends", "appends waiting for room in a full 'block' bin now",
                 waiting["appends"])


def _replication_families(stats: dict[str, Any]) -> Iterator[Metric]:
    """The server's role and term, and its replicas' lag (or, on a replica, its own)."""
    repl = stats.get("replication")
    if repl is None:
        return
    role = GaugeMetricFamily("tensorshare_replication_role", "1 for the server's role now",
                             labels=["role"])
    role.add_metric([str(stats["role"])], 1)
    yield role
    yield _gauge("replication_term", "the server's term (a promotion starts a new one)",
                 stats["term"])
    yield _gauge("replication_offset", "the replication offset (bytes of records)",
                 repl["offset"])
    resyncs = CounterMetricFamily("tensorshare_replication_resyncs",
                                  "resyncs, full copies and partial (on a primary: served to "
                                  "its replicas; on a replica: taken from its primary)",
                                  labels=["kind"])
    resyncs.add_metric(["full"], repl["full_resyncs"])
    resyncs.add_metric(["partial"], repl["partial_resyncs"])
    yield resyncs
    if "lag_s" in repl:  # a replica
        yield _gauge("replication_lag_seconds", "seconds since the primary was last heard",
                     repl["lag_s"] or 0.0)
        yield _gauge("replication_synced", "1 while the replica's full copy is applied",
                     int(bool(repl.get("synced"))))
        return
    yield CounterMetricFamily("tensorshare_replication_replicas_dropped",
                              "replicas dropped for falling past --replica-buffer",
                              value=repl.get("replicas_dropped", 0))
    per_replica = {name: GaugeMetricFamily(f"tensorshare_replica_{name}", text,
                                           labels=["replica"])
                   for name, text in (("offset", "the offset a replica has acknowledged"),
                                      ("lag_bytes", "bytes of records a replica has not "
                                                    "acknowledged"),
                                      ("lag_seconds", "seconds a replica has been behind"),
                                      ("live", "1 while a replica is connected"))}
    for r in repl["replicas"]:
        for name, value in (("offset", r["offset"]), ("lag_bytes", r["lag_bytes"]),
                            ("lag_seconds", r["lag_s"]), ("live", int(bool(r.get("live"))))):
            per_replica[name].add_metric([r["address"]], value)
    yield from per_replica.values()


def _memory_gauges(stats: dict[str, Any]) -> Iterator[Metric]:
    memory = stats["memory"]
    yield _gauge("stored_bytes", "bytes of the items stored in bins", memory["stored"])
    held = GaugeMetricFamily("tensorshare_held_bytes",
                             "bytes held for clients outside the bins: items of "
                             "unacknowledged gets, remembered replies and the sessions "
                             "themselves (sessions), output not yet sent (output), and frames "
                             "still being received (receiving)", labels=["kind"])
    held.add_metric(["sessions"], memory["sessions"])
    held.add_metric(["output"], memory["output"])
    held.add_metric(["receiving"], memory.get("receiving", 0))
    yield held
    yield _gauge("memory_bytes", "bytes counted against max_memory: stored + held",
                 memory["total"])
    if memory.get("max_memory") is not None:
        yield _gauge("max_memory_bytes", "the server's max_memory", memory["max_memory"])


def _counters(counters: dict[str, int]) -> Iterator[Metric]:
    for key, (name, doc) in _COUNTERS.items():
        # Counters still at 0 may be absent from the stats; export them as 0 all the same,
        # so that rate() and alerts work from the first scrape.
        yield CounterMetricFamily(f"tensorshare_{name}", doc, value=counters.get(key, 0))
    for key, value in sorted(counters.items()):
        if key not in _COUNTERS and key != "requests":  # one the server gained later
            name = _NAME_RE.sub("_", key)
            yield CounterMetricFamily(f"tensorshare_event_{name}",
                                      f"the server's {key!r} counter", value=value)


def _by_label(name: str, doc: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(f"tensorshare_{name}", doc, labels=[label])
    for key in sorted(values):
        family.add_metric([key], values[key])
    return family


def _latency(latency: dict[str, Any]) -> HistogramMetricFamily:
    """The server's per-op latency histogram as a Prometheus histogram (seconds)."""
    bounds: list[float] = list(latency["buckets"])
    family = HistogramMetricFamily("tensorshare_request_duration_seconds",
                                   "request latency, from the request's arrival to its reply "
                                   "(a waiting fetch includes its wait)", labels=["op"])
    for op in sorted(latency["ops"]):
        counts: list[int] = latency["ops"][op]  # one per bound, then the one above them all
        # Prometheus buckets are cumulative and end with +Inf (the total count).
        buckets: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip(bounds, counts, strict=False):
            total += count
            buckets.append((floatToGoString(bound), total))
        buckets.append(("+Inf", sum(counts)))
        family.add_metric([op], buckets, sum_value=latency["sum_us"].get(op, 0) / 1e6)
    return family


def _bin_families(bins: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    items = GaugeMetricFamily("tensorshare_bin_items", "items in the bin", labels=["bin"])
    nbytes = GaugeMetricFamily("tensorshare_bin_bytes", "bytes of the bin's items",
                               labels=["bin"])
    listeners = GaugeMetricFamily("tensorshare_bin_listeners", "connections listening to it",
                                  labels=["bin"])
    version = GaugeMetricFamily("tensorshare_bin_version", "the bin's version",
                                labels=["bin"])
    ops = CounterMetricFamily("tensorshare_bin_operations",
                              "operations on the bin since the server started",
                              labels=["bin", "op"])
    bytes_in = CounterMetricFamily("tensorshare_bin_bytes_in",
                                   "bytes stored into the bin by put/append", labels=["bin"])
    bytes_out = CounterMetricFamily("tensorshare_bin_bytes_out",
                                    "bytes returned from the bin by get/peek", labels=["bin"])
    for name, b in bins.items():
        items.add_metric([name], b["n_items"])
        nbytes.add_metric([name], b["nbytes"])
        listeners.add_metric([name], b["listeners"])
        version.add_metric([name], b["version"])
        for op, n in sorted(b["ops"].items()):
            ops.add_metric([name, op], n)
        bytes_in.add_metric([name], b["bytes_in"])
        bytes_out.add_metric([name], b["bytes_out"])
    yield from (items, nbytes, listeners, version, ops, bytes_in, bytes_out)


def _user_families(users: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """Per user (see tensorshare.server.accounts): memory held against its quota, connections,
    requests, denials and quota refusals."""
    fams: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        "memory": GaugeMetricFamily("tensorshare_user_memory_bytes",
                                    "bytes the user's writes hold now (stored, its sessions, "
                                    "its queued output and frames arriving): what counts "
                                    "against its max_memory", labels=["user"]),
        "max_memory": GaugeMetricFamily("tensorshare_user_max_memory_bytes",
                                        "the user's max_memory quota", labels=["user"]),
        "connections": GaugeMetricFamily("tensorshare_user_connections",
                                         "the user's connections open now", labels=["user"]),
        "max_connections": GaugeMetricFamily("tensorshare_user_max_connections",
                                             "the user's max_connections quota",
                                             labels=["user"]),
        "requests": CounterMetricFamily("tensorshare_user_requests",
                                        "requests the user sent", labels=["user"]),
        "denials": CounterMetricFamily("tensorshare_user_denials",
                                       "requests refused permission_denied (outside the "
                                       "user's patterns)", labels=["user"]),
        "refusals": CounterMetricFamily("tensorshare_user_quota_refusals",
                                        "writes and connections refused quota_exceeded",
                                        labels=["user"]),
    }
    for name, u in sorted(users.items()):
        mem = u["memory"]
        fams["memory"].add_metric([name], mem["total"])
        if mem["max_memory"] is not None:
            fams["max_memory"].add_metric([name], mem["max_memory"])
        fams["connections"].add_metric([name], u["connections"])
        if u["max_connections"] is not None:
            fams["max_connections"].add_metric([name], u["max_connections"])
        for key in ("requests", "denials", "refusals"):
            fams[key].add_metric([name], u[key])
    yield from fams.values()


def _stream_families(bins: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """Per stream bin: its head, and each consumer's lag, stall time and items missed."""
    streams = {n: b["stream"] for n, b in bins.items() if b.get("kind") == "stream"}
    if not streams:
        return
    head = GaugeMetricFamily("tensorshare_stream_head", "the stream's next position",
                             labels=["bin"])
    lag = GaugeMetricFamily("tensorshare_stream_consumer_lag",
                            "positions the consumer is behind the head", labels=["bin", "consumer"])
    stalled = GaugeMetricFamily("tensorshare_stream_consumer_stalled_seconds",
                                "how long the consumer has held the window full now",
                                labels=["bin", "consumer"])
    stall = CounterMetricFamily("tensorshare_stream_consumer_stall_seconds",
                                "seconds the consumer held the window full, in total",
                                labels=["bin", "consumer"])
    missed = CounterMetricFamily("tensorshare_stream_consumer_missed",
                                 "items freed before the consumer read them",
                                 labels=["bin", "consumer"])
    for name, st in streams.items():
        head.add_metric([name], st["head"])
        for consumer, c in st["consumers"].items():
            if c["lag"] is not None:
                lag.add_metric([name, consumer], c["lag"])
            stalled.add_metric([name, consumer], c["stalled_s"])
            stall.add_metric([name, consumer], c["stall_total_s"])
            missed.add_metric([name, consumer], c["missed"])
    yield from (head, lag, stalled, stall, missed)


def _per_bin(bins: dict[str, dict[str, Any]], kind: str,
             specs: tuple[tuple[str, str, str, str], ...], seconds: str = ""
             ) -> tuple[dict[str, Any], list[GaugeMetricFamily | CounterMetricFamily]]:
    """The bins of ``kind`` (name -> its summary) and one family per ``(key, metric, "gauge"
    or "counter", doc)``, ``tensorshare_<kind>_<metric>`` labelled by bin, filled with each
    bin's value of ``key`` (``seconds``: the key whose milliseconds are given as seconds)."""
    summaries = {n: b[kind] for n, b in bins.items() if b.get("kind") == kind}
    families = {key: (GaugeMetricFamily if how == "gauge" else CounterMetricFamily)(
        f"tensorshare_{kind}_{metric}", doc, labels=["bin"])
        for key, metric, how, doc in specs} if summaries else {}
    for name, summary in summaries.items():
        for key, fam in families.items():
            value = summary[key]
            fam.add_metric([name], value / 1e3 if key == seconds else value)
    return summaries, list(families.values())


def _service_families(bins: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """Per service bin: its queue, hosts, calls answered, failed and timed out, mean batch
    rows and latency."""
    yield from _per_bin(bins, "service", (
        ("queue", "queue", "gauge", "calls queued, waiting for a host"),
        ("with_hosts", "leased", "gauge", "calls a host has taken and not yet answered"),
        ("hosts", "hosts", "gauge", "hosts serving the service"),
        ("answered", "calls_answered", "counter", "calls answered by a host"),
        ("failed", "calls_failed", "counter", "calls the host failed (service_failed)"),
        ("timed_out", "calls_timed_out", "counter", "calls that got no answer in time"),
        ("requeued", "calls_requeued", "counter",
         "calls given back by a host that left or ran out of lease"),
        ("batches", "batches", "counter", "batches answered"),
        ("mean_batch", "mean_batch_rows", "gauge", "rows per batch, on average"),
        ("latency_mean_ms", "latency_mean_seconds", "gauge",
         "from queued to answered, on average")), seconds="latency_mean_ms")[1]


def _replay_families(bins: dict[str, dict[str, Any]]) -> Iterator[Metric]:
    """Per replay bin: its size, inserts and samples (and their rates), evictions, what
    waits, the rate limiter's diff, and the priority histogram (items per bucket)."""
    replays, families = _per_bin(bins, "replay", (
        ("size", "size", "gauge", "items in the replay bin"),
        ("inserts", "inserts", "counter", "items inserted"),
        ("samples", "samples", "counter", "items drawn by samples"),
        ("evicted", "evicted", "counter", "items the remover took out (max_size)"),
        ("expired", "expired", "counter", "items their max_times_sampled took out"),
        ("inserts_per_s", "inserts_per_second", "gauge", "inserts over the last 10 s"),
        ("samples_per_s", "samples_per_second", "gauge", "draws over the last 10 s"),
        ("waiting_inserts", "waiting_inserts", "gauge", "inserts the rate limiter holds"),
        ("waiting_samples", "waiting_samples", "gauge", "samples waiting for items")))
    if not replays:
        return
    diff = GaugeMetricFamily("tensorshare_replay_limiter_diff", "the rate limiter's "
                             "inserts * samples_per_insert - samples", labels=["bin"])
    hist = GaugeMetricFamily("tensorshare_replay_priority_items", "items whose priority is "
                             "at least the bucket's lower edge (and below the next)",
                             labels=["bin", "ge"])
    for name, rp in replays.items():
        if rp["limiter"]["diff"] is not None:
            diff.add_metric([name], rp["limiter"]["diff"])
        h = rp["priority_histogram"]
        for edge, count in zip(h["edges"], h["counts"], strict=True):
            hist.add_metric([name, f"{edge:g}"], count)
    yield from families
    yield diff
    yield hist


class MetricsServer:
    """A running metrics endpoint: ``http://host:port/metrics``.

    Attributes:
        collector: the :class:`ServerCollector` it serves (set ``collector.server``).
        host, port: where it listens (``port`` is the real one when 0 was asked for).
    """

    def __init__(self, collector: ServerCollector, httpd: WSGIServer,
                 thread: threading.Thread, host: str) -> None:
        self.collector = collector
        self._httpd = httpd
        self._thread = thread
        self.host = host
        self.port: int = httpd.server_port

    @property
    def url(self) -> str:
        """The address to scrape."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and close the port."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout)


def start_metrics_server(port: int, host: str = "127.0.0.1", *,
                         server: EmbeddedServer | None = None, per_bin: bool = True,
                         process: bool = True) -> MetricsServer:
    """Serve a server's metrics over HTTP in a background thread.

    The port is bound before this returns, so it can be called before the tensorshare
    server runs (a busy port fails at once) and the server attached later.

    Args:
        port: TCP port (0 picks a free one; see ``.port``).
        host: interface to bind; 127.0.0.1 unless you mean Prometheus on another machine
            to scrape it.
        server: the server to export (or set ``.collector.server`` later).
        per_bin: also export per-bin series.
        process: also export the process's CPU, memory and file descriptors
            (``process_*``, Linux only).

    Raises:
        OSError: the port could not be bound.
    """
    from prometheus_client import ProcessCollector, start_http_server

    # A registry of our own: only this server's metrics, even if the program (or a test)
    # runs several servers or has metrics of its own in the global registry.
    registry = CollectorRegistry(auto_describe=False)
    collector = ServerCollector(server, per_bin=per_bin)
    registry.register(collector)
    if process:
        ProcessCollector(registry=registry)
    httpd, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(collector, httpd, thread, host)
