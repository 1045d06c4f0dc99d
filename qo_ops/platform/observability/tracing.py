"""OpenTelemetry traces of runs. Tracing is off unless configured.

Each run has one root span (``Job <name>``). Its child spans cover the lease acquisition,
each batch, each checkpoint update and each downstream call (:func:`client_span`). The spans
carry the seed's attributes: ``job.name``, ``job.run_id``, ``job.trigger``, ``job.status``,
``items.processed`` and ``items.failed``. A batch span never carries item ids. The run's
trace id is in every event the run logs (``trace.id``).

:func:`configure_from_env` configures tracing from the environment. The CLI and the Dagster
code location call it. When ``QO_OPS_OTLP_ENDPOINT`` is set (e.g.
``http://collector:4318/v1/traces``), spans are exported over OTLP/HTTP. When it is unset,
tracing is off and every span is a no-op.

Every span's resource is the process's (:func:`trace_resource`). It holds the attributes
that the log events carry (:mod:`qo_ops.platform.observability.resource`) and the SDK's
``telemetry.sdk.*``. Tests install their own provider with :func:`use_provider`, using an
in-memory exporter through :func:`build_provider`.

While tracing is off, nothing here imports OpenTelemetry. A span is then :data:`OFF`, which
takes attributes and keeps none, and a run's events carry no trace id.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import urlsplit

from qo_ops.config import OTLP_ENV
from qo_ops.errors import ConfigError
from qo_ops.platform.observability.resource import process_resource

if TYPE_CHECKING:
    from opentelemetry import trace

_provider: Any = None  # an SDK TracerProvider once configured; None while tracing is off
T = TypeVar("T")


class SpanLike(Protocol):
    """What the platform does with a span: set its attributes."""

    def set_attribute(self, key: str, value: Any) -> None: ...


class _Off:
    """The span while tracing is off: it takes attributes and keeps none."""

    def set_attribute(self, key: str, value: Any) -> None:
        pass


OFF: SpanLike = _Off()


def use_provider(provider: Any) -> None:
    """Trace with ``provider`` from now on (None switches tracing off)."""
    global _provider
    _provider = provider


def configure_from_env(environ: dict[str, str] | None = None) -> None:
    """Export spans over OTLP/HTTP when ``QO_OPS_OTLP_ENDPOINT`` is set. This happens once
    per process."""
    env = os.environ if environ is None else environ
    endpoint = (env.get(OTLP_ENV) or "").strip()
    if not endpoint or _provider is not None:
        return
    if not endpoint.startswith(("http://", "https://")):
        raise ConfigError(f"{OTLP_ENV} must be an http(s) URL")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    use_provider(build_provider(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint))))


def trace_resource() -> Any:
    """The SDK ``Resource`` of this process's spans.

    It holds the process's validated resource attributes (:func:`process_resource`) and
    ``telemetry.sdk.*``. It does not use ``Resource.create``, which would add
    ``OTEL_RESOURCE_ATTRIBUTES`` again, unchecked."""
    from opentelemetry.sdk import resources
    from opentelemetry.sdk.version import __version__ as sdk_version

    return resources.Resource(
        {
            resources.TELEMETRY_SDK_LANGUAGE: "python",
            resources.TELEMETRY_SDK_NAME: "opentelemetry",
            resources.TELEMETRY_SDK_VERSION: sdk_version,
            **process_resource().attributes,
        }
    )


def build_provider(processor: Any) -> Any:
    """An SDK ``TracerProvider`` whose spans carry :func:`trace_resource` and go through
    ``processor`` (a span processor)."""
    from opentelemetry.sdk.trace import TracerProvider

    provider = TracerProvider(resource=trace_resource())
    provider.add_span_processor(processor)
    return provider


def tracer() -> trace.Tracer:
    """The qo-ops tracer (a no-op one while tracing is off)."""
    from opentelemetry import trace

    if _provider is None:
        return trace.NoOpTracer()
    found: trace.Tracer = _provider.get_tracer("qo_ops")
    return found


@contextmanager
def span(name: str, **attributes: Any) -> Iterator[SpanLike]:
    """A span named ``name``, a child of the current one, with ``attributes``.

    Attributes that are None are dropped. While tracing is off, the span is :data:`OFF`."""
    if _provider is None:
        yield OFF
        return
    with tracer().start_as_current_span(
        name, attributes={k: v for k, v in attributes.items() if v is not None}
    ) as current:
        yield current


def trace_id() -> str | None:
    """The current trace's id (32 hex digits), or None when not tracing."""
    if _provider is None:
        return None
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def in_current_context(call: Callable[[T], Any]) -> Callable[[T], Any]:
    """Wrap ``call`` to run in the caller's trace context, for worker threads.

    While tracing is off, this returns ``call`` itself."""
    if _provider is None:
        return call
    from opentelemetry import context as otel_context

    captured = otel_context.get_current()

    def run(item: T) -> Any:
        token = otel_context.attach(captured)
        try:
            return call(item)
        finally:
            otel_context.detach(token)

    return run


class ClientCall:
    """The span of one outgoing HTTP request, open while it runs (:func:`client_span`)."""

    def __init__(self, current: trace.Span) -> None:
        self.span = current

    def set_answer(self, status: int) -> None:
        """Record the answer's status. As this is a client span, 4xx and 5xx mark it as an
        error."""
        from opentelemetry import trace

        self.span.set_attribute("http.response.status_code", status)
        if status >= 400:
            self.span.set_attribute("error.type", str(status))
            self.span.set_status(trace.Status(trace.StatusCode.ERROR))

    def set_failure(self, kind: str) -> None:
        """Record that no answer came. ``kind`` names why, such as a timeout or a reset, and
        never holds a payload."""
        self.span.set_attribute("error.type", kind)


def client_span(
    name: str, method: str, url: str, headers: dict[str, str]
) -> AbstractContextManager[ClientCall | None]:
    """A CLIENT span for one outgoing HTTP request, a child of the current span.

    ``name`` is a path template such as ``POST /fulfilment/deliveries``, with no ids. The
    span has the HTTP attributes of OpenTelemetry's semantic conventions. The trace context
    goes into ``headers`` (W3C ``traceparent``), so the server can join the trace. While
    tracing is off, this is a no-op that yields ``None``."""
    if _provider is None:
        return nullcontext()
    return _client_span(name, method, url, headers)


@contextmanager
def _client_span(name: str, method: str, url: str, headers: dict[str, str]) -> Iterator[ClientCall]:
    from opentelemetry import propagate, trace

    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    attributes: dict[str, str | int] = {
        "http.request.method": method,
        "url.full": f"{parts.scheme}://{host}:{port}{parts.path}",  # no credentials, no query
        "server.address": host,
        "server.port": port,
    }
    with tracer().start_as_current_span(
        name, kind=trace.SpanKind.CLIENT, attributes=attributes
    ) as current:
        propagate.inject(headers)
        yield ClientCall(current)
