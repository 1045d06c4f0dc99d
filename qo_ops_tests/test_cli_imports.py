"""The command line answers at once: ``qo-ops --help``, ``qo-ops status`` and a dry run load
no library they do not use. Each case runs the real command in a fresh interpreter, against
a real database, and reads ``sys.modules`` as the process exits (never a timing).

What they must not load: pyarrow (the audit archive's execute run loads it, and never
pandas), pandas, Dagster (the platform never imports it; the CLI only for ``dev`` and
``demo-dagster``), Alembic (only the ``db`` commands migrate; every other command checks the
schema revision without it), pydantic (the API's; Typer from 0.29 on validates every
parameter through it, which is why ``pyproject.toml`` keeps Typer below 0.29) and
OpenTelemetry (unless tracing is configured).
``--help`` loads no database library at all, and a run of one job loads that job's module
and no other job's (the catalog imports a job when its spec is first used).
"""

from __future__ import annotations

import json
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from alembic.script import ScriptDirectory

from qo_ops.db import migrate
from qo_ops.demo.data import load_demo_data
from qo_ops_tests.conftest import base_env, modules_loaded_by

if TYPE_CHECKING:
    from qo_ops_tests.conftest import TestDatabase

NEVER = ("pyarrow", "pandas", "dagster", "alembic", "pydantic", "opentelemetry")
NOT_FOR_HELP = (*NEVER, "sqlalchemy", "psycopg", "httpx")


@pytest.fixture
def demo(db: TestDatabase) -> TestDatabase:
    """One demo tenant, tenant-001; every ACTIVE quote of it is past expiry by now."""
    load_demo_data(db.engine, tenants=1, quotes=200, seed=7, as_of=datetime(2026, 3, 1, tzinfo=UTC))
    return db


def _loaded_by(
    tmp_path: Path, env: dict[str, str], *args: str
) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``qo-ops ARGS`` in a fresh interpreter; its result and the top-level packages it
    had loaded when it exited."""
    proc, modules = modules_loaded_by(tmp_path, env, *args)
    return proc, {name.split(".")[0] for name in modules}


def test_help_loads_no_database_library_nor_any_heavy_one(tmp_path: Path) -> None:
    proc, loaded = _loaded_by(tmp_path, base_env(), "--help")
    assert proc.returncode == 0, proc.stderr
    assert "status" in proc.stdout and "run" in proc.stdout  # the real help, every command
    assert sorted(loaded.intersection(NOT_FOR_HELP)) == []


def test_status_loads_none_of_pyarrow_pandas_dagster_alembic(
    tmp_path: Path, demo: TestDatabase
) -> None:
    proc, loaded = _loaded_by(tmp_path, base_env(QO_OPS_DATABASE_URL=demo.env_url), "status")
    assert proc.returncode == 0, proc.stderr
    assert "quote_expiration" in proc.stdout and "audit_archive" in proc.stdout  # every job
    assert sorted(loaded.intersection(NEVER)) == []


def test_a_dry_run_loads_none_of_pyarrow_pandas_dagster_alembic(
    tmp_path: Path, demo: TestDatabase
) -> None:
    proc, loaded = _loaded_by(
        tmp_path,
        base_env(QO_OPS_DATABASE_URL=demo.env_url),
        *("run", "quote_expiration", "--tenant", "tenant-001", "--mode", "dry-run", "--json"),
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert (summary["status"], summary["mode"]) == ("success", "dry_run")
    assert summary["eligible_count"] > 0  # it counted real work
    assert sorted(loaded.intersection(NEVER)) == []


def test_a_run_of_one_job_loads_no_other_jobs_module(tmp_path: Path, demo: TestDatabase) -> None:
    proc, modules = modules_loaded_by(
        tmp_path,
        base_env(QO_OPS_DATABASE_URL=demo.env_url),
        *("run", "quote_expiration", "--tenant", "tenant-001", "--mode", "dry-run", "--json"),
    )
    assert proc.returncode == 0, proc.stderr
    jobs = {m.split(".")[2] for m in modules if m.startswith("qo_ops.jobs.")}
    assert jobs == {"catalog", "quote_expiration"}


def test_the_schema_check_needs_the_revision_alembic_knows_as_head() -> None:
    """``require_current`` compares with ``HEAD_REVISION`` to spare every command Alembic:
    a new migration must move it."""
    script = ScriptDirectory(str(migrate.MIGRATIONS_DIR))
    assert script.get_current_head() == migrate.HEAD_REVISION, "move migrate.HEAD_REVISION"
