"""A local Dagster instance for `qo-ops dev` and the demo: DAGSTER_HOME under QO_OPS_HOME,
storage in the same PostgreSQL server as the jobs' database (its own database)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from qo_ops.config import load_settings
from qo_ops.db.engine import DatabaseTarget, ensure_database

REPO = Path(__file__).resolve().parents[2]
STORAGE_ENV = "QO_OPS_DAGSTER_STORAGE_URL"
# workspace.yaml's code location (a python_module location is named after its module) and
# the repository Dagster makes of a Definitions object
LOCAL_LOCATION = "qo_ops.definitions"
REPOSITORY_NAME = "__repository__"
REPOSITORY_LABEL_TAG = ".dagster/repository"  # Dagster's: a run's code location, for the UI


def local_location_tags() -> dict[str, str]:
    """The tag by which the UI counts a run among its job's runs (the job's Runs tab and
    partitions): a run executed in process has no code location, and carries none."""
    return {REPOSITORY_LABEL_TAG: f"{REPOSITORY_NAME}@{LOCAL_LOCATION}"}


def place_in_local_location(instance: Any, run_id: str) -> None:
    """Put a run executed in process (``make demo``) in the local code location, as if the
    webserver had launched it: the Overview timeline and the job's Runs tab then show it
    (they find a run by its code location). Dagster's own way of moving run history between
    code locations (``replace_job_origin``)."""
    from dagster._core.remote_origin import (  # not exported by dagster
        ManagedGrpcPythonEnvCodeLocationOrigin,
        RemoteJobOrigin,
        RemoteRepositoryOrigin,
    )
    from dagster._core.types.loadable_target_origin import LoadableTargetOrigin

    run = instance.get_run_by_id(run_id)
    location = ManagedGrpcPythonEnvCodeLocationOrigin(
        LoadableTargetOrigin(
            executable_path=sys.executable,
            module_name=LOCAL_LOCATION,
            working_directory=str(REPO),
        ),
        LOCAL_LOCATION,
    )
    origin = RemoteJobOrigin(RemoteRepositoryOrigin(location, REPOSITORY_NAME), run.job_name)
    instance.run_storage.replace_job_origin(run, origin)


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
