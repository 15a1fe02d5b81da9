# Types for the compiled twin of replies.py (tensorshare.wire.replies_c; see
# tensorshare._ext), and what other twins cimport of it. The .py stays the reference: this
# file only declares what Cython may type.
import cython

cdef bytes _REPLY_ID, _OK_VERSION, _OK_FLAG, _OK_FALSE_CODE, _OK_KIND, _NOTIFY_BIN
cdef Py_ssize_t _PREFIX_LEN, _ALIGN_MASK, _FRAME_VERSION
cdef bytes _VALUE, _LIST, _N_ITEMS, _DROPPED, _VERSION, _MESSAGE, _EVENT, _ITEMS_ONE, _ONE_BUFFER_AT_0


@cython.final
cdef class ReplyReader:
    cdef public bytes h
    cdef public Py_ssize_t i, start

    cdef bint _at(self, bytes piece)
    @cython.locals(h=bytes, i=Py_ssize_t, b=Py_ssize_t, size=Py_ssize_t)
    cdef object _int(self)
    @cython.locals(h=bytes, i=Py_ssize_t, b=Py_ssize_t, n=Py_ssize_t)
    cdef Py_ssize_t _len(self, Py_ssize_t short, Py_ssize_t one) except -1
    cdef object _after(self, bytes key)
    cdef str _str_after(self, bytes key)
    @cython.locals(n=Py_ssize_t)
    cdef str _str(self)
    @cython.locals(n=Py_ssize_t)
    cdef bytes _bin(self)
    cpdef object reply_id(self, bytes h)
    @cython.locals(b=Py_ssize_t)
    cpdef object reply(self, object rid, object kind, object payload)
    cdef object _error(self, object rid, object payload)
    @cython.locals(size=Py_ssize_t, buffers=tuple, value=bytes)
    cdef object _fetched(self, object rid, object payload)
    cpdef object notify(self, bytes h)
    @cython.locals(header_len=Py_ssize_t, payload_len=Py_ssize_t, head_end=Py_ssize_t,
                   start=Py_ssize_t, end=Py_ssize_t)
    cpdef Py_ssize_t frame_at(self, bytearray data, Py_ssize_t i, Py_ssize_t n,
                              Py_ssize_t max_header, Py_ssize_t max_frame) except -1
