"""Run reports and outcome trends in Dagster: every catalog job's output carries its report
table and the numbers of its run, and every run records its business outcome on its
tenant's partition of the outcome asset (an execute run that kept it right materializes it)."""

from __future__ import annotations

import uuid

import dagster as dg
import pytest

from qo_ops.db import migrate
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.job.outcome import BatchContext
from qo_ops.platform.job.scope import scope_text
from qo_ops.platform.run.report import REPORT_SAMPLE
from qo_ops.platform.run.selection import count_eligible
from qo_ops.platform.schedule.overdue import backlog_scope, database_now
from qo_ops.platform.schedule.partition_keys import MODE_TAG, scope_from_partition_key
from qo_ops_tests.conftest import approval_config
from qo_ops_tests.dagster.test_jobs import SPECS, _run, _summary, work_partition

# what a job's own report rows add up to, on an execute run over a partition with work
JOB_ROWS = {
    "temp_file_cleanup": ("deleted", "succeeded_count"),
    "audit_archive": ("archived", "succeeded_count"),
    "order_reconciliation": ("mismatch", None),
    "delivery_retry": ("outcome", "processed_count"),
    "notification_publish": ("outcome", "processed_count"),
}


def _output_metadata(result) -> dict:
    return next(
        e.event_specific_data.metadata
        for e in result.all_events
        if e.event_type_value == "STEP_OUTPUT"
    )


def _report(metadata) -> list[dict]:
    table = metadata["report"]
    assert isinstance(table, dg.TableMetadataValue)
    assert [c.name for c in table.schema.columns] == ["kind", "name", "count", "detail"]
    rows = [dict(r.data) for r in table.records]
    assert all(isinstance(r["count"], int) for r in rows)  # numbers stay numbers
    return rows


def _outcome_events(
    result, instance, job_name: str
) -> list[dg.AssetMaterialization | dg.AssetObservation]:
    """What the run recorded on its outcome asset: materializations and observations."""
    key = dg.AssetKey(["qo_ops", CATALOG[job_name].presentation.outcome_asset])
    events: list[dg.AssetMaterialization | dg.AssetObservation] = []
    for fetch in (instance.fetch_materializations, instance.fetch_observations):
        for r in fetch(key, limit=100).records:
            if r.run_id == result.run_id:
                events.append(r.asset_materialization or r.asset_observation)
    return events


@pytest.mark.parametrize("job_name", SPECS)
def test_a_dry_run_reports_its_sample_with_the_change_execute_would_make(
    defs, instance, loaded, job_name
):
    spec = CATALOG[job_name]
    result = _run(defs, instance, job_name, {"mode": "dry_run"})
    assert result.success
    summary = _summary(result, job_name)
    metadata = _output_metadata(result)
    rows = _report(metadata)
    assert instance.get_run_by_id(result.run_id).tags[MODE_TAG] == "dry_run"
    if not spec.batching.dry_run_scans:  # a selection: counts and a sample of ids
        would = [r for r in rows if r["kind"] == "would_change"]
        assert would == [
            {
                "kind": "would_change",
                "name": spec.presentation.change,
                "count": summary["eligible_count"],
                "detail": "",
            }
        ]
        sample = [r for r in rows if r["kind"] == "sample"]
        assert [r["name"] for r in sample] == summary["sample_ids"][:REPORT_SAMPLE]
        assert len(sample) == min(len(summary["sample_ids"]), REPORT_SAMPLE) > 0
        assert {r["detail"] for r in sample} == {spec.presentation.change}
        if spec.batching.checkpoint is None:
            assert metadata["backlog"].value == summary["eligible_count"]
    for name in ("fencing_token", "duration_ms", "eligible_count"):
        assert name not in metadata or isinstance(metadata[name].value, (int, float))
    if spec.partitioning == "tenant_day":
        # one day's partition: its first and last day are that day (the last included)
        day = work_partition(loaded, job_name).split("|")[0]  # what _run ran: day|chunk
        assert metadata["first_day"].value == metadata["last_day"].value == day
        assert metadata["scope"].value == f"tenant-001/{day}"
    (outcome,) = _outcome_events(result, instance, job_name)  # a dry run changes nothing:
    assert isinstance(outcome, dg.AssetObservation)  # observed, not materialized
    assert outcome.partition == "tenant-001"


