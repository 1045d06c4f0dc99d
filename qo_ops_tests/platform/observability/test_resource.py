"""Who is speaking: every JSON event and every span of a process carries its resource
attributes, ``service.name`` and ``service.version`` always and, where deployed, the
Kubernetes namespace, pod, container and job and the image digest, read from the
environment deploy/ fills from the downward API (and from ``OTEL_RESOURCE_ATTRIBUTES``).

Checked on a real ``qo-ops run`` in an environment like a run pod's, its spans caught by a
real OTLP/HTTP receiver on loopback, as a collector would get them. Values the environment
gets wrong are left out: they never break a run, never appear, and are named once.

Tests ``qo_ops.platform.observability.resource``.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from qo_ops.demo.data import load_demo_data
from qo_ops.platform.observability import resource
from qo_ops.platform.observability.events import (
    EVENT_LOGGER,
    EventContext,
    json_log_handler,
    log_event,
    resource_fields,
)
from qo_ops.platform.observability.resource import (
    DEPLOYMENT_ATTRIBUTES,
    MAX_ATTRIBUTES,
    MAX_VALUE_CHARS,
    detect,
    package_version,
    process_resource,
)
from qo_ops_tests.conftest import base_env, run_cli

AS_OF = datetime(2026, 3, 1, tzinfo=UTC)
JOB = "quote_expiration"
TENANT = "tenant-001"
RUN_ID = "5f1c9e2a-7b3d-4e8f-9a10-6c2b8d4e1f3a"
DIGEST = "sha256:" + "3f9a" * 16
SERVICE = {"service.name": "qo-ops", "service.version": package_version()}
# What a run pod's environment holds (deploy/helm/values.yaml): the downward API's namespace,
# pod and Job label, the run container's name, the digest ConfigMap; and what a platform's
# OpenTelemetry Operator would inject beside it.
POD_ENV = {
    "K8S_NAMESPACE_NAME": "qo-ops",
    "K8S_POD_NAME": f"dagster-run-{RUN_ID}-x7k2p",
    "K8S_CONTAINER_NAME": "dagster",
    "K8S_JOB_NAME": f"dagster-run-{RUN_ID}",
    "CONTAINER_IMAGE_DIGEST": DIGEST,
    "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment.name=staging,k8s.node.name=node-a",
}
POD_RESOURCE = {
    **SERVICE,
    "deployment.environment.name": "staging",
    "k8s.node.name": "node-a",
    "k8s.namespace.name": "qo-ops",
    "k8s.pod.name": f"dagster-run-{RUN_ID}-x7k2p",
    "k8s.container.name": "dagster",
    "k8s.job.name": f"dagster-run-{RUN_ID}",
    "container.image.digest": DIGEST,
}
RESOURCE_VARIABLES = {v for v, _ in DEPLOYMENT_ATTRIBUTES.values()} | {"OTEL_RESOURCE_ATTRIBUTES"}


class OtlpReceiver:
    """An OTLP/HTTP trace endpoint on 127.0.0.1 (protobuf, as the SDK's exporter sends it):
    keeps every export request it answers."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        received = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                received.append(request)  # before answering: the exporter waits for it
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}/v1/traces"

    def resources(self) -> list[dict[str, str]]:
        """The resource attributes of every batch of spans received."""
        return [
            {a.key: a.value.string_value for a in spans.resource.attributes}
            for request in self.requests
            for spans in request.resource_spans
        ]

    def spans(self) -> list[tuple[str, str]]:
        """(name, trace id in hex) of every span received."""
        return [
            (span.name, span.trace_id.hex())
            for request in self.requests
            for spans in request.resource_spans
            for scope in spans.scope_spans
            for span in scope.spans
        ]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def collector() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture
def demo(db):
    load_demo_data(db.engine, tenants=1, quotes=60, seed=3, as_of=AS_OF)
    return db


