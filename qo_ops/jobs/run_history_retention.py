"""run_history_retention keeps the platform's own run history for a period, per tenant, and
then deletes it in bounded, audited batches. The history is the ``job_run`` rows and the
``job_checkpoint`` cursors. ``job_audit`` is never touched, and the database refuses
UPDATE and DELETE on it anyway.

The period is 90 days unless ``QO_OPS_RUN_HISTORY_DAYS`` says otherwise, as a whole number
of days from 7 to 3650. It is read when a run first selects and kept for that run. The
cutoff is ``now() - period`` of each statement, so a run that lasts minutes also prunes the
rows that crossed it meanwhile.

**A run of tenant T** touches only history whose scope is T's. That is ``T`` for tenant jobs
and ``T/<from>..<to>`` for tenant × day jobs. It reads ``ix_job_run_retention`` and
``ix_job_checkpoint_retention`` (``split_part(scope, '/', 1)`` then time).

**A ``job_run`` row goes** when it finished before the cutoff in a final status, unless it is

- the latest run of its (job, scope). It is kept unless a later run of the same job and
  scope both started and finished after it. ``qo-ops status``, the API and the exporter
  read it.
- the last success (execute, success or no_work) of its (job, scope). The freshness
  sensors, the status and ``job_last_success_timestamp_seconds`` read it.
- named by a held (unexpired) lease.
- named by a business record that says which run did it. These are ``reconciliation_result``
  (mismatches found), ``temp_file_tombstone`` (files deleted) and ``audit_archive_manifest``
  (records archived). None of them has a foreign key to ``job_run``, so nothing would stop
  the delete. The run is kept so that the record keeps its context (window, trigger,
  requester, reason). ``pricing_snapshot.job_run_id`` only stamps which run computed a
  snapshot. Such runs may go, and the snapshot and its stamp stay as written.

Active runs (``awaiting_approval``, ``accepted``, ``running``) never go, because only final
statuses with a ``finished_at`` are selected. ``api_idempotency`` rows are not touched. The
runner has no privilege on that table. A key naming a pruned run is past its 24-hour life
(the period is at least 7 days), and the API treats it as expired.

**A ``job_checkpoint`` row goes** when it was last written before the cutoff and its (job,
scope) has no unexpired lease and no active run. Every checkpointed job is idempotent, since
its writes are upserts or conditional. So a scope whose checkpoint went starts from the
beginning if it is ever run again. That is more work for the same result.

**Items** are both kinds in one selection, oldest first, named ``run:<id>`` and
``checkpoint:<job>:<scope>``. The dry run counts and samples them together, and each batch
deletes up to ``batch_size`` of them. Each execute batch appends ONE ``job_audit`` row
(action ``retention.prune``) in its own transaction. The row says what went (counts, the
cutoff, the oldest and newest times), so the proof outlives the retention run's own
``job_run`` row.

The job is safe twice. The deletes re-check the whole predicate, so a second run finds
nothing to do. The job keeps no checkpoint, because deleting an item removes it from the
selection.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.config import whole_number
from qo_ops.db import audit
from qo_ops.platform.job.options import Limits
from qo_ops.platform.job.outcome import (
    BatchContext,
    BatchOutcome,
    OutcomeCheck,
    ReportRow,
    run_settings,
)
from qo_ops.platform.job.spec import (
    Batching,
    CheckSpec,
    Deployment,
    JobSpec,
    Positions,
    Presentation,
    Signals,
)
from qo_ops.platform.run.selection import seconds_or_none

DAYS_ENV = "QO_OPS_RUN_HISTORY_DAYS"
DEFAULT_DAYS = 90
MIN_DAYS = 7  # never prunes what an incident review of last week would need
MAX_DAYS = 3650
GRACE = timedelta(hours=1)  # the outcome check forgives rows that crossed the cutoff this recently
AUDIT_ACTION = "retention.prune"
RUN_PREFIX, CHECKPOINT_PREFIX = "run:", "checkpoint:"  # the items' names, as the SQL writes them
TS = sa.DateTime(timezone=True)

# A prunable run of the tenant (alias r). The selection and the delete share this one
# predicate, and that is the safety. The delete re-checks exactly what the selection chose
# by, so a run that changed since (a newer run vanished, a lease named it) stays. The status
# lists are statuses.FINAL and statuses.ENDED_WELL, written out, and
# test_run_history_retention checks them. The keep-rules are two per-row lookups by index.
# ``OFFSET 0`` keeps PostgreSQL from turning an EXISTS into a join, since a hash join would
# read all of job_run. Two lookups, rather than one per rule, keep its estimate of the rows
# they pass realistic. So the plan walks ix_job_run_retention in order and stops at the
# batch size.
PRUNABLE_RUN = """
    split_part(r.scope, '/', 1) = :tenant
    AND r.finished_at < now() - make_interval(days => CAST(:days AS integer))
    AND r.status IN ('success', 'partial_success', 'failed', 'timeout', 'cancelled', 'skipped',
                     'no_work')
    -- a later run of the same job and scope started and finished after it (so it is not
    -- the latest), and a later success if it is the last success (ix_job_run_history)
    AND EXISTS (SELECT FROM job_run n
                 WHERE n.job_name = r.job_name AND n.scope = r.scope
                   AND n.started_at > r.started_at AND n.finished_at > r.finished_at
                   AND (r.mode <> 'execute' OR r.status NOT IN ('success', 'no_work')
                        OR (n.mode = 'execute' AND n.status IN ('success', 'no_work')))
                OFFSET 0)
    -- not named by a held lease (its primary key) nor by a business record that says
    -- which run made it (each indexed by job_run_id)
    AND NOT EXISTS (SELECT FROM job_lease l
                     WHERE l.job_name = r.job_name AND l.scope = r.scope
                       AND l.job_run_id = r.id AND l.expires_at > clock_timestamp()
                    UNION ALL
                    SELECT FROM reconciliation_result x WHERE x.job_run_id = r.id
                    UNION ALL
                    SELECT FROM temp_file_tombstone x WHERE x.job_run_id = r.id
                    UNION ALL
                    SELECT FROM audit_archive_manifest x WHERE x.job_run_id = r.id
                    OFFSET 0)
