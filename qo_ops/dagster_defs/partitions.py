"""Partitions, sized for 10,000 tenants × years of days (Dagster advises ≤ 100,000 keys per
definition): ``tenants`` (dynamic, kept equal to the tenant table by a sensor) partitions
the outcome assets and the tenant jobs; a windowed job's partitions are a day × a tenant
chunk (``tenant_chunks``, dynamic, kept by the same sensor: ``chunk-001`` … one per
``CHUNK_SIZE`` tenants), so Dagster's own Launch backfill over days and chunks makes one run
per chunk and day, as a tick does. No tenant × day product: it grows without bound; days ×
chunks is 100 keys a day at 10,000 tenants (36,500 a year).

The run tags and the pure key functions (partition key ↔ scope, chunks of tenants) live in
:mod:`qo_ops.platform.schedule.partition_keys`, which the API and the CLI import without Dagster."""

from __future__ import annotations

import os

import dagster as dg

from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.schedule.partition_keys import CHUNK_DIMENSION, DAY_DIMENSION

PARTITION_START_ENV = "QO_OPS_PARTITION_START"
DEFAULT_PARTITION_START = "2026-01-01"

tenants_partitions_def = dg.DynamicPartitionsDefinition(name="tenants")
tenant_chunks_partitions_def = dg.DynamicPartitionsDefinition(name="tenant_chunks")
days_partitions_def = dg.DailyPartitionsDefinition(
    start_date=os.environ.get(PARTITION_START_ENV, DEFAULT_PARTITION_START), timezone="UTC"
)
windowed_partitions_def = dg.MultiPartitionsDefinition(
    {DAY_DIMENSION: days_partitions_def, CHUNK_DIMENSION: tenant_chunks_partitions_def}
)


def partitions_def_for(spec: JobSpec) -> dg.PartitionsDefinition:
    """Tenant partitions for sweeps, day × tenant chunk partitions for windowed jobs."""
    return windowed_partitions_def if spec.partitioning == "tenant_day" else tenants_partitions_def


def windowed_partition_key(day_key: str, chunk: str) -> dg.MultiPartitionKey:
    """The windowed partition of ``chunk`` on ``day_key`` (``YYYY-MM-DD``)."""
    return dg.MultiPartitionKey({DAY_DIMENSION: day_key, CHUNK_DIMENSION: chunk})
