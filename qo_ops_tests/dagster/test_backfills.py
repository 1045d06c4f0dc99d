"""Backfills by tenant and date range from the UI: tenant_backfill_job (the Launchpad form)
validates, audits and plans; tenant_backfill_sensor turns the plan into chunked runs."""

from __future__ import annotations

import json
from datetime import date, timedelta

import dagster as dg
import pytest
import sqlalchemy as sa

from qo_ops.dagster_defs.backfills import BACKFILL_JOB, BACKFILL_OP
from qo_ops.dagster_defs.resources import QoOpsDatabase
from qo_ops.dagster_defs.submission import BACKFILL_RUN_TAG, REFUSED_TAG, refusal_at_submission
from qo_ops.platform.schedule.partition_keys import MODE_TAG, REASON_TAG, SCOPE_TAG

WINDOWED = "pricing_snapshot_recalculation"


def _launch(defs, instance, **config):
    job = defs.resolve_job_def(BACKFILL_JOB)
    return job.execute_in_process(
        instance=instance,
        run_config={"ops": {BACKFILL_OP: {"config": config}}},
        raise_on_error=False,
    )


def _failure(result) -> str:
    event = next(e for e in result.all_events if e.is_step_failure)
    data = event.step_failure_data
    return data.user_failure_data.description if data.user_failure_data else data.error.message


def _audits(loaded) -> list:
    with loaded.engine.connect() as conn:
        return conn.execute(
            sa.text("SELECT * FROM job_audit WHERE action = 'backfill' ORDER BY id")
        ).all()


def _tick(defs, loaded, instance, cursor=None):
    sensor = defs.resolve_sensor_def("tenant_backfill_sensor")
    context = dg.build_sensor_context(
        instance=instance,
        cursor=cursor,
        resources={"database": QoOpsDatabase(url=loaded.env_url)},
    )
    return sensor.evaluate_tick(context)


@pytest.mark.parametrize(
    ("config", "refusal"),
    [
        ({"job": WINDOWED, "tenants": ["tenant-404"], "first_day": "2026-02-01",
          "last_day": "2026-02-02"}, "unknown tenant(s): tenant-404"),
        ({"job": WINDOWED}, "first_day must be a day"),
        ({"job": WINDOWED, "first_day": "2026-02-05", "last_day": "2026-02-01"},
         "last_day must not be before first_day"),
        ({"job": WINDOWED, "first_day": "2025-01-01", "last_day": "2025-01-02"},
         "days must lie from 2026-01-01"),
        ({"job": "quote_expiration", "first_day": "2026-02-01"}, "is not windowed"),
        ({"job": "quote_expiration", "mode": "execute"}, "needs a reason"),
        ({"job": "temp_file_cleanup", "mode": "execute", "reason": "r",
          "first_day": "2026-02-01", "last_day": "2026-02-01"}, "needs an approval"),
        ({"job": "temp_file_cleanup", "mode": "execute", "reason": "r", "approval": "apr-nope",
          "first_day": "2026-02-01", "last_day": "2026-02-01"}, "apr-nope does not exist"),
    ],
)  # fmt: skip
def test_a_bad_backfill_is_refused_in_one_line_and_plans_nothing(
    defs, loaded, instance, config, refusal
):
    result = _launch(defs, instance, **config)
    assert not result.success
    message = _failure(result)
    assert refusal in message and "\n" not in message
    consent = config.get("mode") == "execute"  # a person's execute refused: on record
    assert [a.decision for a in _audits(loaded)] == (["denied"] if consent else [])
    assert not _tick(defs, loaded, instance).run_requests


