# Types for the compiled twin of messages.py (tensorshare.wire.messages_c; see
# tensorshare._ext): the messages of every request as cdef classes with declared, read-only
# attributes (no dict, no object.__setattr__ per field), recycled through freelists.
# The .py stays the reference: this file only declares what Cython may type.
import cython


cdef class _Record:
    pass


@cython.final
@cython.freelist(256)
cdef class Item(_Record):
    cdef readonly object value, tag


@cython.final
@cython.freelist(64)
cdef class FetchSpec(_Record):
    cdef readonly bint remove, wait
    cdef readonly object max_items, timeout, min_tag, newer_than, min_items


@cython.final
@cython.freelist(64)
cdef class Put(_Record):
    cdef readonly object id, item, min_version
    cdef readonly str bin


@cython.final
@cython.freelist(16)
cdef class Append(_Record):
    cdef readonly object id, item, timeout, rest, min_version
    cdef readonly str bin


@cython.final
@cython.freelist(64)
cdef class Fetch(_Record):
    cdef readonly object id
    cdef readonly str bin
    cdef readonly FetchSpec spec


@cython.final
@cython.freelist(64)
cdef class Stored(_Record):
    cdef readonly object id, version, n_items, dropped


@cython.final
@cython.freelist(64)
cdef class Fetched(_Record):
    cdef readonly object id, items, version, n_items, dropped, tags, nbytes
    cdef readonly str kind
    cdef readonly bint unchanged


@cython.final
@cython.freelist(16)
cdef class Acked(_Record):
    cdef readonly object id
    cdef readonly bint flag


@cython.final
cdef class ErrorReply(_Record):
    cdef readonly object id
    cdef readonly str code, message


@cython.final
@cython.freelist(16)
cdef class Changed(_Record):
    cdef readonly str bin, op
    cdef readonly object n_items, version, skipped, dropped
