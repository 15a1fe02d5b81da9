"""Unit tests for tensorshare.client.election: who reads the blocking client's socket.

No sockets, no threads, no clock: each test plays the events the client's threads would (a
caller starts waiting, asks for its turn, leads, stops; the reader thread asks what to do,
polls, reads; connections come and go) with the time passed in, and checks the decisions.
``A`` and ``B`` stand for two caller threads.
"""

from __future__ import annotations

import random

import pytest

from tensorshare.client.election import (
    LINGER,
    Caller,
    Link,
    ReadElection,
    ReaderDo,
    ReaderTurn,
    Reading,
)

A, B = "caller A", "caller B"
T0 = 100.0  # an arbitrary monotonic time


def sleep(until: float | None) -> ReaderTurn:
    return ReaderTurn(ReaderDo.SLEEP, until)


READ = ReaderTurn(ReaderDo.READ)


def connected(now: float = T0) -> ReadElection:
    """An election on a connection whose handshake is done, that the reader thread last read
    long ago (nobody waits, nobody reads)."""
    e = ReadElection()
    e.connection_made()
    assert e.reader_turn(now - 1.0, ready=False) == READ  # the handshake
    read_once(e)
    return e


def read_once(e: ReadElection) -> None:
    """The reader thread's poll() returns and it reads what came."""
    e.poll_returned()
    e.reader_done()


def lead(e: ReadElection, me: str, now: float) -> None:
    """``me`` starts waiting and takes the lead."""
    e.caller_waits()
    assert e.caller_turn(me, now, ready=True) is Caller.LEAD
    assert e.reading is Reading.CALLER


# -- a lone caller reads its own reply ----------------------------------------------------------
def test_a_lone_caller_reads_its_own_reply_when_nobody_reads() -> None:
    e = connected()
    e.caller_waits()
    assert e.caller_turn(A, T0, ready=True) is Caller.LEAD
    assert e.reading is Reading.CALLER
    assert e.lead_ended(T0 + 0.0001) is False  # a short call: the reader is not woken
    assert e.caller_done(A) is False
    assert (e.reading, e.waiting) == (Reading.NOBODY, 0)


def test_back_to_back_calls_lead_one_after_another_and_never_wake_the_reader() -> None:
    e = connected()
    now = T0
    for _ in range(1000):
        e.caller_waits()
        assert e.caller_turn(A, now, ready=True) is Caller.LEAD
        now += 0.0002
        assert e.lead_ended(now) is False
        assert e.caller_done(A) is False
        now += 0.00001


def test_a_caller_does_not_lead_during_the_handshake_or_without_a_connection() -> None:
    e = ReadElection()
    e.caller_waits()
    assert e.caller_turn(A, T0, ready=True) is Caller.WAIT_SLOT  # no connection yet
    e.connection_made()
    assert e.caller_turn(A, T0, ready=False) is Caller.WAIT_SLOT  # handshake under way
    assert e.reading is Reading.NOBODY


def test_a_caller_does_not_lead_when_others_wait_too() -> None:
    e = connected()
    e.caller_waits()
    e.caller_waits()
    assert e.caller_turn(A, T0, ready=True) is Caller.WAIT_SLOT
    assert e.caller_turn(B, T0, ready=True) is Caller.WAIT_SLOT
    assert e.reader_turn(T0, ready=True) == READ  # the reader thread hands replies over


def test_while_a_caller_leads_a_second_caller_waits_on_its_slot() -> None:
    e = connected()
    lead(e, A, T0)
    e.caller_waits()
    assert e.caller_turn(B, T0, ready=True) is Caller.WAIT_SLOT
    # A reads B's reply too if it comes first; when A is done, the reader takes over.
    assert e.lead_ended(T0 + 0.001) is True  # others wait: wake the reader
    assert e.caller_done(A) is False
    assert e.caller_turn(B, T0 + 0.001, ready=True) is Caller.LEAD  # or B, alone now


