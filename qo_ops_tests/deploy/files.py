"""What the deployment tests read: the Dockerfile and its build context, the chart values,
the Kubernetes manifests, and the Kubernetes schemas kubernetes-validate bundles (offline).

Nothing here talks to a cluster, a registry or Docker: none is reachable on the machines
that run the suite. What can be checked without them is checked by the tests beside this.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from importlib import metadata, resources
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from referencing import Registry, Resource

from qo_ops.dagster_defs.k8s import K8S_CONFIG_TAG
from qo_ops.platform.observability.resource import DEPLOYMENT_ATTRIBUTES

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
VALUES = REPO / "deploy" / "helm" / "values.yaml"
MANIFESTS = REPO / "deploy" / "k8s"
SECRETS_TEMPLATE = MANIFESTS / "secrets.example.yaml"

# The release name docs/deploy.md installs the chart under; deploy/k8s names what the chart
# makes after it. With a name containing "dagster", the chart's fullname is the name itself.
RELEASE = "dagster"
# Kubernetes versions the manifests must be valid for: the oldest docs/deploy.md supports and
# the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.30", "1.37")
K8S_DEFINITIONS_ID = "https://kubernetes.io/api/_definitions.json"

# Console scripts the image's commands may start, by distribution: both are installed by
# `pip install .` (qo-ops, and dagster as its dependency). Plain tools of the base image:
BASE_IMAGE_TOOLS = {"sleep"}
IMAGE_SCRIPTS = {"qo-ops": "qo-ops", "dagster": "dagster"}


def truthy_env(name: str) -> bool:
    """True when ``name`` is set to something other than empty/0/false/no."""
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def require_tool(name: str, install: str) -> str:
    """The path of ``name``; skips with the reason when missing, but fails under ``CI``."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        reason = f"{name} is not installed ({install})"
        if truthy_env("CI"):
            pytest.fail(f"{reason}; CI is set, so this does not skip", pytrace=False)
        pytest.skip(reason)
    return found


# ------------------------------------------------------------------------- Dockerfile


@dataclass
class Instruction:
    """One Dockerfile instruction, its continuation lines joined."""

    keyword: str
    arguments: str
    stage: int  # index of the FROM it belongs to; -1 before the first FROM
    line: int

    def exec_form(self) -> list[str]:
        """The JSON (exec) form of CMD/ENTRYPOINT/RUN arguments."""
        return list(json.loads(self.arguments))


@dataclass
class Dockerfile:
    """A parsed Dockerfile: its instructions, the global ARG defaults and the stages."""

    instructions: list[Instruction]
    args: dict[str, str] = field(default_factory=dict)
    stages: list[str] = field(default_factory=list)  # stage names ("" when unnamed)

    def in_stage(self, stage: int, keyword: str) -> list[Instruction]:
        """The ``keyword`` instructions of stage ``stage`` (-1: the last one)."""
        wanted = stage if stage >= 0 else len(self.stages) - 1
        return [i for i in self.instructions if i.stage == wanted and i.keyword == keyword]

    def base_images(self) -> list[str]:
        """The image each FROM names, ARGs expanded."""
        images = []
        for instruction in self.instructions:
            if instruction.keyword == "FROM":
                image = instruction.arguments.split()[0]
                images.append(re.sub(r"\$\{(\w+)\}", lambda m: self.args[m.group(1)], image))
        return images


def parse_dockerfile(text: str) -> Dockerfile:
    """Parse ``text`` the way docker does for the parts the tests use: comments dropped
    (also inside continuations), backslash continuations joined, keywords upper-cased."""
    logical: list[tuple[int, str]] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        logical.append((start, " ".join(pending)))
        pending = []
    assert not pending, "the Dockerfile ends inside a continuation"
    parsed = Dockerfile(instructions=[])
    stage = -1
    for number, line in logical:
        keyword, _, arguments = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
            words = arguments.split()
            parsed.stages.append(words[2] if len(words) == 3 and words[1].upper() == "AS" else "")
        elif keyword == "ARG" and stage == -1:
            name, _, default = arguments.partition("=")
            parsed.args[name.strip()] = default.strip()
        parsed.instructions.append(Instruction(keyword, arguments.strip(), stage, number))
    return parsed


