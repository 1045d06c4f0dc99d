"""Staleness on every tenant partition at 10,000 tenants: stale_success_sensor evaluated for
real (build_sensor_context; the run it requests launched as the daemon would, executed
in-process against a real instance) and the ``recent_success`` check executed on its own,
over a real PostgreSQL."""

from __future__ import annotations

import time
from collections.abc import Iterator

import dagster as dg
import pytest
import sqlalchemy as sa
from dagster._core.event_api import PartitionKeyFilter
from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus

from qo_ops.dagster_defs import sensors
from qo_ops.dagster_defs.checks import build_outcome_assets, outcome_asset_key
from qo_ops.dagster_defs.freshness import (
    RECENT_SUCCESS_CHECK,
    RECENT_SUCCESS_JOB,
    build_recent_success_checks,
    judge,
    recent_success_evaluation,
)
from qo_ops.dagster_defs.resources import QoOpsDatabase
from qo_ops.dagster_defs.sensors import (
    MAX_STALE_EVENTS_PER_TICK,
    RUN_KEY_TAG,
    STALE_TAG,
    build_stale_success_sensor,
)
from qo_ops.jobs.catalog import CATALOG
from qo_ops_tests.dagster.scale_fixtures import schedules_on_since

TENANTS = 10_000
SPECS = list(CATALOG.values())
NEW = "tenant-10000"  # created just now, no run of the jobs below yet: not judged before its limit
UNRUN_BY_NEW = ("quote_expiration", "read_model_repair")
ALL = [f"tenant-{i:05d}" for i in range(1, TENANTS + 1)]

# (job, tenant) made stale, one way each: an old success, a failure only, nothing, a success
# older than a windowed job's limit
PLANTED = {
    ("quote_expiration", "tenant-00042"),
    ("quote_expiration", "tenant-07777"),
    ("read_model_repair", "tenant-05000"),
    ("read_model_repair", "tenant-09999"),
}

_RUN = """
    INSERT INTO job_run (id, job_name, scope, mode, trigger_type, owner_id, status,
                         started_at, finished_at, correlation_id)
"""
_WINDOW = "'/' || (current_date - 1) || '..' || current_date"


def _scope(job: str, tenant: str) -> str:
    return tenant if CATALOG[job].partitioning == "tenant" else f"{tenant}/2026-01-01..2026-01-02"


def _run(conn, job: str, tenant: str, status: str, ago: str, mode: str = "execute") -> None:
    conn.execute(
        sa.text(
            _RUN + "VALUES (gen_random_uuid(), :job, :scope, :mode, 'manual', 'test', :status, "
            "now() - CAST(:ago AS interval) - interval '1 minute', now() - CAST(:ago AS interval), "
            "'planted')"
        ),
        {"job": job, "scope": _scope(job, tenant), "mode": mode, "status": status, "ago": ago},
    )


def _keep_fresh(db) -> None:
    """The seeded successes of the minute job stay recent however slowly the machine runs the
    test (its limit is 3 minutes)."""
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE job_run SET finished_at = now() WHERE correlation_id = 'fresh' "
                "AND job_name = 'notification_publish'"
            )
        )


def _seed_successes(conn, tenant_ids: str, excluded: list[str]) -> None:
    """A recent execute success of every job for the tenants ``tenant_ids`` selects, but the
    ``excluded`` "job tenant" pairs."""
    conn.execute(
        sa.text(
            _RUN
            + f"""
            SELECT gen_random_uuid(), j.name,
                   CASE WHEN j.windowed THEN t.id || {_WINDOW} ELSE t.id END,
                   'execute', 'schedule', 'test', 'success', now() - interval '1 minute',
                   now(), 'fresh'
              FROM unnest(CAST(:jobs AS text[]), CAST(:windowed AS boolean[])) AS j(name, windowed)
             CROSS JOIN ({tenant_ids}) t
             WHERE (j.name || ' ' || t.id) <> ALL(CAST(:excluded AS text[]))
            """
        ),
        {
            "jobs": [s.name for s in SPECS],
            "windowed": [s.partitioning != "tenant" for s in SPECS],
            "excluded": excluded,
        },
    )


