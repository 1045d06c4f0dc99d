"""Structured job events (one JSON object per line) and Prometheus metrics.

Events carry the job name, run id, trigger, scope and window. Business row ids appear only
in failure events. Events never carry payloads, lease tokens or personal data.

Every event, and every line the JSON handler writes, also carries the process's resource
attributes (:mod:`qo_ops.platform.observability.resource`). These are ``service.name``,
``service.version`` and, where deployed, the Kubernetes namespace, pod, container, job and
image digest. The process's traces carry the same attributes.

Metric labels are bounded sets declared in code: ``job_name`` and ``status``, ``result``,
``reason``, ``scope``, ``mismatch_type``, ``side_effect``, ``trigger`` and ``error_class``.
A label is never a tenant, an id, a cursor or a message.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from qo_ops.errors import redact
from qo_ops.platform.job.outcome import BatchOutcome, RunSummary
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.job.statuses import RunStatus
from qo_ops.platform.observability.resource import process_resource
from qo_ops.platform.observability.tracing import trace_id

EVENT_LOGGER = "qo_ops.events"
_events = logging.getLogger(EVENT_LOGGER)
_SECRET_KEY = re.compile(r"(password|passwd|secret|token|api_?key|authorization|cookie)$", re.I)
_SAFE_KEYS = {"lock.fencing_token", "fencing_token"}  # counters, not secrets


def redact_value(value: Any, key: str = "") -> Any:
    """Return ``value`` with every string in it redacted (``qo_ops.errors.redact``),
    recursively.

    The value of a key that names a secret becomes ``***``, whatever it is."""
    if key and key not in _SAFE_KEYS and _SECRET_KEY.search(key):
        return "***"
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_value(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_value(v) for v in value]
    return value


class RedactingFilter(logging.Filter):
    """Redacts every record passing through: its message, arguments and event payload."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.args:
            record.msg = record.getMessage()
            record.args = None
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        event = getattr(record, "event", None)
        if isinstance(event, dict):
            record.event = redact_value(event)
        return True


REDACTION = RedactingFilter()
_events.addFilter(REDACTION)  # any handler of job events (a CLI, Dagster) sees them redacted
_events.setLevel(logging.INFO)


_resource_lock = threading.Lock()
_resource_reported = False


def resource_fields(logger: logging.Logger | None = None) -> Mapping[str, str]:
    """The process's resource attributes, computed once (:func:`process_resource`).

    The first call given a ``logger`` logs a warning there, once per process
    (``telemetry.resource.rejected``). The warning names the variables whose value was left
    out, never the values."""
    global _resource_reported
    found = process_resource()
    if logger is not None and not _resource_reported:
        with _resource_lock:
            first, _resource_reported = not _resource_reported, True
        if first and found.rejected:
            warning = {
                "event.name": "telemetry.resource.rejected",
                "variables": list(found.rejected),
                **found.attributes,
            }
            logger.warning(json.dumps(warning), extra={"event": warning})
    return found.attributes


class JsonLineFormatter(logging.Formatter):
    """Render a record as one JSON line, with the process's resource attributes.

    A job event gives its fields. A plain log call gives its logger and its redacted
    message."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
        }
        event = getattr(record, "event", None)
        if isinstance(event, dict):
            payload.update(event)
        else:  # a plain log call gives its redacted message
            payload.update(logger=record.name, message=record.getMessage())
        payload.update(resource_fields())  # an event already has these same values
        return json.dumps(payload, default=str, sort_keys=False)


def json_log_handler(stream: Any = None) -> logging.Handler:
    """A handler that writes JSON lines to ``stream`` (default stderr) and redacts each
    record."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonLineFormatter())
    handler.addFilter(REDACTION)
    return handler


def log_event(logger: logging.Logger, level: int, name: str, /, **fields: Any) -> None:
    """Log one structured event.

    The event is ``event.name`` plus ``fields``, redacted, followed by the process's
    resource attributes."""
    event = redact_value({"event.name": name, **fields})
    event.update(resource_fields(logger))  # validated once, not redacted per event
    logger.log(level, json.dumps(event, default=str), extra={"event": event})


def configure_event_logging(stream: Any = None, level: int = logging.INFO) -> None:
    """Send job events as JSON lines to ``stream`` (default stderr). Calling it again does
    nothing."""
    if any(getattr(h, "_qo_ops", False) for h in _events.handlers):
        return
    handler = json_log_handler(stream)
    handler._qo_ops = True  # type: ignore[attr-defined]
    _events.addHandler(handler)
    _events.setLevel(level)
    _events.propagate = False


