"""The soak benchmark's accelerated catalog: every job's cron every minute and
``QO_OPS_SOAK_TENANTS_PER_RUN`` tenants per Dagster run, so that a few minutes of a real
deployment ask for more runs than it can start. :func:`accelerate` replaces each job
module's ``SPEC`` before anything reads the catalog; the soak's code location
(``bench.soak_location``, which its run workers load too) and its exporter call it first,
so the schedules, the runs and the exporter's missed-run and freshness judgements all see
the same cadence."""

from __future__ import annotations

import importlib
import os
from dataclasses import replace

CRON = "* * * * *"
PER_RUN_ENV = "QO_OPS_SOAK_TENANTS_PER_RUN"


def accelerate() -> None:
    from qo_ops.jobs.catalog import JOBS

    per_run = int(os.environ[PER_RUN_ENV])
    for name in JOBS:
        module = importlib.import_module(f"qo_ops.jobs.{name}")
        faster = replace(module.SPEC.deployment, cron_schedule=CRON, tenants_per_run=per_run)
        module.SPEC = replace(module.SPEC, deployment=faster)


def exporter() -> None:
    """``qo-ops metrics …`` over the accelerated catalog (``python -m bench.soak_catalog``)."""
    accelerate()
    from qo_ops.cli import run

    run()


if __name__ == "__main__":
    exporter()
