"""Test scaffolding, never shipped: a stand-in for the node's kubelet and the Job controller.

The emulator only stores objects. This plays the rest of the cluster in one namespace: it runs the
pods a test creates (the code location, the daemon, the webserver), and for each Job the
K8sRunLauncher creates it makes the Job's pod (an object in the emulator,
labelled ``job-name``/``batch.kubernetes.io/job-name``), runs the pod's one container with
podman as its spec says (image, command and args, env with its ``valueFrom``/``envFrom``
sources, configMap, secret, persistentVolumeClaim and emptyDir volumes, user and group,
dropped capabilities, no privilege escalation), and writes the outcome back: the pod's phase
and exit code, the Job's ``active``/``succeeded``/``failed`` counts and conditions, as a Job
with ``backoffLimit: 0`` reports them.

A pod deleted while its container runs is killed at once (SIGKILL: the emulator has no
graceful deletion, so this is ``kubectl delete pod --grace-period=0 --force``, or a lost
node) and its Job counts it failed, as the Job controller does.

``holding()`` leaves new Jobs' pods Pending (scheduled nowhere) inside its block.
What it does not do: scheduling, resource limits (recorded in the Job, not enforced), network policies,
image pulls (the image is local), restarts.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from qo_ops_tests.deploy.cluster.containers import PODMAN_RUN, remove_containers

POLL_S = 0.5


def _now() -> str:
    return datetime.now(tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Pod:
    name: str
    job: str | None  # None: a pod created directly, not by a Job
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    deleted: bool = False


@dataclass(repr=False)
class Kubelet:
    api: str  # the emulator's URL
    namespace: str
    workdir: Path  # volumes, rendered files and each pod's log
    claims: dict[str, Path] = field(default_factory=dict)  # PVC name → host directory
    container_prefix: str = "qo-ops-test-pod-"
    errors: list[str] = field(default_factory=list)
    _pods: dict[str, Pod] = field(default_factory=dict)
    _held: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _client: httpx.Client | None = None

    # -- the test's handle -------------------------------------------------------------------

    def start(self) -> None:
        self._client = httpx.Client(base_url=self.api, timeout=10)
        self._thread = threading.Thread(target=self._loop, name="kubelet", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        remove_containers(self.container_prefix)
        if self._client is not None:
            self._client.close()

    @contextmanager
    def holding(self) -> Iterator[None]:
        """New Jobs' pods stay Pending inside the block; they start once it is left."""
        self._held.set()
        try:
            yield
        finally:
            self._held.clear()

    # The test's thread reads what the kubelet's thread adds to: it reads copies.

    def pod_of(self, job: str) -> str | None:
        return next((p.name for p in list(self._pods.values()) if p.job == job), None)

    def report(self, lines: int = 15) -> str:
        """Every pod's state and the end of its output: what a timed-out test prints."""
        parts = []
        for pod in list(self._pods.values()):
            if pod.process is None:
                state = "pending"
            else:
                code = pod.process.poll()
                state = "running" if code is None else f"exited {code}"
            tail = self.log_of(pod.name).splitlines()[-lines:]
            parts.append(f"--- pod {pod.name} ({state})\n" + "\n".join(tail))
        return "\n".join([f"kubelet errors: {list(self.errors)}", *parts])

    def log_of(self, job_or_pod: str) -> str:
        pods = list(self._pods.values())
        pod = next((p for p in pods if job_or_pod in (p.job, p.name)), None)
        if pod is None or pod.log is None or not pod.log.exists():
            return ""
        return pod.log.read_text(errors="replace")

    # -- the loop ----------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception as exc:  # keep serving; the test reads what went wrong
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self._stop.wait(POLL_S)

    def _step(self) -> None:
        for job in self._list("apis/batch/v1", "jobs"):
            name = job["metadata"]["name"]
            if not any(p.job == name for p in self._pods.values()):
                self._create_pod(job)
        for body in self._list("api/v1", "pods"):
            name = body["metadata"]["name"]
            if name not in self._pods:
                self._pods[name] = Pod(name, None)
        for pod in list(self._pods.values()):
            if pod.process is None and not pod.deleted and not (pod.job and self._held.is_set()):
                self._start(pod)
            elif pod.process is not None and pod.process.poll() is None:
                if self._get("api/v1", "pods", pod.name) is None:
                    self._kill(pod)
            elif pod.process is not None and not pod.deleted and pod.process.returncode is not None:
                self._finished(pod, pod.process.returncode)

    # -- pods --------------------------------------------------------------------------------

    def _create_pod(self, job: dict[str, Any]) -> None:
        name = job["metadata"]["name"]
        pod_name = f"{name}-{len(self._pods):05x}"
        template = job["spec"]["template"]
        labels = {
            **(template.get("metadata", {}).get("labels") or {}),
            "job-name": name,
            "batch.kubernetes.io/job-name": name,
        }
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod_name,
                "namespace": self.namespace,
                "labels": labels,
                "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name}],
            },
            "spec": template["spec"],
            "status": {"phase": "Pending"},
        }
        self._post("api/v1", "pods", body)
        self._patch("apis/batch/v1", "jobs", name, {"status": {"active": 1, "startTime": _now()}})
        self._pods[pod_name] = Pod(pod_name, name)

    def _start(self, pod: Pod) -> None:
        body = self._get("api/v1", "pods", pod.name)
        if body is None:  # deleted while Pending: the Job controller counts it failed
            pod.deleted = True
            self._job_failed(pod.job, "PodDeleted")
            return
        try:
            argv = self._podman_argv(body)
        except ValueError as exc:  # what the kubelet refuses to start (CreateContainerConfigError)
            self.errors.append(f"{pod.name}: {exc}")
            pod.deleted = True
            self._set_pod(pod.name, "Failed", 128, reason="CreateContainerConfigError")
            self._job_failed(pod.job, "CreateContainerConfigError")
            return
        pod.log = self.workdir / f"{pod.name}.log"
        with pod.log.open("wb") as log:
            pod.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self._set_pod(pod.name, "Running", None)

    def _kill(self, pod: Pod) -> None:
        pod.deleted = True
        subprocess.run(
            ["podman", "kill", "--signal", "KILL", self._container(pod.name)], capture_output=True
        )
        if pod.process is not None:
            pod.process.wait(timeout=60)
        self._job_failed(pod.job, "PodDeleted")

    def _finished(self, pod: Pod, code: int) -> None:
        pod.deleted = True  # done: never looked at again
        self._set_pod(pod.name, "Succeeded" if code == 0 else "Failed", code)
        if pod.job is None:
            return
        if code == 0:
            status = {
                "active": 0,
                "succeeded": 1,
                "completionTime": _now(),
                "conditions": [{"type": "Complete", "status": "True"}],
            }
            self._patch("apis/batch/v1", "jobs", pod.job, {"status": status})
        else:
            self._job_failed(pod.job, "BackoffLimitExceeded")

    def _job_failed(self, job: str | None, reason: str) -> None:
        if job is None:
            return
        status = {
            "active": 0,
            "failed": 1,
            "conditions": [{"type": "Failed", "status": "True", "reason": reason}],
        }
        self._patch("apis/batch/v1", "jobs", job, {"status": status})

    def _set_pod(self, name: str, phase: str, code: int | None, reason: str = "") -> None:
        state: dict[str, Any] = {"running": {"startedAt": _now()}}
        if code is not None:
            state = {"terminated": {"exitCode": code, "reason": reason or phase}}
        status = {"phase": phase, "containerStatuses": [{"name": "dagster", "state": state}]}
        if self._get("api/v1", "pods", name) is not None:
            self._patch("api/v1", "pods", name, {"status": status})

    # -- the container -----------------------------------------------------------------------

    def _container(self, pod_name: str) -> str:
        return f"{self.container_prefix}{pod_name}"

    def _podman_argv(self, pod: dict[str, Any]) -> list[str]:
        spec = pod["spec"]
        (container,) = spec["containers"]
        pod_security = spec.get("securityContext") or {}
        security = {**pod_security, **(container.get("securityContext") or {})}
        user, group = security.get("runAsUser"), security.get("runAsGroup")
        if security.get("runAsNonRoot") and not user:
            raise ValueError("runAsNonRoot without a numeric runAsUser")
        argv = [*PODMAN_RUN, "--rm", "--name", self._container(pod["metadata"]["name"])]
        if user is not None:
            argv += ["--user", f"{user}:{group if group is not None else user}"]
        if security.get("allowPrivilegeEscalation") is False:
            argv += ["--security-opt", "no-new-privileges"]
        for cap in (security.get("capabilities") or {}).get("drop", []):
            argv += ["--cap-drop", cap]
        if security.get("readOnlyRootFilesystem"):
            argv += ["--read-only"]
        for name, value in self._env(pod, container).items():
            argv += ["--env", f"{name}={value}"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            source = self._volume(pod, volumes[mount["name"]], pod_security)
            if mount.get("subPath"):
                source = source / mount["subPath"]
            mode = "ro" if mount.get("readOnly") else "rw"
            argv += ["--volume", f"{source}:{mount['mountPath']}:{mode}"]
        if container.get("command"):
            argv += ["--entrypoint", json.dumps(container["command"])]
        return [*argv, container["image"], *container.get("args", [])]

    def _env(self, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                ref = source["configMapRef"]
                data = self._data("configmaps", ref["name"], ref.get("optional", False))
            else:
                ref = source["secretRef"]
                data = self._data("secrets", ref["name"], ref.get("optional", False))
            env.update({source.get("prefix", "") + k: v for k, v in data.items()})
        for var in container.get("env", []):
            value = self._env_value(pod, var)
            if value is not None:
                env[var["name"]] = value
        return env

    def _env_value(self, pod: dict[str, Any], var: dict[str, Any]) -> str | None:
        if "valueFrom" not in var:
            return str(var.get("value", ""))
        source = var["valueFrom"]
        for kind, key in (("secretKeyRef", "secrets"), ("configMapKeyRef", "configmaps")):
            if kind in source:
                ref = source[kind]
                data = self._data(key, ref["name"], ref.get("optional", False))
                if ref["key"] not in data and not ref.get("optional", False):
                    raise ValueError(f"{key} {ref['name']} has no key {ref['key']}")
                return data.get(ref["key"])
        if "fieldRef" in source:
            return _field(pod, source["fieldRef"]["fieldPath"])
        raise ValueError(f"env {var['name']}: valueFrom {sorted(source)} is not supported here")

    def _volume(self, pod: dict[str, Any], volume: dict[str, Any], security: dict) -> Path:
        root = self.workdir / "volumes" / pod["metadata"]["name"] / volume["name"]
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            if claim not in self.claims:
                raise ValueError(f"persistentVolumeClaim {claim} is not bound")
            path = self.claims[claim]
            group = security.get("fsGroup")
            if group is not None:  # what fsGroup does: the volume's group, writable by it
                shutil.chown(path, group=group)
                path.chmod(0o2775)
            return path
        root.mkdir(parents=True, exist_ok=True)
        if "emptyDir" in volume:
            root.chmod(0o1777)
            return root
        for kind, key, name_key in (
            ("configMap", "configmaps", "name"),
            ("secret", "secrets", "secretName"),
        ):
            if kind in volume:
                ref = volume[kind]
                for item, value in self._data(
                    key, ref[name_key], ref.get("optional", False)
                ).items():
                    (root / item).write_text(value)
                    (root / item).chmod(0o644)
                return root
        raise ValueError(f"volume {volume['name']}: {sorted(volume)} is not supported here")

    # -- the API -----------------------------------------------------------------------------

    def _url(self, prefix: str, plural: str, name: str = "") -> str:
        return f"/{prefix}/namespaces/{self.namespace}/{plural}" + (f"/{name}" if name else "")

    def _list(self, prefix: str, plural: str) -> list[dict[str, Any]]:
        assert self._client is not None
        reply = self._client.get(self._url(prefix, plural))
        reply.raise_for_status()
        return [
            o
            for o in reply.json()["items"]
            if o["metadata"].get("namespace") in (None, self.namespace)
        ]

    def _get(self, prefix: str, plural: str, name: str) -> dict[str, Any] | None:
        assert self._client is not None
        reply = self._client.get(self._url(prefix, plural, name))
        if reply.status_code == 404:
            return None
        reply.raise_for_status()
        return reply.json()

    def _post(self, prefix: str, plural: str, body: dict[str, Any]) -> None:
        assert self._client is not None
        self._client.post(self._url(prefix, plural), json=body).raise_for_status()

    def _patch(self, prefix: str, plural: str, name: str, body: dict[str, Any]) -> None:
        assert self._client is not None
        headers = {"content-type": "application/merge-patch+json"}
        self._client.patch(
            self._url(prefix, plural, name), json=body, headers=headers
        ).raise_for_status()

    def _data(self, plural: str, name: str, optional: bool) -> dict[str, str]:
        body = self._get("api/v1", plural, name)
        if body is None:
            if optional:
                return {}
            raise ValueError(f"{plural} {name} does not exist")
        data = dict(body.get("data") or {})
        if plural == "secrets":
            data = {k: base64.b64decode(v).decode() for k, v in data.items()}
            data.update(body.get("stringData") or {})
        return data


_LABEL = re.compile(r"^metadata\.labels\['([^']+)'\]$")


def _field(pod: dict[str, Any], path: str) -> str:
    """The downward API's fieldRef paths the deployment uses."""
    meta = pod["metadata"]
    if path in ("metadata.name", "metadata.namespace"):
        return str(meta[path.split(".")[1]])
    match = _LABEL.match(path)
    if match:
        return str(meta.get("labels", {}).get(match.group(1), ""))
    raise ValueError(f"fieldRef {path} is not supported here")


def wait_until(condition: Callable[[], Any], timeout: float, what: str, kubelet: Kubelet) -> Any:
    """``condition()`` once truthy; on timeout an AssertionError with what every pod said."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}\n{kubelet.report()}")
