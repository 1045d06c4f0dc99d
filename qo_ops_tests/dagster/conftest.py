"""Dagster fixtures: the real code location built against this test's database, and an
ephemeral instance whose `tenants` and `tenant_chunks` partitions match the tenant table."""

from __future__ import annotations

from datetime import UTC, datetime

import dagster as dg
import pytest

from qo_ops.demo.data import load_demo_data

AS_OF = datetime(2026, 3, 1, tzinfo=UTC)


# An instance that launches a submitted run at once, in this process (the run worker's
# path): a re-execution or a sensor's request submitted to it runs inside the test.
SYNC_LAUNCH = {
    "run_coordinator": {
        "module": "dagster._core.run_coordinator.sync_in_memory_run_coordinator",
        "class": "SyncInMemoryRunCoordinator",
    },
    "run_launcher": {
        "module": "dagster._core.launcher.sync_in_memory_run_launcher",
        "class": "SyncInMemoryRunLauncher",
    },
}


@pytest.fixture
def loaded(db):
    load_demo_data(db.engine, tenants=2, quotes=400, seed=9, as_of=AS_OF)
    return db


@pytest.fixture
def defs(loaded, downstream, monkeypatch, tmp_path):
    monkeypatch.setenv("QO_OPS_DATABASE_URL", loaded.env_url)
    monkeypatch.setenv(
        "QO_OPS_HOME", str(tmp_path)
    )  # archives and objects land in the test's folder
    monkeypatch.setenv("QO_OPS_AUDIT_RETENTION_DAYS", "90")  # so 2026 partitions have audit work
    monkeypatch.setenv(
        "QO_OPS_DOWNSTREAM_URL", downstream.url
    )  # jobs that call the fulfilment system
    from qo_ops.definitions import build_definitions

    built = build_definitions()
    built.loaded_db = loaded  # type: ignore[attr-defined]  # lets helpers find work partitions
    return built


@pytest.fixture
def instance():
    with dg.instance_for_test() as inst:
        inst.add_dynamic_partitions("tenants", ["tenant-001", "tenant-002"])
        inst.add_dynamic_partitions("tenant_chunks", ["chunk-001"])  # windowed: day × chunk
        yield inst
