"""One Dagster job per catalog entry: a single op that turns the partition, the run's tags
and its typed config into ``run_job`` calls — one per tenant the run covers (a tick's chunk
of tenants, or one) — and reports on each tenant's partition what the runner returned."""

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

# (no `from __future__ import annotations`: Dagster reads these annotations at decoration time)
from typing import Any

import dagster as dg
import sqlalchemy as sa

from qo_ops.dagster_defs.checks import judged_materialization
from qo_ops.dagster_defs.freshness import recent_success_evaluation
from qo_ops.dagster_defs.k8s import k8s_config_tag
from qo_ops.dagster_defs.partitions import partitions_def_for
from qo_ops.dagster_defs.resources import QoOpsDatabase
from qo_ops.dagster_defs.run_config import JobRunConfig
from qo_ops.dagster_defs.scopes import (
    MAX_NAMED,
    adopted_run,
    known_tenants,
    refuse_accepted,
    requested_scopes,
)
from qo_ops.dagster_defs.submission import (
    DESTRUCTIVE_TAG,
    WINDOWED_TAG,
    run_options,
    trigger_from_tags,
    with_run_facts,
)
from qo_ops.db.availability import is_unavailable
from qo_ops.db.migrate import code_version
from qo_ops.errors import QoOpsError, age_text, one_line
from qo_ops.platform.calls.call_stats import DownstreamCalls
from qo_ops.platform.job.counts import COLUMNS
from qo_ops.platform.job.options import RunOptions, check_consent
from qo_ops.platform.job.scope import Scope, scope_text
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.job.statuses import ENDED_WELL, FAILING, RunStatus
from qo_ops.platform.observability.events import EVENT_LOGGER
from qo_ops.platform.run.runner import RunSummary, run_job
from qo_ops.platform.run.stopping import TERMINATED
from qo_ops.platform.schedule.overdue import Backlog, tenant_backlog
from qo_ops.platform.schedule.partition_keys import (
    FAILED_TENANTS_TAG,
    JOB_RUN_TAG,
    MODE_TAG,
    scope_tag,
)

FAILING_STATUSES = (*FAILING, RunStatus.CANCELLED)  # the op fails with the run
TENANT_TAG = "qo_ops/tenant"  # on a run of one tenant (a chunk names its range in qo_ops/scope)
KEPT_RIGHT = (*ENDED_WELL, RunStatus.PARTIAL_SUCCESS)  # an execute run that kept its outcome


REPORT_COLUMNS = (("kind", "string"), ("name", "string"), ("count", "int"), ("detail", "string"))


AGES = {"oldest_due_age_s": "oldest_due_age", "checkpoint_age_s": "checkpoint_age"}


def human_ages(metadata: dict[str, Any]) -> dict[str, Any]:
    """The ages in ``metadata`` in whole seconds (plotted run after run) and beside each the
    same age as a person reads it: ``oldest_due_age_s 857693``, ``oldest_due_age 9.9 d``."""
    ages: dict[str, Any] = {}
    for key, text in AGES.items():
        if isinstance(metadata.get(key), int | float):
            ages[key] = round(metadata[key])
            ages[text] = age_text(metadata[key])
    return ages


def report_table(summary: RunSummary) -> dg.TableMetadataValue:
    """The run's report rows (ids, states, classes and numbers) as a Dagster table."""
    records = [
        dg.TableRecord(
            {c: (int(row[c]) if t == "int" else str(row.get(c))) for c, t in REPORT_COLUMNS}
        )
        for row in summary.report
    ]
    schema = dg.TableSchema(columns=[dg.TableColumn(c, t) for c, t in REPORT_COLUMNS])
    return dg.MetadataValue.table(records, schema)


