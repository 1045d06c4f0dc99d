"""``deploy/helm/values.yaml`` for the official dagster/dagster chart.

Helm and the chart cannot run here (no helm binary, no network), so the values are checked
against what they must become: the keys the chart reads (``chart_values_contract.yaml``, with
Kubernetes types from kubernetes-validate), the ``dagster.yaml`` the chart renders compared
section by section with the repository's ``dagster.yaml`` and validated by Dagster's own
instance schema, the commands the chart runs, and the run pod each catalog job gets.
"""

from __future__ import annotations

import copy
import importlib
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from dagster._core.instance.config import dagster_instance_config
from dagster_postgres import DagsterPostgresStorage
from jsonschema import Draft202012Validator

from qo_ops.definitions import build_definitions
from qo_ops.jobs.catalog import CATALOG
from qo_ops_tests.deploy.files import (
    K8S_DEFINITIONS_ID,
    K8S_VERSIONS,
    REPO,
    chart_code_server_command,
    chart_code_server_probe,
    chart_instance,
    k8s_registry,
    load_yaml,
    of_kind,
    resource_env_errors,
    run_help,
    run_pod,
    user_deployment,
    validate_k8s,
    values,
    walk,
)

CONTRACT = Path(__file__).with_name("chart_values_contract.yaml")
DAGSTER_YAML = REPO / "dagster.yaml"
CONSTRAINTS = dict(
    line.split("==", 1)
    for line in (REPO / "constraints.txt").read_text().splitlines()
    if "==" in line
)


def _contract_validator(version: str) -> Draft202012Validator:
    text = CONTRACT.read_text().replace('"K8S#', f'"{K8S_DEFINITIONS_ID}#')
    return Draft202012Validator(yaml.safe_load(text), registry=k8s_registry(version))


def _contract_errors(tree: dict[str, Any], version: str) -> list[str]:
    return [
        f"{'.'.join(str(p) for p in e.absolute_path) or '(top)'}: {e.message}"
        for e in _contract_validator(version).iter_errors(tree)
    ]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_values_use_only_keys_the_chart_reads_with_their_types(version):
    assert _contract_errors(values(), version) == []


def test_the_contract_catches_misspelt_and_mistyped_values():
    wrong = copy.deepcopy(values())
    queue = wrong["dagsterDaemon"]["runCoordinator"]["config"]["queuedRunCoordinator"]
    queue["maxConcurrentRun"] = queue.pop("maxConcurrentRuns")
    code_location = wrong["dagster-user-deployments"]["deployments"][0]
    code_location["readinessProbe"]["periodSecond"] = 20  # not a Probe field
    code_location["image"]["tag"] = "latest"
    wrong["dagsterWebserver"]["resources"]["request"] = {}  # not a ResourceRequirements field
    errors = "\n".join(_contract_errors(wrong, K8S_VERSIONS[0]))
    for needle in ("maxConcurrentRun", "periodSecond", "image.tag", "resources"):
        assert needle in errors, errors


# ------------------------------------------------------------------------- the instance


def instance_differences(local: dict[str, Any], chart: dict[str, Any]) -> list[str]:
    """Sections of the local dagster.yaml the chart's instance does not reproduce."""
    differences = []
    for key, section in local.items():
        if key == "storage":  # the same PostgreSQL storage, in the chart's per-store form
            if (
                not _postgres_storage(section)
                or "postgres_db" not in chart["run_storage"]["config"]
            ):
                differences.append(key)
        elif key == "run_coordinator":
            theirs = chart.get(key, {})
            if theirs.get("config") != section["config"] or not _same_queue(section, theirs):
                differences.append(key)
        elif chart.get(key) != section:
            differences.append(key)
    return differences


def _postgres_storage(section: dict[str, Any]) -> bool:
    """dagster-postgres's storage, or a class extending it with the same configuration (the
    chart's image cannot import qo_ops: its processes use Dagster's own classes, on the same
    tables)."""
    if "postgres" in section:
        return True
    custom = section.get("custom", {})
    mine = getattr(importlib.import_module(custom["module"]), custom["class"])
    return issubclass(mine, DagsterPostgresStorage) and "config_type" not in vars(mine)


