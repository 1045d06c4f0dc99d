"""The run record (``job_run``), the orphan reaper, cancel requests, and the audit trail.

This module and the jobs' own modules are the only places that write these tables.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from qo_ops.db.audit import AuditEntry, append_audit
from qo_ops.db.availability import UNAVAILABLE, is_unavailable
from qo_ops.db.migrate import HEAD_REVISION
from qo_ops.db.schema import job_run
from qo_ops.errors import BadInput, error_class, one_line
from qo_ops.platform.job.counts import COLUMNS, Counts
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.outcome import RunSummary
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.job.statuses import FINAL, UNSTARTED, RunStatus
from qo_ops.platform.observability.resource import package_version
from qo_ops.platform.run.liveness import RUN_GONE

# A run's figures as its row holds them. First what it found eligible, then the Counts' columns.
COUNTERS = ("eligible_count", *COLUMNS.values())
ERROR_TEXT_LIMIT = 500


@dataclass(frozen=True)
class RunOwner:
    """Who runs a run. That is the process (host, pid and nonce, with no secrets) and the key
    of the liveness lock it holds while the run runs. With no lock the key is None, and only
    the lease's TTL judges the run."""

    owner_id: str
    liveness_key: int | None = None


def create_run(
    conn: Connection,
    job_name: str,
    scope: Scope,
    options: RunOptions,
    owner: RunOwner,
    resolved: dict[str, Any],
) -> uuid.UUID:
    """Insert the ``running`` row of a new run, or adopt the one pre-created by the API.
    This happens in the caller's transaction, and the run's audit row goes in with it."""
    values = {
        "job_name": job_name,
        "scope": scope.key,
        "window_start": scope.window_start,
        "window_end": scope.window_end,
        "mode": options.mode,
        "trigger_type": options.trigger,
        "requester": options.requester,
        "reason": options.reason,
        "correlation_id": options.correlation_id,
        "scheduled_for": options.scheduled_for,
        "dagster_run_id": options.dagster_run_id,
        "requested_at": options.requested_at,
        "retry_number": options.retry_number,
        "retries_max": options.retries_max,
        "approval_id": options.approval,
        # Which release ran it. A contract step waits for older code (qo_ops/db/migrate.py).
        "code_version": package_version(),
        "code_revision": HEAD_REVISION,
        "owner_id": owner.owner_id,
        "options": resolved,
        "status": RunStatus.RUNNING,
        "liveness_key": owner.liveness_key,
        # The lock was taken before this, so this time, on the database's clock, is after it.
        "liveness_since": None if owner.liveness_key is None else sa.func.clock_timestamp(),
    }
    if options.job_run_id is not None:
        adopted = conn.execute(
            sa.update(job_run)
            .where(job_run.c.id == options.job_run_id, job_run.c.job_name == job_name)
            .where(job_run.c.status == RunStatus.ACCEPTED)
            .values(
                **{**values, "requested_at": job_run.c.created_at},  # the API's acceptance
                started_at=sa.func.clock_timestamp(),
                heartbeat_at=sa.func.clock_timestamp(),
            )
            .returning(job_run.c.id)
        ).scalar()
        if adopted is None:
            raise BadInput(
                f"job run {options.job_run_id} is not an accepted run of {job_name} "
                "(unknown, awaiting approval, already started or finished)"
            )
        return uuid.UUID(str(adopted))
    run_id = uuid.uuid4()
    conn.execute(
        sa.insert(job_run).values(
            id=run_id,
            started_at=sa.func.clock_timestamp(),
            heartbeat_at=sa.func.clock_timestamp(),
            **values,
        )
    )
    return run_id