@pytest.mark.parametrize("job_name", SPECS)
def test_an_execute_run_reports_counters_job_rows_checks_and_observes_its_asset(
    defs, instance, loaded, job_name
):
    spec = CATALOG[job_name]
    partition = work_partition(loaded, job_name)
    config = {"mode": "execute", "reason": "test", "batch_size": 25, **approval_config(job_name)}
    result = _run(defs, instance, job_name, config, partition=partition)
    assert result.success
    summary = _summary(result, job_name)
    metadata = _output_metadata(result)
    rows = _report(metadata)
    assert instance.get_run_by_id(result.run_id).tags[MODE_TAG] == "execute"
    items = {r["name"]: r["count"] for r in rows if r["kind"] == "items"}
    assert items["processed"] == summary["processed_count"]
    assert items["succeeded"] == summary["succeeded_count"] > 0
    checks = {r["name"]: r["detail"] for r in rows if r["kind"] == "check"}
    assert checks == {c.name: "passed" for c in spec.checks}
    assert metadata["fencing_token"].value >= 1
    assert metadata["code_version"].value == migrate.code_version()  # which release ran it
    kind, counter = JOB_ROWS.get(job_name, (None, None))
    if kind is not None:
        own = [r for r in rows if r["kind"] == kind]
        assert own, f"{job_name}: no {kind} rows in {rows}"
        if counter is not None:
            assert sum(r["count"] for r in own) == summary[counter]
    checkpointing = spec.batching.checkpoint
    if checkpointing is not None:  # a backfill keeps its checkpoint; a rescan forgets it when done
        assert ("checkpoint_after" in metadata) is not checkpointing.rescan_when_complete
        assert ("checkpoint_age_s" in metadata) is not checkpointing.rescan_when_complete

    (outcome,) = _outcome_events(result, instance, job_name)
    assert isinstance(outcome, dg.AssetMaterialization)  # an execute run kept its outcome
    figures = outcome.metadata
    run_scope = scope_from_partition_key(spec, partition, "tenant-001")
    assert outcome.partition == run_scope.tenant_id  # whose backlog the point is
    assert figures["status"].value == summary["status"]
    assert figures["job_run_id"].value == summary["job_run_id"]
    if spec.partitioning == "tenant_day":
        assert (
            figures["run_scope"].value
            == scope_text(summary["scope"])
            == f"tenant-001/{partition.split('|')[0]}"
        )
    if spec.batching.checkpoint is None and not spec.batching.dry_run_scans:
        # what is still due for the tenant, every day of it, from the job's own selection
        with loaded.engine.connect() as conn:
            scope = backlog_scope(spec, run_scope.tenant_id, database_now(conn))
            ctx = BatchContext(spec.name, scope, "dry_run", uuid.uuid4())
            assert figures["backlog"].value == count_eligible(conn, spec, ctx)
    if spec.signals.dead_letters is not None:
        assert isinstance(figures["dead_letters"].value, int)