def _same_queue(local: dict[str, Any], chart: dict[str, Any]) -> bool:
    """The chart's coordinator is the local one, or the Dagster class the local one extends:
    the chart's webserver and daemon run Dagster's image, which cannot import qo_ops (and in
    the shared deployment people launch only through the API, which validates every run)."""
    if (local["module"], local["class"]) == (chart.get("module"), chart.get("class")):
        return True
    mine = getattr(importlib.import_module(local["module"]), local["class"])
    theirs = getattr(importlib.import_module(chart["module"]), chart["class"])
    return issubclass(mine, theirs) and "config_type" not in vars(mine)  # same config


def test_the_charts_instance_says_what_dagster_yaml_says():
    """Run queue (max concurrent runs, one run per job × scope), run monitoring, run retries,
    Python logs, telemetry: every section of dagster.yaml, loaded from the file."""
    local = load_yaml(DAGSTER_YAML)
    chart = chart_instance(values())
    assert {"run_coordinator", "run_monitoring", "run_retries", "python_logs"} <= set(local)
    assert instance_differences(local, chart) == []


def test_a_drift_from_dagster_yaml_is_noticed():
    local = load_yaml(DAGSTER_YAML)
    drifted = copy.deepcopy(values())
    queue = drifted["dagsterDaemon"]["runCoordinator"]["config"]["queuedRunCoordinator"]
    queue["tagConcurrencyLimits"][0]["limit"] = 2
    drifted["additionalInstanceConfig"]["run_retries"]["retry_on_asset_or_op_failure"] = True
    del drifted["additionalInstanceConfig"]["run_monitoring"]["max_runtime_seconds"]
    assert instance_differences(local, chart_instance(drifted)) == [
        "run_coordinator",
        "run_monitoring",
        "run_retries",
    ]
    # what the chart would render if its own runRetries were used instead: retries job failures
    chart_only = copy.deepcopy(values())
    del chart_only["additionalInstanceConfig"]["run_retries"]
    chart_only["dagsterDaemon"]["runRetries"] = {"enabled": True, "maxRetries": 1}
    assert instance_differences(local, chart_instance(chart_only)) == ["run_retries"]
    doubled = copy.deepcopy(values())
    doubled["dagsterDaemon"]["runMonitoring"] = {
        "enabled": True,
        "startTimeoutSeconds": 180,
        "pollIntervalSeconds": 30,
        "freeSlotsAfterRunEndSeconds": 300,
    }
    with pytest.raises(AssertionError, match="doubles"):
        chart_instance(doubled)
    # the daemon launching a tick's runs one after another again, in the chart only
    serial = copy.deepcopy(values())
    del serial["dagsterDaemon"]["runCoordinator"]["config"]["queuedRunCoordinator"][
        "dequeueUseThreads"
    ]
    assert instance_differences(local, chart_instance(serial)) == ["run_coordinator"]


def test_dagster_accepts_the_charts_instance(tmp_path):
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(chart_instance(values())))
    config, custom_class = dagster_instance_config(str(tmp_path))
    assert custom_class is None
    assert config["run_retries"]["retry_on_asset_or_op_failure"] is False
    assert config["run_monitoring"]["max_runtime_seconds"] == 14400
    assert config["run_coordinator"]["config"]["dequeue_use_threads"] is True


# ------------------------------------------------------------------------- images and secrets


def test_dagsters_own_images_run_the_dagster_version_qo_ops_pins():
    for component in ("dagsterWebserver", "dagsterDaemon"):
        image = values()[component]["image"]
        assert image["repository"].endswith("dagster/dagster-celery-k8s")
        assert image["tag"] == CONSTRAINTS["dagster"], f"{component} and the code location differ"


def test_no_secret_is_written_in_the_values():
    assert values()["generatePostgresqlPasswordSecret"] is False
    assert "postgresqlPassword" not in values()["postgresql"]
    credentials_in_url = re.compile(r"://[^/\s@:]+:[^/\s@]+@")
    for node in walk(values()):
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if isinstance(value, str):
                assert not re.search(r"pass(word|wd)|token|api_?key", key, re.I), key
                assert not credentials_in_url.search(value), f"{key}: a URL with a password"


# ------------------------------------------------------------------------- the code location


def test_the_code_location_is_the_one_workspace_yaml_loads_and_its_commands_parse():
    deployment = user_deployment()
    args = deployment["dagsterApiGrpcArgs"]
    module = args[args.index("-m") + 1]
    assert f"module_name: {module}" in (REPO / "workspace.yaml").read_text()
    for command in (chart_code_server_command(deployment), chart_code_server_probe(deployment)):
        proc = run_help(command)
        assert proc.returncode == 0, f"{command}: {proc.stderr[-2000:]}"


