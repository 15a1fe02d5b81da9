# Types for the compiled twin of stats.py (tensorshare.server.stats_c; see tensorshare._ext).
# The .py stays the reference: this file only declares what Cython may type.
import cython

cdef object _getitem




@cython.final
cdef class ServerStats:
    cdef public object counters
    cdef public dict latency
    cdef dict _keys

    cpdef count_error(self, str code)
    cpdef observe(self, str op, object bytes_out, double seconds)
    @cython.locals(keys=tuple, h=list, i=Py_ssize_t, bound=double, c=object, k=str)
    cpdef observe_many(self, str op, object n, object bytes_out, double seconds)
    @cython.locals(keys=tuple, h=list)
    cdef tuple _op_keys(self, str op)