def pod_env(db, collector: OtlpReceiver, **variables: str) -> dict[str, str]:
    """The test process's environment without anything that names a resource (the machine
    running the suite may be a pod itself), plus the database, the collector and ``variables``."""
    env = {
        k: v
        for k, v in base_env(QO_OPS_DATABASE_URL=db.env_url).items()
        if k not in RESOURCE_VARIABLES and not k.startswith("OTEL_")
    }
    env.update(QO_OPS_OTLP_ENDPOINT=collector.url, NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")
    env.update(variables)
    return env


def dry_run(env: dict[str, str]) -> tuple[list[dict], str]:
    """``qo-ops run`` of the job over the tenant, dry-run: its JSON events and its stdout."""
    result = run_cli(["run", JOB, "--tenant", TENANT, "--mode", "dry-run"], env)
    assert result.code == 0, result.stderr
    events = [json.loads(line) for line in result.stderr.splitlines()]  # every line is JSON
    assert events and all(isinstance(e, dict) for e in events)
    return events, result.stdout + result.stderr


def resource_of(event: dict) -> dict[str, str]:
    """The resource attributes of an event: the keys the resource may have, as logged."""
    return {k: v for k, v in event.items() if k in POD_RESOURCE}


# ------------------------------------------------------------------------- a run pod


def test_a_run_in_a_pods_environment_names_it_on_every_event_and_span(demo, collector):
    events, _ = dry_run(pod_env(demo, collector, **POD_ENV))

    names = [e["event.name"] for e in events]
    assert names[0] == "job.started" and names[-1] == "job.finished", names
    assert "telemetry.resource.rejected" not in names
    for event in events:
        assert resource_of(event) == POD_RESOURCE, event["event.name"]

    # the spans, as a collector received them when the command exited
    resources = collector.resources()
    assert resources, "no spans exported"
    for attributes in resources:
        sdk = {k: v for k, v in attributes.items() if k.startswith("telemetry.sdk.")}
        assert sdk.get("telemetry.sdk.language") == "python"
        assert {k: v for k, v in attributes.items() if k not in sdk} == POD_RESOURCE
    roots = [trace for name, trace in collector.spans() if name == f"Job {JOB}"]
    assert len(roots) == 1
    assert {e["trace.id"] for e in events} == set(roots), "events and spans of one run"


def test_values_the_environment_gets_wrong_are_left_out_and_named_once(demo, collector):
    secret = "hunter2-5b1e"
    bad = {
        "K8S_NAMESPACE_NAME": "$(K8S_NAMESPACE_NAME)",  # Kubernetes could not expand it
        "K8S_POD_NAME": "p" * 254,  # longer than any pod name
        "K8S_CONTAINER_NAME": "Dagster Run\x1b[31m",  # not a container name
        "K8S_JOB_NAME": "",  # a downward-API label the pod does not have
        "CONTAINER_IMAGE_DIGEST": f"postgresql://qo:{secret}@db/qo_ops",
        "OTEL_RESOURCE_ATTRIBUTES": (
            f"db.password={secret},k8s.node.name=node-a,{secret},"
            "k8s.cluster.name=$(CLUSTER),service.name=not-qo-ops"
        ),
    }
    events, output = dry_run(pod_env(demo, collector, **bad))

    assert secret not in output and "p" * 254 not in output and "$(" not in output
    rejected = [e for e in events if e["event.name"] == "telemetry.resource.rejected"]
    assert len(rejected) == 1 and rejected[0]["level"] == "WARNING"
    assert sorted(rejected[0]["variables"]) == sorted(
        [
            "K8S_NAMESPACE_NAME",
            "K8S_POD_NAME",
            "K8S_CONTAINER_NAME",
            "CONTAINER_IMAGE_DIGEST",
            "OTEL_RESOURCE_ATTRIBUTES",  # a pair without a key: not even its key is shown
            "OTEL_RESOURCE_ATTRIBUTES:db.password",
            "OTEL_RESOURCE_ATTRIBUTES:k8s.cluster.name",
        ]
    )
    for event in events:  # what was right stays; nothing is "unknown" or empty
        assert resource_of(event) == {**SERVICE, "k8s.node.name": "node-a"}
    assert [{k: v for k, v in r.items() if not k.startswith("telemetry.sdk.")}
            for r in collector.resources()] == [{**SERVICE, "k8s.node.name": "node-a"}] * len(
        collector.resources()
    )  # fmt: skip
    assert collector.resources(), "the run was traced all the same"


# ------------------------------------------------------------------------- every path


def test_every_event_path_carries_the_processs_resource(caplog):
    """EventContext.emit, log_event, and the JSON handler's plain lines: the resource this
    process computed once, whichever way a line is written."""
    fields = dict(resource_fields())
    assert fields == dict(process_resource().attributes)
    assert fields.items() >= SERVICE.items()
    assert process_resource() is process_resource()  # computed once per process

    caplog.set_level(logging.INFO, logger=EVENT_LOGGER)
    EventContext(JOB, "run-1", "manual", TENANT, "dry_run").emit("job.started")
    [record] = [r for r in caplog.records if r.name == EVENT_LOGGER]
    assert json.loads(record.getMessage()).items() >= fields.items()  # what Dagster shows
    assert record.event.items() >= fields.items()

    stream = io.StringIO()
    logger = logging.getLogger("qo_ops.tests.resource")
    logger.addHandler(json_log_handler(stream))
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        log_event(logger, logging.INFO, "api.request", status=200)
        logger.warning("a plain line")
    finally:
        logger.handlers.clear()
    structured, plain = (json.loads(line) for line in stream.getvalue().splitlines())
    assert structured["event.name"] == "api.request" and structured.items() >= fields.items()
    assert plain["message"] == "a plain line" and plain.items() >= fields.items()


# ------------------------------------------------------------------------- the rules


def test_outside_kubernetes_only_the_service_is_named():
    assert detect({}) == resource.ProcessResource(SERVICE, ())
    assert detect({"OTEL_SERVICE_NAME": "other", "K8S_JOB_NAME": "  "}).attributes == SERVICE


def test_a_named_variable_wins_over_otel_resource_attributes_which_is_percent_decoded():
    found = detect(
        {
            "OTEL_RESOURCE_ATTRIBUTES": (
                "k8s.pod.name=from-otel, k8s.namespace.name=qo-ops ,"
                "team=quote%20%26%20order,service.version=9.9,empty="
            ),
            "K8S_POD_NAME": "from-downward-api",
        }
    )
    assert found.rejected == ()
    assert found.attributes == {
        **SERVICE,
        "k8s.pod.name": "from-downward-api",
        "k8s.namespace.name": "qo-ops",
        "team": "quote & order",
    }


def test_values_are_bounded():
    assert detect({"K8S_POD_NAME": "p" * 253}).attributes["k8s.pod.name"] == "p" * 253
    assert detect({"K8S_POD_NAME": "p" * 254}).rejected == ("K8S_POD_NAME",)
    assert "k8s.namespace.name" in detect({"K8S_NAMESPACE_NAME": "n" * 63}).attributes
    assert detect({"K8S_NAMESPACE_NAME": "n" * 64}).rejected == ("K8S_NAMESPACE_NAME",)
    assert detect({"K8S_JOB_NAME": "j" * 64}).rejected == ("K8S_JOB_NAME",)
    assert detect({"CONTAINER_IMAGE_DIGEST": "sha256:abc"}).rejected == ("CONTAINER_IMAGE_DIGEST",)
    other = "OTEL_RESOURCE_ATTRIBUTES"
    assert detect({other: "a=" + "v" * MAX_VALUE_CHARS}).attributes["a"] == "v" * MAX_VALUE_CHARS
    assert detect({other: "a=" + "v" * (MAX_VALUE_CHARS + 1)}).rejected == (f"{other}:a",)
    many = detect({other: ",".join(f"k{n}=v" for n in range(MAX_ATTRIBUTES + 8))})
    assert len(many.attributes) == len(SERVICE) + MAX_ATTRIBUTES
    assert len(many.rejected) == 8
    assert detect({other: "k=" + "x" * 100_000}).attributes == SERVICE
    assert detect({other: "nokey," * 10_000}).rejected == (other,)
    assert (
        len(detect({other: ",".join(f"k{n}=" + "x" * 300 for n in range(99))}).rejected)
        == MAX_ATTRIBUTES
    )
