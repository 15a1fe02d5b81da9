# Types for the compiled twin of sessions.py (tensorshare.server.sessions_c; see
# tensorshare._ext). The .py stays the reference: this file only declares what Cython may type.
import cython

from tensorshare.wire.replies cimport ReplyReader

cdef ReplyReader _READER


@cython.final
@cython.freelist(256)
cdef class Remembered:
    cdef public object reply
    cdef public object bin
    cdef public object held


@cython.final
cdef class ServerSession:
    cdef public bytes id
    cdef public dict replies
    cdef public object held
    cdef public object attached
    cdef public object remembered_bytes, usage
    cdef public list order

    cpdef object lookup(self, object rid)
    cpdef list remembered(self)


@cython.final
cdef class SessionTable:
    cdef public object max_sessions, max_session_bytes
    cdef public dict sessions
    cdef public object held, remembered
    cdef public object detached

    @cython.locals(replies=dict)
    cpdef remember(self, ServerSession s, object rid, object reply, object bin=*,
                   object held=*)
    @cython.locals(replies=dict, order=list, gone=list, kept=list)
    cpdef object ack(self, ServerSession s, object through, tuple open_ids=*)
    @cython.locals(n=Py_ssize_t)
    cpdef object _drop(self, ServerSession s, list rids)
