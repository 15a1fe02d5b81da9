"""A replica's side of replication: the connection to its primary (:class:`Upstream`).

It connects as a client (the handshake of docs/PROTOCOL.md §8, with ``--upstream-token-file``
and ``--upstream-user``), asks ``psync`` with the log id and offset it has, applies the full
copy and the records the primary pushes (the same code as a restart's replay), acknowledges
its offset after every read, and reconnects with a growing delay when the connection ends.
Everything runs in the server's reactor thread.
"""

from __future__ import annotations

import os
import re
import struct
import time
import zlib
from typing import Any

import msgpack
from twisted.internet import tcp
from twisted.internet.posixbase import PosixReactorBase
from twisted.internet.protocol import ClientFactory, Protocol
from twisted.logger import Logger
from twisted.python.failure import Failure

from ..errors import ProtocolError
from ..wire.address import parse_address
from ..wire.auth import client_proof, new_nonce, server_proof, tokens_of, verify
from ..wire.frames import PREFIX, FrameDecoder, OversizedFrame, aligned
from ..wire.messages import Auth, Hello
from ..wire.protocol import PROTOCOL_VERSIONS, encode_message
from ..wire.replication import Psync, ReplAck
from .config import env_token
from .persist import SnapshotLoader, parse_record
from .transports import _ZeroCopy

__all__ = ["Upstream"]

log = Logger(namespace="tensorshare.server")

_MAX_DELAY = 2.0
_REC = struct.Struct("<II")  # a record's length and crc32 (persist.py, docs/PROTOCOL.md §12)
_FRAME = struct.Struct("<2sBBIQ")


def _parse_pushed(buf: bytearray | memoryview) -> tuple[dict[str, Any], memoryview | bytearray]:
    """One pushed record (``u32 len | u32 crc32 | frame``), checked as
    :func:`.persist.parse_record` checks it, but without copying it: the payload is a view
    of ``buf`` (the frame's own buffer, a few header bytes more than the record's items
    need). Anything unusual goes to ``parse_record``, which says what is wrong."""
    view = memoryview(buf)
    if len(view) >= _REC.size + PREFIX:
        n, crc = _REC.unpack_from(view)
        magic, version, flags, header_len, payload_len = _FRAME.unpack_from(view, _REC.size)
        head_end = _REC.size + PREFIX + header_len
        start = _REC.size + aligned(PREFIX + header_len) if payload_len else head_end
        if (n == len(view) - _REC.size and magic == b"TS" and version == 1 and not flags
                and start + payload_len == len(view)
                and zlib.crc32(view[_REC.size:]) == crc):
            h = msgpack.unpackb(view[_REC.size + PREFIX:head_end], raw=False,
                                strict_map_key=True)
            if isinstance(h, dict) and isinstance(h.get("op"), str):
                return h, view[start:] if payload_len else bytearray()
    return parse_record(buf if isinstance(buf, bytearray) else bytearray(buf))


class _Stop(Exception):
    """The connection must end (the reason is logged); the replica connects again later."""


