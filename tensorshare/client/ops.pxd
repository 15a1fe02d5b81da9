# Types for the compiled twin of ops.py (tensorshare.client.ops_c; see tensorshare._ext).
# The .py stays the reference: this file only declares what Cython may type. The op
# methods live on Ops, a mixin of Python classes (StreamOps, ServiceOps) that the client's
# faces combine, so it stays a Python class; what is typed is what every get and peek runs:
# the reply's decoder and the function it calls.
import cython


@cython.final
cdef class _Decode:
    cdef public object max_depth, device, face, name
    cdef public bint value_only, non_blocking


cdef object _TENSOR


cpdef object decode_fetched(object reply, object max_depth, object cuda_ipc=*)
