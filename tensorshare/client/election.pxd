# Types for the compiled twin of election.py (tensorshare.client.election_c; see
# tensorshare._ext), and what other twins cimport of it.
import cython

cdef object _NOBODY, _POLLS, _READS, _CALLER, _DOWN, _UP, _BROKEN


@cython.final
cdef class ReadElection:
    cdef public double linger, last_exit, lead_start
    cdef public object reading, link, asked_by
    cdef public Py_ssize_t waiting
    cdef public str broken

    cpdef caller_waits(self)
    cpdef object caller_turn(self, object me, double now, bint ready)
    cpdef bint lone_lead(self, double now, bint ready)
    cpdef bint lone_done(self, double now, object broken=*)
    cpdef bint lead_ended(self, double now, object broken=*)
    cpdef bint caller_done(self, object me)
    cpdef object reader_turn(self, double now, bint ready)
    cpdef poll_returned(self)
    cpdef reader_done(self)
