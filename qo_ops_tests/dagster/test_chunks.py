"""One run for many tenants: overlap with another run of the same tenant leaves the
tenant to whoever holds its lease, and each tenant's truth lands on its own partition."""

from __future__ import annotations

import uuid

import dagster as dg
import sqlalchemy as sa

from qo_ops.platform.run.lease import acquire

JOB = "quote_expiration"


def _chunk(defs, instance, tenants):
    job = defs.resolve_job_def(JOB)
    config = {"mode": "execute", "reason": "chunk overlap", "tenants": tenants}
    return job.execute_in_process(
        instance=instance,
        run_config={"ops": {f"{JOB}_op": {"config": config}}},
        raise_on_error=False,
    )


def _events(result, kind):
    return {
        e.event_specific_data.materialization.partition
        if kind == "ASSET_MATERIALIZATION"
        else e.event_specific_data.asset_observation.partition: e
        for e in result.all_events
        if e.event_type_value == kind
    }


def test_a_tenant_whose_lease_another_run_holds_is_skipped_and_the_others_run(
    defs, loaded, instance
):
    held = acquire(loaded.engine, JOB, "tenant-001", "another-run", 300, uuid.uuid4())
    assert held is not None
    result = _chunk(defs, instance, ["tenant-001", "tenant-002"])
    assert result.success  # a skipped tenant is not a failure: the lease holder does its work
    output = result.output_for_node(f"{JOB}_op")
    assert {(r["scope"], r["status"]) for r in output["runs"]} == {
        ("tenant-001", "skipped"),
        ("tenant-002", "success"),
    }
    metadata = next(
        e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"
    ).event_specific_data.metadata
    assert metadata["status_skipped"].value == 1 and metadata["status_success"].value == 1
    assert metadata["failed_tenants"].value == "none"
    # each tenant's truth on its own partition: tenant-002 kept right, tenant-001 only observed
    assert set(_events(result, "ASSET_MATERIALIZATION")) == {"tenant-002"}
    observed = _events(result, "ASSET_OBSERVATION")
    assert set(observed) == {"tenant-001"}
    assert (
        observed["tenant-001"].event_specific_data.asset_observation.metadata["status"].value
        == "skipped"
    )
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(["qo_ops", "quotes"])), limit=10
    ).records
    assert {r.partition_key for r in records} == {"tenant-002"}


def test_a_person_naming_an_unknown_tenant_is_refused_before_any_tenant_runs(
    defs, loaded, instance
):
    result = _chunk(defs, instance, ["tenant-001", "tenant-404"])
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure)
    assert failure.step_failure_data.user_failure_data.description == (
        "unknown tenant(s): tenant-404"
    )
    with loaded.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM job_run").scalar() == 0


def test_a_tenant_inside_a_chunk_is_found_by_qo_ops_runs(defs, loaded, instance):
    """A chunk's tags name its range, not each tenant (lean tags): `qo-ops runs --tenant T`
    finds the tenant's run inside the chunk, with the chunk's Dagster run id (short, as the
    Runs list shows it) to open in the UI."""
    from qo_ops_tests.conftest import base_env, run_cli

    result = _chunk(defs, instance, ["tenant-001", "tenant-002"])
    assert result.success
    env = base_env(QO_OPS_DATABASE_URL=loaded.env_url)
    found = run_cli(["runs", "--tenant", "tenant-002"], env)
    assert found.code == 0, found.stderr
    rows = [line for line in found.stdout.splitlines() if result.run_id[:8] in line]
    assert len(rows) == 1 and "tenant-002" in rows[0] and JOB in rows[0], found.stdout
    other = run_cli(["runs", "--tenant", "tenant-003"], env)  # not in the chunk
    assert other.code == 0 and result.run_id[:8] not in other.stdout


