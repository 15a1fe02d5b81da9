# Types for the compiled twin of session.py (tensorshare.client.session_c; see tensorshare._ext),
# and what other twins cimport of it. The .py stays the reference: this file only declares
# what Cython may type.
import cython

from tensorshare.wire.frames cimport FrameDecoder
from tensorshare.wire.protocol cimport ClientConnection
from tensorshare.wire.replies cimport ReplyReader


@cython.final
cdef class Call:
    cdef public object id, request, token, convert, timeout, wait, started, deadline, extra
    cdef public object sent_on
    cdef public str op, what, state
    cdef public bint waiting


@cython.final
cdef class Done:
    cdef public Call call
    cdef public object reply, error


@cython.final
cdef class Notify:
    cdef public str bin
    cdef public dict event
    cdef public list callbacks


@cython.final
cdef class Ready:
    cdef public object hello
    cdef public bint first, resumed


@cython.final
cdef class Drop:
    cdef public str reason


@cython.final
cdef class Send:
    cdef public list chunks


@cython.final
cdef class _Listen:
    cdef public list callbacks
    cdef public object version


cdef dict _EXPECTS
cdef tuple _NO_ACK


cdef class ClientSession:
    cdef public str address, name, last_loss
    cdef public object token, user, _nonce, _server_nonce, timeout, reconnect, session_id
    cdef public object heartbeat, rng, limits, server, generation, closed, disconnected_since
    cdef public object server_said, _next_id, _through, _ping, _hello, allocate
    cdef public ClientConnection conn
    cdef public bint connected, shm
    cdef public dict calls, listeners, held
    cdef public Py_ssize_t _last_through
    cdef public tuple _last_open
    cdef public list _deadlines, _queue, _out_shared, _finished_now
    cdef public double _last_tx, _last_rx, _held_at
    cdef public ReplyReader _replies

    cpdef object op_of(self, object rid)
    @cython.locals(c=Call, cls=type)
    cpdef Call call(self, object request, str what, double now, object token=*,
                    object convert=*, object timeout=*, object extra=*)
    @cython.locals(out=list, c=Call, queue=list)
    cpdef list pop_sendable(self, double now)
    @cython.locals(through=Py_ssize_t, open_ids=list, opened=tuple)
    cpdef tuple _ack(self)
    cpdef list receive_data(self, object data, double now)
    @cython.locals(conn=ClientConnection)
    cpdef object get_buffer(self)
    @cython.locals(msgs=list, i=Py_ssize_t, conn=ClientConnection, decoder=FrameDecoder)
    cpdef list receive_read(self, bytearray data, object view, Py_ssize_t n, double now)
    @cython.locals(reader=ReplyReader, i=Py_ssize_t, end=Py_ssize_t, start=Py_ssize_t)
    cdef Py_ssize_t _whole_replies(self, bytearray data, Py_ssize_t n, Py_ssize_t max_header,
                                   Py_ssize_t max_frame, list out) except -1
    cpdef list buffer_updated(self, Py_ssize_t nbytes, double now)
    @cython.locals(out=list)
    cpdef list _events(self, list msgs, double now)
    @cython.locals(c=Call)
    cpdef _reply(self, object msg, list out, double now)
    cpdef object next_deadline(self)
    cpdef double heartbeat_due(self, double now)
    cpdef object ack_due(self)
    @cython.locals(out=list, heap=list, c=Call)
    cpdef list tick(self, double now)
