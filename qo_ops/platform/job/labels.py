"""The label values of the seed's job signals, declared once (``docs/observability.md``).

A metric label takes its values from one of these bounded sets. It is never a tenant, an
id, a cursor or a message. The exporter serves every declared value of every catalog job
from its first scrape (at 0), so ``increase()`` sees the first occurrence. It shows any
other value as ``other``.

The runner and the downstream calls write what these count into each run's record (its
columns and its ``tally``). The exporter reads them back from there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from qo_ops.platform.job.statuses import RunStatus

OTHER = "other"  # any value outside a declared set

# job_lock_acquire_total{result} says whether an execute run took its scope's lease or
# found it held.
LOCK_RESULTS = ("acquired", "skipped_already_running")

# job_retries_total{scope, reason} and job_retry_exhausted_total{scope}. The scope label is
# item or run.
ITEM_RETRY_REASONS = (
    "dependency_timeout",
    "dependency_connection",
    "dependency_rate_limited",
    "dependency_error",
    OTHER,
)
RUN_RETRY_REASONS = ("worker_crashed",)  # the only runs Dagster retries (dagster.yaml)
ITEM_RETRY_PREFIX = "retry.item."  # tally key retry.item.<reason>, an item's retry scheduled
ITEM_RETRY_EXHAUSTED = "retry_exhausted.item"  # tally key, dead-lettered with every attempt used
# The failure code of a call that got no answer in time. It is a call's code, not a run's status.
CALL_TIMEOUT = "timeout"

_CODE_REASONS = {
    CALL_TIMEOUT: "dependency_timeout",
    "connect_error": "dependency_connection",
    "connection_reset": "dependency_connection",
    "http_429": "dependency_rate_limited",
    "http_408": "dependency_timeout",
}


def retry_reason(code: str | None) -> str:
    """The ``reason`` of an item retry, from the failed call's code (``client.py``). The
    reasons are timeouts, connection failures, rate limiting, the dependency's 5xx, and
    ``other`` for the rest."""
    if code is None:
        return OTHER
    if code in _CODE_REASONS:
        return _CODE_REASONS[code]
    if code.startswith("http_5") or code == "http_425":
        return "dependency_error"
    return OTHER


# job_manual_reruns_total{reason} counts an execute a person asked for over a scope that had
# an earlier finished execute run. The reason is how that run ended.
MANUAL_RERUN_REASONS: Mapping[str, str] = {
    RunStatus.FAILED: "after_failure",
    RunStatus.TIMEOUT: "after_failure",
    RunStatus.PARTIAL_SUCCESS: "after_partial_success",
    RunStatus.CANCELLED: "after_cancelled",
    RunStatus.SUCCESS: "after_success",
    RunStatus.NO_WORK: "after_success",
}
# job_checkpoint_resets_total{reason} counts forgotten checkpoints. Either a rescanning job
# went through its whole scope (the runner), or a person reset it (qo-ops checkpoint reset).
CHECKPOINT_RESET_REASONS = ("rescan_complete", "operator")
MANUAL_TRIGGERS = ("manual", "api", "backfill")  # a Dagster run retry is not a person's rerun

# job_failed_total{error_class} takes the platform's error classes of a failed or timed-out
# run. A job adds its own (JobSpec.signals.error_classes).
PLATFORM_ERROR_CLASSES = (
    "items_failed",  # every item of the run failed
    "deadline",  # status timeout. The deadline passed, and the progress is kept.
    "lease_lost",
    "orphaned",  # its process died, and the reaper ended the record
    "database_unavailable",
    "database_error",
    "dependency_unavailable",  # the downstream's circuit breaker stopped it
    "internal_error",
    OTHER,
)

# job_side_effect_ambiguity_total{reason} (qo_ops/downstream/calls.py outcome_of)
AMBIGUITY_REASONS = (
    "timeout_after_send",
    "connection_reset_after_send",
    "terminated_after_send",
    "unreadable_answer",
    "claim_lost_after_call",
    OTHER,
)


@dataclass(frozen=True)
class Reconciliation:
    """What a reconciliation job counts, as tally keys of its runs. Each mismatch type is a
    key. Each action outcome it writes maps to a correction result, or to the reason a
    mismatch is left to a person. The seed's reconciliation_* family is read from them."""

    mismatch_types: tuple[str, ...]
    corrections: Mapping[str, str] = field(default_factory=dict)  # maps a tally key to its result
    unresolved: Mapping[str, str] = field(default_factory=dict)  # maps a tally key to its reason

    @property
    def correction_results(self) -> tuple[str, ...]:
        """The ``result`` values of reconciliation_corrections_total, in declared order."""
        return tuple(dict.fromkeys(self.corrections.values()))

    @property
    def unresolved_reasons(self) -> tuple[str, ...]:
        """The ``reason`` values of reconciliation_unresolved_total, in declared order."""
        return tuple(dict.fromkeys(self.unresolved.values()))