@pytest.fixture
def tenants_db(db):
    """10,000 tenants; a recent execute success of every job for every tenant but the planted
    pairs (and two jobs of the new tenant); the planted pairs' own history."""
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO tenant (id, name, created_at) "
                "SELECT 'tenant-' || lpad(g::text, 5, '0'), 'Tenant ' || g, "
                "CASE WHEN g = :n THEN now() ELSE now() - interval '30 days' END "
                "FROM generate_series(1, :n) g"
            ),
            {"n": TENANTS},
        )
        planted = [f"{j} {t}" for j, t in PLANTED] + [f"{j} {NEW}" for j in UNRUN_BY_NEW]
        planted.append("delivery_retry tenant-00042")  # its partial_success only (below)
        _seed_successes(conn, "SELECT id FROM tenant", planted)
        _run(conn, "quote_expiration", "tenant-00042", "success", "2 hours")
        _run(conn, "quote_expiration", "tenant-00042", "success", "1 minute", mode="dry_run")
        _run(conn, "quote_expiration", "tenant-07777", "failed", "10 minutes")
        _run(conn, "quote_expiration", "tenant-07777", "partial_success", "5 minutes")
        _run(conn, "read_model_repair", "tenant-09999", "success", "5 days")
        # poison items fail on purpose: delivery_retry's partial_success keeps a tenant fresh
        _run(conn, "delivery_retry", "tenant-00042", "partial_success", "1 minute")
        conn.execute(sa.text("ANALYZE tenant; ANALYZE job_run"))
    schedules_on_since(db.engine)  # every job has been at work for 30 days
    return db


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.instance_for_test() as inst:
        inst.add_dynamic_partitions("tenants", ALL)
        yield inst


class Ticks:
    """The sensor's ticks, each handed the previous cursor; the run a tick requests is
    launched as the daemon launches it (its run key and sensor tags) and runs in-process."""

    def __init__(self, db, instance: dg.DagsterInstance, launch: bool = True):
        self.sensor = build_stale_success_sensor(SPECS)
        self.database = QoOpsDatabase(url=db.env_url)
        self.db, self.instance, self.launch = db, instance, launch
        self.cursor: str | None = None
        self.seconds: list[float] = []
        self.recorded: set[tuple[str, str | None, bool]] = set()  # by the last tick's run

    def tick(self):
        _keep_fresh(self.db)
        context = dg.build_sensor_context(
            instance=self.instance, cursor=self.cursor, resources={"database": self.database}
        )
        started = time.perf_counter()
        result = self.sensor.evaluate_tick(context)
        self.seconds.append(time.perf_counter() - started)
        self.cursor = result.cursor
        self.recorded = set()
        for request in result.run_requests or []:
            assert request.job_name in (None, RECENT_SUCCESS_JOB)
            if self.launch:
                self.recorded |= _pairs(self.run(request))
        return result

    def run(self, request: dg.RunRequest):
        done = self.sensor.job.execute_in_process(
            run_config=request.run_config,
            tags=self.tags(request),
            instance=self.instance,
            resources={"database": self.database},
        )
        assert done.success
        return done

    @staticmethod
    def tags(request: dg.RunRequest) -> dict[str, str]:
        return {
            **request.tags,
            RUN_KEY_TAG: request.run_key,
            "dagster/sensor_name": "stale_success_sensor",
        }


def _check_key(job: str) -> dg.AssetCheckKey:
    return dg.AssetCheckKey(outcome_asset_key(CATALOG[job]), RECENT_SUCCESS_CHECK)


def _job_of(key: dg.AssetCheckKey) -> str:
    return next(s.name for s in SPECS if outcome_asset_key(s) == key.asset_key)


def _statuses(instance) -> dict[tuple[str, str | None], AssetCheckExecutionRecordStatus]:
    """The latest recent_success status of every (job, partition) the instance holds."""
    infos = instance.event_log_storage.get_asset_check_partition_info(
        [_check_key(s.name) for s in SPECS]
    )
    return {(_job_of(i.check_key), i.partition_key): i.latest_execution_status for i in infos}


def _failing(instance) -> set[tuple[str, str | None]]:
    return {
        k for k, v in _statuses(instance).items() if v == AssetCheckExecutionRecordStatus.FAILED
    }


def _latest(instance, job: str, tenant: str) -> dg.AssetCheckEvaluation:
    record = instance.event_log_storage.get_latest_asset_check_execution_by_key(
        [_check_key(job)], partition_filter=PartitionKeyFilter(key=tenant)
    )[_check_key(job)]
    return record.event.asset_check_evaluation


def _pairs(result) -> set[tuple[str, str | None, bool]]:
    """(job, partition, passed) of every recent_success evaluation a run recorded."""
    evaluations = [
        e.event_specific_data
        for e in result.all_events
        if e.event_type_value == "ASSET_CHECK_EVALUATION"
    ]
    return {(_job_of(e.asset_check_key), e.partition, e.passed) for e in evaluations}