def test_a_scheduled_run_records_its_tick_and_says_when_it_drifted(
    defs, instance, loaded, caplog, monkeypatch
):
    """The schedule's tick travels in a tag; the run row keeps it next to its real start, and
    a start more than QO_OPS_DRIFT_WARN_S (300 s) late logs job.scheduler.drift.detected."""
    import json
    import logging
    from datetime import UTC, datetime, timedelta

    import sqlalchemy as sa

    caplog.set_level(logging.INFO, logger="qo_ops.events")
    job = defs.resolve_job_def("quote_expiration")
    for late_s in (600, 1):
        tick = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=late_s)
        caplog.clear()
        result = job.execute_in_process(
            partition_key="tenant-001",
            instance=instance,
            run_config={"ops": {"quote_expiration_op": {"config": {"mode": "execute"}}}},
            tags={"dagster/schedule_name": "quote_expiration_schedule",
                  "qo_ops/scheduled_for": tick.isoformat()},
        )  # fmt: skip
        assert result.success
        summary = result.output_for_node("quote_expiration_op")
        with loaded.engine.connect() as conn:
            row = conn.execute(
                sa.text("SELECT scheduled_for, started_at FROM job_run WHERE id = :id"),
                {"id": uuid.UUID(summary["job_run_id"])},
            ).one()
        assert row.scheduled_for == tick and row.started_at >= tick
        events = [json.loads(r.getMessage()) for r in caplog.records if r.name == "qo_ops.events"]
        started = next(e for e in events if e["event.name"] == "job.started")
        assert late_s <= started["scheduler.drift_s"] < late_s + 120
        drifted = [e for e in events if e["event.name"] == "job.scheduler.drift.detected"]
        assert len(drifted) == (1 if late_s > 300 else 0)
        if drifted:  # nothing ran at its tick: the start itself was slow
            assert drifted[0]["reason"] == "start_delayed"
            previous = (row.started_at, summary["job_run_id"])

    # a run whose tick fell while another run of its scope was running waited behind it
    monkeypatch.setenv("QO_OPS_DRIFT_WARN_S", "0.001")
    with loaded.engine.connect() as conn:
        first = conn.execute(
            sa.text("SELECT started_at, finished_at FROM job_run WHERE id = :id"),
            {"id": uuid.UUID(previous[1])},
        ).one()
    tick = first.started_at + (first.finished_at - first.started_at) / 2
    caplog.clear()
    assert job.execute_in_process(
        partition_key="tenant-001",
        instance=instance,
        run_config={"ops": {"quote_expiration_op": {"config": {"mode": "execute"}}}},
        tags={"dagster/schedule_name": "quote_expiration_schedule",
              "qo_ops/scheduled_for": tick.isoformat()},
    ).success  # fmt: skip
    events = [json.loads(r.getMessage()) for r in caplog.records if r.name == "qo_ops.events"]
    [drifted] = [e for e in events if e["event.name"] == "job.scheduler.drift.detected"]
    assert drifted["reason"] == "previous_run_active"


def test_a_run_the_breaker_stopped_reports_why_and_its_calls(defs, instance, downstream):
    """The downstream is down: delivery_retry's breaker opens, the Dagster run fails naming
    the breaker, and its metadata carries the error class, the call figures as numbers and
    the report's downstream and breaker rows (not raw tally keys)."""
    downstream.stop()  # every connection refused from now on
    result = _run(defs, instance, "delivery_retry", {"mode": "execute", "reason": "test"})
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    data = failure.step_failure_data.user_failure_data
    assert data.description == (
        f"delivery_retry ended failed: circuit breaker open for {downstream.url}"
    )
    metadata = data.metadata
    assert metadata["error_code"].value == "dependency_unavailable"
    calls = metadata["downstream_calls"].value
    assert calls > 0 and metadata["downstream_spared"].value > 0
    retries = metadata["downstream_retries"].value  # items that had failed before the outage
    assert metadata["downstream_retry_pressure"].value == pytest.approx(retries / calls, abs=1e-4)
    assert metadata["downstream_breaker"].value == "opened 1"
    rows = _report(metadata)
    downstream_rows = {r["name"]: r for r in rows if r["kind"] == "downstream"}
    assert downstream_rows["calls"]["count"] == calls
    assert downstream_rows["retries"] == {
        "kind": "downstream", "name": "retries", "count": retries,
        "detail": f"{retries / calls * 100:.1f} % of calls",
    }  # fmt: skip
    assert downstream_rows["not_sent_breaker_open"]["count"] > 0
    breaker = {r["name"]: r for r in rows if r["kind"] == "breaker"}
    assert breaker["open"]["count"] == 1
    assert breaker["dependency_unavailable"]["detail"] == (
        f"circuit breaker open for {downstream.url}"
    )
    assert not [
        r
        for r in rows
        if r["kind"] == "tally" and r["name"].startswith(("downstream.", "breaker."))
    ]
