"""Backfills by tenant and date range, from the UI, as chunked runs like a tick.

Dagster's own backfill dialog makes one run per partition and cannot carry run config
(dagster#10079), so 10,000 tenants would be 10,000 runs, and a windowed job's day
partitions cannot say which tenants. Instead an operator launches ``tenant_backfill_job``
from its Launchpad: the job (a drop-down), the tenants (some, or empty for all), the days
(first and last), the mode and, to execute, a reason. Its op validates all of it before
anything is claimed, audits it, and records the plan; ``tenant_backfill_sensor`` then
requests the plan's runs — one per chunk of ``tenants_per_run`` tenants (and, for a windowed
job, per window of at most ``days_per_run`` days) — each tagged ``qo_ops/backfill`` with
the launcher's run id, executing or dry-running as asked, every tenant on its own.
"""

import enum
import json
from collections.abc import Sequence
from datetime import date, datetime, timedelta
from typing import Any

import dagster as dg
from pydantic import Field

from qo_ops.dagster_defs.partitions import days_partitions_def
from qo_ops.dagster_defs.resources import QoOpsDatabase
from qo_ops.dagster_defs.run_config import Mode
from qo_ops.dagster_defs.submission import APPROVAL_TAG, BACKFILL_RUN_TAG, run_options
from qo_ops.db.audit import AuditEntry, append_audit
from qo_ops.errors import BadInput, QoOpsError, one_line
from qo_ops.platform.job.options import MAX_TEXT, ExecuteRefused, RunOptions, check_consent
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.run.consent import check_approval, requires_approval
from qo_ops.platform.schedule.partition_keys import (
    MODE_TAG,
    REASON_TAG,
    REQUESTER_TAG,
    chunk_scope_tag,
    chunk_tenants,
    chunks_of,
    windowed_key,
)
from qo_ops.platform.schedule.tenants import tenant_ids, tenants_in_chunk_order

BACKFILL_JOB = "tenant_backfill_job"
BACKFILL_OP = "plan_tenant_backfill"
MAX_DAYS_PER_RUN = 366
MAX_REQUESTS_PER_TICK = 500  # a bigger plan continues on the next tick (the cursor)
MAX_BACKFILL_RUNS = 20_000
RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"


def _backfill_config(job_names: Sequence[str]) -> type[dg.Config]:
    """The Launchpad's form: the job is a drop-down of the catalog's jobs."""
    target = enum.Enum("CatalogJob", {n: n for n in job_names})  # type: ignore[misc]

    class TenantBackfillConfig(dg.Config):
        """What to backfill. Runs are requested by tenant_backfill_sensor once this succeeds."""

        job: target = Field(description="The catalog job to run.")
        tenants: list[str] = Field(
            default_factory=list, description="Tenants to cover; empty: every tenant."
        )
        first_day: str | None = Field(
            default=None, description="Windowed jobs: the first day (YYYY-MM-DD)."
        )
        last_day: str | None = Field(
            default=None, description="Windowed jobs: the last day, included (YYYY-MM-DD)."
        )
        mode: Mode = Field(  # the catalog jobs' own mode
            default=Mode.dry_run, description="dry_run (default) or execute."
        )
        reason: str | None = Field(
            default=None, max_length=MAX_TEXT, description="Why (required to execute; audited)."
        )
        approval: str | None = Field(
            default=None,
            max_length=MAX_TEXT,
            description=(
                "Destructive jobs: the approval an execute cites (apr-…), covering every "
                "tenant of the backfill (qo-ops approval grant, or POST /internal/jobs/{job}/approvals)."
            ),
        )
        tenants_per_run: int | None = Field(
            default=None, ge=1, le=1000, description="Tenants per run (default: the job's)."
        )
        days_per_run: int = Field(
            default=31, ge=1, le=MAX_DAYS_PER_RUN, description="Windowed jobs: days per run."
        )

    return TenantBackfillConfig


def _day(name: str, value: str | None) -> date:
    try:
        return date.fromisoformat(value or "")
    except ValueError:
        raise BadInput(f"{name} must be a day (YYYY-MM-DD), got {value!r}") from None


