"""The storage dagster.yaml names (qo_ops/dagster_defs/storage.py): every process that loads
the instance gets the pooled event log, from the file (webserver, daemon, code server) and
from a run's InstanceRef (what ``dagster api execute_run`` rebuilds in a run worker); many
writes share one connection; a connection the server dropped is replaced before use."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import dagster as dg
import sqlalchemy as sa
from sqlalchemy import event

from qo_ops.dagster_defs.storage import (
    POOL_SIZE,
    PooledPostgresEventLogStorage,
    QoOpsPostgresStorage,
)
from qo_ops.db.engine import ensure_database
from qo_ops_tests.conftest import REPO

ASSET = dg.AssetKey(["qo_ops", "storage_probe"])


def _connects(storage: PooledPostgresEventLogStorage) -> list[object]:
    """Every new connection the storage's engine opens, from now on."""
    opened: list[object] = []
    event.listen(storage._engine, "connect", lambda conn, _record: opened.append(conn))
    return opened


def _materialize(instance: dg.DagsterInstance, n: int) -> None:
    for i in range(n):
        instance.report_runless_asset_event(dg.AssetMaterialization(ASSET, metadata={"i": i}))


def test_the_instance_and_a_run_workers_instance_share_connections_across_writes(
    db, tmp_path, monkeypatch
):
    storage_url = db.target.dagster_storage_url()
    storage_db = sa.engine.make_url(storage_url).database
    ensure_database(db.url, storage_db)
    shutil.copy(REPO / "dagster.yaml", tmp_path / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    monkeypatch.setenv("QO_OPS_DAGSTER_STORAGE_URL", storage_url)

    with dg.DagsterInstance.get() as instance:
        assert isinstance(instance.get_ref().storage, QoOpsPostgresStorage)
        assert isinstance(instance.event_log_storage, PooledPostgresEventLogStorage)
        # a run worker's instance: rebuilt from the InstanceRef the launcher hands it
        with dg.DagsterInstance.from_ref(instance.get_ref()) as worker:
            storage = worker.event_log_storage
            assert isinstance(storage, PooledPostgresEventLogStorage)
            opened = _connects(storage)
            _materialize(worker, 20)  # dagster-postgres alone: 2 new connections each
            assert 1 <= len(opened) <= POOL_SIZE  # a write and its index transaction
            kept = len(opened)

            # the server drops every connection (as a restart does): the next write
            # notices before using one (pre-ping), reconnects, and is stored
            with db.engine.connect() as conn:
                dropped = conn.execute(
                    sa.text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = :db AND pid <> pg_backend_pid()"
                    ),
                    {"db": storage_db},
                ).scalar_one()
            assert dropped >= 1
            _materialize(worker, 1)
            assert len(opened) > kept

            # Dagster asks whether the checks table exists before storing each evaluation:
            # PostgreSQL's catalog is read once, not once per evaluation
            catalog: list[str] = []
            event.listen(
                storage._engine,
                "before_cursor_execute",
                lambda _c, _cur, sql, *_: catalog.append(sql) if "pg_catalog" in sql else None,
            )
            for i in range(5):
                worker.report_runless_asset_event(
                    dg.AssetCheckEvaluation(asset_key=ASSET, check_name=f"probe_{i}", passed=True)
                )
            assert len(catalog) <= 1
            evaluations = storage.get_asset_check_execution_history(
                dg.AssetCheckKey(ASSET, "probe_4"), limit=5
            )
            assert len(evaluations) == 1

        # what the run worker wrote is what the instance (the webserver's) reads
        records = instance.fetch_materializations(ASSET, limit=100).records
        assert len(records) == 21
        assert records[0].asset_materialization.metadata["i"].value == 0


def test_an_event_is_stored_with_its_index_rows_and_no_notify(db, tmp_path, monkeypatch):
    """Each event is one INSERT into event_logs, without dagster-postgres's NOTIFY after it
    (nothing LISTENs); an asset event still gets its asset_keys row and tags, a check
    evaluation its asset_check_executions row, a run's events their run's log."""
    storage_url = db.target.dagster_storage_url()
    ensure_database(db.url, sa.engine.make_url(storage_url).database)
    shutil.copy(REPO / "dagster.yaml", tmp_path / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    monkeypatch.setenv("QO_OPS_DAGSTER_STORAGE_URL", storage_url)

    @dg.asset(key=ASSET, check_specs=[dg.AssetCheckSpec("probe", asset=ASSET)])
    def probe() -> Iterator[object]:
        yield dg.Output(1, metadata={"tenant": "tenant-001"})
        yield dg.AssetCheckResult(passed=True)

    with dg.DagsterInstance.get() as instance:
        storage = instance.event_log_storage
        assert isinstance(storage, PooledPostgresEventLogStorage)
        statements: list[str] = []
        event.listen(
            storage._engine,
            "before_cursor_execute",
            lambda _c, _cur, sql, *_: statements.append(sql),
        )
        result = dg.materialize([probe], instance=instance)
        assert result.success
        assert not [s for s in statements if "NOTIFY" in s.upper()]
        assert sum("INSERT INTO event_logs" in s for s in statements) == len(
            instance.all_logs(result.run_id)
        )
        (record,) = instance.fetch_materializations(ASSET, limit=5).records
        assert record.run_id == result.run_id
        assert instance.get_latest_materialization_event(ASSET).run_id == result.run_id
        (check,) = storage.get_asset_check_execution_history(
            dg.AssetCheckKey(ASSET, "probe"), limit=5
        )
        assert check.run_id == result.run_id and check.status.value == "SUCCEEDED"
