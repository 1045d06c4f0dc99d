"""A Launchpad execute names its own reason, through real Dagster execution: the Launchpad
pre-fills an earlier run's config, so a relaunch over the same tenant carrying that run's
reason fails with one line before anything is claimed (audited ``denied``); the incident's
reason runs for another tenant, its own reason runs, and so does
Dagster's re-execution of the run that gave the reason (the webserver's path for the UI's
Re-execute: ``create_reexecuted_run`` with the parent's tags) — not a re-execution of the
refused relaunch."""

from __future__ import annotations

from collections.abc import Iterator

import dagster as dg
import pytest
import sqlalchemy as sa
from dagster._core.execution.plan.resume_retry import ReexecutionStrategy
from dagster._core.test_utils import in_process_test_workspace
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin

from qo_ops.dagster_defs.submission import PARENT_RUN_TAG
from qo_ops_tests.conftest import REPO
from qo_ops_tests.dagster import scale_fixtures
from qo_ops_tests.dagster.conftest import SYNC_LAUNCH

JOB = "quote_expiration"
INCIDENT = "INC-21 expire the stale quotes"


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    """An instance that launches a submitted run at once, in this process (the run worker's
    path), so that a re-execution submitted to it runs here."""
    with dg.instance_for_test(overrides=SYNC_LAUNCH) as inst:
        inst.add_dynamic_partitions("tenants", ["tenant-001", "tenant-002"])
        yield inst


def _launch(defs, instance, tenant: str, reason: str) -> dg.ExecuteInProcessResult:
    """What the Launchpad launches: the tenant partition, execute, a reason."""
    config = {"mode": "execute", "reason": reason}
    return defs.resolve_job_def(JOB).execute_in_process(
        partition_key=tenant,
        instance=instance,
        run_config={"ops": {f"{JOB}_op": {"config": config}}},
        raise_on_error=False,
    )


def _reexecute(instance, parent_run_id: str) -> dg.DagsterRun:
    """Re-execute a run as the UI's Re-execute asks the webserver: its config and tags
    (use_parent_run_tags), submitted to the instance and run by its launcher from the code
    location Dagster loads (here: in this process)."""
    origin = LoadableTargetOrigin(
        module_name=scale_fixtures.__name__, attribute="scale_defs", working_directory=str(REPO)
    )
    with in_process_test_workspace(instance, origin) as workspace:
        (location_name,) = workspace.code_location_names
        location = workspace.get_code_location(location_name)
        (repository,) = location.get_repositories().values()
        child = instance.create_reexecuted_run(
            request_context=workspace,
            parent_run=instance.get_run_by_id(parent_run_id),
            code_location=location,
            remote_job=repository.get_full_job(JOB),
            strategy=ReexecutionStrategy.ALL_STEPS,
            use_parent_run_tags=True,
        )
        instance.submit_run(child.run_id, workspace)
    return instance.get_run_by_id(child.run_id)


def _step_failure(instance, run_id: str) -> str:
    (failure,) = [
        e.dagster_event
        for e in instance.all_logs(run_id)
        if e.dagster_event and e.dagster_event.event_type_value == "STEP_FAILURE"
    ]
    return failure.event_specific_data.user_failure_data.description


def _runs(loaded) -> list[sa.Row]:
    with loaded.engine.connect() as conn:
        return conn.execute(
            sa.text("SELECT dagster_run_id, scope, reason FROM job_run ORDER BY started_at")
        ).all()


def test_a_relaunch_with_a_copied_reason_is_refused_and_a_reexecution_runs(defs, instance, loaded):
    first = _launch(defs, instance, "tenant-001", INCIDENT)
    assert first.success
    assert first.output_for_node(f"{JOB}_op")["succeeded_count"] > 0

    other_tenant = _launch(defs, instance, "tenant-002", INCIDENT)  # one incident, two tenants
    assert other_tenant.success, _step_failure(instance, other_tenant.run_id)
    relaunch = _launch(defs, instance, "tenant-001", INCIDENT)  # the pre-filled config
    assert not relaunch.success
    cause = _step_failure(instance, relaunch.run_id)
    assert "\n" not in cause and "give this run its own reason" in cause
    assert f"Dagster run {first.run_id[:8]}" in cause
    assert [r.dagster_run_id for r in _runs(loaded)] == [first.run_id, other_tenant.run_id]
    with loaded.engine.connect() as conn:
        denied = conn.execute(
            sa.text(
                "SELECT actor, scope, mode, reason, details FROM job_audit "
                "WHERE action = 'trigger' AND decision = 'denied'"
            )
        ).one()
    assert (denied.actor, denied.scope, denied.mode, denied.reason) == (
        f"dagster-run:{relaunch.run_id}",
        "tenant-001",
        "execute",
        INCIDENT,
    )
    assert denied.details["refused"] == "reason_reused"
    assert denied.details["dagster_run_id"] == relaunch.run_id

    own = _launch(defs, instance, "tenant-001", "INC-22 tenant-001's stale quotes")
    assert own.success, _step_failure(instance, own.run_id)

    again = _reexecute(instance, first.run_id)  # repeats the incident's run, on purpose
    assert again.status == dg.DagsterRunStatus.SUCCESS, instance.all_logs(again.run_id)
    assert again.tags[PARENT_RUN_TAG] == first.run_id
    retried_refusal = _reexecute(instance, relaunch.run_id)
    assert retried_refusal.status == dg.DagsterRunStatus.FAILURE
    assert "give this run its own reason" in _step_failure(instance, retried_refusal.run_id)

    assert [(r.dagster_run_id, r.scope, r.reason) for r in _runs(loaded)] == [
        (first.run_id, "tenant-001", INCIDENT),
        (other_tenant.run_id, "tenant-002", INCIDENT),
        (own.run_id, "tenant-001", "INC-22 tenant-001's stale quotes"),
        (again.run_id, "tenant-001", INCIDENT),
    ]
