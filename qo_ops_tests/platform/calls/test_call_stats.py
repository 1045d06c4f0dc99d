"""The downstream's manners read back from a run's tally (``qo_ops.platform.calls.call_stats``): the
report rows, the one line of ``qo-ops run`` and the API's figures say the same numbers."""

from __future__ import annotations

from qo_ops.platform.calls.call_stats import (
    DEPENDENCY_UNAVAILABLE,
    DownstreamCalls,
    is_manners_key,
    manners_rows,
)
from qo_ops.platform.job.outcome import ReportRow

OUTAGE = {
    "downstream.calls": 200,
    "downstream.retries": 50,
    "downstream.refused_open": 40,
    "downstream.retry_budget_refused": 6,
    "downstream.rate_limit_pauses": 3,
    "downstream.rate_limit_wait_ms": 4250,
    "downstream.spared": 12,
    "breaker.open": 2,
    "breaker.half_open": 1,
    "breaker.closed": 1,
    "outcome.retryable.attempt_1.spared": 12,  # not a manners key: shown as before
    "side_effect.submit_delivery.failed": 12,
}


def test_an_outage_reads_as_figures_rows_and_one_line():
    calls = DownstreamCalls.from_tally(OUTAGE)
    assert calls is not None
    assert calls.retry_pressure == 0.25
    assert calls.as_dict() == {
        "calls": 200,
        "retries": 50,
        "retry_pressure": 0.25,
        "not_sent_breaker_open": 40,
        "retry_budget_refused": 6,
        "rate_limit_pauses": 3,
        "rate_limit_wait_s": 4.25,
        "spared": 12,
        "held": 0,
        "breaker_transitions": {"open": 2, "half_open": 1, "closed": 1},
    }
    assert calls.line() == (
        "200 calls, 50 retries (25.0 % retry pressure), 3 rate-limit pauses, 4.2 s waited, "
        "breaker opened 2, half-opened 1, closed 1, 40 not sent (breaker open), "
        "6 retries refused (budget used up), 12 spared (attempt kept)"
    )
    assert manners_rows(OUTAGE, DEPENDENCY_UNAVAILABLE, "circuit breaker open for http://d:80") == [
        ReportRow("downstream", "calls", 200, "sent"),
        ReportRow("downstream", "retries", 50, "25.0 % of calls"),
        ReportRow("downstream", "not_sent_breaker_open", 40, "not sent: breaker open"),
        ReportRow("downstream", "retry_budget_refused", 6, "not sent: retry budget used up"),
        ReportRow("downstream", "rate_limit_pauses", 3, "429 + Retry-After: the run paused"),
        ReportRow("downstream", "rate_limit_wait_ms", 4250, "waited for the rate limit, summed"),
        ReportRow("downstream", "spared", 12, "failed in the outage: attempt kept"),
        ReportRow("breaker", "open", 2, "transitions"),
        ReportRow("breaker", "half_open", 1, "transitions"),
        ReportRow("breaker", "closed", 1, "transitions"),
        ReportRow("breaker", "dependency_unavailable", 1, "circuit breaker open for http://d:80"),
    ]
    shown = {k for k in OUTAGE if is_manners_key(k)}
    assert shown == {k for k in OUTAGE if k.startswith(("downstream.", "breaker."))}


def test_a_calm_run_shows_calls_and_retries_only_and_a_run_without_calls_nothing():
    calm = DownstreamCalls.from_tally({"downstream.calls": 40})
    assert calm is not None and calm.retry_pressure == 0.0
    assert calm.line() == "40 calls, 0 retries (0.0 % retry pressure)"
    assert [r.name for r in calm.rows()] == ["calls", "retries"]
    assert calm.breaker_text() == "-"
    # the breaker was open from the start: nothing sent, pressure unknown (not 0)
    refused = DownstreamCalls.from_tally({"downstream.refused_open": 9})
    assert refused is not None and refused.retry_pressure is None
    assert refused.as_dict()["retry_pressure"] is None
    assert refused.line() == "0 calls, 0 retries (- retry pressure), 9 not sent (breaker open)"
    # a job that calls nothing (or a run that had no work): no downstream rows at all
    assert DownstreamCalls.from_tally({"checkpoint.updates": 3, "mismatch": 1}) is None
    assert DownstreamCalls.from_tally(None) is None
    assert manners_rows({"checkpoint.updates": 3}, None, None) == []
    # words that look like manners keys but are not stay raw tally rows
    assert not is_manners_key("breaker.bogus") and not is_manners_key("downstream.bogus")
