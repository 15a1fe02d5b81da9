"""The ``tensorshare`` command: ``serve``, ``relay``, ``ls``, ``peek``, ``watch``, ``monitor``,
``stats``, ``dashboard``, ``health``, ``rebalance``, ``demo``.

This module parses the arguments and dispatches; the inspection commands live in
:mod:`tensorshare.tools`, the Prometheus exporter in :mod:`tensorshare.metrics`.

``tensorshare serve --port 0`` picks a free port and prints it as ``listening on HOST:PORT``,
so scripts can start a server and read back where it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import secrets
import sys
import time
from collections.abc import Sequence
from typing import Any, TypeAlias

from .._version import __version__

__all__ = ["main"]

# What `add_subparsers` returns: each command's parser is added to it.
_Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _size(text: str) -> int:
    """Parse a byte count: ``1048576``, ``512M``, ``2G``, ``64KiB``."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    if mult != 1:
        t = t[:-1]
    try:
        value = int(float(t) * mult)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 1048576, 512M, 2G)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def _memory(text: str) -> int | None | str:
    """``--max-memory``: a size, ``auto`` or ``none``."""
    if text.strip().lower() in ("auto", "none"):
        return text.strip().lower()
    return _size(text)


def _seconds(text: str) -> float:
    """Parse a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"seconds must be positive and finite: {text!r}")
    return value


def _count(text: str) -> int:
    """Parse a positive int."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def _read_ops() -> str:
    from ..server.auth import read_ops_text

    return read_ops_text()


def _disk_options() -> argparse.ArgumentParser:
    """``serve``'s persistence options (a relay has none: it keeps nothing on disk)."""
    d = argparse.ArgumentParser(add_help=False)
    g = d.add_argument_group("persistence (without --data-dir: in memory only)")
    g.add_argument("--data-dir", default=None, metavar="DIR",
                   help="keep the data in DIR (a data log and snapshots) and load it at start; "
                        "without it the server holds everything in memory only")
    g.add_argument("--fsync", choices=("always", "everysec", "no"), default="everysec",
                   help="when the data log reaches the disk: before each reply (always), "
                        "every second (everysec, the default) or when the OS decides (no)")
    g.add_argument("--snapshot-every", type=_seconds, default=300.0, metavar="SECONDS",
                   help="write a snapshot (and drop the log it covers) this often "
                        "(default 300)")
    g.add_argument("--snapshot-log-bytes", type=_size, default=1 << 30, metavar="BYTES",
                   help="also write one once the log has grown this much (default 1G)")
    g.add_argument("--truncate-corrupt-log", action="store_true",
                   help="start even if the data log is corrupt in the middle, dropping it "
                        "from the bad record on (the start-up error tells you when)")
    _replication_options(d)
    return d


def _credentials(g: Any, whose: str, prefix: str = "", tls: bool = True,
                 user_default: str = "TENSORSHARE_USER") -> None:
    """The options that say how to prove who we are to ``whose`` (\"the primary's\", ...):
    ``--{prefix}token-file``, ``--{prefix}user`` and, with ``tls``, ``--{prefix}tls-ca``."""
    g.add_argument(f"--{prefix}token-file", default=None, metavar="PATH",
                   help=f"{whose} token (default: TENSORSHARE_TOKEN or the file "
                        "TENSORSHARE_TOKEN_FILE names)")
    g.add_argument(f"--{prefix}user", default=None, metavar="NAME",
                   help=f"the user of {whose} token, on a server with a users file "
                        f"(default: {user_default})")
    if tls:
        g.add_argument(f"--{prefix}tls-ca", default=None, metavar="PEM",
                       help=f"the CA that signed {whose} certificate (default: "
                            "TENSORSHARE_TLS_CA, else the system's)")


