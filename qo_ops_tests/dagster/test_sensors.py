"""Sensors and schedules evaluated for real against the database (build_sensor_context)."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

import dagster as dg
import sqlalchemy as sa
from dagster._core.definitions.partitions.context import partition_loading_context
from dagster._core.events import DagsterEvent, DagsterEventType
from dagster._core.remote_origin import RegisteredCodeLocationOrigin, RemoteRepositoryOrigin

from qo_ops.dagster_defs.freshness import RECENT_SUCCESS_JOB
from qo_ops.dagster_defs.resources import QoOpsDatabase
from qo_ops.dagster_defs.sensors import STALE_TAG
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.schedule.partition_keys import SCOPE_TAG, TENANTS_TAG
from qo_ops_tests.dagster.scale_fixtures import schedules_on_since


def _database(loaded) -> QoOpsDatabase:
    return QoOpsDatabase(url=loaded.env_url)


def test_tenant_partitions_follow_the_tenant_table(defs, loaded):
    sensor = defs.resolve_sensor_def("tenants_sensor")
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("tenants", ["tenant-001", "tenant-gone"])
        instance.add_dynamic_partitions("tenant_chunks", ["chunk-009"])  # beyond the count
        context = dg.build_sensor_context(
            instance=instance, resources={"database": _database(loaded)}
        )
        result = sensor.evaluate_tick(context)
        assert result.dynamic_partitions_requests is not None
        for request in result.dynamic_partitions_requests:  # apply them as the daemon would
            if isinstance(request, dg.AddDynamicPartitionsRequest):
                instance.add_dynamic_partitions(request.partitions_def_name, request.partition_keys)
            else:
                for key in request.partition_keys:
                    instance.delete_dynamic_partition(request.partitions_def_name, key)
        assert sorted(instance.get_dynamic_partitions("tenants")) == ["tenant-001", "tenant-002"]
        assert instance.get_dynamic_partitions("tenant_chunks") == ["chunk-001"]  # 2 tenants
        assert json.loads(result.cursor)["tenants"] == 2
        again = sensor.evaluate_tick(
            dg.build_sensor_context(instance=instance, resources={"database": _database(loaded)})
        )
        assert not again.dynamic_partitions_requests
        assert again.skip_message == "2 tenant partitions and 1 tenant chunks, all in sync"


def test_backlog_sensor_launches_only_past_the_threshold_and_rotates_its_cursor(
    defs, loaded, instance
):
    sensor = defs.resolve_sensor_def("quote_expiration_backlog_sensor")
    context = dg.build_sensor_context(instance=instance, resources={"database": _database(loaded)})
    quiet = sensor.evaluate_tick(context)  # demo backlog per tenant is far below 1000
    assert not quiet.run_requests
    assert "no tenant has 1000 waiting" in quiet.skip_message
    assert json.loads(quiet.cursor)["offset"] == 2

    with loaded.engine.begin() as conn:  # tenant-002 gets a real backlog of 1,200
        conn.execute(
            sa.text(
                "INSERT INTO quote (tenant_id, quote_number, customer_ref, status, total_amount, "
                "price_book_version, created_at, updated_at, expires_at) "
                "SELECT 'tenant-002', 'BL-' || g, 'c', 'ACTIVE', 1, 2, now(), now(), now() - interval '1 day' "
                "FROM generate_series(1, 1200) g"
            )
        )
    context = dg.build_sensor_context(
        instance=instance,
        cursor=quiet.cursor,
        resources={"database": _database(loaded)},
        definitions=defs,
    )
    # a run of tenant-002 still waits in Dagster's queue: that run takes this backlog too
    queued = submitted_run(
        instance,
        defs.resolve_job_def("quote_expiration"),
        {
            "ops": {
                "quote_expiration_op": {"config": {"mode": "execute", "tenants": ["tenant-002"]}}
            }
        },
        {},
        "RUN_ENQUEUED",
    )
    with partition_loading_context(dynamic_partitions_store=instance):
        waiting = sensor.evaluate_tick(context)
    assert not waiting.run_requests
    assert "a run is already queued or running for: tenant-002" in waiting.skip_message
    instance.report_run_canceled(queued)  # the queue drained: now it is asked for
    context = dg.build_sensor_context(
        instance=instance,
        cursor=quiet.cursor,
        resources={"database": _database(loaded)},
        definitions=defs,
    )
    with partition_loading_context(dynamic_partitions_store=instance):  # as the daemon provides
        busy = sensor.evaluate_tick(context)
    # one chunk run naming the tenants past the threshold (not a partition per tenant)
    (request,) = busy.run_requests
    assert request.partition_key is None
    config = request.run_config["ops"]["quote_expiration_op"]["config"]
    assert config == {"mode": "execute", "tenants": ["tenant-002"]}
    assert request.tags[SCOPE_TAG] == "quote_expiration:chunk:tenant-002"
    assert request.tags[TENANTS_TAG] == "1: tenant-002..tenant-002"
    # each tenant's backlog on its own partition of the outcome asset
    observed = {e.partition: e.metadata["backlog"].value for e in busy.asset_events}
    with loaded.engine.connect() as conn:
        waiting_001 = conn.scalar(
            sa.text(
                "SELECT count(*) FROM quote WHERE tenant_id = 'tenant-001' AND status = 'ACTIVE' AND expires_at < now()"
            )
        )
    # counts stop at the threshold: a tick never counts a whole large backlog
    assert json.loads(busy.cursor)["last"] == {"tenant-001": waiting_001, "tenant-002": 1000}
    assert observed == {"tenant-001": waiting_001, "tenant-002": 1000}


def test_stale_success_sensor_names_jobs_without_a_recent_success(defs, loaded, instance):
    sensor = defs.resolve_sensor_def("stale_success_sensor")

    def tick(cursor=None):
        context = dg.build_sensor_context(
            instance=instance, cursor=cursor, resources={"database": _database(loaded)}
        )
        return sensor.evaluate_tick(context)

    fresh_deployment = tick()  # no job has run, no schedule has ticked: nobody judged yet
    assert not fresh_deployment.run_requests
    assert "no stale tenant" in fresh_deployment.skip_message
    assert "not judged yet, not at work that long: quote_expiration," in (
        fresh_deployment.skip_message
    )
    schedules_on_since(loaded.engine)  # the schedules have been on for 30 days
    first = tick()  # every job/tenant is stale: a run to mark them on their partitions
    (request,) = first.run_requests
    assert request.tags[STALE_TAG].startswith(f"STALE: {2 * len(CATALOG)} job scope(s) — ")
    marked = request.run_config["ops"]["recent_success_op"]["config"]["tenants"]
    assert marked["quote_expiration"] == ["tenant-001", "tenant-002"]

    job = defs.resolve_job_def("quote_expiration")
    for tenant in ("tenant-001", "tenant-002"):
        assert job.execute_in_process(
            partition_key=tenant,
            instance=instance,
            run_config={
                "ops": {
                    "quote_expiration_op": {"config": {"mode": "execute", "reason": f"t {tenant}"}}
                }
            },
        ).success
    fresh = tick(first.cursor)  # the first tick's run never ran: asked again, without those
    (request,) = fresh.run_requests
    assert request.tags[STALE_TAG].startswith(f"STALE: {2 * (len(CATALOG) - 1)} job scope(s)")
    assert (
        "quote_expiration"
        not in request.run_config["ops"]["recent_success_op"]["config"]["tenants"]
    )
    marking = defs.resolve_job_def(RECENT_SUCCESS_JOB).execute_in_process(
        run_config=request.run_config,
        tags={**request.tags, "dagster/run_key": request.run_key},
        instance=instance,
    )
    assert marking.success
    named = tick(fresh.cursor)  # marked: nothing to ask, the reason names them
    assert not named.run_requests
    assert named.skip_message.startswith(f"STALE: {2 * (len(CATALOG) - 1)} job scope(s): ")
    assert "delivery_retry/tenant-001 (last success never" in named.skip_message
    assert "quote_expiration/" not in named.skip_message  # its scopes just succeeded


def schedule_tick(defs, instance, loaded, schedule_name: str, when: datetime):
    """One real evaluation of a schedule at ``when``, as the daemon makes it."""
    with (  # as a context manager: its resources (and instance) are torn down
        dg.build_schedule_context(
            instance=instance,
            scheduled_execution_time=when,
            repository_def=defs.get_repository_def(),
            resources={"database": _database(loaded)},  # the schedule reads the kill switch
        ) as context,
        partition_loading_context(dynamic_partitions_store=instance),
    ):
        return defs.resolve_schedule_def(schedule_name).evaluate_tick(context)


def submitted_run(instance, job, run_config, tags, event: str) -> dg.DagsterRun:
    """A run of ``job`` as the daemon leaves it: created, then moved on by ``event`` --
    ``RUN_ENQUEUED`` (the run coordinator queued it) or ``RUN_START`` (a run worker started
    it) -- and no further. Queued runs name their code location, as workspace.yaml does."""
    location = RegisteredCodeLocationOrigin("qo_ops.definitions")
    origin = RemoteRepositoryOrigin(location, "__repository__").get_job_origin(job.name)
    run = instance.create_run_for_job(
        job, run_config=run_config, tags=tags, remote_job_origin=origin
    )
    kind = DagsterEventType[event].value
    instance.report_dagster_event(DagsterEvent(kind, job_name=run.job_name), run_id=run.run_id)
    return instance.get_run_by_id(run.run_id)


def _tenants_of(request: dg.RunRequest, job: str = "quote_expiration") -> list[str]:
    return request.run_config["ops"][f"{job}_op"]["config"]["tenants"]


def test_schedule_fans_out_over_tenants_in_chunks_with_deterministic_run_keys(
    defs, instance, loaded
):
    when = datetime(2026, 11, 29, 12, 15, tzinfo=UTC)
    size = CATALOG["quote_expiration"].deployment.tenants_per_run

    def tick() -> list[dg.RunRequest]:
        result = schedule_tick(defs, instance, loaded, "quote_expiration_schedule", when)
        return list(result.run_requests or [])

    # two tenants: one run covering both, executing, no partition (the tenants are config)
    (request,) = tick()
    assert request.partition_key is None
    assert request.run_config["ops"]["quote_expiration_op"]["config"] == {
        "mode": "execute",
        "tenants": ["tenant-001", "tenant-002"],
    }
    assert request.run_key == f"quote_expiration:tenants:tenant-001..tenant-002:{when.isoformat()}"
    assert request.tags[SCOPE_TAG] == "quote_expiration:chunk:tenant-001"
    assert request.tags[TENANTS_TAG] == "2: tenant-001..tenant-002"

    # more tenants than a chunk holds: every tenant in exactly one run of at most `size`
    many = [f"tenant-{n:03d}" for n in range(3, 2 * size + 4)]
    instance.add_dynamic_partitions("tenants", many)
    requests = tick()
    covered = [t for r in requests for t in _tenants_of(r)]
    assert sorted(covered) == sorted(["tenant-001", "tenant-002", *many])
    assert len(requests) == 3 and all(len(_tenants_of(r)) <= size for r in requests)
    assert all(r.tags[SCOPE_TAG] == f"quote_expiration:chunk:{_tenants_of(r)[0]}" for r in requests)
    again = tick()  # the same tick asks for the same runs: the daemon launches each once
    assert [r.run_key for r in again] == [r.run_key for r in requests]
    assert len({r.run_key for r in requests}) == 3


def test_retention_schedules_run_the_day_that_just_aged_out(defs, instance, loaded, monkeypatch):
    """temp_file_cleanup and audit_archive run the day past retention, not yesterday (whose
    files and records are never old enough: such a schedule would never clean anything)."""
    when = datetime(2026, 11, 29, 3, 15, tzinfo=UTC)

    def days(schedule_name: str) -> tuple[set[str], str | None]:
        result = schedule_tick(defs, instance, loaded, schedule_name, when)
        requests = result.run_requests or []
        keys = {r.partition_key for r in requests}  # the day|chunk; its tenants in run config
        job = schedule_name.removesuffix("_schedule")
        assert all(_tenants_of(r, job) == ["tenant-001", "tenant-002"] for r in requests)
        return keys, result.skip_message

    monkeypatch.setenv("QO_OPS_TEMP_FILE_RETENTION_DAYS", "7")
    assert days("temp_file_cleanup_schedule") == ({"2026-11-21|chunk-001"}, None)
    monkeypatch.setenv("QO_OPS_AUDIT_RETENTION_DAYS", "90")  # 2026-08-30: inside the partitions
    assert days("audit_archive_schedule") == ({"2026-08-30|chunk-001"}, None)
    monkeypatch.setenv("QO_OPS_AUDIT_RETENTION_DAYS", "365")  # 2025-11-28: before 2026-01-01
    keys, skipped = days("audit_archive_schedule")
    assert keys == set() and "before the first partition" in (skipped or "")
    monkeypatch.setenv("QO_OPS_AUDIT_RETENTION_DAYS", "soon")
    keys, skipped = days("audit_archive_schedule")
    assert keys == set() and "QO_OPS_AUDIT_RETENTION_DAYS" in (skipped or "")
    assert days("order_reconciliation_schedule")[0] == {
        "2026-11-28|chunk-001"
    }  # yesterday, as before


def test_run_failure_recorder_puts_the_failure_on_record(defs, loaded, instance):
    job = defs.resolve_job_def("quote_expiration")
    failed = job.execute_in_process(
        partition_key="tenant-001",
        instance=instance,
        run_config={"ops": {"quote_expiration_op": {"config": {"mode": "execute"}}}},  # no reason
        tags={SCOPE_TAG: "quote_expiration:tenant-001"},
        raise_on_error=False,
    )
    assert not failed.success
    run = instance.get_run_by_id(failed.run_id)
    failure_event = instance.all_logs(failed.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)[
        0
    ].dagster_event
    context = dg.build_run_status_sensor_context(
        sensor_name="run_failure_recorder",
        dagster_event=failure_event,
        dagster_instance=instance,
        dagster_run=run,
        resources={"database": _database(loaded)},
    ).for_run_failure()
    defs.resolve_sensor_def("run_failure_recorder")(
        context
    )  # direct invocation, resources from the context
    with loaded.engine.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT actor, action, job_name, scope, details FROM job_audit WHERE action = 'run_failure'"
            )
        ).one()
    assert (row.actor, row.job_name, row.scope) == ("dagster", "quote_expiration", "tenant-001")
    assert row.details["dagster_run_id"] == failed.run_id
    # the cause, in the runner's own words, not Dagster's "Steps failed: [...]"
    assert "needs a reason" in row.details["message"], row.details
    assert "Steps failed" not in row.details["message"] and "\n" not in row.details["message"]


def test_the_exporters_queue_figures_are_the_instances_queued_runs(defs, loaded, instance):
    """run_queue_sensor samples Dagster's run queue per job; the exporter serves it: the depth
    is each job's QUEUED runs in the instance (a started run is not queued), the oldest age
    that of its first queued run, and both fall to 0 once the queue drains."""
    from qo_ops.metrics.exporter import JobCollector
    from qo_ops_tests.metrics.test_exporter import collect, value

    def run_of(job: str, event: str) -> dg.DagsterRun:
        config = {"ops": {f"{job}_op": {"config": {"mode": "dry_run", "tenants": ["tenant-001"]}}}}
        return submitted_run(instance, defs.resolve_job_def(job), config, {}, event)

    queued = [run_of("quote_expiration", "RUN_ENQUEUED")]
    time.sleep(3)  # the second is 3 s younger: the oldest age must be the first's
    queued += [run_of("quote_expiration", "RUN_ENQUEUED"), run_of("delivery_retry", "RUN_ENQUEUED")]
    started = run_of("quote_expiration", "RUN_START")
    sensor = defs.resolve_sensor_def("run_queue_sensor")
    context = dg.build_sensor_context(instance=instance, resources={"database": _database(loaded)})
    said = sensor.evaluate_tick(context).skip_message
    assert said == "queued runs: delivery_retry 1, quote_expiration 2"
    collector = JobCollector(loaded.engine, CATALOG.values())
    samples = collect(collector)
    with loaded.engine.connect() as conn:
        now = conn.execute(sa.text("SELECT clock_timestamp()")).scalar_one()
    for job in CATALOG:
        in_queue = instance.get_runs_count(
            dg.RunsFilter(job_name=job, statuses=[dg.DagsterRunStatus.QUEUED])
        )
        assert value(samples, "job_run_queue_depth", job_name=job) == in_queue
    assert value(samples, "job_run_queue_depth", job_name="quote_expiration") == 2
    first = instance.get_run_record_by_id(queued[0].run_id).create_timestamp
    age = (now - (first if first.tzinfo else first.replace(tzinfo=UTC))).total_seconds()
    oldest = value(samples, "job_run_queue_oldest_seconds", job_name="quote_expiration")
    assert age - 2 <= oldest <= age + 0.01  # the first queued run's age (read just before)
    assert value(samples, "job_run_queue_oldest_seconds", job_name="order_reconciliation") == 0

    for run in (*queued, started):  # the queue drains
        instance.report_run_canceled(run)
    assert sensor.evaluate_tick(context).skip_message == "no run is queued"
    drained = collect(collector)
    assert all(value(drained, "job_run_queue_depth", job_name=job) == 0 for job in CATALOG)
    assert value(drained, "job_run_queue_oldest_seconds", job_name="quote_expiration") == 0
    assert value(drained, "job_run_queue_sample_age_seconds") < 60
