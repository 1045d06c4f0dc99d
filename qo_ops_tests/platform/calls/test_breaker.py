"""The circuit breaker's rules, on their own (the token bucket's: test_ratelimit.py); the
jobs that use them are tested against the real simulator in
qo_ops_tests/jobs/test_downstream_manners.py.

Tests ``qo_ops.platform.calls.breaker``.
"""

from __future__ import annotations

import threading

import pytest

from qo_ops.platform.calls.breaker import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    BreakerSettings,
    CircuitBreaker,
    Evidence,
    SharedState,
)


def fail(breaker: CircuitBreaker, code: str = "connect_error") -> None:
    ticket = breaker.allow()
    assert ticket is not None
    breaker.failed(ticket, code)


def answer(breaker: CircuitBreaker) -> None:
    ticket = breaker.allow()
    assert ticket is not None
    breaker.succeeded(ticket)


def test_ten_failures_in_a_row_open_it_and_an_open_breaker_lets_nothing_through():
    breaker = CircuitBreaker()
    for _ in range(9):
        fail(breaker)
    assert breaker.state == CLOSED
    fail(breaker)
    assert breaker.state == OPEN
    assert [t.to for t in breaker.drain()] == [OPEN]
    assert breaker.allow() is None and breaker.refused == 1


def test_a_quarter_failing_at_random_keeps_it_closed_but_most_of_the_window_opens_it():
    breaker = CircuitBreaker()
    for i in range(1000):  # every fourth call fails: flaky, not down
        fail(breaker, "http_503") if i % 4 == 0 else answer(breaker)
    assert breaker.state == CLOSED and breaker.up()
    for i in range(50):  # two of three fail: 60 % of the window
        fail(breaker, "http_503") if i % 3 else answer(breaker)
        if breaker.state == OPEN:
            break
    assert breaker.state == OPEN
    assert breaker.drain()[-1].reason.startswith("http_503 ")


def test_a_429_is_neither_success_nor_failure():
    breaker = CircuitBreaker(BreakerSettings(streak=3))
    for _ in range(2):
        fail(breaker, "timeout")
    ticket = breaker.allow()
    assert ticket is not None
    breaker.neutral(ticket)  # does not end the streak
    fail(breaker, "timeout")
    assert breaker.state == OPEN


def test_a_batchs_slow_tail_finishing_together_does_not_open_it():
    """256 calls start in order; every tenth times out. The fast answers come first, the 26
    timeouts last and together (as at concurrency 32-64): in completion order a streak of 26,
    in start order never more than one in a row. The breaker judges by start."""
    breaker = CircuitBreaker()
    tickets = [breaker.allow() for _ in range(256)]
    slow = [t for i, t in enumerate(tickets) if i % 10 == 9]
    for ticket in tickets:
        if ticket not in slow:
            assert ticket is not None
            breaker.succeeded(ticket)
    for ticket in slow:  # the tail: 26 timeouts in a row as they complete
        assert ticket is not None
        breaker.failed(ticket, "timeout")
    assert breaker.state == CLOSED and breaker.drain() == []
    assert breaker.up()


def test_the_tail_planted_in_completion_order_would_open_a_breaker_counting_completions():
    """The planted case above is a real trap: fed to the breaker in completion order (each
    call started only as the previous answered), the same 26 timeouts open it."""
    breaker = CircuitBreaker()
    for _ in range(230):
        answer(breaker)
    for _ in range(10):
        fail(breaker, "timeout")
    assert breaker.state == OPEN


def test_an_outage_of_timeouts_answering_together_opens_it_at_the_tenth():
    """Every call times out: 32 start at once and fail together; it opens at the tenth in
    start order, and the other 22 already in flight do not open it again."""
    breaker = CircuitBreaker()
    tickets = [breaker.allow() for _ in range(32)]
    for ticket in reversed(tickets):  # answers in any order: the evidence waits for order
        assert ticket is not None
        breaker.failed(ticket, "timeout")
    assert breaker.state == OPEN and breaker.opened == 1
    assert [t.reason for t in breaker.drain()] == ["timeout 10_in_a_row"]


