"""A catalog job launched through the real ``K8sRunLauncher``, from the image, end to end.

What runs, all on loopback (``qo_ops_tests/deploy/cluster`` is the test scaffolding):

- a Kubernetes API: kmock's emulator (objects in memory, no controllers);
- a stand-in kubelet and Job controller, which runs pods with podman;
- as pods made like the chart's, in the image built from the Dockerfile: the code location
  ``qo-ops`` (``dagster api grpc``, its container context handed to its runs as
  ``includeConfigInLaunchedRuns`` does), the daemon (queue, run monitoring, retries) and the
  webserver; in the chart these two run Dagster's own image, which cannot be pulled here and
  whose Dagster is the same 1.13.27;
- the instance the chart renders from ``deploy/helm/values.yaml`` (``chart_instance``) with
  the K8sRunLauncher, pointed at a real PostgreSQL;
- a run submitted through the webserver's GraphQL API, queued, dequeued by the daemon, launched
  as a Kubernetes Job, run in its pod, finished in the shared Dagster storage, with its
  ``job_run`` row in the qo-ops database.

The run monitoring poll is 2 s here instead of values.yaml's 30 s, so the test does not wait.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import httpx
import pytest
import sqlalchemy as sa
import yaml
from dagster_graphql import DagsterGraphQLClient

from qo_ops.dagster_defs.k8s import run_pod_resources
from qo_ops.jobs.catalog import CATALOG
from qo_ops_tests.conftest import base_env
from qo_ops_tests.dagster.stack import free_port
from qo_ops_tests.deploy.cluster.containers import Image, remove_containers
from qo_ops_tests.deploy.cluster.kubelet import Kubelet, wait_until
from qo_ops_tests.deploy.cluster.postgres import tcp_postgres
from qo_ops_tests.deploy.files import (
    REPO,
    chart_code_server_command,
    chart_instance,
    load_yaml,
    run_pod,
    values,
)

# one worker builds the image once for both image test files (make test runs pytest-xdist)
pytestmark = pytest.mark.xdist_group("image")

NAMESPACE = "qo-ops"
LOCATION = "qo-ops"  # the chart's deployment name, the operator API's QO_OPS_DAGSTER_LOCATION
JOB = "quote_expiration"
TENANTS = ["tenant-001", "tenant-002"]
PASSWORD = "trust-auth-ignores-it"  # the test server trusts loopback; Dagster wants a value
KUBECONFIG_DIR = "/var/run/qo-ops-test-kube"
WORKSPACE_DIR = "/dagster-workspace"
BIN = Path(sys.executable).parent
FINISHED = (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)


@dataclass(repr=False)  # a failed assertion prints the objects it compares, not this
class Cluster:
    api: str
    kubelet: Kubelet
    client: DagsterGraphQLClient
    instance: dg.DagsterInstance
    app: sa.Engine  # the qo-ops database, as its owner
    image: Image
    chart_values: dict[str, Any]

    def get(self, path: str) -> dict[str, Any] | None:
        reply = httpx.get(f"{self.api}/{path}", timeout=10)
        return None if reply.status_code == 404 else reply.json()

    def job(self, run_id: str) -> dict[str, Any] | None:
        return self.get(f"apis/batch/v1/namespaces/{NAMESPACE}/jobs/dagster-run-{run_id}")

    def status(self, run_id: str) -> dg.DagsterRunStatus:
        run = self.instance.get_run_by_id(run_id)
        assert run is not None
        return run.status

    def launch(self, tenant: str, config: dict[str, Any]) -> str:
        return self.client.submit_job_execution(
            JOB,
            repository_location_name=LOCATION,
            run_config={"ops": {f"{JOB}_op": {"config": config}}},
            tags={"dagster/partition": tenant, "qo_ops/scope": f"{JOB}:{tenant}"},
        )

    def wait_finished(self, run_id: str, timeout: float = 300) -> dg.DagsterRunStatus:
        wait_until(lambda: self.status(run_id) in FINISHED, timeout, f"run {run_id}", self.kubelet)
        return self.status(run_id)

    def explain(self, run_id: str) -> str:
        """What to read when a run went wrong: its pod's output and its Dagster events."""
        events = [e.message for e in self.instance.all_logs(run_id) if e.message][-15:]
        return f"pod log:\n{self.kubelet.log_of(f'dagster-run-{run_id}')[-4000:]}\nevents: {events}"


# ----------------------------------------------------------------------------- the chart


