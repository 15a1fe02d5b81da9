# Types for the compiled twin of handlers.py (tensorshare.server.handlers_c; see
# tensorshare._ext). The .py stays the reference: this file only declares what Cython may type.
import cython


@cython.final
cdef class Route:
    cdef public str op
    cdef public object handler
    cdef public bint mutating, read, store, logged
    cdef public str access


@cython.final
cdef class Responder:
    cdef public object server
    cdef dict _handlers
    cdef list _kind_tables
    cdef public object relay_of, _users
    cdef dict _routes
    cdef Route _get, _peek

    cpdef Route route(self, object msg)
    @cython.locals(s=object)
    cpdef object handle(self, object conn, object msg, Route route=*)


cpdef object put_effect(object store, object msg, object ctx=*, object owner=*)
