"""Partitions: tenants (dynamic, kept in sync with the tenant table by a sensor) and, for
windowed jobs, tenant × day."""

from __future__ import annotations

import os
from datetime import date

import dagster as dg

from qo_ops.errors import BadInput
from qo_ops.platform.spec import JobSpec, Scope

PARTITION_START_ENV = "QO_OPS_PARTITION_START"
DEFAULT_PARTITION_START = "2026-01-01"  # days × tenants stays far below 100,000 partitions

tenants_partitions_def = dg.DynamicPartitionsDefinition(name="tenants")
days_partitions_def = dg.DailyPartitionsDefinition(
    start_date=os.environ.get(PARTITION_START_ENV, DEFAULT_PARTITION_START), timezone="UTC"
)
tenant_day_partitions_def = dg.MultiPartitionsDefinition(
    {"day": days_partitions_def, "tenant": tenants_partitions_def}
)

SCOPE_TAG = "qo_ops/scope"  # one job × scope at a time: see tag_concurrency_limits in dagster.yaml
MODE_TAG = "qo_ops/mode"  # backfills take no run config (dagster#10079): the op reads this tag
REASON_TAG = "qo_ops/reason"
JOB_RUN_TAG = "qo_ops/job_run_id"  # a run the operator API accepted: the op adopts its row
REQUESTER_TAG = "qo_ops/requester"
WINDOW_TAG = "qo_ops/window"


def partitions_def_for(spec: JobSpec) -> dg.PartitionsDefinition:
    """Tenant partitions for sweeps, tenant × day for windowed jobs."""
    return (
        tenant_day_partitions_def if spec.partitioning == "tenant_day" else tenants_partitions_def
    )


def partition_key_for(spec: JobSpec, tenant: str, day: date | None = None) -> str:
    """The partition key of a tenant (and day) for ``spec``."""
    if spec.partitioning == "tenant_day":
        assert day is not None
        return str(dg.MultiPartitionKey({"day": day.isoformat(), "tenant": tenant}))
    return tenant


def scope_from_partition_key(spec: JobSpec, key: str) -> Scope:
    """Turn a partition key back into the platform's scope."""
    if spec.partitioning == "tenant_day":
        day_key, _, tenant = key.partition("|")  # dimensions in name order: day|tenant
        try:
            day = date.fromisoformat(day_key)
        except ValueError:
            raise BadInput(f"partition key {key!r} is not day|tenant") from None
        return Scope.days(tenant, day, day)
    return Scope(key)


def scope_tag(spec: JobSpec, key: str) -> dict[str, str]:
    """Run tags that let the run queue keep one run per job and scope."""
    return {SCOPE_TAG: f"{spec.name}:{scope_from_partition_key(spec, key).key}"}
