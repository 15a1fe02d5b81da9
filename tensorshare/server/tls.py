"""TLS for the server: Twisted's TLS (pyOpenSSL over a memory BIO) with the bulk
path's copies taken out, and the factory wrapper that turns it on when the server
is given a certificate and key. Imported only by a server that uses TLS."""

from __future__ import annotations

from typing import Any, cast

from OpenSSL.SSL import Error, WantReadError, ZeroReturnError
from twisted.internet import ssl
from twisted.internet.interfaces import IProtocolFactory
from twisted.protocols.policies import ProtocolWrapper
from twisted.protocols.tls import BufferingTLSTransport, TLSMemoryBIOFactory, TLSMemoryBIOProtocol
from twisted.python.failure import Failure

from ..errors import ProtocolError
from ..wire.messages import ErrorReply
from ..wire.protocol import encode_message
from .transports import BufferedProtocol

__all__ = ["ServerTLS", "tls_wrapped"]

_CHUNK = 1 << 20


def tls_wrapped(factory: IProtocolFactory, config: Any, reactor: Any) -> IProtocolFactory:
    """``factory`` itself, or wrapped in TLS when ``config`` names a certificate and key.

    ``reactor`` is the one that runs the server (TLS flushes small writes on its next turn:
    never on the global reactor, which a private server's thread does not run).

    TLS is Twisted's own (pyOpenSSL, a memory BIO between the socket and the protocol) with
    :class:`ServerTLS` as its protocol.

    Raises:
        ValueError: only one of the two files is given, or they cannot be loaded.
    """
    cert, key = config.tls_cert, config.tls_key
    if cert is None and key is None:
        return factory
    if cert is None or key is None:
        raise ValueError("TLS needs both a certificate (--tls-cert) and its key (--tls-key)")
    try:
        with open(cert, "rb") as f:
            cert_pem = f.read()
        with open(key, "rb") as f:
            key_pem = f.read()
        chain = [ssl.Certificate.loadPEM(c).original for c in _pem_blocks(cert_pem)[1:]]
        options = ssl.PrivateCertificate.loadPEM(cert_pem + b"\n" + key_pem).options()
        if chain:
            options.extraCertChain = chain
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load the TLS certificate {cert} and key {key}: {exc}") \
            from None
    except Exception as exc:  # OpenSSL's errors
        raise ValueError(f"cannot load the TLS certificate {cert} and key {key}: {exc}") \
            from None
    tls = TLSMemoryBIOFactory(options, False, factory, clock=reactor)
    tls.protocol = ServerTLS
    return tls


class ServerTLS(BufferingTLSTransport):
    """Twisted's TLS with the copies taken out of the bulk path, and a plain-client check.

    * Reads: the socket reads up to 1 MiB at a time into one reused buffer (the zero-copy
      read hooks, on the TLS layer itself), and the decrypted bytes go straight into the
      frame the server protocol is filling (``recv_into`` its ``get_read_buffer``), not
      through 32 KiB ``bytes`` objects.
    * Writes: a large frame's chunks are encrypted as they are (no join) and 1 MiB at a time
      (not 16 KiB), and the encrypted bytes are taken out of the memory BIO in one piece.
    * A plain tensorshare client (its first bytes are a frame, ``TS``, not a TLS record) is
      told, in plain frames, to use TLS, and closed.
    """

    _sniffed = False
    _scratch: bytearray | None = None

    def get_read_buffer(self) -> memoryview:
        if self._scratch is None:
            self._scratch = bytearray(_CHUNK)
        return memoryview(self._scratch)

    def buffer_updated(self, nbytes: int) -> None:
        assert self._scratch is not None
        self.dataReceived(memoryview(self._scratch)[:nbytes])  # type: ignore[arg-type]  # a view

    def dataReceived(self, data: bytes) -> None:
        if not self._sniffed:
            self._sniffed = True
            transport = self.transport
            if bytes(data[:2]) == b"TS" and transport is not None:
                _CHUNKs, _ = encode_message(ErrorReply(0, ProtocolError.code, (
                    "this server speaks TLS: connect with tensorshare+tls://HOST:PORT "
                    "(and the server's CA as tls_ca)")))
                transport.write(b"".join(bytes(c) for c in _CHUNKs))
                transport.loseConnection()
                return
        super().dataReceived(data)

    def _flushReceiveBIO(self) -> None:
        app = self.wrappedProtocol
        direct = getattr(type(app), "get_read_buffer", None) is not None
        buffered = cast(BufferedProtocol, app)  # (used only where direct: it has the hooks)
        plain: bytearray | None = None
        while not self._lostTLSConnection:
            try:
                view = buffered.get_read_buffer() if direct else None
                if view is not None and view.nbytes:
                    # (At most a few records: pyOpenSSL allocates as much as it is asked
                    # for on every call, and one call yields one record, 16 KiB.)
                    n = self._tlsConnection.recv_into(view, 65536)
                    if not self._aborted:
                        buffered.buffer_updated(n)
                    continue
                if plain is None:
                    plain = bytearray(65536)
                n = self._tlsConnection.recv_into(plain)
            except WantReadError:
                break
            except ZeroReturnError:
                self._shutdownTLS()
                self._tlsShutdownFinished(None)
                continue
            except Error:
                self._tlsShutdownFinished(Failure())
                continue
            if not self._aborted:  # the protocol copies what it keeps
                ProtocolWrapper.dataReceived(self, memoryview(plain)[:n])
        self._flushSendBIO()

    def _flushSendBIO(self) -> None:
        while True:
            try:
                data = self._tlsConnection.bio_read(_CHUNK + 65536)
            except WantReadError:
                return
            self.transport.write(data)  # type: ignore[union-attr]  # connected while it reads

    def writeSequence(self, sequence: Any) -> None:
        parts = list(sequence)
        if sum(len(p) for p in parts) < 65536:
            super().writeSequence(parts)
            return
        self._aggregator.flush()  # what small writes wait in, first
        for part in parts:
            TLSMemoryBIOProtocol.write(self, memoryview(part).cast("B"))

    def _write(self, data: bytes) -> None:
        if self._lostTLSConnection:
            return
        sent_total = 0
        while sent_total < len(data):
            try:
                sent = self._tlsConnection.send(data[sent_total:sent_total + _CHUNK])
            except WantReadError:
                self._bufferedWrite(data[sent_total:])
                break
            except Error:
                self._tlsShutdownFinished(Failure())
                break
            sent_total += sent
            self._flushSendBIO()


def _pem_blocks(pem: bytes) -> list[bytes]:
    end = b"-----END CERTIFICATE-----"
    return [block + end for block in pem.split(end)[:-1] if b"-----BEGIN" in block]
