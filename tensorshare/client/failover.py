"""Following the primary of a replicated set: an address list, and the primary found in it.

``Client("tensorshare://a:7000,b:7000")``, ``Client(["a:7000", "b:7000"])`` or a
``TENSORSHARE_URL`` with commas gives a client several servers: a primary and its replicas
(README: Replication and failover). Each time the client connects (the first time, and after
every drop) it asks every address what it is (a handshake, then ``stats`` of no bin: its
``role`` and ``term``) and connects to the one that says it is the primary, the higher term
winning if two do. While none does, the attempt fails like a refused connection: the client
tries again within its timeout (then ``ConnectError``). After a promotion the client's next
connection finds the promoted replica, and its session resumes there.

The probe is sans-I/O (:class:`Probe`: bytes in, bytes out) and the choice is made in one
place (:class:`PrimaryChoice`), so every face asks alike: :class:`PrimaryFinder` with blocking
sockets (the blocking :class:`~.blocking.Client`), the Twisted and asyncio faces with their own
non-blocking connections (``client/twisted.py``, ``aio/failover.py``).
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

__all__ = ["PROBE_ERRORS", "PrimaryChoice", "PrimaryFinder", "Probe", "addresses", "located",
           "resolve_list"]

_PROBE = "tensorshare-probe"
_NO_BIN = "tensorshare-probe-no-bin"

#: What a probe of one server may fail with: that server is skipped (the others are asked).
PROBE_ERRORS = (OSError, TensorShareError, ValueError, KeyError)


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


class Probe:
    """One exchange with one server, sans I/O: a handshake without a session (the token
    proved when the server asks), then one request; :attr:`reply` is its reply's header.

    :meth:`start` gives the first bytes to send; :meth:`feed` takes what came and gives what
    to send next (``b""``: nothing yet), until :attr:`done`. Raises the error a reply carries
    (``AuthenticationError``, ...), ``ProtocolError`` on a malformed reply.
    """

    def __init__(self, ep: Endpoint, request: Any) -> None:
        self.ep, self.request = ep, request
        self.decoder = FrameDecoder(1 << 24, 1 << 22)
        self.nonce = new_nonce() if ep.token is not None else None
        self.stage = "hello"  # then "auth" (a token proved), "request", "done"
        self.reply: dict[str, Any] | None = None

    @property
    def done(self) -> bool:
        return self.reply is not None

    def start(self) -> bytes:
        hello = Hello(1, tuple(PROTOCOL_VERSIONS), _PROBE, self.nonce, None, False, False,
                      self.ep.user)
        return b"".join(encode_message(hello)[0])

    def feed(self, data: bytes) -> bytes:
        """What came (``b""``: the server closed the connection, an error)."""
        if not data:
            raise ConnectionResetError("the server closed the connection")
        out: list[bytes] = []
        for frame in self.decoder.feed(data):
            if self.reply is not None:
                break
            out.append(self._step(_header(frame)))
        return b"".join(out)

    def _step(self, h: dict[str, Any]) -> bytes:
        if self.stage == "hello" and "challenge" in h:
            if self.ep.token is None or self.nonce is None:
                raise ProtocolError("a challenge to a probe that named no token")
            proof = client_proof(self.ep.token, self.nonce, bytes(h["challenge"]["nonce"]),
                                 None, _PROBE, self.ep.user)
            self.stage = "auth"
            return b"".join(encode_message(Auth(1, proof))[0])
        if self.stage in ("hello", "auth"):
            self.stage = "request"
            return b"".join(encode_message(self.request)[0])
        self.stage, self.reply = "done", h
        return b""


def resolve_list(host: Any, port: int | None, endpoint: Callable[[Any, int | None], Endpoint],
                 timeout: float) -> tuple[Endpoint, PrimaryChoice | None]:
    """A face's servers: its endpoint and, for an address list (:func:`addresses`), the
    :class:`PrimaryChoice` of its servers (the endpoint: the first of them)."""
    hosts = addresses(host)
    if hosts is None:
        assert not isinstance(host, list)  # (a list is an address list)
        return endpoint(host, port), None
    choice = PrimaryChoice([endpoint(h, port) for h in hosts], timeout)
    return choice.endpoints[0], choice


def located(host: Any, port: int | None, opts: Any
            ) -> tuple[Endpoint, PrimaryChoice | None, str | None, int | None, str | None, str]:
    """Where the asyncio and Twisted faces connect (``opts``: their ``ClientOptions``): the
    endpoint, the address list's :class:`PrimaryChoice` (``None``: one server), then the
    endpoint's host, port and path, and the address it is named by."""
    ep, choice = resolve_list(host, port, opts.endpoint, opts.timeout)
    where = ep.address
    return ep, choice, where.host, where.port, where.path, str(ep)


def _header(frame: Any) -> dict[str, Any]:
    """A reply's header; raises the error it carries."""
    if isinstance(frame, OversizedFrame):
        raise ProtocolError("an oversized reply to a probe")
    h = msgpack.unpackb(frame.header, raw=False)
    if not isinstance(h, dict):
        raise ProtocolError("a reply header that is not a map")
    if h.get("ok") is False or h.get("op") == "error":
        raise error_from_code(str(h.get("code")), str(h.get("message")))
    return h


