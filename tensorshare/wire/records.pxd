# Types for the compiled twin of records.py (tensorshare.wire.records_c; see tensorshare._ext):
# the records every request makes as cdef classes with declared, read-only attributes (no
# dict, no object.__setattr__ per field). The .py stays the reference: this file only
# declares what Cython may type.
import cython


cdef class Record:
    pass


@cython.final
cdef class Buffer(Record):
    cdef readonly object data, codec, raw_nbytes, shm


@cython.final
cdef class Encoded(Record):
    cdef readonly object value
    cdef readonly tuple buffers
    cdef readonly object nbytes


@cython.final
cdef class Item(Record):
    cdef readonly Encoded value
    cdef readonly object tag


@cython.final
cdef class FetchSpec(Record):
    cdef readonly bint remove, wait
    cdef readonly object max_items, timeout, min_tag, newer_than, min_items


@cython.final
cdef class Put(Record):
    cdef readonly object id, min_version, room
    cdef readonly str bin
    cdef readonly Item item


@cython.final
cdef class Append(Record):
    cdef readonly object id, timeout, rest, min_version
    cdef readonly bint wait_room
    cdef readonly str bin
    cdef readonly Item item


@cython.final
cdef class Fetch(Record):
    cdef readonly object id
    cdef readonly str bin
    cdef readonly FetchSpec spec


@cython.final
cdef class Stored(Record):
    cdef readonly object id, version, n_items, dropped


@cython.final
cdef class Fetched(Record):
    cdef readonly object id, items, version, n_items, dropped, tags, nbytes
    cdef readonly str kind
    cdef readonly bint unchanged


@cython.final
cdef class Acked(Record):
    cdef readonly object id
    cdef readonly bint flag


@cython.final
cdef class ErrorReply(Record):
    cdef readonly object id
    cdef readonly str code, message


@cython.final
cdef class Changed(Record):
    cdef readonly str bin, op
    cdef readonly object n_items, version, skipped, dropped


@cython.locals(b=Buffer)
cpdef Buffer raw_buffer(object data, object nbytes)

@cython.locals(e=Encoded)
cpdef Encoded encoded_of(object value, tuple buffers, object nbytes)
