"""A local Dagster instance for `qo-ops dev` and the demo: DAGSTER_HOME under QO_OPS_HOME,
storage in the same PostgreSQL server as the jobs' database (its own database)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import sqlalchemy as sa

from qo_ops.config import load_settings
from qo_ops.db.engine import DatabaseTarget, ensure_database

REPO = Path(__file__).resolve().parents[2]
STORAGE_ENV = "QO_OPS_DAGSTER_STORAGE_URL"


def prepare_dagster_home(target: DatabaseTarget) -> Path:
    """Create DAGSTER_HOME with the project's dagster.yaml and export its storage URL."""
    home = load_settings().home / "dagster"
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    storage = target.dagster_storage_url()
    ensure_database(target.url, sa.engine.make_url(storage).database or "dagster")
    os.environ["DAGSTER_HOME"] = str(home)
    os.environ[STORAGE_ENV] = storage
    return home