def _replication_options(d: argparse.ArgumentParser) -> None:
    """``serve``'s replication options (README: Replication and failover)."""
    g = d.add_argument_group("replication (see the README's Replication and failover)")
    g.add_argument("--replica-of", default=None, metavar="URL",
                   help="follow this primary as a replica: serve reads, refuse writes until "
                        "`tensorshare promote`")
    _credentials(g, "the primary's", "upstream-",
                 user_default="TENSORSHARE_USER, else 'default'; it needs replicate = true")
    g.add_argument("--replica-backlog", type=_size, default=64 << 20, metavar="BYTES",
                   help="recent records kept for replicas that reconnect (default 64M); one "
                        "that missed more takes a full copy")
    g.add_argument("--replica-buffer", type=_size, default=256 << 20, metavar="BYTES",
                   help="bytes queued for one replica before it is dropped (default 256M)")
    g.add_argument("--min-replicas", type=int, default=0, metavar="N",
                   help="answer a write once N replicas have it; with fewer in sync, refuse "
                        "writes (default 0: replicas are asynchronous)")
    g.add_argument("--replica-timeout", type=_seconds, default=10.0, metavar="SECONDS",
                   help="how long a write waits for --min-replicas (default 10)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tensorshare", description="Share PyTorch tensors "
                                "between processes and machines.")
    p.add_argument("--version", action="version", version=f"tensorshare {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    _add_serve_and_relay(sub)
    conn = _connection_options()
    _add_inspection(sub, conn)
    _add_dashboard(sub)
    _add_rebalance(sub)
    _add_admin(sub, conn)
    _add_demo(sub)
    return p


def _server_options() -> argparse.ArgumentParser:
    """The server's options: `serve` has them, and so does `relay` (a relay is a server)."""
    s = argparse.ArgumentParser(add_help=False)
    s.add_argument("--host", default="127.0.0.1",
                   help="interface to bind (default 127.0.0.1; 0.0.0.0 accepts other machines)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    s.add_argument("--unix", default=None, metavar="PATH",
                   help="also listen on this Unix socket (same-host clients connect to "
                        "unix://PATH; large tensors then travel through shared memory)")
    s.add_argument("--max-memory", type=_memory, default="auto", metavar="BYTES",
                   help="the most the server holds for clients (bins, unacknowledged gets, "
                        "queued output, frames still arriving); a put/append or a large frame "
                        "that would go above is refused. 'auto' (the default): half of this "
                        "machine's (or container's) memory; 'none': no limit")
    s.add_argument("--max-frame-bytes", type=_size, default=None, metavar="BYTES",
                   help="largest request or reply frame (default 1G)")
    s.add_argument("--max-header-bytes", type=_size, default=None, metavar="BYTES",
                   help="largest msgpack header of a frame (default 64M)")
    s.add_argument("--max-depth", type=int, default=None, help="deepest value nesting (default 64)")
    s.add_argument("--max-name-bytes", type=int, default=None,
                   help="longest bin name in UTF-8 bytes (default 1024)")
    s.add_argument("--session-ttl", type=_seconds, default=60.0, metavar="SECONDS",
                   help="keep a disconnected client's session this long for it to resume "
                        "(default 60)")
    s.add_argument("--max-sessions", type=_count, default=10_000, metavar="N",
                   help="client sessions kept at once (default 10000); a full table ends the "
                        "session that has waited longest for its client")
    s.add_argument("--max-connections", type=int, default=1024,
                   help="connections served at once; more are refused (default 1024)")
    s.add_argument("--max-client-buffer", type=_size, default=64 << 20, metavar="BYTES",
                   help="bytes queued for a client that stopped reading before it is "
                        "disconnected (default 64M)")
    s.add_argument("--max-session-bytes", type=_size, default=1 << 30, metavar="BYTES",
                   help="bytes of unacknowledged get items one session may hold (default 1G)")
    s.add_argument("--frame-timeout", type=_seconds, default=60.0, metavar="SECONDS",
                   help="close a connection that leaves a large frame half sent for this "
                        "long, releasing the memory it reserved (default 60)")
    s.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    _security_options(s)
    s.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics on this port at /metrics (0 picks a free "
                        "one); off by default")
    s.add_argument("--metrics-host", default=None, metavar="HOST",
                   help="interface for the metrics endpoint (default: --host's)")
    s.add_argument("--metrics-per-bin", action=argparse.BooleanOptionalAction, default=True,
                   help="also export one series per bin (default on; turn it off for "
                        "servers with very many bins)")
    s.add_argument("--dashboard-port", type=int, default=None, metavar="PORT",
                   help="also serve the web dashboard on 127.0.0.1:PORT (0 picks a free "
                        "one), connected to this server with its read-only token; off by "
                        "default (see tensorshare dashboard)")
    return s


def _security_options(s: argparse.ArgumentParser) -> None:
    """The server's security options (a group of :func:`_server_options`)."""
    sec = s.add_argument_group("security (see the README's Security section)")
    sec.add_argument("--token-file", default=None, metavar="PATH",
                     help="clients must prove they know the token in this file (it never "
                          "crosses the wire); default: TENSORSHARE_TOKEN or the file "
                          "TENSORSHARE_TOKEN_FILE names")
    sec.add_argument("--read-token-file", default=None, metavar="PATH",
                     help=f"a second token that may only {_read_ops()} (dashboards, "
                          f"monitors, evaluation jobs)")
    sec.add_argument("--users-file", default=None, metavar="PATH",
                     help="users from a TOML file: each with its token file, the bins it may "
                          "read and write (glob patterns) and its quotas (max_memory, "
                          "max_connections); SIGHUP or `tensorshare reload` rereads it and "
                          "every token file (a token file may hold several tokens, one per "
                          "line)")
    sec.add_argument("--tls-cert", default=None, metavar="PEM",
                     help="serve TLS with this certificate (its chain after it); clients use "
                          "tensorshare+tls://HOST:PORT. Default: TENSORSHARE_TLS_CERT")
    sec.add_argument("--tls-key", default=None, metavar="PEM",
                     help="the certificate's private key (default: TENSORSHARE_TLS_KEY)")
    sec.add_argument("--insecure", action="store_true",
                     help="listen on an address other machines can reach without a token "
                          "(refused otherwise): only on a network you trust")


def _add_serve_and_relay(sub: _Commands) -> None:
    """``serve`` and ``relay``: the server's options, ``relay`` its upstream's too."""
    s = _server_options()
    sub.add_parser("serve", parents=[s, _disk_options()], help="run a server (until Ctrl+C)")
    r = sub.add_parser("relay", parents=[s], help="serve another server's bins read-only, "
                       "downloading each new version once (parameter fan-out; until Ctrl+C)")
    # A relay keeps nothing on disk (it copies its upstream again when it starts).
    r.set_defaults(**{a.dest: a.default for a in _disk_options()._actions})
    r.add_argument("--upstream", required=True, metavar="URL",
                   help="the server to relay: HOST:PORT, tensorshare://HOST:PORT, "
                        "tensorshare+tls://HOST:PORT or unix://PATH (a primary or a relay)")
    r.add_argument("--bins", action="append", default=None, metavar="GLOB",
                   help="relay the value bins matching this pattern (repeat for more; "
                        "default: every bin)")
    r.add_argument("--poll", type=_seconds, default=1.0, metavar="SECONDS",
                   help="how often to look for new bins upstream (default 1); new versions "
                        "of known bins come at once")
    _credentials(r, "the upstream's", "upstream-")

def _connection_options() -> argparse.ArgumentParser:
    """The connection options every client command takes, as the clients do."""
    conn = argparse.ArgumentParser(add_help=False)
    conn.add_argument("--host", default=None,
                      help="server host, or an address: HOST:PORT, tensorshare://HOST:PORT, "
                           "tensorshare+tls://HOST:PORT, unix://PATH (default: TENSORSHARE_URL, "
                           "else 127.0.0.1)")
    conn.add_argument("--port", type=int, default=None,
                      help="server port (default 8000; a port in --host wins)")
    conn.add_argument("--timeout", type=_seconds, default=5.0, metavar="SECONDS",
                      help="seconds the server has to answer (default 5)")
    conn.add_argument("--tls", action="store_true", default=None,
                      help="connect with TLS (as a tensorshare+tls:// URL does)")
    _credentials(conn, "the server's", user_default="TENSORSHARE_USER, else 'default'")
    return conn


def _add_inspection(sub: _Commands, conn: argparse.ArgumentParser) -> None:
    """The inspection commands: ``ls``, ``peek``, ``watch``, ``monitor``, ``stats``."""
    ls = sub.add_parser("ls", parents=[conn], help="the bins: kind, items, bytes, what they "
                        "hold, version, listeners, last change")
    ls.add_argument("glob", nargs="?", default=None,
                    help="only the bins whose name matches this pattern (e.g. 'rollouts/*')")
    ls.add_argument("--json", action="store_true", help="print JSON for scripts")

    pk = sub.add_parser("peek", parents=[conn], help="a bin's value as a tree, with each "
                        "tensor's dtype, shape, bytes and statistics; nothing is removed")
    pk.add_argument("bin", help="the bin")
    pk.add_argument("--item", type=int, default=None, metavar="N",
                    help="for a list bin: only item N (0 is the oldest, -1 the newest)")
    pk.add_argument("--values", action="store_true",
                    help="also print the tensors themselves (abbreviated as torch does)")
    pk.add_argument("--limit", type=_count, default=10, metavar="K",
                    help="show at most K items of a list bin and K entries of each "
                         "container (default 10)")

    w = sub.add_parser("watch", parents=[conn], help="one line per change of some bins, as "
                       "it happens (until Ctrl+C)")
    w.add_argument("bins", nargs="+", metavar="BIN",
                   help="bin names, or patterns such as 'rollouts/*' (quote them) whose bins "
                        "are found as they appear")
    w.add_argument("--interval", type=_seconds, default=1.0, metavar="SECONDS",
                   help="how often to look for new bins matching a pattern (default 1)")

    m = sub.add_parser("monitor", parents=[conn], help="a live table of every bin's rates, "
                       "redrawn in place (until Ctrl+C)")
    m.add_argument("glob", nargs="?", default=None, help="only the bins matching this pattern")
    m.add_argument("--interval", type=_seconds, default=1.0, metavar="SECONDS",
                   help="seconds between refreshes (default 1)")
    m.add_argument("--history", type=_count, default=8, metavar="N",
                   help="samples of history shown per rate (default 8)")

    st = sub.add_parser("stats", parents=[conn], help="the server: uptime, connections, "
                        "memory, requests and counters since start")
    st.add_argument("--json", action="store_true", help="print the stats reply as JSON")


def _add_dashboard(sub: _Commands) -> None:
    """``dashboard``: a web page of one or more servers."""
    db = sub.add_parser("dashboard", help="a live, read-only web page of one or more servers "
                        "(until Ctrl+C)")
    db.add_argument("--server", action="append", default=None, metavar="URL",
                    help="a server to watch: HOST:PORT, tensorshare://HOST:PORT, "
                         "tensorshare+tls://HOST:PORT or unix://PATH; repeat it or separate "
                         "with commas for shards and relays (default: TENSORSHARE_URL, else "
                         "127.0.0.1:8000)")
    db.add_argument("--read-token-file", default=None, metavar="PATH",
                    help="the servers' read-only token: the dashboard connects with it, and "
                         "browsers log in with it once (open the page with ?token=TOKEN)")
    db.add_argument("--port", type=int, default=8080, help="HTTP port (default 8080; 0 picks "
                    "a free one)")
    db.add_argument("--host", default="127.0.0.1",
                    help="interface to bind (default 127.0.0.1; another needs a token)")
    db.add_argument("--interval", type=_seconds, default=1.0, metavar="SECONDS",
                    help="seconds between snapshots (default 1)")
    db.add_argument("--timeout", type=_seconds, default=5.0, metavar="SECONDS",
                    help="seconds a server has to answer (default 5)")
    db.add_argument("--tls-ca", default=None, metavar="PEM",
                    help="the CA that signed the servers' certificates (default: "
                         "TENSORSHARE_TLS_CA, else the system's)")
    db.add_argument("--max-bins", type=_count, default=1000, metavar="N",
                    help="bins shown per server, the first by name (default 1000)")
    db.add_argument("--insecure", action="store_true",
                    help="serve on an address other machines can reach without a token")


def _add_rebalance(sub: _Commands) -> None:
    """``rebalance``: move the bins of a sharded set to their owners."""
    rb = sub.add_parser("rebalance", help="move the value and list bins of a sharded set to "
                        "the servers that own them now (after servers were added, or before "
                        "some leave with --drain)")
    rb.add_argument("--servers", default=None, metavar="LIST",
                    help="the servers from now on: h1:7000,h2:7000,... (default: "
                         "TENSORSHARE_SERVERS); a DNS name with several addresses counts as "
                         "all of them")
    rb.add_argument("--drain", action="append", default=[], metavar="HOST:PORT",
                    help="a server that leaves the set: its bins move too (repeat for more)")
    rb.add_argument("--timeout", type=_seconds, default=30.0, metavar="SECONDS",
                    help="seconds each server has to answer (default 30)")
    _credentials(rb, "the servers'", tls=False)

def _add_admin(sub: _Commands, conn: argparse.ArgumentParser) -> None:
    """``reload`` and ``health``: one request each to one server."""
    rl = sub.add_parser("reload", parents=[conn], help="make a server reread its users file "
                        "and token files, as SIGHUP does (for an admin user)")
    rl.add_argument("--server", dest="host", default=None, metavar="URL",
                    help="the server (the same as --host)")

    pr = sub.add_parser("promote", parents=[conn], help="make a replica the primary under a "
                        "new term (for an admin user); its clients follow it")
    pr.add_argument("--server", dest="host", default=None, metavar="URL",
                    help="the replica (the same as --host)")

    h = sub.add_parser("health", parents=[conn], help="exit 0 if the server answers a ping "
                       "within --timeout, else 1 (one line each way): for readiness and "
                       "liveness probes")
    h.add_argument("--unix", default=None, metavar="PATH",
                   help="the server's Unix socket (the same as --host unix://PATH)")
    h.add_argument("--role", choices=("primary", "replica"), default=None,
                   help="also exit 1 unless the server is this (its stats' role): a "
                        "readiness probe that sends clients to the primary only")


def _add_demo(sub: _Commands) -> None:
    # The demo's own options (tensorshare/demo.py's `python -m tensorshare.demo` has the same;
    # _demo passes each one run_demo accepts).
    d = sub.add_parser("demo", help="a distributed RL run on a local server (or on a running "
                       "one with --server): a smoke test of a deployment; under a minute "
                       "(about half a minute on 2 cores)")
    d.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    d.add_argument("--max-seconds", type=float, default=90.0, help="stop after this long")
    d.add_argument("--target", type=float, default=None,
                   help="average return to reach (default: the environment's)")
    d.add_argument("--env", default=None,
                   help="Gymnasium id or builtin-CartPole (default Acrobot-v1 with Gymnasium)")
    d.add_argument("--server", default=None, metavar="HOST:PORT",
                   help="use this running server instead of hosting one (HOST:PORT, or a "
                        "tensorshare://, tensorshare+tls:// or unix:// URL)")
    d.add_argument("--warmup", type=float, default=None,
                   help="seconds of 1-worker warm-up (default: 2 with more than one worker)")


def _serve(args: argparse.Namespace) -> int:
    from ..server.auth import check_exposure

    _log_to_stderr(quiet=args.quiet)
    try:
        limits = _limits(args)
    except ValueError as exc:
        print(f"tensorshare serve: {exc}", file=sys.stderr)
        return 2

    if args.max_connections < 1:
        print("tensorshare serve: --max-connections must be at least 1", file=sys.stderr)
        return 2
    exporter = None
    if args.metrics_port is not None:
        # Bound before the server starts: a busy metrics port fails before anything runs.
        exporter = _start_metrics(args)
        if exporter is None:
            return 1

    running: list[Any] = []
    ready = _announcing(args, exporter, running)
    config = _server_config(args, limits)
    if config.relay_of is not None:
        ready = _relaying(args, ready)
    dashboards: list[Any] = []
    if args.dashboard_port is not None:
        config, ready = _with_dashboard(args, config, ready, dashboards)
    try:
        check_exposure(args.host, config, cli=True)  # (in the command line's terms)
    except ValueError as exc:
        print(f"tensorshare serve: {exc}", file=sys.stderr)
        return 2
    try:
        return _run_server(args, ready, config, running)
    finally:
        if exporter is not None:
            exporter.stop()
        for dash in dashboards:
            dash.stop()


def _log_to_stderr(*, quiet: bool) -> None:
    """Twisted's log on stderr: info and up, or warnings only with ``--quiet``."""
    from twisted.logger import (
        FilteringLogObserver,
        LogLevel,
        LogLevelFilterPredicate,
        globalLogBeginner,
        textFileLogObserver,
    )

    level = LogLevel.warn if quiet else LogLevel.info
    observer = FilteringLogObserver(textFileLogObserver(sys.stderr),
                                    [LogLevelFilterPredicate(defaultLogLevel=level)])
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)


