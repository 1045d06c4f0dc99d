"""One Dagster job per catalog entry: a single op that turns the partition, the run's tags
and its typed config into a ``run_job`` call, and reports what the runner returned."""

import enum
import uuid
from collections.abc import Iterator

# (no `from __future__ import annotations`: Dagster reads these annotations at decoration time)
from typing import Any

import dagster as dg
import pandas as pd
import sqlalchemy as sa
from pydantic import Field

from qo_ops.dagster_defs.k8s import k8s_config_tag
from qo_ops.dagster_defs.partitions import (
    JOB_RUN_TAG,
    MODE_TAG,
    partitions_def_for,
    scope_from_partition_key,
    scope_tag,
)
from qo_ops.dagster_defs.resources import QoOpsDatabase
from qo_ops.dagster_defs.submission import DESTRUCTIVE_TAG, run_options, trigger_from_tags
from qo_ops.errors import BadInput, QoOpsError, one_line
from qo_ops.platform import runs
from qo_ops.platform.overdue import Backlog, tenant_backlog
from qo_ops.platform.runner import RunSummary, run_job
from qo_ops.platform.spec import (
    MAX_BATCH_SIZE,
    MAX_DEADLINE_S,
    MAX_ITEMS,
    MAX_TEXT,
    MAX_THROTTLE_MS,
    JobSpec,
    RunOptions,
    Scope,
    Trigger,
)


class Mode(enum.Enum):
    """dry_run counts and samples what execute would change, and changes nothing."""

    dry_run = "dry_run"
    execute = "execute"


class JobRunConfig(dg.Config):
    """How this run behaves. Empty fields take the job's defaults."""

    mode: Mode | None = Field(
        default=None,
        description=(
            "dry_run: count and sample, change nothing. execute: apply. Empty: execute for "
            "schedules and sensors, dry_run when launched by hand or by a backfill (a backfill "
            "executes when tagged qo_ops/mode=execute)."
        ),
    )
    batch_size: int | None = Field(
        default=None, ge=1, le=MAX_BATCH_SIZE, description="Items per batch transaction."
    )
    max_items: int | None = Field(
        default=None, ge=1, le=MAX_ITEMS, description="Stop after this many items."
    )
    throttle_ms: int | None = Field(
        default=None,
        ge=0,
        le=MAX_THROTTLE_MS,
        description="Pause between batches, in milliseconds.",
    )
    deadline_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_DEADLINE_S,
        description="Stop with status timeout after this many seconds.",
    )
    reason: str | None = Field(
        default=None,
        max_length=MAX_TEXT,
        description="Why this run is needed (required to execute by hand; kept in the audit trail).",
    )


FAILING_STATUSES = ("failed", "timeout", "cancelled")


REPORT_COLUMNS = (("kind", "string"), ("name", "string"), ("count", "int"), ("detail", "string"))


def report_table(summary: RunSummary) -> dg.TableMetadataValue:
    """The run's report rows (ids, states, classes and numbers) as a Dagster table."""
    frame = pd.DataFrame(summary.report, columns=[c for c, _ in REPORT_COLUMNS])
    frame["count"] = frame["count"].astype("int64")
    records = [
        dg.TableRecord({k: (int(v) if k == "count" else str(v)) for k, v in row.items()})
        for row in frame.to_dict("records")
    ]
    schema = dg.TableSchema(columns=[dg.TableColumn(c, t) for c, t in REPORT_COLUMNS])
    return dg.MetadataValue.table(records, schema)


def summary_metadata(summary: RunSummary, scope: Scope | None = None) -> dict[str, Any]:
    """The run's report as Dagster metadata: status, counters and timings as numbers, scope
    and window, fencing token, checkpoint before/after, and the report table."""
    keys = (
        "job_run_id",
        "status",
        "status_reason",
        "mode",
        "scope",
        "trigger",
        "eligible_count",
        "processed_count",
        "mutated_count",
        "failed_count",
        "skipped_count",
        "retry_scheduled_count",
        "deadlettered_count",
        "duplicates_prevented",
        "batches",
        "duration_ms",
        "batch_ms_p50",
        "batch_ms_p99",
        "batch_ms_max",
        "fencing_token",
        "checkpoint_before",
        "checkpoint_after",
        "backlog",
        "oldest_due_age_s",
        "checkpoint_age_s",
        "dead_letters",
    )
    data = summary.as_dict()
    metadata: dict[str, Any] = {k: data[k] for k in keys if data.get(k) is not None}
    if scope is not None and scope.window_start is not None:
        metadata["window_start"] = scope.window_start.isoformat()
        metadata["window_end"] = scope.window_end.isoformat() if scope.window_end else ""
    if summary.report:
        metadata["report"] = report_table(summary)
    return metadata


