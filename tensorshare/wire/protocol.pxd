# Types for the compiled twin of protocol.py (tensorshare.wire.protocol_c; see tensorshare._ext).
# The .py stays the reference: this file only declares what Cython may type.
import cython

from tensorshare.wire.fields cimport Fds, check_bin, read_items
from tensorshare.wire.prepared cimport fetched_chunks, packed_int, read_request
from tensorshare.wire.replies cimport ReplyReader
from tensorshare.wire.frames cimport Frame, FrameDecoder, OversizedFrame
from tensorshare.wire.records cimport Item

cdef object _packb, _FRAME_HEAD
cdef tuple _STORED_OK, _ACKED_OK
cdef bytes _PACKED_REPLY_OK, _NOTIFY_OP


cdef class _Side:
    cdef FrameDecoder _decoder
    cdef public Fds fds

    cdef tuple _frames(self, object data, Py_ssize_t nbytes)


@cython.final
cdef class ServerConnection(_Side):
    cdef public object limits
    cdef public bint greeted
    cdef public dict bytes_in

    cpdef tuple frames(self, object data)
    cpdef tuple buffered(self, Py_ssize_t nbytes)
    cpdef tuple parse(self, object frame)
    @cython.locals(by_op=dict, whole=Frame, header=bytes)
    cdef tuple _parse_frame(self, object frame)
    @cython.locals(by_op=dict, h=dict)
    cpdef tuple parse_general(self, object frame)


@cython.final
cdef class ClientConnection(_Side):
    cdef public object limits
    cdef public bint shm
    cdef ReplyReader _replies

    @cython.locals(header=bytes, chunks=list, limits=object, size=Py_ssize_t, c=object)
    cpdef list send_acked(self, object msg, Py_ssize_t through, tuple open_ids,
                          object shared=*)
    @cython.locals(out=list, frame=object)
    cdef list _parse(self, list frames, object error, object op_of)
    @cython.locals(h=dict, header=bytes, reader=ReplyReader, op=object)
    cdef object _parse_frame(self, object frame, object op_of)


@cython.locals(head=bytes, mid=bytes, n_key=bytes, d_key=bytes, header=bytes)
cpdef bytes stored_frame(object rid, object version, object n_items, object dropped=*)

@cython.locals(head=bytes, mid=bytes, header=bytes)
cpdef bytes acked_frame(object rid, bint flag)

cpdef list encode_reply(object msg, object shared=*)

@cython.locals(header=dict, buffers=list, packed=bytes)
cpdef tuple encode_message(object msg, object extra=*, object shared=*)

@cython.locals(k=Py_ssize_t, out=list, descs=list, sizes=list, offsets=list)
cpdef list _items_header(object items, list buffers, object shared)

cpdef dict _header_map(object frame)

cpdef tuple _ack_of(dict h)

cdef object _prepared_request(object msg, Py_ssize_t through, tuple open_ids)

cdef list _prepared_chunks(object msg, bytes header)
