# Types for the compiled twin of frames.py (tensorshare.wire.frames_c; see tensorshare._ext).
# The .py stays the reference: this file only declares what Cython may type.
import cython

cdef object _PREFIX
cdef bytes _ZEROS


@cython.final
@cython.freelist(64)
cdef class Frame:
    cdef public bytes header
    cdef public object payload


@cython.final
cdef class OversizedFrame:
    cdef public bytes header
    cdef public object payload_len
    cdef public object limit
    cdef public object reason


cpdef Py_ssize_t aligned(Py_ssize_t n)


@cython.locals(payload_len=Py_ssize_t, chunks=list, start=Py_ssize_t, head_len=Py_ssize_t,
               pad=Py_ssize_t)
cpdef list encode_frame(bytes header, object buffers=*)


cdef class FrameDecoder:
    cdef public Py_ssize_t max_frame_bytes, max_header_bytes, reserved
    cdef public object budget
    cdef object _allocate
    cdef public int _state
    cdef bytearray _prefix
    cdef object _target
    cdef Py_ssize_t _pos
    cdef public object _remaining_skip
    cdef bytes _header
    cdef object _payload_len
    cdef bint _oversized

    @cython.locals(view=memoryview, out=list)
    cpdef list feed(self, object data)

    @cython.locals(i=Py_ssize_t, n=Py_ssize_t, head_end=Py_ssize_t, start=Py_ssize_t,
                   end=Py_ssize_t, max_header=Py_ssize_t, max_frame=Py_ssize_t,
                   version=Py_ssize_t, flags=Py_ssize_t, header_len=Py_ssize_t)
    cdef memoryview _whole_frames(self, memoryview view, list out)

    @cython.locals(i=Py_ssize_t, n=Py_ssize_t, take=Py_ssize_t, state=int)
    cdef _feed(self, memoryview view, list out)
