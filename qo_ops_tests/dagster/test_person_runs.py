"""Who may execute, on a real deployment (webserver + daemon, dagster.yaml's run
coordinator): a Launchpad execute without a reason, a person's re-execution of it, a
backfill tagged execute without a reason, a destructive job's backfill execute and a
destructive Launchpad execute without an approval are all refused before they are queued —
CANCELED (refused, not failed: not a failure to alert on or retry) with one line, no run
worker, no stack trace — change nothing, and are audited as ``denied`` with their cause;
the same Launchpad execute citing an approval runs. (With a reason, every run of a backfill
has its audit row: test_instance.py.)"""

from __future__ import annotations

import dagster as dg
import httpx
import sqlalchemy as sa
from dagster._core.scheduler.instigation import InstigatorType

from qo_ops.db.digest import database_digest
from qo_ops.db.schema import BUSINESS_TABLES, outbox_event
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.actions import approvals
from qo_ops_tests.dagster.stack import dagster_stack, wait_for
from qo_ops_tests.dagster.test_instance import (
    FINISHED,
    LOCATION,
    _backfill,
    _finished_backfill_runs,
    _launch,
)

TENANTS = ["tenant-001", "tenant-002"]
DESTRUCTIVE_RUN = {"mode": "execute", "reason": "INC-6 old run history"}


def _launch_job(client, job: str, tenant: str, config: dict) -> str:
    """The Launchpad's Launch of a tenant job's partition."""
    return client.submit_job_execution(
        job,
        repository_location_name=LOCATION,
        run_config={"ops": {f"{job}_op": {"config": config}}},
        tags={"dagster/partition": tenant, "qo_ops/scope": f"{job}:{tenant}"},
    )


def _business(db) -> dict[str, str]:
    with db.engine.connect() as conn:
        return database_digest(conn, (*BUSINESS_TABLES, outbox_event))


def _sensor_ticked(instance: dg.DagsterInstance, name: str) -> bool:
    """The run-status sensor has had its first tick (which only sets its cursor: failures
    before it would never be seen)."""
    for state in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR):
        if state.name == name:
            return bool(instance.get_ticks(state.instigator_origin_id, state.selector_id, limit=1))
    return False