def test_a_chunk_whose_downstream_breaker_is_open_claims_nothing_for_any_tenant(
    defs, loaded, instance, downstream
):
    """delivery_retry over a chunk of two tenants in Dagster, the shared breaker open (probe
    not due): each tenant's run ends ``failed`` / ``dependency_unavailable`` at its first
    claim, no item row changes (a claim and release would move ``next_attempt_at``), and no
    call reaches the downstream (up all along). The chunk loop itself knows nothing of it.

    Planted once (in qo_ops_tests/jobs/test_shared_breaker.py, the same rule without
    Dagster): with the refusal taken out of ``prepare_calls``, the item rows changed."""
    from qo_ops.platform.calls.call_stats import DEPENDENCY_UNAVAILABLE

    tenants = ["tenant-001", "tenant-002"]
    items = "SELECT id, attempt_count, next_attempt_at, updated_at FROM delivery_attempt_item ORDER BY id"
    with loaded.engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE delivery_attempt_item SET status = 'READY', payload = payload - 'fault', "
                "next_attempt_at = now() - interval '1 minute'"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO downstream_breaker (downstream, state, opened_at, probe_after) "
                "VALUES (:o, 'open', now(), now() + interval '5 minutes')"
            ),
            {"o": downstream.url},
        )
        before = conn.execute(sa.text(items)).all()
    assert before

    job = defs.resolve_job_def("delivery_retry")
    config = {"mode": "execute", "reason": "breaker open", "tenants": tenants}
    result = job.execute_in_process(
        instance=instance,
        run_config={"ops": {"delivery_retry_op": {"config": config}}},
        raise_on_error=False,
    )
    with loaded.engine.connect() as conn:
        runs = conn.execute(
            sa.text(
                "SELECT scope, status, last_error_code, status_reason FROM job_run "
                "WHERE job_name = 'delivery_retry' ORDER BY scope"
            )
        ).all()
        after = conn.execute(sa.text(items)).all()
    assert [(r.scope, r.status, r.last_error_code) for r in runs] == [
        (t, "failed", DEPENDENCY_UNAVAILABLE) for t in tenants
    ], result.success
    assert {r.status_reason for r in runs} == {f"circuit breaker open for {downstream.url}"}
    assert after == before
    stats = downstream.client.stats(detail=False)
    assert stats["delivery_requests"] == stats["outage_refused"] == 0


def test_a_late_ticks_drift_warning_reaches_the_event_log_once_per_chunk_not_per_tenant(
    defs, loaded
):
    """Every tenant of a chunk whose tick is 10 minutes late logs
    job.scheduler.drift.detected; the run's Dagster event log (managed_python_loggers, as in
    dagster.yaml) gets the first one and a line counting them all, not one write per tenant.
    Each tenant's tick and start stay on its job_run row."""
    from datetime import UTC, datetime, timedelta

    with loaded.engine.begin() as conn:  # a third tenant: three drift warnings to fold
        conn.execute(sa.text("INSERT INTO tenant (id, name) VALUES ('tenant-003', 'T3')"))
    tenants = ["tenant-001", "tenant-002", "tenant-003"]
    tick = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=600)
    logs = {
        "python_logs": {"managed_python_loggers": ["qo_ops.events"], "python_log_level": "INFO"}
    }
    with dg.instance_for_test(overrides=logs) as instance:
        instance.add_dynamic_partitions("tenants", tenants)
        result = defs.resolve_job_def(JOB).execute_in_process(
            instance=instance,
            run_config={"ops": {f"{JOB}_op": {"config": {"mode": "execute", "tenants": tenants}}}},
            tags={"dagster/schedule_name": f"{JOB}_schedule",
                  "qo_ops/scheduled_for": tick.isoformat()},
        )  # fmt: skip
        assert result.success
        messages = [e.user_message or "" for e in instance.all_logs(result.run_id)]
    drift = '"event.name": "job.scheduler.drift.detected"'
    assert sum(drift in m for m in messages) == 1, messages
    counted = [m for m in messages if "job.scheduler.drift.detected (start_delayed): 3 of 3" in m]
    assert len(counted) == 1, messages
    with loaded.engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT scope, scheduled_for FROM job_run WHERE dagster_run_id = :id"),
            {"id": result.run_id},
        ).all()
    assert sorted((r.scope, r.scheduled_for) for r in rows) == [(t, tick) for t in tenants]