def _limits(args: argparse.Namespace) -> Any:
    """The wire's limits from ``--max-*`` (the defaults where not given); ValueError if bad."""
    from ..wire.messages import Limits

    defaults = Limits()
    return Limits(
        max_frame_bytes=args.max_frame_bytes or defaults.max_frame_bytes,
        max_header_bytes=args.max_header_bytes or min(defaults.max_header_bytes,
                                                      args.max_frame_bytes or 1 << 62),
        max_depth=args.max_depth or defaults.max_depth,
        max_name_bytes=args.max_name_bytes or defaults.max_name_bytes,
    )


def _start_metrics(args: argparse.Namespace) -> Any:
    """``--metrics-port``: the running exporter, or None (said on stderr) if it cannot bind."""
    from ..server.metrics import start_metrics_server

    metrics_host = args.metrics_host or args.host
    try:
        return start_metrics_server(args.metrics_port, metrics_host,
                                    per_bin=args.metrics_per_bin)
    except OSError as exc:
        print(f"tensorshare serve: cannot serve metrics on {metrics_host}:"
              f"{args.metrics_port}: {exc}", file=sys.stderr)
        return None


def _announcing(args: argparse.Namespace, exporter: Any, running: list[Any]) -> Any:
    """``ready`` for ``serve``: remember the server in ``running`` and print where it
    listens, its metrics, memory limit, security and hot path; reload on SIGHUP."""

    def ready(server: Any) -> None:
        running.append(server)
        host, port = server.host, server.port
        print(f"tensorshare {__version__} listening on {host}:{port}", flush=True)
        if args.unix is not None:  # on its own line: scripts read HOST:PORT off the first
            print(f"listening on unix://{args.unix}", flush=True)
        if exporter is not None:
            exporter.collector.server = server
            print(f"metrics at {exporter.url}", flush=True)
        print(_memory_line(server.factory.config.max_memory), flush=True)
        print(_security_line(server), flush=True)
        if server.factory.config.insecure and not server.factory.users.authenticating:
            print("warning: --insecure: this server accepts connections from other machines "
                  "and has no token; only use it on a trusted network", file=sys.stderr,
                  flush=True)
        print(_hot_path_line(), flush=True)
        _reload_on_sighup(server)

    return ready


