"""``qo-ops status`` (qo_ops.platform.actions.status) says when a tenant last succeeded as
the exporter and the ``recent_success`` check do: by the job's own fresh statuses, so a
delivery job whose last execute run ended ``partial_success`` (its poison items fail on
purpose) shows that run as its last success in all three, and a job for which a partial
success is work left undone shows its older success in all three (issue 43)."""

from __future__ import annotations

import json
from datetime import datetime

import sqlalchemy as sa

from qo_ops.dagster_defs.freshness import judge, recent_tenants
from qo_ops.jobs.catalog import CATALOG
from qo_ops.metrics.gauges import run_families
from qo_ops.platform.job.statuses import RunStatus

TENANT = "tenant-001"
PARTIAL_IS_FRESH = "delivery_retry"  # every 5 minutes: stale after 15 without a success
PARTIAL_IS_NOT = "quote_expiration"  # every 15 minutes: stale after 45


def _run(conn: sa.Connection, job: str, status: RunStatus, minutes_ago: int) -> datetime:
    """An execute run of ``job`` for the tenant that ended ``minutes_ago``; its end."""
    return conn.execute(
        sa.text(
            "INSERT INTO job_run (id, job_name, scope, mode, trigger_type, owner_id, status, "
            "                     started_at, finished_at) "
            "VALUES (gen_random_uuid(), :job, :tenant, 'execute', 'schedule', 'test', :status, "
            "        now() - make_interval(mins => :ago + 1), now() - make_interval(mins => :ago)) "
            "RETURNING finished_at"
        ),
        {"job": job, "tenant": TENANT, "status": status, "ago": minutes_ago},
    ).scalar_one()


def test_a_partial_success_is_a_last_success_in_status_the_exporter_and_the_check_alike(db, cli):
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO tenant (id, name, created_at) "
                "VALUES (:id, 'Tenant 1', now() - interval '30 days')"
            ),
            {"id": TENANT},
        )
        last_success = {}
        for job in (PARTIAL_IS_FRESH, PARTIAL_IS_NOT):
            older = _run(conn, job, RunStatus.SUCCESS, 6 * 60)
            partial = _run(conn, job, RunStatus.PARTIAL_SUCCESS, 2)
            last_success[job] = partial if CATALOG[job].signals.partial_success_is_fresh else older
    assert CATALOG[PARTIAL_IS_FRESH].signals.partial_success_is_fresh
    assert not CATALOG[PARTIAL_IS_NOT].signals.partial_success_is_fresh

    # qo-ops status --json: each job's row for the tenant
    shown = cli("status", "--tenant", TENANT, "--json")
    assert shown.code == 0, shown.stderr
    rows = {r["job_name"]: r for r in json.loads(shown.stdout)["status"]}
    for job, at in last_success.items():
        assert datetime.fromisoformat(rows[job]["last_success_at"]) == at, job
        assert rows[job]["last_status"] == RunStatus.PARTIAL_SUCCESS
    assert not rows[PARTIAL_IS_FRESH]["failing"] and rows[PARTIAL_IS_NOT]["failing"]

    with db.engine.connect() as conn:
        # the exporter's job_last_success_timestamp_seconds
        specs = [CATALOG[job] for job in last_success]
        served = {
            s.labels["job_name"]: s.value
            for family in run_families(conn, specs, {})
            if family.name == "job_last_success_timestamp_seconds"
            for s in family.samples
        }
        assert served == {job: at.timestamp() for job, at in last_success.items()}

        # the recent_success check's judgement: the age of the same run, fresh or not
        now = conn.execute(sa.text("SELECT now()")).scalar_one()
        for job, at in last_success.items():
            (judged,) = judge(conn, CATALOG[job], [TENANT])
            assert judged.age_s is not None
            assert abs(judged.age_s - (now - at).total_seconds()) < 0.01, job
        assert recent_tenants(conn, CATALOG[PARTIAL_IS_FRESH]) == {TENANT}
        assert recent_tenants(conn, CATALOG[PARTIAL_IS_NOT]) == set()
