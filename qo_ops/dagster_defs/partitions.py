"""Partitions, sized for 10,000 tenants × years of days (Dagster advises ≤ 100,000 keys per
definition): ``tenants`` (dynamic, kept equal to the tenant table by a sensor) partitions
the outcome assets and the tenant jobs; ``days`` partitions the windowed jobs, whose runs
name their tenants in run config. No tenant × day product: it grows without bound.

The run tags and the pure key functions (partition key ↔ scope, chunks of tenants) live in
:mod:`qo_ops.platform.partition_keys`, which the API and the CLI import without Dagster."""

from __future__ import annotations

import os

import dagster as dg

from qo_ops.platform.spec import JobSpec

PARTITION_START_ENV = "QO_OPS_PARTITION_START"
DEFAULT_PARTITION_START = "2026-01-01"

tenants_partitions_def = dg.DynamicPartitionsDefinition(name="tenants")
days_partitions_def = dg.DailyPartitionsDefinition(
    start_date=os.environ.get(PARTITION_START_ENV, DEFAULT_PARTITION_START), timezone="UTC"
)


def partitions_def_for(spec: JobSpec) -> dg.PartitionsDefinition:
    """Tenant partitions for sweeps, day partitions for windowed jobs."""
    return days_partitions_def if spec.partitioning == "tenant_day" else tenants_partitions_def