def test_the_evidence_is_in_start_order_whatever_order_the_answers_come_in():
    """Four calls answer 2nd, 4th, 3rd, 1st: the evidence reads in the order they started,
    and a success that started between two failures ends their row however late it came."""
    breaker = CircuitBreaker(BreakerSettings(streak=3))
    a, b, c, d = (breaker.allow() for _ in range(4))
    assert None not in (a, b, c, d)
    breaker.failed(b, "http_503")  # type: ignore[arg-type]
    breaker.failed(d, "http_503")  # type: ignore[arg-type]
    assert breaker.take_added() == ""  # the first call is still in flight
    breaker.succeeded(c)  # type: ignore[arg-type]
    breaker.failed(a, "http_503")  # type: ignore[arg-type]
    assert breaker.state == CLOSED  # F F S F by start: never three in a row
    assert breaker.take_added() == "FFSF"


def test_a_row_of_failures_counts_through_calls_still_in_flight():
    """An outage of timeouts answering out of order opens it at the tenth failure answered,
    not only once the slowest earlier call has answered too."""
    breaker = CircuitBreaker(BreakerSettings(streak=3))
    first, *later = (breaker.allow() for _ in range(4))
    for ticket in later:
        assert ticket is not None
        breaker.failed(ticket, "timeout")
    assert breaker.state == OPEN  # three failures, the first call still in flight
    assert breaker.drain()[-1].reason == "timeout 3_in_a_row"


def test_fast_failures_answering_ahead_of_slower_successes_do_not_open_it():
    """A flaky downstream answers its 503s at once and its deliveries after their work: at
    concurrency 64 the answers in hand are mostly failures while the successes are still in
    flight. Thirteen 503s answered ahead of 51 pending calls are not a row."""
    breaker = CircuitBreaker()
    tickets = [breaker.allow() for _ in range(64)]
    fast = [t for i, t in enumerate(tickets) if i % 5 == 2]  # 13 of 64
    for ticket in fast:
        assert ticket is not None
        breaker.failed(ticket, "http_503")
    assert breaker.state == CLOSED
    for ticket in tickets:
        if ticket not in fast:
            assert ticket is not None
            breaker.succeeded(ticket)
    assert breaker.state == CLOSED and breaker.up()


@pytest.mark.parametrize(("first", "opens"), [(True, True), (False, False)])
def test_a_new_call_waits_while_failures_ahead_of_a_call_in_flight_would_make_the_row(first, opens):
    """One 503 known, nine more answered ahead of a call still in flight: the next call
    waits for it. It fails: the row is made, the breaker opens and the waiting call is
    refused (no more sent than had the answers come in order); it succeeds: no row, and the
    waiting call goes."""
    breaker = CircuitBreaker()
    fail(breaker, "http_503")
    tickets = [breaker.allow() for _ in range(10)]
    assert None not in tickets
    for ticket in tickets[1:]:
        breaker.failed(ticket, "http_503")  # type: ignore[arg-type]
    assert breaker.state == CLOSED
    got: list[int | None] = []
    waiting = threading.Thread(target=lambda: got.append(breaker.allow()))
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive() and got == []  # held until the first call is known
    if first:
        breaker.failed(tickets[0], "http_503")  # type: ignore[arg-type]
    else:
        breaker.succeeded(tickets[0])  # type: ignore[arg-type]
    waiting.join(5)
    assert (breaker.state == OPEN) is opens
    assert (got == [None]) is opens


def test_the_shared_evidence_is_where_a_run_starts():
    """A run whose batch starts after eight failures of other runs opens it at its second."""
    breaker = CircuitBreaker()
    breaker.sync(SharedState(CLOSED, recent="S" * 30 + "F" * 8))
    fail(breaker)
    assert breaker.state == CLOSED
    fail(breaker)
    assert breaker.state == OPEN
    assert breaker.drain()[-1].reason == "connect_error 10_in_a_row"