def outcome_observation(
    asset_key: dg.AssetKey, summary: RunSummary, scope: Scope, backlog: Backlog
) -> dg.AssetObservation:
    """What the run saw of its business outcome, as numbers Dagster plots over time: the
    tenant's whole backlog (every day, for a windowed job; not only the run's window)."""
    figures: dict[str, Any] = {
        "backlog": backlog.items,
        "oldest_due_age_s": backlog.oldest_due_age_s,
        "checkpoint_age_s": summary.checkpoint_age_s,
        "dead_letters": summary.dead_letters,
    }
    mismatches = [r["count"] for r in summary.report if r["kind"] == "mismatch"]
    if mismatches:
        figures["mismatches"] = sum(mismatches)
    metadata = {k: v for k, v in figures.items() if v is not None}
    where = {"scope": scope.tenant_id}  # whose backlog the point is
    if scope.window_start is not None:
        where["run_scope"] = scope.key  # the window the run itself covered
    return dg.AssetObservation(
        asset_key=asset_key,
        metadata={**metadata, **where, "job": summary.job_name, "mode": summary.mode},
    )


def scope_backlog(
    spec: JobSpec, engine: Any, summary: RunSummary, scope: Scope, log: Any
) -> Backlog:
    """The tenant's whole backlog after a run: the run's own figures for a tenant job (its
    scope is the tenant), every day of the tenant for a windowed job."""
    if scope.window_start is None:
        return Backlog(summary.backlog, summary.oldest_due_age_s)
    try:
        with engine.connect() as conn:
            return tenant_backlog(conn, spec, scope.tenant_id)
    except sa.exc.SQLAlchemyError as exc:  # the run is recorded; only its plot point is lost
        log.warning(f"tenant backlog not measured: {one_line(str(exc), 200)}")
        return Backlog(None, None)


def _adopted(
    spec: JobSpec, engine: Any, job_run_tag: str, context: dg.OpExecutionContext
) -> tuple[Scope, RunOptions]:
    """Scope and options of a run the operator API accepted: its job_run row is the source
    of truth (validated and audited when it was accepted); the partition must agree."""
    try:
        run_id = uuid.UUID(job_run_tag)
    except ValueError:
        raise BadInput(f"tag {JOB_RUN_TAG} is not a job run id") from None
    accepted = runs.load_accepted(engine, run_id, spec.name)
    partition = scope_from_partition_key(spec, context.partition_key)
    if partition.tenant_id != accepted.scope.tenant_id or (
        partition.window_start is not None and partition.window_start != accepted.scope.window_start
    ):
        raise BadInput(
            f"partition {context.partition_key} does not match accepted run {run_id} "
            f"({accepted.scope.key})"
        )
    limits = accepted.options
    options = RunOptions(
        mode=accepted.mode,  # type: ignore[arg-type]
        trigger="api",
        batch_size=limits.get("batch_size"),
        max_items=limits.get("max_items"),
        throttle_ms=limits.get("throttle_ms"),
        requester=accepted.requester,
        reason=accepted.reason,
        correlation_id=accepted.correlation_id or context.run_id,
        dagster_run_id=context.run_id,
        job_run_id=run_id,
        progress_interval_s=10.0,
    )
    return accepted.scope, options


def _refuse_accepted(engine: Any, job_run_tag: str, exc: QoOpsError) -> None:
    try:
        run_id = uuid.UUID(job_run_tag)
    except ValueError:
        return
    with engine.begin() as conn:
        code = getattr(exc, "error_code", "bad_input")  # e.g. "suspended" (the kill switch)
        runs.finish_unstarted(conn, run_id, "failed", "refused_at_start", code, str(exc))