def test_a_backfill_over_tenants_and_days_becomes_chunked_runs_of_windows(defs, loaded, instance):
    result = _launch(
        defs,
        instance,
        job=WINDOWED,
        first_day="2026-02-20",
        last_day="2026-02-27",
        days_per_run=4,
        tenants_per_run=1,
        mode="execute",
        reason="repair after the incident",
    )
    assert result.success, _failure(result)
    (audit,) = _audits(loaded)
    assert (audit.job_name, audit.mode, audit.decision) == (WINDOWED, "execute", "accepted")
    assert audit.reason == "repair after the incident"
    assert audit.details["runs"] == 4  # 2 tenants (1 per run) × 2 windows of 4 days

    tick = _tick(defs, loaded, instance)
    requests = tick.run_requests
    assert len(requests) == 4
    covered = set()
    for request in requests:
        assert request.job_name == WINDOWED
        config = request.run_config["ops"][f"{WINDOWED}_op"]["config"]
        assert config["mode"] == "execute" and config["reason"] == "repair after the incident"
        (tenant,) = config["tenants"]
        start = request.tags["dagster/asset_partition_range_start"]
        end = request.tags["dagster/asset_partition_range_end"]
        covered.add((tenant, start, end))
        assert request.tags[BACKFILL_RUN_TAG] == result.run_id
        assert request.tags[MODE_TAG] == "execute"
        assert request.tags[REASON_TAG] == "repair after the incident"
        day = start.partition("|")[0]
        assert request.tags[SCOPE_TAG] == f"{WINDOWED}:{day}:chunk:{tenant}"
    assert covered == {  # a range of days of one tenant chunk: both tenants are in chunk-001
        (t, f"{a}|chunk-001", f"{b}|chunk-001")
        for t in ("tenant-001", "tenant-002")
        for a, b in (("2026-02-20", "2026-02-23"), ("2026-02-24", "2026-02-27"))
    }
    # the plan is requested once: the next tick finds nothing new
    again = _tick(defs, loaded, instance, cursor=tick.cursor)
    assert not again.run_requests

    # one of those runs, as the daemon would launch it: every tenant of it runs the window
    request = requests[0]
    job = defs.resolve_job_def(WINDOWED)
    run = job.execute_in_process(
        instance=instance, run_config=request.run_config, tags=request.tags, raise_on_error=False
    )
    assert run.success
    with loaded.engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT scope, trigger_type, mode, requester, reason FROM job_run")
        ).all()
    (tenant,) = request.run_config["ops"][f"{WINDOWED}_op"]["config"]["tenants"]
    start = date.fromisoformat(request.tags["dagster/asset_partition_range_start"][:10])
    end = date.fromisoformat(request.tags["dagster/asset_partition_range_end"][:10])
    assert [r.scope for r in rows] == [f"{tenant}/{start}..{end + timedelta(days=1)}"]
    assert {(r.trigger_type, r.mode, r.reason) for r in rows} == {
        ("backfill", "execute", "repair after the incident")
    }
    assert rows[0].requester == f"dagster-run:{result.run_id}"


def test_a_backfill_of_every_tenant_continues_over_ticks(defs, loaded, instance):
    with loaded.engine.begin() as conn:  # 1,200 tenants: 12 chunks × 2 runs of 50 × 25 windows
        conn.execute(
            sa.text(
                "INSERT INTO tenant (id, name) SELECT 'bulk-' || lpad(g::text, 5, '0'), 'b' "
                "FROM generate_series(1, 1198) g"
            )
        )
    result = _launch(
        defs, instance, job=WINDOWED, first_day="2026-01-01", last_day="2026-01-25",
        days_per_run=1, tenants_per_run=50,
    )  # fmt: skip
    assert result.success, _failure(result)
    first = _tick(defs, loaded, instance)
    second = _tick(defs, loaded, instance, cursor=first.cursor)
    third = _tick(defs, loaded, instance, cursor=second.cursor)
    assert len(first.run_requests) == 500  # at most 500 per tick
    assert len(second.run_requests) == 100
    assert not third.run_requests
    keys = [r.run_key for r in first.run_requests + second.run_requests]
    assert len(set(keys)) == 600
    tenants = [
        t
        for r in first.run_requests + second.run_requests
        for t in r.run_config["ops"][f"{WINDOWED}_op"]["config"]["tenants"]
    ]
    assert len(tenants) == 1200 * 25 and len(set(tenants)) == 1200
    ranges = [
        (r.tags["dagster/asset_partition_range_start"], r.tags["dagster/asset_partition_range_end"])
        for r in first.run_requests + second.run_requests
    ]
    assert all(a[11:] == b[11:] for a, b in ranges)  # a run covers one tenant chunk
    assert len({a[11:] for a, _ in ranges}) == 12
    assert all(r.tags[MODE_TAG] == "dry_run" for r in first.run_requests)
    assert json.loads(third.cursor).get("after")


