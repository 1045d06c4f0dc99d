"""How a run is named to Dagster, without importing Dagster.

This module holds the run tags that qo-ops reads and writes, the partition key of a run and
the scope a key stands for, and how tenants are split into chunk runs. The Dagster layer
(``qo_ops.dagster_defs.partitions``), the operator API and the CLI share these. Importing
them imports no Dagster.

A windowed job's partition is a day and a **tenant chunk**. Chunk k (``chunk-001`` …) holds
the tenants at positions [(k-1)·CHUNK_SIZE, k·CHUNK_SIZE) in the order (created_at, id).
Tenants are appended, so adding tenants never moves a tenant to another chunk. Deleting a
tenant shifts every later tenant by one place. So it may move the first tenant of each later
chunk back into the chunk before it."""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from datetime import date

from qo_ops.errors import BadInput
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.job.spec import JobSpec

# The run queue runs one job × scope at a time (see tag_concurrency_limits in dagster.yaml).
SCOPE_TAG = "qo_ops/scope"
# Backfills take no run config (dagster#10079), so the op reads the mode from this tag.
MODE_TAG = "qo_ops/mode"
REASON_TAG = "qo_ops/reason"
JOB_RUN_TAG = "qo_ops/job_run_id"  # for a run the operator API accepted; the op adopts its row
REQUESTER_TAG = "qo_ops/requester"
WINDOW_TAG = "qo_ops/window"
TENANTS_TAG = "qo_ops/tenants"  # on a chunk run: how many tenants, and the first and last
FAILED_TENANTS_TAG = "qo_ops/failed_tenants"  # on a chunk run; re-executing it runs these

PARTITION_TAG = "dagster/partition"  # Dagster's own tag of a run's partition
# A windowed job's partition dimensions. Dagster orders them by name, so its keys read day
# first: 2026-12-01|chunk-001.
DAY_DIMENSION = "day"
CHUNK_DIMENSION = "tenant_chunk"
# Tenants per chunk. It equals every windowed job's tenants_per_run, and a test holds it so.
CHUNK_SIZE = 100
_CHUNK_KEY = re.compile(r"^chunk-([0-9]{3,})$")


def chunk_key(number: int) -> str:
    """The key of tenant chunk ``number`` (1-based): ``chunk-001``."""
    return f"chunk-{number:03d}"


