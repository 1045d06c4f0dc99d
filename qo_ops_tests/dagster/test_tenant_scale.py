"""Issue 19 at tenant scale, on a real PostgreSQL and a real Dagster instance: partition
counts at 10,000 tenants × 3 years, schedule and backlog-sensor ticks over 10,000 tenants
(chunked, deterministic, suspended tenants left out), and a chunk run whose planted failing
tenants neither stop the others nor hide: named on the run, kept off their partitions,
re-executed alone through Dagster's own re-execution."""

from __future__ import annotations

import json
import math
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import pytest
import sqlalchemy as sa
from dagster._core.definitions.partitions.context import partition_loading_context
from dagster._core.event_api import PartitionKeyFilter
from dagster._core.execution.plan.resume_retry import ReexecutionStrategy
from dagster._core.storage.asset_check_execution_record import AssetCheckExecutionRecordStatus
from dagster._core.test_utils import in_process_test_workspace
from dagster._core.types.loadable_target_origin import LoadableTargetOrigin

from qo_ops.dagster_defs.partitions import days_partitions_def, tenants_partitions_def
from qo_ops.dagster_defs.sensors import BACKLOG_COOLDOWN_S, MAX_TENANTS_PER_TICK
from qo_ops.dagster_defs.submission import refusal_at_submission
from qo_ops.demo.data import load_demo_data
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.schedule.missed import expected_scope
from qo_ops.platform.schedule.partition_keys import (
    FAILED_TENANTS_TAG,
    SCOPE_TAG,
    TENANTS_TAG,
    chunk_keys,
)
from qo_ops_tests.dagster import scale_fixtures as sf
from qo_ops_tests.dagster.conftest import SYNC_LAUNCH

MAX_PARTITIONS = 100_000  # Dagster's advice per PartitionsDefinition (docs; PR #28697)
AS_OF = datetime(2026, 3, 1, tzinfo=UTC)
DEMO_TENANTS = [f"tenant-{n:03d}" for n in range(1, 6)]
REPO = Path(__file__).resolve().parents[2]


def _report(capsys: pytest.CaptureFixture[str], line: str) -> None:
    with capsys.disabled():
        print(f"\n[tenant scale] {line}")


@pytest.fixture
def env(db, monkeypatch, tmp_path):
    monkeypatch.setenv("QO_OPS_DATABASE_URL", db.env_url)
    monkeypatch.setenv("QO_OPS_HOME", str(tmp_path))
    monkeypatch.setenv("QO_OPS_AUDIT_RETENTION_DAYS", "90")  # the day it ages out is in 2026
    monkeypatch.setenv("QO_OPS_TEMP_FILE_RETENTION_DAYS", "7")
    return db


@pytest.fixture
def defs(env):
    from qo_ops.definitions import build_definitions

    return build_definitions()


@pytest.fixture
def scale(env):
    """10,000 tenants in the tenant table and in the `tenants` dynamic partitions (and their
    100 chunks in `tenant_chunks`)."""
    tenants = sf.insert_tenants(env.engine, sf.SCALE_TENANTS)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("tenants", tenants)
        instance.add_dynamic_partitions("tenant_chunks", chunk_keys(sf.SCALE_TENANTS))
        yield instance, tenants


# ------------------------------------------------------------------------ partition counts


def _partitions_defs(defs: dg.Definitions) -> dict[str, dg.PartitionsDefinition]:
    """Every PartitionsDefinition the code location uses: jobs, assets, asset checks."""
    found: dict[str, dg.PartitionsDefinition] = {}
    for job in defs.resolve_all_job_defs():
        if job.partitions_def is not None:
            found[f"job {job.name}"] = job.partitions_def
    graph = defs.resolve_asset_graph()
    for key in graph.get_all_asset_keys():
        if graph.get(key).partitions_def is not None:
            found[f"asset {key.to_user_string()}"] = graph.get(key).partitions_def
    for check_key in graph.asset_check_keys:
        if graph.get(check_key).partitions_def is not None:
            found[f"check {check_key.to_user_string()}"] = graph.get(check_key).partitions_def
    return found


