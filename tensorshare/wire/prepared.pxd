# Types for the compiled twin of prepared.py (tensorshare.wire.prepared_c; see tensorshare._ext):
# the readers of the fixed layouts walk the header's bytes with C indices. The .py stays the
# reference: this file only declares what Cython may type.
import cython

from tensorshare.wire.records cimport Buffer, Changed, Encoded, Fetched, Item

cdef object _packb, _FRAME_HEAD, _U16, _U32, _U64, _I8, _I16, _I32, _I64, _F64, _BAD
cdef bytes _ZEROS, _K_OP, _K_ID, _K_BIN, _K_ITEMS, _K_ACK, _K_OPEN, _REPLY_ID
cdef bytes _OK_KIND, _K_N_ITEMS, _K_DROPPED
cdef bytes _K_VERSION, _K_UNCHANGED, _NOTIFY_BIN, _K_EVENT, _K_SKIPPED
cdef bytes _ONE_ITEM, _ONE_BUFFER_AT_0, _K_TIMEOUT, _K_MAX_ITEMS, _K_WAIT_TRUE
cdef bytes _K_MIN_ITEMS, _K_MIN_TAG, _K_NEWER_THAN
cdef bytes _FETCHED_HEAD, _PUT_ID, _APPEND_ID, _GET_ID, _PEEK_ID, _K_WAIT, _ITEMS_ONE
cdef Py_ssize_t _NAMES_MAX
cdef dict _OP_ID, _NAMES, _VALID
cdef tuple _BYTES, _CC, _CD
cdef Py_ssize_t _VALID_MAX, _VALID_MAX_BYTES

@cython.locals(n=Py_ssize_t)
cpdef bytes packed_int(object v)

cpdef bytes packed_name(str name)

@cython.locals(b=Buffer, value=Encoded, n=Py_ssize_t, descs=bytes, ack=bytes, extra=bytes)
cpdef object put_header(str op, object rid, str name, Item item, object timeout,
                        object through, tuple open_ids)

@cython.locals(n=Py_ssize_t, k=Py_ssize_t, parts=list)
cpdef bytes fetch_header(bint remove, object rid, str name, object spec, object through,
                         tuple open_ids)

@cython.locals(pad=Py_ssize_t, n=Py_ssize_t)
cpdef list frame_chunks(bytes header, object data)

@cython.locals(b=cython.uchar)
cdef tuple _int_at(bytes h, Py_ssize_t i)

@cython.locals(b=cython.uchar, n=Py_ssize_t, end=Py_ssize_t)
cdef tuple _str_at(bytes h, Py_ssize_t i)

@cython.locals(b=cython.uchar, n=Py_ssize_t, end=Py_ssize_t)
cdef tuple _bin_at(bytes h, Py_ssize_t i)

@cython.locals(it=Item, value=Encoded, b=Buffer, descs=bytes, header=bytes)
cpdef list fetched_chunks(object rid, Fetched reply)

@cython.locals(n=Py_ssize_t, parts=list, header=bytes)
cpdef list notify_chunks(Changed msg)

cpdef object read_request(bytes h, object payload, object limits)

@cython.locals(name=str)
cdef tuple _id_and_bin(bytes h, Py_ssize_t i, object limits)

@cython.locals(b=cython.uchar, t=double)
cdef tuple _timeout_at(bytes h, Py_ssize_t i)

@cython.locals(b=cython.uchar, n=Py_ssize_t, ids=list)
cdef tuple _ack_at(bytes h, Py_ssize_t i)

@cython.locals(n=Py_ssize_t, k=Py_ssize_t, size=Py_ssize_t, value=bytes,
               name=str, seen=tuple)
cdef object _read_store(bytes h, Py_ssize_t i, bint append, object payload, object limits)

cdef tuple _field_int(bytes h, Py_ssize_t i, bytes key, object minimum)

@cython.locals(n=Py_ssize_t, k=Py_ssize_t, b=cython.uchar, name=str, wait=bint)
cdef object _read_fetch(bytes h, Py_ssize_t i, bint remove, object payload, object limits)
