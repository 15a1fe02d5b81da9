"""What a server can be told: :class:`ServerConfig`, with safe defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..wire.messages import Limits
from ..wire.protocol import PRE_HELLO_MAX_BYTES

__all__ = ["ServerConfig", "default_max_memory", "env_token", "machine_memory"]


def machine_memory() -> int | None:
    """The memory this process may use: the machine's, or its container's limit (cgroup v2
    ``memory.max`` or v1 ``memory.limit_in_bytes``) if smaller; ``None`` if unknown."""
    sizes = []
    try:
        sizes.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max" or a huge number: no limit
            sizes.append(int(text))
    return min(sizes) if sizes else None


def env_token(name: str = "TENSORSHARE_TOKEN") -> str | None:
    """A token from the environment: ``NAME`` itself, or the file ``NAME_FILE`` names."""
    value = os.environ.get(name)
    if value:
        return value
    path = os.environ.get(f"{name}_FILE")
    if path:
        with open(path, encoding="utf-8") as f:
            return f.read()
    return None


def default_max_memory() -> int | None:
    """Half of :func:`machine_memory`: what a server holds for clients by default."""
    total = machine_memory()
    return total // 2 if total else None


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything a server can be told, with safe defaults.

    Attributes:
        limits: hard limits of every connection (frame, header, depth, name).
        max_memory: bytes the server may hold for clients (bins, items taken by gets whose
            replies are not yet acknowledged, queued output, frames still being received); a
            put/append (or a large frame) that would go above is refused. Default: half of
            the machine's (or the container's) memory; ``None``: no limit.
        session_ttl: seconds a disconnected client's session is kept for it to resume.
        max_sessions: sessions kept at once (connected or waiting to be resumed).
        max_session_bytes: bytes of unacknowledged get items one session may hold.
        max_connections: connections served at once; more are refused with an error.
        max_client_buffer: bytes queued for one connection beyond its current reply before
            the server gives up on it and closes it (a client that stopped reading).
        hello_timeout: seconds a new connection has to complete ``hello``.
        pre_hello_bytes: the largest frame accepted before ``hello``.
        data_dir: keep the data in this directory (a data log and snapshots, see
            :mod:`tensorshare.server.persist`); ``None``: in memory only.
        fsync: when the data log reaches the disk: ``"always"``, ``"everysec"``, ``"no"``.
        snapshot_every: seconds between snapshots (``None``: by log size and at exit only).
        snapshot_log_bytes: take a snapshot once the data log has grown this much.
        truncate_corrupt_log: start even if a log segment is corrupt in the middle,
            dropping it from there (only after reading the error that says so).
        frame_timeout: seconds a connection may leave a frame half received without sending
            more of it before it is closed (what the frame reserved is released).
        pool_bytes: the most idle memory kept for reuse by received frames (see
            :mod:`tensorshare.memory.pool`); at most an eighth of ``max_memory``.
        token: the read-write token every client must prove it knows (the handshake never
            sends it); default: ``TENSORSHARE_TOKEN`` or the file ``TENSORSHARE_TOKEN_FILE``
            names. ``None``: no authentication.
        read_token: a second token that may only send the ops the op table marks ``read``
            (peek, list, listen, unlisten, ping, cancel, stats, bye).
        token_file, read_token_file: files holding those tokens (one per line, each valid:
            rotation), read at start and again on every reload (``SIGHUP``); they are the
            built-in users ``default`` and ``readonly`` (see :mod:`tensorshare.server.accounts`).
        users_file: a TOML file of users, each with its token file, the bins it may read and
            write, and its quotas (see :mod:`tensorshare.server.accounts`); reread on reload.
        insecure: listen beyond loopback without a token (protected mode refuses otherwise).
        tls_cert, tls_key: PEM files of the server's certificate (its chain after it) and
            private key: the TCP port speaks TLS (clients use ``tensorshare+tls://``).
            Default: ``TENSORSHARE_TLS_CERT`` and ``TENSORSHARE_TLS_KEY``.
        relay_of: this server is a relay of that primary (a URL, see :mod:`tensorshare.relay`):
            it serves the primary's bins read-only; every request that would change something
            is refused with ``permission_denied`` naming the primary.
        replica_of: this server is a replica of that primary (a URL): it follows the primary's
            data log (:mod:`tensorshare.server.replication`), serves reads, and refuses
            writes with ``read_only_replica`` until promoted.
        upstream_token, upstream_token_file, upstream_user: how a replica proves itself to its
            primary (default: ``TENSORSHARE_TOKEN`` and ``TENSORSHARE_USER``).
        upstream_tls_ca: the CA of a ``tensorshare+tls://`` primary's certificate (default:
            ``TENSORSHARE_TLS_CA``, else the system's).
        replica_backlog: bytes of recent records a primary keeps for replicas that reconnect
            (a partial resync); one that missed more takes a full copy.
        replica_buffer: bytes queued for one replica before the primary drops it (it resyncs).
        min_replicas: a write is answered once this many replicas have it; with fewer in sync
            writes are refused with ``not_enough_replicas``.
        replica_timeout: seconds a write waits for ``min_replicas`` replicas before it is
            answered ``not_enough_replicas`` (it may have been applied).
    """

    limits: Limits = field(default_factory=Limits)
    max_memory: int | None = field(default_factory=default_max_memory)
    session_ttl: float = 60.0
    max_sessions: int = 10_000
    max_session_bytes: int = 1 << 30
    max_connections: int = 1024
    max_client_buffer: int = 64 << 20
    hello_timeout: float = 10.0
    pre_hello_bytes: int = PRE_HELLO_MAX_BYTES
    data_dir: str | None = None
    fsync: str = "everysec"
    snapshot_every: float | None = 300.0
    snapshot_log_bytes: int = 1 << 30
    truncate_corrupt_log: bool = False
    frame_timeout: float = 60.0
    pool_bytes: int = 256 << 20
    token: str | None = field(default_factory=env_token, repr=False)
    read_token: str | None = field(default=None, repr=False)
    token_file: str | None = None
    read_token_file: str | None = None
    users_file: str | None = None
    insecure: bool = False
    tls_cert: str | None = field(default_factory=lambda: os.environ.get("TENSORSHARE_TLS_CERT"))
    tls_key: str | None = field(default_factory=lambda: os.environ.get("TENSORSHARE_TLS_KEY"))
    relay_of: str | None = None
    replica_of: str | None = None
    upstream_token: str | None = field(default=None, repr=False)
    upstream_token_file: str | None = None
    upstream_user: str | None = None
    upstream_tls_ca: str | None = None
    replica_backlog: int = 64 << 20
    replica_buffer: int = 256 << 20
    min_replicas: int = 0
    replica_timeout: float = 10.0
