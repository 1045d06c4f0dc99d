"""The one runner every trigger calls: ``run_job(spec, scope, options) -> RunSummary``.

    reap orphans -> lease -> bounded batches (guard, select, transition, checkpoint,
    counters: one transaction each) -> final status -> outcome check -> release

A run stops between batches when its deadline passes (``timeout``), when it is asked to
(``cancelled``: a flag on its job_run row, or SIGTERM/SIGINT), or when its lease is gone
(``failed``/``lease_lost``); whatever committed stays, and a rerun carries on from there.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from qo_ops.config import number
from qo_ops.db.availability import (
    UNAVAILABLE,
    db_retry_s,
    is_unavailable,
    retry_while_unavailable,
)
from qo_ops.db.schema import job_checkpoint
from qo_ops.errors import BadInput, DatabaseUnavailable, one_line
from qo_ops.platform import runs
from qo_ops.platform.consent import check_reason_is_new
from qo_ops.platform.control import JobSuspended, suspension_for
from qo_ops.platform.counts import Counts
from qo_ops.platform.faults import crash_point, hold_point
from qo_ops.platform.lease import Heartbeat, Lease, LeaseLost, acquire
from qo_ops.platform.manners import is_manners_key, manners_rows
from qo_ops.platform.missed import scope_busy_at
from qo_ops.platform.signals import ITEM_RETRY_EXHAUSTED, ITEM_RETRY_PREFIX
from qo_ops.platform.spec import (
    CHECKPOINT_RESETS,
    CHECKPOINT_UPDATES,
    BatchContext,
    BatchOutcome,
    ExecuteRefused,
    JobSpec,
    Limits,
    ReportRow,
    RunOptions,
    RunSummary,
    Scope,
    check_consent,
)
from qo_ops.platform.stopping import TERMINATED, StopSignals, Terminated, stop_grace_s
from qo_ops.platform.telemetry import METRICS, EventContext, JobMetrics
from qo_ops.platform.tenants import tenant_exists
from qo_ops.platform.tracing import span

log = logging.getLogger(__name__)


def owner_identity() -> str:
    """Who holds a lease: host, process and a per-process nonce (no secrets)."""
    return f"{socket.gethostname()}:{os.getpid()}:{_PROCESS_NONCE}"


_PROCESS_NONCE = uuid.uuid4().hex[:8]


def validate_request(engine: Engine, spec: JobSpec, scope: Scope, options: RunOptions) -> object:
    """Reject a run that cannot be right, before anything is written; returns the job's
    settings (``JobSpec.validate_settings``), which the run then uses (``run_settings``)."""
    options.validated()
    check_consent(options, destructive=spec.destructive, job_name=spec.name)
    check_reason_is_new(engine, spec.name, options)  # a Launchpad relaunch's copied reason
    drift_warn_s(), db_retry_s()  # the runner's own settings, read again when needed
    settings = spec.validate_settings() if spec.validate_settings is not None else None
    windowed = spec.partitioning == "tenant_day"
    if windowed and scope.window_start is None:
        raise BadInput(f"{spec.name} is windowed: give --date or --from/--to")
    if not windowed and scope.window_start is not None:
        raise BadInput(f"{spec.name} is not windowed: drop --date/--from/--to")
    with engine.connect() as conn:
        known = tenant_exists(conn, scope.tenant_id)
    if not known:
        raise BadInput(f"unknown tenant {scope.tenant_id}")
    return settings


DRIFT_WARN_ENV = "QO_OPS_DRIFT_WARN_S"
DEFAULT_DRIFT_WARN_S = 300.0


def drift_warn_s() -> float:
    """Above this many seconds late, a scheduled run logs job.scheduler.drift.detected
    (``QO_OPS_DRIFT_WARN_S``; a bad value is refused before a run starts)."""
    return number(DRIFT_WARN_ENV, DEFAULT_DRIFT_WARN_S, 0.001, 86400.0, unit="seconds")


def _drift_reason(
    engine: Engine, spec: JobSpec, scope: Scope, run_id: uuid.UUID, tick: datetime
) -> str:
    """Why a scheduled run starts late, as far as the run records tell: another run of the
    scope was running at its tick (it waited behind it), or nothing recorded explains it
    (the daemon, the run queue or the run worker's start was slow)."""
    with engine.connect() as conn:
        behind = scope_busy_at(conn, spec.name, scope.key, tick, other_than=run_id)
    return "previous_run_active" if behind else "start_delayed"


def _drift_s(options: RunOptions) -> float | None:
    """How late a scheduled run starts after its tick (UTC clocks), or None."""
    if options.scheduled_for is None:
        return None
    return (datetime.now(UTC) - options.scheduled_for).total_seconds()


def _audit_trigger(
    conn: Connection,
    spec: JobSpec,
    scope: Scope,
    options: RunOptions,
    decision: str,
    run_id: uuid.UUID | None,
    details: dict[str, Any],
) -> None:
    """The audit row of a run being started (or refused) for ``options.requester``."""
    trigger: dict[str, str] = {"trigger": options.trigger}
    if options.dagster_run_id:
        trigger["dagster_run_id"] = options.dagster_run_id
    runs.append_audit(
        conn,
        actor=options.requester or "unknown",
        action="trigger",
        decision=decision,
        job_name=spec.name,
        scope=scope.key,
        mode=options.mode,
        reason=options.reason,
        correlation_id=options.correlation_id,
        job_run_id=run_id,
        details={**trigger, **details},
    )


def _refuse_if_suspended(engine: Engine, spec: JobSpec, scope: Scope, options: RunOptions) -> None:
    """A suspended job starts no run, whatever triggered it; the refusal is audited."""
    with engine.begin() as conn:
        found = suspension_for(conn, spec.name, scope.tenant_id)
        if found is None:
            return
        _audit_trigger(
            conn, spec, scope, options, "denied", options.job_run_id,
            {"refused": "suspended", "trigger": options.trigger, **found.as_dict()},
        )  # fmt: skip
    raise JobSuspended(f"{found.describe()}; nothing was run (resume: qo-ops resume)")


def _load_cursor(engine: Engine, spec: JobSpec, scope: Scope) -> dict[str, Any] | None:
    with engine.connect() as conn:
        return conn.execute(
            sa.select(job_checkpoint.c.cursor).where(
                job_checkpoint.c.job_name == spec.name, job_checkpoint.c.scope == scope.key
            )
        ).scalar()


def _save_cursor(
    conn: Connection, spec: JobSpec, scope: Scope, run_id: uuid.UUID, cursor: dict[str, Any]
) -> None:
    stmt = sa.dialects.postgresql.insert(job_checkpoint).values(
        job_name=spec.name,
        scope=scope.key,
        cursor=cursor,
        job_run_id=run_id,
        updated_at=sa.func.clock_timestamp(),
    )
    conn.execute(
        stmt.on_conflict_do_update(
            index_elements=["job_name", "scope"],
            set_={
                "cursor": stmt.excluded.cursor,
                "job_run_id": run_id,
                "updated_at": sa.func.clock_timestamp(),
            },
        )
    )


def count_eligible(conn: Connection, spec: JobSpec, ctx: BatchContext) -> int:
    """How many items the run's selection matches now (the dry-run estimate)."""
    selection = spec.eligible(ctx).order_by(None).subquery()
    return int(conn.execute(sa.select(sa.func.count()).select_from(selection)).scalar() or 0)


def select_batch(conn: Connection, spec: JobSpec, ctx: BatchContext, limit: int) -> list[Any]:
    """The next ``limit`` items, locked for this transaction (skipping ones others hold)."""
    query = spec.eligible(ctx).limit(limit)
    if spec.compete_with_skip_locked:
        query = query.with_for_update(skip_locked=True, of=spec.lock_of)
    return list(conn.execute(query).scalars().all())


@contextmanager
def _batch_transaction(conn: Connection, lease: Lease, run_id: uuid.UUID) -> Iterator[str | None]:
    """One batch's transaction on the run's connection; yields why the run must stop (a
    cancel asked, the job suspended), or None."""
    with conn.begin():
        # a holder frozen mid-transaction is cut off by the server, releasing its locks
        conn.exec_driver_sql(
            f"SET LOCAL idle_in_transaction_session_timeout = '{int(lease.ttl_s * 1000)}ms'"
        )
        yield lease.guard(conn, run_id)


def run_job(
    spec: JobSpec,
    scope: Scope,
    options: RunOptions,
    *,
    engine: Engine,
    metrics: JobMetrics = METRICS,
) -> RunSummary:
    """Run ``spec`` over ``scope`` once, safely; see the module docstring for the shape.

    Whatever happens after the run record is written -- SIGTERM/SIGINT at any point, the
    database restarting, a bug -- the record is finished and the lease given back before
    this returns (or re-raises a foreign interrupt, e.g. Dagster's)."""
    with StopSignals(stop_grace_s()) as stop:  # a signal before the record: nothing written
        try:
            settings = validate_request(engine, spec, scope, options)
        except ExecuteRefused as refused:  # a person's execute without consent: on record
            with stop.deferred(), engine.begin() as conn:
                _audit_trigger(
                    conn, spec, scope, options, "denied", options.job_run_id,
                    {"refused": refused.error_code, "cause": str(refused)},
                )  # fmt: skip
            raise
        _refuse_if_suspended(engine, spec, scope, options)
        limits = spec.defaults.overridden_by(options)
        started = time.monotonic()
        owner = owner_identity()
        with stop.deferred():
            run_id = runs.create_run(engine, spec.name, scope, options, owner, limits.as_dict())
        ctx = BatchContext(
            spec.name, scope, options.mode, run_id, limits=limits, settings=settings, stop=stop
        )
        summary = RunSummary(
            job_run_id=str(run_id),
            job_name=spec.name,
            status="running",
            mode=options.mode,
            scope=scope.key,
            trigger=options.trigger,
            requester=options.requester,
        )
        events = EventContext(
            job_name=spec.name,
            run_id=str(run_id),
            trigger=options.trigger,
            scope=scope.tenant_id,
            mode=options.mode,
            window_start=scope.window_start.isoformat() if scope.window_start else None,
            window_end=scope.window_end.isoformat() if scope.window_end else None,
            progress_interval_s=options.progress_interval_s,
        )
        root_attributes = {
            "job.name": spec.name,
            "job.run_id": str(run_id),
            "job.trigger": options.trigger,
            "job.mode": options.mode,
            "job.scope": scope.key,
        }
        foreign: BaseException | None = None
        with span(f"Job {spec.name}", **root_attributes) as root:
            try:
                _run(engine, spec, ctx, options, limits, owner, summary, events, metrics)
            except Terminated:
                _stopped_by_signal(summary, "")
            except Exception as exc:  # a failure outside the batches: still a finished record
                _failed(summary, exc)
            except BaseException as exc:  # interrupted by the caller (Dagster terminating the
                # run): the record still gets the batches' outcome before this goes on
                foreign = exc
                if summary.status == "running":
                    summary.status = "cancelled"
                summary.status_reason = summary.status_reason or "interrupted"
            summary.duration_ms = int((time.monotonic() - started) * 1000)  # checks included
            with stop.deferred():
                _finish(engine, run_id, summary, stop)
            _record_metrics(metrics, spec, summary, time.monotonic() - started)
            events.emit(
                "job.finished",
                logging.INFO
                if summary.status in ("success", "no_work", "skipped")
                else logging.WARNING,
                **{
                    "job.status": summary.status,
                    "job.status_reason": summary.status_reason,
                    "duration_ms": summary.duration_ms,
                    "items.eligible": summary.eligible_count,
                    **summary.counts.event_fields(),
                    "tally": summary.tally or None,
                    "error.class": summary.error_code,
                    "checks.failed": [c.name for c in summary.checks if not c.passed],
                    **({"stop.signal": stop.signal_name} if stop.requested else {}),
                },
            )
            root.set_attribute("job.status", summary.status)
            root.set_attribute("items.processed", summary.counts.processed)
            root.set_attribute("items.failed", summary.counts.failed)
        if foreign is not None:
            raise foreign
    return summary


def _run(
    engine: Engine,
    spec: JobSpec,
    ctx: BatchContext,
    options: RunOptions,
    limits: Limits,
    owner: str,
    summary: RunSummary,
    events: EventContext,
    metrics: JobMetrics,
) -> None:
    """Everything between the run record's creation and its end: audit, start events,
    orphans, the work (dry run or batches), then the outcome checks."""
    run_id = ctx.job_run_id
    if options.person_behind and options.job_run_id is None:  # API runs: audited on accept
        with ctx.stop.deferred(), engine.begin() as conn:
            _audit_trigger(
                conn, spec, ctx.scope, options, "allowed", run_id, {"limits": limits.as_dict()}
            )
    metrics.started.labels(spec.name).inc()
    drift_s = _drift_s(options)
    events.emit(
        "job.started", scheduled_for=options.scheduled_for, limits=limits.as_dict(),
        **({"scheduler.drift_s": round(drift_s, 3)} if drift_s is not None else {}),
    )  # fmt: skip
    if drift_s is not None and drift_s > drift_warn_s():
        assert options.scheduled_for is not None
        events.emit(
            "job.scheduler.drift.detected",
            logging.WARNING,
            scheduled_for=options.scheduled_for,
            reason=_drift_reason(engine, spec, ctx.scope, run_id, options.scheduled_for),
            **{
                "scheduler.drift_s": round(drift_s, 3),
                "scheduler.drift_warn_s": drift_warn_s(),
            },
        )
    with ctx.stop.deferred():
        reaped = runs.reap_orphans(engine, spec.name, grace_s=limits.lease_ttl_s)
    if reaped:
        events.emit(
            "job.orphans.reaped",
            logging.WARNING,
            count=len(reaped),
            run_ids=[str(r) for r in reaped],
        )

    if options.mode == "dry_run" and not spec.dry_run_scans:
        _dry_run(engine, spec, ctx, options, summary)
    else:
        _execute(engine, spec, ctx, options, limits, owner, summary, events, metrics)
    crash_point("before_finalize")
    if (
        summary.status in ("skipped", "running")
        or summary.error_code == UNAVAILABLE
        or ctx.stop.requested
    ):
        return  # nothing was done, or the checks cannot run now: nothing to check
    try:
        hold_point("before_finalize")  # the outcome-check phase, as far as a signal knows
        with engine.connect() as conn:
            summary.checks = spec.check(conn, ctx)
            lag = spec.lag(conn, ctx) if spec.lag else None
            summary.oldest_due_age_s = lag
            _after_run(conn, spec, ctx, limits, summary)
        metrics.lag.labels(spec.name).set(lag or 0.0)
    except Terminated:
        summary.checks = []
        _stopped_by_signal(summary, " during outcome checks")
        raise
    except Exception as exc:
        if not is_unavailable(exc):
            raise
        summary.checks = []  # the work is recorded; its checks wait for the next run
        summary.status_reason = (
            summary.status_reason or "outcome checks skipped: database unavailable"
        )
    except BaseException:
        summary.status_reason = summary.status_reason or "interrupted during outcome checks"
        raise


def _stopped_by_signal(summary: RunSummary, where: str) -> None:
    """A run stopped by SIGTERM/SIGINT: ``cancelled``/``terminated``, unless its work was
    already over (then it keeps that status, and the reason says what was cut short)."""
    if summary.status == "running":
        summary.status, summary.status_reason = "cancelled", TERMINATED
    else:
        summary.status_reason = summary.status_reason or f"{TERMINATED}{where}"


def _failed(summary: RunSummary, exc: BaseException) -> None:
    """A run that ends on an error: ``failed``, with its class and a safe one-line text."""
    summary.status = "failed"
    summary.error_code = UNAVAILABLE if is_unavailable(exc) else _error_class(exc)
    summary.status_reason = summary.error_code
    summary.error_text = one_line(
        f"{type(exc).__name__}: {getattr(exc, 'orig', exc)}", runs.ERROR_TEXT_LIMIT
    )
    log.debug("run failed", exc_info=True)


def _finish(engine: Engine, run_id: uuid.UUID, summary: RunSummary, stop: StopSignals) -> None:
    """Write the run's final record, riding out a database restart for a bounded time (the
    stop grace, when stopping); if the database never comes back, the reaper ends it."""
    limit = min(db_retry_s(), stop.remaining_s()) if stop.requested else db_retry_s()
    try:
        retry_while_unavailable(
            lambda: runs.finish_run(
                engine,
                run_id,
                summary.status,
                summary.status_reason,
                summary.error_code,
                summary.error_text,
                summary.lock_wait_ms,
                summary.fencing_token,
            ),  # fmt: skip
            limit_s=limit,
            what="finishing the run record",
        )
    except DBAPIError as exc:
        if not is_unavailable(exc):
            raise
        raise DatabaseUnavailable(
            f"the database did not come back within {limit:.0f} s: run {run_id} ended "
            f"{summary.status} but its record says running until the reaper ends it "
            f"(qo-ops reap)",
            exit_code=1,
        ) from None


def _cursor_text(cursor: Any) -> str | None:
    return (
        None if cursor is None else one_line(json.dumps(cursor, default=str, sort_keys=True), 200)
    )


def _after_run(
    conn: Connection, spec: JobSpec, ctx: BatchContext, limits: Limits, summary: RunSummary
) -> None:
    """What the run left behind, for its report: backlog, checkpoint, the report rows."""
    if spec.uses_checkpoint:
        saved = conn.execute(
            sa.select(
                job_checkpoint.c.cursor,
                sa.func.extract("epoch", sa.func.clock_timestamp() - job_checkpoint.c.updated_at),
            ).where(job_checkpoint.c.job_name == spec.name, job_checkpoint.c.scope == ctx.scope.key)
        ).first()
        if saved is not None:
            summary.checkpoint_after = _cursor_text(saved[0])
            summary.checkpoint_age_s = float(saved[1])
    elif not spec.dry_run_scans:  # a selection of what is due: what is still due is backlog
        fresh = BatchContext(
            spec.name, ctx.scope, ctx.mode, ctx.job_run_id, limits=limits, settings=ctx.settings
        )
        summary.backlog = (
            summary.eligible_count if ctx.mode == "dry_run" else count_eligible(conn, spec, fresh)
        )
    if spec.dead_letters is not None:
        summary.dead_letters = spec.dead_letters(conn)
    summary.report = [asdict(row) for row in build_report(conn, spec, ctx, summary)]


REPORT_SAMPLE = 20  # sample rows of a dry run's report


def build_report(
    conn: Connection, spec: JobSpec, ctx: BatchContext, summary: RunSummary
) -> list[ReportRow]:
    """The run's report table: a dry run's sample with the change execute would make, the
    counters, the job's own tallies and rows, its calls to the downstream (retry pressure,
    rate limiting, breaker), and the checks."""
    rows: list[ReportRow] = []
    change = spec.change or "changed"
    if summary.mode == "dry_run":
        rows.append(ReportRow("would_change", change, summary.eligible_count))
        rows += [ReportRow("sample", i, 1, change) for i in summary.sample_ids[:REPORT_SAMPLE]]
    else:
        rows += [
            ReportRow("items", k, v, change if k == "changed" else "")
            for k, v in summary.counts.report_items().items()
        ]
    for key, value in sorted(summary.tally.items()):
        if not is_manners_key(key):
            rows.append(_tally_row(key, value))
    rows += manners_rows(summary.tally, summary.error_code, summary.status_reason)
    if spec.report is not None:
        rows += spec.report(conn, ctx)
    words = ("met now", "not met now") if summary.mode == "dry_run" else ("passed", "FAILED")
    rows += [
        ReportRow("check", c.name, int(c.passed), words[0] if c.passed else words[1])
        for c in summary.checks
    ]
    return rows


def _tally_row(key: str, value: int) -> ReportRow:
    """A tally counter as a report row; ``outcome.<class>.attempt_<n>.<state>`` (calls to
    another system) becomes an outcome row by error class and attempt, and side-effect
    counts a row per side effect and result (or ambiguity reason)."""
    parts = key.split(".")
    if len(parts) == 4 and parts[0] == "outcome" and parts[2].startswith("attempt_"):
        attempt = parts[2].removeprefix("attempt_")
        return ReportRow("outcome", parts[1], value, f"attempt {attempt} → {parts[3]}")
    if len(parts) == 3 and parts[0] == "side_effect":
        return ReportRow("side_effect", parts[1], value, parts[2])
    if len(parts) == 2 and parts[0] == "side_effect_ambiguity":
        return ReportRow("side_effect_ambiguity", parts[1], value)
    if key.startswith(ITEM_RETRY_PREFIX):
        return ReportRow(
            "retry", key.removeprefix(ITEM_RETRY_PREFIX), value, "item retry scheduled"
        )
    if key == ITEM_RETRY_EXHAUSTED:
        return ReportRow("retry_exhausted", "item", value, "dead-lettered after its last attempt")
    return ReportRow("tally", key, value)


def _dry_run(
    engine: Engine, spec: JobSpec, ctx: BatchContext, options: RunOptions, summary: RunSummary
) -> None:
    """Count and sample exactly what execute would select; write nothing but the run row."""
    if spec.uses_checkpoint:  # what execute would do next starts at the checkpoint
        ctx.cursor = _load_cursor(engine, spec, ctx.scope)
        summary.checkpoint_before = _cursor_text(ctx.cursor)
    with engine.connect() as conn:
        summary.eligible_count = count_eligible(conn, spec, ctx)
        sample = conn.execute(spec.eligible(ctx).limit(options.sample_size)).scalars()
        summary.sample_ids = [str(v) for v in sample]
    runs.set_eligible(engine, uuid.UUID(summary.job_run_id), summary.eligible_count, None)
    summary.status = "success" if summary.eligible_count else "no_work"


def _execute(
    engine: Engine,
    spec: JobSpec,
    ctx: BatchContext,
    options: RunOptions,
    limits: Limits,
    owner: str,
    summary: RunSummary,
    events: EventContext,
    metrics: JobMetrics,
) -> None:
    run_id = ctx.job_run_id
    with (
        span("lease.acquire", **{"lock.name": f"{spec.name}:{ctx.scope.key}"}) as acquiring,
        ctx.stop.deferred(),  # taken or not, never half: the token must reach us
    ):
        asked = time.monotonic()
        lease = acquire(engine, spec.name, ctx.scope.key, owner, limits.lease_ttl_s, run_id)
        summary.lock_wait_ms = int((time.monotonic() - asked) * 1000)
        acquiring.set_attribute("lock.acquired", lease is not None)
    if lease is None:
        if ctx.stop.requested:  # asked to stop while waiting for the lease
            summary.status, summary.status_reason = "cancelled", TERMINATED
            return
        metrics.lock_failed.labels(spec.name).inc()
        events.emit(
            "job.lock.acquire.failed",
            logging.WARNING,
            **{"lock.name": f"{spec.name}:{ctx.scope.key}", "wait_ms": summary.lock_wait_ms},
        )
        summary.status, summary.status_reason = "skipped", "lease-not-acquired"
        return
    events.emit(
        "job.lock.acquire.succeeded",
        **{
            "lock.name": f"{spec.name}:{ctx.scope.key}",
            "lock.ttl_ms": int(lease.ttl_s * 1000),
            "lock.fencing_token": lease.fencing_token,
            "wait_ms": summary.lock_wait_ms,
        },
    )
    summary.fencing_token = lease.fencing_token
    heartbeat = Heartbeat(engine, lease, run_id).start()
    deadline = time.monotonic() + limits.deadline_s
    try:
        crash_point("after_lease_acquire")
        hold_point("after_lease_acquire")
        if spec.uses_checkpoint:
            ctx.cursor = _load_cursor(engine, spec, ctx.scope)
            summary.checkpoint_before = _cursor_text(ctx.cursor)
        with engine.connect() as conn:
            summary.eligible_count = count_eligible(conn, spec, ctx)
        with ctx.stop.deferred():
            runs.set_eligible(engine, run_id, summary.eligible_count, lease.fencing_token)
        _batches(engine, spec, ctx, limits, lease, heartbeat, deadline, summary, events, metrics)
    except LeaseLost as exc:
        summary.status, summary.status_reason, summary.error_code = (
            "failed",
            "lease_lost",
            "lease_lost",
        )
        summary.error_text = str(exc)
        events.emit("job.lock.lost", logging.ERROR, **{"lock.name": f"{spec.name}:{ctx.scope.key}"})
    except Exception as exc:  # any failure ends the run as failed, with a safe one-line reason
        _failed(summary, exc)
        if summary.error_code != UNAVAILABLE and not _still_held(engine, lease):
            summary.error_code = summary.status_reason = "lease_lost"
    finally:  # on a signal too: the lease goes back before the run is recorded as ended
        heartbeat.stop()
        with ctx.stop.deferred():
            _release(engine, lease, ctx.stop, events)
    if summary.status == "running":
        summary.status = _final_status(summary)


def _release(engine: Engine, lease: Lease, stop: StopSignals, events: EventContext) -> None:
    """Give the lease back, riding out a database restart for a bounded time; if the
    database stays away, the lease expires by itself (its TTL)."""
    limit = min(db_retry_s(), stop.remaining_s()) if stop.requested else db_retry_s()
    try:
        retry_while_unavailable(
            lambda: lease.release(engine), limit_s=limit, what="giving the lease back"
        )
    except DBAPIError:
        return  # it expires by itself
    events.emit("job.lock.released", **{"lock.name": f"{lease.job_name}:{lease.scope}"})


def _batches(
    engine: Engine,
    spec: JobSpec,
    ctx: BatchContext,
    limits: Limits,
    lease: Lease,
    heartbeat: Heartbeat,
    deadline: float,
    summary: RunSummary,
    events: EventContext,
    metrics: JobMetrics,
) -> None:
    batch_ms: list[float] = []
    try:
        with engine.connect() as conn:  # one connection for all of the run's batches
            _batch_loop(
                conn,
                spec,
                ctx,
                limits,
                lease,
                heartbeat,
                deadline,
                summary,
                events,
                metrics,
                batch_ms,
            )
    finally:
        if batch_ms:
            ordered = sorted(batch_ms)
            summary.batch_ms_p50 = round(ordered[len(ordered) // 2], 2)
            summary.batch_ms_p99 = round(
                ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 2
            )
            summary.batch_ms_max = round(ordered[-1], 2)


def _batch_loop(
    conn: Connection,
    spec: JobSpec,
    ctx: BatchContext,
    limits: Limits,
    lease: Lease,
    heartbeat: Heartbeat,
    deadline: float,
    summary: RunSummary,
    events: EventContext,
    metrics: JobMetrics,
    batch_ms: list[float],
) -> None:
    run_id, started = ctx.job_run_id, time.monotonic()
    while True:
        if heartbeat.lost.is_set():
            raise LeaseLost("heartbeat found the lease taken over or expired")
        if ctx.stop.requested:  # SIGTERM/SIGINT: every batch before this one is recorded
            summary.status, summary.status_reason = "cancelled", TERMINATED
            return
        if time.monotonic() >= deadline:
            summary.status, summary.status_reason = "timeout", "deadline reached"
            return
        room = limits.max_items - summary.counts.processed
        if room <= 0:
            summary.status_reason = "max items reached"
            return
        with (
            ctx.stop.deferred(),  # a signal waits for the batch (and its calls) to be recorded
            span(
                "batch",
                **{"batch.number": summary.batches + 1, "items.processed": 0, "items.failed": 0},
            ) as batch_span,
        ):
            batch_started = time.perf_counter()
            with _batch_transaction(conn, lease, run_id) as must_stop:
                if must_stop:  # at a batch boundary: the batches before it are all committed
                    summary.status, summary.status_reason = "cancelled", must_stop
                    return
                items = select_batch(conn, spec, ctx, min(limits.batch_size, room))
                if not items and ctx.position is not None:
                    ctx.position = None
                    continue  # one last pass from the start: rows others held locked are due too
                if not items:
                    rescan = spec.uses_checkpoint and spec.rescan_when_complete
                    if rescan and ctx.mode == "execute" and _forget_cursor(conn, spec, ctx.scope):
                        runs.add_counts(conn, run_id, Counts(), {CHECKPOINT_RESETS: 1})
                        summary.tally[CHECKPOINT_RESETS] = 1
                    return
                crash_point("after_batch_select")
                outcome = spec.transition(conn, ctx, items)
                outcome.processed = len(items)
                crash_point("before_commit")
                if spec.external is None:
                    _commit_effects(conn, spec, ctx, run_id, outcome)
            crash_point("after_commit")
            if spec.external is not None and spec.record is not None:
                results = spec.external(ctx, outcome.work)  # no transaction open, no rows locked
                crash_point("after_external_call")
                with _batch_transaction(conn, lease, run_id):
                    claimed, outcome = outcome, spec.record(conn, ctx, results)
                    outcome.processed = claimed.processed  # the claim knows what was selected
                    outcome.cursor = outcome.cursor or claimed.cursor  # and the position
                    _commit_effects(conn, spec, ctx, run_id, outcome)
            batch_ms.append((time.perf_counter() - batch_started) * 1000)
            _account(summary, outcome, spec, metrics)
            batch_span.set_attribute("items.processed", outcome.processed)  # counts, never ids
            batch_span.set_attribute("items.failed", outcome.failed)
            if outcome.position is not None:
                ctx.position = outcome.position
            if spec.uses_checkpoint and outcome.cursor is not None:
                ctx.cursor = outcome.cursor
                events.emit(
                    "job.checkpoint.updated",
                    **{"checkpoint.updated": True, "batch_number": summary.batches},
                )
            for item_id, error_class in outcome.failed_items:
                events.emit(
                    "job.item.failed",
                    logging.WARNING,
                    **{"item.id": item_id, "error.type": error_class},
                )
            for name, fields in outcome.notes:  # e.g. downstream.breaker.open
                events.emit(
                    name, logging.WARNING if name.endswith("open") else logging.INFO, **fields
                )
            elapsed = time.monotonic() - started
            events.progress(
                **{
                    "batch_number": summary.batches,
                    **summary.counts.event_fields(("processed", "succeeded", "failed")),
                    "elapsed_ms": int(elapsed * 1000),
                    "throughput_per_second": round(summary.counts.processed / elapsed, 1)
                    if elapsed
                    else None,
                }
            )
        if outcome.halt is not None:  # e.g. the downstream's breaker opened
            code, reason = outcome.halt
            if code is not None:
                summary.status, summary.error_code = "failed", code
            summary.status_reason = reason
            return
        if limits.throttle_ms and ctx.stop.event.wait(limits.throttle_ms / 1000.0):
            continue  # woken by a stop signal: the loop head ends the run as cancelled


def _commit_effects(
    conn: Connection,
    spec: JobSpec,
    ctx: BatchContext,
    run_id: uuid.UUID,
    outcome: BatchOutcome,
) -> None:
    """The rest of a batch's transaction: checkpoint and run counters."""
    if spec.uses_checkpoint and outcome.cursor is not None and ctx.mode == "execute":
        with span("checkpoint.update", **{"job.name": spec.name}):
            _save_cursor(conn, spec, ctx.scope, run_id, outcome.cursor)
        outcome.tally[CHECKPOINT_UPDATES] = outcome.tally.get(CHECKPOINT_UPDATES, 0) + 1
    runs.add_counts(conn, run_id, outcome, outcome.tally)


def _forget_cursor(conn: Connection, spec: JobSpec, scope: Scope) -> bool:
    """Delete the scope's checkpoint; whether there was one."""
    gone = conn.execute(
        sa.delete(job_checkpoint).where(
            job_checkpoint.c.job_name == spec.name, job_checkpoint.c.scope == scope.key
        )
    )
    return bool(gone.rowcount)


def _account(
    summary: RunSummary, outcome: BatchOutcome, spec: JobSpec, metrics: JobMetrics
) -> None:
    summary.batches += 1
    summary.counts += outcome
    for key, value in outcome.tally.items():
        summary.tally[key] = summary.tally.get(key, 0) + value
    metrics.items_processed.labels(spec.name).inc(outcome.processed)
    for _, error_class in outcome.failed_items:
        metrics.items_failed.labels(spec.name, error_class).inc()
    if outcome.failed and not outcome.failed_items:
        metrics.items_failed.labels(spec.name, "unknown").inc(outcome.failed)
    metrics.retry_scheduled.labels(spec.name).inc(outcome.retry_scheduled)
    metrics.deadletter.labels(spec.name).inc(outcome.deadlettered)
    metrics.duplicates_prevented.labels(spec.name).inc(outcome.duplicates_prevented)


def _final_status(summary: RunSummary) -> str:
    if summary.counts.processed == 0:
        return "no_work"
    if summary.counts.failed == 0:
        return "success"
    if summary.counts.succeeded > 0:
        return "partial_success"
    summary.error_code = summary.error_code or "items_failed"
    return "failed"


def _still_held(engine: Engine, lease: Lease) -> bool:
    try:
        return lease.still_held(engine)
    except DBAPIError:
        return False


def _error_class(exc: BaseException) -> str:
    code = getattr(exc, "error_code", None)  # a job's own stop, e.g. anomaly_threshold
    if isinstance(code, str) and code:
        return code
    if isinstance(exc, DBAPIError):
        return "database_error"
    return "internal_error"


def _record_metrics(
    metrics: JobMetrics, spec: JobSpec, summary: RunSummary, seconds: float
) -> None:
    metrics.completed.labels(spec.name, summary.status).inc()
    metrics.duration.labels(spec.name, summary.status).observe(seconds)
    if summary.status == "skipped":
        metrics.skipped.labels(spec.name).inc()
    if summary.status == "failed":
        metrics.failed.labels(spec.name, summary.error_code or "unknown").inc()
    if summary.status in ("success", "no_work"):
        metrics.last_success.labels(spec.name).set(time.time())
