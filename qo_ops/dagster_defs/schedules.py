"""One schedule per catalog job at its declared cadence, fanning out over every tenant in
chunks (``JobSpec.deployment.tenants_per_run`` tenants per run, deterministic run keys). Windowed jobs run one day: yesterday, or for retention jobs the
day that has just aged past retention (``JobSpec.deployment.scheduled_window_age_days``), one run per
tenant chunk of their day × chunk partitions (``qo_ops.platform.schedule.partition_keys``)."""

from collections.abc import Iterator, Sequence
from datetime import date, datetime, timedelta

import dagster as dg

from qo_ops.dagster_defs.partitions import (
    PARTITION_START_ENV,
    days_partitions_def,
    tenant_chunks_partitions_def,
    tenants_partitions_def,
    windowed_partition_key,
)
from qo_ops.dagster_defs.pending import ACTIVE, QUEUED, pending_work
from qo_ops.dagster_defs.resources import QoOpsDatabase
from qo_ops.dagster_defs.submission import SCHEDULED_FOR_TAG
from qo_ops.errors import QoOpsError, first_few
from qo_ops.platform.actions.control import suspensions
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.run.lease import held_scopes
from qo_ops.platform.schedule.missed import expected_scope, record_tick
from qo_ops.platform.schedule.partition_keys import (
    chunk_scope_tag,
    chunk_tenants,
    chunks_of,
    partition_tags,
)
from qo_ops.platform.schedule.tenants import tenants_in_chunk_order

SCHEDULE_TIMEZONE = "UTC"


def build_schedule(spec: JobSpec, job: dg.JobDefinition) -> dg.ScheduleDefinition:
    """The schedule of ``spec``: execute on every tenant, one run per chunk of tenants."""

    @dg.schedule(
        name=f"{spec.name}_schedule",
        cron_schedule=spec.deployment.cron_schedule,
        job=job,
        execution_timezone=SCHEDULE_TIMEZONE,
        description=f"{spec.name} for every tenant, {spec.deployment.cron_schedule} ({SCHEDULE_TIMEZONE})",
    )
    def catalog_schedule(
        context: dg.ScheduleEvaluationContext, database: QoOpsDatabase
    ) -> Iterator[dg.RunRequest | dg.SkipReason]:
        scheduled = context.scheduled_execution_time
        tenants = tenants_partitions_def.get_partition_keys(
            dynamic_partitions_store=context.instance
        )
        if not tenants:
            yield dg.SkipReason("no tenant partitions yet (the tenants sensor adds them)")
            return
        with database.engine().connect() as conn:  # the kill switch, and who is busy
            held = {s.tenant_id: s for s in suspensions(conn, spec.name)}
            busy = held_scopes(conn, spec.name)
        if None in held:
            yield dg.SkipReason(f"{held[None].describe()}; no run requested")
            return
        if held:
            context.log.info(
                "; ".join(s.describe() for s in held.values()) + ": those tenants are skipped"
            )
            tenants = [t for t in tenants if t not in held]
            if not tenants:
                yield dg.SkipReason(
                    f"{spec.name}: every tenant is suspended ({len(held)}); no run requested"
                )
                return
        day = None
        if spec.partitioning == "tenant_day":
            try:
                age = (
                    spec.deployment.scheduled_window_age_days()
                    if spec.deployment.scheduled_window_age_days
                    else 1
                )
            except QoOpsError as exc:  # a bad retention setting: say so, start nothing
                yield dg.SkipReason(f"{spec.name}: {exc}")
                return
            day = (scheduled - timedelta(days=age)).date()
            first = days_partitions_def.start.date()
            if day < first:
                yield dg.SkipReason(
                    f"{spec.name}: the day that ages out now ({day}) is before the first "
                    f"partition ({first}); set {PARTITION_START_ENV} earlier to cover it"
                )
                return
        # a scope with a run still queued or running in Dagster, or whose lease is held (a
        # run started elsewhere), is asked for nothing: a backlog must not feed itself
        pending = pending_work(context.instance, spec)
        skipped: dict[str, list[str]] = {QUEUED: [], ACTIVE: []}
        if pending.scopes or busy:  # nothing pending (most ticks): nothing to compute
            for tenant in tenants:
                scope = expected_scope(spec, tenant, scheduled)
                why = pending.scopes.get(scope) or (ACTIVE if scope in busy else None)
                if why is not None:
                    skipped[why].append(tenant)
        with database.engine().begin() as conn:  # the exporter's missed-run reasons
            record_tick(conn, spec.name, scheduled, skipped)
        taken = set(skipped[QUEUED]) | set(skipped[ACTIVE])
        if taken:
            context.log.info(
                f"{spec.name}: no run requested for {len(taken)} tenant(s) whose previous run "
                f"is still queued ({first_few(skipped[QUEUED])}) or active ({first_few(skipped[ACTIVE])}) "
                "(counted in job_missed_runs_total)"
            )
            tenants = [t for t in tenants if t not in taken]
            if not tenants:
                yield dg.SkipReason(
                    f"{spec.name}: the previous run of every tenant is still queued "
                    f"({len(skipped[QUEUED])}) or active ({len(skipped[ACTIVE])}); "
                    "no run requested"
                )
                return
        if day is not None:  # a windowed job: one run per tenant chunk of the day
            yield from _chunk_requests(context, spec, database, tenants, day, scheduled)
            return
        for chunk in chunk_tenants(spec, tenants):  # a tenant job: no day
            yield chunk_run_request(
                spec,
                chunk,
                None,
                run_key=f"{spec.name}:tenants:{chunk[0]}..{chunk[-1]}:{scheduled.isoformat()}",
                tags={SCHEDULED_FOR_TAG: scheduled.isoformat()},
            )

    return catalog_schedule