def _requested(result) -> dict[str, list[str]]:
    (request,) = result.run_requests
    return request.run_config["ops"]["recent_success_op"]["config"]["tenants"]


def test_stale_tenants_are_marked_on_their_partitions_once_and_cleared_on_recovery(
    tenants_db, instance
):
    ticks = Ticks(tenants_db, instance)
    first = ticks.tick()
    print(
        f"\nstale_success_sensor tick at {TENANTS:,} tenants × {len(SPECS)} jobs: "
        f"{ticks.seconds[-1]:.2f} s, cursor {len(first.cursor)} bytes"
    )
    # exactly the planted pairs are failing, each on its own tenant partition
    assert ticks.recorded == {(j, t, False) for j, t in PLANTED}
    assert _failing(instance) == PLANTED
    assert set(_statuses(instance)) == PLANTED  # no other partition, no unpartitioned record
    (request,) = first.run_requests
    assert request.tags[STALE_TAG] == (
        "STALE: 4 job scope(s) — marking 4 tenant partition(s) stale, 0 recovered"
    )

    old = _latest(instance, "quote_expiration", "tenant-00042")  # the dry run did not count
    assert not old.passed and old.severity == dg.AssetCheckSeverity.WARN
    assert 7200 <= old.metadata["last_success_age_s"].value < 7800
    assert old.metadata["limit_s"].value == 2700
    never = _latest(instance, "quote_expiration", "tenant-07777")  # failed, partial: no success
    assert never.metadata["last_success_age_s"].value == "never"
    windowed = _latest(instance, "read_model_repair", "tenant-09999")
    assert 5 * 86400 <= windowed.metadata["last_success_age_s"].value < 5 * 86400 + 600
    assert windowed.metadata["limit_s"].value == 3 * 86400

    # a second tick asks for nothing; a tenant created since does not disturb the cursor
    with tenants_db.engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO tenant (id, name) VALUES ('tenant-10001', 'late')"))
        _seed_successes(conn, "SELECT 'tenant-10001' AS id", [])
    second = ticks.tick()
    assert not second.run_requests
    assert second.skip_message.startswith("STALE: 4 job scope(s): ")
    assert "quote_expiration/tenant-07777 (last success never, limit 45 min)" in second.skip_message
    assert "read_model_repair/tenant-09999 (last success 7200 min ago" in second.skip_message

    # two recover (a CLI run: no op reported it), one more turns stale
    with tenants_db.engine.begin() as conn:
        _run(conn, "quote_expiration", "tenant-00042", "success", "0 seconds")
        _run(conn, "read_model_repair", "tenant-09999", "no_work", "0 seconds")
        conn.execute(
            sa.text(
                "UPDATE job_run SET finished_at = now() - interval '1 hour', correlation_id = NULL "
                "WHERE job_name = 'delivery_retry' AND scope = 'tenant-00100'"
            )
        )
    ticks.tick()
    assert ticks.recorded == {
        ("quote_expiration", "tenant-00042", True),
        ("read_model_repair", "tenant-09999", True),
        ("delivery_retry", "tenant-00100", False),
    }
    assert _failing(instance) == {
        ("quote_expiration", "tenant-07777"),
        ("read_model_repair", "tenant-05000"),
        ("delivery_retry", "tenant-00100"),
    }
    recovered = _latest(instance, "quote_expiration", "tenant-00042")
    assert recovered.passed and recovered.metadata["last_success_age_s"].value < 600
    assert not ticks.tick().run_requests

    # the same tenant stale again: recorded again (a run-less evaluation could not be)
    with tenants_db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE job_run SET finished_at = now() - interval '3 hours' "
                "WHERE job_name = 'quote_expiration' AND scope = 'tenant-00042'"
            )
        )
    ticks.tick()
    assert ticks.recorded == {("quote_expiration", "tenant-00042", False)}

    # a removed tenant leaves the cursor unreadable: every stale pair is marked again
    with tenants_db.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM tenant WHERE id = 'tenant-00500'"))
    ticks.tick()
    assert ticks.recorded == {(j, t, False) for j, t in _failing(instance)}
    assert len(ticks.recorded) == 4
    assert not ticks.tick().run_requests
    print(f"ticks: {', '.join(f'{s:.2f} s' for s in ticks.seconds)}")