def test_every_partitions_definition_stays_under_100k_at_10k_tenants_and_3_years(
    defs, scale, capsys
):
    """Every definition but the windowed jobs' day × tenant chunk stays under 100,000 keys
    over 3 years; that one grows by 100 keys a day at 10,000 tenants (36,500 a year) and
    reaches 100,000 after 1,000 days (docs/dagster.md: move QO_OPS_PARTITION_START)."""
    instance, _ = scale
    three_years = days_partitions_def.start + timedelta(days=3 * 365 + 1)
    used = _partitions_defs(defs)
    # every catalog job, every outcome asset and every declared check is partitioned
    assert {n for n in used if n.startswith("job ")} == {f"job {n}" for n in CATALOG}
    assert sum(n.startswith("check ") for n in used) >= sum(len(s.checks) for s in CATALOG.values())
    windowed = {f"job {n}" for n, s in CATALOG.items() if s.partitioning == "tenant_day"}
    counts = {}
    with partition_loading_context(effective_dt=three_years, dynamic_partitions_store=instance):
        for name, partitions_def in used.items():
            counts[name] = partitions_def.get_num_partitions()
            # the count is what listing them gives (no definition is lazily infinite)
            keys = partitions_def.get_partition_keys(
                current_time=three_years, dynamic_partitions_store=instance
            )
            assert len(keys) == counts[name], name
        assert tenants_partitions_def.get_num_partitions() == sf.SCALE_TENANTS
        days = days_partitions_def.get_num_partitions()
        # one key per day that has ended: the start day through the day before the clock
        assert days == (three_years - days_partitions_def.start).days == 3 * 365 + 1
        # the old tenant × day product, counted the same way: far past the limit
        old = dg.MultiPartitionsDefinition(
            {"day": days_partitions_def, "tenant": tenants_partitions_def}
        )
        old_count = old.get_num_partitions()
    chunks = sf.SCALE_TENANTS // CATALOG["order_reconciliation"].deployment.tenants_per_run
    assert windowed and all(counts[n] == days * chunks for n in windowed)
    assert MAX_PARTITIONS // chunks == 1000  # days before a windowed job reaches the limit
    others = {n: c for n, c in counts.items() if n not in windowed}
    assert max(others.values()) <= MAX_PARTITIONS, others
    assert old_count == sf.SCALE_TENANTS * days > MAX_PARTITIONS
    _report(
        capsys,
        f"{len(used)} partitions definitions at {sf.SCALE_TENANTS} tenants × 3 years: largest "
        f"{max(others.values())} keys but the windowed jobs' day × chunk ({days} × {chunks} = "
        f"{days * chunks}); the old tenant × day product: {old_count}",
    )


# ------------------------------------------------------------------------- schedule ticks


def _assert_chunked(requests, job_name: str, expected: list[str]) -> None:
    """Exactly ceil(n / tenants_per_run) runs, every tenant in exactly one, chunks sorted
    and no larger than tenants_per_run, queue tags naming the chunk."""
    size = CATALOG[job_name].deployment.tenants_per_run
    chunks = [sf.chunk_tenants_of(r, job_name) for r in requests]
    assert len(requests) == math.ceil(len(expected) / size)
    assert all(0 < len(c) <= size and c == sorted(c) for c in chunks)
    covered = [t for c in chunks for t in c]
    assert len(covered) == len(set(covered))  # nobody twice
    assert sorted(covered) == sorted(expected)  # everybody else once
    assert len({r.run_key for r in requests}) == len(requests)
    for request, chunk in zip(requests, chunks, strict=True):
        assert request.run_config["ops"][f"{job_name}_op"]["config"]["mode"] == "execute"
        assert request.tags[SCOPE_TAG].endswith(f"chunk:{chunk[0]}")
        assert request.tags[TENANTS_TAG] == f"{len(chunk)}: {chunk[0]}..{chunk[-1]}"