"""

# A prunable checkpoint of the tenant (alias c) is old, and nobody is working on its scope.
# Its scope has no unexpired lease (by primary key) and no active run (by ix_job_run_active,
# whose predicate the literal statuses.ACTIVE implies). Each is one per-row lookup. The
# selection and the delete share it, like PRUNABLE_RUN, for the same reason.
PRUNABLE_CHECKPOINT = """
    split_part(c.scope, '/', 1) = :tenant
    AND c.updated_at < now() - make_interval(days => CAST(:days AS integer))
    AND NOT EXISTS (SELECT FROM job_lease l
                     WHERE l.job_name = c.job_name AND l.scope = c.scope
                       AND l.expires_at > clock_timestamp()
                    UNION ALL
                    SELECT FROM job_run a
                     WHERE a.job_name = c.job_name AND a.scope = c.scope
                       AND a.status IN ('awaiting_approval', 'accepted', 'running')
                    OFFSET 0)
"""

# Both kinds of prunable history as (item, at, kind), the whole of it. The counts, a run's
# first batch and its last pass use it.
ALL_PRUNABLE_HISTORY = sa.text(
    f"""
    SELECT 'run:' || r.id::text AS item, r.finished_at AS at, 'job_run' AS kind
      FROM job_run r WHERE {PRUNABLE_RUN}
    UNION ALL
    SELECT 'checkpoint:' || c.job_name || ':' || c.scope, c.updated_at, 'job_checkpoint'
      FROM job_checkpoint c WHERE {PRUNABLE_CHECKPOINT}
    """
)

# The same after a position (``:after``). Each kind is its own ordered range cut at ``:cap``
# (the batch size), so a batch reads at most two batches' worth of index entries.
PRUNABLE_HISTORY_AFTER = sa.text(
    f"""
    (SELECT 'run:' || r.id::text AS item, r.finished_at AS at, 'job_run' AS kind
       FROM job_run r WHERE {PRUNABLE_RUN} AND r.finished_at > :after
      ORDER BY r.finished_at LIMIT :cap)
    UNION ALL
    (SELECT 'checkpoint:' || c.job_name || ':' || c.scope, c.updated_at, 'job_checkpoint'
       FROM job_checkpoint c WHERE {PRUNABLE_CHECKPOINT} AND c.updated_at > :after
      ORDER BY c.updated_at LIMIT :cap)
    """
)


def history_days(environ: dict[str, str] | None = None) -> int:
    """Read the retention period in days from ``QO_OPS_RUN_HISTORY_DAYS`` (default 90)."""
    return whole_number(DAYS_ENV, DEFAULT_DAYS, MIN_DAYS, MAX_DAYS, unit="days", environ=environ)


def _run_days(ctx: BatchContext) -> int:
    """Return the period checked before the run began. It stays fixed for the run."""
    return run_settings(ctx, history_days)


def _history(ctx: BatchContext, after: datetime | None = None) -> sa.Subquery:
    """Select both kinds of prunable history as (item, at, kind), all or after a position."""
    params: dict[str, Any] = {"tenant": ctx.scope.tenant_id, "days": _run_days(ctx)}
    statement = ALL_PRUNABLE_HISTORY
    if after is not None:
        statement = PRUNABLE_HISTORY_AFTER
        params |= {"after": after, "cap": ctx.limits.batch_size}
    return (
        statement.bindparams(**params)
        .columns(sa.column("item", sa.Text), sa.column("at", TS), sa.column("kind", sa.Text))
        .subquery("history")
    )


def prunable_history(ctx: BatchContext) -> sa.Select[Any]:
    """Select the tenant's runs and checkpoints past the period that may go, oldest first.

    Within a run, each batch starts after the last one (``position``). Each kind is then a
    range of its retention index, read in order and cut at the batch size. The batch does
    not walk the index entries that earlier batches left dead. The runner ends with one
    pass from the start.
    """
    position = ctx.position
    history = _history(ctx, position["at"] if position else None)
    return sa.select(history.c.item).order_by(history.c.at)


# Delete what is still prunable of the batch. The main query sees the rows as they were
# before the deletes, and returns the batch's last time, where the next batch starts.
# Twice: the deletes re-check the whole predicate (PRUNABLE_RUN, PRUNABLE_CHECKPOINT), so a
# row that changed since the selection stays and a second run deletes nothing.
PRUNE_HISTORY_BATCH = sa.text(
    f"""
    WITH keys AS (
        SELECT j, s FROM unnest(CAST(:cp_jobs AS text[]), CAST(:cp_scopes AS text[])) AS k(j, s)
    ), pruned_runs AS (
        DELETE FROM job_run r
         WHERE r.id = ANY(CAST(:run_ids AS uuid[])) AND {PRUNABLE_RUN}
        RETURNING r.finished_at
    ), pruned_checkpoints AS (
        DELETE FROM job_checkpoint c
         WHERE (c.job_name, c.scope) IN (SELECT j, s FROM keys) AND {PRUNABLE_CHECKPOINT}
        RETURNING c.updated_at
    )
    SELECT (SELECT count(*) FROM pruned_runs) AS runs,
           (SELECT min(finished_at) FROM pruned_runs) AS oldest_finished_at,
           (SELECT max(finished_at) FROM pruned_runs) AS newest_finished_at,
           (SELECT count(*) FROM pruned_checkpoints) AS checkpoints,
           (SELECT min(updated_at) FROM pruned_checkpoints) AS oldest_checkpoint_at,
           (SELECT max(updated_at) FROM pruned_checkpoints) AS newest_checkpoint_at,
           now() - make_interval(days => CAST(:days AS integer)) AS cutoff,
           greatest((SELECT max(finished_at) FROM job_run WHERE id = ANY(CAST(:run_ids AS uuid[]))),
                    (SELECT max(c.updated_at) FROM job_checkpoint c
                      WHERE (c.job_name, c.scope) IN (SELECT j, s FROM keys))) AS last_at
    """
)

_RUN_REQUESTER = sa.text("SELECT requester, correlation_id FROM job_run WHERE id = :id")


def _split(items: Sequence[Any]) -> tuple[list[str], list[str], list[str]]:
    """Split the batch's items into run ids and checkpoint (job, scope) pairs as two lists."""
    run_ids, jobs, scopes = [], [], []
    for item in items:
        if item.startswith(RUN_PREFIX):
            run_ids.append(item.removeprefix(RUN_PREFIX))
        else:
            job, _, scope = item.removeprefix(CHECKPOINT_PREFIX).partition(":")
            jobs.append(job)
            scopes.append(scope)
    return run_ids, jobs, scopes


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def prune_history_batch(conn: Connection, ctx: BatchContext, items: Sequence[Any]) -> BatchOutcome:
    """Delete the selected runs and checkpoints that are still prunable. Append one
    ``retention.prune`` audit row saying what went, as counts and times (no ids, no free
    text)."""
    days = _run_days(ctx)
    run_ids, jobs, scopes = _split(items)
    row = conn.execute(
        PRUNE_HISTORY_BATCH,
        {
            "tenant": ctx.scope.tenant_id,
            "days": days,
            "run_ids": run_ids,
            "cp_jobs": jobs,
            "cp_scopes": scopes,
        },
    ).one()
    requester = conn.execute(_RUN_REQUESTER, {"id": ctx.job_run_id}).one()
    audit.append_audit(
        conn,
        audit.AuditEntry(
            actor=requester.requester or "qo-ops",
            action=AUDIT_ACTION,
            decision="pruned",
            job_name=ctx.job_name,
            scope=ctx.scope.key,
            mode=ctx.mode,
            correlation_id=requester.correlation_id,
            job_run_id=ctx.job_run_id,
            details={
                "retention_days": days,
                "cutoff": _iso(row.cutoff),
                "runs_deleted": row.runs,
                "checkpoints_deleted": row.checkpoints,
                "runs_finished_from": _iso(row.oldest_finished_at),
                "runs_finished_to": _iso(row.newest_finished_at),
                "checkpoints_updated_from": _iso(row.oldest_checkpoint_at),
                "checkpoints_updated_to": _iso(row.newest_checkpoint_at),
            },
        ),
    )
    deleted = row.runs + row.checkpoints
    return BatchOutcome(
        succeeded=deleted,
        skipped=len(items) - deleted,  # changed since the selection (e.g. a newer run vanished)
        tally={"runs_deleted": row.runs, "checkpoints_deleted": row.checkpoints},
        position={"at": row.last_at} if row.last_at is not None else None,
    )


