"""How each call to the downstream counts as an attempt at a side effect (pure: the counts
from recorded call results; the end-to-end counts are in qo_ops_tests/jobs)."""

from __future__ import annotations

import pytest

from qo_ops.downstream.calls import outcome_of
from qo_ops.platform.calls.retry import CallResult, ErrorClass, RetryPolicy, dispose
from qo_ops.platform.job.outcome import BatchOutcome


def _result(item: str, **fields) -> CallResult:
    return CallResult(item_id=item, attempt=1, max_attempts=5, **fields)


def test_each_call_is_one_attempt_counted_by_how_it_ended():
    results = [
        _result("a", ok=True),
        _result("b", ok=True, duplicate=True),
        _result("c", ok=False, error_class=ErrorClass.RETRYABLE, code="http_503"),
        _result(
            "d", ok=False, error_class=ErrorClass.UNKNOWN, code="timeout", outcome_unknown=True
        ),
        _result(
            "e", ok=False, error_class=ErrorClass.UNKNOWN, code="bad_response", outcome_unknown=True
        ),
        _result("f", ok=True),  # its claim passed to another run before the result was recorded
    ]
    decisions = [(r, dispose(r, RetryPolicy())) for r in results]
    recorded = {"a": "done", "b": "done", "c": "retry", "d": "retry", "e": "retry"}
    outcome = outcome_of(decisions, recorded, "submit_delivery")
    effects = {k: v for k, v in outcome.tally.items() if k.startswith("side_effect")}
    assert effects == {
        "side_effect.submit_delivery.success": 1,
        "side_effect.submit_delivery.duplicate_prevented": 1,
        "side_effect.submit_delivery.failed": 1,
        "side_effect.submit_delivery.ambiguous": 3,
        "side_effect_ambiguity.timeout_after_send": 1,
        "side_effect_ambiguity.unreadable_answer": 1,
        "side_effect_ambiguity.claim_lost_after_call": 1,
    }
    assert outcome.duplicates_prevented == 1
    assert (outcome.succeeded, outcome.retry_scheduled, outcome.skipped) == (2, 3, 1)


def test_a_side_effect_result_is_one_of_the_known_words():
    outcome = BatchOutcome()
    with pytest.raises(ValueError, match="unknown side-effect result"):
        outcome.side_effect("x", "maybe")
    with pytest.raises(ValueError, match="names its reason"):
        outcome.side_effect("x", "ambiguous")
    with pytest.raises(ValueError, match="names its reason"):
        outcome.side_effect("x", "success", reason="timeout")
    outcome.side_effect("x", "success", 0)  # nothing to count: no key
    assert outcome.tally == {}
