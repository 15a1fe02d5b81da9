# Types for the compiled twin of connection.py (tensorshare.server.connection_c; see
# tensorshare._ext), and what other twins cimport of it. The .py stays the reference: this file only declares what Cython may type.
import cython

from tensorshare.server.handlers cimport Responder
from tensorshare.server.parts cimport Route
from tensorshare.server.sessions cimport SessionTable
from tensorshare.server.stats cimport ServerStats
from tensorshare.wire.frames cimport FrameDecoder
from tensorshare.wire.protocol cimport ServerConnection
from tensorshare.wire.records cimport Fetch, Fetched


cdef class Connection:
    cdef public object factory, transport
    cdef public ServerConnection conn
    cdef public FrameDecoder _decoder
    cdef public object _st
    cdef public double last_rx, _pass_start
    cdef public object version, session, _timer, _ack, _stall, _greeting, _out, user, usage
    cdef public object _then, _held
    cdef public object _serving, _answered
    cdef public str client_name, peer, role
    cdef public set listening
    cdef public dict started, _waiting, _pass_ops, _folded
    cdef public bint shm, runs, _closed, _paused, _refusing, keeps_reading
    cdef public Responder _responder
    cdef public SessionTable _sessions
    cdef public ServerStats _stats

    cpdef emit(self, object chunks, object shared=*, bint hold=*)
    cpdef _write(self, object chunks, object shared)
    @cython.locals(route=Route, fetched=Fetched, taken=bint, peeked=bint)
    cpdef answer(self, object msg, object reply, Route route=*)
    cpdef _pass(self, list frames, object error)
    @cython.locals(n=Py_ssize_t, conn=ServerConnection, responder=Responder, route=Route)
    cpdef Py_ssize_t _serve(self, list frames)
    cpdef _count_pass(self)