@pytest.mark.parametrize(
    ("job_name", "windowed"), [("quote_expiration", False), ("order_reconciliation", True)]
)
def test_a_schedule_tick_over_10k_tenants_requests_one_run_per_chunk(
    defs, env, scale, capsys, job_name, windowed
):
    instance, tenants = scale
    spec = CATALOG[job_name]
    assert spec.partitioning == ("tenant_day" if windowed else "tenant")
    when = datetime(2026, 11, 29, 12, 15, tzinfo=UTC)
    suspended = [sf.tenant_id(17), sf.tenant_id(5000), sf.tenant_id(9999)]
    for tenant in suspended:
        sf.suspend(env.engine, job_name, tenant)
    busy = sf.tenant_id(4242)  # a run of the same scope still holds its lease
    sf.hold_lease(env.engine, job_name, expected_scope(spec, busy, when))
    expected = [t for t in tenants if t not in {*suspended, busy}]
    name = f"{job_name}_schedule"

    started = time.perf_counter()
    result = sf.schedule_tick(defs, instance, env.env_url, name, when)
    first_s = time.perf_counter() - started
    requests = list(result.run_requests or [])
    _assert_chunked(requests, job_name, expected)
    assert len(requests) == math.ceil(sf.SCALE_TENANTS / spec.deployment.tenants_per_run)
    day = (when - timedelta(days=1)).date().isoformat()
    keys = {f"{day}|{c}" for c in chunk_keys(sf.SCALE_TENANTS)} if windowed else {None}
    assert {r.partition_key for r in requests} == keys  # windowed: one run per day × chunk
    # a windowed chunk keeps its own queue tag: the partition's tag (<job>:<day>|<chunk>) is
    # not laid over it
    assert {r.tags.get("dagster/partition") for r in requests} == keys
    assert all(r.run_key.endswith(when.isoformat()) for r in requests)

    started = time.perf_counter()
    again = list(sf.schedule_tick(defs, instance, env.env_url, name, when).run_requests or [])
    second_s = time.perf_counter() - started
    assert [r.run_key for r in again] == [r.run_key for r in requests]  # deterministic
    assert [sf.chunk_tenants_of(r, job_name) for r in again] == [
        sf.chunk_tenants_of(r, job_name) for r in requests
    ]
    _report(
        capsys,
        f"{name} at {sf.SCALE_TENANTS} tenants: {len(requests)} run requests, "
        f"evaluated in {first_s:.2f} s (again: {second_s:.2f} s)",
    )


# -------------------------------------------------------------------- backlog sensor ticks


def test_the_backlog_sensor_over_10k_tenants_launches_chunks_once_per_cooldown(
    defs, env, scale, capsys
):
    instance, tenants = scale
    job_name = "quote_expiration"
    spec = CATALOG[job_name]
    threshold = spec.deployment.backlog_threshold
    assert threshold is not None
    # 160 tenants of the first tick's window past the threshold (more than one chunk), 5 far
    # apart, one just below it; one past it is suspended
    planted = [sf.tenant_id(n) for n in range(1, 161)] + [
        sf.tenant_id(n) for n in (1234, 3333, 5555, 7777, 9998)
    ]
    sf.plant_expired_quotes(env.engine, planted, threshold)
    sf.plant_expired_quotes(env.engine, [sf.tenant_id(6000)], threshold - 1)
    suspended = sf.tenant_id(30)
    sf.suspend(env.engine, job_name, suspended)
    due = sorted(set(planted) - {suspended})
    name = f"{job_name}_backlog_sensor"
    ticks_per_rotation = math.ceil(len(tenants) / MAX_TENANTS_PER_TICK)

    cursor = None
    launches: list[tuple[str, int]] = []  # (tenant, cooldown bucket) of every run requested
    per_rotation: list[list[str]] = []
    first_tick_chunks: list[int] = []
    slowest = total = 0.0
    for rotation in range(2):
        launched: list[str] = []
        for tick in range(ticks_per_rotation):
            started = time.perf_counter()
            result = sf.sensor_tick(defs, instance, env.env_url, name, cursor)
            took = time.perf_counter() - started
            slowest, total = max(slowest, took), total + took
            cursor = result.cursor
            bucket = int(json.loads(cursor)["bucket"])
            requests = list(result.run_requests or [])
            chunks = [sf.chunk_tenants_of(r, job_name) for r in requests]
            _assert_chunked(requests, job_name, [t for c in chunks for t in c])
            if rotation == 0 and tick == 0:
                first_tick_chunks = sorted(len(c) for c in chunks)
            for request, chunk in zip(requests, chunks, strict=True):
                assert request.run_key.endswith(f":{bucket}") and request.partition_key is None
                launched += chunk
                launches += [(t, bucket) for t in chunk]
        per_rotation.append(launched)
    # the first window's 159 due tenants: one run of 100 and one of 59, not 159 runs
    assert spec.deployment.tenants_per_run == 100
    assert first_tick_chunks == [59, 100]
    # one rotation visits every tenant once: every tenant past the threshold, exactly once
    assert sorted(per_rotation[0]) == due
    # never twice in one cooldown bucket (a second rotation in the same bucket: nothing)
    assert len(launches) == len(set(launches))
    assert set(per_rotation[1]) <= set(due)
    if len({b for _, b in launches}) == 1:
        assert per_rotation[1] == []
    _report(
        capsys,
        f"{name} at {sf.SCALE_TENANTS} tenants ({MAX_TENANTS_PER_TICK} per tick, cooldown "
        f"{BACKLOG_COOLDOWN_S} s): {2 * ticks_per_rotation} ticks, slowest {slowest:.2f} s, "
        f"mean {total / (2 * ticks_per_rotation):.3f} s, {len(per_rotation[0])} tenants launched",
    )


