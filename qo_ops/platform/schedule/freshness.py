"""When a tenant's outcome is stale.

An outcome is stale when no execute run of the job ended in success within
``STALE_FACTOR`` times the job's cadence. ``no_work`` also counts as success, and so does
``partial_success`` where the catalog says so. The Dagster ``recent_success`` checks
(``qo_ops/dagster_defs/freshness.py``) and ``qo-ops status`` share this rule. This module
does not use Dagster."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.schedule.cron import cadence_seconds

STALE_FACTOR = 3


def stale_limit_s(spec: JobSpec) -> float:
    """Seconds without a success after which a tenant of ``spec`` is stale."""
    return STALE_FACTOR * cadence_seconds(spec.deployment.cron_schedule)


# How long the job has been at work here, since its first finished run or evaluated tick.
# ix_job_run_job_finished serves the first, and job_schedule_tick keeps a job's first
# evaluation. The result is NULL if the job has never been at work.
_JOB_AGE = sa.text(
    """
    SELECT extract(epoch FROM now() - least(
             (SELECT min(finished_at) FROM job_run
               WHERE job_name = :job AND finished_at IS NOT NULL),
             (SELECT min(scheduled_for) FROM job_schedule_tick WHERE job_name = :job)))
    """
)


def job_due(conn: Connection, spec: JobSpec) -> bool:
    """Whether ``spec`` has been at work for longer than its stale limit.

    It has, when its first run finished or its first tick was evaluated that long ago.
    Before that, none of its tenants is judged. So a daily job is not stale on a fresh
    deployment before its first ticks."""
    age = conn.execute(_JOB_AGE, {"job": spec.name}).scalar()
    return age is not None and float(age) > stale_limit_s(spec)