def _run_tenant_range(
    spec: JobSpec,
    context: dg.OpExecutionContext,
    config: JobRunConfig,
    tags: dict[str, str],
    trigger: Trigger,
    engine: Any,
    asset_key: dg.AssetKey | None,
) -> Iterator[Any]:
    """One Dagster run over a range of tenant partitions (tags
    ``dagster/asset_partition_range_start`` / ``_end``): ``run_job`` for each tenant in
    turn, each with its own lease and job_run row, so a tick over many tenants costs one
    run process instead of one per tenant. A tenant that fails does not stop the others;
    the run fails at the end if any did. One check evaluation per check covers the range."""
    if spec.partitioning != "tenant":
        raise dg.Failure(
            description=f"{spec.name} is windowed: launch it per partition, not over a range",
            allow_retries=False,
        )
    if trigger == "api":
        raise dg.Failure(
            description="an API-accepted run covers one partition, not a range",
            allow_retries=False,
        )
    tenants = list(context.partition_keys)
    options = run_options(dict(config), tags, context.run_id)
    summaries: list[RunSummary] = []
    refused: list[str] = []
    for tenant in tenants:
        try:
            summary = run_job(spec, Scope(tenant), options, engine=engine)
        except QoOpsError as exc:  # bad input: refused before anything was written
            refused.append(tenant)
            context.log.error(f"{spec.name} {tenant}: refused: {exc}")
            continue
        summaries.append(summary)
        if asset_key is not None and summary.status != "skipped":
            backlog = scope_backlog(spec, engine, summary, Scope(tenant), context.log)
            yield outcome_observation(asset_key, summary, Scope(tenant), backlog)
        context.log.info(
            f"{spec.name} {summary.scope} {summary.mode}: {summary.status} — "
            f"eligible {summary.eligible_count}, changed {summary.mutated_count}, "
            f"failed {summary.failed_count}"
        )
    declared = {c.name: c for c in spec.checks}
    checked = [s for s in summaries if s.mode == "execute" and s.status != "skipped"]
    failing_checks: dict[str, list[str]] = {}
    for s in checked:
        for check in s.checks:
            failing_checks.setdefault(check.name, [])
            if not check.passed:
                failing_checks[check.name].append(s.scope)
    if asset_key is not None:
        for name, scopes in failing_checks.items():
            declared_check = declared.get(name)
            yield dg.AssetCheckEvaluation(
                asset_key=asset_key,
                check_name=name,
                passed=not scopes,
                metadata={
                    "scopes_checked": len(checked),
                    "failing_scopes": ", ".join(scopes[:50]) or "none",
                    "range": f"{tenants[0]}..{tenants[-1]}" if tenants else "",
                },
                severity=dg.AssetCheckSeverity.ERROR
                if declared_check is None or declared_check.blocking
                else dg.AssetCheckSeverity.WARN,
            )
    by_status: dict[str, int] = {}
    for s in summaries:
        by_status[s.status] = by_status.get(s.status, 0) + 1
    metadata: dict[str, Any] = {
        "tenants": len(tenants),
        **{f"status_{k}": v for k, v in sorted(by_status.items())},
        "refused": len(refused),
        "eligible_count": sum(s.eligible_count for s in summaries),
        "processed_count": sum(s.processed_count for s in summaries),
        "mutated_count": sum(s.mutated_count for s in summaries),
        "failed_count": sum(s.failed_count for s in summaries),
    }
    failed = [s.scope for s in summaries if s.status in FAILING_STATUSES]
    blocking = sorted(
        {
            scope
            for name, scopes in failing_checks.items()
            if name in declared and declared[name].blocking
            for scope in scopes
        }
    )
    if refused or failed or blocking:
        raise dg.Failure(
            description=f"{spec.name} over {len(tenants)} tenants: "
            + "; ".join(
                part
                for part in (
                    f"refused {', '.join(refused)}" if refused else "",
                    f"ended failing {', '.join(failed)}" if failed else "",
                    f"outcome not met {', '.join(blocking)}" if blocking else "",
                )
                if part
            ),
            metadata=metadata,
            allow_retries=False,
        )
    yield dg.Output({"runs": [s.as_dict() for s in summaries]}, metadata=metadata)


def job_description(spec: JobSpec) -> str:
    """The job's description in the UI: what it does, its safe default, how to execute."""
    lines = [spec.description + "."]
    if spec.change:
        lines.append(f"Per item: {spec.change}.")
    lines.append(
        "Launched by hand or by a backfill it runs as a dry run (counts and a sample, no "
        "change) unless config says mode: execute (with a reason)."
    )
    if spec.destructive:
        lines.append(
            "Destructive: dry-run first, and read the report's sample. A backfill only "
            "dry-runs it: to execute, use the operator API's approval flow."
        )
    else:
        lines.append(
            "To execute a backfill: Materialize/Backfill the partitions with the tags "
            "qo_ops/mode=execute and qo_ops/reason=<why> (Dagster cannot pass run config to a "
            "backfill); schedules and sensors execute."
        )
    return " ".join(lines)