@cache
def dockerfile() -> Dockerfile:
    """The repository's Dockerfile, parsed."""
    return parse_dockerfile(DOCKERFILE.read_text())


def env_of_last_stage(parsed: Dockerfile) -> dict[str, str]:
    """ENV key=value pairs of the final stage (``$PATH``-style references left as written)."""
    env: dict[str, str] = {}
    for instruction in parsed.in_stage(-1, "ENV"):
        for pair in instruction.arguments.split():
            key, _, value = pair.partition("=")
            env[key] = value
    return env


# ----------------------------------------------------------------- .dockerignore (docker's rules)


def _pattern(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex: ``**`` spans directories, ``*``/``?`` do not."""
    regex, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            regex, i = regex + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            regex, i = regex + ".*", i + 2
        elif pattern[i] == "*":
            regex, i = regex + "[^/]*", i + 1
        elif pattern[i] == "?":
            regex, i = regex + "[^/]", i + 1
        else:
            regex, i = regex + re.escape(pattern[i]), i + 1
    return re.compile(f"^{regex}$")


@dataclass(frozen=True)
class DockerIgnore:
    """The rules of a .dockerignore: the last rule that matches a path, or one of the
    directories above it, decides; a ``!`` rule brings the path back."""

    rules: tuple[tuple[bool, re.Pattern[str]], ...]

    @classmethod
    def parse(cls, text: str) -> DockerIgnore:
        rules = []
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            keep = line.startswith("!")
            pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
            rules.append((keep, _pattern(pattern)))
        return cls(tuple(rules))

    def excludes(self, path: str) -> bool:
        """True when ``path`` (relative to the context, ``/``-separated) is left out."""
        parts = path.strip("/").split("/")
        candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        excluded = False
        for keep, regex in self.rules:
            if any(regex.match(candidate) for candidate in candidates):
                excluded = not keep
        return excluded


def files_under(root: Path) -> Iterator[Path]:
    """Every file below ``root`` except Python's byte-code caches."""
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            yield path


# ------------------------------------------------------------------------- values and manifests


def load_yaml(path: Path) -> Any:
    """One YAML document."""
    return yaml.safe_load(path.read_text())


@cache
def values() -> dict[str, Any]:
    """deploy/helm/values.yaml."""
    loaded = load_yaml(VALUES)
    assert isinstance(loaded, dict)
    return loaded


def user_deployment() -> dict[str, Any]:
    """The qo-ops code location in the chart values (the only user deployment)."""
    deployments = values()["dagster-user-deployments"]["deployments"]
    assert len(deployments) == 1, "one code location: qo-ops"
    return dict(deployments[0])


def chart_instance(chart_values: dict[str, Any]) -> dict[str, Any]:
    """The dagster.yaml the chart renders from ``chart_values`` (its templates
    configmap-instance.yaml and helpers/instance/*.tpl), for what qo-ops sets."""
    pg = chart_values["postgresql"]
    assert not pg["enabled"], "Dagster's storage is the external PostgreSQL"
    postgres = {
        "postgres_db": {
            "username": pg["postgresqlUsername"],
            "password": {"env": "DAGSTER_PG_PASSWORD"},
            "hostname": pg["postgresqlHost"],
            "db_name": pg["postgresqlDatabase"],
            "port": pg["service"]["port"],
            "params": pg.get("postgresqlParams", {}),
            **({"scheme": pg["postgresqlScheme"]} if pg.get("postgresqlScheme") else {}),
        }
    }
    launcher = chart_values["runLauncher"]["config"]["k8sRunLauncher"]
    instance: dict[str, Any] = {
        "scheduler": {"module": "dagster._core.scheduler", "class": "DagsterDaemonScheduler"},
        "schedule_storage": {
            "module": "dagster_postgres.schedule_storage",
            "class": "PostgresScheduleStorage",
            "config": postgres,
        },
        "run_storage": {
            "module": "dagster_postgres.run_storage",
            "class": "PostgresRunStorage",
            "config": postgres,
        },
        "event_log_storage": {
            "module": "dagster_postgres.event_log",
            "class": "PostgresEventLogStorage",
            "config": postgres,
        },
        "run_launcher": {
            "module": "dagster_k8s",
            "class": chart_values["runLauncher"]["type"],
            "config": {
                "load_incluster_config": launcher["loadInclusterConfig"],
                "image_pull_policy": launcher["imagePullPolicy"],
                "volumes": launcher["volumes"],
                "volume_mounts": launcher["volumeMounts"],
            },
        },
        "telemetry": {"enabled": chart_values["telemetry"]["enabled"]},
    }
    daemon = chart_values["dagsterDaemon"]
    if daemon["enabled"] and daemon["runCoordinator"]["enabled"]:
        queued = daemon["runCoordinator"]["config"]["queuedRunCoordinator"]
        instance["run_coordinator"] = {
            "module": "dagster._core.run_coordinator",
            "class": daemon["runCoordinator"]["type"],
            "config": {
                "max_concurrent_runs": queued["maxConcurrentRuns"],
                "tag_concurrency_limits": queued["tagConcurrencyLimits"],
                "dequeue_interval_seconds": queued["dequeueIntervalSeconds"],
                **{  # the chart writes each only when set (and true: a false is left out)
                    key: queued[value]
                    for key, value in (
                        ("dequeue_use_threads", "dequeueUseThreads"),
                        ("dequeue_num_workers", "dequeueNumWorkers"),
                    )
                    if queued.get(value)
                },
            },
        }
    logs = chart_values["pythonLogs"]
    instance["python_logs"] = {
        "python_log_level": logs["pythonLogLevel"],
        "managed_python_loggers": logs["managedPythonLoggers"],
    }
    monitoring = daemon["runMonitoring"]
    if daemon["enabled"] and monitoring["enabled"]:  # the keys the chart renders
        instance["run_monitoring"] = {
            "enabled": True,
            "start_timeout_seconds": monitoring["startTimeoutSeconds"],
            "poll_interval_seconds": monitoring["pollIntervalSeconds"],
            "free_slots_after_run_end_seconds": monitoring["freeSlotsAfterRunEndSeconds"],
        }
    retries = daemon["runRetries"]
    if daemon["enabled"] and retries["enabled"]:
        instance["run_retries"] = {"enabled": True, "max_retries": retries["maxRetries"]}
    for key, section in chart_values.get("additionalInstanceConfig", {}).items():
        # the chart appends it verbatim: a key it already rendered would appear twice
        assert key not in instance, f"additionalInstanceConfig.{key} doubles the chart's own"
        instance[key] = section
    return instance


def deep_merge(onto: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(onto)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def run_pod(
    run_tags: dict[str, str], chart_values: dict[str, Any] | None = None, job_name: str = "job"
) -> dict[str, Any]:
    """The run worker pod dagster-k8s's K8sRunLauncher builds for a run with ``run_tags``,
    from the pieces values.yaml gives it: the launcher's config, the code location's
    container context (includeConfigInLaunchedRuns) and the run's dagster-k8s/config tag,
    merged in that order (dagster_k8s.container_context, DEEP merge). The container's env:
    dagster-k8s's own variables, then the container context's ``env`` and the merged
    ``container_config.env`` (dagster_k8s.job.construct_dagster_k8s_job); its name is
    ``container_config.name``, "dagster" by default. No instance volume: the run worker gets
    its instance in its ``execute_run`` argument (``instance_config_map`` mounts nothing in
    dagster-k8s 0.29). test_k8s_run_launcher.py compares this with the Job the real
    launcher creates."""
    chart_values = chart_values or values()
    launcher = chart_values["runLauncher"]["config"]["k8sRunLauncher"]
    deployment = chart_values["dagster-user-deployments"]["deployments"][0]
    tag = json.loads(run_tags[K8S_CONFIG_TAG])
    container_config = deep_merge(
        launcher.get("runK8sConfig", {}).get("containerConfig", {}), tag["container_config"]
    )
    resources = deep_merge(
        deep_merge(launcher.get("resources") or {}, deployment.get("resources") or {}),
        container_config["resources"],
    )
    home = chart_values["global"]["dagsterHome"]
    config_maps = [*launcher["envConfigMaps"], *deployment["envConfigMaps"]]
    container = {
        "name": container_config.get("name", "dagster"),
        "image": f"{deployment['image']['repository']}:{deployment['image']['tag']}",
        "imagePullPolicy": launcher["imagePullPolicy"],
        "args": ["dagster", "api", "execute_run", "{}"],
        "env": [
            {"name": "DAGSTER_RUN_JOB_NAME", "value": job_name},
            {"name": "DAGSTER_HOME", "value": home},
            {
                "name": "DAGSTER_PG_PASSWORD",
                "valueFrom": {
                    "secretKeyRef": {
                        "name": chart_values["global"]["postgresqlSecretName"],
                        "key": "postgresql-password",
                    }
                },
            },
            *deployment["env"],
            *container_config.get("env", []),
        ],
        "envFrom": [{"configMapRef": {"name": c["name"]}} for c in config_maps],
        "resources": resources,
        "securityContext": launcher["securityContext"],
        "volumeMounts": [*launcher["volumeMounts"], *deployment.get("volumeMounts", [])],
    }
    spec = {
        **launcher["runK8sConfig"]["podSpecConfig"],
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [*launcher["volumes"], *deployment.get("volumes", [])],
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "dagster-run"}, "spec": spec}


def chart_fullname() -> str:
    """The chart's fullname for the release: the release name when it contains "dagster"."""
    return RELEASE if "dagster" in RELEASE else f"{RELEASE}-dagster"


@dataclass(frozen=True)
class Manifest:
    """One Kubernetes object from deploy/k8s and the file it came from."""

    path: Path
    body: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.body["kind"])

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])

    def __str__(self) -> str:
        return f"{self.path.relative_to(REPO)}: {self.kind}/{self.name}"