def site_values(db_port: int, storage_db: str) -> dict[str, Any]:
    """values.yaml with what a site sets: its PostgreSQL (here the test's, on loopback)."""
    site = copy.deepcopy(values())
    site["postgresql"].update(
        postgresqlHost="127.0.0.1",
        postgresqlUsername="postgres",
        postgresqlDatabase=storage_db,
        postgresqlParams={},
    )
    site["postgresql"]["service"]["port"] = db_port
    return site


def run_launcher(chart_values: dict[str, Any]) -> dict[str, Any]:
    """The K8sRunLauncher section as the chart renders it for the release ``dagster``
    (helpers/instance/_run-launcher.tpl), out of the cluster: a kubeconfig instead of the
    in-cluster service account's token."""
    launcher = chart_values["runLauncher"]["config"]["k8sRunLauncher"]
    config = {
        "load_incluster_config": False,
        "kubeconfig_file": f"{KUBECONFIG_DIR}/config",
        "job_namespace": NAMESPACE,
        "image_pull_policy": launcher["imagePullPolicy"],
        "service_account_name": "dagster",
        "dagster_home": chart_values["global"]["dagsterHome"],
        "instance_config_map": "dagster-instance",
        "postgres_password_secret": chart_values["global"]["postgresqlSecretName"],
        "env_config_maps": [c["name"] for c in launcher["envConfigMaps"]],
        "env_secrets": [s["name"] for s in launcher["envSecrets"]],
        "env_vars": launcher["envVars"],
        "volumes": launcher["volumes"],
        "volume_mounts": launcher["volumeMounts"],
        "security_context": launcher["securityContext"],
        "run_k8s_config": {
            "container_config": launcher["runK8sConfig"]["containerConfig"],
            "pod_spec_config": launcher["runK8sConfig"]["podSpecConfig"],
        },
    }
    return {"module": "dagster_k8s", "class": "K8sRunLauncher", "config": config}


def instance_yaml(chart_values: dict[str, Any]) -> str:
    instance = chart_instance(chart_values)
    instance["run_launcher"] = run_launcher(chart_values)
    instance["run_monitoring"]["poll_interval_seconds"] = 2
    return yaml.safe_dump(instance, sort_keys=False)


def code_location_pod(chart_values: dict[str, Any], image: str, port: int) -> dict[str, Any]:
    """The chart's user-deployment pod for qo-ops (dagster-user-deployments'
    deployment-user.yaml): its command, env and settings, its image named to its runs
    (DAGSTER_CURRENT_IMAGE) and its container context handed to them
    (includeConfigInLaunchedRuns: env, envConfigMaps, resources)."""
    deployment = chart_values["dagster-user-deployments"]["deployments"][0]
    command = chart_code_server_command({**deployment, "port": port})
    context = {
        "k8s": {
            "namespace": NAMESPACE,
            "image_pull_policy": deployment["image"]["pullPolicy"],
            "env": deployment["env"],
            "env_config_maps": [c["name"] for c in deployment["envConfigMaps"]],
            "resources": deployment["resources"],
        }
    }
    container = {
        "name": "dagster",
        "image": image,
        "args": command,
        "env": [
            {"name": "DAGSTER_CURRENT_IMAGE", "value": image},
            {"name": "DAGSTER_CONTAINER_CONTEXT", "value": json.dumps(context)},
            *deployment["env"],
        ],
        "envFrom": [{"configMapRef": {"name": c["name"]}} for c in deployment["envConfigMaps"]],
        "securityContext": deployment["securityContext"],
    }
    return _pod("qo-ops-code-location", container, deployment["podSecurityContext"], volumes=[])


def dagster_pod(name: str, image: str, args: list[str], home: str) -> dict[str, Any]:
    """The daemon's or the webserver's pod: the instance at DAGSTER_HOME (ConfigMap
    dagster-instance), the workspace, and here the kubeconfig the launcher uses."""
    container = {
        "name": "dagster",
        "image": image,
        "args": args,
        "env": [
            {"name": "DAGSTER_HOME", "value": home},
            {
                "name": "DAGSTER_PG_PASSWORD",
                "valueFrom": {
                    "secretKeyRef": {"name": "qo-ops-dagster-storage", "key": "postgresql-password"}
                },
            },
        ],
        "volumeMounts": [
            {"name": "instance", "mountPath": f"{home}/dagster.yaml", "subPath": "dagster.yaml"},
            {"name": "workspace", "mountPath": WORKSPACE_DIR},
            {"name": "kubeconfig", "mountPath": KUBECONFIG_DIR},
        ],
    }
    volumes = [
        {"name": "instance", "configMap": {"name": "dagster-instance"}},
        {"name": "workspace", "configMap": {"name": "dagster-workspace-yaml"}},
        {"name": "kubeconfig", "secret": {"secretName": "qo-ops-test-kubeconfig"}},
    ]
    security = {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001}
    return _pod(name, container, security, volumes)