def _server_config(args: argparse.Namespace, limits: Any) -> Any:
    """The ServerConfig the command line asks for."""
    from ..server import ServerConfig

    security: dict[str, Any] = {"insecure": args.insecure}
    # Token files are read by the server (at start, and again on every reload).
    for name in ("token_file", "read_token_file", "users_file"):
        if getattr(args, name) is not None:
            security[name] = getattr(args, name)
    if args.token_file is None and not os.environ.get("TENSORSHARE_TOKEN") and \
            os.environ.get("TENSORSHARE_TOKEN_FILE"):
        security["token_file"] = os.environ["TENSORSHARE_TOKEN_FILE"]
    for name in ("tls_cert", "tls_key"):
        if getattr(args, name) is not None:
            security[name] = getattr(args, name)
    return ServerConfig(**security, limits=limits, max_memory=_max_memory(args.max_memory),
                        frame_timeout=args.frame_timeout, max_sessions=args.max_sessions,
                        session_ttl=args.session_ttl, max_connections=args.max_connections,
                        max_client_buffer=args.max_client_buffer,
                        max_session_bytes=args.max_session_bytes, data_dir=args.data_dir,
                        fsync=args.fsync, snapshot_every=args.snapshot_every,
                        snapshot_log_bytes=args.snapshot_log_bytes,
                        truncate_corrupt_log=args.truncate_corrupt_log,
                        relay_of=_upstream(args), **_replication(args))


