"""Missed scheduled runs, judged from the schedule's cadence and the run records.

Every tick of a job's cron (UTC) expects one run for each tenant that existed at the tick.
For a windowed job, the run covers the day its schedule runs at that tick. A tick is judged
once its window has passed. The window is the cadence, at most an hour. A run that has not
started by then missed its tick. If it starts later, it still counts as a run, with its
drift.

An expected run is missed when no run record exists for its tick (``job_run.scheduled_for``).
A ``skipped`` run did nothing, so it does not count. The records say why the run was missed:

- ``suspended``: the kill switch covered the scope at the tick, so the schedule skipped it
  on purpose. The ``job_audit`` suspend and resume rows give the intervals.
- ``previous_run_queued``: the schedule asked for nothing for the scope, because a run of it
  was still waiting in Dagster's run queue (``job_schedule_tick``). A backlog must not feed
  itself.
- ``previous_run_active``: a run of the same scope was running at the tick. Either the
  schedule skipped the tick, as recorded, or that run held the scope's lease and the
  requested run found it held.
- ``queued``: the schedule evaluated the tick and asked for the run, but the run did not
  start within the window. It waited in Dagster's run queue, or its launch failed.
- ``daemon_down``: none of the above. The tick was never evaluated, because Dagster's
  scheduler daemon was down or the schedule was stopped.

This module does not use Dagster. The platform judges from what the database recorded.
"""

from __future__ import annotations

import uuid
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass
from datetime import date, datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.errors import QoOpsError
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.job.statuses import RunStatus
from qo_ops.platform.schedule.cron import cadence_seconds

MISSED_REASONS = (
    "previous_run_active",
    "previous_run_queued",
    "queued",
    "suspended",
    "daemon_down",
)
TICK_RECORDS_KEPT = timedelta(days=2)  # longer than the exporter looks back for missed ticks
WINDOW_CAP_S = 3600.0
NOT_RUN = (
    RunStatus.SKIPPED,
    RunStatus.ACCEPTED,
    RunStatus.AWAITING_APPROVAL,
)  # the statuses of runs that did no work


def tick_window_s(spec: JobSpec) -> float:
    """How long after its tick a scheduled run may start and still count as that tick's."""
    return min(cadence_seconds(spec.deployment.cron_schedule), WINDOW_CAP_S)


@dataclass(frozen=True)
class MissedRun:
    tick: datetime
    tenant_id: str
    reason: str


def _during(start: datetime, end: datetime | None, at: datetime) -> bool:
    """Whether ``at`` lies in [start, end), such as a run running or a suspension in force.

    ``end`` is None while the interval is still open."""
    return start <= at and (end is None or end > at)


_SCOPE_BUSY_AT = sa.text(
    """
    SELECT 1 FROM job_run
     WHERE job_name = :job AND scope = :scope AND id <> :other
       AND fencing_token IS NOT NULL
       AND started_at <= :at AND (finished_at IS NULL OR finished_at > :at)
     LIMIT 1
    """
)


def scope_busy_at(
    conn: Connection, job_name: str, scope: str, at: datetime, other_than: uuid.UUID
) -> bool:
    """Whether a run of the scope other than ``other_than`` held its lease and was running at
    ``at``.

    A run that held the lease has a fencing token. This is the rule that :func:`missed_runs`
    applies to the rows it reads, written as one query. It gives a late run's drift
    reason."""
    params = {"job": job_name, "scope": scope, "at": at, "other": other_than}
    return conn.execute(_SCOPE_BUSY_AT, params).first() is not None


def first_scheduled_tick(conn: Connection, job_name: str) -> datetime | None:
    """The job's oldest tick on record, from a scheduled run or from an evaluation.

    Judging starts there, because before it the schedule may never have been on."""
    value: datetime | None = conn.execute(
        sa.text(
            "SELECT least("
            "(SELECT min(scheduled_for) FROM job_run "
            "WHERE job_name = :job AND scheduled_for IS NOT NULL), "
            "(SELECT min(scheduled_for) FROM job_schedule_tick WHERE job_name = :job))"
        ),
        {"job": job_name},
    ).scalar()
    return value


def scheduled_day(spec: JobSpec, tick: datetime) -> date:
    """The day a windowed job's schedule runs at ``tick``.

    It is yesterday, or for retention jobs the day that has just aged out. A bad retention
    setting raises :class:`QoOpsError`."""
    age = (
        spec.deployment.scheduled_window_age_days()
        if spec.deployment.scheduled_window_age_days
        else 1
    )
    return (tick - timedelta(days=age)).date()


def expected_scope(spec: JobSpec, tenant_id: str, tick: datetime) -> str:
    """The scope key the schedule runs for ``tenant_id`` at ``tick``."""
    if spec.partitioning != "tenant_day":
        return tenant_id
    try:
        day = scheduled_day(spec, tick)
    except QoOpsError:  # a bad retention setting; the schedule itself skips with the reason
        day = (tick - timedelta(days=1)).date()
    return Scope(tenant_id, day, day + timedelta(days=1)).key


# Read the runs that overlap the judged ticks. They finished after the first tick, or they
# are still running (ix_job_run_job_finished, ix_job_run_running).
_RUNS = sa.text(
    """
    SELECT scope, scheduled_for, status, fencing_token, started_at, finished_at FROM job_run
     WHERE job_name = :job AND finished_at > :lo AND started_at <= :hi
    UNION ALL
    SELECT scope, scheduled_for, status, fencing_token, started_at, finished_at FROM job_run
     WHERE job_name = :job AND status = 'running' AND started_at <= :hi
    """
)
_SUSPENSIONS = sa.text(
    """
    SELECT scope, action, occurred_at FROM job_audit
     WHERE job_name = :job AND action IN ('suspend', 'resume') AND decision = 'allowed'
       AND occurred_at <= :hi
     ORDER BY occurred_at, id
    """
)