def _cutoff(ctx: BatchContext, minus: timedelta = timedelta(0)) -> sa.ColumnElement[Any]:
    """Return the run's cutoff less ``minus``. The cutoff is now less the period in whole days."""
    age: sa.BindParameter[timedelta] = sa.bindparam(
        "cutoff_age", timedelta(days=_run_days(ctx)) + minus
    )
    return sa.func.now() - sa.cast(age, sa.Interval)


def _counts(
    conn: Connection, ctx: BatchContext, older_than: timedelta | None = None
) -> dict[str, int]:
    """Count the prunable rows now by kind, optionally only those ``older_than`` past the cutoff."""
    history = _history(ctx)
    query = sa.select(history.c.kind, sa.func.count()).group_by(history.c.kind)
    if older_than is not None:
        query = query.where(history.c.at < _cutoff(ctx, older_than))
    found = {"job_run": 0, "job_checkpoint": 0}
    found.update({kind: int(n) for kind, n in conn.execute(query).all()})
    return found


# Declared once. Its results in check_run_history carry the same description.
NO_EXPIRED_RUN_HISTORY = CheckSpec(
    "no_expired_run_history",
    "No run or checkpoint of the tenant is past the retention period beyond grace, "
    "apart from the ones that must be kept",
)


def check_run_history(conn: Connection, ctx: BatchContext) -> list[OutcomeCheck]:
    """Check that nothing of the tenant's history is past the period beyond grace, except what
    must be kept."""
    expired = _counts(conn, ctx, GRACE)
    return [
        NO_EXPIRED_RUN_HISTORY.result(
            sum(expired.values()) == 0,
            {
                "expired_runs": expired["job_run"],
                "expired_checkpoints": expired["job_checkpoint"],
                "retention_days": _run_days(ctx),
            },
        )
    ]