def test_marks_wait_for_the_run_and_are_asked_again_when_it_did_not_succeed(tenants_db, instance):
    ticks = Ticks(tenants_db, instance, launch=False)
    first = ticks.tick()
    asked = _requested(first)
    (request,) = first.run_requests
    run = instance.create_run_for_job(
        ticks.sensor.job, run_config=request.run_config, tags=Ticks.tags(request)
    )
    waiting = ticks.tick()  # the run is queued: no second run, and the reason says so
    assert not waiting.run_requests
    assert f"once run {request.run_key} has recorded the last" in waiting.skip_message
    instance.report_run_canceled(run)  # terminated before it recorded anything
    again = ticks.tick()
    assert _requested(again) == asked
    ticks.run(again.run_requests[0])
    assert not ticks.tick().run_requests
    assert _failing(instance) == PLANTED


def test_a_run_records_at_most_the_bound_and_the_rest_follow(tenants_db, instance, monkeypatch):
    """Many stale tenants of one job and the planted ones of two others: each run records the
    bound, taking the jobs in turn, and the next runs record the rest, none twice."""
    monkeypatch.setattr(sensors, "MAX_STALE_EVENTS_PER_TICK", 20)
    with tenants_db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "DELETE FROM job_run WHERE job_name = 'catalog_cache_refresh' "
                "AND scope <= 'tenant-00060'"
            )
        )
    ticks = Ticks(tenants_db, instance)
    first = ticks.tick()
    assert len(ticks.recorded) == 20
    assert {j for j, _, _ in ticks.recorded} == {
        "catalog_cache_refresh",
        "quote_expiration",
        "read_model_repair",
    }  # not starved by the big one
    assert "44 left for the next runs" in first.run_requests[0].tags[STALE_TAG]
    seen = list(ticks.recorded)
    while ticks.tick().run_requests:
        seen += ticks.recorded
        assert len(ticks.seconds) <= 4
    expected = {("catalog_cache_refresh", f"tenant-{i:05d}", False) for i in range(1, 61)}
    assert len(seen) == len(set(seen)) == 64
    assert set(seen) == expected | {(j, t, False) for j, t in PLANTED}


def test_a_tick_over_a_whole_stale_job_asks_for_the_bound_only(tenants_db, instance):
    """Every tenant of a job stale (its schedule stopped): the tick stays quick and asks for
    one run of MAX_STALE_EVENTS_PER_TICK evaluations; the cursor stays small."""
    with tenants_db.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM job_run WHERE job_name = 'catalog_cache_refresh'"))
    ticks = Ticks(tenants_db, instance, launch=False)
    first = ticks.tick()
    asked = _requested(first)
    assert sum(map(len, asked.values())) == MAX_STALE_EVENTS_PER_TICK
    assert first.run_requests[0].tags[STALE_TAG].startswith(f"STALE: {9_999 + len(PLANTED)} ")
    assert len(first.cursor) < 2_000  # bits: 2,000 of 10,000 set for one job, compressed
    print(
        f"\nwhole job stale at {TENANTS:,} tenants: tick {ticks.seconds[-1]:.2f} s, cursor "
        f"{len(first.cursor)} bytes"
    )


def _execute_check(tenants_db, instance, job: str, tags: dict[str, str]):
    defs = dg.Definitions(
        assets=build_outcome_assets(SPECS),
        asset_checks=build_recent_success_checks(SPECS),
        resources={"database": QoOpsDatabase(url=tenants_db.env_url)},
    )
    asset_job = defs.resolve_implicit_global_asset_job_def()
    only = asset_job.get_subset(asset_check_selection={_check_key(job)}, asset_selection=set())
    result = only.execute_in_process(instance=instance, tags=tags)
    assert result.success
    return result


def test_the_check_executed_on_its_own_judges_each_tenant_partition(tenants_db, instance):
    _keep_fresh(tenants_db)
    _execute_check(tenants_db, instance, "quote_expiration", {"dagster/partition": "tenant-00042"})
    _execute_check(tenants_db, instance, "quote_expiration", {"dagster/partition": "tenant-00001"})
    assert _statuses(instance) == {
        ("quote_expiration", "tenant-00042"): AssetCheckExecutionRecordStatus.FAILED,
        ("quote_expiration", "tenant-00001"): AssetCheckExecutionRecordStatus.SUCCEEDED,
    }
    # a run over a range of partitions: one evaluation on each, none without a partition
    _execute_check(
        tenants_db,
        instance,
        "read_model_repair",
        {
            "dagster/asset_partition_range_start": "tenant-09998",
            "dagster/asset_partition_range_end": NEW,
        },
    )
    _execute_check(tenants_db, instance, "read_model_repair", {"dagster/partition": "tenant-05000"})
    statuses = {k: v for k, v in _statuses(instance).items() if k[0] == "read_model_repair"}
    assert statuses == {
        ("read_model_repair", "tenant-09998"): AssetCheckExecutionRecordStatus.SUCCEEDED,
        ("read_model_repair", "tenant-09999"): AssetCheckExecutionRecordStatus.FAILED,
        ("read_model_repair", NEW): AssetCheckExecutionRecordStatus.SUCCEEDED,  # too new
        ("read_model_repair", "tenant-05000"): AssetCheckExecutionRecordStatus.FAILED,
    }
    new = _latest(instance, "read_model_repair", NEW)
    assert new.metadata["last_success_age_s"].value == "never"
    assert "not judged yet" in new.description


