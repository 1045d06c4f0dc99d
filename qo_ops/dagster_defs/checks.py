"""Business outcomes as assets with checks. The job ops report the checks after each execute
run (``AssetCheckEvaluation``, the run's own scope). Executed on their own (asset → Checks →
Execute all), one asset check per job evaluates them for every tenant: the tenant (tenant
jobs), or every day that can hold overdue work (windowed jobs: ``overdue_scope``)."""

import uuid
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import dagster as dg
import sqlalchemy as sa

from qo_ops.dagster_defs.partitions import tenants_partitions_def
from qo_ops.dagster_defs.resources import QoOpsDatabase
from qo_ops.errors import QoOpsError, one_line
from qo_ops.platform.overdue import database_now, overdue_scope
from qo_ops.platform.spec import BatchContext, CheckSpec, JobSpec, OutcomeCheck

MAX_NAMED_TENANTS = 50  # failing tenants named in a check's metadata
MAX_DETAIL = 10  # failing tenants whose figures are shown


def outcome_asset_key(spec: JobSpec) -> dg.AssetKey:
    return dg.AssetKey(["qo_ops", spec.outcome_asset])


def build_outcome_assets(specs: Sequence[JobSpec]) -> list[dg.AssetSpec]:
    """One asset per business outcome named in the catalog."""
    by_asset: dict[str, list[JobSpec]] = {}
    for spec in specs:
        if spec.outcome_asset:
            by_asset.setdefault(spec.outcome_asset, []).append(spec)
    return [
        dg.AssetSpec(
            key=dg.AssetKey(["qo_ops", asset]),
            partitions_def=tenants_partitions_def,  # every tenant's outcome on its own partition
            description=_asset_description(jobs),
            group_name="business_outcomes",
            kinds={"postgres"},
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


def _build_checks(spec: JobSpec) -> dg.AssetChecksDefinition:
    """The job's declared checks, executed on their own: one pass over the tenants computes
    every selected check (``spec.check`` returns them all at once)."""
    asset = outcome_asset_key(spec)
    declared = {dg.AssetCheckKey(asset, c.name): c for c in spec.checks}

    @dg.multi_asset_check(
        name=f"{spec.name}_outcome_checks",
        specs=[
            dg.AssetCheckSpec(c.name, asset=asset, description=c.description, blocking=c.blocking)
            for c in spec.checks
        ],
        can_subset=True,
        description=f"The outcome checks of {spec.name}, for every tenant"
        + (
            ", over every day that can hold overdue work"
            if spec.partitioning == "tenant_day"
            else ""
        ),
    )
    def outcome_checks(
        context: dg.AssetCheckExecutionContext, database: QoOpsDatabase
    ) -> Iterator[dg.AssetCheckResult]:
        selected = [declared[k] for k in declared if k in context.selected_asset_check_keys]
        failing: dict[str, list[str]] = {c.name: [] for c in selected}
        detail: dict[str, list[str]] = {c.name: [] for c in selected}
        days: dict[str, str] = {}  # the same for every tenant: the days that can hold overdue work
        try:
            with database.engine().connect() as conn:
                now = database_now(conn)  # one clock for every tenant of this evaluation
                tenants = conn.execute(sa.text("SELECT id FROM tenant ORDER BY id")).scalars().all()
                for tenant in tenants:
                    scope = overdue_scope(spec, tenant, now)
                    if scope.window_start is not None and scope.window_end is not None:
                        last = scope.window_end - timedelta(days=1)
                        days = {"first_day": str(scope.window_start), "last_day": str(last)}
                    ctx = BatchContext(spec.name, scope, "dry_run", uuid.uuid4())
                    results = {r.name: r for r in spec.check(conn, ctx)}
                    for check in selected:
                        result = results[check.name]
                        if not result.passed:
                            failing[check.name].append(tenant)
                            if len(detail[check.name]) < MAX_DETAIL:
                                detail[check.name].append(f"{tenant}: {_figures(result)}")
        except QoOpsError as exc:  # a bad setting: the outcome cannot be judged, so not passed
            for check in selected:
                yield dg.AssetCheckResult(
                    asset_key=asset,
                    check_name=check.name,
                    passed=False,
                    severity=_severity(check),
                    description=f"cannot check: {one_line(str(exc), 300)}",
                )
            return
        for check in selected:
            names = failing[check.name]
            metadata: dict[str, Any] = {
                "tenants_checked": len(tenants),
                "tenants_failing": len(names),
                "failing_tenants": ", ".join(names[:MAX_NAMED_TENANTS]) or "none",
            }
            metadata |= days
            if detail[check.name]:
                metadata["failing_detail"] = one_line("; ".join(detail[check.name]), 1000)
            yield dg.AssetCheckResult(
                asset_key=asset,
                check_name=check.name,
                passed=not names,
                severity=_severity(check),
                metadata=metadata,
            )

    return outcome_checks


def build_outcome_checks(specs: Sequence[JobSpec]) -> list[dg.AssetChecksDefinition]:
    """Every check every catalog job declares (one asset check definition per job)."""
    return [_build_checks(spec) for spec in specs if spec.outcome_asset and spec.checks]