def report_run_history(conn: Connection, ctx: BatchContext) -> list[ReportRow]:
    """Report what is prunable now, by table, and the period. For a dry run that is what
    execute would delete. After an execute it is what is left."""
    days = _run_days(ctx)
    word = "would be deleted" if ctx.mode == "dry_run" else "still past the period"
    rows = [ReportRow("retention", "days", days, f"cutoff: now - {days} days")]
    rows += [ReportRow("prunable", kind, n, word) for kind, n in _counts(conn, ctx).items()]
    return rows


def oldest_prunable_seconds(conn: Connection, ctx: BatchContext) -> float | None:
    """Return the seconds since the tenant's oldest prunable run or checkpoint passed the cutoff."""
    history = _history(ctx)
    value = conn.execute(
        sa.select(sa.func.extract("epoch", _cutoff(ctx) - sa.func.min(history.c.at)))
    ).scalar()
    return seconds_or_none(value)


SPEC = JobSpec(
    name="run_history_retention",
    kind="cleanup",
    description="Delete the tenant's job runs and checkpoints older than the retention period "
    "(never an active run, the latest or last successful run of a job and scope, a leased "
    "scope's, or job_audit), one audit row per batch",
    partitioning="tenant",
    eligible=prunable_history,
    transition=prune_history_batch,
    check=check_run_history,
    checks=(NO_EXPIRED_RUN_HISTORY,),
    defaults=Limits(batch_size=500),
    destructive=True,
    validate_settings=history_days,
    batching=Batching(
        locks=None,  # a union cannot be locked, and the lease keeps one run per tenant
        positions=Positions(),
    ),
    presentation=Presentation(
        outcome_asset="run_history",
        change="run or checkpoint deleted (job_audit kept)",
        healthy="No run or checkpoint older than the retention period, apart from the latest and "
        "last successful run of each job and scope, leased scopes' and runs named by business records.",
    ),
    # Daily, a quiet hour after the nightly jobs (UTC). There is no backlog sensor.
    deployment=Deployment(cron_schedule="40 4 * * *", backlog_threshold=None),
    signals=Signals(
        lag=oldest_prunable_seconds,
        report=report_run_history,
        reports_backlog=False,  # history ages out all day, and the daily run clears it
    ),
)