# Record a tick the schedule evaluated, and which tenants it skipped and why. There is one row
# per tick and decision.
# Twice: the same tick again upserts its row. Its tenants become the union of both, and
# nothing is doubled.
_RECORD_TICK = sa.text(
    """
    INSERT INTO job_schedule_tick (job_name, scheduled_for, decision, tenants)
    VALUES (:job, :tick, :decision, :tenants)
    ON CONFLICT (job_name, scheduled_for, decision) DO UPDATE
       SET tenants = ARRAY(SELECT DISTINCT unnest(job_schedule_tick.tenants || EXCLUDED.tenants)),
           recorded_at = now()
    """
)
# Delete ticks older than the missed-run window. The job's first tick stays, because it
# says since when the schedule has been on (freshness.job_due).
# Twice: the second delete finds nothing older left to remove.
_PRUNE_TICKS = sa.text(
    """
    DELETE FROM job_schedule_tick
     WHERE job_name = :job AND scheduled_for < :before
       AND scheduled_for > (SELECT min(scheduled_for) FROM job_schedule_tick WHERE job_name = :job)
    """
)
_TICKS = sa.text(
    """
    SELECT scheduled_for, decision, tenants FROM job_schedule_tick
     WHERE job_name = :job AND scheduled_for BETWEEN :lo AND :hi
    """
)


def record_tick(
    conn: Connection, job_name: str, tick: datetime, skipped: dict[str, list[str]]
) -> None:
    """Record that the schedule of ``job_name`` evaluated ``tick``, and which tenants it
    skipped and why (``previous_run_queued`` or ``previous_run_active``).

    It also prunes the job's records older than :data:`TICK_RECORDS_KEPT`, except the first
    tick, which says since when the schedule has been on. A tick evaluated twice adds up."""
    rows = [{"decision": "evaluated", "tenants": []}]
    rows += [{"decision": why, "tenants": sorted(ts)} for why, ts in skipped.items() if ts]
    conn.execute(_RECORD_TICK, [{"job": job_name, "tick": tick, **row} for row in rows])
    conn.execute(_PRUNE_TICKS, {"job": job_name, "before": tick - TICK_RECORDS_KEPT})


def missed_runs(conn: Connection, spec: JobSpec, ticks: list[datetime]) -> list[MissedRun]:
    """The expected runs of ``ticks`` (oldest first) that did not happen, each with a
    reason."""
    if not ticks:
        return []
    lo, hi = ticks[0], ticks[-1] + timedelta(seconds=tick_window_s(spec))
    evaluated: set[datetime] = set()
    skipped: dict[tuple[datetime, str], str] = {}
    for row in conn.execute(_TICKS, {"job": spec.name, "lo": lo, "hi": ticks[-1]}):
        if row.decision == "evaluated":
            evaluated.add(row.scheduled_for)
        else:
            skipped.update(
                dict.fromkeys(((row.scheduled_for, t) for t in row.tenants), row.decision)
            )
    ran: set[tuple[datetime, str]] = set()
    busy: dict[str, list[tuple[datetime, datetime | None]]] = defaultdict(list)
    for run in conn.execute(_RUNS, {"job": spec.name, "lo": lo, "hi": hi}):
        if run.status in NOT_RUN:
            continue
        if run.scheduled_for is not None:
            ran.add((run.scheduled_for, run.scope))
        if run.fencing_token is not None:  # it held the scope's lease (a dry run does not)
            busy[run.scope].append((run.started_at, run.finished_at))
    suspended = _suspension_intervals(conn, spec.name, hi)
    tenants = list(conn.execute(sa.text("SELECT id, created_at FROM tenant ORDER BY id")))
    missed = []
    for tick in ticks:
        for tenant in tenants:
            if tenant.created_at > tick:
                continue
            scope = expected_scope(spec, tenant.id, tick)
            if (tick, scope) in ran:
                continue
            if _within(suspended.get("*", []), tick) or _within(suspended.get(tenant.id, []), tick):
                reason = "suspended"
            elif (tick, tenant.id) in skipped:
                reason = skipped[(tick, tenant.id)]
            elif any(_during(start, end, tick) for start, end in busy[scope]):
                reason = "previous_run_active"
            elif tick in evaluated:
                reason = "queued"
            else:
                reason = "daemon_down"
            missed.append(MissedRun(tick, tenant.id, reason))
    return missed


def _suspension_intervals(
    conn: Connection, job_name: str, hi: datetime
) -> dict[str, list[tuple[datetime, datetime | None]]]:
    """Map each suspension key ('*' or a tenant) to its intervals, oldest first.

    Each interval is [suspended_at, resumed_at), with None while it is still open."""
    intervals: dict[str, list[tuple[datetime, datetime | None]]] = defaultdict(list)
    open_since: dict[str, datetime] = {}
    for row in conn.execute(_SUSPENSIONS, {"job": job_name, "hi": hi}):
        if row.action == "suspend":
            open_since.setdefault(row.scope, row.occurred_at)
        elif row.scope in open_since:
            intervals[row.scope].append((open_since.pop(row.scope), row.occurred_at))
    for key, since in open_since.items():
        intervals[key].append((since, None))
    return intervals


def _within(intervals: list[tuple[datetime, datetime | None]], at: datetime) -> bool:
    """Whether ``at`` lies in one of ``intervals`` (sorted, not overlapping)."""
    i = bisect_right([start for start, _ in intervals], at)
    return i > 0 and _during(*intervals[i - 1], at)
