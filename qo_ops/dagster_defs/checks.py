"""Business outcomes as assets partitioned by tenant, with checks partitioned the same way.
The job ops record each tenant's outcome and checks on its partition after each run.
Judged on their own (``outcome_checks_job`` from the Launchpad, or a check executed for
some partitions), a check judges each tenant: the tenant (tenant jobs), or every day that
can hold overdue work (windowed jobs: ``overdue_scope``)."""

import enum
import uuid
import warnings
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import dagster as dg

# not exported by dagster; its AssetCheckResult fills the same field the same way
from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    AssetCheckEvaluationTargetMaterializationData,
)
from pydantic import Field

from qo_ops.dagster_defs.partitions import tenants_partitions_def
from qo_ops.dagster_defs.resources import QoOpsDatabase
from qo_ops.errors import QoOpsError, one_line
from qo_ops.platform.job.outcome import BatchContext, OutcomeCheck
from qo_ops.platform.job.spec import CheckSpec, JobSpec
from qo_ops.platform.schedule.overdue import database_now, overdue_scope
from qo_ops.platform.schedule.tenants import tenant_ids

MAX_NAMED_TENANTS = 50  # failing tenants named in a check's metadata
MAX_DETAIL = 10  # failing tenants whose figures are shown


def outcome_asset_key(spec: JobSpec) -> dg.AssetKey:
    return dg.AssetKey(["qo_ops", spec.presentation.outcome_asset])


TargetMaterialization = AssetCheckEvaluationTargetMaterializationData


