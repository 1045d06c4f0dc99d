"""Each catalog job through real Dagster execution (execute_in_process), one partition: a
tenant job's tenant, or a windowed job's day with its tenant named in run config."""

from __future__ import annotations

import dagster as dg
import pytest
import sqlalchemy as sa

from qo_ops.dagster_defs.freshness import RECENT_SUCCESS_CHECK
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.schedule.partition_keys import FAILED_TENANTS_TAG, MODE_TAG, REASON_TAG
from qo_ops_tests.conftest import approval_config

SPECS = sorted(CATALOG)


def tenant_config(job_name: str, tenant: str = "tenant-001") -> dict:
    """Run config naming the tenant of a windowed job's run (its partition is the day)."""
    return {"tenants": [tenant]} if CATALOG[job_name].partitioning == "tenant_day" else {}


def work_partition(loaded, job_name: str, tenant: str = "tenant-001") -> str:
    """A partition of ``job_name`` with work to do for ``tenant``: the tenant, or the first
    day the tenant has work on and the tenant's chunk (its run names the tenant in config:
    ``tenant_config``)."""
    import uuid
    from datetime import date, timedelta

    from qo_ops.platform.job.outcome import BatchContext
    from qo_ops.platform.job.scope import Scope
    from qo_ops.platform.run.runner import count_eligible
    from qo_ops.platform.schedule.partition_keys import partition_key_for
    from qo_ops.platform.schedule.tenants import chunk_of

    spec = CATALOG[job_name]
    if job_name == "run_history_retention":  # its work is old run history: plant some
        from qo_ops_tests.jobs.test_run_history_retention import plant_old_history

        plant_old_history(loaded.engine, tenant)
    if spec.partitioning == "tenant":
        return tenant
    with loaded.engine.connect() as conn:
        for offset in range(90):
            day = date(2026, 1, 1) + timedelta(days=offset)
            ctx = BatchContext(
                spec.name, Scope(tenant, day, day + timedelta(days=1)), "dry_run", uuid.uuid4()
            )
            if count_eligible(conn, spec, ctx):
                return partition_key_for(spec, tenant, day, chunk_of(conn, tenant))
    raise AssertionError(f"no day with work for {job_name}")


def _run(
    defs,
    instance,
    job_name: str,
    config: dict | None = None,
    tags: dict | None = None,
    partition=None,
):
    job = defs.resolve_job_def(job_name)
    partition = partition or work_partition(defs.loaded_db, job_name)
    config = {**tenant_config(job_name), **(config or {})}
    run_config = {"ops": {f"{job_name}_op": {"config": config}}}
    return job.execute_in_process(
        partition_key=partition,
        instance=instance,
        run_config=run_config,
        tags=tags,
        raise_on_error=False,
    )


def _summary(result, job_name: str) -> dict:
    return result.output_for_node(f"{job_name}_op")


def _counts(loaded) -> tuple[int, str]:
    """Runs recorded, and a digest of every business table."""
    from qo_ops.db.digest import database_digest
    from qo_ops.db.schema import BUSINESS_TABLES, outbox_event

    with loaded.engine.connect() as conn:
        runs = conn.scalar(sa.text("SELECT count(*) FROM job_run"))
        return runs, str(database_digest(conn, (*BUSINESS_TABLES, outbox_event)))


@pytest.mark.parametrize("job_name", SPECS)
def test_dry_run_partition_changes_nothing_and_reports(defs, instance, loaded, job_name):
    partition = work_partition(loaded, job_name)
    before = _counts(loaded)
    result = _run(defs, instance, job_name, {"mode": "dry_run"}, partition=partition)
    assert result.success
    summary = _summary(result, job_name)
    assert summary["mode"] == "dry_run" and summary["scope"].startswith("tenant-001")
    assert summary["trigger"] == "manual"
    assert summary["eligible_count"] > 0
    metadata = result.get_step_success_events()[0].step_success_data  # the step really ran
    assert metadata is not None
    output_meta = next(
        e.event_specific_data.metadata
        for e in result.all_events
        if e.event_type_value == "STEP_OUTPUT"
    )
    assert output_meta["eligible_count"].value == summary["eligible_count"]
    assert output_meta["mutated_count"].value == summary["mutated_count"] == 0  # a dry run
    assert output_meta["job_run_id"].value == summary["job_run_id"]
    after = _counts(loaded)
    assert after[0] == before[0] + 1 and after[1] == before[1]  # one run row, no business change
    assert result.get_asset_check_evaluations() == []  # checks follow execute runs only
    run_tags = instance.get_run_by_id(result.run_id).tags
    assert run_tags["qo_ops/tenant"] == "tenant-001"  # the Runs list filters by tenant


