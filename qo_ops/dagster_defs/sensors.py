"""Sensors, each tick bounded (a handful of index-backed queries, capped fan-out):

- ``tenants_sensor``: keeps the ``tenants`` dynamic partitions equal to the tenant table;
- ``<job>_backlog_sensor``: launches the job for a tenant whose backlog passed its threshold;
- ``stale_success_sensor``: says which job/scope has not succeeded for 3× its cadence;
- ``checkpoint_age_sensor``: says which windowed job's checkpoint stopped advancing;
- ``run_failure_recorder``: records every failed Dagster run of a catalog job, with its cause.
"""

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

import dagster as dg
import sqlalchemy as sa

from qo_ops.dagster_defs.checks import outcome_asset_key
from qo_ops.dagster_defs.partitions import (
    JOB_RUN_TAG,
    SCOPE_TAG,
    chunk_tenants,
    tenants_partitions_def,
)
from qo_ops.dagster_defs.resources import QoOpsDatabase
from qo_ops.dagster_defs.schedules import chunk_run_request
from qo_ops.dagster_defs.submission import REFUSED_PREFIX, REFUSED_TAG, op_config, run_options
from qo_ops.errors import one_line
from qo_ops.platform.control import suspensions
from qo_ops.platform.overdue import backlog_scope, database_now
from qo_ops.platform.runs import append_audit, finish_unstarted
from qo_ops.platform.spec import BatchContext, JobSpec, cadence_seconds

MAX_TENANTS_PER_TICK = (
    1000  # a tick counts at most this many tenants (~0.75 ms each); the cursor rotates
)
BACKLOG_COOLDOWN_S = 300  # one backlog-triggered run per job and tenant per 5 minutes
STALE_FACTOR = 3
CHECKPOINT_MAX_AGE_S = 3600


@dg.sensor(
    name="tenants_sensor",
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Adds and removes `tenants` partitions to match the tenant table",
)
def tenants_sensor(context: dg.SensorEvaluationContext, database: QoOpsDatabase) -> dg.SensorResult:
    with database.engine().connect() as conn:
        wanted = set(conn.execute(sa.text("SELECT id FROM tenant")).scalars())
    have = set(tenants_partitions_def.get_partition_keys(dynamic_partitions_store=context.instance))
    added, removed = sorted(wanted - have), sorted(have - wanted)
    requests: list[dg.AddDynamicPartitionsRequest | dg.DeleteDynamicPartitionsRequest] = []
    if added:
        requests.append(tenants_partitions_def.build_add_request(added))
    if removed:
        requests.append(tenants_partitions_def.build_delete_request(removed))
    return dg.SensorResult(
        dynamic_partitions_requests=requests,
        skip_reason=None if requests else f"{len(have)} tenant partitions, all in sync",
        cursor=json.dumps({"tenants": len(wanted)}),
    )