def test_every_tick_of_the_code_location_at_10k_tenants(defs, env, scale, capsys):
    """Every schedule and sensor of the code location, evaluated once over 10,000 tenants:
    each schedule requests one run per chunk; the times are printed (the issue's goal is
    < 10 s each)."""
    instance, tenants = scale
    when = datetime(2026, 11, 29, 3, 15, tzinfo=UTC)
    times: dict[str, float] = {}
    for schedule in defs.get_repository_def().schedule_defs:
        job_name = schedule.job_name
        started = time.perf_counter()
        result = sf.schedule_tick(defs, instance, env.env_url, schedule.name, when)
        times[schedule.name] = time.perf_counter() - started
        requests = list(result.run_requests or [])
        assert not result.skip_message, (schedule.name, result.skip_message)
        _assert_chunked(requests, job_name, tenants)
    assert set(times) == {f"{n}_schedule" for n in CATALOG}
    sensors = [s for s in defs.get_repository_def().sensor_defs if s.name != "run_failure_recorder"]
    for sensor in sensors:
        started = time.perf_counter()
        result = sf.sensor_tick(defs, instance, env.env_url, sensor.name, None)
        times[sensor.name] = time.perf_counter() - started
        if sensor.name == "tenants_sensor":  # the partitions are the tenant table already
            assert "10000 tenant partitions and 100 tenant chunks, all in sync" in (
                result.skip_message or ""
            )
    with dg.instance_for_test() as fresh:  # a new deployment: 10,000 partitions to add
        started = time.perf_counter()
        result = sf.sensor_tick(defs, fresh, env.env_url, "tenants_sensor", None)
        times["tenants_sensor (first sync)"] = time.perf_counter() - started
        (request, chunks) = result.dynamic_partitions_requests
        assert sorted(request.partition_keys) == tenants
        assert sorted(chunks.partition_keys) == chunk_keys(sf.SCALE_TENANTS)
    _report(
        capsys,
        f"every tick at {sf.SCALE_TENANTS} tenants (seconds): "
        + ", ".join(f"{name} {took:.2f}" for name, took in sorted(times.items())),
    )


# --------------------------------------------------------- failure isolation inside a chunk


@pytest.fixture
def demo(env):
    """Five demo tenants; an instance whose `tenants` partitions match them."""
    load_demo_data(env.engine, tenants=5, quotes=200, seed=9, as_of=AS_OF)
    with dg.instance_for_test(overrides=SYNC_LAUNCH) as instance:
        instance.add_dynamic_partitions("tenants", DEMO_TENANTS)
        yield instance


def _chunk_run(defs, instance, tenants=DEMO_TENANTS):
    job = defs.resolve_job_def("quote_expiration")
    return job.execute_in_process(
        instance=instance,
        run_config={
            "ops": {
                "quote_expiration_op": {
                    "config": {"mode": "execute", "reason": "INC-19", "tenants": list(tenants)}
                }
            }
        },
        raise_on_error=False,
    )


def _planted_chunk(env, defs, instance):
    """A chunk of 5 with tenant-002's expiry failing in PostgreSQL, tenant-004 suspended
    (refused), and tenant-005's lease held by another run (skipped, not a failure)."""
    sf.plant_failing_expiry(env.engine, "tenant-002")
    sf.suspend(env.engine, "quote_expiration", "tenant-004")
    sf.hold_lease(env.engine, "quote_expiration", "tenant-005")
    before = {t: sf.overdue(env.engine, t) for t in DEMO_TENANTS}
    assert all(before.values())  # every tenant has work
    return _chunk_run(defs, instance), before


