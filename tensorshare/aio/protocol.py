"""The bytes of an :class:`~.client.AsyncClient`'s connection: one
:class:`asyncio.BufferedProtocol` for every transport, and :class:`SocketStream`, the
transport of a plain TCP or Unix socket.

:class:`AioProtocol` reads straight into the buffer the session names (the large parts of a
message land in the memory the received tensors will live in, as the blocking client's
``recv_into`` does) and into a scratch buffer otherwise; it hands what it read, the
descriptors that came with it and the connection's end to its client, nothing more.

Over TLS the loop's own transport drives it (``loop.create_connection``: asyncio's or
uvloop's). A plain socket gets :class:`SocketStream`, on the loop's ``add_reader`` /
``add_writer`` over the non-blocking socket, for what the loops' transports do not give:

* a Unix socket passes memfds with ``SCM_RIGHTS`` both ways (shared memory), and neither
  ``loop.sock_recvmsg`` nor a transport's ``write`` carries descriptors: ``recvmsg_into``
  the protocol's buffer with room for descriptors, ``sendmsg`` with the memfds beside the
  frame, at most :data:`~tensorshare.memory.fdpass.MAX_FDS_PER_MESSAGE` per message
  (docs/PROTOCOL.md §4.4), each with at least one byte of the frame;
* a frame goes out with ``sendmsg`` of its own buffers (a tensor's own memory, never a
  copy, as the blocking client sends it), what the socket does not take now kept as views
  of them until it does; asyncio's transport (Python 3.11) copies whatever it cannot send
  at once into its buffer, a copy of every large tensor.
"""

from __future__ import annotations

import array
import asyncio
import collections
import socket
from collections.abc import Sequence
from typing import Any, Protocol

from ..memory.fdpass import ANC_SPACE, MAX_FDS_PER_MESSAGE, fds_of
from ..wire.frames import BytesLike, skip_sent  # (the blocking client's too: one way to count)

__all__ = ["READ_CHUNK", "AioProtocol", "SocketStream"]

class Owner(Protocol):
    """What a connection tells its :class:`~.client.AsyncClient` (declared here, so this
    module needs nothing above it)."""

    def _loop_now(self) -> asyncio.AbstractEventLoop: ...

    def _connection_made(self, proto: AioProtocol) -> None: ...

    def _direct_buffer(self, proto: AioProtocol) -> memoryview | None: ...

    def _received(self, proto: AioProtocol, nbytes: int, direct: int) -> None: ...

    def _fds(self, proto: AioProtocol, fds: list[int]) -> None: ...

    def _connection_lost(self, proto: AioProtocol, why: str) -> None: ...


#: The scratch buffer a read lands in when no large part is expected.
READ_CHUNK = 256 * 1024
# A frame at most this long goes out as one joined write; a longer one buffer by buffer
# (a tensor's own memory, not a copy, where the transport sends at once).
_JOIN_MAX = 64 * 1024
_MAX_IOV = 512  # buffers per sendmsg (Linux: IOV_MAX is 1024)
_READS_PER_TURN = 64  # the most reads of a large part in one turn of the loop


class AioProtocol(asyncio.BufferedProtocol):
    """One connection of an :class:`~.client.AsyncClient` (see the module docstring)."""

    def __init__(self, client: Owner) -> None:
        self.client = client
        self.transport: Any = None
        self.lost = False
        self.scratch = bytearray(READ_CHUNK)
        self.view = memoryview(self.scratch)
        self.direct = 0  # the length of the session's own buffer get_buffer gave (0: scratch)
        self.done: asyncio.Future[str] = client._loop_now().create_future()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.client._connection_made(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        direct = self.client._direct_buffer(self)
        if direct is not None:
            self.direct = len(direct)
            return direct
        self.direct = 0
        return self.view

    def buffer_updated(self, nbytes: int) -> None:
        self.client._received(self, nbytes, self.direct)

    def fds_received(self, fds: list[int]) -> None:
        """Descriptors a Unix socket passed: they come before the bytes they came with."""
        self.client._fds(self, fds)

    def eof_received(self) -> bool:
        return False  # the server closed its side: close ours

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        why = "the server closed the connection" if exc is None else \
            (str(exc) or type(exc).__name__)
        if not self.done.done():
            self.done.set_result(why)
        self.client._connection_lost(self, why)

    def write(self, chunks: Sequence[BytesLike], shared: list[Any] | None = None) -> None:
        """Send one batch of frames (``shared``: the memfds that go with them, in order)."""
        transport = self.transport
        if self.lost or transport is None:
            return
        if type(transport) is SocketStream:
            transport.send(chunks, shared)
        elif len(chunks) == 1:
            transport.write(chunks[0])
        elif sum(map(len, chunks)) <= _JOIN_MAX:
            transport.write(b"".join(chunks))
        else:
            for chunk in chunks:
                transport.write(chunk)

    def abort(self) -> None:
        if not self.lost and self.transport is not None:
            self.transport.abort()


class _Out:
    """One batch of frames on its way out of a :class:`SocketStream`: what is left of its
    buffers, the descriptors still to pass, and the memfds they belong to (kept open until
    they are passed)."""

    __slots__ = ("views", "fds", "keep", "i")

    def __init__(self, chunks: Sequence[BytesLike], shared: list[Any] | None) -> None:
        self.views = [c if isinstance(c, memoryview) else memoryview(c) for c in chunks]
        self.keep = shared
        self.fds = [m.fd for m in shared] if shared else []
        self.i = skip_sent(self.views, 0, 0)

    def send(self, sock: socket.socket) -> bool:
        """Send what the socket takes now; whether everything went.

        Raises:
            BlockingIOError: the socket is full.
            OSError: the send failed.
        """
        views = self.views
        while self.i < len(views):
            pending = self.fds
            if pending:
                now = pending[:MAX_FDS_PER_MESSAGE]
                # While more descriptors wait, a message carries one byte of the frame, so
                # that none is left behind when the data runs out.
                data = views[self.i:self.i + _MAX_IOV] if len(now) == len(pending) \
                    else [views[self.i][:1]]
                sent = sock.sendmsg(data, [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                            array.array("i", now).tobytes())])
                self.fds = pending[len(now):]
            else:
                sent = sock.sendmsg(views[self.i:self.i + _MAX_IOV])
            self.i = skip_sent(views, self.i, sent)
        self.keep = None
        return True


