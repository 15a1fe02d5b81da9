"""A Twisted TCP server transport for bulk binary traffic, without the stock copies.

The stock :class:`twisted.internet.tcp.Server` costs several full copies per
payload byte:

* ``doRead`` ``recv()``\\ s at most ``bufferSize`` (64 KiB) bytes at a time into a
  new ``bytes`` object, which a framing protocol then copies again into its frame
  buffer;
* ``write()`` accepts only ``bytes``, so a ``bytearray``/``numpy`` payload must be
  copied into ``bytes`` first;
* ``doWrite`` joins every pending chunk into one new ``bytes`` object before
  sending it.

:class:`FastServer` removes all three:

* a protocol that implements :class:`BufferedProtocol` hands out a writable
  ``memoryview`` (usually the unfilled tail of a preallocated frame buffer) and the
  transport ``recv_into()``\\ s straight into it;
* ``write()``/``writeSequence()`` accept any C-contiguous bytes-like object and only
  queue a ``memoryview`` of it;
* ``doWrite`` hands up to :attr:`FastServer.SEND_MAX_BUFFERS` of the queued views to
  one ``sendmsg()`` call (scatter/gather), advancing through partially sent views
  by slicing.

Use :func:`listen_fast_tcp` instead of ``reactor.listenTCP``. This module never
imports the global reactor: every object is bound to the reactor it is given.

Caveats (differences from the stock transport):

* **Zero copy means shared buffers.** ``write(buf)`` keeps a reference to ``buf``
  and sends from it later. The caller must not modify ``buf`` until it has been
  sent (:attr:`FastServer.queued_bytes` drops accordingly, or the connection is
  lost). A queued ``bytearray`` cannot be resized meanwhile (``BufferError``),
  because the queued ``memoryview`` is an export of it.
* TLS (``startTLS``) is not supported: TLS needs its own record buffering, which
  would bypass this transport's queue. :meth:`FastServer.startTLS` raises.
* The read path only applies to the transport's own ``protocol``. A protocol
  wrapped by e.g. :class:`twisted.protocols.policies.ProtocolWrapper` does not
  expose ``get_read_buffer`` and transparently gets the stock ``dataReceived``
  path.
"""

from __future__ import annotations

import os
import socket
from collections import deque
from collections.abc import Iterable
from errno import EAGAIN, ENOBUFS, EWOULDBLOCK
from typing import Any, Protocol, runtime_checkable

from twisted.internet import main, tcp
from twisted.internet.interfaces import IProtocolFactory, IReactorFDSet, IReactorTCP
from twisted.python import failure

__all__ = [
    "BufferedProtocol",
    "FastPort",
    "FastServer",
    "listen_fast_tcp",
]

# recv/send errors meaning "nothing can be transferred right now", not failures.
# EAGAIN == EWOULDBLOCK on Linux, but not necessarily everywhere.
_READ_RETRY_ERRNOS = frozenset({EWOULDBLOCK, EAGAIN})
_SEND_RETRY_ERRNOS = frozenset({EWOULDBLOCK, EAGAIN, ENOBUFS})


def _iov_max() -> int:
    """The kernel's limit on buffers per ``sendmsg()``; 1024 on Linux."""
    try:
        value = os.sysconf("SC_IOV_MAX")
    except (AttributeError, OSError, ValueError):
        return 16  # POSIX's guaranteed minimum (_XOPEN_IOV_MAX)
    return value if value > 0 else 16