@pytest.mark.parametrize("job_name", SPECS)
def test_execute_partition_records_passing_checks(defs, instance, loaded, job_name):
    result = _run(
        defs,
        instance,
        job_name,
        {"mode": "execute", "reason": "test", "batch_size": 25, **approval_config(job_name)},
    )
    assert result.success
    summary = _summary(result, job_name)
    # every eligible item handled; planted poison deliveries make delivery_retry a partial success
    assert summary["status"] in ("success", "partial_success")
    assert summary["processed_count"] == summary["eligible_count"] > 0
    assert summary["mutated_count"] == summary["succeeded_count"] > 0
    evaluations = result.get_asset_check_evaluations()
    declared = [e for e in evaluations if e.check_name != RECENT_SUCCESS_CHECK]
    assert {e.check_name for e in declared} == {c.name for c in CATALOG[job_name].checks}
    assert all(e.passed for e in evaluations)
    assert all(e.metadata["scope"].value.startswith("tenant-001") for e in declared)
    assert {e.partition for e in evaluations} == {"tenant-001"}  # on the tenant's partition
    # a success marks the tenant fresh at once; a partial success only for a job whose
    # catalog entry counts it (poison items failing on purpose: delivery_retry)
    fresh = [e for e in evaluations if e.check_name == RECENT_SUCCESS_CHECK]
    assert len(fresh) == (1 if summary["status"] in CATALOG[job_name].fresh_statuses else 0)


def test_broken_outcome_fails_the_check_and_the_run(defs, instance, loaded):
    with loaded.engine.begin() as conn:  # an EXPIRED quote that never got its event
        conn.execute(
            sa.text(
                "UPDATE quote SET status = 'EXPIRED' WHERE id = (SELECT min(id) FROM quote "
                "WHERE tenant_id = 'tenant-001' AND status = 'DRAFT')"
            )
        )
    result = _run(defs, instance, "quote_expiration", {"mode": "execute", "reason": "test"})
    assert not result.success
    evaluations = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert evaluations["one_event_per_expired_quote"].passed is False
    assert evaluations["one_event_per_expired_quote"].metadata["missing_events"].value == 1
    assert evaluations["no_overdue_active_quotes"].passed is True
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "one_event_per_expired_quote" in failure.message + str(failure.event_specific_data.error)


def test_backfill_runs_take_their_mode_from_a_tag(defs, instance, loaded):
    dry = _run(defs, instance, "quote_expiration", tags={"dagster/backfill": "abc"})
    assert _summary(dry, "quote_expiration")["mode"] == "dry_run"
    assert _summary(dry, "quote_expiration")["trigger"] == "backfill"
    executed = _run(
        defs,
        instance,
        "quote_expiration",
        tags={"dagster/backfill": "abc", MODE_TAG: "execute", REASON_TAG: "backfill INC-1"},
    )
    summary = _summary(executed, "quote_expiration")
    assert (summary["mode"], summary["status"]) == ("execute", "success")
    with loaded.engine.connect() as conn:
        row = conn.execute(
            sa.text("SELECT trigger_type, reason, dagster_run_id FROM job_run WHERE id = :id"),
            {"id": summary["job_run_id"]},
        ).one()
    assert (row.trigger_type, row.reason, row.dagster_run_id) == (
        "backfill",
        "backfill INC-1",
        executed.run_id,
    )


def test_bad_run_config_is_refused_with_a_clear_message(defs, instance, loaded):
    job = defs.resolve_job_def("quote_expiration")
    with pytest.raises(dg.DagsterInvalidConfigError, match="not in enum type Mode"):
        job.execute_in_process(
            partition_key="tenant-001",
            instance=instance,
            run_config={"ops": {"quote_expiration_op": {"config": {"mode": "sideways"}}}},
        )
    before = _counts(loaded)
    negative = _run(
        defs, instance, "quote_expiration", {"mode": "execute", "reason": "x", "batch_size": -5}
    )
    assert not negative.success
    failure = next(e for e in negative.all_events if e.event_type_value == "STEP_FAILURE")
    assert "batch_size" in str(
        failure.event_specific_data.error
    ) and "greater than or equal to 1" in str(failure.event_specific_data.error)
    no_reason = _run(defs, instance, "quote_expiration", {"mode": "execute"})
    assert not no_reason.success
    failure = next(e for e in no_reason.all_events if e.event_type_value == "STEP_FAILURE")
    assert "needs a reason" in str(failure.event_specific_data.error)
    assert _counts(loaded) == before  # refused before anything was written


