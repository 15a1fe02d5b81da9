# Types for the compiled twin of store.py (tensorshare.server.store_c; see tensorshare._ext).
# The .py stays the reference: this file only declares what Cython may type.
import cython


@cython.final
@cython.freelist(64)
cdef class Written:
    cdef public object version, n_items, dropped


@cython.final
@cython.freelist(256)
cdef class _Entry:
    cdef public object item, nbytes, tag, owner


@cython.final
cdef class _Bin:
    cdef public str kind
    cdef public object entries
    cdef public object nbytes


@cython.final
cdef class _Meta:
    cdef public object version, config, changed_at, bytes_in, bytes_out
    cdef public dict ops


@cython.final
cdef class Waiter:
    cdef public str name
    cdef public object spec, max_bytes, callback, ctx
    cdef public bint active


@cython.final
cdef class Blocked:
    cdef public str name
    cdef public list entries
    cdef public object callback, ctx, min_version, owner
    cdef public bint active


cdef class Store:
    cdef public object max_memory, on_change, clock, outside, journal, nbytes, watched
    cdef public dict _bins, _meta, _waiters, _blocked, _unreported_drops

    @cython.locals(m=_Meta)
    cpdef object config(self, str name)
    @cython.locals(old=_Bin, b=_Bin)
    cpdef Written put(self, str name, object item, object nbytes, object tag=*, object ctx=*,
                      object min_version=*, object owner=*)
    @cython.locals(m=_Meta)
    cpdef _count(self, str name, str op, object bytes_in, object bytes_out)
    @cython.locals(m=_Meta)
    cpdef tuple _changed(self, str name, str op, _Bin b, object dropped=*,
                         object min_version=*)
    cpdef _check_memory(self, str name, object growth, object nbytes)
    cpdef object fetch(self, str name, object spec, object max_bytes=*, object ctx=*)
    @cython.locals(b=_Bin, e=_Entry, n=Py_ssize_t, chosen=list)
    cpdef object _try_fetch(self, str name, object spec, object min_items, object max_bytes,
                            bint report_unchanged=*, object ctx=*)
    cpdef tuple _after_removal(self, str name, _Bin b, object nbytes)
