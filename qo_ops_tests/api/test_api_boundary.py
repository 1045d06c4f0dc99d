"""Import boundaries that hold: the operator API, and every module of the platform, the jobs
and the database layer, load without Dagster. Each check imports in a fresh interpreter, so
what it sees is what those imports pull in, not what this test session loaded earlier."""

from __future__ import annotations

import json
import subprocess
import sys

from qo_ops_tests.conftest import REPO, base_env

_IMPORT_AND_LIST_DAGSTER = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m.startswith("dagster"))))
"""

# Alembic's script: it runs the migrations when imported, so only alembic imports it.
_NOT_IMPORTABLE = {"qo_ops.db.migrations.env"}


def _dagster_modules_after_importing(modules: list[str]) -> list[str]:
    """The ``dagster*`` modules a fresh interpreter holds after importing ``modules``."""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_AND_LIST_DAGSTER, *modules],
        cwd=REPO,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return list(json.loads(done.stdout.splitlines()[-1]))


def _modules_under(*packages: str) -> list[str]:
    """Every module below ``qo_ops/<package>`` (migrations included), by dotted name."""
    names = []
    for package in packages:
        for path in sorted((REPO / "qo_ops" / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if name not in _NOT_IMPORTABLE:
                names.append(name)
    return names


def test_the_operator_api_loads_without_dagster():
    modules = ["qo_ops.api.app", *_modules_under("api")]
    assert "qo_ops.api.routes.runs" in modules
    assert _dagster_modules_after_importing(modules) == []


def test_the_platform_jobs_and_database_layer_load_without_dagster():
    modules = _modules_under("platform", "jobs", "db")
    assert {
        "qo_ops.platform.schedule.partition_keys",
        "qo_ops.jobs.catalog",
        "qo_ops.db.schema",
    } <= set(modules)
    assert any(m.startswith("qo_ops.db.migrations.versions.") for m in modules)
    assert _dagster_modules_after_importing(modules) == []