@dataclass
class EventContext:
    """The fields every event of one run carries."""

    job_name: str
    run_id: str
    trigger: str
    scope: str
    mode: str
    window_start: str | None = None
    window_end: str | None = None
    progress_interval_s: float = 10.0
    _last_progress: float | None = field(default=None, repr=False)  # so the first always goes out

    def emit(self, name: str, level: int = logging.INFO, /, **fields: Any) -> None:
        """Emit event ``name`` with this run's identity and ``fields``."""
        event = {
            "event.name": name,
            "job.name": self.job_name,
            "job.run_id": self.run_id,
            "job.trigger": self.trigger,
            "job.scope": self.scope,
            "job.mode": self.mode,
            "job.window.start": self.window_start,
            "job.window.end": self.window_end,
        }
        current_trace = trace_id()
        if current_trace is not None:
            event["trace.id"] = current_trace
        event.update(fields)
        event = redact_value(event)
        event.update(resource_fields(_events))  # validated once, not redacted per event
        # The message is the event itself, so handlers that only print messages (Dagster's
        # log manager) show it whole.
        _events.log(level, json.dumps(event, default=str), extra={"event": event})

    def progress(self, force: bool = False, /, **fields: Any) -> None:
        """Emit ``job.progress`` at most once per ``progress_interval_s``."""
        now = time.monotonic()
        if (
            force
            or self._last_progress is None
            or now - self._last_progress >= self.progress_interval_s
        ):
            self._last_progress = now
            self.emit("job.progress", **fields)


class JobMetrics:
    """The seed's job metrics, in a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.started = Counter("job_started_total", "Runs started", ["job_name"], registry=r)
        self.completed = Counter(
            "job_completed_total", "Runs finished, by status", ["job_name", "status"], registry=r
        )
        self.failed = Counter(
            "job_failed_total",
            "Runs that failed, by error class",
            ["job_name", "error_class"],
            registry=r,
        )
        self.skipped = Counter(
            "job_skipped_total", "Runs skipped (lease held elsewhere)", ["job_name"], registry=r
        )
        self.duration = Histogram(
            "job_duration_seconds",
            "Run duration",
            ["job_name", "status"],
            buckets=(0.1, 0.5, 1, 5, 15, 60, 300, 900, 1800, 3600, 7200),
            registry=r,
        )
        self.items_processed = Counter(
            "job_items_processed_total", "Items processed", ["job_name"], registry=r
        )
        self.items_failed = Counter(
            "job_items_failed_total", "Items failed", ["job_name", "error_class"], registry=r
        )
        self.lag = Gauge(
            "job_lag_seconds", "Age of the oldest eligible item", ["job_name"], registry=r
        )
        self.last_success = Gauge(
            "job_last_success_timestamp_seconds",
            "When an execute run last ended in one of its job's fresh statuses",
            ["job_name"],
            registry=r,
        )
        self.lock_failed = Counter(
            "job_lock_acquire_failed_total", "Lease acquisitions refused", ["job_name"], registry=r
        )
        self.retry_scheduled = Counter(
            "job_retry_scheduled_total", "Item retries scheduled", ["job_name"], registry=r
        )
        self.deadletter = Counter(
            "job_deadletter_total", "Items dead-lettered", ["job_name"], registry=r
        )
        self.duplicates_prevented = Counter(
            "job_duplicate_side_effect_prevented_total",
            "Side effects not repeated because their business key existed",
            ["job_name"],
            registry=r,
        )

    def count_batch(self, job_name: str, outcome: BatchOutcome) -> None:
        """Count a recorded batch: its items, its failures by class, retries, dead letters
        and duplicates prevented."""
        self.items_processed.labels(job_name).inc(outcome.processed)
        for _, error_class in outcome.failed_items:
            self.items_failed.labels(job_name, error_class).inc()
        if outcome.failed and not outcome.failed_items:
            self.items_failed.labels(job_name, "unknown").inc(outcome.failed)
        self.retry_scheduled.labels(job_name).inc(outcome.retry_scheduled)
        self.deadletter.labels(job_name).inc(outcome.deadlettered)
        self.duplicates_prevented.labels(job_name).inc(outcome.duplicates_prevented)

    def count_run(self, spec: JobSpec, summary: RunSummary, seconds: float) -> None:
        """Count a finished run by status and duration, and as skipped or failed by class.

        It also sets the last success as the exporter counts it: an execute that ended in
        one of the job's fresh statuses."""
        job_name, status = spec.name, summary.status
        self.completed.labels(job_name, status).inc()
        self.duration.labels(job_name, status).observe(seconds)
        if status == RunStatus.SKIPPED:
            self.skipped.labels(job_name).inc()
        if status == RunStatus.FAILED:
            self.failed.labels(job_name, summary.error_code or "unknown").inc()
        if summary.mode == "execute" and status in spec.fresh_statuses:
            self.last_success.labels(job_name).set(time.time())


METRICS = JobMetrics()