def test_a_caller_that_finds_nobody_waiting_or_reading_leads_in_one_step() -> None:
    e = connected()
    assert e.lone_lead(T0, ready=True) is True
    assert (e.reading, e.waiting) == (Reading.CALLER, 1)
    e.caller_waits()  # another caller meanwhile: it waits on its slot (A reads its reply)
    assert e.caller_turn(B, T0, ready=True) is Caller.WAIT_SLOT
    assert e.lone_lead(T0, ready=True) is False  # nor can a third lead
    assert e.lone_done(T0 + 0.0001) is True  # B still waits: wake the reader
    assert (e.reading, e.waiting) == (Reading.NOBODY, 1)
    assert e.caller_turn(B, T0 + 0.0001, ready=True) is Caller.LEAD  # alone now
    assert e.lead_ended(T0 + 0.0002) is False and e.caller_done(B) is False
    assert e.lone_lead(T0 + 0.0003, ready=True) is True
    assert e.lone_done(T0 + 0.0004) is False  # a short lone lead: the reader is not woken
    assert e.lone_lead(T0 + 1.0, ready=True) is True
    assert e.lone_done(T0 + 1.1) is True  # a long one: it is
    assert (e.reading, e.waiting) == (Reading.NOBODY, 0)


def test_a_lone_lead_is_refused_unless_nobody_waits_or_reads_on_a_ready_connection() -> None:
    e = ReadElection()
    assert e.lone_lead(T0, ready=True) is False  # no connection yet
    e.connection_made()
    assert e.lone_lead(T0, ready=False) is False  # handshake under way
    assert e.reader_turn(T0, ready=False) == READ  # the reader reads the handshake
    read_once(e)
    e.caller_waits()
    assert e.lone_lead(T0, ready=True) is False  # someone waits already
    e.caller_done(A)
    assert e.reader_turn(T0 + 1.0, ready=True) == READ  # the reader polls
    assert e.lone_lead(T0 + 1.0, ready=True) is False
    read_once(e)
    assert e.lone_lead(T0 + 1.0, ready=True) is True
    assert e.lone_done(T0 + 1.0, "reset by peer") is True  # it saw the connection end
    assert e.link is Link.BROKEN and e.waiting == 0
    assert e.lone_lead(T0 + 1.0, ready=True) is False


# -- the reader thread parks while a caller leads -----------------------------------------------
def test_the_reader_looks_again_within_linger_during_a_short_lead() -> None:
    e = connected()
    lead(e, A, T0)
    assert e.reader_turn(T0 + 0.001, ready=True) == sleep(T0 + 0.001 + LINGER)


def test_after_a_short_lead_the_reader_is_not_woken_and_reads_after_linger() -> None:
    e = connected()
    lead(e, A, T0)
    end = T0 + LINGER / 2
    assert e.lead_ended(end) is False
    e.caller_done(A)
    # Back-to-back calls may come: it sleeps until LINGER after the lead, then reads.
    assert e.reader_turn(end + 0.001, ready=True) == sleep(end + LINGER)
    assert e.reader_turn(end + LINGER, ready=True) == READ
    assert e.reading is Reading.READER_POLLS


def test_a_long_lead_makes_the_reader_sleep_without_a_deadline_until_woken() -> None:
    e = connected()
    lead(e, A, T0)  # a waiting get
    assert e.reader_turn(T0 + 0.001, ready=True) == sleep(T0 + 0.001 + LINGER)
    # Past LINGER the lead is a long one: no more looks (an idle client uses no CPU).
    assert e.reader_turn(T0 + 0.001 + LINGER, ready=True) == sleep(None)
    assert e.reader_turn(T0 + 30.0, ready=True) == sleep(None)
    # The caller wakes it when done; it then reads (nobody led within LINGER since).
    assert e.lead_ended(T0 + 30.0) is True
    e.caller_done(A)
    assert e.reader_turn(T0 + 30.0 + LINGER, ready=True) == READ


def test_a_short_lead_does_not_wake_the_reader_a_long_one_does() -> None:
    e = connected()
    lead(e, A, T0)
    assert e.lead_ended(T0 + LINGER) is False  # exactly LINGER is still short
    e.caller_done(A)
    lead(e, A, T0 + 1.0)
    assert e.lead_ended(T0 + 1.0 + LINGER * 1.01) is True


# -- the reader thread reads --------------------------------------------------------------------
def test_the_reader_reads_when_nobody_waits_for_linger() -> None:
    e = connected()
    lead(e, A, T0)
    e.lead_ended(T0 + 0.001)
    e.caller_done(A)
    assert e.reader_turn(T0 + 0.002, ready=True) == sleep(T0 + 0.001 + LINGER)
    assert e.reader_turn(T0 + 0.001 + LINGER, ready=True) == READ


def test_the_reader_reads_a_handshake_whoever_waits() -> None:
    e = ReadElection()
    e.connection_made()
    e.caller_waits()  # a call made while connecting
    assert e.reader_turn(T0, ready=False) == READ


