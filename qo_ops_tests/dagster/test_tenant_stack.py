"""Chunked runs on a real deployment (webserver + daemon over PostgreSQL): a backfill
launched from tenant_backfill_job's Launchpad becomes chunked runs through the daemon's
sensor; a chunk with a failing tenant fails naming it, and Dagster's re-execution (the UI's
Re-execute, through GraphQL) runs only that tenant; each tenant of the chunk has its outcome
and its checks on its own partition, written by the run worker through the pooled event log."""

from __future__ import annotations

import dagster as dg
import httpx
import sqlalchemy as sa
from dagster._core.event_api import PartitionKeyFilter
from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus

from qo_ops.dagster_defs.backfills import BACKFILL_JOB, BACKFILL_OP
from qo_ops.dagster_defs.freshness import RECENT_SUCCESS_CHECK
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.actions.control import ControlChange, resume, suspend
from qo_ops.platform.schedule.partition_keys import FAILED_TENANTS_TAG
from qo_ops_tests.dagster.stack import LOCATION, dagster_stack, wait_for
from qo_ops_tests.dagster.test_person_runs import _reexecute

FINISHED = (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)
JOB = "quote_expiration"


def _status(instance: dg.DagsterInstance, run_id: str) -> dg.DagsterRunStatus:
    run = instance.get_run_by_id(run_id)
    assert run is not None
    return run.status


def _job_runs(db, dagster_run_id: str) -> list:
    with db.engine.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT scope, trigger_type, mode, status, reason FROM job_run "
                "WHERE dagster_run_id = :id ORDER BY scope"
            ),
            {"id": dagster_run_id},
        ).all()


def _runner_lines(instance: dg.DagsterInstance, run_id: str, event: str) -> int:
    """How many of the runner's ``event`` lines the run's Dagster event log holds."""
    return sum(
        f'"event.name": "{event}"' in (entry.user_message or "")
        for entry in instance.all_logs(run_id)
    )


RUN_MATERIALIZATIONS = """
query($id: ID!) { runOrError(runId: $id) { ... on Run { assetMaterializations { partition } } } }
"""


def _each_tenant_on_its_partition(
    instance: dg.DagsterInstance, port: int, run_id: str, tenants: list[str]
) -> None:
    """The run worker (its instance from dagster.yaml: the pooled event log) put each tenant's
    outcome and every check of the job on the tenant's own partition; the webserver shows
    them."""
    spec = CATALOG[JOB]
    asset = dg.AssetKey(["qo_ops", spec.presentation.outcome_asset])
    for tenant in tenants:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=asset, asset_partitions=[tenant]), limit=5
        ).records
        assert [r.run_id for r in records] == [run_id], tenant
        for check in [RECENT_SUCCESS_CHECK, *(c.name for c in spec.checks)]:
            executions = instance.event_log_storage.get_asset_check_execution_history(
                dg.AssetCheckKey(asset, check),
                limit=5,
                partition_filter=PartitionKeyFilter(key=tenant),
            )
            assert [(e.run_id, e.status) for e in executions] == [
                (run_id, AssetCheckExecutionRecordStatus.SUCCEEDED)
            ], (tenant, check)
    body = httpx.post(
        f"http://127.0.0.1:{port}/graphql",
        json={"query": RUN_MATERIALIZATIONS, "variables": {"id": run_id}},
        timeout=60,
    ).json()
    shown = body["data"]["runOrError"]["assetMaterializations"]
    assert sorted(m["partition"] for m in shown) == tenants