def test_a_held_lease_makes_the_run_skip_visibly(defs, instance, loaded):
    with loaded.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO job_lease VALUES ('quote_expiration', 'tenant-001', 'elsewhere', 'tok', 7, "
                "now(), now(), now() + interval '1 hour', NULL)"
            )
        )
    result = _run(defs, instance, "quote_expiration", {"mode": "execute", "reason": "x"})
    assert result.success  # another run is doing the work: not a failure
    summary = _summary(result, "quote_expiration")
    assert (summary["status"], summary["status_reason"]) == ("skipped", "lease-not-acquired")
    assert result.get_asset_check_evaluations() == []


RANGE = {
    "dagster/asset_partition_range_start": "tenant-001",
    "dagster/asset_partition_range_end": "tenant-002",
}


def test_a_partition_range_run_leases_each_tenant_in_turn(defs, instance, loaded):
    job = defs.resolve_job_def("quote_expiration")
    result = job.execute_in_process(
        instance=instance,
        run_config={"ops": {"quote_expiration_op": {"config": {"mode": "execute", "reason": "r"}}}},
        tags=RANGE,
        raise_on_error=False,
    )
    assert result.success
    runs = _summary(result, "quote_expiration")["runs"]
    assert [r["scope"] for r in runs] == ["tenant-001", "tenant-002"]
    assert all(r["status"] == "success" and r["succeeded_count"] > 0 for r in runs)
    with loaded.engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT scope, dagster_run_id, status FROM job_run "
                "WHERE job_name = 'quote_expiration' ORDER BY scope"
            )
        ).all()
        left = conn.scalar(
            sa.text("SELECT count(*) FROM quote WHERE status = 'ACTIVE' AND expires_at < now()")
        )
    assert [(r.scope, r.dagster_run_id, r.status) for r in rows] == [
        ("tenant-001", result.run_id, "success"),
        ("tenant-002", result.run_id, "success"),
    ]
    assert left == 0
    # each tenant's outcome and checks on its own partition of the outcome asset
    asset = dg.AssetKey(["qo_ops", "quotes"])
    materialized = {
        e.partition: e.event_specific_data.materialization.metadata["status"].value
        for e in result.get_asset_materialization_events()
        if e.asset_key == asset
    }
    assert materialized == {"tenant-001": "success", "tenant-002": "success"}
    evaluations = result.get_asset_check_evaluations()
    assert sorted((e.check_name, e.partition) for e in evaluations) == sorted(
        (name, t)
        for name in (*(c.name for c in CATALOG["quote_expiration"].checks), RECENT_SUCCESS_CHECK)
        for t in ("tenant-001", "tenant-002")
    )
    assert all(e.passed for e in evaluations)
    assert all(
        e.metadata["scope"].value == e.partition
        for e in evaluations
        if e.check_name != RECENT_SUCCESS_CHECK
    )
    output = next(e for e in result.all_events if e.event_type_value == "STEP_OUTPUT")
    meta = output.event_specific_data.metadata
    assert (meta["tenants"].value, meta["tenants_failed"].value) == (2, 0)
    assert meta["failed_tenants"].value == "none"


def test_a_partition_range_run_fails_at_the_end_when_a_tenant_fails(defs, instance, loaded):
    with loaded.engine.begin() as conn:  # tenant-001: an EXPIRED quote that never got its event
        conn.execute(
            sa.text(
                "UPDATE quote SET status = 'EXPIRED' WHERE id = (SELECT min(id) FROM quote "
                "WHERE tenant_id = 'tenant-001' AND status = 'DRAFT')"
            )
        )
    job = defs.resolve_job_def("quote_expiration")
    result = job.execute_in_process(
        instance=instance,
        run_config={"ops": {"quote_expiration_op": {"config": {"mode": "execute", "reason": "r"}}}},
        tags=RANGE,
        raise_on_error=False,
    )
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "1 of 2 tenants failed or missed their outcome: tenant-001." in str(
        failure.event_specific_data.error
    )
    # re-executing the run runs only the tenant whose outcome was not met
    assert instance.get_run_by_id(result.run_id).tags[FAILED_TENANTS_TAG] == "tenant-001"
    assert "qo_ops/tenant" not in instance.get_run_by_id(result.run_id).tags  # two tenants
    with loaded.engine.connect() as conn:  # tenant-002 was still done
        done = conn.execute(
            sa.text(
                "SELECT scope FROM job_run WHERE job_name = 'quote_expiration' "
                "AND status = 'success' ORDER BY scope"
            )
        ).scalars()
        assert list(done) == ["tenant-001", "tenant-002"]
    evaluations = {(e.check_name, e.partition): e for e in result.get_asset_check_evaluations()}
    assert evaluations["one_event_per_expired_quote", "tenant-001"].passed is False
    assert evaluations["one_event_per_expired_quote", "tenant-002"].passed is True