def test_runs_inherit_the_code_locations_environment_and_settings():
    deployment = user_deployment()
    assert deployment["includeConfigInLaunchedRuns"]["enabled"] is True
    env = {e["name"]: e for e in deployment["env"]}
    assert env["QO_OPS_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "qo-ops-db-runner"
    config_maps = {m.name for m in of_kind("ConfigMap")}
    for source in deployment["envConfigMaps"]:
        assert source["name"] in config_maps, f"ConfigMap {source['name']} is not in deploy/k8s"


def test_the_archive_volume_is_shared_by_every_run():
    launcher = values()["runLauncher"]["config"]["k8sRunLauncher"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in launcher["volumes"]}
    claimed = {m.name: m for m in of_kind("PersistentVolumeClaim")}
    for mount in launcher["volumeMounts"]:
        claim = claimed[claims[mount["name"]]]  # a mount of a declared volume and claim
        assert claim.body["spec"]["accessModes"] == ["ReadWriteMany"], "runs land on any node"
    settings = {m.name: m for m in of_kind("ConfigMap")}["qo-ops-settings"].body["data"]
    assert settings["QO_OPS_HOME"] in [m["mountPath"] for m in launcher["volumeMounts"]]


# ------------------------------------------------------------------------- the run pods


@pytest.fixture(scope="module")
def catalog_jobs():
    with pytest.MonkeyPatch.context() as env:  # a code location in the chart's pod
        env.setenv("K8S_POD_NAME", "qo-ops-code-location-0")
        defs = build_definitions()
    return {name: defs.resolve_job_def(name) for name in CATALOG}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_catalog_jobs_run_pod_is_valid_kubernetes(catalog_jobs, version):
    for name, job in catalog_jobs.items():
        pod = run_pod(dict(job.run_tags))
        validate_k8s(pod, version)
        volumes = {v["name"] for v in pod["spec"]["volumes"]}
        mounts = {m["name"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
        assert mounts <= volumes, f"{name}: mounts of undeclared volumes {mounts - volumes}"


def test_every_run_pod_gets_exactly_its_catalog_resources(catalog_jobs):
    """Nothing the code location or the launcher sets leaks into a run's resources (a CPU
    limit there would throttle every run); what the catalog declares is what the pod asks."""
    for name, job in catalog_jobs.items():
        wanted = CATALOG[name].deployment.run_resources
        resources = run_pod(dict(job.run_tags))["spec"]["containers"][0]["resources"]
        assert resources == {
            "requests": {"cpu": wanted.cpu_request, "memory": wanted.memory_request},
            "limits": {"memory": wanted.memory_limit},
        }, name


# ------------------------------------------------------------------------- who is speaking


def test_the_code_location_says_where_it_runs_and_nothing_a_run_would_get_wrong():
    """Its env goes into every run pod too (includeConfigInLaunchedRuns), where a downward-API
    value resolves to the run's own pod; a container or Job name would not fit both pods."""
    env = user_deployment()["env"]
    assert resource_env_errors(env, container_name=None, in_job=False) == []


def test_every_run_pod_says_where_it_runs(catalog_jobs):
    """The code location's namespace, pod and digest, the launcher's run container name and
    Job name: each once, the container name the one the run's container really has."""
    for name, job in catalog_jobs.items():
        [container] = run_pod(dict(job.run_tags))["spec"]["containers"]
        errors = resource_env_errors(container["env"], container["name"], in_job=True)
        assert errors == [], f"{name}: {errors}"


def test_a_run_pod_whose_names_are_missing_or_doubled_is_noticed(catalog_jobs):
    tags = dict(catalog_jobs["quote_expiration"].run_tags)
    doubled = copy.deepcopy(values())
    location = doubled["dagster-user-deployments"]["deployments"][0]
    location["env"].append({"name": "K8S_CONTAINER_NAME", "value": "dagster-user-deployments"})
    [container] = run_pod(tags, doubled)["spec"]["containers"]
    assert "K8S_CONTAINER_NAME is set twice" in resource_env_errors(
        container["env"], container["name"], in_job=True
    )
    bare = copy.deepcopy(values())
    del bare["runLauncher"]["config"]["k8sRunLauncher"]["runK8sConfig"]["containerConfig"]
    [container] = run_pod(tags, bare)["spec"]["containers"]
    errors = "".join(resource_env_errors(container["env"], container["name"], in_job=True))
    assert "K8S_CONTAINER_NAME: missing" in errors and "K8S_JOB_NAME: missing" in errors