def test_up_needs_enough_calls_and_no_outage():
    settings = BreakerSettings()
    assert not Evidence.from_text("S" * 29, settings).up()  # too few to judge
    assert Evidence.from_text("S" * 30, settings).up()
    assert Evidence.from_text("S" * 21 + "F" * 9, settings).up()
    assert not Evidence.from_text("S" * 40 + "F" * 10, settings).up()  # 10 in a row
    assert not Evidence.from_text("SF" * 5 + "SFF" * 10, settings).up()  # 25 of 40
    assert Evidence.from_text("SF" * 5 + "SFF" * 10, settings).down() == "25/40"


def test_another_runs_opening_stops_this_run_without_counting_as_its_own():
    breaker = CircuitBreaker()
    breaker.sync(SharedState(OPEN, probe_due=False))
    assert breaker.state == OPEN and breaker.opened == 0 and breaker.drain() == []
    assert breaker.allow() is None
    breaker.sync(SharedState(OPEN, probe_due=True))
    assert breaker.state == HALF_OPEN
    assert [t.to for t in breaker.drain()] == [HALF_OPEN]


def test_half_open_probes_one_at_a_time_and_closes_after_the_probes_answer():
    breaker = CircuitBreaker(BreakerSettings(probes=3))
    breaker.state = OPEN
    breaker.half_open()
    assert breaker.state == HALF_OPEN
    first = breaker.allow()  # the first probe
    assert first is not None
    waiting = threading.Event()
    let_in: list[int | None] = []

    def second() -> None:
        waiting.set()
        let_in.append(breaker.allow())  # waits for the first probe's answer

    t = threading.Thread(target=second)
    t.start()
    waiting.wait(5)
    t.join(0.2)
    assert t.is_alive() and not let_in  # still waiting: one probe at a time
    breaker.succeeded(first)
    t.join(5)
    assert len(let_in) == 1 and let_in[0] is not None
    breaker.succeeded(let_in[0])
    answer(breaker)
    assert breaker.state == CLOSED
    assert [t.to for t in breaker.drain()] == [HALF_OPEN, CLOSED]


def test_a_failed_probe_opens_it_again_and_the_waiting_callers_are_refused():
    breaker = CircuitBreaker()
    breaker.state = OPEN
    breaker.half_open()
    probe = breaker.allow()
    assert probe is not None
    stop = threading.Event()
    answers: list[int | None] = []
    t = threading.Thread(target=lambda: answers.append(breaker.allow(stop)))
    t.start()
    breaker.failed(probe, "connect_error")
    t.join(5)
    assert answers == [None] and breaker.state == OPEN
    assert breaker.opened == 1


def test_a_caller_waiting_for_a_probe_gives_up_when_the_run_stops():
    breaker = CircuitBreaker()
    breaker.state = OPEN
    breaker.half_open()
    assert breaker.allow() is not None
    stop = threading.Event()
    stop.set()
    assert breaker.allow(stop) is None


def test_a_sync_while_calls_are_in_flight_keeps_what_this_run_has_not_written():
    """Overlapped batches take up the shared row (at the next claim) before the last batch's
    record wrote this run's outcomes and transitions. The row is older than them: the run
    keeps its unwritten outcomes in its evidence, and its unwritten opening."""
    breaker = CircuitBreaker()
    for _ in range(6):
        fail(breaker)
    breaker.sync(SharedState(CLOSED, recent="FFF"))  # the row: three failures, not this run's six
    assert breaker.evidence.streak == 9
    fail(breaker)  # the tenth in a row, counting the row's and this run's
    assert breaker.state == OPEN
    breaker.sync(SharedState(CLOSED, recent="SSSS"))  # the row does not say open yet
    assert breaker.state == OPEN and breaker.allow() is None
    assert [t.to for t in breaker.drain()] == [OPEN]  # the record writes it …
    breaker.sync(SharedState(CLOSED, recent="SSSS"))  # … and a later row is taken up as before
    assert breaker.state == CLOSED and breaker.evidence.text() == "SSSS"
