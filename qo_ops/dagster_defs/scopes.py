"""What one Dagster run of a catalog job covers, settled before any scope is claimed: the
scopes its partition(s), run config and tags name (narrowed on a re-execution to the
tenants its parent failed, and to the tenants that exist), or, for a run the operator API
accepted, the scope and options of its job_run row."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import date
from typing import Any

import dagster as dg

from qo_ops.dagster_defs.submission import (
    BACKFILL_TENANTS_TAG,
    PARENT_RUN_TAG,
    trigger_from_tags,
)
from qo_ops.errors import BadInput, QoOpsError, error_class
from qo_ops.platform.job.options import TRIGGERS_WITH_A_PERSON, RunOptions
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.job.statuses import RunStatus
from qo_ops.platform.run import records
from qo_ops.platform.schedule.partition_keys import (
    FAILED_TENANTS_TAG,
    JOB_RUN_TAG,
    PARTITION_TAG,
    scope_from_partition_key,
    split_windowed_key,
)
from qo_ops.platform.schedule.tenants import chunk_members, chunk_of, tenant_ids

RANGE_START_TAG = "dagster/asset_partition_range_start"
RANGE_END_TAG = "dagster/asset_partition_range_end"
MAX_TENANTS_PER_RUN = 1000  # a run naming more tenants is refused: split it (ticks chunk by 50)
MAX_NAMED = 50  # tenants named in a run's failure description and metadata


def backfill_tenants(
    spec: JobSpec, tags: Mapping[str, str], engine: Any, chunk: str | None = None
) -> list[str]:
    """The tenants of a windowed job's run that names none in run config: its tenant
    chunk's (the partition's), or, in a Dagster backfill of the old day-only partitions,
    every tenant; in a backfill, only those of them the tag ``qo_ops/backfill_tenants``
    (comma-separated) names. A run of neither must name them (BadInput)."""
    if chunk is None and trigger_from_tags(tags) != "backfill":
        raise BadInput(
            f"{spec.name} is windowed: pick a day and tenant chunk partition, or name its "
            "tenants in run config (tenants)"
        )
    named = [t.strip() for t in tags.get(BACKFILL_TENANTS_TAG, "").split(",") if t.strip()]
    if BACKFILL_TENANTS_TAG in tags and not named:
        raise BadInput(f"tag {BACKFILL_TENANTS_TAG} names no tenant (tenant-001,tenant-002)")
    with engine.connect() as conn:
        if chunk is None:
            return named if named else tenant_ids(conn)
        members = chunk_members(conn, chunk)
    if named and trigger_from_tags(tags) == "backfill":  # the chosen ones of this chunk
        return [t for t in members if t in set(named)]
    return members


def chunk_strays(engine: Any, chunk: str, tenants: list[str]) -> str | None:
    """Config tenants of a run of tenant chunk ``chunk`` must be among its members: None
    when they are, else one line naming the chunk each stray tenant is in (or none)."""
    with engine.connect() as conn:
        members = set(chunk_members(conn, chunk))
        strays = [t for t in tenants if t not in members]
        if not strays:
            return None
        where = [
            f"{t[:64]} is in {chunk_of(conn, t) or 'no chunk (unknown tenant)'}" for t in strays
        ]
    return (
        f"config tenants must be members of the partition's tenant chunk {chunk}: "
        + "; ".join(where[:MAX_NAMED])
        + " (qo-ops status --tenant T names a tenant's chunk)"
    )


def windowed_partition(spec: JobSpec, tags: Mapping[str, str]) -> tuple[date, date, str | None]:
    """The first and last day of a windowed run's day partition(s) and its tenant chunk (None
    for the old day-only keys), read from the run's tags: Dagster cannot parse an old
    day-only key against today's day × chunk partitions. A range over several chunks is
    refused: a run is one chunk."""
    if PARTITION_TAG in tags:
        first, chunk, _ = split_windowed_key(tags[PARTITION_TAG])
        return first, first, chunk
    if RANGE_START_TAG not in tags or RANGE_END_TAG not in tags:
        raise BadInput(f"{spec.name} is windowed: pick its day and tenant chunk partition(s)")
    first, chunk, _ = split_windowed_key(tags[RANGE_START_TAG])
    last, last_chunk, _ = split_windowed_key(tags[RANGE_END_TAG])
    if chunk != last_chunk:
        raise BadInput(
            f"a run of {spec.name} covers one tenant chunk, got {chunk}..{last_chunk}: launch a "
            "backfill (one run per day and chunk)"
        )
    if last < first:
        raise BadInput(
            f"partition range {tags[RANGE_START_TAG]}..{tags[RANGE_END_TAG]} is reversed"
        )
    return first, last, chunk


def adopted_run(
    spec: JobSpec, engine: Any, job_run_tag: str, context: dg.OpExecutionContext
) -> tuple[Scope, RunOptions]:
    """Scope and options of a run the operator API accepted: its job_run row is the source
    of truth (validated and audited when it was accepted); the partition must agree."""
    try:
        run_id = uuid.UUID(job_run_tag)
    except ValueError:
        raise BadInput(f"tag {JOB_RUN_TAG} is not a job run id") from None
    accepted = records.load_accepted(engine, run_id, spec.name)
    key = context.run.tags.get(PARTITION_TAG, "")  # (Dagster cannot parse an old day-only key)
    partition = scope_from_partition_key(spec, key, accepted.scope.tenant_id)
    if spec.partitioning == "tenant_day":
        chunk = split_windowed_key(key)[1]
        strays = chunk_strays(engine, chunk, [accepted.scope.tenant_id]) if chunk else None
        if strays is not None:
            raise BadInput(strays)
    if partition.tenant_id != accepted.scope.tenant_id or (
        partition.window_start is not None and partition.window_start != accepted.scope.window_start
    ):
        raise BadInput(
            f"partition {key} does not match accepted run {run_id} ({accepted.scope.key})"
        )
    limits = accepted.options
    options = RunOptions(
        mode=accepted.mode,  # type: ignore[arg-type]
        trigger="api",
        batch_size=limits.get("batch_size"),
        max_items=limits.get("max_items"),
        throttle_ms=limits.get("throttle_ms"),
        requester=accepted.requester,
        reason=accepted.reason,
        approval=accepted.approval,
        correlation_id=accepted.correlation_id or context.run_id,
        dagster_run_id=context.run_id,
        job_run_id=run_id,
        progress_interval_s=10.0,
    )
    return accepted.scope, options


def refuse_accepted(engine: Any, job_run_tag: str, exc: QoOpsError) -> None:
    """Finish the accepted run ``job_run_tag`` names as failed (refused at start): a run the
    API accepted must not wait for ever when its Dagster run refuses it."""
    try:
        run_id = uuid.UUID(job_run_tag)
    except ValueError:
        return
    with engine.begin() as conn:
        code = error_class(exc, "bad_input")  # e.g. "suspended" (the kill switch)
        records.finish_unstarted(conn, run_id, RunStatus.FAILED, "refused_at_start", code, str(exc))


def _parent_failed_tenants(context: dg.OpExecutionContext, tags: dict[str, str]) -> set[str] | None:
    """A re-execution of a failed run that recorded which tenants failed runs only those: the
    failed tenants of the parent run, or None (not a re-execution, the parent succeeded, or
    no record: run all)."""
    parent_id = tags.get(PARENT_RUN_TAG)
    if not parent_id:
        return None
    parent = context.instance.get_run_by_id(parent_id)
    if (
        parent is None
        or parent.status == dg.DagsterRunStatus.SUCCESS  # its tag (if inherited) is cleared
        or FAILED_TENANTS_TAG not in parent.tags
    ):
        return None
    return {t for t in parent.tags[FAILED_TENANTS_TAG].split(",") if t}


def requested_scopes(
    spec: JobSpec,
    context: dg.OpExecutionContext,
    tenants: list[str] | None,
    tags: dict[str, str],
    engine: Any,
) -> list[Scope]:
    """The scopes a run covers, validated before any is claimed: its tenants (run config, or
    the tenant partition(s) of a tenant job) and, for a windowed job, its day partition(s)
    as one window. A windowed job's partition is a day and a tenant chunk: config tenants
    must be members of the chunk; without them (a Dagster backfill, which cannot pass run
    config) the run covers the chunk's tenants, narrowed in a backfill to those of the tag
    ``qo_ops/backfill_tenants``. A re-execution narrows them to the tenants its parent
    failed."""
    if tenants and spec.partitioning == "tenant" and context.has_partition_key:
        raise BadInput("give either a tenant partition or config tenants, not both")
    window: tuple[date, date] | None = None
    chunk: str | None = None
    if spec.partitioning == "tenant_day":
        first, last, chunk = windowed_partition(spec, tags)
        window = (first, last)
    every = False
    if not tenants:
        if spec.partitioning == "tenant_day":
            tenants = backfill_tenants(spec, tags, engine, chunk)
            every = BACKFILL_TENANTS_TAG not in tags
        else:
            if not context.has_partition_key_range and not context.has_partition_key:
                raise BadInput(
                    f"{spec.name}: pick a tenant partition or name tenants in run config"
                )
            tenants = list(context.partition_keys)
    elif chunk is not None and (strays := chunk_strays(engine, chunk, tenants)) is not None:
        if trigger_from_tags(tags) in TRIGGERS_WITH_A_PERSON:
            raise BadInput(strays)
        # a tick's tenant deleted (or shifted by a deletion) since the tick: left out
        members = set(backfill_tenants(spec, tags, engine, chunk))
        context.log.warning(f"{strays}: those are not run")
        tenants = [t for t in tenants if t in members]
    if len(tenants) > MAX_TENANTS_PER_RUN and not every:
        raise BadInput(f"a run covers at most {MAX_TENANTS_PER_RUN} tenants, got {len(tenants)}")
    if len(set(tenants)) != len(tenants):
        raise BadInput("config tenants names a tenant twice")
    failed_before = _parent_failed_tenants(context, tags)
    if failed_before is not None:
        tenants = [t for t in tenants if t in failed_before]
    scopes = []
    for tenant in tenants:
        try:
            scopes.append(Scope.days(tenant, *window) if window else Scope(tenant))
        except BadInput as exc:
            raise BadInput(f"tenant {tenant[:64]!r}: {exc}") from None
    return scopes


def known_tenants(
    engine: Any, scopes: list[Scope], trigger: str, context: dg.OpExecutionContext
) -> list[Scope]:
    """The scopes whose tenant exists. A person naming an unknown tenant is refused before
    any tenant runs; a tick's tenant removed since the tick is left out, with a warning."""
    with engine.connect() as conn:
        known = set(tenant_ids(conn, [s.tenant_id for s in scopes]))
    unknown = [s.tenant_id for s in scopes if s.tenant_id not in known]
    if unknown and trigger in TRIGGERS_WITH_A_PERSON:
        raise BadInput(f"unknown tenant(s): {', '.join(unknown[:MAX_NAMED])}")
    if unknown:
        context.log.warning(f"tenants removed since the tick, not run: {', '.join(unknown)}")
    return [s for s in scopes if s.tenant_id in known]