class PrimaryChoice:
    """Which server of an address list is the primary, from what each said: the part every
    face shares (the I/O is each face's own).

    A face asks :meth:`role_probe` of every endpoint (and reads each finished probe with
    :meth:`heard`, or :meth:`failed`), then :meth:`choose`: the primary (the highest term
    among those that say they are one), and the former primaries to tell of that term
    (:meth:`fence_probe` each, best effort: it stops their writes).

    Args:
        endpoints: the servers, each with its token and user.
        timeout: seconds the client may take to connect (a probe takes at most half, and
            at most 5 s).
    """

    def __init__(self, endpoints: Sequence[Endpoint], timeout: float) -> None:
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.current: Endpoint | None = None
        self.seen: dict[str, tuple[str, int]] = {}
        self._why: dict[str, str] = {}

    @property
    def probe_timeout(self) -> float:
        """How long a probe may take: a server that never answers (a machine that is gone)
        costs at most this, and leaves half the client's timeout to connect."""
        return min(self.timeout / 2, 5.0)

    def role_probe(self, ep: Endpoint) -> Probe:
        """The probe that asks ``ep`` its role and term (``stats`` of no bin)."""
        return Probe(ep, Stats(2, _NO_BIN))

    def fence_probe(self, ep: Endpoint, term: int) -> Probe:
        """The probe that tells a server that says it is the primary under an older term of
        the newer one (a ``psync`` with that term: it stops accepting writes, and answers
        with a refusal). A user without the ``replicate`` right cannot: nothing fails."""
        return Probe(ep, Psync(2, "", 0, term, ""))

    def heard(self, ep: Endpoint, probe: Probe) -> None:
        """``ep`` answered its role probe: ``(role, term)`` (an older server without
        replication: a primary of term 0)."""
        try:
            assert probe.reply is not None
            stats = probe.reply["stats"]
            role, term = stats.get("role", "primary"), stats.get("term", 0)
            if not isinstance(role, str) or not isinstance(term, int):
                raise ValueError("a malformed role or term")
        except (KeyError, AttributeError, TypeError, ValueError) as exc:
            self.failed(ep, exc)
            return
        self.seen[str(ep)] = (role, term)
        self._why.pop(str(ep), None)

    def failed(self, ep: Endpoint, exc: BaseException) -> None:
        """``ep`` could not be asked (down, refused, malformed)."""
        self.seen.pop(str(ep), None)
        self._why[str(ep)] = f"{ep}: {exc or type(exc).__name__}"

    def choose(self) -> tuple[Endpoint, list[tuple[Endpoint, int]]]:
        """The primary (:attr:`current` from now), and the former primaries to fence with
        the newer term.

        Raises:
            ConnectionRefusedError: none says it is the primary (the reasons, each named).
        """
        best: tuple[Endpoint, int] | None = None
        why: list[str] = []
        for ep in self.endpoints:
            if str(ep) not in self.seen:
                why.append(self._why.get(str(ep), f"{ep}: no answer"))
                continue
            role, term = self.seen[str(ep)]
            if role == "primary" and (best is None or term > best[1]):
                best = (ep, term)
            elif role != "primary":
                why.append(f"{ep} is a {role} (term {term})")
        if best is None:
            raise ConnectionRefusedError(
                f"no primary among {', '.join(map(str, self.endpoints))}: {'; '.join(why)}")
        stale = [(ep, best[1]) for ep in self.endpoints
                 if self.seen.get(str(ep), ("", 0))[0] == "primary"
                 and self.seen[str(ep)][1] < best[1]]
        self.current = best[0]
        return best[0], stale


class PrimaryFinder(PrimaryChoice):
    """The blocking client's connector for an address list: a socket connected to the
    primary (the probes over blocking sockets, one server after the other).

    Args:
        endpoints, timeout: as for :class:`PrimaryChoice`.
        opener: connects to one endpoint (the client's own way: TCP, TLS or Unix socket).
    """

    def __init__(self, endpoints: Sequence[Endpoint], timeout: float,
                 opener: Callable[[Endpoint, float], socket.socket]) -> None:
        super().__init__(endpoints, timeout)
        self.opener = opener

    def __call__(self) -> socket.socket:
        for ep in self.endpoints:
            try:
                probe = self._exchange(self.role_probe(ep))
            except PROBE_ERRORS as exc:
                self.failed(ep, exc)
                continue
            self.heard(ep, probe)
        primary, stale = self.choose()
        for ep, term in stale:  # a former primary that has not heard of the newer term
            self.tell_term(ep, term)
        return self.opener(primary, self.timeout)

    def tell_term(self, ep: Endpoint, term: int) -> None:
        """Fence a former primary with ``term`` (best effort, see :meth:`fence_probe`)."""
        try:
            self._exchange(self.fence_probe(ep, term))
        except PROBE_ERRORS:
            pass

    def _exchange(self, probe: Probe) -> Probe:
        """Run ``probe`` over a blocking socket of its own."""
        sock = self.opener(probe.ep, self.probe_timeout)
        try:
            sock.settimeout(self.probe_timeout)
            sock.sendall(probe.start())
            while not probe.done:
                sock.sendall(probe.feed(sock.recv(1 << 16)))
            return probe
        finally:
            sock.close()