class SocketStream:
    """The transport of an :class:`AioProtocol` over a connected TCP or Unix socket (with
    descriptors both ways over a Unix socket; see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                 protocol: AioProtocol) -> None:
        self._loop, self._sock, self._protocol = loop, sock, protocol
        self._fd = sock.fileno()
        self._unix = sock.family == socket.AF_UNIX
        self._out: collections.deque[_Out] = collections.deque()
        self._writing = False
        self._closing = False
        self._closed = False
        sock.setblocking(False)
        loop.add_reader(self._fd, self._read_ready)
        protocol.connection_made(self)

    def _read_ready(self) -> None:
        """Read what came; while a large part streams in (into the session's own buffer),
        read again at once rather than through another turn of the loop, up to
        :data:`_READS_PER_TURN` reads."""
        proto = self._protocol
        for _ in range(_READS_PER_TURN):
            if not self._read_once(proto) or not proto.direct or self._closed:
                return

    def _read_once(self, proto: AioProtocol) -> bool:
        """One read into ``proto``'s buffer; whether it brought bytes."""
        target = proto.get_buffer(-1)
        fds = None
        try:
            if self._unix:
                n, ancdata, _, _ = self._sock.recvmsg_into([target], ANC_SPACE)
                if ancdata:
                    fds = fds_of(ancdata)
            else:
                n = self._sock.recv_into(target)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            self._end(exc)
            return False
        if fds:
            proto.fds_received(fds)
        if not n:
            self._end(None)
            return False
        proto.buffer_updated(n)
        return True

    def send(self, chunks: Sequence[BytesLike], shared: list[Any] | None) -> None:
        if self._closed or self._closing:
            return
        sent = 0
        if not self._out and not shared and len(chunks) <= _MAX_IOV:
            # The usual case: the socket takes the whole batch in one call.
            try:
                sent = self._sock.sendmsg(chunks)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self._end(exc)
                return
            if sent == sum(map(len, chunks)):
                return
        out = _Out(chunks, shared)
        out.i = skip_sent(out.views, out.i, sent)
        self._out.append(out)
        if not self._writing:
            self._write_ready()

    def _write_ready(self) -> None:
        out = self._out
        while out:
            try:
                out[0].send(self._sock)
            except (BlockingIOError, InterruptedError):
                if not self._writing:
                    self._writing = True
                    self._loop.add_writer(self._fd, self._write_ready)
                return
            except OSError as exc:
                self._end(exc)
                return
            out.popleft()
        if self._writing:
            self._writing = False
            self._loop.remove_writer(self._fd)
        if self._closing:
            self._end(None)

    def get_write_buffer_size(self) -> int:
        return sum(sum(v.nbytes for v in o.views[o.i:]) for o in self._out)

    def is_closing(self) -> bool:
        return self._closing or self._closed

    def close(self) -> None:
        """Close once what is queued went out (the reader stops now)."""
        if self._closed or self._closing:
            return
        self._closing = True
        self._loop.remove_reader(self._fd)
        if not self._out:
            self._end(None)

    def abort(self) -> None:
        self._end(None)

    def _end(self, exc: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._fd)
        if self._writing:
            self._loop.remove_writer(self._fd)
            self._writing = False
        self._out.clear()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._loop.call_soon(self._protocol.connection_lost, exc)