def _replication(args: argparse.Namespace) -> dict[str, Any]:
    if args.command != "serve":
        return {}
    of = args.replica_of
    if of is not None and "://" not in of:
        of = f"tensorshare://{of}"
    return {"replica_of": of, "upstream_token_file": args.upstream_token_file,
            "upstream_user": args.upstream_user, "upstream_tls_ca": args.upstream_tls_ca,
            "replica_backlog": args.replica_backlog,
            "replica_buffer": args.replica_buffer, "min_replicas": max(args.min_replicas, 0),
            "replica_timeout": args.replica_timeout}


def _upstream(args: argparse.Namespace) -> str | None:
    if args.command != "relay":
        return None
    up = args.upstream
    return up if "://" in up else f"tensorshare://{up}"


def _relaying(args: argparse.Namespace, ready: Any) -> Any:
    """``ready`` for ``tensorshare relay``: start relaying once the server listens."""

    def start(server: Any) -> None:
        from ..relay import Relay

        ready(server)
        relay = Relay(_upstream(args) or "", args.bins or ["*"], server=server,
                      poll=args.poll, token_file=args.upstream_token_file,
                      tls_ca=args.upstream_tls_ca, user=args.upstream_user)
        print(f"relaying {', '.join(relay.globs)} of {relay.upstream} (read-only)", flush=True)

    return start


