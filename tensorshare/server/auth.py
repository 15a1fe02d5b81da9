"""What the server needs to authenticate clients besides its users (:mod:`.users`): the check
that refuses to listen beyond loopback without a token (protected mode), and a bounded memory
of failed attempts per address, which slows a guesser down.

The handshake itself is in :mod:`.connection`; the proofs in :mod:`tensorshare.wire.auth`.
"""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict

from .config import ServerConfig

__all__ = ["FailedAttempts", "check_exposure", "has_tokens", "is_loopback", "read_ops",
           "read_ops_text"]


def read_ops() -> list[str]:
    """The ops a connection with the read-only token (or any client of a relay) may send
    after the handshake: those the op table marks ``read`` (``hello`` and ``auth`` are the
    handshake's own)."""
    from ..wire.protocol import OPS

    return [name for name, op in OPS.items() if op.read and name not in ("hello", "auth")]


def read_ops_text() -> str:
    """:func:`read_ops` as a phrase: ``"peek, list, ... and bye"``."""
    ops = read_ops()
    return f"{', '.join(ops[:-1])} and {ops[-1]}"


def has_tokens(config: ServerConfig) -> bool:
    """Whether the configuration makes clients prove a token (a token, a token file or a
    users file)."""
    return bool(config.token or config.token_file or config.users_file)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` accepts connections from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def check_exposure(host: str, config: ServerConfig, *, cli: bool = False) -> None:
    """Protected mode: refuse to listen beyond loopback without a token.

    Raises:
        ValueError: ``host`` is not a loopback address, the server has no token, and
            ``config.insecure`` was not given; the message says what to do, in the terms
            of the command line (``cli``) or of Python (``EmbeddedServer`` / ``run_server``).
    """
    if is_loopback(host) or has_tokens(config) or config.insecure:
        return
    if cli:
        how = ("Give the server a token (--token-file PATH, or TENSORSHARE_TOKEN / "
               "TENSORSHARE_TOKEN_FILE in its environment; clients then need the same token), "
               "or pass --insecure if this network is trusted")
    else:
        how = ("Give the server a token (token=... or token_file=PATH, or TENSORSHARE_TOKEN / "
               "TENSORSHARE_TOKEN_FILE in the environment; clients then need the same token), "
               "or pass insecure=True if this network is trusted")
    raise ValueError(f"refusing to listen on {host} without a token: anyone who can reach it "
                     f"could read, overwrite or delete every bin. {how}")


class FailedAttempts:
    """Failed authentications per peer address, to slow a guesser down.

    Keeps at most ``max_peers`` addresses (the oldest forgotten first) and forgets failures
    older than ``window`` seconds. After ``free`` failures in the window, each refusal is
    delayed: 0.25 s, doubling with each failure, at most ``max_delay``.
    """

    def __init__(self, max_peers: int = 4096, window: float = 60.0, free: int = 3,
                 max_delay: float = 8.0) -> None:
        self.max_peers, self.window, self.free, self.max_delay = max_peers, window, free, \
            max_delay
        self._peers: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def failed(self, peer: str, now: float | None = None) -> float:
        """Count a failure from ``peer``; return how long to delay its refusal (seconds)."""
        now = time.monotonic() if now is None else now
        count, since = self._peers.pop(peer, (0, now))
        if now - since > self.window:
            count, since = 0, now
        count += 1
        self._peers[peer] = (count, since)
        while len(self._peers) > self.max_peers:
            self._peers.popitem(last=False)
        if count <= self.free:
            return 0.0
        return min(0.25 * 2 ** (count - self.free - 1), self.max_delay)