def chunk_keys(tenant_count: int, size: int = CHUNK_SIZE) -> list[str]:
    """The chunk keys of ``tenant_count`` tenants. There are ceil(count / size) of them."""
    return [chunk_key(k) for k in range(1, -(-tenant_count // size) + 1)]


def chunk_number(key: str) -> int:
    """The number of chunk ``key``, e.g. 7 for ``chunk-007``.

    Any other key raises :class:`BadInput`."""
    found = _CHUNK_KEY.match(key)
    if found is None or int(found.group(1)) < 1:
        raise BadInput(f"{key[:64]!r} is not a tenant chunk (chunk-001, chunk-002, …)")
    return int(found.group(1))


def chunk_bounds(key: str, size: int = CHUNK_SIZE) -> tuple[int, int]:
    """The positions [start, stop) of chunk ``key``'s tenants in the (created_at, id) order."""
    k = chunk_number(key)
    return (k - 1) * size, k * size


def chunk_at(position: int, size: int = CHUNK_SIZE) -> str:
    """The chunk of the tenant at ``position`` (0-based) in the (created_at, id) order."""
    return chunk_key(position // size + 1)


def chunks_of(ordered: Sequence[str], size: int = CHUNK_SIZE) -> dict[str, list[str]]:
    """Map each chunk key to its tenants, given the tenants in (created_at, id) order."""
    return {chunk_at(i, size): list(ordered[i : i + size]) for i in range(0, len(ordered), size)}


def windowed_key(day: date, chunk: str) -> str:
    """The partition key of a windowed job's run: ``2026-12-01|chunk-001``."""
    chunk_number(chunk)
    return f"{day.isoformat()}|{chunk}"


def split_windowed_key(key: str) -> tuple[date, str | None, str | None]:
    """Split a windowed job's partition key into ``(day, chunk, tenant)``.

    Keys are ``day|chunk`` today. Runs recorded before may carry old keys, which are still
    read. These are day-only keys (``2026-12-01``, with no chunk) and tenant × day keys
    (``day|tenant``)."""
    day_key, _, rest = key.partition("|")
    try:
        day = date.fromisoformat(day_key)
    except ValueError:
        raise BadInput(f"partition key {key[:80]!r} is not a day (YYYY-MM-DD) and chunk") from None
    if not rest:
        return day, None, None
    if _CHUNK_KEY.match(rest):
        return day, rest, None
    return day, None, rest


def partition_tags(key: str) -> dict[str, str]:
    """Dagster's partition tags of a run of ``key``, as Dagster sets them on the runs it
    creates itself.

    They are ``dagster/partition`` and, for a windowed key, one tag per dimension
    (``dagster/partition/day`` and ``…/tenant_chunk``)."""
    tags = {PARTITION_TAG: key}
    if "|" in key:
        day, chunk, _ = split_windowed_key(key)
        if chunk is not None:
            tags[f"{PARTITION_TAG}/{DAY_DIMENSION}"] = day.isoformat()
            tags[f"{PARTITION_TAG}/{CHUNK_DIMENSION}"] = chunk
    return tags


def partition_key_for(
    spec: JobSpec, tenant: str, day: date | None = None, chunk: str | None = None
) -> str:
    """The partition key of a run of ``spec`` for a tenant (and day).

    For a windowed job, it is the day and the tenant's chunk, and the tenants go in run
    config. For other jobs, it is the tenant."""
    if spec.partitioning == "tenant_day":
        assert day is not None and chunk is not None
        return windowed_key(day, chunk)
    return tenant


def scope_from_partition_key(spec: JobSpec, key: str, tenant: str | None = None) -> Scope:
    """Turn a partition key (and, for a windowed job, the tenant) into the platform's scope.

    Keys of the old day-only and tenant × day partitions are still read."""
    if spec.partitioning == "tenant_day":
        day, _, old_tenant = split_windowed_key(key)
        who = tenant or old_tenant
        if not who:
            raise BadInput(f"{spec.name} is windowed: name its tenants in run config (tenants)")
        return Scope.days(who, day, day)
    return Scope(key)


def scope_tag(spec: JobSpec, key: str) -> dict[str, str]:
    """Run tags that let the run queue keep one run per job and scope.

    For a windowed job launched by hand, it is one run per job and day."""
    if spec.partitioning == "tenant_day":
        return {SCOPE_TAG: f"{spec.name}:{key}"}
    return {SCOPE_TAG: f"{spec.name}:{scope_from_partition_key(spec, key).key}"}


def chunk_tenants(
    spec: JobSpec, tenants: Sequence[str], size: int | None = None
) -> list[list[str]]:
    """Split ``tenants`` (sorted) into runs of at most ``size`` tenants.

    ``size`` defaults to ``spec.deployment.tenants_per_run``. The chunks start at an offset
    derived from the job's name, so jobs that share a cron do not all begin with the same
    tenants at the same second."""
    ordered = sorted(tenants)
    size = size or spec.deployment.tenants_per_run
    chunks = [ordered[i : i + size] for i in range(0, len(ordered), size)]
    if not chunks:
        return []
    turn = zlib.crc32(spec.name.encode()) % len(chunks)  # deterministic per job
    return chunks[turn:] + chunks[:turn]


def chunk_scope_tag(
    spec: JobSpec, tenants: Sequence[str], day: date | None = None
) -> dict[str, str]:
    """The queue tag of a chunk run: the job, the day, and the chunk's first tenant.

    With this tag, the same chunk of the next tick waits behind this run instead of
    overlapping it."""
    where = f"{day.isoformat()}:" if day is not None else ""
    return {
        SCOPE_TAG: f"{spec.name}:{where}chunk:{tenants[0]}",
        TENANTS_TAG: f"{len(tenants)}: {tenants[0]}..{tenants[-1]}",
    }
