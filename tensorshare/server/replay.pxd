# Types for a compiled twin of replay.py (tensorshare.server.replay_c; see tensorshare._ext),
# ready for when the replay kind adds the module to TWINS. The .py stays the reference: this
# file only declares what Cython may type. (Counters are int64: from_state refuses larger.)
import cython
from libc.stdint cimport int64_t


@cython.final
cdef class SumTree:
    cdef public Py_ssize_t capacity
    cdef public double[::1] nodes

    cpdef double total(self)
    cpdef double value(self, Py_ssize_t slot)
    @cython.locals(nodes="double[::1]", i=Py_ssize_t)
    cpdef set(self, Py_ssize_t slot, double weight)
    @cython.locals(nodes="double[::1]", i=Py_ssize_t, capacity=Py_ssize_t, left=double)
    cpdef Py_ssize_t find(self, double target)
    @cython.locals(nodes="double[::1]", old="double[::1]", old_capacity=Py_ssize_t,
                   i=Py_ssize_t)
    cpdef grow(self, Py_ssize_t capacity)


@cython.final
cdef class ExtremeTree:
    cdef public Py_ssize_t capacity
    cdef public bint highest
    cdef public double[::1] priorities
    cdef public int64_t[::1] seqs, winners

    cpdef Py_ssize_t top(self)
    @cython.locals(pa=double, pb=double)
    cdef bint _beats(self, Py_ssize_t a, Py_ssize_t b)
    cdef Py_ssize_t _winner(self, Py_ssize_t a, Py_ssize_t b)
    @cython.locals(winners=int64_t[::1])
    cdef _climb(self, Py_ssize_t i)
    cpdef set(self, Py_ssize_t slot, double priority, int64_t seq)
    cpdef clear(self, Py_ssize_t slot)
    @cython.locals(old=Py_ssize_t, priorities="double[::1]", seqs=int64_t[::1],
                   winners=int64_t[::1], i=Py_ssize_t)
    cpdef grow(self, Py_ssize_t capacity)


@cython.final
cdef class RateLimiter:
    cdef public bint ratio
    cdef public double samples_per_insert, min_diff, max_diff
    cdef public int64_t min_size_to_sample, inserts, samples, deletes

    cpdef double diff(self)
    cpdef bint can_insert(self, Py_ssize_t count)
    cpdef bint can_sample(self, Py_ssize_t count)


@cython.final
@cython.freelist(256)
cdef class ReplayItem:
    cdef public int64_t key, nbytes, seq, times_sampled
    cdef public Py_ssize_t slot
    cdef public double priority
    cdef public object payload


@cython.final
cdef class ReplayTable:
    cdef public object config, _items, _rng
    cdef public RateLimiter limiter
    cdef public int _sampler, _remover
    cdef public double _alpha
    cdef public Py_ssize_t _max_size, _max_times, _capacity
    cdef public list _slots, _hist, released
    cdef public SumTree _sum
    cdef public ExtremeTree _high, _low
    cdef public int64_t _nbytes, _draws_left, _next_key, _seq
    cdef public int64_t _inserted, _sampled, _evicted, _expired, _deleted

    @cython.locals(item=ReplayItem, i=Py_ssize_t, count=Py_ssize_t, key=cython.longlong,
                   priority=double, weight=double, checked=list, keys=list)
    cpdef list insert(self, payloads, priorities, nbytes)
    @cython.locals(item=ReplayItem, removed=Py_ssize_t, max_times=Py_ssize_t, keys=list,
                   payloads=list, probabilities=list, sizes=list)
    cpdef sample(self, batch_size)
    @cython.locals(item=ReplayItem, i=Py_ssize_t, priority=double, weight=double,
                   skipped=Py_ssize_t, checked=list)
    cpdef update_priorities(self, keys, priorities)
    @cython.locals(code=int, slots=list, tree=SumTree, total=double, slot=Py_ssize_t,
                   size=Py_ssize_t)
    cdef ReplayItem _select(self, list probabilities)
    cdef ReplayItem _removers_choice(self)
    @cython.locals(slot=Py_ssize_t)
    cdef _place(self, ReplayItem item, double weight)
    cdef _set_slot(self, Py_ssize_t slot, ReplayItem item, double weight)
    @cython.locals(slots=list, last=ReplayItem, end=Py_ssize_t, slot=Py_ssize_t, weight=double)
    cdef _remove(self, ReplayItem item)


@cython.locals(p=double, weight=double)
cdef tuple _check_priority(object priority, double exponent)
@cython.locals(i=int, last=int)
cpdef int histogram_bucket(double priority)
@cython.locals(table=ReplayTable, item=ReplayItem, p=double, weight=double)
cdef ReplayTable _restore(cls, state, payloads)
cdef _restore_counters(ReplayTable table, state)
