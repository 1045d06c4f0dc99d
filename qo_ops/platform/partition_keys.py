"""How a run is named to Dagster, without Dagster: the run tags qo-ops reads and writes, the
partition key of a run and the scope a key stands for, and how tenants are split into chunk
runs. The Dagster layer (``qo_ops.dagster_defs.partitions``), the operator API and the CLI
share these; importing them imports no Dagster."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from datetime import date

from qo_ops.errors import BadInput
from qo_ops.platform.spec import JobSpec, Scope

SCOPE_TAG = "qo_ops/scope"  # one job × scope at a time: see tag_concurrency_limits in dagster.yaml
MODE_TAG = "qo_ops/mode"  # backfills take no run config (dagster#10079): the op reads this tag
REASON_TAG = "qo_ops/reason"
JOB_RUN_TAG = "qo_ops/job_run_id"  # a run the operator API accepted: the op adopts its row
REQUESTER_TAG = "qo_ops/requester"
WINDOW_TAG = "qo_ops/window"
TENANTS_TAG = "qo_ops/tenants"  # a chunk run: how many tenants, and the first and last
FAILED_TENANTS_TAG = "qo_ops/failed_tenants"  # set on a chunk run: re-executing it runs these


def partition_key_for(spec: JobSpec, tenant: str, day: date | None = None) -> str:
    """The partition key of a run of ``spec`` for a tenant (and day): the day for a windowed
    job (its tenants go in run config), the tenant otherwise."""
    if spec.partitioning == "tenant_day":
        assert day is not None
        return day.isoformat()
    return tenant


def scope_from_partition_key(spec: JobSpec, key: str, tenant: str | None = None) -> Scope:
    """Turn a partition key (and, for a windowed job, the tenant) into the platform's scope.
    Keys of the old tenant × day partitions (``day|tenant``) are still read."""
    if spec.partitioning == "tenant_day":
        day_key, _, old_tenant = key.partition("|")  # dimensions in name order: day|tenant
        try:
            day = date.fromisoformat(day_key)
        except ValueError:
            raise BadInput(f"partition key {key!r} is not a day (YYYY-MM-DD)") from None
        who = tenant or old_tenant
        if not who:
            raise BadInput(f"{spec.name} is windowed: name its tenants in run config (tenants)")
        return Scope.days(who, day, day)
    return Scope(key)


def scope_tag(spec: JobSpec, key: str) -> dict[str, str]:
    """Run tags that let the run queue keep one run per job and scope (a windowed job's
    launch by hand: per job and day)."""
    if spec.partitioning == "tenant_day":
        return {SCOPE_TAG: f"{spec.name}:{key}"}
    return {SCOPE_TAG: f"{spec.name}:{scope_from_partition_key(spec, key).key}"}


def chunk_tenants(
    spec: JobSpec, tenants: Sequence[str], size: int | None = None
) -> list[list[str]]:
    """Split ``tenants`` (sorted) into runs of at most ``size`` (``spec.tenants_per_run``).
    The chunks start at an offset derived from the job's name, so jobs that share a cron
    do not all begin with the same tenants at the same second."""
    ordered = sorted(tenants)
    size = size or spec.tenants_per_run
    chunks = [ordered[i : i + size] for i in range(0, len(ordered), size)]
    if not chunks:
        return []
    turn = zlib.crc32(spec.name.encode()) % len(chunks)  # deterministic per job
    return chunks[turn:] + chunks[:turn]


def chunk_scope_tag(
    spec: JobSpec, tenants: Sequence[str], day: date | None = None
) -> dict[str, str]:
    """The queue tag of a chunk run: the job, the day, and the chunk's first tenant — the same
    chunk of the next tick waits behind this one instead of overlapping it."""
    where = f"{day.isoformat()}:" if day is not None else ""
    return {
        SCOPE_TAG: f"{spec.name}:{where}chunk:{tenants[0]}",
        TENANTS_TAG: f"{len(tenants)}: {tenants[0]}..{tenants[-1]}",
    }
