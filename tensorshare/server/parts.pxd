# Types for the compiled twin of parts.py (tensorshare.server.parts_c; see tensorshare._ext),
# and what other twins cimport of it: the Route every request meets. The .py stays the
# reference: this file only declares what Cython may type.
import cython


@cython.final
cdef class Route:
    cdef public str op
    cdef public object handler
    cdef public bint mutating, read, store, logged
    cdef public str access
