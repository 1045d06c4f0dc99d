"""Business outcomes as assets partitioned by tenant, with checks partitioned the same way.
The job ops record each tenant's outcome and checks on its partition after each run.
Executed on their own (asset → Checks → Execute), a check judges each tenant partition
picked: the tenant (tenant jobs), or every day that can hold overdue work (windowed jobs:
``overdue_scope``)."""

import uuid
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import dagster as dg
import sqlalchemy as sa

# not exported by dagster; its AssetCheckResult fills the same field the same way
from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    AssetCheckEvaluationTargetMaterializationData,
)

from qo_ops.dagster_defs.partitions import tenants_partitions_def
from qo_ops.dagster_defs.resources import QoOpsDatabase
from qo_ops.errors import QoOpsError, one_line
from qo_ops.platform.overdue import database_now, overdue_scope
from qo_ops.platform.spec import BatchContext, CheckSpec, JobSpec, OutcomeCheck

MAX_NAMED_TENANTS = 50  # failing tenants named in a check's metadata
MAX_DETAIL = 10  # failing tenants whose figures are shown


def outcome_asset_key(spec: JobSpec) -> dg.AssetKey:
    return dg.AssetKey(["qo_ops", spec.outcome_asset])


def judged_materialization(
    instance: dg.DagsterInstance, asset_key: dg.AssetKey, tenant: str
) -> AssetCheckEvaluationTargetMaterializationData | None:
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
        if spec.outcome_asset:
            by_asset.setdefault(spec.outcome_asset, []).append(spec)
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
    healthy = " ".join(j.healthy for j in jobs if j.healthy)
    return (
        f"Business state kept right by: {names}. Healthy: {healthy} "
        "Plots (from every run and the backlog sensors): backlog and oldest_due_age_s (a "
        "tenant's whole backlog, every day of it), and where they apply checkpoint_age_s, "
        "mismatches, dead_letters — each should stay flat near 0; a line that keeps rising "
        "means the job is not keeping up. Checks executed on their own look at every tenant "
        "and, for a windowed job, every day its schedule has run for."
    )


def _severity(check: CheckSpec) -> dg.AssetCheckSeverity:
    return dg.AssetCheckSeverity.ERROR if check.blocking else dg.AssetCheckSeverity.WARN


def _figures(result: OutcomeCheck) -> str:
    return ", ".join(f"{k}={v}" for k, v in result.metadata.items())


def _check_tenants(
    spec: JobSpec, conn: Any, tenants: Sequence[str], selected: CheckSpec
) -> Iterator[tuple[str, OutcomeCheck, dict[str, str]]]:
    """``selected`` judged for each tenant: the tenant (tenant jobs), or every day that can
    hold its overdue work (windowed jobs); one clock for every tenant of the evaluation."""
    now = database_now(conn)
    for tenant in tenants:
        scope = overdue_scope(spec, tenant, now)
        days: dict[str, str] = {}
        if scope.window_start is not None and scope.window_end is not None:
            last = scope.window_end - timedelta(days=1)
            days = {"first_day": str(scope.window_start), "last_day": str(last)}
        ctx = BatchContext(spec.name, scope, "dry_run", uuid.uuid4())
        results = {r.name: r for r in spec.check(conn, ctx)}
        yield tenant, results[selected.name], days


def _build_check(spec: JobSpec, declared: CheckSpec) -> dg.AssetChecksDefinition:
    """One declared check, partitioned by tenant like its asset. Executed on its own for
    some tenant partitions (asset → Checks → Execute), it records one evaluation on each of
    them; with no partition, on every tenant. Its own result sums them up."""
    asset = outcome_asset_key(spec)

    @dg.asset_check(
        asset=asset,
        name=declared.name,
        description=declared.description,
        blocking=declared.blocking,
        partitions_def=tenants_partitions_def,
    )
    def outcome_check(
        context: dg.AssetCheckExecutionContext, database: QoOpsDatabase
    ) -> dg.AssetCheckResult:
        op = context.op_execution_context
        failing: list[str] = []
        detail: list[str] = []
        checked = 0
        try:
            with database.engine().connect() as conn:
                tenants = (
                    list(op.partition_keys)
                    if op.has_partition_key or op.has_partition_key_range
                    else conn.execute(sa.text("SELECT id FROM tenant ORDER BY id")).scalars().all()
                )
                for tenant, result, days in _check_tenants(spec, conn, tenants, declared):
                    checked += 1
                    op.log_event(  # Dagster records it per partition; its annotation lags
                        dg.AssetCheckEvaluation(  # type: ignore[arg-type]
                            asset_key=asset,
                            check_name=declared.name,
                            passed=result.passed,
                            partition=tenant,
                            target_materialization_data=judged_materialization(
                                op.instance, asset, tenant
                            ),
                            metadata={**result.metadata, **days},
                            severity=_severity(declared),
                            description=result.description,
                        )
                    )
                    if not result.passed:
                        failing.append(tenant)
                        if len(detail) < MAX_DETAIL:
                            detail.append(f"{tenant}: {_figures(result)}")
        except QoOpsError as exc:  # a bad setting: the outcome cannot be judged, so not passed
            return dg.AssetCheckResult(
                passed=False,
                severity=_severity(declared),
                description=f"cannot check: {one_line(str(exc), 300)}",
            )
        metadata: dict[str, Any] = {
            "tenants_checked": checked,
            "tenants_failing": len(failing),
            "failing_tenants": ", ".join(failing[:MAX_NAMED_TENANTS]) or "none",
        }
        if detail:
            metadata["failing_detail"] = one_line("; ".join(detail), 1000)
        return dg.AssetCheckResult(
            passed=not failing, severity=_severity(declared), metadata=metadata
        )

    return outcome_check


def build_outcome_checks(specs: Sequence[JobSpec]) -> list[dg.AssetChecksDefinition]:
    """Every check every catalog job declares, each partitioned by tenant."""
    return [_build_check(s, c) for s in specs if s.outcome_asset for c in s.checks]