def _with_dashboard(args: argparse.Namespace, config: Any, ready: Any,
                    dashboards: list[Any]) -> tuple[Any, Any]:
    """``serve --dashboard-port``: the config (with a read-only token made for this run when
    the server has a token but no read-only one: the dashboard connects with a read-only
    token, never the read-write one, and only it knows this one) and ``ready``."""
    from ..server.auth import has_tokens
    from ..wire.auth import tokens_of

    generated = False
    if config.read_token is None and config.read_token_file is not None:
        # (the newest of the file's tokens, as a client given the file uses)
        with open(config.read_token_file, "rb") as f:
            config = dataclasses.replace(config, read_token=tokens_of(f.read())[-1].decode())
    elif config.read_token is None and has_tokens(config):
        generated = True
        config = dataclasses.replace(config, read_token=secrets.token_urlsafe(32))
    return config, _beside(args, config, ready, dashboards, show_token=generated)


def _beside(args: argparse.Namespace, config: Any, ready: Any, dashboards: list[Any], *,
            show_token: bool) -> Any:
    """``ready`` for ``serve --dashboard-port``: start the dashboard once the server listens,
    on 127.0.0.1, connected to it over loopback (its Unix socket when it has one) with the
    read-only token; print its address (with the token to log in with, when this run made
    it: ``show_token``)."""

    def start(server: Any) -> None:
        from ..dashboard import Dashboard

        ready(server)
        if server.unix is not None:
            where = f"unix://{server.unix}"
        elif config.tls_cert:
            raise RuntimeError("--dashboard-port with --tls-cert needs --unix PATH too (the "
                               "dashboard connects over the Unix socket)")
        else:
            host = "127.0.0.1" if server.host in ("0.0.0.0", "", "::", "localhost") \
                else server.host
            where = f"tensorshare://{host if ':' not in host else f'[{host}]'}:{server.port}"
        try:
            dash = Dashboard(where, port=args.dashboard_port, read_token=config.read_token)
        except OSError as exc:
            raise RuntimeError(f"cannot serve the dashboard on 127.0.0.1:"
                               f"{args.dashboard_port}: {exc}") from None
        dashboards.append(dash)
        if show_token or config.read_token is None:
            print(f"dashboard at {dash.login_url}", flush=True)
        else:
            print(f"dashboard at {dash.url} (log in once with ?token=<the read-only token>)",
                  flush=True)

    return start


