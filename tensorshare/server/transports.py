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

Use :func:`listen_fast_tcp` instead of ``reactor.listenTCP`` (and :func:`listen_fast_unix`
instead of ``reactor.listenUNIX``: the same transport on a Unix socket, which can also pass
file descriptors along with the data, see :meth:`FastServer.writeSequence`). This module
never imports the global reactor: every object is bound to the reactor it is given.

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

import array
import os
import socket
from collections import deque
from collections.abc import Iterable
from errno import EAGAIN, ENOBUFS, EWOULDBLOCK
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

from twisted.internet import main, tcp, unix
from twisted.internet.error import ConnectionDone, ConnectionLost
from twisted.internet.interfaces import IProtocolFactory, IReactorFDSet, IReactorTCP
from twisted.python import failure

from ..memory.fdpass import ANC_SPACE, MAX_FDS_PER_MESSAGE, fds_of

__all__ = [
    "BufferedProtocol",
    "FastPort",
    "FastServer",
    "FastUnixPort",
    "FastUnixServer",
    "listen_fast_tcp",
    "listen_fast_unix",
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


if TYPE_CHECKING:  # the mixin is only ever used on top of a Twisted stream transport
    _Transport = tcp.Server
else:
    _Transport = object


class _ZeroCopy(_Transport):
    """The zero-copy read and write paths, for a Twisted stream transport (TCP or Unix).

    Mixed into :class:`FastServer` (a drop-in replacement for
    :class:`twisted.internet.tcp.Server`, created by :class:`FastPort`) and
    :class:`FastUnixServer`. Differences from the stock transports:

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

    #: Optional: an object whose ``queued`` attribute every transport that shares it keeps
    #: up to date with the bytes queued on all of them (the server's total, in O(1)).
    ledger: Any = None

    def attach_ledger(self, ledger: Any) -> None:
        """Keep ``ledger.queued`` up to date with this transport's queued bytes (those
        queued already included)."""
        if self.ledger is None:
            self.ledger = ledger
            ledger.queued += self._queued_bytes

    def _init_queues(self) -> None:
        # The queue must exist before the base __init__ starts reading: nothing can be
        # written before makeConnection(), but keep the object consistent.
        self._send_queue: deque[memoryview] = deque()
        self._queued_bytes = 0
        # File descriptors to pass (Unix sockets only): (stream offset of the data they go
        # with, fds, owner kept alive until they are sent), in order.
        self._fd_marks: deque[tuple[int, list[int], Any]] = deque()
        self._queued_total = 0  # bytes ever queued (stream offsets of the marks)
        self._sent_total = 0
        # Reused for ordinary reads of protocols that take the zero-copy hooks: they copy
        # what they keep, so one buffer per connection replaces a new bytes per read.
        self._read_buffer = bytearray(self.bufferSize)
        self._read_view = memoryview(self._read_buffer)

    # ------------------------------------------------------------------ reading

    def doRead(self) -> ConnectionLost | ConnectionDone | None:
        """Read into the protocol's buffer if it offers one, else read the stock way.

        Same error contract as :meth:`twisted.internet.tcp.Connection.doRead`:
        ``None`` if all is well (including "nothing to read yet"),
        ``main.CONNECTION_DONE`` on orderly EOF, ``main.CONNECTION_LOST`` on a
        socket error.
        """
        # Looked up on the protocol's class: a wrapper (TLS) that forwards unknown attributes
        # to the protocol it wraps must not have its bytes read past it.
        if getattr(type(self.protocol), "get_read_buffer", None) is None:
            return super().doRead()
        protocol = cast(BufferedProtocol, self.protocol)  # (its class has the hooks)
        view = protocol.get_read_buffer()
        # recv_into() on an empty view returns 0, indistinguishable from EOF;
        # treat "no room" like "no buffer" instead of killing the connection.
        direct = view is not None and view.nbytes > 0
        try:
            nbytes = self._recv_into(view if view is not None and direct else self._read_buffer)
        except OSError as se:
            if se.args[0] in _READ_RETRY_ERRNOS:
                return None
            return main.CONNECTION_LOST
        if not nbytes:
            return main.CONNECTION_DONE
        if direct:
            protocol.buffer_updated(nbytes)
        else:
            # A view of the reused buffer: valid only during this call (the protocol copies).
            self.protocol.dataReceived(self._read_view[:nbytes])  # type: ignore[arg-type]  # a view
        return None

    def _recv_into(self, target: memoryview | bytearray) -> int:
        return self.socket.recv_into(target)

    # ------------------------------------------------------------------ writing

    @property
    def queued_bytes(self) -> int:
        """Bytes accepted by :meth:`write`/:meth:`writeSequence` but not yet sent."""
        return self._queued_bytes

    def write(self, data: Any) -> None:
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

    def writeSequence(self, iovec: Iterable[Any], fds: list[int] | None = None,
                      owner: Any = None) -> None:
        """Queue several bytes-like objects, in order, without copying or joining.

        All items are validated before any is queued, so a bad item leaves the
        queue untouched.

        Args:
            fds: file descriptors to pass along (Unix sockets only, see
                :class:`FastUnixServer`): they reach the peer no later than the first
                byte of this data, in order with every other data's descriptors.
            owner: kept alive until the descriptors are sent (whatever closes them).
        """
        views = [_as_byte_view(item) for item in iovec]
        if not self.connected or self._writeDisconnected:
            return
        views = [v for v in views if v.nbytes]  # empty views would stall the advance loop
        if fds:
            if not self._passes_fds:
                raise TypeError("file descriptors can only be passed over a Unix socket")
            at = self._queued_total
            for i in range(0, len(fds), MAX_FDS_PER_MESSAGE):  # (each mark fits one message)
                self._fd_marks.append((at, list(fds[i : i + MAX_FDS_PER_MESSAGE]), owner))
        if views:
            self._queue_views(views, sum(v.nbytes for v in views))

    _passes_fds = False

    def write_frames(self, chunks: list[Any]) -> None:
        """Queue a frame's chunks as tensorshare's encoders make them (``bytes``, ``bytearray``
        or flat byte ``memoryview``s, whose ``len`` is their size), without the checks and
        conversions of :meth:`writeSequence`: the one write per reply of the server."""
        if not self.connected or self._writeDisconnected:
            return
        nbytes = 0
        for c in chunks:
            nbytes += len(c)
        if nbytes:
            self._queue_views(chunks, nbytes)

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
        self._queued_total += nbytes
        if self.ledger is not None:
            self.ledger.queued += nbytes
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
            total = max_bytes
        marks = self._fd_marks
        ancillary: list[tuple[int, int, bytes]] = []
        sending = 0
        if marks:
            # The descriptors of data that starts within this send go with it (the peer
            # matches them to frames in order, so early is fine, late is not).
            end = self._sent_total + total
            fds: list[int] = []
            for offset, mark_fds, _ in marks:
                if offset >= end:
                    break
                if len(fds) + len(mark_fds) > MAX_FDS_PER_MESSAGE:
                    # The rest go with the next send: this one stops where their data
                    # begins, or after one byte when it began already (every descriptor is
                    # passed before its frame's last byte, and the queue never runs dry first).
                    total = max(offset - self._sent_total, 1)
                    buffers = _cut(buffers, total)
                    break
                fds.extend(mark_fds)
                sending += 1
            if fds:
                ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                              array.array("i", fds).tobytes())]
        try:
            sent = self.socket.sendmsg(buffers, ancillary) if ancillary else \
                self.socket.sendmsg(buffers)
        except OSError as se:
            if se.args[0] in _SEND_RETRY_ERRNOS:
                return 0
            return main.CONNECTION_LOST
        if sent and sending:
            for _ in range(sending):
                marks.popleft()  # sent: the owners may let go of the descriptors now
        self._sent_total += sent
        return sent

    def _advance(self, sent: int) -> None:
        """Drop fully sent views; re-slice the first partially sent one."""
        queue = self._send_queue
        self._queued_bytes -= sent
        if self.ledger is not None:
            self.ledger.queued -= sent
        while sent:
            head = queue[0]
            size = len(head)
            if sent >= size:
                queue.popleft()
                sent -= size
            else:  # (a view of the rest: bytes chunks from write_frames are not copied)
                queue[0] = (head if type(head) is memoryview else memoryview(head))[sent:]
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
            self.producer.resumeProducing()  # type: ignore[attr-defined]  # IProducer: both kinds
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
        if self.ledger is not None:
            self.ledger.queued -= self._queued_bytes
        self._queued_bytes = 0
        self._fd_marks.clear()
        super().connectionLost(reason)

    def startTLS(self, ctx: object, normal: bool = True) -> None:
        """Not supported: TLS would bypass this transport's zero-copy send queue."""
        raise NotImplementedError("FastServer does not support startTLS")