# The job's tally, merged key by key into the run's. Each key the batch counted adds to the
# run's count of it (0 before). Other keys are kept.
_added = sa.func.jsonb_each_text(sa.bindparam("tally", type_=JSONB)).table_valued("key", "value")
_tally_added = (
    sa.select(
        sa.func.jsonb_object_agg(
            _added.c.key,
            sa.func.coalesce(sa.cast(job_run.c.tally[_added.c.key].astext, sa.BigInteger), 0)
            + sa.cast(_added.c.value, sa.BigInteger),
        )
    )
    .select_from(_added)
    .scalar_subquery()
)
# Add a batch's counters to its run's and merge its tally in, in the batch's transaction.
# Each counter is bound, and the Counts' columns are derived once.
# Twice: it never runs twice for one batch. It commits with the batch's effects or rolls
# back with them, and a retried batch is another batch with its own counters.
_ADD_COUNTS = (
    sa.update(job_run)
    .where(job_run.c.id == sa.bindparam("run_id"))
    .values(
        {
            column: job_run.c[column] + sa.bindparam(column, type_=sa.BigInteger)
            for column in COLUMNS.values()
        }
        | {
            "tally": job_run.c.tally.op("||", return_type=JSONB)(
                sa.func.coalesce(_tally_added, sa.func.jsonb_build_object())
            ),
            "heartbeat_at": sa.func.clock_timestamp(),
        }
    )
)


def add_counts(
    conn: Connection, run_id: uuid.UUID, counts: Counts, tally: dict[str, int] | None = None
) -> None:
    """Add a batch's counters (``counts``) to its run's, and its ``tally`` to the run's key
    by key. It is one statement inside the caller's batch transaction. The statement is
    built once, because building it per batch (the tally's keys as literals) cost Python
    time on every batch (bench/TUNING.md has the figure)."""
    columns = counts.columns()
    if any(columns.values()) or tally:
        conn.execute(_ADD_COUNTS, {"run_id": run_id, "tally": tally or {}, **columns})


def set_eligible(
    engine: Engine, run_id: uuid.UUID, eligible: int, fencing_token: int | None
) -> None:
    """Record how many items the run found eligible when it started."""
    with engine.begin() as conn:
        conn.execute(
            sa.update(job_run)
            .where(job_run.c.id == run_id)
            .values(eligible_count=eligible, fencing_token=fencing_token)
        )


def finish_run(engine: Engine, summary: RunSummary, owner_id: str) -> None:
    """Write the run's final status as ``summary`` says.

    Only a ``running`` row is finished, so never twice. The one exception is a row the reaper
    ended as orphaned while its process (``owner_id``) was in fact alive, because its
    liveness session was cut. Then the run itself says how it ended. The lease the run took
    (its fencing token) and how long taking it took go on the record too."""
    assert summary.status in FINAL, summary.status
    error_text = summary.error_text
    reaped_alive = sa.and_(job_run.c.status_reason == "orphaned", job_run.c.owner_id == owner_id)
    with engine.begin() as conn:
        conn.execute(
            sa.update(job_run)
            .where(job_run.c.id == uuid.UUID(summary.job_run_id))
            .where(sa.or_(job_run.c.status == RunStatus.RUNNING, reaped_alive))
            .values(
                status=summary.status,
                status_reason=summary.status_reason,
                finished_at=sa.func.clock_timestamp(),
                last_error_code=summary.error_code,
                last_error_text=one_line(error_text, ERROR_TEXT_LIMIT) if error_text else None,
                lock_wait_ms=summary.lock_wait_ms,
                fencing_token=sa.func.coalesce(job_run.c.fencing_token, summary.fencing_token),
            )
        )


# A run is orphaned when it says `running` but its process is gone, whatever its job. Its
# liveness lock dropped (qo_ops/platform/run/liveness.py).
# A run of :job (all jobs when NULL) is also orphaned when it holds no live lease and has
# not beaten its heartbeat for a whole grace period. The grace lets a fresh run acquire
# first. This covers the runs liveness cannot judge, such as a run of older code or a lock
# from before a database restart.
# Twice: a reaped run is `failed`, no longer `running`, so a second reaper matches nothing.
_REAP = sa.text(
    f"""
    UPDATE job_run r
       SET status = 'failed', status_reason = 'orphaned', finished_at = clock_timestamp(),
           last_error_code = 'orphaned',
           last_error_text = 'run stopped without finishing (process killed or lost); reaped'
     WHERE r.status = 'running'
       AND ({RUN_GONE}
            OR ((CAST(:job AS text) IS NULL OR r.job_name = :job)
                AND r.heartbeat_at < clock_timestamp() - make_interval(secs => :grace)
                AND NOT EXISTS (SELECT 1 FROM job_lease l
                                 WHERE l.job_name = r.job_name AND l.scope = r.scope
                                   AND l.job_run_id = r.id
                                   AND l.expires_at > clock_timestamp())))
    RETURNING r.id
    """
)