def manifest_files() -> list[Path]:
    """Every YAML file of deploy/k8s except the kustomizations."""
    return sorted(p for p in MANIFESTS.rglob("*.yaml") if p.name != "kustomization.yaml")


@cache
def manifests() -> tuple[Manifest, ...]:
    """Every object of every manifest file, secrets template included."""
    found = []
    for path in manifest_files():
        for body in yaml.safe_load_all(path.read_text()):
            if body:
                found.append(Manifest(path, body))
    return tuple(found)


def of_kind(kind: str) -> list[Manifest]:
    """The manifests of one kind."""
    return [m for m in manifests() if m.kind == kind]


def by_name(kind: str, name: str) -> Manifest:
    """The manifest of ``kind`` called ``name``."""
    matches = [m for m in of_kind(kind) if m.name == name]
    assert len(matches) == 1, f"expected one {kind}/{name} in deploy/k8s, found {len(matches)}"
    return matches[0]


def pod_spec(manifest: Manifest) -> dict[str, Any]:
    """The pod spec of a Pod, Deployment or Job."""
    if manifest.kind == "Pod":
        return dict(manifest.body["spec"])
    return dict(manifest.body["spec"]["template"]["spec"])


def workloads() -> list[Manifest]:
    """The manifests that run containers."""
    return [m for m in manifests() if m.kind in ("Pod", "Deployment", "Job")]


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Init containers and containers of a pod spec."""
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def walk(node: Any) -> Iterator[Any]:
    """Every mapping, list and scalar in a YAML tree, depth first."""
    yield node
    if isinstance(node, dict):
        for value in node.values():
            yield from walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from walk(value)


def secret_key_refs(tree: Any) -> set[tuple[str, str]]:
    """(Secret name, key) of every ``secretKeyRef`` in a YAML tree."""
    return {
        (node["secretKeyRef"]["name"], node["secretKeyRef"]["key"])
        for node in walk(tree)
        if isinstance(node, dict) and isinstance(node.get("secretKeyRef"), dict)
    }


# ------------------------------------------------------------------------- who is speaking

VARIABLE = {attribute: variable for attribute, (variable, _) in DEPLOYMENT_ATTRIBUTES.items()}
DIGEST_CONFIG_MAP = "qo-ops-image"  # written by the release step (docs/deploy.md), not here
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"  # on every Job's pods since Kubernetes 1.27


def _field(path: str) -> dict[str, Any]:
    return {"valueFrom": {"fieldRef": {"fieldPath": path}}}


def resource_sources(container_name: str | None, in_job: bool) -> dict[str, dict[str, Any]]:
    """Where a container's resource-attribute variables must come from (docs/deploy.md): the
    downward API, the container's own name (None: not set, the chart's code location), the
    Job's label on a Job's pods, the optional digest ConfigMap."""
    sources = {
        VARIABLE["k8s.namespace.name"]: _field("metadata.namespace"),
        VARIABLE["k8s.pod.name"]: _field("metadata.name"),
        VARIABLE["container.image.digest"]: {
            "valueFrom": {
                "configMapKeyRef": {"name": DIGEST_CONFIG_MAP, "key": "digest", "optional": True}
            }
        },
    }
    if container_name is not None:
        sources[VARIABLE["k8s.container.name"]] = {"value": container_name}
    if in_job:
        sources[VARIABLE["k8s.job.name"]] = _field(f"metadata.labels['{JOB_NAME_LABEL}']")
    return sources


def resource_env_errors(
    env: list[dict[str, Any]], container_name: str | None, in_job: bool
) -> list[str]:
    """What is wrong with the resource-attribute variables of a container's ``env``: one
    missing or from another source, one that would be wrong there, one set twice."""
    names = [e["name"] for e in env]
    given = {e["name"]: {k: v for k, v in e.items() if k != "name"} for e in env}
    wanted = resource_sources(container_name, in_job)
    errors = sorted({f"{name} is set twice" for name in names if names.count(name) > 1})
    for name, source in wanted.items():
        if given.get(name) != source:
            errors.append(f"{name}: {given.get(name, 'missing')}, not {source}")
    for name in set(VARIABLE.values()) - set(wanted):
        if name in given:
            errors.append(f"{name} is set where it would be wrong or empty")
    return errors


# ------------------------------------------------------------------------- Kubernetes schemas


def validate_k8s(body: dict[str, Any], version: str) -> None:
    """Validate one object against the strict (no unknown fields) schema of ``version``."""
    kubernetes_validate.validate(body, version, strict=True)


def k8s_definitions(version: str) -> dict[str, Any]:
    """The Kubernetes type definitions of ``version`` (strict), as kubernetes-validate ships them."""
    folder = resources.files("kubernetes_validate") / "kubernetes-json-schema"
    path = folder / f"v{version}.0-local-strict" / "_definitions.json"
    loaded = json.loads(path.read_text())
    assert loaded["$id"] == K8S_DEFINITIONS_ID
    return dict(loaded)


def k8s_registry(version: str) -> Registry[Any]:
    """A registry resolving ``https://kubernetes.io/api/_definitions.json#/$defs/…``."""
    return Resource.from_contents(k8s_definitions(version)) @ Registry()


