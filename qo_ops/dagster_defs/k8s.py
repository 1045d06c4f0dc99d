"""The run pod of each job on Kubernetes: its CPU and memory, from the catalog, as the
``dagster-k8s/config`` tag that dagster-k8s's ``K8sRunLauncher`` reads (``docs/deploy.md``).
Other run launchers ignore the tag, so the local instance runs exactly as before."""

from __future__ import annotations

import json
from typing import Any

from qo_ops.platform.spec import JobSpec

K8S_CONFIG_TAG = "dagster-k8s/config"


def run_pod_resources(spec: JobSpec) -> dict[str, Any]:
    """Kubernetes ``resources`` of the run container of ``spec``: requests and a memory limit;
    no CPU limit (a throttled batch only holds its row locks longer)."""
    wanted = spec.run_resources
    return {
        "requests": {"cpu": wanted.cpu_request, "memory": wanted.memory_request},
        "limits": {"memory": wanted.memory_limit},
    }


def k8s_config_tag(spec: JobSpec) -> dict[str, str]:
    """The run tag carrying ``spec``'s run pod resources (a JSON string, as dagster-k8s reads it)."""
    config = {"container_config": {"resources": run_pod_resources(spec)}}
    return {K8S_CONFIG_TAG: json.dumps(config, sort_keys=True)}