def reap_orphans(
    engine: Engine, job_name: str | None = None, grace_s: float = 30.0
) -> list[uuid.UUID]:
    """Turn orphaned ``running`` rows into ``failed``/``orphaned``, and return their ids.

    These are the rows of a gone process (any job), and the rows of ``job_name`` (every job
    when None) whose heartbeat and lease lapsed ``grace_s`` ago."""
    with engine.begin() as conn:
        return list(conn.execute(_REAP, {"job": job_name, "grace": grace_s}).scalars())


@dataclass(frozen=True)
class AcceptedRun:
    """A run the API accepted. It says what its Dagster run must do when its op starts."""

    id: uuid.UUID
    job_name: str
    scope: Scope
    mode: str
    requester: str | None
    reason: str | None
    correlation_id: str | None
    options: dict[str, Any]
    approval: str | None = None  # the approval the API granted or the request cited


def load_accepted(engine: Engine, run_id: uuid.UUID, job_name: str) -> AcceptedRun:
    """The accepted, not yet started run ``run_id`` of ``job_name``. Raises BadInput if none."""
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(job_run).where(
                job_run.c.id == run_id,
                job_run.c.job_name == job_name,
                job_run.c.status == RunStatus.ACCEPTED,
            )
        ).first()
    if row is None:
        raise BadInput(
            f"job run {run_id} is not an accepted run of {job_name} "
            "(unknown, awaiting approval, already started or finished)"
        )
    return AcceptedRun(
        id=row.id,
        job_name=row.job_name,
        scope=Scope.parse(row.scope),
        mode=row.mode,
        requester=row.requester,
        reason=row.reason,
        correlation_id=row.correlation_id,
        options=dict(row.options or {}),
        approval=row.approval_id,
    )


def finish_unstarted(
    conn: Connection,
    run_id: uuid.UUID,
    status: RunStatus,
    reason: str,
    error_code: str | None = None,
    error_text: str | None = None,
) -> bool:
    """End a run that never started (accepted or awaiting approval). False if it had started."""
    assert status in FINAL, status
    done = conn.execute(
        sa.update(job_run)
        .where(job_run.c.id == run_id, job_run.c.status.in_(UNSTARTED))
        .values(
            status=status,
            status_reason=reason,
            finished_at=sa.func.clock_timestamp(),
            last_error_code=error_code,
            last_error_text=one_line(error_text, ERROR_TEXT_LIMIT) if error_text else None,
        )
        .returning(job_run.c.id)
    ).first()
    return done is not None


def request_cancel(
    engine: Engine,
    run_id: uuid.UUID,
    requester: str,
    reason: str,
    *,
    request_id: str | None = None,
    client_address: str | None = None,
) -> str:
    """Ask a running run to stop after its current batch, or end a run that has not started
    yet as ``cancelled``. The request is audited. Returns the status the run had."""
    with engine.begin() as conn:
        row = conn.execute(
            sa.select(job_run.c.job_name, job_run.c.scope, job_run.c.mode, job_run.c.status)
            .where(job_run.c.id == run_id)
            .with_for_update()
        ).first()
        if row is None:
            raise BadInput(f"no job run {run_id}")
        decision = (
            "requested" if row.status == RunStatus.RUNNING else f"ignored: run is {row.status}"
        )
        if row.status in UNSTARTED:
            finish_unstarted(conn, run_id, RunStatus.CANCELLED, "cancelled before start")
            decision = "cancelled before start"
        if row.status == RunStatus.RUNNING:
            conn.execute(
                sa.update(job_run)
                .where(job_run.c.id == run_id)
                .values(cancel_requested_at=sa.func.clock_timestamp())
            )
        append_audit(
            conn,
            AuditEntry(
                actor=requester,
                action="cancel",
                job_name=row.job_name,
                scope=row.scope,
                mode=row.mode,
                reason=reason,
                decision=decision,
                job_run_id=run_id,
                request_id=request_id,
                client_address=client_address,
            ),
        )
        status: str = row.status
        return status