def _dashboard(args: argparse.Namespace) -> int:
    """``tensorshare dashboard``: serve the page until Ctrl+C."""
    import threading

    from ..dashboard import Dashboard

    servers = args.server or [os.environ.get("TENSORSHARE_URL") or "127.0.0.1:8000"]
    try:
        token = _read(args.read_token_file) if args.read_token_file is not None else None
        dash = Dashboard(servers, port=args.port, host=args.host, read_token=token,
                         tls_ca=args.tls_ca, timeout=args.timeout, interval=args.interval,
                         insecure=args.insecure, max_bins=args.max_bins)
    except (ValueError, OSError) as exc:
        print(f"tensorshare dashboard: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    try:
        for up, error in zip(dash.upstreams, dash.first_contact(args.timeout + 1), strict=True):
            if error is not None and up.fatal:
                print(f"tensorshare dashboard: {up.address}: {error}", file=sys.stderr)
                return 2
            if error is not None:
                print(f"warning: {up.address}: {error} (the page shows it until it answers)",
                      file=sys.stderr, flush=True)
        print(f"dashboard at {dash.url} watching {', '.join(u.address for u in dash.upstreams)}"
              + ("; log in once with ?token=<the read-only token>" if token else ""),
              flush=True)
        stop = threading.Event()
        while dash.running and not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        dash.stop()
    return 0


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _security_line(server: Any) -> str:
    config = server.factory.config
    users = server.factory.users.table
    auth = "off (no token)" if not users else (
        "token required" + (", read-only token too" if "readonly" in users else ""))
    if config.users_file is not None:
        auth += f"; users: {', '.join(sorted(users))} (from {config.users_file})"
    tls = "on" if config.tls_cert else "off"
    return f"authentication: {auth}; TLS: {tls}"


def _reload_on_sighup(server: Any) -> None:
    """``kill -HUP``: reread the users file and every token file (in the server's thread; a
    file that fails to parse keeps the old users and says why, on stderr)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def reload() -> None:
        try:
            names = server.factory.reload_users()
        except ValueError as exc:
            print(f"tensorshare serve: reload failed, the old users stay: {exc}",
                  file=sys.stderr, flush=True)
            return
        print(f"reloaded the users: {', '.join(names) or 'none'}", file=sys.stderr, flush=True)

    signal.signal(signal.SIGHUP, lambda signum, frame: server.reactor.callFromThread(reload))


def _hot_path_line() -> str:
    from .. import _ext

    # (the server's and the wire's: the server runs them, and never imports the client's)
    mine = [name for name in _ext.TWINS if name.startswith(("tensorshare.wire.",
                                                            "tensorshare.server."))]
    if all(_ext.compiled(mine).values()):
        return "hot path: compiled (see tensorshare._ext)"
    return f"hot path: pure Python ({_ext.pure_reason()})"


def _max_memory(value: int | str | None) -> int | None:
    from ..server.config import default_max_memory

    if isinstance(value, int):
        return value
    return default_max_memory() if value == "auto" else None


def _memory_line(limit: int | None) -> str:
    from ..server.config import machine_memory

    if limit is None:
        return "memory limit: none (--max-memory); clients can make this server hold any amount"
    total = machine_memory()
    of = f" of this machine's {_gib(total)}" if total else ""
    return f"memory limit: {_gib(limit)}{of} (--max-memory)"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.0f} MiB"


def _run_server(args: argparse.Namespace, ready: Any, config: Any, running: list[Any]) -> int:
    from ..server import run_server
    from ..server.persist import DataError

    try:
        run_server(args.port, args.host, ready=ready, config=config, unix=args.unix)
    except KeyboardInterrupt:
        # Ctrl+C while run_server was still calling ready() (a script that reads the
        # "listening on" line and interrupts at once): run_server only handles it once it
        # waits, so stop the server here, as it would have.
        if running:
            running[0].stop()
        return 0
    except DataError as exc:
        print(f"tensorshare serve: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # protected mode, a bad token, TLS files that do not load
        print(f"tensorshare serve: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        where = f"{args.host}:{args.port}" + (f" or unix://{args.unix}" if args.unix else "")
        print(f"tensorshare serve: cannot listen on {where}: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        print(f"tensorshare serve: {exc}", file=sys.stderr)
        return 1
    return 0


#: How a command is given the server's token, in a refusal's message.
TOKEN_HINT = ("give the server's token with --token-file PATH (or TENSORSHARE_TOKEN_FILE / "
              "TENSORSHARE_TOKEN in the environment)")


def _failure(exc: BaseException) -> str:
    """The first line of what ``exc`` says, an authentication refusal's hint in the command
    line's terms (the server's names the Python API's keywords)."""
    from ..client.endpoint import with_token_hint
    from ..errors import AuthenticationError

    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return with_token_hint(text, TOKEN_HINT) if isinstance(exc, AuthenticationError) else text


def _tool(args: argparse.Namespace) -> int:
    """Run an inspection command; a failure is one line on stderr and exit status 1."""
    from ..errors import TensorShareError
    from . import tools

    run = {"ls": tools.run_ls, "peek": tools.run_peek, "watch": tools.run_watch,
           "monitor": tools.run_monitor, "stats": tools.run_stats}[args.command]
    try:
        return run(args)
    except (TensorShareError, tools.ToolError) as exc:
        print(f"tensorshare {args.command}: {_failure(exc)}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`tensorshare ls | head`): not an error worth a traceback.
        # Point stdout at nothing so the interpreter's final flush does not complain.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:  # Ctrl+C in a one-shot command (watch and monitor catch it)
        return 130


def _health(args: argparse.Namespace) -> int:
    """``tensorshare health``: one ping within ``--timeout``, exit 0 or 1 with one line.

    The check runs in a daemon thread that this waits for at most ``--timeout`` (plus a
    moment to report an error the client raised at its own deadline): a server that accepts
    the connection and then says nothing cannot make a probe hang.
    """
    import threading
    import time

    if args.unix is not None:
        if args.host is not None:
            print("tensorshare health: give --host or --unix, not both", file=sys.stderr)
            return 2
        args.host = f"unix://{args.unix}"
    result: list[tuple[str, float] | BaseException] = []

    def check() -> None:
        from ..client.blocking import Client

        start = time.monotonic()
        try:
            with Client(args.host, args.port, timeout=args.timeout, reconnect=False,
                        session=False, name="tensorshare-health", shm=False, tls=args.tls,
                        tls_ca=args.tls_ca, token_file=args.token_file,
                        user=args.user) as c:
                c.ping()
                role = c.stats("tensorshare-health-no-bin")["server"].get("role") \
                    if args.role else None
                if role is not None and role != args.role:
                    raise ValueError(f"{c.address} is a {role}, not a {args.role}")
                result.append((c.address, time.monotonic() - start))
        except BaseException as exc:  # reported by the waiting thread below
            result.append(exc)

    thread = threading.Thread(target=check, name="tensorshare-health", daemon=True)
    thread.start()
    thread.join(args.timeout + 0.5)
    if not result:
        print(f"tensorshare health: {_where(args)}: no answer within {args.timeout:g} s",
              file=sys.stderr)
        return 1
    outcome = result[0]
    if isinstance(outcome, BaseException):
        print(f"tensorshare health: {_failure(outcome)}", file=sys.stderr)
        return 1
    address, took = outcome
    print(f"ok: {address} answered in {took * 1000:.1f} ms")
    return 0


class _Progress:
    """Prints a rebalance's progress on stderr, at most once every ``every`` seconds (and
    nothing for work done within the first ``every``)."""

    every = 1.0

    def __init__(self) -> None:
        self.last = time.monotonic()

    def __call__(self, done: int, total: int, name: str, where: str) -> None:
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            print(f"tensorshare rebalance: {done}/{total} bins moved ({name!r} -> {where})",
                  file=sys.stderr, flush=True)


def _rebalance(args: argparse.Namespace) -> int:
    """``tensorshare rebalance``: move bins to their owners (ShardedClient.rebalance)."""
    from ..client.sharded import ShardedClient
    from ..errors import TensorShareError

    try:
        with ShardedClient(args.servers, timeout=args.timeout,
                           token_file=args.token_file, user=args.user) as c:
            moved = c.rebalance(args.drain, progress=_Progress())
    except (TensorShareError, ValueError, OSError) as exc:
        print(f"tensorshare rebalance: {_failure(exc)}", file=sys.stderr)
        return 1
    for name, where in sorted(moved.items()):
        print(f"{name} -> {where}")
    print(f"moved {len(moved)} bins")
    return 0


def _admin(args: argparse.Namespace, command: str, call: Any, ok: str) -> int:
    """``tensorshare reload`` / ``promote``: one call of ``call(client)`` on ``--host``; on
    success print ``ok`` (formatted with ``where`` and ``result``), else the failure on
    stderr (exit status 1)."""
    from ..client.blocking import Client
    from ..errors import TensorShareError

    try:
        with Client(args.host, args.port, timeout=args.timeout, reconnect=False, session=False,
                    name=f"tensorshare-{command}", shm=False, tls=args.tls, tls_ca=args.tls_ca,
                    token_file=args.token_file, user=args.user) as c:
            where, result = c.address, call(c)
    except (TensorShareError, ValueError, OSError) as exc:
        print(f"tensorshare {command}: {_failure(exc)}", file=sys.stderr)
        return 1
    print(ok.format(where=where, result=result))
    return 0


#: The admin commands: ``command -> (what it calls on the client, what it prints)``.
_ADMIN: dict[str, tuple[Any, str]] = {
    # the server rereads its users file and token files
    "reload": (lambda c: c.reload_users(), "ok: {where} reloaded its users"),
    # the replica becomes the primary under a new term
    "promote": (lambda c: c.promote(), "ok: {where} is the primary (term {result})"),
}


def _where(args: argparse.Namespace) -> str:
    from ..client.endpoint import resolve

    try:
        return str(resolve(args.host, args.port, tls=args.tls))
    except (ValueError, OSError):
        return f"{args.host}:{args.port}"


def _demo(args: argparse.Namespace) -> int:
    """``tensorshare demo``: pass the options through to whatever ``run_demo`` accepts."""
    from ..rl.demo import run_demo

    accepted = inspect.signature(run_demo).parameters
    return run_demo(**{k: v for k, v in vars(args).items() if k in accepted})


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tensorshare`` command. Returns the exit status."""
    args = _parser().parse_args(argv)
    if args.command in ("serve", "relay"):
        return _serve(args)
    if args.command == "demo":
        return _demo(args)
    if args.command == "health":
        return _health(args)
    if args.command == "rebalance":
        return _rebalance(args)
    if args.command == "dashboard":
        return _dashboard(args)
    if args.command in _ADMIN:
        return _admin(args, args.command, *_ADMIN[args.command])
    return _tool(args)