# ------------------------------------------------------------------------- commands


def console_script_distribution(name: str) -> str | None:
    """The distribution that installs console script ``name`` in this environment."""
    for entry in metadata.entry_points(group="console_scripts"):
        if entry.name == name and entry.dist is not None:
            return str(entry.dist.name)
    return None


def run_help(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """``argv --help`` with the console script of this environment: parses every option name
    and subcommand of ``argv`` exactly as the container would, then prints help."""
    script = str(Path(sys.executable).with_name(argv[0]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QO_OPS_", "DAGSTER_"))}
    return subprocess.run(
        [script, *argv[1:], "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )


def chart_code_server_command(deployment: dict[str, Any]) -> list[str]:
    """What the chart's user-deployment template runs for a deployment with
    ``dagsterApiGrpcArgs`` (helm/dagster/charts/dagster-user-deployments/templates/
    deployment-user.yaml): ``dagster api grpc -h 0.0.0.0 -p <port>`` plus those args."""
    return [
        "dagster", "api", "grpc", "-h", "0.0.0.0", "-p", str(deployment["port"]),
        *deployment["dagsterApiGrpcArgs"],
    ]  # fmt: skip


def chart_code_server_probe(deployment: dict[str, Any]) -> list[str]:
    """The exec command the chart gives the code server's probes when none is set."""
    return ["dagster", "api", "grpc-health-check", "-p", str(deployment["port"])]


def kustomize(directory: Path) -> list[dict[str, Any]] | None:
    """``kubectl kustomize directory`` rendered offline, or None without kubectl."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    proc = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]
