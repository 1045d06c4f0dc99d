"""A real Dagster deployment for tests: dagster-webserver and dagster-daemon on loopback,
over PostgreSQL storage next to the test's database.

    with dagster_stack(db, tmp_path) as (client, instance, port):
        ...  # client: DagsterGraphQLClient; port: the webserver's port on 127.0.0.1

``read_only=True`` starts the webserver with ``--read-only``; ``env`` adds environment
variables to both processes. Their output is in ``home/webserver.log`` and ``home/daemon.log``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import httpx
import pytest
import sqlalchemy as sa
from dagster_graphql import DagsterGraphQLClient

from qo_ops.db.engine import ensure_database
from qo_ops_tests.conftest import REPO, base_env

BIN = Path(sys.executable).parent
LOCATION = "qo_ops.definitions"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return
        time.sleep(0.25)
    pytest.fail(f"timed out waiting for {what}")


@contextmanager
def dagster_stack(
    db, home: Path, *, read_only: bool = False, env: dict[str, str] | None = None
) -> Iterator[tuple[DagsterGraphQLClient, dg.DagsterInstance, int]]:
    """Start dagster-webserver and dagster-daemon for this test's database; stop them after."""
    storage = db.target.dagster_storage_url()
    ensure_database(db.url, sa.engine.make_url(storage).database)
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    proc_env = base_env(
        QO_OPS_DATABASE_URL=db.env_url,
        QO_OPS_DAGSTER_STORAGE_URL=storage,
        DAGSTER_HOME=str(home),
    )
    proc_env.update(env or {})
    port = free_port()
    logs = [open(home / name, "w") for name in ("webserver.log", "daemon.log")]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [
                str(BIN / "dagster-webserver"),
                "-w",
                "workspace.yaml",
                "-h",
                "127.0.0.1",
                "-p",
                str(port),
                *(["--read-only"] if read_only else []),
            ],
            cwd=REPO,
            env=proc_env,
            stdout=logs[0],
            stderr=subprocess.STDOUT,
            start_new_session=True,
        ),
        subprocess.Popen(
            [str(BIN / "dagster-daemon"), "run", "-w", "workspace.yaml"],
            cwd=REPO,
            env=proc_env,
            stdout=logs[1],
            stderr=subprocess.STDOUT,
            start_new_session=True,
        ),
    ]
    old_home = os.environ.get("DAGSTER_HOME")
    old_url = os.environ.get("QO_OPS_DAGSTER_STORAGE_URL")
    os.environ["DAGSTER_HOME"], os.environ["QO_OPS_DAGSTER_STORAGE_URL"] = str(home), storage
    try:

        def webserver_up() -> bool:
            try:
                return (
                    httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=2).status_code == 200
                )
            except httpx.HTTPError:
                return False

        wait_for(webserver_up, 120, "the webserver")
        with dg.DagsterInstance.get() as instance:
            wait_for(
                lambda: (
                    instance.daemon_heartbeats_healthy()
                    if hasattr(instance, "daemon_heartbeats_healthy")
                    else True
                ),
                5,
                "daemon heartbeats",
            )
            yield DagsterGraphQLClient("127.0.0.1", port_number=port), instance, port
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        for log in logs:
            log.close()
        for key, value in (("DAGSTER_HOME", old_home), ("QO_OPS_DAGSTER_STORAGE_URL", old_url)):
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
