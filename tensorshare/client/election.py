"""Who reads the blocking client's socket: the read election, as a state machine.

The blocking :class:`~tensorshare.client.blocking.Client` has a reader thread, and any number
of caller threads waiting for replies. Exactly one thread reads the socket at a time (it
*leads*) and hands every reply it reads to the thread waiting for it. Who that is:

* A caller that is the **only** one waiting reads its own reply: no thread handoff per
  request (a handoff costs more than the whole request on a small machine).
* The reader thread parks while a caller leads. After a caller's *short* lead it looks again
  by itself within :data:`LINGER`: it is not woken at the end of every call (a wake-up per
  request costs more than the request). During a caller's *long* lead (a waiting get,
  ``await_new_parameters``: longer than ``LINGER``) it sleeps until that caller wakes it when
  done, so an idle client waiting on the server uses no CPU.
* With several callers waiting, or none for ``LINGER``, or during the handshake, the reader
  thread reads and hands replies over. So it does when a lone caller did not take the lead
  within ``LINGER`` (it called while the client reconnected, say, and waits on its slot).
* A lone caller that finds the reader thread reading asks it to step aside (and wakes its
  ``poll()``); the caller that asked leads next. A request to step aside is about one
  connection: forgotten when the connection ends, and it never keeps the reader from reading
  a handshake.
* A leading caller that sees the connection end records why; the reader thread then stops.

:class:`ReadElection` holds that state and decides; it touches no socket, thread, lock or
clock. The client calls it holding its lock, passes the time in, and does what each
decision says (reads, waits, wakes the reader thread, sleeps). The tests drive it with time
passed in, like :class:`~tensorshare.client.session.ClientSession`.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from typing import NamedTuple

__all__ = ["CHECK_BACK", "LINGER", "Caller", "Link", "ReadElection", "ReaderDo", "ReaderTurn",
           "Reading"]

# How long the reader thread stays parked after a caller read its own reply: calls made back
# to back never wake it; a change notification arriving between two calls waits at most this
# long (a caller that is reading handles them at once). A caller's lead longer than this is a
# long one: the reader sleeps through it until woken.
LINGER = 0.005
# How often a caller that does not lead looks again (it may lead later: once a reconnect
# completes, or when the other waiting callers are done).
CHECK_BACK = 0.05


class Reading(enum.Enum):
    """Who reads the socket now."""

    NOBODY = "nobody reads"
    READER_POLLS = "the reader thread waits in poll() (the wake pipe interrupts it)"
    READER_READS = "the reader thread reads what poll() found"
    CALLER = "a caller reads (its own reply, and any other that comes)"


class Link(enum.Enum):
    """The connection, as far as reading it goes."""

    DOWN = "no connection (connecting, or between connections)"
    UP = "a connection to read (its handshake may still be under way)"
    BROKEN = "a leading caller saw the connection end; the reader thread ends it"


class Caller(enum.Enum):
    """What a waiting caller must do next (then ask again, unless its reply is in)."""

    LEAD = "read the socket yourself until your reply is in, then call lead_ended"
    WAKE_AND_WAIT = ("you asked the reader thread to step aside: interrupt its poll() "
                     "(the wake pipe), then wait on the condition for up to CHECK_BACK")
    WAIT = ("you asked the reader thread to step aside; it is reading already: wait on the "
            "condition for up to CHECK_BACK")
    WAIT_SLOT = "wait on your slot for up to CHECK_BACK (or until your deadline)"


class ReaderDo(enum.Enum):
    READ = "poll and read the socket (poll_returned, then reader_done)"
    SLEEP = "sleep on the condition until `until` (None: until woken), then ask again"
    STOP = "the connection broke (`reason`): end it"


class ReaderTurn(NamedTuple):
    """What the reader thread must do next."""

    do: ReaderDo
    until: float | None = None  # SLEEP: look again by then; None: only when woken
    reason: str = ""  # STOP: why the connection ended


# The states, as module constants (an enum member read from its class is an attribute
# lookup through the enum's metaclass, on every call).
_NOBODY = Reading.NOBODY
_POLLS = Reading.READER_POLLS
_READS = Reading.READER_READS
_CALLER = Reading.CALLER
_DOWN = Link.DOWN
_UP = Link.UP
_BROKEN = Link.BROKEN
READ = ReaderTurn(ReaderDo.READ)
SLEEP_UNTIL_WOKEN = ReaderTurn(ReaderDo.SLEEP)


class ReadElection:
    """Which thread reads the socket, decided from events (all called under the client's
    lock; ``now`` from a monotonic clock; ``ready``: the session's handshake completed on
    the current connection).

    Callers: :meth:`caller_waits`, then :meth:`caller_turn` until the reply is in
    (:meth:`lead_ended` after each lead), then :meth:`caller_done`; or, for a caller that
    finds nobody else waiting, :meth:`lone_lead` then :meth:`lone_done` around its lead.
    The reader thread: :meth:`connection_made`; :meth:`reader_turn` (after ``READ``:
    :meth:`poll_returned`, then :meth:`reader_done`) until ``STOP`` or the connection ends;
    :meth:`end_connection`.
    """

    __slots__ = ("linger", "reading", "link", "waiting", "asked_by", "last_exit", "lead_start",
                 "broken")

    def __init__(self, linger: float = LINGER) -> None:
        self.linger = linger
        self.reading = _NOBODY
        self.link = _DOWN
        self.waiting = 0  # callers waiting for a reply
        self.asked_by: Hashable | None = None  # the lone caller that asked the reader to step aside
        self.last_exit = float("-inf")  # when a caller last stopped leading
        self.lead_start = 0.0  # when the current (or last) lead began
        self.broken = ""  # _BROKEN: why

    def __repr__(self) -> str:
        return (f"<ReadElection {self.reading.name} {self.link.name} waiting={self.waiting} "
                f"asked_by={self.asked_by!r}>")

    # -- callers ------------------------------------------------------------------------------
    def caller_waits(self) -> None:
        """A caller starts waiting for a reply."""
        self.waiting += 1

    def caller_turn(self, me: Hashable, now: float, ready: bool) -> Caller:
        """A waiting caller (``me``: its thread) asks what to do; its reply is not in yet.

        A lone caller on a connection that is up and ready leads when nobody reads, and asks
        the reader thread to step aside when it reads. Otherwise it waits on its slot.
        """
        if self.waiting == 1 and ready and self.link is _UP:
            reading = self.reading
            if reading is _NOBODY:
                self.reading = _CALLER
                self.asked_by = None
                self.lead_start = now
                return Caller.LEAD
            if reading is _POLLS:
                self.asked_by = me  # until this caller leads, is done, or the connection ends
                return Caller.WAKE_AND_WAIT
            if reading is _READS:
                self.asked_by = me
                return Caller.WAIT
        return Caller.WAIT_SLOT

    def lone_lead(self, now: float, ready: bool) -> bool:
        """A caller about to send asks to lead at once: when nobody waits or reads and the
        connection is up and ready, it counts as waiting and leads (what
        :meth:`caller_waits` then :meth:`caller_turn`'s ``LEAD`` do, in one step) and says
        True; it then reads and ends with :meth:`lone_done`. Otherwise False, and nothing
        changed: it waits the usual way."""
        if self.waiting or self.reading is not _NOBODY or not ready or \
                self.link is not _UP:
            return False
        self.waiting = 1
        self.reading = _CALLER
        self.asked_by = None
        self.lead_start = now
        return True

    def lone_done(self, now: float, broken: str | None = None) -> bool:
        """The lone lead of :meth:`lone_lead` ends (:meth:`lead_ended`, then
        :meth:`caller_done`: nobody asked the reader to step aside meanwhile, since this
        caller was waiting). Returns whether to wake the reader thread."""
        wake = self.lead_ended(now, broken)
        self.waiting -= 1
        return wake

    def lead_ended(self, now: float, broken: str | None = None) -> bool:
        """The leading caller stops reading (its reply is in, its deadline passed, or it saw
        the connection end: ``broken`` says why). Returns whether to wake the reader thread:
        when the connection broke, when other callers wait, or after a long lead (the reader
        sleeps through those). After a short lead it looks again by itself within LINGER."""
        assert self.reading is _CALLER, self
        self.reading = _NOBODY
        self.last_exit = now
        if broken is not None and self.link is _UP:
            self.link = _BROKEN
            self.broken = broken
        return broken is not None or self.waiting > 1 or now - self.lead_start > self.linger

    def caller_done(self, me: Hashable) -> bool:
        """A caller stops waiting (its reply is in, or it gave up). Returns whether to wake
        the reader thread: this caller had asked it to step aside and never led, so it may
        read again."""
        self.waiting -= 1
        if self.asked_by is not None and self.asked_by == me:
            self.asked_by = None
            return True
        return False

    # -- the reader thread --------------------------------------------------------------------
    def connection_made(self) -> None:
        """The reader thread has a new connection (its handshake not done yet)."""
        assert self.link is _DOWN and self.reading is _NOBODY, self
        self.link = _UP

    def reader_turn(self, now: float, ready: bool) -> ReaderTurn:
        """The reader thread asks what to do: read now, sleep (until a time, or until woken),
        or stop because a leading caller saw the connection end."""
        assert self.reading is _NOBODY or self.reading is _CALLER, self
        if self.link is _BROKEN:
            return ReaderTurn(ReaderDo.STOP, reason=self.broken)
        ready = ready and self.link is _UP
        if self.reading is _NOBODY:
            if self.asked_by is not None and self.waiting == 1 and ready:
                # The lone caller that asked us to step aside leads next: leave it the turn.
                return ReaderTurn(ReaderDo.SLEEP, now + self.linger)
            resume = self.last_exit + self.linger
            if self.waiting > 1 or now >= resume or not ready:
                self.reading = _POLLS
                return READ
            return ReaderTurn(ReaderDo.SLEEP, resume)  # a lone caller may lead again by then
        if now - self.lead_start > self.linger:
            return SLEEP_UNTIL_WOKEN  # a long lead: the caller wakes us when it is done
        # A short lead: look again after LINGER rather than be woken at the end of every call.
        return ReaderTurn(ReaderDo.SLEEP, now + self.linger)

    def poll_returned(self) -> None:
        """The reader thread's poll() returned: it reads what came (no wake-up needed now)."""
        assert self.reading is _POLLS, self
        self.reading = _READS

    def reader_done(self) -> None:
        """The reader thread stops reading for now (the client then wakes the waiting
        callers: one that asked it to step aside leads next)."""
        assert self.reading is _READS, self
        self.reading = _NOBODY

    def end_connection(self) -> bool:
        """The reader thread is done with the connection. Returns False while a caller still
        reads it (wait until its lead ends, then call again); True once it is over: a request
        to step aside and a broken mark are about one connection and are forgotten."""
        if self.reading is _CALLER:
            return False
        self.reading = _NOBODY
        self.link = _DOWN
        self.asked_by = None
        self.broken = ""
        return True
