"""OpenTelemetry traces of runs: off unless configured.

One root span per run (``Job <name>``) with child spans for the lease acquisition, each
batch, each checkpoint update and each downstream call (httpx instrumentation), carrying the
seed's attributes: ``job.name``, ``job.run_id``, ``job.trigger``, ``job.status``,
``items.processed``, ``items.failed`` — never item ids on a batch span. The run's trace id is
in every event the run logs (``trace.id``).

Configured from the environment by :func:`configure_from_env` (the CLI and the Dagster code
location call it): ``QO_OPS_OTLP_ENDPOINT`` (e.g. ``http://collector:4318/v1/traces``)
exports spans over OTLP/HTTP; unset, tracing is off and every span is a no-op. Tests install
their own provider with :func:`use_provider` (an in-memory exporter).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace

from qo_ops.errors import ConfigError

OTLP_ENV = "QO_OPS_OTLP_ENDPOINT"
SERVICE_NAME = "qo-ops"

_provider: Any = None  # an SDK TracerProvider once configured; None: tracing off
T = TypeVar("T")


def use_provider(provider: Any) -> None:
    """Trace with ``provider`` from now on (None switches tracing off)."""
    global _provider
    _provider = provider


def configure_from_env(environ: dict[str, str] | None = None) -> None:
    """Export spans over OTLP/HTTP when ``QO_OPS_OTLP_ENDPOINT`` is set (once per process)."""
    env = os.environ if environ is None else environ
    endpoint = (env.get(OTLP_ENV) or "").strip()
    if not endpoint or _provider is not None:
        return
    if not endpoint.startswith(("http://", "https://")):
        raise ConfigError(f"{OTLP_ENV} must be an http(s) URL")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    use_provider(provider)


def tracer() -> trace.Tracer:
    """The qo-ops tracer (a no-op one while tracing is off)."""
    if _provider is None:
        return trace.NoOpTracer()
    return _provider.get_tracer("qo_ops")


@contextmanager
def span(name: str, **attributes: Any) -> Iterator[trace.Span]:
    """A span named ``name``, child of the current one, with ``attributes`` (None dropped)."""
    with tracer().start_as_current_span(
        name, attributes={k: v for k, v in attributes.items() if v is not None}
    ) as current:
        yield current


def trace_id() -> str | None:
    """The current trace's id (32 hex digits), or None when not tracing."""
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None


def in_current_context(call: Callable[[T], Any]) -> Callable[[T], Any]:
    """``call`` wrapped to run in the caller's trace context (for worker threads)."""
    captured = otel_context.get_current()

    def run(item: T) -> Any:
        token = otel_context.attach(captured)
        try:
            return call(item)
        finally:
            otel_context.detach(token)

    return run


def instrument_httpx(client: Any) -> None:
    """Make each request of this httpx client a span (only while tracing is on)."""
    if _provider is None:
        return
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

    HTTPXClientInstrumentor.instrument_client(client, tracer_provider=_provider)