@runtime_checkable
class BufferedProtocol(Protocol):
    """The optional read interface :class:`FastServer` looks for on its protocol.

    This is a duck-typed interface, not a base class: any Twisted protocol (e.g. a
    :class:`twisted.internet.protocol.Protocol` subclass) may add these two methods.
    A protocol without them simply gets the stock ``dataReceived`` behaviour.

    On every read event the transport calls :meth:`get_read_buffer` afresh (its
    answer usually changes from one read to the next):

    * a non-empty writable ``memoryview``: the transport reads with
      ``socket.recv_into(view)`` directly into it, then calls
      :meth:`buffer_updated` with the number of bytes written at the start of
      ``view``;
    * ``None`` (or an empty view): the transport does a stock read of up to
      ``bufferSize`` bytes and calls ``dataReceived(data)``. Use this while the
      size of the next frame is still unknown, e.g. while reading a length prefix.
    """

    def get_read_buffer(self) -> memoryview | None:
        """Return where the next read should land, or ``None`` for ``dataReceived``."""
        ...

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` (> 0) bytes were written at the start of the last returned view."""
        ...


def _as_byte_view(data: Any) -> memoryview:
    """Return a flat unsigned-byte ``memoryview`` of ``data``, without copying.

    Non-byte formats (``array('f')``, numpy arrays, ...) and multi-dimensional
    C-contiguous buffers are recast to ``'B'`` so ``len()`` counts bytes, which
    the send bookkeeping relies on.
    """
    if isinstance(data, str):
        # memoryview(str) also fails, but this message says what to do.
        raise TypeError("Data must be bytes-like, not str; encode it first")
    view = memoryview(data)  # TypeError for anything without the buffer protocol
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return view
    if not view.c_contiguous:
        # sendmsg() needs contiguous memory; making it so would be a silent copy.
        raise TypeError(
            "Data must be a C-contiguous bytes-like object; "
            "copy it (e.g. bytes(view) or numpy.ascontiguousarray) first"
        )
    return view.cast("B")


class FastServer(tcp.Server):
    """A server-side TCP transport with ``recv_into`` reads and ``sendmsg`` writes.

    Drop-in replacement for :class:`twisted.internet.tcp.Server` (created by
    :class:`FastPort`). Differences:

    * reads go straight into the protocol's buffer if it implements
      :class:`BufferedProtocol`;
    * :meth:`write`/:meth:`writeSequence` accept any C-contiguous bytes-like
      object and queue it without copying (see the module caveats about
      mutating queued buffers);
    * ``TCP_NODELAY`` is enabled on every connection: request/response traffic of
      small frames would otherwise stall on Nagle + delayed ACK (~40 ms), and the
      scatter/gather writes already coalesce bulk data, so Nagle gains nothing;
    * :attr:`queued_bytes` tells the application how much is waiting to be sent.

    Producers (``registerProducer``) work as with the stock transport: a streaming
    producer is paused when more than ``bufferSize`` bytes are queued and resumed
    when the queue drains; a pull producer is asked for more when it drains.
    """

    #: Most buffers handed to one ``sendmsg()`` call (bounded by ``IOV_MAX``).
    #: More buffers than the kernel's send buffer can take in one call is wasted
    #: list building; 512 is well past that for any realistic frame mix.
    SEND_MAX_BUFFERS: int = min(512, _iov_max())

    #: Most bytes offered to one ``sendmsg()`` call. The kernel accepts at most its
    #: free send-buffer space anyway (a few MiB), so this only bounds the work
    #: per event-loop turn, should a very large ``SO_SNDBUF`` be configured.
    #: Measured on loopback (1 and 16 MiB echo): 1, 4 and 64 MiB are
    #: indistinguishable; 256 KiB is a little slower.
    SEND_MAX_BYTES: int = 64 * 1024 * 1024

    TLS = False

    def __init__(
        self,
        sock: socket.socket,
        protocol: Any,
        client: tuple[object, ...],
        server: tcp.Port,
        sessionno: int,
        reactor: IReactorFDSet,
    ) -> None:
        # The queue must exist before tcp.Server.__init__ starts reading: nothing
        # can be written before makeConnection(), but keep the object consistent.
        self._send_queue: deque[memoryview] = deque()
        self._queued_bytes = 0
        # Reused for ordinary reads of protocols that take the zero-copy hooks: they copy
        # what they keep, so one buffer per connection replaces a new bytes per read.
        self._read_buffer = bytearray(self.bufferSize)
        self._read_view = memoryview(self._read_buffer)
        super().__init__(sock, protocol, client, server, sessionno, reactor)
        self.setTcpNoDelay(True)

    # ------------------------------------------------------------------ reading

    def doRead(self) -> BaseException | None:  # type: ignore[override]
        """Read into the protocol's buffer if it offers one, else read the stock way.

        Same error contract as :meth:`twisted.internet.tcp.Connection.doRead`:
        ``None`` if all is well (including "nothing to read yet"),
        ``main.CONNECTION_DONE`` on orderly EOF, ``main.CONNECTION_LOST`` on a
        socket error.
        """
        get_read_buffer = getattr(self.protocol, "get_read_buffer", None)
        if get_read_buffer is None:
            return super().doRead()
        view = get_read_buffer()
        # recv_into() on an empty view returns 0, indistinguishable from EOF;
        # treat "no room" like "no buffer" instead of killing the connection.
        direct = view is not None and view.nbytes > 0
        try:
            nbytes = self.socket.recv_into(view if direct else self._read_buffer)
        except OSError as se:
            if se.args[0] in _READ_RETRY_ERRNOS:
                return None
            return main.CONNECTION_LOST
        if not nbytes:
            return main.CONNECTION_DONE
        if direct:
            self.protocol.buffer_updated(nbytes)  # type: ignore[attr-defined]
        else:
            # A view of the reused buffer: valid only during this call (the protocol copies).
            self.protocol.dataReceived(self._read_view[:nbytes])  # type: ignore[arg-type]
        return None

    # ------------------------------------------------------------------ writing

    @property
    def queued_bytes(self) -> int:
        """Bytes accepted by :meth:`write`/:meth:`writeSequence` but not yet sent."""
        return self._queued_bytes

    def write(self, data: Any) -> None:  # type: ignore[override]
        """Queue a bytes-like object for sending, without copying it.

        Raises ``TypeError`` for ``str`` and for objects that are not C-contiguous
        bytes-like objects (checked before the connection state, as the stock
        transport does). Ignored once the connection is closed or half-closed for
        writing. ``data`` must stay unmodified until it has been sent.
        """
        view = _as_byte_view(data)
        if not self.connected or self._writeDisconnected:
            return
        nbytes = view.nbytes
        if nbytes:
            self._queue_views([view], nbytes)

    def writeSequence(self, iovec: Iterable[Any]) -> None:  # type: ignore[override]
        """Queue several bytes-like objects, in order, without copying or joining.

        All items are validated before any is queued, so a bad item leaves the
        queue untouched.
        """
        views = [_as_byte_view(item) for item in iovec]
        if not self.connected or self._writeDisconnected:
            return
        views = [v for v in views if v.nbytes]  # empty views would stall the advance loop
        if views:
            self._queue_views(views, sum(v.nbytes for v in views))

    def _queue_views(self, views: list[memoryview], nbytes: int) -> None:
        """Queue views; if nothing was waiting, send right away (write-through).

        Sending at once saves a reactor pass and two epoll_ctl calls per reply, which is
        most of a small request's latency; what the socket does not take now is sent by
        doWrite as usual. A send error is left for doWrite to find and report.
        """
        queue = self._send_queue
        # A pull producer expects doWrite to ask it for more; a streaming one (the server's
        # protocol, pausing itself while this queue is long) is fine with write-through.
        idle = not queue and not self.disconnecting and (
            self.producer is None or self.streamingProducer)
        queue.extend(views)
        self._queued_bytes += nbytes
        if idle:
            sent = self._send_some()
            if not isinstance(sent, BaseException):
                self._advance(sent)
                if not queue:
                    return
        self._maybePauseProducer()
        self.startWriting()

    def _isSendBufferFull(self) -> bool:
        """Whether a streaming producer should be paused (see ``_maybePauseProducer``)."""
        return self._queued_bytes > self.bufferSize

    def _send_some(self) -> int | BaseException:
        """One ``sendmsg()`` of the head of the queue; bytes sent, or the error."""
        queue = self._send_queue
        max_buffers = self.SEND_MAX_BUFFERS
        max_bytes = self.SEND_MAX_BYTES
        buffers: list[memoryview] = []
        total = 0
        for view in queue:
            buffers.append(view)
            total += len(view)
            if total >= max_bytes or len(buffers) >= max_buffers:
                break
        if total > max_bytes:
            last = buffers[-1]
            buffers[-1] = last[: len(last) - (total - max_bytes)]
        try:
            return self.socket.sendmsg(buffers)
        except OSError as se:
            if se.args[0] in _SEND_RETRY_ERRNOS:
                return 0
            return main.CONNECTION_LOST

    def _advance(self, sent: int) -> None:
        """Drop fully sent views; re-slice the first partially sent one."""
        queue = self._send_queue
        self._queued_bytes -= sent
        while sent:
            head = queue[0]
            size = len(head)
            if sent >= size:
                queue.popleft()
                sent -= size
            else:
                queue[0] = head[sent:]
                sent = 0

    def doWrite(self) -> BaseException | None:
        """Send what the socket takes now; on an empty queue, finish pending closes.

        Mirrors :meth:`twisted.internet.abstract.FileDescriptor.doWrite`: once
        everything is sent it stops write notifications, then either asks a
        producer for more, completes ``loseConnection()`` or completes
        ``loseWriteConnection()`` (half-close).
        """
        queue = self._send_queue
        if queue:
            sent = self._send_some()
            if isinstance(sent, BaseException):
                return sent
            self._advance(sent)
        if queue:
            return None

        self.stopWriting()
        if self.producer is not None and ((not self.streamingProducer) or self.producerPaused):
            self.producerPaused = False
            self.producer.resumeProducing()  # type: ignore[attr-defined]
        elif self.disconnecting:
            return self._postLoseConnection()
        elif self._writeDisconnecting:
            # Set before the handler runs: it may call loseConnection(), which
            # checks this attribute.
            self._writeDisconnected = True
            self._closeWriteConnection()
            return None
        return None

    def connectionLost(self, reason: failure.Failure) -> None:
        """Drop unsent data so the queued buffers (maybe large) are released now."""
        self._send_queue.clear()
        self._queued_bytes = 0
        super().connectionLost(reason)

    def startTLS(self, ctx: object, normal: bool = True) -> None:
        """Not supported: TLS would bypass this transport's zero-copy send queue."""
        raise NotImplementedError("FastServer does not support startTLS")


class FastPort(tcp.Port):
    """A TCP listening port whose accepted connections are :class:`FastServer`\\ s."""

    transport = FastServer


def listen_fast_tcp(
    reactor: IReactorTCP | IReactorFDSet,
    port: int,
    factory: IProtocolFactory,
    *,
    interface: str = "127.0.0.1",
    backlog: int = 50,
) -> FastPort:
    """Listen on ``interface:port`` with :class:`FastServer` connections.

    The equivalent of ``reactor.listenTCP(port, factory, backlog, interface)`` for
    any reactor instance (installed or private). Call it from the reactor's
    thread (or before the reactor runs). ``port=0`` picks a free port; read it
    back with ``listening_port.getHost().port``.

    Note the default interface is loopback only, unlike ``listenTCP``'s ``""``.
    """
    listening_port = FastPort(port, factory, backlog, interface, reactor)
    listening_port.startListening()
    return listening_port
