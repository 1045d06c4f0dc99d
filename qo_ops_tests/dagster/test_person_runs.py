"""Who may execute, on a real deployment (webserver + daemon, dagster.yaml's run
coordinator): a Launchpad execute without a reason, a person's re-execution of it, a
backfill tagged execute without a reason and a destructive job's backfill execute are all
refused before they are queued — FAILURE with one line, no run worker, no stack trace —
change nothing, and are audited as ``denied`` with their cause. (With a reason, every run
of a backfill has its audit row: test_instance.py.)"""

from __future__ import annotations

import dagster as dg
import httpx
import sqlalchemy as sa
from dagster._core.scheduler.instigation import InstigatorType

from qo_ops.db.digest import database_digest
from qo_ops.db.schema import BUSINESS_TABLES, outbox_event
from qo_ops_tests.dagster.stack import dagster_stack, wait_for
from qo_ops_tests.dagster.test_instance import _backfill, _finished_backfill_runs, _launch

TENANTS = ["tenant-001", "tenant-002"]


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
    """The run ended FAILURE without being queued or started; its one failure line."""
    wait_for(
        lambda: instance.get_run_by_id(run_id).status == dg.DagsterRunStatus.FAILURE,
        60,
        f"run {run_id} to be refused",
    )
    events = [e.dagster_event for e in instance.all_logs(run_id) if e.dagster_event]
    kinds = {e.event_type_value for e in events}
    assert not kinds & {"PIPELINE_ENQUEUED", "PIPELINE_STARTING", "PIPELINE_START", "STEP_START"}
    assert instance.get_run_record_by_id(run_id).start_time is None
    (failure,) = [e for e in events if e.event_type_value == "PIPELINE_FAILURE"]
    engine_errors = [
        e for e in events if e.event_type_value == "ENGINE_EVENT" and e.engine_event_data.error
    ]
    assert not engine_errors  # no Python error, no stack trace
    assert "\n" not in failure.message and failure.message.startswith("refused before queueing")
    assert instance.get_run_by_id(run_id).tags["dagster/will_retry"] == "false"  # not retried
    return failure.message


def test_unconsented_person_runs_are_refused_before_queueing_and_audited(loaded, tmp_path):
    db = loaded
    with dagster_stack(db, tmp_path) as (client, instance, port):
        instance.add_dynamic_partitions("tenants", TENANTS)
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
        # (a windowed job's partition is the day: Dagster's backfill names no tenant)
        destructive = _backfill(
            port,
            "read_model_repair",
            ["2026-02-10"],
            {"qo_ops/mode": "execute", "qo_ops/reason": "INC-6 drift"},
        )
        (repair,) = _finished_backfill_runs(instance, destructive, 1)
        assert "operator API's approval flow" in _refused_before_queueing(instance, repair.run_id)

        with db.engine.connect() as conn:
            ran = conn.execute(sa.text("SELECT job_name, trigger_type, mode FROM job_run")).all()
        assert ran == []  # nothing ran
        after = _business(db)
        assert {k for k in after if after[k] != before[k]} == set()  # nothing changed

        # run_failure_recorder puts each refusal on record: who, what, scope, mode, reason
        refused_ids = [launchpad, again, *(r.run_id for r in unreasoned), repair.run_id]

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
            repair.run_id: (f"backfill:{destructive}", "read_model_repair", "2026-02-10",
                            "INC-6 drift"),
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
            assert row.details["cause"].startswith("refused before queueing")
        assert rows[repair.run_id].details["refused"] == "approval_required"
        assert {rows[i].details["refused"] for i in refused_ids[:-1]} == {"reason_required"}
        assert rows[again].details["trigger"] == "manual"  # a person's re-execution
