"""The run pod of each job on Kubernetes: its CPU and memory, from the catalog, as the
``dagster-k8s/config`` tag that dagster-k8s's ``K8sRunLauncher`` reads (``docs/deploy.md``).
The tag is put on the job only when its code location runs in a Kubernetes pod (the chart
gives it ``K8S_POD_NAME``; Kubernetes gives every pod ``KUBERNETES_SERVICE_HOST``): other run
launchers ignore it, and elsewhere (``make ui``) it is a JSON blob on every row of the Runs
list."""

from __future__ import annotations

import json
import os
from typing import Any

from qo_ops.platform.job.spec import JobSpec

K8S_CONFIG_TAG = "dagster-k8s/config"
IN_A_POD_ENV = ("K8S_POD_NAME", "KUBERNETES_SERVICE_HOST")  # either: the code location is in one


def run_pod_resources(spec: JobSpec) -> dict[str, Any]:
    """Kubernetes ``resources`` of the run container of ``spec``: requests and a memory limit;
    no CPU limit (a throttled batch only holds its row locks longer)."""
    wanted = spec.deployment.run_resources
    return {
        "requests": {"cpu": wanted.cpu_request, "memory": wanted.memory_request},
        "limits": {"memory": wanted.memory_limit},
    }


def k8s_config_tag(spec: JobSpec) -> dict[str, str]:
    """The run tag carrying ``spec``'s run pod resources (a JSON string, as dagster-k8s reads
    it); none outside a Kubernetes pod."""
    if not any(os.environ.get(name) for name in IN_A_POD_ENV):
        return {}
    config = {"container_config": {"resources": run_pod_resources(spec)}}
    return {K8S_CONFIG_TAG: json.dumps(config, sort_keys=True)}
