"""Following the primary of a replicated set: an address list, and the primary found in it.

``Client("tensorshare://a:7000,b:7000")``, ``Client(["a:7000", "b:7000"])`` or a
``TENSORSHARE_URL`` with commas gives a client several servers: a primary and its replicas
(README: Replication and failover). Each time the client connects (the first time, and after
every drop) :class:`PrimaryFinder` asks every address what it is (a handshake, then ``stats``
of no bin: its ``role`` and ``term``) and connects to the one that says it is the primary, the
higher term winning if two do. While none does, the attempt fails like a refused connection:
the client tries again within its timeout (then ``ConnectError``). After a promotion the
client's next connection finds the promoted replica, and its session resumes there.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from ..errors import ProtocolError, TensorShareError, error_from_code
from ..wire.auth import client_proof, new_nonce
from ..wire.frames import FrameDecoder, OversizedFrame
from ..wire.messages import Auth, Hello, Stats
from ..wire.protocol import PROTOCOL_VERSIONS, encode_message
from ..wire.replication import Psync
from .endpoint import Endpoint

__all__ = ["PrimaryFinder", "addresses"]

_PROBE = "tensorshare-probe"
_NO_BIN = "tensorshare-probe-no-bin"


def addresses(host: Any) -> list[str] | None:
    """The servers of an address list (``None``: one server, as before).

    A list or tuple of addresses, or a string with commas (``tensorshare://a:7000,b:7000``:
    the scheme applies to each); ``None`` looks at ``TENSORSHARE_URL``."""
    if host is None:
        host = os.environ.get("TENSORSHARE_URL") or None
        if host is None or "," not in host:
            return None
    if isinstance(host, (list, tuple)):
        if not host or not all(isinstance(h, str) and h for h in host):
            raise ValueError("an address list must hold at least one address, each a str")
        return list(host)
    if not isinstance(host, str) or "," not in host:
        return None
    scheme, sep, rest = host.rpartition("://")
    parts = [p.strip() for p in (rest if sep else host).split(",")]
    if not all(parts):
        raise ValueError(f"an empty address in the list {host!r}")
    return [f"{scheme}://{p}" if sep else p for p in parts]


class PrimaryFinder:
    """A client's connector for an address list: a socket connected to the primary.

    Args:
        endpoints: the servers, each with its token and user.
        timeout: seconds each probe may take.
        opener: connects to one endpoint (the client's own way: TCP, TLS or Unix socket).
    """

    def __init__(self, endpoints: Sequence[Endpoint], timeout: float,
                 opener: Callable[[Endpoint, float], socket.socket]) -> None:
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.opener = opener
        self.current: Endpoint | None = None
        self.seen: dict[str, tuple[str, int]] = {}

    def __call__(self) -> socket.socket:
        best: tuple[Endpoint, int] | None = None
        why: list[str] = []
        for ep in self.endpoints:
            try:
                role, term = self.probe(ep)
            except (OSError, TensorShareError, ValueError, KeyError) as exc:
                why.append(f"{ep}: {exc}")
                continue
            self.seen[str(ep)] = (role, term)
            if role == "primary" and (best is None or term > best[1]):
                best = (ep, term)
            elif role != "primary":
                why.append(f"{ep} is a {role} (term {term})")
        if best is None:
            raise ConnectionRefusedError(
                f"no primary among {', '.join(map(str, self.endpoints))}: {'; '.join(why)}")
        for ep in self.endpoints:  # a former primary that has not heard of the newer term
            if self.seen.get(str(ep), ("", best[1]))[1] < best[1] and \
                    self.seen[str(ep)][0] == "primary":
                self.tell_term(ep, best[1])
        self.current = best[0]
        return self.opener(best[0], self.timeout)

    def tell_term(self, ep: Endpoint, term: int) -> None:
        """Tell a server that says it is the primary under an older term of the newer one (a
        ``psync`` with that term: it stops accepting writes, and answers with a refusal).
        Best effort: a user without the ``replicate`` right cannot, and nothing fails."""
        try:
            self._exchange(ep, Psync(2, "", 0, term, ""))
        except (OSError, TensorShareError, ValueError, KeyError):
            pass

    def probe(self, ep: Endpoint) -> tuple[str, int]:
        """``(role, term)`` of one server (an older server without replication: a primary
        of term 0)."""
        stats = self._exchange(ep, Stats(2, _NO_BIN))["stats"]
        role, term = stats.get("role", "primary"), stats.get("term", 0)
        if not isinstance(role, str) or not isinstance(term, int):
            raise ValueError("a malformed role or term")
        return role, term

    def _exchange(self, ep: Endpoint, request: Any) -> dict[str, Any]:
        """A handshake (without a session), then ``request``: its reply's header."""
        sock = self.opener(ep, min(self.timeout, 5.0))
        try:
            sock.settimeout(min(self.timeout, 5.0))
            reader = _Frames(sock)
            nonce = new_nonce() if ep.token is not None else None
            hello = Hello(1, tuple(PROTOCOL_VERSIONS), _PROBE, nonce, None, False, False,
                          ep.user)
            sock.sendall(b"".join(encode_message(hello)[0]))
            h = reader.reply()
            if "challenge" in h:
                assert ep.token is not None and nonce is not None
                proof = client_proof(ep.token, nonce, bytes(h["challenge"]["nonce"]), None,
                                     _PROBE, ep.user)
                sock.sendall(b"".join(encode_message(Auth(1, proof))[0]))
                reader.reply()
            sock.sendall(b"".join(encode_message(request)[0]))
            return reader.reply()
        finally:
            sock.close()


class _Frames:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.decoder = FrameDecoder(1 << 24, 1 << 22)
        self.frames: list[Any] = []

    def reply(self) -> dict[str, Any]:
        """The next reply's header; raises the error it carries."""
        while not self.frames:
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionResetError("the server closed the connection")
            self.frames.extend(self.decoder.feed(data))
        frame = self.frames.pop(0)
        if isinstance(frame, OversizedFrame):
            raise ProtocolError("an oversized reply to a probe")
        h = msgpack.unpackb(frame.header, raw=False)
        if not isinstance(h, dict):
            raise ProtocolError("a reply header that is not a map")
        if h.get("ok") is False or h.get("op") == "error":
            raise error_from_code(str(h.get("code")), str(h.get("message")))
        return h