@dataclass(frozen=True)
class RunRow:
    """A run as stored, for status and history."""

    id: uuid.UUID
    job_name: str
    scope: str
    mode: str
    trigger_type: str
    status: str
    status_reason: str | None  # why it ended as it did (the runner's words)
    requester: str | None
    reason: str | None  # why it was asked for (the requester's words)
    correlation_id: str | None
    dagster_run_id: str | None
    started_at: datetime
    finished_at: datetime | None
    eligible_count: int
    processed_count: int
    succeeded_count: int
    failed_count: int
    skipped_count: int
    last_error_code: str | None
    tally: dict[str, int] | None = None  # job-specific counts and the downstream's manners


def list_runs(
    engine: Engine,
    job_name: str | None,
    scope: str | None = None,
    limit: int = 20,
    since_s: float | None = None,
) -> list[RunRow]:
    """The most recent runs of a job, or of every job (``job_name`` None), newest first.

    ``scope`` limits them to one tenant: its scope and, for windowed jobs, every window of
    it. ``since_s`` keeps only those asked for in the last ``since_s`` seconds, by
    ``created_at`` (ix_job_run_created)."""
    query = (
        sa.select(*(job_run.c[f] for f in RunRow.__dataclass_fields__))
        .order_by(job_run.c.started_at.desc())
        .limit(limit)
    )
    if job_name is not None:
        query = query.where(job_run.c.job_name == job_name)
    if scope is not None:
        query = query.where(
            sa.or_(job_run.c.scope == scope, job_run.c.scope.startswith(f"{scope}/"))
        )
    if since_s is not None:
        query = query.where(
            job_run.c.created_at >= sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, since_s)
        )
    with engine.connect() as conn:
        return [RunRow(**row._mapping) for row in conn.execute(query)]


def running_run_by_prefix(engine: Engine, prefix: str) -> uuid.UUID:
    """The one running run whose id starts with ``prefix`` (the short id ``qo-ops runs``
    shows). Raises BadInput when no running run, or more than one, has such an id."""
    with engine.connect() as conn:
        # status = 'running' uses the partial index ix_job_run_running, a few rows at most
        found = (
            conn.execute(
                sa.select(job_run.c.id)
                .where(job_run.c.status == RunStatus.RUNNING)
                .where(sa.cast(job_run.c.id, sa.Text).startswith(prefix, autoescape=True))
                .limit(2)
            )
            .scalars()
            .all()
        )
    if not found:
        raise BadInput(f"no running run has an id starting {prefix!r}: give the whole run id")
    if len(found) > 1:
        raise BadInput(f"several running runs have ids starting {prefix!r}: give more of it")
    return uuid.UUID(str(found[0]))


def mark_failed(summary: RunSummary, exc: BaseException) -> None:
    """Mark a run that ends on ``exc`` ``failed``: its error class, and a safe one-line text."""
    summary.status = RunStatus.FAILED
    summary.error_code = UNAVAILABLE if is_unavailable(exc) else run_error_class(exc)
    summary.status_reason = summary.error_code
    summary.error_text = one_line(
        f"{type(exc).__name__}: {getattr(exc, 'orig', exc)}", ERROR_TEXT_LIMIT
    )


def run_error_class(exc: BaseException) -> str:
    """The run's error class. It is the one ``exc`` declares (a job's own stop, such as
    anomaly_threshold), else ``database_error`` or ``internal_error``."""
    return error_class(exc, "database_error" if isinstance(exc, DBAPIError) else "internal_error")


def final_status(summary: RunSummary) -> RunStatus:
    """How a run's batches ended, judged by their counters."""
    counts = summary.counts
    if counts.processed == 0:
        return RunStatus.NO_WORK
    if counts.failed == 0:
        return RunStatus.SUCCESS
    if counts.succeeded > 0:
        return RunStatus.PARTIAL_SUCCESS
    summary.error_code = summary.error_code or "items_failed"
    return RunStatus.FAILED
