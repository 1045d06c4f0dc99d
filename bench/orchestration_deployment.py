"""The orchestration section's deployment: dagster-webserver and dagster-daemon on loopback
over PostgreSQL storage, with a code server of its own, driven through GraphQL (the soak
starts it too)."""

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
from typing import Any

from sqlalchemy.engine import URL

from bench.common import REPO, admin_engine, env_url
from bench.orchestration_data import JOB
from qo_ops_tests.dagster.stack import start_code_server

LOCATION = "qo_ops.definitions"
REPOSITORY = "__repository__"
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(condition: Callable[[], bool], timeout: float, what: str, poll: float = 0.25) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return
        time.sleep(poll)
    raise TimeoutError(f"timed out waiting for {what}")


def tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class Deployment:
    """A running webserver + daemon: GraphQL on ``port``, the instance, the storage URL."""

    def __init__(self, port: int, instance: Any, storage: str, home: Path) -> None:
        self.port = port
        self.instance = instance
        self.storage = storage
        self.home = home

    def graphql(self, query: str, variables: dict[str, Any]) -> dict[str, Any]:
        import httpx

        r = httpx.post(
            f"http://127.0.0.1:{self.port}/graphql",
            json={"query": query, "variables": variables},
            timeout=120,
        )
        r.raise_for_status()
        body = r.json()
        if body.get("errors"):
            raise RuntimeError(f"GraphQL: {body['errors']}")
        return dict(body["data"])

    def launch(self, config: dict[str, Any], tags: dict[str, str]) -> str:
        data = self.graphql(
            LAUNCH_RUN,
            {
                "p": {
                    "selector": {
                        "repositoryLocationName": LOCATION,
                        "repositoryName": REPOSITORY,
                        "jobName": JOB,
                    },
                    "runConfigData": {"ops": {f"{JOB}_op": {"config": config}}},
                    "executionMetadata": {
                        "tags": [{"key": k, "value": v} for k, v in tags.items()]
                    },
                }
            },
        )["launchRun"]
        if data["__typename"] != "LaunchRunSuccess":
            raise RuntimeError(f"launchRun: {data}")
        return str(data["run"]["runId"])

    def set_tenants(self, wanted: list[str]) -> None:
        """The ``tenants`` partitions become exactly ``wanted`` (and ``tenant_chunks`` their
        chunks), as ``tenants_sensor`` keeps them."""
        from qo_ops.platform.schedule.partition_keys import chunk_keys

        for name, keys in (("tenants", wanted), ("tenant_chunks", chunk_keys(len(wanted)))):
            have = set(self.instance.get_dynamic_partitions(name))
            for key in sorted(have - set(keys)):
                self.instance.delete_dynamic_partition(name, key)
            self.instance.add_dynamic_partitions(name, [k for k in keys if k not in have])


LAUNCH_RUN = """
mutation($p: ExecutionParams!) { launchRun(executionParams: $p) { __typename
  ... on LaunchRunSuccess { run { runId } }
  ... on PythonError { message }
  ... on RunConfigValidationInvalid { errors { message } } } }
"""
SENSOR_ID = """
query($s: SensorSelector!) { sensorOrError(sensorSelector: $s) { __typename
  ... on Sensor { id } } }
"""
STOP_SENSOR = """
mutation($id: String) { stopSensor(id: $id) { __typename
  ... on StopSensorMutationResult { instigationState { status } }
  ... on PythonError { message } } }
"""
START_SCHEDULE = """
mutation($s: ScheduleSelector!) { startSchedule(scheduleSelector: $s) { __typename
  ... on ScheduleStateResult { scheduleState { id } }
  ... on PythonError { message } } }
"""
STOP_SCHEDULE = """
mutation($id: String) { stopRunningSchedule(id: $id) { __typename
  ... on PythonError { message } } }
"""


@contextmanager
def deployment(
    url: URL,
    home: Path,
    env: dict[str, str],
    module: str = LOCATION,
    stop_tenants_sensor: bool = True,
) -> Iterator[Deployment]:
    """A code server (of ``module``, under the location name qo_ops.definitions),
    dagster-webserver, then (the tenants sensor stopped, unless told otherwise) dagster-daemon,
    on loopback over PostgreSQL storage next to ``url``; every process group stopped in every
    case."""
    import dagster as dg
    import httpx

    storage_db = f"{url.database}_dagster"
    admin = admin_engine()
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{storage_db}" WITH (FORCE)')
        conn.exec_driver_sql(f'CREATE DATABASE "{storage_db}"')
    storage = url.set(drivername="postgresql+psycopg2", database=storage_db).render_as_string(
        hide_password=False
    )
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    (home / "qo_ops").mkdir(exist_ok=True)
    proc_env = {k: v for k, v in os.environ.items() if not k.startswith("QO_OPS_")}
    proc_env.update(
        QO_OPS_DATABASE_URL=env_url(url),
        QO_OPS_DAGSTER_STORAGE_URL=storage,
        QO_OPS_HOME=str(home / "qo_ops"),
        DAGSTER_HOME=str(home),
        **env,
    )
    port = free_port()
    names = ("webserver.log", "daemon.log", "code-server.log")
    logs = [open(home / name, "w") for name in names]  # noqa: SIM115
    procs: list[subprocess.Popen[bytes]] = []
    old = {k: os.environ.get(k) for k in ("DAGSTER_HOME", "QO_OPS_DAGSTER_STORAGE_URL")}

    def start(cmd: list[str], log: Any) -> None:
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=REPO,
                env=proc_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        )

    def alive() -> None:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(
                "a Dagster process exited:\n"
                + tail(home / "webserver.log")
                + tail(home / "daemon.log")
                + tail(home / "code-server.log")
            )

    try:
        code, workspace = start_code_server(home, proc_env, logs[2], module=module)
        procs.append(code)
        start(
            [str(BIN / "dagster-webserver"), "-w", str(workspace), "-h", "127.0.0.1"]
            + ["-p", str(port)],
            logs[0],
        )
        os.environ["DAGSTER_HOME"], os.environ["QO_OPS_DAGSTER_STORAGE_URL"] = str(home), storage

        def webserver_up() -> bool:
            alive()
            try:
                return (
                    httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=2).status_code == 200
                )
            except httpx.HTTPError:
                return False

        wait_for(webserver_up, 180, "the webserver")
        with dg.DagsterInstance.get() as instance:
            d = Deployment(port, instance, storage, home)
            if stop_tenants_sensor:
                selector = {
                    "repositoryLocationName": LOCATION,
                    "repositoryName": REPOSITORY,
                    "sensorName": "tenants_sensor",
                }
                sensor = d.graphql(SENSOR_ID, {"s": selector})["sensorOrError"]
                stopped = d.graphql(STOP_SENSOR, {"id": sensor["id"]})["stopSensor"]
                if stopped["__typename"] != "StopSensorMutationResult":
                    raise RuntimeError(f"stopSensor: {stopped}")
            start([str(BIN / "dagster-daemon"), "run", "-w", str(workspace)], logs[1])

            def daemon_up() -> bool:
                alive()
                beats = instance.get_daemon_heartbeats()
                return "QUEUED_RUN_COORDINATOR" in beats and "SCHEDULER" in beats

            wait_for(daemon_up, 180, "the daemon's run queue and scheduler", poll=0.5)
            yield d
    finally:
        for proc in procs:
            if proc.poll() is None:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for proc in procs:  # children left in a group whose leader has gone (code servers)
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, 0)
                time.sleep(2)
                os.killpg(proc.pid, signal.SIGKILL)
        for log in logs:
            log.close()
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{storage_db}" WITH (FORCE)')
        admin.dispose()