def test_a_failing_tenant_fails_only_itself_and_the_run_names_it(env, defs, demo):
    instance = demo
    result, before = _planted_chunk(env, defs, instance)
    assert not result.success
    assert instance.get_run_by_id(result.run_id).status == dg.DagsterRunStatus.FAILURE

    rows = {r.scope: r for r in sf.job_runs(env.engine, "quote_expiration")}
    # the others ran and changed state (tenant-003 after the failure)
    for tenant in ("tenant-001", "tenant-003"):
        assert rows[tenant].status == "success" and rows[tenant].succeeded_count > 0
        assert rows[tenant].dagster_run_id == result.run_id
        assert sf.overdue(env.engine, tenant) == 0
    # the failing one failed on its own, changed nothing
    assert rows["tenant-002"].status == "failed"
    assert rows["tenant-002"].succeeded_count == 0
    assert rows["tenant-002"].last_error_code == "database_error"
    assert sf.overdue(env.engine, "tenant-002") == before["tenant-002"]
    # the suspended one was refused before any record; the refusal is audited
    assert "tenant-004" not in rows
    assert sf.overdue(env.engine, "tenant-004") == before["tenant-004"]
    with env.engine.connect() as conn:
        denied = conn.execute(
            sa.text(
                "SELECT details FROM job_audit WHERE action = 'trigger' AND decision = 'denied' "
                "AND scope = 'tenant-004'"
            )
        ).scalar_one()
    assert denied["refused"] == "suspended"
    # the busy one was skipped: another run does its work; not a failure
    assert (rows["tenant-005"].status, rows["tenant-005"].status_reason) == (
        "skipped",
        "lease-not-acquired",
    )
    assert sf.overdue(env.engine, "tenant-005") == before["tenant-005"]

    failure = sf.step_failure(instance, result.run_id)
    named = failure.description.split("outcome: ")[1].split(". ")[0].split(", ")
    assert named == ["tenant-002", "tenant-004"], failure.description
    assert failure.description.startswith("quote_expiration: 2 of 5 tenants failed")
    meta = failure.metadata
    assert meta["failed_tenants"].value == "tenant-002, tenant-004"
    assert (meta["tenants"].value, meta["tenants_failed"].value) == (5, 2)
    assert meta["status_success"].value == 2 and meta["status_skipped"].value == 1
    table = {r.data["tenant"]: r.data["status"] for r in meta["tenant_runs"].value.records}
    assert table == {
        "tenant-001": "success",
        "tenant-002": "failed",
        "tenant-003": "success",
        "tenant-004": "refused",
        "tenant-005": "skipped",
    }
    tags = instance.get_run_by_id(result.run_id).tags
    assert tags[FAILED_TENANTS_TAG] == "tenant-002,tenant-004"


# ------------------------------------------------- per-tenant asset partitions and checks


def _check_records(instance, spec, tenant):
    """{check name: [execution records]} of the tenant's partition of the outcome asset."""
    asset = dg.AssetKey(["qo_ops", spec.presentation.outcome_asset])
    return {
        c.name: instance.event_log_storage.get_asset_check_execution_history(
            dg.AssetCheckKey(asset, c.name),
            limit=10,
            partition_filter=PartitionKeyFilter(key=tenant),
        )
        for c in spec.checks
    }


