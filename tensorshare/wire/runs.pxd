# Types for the compiled twin of runs.py (tensorshare.wire.runs_c; see tensorshare._ext): the
# server's scan for runs of like items and the client's read of one, in C loops. The .py stays
# the reference: this file only declares what Cython may type.
import cython

from tensorshare.wire.records cimport Buffer, Encoded, Item

cdef Py_ssize_t _ALIGN_MASK
cdef object _MAX_RAW_BYTES


@cython.final
cdef class Run:
    cdef readonly bytes value
    cdef readonly object data
    cdef readonly Py_ssize_t count
    cdef readonly tuple tags


cdef list _lone(bytes tree)

@cython.locals(n=Py_ssize_t, k=Py_ssize_t, stop=Py_ssize_t, size=Py_ssize_t, first=Encoded,
               e=Encoded, b=Buffer, tree=bytes)
cdef Py_ssize_t _run_end(object items, Py_ssize_t i, list shared)

@cython.locals(out=list, end=Py_ssize_t, off=Py_ssize_t, i=Py_ssize_t, j=Py_ssize_t,
               n=Py_ssize_t, it=Item, b=Buffer, descs=list, tags=list, run=object,
               joined=bytes)
cpdef list items_header(object items, list buffers, list shared)

@cython.locals(count=object, off=object, nbytes=object)
cpdef tuple read_run(dict raw, object view, Py_ssize_t end)

@cython.locals(total=Py_ssize_t, runs=bint)
cpdef Py_ssize_t run_count(object items)
