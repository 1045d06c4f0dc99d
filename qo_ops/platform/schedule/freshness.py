"""When a tenant's outcome is stale: no execute run of the job ended success (or no_work,
or partial_success where the catalog says so) within ``STALE_FACTOR`` × the job's cadence.
The rule the Dagster ``recent_success`` checks (``qo_ops/dagster_defs/freshness.py``) and
``qo-ops status`` share. No Dagster here."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.schedule.cron import cadence_seconds

STALE_FACTOR = 3


def stale_limit_s(spec: JobSpec) -> float:
    """Seconds without a success after which a tenant of ``spec`` is stale."""
    return STALE_FACTOR * cadence_seconds(spec.deployment.cron_schedule)


# How long the job has been at work here: since its first finished run or evaluated tick
# (ix_job_run_job_finished; job_schedule_tick keeps a job's first evaluation). NULL: never.
_JOB_AGE = sa.text(
    """
    SELECT extract(epoch FROM now() - least(
             (SELECT min(finished_at) FROM job_run
               WHERE job_name = :job AND finished_at IS NOT NULL),
             (SELECT min(scheduled_for) FROM job_schedule_tick WHERE job_name = :job)))
    """
)


def job_due(conn: Connection, spec: JobSpec) -> bool:
    """Whether ``spec`` has been at work for longer than its limit (a first run finished, or
    a first tick evaluated, that long ago): before that no tenant of it is judged -- a daily
    job is not stale on a fresh deployment before its first ticks."""
    age = conn.execute(_JOB_AGE, {"job": spec.name}).scalar()
    return age is not None and float(age) > stale_limit_s(spec)