def test_the_op_evaluation_is_a_warning_on_the_tenant_partition():
    evaluation = recent_success_evaluation(
        CATALOG["delivery_retry"], "tenant-00007", True, {"last_success_age_s": 0}
    )
    assert evaluation.partition == "tenant-00007"
    assert evaluation.asset_check_key == _check_key("delivery_retry")
    assert evaluation.severity == dg.AssetCheckSeverity.WARN
    assert evaluation.metadata["limit_s"].value == 900


def test_dagster_records_a_runless_evaluation_of_a_partition_only_once(instance):
    """Why the sensor has a run record its marks: Dagster 1.13 keys a run-less evaluation
    by (asset, check, run id '', partition), so the second one on a partition is refused.
    When this starts passing through, the sensor could yield SensorResult(asset_events=…)."""
    stale = recent_success_evaluation(CATALOG["delivery_retry"], "tenant-00007", False)
    instance.report_runless_asset_event(stale)
    with pytest.raises(sa.exc.IntegrityError):
        instance.report_runless_asset_event(
            recent_success_evaluation(CATALOG["delivery_retry"], "tenant-00007", True)
        )


def test_a_job_not_at_work_for_its_limit_judges_nobody_stale(tenants_db, instance):
    """A fresh deployment: a job whose first run or tick is newer than its limit (here:
    catalog_cache_refresh, which has never run and whose schedule first ticked a minute ago)
    has no stale tenant, while the jobs at work for 30 days keep their planted ones."""
    with tenants_db.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM job_run WHERE job_name = 'catalog_cache_refresh'"))
        conn.execute(
            sa.text(
                "UPDATE job_schedule_tick SET scheduled_for = now() - interval '1 minute' "
                "WHERE job_name = 'catalog_cache_refresh'"
            )
        )
    ticks = Ticks(tenants_db, instance, launch=False)
    asked = _requested(ticks.tick())
    assert "catalog_cache_refresh" not in asked
    assert {(j, t) for j, ts in asked.items() for t in ts} == PLANTED
    with tenants_db.engine.connect() as conn:
        [judged] = judge(conn, CATALOG["catalog_cache_refresh"], ["tenant-00001"])
    assert judged.new and not judged.stale and judged.age_s is None
    assert "not judged yet" in judged.describe()


def test_execute_all_on_the_assets_checks_judges_every_tenant(db):
    """The UI's Catalog → asset → Checks → "Execute all" launches the check with no
    partition: it judges every tenant, one evaluation on each partition, and never fails
    (it crashed on "Cannot access partition_key for a non-partitioned run")."""
    tenants = ["tenant-a", "tenant-b", "tenant-c"]
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO tenant (id, name, created_at) "
                "SELECT t, t, now() - interval '30 days' FROM unnest(CAST(:t AS text[])) t"
            ),
            {"t": tenants},
        )
        _run(conn, "quote_expiration", "tenant-a", "success", "1 minute")
        _run(conn, "quote_expiration", "tenant-c", "success", "3 hours")  # stale
    with dg.instance_for_test() as inst:
        inst.add_dynamic_partitions("tenants", tenants)
        _execute_check(db, inst, "quote_expiration", {})  # no partition: Execute all
        assert {k: v for k, v in _statuses(inst).items() if k[0] == "quote_expiration"} == {
            ("quote_expiration", "tenant-a"): AssetCheckExecutionRecordStatus.SUCCEEDED,
            ("quote_expiration", "tenant-b"): AssetCheckExecutionRecordStatus.FAILED,  # never
            ("quote_expiration", "tenant-c"): AssetCheckExecutionRecordStatus.FAILED,
            # the run's own record: not left planned, it says how many were stale
            ("quote_expiration", None): AssetCheckExecutionRecordStatus.FAILED,
        }
