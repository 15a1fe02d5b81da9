"""The ``tensorshare`` command: ``serve``, ``ls``, ``demo``.

``tensorshare serve --port 0`` picks a free port and prints it as ``listening on HOST:PORT``,
so scripts can start a server and read back where it is.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._version import __version__

__all__ = ["main"]


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


def _seconds(text: str) -> float:
    """Parse a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"seconds must be positive and finite: {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tensorshare", description="Share PyTorch tensors "
                                "between processes and machines.")
    p.add_argument("--version", action="version", version=f"tensorshare {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run a server (until Ctrl+C)")
    s.add_argument("--host", default="127.0.0.1",
                   help="interface to bind (default 127.0.0.1; 0.0.0.0 accepts other machines)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    s.add_argument("--max-memory", type=_size, default=None, metavar="BYTES",
                   help="refuse put/append that would take stored data above this")
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
    s.add_argument("--max-connections", type=int, default=1024,
                   help="connections served at once; more are refused (default 1024)")
    s.add_argument("--max-client-buffer", type=_size, default=64 << 20, metavar="BYTES",
                   help="bytes queued for a client that stopped reading before it is "
                        "disconnected (default 64M)")
    s.add_argument("--max-session-bytes", type=_size, default=1 << 30, metavar="BYTES",
                   help="bytes of unacknowledged get items one session may hold (default 1G)")
    s.add_argument("--data-dir", default=None, metavar="DIR",
                   help="keep the data in DIR (a data log and snapshots) and load it at start; "
                        "without it the server holds everything in memory only")
    s.add_argument("--fsync", choices=("always", "everysec", "no"), default="everysec",
                   help="when the data log reaches the disk: before each reply (always), "
                        "every second (everysec, the default) or when the OS decides (no)")
    s.add_argument("--snapshot-every", type=_seconds, default=300.0, metavar="SECONDS",
                   help="write a snapshot (and drop the log it covers) this often "
                        "(default 300)")
    s.add_argument("--snapshot-log-bytes", type=_size, default=1 << 30, metavar="BYTES",
                   help="also write one once the log has grown this much (default 1G)")
    s.add_argument("--truncate-corrupt-log", action="store_true",
                   help="start even if the data log is corrupt in the middle, dropping it "
                        "from the bad record on (the start-up error tells you when)")
    s.add_argument("-q", "--quiet", action="store_true", help="log warnings only")

    ls = sub.add_parser("ls", help="list the bins of a server and their item counts")
    ls.add_argument("--host", default="127.0.0.1")
    ls.add_argument("--port", type=int, default=8000)
    ls.add_argument("--timeout", type=float, default=5.0)

    d = sub.add_parser("demo", help="a distributed RL run (CartPole) on a local server; ~10-60 s")
    d.add_argument("--workers", type=int, default=3, help="rollout worker processes (default 3)")
    d.add_argument("--max-seconds", type=float, default=90.0, help="stop after this long")
    d.add_argument("--target", type=float, default=195.0, help="stop at this average return")
    return p


def _serve(args: argparse.Namespace) -> int:
    from twisted.logger import (
        FilteringLogObserver,
        LogLevel,
        LogLevelFilterPredicate,
        globalLogBeginner,
        textFileLogObserver,
    )

    from .messages import Limits
    from .persist import DataError
    from .server import ServerConfig, run_server

    level = LogLevel.warn if args.quiet else LogLevel.info
    observer = FilteringLogObserver(textFileLogObserver(sys.stderr),
                                    [LogLevelFilterPredicate(defaultLogLevel=level)])
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)
    defaults = Limits()
    try:
        limits = Limits(
            max_frame_bytes=args.max_frame_bytes or defaults.max_frame_bytes,
            max_header_bytes=args.max_header_bytes or min(defaults.max_header_bytes,
                                                          args.max_frame_bytes or 1 << 62),
            max_depth=args.max_depth or defaults.max_depth,
            max_name_bytes=args.max_name_bytes or defaults.max_name_bytes,
        )
    except ValueError as exc:
        print(f"tensorshare serve: {exc}", file=sys.stderr)
        return 2

    def ready(server: object) -> None:
        host, port = getattr(server, "host"), getattr(server, "port")  # noqa: B009
        print(f"tensorshare {__version__} listening on {host}:{port}", flush=True)
        if host not in ("127.0.0.1", "localhost", "::1"):
            print("warning: this server accepts connections from other machines and has no "
                  "authentication; only use it on a trusted network", file=sys.stderr, flush=True)

    if args.max_connections < 1:
        print("tensorshare serve: --max-connections must be at least 1", file=sys.stderr)
        return 2
    config = ServerConfig(limits=limits, max_memory=args.max_memory,
                          session_ttl=args.session_ttl, max_connections=args.max_connections,
                          max_client_buffer=args.max_client_buffer,
                          max_session_bytes=args.max_session_bytes, data_dir=args.data_dir,
                          fsync=args.fsync, snapshot_every=args.snapshot_every,
                          snapshot_log_bytes=args.snapshot_log_bytes,
                          truncate_corrupt_log=args.truncate_corrupt_log)
    try:
        run_server(args.port, args.host, ready=ready, config=config)
    except DataError as exc:
        print(f"tensorshare serve: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"tensorshare serve: cannot listen on {args.host}:{args.port}: {exc}",
              file=sys.stderr)
        return 1
    except RuntimeError as exc:
        print(f"tensorshare serve: {exc}", file=sys.stderr)
        return 1
    return 0


def _ls(args: argparse.Namespace) -> int:
    from .client import Client
    from .errors import TensorShareError

    try:
        with Client(args.host, args.port, timeout=args.timeout) as c:
            bins = c.list()
    except TensorShareError as exc:
        print(f"tensorshare ls: {exc}", file=sys.stderr)
        return 1
    width = max((len(b) for b in bins), default=3)
    print(f"{'bin':<{width}}  items")
    for name in sorted(bins):
        print(f"{name:<{width}}  {bins[name]}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tensorshare`` command. Returns the exit status."""
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "ls":
        return _ls(args)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(workers=args.workers, max_seconds=args.max_seconds, target=args.target)
    return 2