def _chunk_requests(
    context: dg.ScheduleEvaluationContext,
    spec: JobSpec,
    database: QoOpsDatabase,
    eligible: Sequence[str],
    day: date,
    scheduled: datetime,
) -> Iterator[dg.RunRequest | dg.SkipReason]:
    """A windowed job's tick: one run per tenant chunk (partition ``day|chunk-NNN``) naming
    the chunk's eligible tenants; a chunk the tenants sensor has not added yet waits for it."""
    with database.engine().connect() as conn:
        chunks = chunks_of(tenants_in_chunk_order(conn))
    known = set(
        tenant_chunks_partitions_def.get_partition_keys(dynamic_partitions_store=context.instance)
    )
    wanted = set(eligible)
    waiting = [c for c in chunks if c not in known and wanted & set(chunks[c])]
    if waiting:
        context.log.info(
            f"{spec.name}: chunks not yet partitions, left for the next tick: {', '.join(waiting)}"
        )
    requested = False
    for chunk, members in chunks.items():
        tenants = [t for t in members if t in wanted]
        if chunk in known and tenants:
            requested = True
            yield chunk_run_request(
                spec,
                tenants,
                day,
                run_key=f"{spec.name}:{day}:{chunk}:{scheduled.isoformat()}",
                tags={SCHEDULED_FOR_TAG: scheduled.isoformat()},
                chunk=chunk,
            )
    if not requested:
        yield dg.SkipReason(
            f"{spec.name}: no tenant chunk is a partition yet (the tenants sensor adds them)"
        )


def chunk_run_request(
    spec: JobSpec,
    tenants: list[str],
    day: date | None,
    run_key: str,
    tags: dict[str, str],
    chunk: str | None = None,
) -> dg.RunRequest:
    """One run for a chunk of tenants (and a windowed job's day and tenant chunk),
    executing: the tenants in run config, the chunk's queue tag so the next tick's same
    chunk waits behind it."""
    # The partition's tags given here mark the request resolved: Dagster would otherwise lay
    # the partition's own tags (queue tag <job>:<day>|<chunk>) over the chunk's.
    key = windowed_partition_key(day.isoformat(), chunk) if day is not None and chunk else None
    return dg.RunRequest(
        run_key=run_key,
        partition_key=key,
        run_config={
            "ops": {f"{spec.name}_op": {"config": {"mode": "execute", "tenants": tenants}}}
        },
        tags={
            **chunk_scope_tag(spec, tenants, day),
            **tags,
            **(partition_tags(key) if key else {}),
        },
    )