def summary_metadata(summary: RunSummary, scope: Scope | None = None) -> dict[str, Any]:
    """The run's report as Dagster metadata: status, counters and timings as numbers, scope
    and window, fencing token, checkpoint before/after, the downstream's figures (calls,
    retries, retry pressure, rate limiting, breaker), and the report table."""
    keys = (
        "job_run_id",
        "status",
        "status_reason",
        "error_code",
        "mode",
        "scope",
        "trigger",
        "eligible_count",
        "mutated_count",
        *COLUMNS.values(),  # processed_count … duplicates_prevented_count
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
    if "scope" in metadata:  # as a person reads it: the days it covers, the last included
        metadata["scope"] = scope_text(metadata["scope"])
    if scope is not None and scope.window_start is not None and scope.window_end is not None:
        metadata["first_day"] = scope.window_start.isoformat()
        metadata["last_day"] = (scope.window_end - timedelta(days=1)).isoformat()
    metadata |= human_ages(metadata)
    metadata["code_version"] = code_version()  # which release ran it (a rollout has two)
    calls = DownstreamCalls.from_tally(summary.tally)
    if calls is not None:  # numbers, so that Dagster plots them run after run
        for key, value in calls.as_dict().items():
            if isinstance(value, int | float):  # retry_pressure is None without calls
                metadata[f"downstream_{key}"] = value
        metadata["downstream_breaker"] = calls.breaker_text()
    if summary.report:
        metadata["report"] = report_table(summary)
    return metadata


def outcome_event(
    asset_key: dg.AssetKey, summary: RunSummary, scope: Scope, backlog: Backlog
) -> dg.AssetMaterialization | dg.AssetObservation:
    """What one tenant's run did to its business outcome, on the tenant's partition of the
    outcome asset: a materialization when an execute run kept it right (success, no work,
    partial success), an observation otherwise (dry run, failed, skipped). Its figures are
    the tenant's whole backlog (every day, for a windowed job), plotted over time."""
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
    metadata |= human_ages(metadata)
    metadata |= {
        "status": summary.status,
        "job": summary.job_name,
        "mode": summary.mode,
        "job_run_id": summary.job_run_id,
        "eligible_count": summary.eligible_count,
        "mutated_count": summary.mutated_count,
        "succeeded_count": summary.counts.succeeded,
        "failed_count": summary.counts.failed,
    }
    if scope.window_start is not None:
        metadata["run_scope"] = scope.text  # the days the run itself covered
    kept_right = summary.mode == "execute" and summary.status in KEPT_RIGHT
    event = dg.AssetMaterialization if kept_right else dg.AssetObservation
    return event(asset_key=asset_key, partition=scope.tenant_id, metadata=metadata)


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


class ChunkProgress:
    """A run of many tenants says how far it is at most every ``interval_s`` and at its end
    (a line per tenant would cost an event-log write each: their figures are on the
    tenants' partitions and in the run's ``tenant_runs`` table)."""

    def __init__(self, job: str, total: int, log: Any, interval_s: float = 10.0) -> None:
        self.job, self.total, self.log, self.interval_s = job, total, log, interval_s
        self.last = time.monotonic()

    def tick(self, done: int, outcomes: list["TenantOutcome"]) -> None:
        now = time.monotonic()
        if self.total < 2 or (done < self.total and now - self.last < self.interval_s):
            return
        self.last = now
        counts: dict[str, int] = {}
        for o in outcomes:
            counts[o.status] = counts.get(o.status, 0) + 1
        tally = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        self.log.info(f"{self.job}: {done}/{self.total} tenants done — {tally}")


@dataclass
class TenantOutcome:
    """How one tenant of a run ended: its summary, or why it did not run."""

    scope: Scope
    summary: RunSummary | None = None
    refused: QoOpsError | None = None
    error: str | None = None  # an unexpected error: the other tenants ran on

    @property
    def status(self) -> str:
        """The run's status, or ``refused`` / ``error`` when it did not run."""
        if self.summary is not None:
            return self.summary.status
        return "refused" if self.refused is not None else "error"

    @property
    def failed(self) -> bool:
        return self.summary is None or self.summary.status in FAILING_STATUSES


def check_evaluations(
    spec: JobSpec,
    asset_key: dg.AssetKey,
    summary: RunSummary,
    scope: Scope,
    instance: dg.DagsterInstance,
) -> Iterator[dg.AssetCheckEvaluation]:
    """The run's outcome checks, each on the tenant's partition of the outcome asset,
    judging its latest materialization (the one just recorded, when the run kept it right);
    after a success, ``recent_success`` passing there too (the tenant is fresh at once)."""
    if summary.mode != "execute" or summary.status == RunStatus.SKIPPED:
        return
    declared = {c.name: c for c in spec.checks}
    judged = judged_materialization(instance, asset_key, scope.tenant_id)
    if summary.status in spec.fresh_statuses:
        yield recent_success_evaluation(
            spec,
            scope.tenant_id,
            True,
            {"last_success_age_s": 0, "job_run_id": summary.job_run_id},
            f"{spec.name} ended {summary.status} just now",
            judged,
        )
    for check in summary.checks:
        declared_check = declared.get(check.name)
        yield dg.AssetCheckEvaluation(
            asset_key=asset_key,
            check_name=check.name,
            passed=check.passed,
            partition=scope.tenant_id,
            target_materialization_data=judged,
            metadata={**check.metadata, "scope": scope.key, "job_run_id": summary.job_run_id},
            severity=dg.AssetCheckSeverity.ERROR
            if declared_check is None or declared_check.blocking
            else dg.AssetCheckSeverity.WARN,
            description=check.description,
        )


def run_tenants(
    spec: JobSpec,
    scopes: list[Scope],
    options: RunOptions,
    engine: Any,
    context: dg.OpExecutionContext,
    outcomes: list[TenantOutcome],
) -> Iterator[Any]:
    """``run_job`` for each scope in turn, each with its own lease, job_run row, kill-switch
    check and limits; what each did goes on its tenant's partition of the outcome asset.
    A tenant refused, failing or raising does not stop the others; a stop signal, or the
    database gone (every tenant would wait out its retry), stops the rest, which count as
    failed so that a re-execution runs them."""
    asset_key = (
        dg.AssetKey(["qo_ops", spec.presentation.outcome_asset])
        if spec.presentation.outcome_asset
        else None
    )
    progress = ChunkProgress(spec.name, len(scopes), context.log)
    lines = RunnerLines(len(scopes) > 1)
    for n, scope in enumerate(scopes, 1):
        outcome = TenantOutcome(scope)
        outcomes.append(outcome)
        try:
            # (around the call only: Dagster re-attaches its handler when the op resumes)
            with lines.around_run_job():
                outcome.summary = run_job(spec, scope, options, engine=engine)
        except QoOpsError as exc:  # bad input for this tenant (e.g. suspended): nothing written
            outcome.refused = exc
            context.log.error(f"{spec.name} {scope.key}: refused: {exc}")
            progress.tick(n, outcomes)
            continue
        except Exception as exc:  # a bug or the database: this tenant failed, the others run
            outcome.error = one_line(f"{type(exc).__name__}: {exc}", 300)
            context.log.error(f"{spec.name} {scope.key}: error: {outcome.error}")
            if is_unavailable(exc):
                context.log.error("database unavailable: the remaining tenants are not run")
                outcomes.extend(TenantOutcome(s, error="not run") for s in scopes[n:])
                break
            progress.tick(n, outcomes)
            continue
        summary = outcome.summary
        line = (
            f"{spec.name} {scope.key} {summary.mode}: {summary.status}"
            f"{' (' + summary.status_reason + ')' if summary.status_reason else ''} — "
            f"eligible {summary.eligible_count}, processed {summary.counts.processed}, "
            f"changed {summary.counts.succeeded}, failed {summary.counts.failed}"
        )
        if len(scopes) == 1:
            context.log.info(line)
        elif summary.status not in ENDED_WELL:  # what needs a look: on its own
            context.log.warning(f"{line} [{n}/{len(scopes)}]")
        progress.tick(n, outcomes)
        if asset_key is not None:
            backlog = scope_backlog(spec, engine, summary, scope, context.log)
            yield outcome_event(asset_key, summary, scope, backlog)
            yield from check_evaluations(spec, asset_key, summary, scope, context.instance)
        if (summary.status_reason or "").startswith(TERMINATED):  # the process is stopping
            outcomes.extend(TenantOutcome(s, error="not run: terminated") for s in scopes[n:])
            break
    for repeated in lines.summary_lines(len(scopes)):
        context.log.warning(repeated)


# one cause for the whole run (its tick was late): every tenant of a chunk would say it
ONCE_PER_RUN = ("job.scheduler.drift.detected",)


class RunnerLines:
    """In a run of many tenants, only the runner's warnings and errors are copied into the
    Dagster event log (``managed_python_loggers``): its routine lines, ~5 a tenant, would
    bury the op's one line per tenant, and each costs an event-log write (~25 ms here). A
    warning every tenant of the run gives for the same cause (``ONCE_PER_RUN``: the chunk's
    tick was late) is copied once per reason (its first tenant's); ``repeated`` counts the
    tenants that gave it. All still reach the run worker's own log (stdout, the pod's log)
    as JSON, and each tenant's start and tick are on its job_run row."""

    def __init__(self, many_tenants: bool) -> None:
        self.many_tenants = many_tenants
        self.repeated: dict[str, int] = {}  # "event (reason)": tenants that gave it

    def emit(self, target: logging.Handler, record: logging.LogRecord) -> None:
        """Hand ``record`` to ``target`` unless it repeats a once-per-run warning."""
        event = getattr(record, "event", None) or {}
        if event.get("event.name") in ONCE_PER_RUN:
            key = f"{event['event.name']} ({event.get('reason')})"
            self.repeated[key] = self.repeated.get(key, 0) + 1
            if self.repeated[key] > 1:
                return
        target.handle(record)

    @contextmanager
    def around_run_job(self) -> Iterator[None]:
        """Around one tenant's ``run_job`` only: Dagster re-attaches its handler when the op
        resumes."""
        logger = logging.getLogger(EVENT_LOGGER)
        dagsters = [  # Dagster's handler for the run (dagster._core.log_manager); it ignores
            h  # added filters, so it is swapped for one that passes it warnings only
            for h in logger.handlers
            if self.many_tenants and type(h).__name__ == "DagsterLogHandler"
        ]
        forwards = [_WarningsTo(h, self) for h in dagsters]
        for dagster, forward in zip(dagsters, forwards, strict=True):
            logger.removeHandler(dagster)
            logger.addHandler(forward)
        try:
            yield
        finally:
            for dagster, forward in zip(dagsters, forwards, strict=True):
                logger.removeHandler(forward)
                logger.addHandler(dagster)

    def summary_lines(self, tenants: int) -> list[str]:
        """One line per once-per-run warning (and reason) that more than one tenant gave."""
        return [
            f"{key}: {n} of {tenants} tenants (the first one's line above; every tenant's in "
            "the run worker's log, its tick and start on its job_run row)"
            for key, n in self.repeated.items()
            if n > 1
        ]


class _WarningsTo(logging.Handler):
    """Hands the warnings and errors it receives to another handler, through ``lines``."""

    def __init__(self, target: logging.Handler, lines: RunnerLines) -> None:
        super().__init__(logging.WARNING)
        self.target, self.lines = target, lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.emit(self.target, record)


def tenants_table(outcomes: list[TenantOutcome]) -> dg.TableMetadataValue:
    """One row per tenant of the run: how it ended, its counts and its job run."""
    columns = (
        ("tenant", "string"),
        ("status", "string"),
        ("eligible", "int"),
        ("succeeded", "int"),
        ("failed", "int"),
        ("job_run_id", "string"),
        ("detail", "string"),
    )
    records = []
    for o in outcomes:
        s = o.summary
        records.append(
            dg.TableRecord(
                {
                    "tenant": o.scope.tenant_id,
                    "status": o.status,
                    "eligible": s.eligible_count if s else 0,
                    "succeeded": s.counts.succeeded if s else 0,
                    "failed": s.counts.failed if s else 0,
                    "job_run_id": s.job_run_id if s else "",
                    "detail": one_line(
                        (s.status_reason or "") if s else str(o.refused or o.error), 200
                    ),
                }
            )
        )
    schema = dg.TableSchema(columns=[dg.TableColumn(c, t) for c, t in columns])
    return dg.MetadataValue.table(records, schema)


def finish_chunk(
    spec: JobSpec, context: dg.OpExecutionContext, outcomes: list[TenantOutcome]
) -> dg.Output[dict[str, Any]]:
    """The run of many tenants ends: its metadata names every tenant's status; the run
    fails, naming the tenants that failed (and tags them, so that re-executing the run runs
    only those), if any tenant failed, was refused or missed a blocking outcome check."""
    declared_blocking = {c.name for c in spec.checks if c.blocking}
    summaries = [o.summary for o in outcomes if o.summary is not None]
    failed = [o.scope.tenant_id for o in outcomes if o.failed]
    blocking = [
        o.scope.tenant_id
        for o in outcomes
        if o.summary is not None
        and not o.failed
        and o.summary.mode == "execute"
        and o.summary.status != RunStatus.SKIPPED
        and any(not c.passed and c.name in declared_blocking for c in o.summary.checks)
    ]
    by_status: dict[str, int] = {}
    for o in outcomes:
        by_status[o.status] = by_status.get(o.status, 0) + 1
    rerun = sorted(set(failed) | set(blocking))
    metadata: dict[str, Any] = {
        "tenants": len(outcomes),
        **{f"status_{k}": v for k, v in sorted(by_status.items())},
        "tenants_failed": len(failed),
        "tenants_outcome_not_met": len(blocking),
        "failed_tenants": ", ".join(rerun[:MAX_NAMED]) or "none",
        "eligible_count": sum(s.eligible_count for s in summaries),
        "mutated_count": sum(s.mutated_count for s in summaries),
        "processed_count": sum(s.counts.processed for s in summaries),
        "succeeded_count": sum(s.counts.succeeded for s in summaries),
        "failed_count": sum(s.counts.failed for s in summaries),
        "tenant_runs": tenants_table(outcomes),
    }
    if rerun:
        context.instance.add_run_tags(context.run_id, {FAILED_TENANTS_TAG: ",".join(rerun)})
        named = ", ".join(rerun[:MAX_NAMED]) + (" …" if len(rerun) > MAX_NAMED else "")
        raise dg.Failure(
            description=f"{spec.name}: {len(rerun)} of {len(outcomes)} tenants failed or missed "
            f"their outcome: {named}. Re-execute this run to run only those.",
            metadata=metadata,
            allow_retries=False,
        )
    return dg.Output({"runs": [s.as_dict() for s in summaries]}, metadata=metadata)


def finish_single(spec: JobSpec, outcome: TenantOutcome) -> dg.Output[dict[str, Any]]:
    """The run of one scope ends as the runner said: its summary as the op's output, a
    failure (with the runner's one line) when it failed or missed a blocking check."""
    if outcome.summary is None:
        raise dg.Failure(description=str(outcome.refused or outcome.error), allow_retries=False)
    summary = outcome.summary
    if summary.status == RunStatus.PARTIAL_SUCCESS:
        dg.get_dagster_logger().warning(f"partial success: {summary.counts.failed} item(s) failed")
    metadata = summary_metadata(summary, outcome.scope)
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
    if summary.mode == "execute" and summary.status != RunStatus.SKIPPED and blocking_failed:
        raise dg.Failure(
            description=f"business outcome not met after {spec.name}: {', '.join(blocking_failed)}",
            metadata=metadata,
            allow_retries=False,
        )
    return dg.Output(summary.as_dict(), metadata=metadata)


def launchpad_config(spec: JobSpec) -> dict[str, Any]:
    """The config the Launchpad shows once a partition is picked: the mode the run will have
    (a dry run, until a person writes ``execute``) and, empty, what an execute needs (a
    reason; a destructive job's approval; a windowed job's tenants, empty for its whole
    chunk; the same for every key, day-only or day × chunk). Dagster's "Scaffold
    missing config" adds only required fields, and every field here is optional. Schedules,
    sensors and qo-ops's own backfills give their runs config of their own; a backfill
    launched from Dagster's dialog gets this, and its ``qo_ops/mode`` tag decides
    (``resolve_mode``)."""
    config: dict[str, Any] = {"mode": "dry_run", "reason": None}
    if spec.destructive:
        config["approval"] = None
    if spec.partitioning == "tenant_day":
        config["tenants"] = None
    return {"ops": {f"{spec.name}_op": {"config": config}}}


def job_description(spec: JobSpec) -> str:
    """The job's description in the UI: what it does, its safe default, how to execute."""
    lines = [spec.description + "."]
    if spec.presentation.change:
        lines.append(f"Per item: {spec.presentation.change}.")
    lines.append(
        "Launched by hand or by a backfill it runs as a dry run (counts and a sample, no "
        "change) unless config says mode: execute (with a reason)."
    )
    lines.append(
        "The Launchpad pre-fills an earlier run's config, mode and reason included: an "
        "execute repeating the reason an earlier execute of this job gave for the same "
        "tenant is refused before anything runs (one incident's reason may cover many "
        "tenants; to repeat that run, Re-execute it)."
    )
    if spec.destructive:
        lines.append(
            "Destructive: dry-run first, and read the report's sample. Its execute cites an "
            "approval an approver granted (qo-ops approval grant): config approval, or the "
            "tag qo_ops/approval on a backfill."
        )
    lines.append(
        "To execute a backfill: Launch backfill over the partitions with the tags "
        "qo_ops/mode=execute and qo_ops/reason=<why> (Dagster cannot pass run config to a "
        "backfill); schedules and sensors execute."
    )
    if spec.partitioning == "tenant_day":
        lines.append(
            "Its partitions are a day × a tenant chunk (chunk-001: the first 100 tenants by "
            "creation, …): a run covers its chunk's tenants, or those of them config "
            "tenants names; Launch backfill over days and chunks makes one run per day and "
            "chunk (the tag qo_ops/backfill_tenants=tenant-001,tenant-002 narrows it)."
        )
    return " ".join(lines)


def build_job(spec: JobSpec) -> dg.JobDefinition:
    """The Dagster job of ``spec``: partitioned, one op, in-process executor."""
    partitions_def = partitions_def_for(spec)

    @dg.op(name=f"{spec.name}_op", description=spec.description, tags={"kind": spec.kind})
    def run_catalog_job(
        context: dg.OpExecutionContext, config: JobRunConfig, database: QoOpsDatabase
    ) -> Iterator[Any]:
        tags = dict(context.run.tags)
        trigger = trigger_from_tags(tags)
        engine = database.engine()
        try:
            if trigger == "api":
                scope, options = adopted_run(spec, engine, tags[JOB_RUN_TAG], context)
                scopes = [scope]
            else:
                scopes = requested_scopes(spec, context, config.tenants, tags, engine)
                options = run_options(dict(config), tags, context.run_id)
                options = with_run_facts(options, context.instance, context.run_id)
                if len(scopes) > 1:  # refuse once, not once per tenant (run_job checks again)
                    options.validated()
                    check_consent(options, destructive=spec.destructive, job_name=spec.name)
                    scopes = known_tenants(engine, scopes, trigger, context)
            run_tags: dict[str, str] = {MODE_TAG: options.mode}
            if len(scopes) == 1:  # the Runs list filters by tenant: qo_ops/tenant=<tenant>
                run_tags[TENANT_TAG] = scopes[0].tenant_id
            context.instance.add_run_tags(context.run_id, run_tags)
        except QoOpsError as exc:  # bad input: refused before anything was written
            if trigger == "api":  # the accepted row must not wait forever
                refuse_accepted(engine, tags[JOB_RUN_TAG], exc)
            raise dg.Failure(description=str(exc), allow_retries=False) from None
        outcomes: list[TenantOutcome] = []
        yield from run_tenants(spec, scopes, options, engine, context, outcomes)
        if len(scopes) == 1:
            if trigger == "api" and outcomes[0].refused is not None:
                refuse_accepted(engine, tags[JOB_RUN_TAG], outcomes[0].refused)
            output = finish_single(spec, outcomes[0])
        else:
            output = finish_chunk(spec, context, outcomes)
        if tags.get(FAILED_TENANTS_TAG):  # a re-execution inherits its parent's: none failed now
            context.instance.add_run_tags(context.run_id, {FAILED_TENANTS_TAG: ""})
        yield output

    @dg.job(
        name=spec.name,
        description=job_description(spec),
        partitions_def=partitions_def,
        config=dg.PartitionedConfig(
            partitions_def=partitions_def,
            run_config_for_partition_key_fn=lambda _key: launchpad_config(spec),
            tags_for_partition_key_fn=lambda key: scope_tag(spec, key),
        ),
        executor_def=dg.in_process_executor,
        tags={
            "qo_ops/job": spec.name,
            "qo_ops/kind": spec.kind,
            **({DESTRUCTIVE_TAG: "true"} if spec.destructive else {}),
            **({WINDOWED_TAG: "true"} if spec.partitioning == "tenant_day" else {}),
            **k8s_config_tag(spec),
        },
    )
    def catalog_job() -> None:
        run_catalog_job()

    return catalog_job