def _reexecute(port: int, parent_run_id: str) -> str:
    """Re-execute a run as a person does from the UI's Re-execute button."""
    result = httpx.post(
        f"http://127.0.0.1:{port}/graphql",
        json={
            "query": """
            mutation($params: ReexecutionParams!) {
              launchRunReexecution(reexecutionParams: $params) {
                __typename
                ... on LaunchRunSuccess { run { runId } }
                ... on PythonError { message }
              }
            }""",
            "variables": {"params": {"parentRunId": parent_run_id, "strategy": "ALL_STEPS"}},
        },
        timeout=60,
    ).json()
    launched = result["data"]["launchRunReexecution"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    return launched["run"]["runId"]


def _refused_before_queueing(instance: dg.DagsterInstance, run_id: str) -> str:
    """The run ended CANCELED without being queued or started; its one line."""
    wait_for(
        lambda: instance.get_run_by_id(run_id).status == dg.DagsterRunStatus.CANCELED,
        60,
        f"run {run_id} to be refused",
    )
    events = [e.dagster_event for e in instance.all_logs(run_id) if e.dagster_event]
    kinds = {e.event_type_value for e in events}
    assert not kinds & {"PIPELINE_ENQUEUED", "PIPELINE_STARTING", "PIPELINE_START", "STEP_START"}
    assert not kinds & {"PIPELINE_FAILURE"}  # refused, not failed
    assert instance.get_run_record_by_id(run_id).start_time is None
    (failure,) = [e for e in events if e.event_type_value == "PIPELINE_CANCELED"]
    engine_errors = [
        e for e in events if e.event_type_value == "ENGINE_EVENT" and e.engine_event_data.error
    ]
    assert not engine_errors  # no Python error, no stack trace
    assert "\n" not in failure.message and failure.message.startswith("refused before queueing")
    tags = instance.get_run_by_id(run_id).tags
    assert "dagster/will_retry" not in tags and tags["dagster/max_retries"] == "0"  # not retried
    return failure.message


def test_unconsented_person_runs_are_refused_before_queueing_and_audited(loaded, tmp_path):
    db = loaded
    with dagster_stack(db, tmp_path) as (client, instance, port):
        instance.add_dynamic_partitions("tenants", TENANTS)
        instance.add_dynamic_partitions("tenant_chunks", ["chunk-001"])
        wait_for(lambda: _sensor_ticked(instance, "run_failure_recorder"), 120, "the sensor")
        before = _business(db)

        # the Launchpad: execute with no reason
        launchpad = _launch(client, "tenant-001", {"mode": "execute"})
        assert "needs a reason" in _refused_before_queueing(instance, launchpad)
        # a person re-executes it: the same rule (the re-execution copies config and tags)
        again = _reexecute(port, launchpad)
        assert instance.get_run_by_id(again).tags["dagster/parent_run_id"] == launchpad
        assert "needs a reason" in _refused_before_queueing(instance, again)

        # a backfill tagged execute but with no reason: every run refused
        no_reason = _backfill(port, "quote_expiration", TENANTS, {"qo_ops/mode": "execute"})
        unreasoned = _finished_backfill_runs(instance, no_reason, 2)
        for run in unreasoned:
            assert "needs a reason" in _refused_before_queueing(instance, run.run_id)

        # a destructive job's backfill execute, with a reason: refused, pointing at the API
        # (a windowed job's partition is the day × tenant chunk: Dagster's backfill names no
        # tenant)
        destructive = _backfill(
            port,
            "read_model_repair",
            ["2026-02-10|chunk-001"],
            {"qo_ops/mode": "execute", "qo_ops/reason": "INC-6 drift"},
        )
        (repair,) = _finished_backfill_runs(instance, destructive, 1)
        assert "needs an approval" in _refused_before_queueing(instance, repair.run_id)

        # the Launchpad: a destructive job's execute with a reason and no approval
        unapproved = _launch_job(client, "run_history_retention", "tenant-001", DESTRUCTIVE_RUN)
        assert "needs an approval" in _refused_before_queueing(instance, unapproved)

        with db.engine.connect() as conn:
            ran = conn.execute(sa.text("SELECT job_name, trigger_type, mode FROM job_run")).all()
        assert ran == []  # nothing ran
        after = _business(db)
        assert {k for k in after if after[k] != before[k]} == set()  # nothing changed

        # each refusal is on record: who, what, scope, mode, reason
        refused_ids = [
            launchpad, again, *(r.run_id for r in unreasoned), repair.run_id, unapproved
        ]  # fmt: skip

        def audited() -> list[sa.Row]:
            with db.engine.connect() as conn:
                return conn.execute(
                    sa.text(
                        "SELECT actor, action, decision, job_name, scope, mode, reason, "
                        "correlation_id, details FROM job_audit WHERE correlation_id = ANY(:ids)"
                    ),
                    {"ids": refused_ids},
                ).all()

        wait_for(lambda: len(audited()) == len(refused_ids), 120, "the refusals' audit rows")
        rows = {r.correlation_id: r for r in audited()}
        expected = {
            launchpad: (f"dagster-run:{launchpad}", "quote_expiration", "tenant-001", None),
            again: (f"dagster-run:{again}", "quote_expiration", "tenant-001", None),
            **{
                r.run_id: (f"backfill:{no_reason}", "quote_expiration", r.tags["dagster/partition"],
                           None)
                for r in unreasoned
            },
            repair.run_id: (f"backfill:{destructive}", "read_model_repair", "2026-02-10|chunk-001",
                            "INC-6 drift"),
            unapproved: (f"dagster-run:{unapproved}", "run_history_retention", "tenant-001",
                         DESTRUCTIVE_RUN["reason"]),
        }  # fmt: skip
        for run_id, (actor, job, scope, reason) in expected.items():
            row = rows[run_id]
            assert (row.actor, row.action, row.decision) == (actor, "trigger", "denied")
            assert (row.job_name, row.scope, row.mode, row.reason) == (
                job,
                scope,
                "execute",
                reason,
            )
            assert row.details["at"] == "submission" and "\n" not in row.details["cause"]
        assert rows[repair.run_id].details["refused"] == "approval_required"
        assert rows[unapproved].details["refused"] == "approval_required"
        assert {rows[i].details["refused"] for i in refused_ids[:-2]} == {"reason_required"}
        assert rows[again].details["trigger"] == "manual"  # a person's re-execution

        # the same Launchpad execute citing an approver's approval is queued and runs
        granted = approvals.grant(
            db.engine,
            CATALOG["run_history_retention"],
            approvals.Grant("run_history_retention", ["tenant-001"], "INC-6 drift", "ana"),
        )
        approved = _launch_job(
            client,
            "run_history_retention",
            "tenant-001",
            {**DESTRUCTIVE_RUN, "approval": granted.id},
        )
        wait_for(
            lambda: instance.get_run_by_id(approved).status in FINISHED, 180, "the approved run"
        )
        assert instance.get_run_by_id(approved).status == dg.DagsterRunStatus.SUCCESS
        with db.engine.connect() as conn:
            cited = conn.execute(
                sa.text("SELECT approval_id, status FROM job_run WHERE dagster_run_id = :r"),
                {"r": approved},
            ).one()
        assert cited.approval_id == granted.id and cited.status in ("success", "no_work")