def backfill_windows(
    spec: JobSpec, first_day: str | None, last_day: str | None, days_per_run: int, today: date
) -> list[tuple[date, date]]:
    """The windows (first, last day, both included) of a backfill; ``[]`` for a tenant job,
    which has no days. Refused: missing or reversed days, days outside the partitions."""
    if spec.partitioning != "tenant_day":
        if first_day or last_day:
            raise BadInput(f"{spec.name} is not windowed: leave first_day and last_day empty")
        return []
    first, last = _day("first_day", first_day), _day("last_day", last_day)
    start = days_partitions_def.start.date()
    if last < first:
        raise BadInput("last_day must not be before first_day")
    if first < start or last >= today:
        raise BadInput(f"days must lie from {start} (the first partition) to yesterday")
    windows = []
    while first <= last:
        end = min(first + timedelta(days=days_per_run - 1), last)
        windows.append((first, end))
        first = end + timedelta(days=1)
    return windows


def backfill_run_requests(
    spec: JobSpec,
    plan: dict[str, Any],
    tenants: Sequence[str],
    launcher_run_id: str,
    chunks: dict[str, list[str]] | None = None,
) -> list[dg.RunRequest]:
    """Every run of a backfill: one per chunk of tenants × window, deterministic run keys
    (a repeated tick requests nothing twice), each carrying mode, reason and who asked. A
    windowed job's runs follow its tenant chunks (``chunks``: key → members in order), each
    run over one window's days of one chunk (a partition range ``first|chunk..last|chunk``),
    split further when the plan asks for fewer tenants per run."""
    windows = [(date.fromisoformat(a), date.fromisoformat(b)) for a, b in plan["windows"]]
    size = plan.get("tenants_per_run")
    groups: list[tuple[str | None, list[str]]]
    if windows:
        chosen = set(tenants)
        groups = [
            (key, part)
            for key, members in (chunks or {}).items()
            for part in chunk_tenants(spec, [t for t in members if t in chosen], size)
        ]
    else:
        groups = [(None, part) for part in chunk_tenants(spec, tenants, size)]
    requests = []
    each: list[tuple[date, date] | None] = list(windows) or [None]  # a tenant job: no days
    for chunk_key, chunk in groups:
        for window in each:
            tags = {
                BACKFILL_RUN_TAG: launcher_run_id,
                MODE_TAG: plan["mode"],
                REQUESTER_TAG: plan["requester"],
                **({REASON_TAG: plan["reason"]} if plan.get("reason") else {}),
                **({APPROVAL_TAG: plan["approval"]} if plan.get("approval") else {}),
                **chunk_scope_tag(spec, chunk, window[0] if window else None),
            }
            if window is not None and chunk_key is not None:  # one run over the window's days
                tags[RANGE_START_TAG] = windowed_key(window[0], chunk_key)
                tags[RANGE_END_TAG] = windowed_key(window[1], chunk_key)
            config: dict[str, Any] = {"mode": plan["mode"], "tenants": chunk}
            for field in ("reason", "approval"):
                if plan.get(field):
                    config[field] = plan[field]
            where = f"{window[0]}..{window[1]}" if window else "tenants"
            requests.append(
                dg.RunRequest(
                    run_key=f"backfill:{launcher_run_id}:{where}:{chunk[0]}..{chunk[-1]}",
                    job_name=spec.name,
                    run_config={"ops": {f"{spec.name}_op": {"config": config}}},
                    tags=tags,
                )
            )
    return requests


def _tenants(conn: Any, named: Sequence[str]) -> list[str]:
    """The backfill's tenants: those named (each must exist), or every tenant."""
    if not named:
        return tenant_ids(conn)
    if len(set(named)) != len(named):
        raise BadInput("tenants names a tenant twice")
    known = set(tenant_ids(conn, named))
    unknown = [t for t in named if t not in known]
    if unknown:
        raise BadInput(f"unknown tenant(s): {', '.join(t[:64] for t in unknown[:20])}")
    return sorted(named)


