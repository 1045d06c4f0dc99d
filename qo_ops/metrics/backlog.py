"""Backlog, lag and dead letters of every job: sampled by the exporter's background thread
at most every ``refresh_s`` seconds (one capped query per tenant), and served by each scrape
from the last sample. Tenants suspended on their own are left out: their items wait on
purpose, and the alerts built on these gauges must not fire for it."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import sqlalchemy as sa
from prometheus_client.core import GaugeMetricFamily, Metric
from sqlalchemy.engine import Engine

from qo_ops.metrics.gauges import suspended_tenants
from qo_ops.platform.actions.control import suspensions
from qo_ops.platform.job.outcome import BatchContext
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.run.selection import capped_count

BACKLOG_CAP_PER_TENANT = 10_000

# Every tenant: a tenant job's backlog is the sum of theirs.
_TENANTS = sa.text("SELECT id FROM tenant ORDER BY id")


class BacklogSampler:
    """The last sample of the slow gauges, replaced whole by each ``refresh``."""

    def __init__(self, engine: Engine, specs: list[JobSpec]) -> None:
        self.engine = engine
        self.specs = specs
        self._lock = threading.Lock()
        self._values: dict[str, dict[str, float]] = {}

    def refresh(self) -> None:
        """Backlog, lag and dead letters of every job (capped, one query per tenant)."""
        values: dict[str, dict[str, float]] = {
            "job_backlog_items": {},
            "job_lag_seconds": {},
            "job_deadletter_items": {},
        }
        with self.engine.connect() as conn:
            tenants = list(conn.execute(_TENANTS).scalars())
            paused = suspended_tenants(suspensions(conn))
            for spec in self.specs:
                if spec.signals.dead_letters is not None:
                    values["job_deadletter_items"][spec.name] = float(
                        spec.signals.dead_letters(conn)
                    )
                if spec.partitioning != "tenant" or not spec.signals.reports_backlog:
                    continue  # a windowed job's backlog belongs to its windows
                backlog, worst = 0, 0.0
                for tenant in tenants:
                    if tenant in paused.get(spec.name, ()):
                        continue  # its items wait on purpose until it is resumed
                    ctx = BatchContext(spec.name, Scope(tenant), "dry_run", uuid.uuid4())
                    backlog += capped_count(conn, spec.eligible(ctx), BACKLOG_CAP_PER_TENANT)
                    if spec.signals.lag is not None:
                        worst = max(worst, spec.signals.lag(conn, ctx) or 0.0)
                values["job_backlog_items"][spec.name] = float(backlog)
                if spec.signals.lag is not None:
                    values["job_lag_seconds"][spec.name] = worst
        with self._lock:
            self._values = values

    def families(self) -> Iterator[Metric]:
        """The last sample's gauges (families without series before the first ``refresh``)."""
        with self._lock:
            slow = self._values
        texts = {
            "job_backlog_items": f"Eligible items, each tenant counted up to {BACKLOG_CAP_PER_TENANT}",
            "job_lag_seconds": "Age of the oldest eligible item, worst tenant",
            "job_deadletter_items": "Items dead-lettered now and not requeued",
        }
        for name, text in texts.items():
            family = GaugeMetricFamily(name, text, labels=["job_name"])
            for job, value in sorted(slow.get(name, {}).items()):
                family.add_metric([job], value)
            yield family
