"""The code location loads, and everything in it is derived from the job catalog."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import sqlalchemy as sa

from qo_ops.db.engine import ensure_database
from qo_ops.jobs.catalog import CATALOG
from qo_ops_tests.conftest import REPO, base_env


def test_every_catalog_job_has_its_job_schedule_sensors_and_checks(defs):
    for spec in CATALOG.values():
        job = defs.resolve_job_def(spec.name)
        assert job.partitions_def is not None
        schedule = defs.resolve_schedule_def(f"{spec.name}_schedule")
        assert schedule.execution_timezone == "UTC"
        assert schedule.cron_schedule == spec.deployment.cron_schedule
        if spec.deployment.backlog_threshold:
            assert defs.resolve_sensor_def(f"{spec.name}_backlog_sensor").job_name == spec.name
        checks = {key.name for key in defs.resolve_asset_graph().asset_check_keys}
        assert {c.name for c in spec.checks} <= checks
    for name in (
        "tenants_sensor",
        "stale_success_sensor",
        "checkpoint_age_sensor",
        "run_failure_recorder",
    ):
        assert defs.resolve_sensor_def(name) is not None


def test_declared_checks_match_what_each_job_reports(loaded):
    """The catalog declares check names up front (for Dagster); each job reports exactly those."""
    import uuid
    from datetime import date

    from qo_ops.platform.job.outcome import BatchContext
    from qo_ops.platform.job.scope import Scope

    with loaded.engine.connect() as conn:
        for spec in CATALOG.values():
            scope = (
                Scope("tenant-001")
                if spec.partitioning == "tenant"
                else Scope("tenant-001", date(2026, 2, 1), date(2026, 2, 2))
            )
            ctx = BatchContext(spec.name, scope, "dry_run", uuid.uuid4())
            assert [c.name for c in spec.check(conn, ctx)] == [c.name for c in spec.checks]


def test_dagster_definitions_validate_passes(db, tmp_path):
    storage = db.target.dagster_storage_url()
    ensure_database(db.url, sa.engine.make_url(storage).database)
    env = base_env(
        QO_OPS_DATABASE_URL=db.env_url,
        QO_OPS_DAGSTER_STORAGE_URL=storage,
        DAGSTER_HOME=str(tmp_path),
    )
    dagster = str(Path(sys.executable).with_name("dagster"))
    proc = subprocess.run(
        [dagster, "definitions", "validate", "-w", "workspace.yaml"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Validation successful" in proc.stdout + proc.stderr