def judged_materialization(
    instance: dg.DagsterInstance, asset_key: dg.AssetKey, tenant: str
) -> TargetMaterialization | None:
    """The tenant partition's latest materialization, which a check evaluation on that
    partition judges. Without it Dagster counts the evaluation as older than the
    materialization: the check's Partitions tab shows the tenant as Missing."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=asset_key, asset_partitions=[tenant]), limit=1
    ).records
    if not records:
        return None
    return AssetCheckEvaluationTargetMaterializationData(
        storage_id=records[0].storage_id,
        run_id=records[0].run_id,
        timestamp=records[0].timestamp,
    )


def build_outcome_assets(specs: Sequence[JobSpec]) -> list[dg.AssetSpec]:
    """One asset per business outcome named in the catalog."""
    by_asset: dict[str, list[JobSpec]] = {}
    for spec in specs:
        if spec.presentation.outcome_asset:
            by_asset.setdefault(spec.presentation.outcome_asset, []).append(spec)
    return [
        dg.AssetSpec(
            key=dg.AssetKey(["qo_ops", asset]),
            description=_asset_description(jobs),
            group_name="business_outcomes",
            kinds={"postgres"},
            partitions_def=tenants_partitions_def,
        )
        for asset, jobs in sorted(by_asset.items())
    ]


def _asset_description(jobs: Sequence[JobSpec]) -> str:
    """Who keeps the asset right, what healthy looks like, and what its plots show."""
    names = ", ".join(j.name for j in jobs)
    healthy = " ".join(j.presentation.healthy for j in jobs if j.presentation.healthy)
    return (
        f"Business state kept right by: {names}, one partition per tenant. Healthy: {healthy} "
        "Each tenant's run records on the tenant's partition what it did (a materialization "
        "when an execute run kept the outcome right, else an observation) and its checks. "
        "Figures (per tenant): backlog and oldest_due_age_s (the tenant's whole backlog, every "
        "day of it), and where they apply checkpoint_age_s, mismatches, dead_letters — each "
        "should stay flat near 0; a line that keeps rising means the job is not keeping up. "
        "A check executed on its own judges each tenant partition picked (a windowed job: "
        "every day its schedule has run for)."
    )


def check_severity(check: CheckSpec) -> dg.AssetCheckSeverity:
    return dg.AssetCheckSeverity.ERROR if check.blocking else dg.AssetCheckSeverity.WARN


def _figures(result: OutcomeCheck) -> str:
    return ", ".join(f"{k}={v}" for k, v in result.metadata.items())


def judge_declared(
    spec: JobSpec, conn: Any, tenants: Sequence[str], selected: Sequence[CheckSpec]
) -> Iterator[tuple[str, CheckSpec, OutcomeCheck, dict[str, str]]]:
    """The ``selected`` checks judged for each tenant: the tenant (tenant jobs), or every
    day that can hold its overdue work (windowed jobs); one clock for every tenant.
    Raises :class:`QoOpsError` for a bad setting (the outcome cannot be judged)."""
    now = database_now(conn)
    for tenant in tenants:
        scope = overdue_scope(spec, tenant, now)
        days: dict[str, str] = {}
        if scope.window_start is not None and scope.window_end is not None:
            last = scope.window_end - timedelta(days=1)
            days = {"first_day": str(scope.window_start), "last_day": str(last)}
        ctx = BatchContext(spec.name, scope, "dry_run", uuid.uuid4())
        results = {r.name: r for r in spec.check(conn, ctx)}
        for check in selected:
            yield tenant, check, results[check.name], days


def declared_evaluations(
    spec: JobSpec,
    conn: Any,
    tenants: Sequence[str],
    selected: Sequence[CheckSpec],
    instance: dg.DagsterInstance,
) -> Iterator[dg.AssetCheckEvaluation | dg.Output[None]]:
    """One evaluation per tenant partition and check, then the summed-up output: tenants
    checked, failing tenants per check (first 50) and the figures of the first 10. A
    blocking check failing anywhere fails the step, as Dagster does for blocking checks;
    a bad setting fails every selected check on every tenant with ``cannot check: …``."""
    asset = outcome_asset_key(spec)
    failing: dict[str, list[str]] = {c.name: [] for c in selected}
    detail: list[str] = []
    try:
        judged = list(judge_declared(spec, conn, tenants, selected))
    except QoOpsError as exc:
        cause = f"cannot check: {one_line(str(exc), 300)}"
        for tenant in tenants:
            for check in selected:
                yield dg.AssetCheckEvaluation(
                    asset_key=asset, check_name=check.name, passed=False, partition=tenant,
                    severity=check_severity(check), description=cause,
                )  # fmt: skip
        raise dg.Failure(description=cause, allow_retries=False) from None
    for tenant, check, result, days in judged:
        yield dg.AssetCheckEvaluation(
            asset_key=asset,
            check_name=check.name,
            passed=result.passed,
            partition=tenant,
            target_materialization_data=judged_materialization(instance, asset, tenant),
            metadata={**result.metadata, **days},
            severity=check_severity(check),
            description=result.description,
        )
        if not result.passed:
            failing[check.name].append(tenant)
            if len(detail) < MAX_DETAIL:
                detail.append(f"{check.name} {tenant}: {_figures(result)}")
    metadata: dict[str, Any] = {"tenants_checked": len(tenants)}
    for name, names in failing.items():
        metadata[f"{name}_failing"] = len(names)
        metadata[f"{name}_failing_tenants"] = ", ".join(names[:MAX_NAMED_TENANTS]) or "none"
    if detail:
        metadata["failing_detail"] = one_line("; ".join(detail), 1000)
    blocked = sorted({t for c in selected if c.blocking for t in failing[c.name]})
    if blocked:
        raise dg.Failure(
            description=f"{spec.name}: a blocking outcome check failed for {len(blocked)} "
            f"tenant(s): {', '.join(blocked[:MAX_NAMED_TENANTS])}",
            metadata=metadata,
            allow_retries=False,
        )
    yield dg.Output(None, metadata=metadata)


def _build_check(spec: JobSpec, declared: CheckSpec) -> dg.AssetChecksDefinition:
    """One declared check, partitioned by tenant like its asset. Executed for some tenant
    partitions (GraphQL or Python: Dagster 1.13.27's UI disables Execute on a partitioned
    check) it records one evaluation on each; through the Checks tab's "Execute all" (no
    partition) or ``outcome_checks_job``, on every tenant."""
    with warnings.catch_warnings():  # partitioned checks are a preview in the pinned Dagster
        warnings.simplefilter("ignore", dg.PreviewWarning)

        @dg.asset_check(  # type: ignore[arg-type]  # yields evaluations, not one AssetCheckResult
            asset=outcome_asset_key(spec),
            name=declared.name,
            description=declared.description,
            blocking=declared.blocking,
            partitions_def=tenants_partitions_def,
        )
        def outcome_check(
            context: dg.AssetCheckExecutionContext, database: QoOpsDatabase
        ) -> Iterator[dg.AssetCheckEvaluation | dg.Output[None]]:
            # one evaluation per tenant partition: an AssetCheckResult has no partition
            op = context.op_execution_context
            with database.engine().connect() as conn:
                tenants = (  # the Checks tab's "Execute all" launches without a partition
                    list(op.partition_keys)
                    if op.has_partition_key or op.has_partition_key_range
                    else tenant_ids(conn)
                )
                yield from declared_evaluations(spec, conn, tenants, [declared], op.instance)

    return outcome_check


OUTCOME_CHECKS_JOB = "outcome_checks_job"


def build_outcome_checks_job(specs: Sequence[JobSpec]) -> dg.JobDefinition:
    """``outcome_checks_job``: a person judges a job's declared checks now, for some or
    every tenant, from the Launchpad; each result lands on the tenant's partition."""
    by_name = {s.name: s for s in specs if s.presentation.outcome_asset and s.checks}
    target = enum.Enum("CheckedJob", {n: n for n in by_name})  # type: ignore[misc]

    class OutcomeChecksConfig(dg.Config):
        """Which job's checks, for which tenants."""

        job: target = Field(description="The catalog job whose declared checks to judge.")
        tenants: list[str] = Field(
            default_factory=list, description="Tenants to judge; empty: every tenant."
        )
        checks: list[str] = Field(
            default_factory=list, description="Check names; empty: every declared check."
        )

    @dg.op(name="outcome_checks_op", description="Judge a job's declared outcome checks now")
    def outcome_checks_op(
        context: dg.OpExecutionContext,
        config: OutcomeChecksConfig,
        database: QoOpsDatabase,
    ) -> Iterator[dg.AssetCheckEvaluation | dg.Output[None]]:
        spec = by_name[config.job.value]
        declared = {c.name: c for c in spec.checks}
        unknown = [c for c in config.checks if c not in declared]
        if unknown:
            raise dg.Failure(
                description=f"{spec.name} declares no check {', '.join(unknown[:10])} "
                f"(it declares {', '.join(declared)})",
                allow_retries=False,
            )
        selected = [declared[c] for c in config.checks] or list(spec.checks)
        with database.engine().connect() as conn:
            every = tenant_ids(conn)
            missing = sorted(set(config.tenants) - set(every))
            if missing:  # validated before anything is recorded
                raise dg.Failure(
                    description=f"unknown tenant(s): {', '.join(missing[:20])}",
                    allow_retries=False,
                )
            tenants = sorted(config.tenants) or every
            context.log.info(
                f"judging {', '.join(c.name for c in selected)} of {spec.name} "
                f"for {len(tenants)} tenant(s)"
            )
            yield from declared_evaluations(spec, conn, tenants, selected, context.instance)

    @dg.job(
        name=OUTCOME_CHECKS_JOB,
        description="Judge a catalog job's declared outcome checks now, for some or every "
        "tenant; each evaluation lands on the tenant's partition of the job's outcome asset",
    )
    def outcome_checks_job() -> None:
        outcome_checks_op()

    return outcome_checks_job


def build_outcome_checks(specs: Sequence[JobSpec]) -> list[dg.AssetChecksDefinition]:
    """Every check every catalog job declares, each partitioned by tenant."""
    return [_build_check(s, c) for s in specs if s.presentation.outcome_asset for c in s.checks]
