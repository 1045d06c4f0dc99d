"""``qo-ops metrics``: serve the exporter on a port, or print one scrape (``--once``)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Annotated

import typer

from qo_ops.errors import BadInput, ConfigError

REFRESH_ENV = "QO_OPS_METRICS_REFRESH_S"
SUSPENSION_ALERT_ENV = "QO_OPS_SUSPENSION_ALERT_AFTER_S"


def _seconds(name: str, default: float, low: float, high: float) -> float:
    """A number of seconds from environment variable ``name``, within [low, high]."""
    raw = os.environ.get(name, "").strip() or str(default)
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not low <= value <= high:
        raise ConfigError(f"{name} must be a number of seconds between {low:g} and {high:g}")
    return value


def metrics_command(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port of /metrics.")] = 9464,
    once: Annotated[
        bool, typer.Option("--once", help="Print one scrape to stdout and exit.")
    ] = False,
) -> None:
    """Serve job metrics derived from the database, for Prometheus (docs/observability.md)."""
    from prometheus_client import CollectorRegistry, generate_latest, start_http_server

    from qo_ops.db import migrate
    from qo_ops.db.engine import get_engine
    from qo_ops.downstream.calls import origin
    from qo_ops.downstream.client import DOWNSTREAM_URL_ENV, downstream_url
    from qo_ops.jobs.catalog import CATALOG
    from qo_ops.metrics.exporter import JobCollector
    from qo_ops.platform.observability.events import json_log_handler

    if not 1 <= port <= 65535:
        raise BadInput("--port must be between 1 and 65535")
    refresh = _seconds(REFRESH_ENV, 30, 1, 3600)
    # how long a job may stay suspended before QoOpsJobSuspendedTooLong (default: one day)
    suspension_alert_after = _seconds(SUSPENSION_ALERT_ENV, 86400, 60, 30 * 86400)
    # the configured downstream's breaker is served (closed) before any run opens it
    downstreams = (
        [origin(downstream_url())] if os.environ.get(DOWNSTREAM_URL_ENV, "").strip() else []
    )
    engine = get_engine()
    migrate.require_current(engine)
    collector = JobCollector(
        engine,
        CATALOG.values(),
        refresh_s=refresh,
        suspension_alert_after_s=suspension_alert_after,
        downstreams=downstreams,
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    if once:
        collector.refresh_slow()
        typer.echo(generate_latest(registry).decode(), nl=False)
        return
    metrics_log = logging.getLogger("qo_ops.metrics")
    metrics_log.addHandler(json_log_handler(sys.stdout))
    metrics_log.setLevel(logging.INFO)
    metrics_log.propagate = False
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server, thread = start_http_server(port, addr=host, registry=registry)
    typer.echo(f'{{"event": "metrics.listening", "host": "{host}", "port": {port}}}', err=True)
    refresher = threading.Thread(target=collector.run_refresher, args=(stop,), daemon=True)
    refresher.start()
    stop.wait()
    server.shutdown()
    thread.join(timeout=5)