def test_backfill_from_the_launchpad_and_rerun_of_a_failed_tenant_on_a_real_deployment(
    loaded, tmp_path
):
    db = loaded
    with dagster_stack(db, tmp_path) as (client, instance, port):
        instance.add_dynamic_partitions("tenants", ["tenant-001", "tenant-002"])

        # the Launchpad form of tenant_backfill_job: every tenant, one per run, dry run
        launcher = client.submit_job_execution(
            BACKFILL_JOB,
            repository_location_name=LOCATION,
            run_config={"ops": {BACKFILL_OP: {"config": {"job": JOB, "tenants_per_run": 1}}}},
        )
        wait_for(lambda: _status(instance, launcher) in FINISHED, 180, "the launcher run")
        assert _status(instance, launcher) == dg.DagsterRunStatus.SUCCESS

        def backfill_runs() -> list[dg.DagsterRun]:
            return list(
                instance.get_runs(filters=dg.RunsFilter(tags={"qo_ops/backfill": launcher}))
            )

        wait_for(lambda: len(backfill_runs()) == 2, 180, "the sensor to request both chunks")
        wait_for(lambda: all(r.status in FINISHED for r in backfill_runs()), 240, "both chunk runs")
        runs = backfill_runs()
        assert {r.status for r in runs} == {dg.DagsterRunStatus.SUCCESS}
        scopes = sorted(row.scope for r in runs for row in _job_runs(db, r.run_id))
        assert scopes == ["tenant-001", "tenant-002"]
        assert {(row.trigger_type, row.mode) for r in runs for row in _job_runs(db, r.run_id)} == {
            ("backfill", "dry_run")
        }

        # a chunk of three tenants, tenant-002 suspended: the other two run, the run fails
        with db.engine.begin() as conn:  # a tenant with nothing to do
            conn.execute(sa.text("INSERT INTO tenant (id, name) VALUES ('tenant-003', 'T3')"))
        instance.add_dynamic_partitions("tenants", ["tenant-003"])
        suspend(
            db.engine,
            ControlChange(JOB, "tenant-002", actor="sre", reason="stack test"),
            known_jobs={JOB},
        )
        chunk = client.submit_job_execution(
            JOB,
            repository_location_name=LOCATION,
            run_config={
                "ops": {
                    f"{JOB}_op": {
                        "config": {
                            "mode": "execute",
                            "reason": "chunk test",
                            "tenants": ["tenant-001", "tenant-003", "tenant-002"],
                        }
                    }
                }
            },
        )
        wait_for(lambda: _status(instance, chunk) in FINISHED, 240, "the chunk run")
        assert _status(instance, chunk) == dg.DagsterRunStatus.FAILURE
        parent = instance.get_run_by_id(chunk)
        assert parent is not None and parent.tags[FAILED_TENANTS_TAG] == "tenant-002"
        assert [(r.scope, r.status) for r in _job_runs(db, chunk)] == [
            ("tenant-001", "success"),
            ("tenant-003", "no_work"),
        ]
        # a run of many tenants keeps the runner's routine lines out of the event log (the
        # op's one line per tenant stays); a run of one tenant shows them
        assert _runner_lines(instance, chunk, "job.started") == 0
        assert all(_runner_lines(instance, r.run_id, "job.started") == 1 for r in runs)
        op_lines = [e.user_message or "" for e in instance.all_logs(chunk)]
        done = f"{JOB}: 3/3 tenants done — 1 no_work, 1 refused, 1 success"
        assert sum(done in m for m in op_lines) == 1
        assert sum(f"{JOB} tenant-002: refused: " in m for m in op_lines) == 1
        _each_tenant_on_its_partition(instance, port, chunk, ["tenant-001", "tenant-003"])

        # lift the suspension, press Re-execute: only tenant-002 runs
        resume(
            db.engine,
            ControlChange(JOB, "tenant-002", actor="sre", reason="done"),
            known_jobs={JOB},
        )
        child = _reexecute(port, chunk)
        wait_for(lambda: _status(instance, child) in FINISHED, 240, "the re-execution")
        assert _status(instance, child) == dg.DagsterRunStatus.SUCCESS
        rows = _job_runs(db, child)
        assert [(r.scope, r.trigger_type, r.mode, r.reason) for r in rows] == [
            ("tenant-002", "manual", "execute", "chunk test")
        ]
        assert _runner_lines(instance, child, "job.started") == 1  # one tenant: all its lines
