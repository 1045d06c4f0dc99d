"""The Dagster code location (``workspace.yaml``): everything derived from the job catalog."""

from __future__ import annotations

import os

import dagster as dg

from qo_ops.config import DATABASE_URL_ENV
from qo_ops.dagster_defs.backfills import build_backfill_job, build_backfill_sensor
from qo_ops.dagster_defs.checks import (
    build_outcome_assets,
    build_outcome_checks,
    build_outcome_checks_job,
)
from qo_ops.dagster_defs.freshness import build_recent_success_checks
from qo_ops.dagster_defs.jobs import build_job
from qo_ops.dagster_defs.probes import breaker_probe_sensor
from qo_ops.dagster_defs.resources import QoOpsDatabase
from qo_ops.dagster_defs.schedules import build_schedule
from qo_ops.dagster_defs.sensors import (
    build_backlog_sensor,
    build_checkpoint_age_sensor,
    build_outside_runs_sensor,
    build_run_queue_sensor,
    build_stale_success_sensor,
    run_failure_recorder,
    tenants_sensor,
)
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.observability.tracing import configure_from_env


def build_definitions() -> dg.Definitions:
    """Jobs, schedules, sensors, outcome assets and checks for every catalog entry."""
    configure_from_env()  # run workers trace their runs when QO_OPS_OTLP_ENDPOINT is set
    specs = list(CATALOG.values())
    jobs = {spec.name: build_job(spec) for spec in specs}
    checks_job = build_outcome_checks_job(specs)
    database = QoOpsDatabase(
        url=dg.EnvVar(DATABASE_URL_ENV) if os.environ.get(DATABASE_URL_ENV) else None
    )
    return dg.Definitions(
        assets=build_outcome_assets(specs),
        asset_checks=[*build_outcome_checks(specs), *build_recent_success_checks(specs)],
        jobs=[*jobs.values(), build_backfill_job(specs), checks_job],
        schedules=[build_schedule(spec, jobs[spec.name]) for spec in specs],
        sensors=[
            tenants_sensor,
            *(
                build_backlog_sensor(s, jobs[s.name])
                for s in specs
                if s.deployment.backlog_threshold
            ),
            build_stale_success_sensor(specs),
            build_checkpoint_age_sensor(specs),
            build_run_queue_sensor(specs),
            build_outside_runs_sensor(specs, checks_job),
            build_backfill_sensor(specs, list(jobs.values())),
            run_failure_recorder,
            breaker_probe_sensor,
        ],
        resources={"database": database},
    )


defs = build_definitions()
