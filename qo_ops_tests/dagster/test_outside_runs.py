"""A tenant fixed from the CLI looks fixed in Dagster: ``outside_runs_sensor`` puts every run
that did not run in Dagster on its tenant's partition of the outcome asset, as the job's op
does for a Dagster run — a materialization for an execute that kept the outcome, an
observation for a dry run — with the run's figures and the tenant's backlog now; each run
once, Dagster's own runs never (their op recorded them). After an execute, the tick asks for
an ``outcome_checks_job`` run that judges the tenant's checks on its partition: a tenant left
behind fails there, a fixed one passes, each judging its latest materialization. Real PostgreSQL, real runs through
the runner, the real sensor and a real Dagster instance."""

from __future__ import annotations

import dagster as dg
from dagster._core.storage.asset_check_execution_record import (
    AssetCheckExecutionRecordStatus,
    AssetCheckPartitionInfo,
)

from qo_ops.dagster_defs.checks import OUTCOME_CHECKS_JOB
from qo_ops.dagster_defs.sensors import OUTSIDE_CHECKS_TAG
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.runner import run_job
from qo_ops_tests.dagster.test_sensors import _database

QE = CATALOG["quote_expiration"]
ASSET = dg.AssetKey(["qo_ops", QE.presentation.outcome_asset])


def _tick(defs, instance, loaded, cursor: str | None) -> dg.SensorResult:
    sensor = defs.resolve_sensor_def("outside_runs_sensor")
    context = dg.build_sensor_context(
        instance=instance, cursor=cursor, resources={"database": _database(loaded)}
    )
    result = sensor(context)
    assert isinstance(result, dg.SensorResult)
    return result


def _cli(loaded, tenant: str, mode: str, **extra):
    """What `qo-ops run` hands the runner: trigger manual, no Dagster run."""
    options = RunOptions(mode=mode, reason="INC-5 from the CLI", progress_interval_s=3600, **extra)
    return run_job(QE, Scope(tenant), options, engine=loaded.engine)


def test_a_tenant_fixed_from_the_cli_is_materialized_on_its_partition(defs, loaded):
    fixed = _cli(loaded, "tenant-002", "execute")
    looked = _cli(loaded, "tenant-001", "dry_run")
    in_dagster = _cli(loaded, "tenant-001", "dry_run", dagster_run_id="d-1")  # its op recorded it
    assert fixed.status == "success" and fixed.counts.succeeded > 0
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("tenants", ["tenant-001", "tenant-002"])
        first = _tick(defs, instance, loaded, None)
        by_run = {e.metadata["job_run_id"].value: e for e in first.asset_events}
        assert set(by_run) == {fixed.job_run_id, looked.job_run_id}  # not in_dagster's
        assert in_dagster.job_run_id not in by_run
        materialized = by_run[fixed.job_run_id]
        assert isinstance(materialized, dg.AssetMaterialization)
        assert (materialized.asset_key, materialized.partition) == (ASSET, "tenant-002")
        assert materialized.metadata["backlog"].value == 0  # fixed: nothing overdue now
        assert materialized.metadata["mutated_count"].value == fixed.counts.succeeded
        assert materialized.metadata["trigger"].value == "manual"
        observed = by_run[looked.job_run_id]
        assert isinstance(observed, dg.AssetObservation)  # a dry run fixes nothing
        assert observed.partition == "tenant-001" and observed.metadata["backlog"].value > 0
        assert observed.metadata["mode"].value == "dry_run"

        # what the daemon does with the tick's events: the Partitions tab's health
        for event in first.asset_events:
            instance.report_runless_asset_event(event)
        assert instance.get_materialized_partitions(ASSET) == {"tenant-002"}

        # the fixed tenant's checks, judged now by the run the tick asks for (not the dry
        # run's tenant: a dry run changed nothing), judging the materialization just recorded
        assert _judge(defs, instance, first) == {"tenant-002"}
        checks = _checks(instance)
        assert set(checks) == {(c.name, "tenant-002") for c in QE.checks}
        for name, info in checks.items():
            assert info.latest_execution_status == AssetCheckExecutionRecordStatus.SUCCEEDED, name
            assert info.is_current, name  # else the UI shows the check Missing there

        again = _tick(defs, instance, loaded, first.cursor)  # each run once
        assert again.asset_events == [] and again.run_requests == []

        # a tenant left behind by a CLI execute: its check fails on its partition
        stuck = _cli(loaded, "tenant-001", "execute", max_items=1)
        third = _tick(defs, instance, loaded, again.cursor)
        assert [e.metadata["job_run_id"].value for e in third.asset_events] == [stuck.job_run_id]
        for event in third.asset_events:
            instance.report_runless_asset_event(event)
        assert _judge(defs, instance, third, succeeds=False) == {"tenant-001"}
        failing = _checks(instance)[("no_overdue_active_quotes", "tenant-001")]
        assert failing.latest_execution_status == AssetCheckExecutionRecordStatus.FAILED
        assert failing.is_current

        later = _cli(loaded, "tenant-001", "execute")  # fixed from the CLI: it passes
        fourth = _tick(defs, instance, loaded, third.cursor)
        assert [e.metadata["job_run_id"].value for e in fourth.asset_events] == [later.job_run_id]
        for event in fourth.asset_events:
            instance.report_runless_asset_event(event)
        assert _judge(defs, instance, fourth) == {"tenant-001"}
        healed = _checks(instance)[("no_overdue_active_quotes", "tenant-001")]
        assert healed.latest_execution_status == AssetCheckExecutionRecordStatus.SUCCEEDED
        assert healed.is_current
        assert instance.get_materialized_partitions(ASSET) == {"tenant-001", "tenant-002"}


def _judge(defs, instance, tick: dg.SensorResult, succeeds: bool = True) -> set[str]:
    """Run what the tick asked for, as the daemon would: one outcome_checks_job run of
    quote_expiration's checks; the tenants it judged. A blocking check failing fails it."""
    (request,) = tick.run_requests
    assert request.tags[OUTSIDE_CHECKS_TAG] == "quote_expiration run outside Dagster"
    result = defs.resolve_job_def(OUTCOME_CHECKS_JOB).execute_in_process(
        instance=instance, run_config=request.run_config, tags=request.tags, raise_on_error=False
    )
    assert result.success is succeeds
    return {e.partition for e in result.get_asset_check_evaluations()}


def _checks(instance) -> dict[tuple[str, str | None], AssetCheckPartitionInfo]:
    """The latest evaluation of each of quote_expiration's checks, by tenant."""
    keys = [dg.AssetCheckKey(ASSET, c.name) for c in QE.checks]
    infos = instance.event_log_storage.get_asset_check_partition_info(keys)
    return {(i.check_key.name, i.partition_key): i for i in infos}
