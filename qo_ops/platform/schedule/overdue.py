"""What a tenant's outcome covers beyond one run's window. This module does not use Dagster.

A windowed job's run covers one window (a day). The outcome the job keeps covers every day
of the tenant. This module gives two ranges of days, both starting at :data:`FIRST_DAY`:

- :func:`overdue_scope`: the days that can hold *overdue* work now. It runs through the last
  day the job's schedule has run for, allowing that run time to start late and to finish.
  The outcome checks executed on their own (Dagster's asset checks) look at this range.
- :func:`backlog_scope`: every day through today, which is everything the job's selection
  matches now, due or not. The outcome assets plot this backlog (:func:`tenant_backlog`).

For a tenant job, both are the tenant. "Now" is the database clock.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.platform.job.outcome import BatchContext
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.run.selection import count_eligible
from qo_ops.platform.schedule.cron import cron_ticks
from qo_ops.platform.schedule.missed import scheduled_day, tick_window_s

FIRST_DAY = date(1970, 1, 1)  # no business record predates it, so "every day" starts here


def database_now(conn: Connection) -> datetime:
    """The database's ``now()``. Every selection and check compares with this clock."""
    now: datetime = conn.execute(sa.select(sa.func.now())).scalar_one()
    return now


def last_scheduled_day(spec: JobSpec, now: datetime) -> date:
    """The last day a windowed job's schedule has run for by ``now``. That is the day of its
    latest tick that lies at least a start window and a run deadline before ``now``, because
    a scheduled run may start that late and run that long. Raises :class:`QoOpsError` when
    the job has a bad retention setting."""
    until = now - timedelta(seconds=tick_window_s(spec) + spec.defaults.deadline_s)
    ticks = cron_ticks(spec.deployment.cron_schedule, until - timedelta(days=2), until)
    return scheduled_day(spec, ticks[-1])


def overdue_scope(spec: JobSpec, tenant_id: str, now: datetime) -> Scope:
    """The tenant's days whose work should be done by ``now``, from :data:`FIRST_DAY`
    through :func:`last_scheduled_day`. For a tenant job, the tenant."""
    if spec.partitioning != "tenant_day":
        return Scope(tenant_id)
    return Scope(tenant_id, FIRST_DAY, last_scheduled_day(spec, now) + timedelta(days=1))


def backlog_scope(spec: JobSpec, tenant_id: str, now: datetime) -> Scope:
    """Every day of the tenant from :data:`FIRST_DAY` through today (UTC). For a tenant
    job, the tenant."""
    if spec.partitioning != "tenant_day":
        return Scope(tenant_id)
    return Scope(tenant_id, FIRST_DAY, now.astimezone(UTC).date() + timedelta(days=1))


@dataclass(frozen=True)
class Backlog:
    """A tenant's whole backlog for one job.

    It holds the eligible items and the age of the oldest one (the job's lag). ``None``
    means the job does not measure that figure."""

    items: int | None
    oldest_due_age_s: float | None


def tenant_backlog(conn: Connection, spec: JobSpec, tenant_id: str) -> Backlog:
    """What the job's selection matches now over every day of the tenant
    (:func:`backlog_scope`), and its lag.

    For a checkpointed or scanning job, the selection is not a backlog. It walks a key
    range, or what there is to compare. So ``items`` is ``None``, as it is for the run's own
    backlog."""
    scope = backlog_scope(spec, tenant_id, database_now(conn))
    ctx = BatchContext(spec.name, scope, "dry_run", uuid.uuid4())
    items = None
    if spec.batching.checkpoint is None and not spec.batching.dry_run_scans:
        items = count_eligible(conn, spec, ctx)
    return Backlog(items, spec.signals.lag(conn, ctx) if spec.signals.lag else None)
