"""The token bucket's rules, on their own and on a fake clock (the circuit breaker's:
test_breaker.py); the jobs that use them are tested against the real simulator in
qo_ops_tests/jobs/test_downstream_manners.py.

Tests ``qo_ops.platform.calls.ratelimit``.
"""

from __future__ import annotations

import threading

import pytest

from qo_ops.platform.calls.ratelimit import TokenBucket


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

    monkeypatch.setattr("qo_ops.platform.calls.ratelimit._sleep", sleep)
    bucket = TokenBucket(20.0, clock=clock)  # a burst of 2 (a tenth of a second's worth)
    start = clock.now
    for _ in range(42):
        assert bucket.acquire()
    assert clock.now - start == pytest.approx(40 / 20.0, abs=0.01)  # 2 at once, then 20/s
    assert bucket.waited_s == pytest.approx(2.0, abs=0.01)


def test_a_pause_holds_every_caller_and_never_shortens(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(
        "qo_ops.platform.calls.ratelimit._sleep",
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
