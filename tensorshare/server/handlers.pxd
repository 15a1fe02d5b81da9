# Types for the compiled twin of handlers.py (tensorshare.server.handlers_c; see
# tensorshare._ext). The .py stays the reference: this file only declares what Cython may type.
import cython

from tensorshare.server.parts cimport Route
from tensorshare.server.sessions cimport ServerSession
from tensorshare.server.store cimport Store, Written
from tensorshare.wire.records cimport Fetch, Fetched, Item, Put


@cython.final
cdef class Responder:
    cdef public object server
    cdef dict _handlers
    cdef list _tables
    cdef dict _kind_of
    cdef public object relay_of, _users, fence
    cdef dict _routes, _refusals
    cdef Route _get, _peek

    cpdef Route route(self, object msg)
    cpdef object handle(self, object conn, object msg, Route route=*)
    @cython.locals(s=ServerSession)
    cdef object _remembered(self, object conn, object msg, Route route)


cpdef object put_effect(object store, object msg, object ctx=*, object owner=*)

@cython.locals(item=Item)
cdef Written _put_written(Store store, Put msg, object ctx, object owner)

cdef Fetched _fetched(Fetch msg, Fetched taken)
