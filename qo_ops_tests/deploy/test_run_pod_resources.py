"""Each catalog job's run pod resources: declared once in the catalog (``JobSpec.deployment.run_resources``,
plain data), carried by the job's ``dagster-k8s/config`` run tag, which dagster-k8s's
``K8sRunLauncher`` reads and every other launcher ignores."""

from __future__ import annotations

import json

import pytest

from qo_ops.dagster_defs.k8s import K8S_CONFIG_TAG
from qo_ops.definitions import build_definitions
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.job.resources import RunResources, memory_bytes
from qo_ops_tests.deploy.files import K8S_VERSIONS, validate_k8s

# The top-level keys dagster-k8s accepts in the tag (dagster_k8s.job.USER_DEFINED_K8S_JOB_CONFIG_SCHEMA)
TAG_KEYS = {
    "container_config",
    "pod_template_spec_metadata",
    "pod_spec_config",
    "job_config",
    "job_metadata",
    "job_spec_config",
    "merge_behavior",
}


@pytest.fixture(scope="module")
def run_tags():
    with pytest.MonkeyPatch.context() as env:  # a code location in the chart's pod
        env.setenv("K8S_POD_NAME", "qo-ops-code-location-0")
        defs = build_definitions()
    return {name: dict(defs.resolve_job_def(name).run_tags) for name in CATALOG}


def test_every_jobs_runs_carry_its_catalog_resources(run_tags):
    """The tag is on the job's run tags, which schedules, sensors, backfills, the API's
    launches and run retries all copy onto each run."""
    for name, spec in CATALOG.items():
        config = json.loads(run_tags[name][K8S_CONFIG_TAG])
        assert set(config) <= TAG_KEYS
        assert config == {
            "container_config": {
                "resources": {
                    "requests": {
                        "cpu": spec.deployment.run_resources.cpu_request,
                        "memory": spec.deployment.run_resources.memory_request,
                    },
                    "limits": {"memory": spec.deployment.run_resources.memory_limit},
                }
            }
        }, name
        assert run_tags[name]["qo_ops/job"] == name  # the job's other tags stay


def test_the_heavy_jobs_ask_for_more_than_the_default(run_tags):
    default = RunResources()
    # audit_archive holds a Parquet chunk (batch_size records) in memory
    archive = CATALOG["audit_archive"].deployment.run_resources
    assert memory_bytes(archive.memory_limit) > memory_bytes(default.memory_limit)
    assert memory_bytes(archive.memory_request) > memory_bytes(default.memory_request)
    cleanup = CATALOG[
        "temp_file_cleanup"
    ].deployment.run_resources  # hashes every object it deletes
    assert cleanup.cpu_request != default.cpu_request
    tags = {run_tags[name][K8S_CONFIG_TAG] for name in CATALOG}
    assert len(tags) >= 3, "the default plus the two heavy jobs"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_tags_resources_are_valid_kubernetes(run_tags, version):
    for name in CATALOG:
        container = json.loads(run_tags[name][K8S_CONFIG_TAG])["container_config"]
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "run"},
            "spec": {"containers": [{"name": "run", "image": "qo-ops", **container}]},
        }
        validate_k8s(pod, version)


def test_run_resources_refuse_what_kubernetes_would_refuse():
    with pytest.raises(ValueError, match="cpu_request"):
        RunResources(cpu_request="a quarter")
    with pytest.raises(ValueError, match="memory"):
        RunResources(memory_request="512MB")  # decimal units are not accepted here
    with pytest.raises(ValueError, match="exceeds"):
        RunResources(memory_request="2Gi", memory_limit="1Gi")
    assert memory_bytes("1536Mi") == memory_bytes("1Gi") + 512 * 2**20
    assert RunResources(cpu_request="1.5").cpu_request == "1.5"


def test_outside_a_kubernetes_pod_runs_carry_no_pod_size(monkeypatch):
    """`make ui` and the demo: no dagster-k8s/config JSON on every row of the Runs list
    (issue 41); no run launcher there reads it."""
    for name in ("K8S_POD_NAME", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(name, raising=False)
    defs = build_definitions()
    for name in CATALOG:
        tags = defs.resolve_job_def(name).run_tags
        assert K8S_CONFIG_TAG not in tags and tags["qo_ops/job"] == name, name
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")  # any pod, chart or not
    tags = build_definitions().resolve_job_def("quote_expiration").run_tags
    assert K8S_CONFIG_TAG in tags