class FastServer(_ZeroCopy, tcp.Server):
    """A server-side TCP transport with ``recv_into`` reads and ``sendmsg`` writes."""

    def __init__(self, sock: socket.socket, protocol: Any, client: tuple[object, ...],
                 server: tcp.Port, sessionno: int, reactor: IReactorFDSet) -> None:
        self._init_queues()
        tcp.Server.__init__(self, sock, protocol, client, server, sessionno, reactor)
        self.setTcpNoDelay(True)


class FastUnixServer(_ZeroCopy, unix.Server):
    """The same transport on a Unix socket, passing file descriptors both ways.

    Descriptors given to :meth:`writeSequence` travel with the data (``SCM_RIGHTS``).
    Descriptors received are handed to the protocol's ``fds_received(list)`` before the
    data they came with; a protocol without that method gets them closed.
    """

    _passes_fds = True

    def __init__(self, sock: socket.socket, protocol: Any, client: Any, server: Any,
                 sessionno: int, reactor: IReactorFDSet) -> None:
        self._init_queues()
        unix.Server.__init__(self, sock, protocol, client, server, sessionno, reactor)

    def _recv_into(self, target: memoryview | bytearray) -> int:
        nbytes, ancdata, _flags, _addr = self.socket.recvmsg_into([target], ANC_SPACE)
        if ancdata:
            fds = fds_of(ancdata)
            if fds:
                take = getattr(self.protocol, "fds_received", None) \
                    if getattr(type(self.protocol), "fds_received", None) else None
                if take is None:
                    for fd in fds:
                        os.close(fd)
                else:
                    take(fds)
        return nbytes