def build_job(spec: JobSpec) -> dg.JobDefinition:
    """The Dagster job of ``spec``: partitioned, one op, in-process executor."""
    partitions_def = partitions_def_for(spec)
    asset_key = dg.AssetKey(["qo_ops", spec.outcome_asset]) if spec.outcome_asset else None

    @dg.op(name=f"{spec.name}_op", description=spec.description, tags={"kind": spec.kind})
    def run_catalog_job(
        context: dg.OpExecutionContext, config: JobRunConfig, database: QoOpsDatabase
    ) -> Iterator[Any]:
        tags = dict(context.run.tags)
        trigger = trigger_from_tags(tags)
        engine = database.engine()
        if context.has_partition_key_range and not context.has_partition_key:
            yield from _run_tenant_range(spec, context, config, tags, trigger, engine, asset_key)
            return
        try:
            if trigger == "api":
                scope, options = _adopted(spec, engine, tags[JOB_RUN_TAG], context)
            else:
                scope = scope_from_partition_key(spec, context.partition_key)
                options = run_options(dict(config), tags, context.run_id)
            context.instance.add_run_tags(context.run_id, {MODE_TAG: options.mode})
            summary = run_job(spec, scope, options, engine=engine)
        except QoOpsError as exc:  # bad input: refused before anything was written
            if trigger == "api":  # the accepted row must not wait forever
                _refuse_accepted(engine, tags[JOB_RUN_TAG], exc)
            raise dg.Failure(description=str(exc), allow_retries=False) from None
        context.log.info(
            f"{spec.name} {scope.key} {summary.mode}: {summary.status}"
            f"{' (' + summary.status_reason + ')' if summary.status_reason else ''} — "
            f"eligible {summary.eligible_count}, processed {summary.processed_count}, "
            f"changed {summary.mutated_count}, failed {summary.failed_count}"
        )
        if summary.status == "partial_success":
            context.log.warning(f"partial success: {summary.failed_count} item(s) failed")
        metadata = summary_metadata(summary, scope)
        if asset_key is not None and summary.status != "skipped":
            backlog = scope_backlog(spec, engine, summary, scope, context.log)
            yield outcome_observation(asset_key, summary, scope, backlog)
        if asset_key is not None and summary.mode == "execute" and summary.status != "skipped":
            declared = {c.name: c for c in spec.checks}
            for check in summary.checks:
                declared_check = declared.get(check.name)
                yield dg.AssetCheckEvaluation(
                    asset_key=asset_key,
                    check_name=check.name,
                    passed=check.passed,
                    metadata={
                        **check.metadata,
                        "scope": scope.key,
                        "job_run_id": summary.job_run_id,
                    },
                    severity=dg.AssetCheckSeverity.ERROR
                    if declared_check is None or declared_check.blocking
                    else dg.AssetCheckSeverity.WARN,
                    description=check.description,
                )
        if summary.status in FAILING_STATUSES:
            raise dg.Failure(
                description=f"{spec.name} ended {summary.status}: {summary.status_reason or summary.error_code}",
                metadata=metadata,
                allow_retries=False,
            )
        blocking_failed = [
            c.name
            for c in summary.checks
            if not c.passed and any(d.name == c.name and d.blocking for d in spec.checks)
        ]
        if summary.mode == "execute" and summary.status != "skipped" and blocking_failed:
            raise dg.Failure(
                description=f"business outcome not met after {spec.name}: {', '.join(blocking_failed)}",
                metadata=metadata,
                allow_retries=False,
            )
        yield dg.Output(summary.as_dict(), metadata=metadata)

    @dg.job(
        name=spec.name,
        description=job_description(spec),
        partitions_def=partitions_def,
        config=dg.PartitionedConfig(
            partitions_def=partitions_def,
            run_config_for_partition_key_fn=lambda _key: {},
            tags_for_partition_key_fn=lambda key: scope_tag(spec, key),
        ),
        executor_def=dg.in_process_executor,
        tags={
            "qo_ops/job": spec.name,
            "qo_ops/kind": spec.kind,
            **({DESTRUCTIVE_TAG: "true"} if spec.destructive else {}),
            **k8s_config_tag(spec),
        },
    )
    def catalog_job() -> None:
        run_catalog_job()

    return catalog_job