def test_a_windowed_run_names_its_tenants_by_its_chunk_or_config(defs):
    """A windowed run's partition is a day and a tenant chunk: without tenants in config it
    covers the chunk's, and is queued; a run of an old day-only key a person launches
    without tenants is refused before queueing, saying how; Dagster's backfill of such a
    day is still queued (every tenant, or the tag qo_ops/backfill_tenants's)."""
    from qo_ops_tests.dagster.test_submission import _coordinated_instance, _create, _submit

    day = {"dagster/partition": "2026-02-10"}
    chunk = {"dagster/partition": "2026-02-10|chunk-001"}
    with _coordinated_instance() as instance:
        refused = _submit(instance, defs, WINDOWED, {}, day)  # the Launchpad, no tenants
        assert refused.status == dg.DagsterRunStatus.CANCELED  # refused, not failed
        assert refused.tags[REFUSED_TAG] == "bad_input"
        (failure,) = instance.all_logs(refused.run_id, of_type=dg.DagsterEventType.RUN_CANCELED)
        message = failure.dagster_event.message
        assert message.startswith("refused before queueing: ") and "\n" not in message
        assert "pick a day and tenant chunk partition" in message
        assert refusal_at_submission(_create(instance, defs, WINDOWED, {}, chunk)) is None
        backfill_day = _create(instance, defs, WINDOWED, {}, {"dagster/backfill": "b7", **day})
        assert refusal_at_submission(backfill_day) is None
        named = _create(instance, defs, WINDOWED, {"tenants": ["tenant-001"]}, day)
        assert refusal_at_submission(named) is None
        tenant_job = _create(instance, defs, "quote_expiration", {}, {"dagster/partition": "t"})
        assert refusal_at_submission(tenant_job) is None  # its partition is the tenant


def test_a_day_backfill_run_covers_every_tenant_or_the_tagged_ones(defs, loaded, instance):
    """The day × chunk run of Dagster's own backfill, executed: each tenant of the chunk run
    on its own scope of the day; with qo_ops/backfill_tenants, only those; an empty tag is
    refused."""
    job = defs.resolve_job_def(WINDOWED)
    backfill = {"dagster/backfill": "b8"}
    every = job.execute_in_process(
        partition_key="2026-02-10|chunk-001", instance=instance, tags=backfill, raise_on_error=False
    )
    assert every.success, _failure(every)
    tagged = job.execute_in_process(
        partition_key="2026-02-11|chunk-001",
        instance=instance,
        tags={**backfill, "qo_ops/backfill_tenants": "tenant-002"},
        raise_on_error=False,
    )
    assert tagged.success, _failure(tagged)
    empty = job.execute_in_process(
        partition_key="2026-02-12|chunk-001",
        instance=instance,
        tags={**backfill, "qo_ops/backfill_tenants": " , "},
        raise_on_error=False,
    )
    assert not empty.success and "names no tenant" in _failure(empty)
    with loaded.engine.connect() as conn:
        ran = conn.execute(
            sa.text("SELECT scope, trigger_type, mode FROM job_run ORDER BY scope")
        ).all()
    assert [tuple(r) for r in ran] == [
        ("tenant-001/2026-02-10..2026-02-11", "backfill", "dry_run"),
        ("tenant-002/2026-02-10..2026-02-11", "backfill", "dry_run"),
        ("tenant-002/2026-02-11..2026-02-12", "backfill", "dry_run"),
    ]
