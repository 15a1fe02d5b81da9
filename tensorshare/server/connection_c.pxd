# Types for the compiled twin of connection.py (tensorshare.server.connection_c; see
# tensorshare._ext). The .py stays the reference: this file only declares what Cython may type.
import cython

from tensorshare.server.handlers_c cimport Responder as _ResponderC, Route as _RouteC
from tensorshare.server.sessions_c cimport SessionTable as _SessionTableC
from tensorshare.server.stats_c cimport ServerStats as _StatsC
from tensorshare.wire.frames_c cimport FrameDecoder as _FrameDecoderC
from tensorshare.wire.protocol_c cimport ServerConnection as _ServerConnectionC


cdef class Connection:
    cdef public object factory, transport
    cdef public _ServerConnectionC conn
    cdef public _FrameDecoderC _decoder
    cdef public object _st
    cdef public double last_rx, _pass_start
    cdef public object version, session, _timer, _ack, _stall, _greeting, _out
    cdef public object _serving, _answered
    cdef public str client_name, peer, role
    cdef public set listening
    cdef public dict started, _waiting, _pass_ops, _folded
    cdef public bint shm, _closed, _paused
    cdef public _ResponderC _responder
    cdef public _SessionTableC _sessions
    cdef public _StatsC _stats

    cpdef emit(self, object chunks, object shared=*, bint hold=*)
    cpdef _write(self, object chunks, object shared)
    @cython.locals(route=_RouteC)
    cpdef answer(self, object msg, object reply, _RouteC route=*)
    cpdef _pass(self, list frames, object error)
    @cython.locals(n=Py_ssize_t, conn=_ServerConnectionC, responder=_ResponderC, route=_RouteC)
    cpdef Py_ssize_t _serve(self, list frames)
    cpdef _count_pass(self)