class Upstream:
    """The replica's link to its primary: connects, resyncs, applies, acknowledges."""

    def __init__(self, server: Any, repl: Any) -> None:
        self.server, self.repl = server, repl
        cfg = server.config
        self.address = parse_address(cfg.replica_of, 8000)
        token = cfg.upstream_token
        if token is None and cfg.upstream_token_file is not None:
            with open(cfg.upstream_token_file, encoding="utf-8") as f:
                token = f.read()
        if token is None:
            token = env_token()
        self.key = tokens_of(token)[0] if token else None
        self.user = cfg.upstream_user or os.environ.get("TENSORSHARE_USER") or None
        self.replid = ""
        self.offset = 0
        self.synced = False  # the current stream's full copy is applied
        self.ever_synced = False  # a full copy was applied once: it answers reads
        self.last_heard = time.monotonic()
        self.proto: _UpstreamProtocol | None = None
        self.delay = 0.1
        self._stopped = False
        self._retry: Any = None
        self.loader: SnapshotLoader | None = None
        self._last_why = ""
        self._before: set[str] = set()

    def start(self) -> None:
        self._connect()

    def stop(self) -> None:
        self._stopped = True
        if self._retry is not None and self._retry.active():
            self._retry.cancel()
        if self.proto is not None:
            self.proto.abort()

    def lag_s(self) -> float:
        """Seconds since the primary was last heard from (it pings every second)."""
        return round(time.monotonic() - self.last_heard, 3)

    def _connect(self) -> None:
        self._retry = None
        if self._stopped:
            return
        reactor, a = self.server.reactor, self.address
        factory = _Factory(self)
        if a.path is not None:
            reactor.connectUNIX(a.path, factory, timeout=5)
        elif a.tls:
            from twisted.protocols.tls import TLSMemoryBIOFactory

            # (TLS flushes small writes on the next turn of ``clock``: the server's own
            # reactor, never the global one, which a private server's thread does not run)
            tls = TLSMemoryBIOFactory(self._tls(), True, factory, clock=reactor)
            reactor.connectTCP(a.host, a.port, tls, timeout=5)
        elif isinstance(reactor, PosixReactorBase):  # records read straight into place
            _Connector(a.host, a.port, factory, 5, None, reactor).connect()
        else:
            reactor.connectTCP(a.host, a.port, factory, timeout=5)

    def _tls(self) -> Any:
        """The TLS options: the primary's certificate checked against ``upstream_tls_ca``
        (or ``TENSORSHARE_TLS_CA``, else the system's CAs) and its host name."""
        from twisted.internet import ssl

        ca = self.server.config.upstream_tls_ca or os.environ.get("TENSORSHARE_TLS_CA")
        if ca is None:
            return ssl.optionsForClientTLS(self.address.host)
        with open(ca, encoding="ascii") as f:
            pems = re.findall(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----",
                              f.read(), re.S)
        roots = ssl.trustRootFromCertificates([ssl.Certificate.loadPEM(p) for p in pems])
        return ssl.optionsForClientTLS(self.address.host, trustRoot=roots)

    def lost(self, why: str) -> None:
        self.proto = None
        self.loader = None
        if self._stopped:
            return
        # A warning once per reason (a wrong CA, a refused connection), not once a second.
        emit = log.info if why == self._last_why else log.warn
        self._last_why = why
        emit("replica: the connection to the primary {addr} ended ({why}); again in "
             "{delay:g} s", addr=str(self.address), why=why, delay=self.delay)
        self._retry = self.server.reactor.callLater(self.delay, self._connect)
        self.delay = min(self.delay * 2, _MAX_DELAY)

    # -- what the primary sends -----------------------------------------------------------
    def full_copy(self, offset: int, replid: str) -> None:
        """A full copy starts: the replica's state is replaced by what follows."""
        f = self.server
        self._before = set(f.store.names())
        for s in f.sessions:
            f.sessions.close(s)
        self.loader = SnapshotLoader(f.persist, f.store, f.sessions)
        self.replid, self.offset, self.synced = replid, offset, False

    def snap_record(self, payload: bytearray) -> bool:
        if self.loader is None:
            raise _Stop("a full copy's record without a full copy")
        h, body = parse_record(payload)
        self.loader.feed(h, body)
        if not self.loader.ended:
            return False
        self._copied()
        return True

    def _copied(self) -> None:
        f, loader = self.server, self.loader
        assert loader is not None
        self.loader = None
        loader.finish()
        for name in self._before - set(loader.bins):
            f.store.load_bin(name, "value", [])
        self.repl.term = max(self.repl.term, f.persist.term)
        self.synced = self.ever_synced = True
        if f.persist.on_disk:  # its data directory starts again from this copy
            f.snapshot(wait=True)
        for name in sorted(self._before | set(loader.bins)):
            if name in f.store:
                f.changed(name, "put", f.store.n_items(name), f.store.version(name), 0)
            else:
                f.changed(name, "delete", 0, f.store.version(name), 0)
        log.info("replica: full copy applied ({n} bins) at offset {off}",
                 n=len(loader.bins), off=self.offset)

    def record(self, payload: bytearray, offset: int) -> None:
        """One log record: applied as a restart replays it, and kept in the data log."""
        if self.loader is not None:
            raise _Stop("a log record in the middle of a full copy")
        f = self.server
        h, body = _parse_pushed(payload)
        store, p = f.store, f.persist
        journal, store.journal = store.journal, None
        limit, store.max_memory = store.max_memory, None  # what the primary stored, fits
        try:
            p._apply(h, body, store, f.sessions)
        finally:
            store.journal, store.max_memory = journal, limit
        p.add_record([payload], len(payload))
        self.repl.term = max(self.repl.term, p.term)
        self.offset = offset