def test_a_windowed_run_covers_its_chunk_and_refuses_a_tenant_of_another_in_one_line(
    defs, instance, loaded
):
    """A windowed job's partition is a day and a tenant chunk: launched without tenants it
    covers the chunk's tenants; naming a tenant outside the chunk is refused in one line,
    naming the tenant's chunk, before anything is written."""
    job = defs.resolve_job_def("order_reconciliation")
    covered = job.execute_in_process(
        partition_key="2026-02-10|chunk-001",
        instance=instance,
        run_config={"ops": {"order_reconciliation_op": {"config": {"mode": "dry_run"}}}},
        raise_on_error=False,
    )
    assert covered.success
    with loaded.engine.connect() as conn:
        scopes = conn.execute(
            sa.text("SELECT scope FROM job_run WHERE dagster_run_id = :r ORDER BY scope"),
            {"r": covered.run_id},
        ).scalars()
        assert list(scopes) == [
            "tenant-001/2026-02-10..2026-02-11",
            "tenant-002/2026-02-10..2026-02-11",
        ]
    before = _counts(loaded)
    instance.add_dynamic_partitions("tenant_chunks", ["chunk-002"])
    refused = job.execute_in_process(
        partition_key="2026-02-10|chunk-002",
        instance=instance,
        run_config={
            "ops": {
                "order_reconciliation_op": {
                    "config": {"mode": "dry_run", "tenants": ["tenant-002"]}
                }
            }
        },
        raise_on_error=False,
    )
    assert not refused.success
    failure = next(e for e in refused.all_events if e.event_type_value == "STEP_FAILURE")
    description = failure.event_specific_data.user_failure_data.description
    assert description == (
        "config tenants must be members of the partition's tenant chunk chunk-002: "
        "tenant-002 is in chunk-001 (qo-ops status --tenant T names a tenant's chunk)"
    )
    assert _counts(loaded) == before


def test_a_run_of_an_old_day_only_key_naming_its_tenants_still_runs(defs, instance, loaded):
    """A run queued before windowed jobs had tenant chunks (``dagster/partition`` a day only,
    its tenants in config) starts on today's code: its key is read from the tag, which
    Dagster itself cannot parse against the day × chunk partitions."""
    result = defs.resolve_job_def("order_reconciliation").execute_in_process(
        instance=instance,
        run_config={
            "ops": {
                "order_reconciliation_op": {
                    "config": {"mode": "dry_run", "tenants": ["tenant-001"]}
                }
            }
        },
        tags={"dagster/partition": "2026-02-10"},
        raise_on_error=False,
    )
    assert result.success
    with loaded.engine.connect() as conn:
        scopes = conn.execute(sa.text("SELECT scope FROM job_run")).scalars().all()
    assert scopes == ["tenant-001/2026-02-10..2026-02-11"]


def test_a_run_record_says_when_its_dagster_run_was_created_and_which_retry_it_is(
    defs, instance, loaded
):
    """What the start-delay and retry signals read (job_start_delay_seconds, job_retries_total
    {scope="run"}): the Dagster run's creation, and the retry number and budget of its tags."""
    first = _run(defs, instance, "quote_expiration", {"mode": "execute", "reason": "facts"})
    retry = _run(
        defs,
        instance,
        "quote_expiration",
        {"mode": "execute", "reason": "facts, again"},
        tags={"dagster/retry_number": "1", "dagster/max_retries": "2"},
    )
    with loaded.engine.connect() as conn:
        rows = {
            r.dagster_run_id: r
            for r in conn.execute(
                sa.text(
                    "SELECT dagster_run_id, requested_at, created_at, started_at, trigger_type, "
                    "retry_number, retries_max FROM job_run"
                )
            )
        }
    for result in (first, retry):
        created = instance.get_run_record_by_id(result.run_id).create_timestamp
        row = rows[result.run_id]
        assert row.requested_at == created.replace(tzinfo=row.requested_at.tzinfo)
        assert row.requested_at <= row.started_at
    assert (rows[first.run_id].retry_number, rows[first.run_id].retries_max) == (0, 0)
    assert (rows[retry.run_id].retry_number, rows[retry.run_id].retries_max) == (1, 2)
    assert rows[retry.run_id].trigger_type == "retry"
