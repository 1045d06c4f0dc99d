"""One schedule per catalog job at its declared cadence, fanning out over every tenant in
chunks (``JobSpec.tenants_per_run`` tenants per run, deterministic run keys). Windowed jobs run one day: yesterday, or for retention jobs the
day that has just aged past retention (``JobSpec.scheduled_window_age_days``)."""

from collections.abc import Iterator
from datetime import date, timedelta

import dagster as dg

from qo_ops.dagster_defs.partitions import (
    PARTITION_START_ENV,
    days_partitions_def,
    tenants_partitions_def,
)
from qo_ops.dagster_defs.pending import ACTIVE, QUEUED, pending_work
from qo_ops.dagster_defs.resources import QoOpsDatabase
from qo_ops.dagster_defs.submission import SCHEDULED_FOR_TAG
from qo_ops.errors import QoOpsError, first_few
from qo_ops.platform.control import suspensions
from qo_ops.platform.lease import held_scopes
from qo_ops.platform.missed import expected_scope, record_tick
from qo_ops.platform.partition_keys import chunk_scope_tag, chunk_tenants
from qo_ops.platform.spec import JobSpec

SCHEDULE_TIMEZONE = "UTC"
PARTITION_TAG = "dagster/partition"  # Dagster's own tag of a run's partition


def build_schedule(spec: JobSpec, job: dg.JobDefinition) -> dg.ScheduleDefinition:
    """The schedule of ``spec``: execute on every tenant, one run per chunk of tenants."""

    @dg.schedule(
        name=f"{spec.name}_schedule",
        cron_schedule=spec.cron_schedule,
        job=job,
        execution_timezone=SCHEDULE_TIMEZONE,
        description=f"{spec.name} for every tenant, {spec.cron_schedule} ({SCHEDULE_TIMEZONE})",
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
                age = spec.scheduled_window_age_days() if spec.scheduled_window_age_days else 1
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
        for chunk in chunk_tenants(spec, tenants):
            yield chunk_run_request(
                spec,
                chunk,
                day,
                run_key=f"{spec.name}:{day or 'tenants'}:{chunk[0]}..{chunk[-1]}:{scheduled.isoformat()}",
                tags={SCHEDULED_FOR_TAG: scheduled.isoformat()},
            )

    return catalog_schedule


def chunk_run_request(
    spec: JobSpec, tenants: list[str], day: date | None, run_key: str, tags: dict[str, str]
) -> dg.RunRequest:
    """One run for a chunk of tenants (and a windowed job's day), executing: the tenants in
    run config, the chunk's queue tag so the next tick's same chunk waits behind it."""
    # The day's partition tag given here marks the request resolved: Dagster would otherwise
    # lay the day's own tags (queue tag <job>:<day>) over the chunk's, queueing every chunk
    # of the day behind one another.
    day_tag = {PARTITION_TAG: day.isoformat()} if day is not None else {}
    return dg.RunRequest(
        run_key=run_key,
        partition_key=day.isoformat() if day is not None else None,
        run_config={
            "ops": {f"{spec.name}_op": {"config": {"mode": "execute", "tenants": tenants}}}
        },
        tags={**chunk_scope_tag(spec, tenants, day), **tags, **day_tag},
    )
