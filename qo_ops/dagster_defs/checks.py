"""Business outcomes as assets with checks. The job ops report the checks after each execute
run (``AssetCheckEvaluation``); executed on their own, the checks look at every tenant."""

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import dagster as dg
import sqlalchemy as sa

from qo_ops.dagster_defs.resources import QoOpsDatabase
from qo_ops.platform.spec import BatchContext, CheckSpec, JobSpec, Scope

CHECK_DAYS = 7


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
        "Plots (from every run and the backlog sensors): backlog, oldest_due_age_s, and "
        "where they apply checkpoint_age_s, mismatches, dead_letters — each should stay flat "
        "near 0; a line that keeps rising means the job is not keeping up."
    )


def _build_check(spec: JobSpec, check: CheckSpec) -> dg.AssetChecksDefinition:
    @dg.asset_check(
        asset=outcome_asset_key(spec),
        name=check.name,
        description=check.description,
        blocking=check.blocking,
    )
    def outcome_check(database: QoOpsDatabase) -> dg.AssetCheckResult:
        engine = database.engine()
        failing: list[str] = []
        with engine.connect() as conn:
            tenants = conn.execute(sa.text("SELECT id FROM tenant ORDER BY id")).scalars().all()
            today = datetime.now(UTC).date()
            for tenant in tenants:
                # windowed outcomes: the last CHECK_DAYS full days
                scope = (
                    Scope(tenant)
                    if spec.partitioning == "tenant"
                    else Scope(tenant, today - timedelta(days=CHECK_DAYS), today)
                )
                ctx = BatchContext(spec.name, scope, "dry_run", uuid.uuid4())
                result = next(c for c in spec.check(conn, ctx) if c.name == check.name)
                if not result.passed:
                    failing.append(tenant)
        return dg.AssetCheckResult(
            passed=not failing,
            metadata={
                "tenants_checked": len(tenants),
                "tenants_failing": ", ".join(failing) or "none",
            },
        )

    return outcome_check


def build_outcome_checks(specs: Sequence[JobSpec]) -> list[dg.AssetChecksDefinition]:
    """Every check every catalog job declares."""
    return [
        _build_check(spec, check) for spec in specs if spec.outcome_asset for check in spec.checks
    ]
