"""A real Dagster deployment for tests: a code server, dagster-webserver and dagster-daemon
on loopback, over PostgreSQL storage next to the test's database.

    with dagster_stack(db, tmp_path) as (client, instance, port):
        ...  # client: DagsterGraphQLClient; port: the webserver's port on 127.0.0.1

``read_only=True`` starts the webserver with ``--read-only``; ``env`` adds environment
variables to every process. Their output is in ``home/webserver.log``, ``home/daemon.log``
and ``home/code-server.log``.
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
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO

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


def start_code_server(
    home: Path, env: dict[str, str], log: IO[str], timeout: float = 180.0, module: str = LOCATION
) -> tuple[subprocess.Popen[bytes], Path]:
    """One code server of the deployment's own (``dagster api grpc``, as the Helm chart's
    user deployment runs it), answering health checks, and ``home/workspace.yaml`` pointing
    at it (a grpc_server entry). The webserver and daemon share it instead of each spawning
    a code server that shuts itself down when its parent's heartbeats lapse (20 s for the
    daemon's): on a loaded 2-core machine that left the daemon's sensors and scheduler
    without a code server for minutes. ``module`` loads another module under the same
    location name (the soak benchmark's accelerated catalog)."""
    port = free_port()
    proc = subprocess.Popen(
        [str(BIN / "dagster"), "api", "grpc", "-m", module, "--location-name", LOCATION]
        + ["-h", "127.0.0.1", "-p", str(port)],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    workspace = home / "workspace.yaml"
    workspace.write_text(
        "load_from:\n  - grpc_server:\n      host: 127.0.0.1\n"
        f"      port: {port}\n      location_name: {LOCATION}\n"
    )
    check = [str(BIN / "dagster"), "api", "grpc-health-check", "-p", str(port)]
    end = time.monotonic() + timeout
    while subprocess.run(check, capture_output=True, env=env).returncode != 0:
        if proc.poll() is not None or time.monotonic() > end:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"the code server did not start (log: {log.name})")
        time.sleep(0.5)
    return proc, workspace


@contextmanager
def dagster_stack(
    db,
    home: Path,
    *,
    read_only: bool = False,
    env: dict[str, str] | None = None,
    daemon: bool = True,
) -> Iterator[tuple[DagsterGraphQLClient, dg.DagsterInstance, int]]:
    """Start dagster-webserver and dagster-daemon for this test's database; stop them after.
    Without ``daemon``, a launched run stays queued: Dagster takes it, nothing executes it."""
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
    names = ("webserver.log", "daemon.log", "code-server.log")
    logs = [open(home / name, "w") for name in names]  # noqa: SIM115
    code, workspace = start_code_server(home, proc_env, logs[2])
    procs = [
        code,
        subprocess.Popen(
            [
                str(BIN / "dagster-webserver"),
                "-w",
                str(workspace),
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
    ]
    if daemon:
        procs.append(
            subprocess.Popen(
                [str(BIN / "dagster-daemon"), "run", "-w", str(workspace)],
                cwd=REPO,
                env=proc_env,
                stdout=logs[1],
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
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
                    if daemon and hasattr(instance, "daemon_heartbeats_healthy")
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