def _pod(name: str, container: dict, security: dict, volumes: list[dict]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app": name}},
        "spec": {"securityContext": security, "containers": [container], "volumes": volumes},
    }


def config_map(name: str, data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}


def secret(name: str, data: dict[str, str]) -> dict[str, Any]:
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "data": encoded}


# ----------------------------------------------------------------------------- the setup


def _create(api: str, body: dict[str, Any]) -> None:
    plural = {"ConfigMap": "configmaps", "Secret": "secrets", "Pod": "pods"}[body["kind"]]
    reply = httpx.post(f"{api}/api/v1/namespaces/{NAMESPACE}/{plural}", json=body, timeout=10)
    reply.raise_for_status()


def _databases(server: sa.URL, suffix: str) -> tuple[sa.URL, str, str]:
    """The qo-ops database (migrated, demo data, a runner login) and Dagster's storage."""
    app_name, storage_name, runner = (
        f"qo_ops_k8s_{suffix}",
        f"qo_ops_dagster_k8s_{suffix}",
        f"qo_ops_k8s_runner_{suffix}",
    )
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        for name in (app_name, storage_name):
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    admin.dispose()
    app = server.set(database=app_name)
    env = base_env(
        QO_OPS_DATABASE_URL=app.set(drivername="postgresql").render_as_string(hide_password=False)
    )
    for args in (
        ["db", "upgrade"],
        ["demo-data", "--tenants", "2", "--quotes", "300", "--seed", "7"],
    ):
        done = subprocess.run(
            [str(BIN / "qo-ops"), *args], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
    owner = sa.create_engine(app, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with owner.connect() as conn:  # the runner's own login, as docs/security.md makes it
        conn.exec_driver_sql(f"CREATE ROLE {runner} LOGIN IN ROLE qo_ops_runner")
    owner.dispose()
    return app, storage_name, runner


def _drop(server: sa.URL, app: sa.URL, storage: str, runner: str) -> None:
    admin = sa.create_engine(server, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        for name in (app.database, storage):
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.exec_driver_sql(f"DROP ROLE IF EXISTS {runner}")
    admin.dispose()


@pytest.fixture(scope="module")
def cluster(image: Image, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("cluster")
    work.chmod(0o755)
    suffix = f"{os.getpid()}_{uuid.uuid4().hex[:6]}"
    prefix = f"qo-ops-test-{suffix.replace('_', '-')}-"
    with tcp_postgres(work) as server:
        app, storage, runner = _databases(server, suffix)
        emulator_port = free_port()
        emulator_log = work / "emulator.log"  # a file, not a pipe nobody would drain
        with emulator_log.open("w") as log:
            emulator = subprocess.Popen(
                [sys.executable, "-m", "qo_ops_tests.deploy.cluster.emulator", str(emulator_port)],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        api = f"http://127.0.0.1:{emulator_port}"
        kubelet = Kubelet(
            api,
            NAMESPACE,
            work,
            claims={"qo-ops-home": work / "qo-ops-home"},
            container_prefix=prefix,
        )
        (work / "qo-ops-home").mkdir()
        try:
            wait_until(
                lambda: "ready" in emulator_log.read_text() or emulator.poll() is not None,
                60,
                "the Kubernetes API emulator",
                kubelet,
            )
            assert emulator.poll() is None, emulator_log.read_text()[-3000:]
            chart_values = site_values(server.port or 5432, storage)
            code_port, web_port = free_port(), free_port()
            home = chart_values["global"]["dagsterHome"]
            runner_url = app.set(drivername="postgresql", username=runner)
            settings = load_yaml(REPO / "deploy" / "k8s" / "settings.yaml")
            kubeconfig = {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "emulator", "cluster": {"server": api}}],
                "users": [{"name": "test", "user": {}}],
                "contexts": [
                    {
                        "name": "emulator",
                        "context": {"cluster": "emulator", "user": "test", "namespace": NAMESPACE},
                    }
                ],
                "current-context": "emulator",
            }
            workspace = {
                "load_from": [
                    {
                        "grpc_server": {
                            "host": "127.0.0.1",
                            "port": code_port,
                            "location_name": LOCATION,
                        }
                    }
                ]
            }
            for body in (
                config_map("qo-ops-settings", settings["data"]),
                config_map("dagster-instance", {"dagster.yaml": instance_yaml(chart_values)}),
                config_map("dagster-workspace-yaml", {"workspace.yaml": yaml.safe_dump(workspace)}),
                secret(
                    "qo-ops-db-runner", {"url": runner_url.render_as_string(hide_password=False)}
                ),
                secret(
                    chart_values["global"]["postgresqlSecretName"],
                    {"postgresql-password": PASSWORD},
                ),
                secret("qo-ops-test-kubeconfig", {"config": yaml.safe_dump(kubeconfig)}),
                code_location_pod(chart_values, image.name, code_port),
            ):
                _create(api, body)
            kubelet.start()
            health = [str(BIN / "dagster"), "api", "grpc-health-check", "-p", str(code_port)]
            wait_until(
                lambda: subprocess.run(health, capture_output=True).returncode == 0,
                240,
                "the code location pod",
                kubelet,
            )
            for body in (  # the daemon and webserver load the location once it serves
                dagster_pod(
                    "dagster-daemon",
                    image.name,
                    ["dagster-daemon", "run", "-w", f"{WORKSPACE_DIR}/workspace.yaml"],
                    home,
                ),
                dagster_pod(
                    "dagster-webserver",
                    image.name,
                    [
                        "dagster-webserver",
                        "-h",
                        "127.0.0.1",
                        "-p",
                        str(web_port),
                        "-w",
                        f"{WORKSPACE_DIR}/workspace.yaml",
                    ],
                    home,
                ),
            ):
                _create(api, body)
            storage_url = server.set(
                drivername="postgresql+psycopg2", database=storage, password=PASSWORD
            )
            dagster_home = work / "dagster-home"  # the test reads runs and events from the storage
            dagster_home.mkdir()
            (dagster_home / "dagster.yaml").write_text(
                yaml.safe_dump(
                    {
                        "storage": {
                            "postgres": {
                                "postgres_url": storage_url.render_as_string(hide_password=False)
                            }
                        }
                    }
                )
            )

            def webserver_up() -> bool:
                try:
                    return (
                        httpx.get(f"http://127.0.0.1:{web_port}/server_info", timeout=2).status_code
                        == 200
                    )
                except httpx.HTTPError:
                    return False

            wait_until(webserver_up, 240, "the webserver pod", kubelet)
            with dg.DagsterInstance.from_config(str(dagster_home)) as instance:
                instance.add_dynamic_partitions("tenants", TENANTS)
                engine = sa.create_engine(app, poolclass=sa.pool.NullPool)
                yield Cluster(
                    api,
                    kubelet,
                    DagsterGraphQLClient("127.0.0.1", port_number=web_port),
                    instance,
                    engine,
                    image,
                    chart_values,
                )
                engine.dispose()
        finally:
            for pod in ("dagster-daemon", "dagster-webserver", "qo-ops-code-location"):
                log = kubelet.log_of(pod)
                if log:
                    (work / f"{pod}.log").write_text(log)
            kubelet.stop()
            remove_containers(prefix)
            emulator.terminate()
            emulator.wait(timeout=30)
            _drop(server, app, storage, runner)


# ----------------------------------------------------------------------------- the tests


def _by_name(env: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {variable["name"]: variable for variable in env}


def _job_run(cluster: Cluster, run_id: str) -> str | None:
    with cluster.app.connect() as conn:
        return conn.scalar(
            sa.text("SELECT status FROM job_run WHERE dagster_run_id = :r"), {"r": run_id}
        )


def test_a_queued_run_becomes_a_kubernetes_job_and_succeeds_and_the_next_of_its_scope_waits(
    cluster,
):
    execute = {"mode": "execute", "reason": "k8s launch test", "batch_size": 50}
    # while held, the first run's pod stays Pending: the run is in progress, not started
    with cluster.kubelet.holding():
        first = cluster.launch(TENANTS[0], execute)
        job = wait_until(
            lambda: cluster.job(first), 180, "the daemon to launch the first run", cluster.kubelet
        )

        # the Job: the code location's image and command, the catalog's resources, the run's labels
        spec = job["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        assert container["image"] == cluster.image.name
        assert container["args"][:3] == ["dagster", "api", "execute_run"]
        execute_args = json.loads(container["args"][3])
        assert (execute_args["__class__"], execute_args["pipeline_run_id"]) == (
            "ExecuteRunArgs",
            first,
        )
        assert container["resources"] == run_pod_resources(CATALOG[JOB]), "the catalog's run pod"
        labels = job["metadata"]["labels"]
        assert (
            labels["dagster/run-id"],
            labels["dagster/job"],
            labels["dagster/code-location"],
        ) == (
            first,
            JOB,
            LOCATION,
        )
        assert (
            spec["securityContext"]["runAsUser"] == 10001
            and spec["securityContext"]["runAsNonRoot"]
        )
        assert spec["serviceAccountName"] == "dagster"
        # and the rest is the pod the offline checks (test_helm_values.py's run_pod) predict
        run = cluster.instance.get_run_by_id(first)
        assert run is not None
        assert run.tags["dagster/image"] == cluster.image.name  # the launcher tagged the run
        expected = run_pod(dict(run.tags), cluster.chart_values, job_name=JOB)["spec"]
        (want,) = expected["containers"]
        assert _by_name(container["env"]) == _by_name(want["env"])
        for key in ("name", "envFrom", "resources", "securityContext", "volumeMounts"):
            assert container[key] == want[key], key
        for key in ("securityContext", "volumes", "restartPolicy"):
            assert spec[key] == expected[key], key

        # a second run of the same job and tenant waits while the first is in progress
        second = cluster.launch(TENANTS[0], {**execute, "reason": "k8s launch test, second"})
        # a run of another tenant, queued after it, is launched: the daemon has gone through the
        # queue since the second run joined it, and left that one where it was
        other = cluster.launch(TENANTS[1], {"mode": "dry_run"})
        wait_until(lambda: cluster.job(other), 180, "the other tenant's run", cluster.kubelet)
        assert cluster.status(second) == dg.DagsterRunStatus.QUEUED
        assert cluster.job(second) is None
        assert cluster.status(first) == dg.DagsterRunStatus.STARTING

    assert cluster.wait_finished(first) == dg.DagsterRunStatus.SUCCESS, cluster.explain(first)
    wait_until(  # the pod exits after the run has ended; then its Job has succeeded
        lambda: cluster.job(first)["status"].get("succeeded") == 1,
        60,
        "Job complete",
        cluster.kubelet,
    )
    assert _job_run(cluster, first) == "success"
    assert cluster.wait_finished(second) == dg.DagsterRunStatus.SUCCESS, cluster.explain(second)
    assert _job_run(cluster, second) == "no_work"  # the first had done the work
    assert cluster.wait_finished(other) == dg.DagsterRunStatus.SUCCESS, cluster.explain(other)
    first_end = cluster.instance.get_run_record_by_id(first).end_time
    assert cluster.instance.get_run_record_by_id(second).start_time >= first_end
    with cluster.app.connect() as conn:  # the work itself: every past-due quote expired
        expired, overdue = conn.execute(
            sa.text(
                "SELECT count(*) FILTER (WHERE status = 'EXPIRED'),"
                " count(*) FILTER (WHERE status = 'ACTIVE' AND expires_at < now())"
                " FROM quote WHERE tenant_id = :t"
            ),
            {"t": TENANTS[0]},
        ).one()
    assert expired > 0 and overdue == 0


def test_a_run_whose_pod_is_deleted_is_failed_by_run_monitoring(cluster):
    slow = {
        "mode": "execute",
        "reason": "k8s pod deletion test",
        "batch_size": 1,
        "throttle_ms": 1000,
    }
    run_id = cluster.launch(TENANTS[1], slow)
    # Dagster says STARTED before the op has admitted the run; the pod is deleted only once
    # the run's own row says it is running, so the kill lands mid-run and not before it.
    wait_until(
        lambda: (
            cluster.status(run_id) == dg.DagsterRunStatus.STARTED
            and _job_run(cluster, run_id) == "running"
        ),
        240,
        "the run to start in its pod and claim its scope",
        cluster.kubelet,
    )
    pod = cluster.kubelet.pod_of(f"dagster-run-{run_id}")
    assert pod is not None
    httpx.delete(
        f"{cluster.api}/api/v1/namespaces/{NAMESPACE}/pods/{pod}", timeout=10
    ).raise_for_status()
    assert cluster.wait_finished(run_id, 120) == dg.DagsterRunStatus.FAILURE, cluster.explain(
        run_id
    )
    messages = [e.message for e in cluster.instance.all_logs(run_id) if e.message]
    assert any("K8s job has no active pods" in m for m in messages), messages[-10:]
    assert cluster.job(run_id)["status"]["failed"] == 1
    assert _job_run(cluster, run_id) == "running"  # killed mid-run: nothing could end its row