def test_each_tenant_outcome_and_check_lands_on_its_own_partition(env, defs, demo):
    instance = demo
    spec = CATALOG["quote_expiration"]
    asset = dg.AssetKey(["qo_ops", "quotes"])
    sf.plant_failing_expiry(env.engine, "tenant-002")  # its run fails
    sf.plant_missing_event(env.engine, "tenant-004")  # its outcome check fails
    result = _chunk_run(defs, instance)
    assert not result.success
    rows = {r.scope: r for r in sf.job_runs(env.engine, "quote_expiration")}
    assert {t: r.status for t, r in rows.items()} == {
        "tenant-001": "success",
        "tenant-002": "failed",
        "tenant-003": "success",
        "tenant-004": "success",  # the work is done; its outcome is not right
        "tenant-005": "success",
    }
    # a materialization on each succeeded tenant's partition, none on the failed one
    assert set(instance.get_materialized_partitions(asset)) == {
        "tenant-001",
        "tenant-003",
        "tenant-004",
        "tenant-005",
    }
    for tenant in DEMO_TENANTS:
        materialized = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=asset, asset_partitions=[tenant]), limit=10
        ).records
        observed = instance.fetch_observations(
            dg.AssetRecordsFilter(asset_key=asset, asset_partitions=[tenant]), limit=10
        ).records
        if tenant == "tenant-002":  # the failed run is on record, as an observation
            assert materialized == [] and len(observed) == 1
            event = observed[0].asset_observation
        else:
            assert len(materialized) == 1 and observed == []
            event = materialized[0].asset_materialization
        assert event.partition == tenant
        assert event.metadata["job_run_id"].value == str(rows[tenant].id)
        assert event.metadata["status"].value == rows[tenant].status

    # one evaluation per check on each tenant's partition; failing exactly where planted:
    # tenant-004's missing event, and tenant-002's quotes its failed run could not expire
    verdicts = {}
    for tenant in DEMO_TENANTS:
        for check_name, records in _check_records(instance, spec, tenant).items():
            assert len(records) == 1, (tenant, check_name, records)
            record = records[0]
            assert record.partition == tenant and record.run_id == result.run_id
            verdicts[(tenant, check_name)] = record.status
    failed = {k for k, v in verdicts.items() if v == AssetCheckExecutionRecordStatus.FAILED}
    assert failed == {
        ("tenant-002", "no_overdue_active_quotes"),
        ("tenant-004", "one_event_per_expired_quote"),
    }
    assert all(
        v == AssetCheckExecutionRecordStatus.SUCCEEDED
        for k, v in verdicts.items()
        if k not in failed
    )
    # the run names both: one failed, one missed its outcome
    meta = sf.step_failure(instance, result.run_id).metadata
    assert (meta["tenants_failed"].value, meta["tenants_outcome_not_met"].value) == (1, 1)
    assert instance.get_run_by_id(result.run_id).tags[FAILED_TENANTS_TAG] == (
        "tenant-002,tenant-004"
    )


# ------------------------------------------------------------ re-running the failed tenants


def test_re_executing_the_failed_chunk_runs_only_its_failed_tenants(env, defs, demo):
    instance = demo
    parent, _ = _planted_chunk(env, defs, instance)
    assert not parent.success
    before = {r.id for r in sf.job_runs(env.engine, "quote_expiration")}
    sf.resume(env.engine, "quote_expiration", "tenant-004")  # the failures are fixed
    sf.unplant_failing_expiry(env.engine)

    # Dagster's own re-execution, as the UI's "Re-execute from failure" asks the webserver:
    # the parent's config and tags (use_parent_run_tags), submitted to the instance, run by
    # its run launcher from the code location Dagster loads (here: in this process)
    origin = LoadableTargetOrigin(
        module_name=sf.__name__, attribute="scale_defs", working_directory=str(REPO)
    )
    with in_process_test_workspace(instance, origin) as workspace:
        (location_name,) = workspace.code_location_names
        location = workspace.get_code_location(location_name)
        (repository,) = location.get_repositories().values()
        child = instance.create_reexecuted_run(
            request_context=workspace,
            parent_run=instance.get_run_by_id(parent.run_id),
            code_location=location,
            remote_job=repository.get_full_job("quote_expiration"),
            strategy=ReexecutionStrategy.FROM_FAILURE,
            use_parent_run_tags=True,
        )
        # qo-ops's coordinator (dagster.yaml) would queue it: nothing to refuse
        assert refusal_at_submission(child) is None
        instance.submit_run(child.run_id, workspace)
    child = instance.get_run_by_id(child.run_id)
    assert child.status == dg.DagsterRunStatus.SUCCESS, instance.all_logs(child.run_id)
    assert child.tags["dagster/parent_run_id"] == parent.run_id

    new = [r for r in sf.job_runs(env.engine, "quote_expiration") if r.id not in before]
    # exactly one new job run per failed tenant, each done now; nobody else ran again
    assert sorted((r.scope, r.status, r.dagster_run_id) for r in new) == [
        ("tenant-002", "success", child.run_id),
        ("tenant-004", "success", child.run_id),
    ]
    assert sf.overdue(env.engine, "tenant-002") == sf.overdue(env.engine, "tenant-004") == 0
    # the re-execution inherited its parent's failed-tenants tag: cleared, none failed now
    assert child.tags[FAILED_TENANTS_TAG] == ""