def _cut(buffers: list[memoryview], nbytes: int) -> list[memoryview]:
    """The first ``nbytes`` of ``buffers``."""
    out: list[memoryview] = []
    for view in buffers:
        if nbytes <= 0:
            break
        out.append(view if len(view) <= nbytes else view[:nbytes])
        nbytes -= len(view)
    return out


class FastPort(tcp.Port):
    """A TCP listening port whose accepted connections are :class:`FastServer`\\ s."""

    transport = FastServer


class FastUnixPort(unix.Port):
    """A Unix socket listening port whose connections are :class:`FastUnixServer`\\ s."""

    transport = FastUnixServer


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


def listen_fast_unix(reactor: Any, path: str, factory: IProtocolFactory, *,
                     mode: int = 0o600, backlog: int = 50) -> FastUnixPort:
    """Listen on the Unix socket ``path`` with :class:`FastUnixServer` connections.

    A stale socket file at ``path`` (one nobody listens on) is removed first. The socket is
    readable and writable by its owner only, unless ``mode`` says otherwise.

    Raises:
        OSError: ``path`` exists and something listens there, or cannot be bound.
    """
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)  # nobody listens: a leftover from a process that died
        except OSError:
            pass
        else:
            raise OSError(f"another server listens on {path}")
        finally:
            probe.close()
    port = FastUnixPort(path, factory, backlog, mode, reactor)  # type: ignore[arg-type]  # str works
    port.startListening()
    return port