def test_the_reader_reads_when_a_lone_caller_did_not_take_the_lead_within_linger() -> None:
    # A caller called while the client reconnected and waits on its slot: once connected
    # the reader reads for it, after at most LINGER, and without spinning on a zero wait.
    e = connected()
    lead(e, A, T0)
    e.lead_ended(T0 + 0.001)
    e.caller_done(A)
    e.caller_waits()  # B calls; it will look again only in CHECK_BACK
    turn = e.reader_turn(T0 + 0.002, ready=True)
    assert turn.do is ReaderDo.SLEEP and turn.until is not None and turn.until > T0 + 0.002
    assert e.reader_turn(T0 + 0.001 + LINGER, ready=True) == READ


def test_with_several_callers_waiting_the_reader_reads_at_once() -> None:
    e = connected()
    lead(e, A, T0)
    e.lead_ended(T0 + 0.0001)
    e.caller_done(A)
    e.caller_waits()
    e.caller_waits()
    assert e.reader_turn(T0 + 0.0002, ready=True) == READ  # no LINGER to wait out


def test_reader_sleeps_never_end_in_the_past() -> None:
    # A sleep that ends at once is a spin: every SLEEP the reader is told ends after now, or
    # only when woken. Random event sequences, time moving forward.
    for seed in range(200):
        rng = random.Random(seed)
        e = connected()
        now = T0
        callers: list[str] = []
        leader: str | None = None
        for _ in range(200):
            now += rng.choice([0.0, 0.0001, 0.001, LINGER, 0.02, 1.0])
            ready = rng.random() < 0.9
            step = rng.randrange(6)
            if step == 0 and len(callers) < 3:
                callers.append(f"c{len(callers)}")
                e.caller_waits()
            elif step == 1 and callers and leader is None:
                me = rng.choice(callers)
                turn = e.caller_turn(me, now, ready)
                if turn is Caller.LEAD:
                    assert e.waiting == 1 and ready
                    leader = me
            elif step == 2 and leader is not None:
                e.lead_ended(now, None)
                leader = None
            elif step == 3 and callers and leader is None:
                e.caller_done(callers.pop())
            elif e.reading in (Reading.NOBODY, Reading.CALLER):
                turn = e.reader_turn(now, ready)
                assert turn.do is not ReaderDo.STOP
                if turn.do is ReaderDo.SLEEP:
                    assert turn.until is None or turn.until > now, (seed, e, turn)
                    assert turn.until is not None or e.reading is Reading.CALLER
                else:
                    assert leader is None and (not ready or e.waiting != 1 or
                                               e.asked_by is None)
            else:
                read_once(e)
            assert e.waiting == len(callers)


# -- a lone caller asks the reader thread to step aside -----------------------------------------
def test_a_lone_caller_asks_a_polling_reader_to_step_aside_and_leads_next() -> None:
    e = connected()
    assert e.reader_turn(T0, ready=True) == READ  # nobody waits: the reader polls
    e.caller_waits()
    assert e.caller_turn(A, T0, ready=True) is Caller.WAKE_AND_WAIT  # interrupt its poll()
    assert e.asked_by == A
    read_once(e)  # poll() returns (the wake pipe), the reader gives the lead back
    # The reader leaves the turn to A (it looks again within LINGER, not at once) ...
    assert e.reader_turn(T0 + 0.0001, ready=True) == sleep(T0 + 0.0001 + LINGER)
    assert e.reading is Reading.NOBODY
    # ... and A leads.
    assert e.caller_turn(A, T0 + 0.0002, ready=True) is Caller.LEAD
    assert e.asked_by is None
    assert e.lead_ended(T0 + 0.0003) is False
    assert e.caller_done(A) is False


def test_a_reader_that_is_already_reading_is_not_woken_again() -> None:
    e = connected()
    assert e.reader_turn(T0, ready=True) == READ
    e.poll_returned()  # data came: it reads
    e.caller_waits()
    assert e.caller_turn(A, T0, ready=True) is Caller.WAIT  # asked; no wake-up needed
    assert e.asked_by == A
    e.reader_done()
    assert e.caller_turn(A, T0, ready=True) is Caller.LEAD


def test_a_caller_that_asked_and_finished_without_leading_lets_the_reader_read() -> None:
    e = connected()
    assert e.reader_turn(T0, ready=True) == READ
    e.caller_waits()
    assert e.caller_turn(A, T0, ready=True) is Caller.WAKE_AND_WAIT
    read_once(e)  # the reader read A's reply on its way out
    assert e.caller_done(A) is True  # wake the reader: nobody will take the turn it left
    assert e.asked_by is None
    assert e.reader_turn(T0 + 1.0, ready=True) == READ


