"""The circuit breaker's and the token bucket's rules, on their own (the bucket on a fake
clock); the jobs that use them are tested against the real simulator in
qo_ops_tests/jobs/test_downstream_manners.py."""

from __future__ import annotations

import threading

import pytest

from qo_ops.platform.breaker import CLOSED, HALF_OPEN, OPEN, BreakerSettings, CircuitBreaker
from qo_ops.platform.ratelimit import TokenBucket


def test_ten_failures_in_a_row_open_it_and_an_open_breaker_lets_nothing_through():
    breaker = CircuitBreaker()
    for _ in range(9):
        assert breaker.allow()
        breaker.failed("connect_error")
    assert breaker.state == CLOSED
    breaker.failed("connect_error")
    assert breaker.state == OPEN
    assert [t.to for t in breaker.drain()] == [OPEN]
    assert not breaker.allow() and breaker.refused == 1


def test_a_quarter_failing_at_random_keeps_it_closed_but_most_of_the_window_opens_it():
    breaker = CircuitBreaker()
    for i in range(1000):  # every fourth call fails: flaky, not down
        breaker.failed("http_503") if i % 4 == 0 else breaker.succeeded()
    assert breaker.state == CLOSED
    for i in range(50):  # two of three fail: 60 % of the window
        breaker.failed("http_503") if i % 3 else breaker.succeeded()
    assert breaker.state == OPEN
    assert breaker.drain()[-1].reason.startswith("http_503 ")


def test_a_429_is_neither_success_nor_failure():
    breaker = CircuitBreaker(BreakerSettings(streak=3))
    for _ in range(2):
        breaker.failed("timeout")
    breaker.neutral()  # does not end the streak
    breaker.failed("timeout")
    assert breaker.state == OPEN


def test_half_open_probes_one_at_a_time_and_closes_after_the_probes_answer():
    breaker = CircuitBreaker(BreakerSettings(probes=3))
    breaker.state = OPEN
    breaker.half_open()
    assert breaker.state == HALF_OPEN
    assert breaker.allow()  # the first probe
    waiting = threading.Event()
    let_in: list[bool] = []

    def second() -> None:
        waiting.set()
        let_in.append(breaker.allow())  # waits for the first probe's answer

    t = threading.Thread(target=second)
    t.start()
    waiting.wait(5)
    t.join(0.2)
    assert t.is_alive() and not let_in  # still waiting: one probe at a time
    breaker.succeeded()
    t.join(5)
    assert let_in == [True]
    breaker.succeeded()
    assert breaker.allow()
    breaker.succeeded()
    assert breaker.state == CLOSED
    assert [t.to for t in breaker.drain()] == [HALF_OPEN, CLOSED]


def test_a_failed_probe_opens_it_again_and_the_waiting_callers_are_refused():
    breaker = CircuitBreaker()
    breaker.state = OPEN
    breaker.half_open()
    assert breaker.allow()
    stop = threading.Event()
    answers: list[bool] = []
    t = threading.Thread(target=lambda: answers.append(breaker.allow(stop)))
    t.start()
    breaker.failed("connect_error")
    t.join(5)
    assert answers == [False] and breaker.state == OPEN
    assert breaker.opened == 1


def test_a_caller_waiting_for_a_probe_gives_up_when_the_run_stops():
    breaker = CircuitBreaker()
    breaker.state = OPEN
    breaker.half_open()
    assert breaker.allow()
    stop = threading.Event()
    stop.set()
    assert not breaker.allow(stop)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_bucket_allows_its_rate_after_a_burst(monkeypatch):
    clock = FakeClock()
    slept: list[float] = []

    def sleep(seconds: float, stop: object) -> None:
        slept.append(seconds)
        clock.now += seconds

    monkeypatch.setattr("qo_ops.platform.ratelimit._sleep", sleep)
    bucket = TokenBucket(20.0, clock=clock)  # a burst of 2 (a tenth of a second's worth)
    start = clock.now
    for _ in range(42):
        assert bucket.acquire()
    assert clock.now - start == pytest.approx(40 / 20.0, abs=0.01)  # 2 at once, then 20/s
    assert bucket.waited_s == pytest.approx(2.0, abs=0.01)


def test_a_pause_holds_every_caller_and_never_shortens(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(
        "qo_ops.platform.ratelimit._sleep",
        lambda seconds, stop: setattr(clock, "now", clock.now + seconds),
    )
    bucket = TokenBucket(None, clock=clock)  # no rate limit of ours; pauses still apply
    bucket.pause(3.0)
    bucket.pause(1.0)  # a shorter Retry-After after a longer one
    start = clock.now
    assert bucket.acquire()
    assert clock.now - start == pytest.approx(3.0, abs=0.06)
    assert bucket.pauses == 2


def test_a_stopping_run_takes_no_token():
    bucket = TokenBucket(1.0)
    assert bucket.acquire()  # the burst of one
    stop = threading.Event()
    stop.set()
    assert not bucket.acquire(stop)