class _UpstreamProtocol(Protocol):
    def __init__(self, up: Upstream) -> None:
        self.up = up
        limits = up.server.config.limits
        # Large records land in the server's receive pool, as a client's put does: memory
        # used before, not fresh pages to fault in and zero (a 64 MiB record's items are
        # views of it, and it goes back to the pool when they go).
        self.decoder = FrameDecoder(limits.max_frame_bytes + (1 << 20), limits.max_header_bytes,
                                    allocate=up.server.pool.take)
        self.rid = 0
        self.hello: Hello | None = None
        self.nonce = b""
        self.psync_id = -1
        self.acked = -1

    def _next_id(self) -> int:
        self.rid += 1
        return self.rid

    def _send(self, msg: Any) -> None:
        t: Any = self.transport
        t.write(b"".join(encode_message(msg)[0]))  # (small: one write, whatever the transport)

    def abort(self) -> None:
        t: Any = self.transport
        if t is not None:
            t.abortConnection()

    def connectionMade(self) -> None:
        up = self.up
        t: Any = self.transport
        if getattr(t, "setTcpNoDelay", None) is not None:  # (acks are small: no Nagle wait)
            t.setTcpNoDelay(True)
        up.proto = self
        self.hello = Hello(self._next_id(), tuple(PROTOCOL_VERSIONS), "tensorshare-replica",
                           new_nonce() if up.key is not None else None, None, False, False,
                           up.user)
        self._send(self.hello)

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.up.lost(reason.getErrorMessage() if reason is not None else "closed")

    # (the zero-copy read hooks of .transports.BufferedProtocol: a record's payload is read
    # straight into its buffer, not 64 KiB at a time through dataReceived)
    def get_read_buffer(self) -> memoryview | None:
        return self.decoder.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        self._decode(self.decoder.buffer_updated, nbytes)

    def dataReceived(self, data: bytes) -> None:
        self._decode(self.decoder.feed, data)

    def _decode(self, read: Any, what: Any) -> None:
        """The frames the decoder completes with ``read(what)``, applied (a bad frame drops
        the link: see :meth:`_fail`)."""
        try:
            frames = read(what)
        except ProtocolError as exc:
            self._fail(exc)
            return
        if frames:
            self._frames(frames)

    def _fail(self, exc: BaseException) -> None:
        log.error("replica: {why}; resyncing from the primary {addr}", why=exc,
                  addr=str(self.up.address))
        self.up.replid = ""  # what it has is not to be trusted: a full copy next time
        self.abort()

    def _frames(self, frames: list[Any]) -> None:
        """Apply what one read completed, write it to the data log, then acknowledge it
        (once per read, however many records it held)."""
        up = self.up
        try:
            applied = False
            for frame in frames:
                if isinstance(frame, OversizedFrame):
                    raise _Stop("a frame over the replica's limits")
                header = msgpack.unpackb(frame.header, raw=False)
                if not isinstance(header, dict):
                    raise _Stop("a header that is not a map")
                applied = self._message(header, frame.payload) or applied
        except (_Stop, ProtocolError, ValueError, KeyError, TypeError, OverflowError,
                msgpack.UnpackException) as exc:
            self._fail(exc)
            return
        up.server.commit()  # (its own data log first: what it acknowledges is written)
        if applied and up.offset != self.acked:
            self.acked = up.offset
            self._send(ReplAck(self._next_id(), up.offset))

    def _message(self, h: dict[str, Any], payload: Any) -> bool:
        op, up = h.get("op"), self.up
        term = h.get("term")
        if isinstance(term, int) and term < up.repl.term:
            raise _Stop(f"the primary is at term {term}, older than this replica's "
                        f"{up.repl.term}: it is a former primary")
        up.last_heard = time.monotonic()
        if op == "repl":
            up.record(payload, int(h["offset"]))
            return True
        if op == "repl_snap":
            return up.snap_record(payload)
        if op == "repl_ping":
            return False
        if op == "reply":
            return self._reply(h)
        if op == "error":
            raise _Stop(f"the primary closed the connection: {h.get('message')}")
        raise _Stop(f"unknown op {op!r} from the primary")

    def _reply(self, h: dict[str, Any]) -> bool:
        hello, up = self.hello, self.up
        rid = h.get("id")
        if not h.get("ok"):
            if rid == self.psync_id or (hello is not None and rid == hello.id) or rid == -2:
                raise _Stop(f"the primary refused: {h.get('code')}: {h.get('message')}")
            return False
        if hello is not None and rid == hello.id:
            self._greeted(h)
        elif rid == self.psync_id:
            up.delay = 0.1
            if h["mode"] == "full":
                up.full_copy(int(h["offset"]), str(h["replid"]))
            # (On a replica the resync counts are those it took; on a primary, served.)
            up.repl.resyncs["full_resyncs" if h["mode"] == "full" else "partial_resyncs"] += 1
            up.repl.term = max(up.repl.term, int(h["term"]))
            sid = h.get("server_id")
            if isinstance(sid, str) and sid:  # the primary's data set: its versions go on here
                up.server.server_id = sid
            log.info("replica: following {addr} ({mode}, offset {off}, term {term})",
                     addr=str(up.address), mode=h["mode"], off=h["offset"], term=h["term"])
        return False

    def _greeted(self, h: dict[str, Any]) -> None:
        hello, up = self.hello, self.up
        assert hello is not None
        challenge = h.get("challenge")
        if challenge is not None:
            if up.key is None or hello.nonce is None:
                raise _Stop("the primary requires a token: give --upstream-token-file")
            self.nonce = bytes(challenge["nonce"])
            args = (up.key, hello.nonce, self.nonce, None, hello.client, hello.user)
            self._send(Auth(hello.id, client_proof(*args)))
            return
        if hello.nonce is not None and self.nonce and up.key is not None:
            proof = server_proof(up.key, hello.nonce, self.nonce, None, hello.client,
                                 hello.user)
            if not verify(proof, h.get("proof")):
                raise _Stop("the primary's proof is wrong: it does not know the token")
        self.hello = None
        self.psync_id = self._next_id()
        self._send(Psync(self.psync_id, up.replid, up.offset if up.replid else 0,
                         up.repl.term, ""))


class _FastClient(_ZeroCopy, tcp.Client):  # type: ignore[misc]  # (_ZeroCopy: tcp.Server)
    """The replica's TCP transport: reads go straight into the protocol's buffers (the
    server's own zero-copy transport, :mod:`.transports`, on the connecting side)."""

    def __init__(self, *args: Any) -> None:
        self._init_queues()
        tcp.Client.__init__(self, *args)


class _Connector(tcp.Connector):
    def _makeTransport(self) -> tcp.Client:
        return _FastClient(self.host, self.port, self.bindAddress, self, self.reactor)


class _Factory(ClientFactory):
    noisy = False

    def __init__(self, up: Upstream) -> None:
        self.up = up

    def buildProtocol(self, addr: Any) -> _UpstreamProtocol:  # type: ignore[override]
        return _UpstreamProtocol(self.up)

    def clientConnectionFailed(self, connector: Any, reason: Failure) -> None:
        self.up.lost(reason.getErrorMessage())
