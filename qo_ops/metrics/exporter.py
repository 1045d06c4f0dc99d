"""The Prometheus exporter (``qo-ops metrics``): job metrics derived from the database, so
they stay right across many short run processes (``docs/observability.md``).

- Gauges (last success, last status, failure streak, running, leases, checkpoint age) are
  read on each scrape with index-backed queries.
- Backlog, lag and dead letters are read by a background thread at most every
  ``refresh_s`` seconds (one capped query per tenant); a scrape serves the last values.
- Counters and the duration histogram follow the run records: the first scrape reads every
  retained run once, each later scrape only the runs created or finished since the
  previous one (indexes on ``created_at`` and ``finished_at``), so a restarted exporter
  counts the same totals again instead of going down. The database sums the runs per job
  and status, so the first scrape over many runs is one aggregate query, not a row each.
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
import re
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from qo_ops.downstream.calls import call_settings
from qo_ops.platform import manners
from qo_ops.platform.breaker import CLOSED
from qo_ops.platform.control import Suspension, suspensions
from qo_ops.platform.missed import MISSED_REASONS, first_scheduled_tick, missed_runs, tick_window_s
from qo_ops.platform.runs import FINAL_STATUSES
from qo_ops.platform.selection import capped_count
from qo_ops.platform.signals import (
    AMBIGUITY_REASONS,
    ITEM_RETRY_EXHAUSTED,
    ITEM_RETRY_PREFIX,
    ITEM_RETRY_REASONS,
    LOCK_RESULTS,
    MANUAL_RERUN_REASONS,
    MANUAL_TRIGGERS,
    OTHER,
    PLATFORM_ERROR_CLASSES,
    RUN_RETRY_REASONS,
)
from qo_ops.platform.spec import (
    CHECKPOINT_RESETS,
    CHECKPOINT_UPDATES,
    SIDE_EFFECT_RESULTS,
    TRIGGERS,
    BatchContext,
    JobSpec,
    Scope,
    cadence_seconds,
    cron_ticks,
    tenant_of,
)
from qo_ops.platform.status import BreakerStatus, breaker_status
from qo_ops.platform.telemetry import log_event

log = logging.getLogger("qo_ops.metrics")

BACKLOG_CAP_PER_TENANT = 10_000
STREAK_WINDOW = 1000  # latest finished execute runs read for the failure streaks
SETTLE_S = 2.0  # rows newer than this may still be in uncommitted transactions
DURATION_BUCKETS = (0.1, 0.5, 1, 5, 15, 60, 300, 900, 1800, 3600, 7200)
FAILING = ("failed", "timeout")
MISSED_LOOKBACK_S = 7 * 86400.0  # a starting exporter judges the ticks of the last week
MAX_TICKS_PER_SCRAPE = 5000  # per job: a long backlog of ticks is judged over a few scrapes


@dataclass(frozen=True)
class _Observed:
    """A group of histogram observations as the queries return them."""

    n: int
    seconds: float
    buckets: list[int]


@dataclass
class _Feed:
    """Counters over the run records, advanced by (timestamp, id) cursors."""

    created_cursor: tuple[datetime, uuid.UUID]
    finished_cursor: tuple[datetime, uuid.UUID]
    started: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    completed: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    failed: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    sums: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    side_effects: dict[tuple[str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    ambiguity: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    missed: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    missed_cursor: dict[str, datetime] = field(default_factory=dict)  # last tick judged
    # (metric, job, label value) → the downstream counters of DOWNSTREAM_COUNTERS
    downstream: dict[tuple[str, str, str], float] = field(
        default_factory=lambda: defaultdict(float)
    )
    # (metric, job, *label values) → the seed's lock, retry, rerun and reconciliation counters
    signals: dict[tuple[str, ...], float] = field(default_factory=lambda: defaultdict(float))
    # (metric, job, *label values) → a histogram's cumulative bucket counts, and their sums
    histograms: dict[tuple[str, ...], list[float]] = field(default_factory=dict)
    histogram_sums: dict[tuple[str, ...], float] = field(default_factory=lambda: defaultdict(float))


# Runs created in (cursor, cutoff), counted per job in the database.
_NEW_RUNS = sa.text(
    """
    SELECT job_name, count(*) AS n FROM job_run
     WHERE created_at < :cutoff AND (created_at, id) > (:ts, :id)
     GROUP BY job_name
    """
)
_BUCKET_COUNTS = ", ".join(f"count(*) FILTER (WHERE seconds <= {b})" for b in DURATION_BUCKETS)
# Runs finished in (cursor, cutoff), summed in the database per job, status and what the
# counters tell apart (error source of a failing run, lease lost, anomaly stop); durations
# bucketed there too. Python adds a few dozen groups, not one row per run.
_FINISHED_RUNS = sa.text(
    f"""
    SELECT job_name, status, error_source, lease_lost, anomaly, count(*) AS n,
           sum(processed_count) AS processed_count, sum(failed_count) AS failed_count,
           sum(retry_scheduled_count) AS retry_scheduled_count,
           sum(deadlettered_count) AS deadlettered_count,
           sum(duplicates_prevented_count) AS duplicates_prevented_count,
           sum(seconds) AS seconds, ARRAY[{_BUCKET_COUNTS}] AS buckets
      FROM (
        SELECT job_name, status,
               CASE WHEN status = ANY(CAST(:failing AS text[]))
                    THEN coalesce(nullif(last_error_code, ''),
                                  CASE WHEN status = 'timeout' THEN 'deadline' END,
                                  status_reason) END AS error_source,
               coalesce(status_reason = 'lease_lost', false)
                 OR coalesce(last_error_code = 'lease_lost', false) AS lease_lost,
               coalesce(last_error_code = 'anomaly_threshold', false) AS anomaly,
               greatest(0, coalesce(extract(epoch FROM finished_at - started_at), 0))::float8
                 AS seconds,
               processed_count, failed_count, retry_scheduled_count, deadlettered_count,
               duplicates_prevented_count
          FROM job_run
         WHERE finished_at IS NOT NULL AND finished_at < :cutoff
           AND (finished_at, id) > (:ts, :id)
      ) AS runs
     GROUP BY job_name, status, error_source, lease_lost, anomaly
    """
)
DRIFT_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600)
_DRIFT_COUNTS = ", ".join(f"count(*) FILTER (WHERE drift <= {b})" for b in DRIFT_BUCKETS)
# Scheduled runs created in (cursor, cutoff): how late each started after its tick.
_NEW_SCHEDULED = sa.text(
    f"""
    SELECT job_name, count(*) AS n, sum(drift) AS seconds, ARRAY[{_DRIFT_COUNTS}] AS buckets
      FROM (SELECT job_name, extract(epoch FROM started_at - scheduled_for)::float8 AS drift
              FROM job_run
             WHERE created_at < :cutoff AND (created_at, id) > (:ts, :id)
               AND scheduled_for IS NOT NULL) AS scheduled
     GROUP BY job_name
    """
)
# The platform's counts in the tallies of runs finished in (cursor, cutoff): side effects by
# result, ambiguity by reason, checkpoint updates and resets, the downstream's manners.
_FINISHED_TALLIES = sa.text(
    r"""
    SELECT job_name, t.key, sum(t.value::bigint) AS n
      FROM job_run, jsonb_each_text(tally) AS t(key, value)
     WHERE finished_at IS NOT NULL AND finished_at < :cutoff AND (finished_at, id) > (:ts, :id)
       AND (t.key LIKE 'side\_effect%' OR t.key LIKE 'checkpoint.%'
            OR t.key LIKE 'downstream.%' OR t.key LIKE 'breaker.%' OR t.key LIKE 'retry%'
            OR job_name = ANY(CAST(:reconciling AS text[])))
     GROUP BY 1, 2
    """
)
LOCK_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5)
_LOCK_COUNTS = ", ".join(
    f"count(*) FILTER (WHERE lock_wait_ms <= {b * 1000})" for b in LOCK_WAIT_BUCKETS
)
_DELAY_COUNTS = ", ".join(f"count(*) FILTER (WHERE delay <= {b})" for b in DRIFT_BUCKETS)
# The seed's lock and run-retry signals of the runs finished in (cursor, cutoff), per job:
# leases taken or found held, how long taking them took, Dagster's run retries (and the
# last of them failing again).
_FINISHED_LOCKS = sa.text(
    f"""
    SELECT job_name,
           count(*) FILTER (WHERE fencing_token IS NOT NULL) AS acquired,
           count(*) FILTER (WHERE status = 'skipped') AS skipped_already_running,
           count(lock_wait_ms) AS waits, coalesce(sum(lock_wait_ms), 0) / 1000.0 AS wait_s,
           ARRAY[{_LOCK_COUNTS}] AS wait_buckets,
           count(*) FILTER (WHERE retry_number > 0) AS run_retries,
           count(*) FILTER (WHERE retry_number > 0 AND retry_number >= coalesce(retries_max, 0)
                              AND status = ANY(CAST(:failing AS text[]))) AS run_exhausted
      FROM job_run
     WHERE finished_at IS NOT NULL AND finished_at < :cutoff AND (finished_at, id) > (:ts, :id)
     GROUP BY job_name
    """
)
# How long the runs finished in (cursor, cutoff) waited to start, per job and trigger: from
# when they were asked for (the Dagster run's creation or the API's acceptance, else the
# tick, else the record's creation) to when the runner started them.
_FINISHED_DELAYS = sa.text(
    f"""
    SELECT job_name, trigger_type, count(*) AS n, sum(delay) AS seconds,
           ARRAY[{_DELAY_COUNTS}] AS buckets
      FROM (SELECT job_name, trigger_type,
                   greatest(0, extract(epoch FROM started_at
                            - coalesce(requested_at, scheduled_for, created_at)))::float8 AS delay
              FROM job_run
             WHERE finished_at IS NOT NULL AND finished_at < :cutoff
               AND (finished_at, id) > (:ts, :id)) AS runs
     GROUP BY job_name, trigger_type
    """
)
# Execute runs a person asked for, finished in (cursor, cutoff), over a scope that had an
# earlier finished execute run: by that run's status (ix_job_run_history, one row each).
_FINISHED_RERUNS = sa.text(
    """
    SELECT r.job_name, previous.status, count(*) AS n
      FROM job_run r
      CROSS JOIN LATERAL (
        SELECT p.status FROM job_run p
         WHERE p.job_name = r.job_name AND p.scope = r.scope AND p.started_at < r.started_at
           AND p.mode = 'execute' AND p.finished_at IS NOT NULL AND p.status <> 'skipped'
           AND p.id <> r.id
         ORDER BY p.started_at DESC LIMIT 1) AS previous
     WHERE r.finished_at IS NOT NULL AND r.finished_at < :cutoff
       AND (r.finished_at, r.id) > (:ts, :id)
       AND r.mode = 'execute' AND r.trigger_type = ANY(CAST(:manual AS text[]))
     GROUP BY 1, 2
    """
)
_CUTOFF = sa.text("SELECT clock_timestamp() - make_interval(secs => :settle)")
_CLOCK = sa.text("SELECT clock_timestamp()")
TALLY_COUNTERS = {
    CHECKPOINT_UPDATES: "job_checkpoint_updates_total",
    CHECKPOINT_RESETS: "job_checkpoint_resets_total",
}
# A run's calls to the downstream (qo_ops.platform.manners): tally key → (metric, label
# value, scale). The label is the metric's one label besides job_name, from this list only.
DOWNSTREAM_COUNTERS: dict[str, tuple[str, str, float]] = {
    manners.CALLS: ("job_downstream_calls_total", "", 1.0),
    manners.RETRIES: ("job_downstream_retries_total", "", 1.0),
    manners.REFUSED_OPEN: ("job_downstream_not_sent_total", "breaker_open", 1.0),
    manners.RETRY_BUDGET_REFUSED: ("job_downstream_not_sent_total", "retry_budget", 1.0),
    manners.RATE_LIMIT_PAUSES: ("job_downstream_rate_limit_pauses_total", "", 1.0),
    manners.RATE_LIMIT_WAIT_MS: ("job_downstream_rate_limit_wait_seconds_total", "", 0.001),
    manners.SPARED: ("job_downstream_spared_total", "", 1.0),
    **{
        manners.BREAKER_PREFIX + state: ("job_breaker_transitions_total", state, 1.0)
        for state in manners.BREAKER_STATES
    },
}
DOWNSTREAM_FAMILIES = {  # metric → (help, its label besides job_name, the label's values)
    "job_downstream_calls_total": ("Calls sent to the downstream", None, ("",)),
    "job_downstream_retries_total": (
        "Calls sent for items that had failed before (retry pressure: retries / calls)",
        None,
        ("",),
    ),
    "job_downstream_not_sent_total": (
        "Calls not sent: the circuit breaker was open, or the run's retry budget was used up",
        "reason",
        ("breaker_open", "retry_budget"),
    ),
    "job_downstream_rate_limit_pauses_total": (
        "429 answers with Retry-After: each paused the run's calls",
        None,
        ("",),
    ),
    "job_downstream_rate_limit_wait_seconds_total": (
        "Time calls waited for the rate limit or a Retry-After, summed over workers",
        None,
        ("",),
    ),
    "job_downstream_spared_total": (
        "Items whose failed attempt was given back: the breaker judged the failure systemic",
        None,
        ("",),
    ),
    "job_breaker_transitions_total": (
        "Circuit breaker transitions made by the job's runs, by the state moved to",
        "to",
        manners.BREAKER_STATES,
    ),
}
# A downstream label is an origin as qo_ops.downstream.calls.origin writes it; anything else
# in the table shows as "other" (never free text in a label)
_ORIGIN = re.compile(r"^https?://[A-Za-z0-9.:\[\]\-]{1,260}:[0-9]{1,5}$")
ITEM_SUMS = {
    "job_items_processed_total": ("processed_count", "Items processed"),
    "job_items_failed_total": ("failed_count", "Items failed"),
    "job_retry_scheduled_total": ("retry_scheduled_count", "Item retries scheduled"),
    "job_deadletter_total": ("deadlettered_count", "Items dead-lettered"),
    "job_duplicate_side_effect_prevented_total": (
        "duplicates_prevented_count",
        "Side effects not repeated because their business key existed",
    ),
}


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
        self.downstreams = [_downstream_label(d) for d in downstreams]
        # the jobs whose runs call the downstream (their counters exist from the first scrape)
        self.calling = [s.name for s in self.specs if s.validate_settings is call_settings]
        self._by_name = {s.name: s for s in self.specs}
        self.reconciling = [s.name for s in self.specs if s.reconciliation is not None]
        # job → the error classes job_failed_total serves it (the platform's, then its own)
        self.error_classes = {
            s.name: tuple(dict.fromkeys((*PLATFORM_ERROR_CLASSES, *s.error_classes)))
            for s in self.specs
        }
        self.missed_lookback_s = missed_lookback_s
        self._clock = clock  # None: the database's; a test may freeze it
        self.refresh_s = refresh_s
        self.suspension_alert_after_s = suspension_alert_after_s
        origin = (datetime(1970, 1, 1, tzinfo=UTC), uuid.UUID(int=0))
        self._feed = _Feed(origin, origin)
        self._lock = threading.Lock()
        self._slow: dict[str, dict[str, float]] = {}
        self._up = 1.0

    # ------------------------------------------------------------------ slow gauges

    def refresh_slow(self) -> None:
        """Backlog, lag and dead letters of every job (capped, one query per tenant)."""
        values: dict[str, dict[str, float]] = {
            "job_backlog_items": {},
            "job_lag_seconds": {},
            "job_deadletter_items": {},
        }
        with self.engine.connect() as conn:
            tenants = list(conn.execute(sa.text("SELECT id FROM tenant ORDER BY id")).scalars())
            paused = _suspended_tenants(suspensions(conn))
            for spec in self.specs:
                if spec.dead_letters is not None:
                    values["job_deadletter_items"][spec.name] = float(spec.dead_letters(conn))
                if spec.partitioning != "tenant" or not spec.reports_backlog:
                    continue  # a windowed job's backlog belongs to its windows
                backlog, worst = 0, 0.0
                for tenant in tenants:
                    if tenant in paused.get(spec.name, ()):
                        continue  # its items wait on purpose until it is resumed
                    ctx = BatchContext(spec.name, Scope(tenant), "dry_run", uuid.uuid4())
                    backlog += capped_count(conn, spec.eligible(ctx), BACKLOG_CAP_PER_TENANT)
                    if spec.lag is not None:
                        worst = max(worst, spec.lag(conn, ctx) or 0.0)
                values["job_backlog_items"][spec.name] = float(backlog)
                if spec.lag is not None:
                    values["job_lag_seconds"][spec.name] = worst
        with self._lock:
            self._slow = values

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

    # ------------------------------------------------------------------ the feed

    def _advance(self, conn: Connection) -> None:
        """Count the runs created and finished in (cursor, now − SETTLE_S); the cursors then
        move to that cutoff (with the lowest id, so a run at the cutoff is counted next)."""
        feed = self._feed
        cutoff = conn.execute(_CUTOFF, {"settle": SETTLE_S}).scalar_one()
        created_ts, created_id = feed.created_cursor
        for g in conn.execute(_NEW_RUNS, {"cutoff": cutoff, "ts": created_ts, "id": created_id}):
            feed.started[g.job_name] += int(g.n)
        finished_ts, finished_id = feed.finished_cursor
        for g in conn.execute(
            _NEW_SCHEDULED, {"cutoff": cutoff, "ts": created_ts, "id": created_id}
        ):
            self._observe("job_scheduler_drift_seconds", (g.job_name,), g)
        finished = {"cutoff": cutoff, "ts": finished_ts, "id": finished_id}
        for g in conn.execute(_FINISHED_RUNS, {**finished, "failing": list(FAILING)}):
            self._count_finished(g)
        for g in conn.execute(_FINISHED_TALLIES, {**finished, "reconciling": self.reconciling}):
            self._count_tally(g.job_name, g.key, int(g.n))
        for g in conn.execute(_FINISHED_LOCKS, {**finished, "failing": list(FAILING)}):
            self._count_locks(g)
        for g in conn.execute(_FINISHED_DELAYS, finished):
            self._observe("job_start_delay_seconds", (g.job_name, g.trigger_type), g)
        for g in conn.execute(_FINISHED_RERUNS, {**finished, "manual": list(MANUAL_TRIGGERS)}):
            if g.status in MANUAL_RERUN_REASONS:
                key = ("job_manual_reruns_total", g.job_name, MANUAL_RERUN_REASONS[g.status])
                self._feed.signals[key] += int(g.n)
        lowest = uuid.UUID(int=0)
        feed.created_cursor = (
            max(created_ts, cutoff),
            lowest if cutoff > created_ts else created_id,
        )
        feed.finished_cursor = (
            max(finished_ts, cutoff),
            lowest if cutoff > finished_ts else finished_id,
        )

    def _count_finished(self, g: Any) -> None:
        """Add one group of finished runs (same job, status and distinguishing fields)."""
        feed = self._feed
        n = int(g.n)
        feed.completed[(g.job_name, g.status)] += n
        if g.status in FAILING:
            feed.failed[(g.job_name, self._error_class(g.job_name, g.error_source))] += n
        for metric, (column, _) in ITEM_SUMS.items():
            feed.sums[(metric, g.job_name)] += int(getattr(g, column) or 0)
        if g.lease_lost:
            feed.sums[("job_lease_lost_total", g.job_name)] += n
        if g.anomaly:
            feed.sums[("job_anomaly_stops_total", g.job_name)] += n
        if g.status == "skipped":
            feed.sums[("job_skipped_total", g.job_name)] += n
        self._observe("job_duration_seconds", (g.job_name, g.status), g)

    def _error_class(self, job: str, code: str | None) -> str:
        """A failed run's error class as a label: one its job declares, else ``other``."""
        return code if code in self.error_classes.get(job, ()) else OTHER

    def _count_locks(self, g: Any) -> None:
        """Leases taken or found held, the time taking them took, Dagster's run retries."""
        signals, job = self._feed.signals, g.job_name
        signals[("job_lock_acquire_total", job, "acquired")] += int(g.acquired)
        signals[("job_lock_acquire_total", job, "skipped_already_running")] += int(
            g.skipped_already_running
        )
        signals[("job_retries_total", job, "run", "worker_crashed")] += int(g.run_retries)
        signals[("job_retry_exhausted_total", job, "run")] += int(g.run_exhausted)
        if g.waits:
            g_wait = _Observed(int(g.waits), float(g.wait_s), list(g.wait_buckets))
            self._observe("job_lock_wait_seconds", (job,), g_wait)

    def _observe(self, metric: str, labels: tuple[str, ...], g: Any) -> None:
        """Add a group of observations: ``n`` of them, their sum ``seconds``, and ``buckets``
        (how many were at most each bound, cumulative; +Inf is ``n``)."""
        feed = self._feed
        key = (metric, *labels)
        buckets = feed.histograms.setdefault(key, [0.0] * (len(g.buckets) + 1))
        for i, count in enumerate(g.buckets):
            buckets[i] += count
        buckets[-1] += int(g.n)
        feed.histogram_sums[key] += float(g.seconds or 0.0)

    def _count_tally(self, job: str, key: str, n: int) -> None:
        """One platform tally key of a job's finished runs; label values only from the
        catalog (side effects) or a fixed word list (results), never free text."""
        feed = self._feed
        spec = self._by_name.get(job)
        if spec is None:
            return
        parts = key.split(".")
        recon = spec.reconciliation
        if recon is not None and key in recon.mismatch_types:
            feed.signals[("reconciliation_mismatches_total", job, key)] += n
        elif recon is not None and key in recon.corrections:
            feed.signals[("reconciliation_corrections_total", job, recon.corrections[key])] += n
        elif recon is not None and key in recon.unresolved:
            feed.signals[("reconciliation_unresolved_total", job, recon.unresolved[key])] += n
        elif key.startswith(ITEM_RETRY_PREFIX):
            reason = key.removeprefix(ITEM_RETRY_PREFIX)
            reason = reason if reason in ITEM_RETRY_REASONS else OTHER
            feed.signals[("job_retries_total", job, "item", reason)] += n
        elif key == ITEM_RETRY_EXHAUSTED:
            feed.signals[("job_retry_exhausted_total", job, "item")] += n
        elif key in TALLY_COUNTERS:
            feed.sums[(TALLY_COUNTERS[key], job)] += n
        elif key in DOWNSTREAM_COUNTERS:
            metric, label, scale = DOWNSTREAM_COUNTERS[key]
            feed.downstream[(metric, job, label)] += n * scale
        elif len(parts) == 3 and parts[0] == "side_effect":
            name = parts[1] if parts[1] in spec.side_effects else "other"
            result = parts[2] if parts[2] in SIDE_EFFECT_RESULTS else "other"
            feed.side_effects[(job, name, result)] += n
        elif len(parts) == 2 and parts[0] == "side_effect_ambiguity":
            feed.ambiguity[(job, parts[1] if parts[1] in AMBIGUITY_REASONS else OTHER)] += n

    def _judge_missed(self, conn: Connection, now: datetime) -> None:
        """Judge the ticks whose window has passed since the last scrape (from the job's first
        scheduled run, at most ``missed_lookback_s`` back; at most MAX_TICKS_PER_SCRAPE)."""
        feed = self._feed
        for spec in self.specs:
            until = now - timedelta(seconds=tick_window_s(spec) + SETTLE_S)
            after = feed.missed_cursor.get(spec.name)
            if after is None:
                first = first_scheduled_tick(conn, spec.name)
                if first is None:
                    continue  # never scheduled yet: nothing to judge
                after = max(
                    first - timedelta(microseconds=1),
                    now - timedelta(seconds=self.missed_lookback_s),
                )
            ticks = cron_ticks(spec.cron_schedule, after, until)[:MAX_TICKS_PER_SCRAPE]
            if not ticks:
                continue
            for missed in missed_runs(conn, spec, ticks):
                feed.missed[(spec.name, missed.reason)] += 1
            feed.missed_cursor[spec.name] = ticks[-1]

    # ------------------------------------------------------------------ collect

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("qo_ops_database_up", "1 if the last read of the database worked")
        try:
            with self._lock, self.engine.connect() as conn:
                self._advance(conn)
                held = suspensions(conn)
                now = conn.execute(_CLOCK).scalar_one()
                self._judge_missed(conn, self._clock() if self._clock else now)
                now_families = [
                    *self._now(conn, _suspended_tenants(held)),
                    *self._suspensions(held, now),
                    *self._breakers(breaker_status(conn)),
                ]
            self._up = 1.0
        except DBAPIError as exc:
            log_event(log, logging.WARNING, "metrics.scrape_failed", error=type(exc.orig).__name__)
            self._up, now_families = 0.0, []
        up.add_metric([], self._up)
        yield up
        yield from self._catalog()
        yield from now_families
        yield from self._slow_families()
        yield from self._feed_families()

    def _catalog(self) -> Iterator[Metric]:
        interval = GaugeMetricFamily(
            "job_expected_interval_seconds",
            "Seconds between two schedule ticks",
            labels=["job_name"],
        )
        budget = GaugeMetricFamily(
            "job_duration_budget_seconds",
            "How long one run may take: min(cadence, deadline)",
            labels=["job_name"],
        )
        for spec in self.specs:
            cadence = cadence_seconds(spec.cron_schedule)
            interval.add_metric([spec.name], cadence)
            budget.add_metric([spec.name], min(cadence, spec.defaults.deadline_s))
        yield interval
        yield budget
        yield GaugeMetricFamily(
            "job_suspension_alert_after_seconds",
            "How long a job may stay suspended before it alerts (QO_OPS_SUSPENSION_ALERT_AFTER_S)",
            value=self.suspension_alert_after_s,
        )

    def _now(self, conn: Connection, paused: dict[str, set[str]]) -> Iterator[Metric]:
        g = {
            name: GaugeMetricFamily(name, text, labels=["job_name"])
            for name, text in (
                ("job_last_success_timestamp_seconds", "End of the latest successful execute run"),
                ("job_last_run_timestamp_seconds", "Start of the latest execute run"),
                ("job_consecutive_failures", "Longest current failed/timeout streak of a tenant"),
                ("job_running", "Runs in status running"),
                ("job_longest_running_seconds", "Age of the oldest running run"),
                ("job_checkpoint_age_seconds", "Worst age of a leased scope's checkpoint"),
                ("job_lease_held", "Unexpired leases"),
                ("job_lease_age_seconds", "Time since the oldest held lease was acquired"),
            )
        }
        status = GaugeMetricFamily(
            "job_last_run_status",
            "1 for the latest finished run's status",
            labels=["job_name", "status"],
        )
        for spec in self.specs:
            row = conn.execute(_NOW, {"job": spec.name}).one()
            g["job_last_success_timestamp_seconds"].add_metric(
                [spec.name], _epoch(row.last_success)
            )
            g["job_last_run_timestamp_seconds"].add_metric([spec.name], _epoch(row.last_start))
            g["job_running"].add_metric([spec.name], float(row.running))
            g["job_longest_running_seconds"].add_metric(
                [spec.name], float(row.longest_running or 0)
            )
            g["job_lease_held"].add_metric([spec.name], float(row.leases))
            g["job_lease_age_seconds"].add_metric([spec.name], float(row.lease_age or 0))
            g["job_checkpoint_age_seconds"].add_metric([spec.name], float(row.checkpoint_age or 0))
            for final in FINAL_STATUSES:
                status.add_metric([spec.name, final], 1.0 if row.last_status == final else 0.0)
            # per tenant, not per scope: a windowed job's every day is a new scope
            streaks: dict[str, int] = {}
            broken: set[str] = set()
            for run in conn.execute(_RECENT, {"job": spec.name, "n": STREAK_WINDOW}):
                tenant = tenant_of(run.scope)
                if tenant in broken or tenant in paused.get(spec.name, ()):
                    continue  # a suspended tenant's streak waits for its resumption
                if run.status in FAILING:
                    streaks[tenant] = streaks.get(tenant, 0) + 1
                elif run.status not in ("cancelled", "skipped"):  # neither breaks nor extends
                    broken.add(tenant)
            g["job_consecutive_failures"].add_metric(
                [spec.name], float(max(streaks.values(), default=0))
            )
        yield status
        yield from g.values()

    def _suspensions(self, held: list[Suspension], now: datetime) -> Iterator[Metric]:
        """Per suspended catalog job: suspended for every scope (1), the number of
        suspensions, the oldest one's age. A job without a suspension has none of these
        series. Only counts and ages: the tenant, reason and author stay in the database."""
        every = GaugeMetricFamily(
            "job_suspended", "1 while the job is suspended for every scope", labels=["job_name"]
        )
        count = GaugeMetricFamily(
            "job_suspensions",
            "Suspensions in force: 1 for every scope plus 1 per suspended tenant",
            labels=["job_name"],
        )
        age = GaugeMetricFamily(
            "job_suspended_seconds", "Age of the job's oldest suspension", labels=["job_name"]
        )
        by_job: dict[str, list[Suspension]] = defaultdict(list)
        for suspension in held:
            by_job[suspension.job_name].append(suspension)
        for spec in self.specs:  # catalog jobs only: a label value never comes from a row
            mine = by_job.get(spec.name)
            if not mine:
                continue
            if any(s.tenant_id is None for s in mine):
                every.add_metric([spec.name], 1.0)
            count.add_metric([spec.name], float(len(mine)))
            oldest = min(s.suspended_at for s in mine)
            age.add_metric([spec.name], max(0.0, (now - oldest).total_seconds()))
        yield every
        yield count
        yield age

    def _breakers(self, rows: list[BreakerStatus]) -> Iterator[Metric]:
        """Per downstream origin: its breaker's state (1 for the current one) and how long it
        has been open (since it last opened, on the database's clock; 0 when closed). An
        origin that is not one is shown as ``other``, the worst of them."""
        state = GaugeMetricFamily(
            "qo_ops_downstream_breaker_state",
            "1 for the downstream's circuit breaker state (closed, open, half_open)",
            labels=["downstream", "state"],
        )
        open_s = GaugeMetricFamily(
            "qo_ops_downstream_breaker_open_seconds",
            "Since the downstream's breaker last opened (0 when closed; a failed probe opens it again)",
            labels=["downstream"],
        )
        worst: dict[str, tuple[float, str]] = {d: (0.0, CLOSED) for d in self.downstreams}
        for row in sorted(rows, key=lambda r: r.open_s):  # the longest open one wins a label
            worst[_downstream_label(row.downstream)] = (row.open_s, row.state)
        for downstream, (seconds, current) in sorted(worst.items()):
            for name in manners.BREAKER_STATES:
                state.add_metric([downstream, name], 1.0 if name == current else 0.0)
            open_s.add_metric([downstream], seconds)  # 0 when closed
        yield state
        yield open_s

    def _slow_families(self) -> Iterator[Metric]:
        with self._lock:
            slow = self._slow
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

    def _feed_families(self) -> Iterator[Metric]:
        feed = self._feed
        names = [s.name for s in self.specs]
        started = CounterMetricFamily("job_started_total", "Runs started", labels=["job_name"])
        for job in names:
            started.add_metric([job], feed.started.get(job, 0))
        yield started
        completed = CounterMetricFamily(
            "job_completed_total", "Runs finished, by status", labels=["job_name", "status"]
        )
        for job in names:
            for st in FINAL_STATUSES:
                completed.add_metric([job, st], feed.completed.get((job, st), 0))
        yield completed
        failed = CounterMetricFamily(
            "job_failed_total",
            "Runs failed or timed out, by error class",
            labels=["job_name", "error_class"],
        )
        for job in names:
            for ec in self.error_classes[job]:
                failed.add_metric([job, ec], feed.failed.get((job, ec), 0))
        yield failed
        per_job = {
            **{m: t for m, (_, t) in ITEM_SUMS.items()},
            "job_skipped_total": "Runs skipped (lease held elsewhere)",
            "job_lock_acquire_failed_total": "Lease acquisitions refused",
            "job_lease_lost_total": "Runs that lost their lease to another holder",
            "job_anomaly_stops_total": "Runs stopped by an anomaly threshold",
            "job_checkpoint_updates_total": "Checkpoints saved (one per batch of a cursor job)",
            "job_checkpoint_resets_total": "Checkpoints forgotten after a complete rescan",
        }
        for metric, text in per_job.items():
            family = CounterMetricFamily(metric, text, labels=["job_name"])
            source = "job_skipped_total" if metric == "job_lock_acquire_failed_total" else metric
            for job in names:
                family.add_metric([job], feed.sums.get((source, job), 0))
            yield family
        yield self._histogram(
            "job_duration_seconds",
            "Run duration",
            ["status"],
            [(j, st) for j in names for st in FINAL_STATUSES],
            DURATION_BUCKETS,
        )
        yield self._histogram(
            "job_scheduler_drift_seconds",
            "How late a scheduled run started after its tick",
            [],
            [(j,) for j in names],
            DRIFT_BUCKETS,
        )
        missed = CounterMetricFamily(
            "job_missed_runs_total",
            "Scheduled runs (one per tenant and tick) that did not start in their window",
            labels=["job_name", "reason"],
        )
        for job in names:
            for reason in MISSED_REASONS:
                missed.add_metric([job, reason], feed.missed.get((job, reason), 0))
        yield missed
        effects = CounterMetricFamily(
            "job_side_effects_total",
            "Attempts at a side effect, by result",
            labels=["job_name", "side_effect", "result"],
        )
        for spec in self.specs:
            for name in spec.side_effects:
                for result in SIDE_EFFECT_RESULTS:
                    effects.add_metric(
                        [spec.name, name, result],
                        feed.side_effects.get((spec.name, name, result), 0),
                    )
        for (job, name, result), n in sorted(feed.side_effects.items()):
            if name == "other" or result == "other":
                effects.add_metric([job, name, result], n)
        yield effects
        ambiguity = CounterMetricFamily(
            "job_side_effect_ambiguity_total",
            "Side effects whose outcome is unknown, by reason (they need reconciliation)",
            labels=["job_name", "reason"],
        )
        for spec in self.specs:
            if spec.side_effects:
                for reason in AMBIGUITY_REASONS:
                    ambiguity.add_metric(
                        [spec.name, reason], feed.ambiguity.get((spec.name, reason), 0)
                    )
        yield ambiguity
        yield from self._downstream_families()
        yield from self._signal_families()
        yield from self._reconciliation_families()

    def _series(self) -> dict[str, list[tuple[str, ...]]]:
        """Metric → the (job, *label values) of every series it serves: each catalog job
        with every value the code declares (signals.py, the job's spec)."""
        names = [s.name for s in self.specs]
        return {
            "job_lock_acquire_total": [(j, r) for j in names for r in LOCK_RESULTS],
            "job_overlap_detected_total": [(j,) for j in names],
            "job_retries_total": [
                *((j, "item", r) for j in self.calling for r in ITEM_RETRY_REASONS),
                *((j, "run", r) for j in names for r in RUN_RETRY_REASONS),
            ],
            "job_retry_exhausted_total": [
                *((j, "item") for j in self.calling),
                *((j, "run") for j in names),
            ],
            "job_manual_reruns_total": [
                (j, r) for j in names for r in dict.fromkeys(MANUAL_RERUN_REASONS.values())
            ],
        }

    def _signal_families(self) -> Iterator[Metric]:
        """The seed's lock, retry and rerun counters and the start and lock histograms."""
        feed = self._feed
        texts = {
            "job_lock_acquire_total": (
                "Execute runs' lease acquisitions, by result",
                ["result"],
            ),
            "job_overlap_detected_total": (
                "Runs that found another holder had taken their lease while they ran "
                "(two at once; fencing kept the old one from writing)",
                [],
            ),
            "job_retries_total": (
                "Retries, by scope (item: a retry scheduled; run: Dagster re-ran a run "
                "whose worker died) and reason",
                ["scope", "reason"],
            ),
            "job_retry_exhausted_total": (
                "Retries given up, by scope (item: dead-lettered after its last attempt; "
                "run: a run retry that failed again with none left)",
                ["scope"],
            ),
            "job_manual_reruns_total": (
                "Execute runs a person asked for over a scope run before, by how the "
                "previous execute run ended",
                ["reason"],
            ),
        }
        for metric, series in self._series().items():
            text, labels = texts[metric]
            family = CounterMetricFamily(metric, text, labels=["job_name", *labels])
            for key in series:
                if metric == "job_overlap_detected_total":
                    n = float(feed.sums.get(("job_lease_lost_total", key[0]), 0))
                else:
                    n = feed.signals.get((metric, *key), 0.0)
                family.add_metric(list(key), n)
            yield family
        names = [s.name for s in self.specs]
        yield self._histogram(
            "job_start_delay_seconds",
            "From when a run was asked for (its Dagster run's creation, the API's acceptance, "
            "its tick) to when the runner started it",
            ["trigger"],
            [(j, t) for j in names for t in TRIGGERS],
            DRIFT_BUCKETS,
        )
        yield self._histogram(
            "job_lock_wait_seconds",
            "How long taking (or being refused) the scope's lease took",
            [],
            [(j,) for j in names],
            LOCK_WAIT_BUCKETS,
        )

    def _histogram(
        self,
        metric: str,
        text: str,
        labels: list[str],
        series: list[tuple[str, ...]],
        bounds: tuple[float, ...],
    ) -> Metric:
        """A histogram family from the feed's observations, every series from the start."""
        feed = self._feed
        family = HistogramMetricFamily(metric, text, labels=["job_name", *labels])
        names = [*(str(float(b)) for b in bounds), "+Inf"]
        for key in series:
            counts = feed.histograms.get((metric, *key), [0.0] * (len(bounds) + 1))
            family.add_metric(
                list(key),
                list(zip(names, counts, strict=True)),
                feed.histogram_sums.get((metric, *key), 0.0),
            )
        return family

    def _reconciliation_families(self) -> Iterator[Metric]:
        """The seed's reconciliation family, for the jobs that declare a reconciliation."""
        feed = self._feed
        runs = CounterMetricFamily(
            "reconciliation_runs_total",
            "Reconciliation runs, by status",
            labels=["job_name", "status"],
        )
        scanned = CounterMetricFamily(
            "reconciliation_items_scanned_total",
            "Items a reconciliation compared with the other system",
            labels=["job_name"],
        )
        families = {
            "reconciliation_mismatches_total": CounterMetricFamily(
                "reconciliation_mismatches_total",
                "Mismatches found (dry-run and execute), by type",
                labels=["job_name", "mismatch_type"],
            ),
            "reconciliation_corrections_total": CounterMetricFamily(
                "reconciliation_corrections_total",
                "Repairs attempted in execute, by result",
                labels=["job_name", "result"],
            ),
            "reconciliation_unresolved_total": CounterMetricFamily(
                "reconciliation_unresolved_total",
                "Mismatches left to a person, by reason",
                labels=["job_name", "reason"],
            ),
        }
        for spec in self.specs:
            recon = spec.reconciliation
            if recon is None:
                continue
            job = spec.name
            for st in FINAL_STATUSES:
                runs.add_metric([job, st], feed.completed.get((job, st), 0))
            scanned.add_metric([job], feed.sums.get(("job_items_processed_total", job), 0))
            for metric, values in (
                ("reconciliation_mismatches_total", recon.mismatch_types),
                ("reconciliation_corrections_total", recon.correction_results),
                ("reconciliation_unresolved_total", recon.unresolved_reasons),
            ):
                for v in values:
                    families[metric].add_metric([job, v], feed.signals.get((metric, job, v), 0.0))
        yield runs
        yield scanned
        yield from families.values()

    def _downstream_families(self) -> Iterator[Metric]:
        """The downstream counters: every series of a job that calls the downstream from the
        first scrape, another catalog job's once its runs counted some."""
        feed = self._feed
        seen = {job for (_, job, _) in feed.downstream}
        jobs = [s.name for s in self.specs if s.name in self.calling or s.name in seen]
        for metric, (text, label, values) in DOWNSTREAM_FAMILIES.items():
            family = CounterMetricFamily(
                metric, text, labels=["job_name"] if label is None else ["job_name", label]
            )
            for job in jobs:
                for value in values:
                    n = feed.downstream.get((metric, job, value), 0.0)
                    family.add_metric([job] if label is None else [job, value], n)
            yield family


