"""The Prometheus exporter (``qo-ops metrics``): job metrics derived from the database, so
they stay right across many short run processes (``docs/observability.md``).

- Gauges (last success, last status, failure streak, running, leases, checkpoint age) are
  read on each scrape with index-backed queries (``gauges.py``).
- Backlog, lag and dead letters are read by a background thread at most every
  ``refresh_s`` seconds (one capped query per tenant); a scrape serves the last values
  (``backlog.py``).
- Counters and the duration histogram follow the run records: the first scrape reads every
  retained run once, each later scrape only the runs created or finished since the
  previous one (indexes on ``created_at`` and ``finished_at``), so a restarted exporter
  counts the same totals again instead of going down. The database sums the runs per job
  and status, so the first scrape over many runs is one aggregate query, not a row each
  (``feed.py``; served by ``counters.py`` and ``histograms.py``).
- Suspensions (the kill switch, ``job_control``, a few rows) are read on each scrape: whether
  a job is suspended for every scope, how many suspensions it has, the oldest one's age.
  Tenants suspended on their own are left out of the failure streak, backlog and lag: their
  runs and items wait on purpose, and the alerts built on those gauges must not fire for it.

- The downstream's circuit breakers (``downstream_breaker``, a row per downstream origin) are
  read on each scrape: state and open time per origin. The runs' calls to it (retries, calls
  not sent, rate-limit pauses, breaker transitions) are counters over their tallies.

Labels come from fixed lists (the catalog, words in the code) or, for ``downstream``, an
origin (scheme://host:port): a suspension's tenant, reason and author, or a breaker's reason,
never become a label or a value.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime

import sqlalchemy as sa
from prometheus_client.core import GaugeMetricFamily, Metric
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from qo_ops.metrics.backlog import BacklogSampler
from qo_ops.metrics.counters import counter_families
from qo_ops.metrics.feed import MISSED_LOOKBACK_S, RunFeed
from qo_ops.metrics.gauges import (
    breaker_families,
    catalog_families,
    downstream_label,
    queue_families,
    run_families,
    schema_families,
    suspended_tenants,
    suspension_families,
)
from qo_ops.platform.actions.control import suspensions
from qo_ops.platform.actions.status import breaker_status
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.observability.events import log_event
from qo_ops.platform.schedule.run_queue import read_run_queue

log = logging.getLogger("qo_ops.metrics")

_CLOCK = sa.text("SELECT clock_timestamp()")


class JobCollector:
    """A prometheus_client collector over the catalog's jobs and the database."""

    def __init__(
        self,
        engine: Engine,
        specs: Iterable[JobSpec],
        refresh_s: float = 30.0,
        suspension_alert_after_s: float = 86400.0,
        missed_lookback_s: float = MISSED_LOOKBACK_S,
        clock: Callable[[], datetime] | None = None,
        downstreams: Iterable[str] = (),
    ) -> None:
        self.engine = engine
        self.specs = list(specs)
        # origins served as closed breakers until a run writes a row (the configured one)
        self.downstreams = [downstream_label(d) for d in downstreams]
        self._clock = clock  # None: the database's; a test may freeze it
        self.refresh_s = refresh_s
        self.suspension_alert_after_s = suspension_alert_after_s
        self._feed = RunFeed(self.specs, missed_lookback_s)
        self._slow = BacklogSampler(engine, self.specs)
        self._lock = threading.Lock()  # one scrape at a time advances the feed
        self._up = 1.0

    def refresh_slow(self) -> None:
        """Backlog, lag and dead letters of every job (capped, one query per tenant)."""
        self._slow.refresh()

    def run_refresher(self, stop: threading.Event) -> None:
        """Keep the slow gauges fresh until ``stop`` is set (a daemon thread's loop)."""
        while not stop.is_set():
            try:
                self.refresh_slow()
            except DBAPIError as exc:
                log_event(
                    log, logging.WARNING, "metrics.refresh_failed", error=type(exc.orig).__name__
                )
            stop.wait(self.refresh_s)

    def collect(self) -> Iterator[Metric]:
        """One scrape: the feed advanced, the gauges read, every family served."""
        up = GaugeMetricFamily("qo_ops_database_up", "1 if the last read of the database worked")
        try:
            with self._lock, self.engine.connect() as conn:
                self._feed.advance(conn)
                held = suspensions(conn)
                now = conn.execute(_CLOCK).scalar_one()
                self._feed.judge_missed(conn, self._clock() if self._clock else now)
                now_families = [
                    *run_families(conn, self.specs, suspended_tenants(held)),
                    *queue_families(self.specs, read_run_queue(conn)),
                    *suspension_families(self.specs, held, now),
                    *breaker_families(self.downstreams, breaker_status(conn)),
                    *schema_families(conn),
                ]
            self._up = 1.0
        except DBAPIError as exc:
            log_event(log, logging.WARNING, "metrics.scrape_failed", error=type(exc.orig).__name__)
            self._up, now_families = 0.0, []
        up.add_metric([], self._up)
        yield up
        yield from catalog_families(self.specs, self.suspension_alert_after_s)
        yield from now_families
        yield from self._slow.families()
        yield from counter_families(self._feed)
        yield from self._feed.histograms.families([s.name for s in self.specs])
