"""Who is speaking: this process's resource attributes (OpenTelemetry's word for them).

Every structured log event (:mod:`qo_ops.platform.observability.events`) carries them, and
so does the resource of every trace (:mod:`qo_ops.platform.observability.tracing`).

``service.name`` (``qo-ops``) and ``service.version`` (the installed package's version) are
always there, and nothing in the environment changes them. Where the process is deployed,
the environment says where it runs. The environment is read once per process, from two
sources:

- Each attribute of :data:`DEPLOYMENT_ATTRIBUTES` comes from the variable named like it
  (``k8s.pod.name`` from ``K8S_POD_NAME``). deploy/ fills these from the Kubernetes
  downward API (``docs/deploy.md``).
- ``OTEL_RESOURCE_ATTRIBUTES`` (``key=value,…``, with values percent-encoded) is the
  OpenTelemetry SDK's own variable, which platforms fill. For example, the OpenTelemetry
  Operator injects ``k8s.pod.name=…`` and the like. A named variable wins over the same key
  here.

Values come from the environment, so each is checked before it is used. A Kubernetes name
must be a valid one, and a digest must be ``algorithm:hex``. Any other key must be short and
plain, and its value short, printable and unchanged by :func:`qo_ops.errors.redact`. At most
:data:`MAX_ATTRIBUTES` are taken from ``OTEL_RESOURCE_ATTRIBUTES``. A value that fails a
check, or is empty, is left out. It never becomes ``unknown`` or ``""``. Its variable is
named in :attr:`ProcessResource.rejected`, but the value itself is never repeated.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from urllib.parse import unquote

import qo_ops
from qo_ops.errors import redact

SERVICE_NAME = "qo-ops"
OTEL_RESOURCE_ATTRIBUTES = "OTEL_RESOURCE_ATTRIBUTES"
MAX_ATTRIBUTES = 32  # from OTEL_RESOURCE_ATTRIBUTES; the OpenTelemetry Operator injects ~8
MAX_VALUE_CHARS = 255


@dataclass(frozen=True)
class Rule:
    """What a value of one attribute must look like."""

    pattern: re.Pattern[str]
    max_chars: int

    def accepts(self, value: str) -> bool:
        return len(value) <= self.max_chars and self.pattern.fullmatch(value) is not None


_DNS_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
DNS_LABEL = Rule(re.compile(_DNS_LABEL), 63)  # namespaces, containers (RFC 1123 label)
DNS_SUBDOMAIN = Rule(re.compile(rf"{_DNS_LABEL}(?:\.{_DNS_LABEL})*"), 253)  # pods
JOB_NAME = Rule(DNS_SUBDOMAIN.pattern, 63)  # a Job's name is also its pods' label value
IMAGE_DIGEST = Rule(re.compile(r"[a-z0-9]+(?:[+._-][a-z0-9]+)*:[a-zA-Z0-9=_-]{32,}"), 160)
_OTHER_KEY = Rule(re.compile(r"[A-Za-z][A-Za-z0-9_.-]*"), 64)
_OTHER_VALUE = Rule(re.compile(r"[\x20-\x7e]+"), MAX_VALUE_CHARS)  # printable ASCII

DEPLOYMENT_ATTRIBUTES: dict[str, tuple[str, Rule]] = {
    "k8s.namespace.name": ("K8S_NAMESPACE_NAME", DNS_LABEL),
    "k8s.pod.name": ("K8S_POD_NAME", DNS_SUBDOMAIN),
    "k8s.container.name": ("K8S_CONTAINER_NAME", DNS_LABEL),
    "k8s.job.name": ("K8S_JOB_NAME", JOB_NAME),
    "container.image.digest": ("CONTAINER_IMAGE_DIGEST", IMAGE_DIGEST),
}
"""attribute -> (the environment variable deploy/ sets, what a value must look like)"""

_OWN = ("service.name", "service.version")  # qo-ops sets these, never the environment


@dataclass(frozen=True)
class ProcessResource:
    """The resource attributes of a process, and what the environment offered that was left
    out.

    ``rejected`` holds variable names, and ``OTEL_RESOURCE_ATTRIBUTES:<key>`` for one pair of
    that variable."""

    attributes: Mapping[str, str]
    rejected: tuple[str, ...] = ()


@cache
def package_version() -> str:
    """The installed qo-ops distribution's version, or the source tree's when it is not
    installed."""
    try:
        return metadata.version(SERVICE_NAME)
    except metadata.PackageNotFoundError:
        return qo_ops.__version__


def detect(environ: Mapping[str, str]) -> ProcessResource:
    """The resource attributes ``environ`` describes (see the module docstring)."""
    attributes = {"service.name": SERVICE_NAME, "service.version": package_version()}
    rejected: list[str] = []
    offered = _otel_resource_attributes(environ.get(OTEL_RESOURCE_ATTRIBUTES, ""), rejected)
    for key, value in offered.items():
        if key in _OWN:
            continue
        rule = DEPLOYMENT_ATTRIBUTES[key][1] if key in DEPLOYMENT_ATTRIBUTES else _OTHER_VALUE
        if rule.accepts(value) and _plain(key, value):
            attributes[key] = value
        else:
            rejected.append(f"{OTEL_RESOURCE_ATTRIBUTES}:{key}")
    for key, (variable, rule) in DEPLOYMENT_ATTRIBUTES.items():
        value = environ.get(variable, "").strip()
        if not value:
            continue  # unset, or a downward-API label the pod does not have
        if rule.accepts(value):
            attributes[key] = value
        else:
            rejected.append(variable)
    # Each variable is named once, not a thousand times for a thousand bad pairs.
    return ProcessResource(attributes, tuple(dict.fromkeys(rejected))[:MAX_ATTRIBUTES])


def _plain(key: str, value: str) -> bool:
    """Whether the pair is plain.

    It must hold nothing secret-looking, meaning nothing that redaction would change. It
    must also hold no ``$(VAR)`` that Kubernetes left unexpanded because VAR was not
    defined."""
    return "$(" not in value and redact(f"{key}={value}") == f"{key}={value}"


def _otel_resource_attributes(text: str, rejected: list[str]) -> dict[str, str]:
    """The pairs of an ``OTEL_RESOURCE_ATTRIBUTES`` value, read as the OpenTelemetry SDK
    reads it.

    Values are percent-decoded, and empty ones are dropped. A pair without a plain key is
    rejected."""
    pairs: dict[str, str] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, equals, value = (part.strip() for part in item.partition("="))
        if not equals or not _OTHER_KEY.accepts(key):
            rejected.append(OTEL_RESOURCE_ATTRIBUTES)  # the key itself may not be shown
        elif len(pairs) >= MAX_ATTRIBUTES:
            rejected.append(f"{OTEL_RESOURCE_ATTRIBUTES}:{key}")
        elif value := unquote(value).strip():
            pairs[key] = value
    return pairs


@cache
def process_resource() -> ProcessResource:
    """This process's resource, read from ``os.environ`` on first use and kept.

    The environment of a process does not change, and every event reuses the same
    attributes."""
    return detect(os.environ)