def _downstream_label(origin: str) -> str:
    """A breaker row's downstream as a label value: the origin, or ``other``."""
    return origin if _ORIGIN.match(origin) else "other"


def _suspended_tenants(held: Iterable[Suspension]) -> dict[str, set[str]]:
    """Job name → the tenants suspended on their own (a job-wide suspension is not listed:
    its gauges keep every tenant, and the alerts stay quiet on ``job_suspended``)."""
    paused: dict[str, set[str]] = defaultdict(set)
    for suspension in held:
        if suspension.tenant_id is not None:
            paused[suspension.job_name].add(suspension.tenant_id)
    return paused


def _epoch(value: datetime | None) -> float:
    return value.timestamp() if value is not None else 0.0


_NOW = sa.text(
    """
    SELECT
      (SELECT finished_at FROM job_run WHERE job_name = :job AND finished_at IS NOT NULL
          AND status IN ('success', 'no_work') AND mode = 'execute'
        ORDER BY finished_at DESC LIMIT 1) AS last_success,
      (SELECT started_at FROM job_run WHERE job_name = :job AND mode = 'execute'
          AND status NOT IN ('awaiting_approval', 'accepted')
        ORDER BY started_at DESC LIMIT 1) AS last_start,
      (SELECT status FROM job_run WHERE job_name = :job AND finished_at IS NOT NULL
        ORDER BY finished_at DESC LIMIT 1) AS last_status,
      (SELECT count(*) FROM job_run WHERE job_name = :job AND status = 'running') AS running,
      (SELECT extract(epoch FROM clock_timestamp() - min(started_at)) FROM job_run
        WHERE job_name = :job AND status = 'running') AS longest_running,
      (SELECT count(*) FROM job_lease WHERE job_name = :job
          AND expires_at > clock_timestamp()) AS leases,
      (SELECT extract(epoch FROM clock_timestamp() - min(acquired_at)) FROM job_lease
        WHERE job_name = :job AND expires_at > clock_timestamp()) AS lease_age,
      (SELECT extract(epoch FROM max(clock_timestamp() - greatest(c.updated_at, l.acquired_at)))
         FROM job_lease l JOIN job_checkpoint c ON c.job_name = l.job_name AND c.scope = l.scope
        WHERE l.job_name = :job AND l.expires_at > clock_timestamp()) AS checkpoint_age
    """
)
_RECENT = sa.text(
    """
    SELECT scope, status FROM job_run
     WHERE job_name = :job AND finished_at IS NOT NULL AND mode = 'execute'
     ORDER BY finished_at DESC LIMIT :n
    """
)
