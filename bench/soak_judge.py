"""The soak's judgement (``bench/section_soak.py``): the timeline it samples, the facts the
database holds after it, and why each alert that went pending or firing is right, or None.

Explained by the queue: ``QoOpsRunQueueBacklog`` is right when the samples saw a run wait in
the queue longer than its bound (the job's cadence, clamped to 60-900 s: 60 s in the soak,
whose catalog runs every job every minute). The queue explains no ``QoOpsJobNotSucceeding``:
that rule is held back for a job whose runs wait (the queue's alert names it), so one that
still fires is right only if the job's own runs failed or the outage stopped them, and is
wrong if the queue is all that explains it (one cause, two pages). Misses as queued or
previous_run_queued are right only for a job whose runs the samples saw waiting.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL

from bench.common import engine_for, percentile
from qo_ops.platform.calls.call_stats import CALLS, RETRIES

# QoOpsRunQueueBacklog's bound for a job (alerts.yml): its cadence, clamped to 60-900 s. The
# soak's catalog runs every job every minute, so 60 s for each.
QUEUE_BOUND_S = 60.0
# the judge's rule for "explained by the queue", as BENCHMARKS.md states it beside the runs
QUEUE_RULE = (
    "Explained by the queue: QoOpsRunQueueBacklog is right when the samples saw a run wait in "
    f"the queue longer than its bound (the job's cadence, clamped to 60-900 s: "
    f"{QUEUE_BOUND_S:.0f} s here); QoOpsJobMissedRuns with reason queued or "
    "previous_run_queued and QoOpsJobBacklogGrowing are right for a job whose runs the samples "
    "saw queued; the queue explains no QoOpsJobNotSucceeding (held back for a job whose runs "
    "wait: one that fires is right only if the job's own runs failed or the outage stopped "
    "them)."
)


@dataclass
class Timeline:
    started: float  # time.time() at the soak's start
    outage: tuple[float, float]  # seconds from the start
    samples: list[dict[str, Any]] = field(default_factory=list)
    alerts: dict[tuple[str, tuple[tuple[str, str], ...]], dict[str, Any]] = field(
        default_factory=dict
    )

    def phase(self, t: float) -> str:
        return "before" if t < self.outage[0] else "outage" if t < self.outage[1] else "after"


# ------------------------------------------------------------------ judging


@dataclass(frozen=True)
class Facts:
    """What the soak did and what the database holds, to judge each alert against."""

    outage_start: float  # seconds from the start
    failed_jobs: frozenset[str]  # jobs with a failed or cancelled run in the soak
    anomaly_jobs: frozenset[str]  # jobs with a run stopped by an anomaly threshold
    takeover_jobs: frozenset[str]  # jobs with a run that lost its lease
    downstream_jobs: frozenset[str]  # jobs whose runs called the downstream (the outage's)
    deadletter_jobs: frozenset[str]  # jobs whose runs dead-lettered items
    item_failure_jobs: frozenset[str]  # jobs whose runs had items fail (demo poison, faults)
    retry_jobs: frozenset[str]  # jobs whose runs retried downstream calls
    mismatch_jobs: frozenset[str]  # reconciliation jobs whose runs found mismatches
    oldest_queued_s: dict[str, float]  # per job, the oldest queued run the samples saw
    # per job, how late its scheduled tenant runs started after their tick (p90), as the
    # exporter's job_scheduler_drift_seconds counts it (job_run.started_at - scheduled_for):
    # a chunk's tenants start one after another, later than the Dagster run that holds them
    drift_p90_s: dict[str, float]


def judge(name: str, labels: dict[str, str], first_t: float, f: Facts) -> str | None:
    """Why this alert is right, or None: it is wrong."""
    job = labels.get("job_name", "")
    after_outage = first_t >= f.outage_start
    if name == "QoOpsJobMissedRuns":
        reason = labels.get("reason")
        if reason == "previous_run_active":
            return "a run of the scope was still running at the tick (runs wait, then run late)"
        if reason in ("previous_run_queued", "queued") and f.oldest_queued_s.get(job, 0.0) > 0:
            return f"its runs waited in the queue ({reason}): more asked for than started"
        return None  # daemon_down with a healthy daemon: the wrong cause
    if name == "QoOpsRunQueueBacklog":  # one for the queue, no job_name
        held = sorted(j for j, age in f.oldest_queued_s.items() if age > QUEUE_BOUND_S)
        oldest = max(f.oldest_queued_s.values(), default=0.0)
        return (
            f"runs waited in the queue up to {oldest:.0f} s (> {QUEUE_BOUND_S:.0f} s) for "
            f"{len(held)} jobs"
            if held
            else None
        )
    if name == "QoOpsJobSchedulerDriftHigh":  # p90 over max(60 s, a quarter of the cadence)
        drift = f.drift_p90_s.get(job, 0.0)
        return f"its runs started {drift:.0f} s after their tick (p90)" if drift > 60 else None
    if name == "QoOpsDownstreamBreakerOpen":
        return "the downstream was stopped" if after_outage else None
    if name == "QoOpsJobAnomalyStop":
        return "the demo data plants an anomaly" if job in f.anomaly_jobs else None
    if name == "QoOpsJobLeaseTakeover":
        return "a run lost its lease" if job in f.takeover_jobs else None
    if name == "QoOpsJobDeadLetters":
        return "the demo data plants poison items" if job in f.deadletter_jobs else None
    if name == "QoOpsJobReconciliationMismatchSpike":
        return "the demo data plants mismatches" if job in f.mismatch_jobs else None
    if name == "QoOpsJobPartialFailureRateHigh" and job in f.item_failure_jobs:
        return "items of its runs failed (the demo's poison items and faults, the outage)"
    if name == "QoOpsJobRetryPressureHigh" and job in f.retry_jobs:
        return "its runs retried downstream calls (the demo's faults, the outage)"
    if name == "QoOpsJobBacklogGrowing" and f.oldest_queued_s.get(job, 0.0) > 0:
        return "items kept arriving while its runs waited in the queue"
    if name in ("QoOpsJobConsecutiveFailures", "QoOpsJobNotSucceeding") and job in f.failed_jobs:
        return "its runs failed"
    if name in (
        "QoOpsJobBacklogGrowing",
        "QoOpsJobConsecutiveFailures",
        "QoOpsJobNotSucceeding",
        "QoOpsJobRetryPressureHigh",
        "QoOpsJobPartialFailureRateHigh",
        "QoOpsJobRunRetriesSustained",
    ):
        return "the downstream was stopped" if job in f.downstream_jobs and after_outage else None
    return None  # QoOpsExporterDown, QoOpsJobSuspendedTooLong (nobody suspended), …


# The p90 of each job's scheduled tenant runs' drift, as the exporter measures it.
TENANT_DRIFT_P90 = sa.text(
    """
    SELECT job_name,
           percentile_cont(0.9) WITHIN GROUP (
               ORDER BY extract(epoch FROM started_at - scheduled_for))::float8 AS p90
      FROM job_run
     WHERE created_at >= :s AND scheduled_for IS NOT NULL AND started_at IS NOT NULL
     GROUP BY job_name
    """
)


def facts(
    url: URL,
    since: datetime,
    outage_start: float,
    timeline: Timeline,
    started: list[dict[str, Any]],
) -> Facts:
    delays: dict[str, list[float]] = defaultdict(list)
    for r in started:
        if r["by"] == "schedule" and r["delay_s"] is not None:
            delays[r["job"]].append(r["delay_s"])
    oldest: dict[str, float] = defaultdict(float)
    for s in timeline.samples:
        for job, age in s["oldest_by_job"].items():
            oldest[job] = max(oldest[job], age)
    engine = engine_for(url)
    with engine.connect() as conn:

        def jobs(where: str) -> frozenset[str]:
            rows = conn.execute(
                sa.text(
                    f"SELECT DISTINCT job_name FROM job_run WHERE created_at >= :s AND {where}"
                ),
                {"s": since},
            )
            return frozenset(r[0] for r in rows)

        out = Facts(
            outage_start=outage_start,
            failed_jobs=jobs("status IN ('failed', 'timeout', 'cancelled')"),
            anomaly_jobs=jobs("last_error_code = 'anomaly_threshold'"),
            takeover_jobs=jobs("last_error_code = 'lease_lost'"),
            downstream_jobs=jobs(f"coalesce((tally->>'{CALLS}')::bigint, 0) > 0"),
            deadletter_jobs=jobs("deadlettered_count > 0"),
            item_failure_jobs=jobs("failed_count > 0"),
            retry_jobs=jobs(f"coalesce((tally->>'{RETRIES}')::bigint, 0) > 0"),
            mismatch_jobs=jobs("job_name = 'order_reconciliation' AND tally <> '{}'::jsonb"),
            oldest_queued_s=dict(oldest),
            drift_p90_s={**{job: percentile(d, 0.9) for job, d in delays.items()},
                         **dict(conn.execute(TENANT_DRIFT_P90, {"s": since}).tuples().all())},
        )  # fmt: skip
    engine.dispose()
    return out