def test_with_several_callers_the_reader_reads_even_if_one_asked_it_to_step_aside() -> None:
    e = connected()
    assert e.reader_turn(T0, ready=True) == READ
    e.caller_waits()
    assert e.caller_turn(A, T0, ready=True) is Caller.WAKE_AND_WAIT
    e.caller_waits()  # B arrives before A leads
    read_once(e)
    assert e.caller_turn(A, T0, ready=True) is Caller.WAIT_SLOT
    assert e.reader_turn(T0, ready=True) == READ


def test_a_request_to_step_aside_is_forgotten_when_the_connection_ends() -> None:
    # A lone caller asked just as the connection dropped: the reader reads the next
    # handshake (and then every reply) instead of waiting for that caller to lead, and the
    # caller, waiting for the handshake, gets its reply (or SessionLost) from the reader.
    e = connected()
    assert e.reader_turn(T0, ready=True) == READ
    e.caller_waits()
    assert e.caller_turn(A, T0, ready=True) is Caller.WAKE_AND_WAIT
    read_once(e)  # it read the end of the connection
    assert e.end_connection() is True
    assert e.asked_by is None and e.link is Link.DOWN
    assert e.caller_turn(A, T0, ready=False) is Caller.WAIT_SLOT  # reconnecting
    e.connection_made()
    assert e.reader_turn(T0 + 0.1, ready=False) == READ  # the handshake
    read_once(e)
    # Handshake done, A still waits alone but never led: the reader reads for it.
    assert e.reader_turn(T0 + 0.2, ready=True) == READ
    assert e.caller_done(A) is False  # its request went with the old connection


def test_a_request_to_step_aside_never_blocks_reading_a_handshake() -> None:
    e = connected()
    assert e.reader_turn(T0, ready=True) == READ
    e.caller_waits()
    assert e.caller_turn(A, T0, ready=True) is Caller.WAKE_AND_WAIT
    read_once(e)
    # Even with the request still standing, a handshake under way is the reader's to read.
    assert e.reader_turn(T0, ready=False) == READ


# -- the connection ends ------------------------------------------------------------------------
def test_a_leading_caller_that_sees_the_connection_end_stops_the_reader() -> None:
    e = connected()
    lead(e, A, T0)
    assert e.reader_turn(T0 + 0.001, ready=True).do is ReaderDo.SLEEP
    assert e.lead_ended(T0 + 0.002, "the server closed the connection") is True
    assert e.link is Link.BROKEN
    assert e.reader_turn(T0 + 0.002, ready=True) == ReaderTurn(
        ReaderDo.STOP, reason="the server closed the connection")
    # Nobody leads a broken connection; the reader ends it.
    assert e.caller_turn(A, T0 + 0.003, ready=True) is Caller.WAIT_SLOT
    assert e.end_connection() is True
    assert e.link is Link.DOWN and e.broken == ""
    e.connection_made()
    assert e.reader_turn(T0 + 0.1, ready=False) == READ


def test_the_first_reason_a_connection_broke_is_kept() -> None:
    e = connected()
    lead(e, A, T0)
    e.lead_ended(T0, "reset")
    e.caller_done(A)
    e.caller_waits()
    assert e.caller_turn(A, T0, ready=True) is Caller.WAIT_SLOT
    assert e.reader_turn(T0, ready=True).reason == "reset"


def test_the_connection_ends_only_once_no_caller_reads_it() -> None:
    e = connected()
    lead(e, A, T0)
    assert e.end_connection() is False  # A still reads it: wait for its lead to end
    assert e.link is Link.UP and e.reading is Reading.CALLER
    e.lead_ended(T0 + 0.01, "closed")
    assert e.end_connection() is True


def test_a_connection_ends_while_the_reader_leads() -> None:
    e = connected()
    assert e.reader_turn(T0, ready=True) == READ
    read_once(e)  # it read the end of the connection
    assert e.end_connection() is True
    assert (e.reading, e.link) == (Reading.NOBODY, Link.DOWN)


# -- misuse is caught ---------------------------------------------------------------------------
def test_events_out_of_order_are_refused() -> None:
    e = connected()
    with pytest.raises(AssertionError):
        e.lead_ended(T0)  # nobody leads
    with pytest.raises(AssertionError):
        e.poll_returned()  # the reader is not polling
    with pytest.raises(AssertionError):
        e.connection_made()  # there is one already
    assert e.reader_turn(T0, ready=True) == READ
    with pytest.raises(AssertionError):
        e.reader_turn(T0, ready=True)  # it reads already
