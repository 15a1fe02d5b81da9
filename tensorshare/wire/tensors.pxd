# Types for the compiled twin of tensors.py (tensorshare.wire.tensors_c; see tensorshare._ext):
# a lone tensor's encode and decode. The .py stays the reference: this file only declares
# what Cython may type.
import cython

from tensorshare.wire.records cimport Buffer, Encoded

cdef dict _TREES, _SHAPES
cdef Py_ssize_t TREES_MAX

@cython.locals(tree=bytes, view=object, n=Py_ssize_t)
cpdef Encoded encode_tensor(object x)

@cython.locals(lone=list, n=Py_ssize_t, itemsize=Py_ssize_t)
cpdef object decode_tensor(Encoded enc, object max_raw_bytes)

cpdef object lone_of(bytes tree)

cpdef bint known(bytes tree)

@cython.locals(t=object)
cpdef object make_tensor(object dtype, str name, object shape, Py_ssize_t n,
                         Py_ssize_t itemsize, object raw)

cpdef object writable_raw(Buffer buf, Py_ssize_t expected, object max_raw_bytes)
