"""The Prometheus endpoint: scraped over HTTP and parsed with prometheus_client's own parser."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tensorshare import BinNotFound, Client, EmbeddedServer
from tensorshare.server.metrics import ServerCollector, start_metrics_server
from tensorshare.server.stats import LATENCY_BUCKETS
from tests.conftest import interrupt, interruptible, wait_until


def _scrape(url: str) -> dict[str, Any]:
    """``family name -> {(sample name, labels as sorted tuple): value}`` and each family's
    type under ``(name, "type")``."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        out[(family.name, "type")] = family.type
        samples = out.setdefault(family.name, {})
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(metrics: dict[str, Any], family: str, sample: str | None = None,
           **labels: str) -> float:
    return metrics[family][(sample or family, tuple(sorted(labels.items())))]  # type: ignore[no-any-return]


def test_scrape_exports_requests_bytes_errors_bins_connections_and_latency(
        server: EmbeddedServer) -> None:
    exporter = start_metrics_server(0, server=server)
    try:
        with Client("127.0.0.1", server.port) as c, Client("127.0.0.1", server.port) as d:
            c.put("weights", torch.zeros(100))
            c.put("weights", torch.ones(100))
            for i in range(3):
                c.append("queue", torch.full((10,), float(i)))
            c.get("queue", max_items=1)
            with pytest.raises(BinNotFound):
                c.get("nothing")
            d.listen("queue", lambda ev: None)
            stats = c.stats()
            m = _scrape(exporter.url)
        s, bins = stats["server"], stats["bins"]
        assert _value(m, "tensorshare_up") == 1
        assert _value(m, "tensorshare_server_info",
                      server_id=server.factory.server_id, version="tensorshare/0.1.0") == 1
        # Requests and bytes by operation, errors by code.
        assert m[("tensorshare_requests", "type")] == "counter"
        assert _value(m, "tensorshare_requests", "tensorshare_requests_total", op="put") == 2
        assert _value(m, "tensorshare_requests", "tensorshare_requests_total",
                      op="append") == 3
        assert _value(m, "tensorshare_requests", "tensorshare_requests_total", op="get") == 2
        assert _value(m, "tensorshare_errors", "tensorshare_errors_total",
                      code="bin_not_found") == 1
        for op in ("put", "append"):
            assert _value(m, "tensorshare_request_bytes", "tensorshare_request_bytes_total",
                          op=op) == s["bytes_in"][op]
            assert _value(m, "tensorshare_reply_bytes", "tensorshare_reply_bytes_total",
                          op=op) == s["bytes_out"][op]
        # Bins, items, stored bytes, connections, listeners.
        assert _value(m, "tensorshare_bins") == 2
        assert _value(m, "tensorshare_items") == 3  # the value, and two items left in queue
        assert _value(m, "tensorshare_stored_bytes") == s["memory"]["stored"]
        assert _value(m, "tensorshare_connections_open") == 2
        assert _value(m, "tensorshare_connections", "tensorshare_connections_total") == 2
        assert _value(m, "tensorshare_listeners") == 1
        assert _value(m, "tensorshare_notifications_coalesced",
                      "tensorshare_notifications_coalesced_total") == 0
        assert _value(m, "tensorshare_slow_client_disconnects",
                      "tensorshare_slow_client_disconnects_total") == 0
        # Per bin.
        assert _value(m, "tensorshare_bin_items", bin="queue") == 2
        assert _value(m, "tensorshare_bin_bytes", bin="weights") == bins["weights"]["nbytes"]
        assert _value(m, "tensorshare_bin_listeners", bin="queue") == 1
        assert _value(m, "tensorshare_bin_operations", "tensorshare_bin_operations_total",
                      bin="queue", op="append") == 3
        # The latency histogram: cumulative buckets at the server's bounds, +Inf = count.
        assert m[("tensorshare_request_duration_seconds", "type")] == "histogram"
        h = m["tensorshare_request_duration_seconds"]
        for op, n in (("put", 2), ("append", 3), ("get", 2)):
            buckets = sorted((float(dict(labels)["le"]), v) for (name, labels), v in h.items()
                             if name.endswith("_bucket") and dict(labels)["op"] == op)
            assert [b for b, _ in buckets] == list(LATENCY_BUCKETS)  # ends with +Inf
            counts = [v for _, v in buckets]
            assert counts == sorted(counts) and counts[-1] == n
            assert _value(m, "tensorshare_request_duration_seconds",
                          "tensorshare_request_duration_seconds_count", op=op) == n
            total = _value(m, "tensorshare_request_duration_seconds",
                           "tensorshare_request_duration_seconds_sum", op=op)
            assert total == s["latency"]["sum_us"][op] / 1e6 and 0 < total < 10
    finally:
        exporter.stop()


