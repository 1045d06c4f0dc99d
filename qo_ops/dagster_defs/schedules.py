"""One schedule per catalog job at its declared cadence, fanning out over every tenant
(yesterday's window for windowed jobs) with deterministic run keys."""

from collections.abc import Iterator
from datetime import timedelta

import dagster as dg

from qo_ops.dagster_defs.partitions import partition_key_for, scope_tag, tenants_partitions_def
from qo_ops.platform.spec import JobSpec

SCHEDULE_TIMEZONE = "UTC"


def build_schedule(spec: JobSpec, job: dg.JobDefinition) -> dg.ScheduleDefinition:
    """The schedule of ``spec``: execute on every tenant partition."""

    @dg.schedule(
        name=f"{spec.name}_schedule",
        cron_schedule=spec.cron_schedule,
        job=job,
        execution_timezone=SCHEDULE_TIMEZONE,
        description=f"{spec.name} for every tenant, {spec.cron_schedule} ({SCHEDULE_TIMEZONE})",
    )
    def catalog_schedule(
        context: dg.ScheduleEvaluationContext,
    ) -> Iterator[dg.RunRequest | dg.SkipReason]:
        scheduled = context.scheduled_execution_time
        tenants = tenants_partitions_def.get_partition_keys(
            dynamic_partitions_store=context.instance
        )
        if not tenants:
            yield dg.SkipReason("no tenant partitions yet (the tenants sensor adds them)")
            return
        day = (scheduled - timedelta(days=1)).date() if spec.partitioning == "tenant_day" else None
        for tenant in tenants:
            key = partition_key_for(spec, tenant, day)
            yield dg.RunRequest(
                run_key=f"{spec.name}:{key}:{scheduled.isoformat()}",
                partition_key=key,
                run_config={"ops": {f"{spec.name}_op": {"config": {"mode": "execute"}}}},
                tags={**scope_tag(spec, key), "qo_ops/scheduled_for": scheduled.isoformat()},
            )

    return catalog_schedule
