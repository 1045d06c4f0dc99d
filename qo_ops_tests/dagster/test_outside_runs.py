"""A tenant fixed from the CLI looks fixed in Dagster: ``outside_runs_sensor`` puts every run
that did not run in Dagster on its tenant's partition of the outcome asset, as the job's op
does for a Dagster run — a materialization for an execute that kept the outcome, an
observation for a dry run — with the run's figures and the tenant's backlog now; each run
once, Dagster's own runs never (their op recorded them). Real PostgreSQL, real runs through
the runner, the real sensor and a real Dagster instance."""

from __future__ import annotations

import dagster as dg

from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.runner import run_job
from qo_ops.platform.spec import RunOptions, Scope
from qo_ops_tests.dagster.test_sensors import _database

QE = CATALOG["quote_expiration"]
ASSET = dg.AssetKey(["qo_ops", QE.outcome_asset])


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

        again = _tick(defs, instance, loaded, first.cursor)  # each run once
        assert again.asset_events == []
        later = _cli(loaded, "tenant-001", "execute")
        third = _tick(defs, instance, loaded, again.cursor)
        assert [e.metadata["job_run_id"].value for e in third.asset_events] == [later.job_run_id]
        for event in third.asset_events:
            instance.report_runless_asset_event(event)
        assert instance.get_materialized_partitions(ASSET) == {"tenant-001", "tenant-002"}
