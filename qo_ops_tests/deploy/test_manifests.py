"""The Kubernetes manifests beside the chart (``deploy/k8s``): operator API, metrics
exporter, settings, archive volume, network policies, ingress, the pre-upgrade migration Job,
the owner's shell and the Secrets template.

Each object is validated offline against the strict schemas of two Kubernetes versions
(kubernetes-validate); each kustomization renders with ``kubectl kustomize`` when kubectl is
installed. Then the wiring no schema sees: every container command parses, every Secret and
ConfigMap it reads exists, each database role has its own Secret used only by its own
process, the API reaches the full webserver the chart makes and nothing else does, and every
qo-ops container runs the same image as the code location, as the image's non-root user.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest

from qo_ops.db import roles
from qo_ops_tests.deploy.files import (
    BASE_IMAGE_TOOLS,
    IMAGE_SCRIPTS,
    K8S_VERSIONS,
    MANIFESTS,
    RELEASE,
    REPO,
    SECRETS_TEMPLATE,
    VARIABLE,
    Manifest,
    by_name,
    chart_fullname,
    console_script_distribution,
    containers,
    dockerfile,
    kustomize,
    manifests,
    of_kind,
    pod_spec,
    resource_env_errors,
    run_help,
    secret_key_refs,
    user_deployment,
    validate_k8s,
    values,
    walk,
    workloads,
)

# Which Secret carries which login, and who may read it (docs/security.md): one role each.
OWNER = "qo-ops-db-owner"
DATABASE_SECRETS = {
    OWNER: "qo_ops_owner",
    "qo-ops-db-runner": f"{roles.RUNNER}_login",
    "qo-ops-db-api": f"{roles.API}_login",
    "qo-ops-db-readonly": "qo_ops_metrics_login",
}
ROLE_OF_LOGIN = {
    f"{roles.RUNNER}_login": roles.RUNNER,
    f"{roles.API}_login": roles.API,
    "qo_ops_metrics_login": roles.READONLY,
}
# Workload (or "chart:qo-ops", the code location and its runs) → the one Secret it reads.
READERS = {
    "chart:qo-ops": "qo-ops-db-runner",
    "Deployment/qo-ops-api": "qo-ops-db-api",
    "Deployment/qo-ops-metrics": "qo-ops-db-readonly",
    "Job/qo-ops-migrate": OWNER,
    "Pod/qo-ops-owner-shell": OWNER,
}
IMAGE = "{repository}:{tag}".format(**user_deployment()["image"])


def _ids(found: list[Manifest]) -> list[str]:
    return [f"{m.path.name}:{m.kind}/{m.name}" for m in found]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("manifest", manifests(), ids=_ids(list(manifests())))
def test_every_manifest_is_valid_kubernetes(manifest, version):
    validate_k8s(manifest.body, version)


def test_the_validator_refuses_what_kubernetes_would():
    """Strict: an unknown field fails, and so does a wrong type (not a no-op validator)."""
    api = by_name("Deployment", "qo-ops-api").body
    broken = {**api, "spec": {**api["spec"], "replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError, match="replica"):
        validate_k8s(broken, K8S_VERSIONS[0])
    with pytest.raises(kubernetes_validate.ValidationError, match="two"):
        validate_k8s({**api, "spec": {**api["spec"], "replicas": "two"}}, K8S_VERSIONS[-1])


def test_each_kustomization_lists_its_folder_and_renders():
    folders = sorted({p.parent for p in MANIFESTS.rglob("kustomization.yaml")})
    assert folders == [MANIFESTS, MANIFESTS / "admin", MANIFESTS / "upgrade"]
    for folder in folders:
        kustomization = (folder / "kustomization.yaml").read_text()
        listed = set(re.findall(r"^\s*-\s*(\S+\.yaml)\s*$", kustomization, re.M))
        present = {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml"}
        assert listed == present - {SECRETS_TEMPLATE.name}, folder  # Secrets are made by hand
        rendered = kustomize(folder)
        if rendered is None:
            continue  # kubectl not installed: the files themselves are validated above
        expected = {(m.kind, m.name) for m in manifests() if m.path.parent == folder}
        expected -= {("Secret", m.name) for m in of_kind("Secret")}
        assert {(d["kind"], d["metadata"]["name"]) for d in rendered} == expected


# ------------------------------------------------------------------------- commands


def _commands() -> list[tuple[str, list[str]]]:
    found = []
    for manifest in workloads():
        for container in containers(pod_spec(manifest)):
            argv = [*container.get("command", []), *container.get("args", [])]
            assert argv, f"{manifest}: {container['name']} relies on the image's default"
            found.append((f"{manifest}:{container['name']}", argv))
    return found


@pytest.mark.parametrize(("where", "argv"), _commands(), ids=[w for w, _ in _commands()])
def test_every_container_command_exists_in_the_image_and_parses(where, argv):
    if argv[0] in BASE_IMAGE_TOOLS:
        return
    assert argv[0] in IMAGE_SCRIPTS, f"{where}: {argv[0]} is not a command of the image"
    assert console_script_distribution(argv[0]) == IMAGE_SCRIPTS[argv[0]]
    proc = run_help(argv)
    assert proc.returncode == 0, f"{where}: {argv}: {proc.stderr[-2000:]}"


def test_ports_probes_and_services_line_up():
    for manifest in workloads():
        for container in containers(pod_spec(manifest)):
            ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
            argv = [*container.get("command", []), *container.get("args", [])]
            if "--port" in argv:
                assert int(argv[argv.index("--port") + 1]) in ports.values(), manifest
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                check = container.get(probe, {})
                for action in ("httpGet", "tcpSocket"):
                    if action in check:
                        assert check[action]["port"] in ports, f"{manifest}: {probe}"
    for service in of_kind("Service"):
        selector = service.body["spec"]["selector"]
        targets = [
            m
            for m in workloads()
            if m.kind == "Deployment"
            and selector.items() <= m.body["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(targets) == 1, f"{service} selects {len(targets)} Deployments"
        named = {p["name"] for c in containers(pod_spec(targets[0])) for p in c.get("ports", [])}
        for port in service.body["spec"]["ports"]:
            assert port["targetPort"] in named, f"{service}: {port['targetPort']}"


# ------------------------------------------------------------------------- secrets


def _secret_template() -> dict[str, dict[str, str]]:
    return {m.name: dict(m.body["stringData"]) for m in of_kind("Secret")}


def test_the_secrets_template_holds_placeholders_only():
    for name, data in _secret_template().items():
        for key, value in data.items():
            assert "CHANGE-ME" in value, f"{name}.{key}: a template, never a real value"


def test_each_role_has_its_own_secret_with_its_own_login():
    template = _secret_template()
    assert set(DATABASE_SECRETS) <= set(template)
    security = (REPO / "docs" / "security.md").read_text()
    for secret, login in DATABASE_SECRETS.items():
        url = urlsplit(template[secret]["url"])
        assert url.scheme == "postgresql" and url.username == login, secret
        assert url.path == "/qo_ops", "qo-ops' own database, never Dagster's"
        if login in ROLE_OF_LOGIN:  # the login docs/security.md tells the DBA to create
            role = ROLE_OF_LOGIN[login]
            assert f"CREATE ROLE {login} LOGIN PASSWORD '…' IN ROLE {role};" in security
    dagster = values()["global"]["postgresqlSecretName"]
    assert set(template[dagster]) == {"postgresql-password"}, "the key the chart reads"


def test_every_secret_read_exists_and_each_process_reads_only_its_roles_secret():
    template = _secret_template()
    read = {"chart:qo-ops": secret_key_refs(user_deployment())}
    for manifest in workloads():
        read[f"{manifest.kind}/{manifest.name}"] = secret_key_refs(pod_spec(manifest))
    everything = set().union(*read.values()) | secret_key_refs(values())
    for name, key in everything:
        assert key in template.get(name, {}), f"Secret {name} (key {key}) is not in the template"
    for reader, refs in read.items():
        databases = {name for name, _ in refs if name in DATABASE_SECRETS}
        assert databases == {READERS[reader]}, f"{reader} reads {databases}"


# ------------------------------------------------------------------------- wiring


def test_every_qo_ops_setting_named_is_one_qo_ops_reads():
    source = "\n".join(p.read_text() for p in (REPO / "qo_ops").rglob("*.py"))
    names = {
        node["name"] for node in walk([m.body for m in manifests()]) if isinstance(node, dict)
        and isinstance(node.get("name"), str) and node["name"].startswith("QO_OPS_")
    }  # fmt: skip
    names |= set(by_name("ConfigMap", "qo-ops-settings").body["data"])
    assert names
    for name in names:
        assert f'"{name}"' in source, f"{name} is set but qo-ops never reads it"


def test_the_api_reaches_the_full_webserver_and_the_code_location_by_their_chart_names():
    env = {
        e["name"]: e.get("value")
        for e in pod_spec(by_name("Deployment", "qo-ops-api"))["containers"][0]["env"]
    }
    webserver = values()["dagsterWebserver"]
    service = f"{RELEASE}-{webserver['nameOverride']}"
    assert env["QO_OPS_DAGSTER_URL"] == f"http://{service}:{webserver['service']['port']}"
    assert env["QO_OPS_DAGSTER_LOCATION"] == user_deployment()["name"]
    assert urlsplit(env["QO_OPS_DAGSTER_PUBLIC_URL"]).scheme == "https"


def test_only_the_api_may_reach_the_full_webserver():
    webserver = values()["dagsterWebserver"]
    policy = by_name("NetworkPolicy", "qo-ops-dagster-webserver-internal").body["spec"]
    assert policy["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/instance": RELEASE,
        "component": "dagster-webserver",  # the chart's label; the read-only one differs
    }
    api_labels = by_name("Deployment", "qo-ops-api").body["spec"]["template"]["metadata"]
    [rule] = policy["ingress"]
    [source] = rule["from"]
    assert source["podSelector"]["matchLabels"].items() <= api_labels["labels"].items()
    assert [p["port"] for p in rule["ports"]] == [webserver["service"]["port"]]
    code = by_name("NetworkPolicy", "qo-ops-code-location").body["spec"]
    assert code["podSelector"]["matchLabels"]["deployment"] == user_deployment()["name"]
    assert [p["port"] for p in code["ingress"][0]["ports"]] == [user_deployment()["port"]]


def test_what_comes_in_from_outside_is_tls_and_never_the_full_webserver():
    webserver = values()["dagsterWebserver"]
    full = f"{RELEASE}-{webserver['nameOverride']}"
    read_only = f"{full}-read-only"
    assert webserver["enableReadOnly"] is True and values()["ingress"]["enabled"] is False
    services = {m.name for m in of_kind("Service")} | {read_only, "oauth2-proxy"}
    backends = set()
    for ingress in of_kind("Ingress"):
        spec = ingress.body["spec"]
        hosts = {rule["host"] for rule in spec["rules"]}
        assert hosts <= {h for t in spec["tls"] for h in t["hosts"]}, f"{ingress}: no TLS"
        for rule in spec["rules"]:
            for path in rule["http"]["paths"]:
                name = path["backend"]["service"]["name"]
                assert name != full, f"{ingress} exposes the full webserver"
                assert name in services, f"{ingress}: no Service {name}"
                backends.add(name)
                if name == read_only:
                    assert "nginx.ingress.kubernetes.io/auth-url" in ingress.body["metadata"].get(
                        "annotations", {}
                    ), "people sign in before they see the UI"
    assert {"qo-ops-api", read_only} <= backends


def test_every_qo_ops_container_runs_the_code_locations_image_as_its_user():
    uid, _, gid = dockerfile().in_stage(-1, "USER")[-1].arguments.partition(":")
    for manifest in workloads():
        spec = pod_spec(manifest)
        assert spec.get("automountServiceAccountToken") is False, manifest
        pod_context = spec["securityContext"]
        assert pod_context["runAsNonRoot"] is True
        assert (pod_context["runAsUser"], pod_context["runAsGroup"]) == (int(uid), int(gid))
        assert pod_context["seccompProfile"]["type"] == "RuntimeDefault"
        for container in containers(spec):
            assert container["image"] == IMAGE, f"{manifest}: one image, one version"
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]
            limits = container["resources"]["limits"]
            assert "memory" in limits and "cpu" not in limits, manifest
            assert set(container["resources"]["requests"]) == {"cpu", "memory"}


def test_every_qo_ops_container_says_where_it_runs_from_the_downward_api():
    """Namespace and pod from the downward API, the container's own name, the Job's name on a
    Job's pods, the image digest when the release step wrote it: what qo-ops puts on every log
    line and trace (docs/deploy.md). Dagster's own CLI (`dagster instance migrate`) logs
    nothing of qo-ops', so its container needs none."""
    checked = []
    for manifest in workloads():
        for container in containers(pod_spec(manifest)):
            argv = [*container.get("command", []), *container.get("args", [])]
            if argv[0] == "dagster":
                continue
            errors = resource_env_errors(
                container.get("env", []), container["name"], in_job=manifest.kind == "Job"
            )
            assert errors == [], f"{manifest}: {container['name']}: {errors}"
            checked.append(container["name"])
    assert sorted(checked) == ["api", "exporter", "qo-ops-db-upgrade", "shell"]


