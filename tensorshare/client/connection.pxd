# Types for the compiled twin of connection.py (tensorshare.client.connection_c; see
# tensorshare._ext): the connection a Client face holds, and the records of a call.
# The .py stays the reference: this file only declares what Cython may type.
import cython

from tensorshare.client.election cimport ReadElection
from tensorshare.client.session cimport Call, ClientSession, Done


cdef object _PLAIN


@cython.locals(sent=Py_ssize_t, total=Py_ssize_t, i=Py_ssize_t)
cpdef _sendall(object sock, object chunks, object fds=*, object timeout=*)


cdef class _Slot:
    cdef public object _lock
    cdef public object reply, error
    cdef public bint done

    cpdef resolve(self, object reply, object error=*)
    cpdef bint wait(self, object timeout)


cdef class _FutureSlot(_Slot):
    cdef public object future
    cdef public Call call

    cpdef resolve(self, object reply, object error=*)


@cython.final
cdef class _Reader:
    cdef public object sock, poll, scratch, view
    cdef public bint is_unix, tls


@cython.final
cdef class PendingCall:
    cdef public object _client, _outcome
    cdef public Call _call
    cdef public _Slot _slot


cdef class Connection:
    cdef public double timeout
    cdef public object reconnect, endpoint, host, port, path, _connector, _options
    cdef public str address
    cdef public object _pid, _forks
    cdef public ClientSession _session
    cdef public object _lock, _cv, _send_lock
    cdef public ReadElection _election
    cdef public _Reader _reader
    cdef public object _wake_r, _wake_w, _sock, _events, _dispatcher, _ready, _wakeup
    cdef public object _attempt, _lost_at, _thread
    cdef public bint _closing, _leaving
    cdef dict __dict__
    cdef object __weakref__

    @cython.locals(call=Call, slot=_Slot, session=ClientSession, reader=_Reader, lone=bint,
                   now=double, taken=tuple)
    cpdef object _execute(self, object cmd)
    @cython.locals(slot=_Slot, call=Call)
    cpdef tuple _call(self, object cmd)
    cpdef _flush(self)
    @cython.locals(session=ClientSession)
    cpdef tuple _take_sendable(self, double now)
    cpdef _write(self, tuple taken)
    @cython.locals(session=ClientSession, election=ReadElection)
    cpdef _await(self, Call call, _Slot slot)
    cpdef _wait_slot(self, Call call, _Slot slot)
    @cython.locals(ev=object, done=Done, slot=_Slot)
    cpdef _process(self, object events)
    @cython.locals(session=ClientSession, reader=_Reader)
    cpdef object _read_once(self, _Reader reader, double now)
    cpdef _lone(self, _Reader reader, Call call, _Slot slot, double now)
    cpdef _lead(self, Call call, _Slot slot)
    cpdef object _lead_read(self, _Reader reader, Call call, _Slot slot, double now)
    cpdef bint _handle(self, list events)