def test_without_a_running_server_the_scrape_says_up_0(server: EmbeddedServer) -> None:
    exporter = start_metrics_server(0, process=False)  # no server attached yet
    try:
        m = _scrape(exporter.url)
        assert _value(m, "tensorshare_up") == 0
        assert "tensorshare_requests" not in m
        exporter.collector.server = server
        assert _value(_scrape(exporter.url), "tensorshare_up") == 1
        server.stop()
        assert _value(_scrape(exporter.url), "tensorshare_up") == 0
    finally:
        exporter.stop()


def test_per_bin_series_can_be_turned_off(server: EmbeddedServer) -> None:
    collector = ServerCollector(server, per_bin=False)
    with Client("127.0.0.1", server.port) as c:
        c.put("w", 1)
    names = {f.name for f in collector.collect()}
    assert "tensorshare_items" in names
    assert not any(n.startswith("tensorshare_bin_") for n in names)


def test_serve_metrics_port_serves_metrics_and_stops_on_ctrl_c() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "tensorshare", "serve", "--port", "0",
                             "--metrics-port", "0", "-q"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **interruptible())
    try:
        assert proc.stdout is not None
        listening, metrics = proc.stdout.readline(), proc.stdout.readline()
        assert "listening on 127.0.0.1:" in listening
        assert metrics.startswith("metrics at http://127.0.0.1:")  # localhost by default
        port = int(listening.rsplit(":", 1)[1])
        with Client("127.0.0.1", port) as c:
            c.append("q", torch.zeros(3))
        m = _scrape(metrics.split()[-1])
        assert _value(m, "tensorshare_up") == 1
        assert _value(m, "tensorshare_bin_items", bin="q") == 1
        assert _value(m, "tensorshare_requests", "tensorshare_requests_total", op="append") == 1
        assert "process_resident_memory_bytes" in m  # the server process's own
        assert interrupt(proc) == 0
        assert proc.stderr is not None and "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_busy_metrics_port_is_one_line_before_anything_starts() -> None:
    exporter = start_metrics_server(0, process=False)
    try:
        out = subprocess.run([sys.executable, "-m", "tensorshare", "serve", "--port", "0",
                              "--metrics-port", str(exporter.port)], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 1
        assert out.stdout == ""  # the server never started
        assert out.stderr.startswith(f"tensorshare serve: cannot serve metrics on "
                                     f"127.0.0.1:{exporter.port}: ")
        assert out.stderr.count("\n") == 1
    finally:
        exporter.stop()


def test_streams_export_their_head_and_each_consumers_lag_stall_and_misses(
        server: EmbeddedServer) -> None:
    from tensorshare.data import StreamConsumer, StreamProducer

    exporter = start_metrics_server(0, server=server)
    try:
        with StreamProducer("train", "127.0.0.1", server.port, window=8) as p, \
                StreamConsumer("train", "job", "127.0.0.1", server.port, timeout=5) as c:
            for _ in range(3):
                p.append(torch.zeros(4))
            assert len(c.read(1).items) == 1
            assert len(c.read(1).items) == 1  # acknowledges the first
            m = _scrape(exporter.url)
        assert _value(m, "tensorshare_stream_head", bin="train") == 3
        assert _value(m, "tensorshare_stream_consumer_lag", bin="train", consumer="job") == 2
        assert _value(m, "tensorshare_stream_consumer_missed", "tensorshare_stream_consumer_missed_total",
                      bin="train", consumer="job") == 0
        assert m[("tensorshare_stream_consumer_stall_seconds", "type")] == "counter"
    finally:
        exporter.stop()


def test_services_export_their_queue_hosts_calls_and_batches(server: EmbeddedServer) -> None:
    exporter = start_metrics_server(0, server=server)
    try:
        with Client("127.0.0.1", server.port) as caller, \
                Client("127.0.0.1", server.port) as host:
            futs = [caller._submit_future(caller.service_call_command("policy", torch.zeros(2)))
                    for _ in range(3)]
            # (all three queued before the take, which takes what is there: two of them)
            wait_until(lambda: server.call(lambda: server.factory.kinds[1].describe(None)).get(
                "policy", {}).get("service", {}).get("queue") == 3, what="3 calls queued")
            b = host.service_take("policy", max_wait_ms=0, max_batch=2, timeout=5)
            host.service_reply("policy", b.batch, b.values)
            assert len([f.result(5) for f in futs[:2]]) == 2
            m = _scrape(exporter.url)
        assert _value(m, "tensorshare_service_queue", bin="policy") == 1
        assert _value(m, "tensorshare_service_hosts", bin="policy") == 1
        assert _value(m, "tensorshare_service_calls_answered",
                      "tensorshare_service_calls_answered_total", bin="policy") == 2
        assert _value(m, "tensorshare_service_mean_batch_rows", bin="policy") == 2
        assert m[("tensorshare_service_batches", "type")] == "counter"
    finally:
        exporter.stop()


def test_replay_bins_export_size_counts_limiter_and_histogram(server: EmbeddedServer) -> None:
    exporter = start_metrics_server(0, server=server)
    try:
        with Client("127.0.0.1", server.port) as c:
            c.replay_open("rl/replay", max_size=3, samples_per_insert=2.0, error_buffer=10.0)
            c.replay_insert("rl/replay", [torch.zeros(2)] * 4, [0.5, 5.0, 5.0, 50.0])
            c.replay_sample("rl/replay", 3)
            m = _scrape(exporter.url)
        assert _value(m, "tensorshare_replay_size", bin="rl/replay") == 3
        assert _value(m, "tensorshare_replay_inserts", "tensorshare_replay_inserts_total",
                      bin="rl/replay") == 4
        assert _value(m, "tensorshare_replay_evicted", "tensorshare_replay_evicted_total",
                      bin="rl/replay") == 1
        assert _value(m, "tensorshare_replay_limiter_diff", bin="rl/replay") == 4 * 2 - 3
        assert _value(m, "tensorshare_replay_priority_items", bin="rl/replay", ge="1") == 2
        assert _value(m, "tensorshare_replay_priority_items", bin="rl/replay", ge="10") == 1
        assert m[("tensorshare_replay_samples", "type")] == "counter"
    finally:
        exporter.stop()


def test_replication_exports_the_role_the_term_and_each_replicas_lag(
        server: EmbeddedServer) -> None:
    exporter = start_metrics_server(0, server=server)
    replica = EmbeddedServer(0, replica_of=f"127.0.0.1:{server.port}")
    try:
        c = Client("127.0.0.1", server.port, timeout=5)
        c.put("w", 1)
        wait_until(lambda: c.wait_replicas(1, 1.0) == 1, 10, "the replica in sync")
        m = _scrape(exporter.url)
        assert _value(m, "tensorshare_replication_role", role="primary") == 1
        assert _value(m, "tensorshare_replication_term") == 0
        (address,) = [r["address"] for r in c.stats()["server"]["replication"]["replicas"]]
        assert _value(m, "tensorshare_replica_lag_bytes", replica=address) == 0
        assert _value(m, "tensorshare_replication_resyncs", "tensorshare_replication_resyncs_total",
                      kind="full") == 1
        offset = c.stats()["server"]["replication"]["offset"]
        assert _value(m, "tensorshare_replica_offset", replica=address) == offset
        assert _value(m, "tensorshare_replica_lag_seconds", replica=address) == 0
        assert _value(m, "tensorshare_replica_live", replica=address) == 1
        assert _value(m, "tensorshare_replication_replicas_dropped",
                      "tensorshare_replication_replicas_dropped_total") == 0
        c.close()
    finally:
        replica.stop()
        exporter.stop()


def test_a_replica_exports_its_role_offset_lag_and_the_resyncs_it_took(
        server: EmbeddedServer) -> None:
    replica = EmbeddedServer(0, replica_of=f"127.0.0.1:{server.port}")
    exporter = start_metrics_server(0, server=replica)
    try:
        with Client("127.0.0.1", server.port, timeout=5) as c:
            c.put("w", 1)
            assert c.wait_replicas(1, 10.0) == 1
            offset = c.stats()["server"]["replication"]["offset"]
            # (While the client is open: its session's end is a record too.)
            wait_until(lambda: _value(_scrape(exporter.url), "tensorshare_replication_offset")
                       == offset, 10, "the replica's offset")
        m = _scrape(exporter.url)
        assert _value(m, "tensorshare_replication_role", role="replica") == 1
        assert _value(m, "tensorshare_replication_term") == 0
        assert _value(m, "tensorshare_replication_synced") == 1
        assert _value(m, "tensorshare_replication_lag_seconds") >= 0
        assert _value(m, "tensorshare_replication_resyncs", "tensorshare_replication_resyncs_total",
                      kind="full") == 1
        assert "tensorshare_replica_lag_bytes" not in m  # (a primary's, per replica)
    finally:
        exporter.stop()
        replica.stop()