def test_a_container_that_misnames_itself_is_noticed():
    spec = pod_spec(by_name("Deployment", "qo-ops-api"))
    env = [dict(e) for e in spec["containers"][0]["env"]]
    assert resource_env_errors(env, "api", in_job=False) == []
    renamed = [
        {**e, "value": "qo-ops-api"} if e["name"] == "K8S_CONTAINER_NAME" else e for e in env
    ]
    assert "K8S_CONTAINER_NAME" in "".join(resource_env_errors(renamed, "api", in_job=False))
    no_pod = [e for e in env if e["name"] != "K8S_POD_NAME"]
    assert "K8S_POD_NAME: missing" in "".join(resource_env_errors(no_pod, "api", in_job=False))
    assert resource_env_errors(env, "api", in_job=True) != []  # a Job's pod names its Job


def test_the_migration_job_migrates_both_schemas_with_their_owners():
    job = by_name("Job", "qo-ops-migrate")
    spec = pod_spec(job)
    assert job.body["spec"]["backoffLimit"] == 0 and spec["restartPolicy"] == "Never"
    [upgrade] = spec["initContainers"]
    [migrate] = spec["containers"]
    assert upgrade["args"][:3] == ["qo-ops", "db", "upgrade"]
    assert "--contract" not in upgrade["args"]  # expand steps only: the old release runs on
    assert migrate["args"] == ["dagster", "instance", "migrate"]
    assert secret_key_refs(upgrade) == {(OWNER, "url")}
    storage_secret = values()["global"]["postgresqlSecretName"]
    password = {e["name"]: e for e in migrate["env"]}["DAGSTER_PG_PASSWORD"]
    assert password["valueFrom"]["secretKeyRef"] == {
        "name": storage_secret,
        "key": "postgresql-password",
    }
    [mount] = migrate["volumeMounts"]
    assert mount["mountPath"] == f"{values()['global']['dagsterHome']}/dagster.yaml"
    volume = {v["name"]: v for v in spec["volumes"]}[mount["name"]]
    assert volume["configMap"]["name"] == f"{chart_fullname()}-instance", "the chart's instance"