def build_backlog_sensor(spec: JobSpec, job: dg.JobDefinition) -> dg.SensorDefinition:
    """Launch ``spec`` for tenants whose eligible backlog reached ``spec.backlog_threshold``."""
    threshold = spec.backlog_threshold or 0

    @dg.sensor(
        name=f"{spec.name}_backlog_sensor",
        job=job,
        minimum_interval_seconds=60,
        description=f"Runs {spec.name} for a tenant once {threshold} items are waiting",
    )
    def backlog_sensor(
        context: dg.SensorEvaluationContext, database: QoOpsDatabase
    ) -> dg.SensorResult:
        state: dict[str, Any] = json.loads(context.cursor) if context.cursor else {"offset": 0}
        tenants = sorted(
            tenants_partitions_def.get_partition_keys(dynamic_partitions_store=context.instance)
        )
        offset = state.get("offset", 0) % max(len(tenants), 1)
        window = (tenants[offset:] + tenants[:offset])[:MAX_TENANTS_PER_TICK]
        bucket = int(time.time() // BACKLOG_COOLDOWN_S)
        # a tenant launched in this cooldown bucket is not launched again in it (the cursor)
        launched: dict[str, int] = (
            state.get("launched", {}) if state.get("bucket") == bucket else {}
        )
        due: list[str] = []
        figures = {}
        with database.engine().connect() as conn:
            held = {s.tenant_id: s for s in suspensions(conn, spec.name)}  # the kill switch
            if None in held:
                return dg.SensorResult(
                    skip_reason=f"{held[None].describe()}; no run requested",
                    cursor=context.cursor,
                )
            now = database_now(conn)
            for tenant in window:
                if tenant in held:
                    continue
                # the tenant's whole backlog (every day, were the job windowed)
                scope = backlog_scope(spec, tenant, now)
                ctx = BatchContext(spec.name, scope, "dry_run", uuid.uuid4())
                # bounded count: stop counting at the threshold
                waiting = conn.execute(
                    sa.select(sa.func.count()).select_from(
                        spec.eligible(ctx).limit(threshold).subquery()
                    )
                ).scalar_one()
                figures[tenant] = waiting
                if waiting >= threshold and tenant not in launched:
                    due.append(tenant)
        runs = [  # one run per chunk of tenants past the threshold, not one per tenant
            chunk_run_request(
                spec,
                chunk,
                None,
                run_key=f"backlog:{spec.name}:{chunk[0]}..{chunk[-1]}:{bucket}",
                tags={},
            )
            for chunk in chunk_tenants(spec, due)
        ]
        launched |= dict.fromkeys(due, 1)
        cursor = json.dumps(
            {
                "offset": offset + len(window),
                "last": figures,
                "bucket": bucket,
                "launched": launched,
            }
        )
        # the backlog over time on the outcome asset's page (counted up to the threshold)
        observations = (
            [
                dg.AssetObservation(
                    asset_key=outcome_asset_key(spec),
                    partition=tenant,
                    metadata={
                        "backlog": waiting,
                        "backlog_counted_up_to": threshold,
                        "scope": tenant,
                    },
                )
                for tenant, waiting in figures.items()
            ]
            if spec.outcome_asset
            else []
        )
        if runs:
            return dg.SensorResult(run_requests=runs, cursor=cursor, asset_events=observations)
        suspended = [t for t in window if t in held]
        return dg.SensorResult(
            skip_reason=f"no tenant has {threshold} waiting ({len(window) - len(suspended)} "
            f"checked)"
            + (f"; suspended, not checked: {', '.join(suspended)}" if suspended else ""),
            cursor=cursor,
            asset_events=observations,
        )

    return backlog_sensor


# Tenants with a success within the limit: a range of ix_job_run_job_finished (now(), not
# clock_timestamp(): a volatile bound cannot use the index), so a tick reads only the last
# 3 cadences of runs, however long job_run is.
_RECENT_SUCCESS = sa.text(
    """
    SELECT DISTINCT split_part(scope, '/', 1) AS tenant FROM job_run
     WHERE job_name = :job AND finished_at IS NOT NULL
       AND finished_at > now() - make_interval(secs => :limit_s)
       AND mode = 'execute' AND status IN ('success', 'no_work')
    """
)
# The last success of the tenants without a recent one (rare). A tenant job's scope is the
# tenant: ix_job_run_history reads only that tenant's runs.
_LAST_SUCCESS_TENANT = sa.text(
    """
    SELECT t.id AS tenant, extract(epoch FROM clock_timestamp() - max(r.finished_at)) AS age
      FROM unnest(CAST(:tenants AS text[])) AS t(id)
      LEFT JOIN job_run r ON r.job_name = :job AND r.scope = t.id AND r.mode = 'execute'
           AND r.status IN ('success', 'no_work')
     GROUP BY t.id
     ORDER BY t.id
    """
)
# A windowed job's scopes are tenant/window: one pass over the job's successes.
_LAST_SUCCESS_WINDOWED = sa.text(
    """
    SELECT t.id AS tenant, extract(epoch FROM clock_timestamp() - r.last) AS age
      FROM unnest(CAST(:tenants AS text[])) AS t(id)
      LEFT JOIN (SELECT split_part(scope, '/', 1) AS tenant, max(finished_at) AS last
                   FROM job_run
                  WHERE job_name = :job AND mode = 'execute'
                    AND status IN ('success', 'no_work')
                    AND split_part(scope, '/', 1) = ANY(CAST(:tenants AS text[]))
                  GROUP BY 1) r ON r.tenant = t.id
     ORDER BY t.id
    """
)


def build_stale_success_sensor(specs: Sequence[JobSpec]) -> dg.SensorDefinition:
    """Say which (job, scope) has not ended success/no_work for 3× its cadence."""

    @dg.sensor(
        name="stale_success_sensor",
        minimum_interval_seconds=300,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Reports jobs whose last success is older than 3× their cadence",
    )
    def stale_success_sensor(
        context: dg.SensorEvaluationContext, database: QoOpsDatabase
    ) -> dg.SkipReason:
        stale: list[str] = []
        with database.engine().connect() as conn:
            tenants = list(
                conn.execute(
                    sa.text("SELECT id FROM tenant ORDER BY id LIMIT :cap"),
                    {"cap": MAX_TENANTS_PER_TICK},
                ).scalars()
            )
            for spec in specs:
                limit_s = STALE_FACTOR * cadence_seconds(spec.cron_schedule)
                recent = set(
                    conn.execute(_RECENT_SUCCESS, {"job": spec.name, "limit_s": limit_s}).scalars()
                )
                missing = [t for t in tenants if t not in recent]
                if not missing:
                    continue
                last = (
                    _LAST_SUCCESS_TENANT
                    if spec.partitioning == "tenant"
                    else _LAST_SUCCESS_WINDOWED
                )
                for row in conn.execute(last, {"job": spec.name, "tenants": missing}):
                    if row.age is None or row.age > limit_s:
                        age = "never" if row.age is None else f"{row.age / 60:.0f} min ago"
                        stale.append(
                            f"{spec.name}/{row.tenant} (last success {age}, limit {limit_s / 60:.0f} min)"
                        )
        if stale:
            context.log.warning("stale last success: " + "; ".join(stale[:50]))
            return dg.SkipReason(f"STALE: {len(stale)} job scope(s): " + "; ".join(stale[:20]))
        return dg.SkipReason("every job succeeded within 3× its cadence")

    return stale_success_sensor


def build_checkpoint_age_sensor(specs: Sequence[JobSpec]) -> dg.SensorDefinition:
    """Say which checkpointed job has a running run whose checkpoint stopped advancing."""
    names = [s.name for s in specs if s.uses_checkpoint]

    @dg.sensor(
        name="checkpoint_age_sensor",
        minimum_interval_seconds=300,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Reports running checkpointed jobs whose checkpoint has not moved for an hour",
    )
    def checkpoint_age_sensor(
        context: dg.SensorEvaluationContext, database: QoOpsDatabase
    ) -> dg.SkipReason:
        if not names:
            return dg.SkipReason("no catalog job uses a checkpoint")
        with database.engine().connect() as conn:
            rows = conn.execute(
                sa.text(
                    """
                    SELECT c.job_name, c.scope, extract(epoch FROM clock_timestamp() - c.updated_at) AS age
                      FROM job_checkpoint c
                      JOIN job_run r ON r.job_name = c.job_name AND r.scope = c.scope AND r.status = 'running'
                     WHERE c.job_name = ANY(:names)
                       AND c.updated_at < clock_timestamp() - make_interval(secs => :max_age)
                     LIMIT 50
                    """
                ),
                {"names": names, "max_age": CHECKPOINT_MAX_AGE_S},
            ).all()
        if rows:
            text = "; ".join(
                f"{r.job_name}/{r.scope} checkpoint {r.age / 60:.0f} min old" for r in rows
            )
            context.log.warning("checkpoint stopped advancing: " + text)
            return dg.SkipReason("STALE CHECKPOINT: " + text)
        return dg.SkipReason("every running checkpointed job advanced within the hour")

    return checkpoint_age_sensor


def _job_run_id(tag: str | None) -> uuid.UUID | None:
    try:
        return uuid.UUID(tag) if tag else None
    except ValueError:
        return None


def failure_cause(context: dg.RunFailureSensorContext) -> str:
    """Why the run failed, in one line: the first failed step's own description (the
    runner's one-line error, e.g. a refusal) rather than Dagster's "Steps failed"."""
    for event in context.get_step_failure_events():
        data = event.step_failure_data
        described = data.user_failure_data.description if data.user_failure_data else None
        if described or data.error is not None:
            return one_line(described or data.error.message, 300)  # type: ignore[union-attr]
    return one_line(context.failure_event.message or "no message", 300)


@dg.run_failure_sensor(name="run_failure_recorder", default_status=dg.DefaultSensorStatus.RUNNING)
def run_failure_recorder(context: dg.RunFailureSensorContext, database: QoOpsDatabase) -> None:
    """Record each failed catalog run in the audit trail (and the log), with its scope and
    its cause, so a failure is on record even when it happened before the runner wrote a
    job_run row. A run the coordinator refused before queueing (its failure message says so) is
    recorded as the runner records a refusal: ``trigger``, ``denied``, who, mode, reason."""
    run = context.dagster_run
    refused = (context.failure_event.message or "").startswith(REFUSED_PREFIX)
    message = (
        one_line(context.failure_event.message or "", 300) if refused else failure_cause(context)
    )
    scope = run.tags.get(SCOPE_TAG, "").partition(":")[2] or None
    context.log.error(f"run {run.run_id} of {run.job_name} failed ({scope or '?'}): {message}")
    with database.engine().begin() as conn:
        accepted = _job_run_id(run.tags.get(JOB_RUN_TAG))
        if accepted is not None:  # an API run that failed before its op adopted the row
            finish_unstarted(conn, accepted, "failed", "dagster_run_failed", "dagster_run_failed")
        if refused:
            options = run_options(op_config(run), run.tags, run.run_id)
            append_audit(
                conn,
                actor=options.requester or "unknown",
                action="trigger",
                decision="denied",
                job_name=run.job_name,
                scope=scope,
                mode=options.mode,
                reason=options.reason,
                correlation_id=run.run_id,
                details={
                    "refused": run.tags.get(REFUSED_TAG, "bad_input"),
                    "cause": message,
                    "trigger": options.trigger,
                    "dagster_run_id": run.run_id,
                    "at": "submission",
                },
            )
            return
        append_audit(
            conn,
            actor="dagster",
            action="run_failure",
            decision="recorded",
            job_name=run.job_name,
            scope=scope,
            details={"dagster_run_id": run.run_id, "message": message},
        )