def build_backfill_job(specs: Sequence[JobSpec]) -> dg.JobDefinition:
    """``tenant_backfill_job``: validate, audit and plan a backfill of one catalog job."""
    by_name = {s.name: s for s in specs}
    config_type = _backfill_config(list(by_name))

    @dg.op(name=BACKFILL_OP, description="Validate, audit and plan a backfill")
    def plan_tenant_backfill(
        context: dg.OpExecutionContext,
        config: config_type,  # type: ignore[valid-type]
        database: QoOpsDatabase,
    ) -> dg.Output[dict[str, Any]]:
        spec = by_name[config.job.value]  # type: ignore[attr-defined]
        mode = config.mode.value  # type: ignore[attr-defined]
        requester = run_options({}, dict(context.run.tags), context.run_id).requester
        try:
            windows = backfill_windows(
                spec,
                config.first_day,  # type: ignore[attr-defined]
                config.last_day,  # type: ignore[attr-defined]
                config.days_per_run,  # type: ignore[attr-defined]
                datetime.now().astimezone().date(),
            )
            options = RunOptions(
                mode=mode,
                trigger="backfill",
                reason=config.reason,  # type: ignore[attr-defined]
                approval=config.approval,  # type: ignore[attr-defined]
            )
            check_consent(options, destructive=spec.destructive, job_name=spec.name)
            engine = database.engine()
            with engine.begin() as conn:
                tenants = _tenants(conn, config.tenants)  # type: ignore[attr-defined]
            for tenant in tenants if requires_approval(spec, options) else ():
                check_approval(engine, spec, Scope(tenant), options)  # covers each, or none
            with engine.begin() as conn:
                size = config.tenants_per_run or spec.deployment.tenants_per_run  # type: ignore[attr-defined]
                if windows:  # a windowed job's runs follow its tenant chunks
                    chosen = set(tenants)
                    per_chunk = [
                        sum(t in chosen for t in members)
                        for members in chunks_of(tenants_in_chunk_order(conn)).values()
                    ]
                    runs = sum(-(-n // size) for n in per_chunk) * len(windows)
                else:
                    runs = -(-len(tenants) // size)
                if runs > MAX_BACKFILL_RUNS:
                    raise BadInput(
                        f"the backfill would be {runs} runs (at most {MAX_BACKFILL_RUNS}): "
                        "pick fewer tenants or days, or raise tenants_per_run/days_per_run"
                    )
                append_audit(
                    conn,
                    AuditEntry(
                        actor=requester or "unknown",
                        action="backfill",
                        decision="accepted",
                        job_name=spec.name,
                        mode=mode,
                        reason=config.reason,  # type: ignore[attr-defined]
                        correlation_id=context.run_id,
                        details={
                            "tenants": len(tenants),
                            "windows": len(windows),
                            "runs": runs,
                            "dagster_run_id": context.run_id,
                        },
                    ),
                )
        except QoOpsError as exc:  # refused before anything was claimed
            if isinstance(exc, ExecuteRefused):  # a person's execute without consent: on record
                with database.engine().begin() as conn:
                    append_audit(
                        conn,
                        AuditEntry(
                            actor=requester or "unknown",
                            action="backfill",
                            decision="denied",
                            job_name=spec.name,
                            mode=mode,
                            reason=config.reason,  # type: ignore[attr-defined]
                            correlation_id=context.run_id,
                            details={
                                "refused": exc.error_code,
                                "cause": one_line(str(exc), 300),
                                "dagster_run_id": context.run_id,
                                **({"approval": config.approval} if config.approval else {}),  # type: ignore[attr-defined]
                            },
                        ),
                    )
            raise dg.Failure(description=one_line(str(exc), 300), allow_retries=False) from None
        plan = {
            "job": spec.name,
            "mode": mode,
            "reason": config.reason,  # type: ignore[attr-defined]
            "approval": config.approval,  # type: ignore[attr-defined]
            "requester": requester,
            "tenants": config.tenants,  # type: ignore[attr-defined]  # empty: all
            "tenants_per_run": size,
            "windows": [[a.isoformat(), b.isoformat()] for a, b in windows],
        }
        context.log.info(
            f"backfill of {spec.name} ({mode}): {len(tenants)} tenants"
            + (f" × {len(windows)} window(s) {windows[0][0]}..{windows[-1][1]}" if windows else "")
            + f" → {runs} runs, requested by tenant_backfill_sensor"
        )
        return dg.Output(
            plan,
            metadata={
                "job": spec.name,
                "mode": mode,
                "tenants": len(tenants),
                "windows": len(windows),
                "runs": runs,
                "plan": json.dumps(plan),
            },
        )

    @dg.job(
        name=BACKFILL_JOB,
        description=(
            "Backfill one catalog job over tenants (some or all) and, for a windowed job, a "
            "range of days, as chunked runs like a tick (tenant_backfill_sensor requests them)."
            " Dry run unless mode: execute with a reason; a destructive job's execute cites an"
            " approval covering every tenant (config approval)."
        ),
        tags={"qo_ops/backfill_launcher": "true"},
    )
    def tenant_backfill_job() -> None:
        plan_tenant_backfill()

    return tenant_backfill_job


def build_backfill_sensor(
    specs: Sequence[JobSpec], jobs: Sequence[dg.JobDefinition]
) -> dg.SensorDefinition:
    """``tenant_backfill_sensor``: request the runs of each succeeded backfill plan."""
    by_name = {s.name: s for s in specs}

    @dg.sensor(
        name="tenant_backfill_sensor",
        jobs=list(jobs),
        minimum_interval_seconds=30,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Requests the chunked runs of every tenant_backfill_job run that succeeded",
    )
    def tenant_backfill_sensor(
        context: dg.SensorEvaluationContext, database: QoOpsDatabase
    ) -> dg.SensorResult:
        state = json.loads(context.cursor) if context.cursor else {}
        after = datetime.fromisoformat(state["after"]) if state.get("after") else None
        records = context.instance.get_run_records(
            filters=dg.RunsFilter(
                job_name=BACKFILL_JOB,
                statuses=[dg.DagsterRunStatus.SUCCESS],
                updated_after=after,
            ),
            order_by="update_timestamp",
            ascending=True,
            limit=20,
        )
        requests: list[dg.RunRequest] = []
        for record in records:
            plan = plan_from_events(context.instance, record.dagster_run.run_id)
            if plan is None or plan["job"] not in by_name:
                state["after"] = record.update_timestamp.isoformat()
                continue
            spec = by_name[plan["job"]]
            with database.engine().connect() as conn:
                # the plan's tenants as they are now: those named that still exist, or all
                tenants = tenant_ids(conn, plan["tenants"] or None)
                chunks = chunks_of(tenants_in_chunk_order(conn)) if plan["windows"] else None
            every = backfill_run_requests(spec, plan, tenants, record.dagster_run.run_id, chunks)
            start = state.get("next", 0) if state.get("run") == record.dagster_run.run_id else 0
            room = MAX_REQUESTS_PER_TICK - len(requests)
            requests.extend(every[start : start + room])
            if start + room < len(every):  # the rest on the next tick
                state |= {"run": record.dagster_run.run_id, "next": start + room}
                break
            state = {"after": record.update_timestamp.isoformat()}
        return dg.SensorResult(
            run_requests=requests,
            cursor=json.dumps(state),
            skip_reason=None if requests else "no new backfill plan",
        )

    return tenant_backfill_sensor


def plan_from_events(instance: dg.DagsterInstance, run_id: str) -> dict[str, Any] | None:
    """The plan a launcher run recorded: the ``plan`` metadata of its op's output."""
    records = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.STEP_OUTPUT)
    for record in records.records:
        event = record.event_log_entry.dagster_event
        data = event.step_output_data if event is not None else None
        plan = data.metadata.get("plan") if data is not None else None
        if plan is not None:
            found: dict[str, Any] = json.loads(str(plan.value))  # the plan as JSON text
            return found
    return None