def test_volume_mounts_name_declared_volumes():
    for manifest in workloads():
        spec = pod_spec(manifest)
        volumes = {v["name"] for v in spec.get("volumes", [])}
        for container in containers(spec):
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, f"{manifest}: {mount['name']}"
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    assert by_name("ConfigMap", source["configMapRef"]["name"])
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert by_name(
                    "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]
                )


def test_the_manifest_files_are_where_the_docs_say():
    deploy_doc = (REPO / "docs" / "deploy.md").read_text()
    for path in sorted(MANIFESTS.rglob("*.yaml")):
        relative = Path(path).relative_to(REPO).as_posix()
        if path.name != "kustomization.yaml":
            assert relative in deploy_doc, f"docs/deploy.md does not mention {relative}"
    texts = [deploy_doc, *(p.read_text() for p in (REPO / "deploy").rglob("*.yaml"))]
    texts.append((REPO / "Dockerfile").read_text())
    for text in texts:  # and every deploy/ path they name exists
        for named in re.findall(r"deploy/[\w./-]+\.yaml", text):
            assert (REPO / named).exists(), f"{named} is named but does not exist"


def test_the_resource_variables_are_in_the_docs():
    """docs/deploy.md names each variable deploy/ sets and the attribute it fills."""
    deploy_doc = (REPO / "docs" / "deploy.md").read_text()
    for attribute, variable in VARIABLE.items():
        assert f"`{attribute}`" in deploy_doc and f"`{variable}`" in deploy_doc, attribute
