# Types for the compiled twin of fields.py (tensorshare.wire.fields_c; see tensorshare._ext).
# The .py stays the reference: this file only declares what Cython may type, and what the
# protocol's twin calls at C level (it cimports these).
import cython

from tensorshare.wire.records cimport Buffer, Encoded, Item


@cython.final
cdef class Fds:
    cdef public object queue
    cdef public bint writable
    cdef public object limit


cpdef str check_bin(dict h, object limits)

@cython.locals(end=Py_ssize_t, items=list, size=Py_ssize_t, buffers=list,
               total=Py_ssize_t, view=memoryview)
cpdef list read_items(dict h, object payload, Py_ssize_t max_depth, bint check)
