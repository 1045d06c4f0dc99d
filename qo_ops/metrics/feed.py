"""Counters over the run records (``job_run``), advanced by (timestamp, id) cursors: the first
scrape reads every retained run once, each later scrape only the runs created or finished
since the previous one (indexes on ``created_at`` and ``finished_at``), so a restarted
exporter counts the same totals again instead of going down. The database sums the runs per
job and status, so the first scrape over many runs is one aggregate query, not a row each.
Missed scheduled runs are judged here too, tick by tick, from a cursor per job."""

from __future__ import annotations

import uuid
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.metrics.histograms import (
    DRIFT_BUCKETS,
    DURATION_BUCKETS,
    LOCK_WAIT_BUCKETS,
    Histograms,
    Observed,
    bucket_counts,
)
from qo_ops.platform.actions.recovery import CHECKPOINT_RESET
from qo_ops.platform.calls import call_stats
from qo_ops.platform.job.labels import (
    AMBIGUITY_REASONS,
    ITEM_RETRY_EXHAUSTED,
    ITEM_RETRY_PREFIX,
    ITEM_RETRY_REASONS,
    MANUAL_RERUN_REASONS,
    MANUAL_TRIGGERS,
    OTHER,
    PLATFORM_ERROR_CLASSES,
)
from qo_ops.platform.job.outcome import CHECKPOINT_RESETS, CHECKPOINT_UPDATES, SIDE_EFFECT_RESULTS
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.job.statuses import FAILING, RunStatus
from qo_ops.platform.schedule.cron import cron_ticks
from qo_ops.platform.schedule.missed import first_scheduled_tick, missed_runs, tick_window_s

SETTLE_S = 2.0  # rows newer than this may still be in uncommitted transactions
MISSED_LOOKBACK_S = 7 * 86400.0  # a starting exporter judges the ticks of the last week
MAX_TICKS_PER_SCRAPE = 5000  # per job: a long backlog of ticks is judged over a few scrapes

# Runs created in (cursor, cutoff), counted per job in the database.
_NEW_RUNS = sa.text(
    """
    SELECT job_name, count(*) AS n FROM job_run
     WHERE created_at < :cutoff AND (created_at, id) > (:ts, :id)
     GROUP BY job_name
    """
)
_BUCKET_COUNTS = bucket_counts("seconds", DURATION_BUCKETS)
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
_DRIFT_COUNTS = bucket_counts("drift", DRIFT_BUCKETS)
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
# result, ambiguity by reason, checkpoint updates and resets, the downstream's call_stats.
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
_LOCK_COUNTS = bucket_counts("lock_wait_ms", LOCK_WAIT_BUCKETS, 1000)
_DELAY_COUNTS = bucket_counts("delay", DRIFT_BUCKETS)
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
TALLY_COUNTERS = {CHECKPOINT_UPDATES: "job_checkpoint_updates_total"}
# Checkpoints a person reset (qo-ops checkpoint reset, the API), from their audit rows in
# (cursor, cutoff): job_audit is append-only, each reset one row counting its checkpoints.
_OPERATOR_RESETS = sa.text(
    """
    SELECT job_name, coalesce(sum(CAST(details ->> 'reset' AS bigint)), 0) AS n
      FROM job_audit
     WHERE job_name = ANY(CAST(:jobs AS text[])) AND action = :action AND mode = 'execute'
       AND occurred_at < :cutoff AND (occurred_at, id) > (:ts, :id)
     GROUP BY job_name
    """
)
_LAST_AUDIT = sa.text(
    "SELECT occurred_at, id FROM job_audit WHERE occurred_at < :cutoff "
    "AND job_name = ANY(CAST(:jobs AS text[])) ORDER BY occurred_at DESC, id DESC LIMIT 1"
)
# A run's calls to the downstream (qo_ops.platform.calls.call_stats): tally key → (metric, label
# value, scale). The label is the metric's one label besides job_name, from this list only.
DOWNSTREAM_COUNTERS: dict[str, tuple[str, str, float]] = {
    call_stats.CALLS: ("job_downstream_calls_total", "", 1.0),
    call_stats.RETRIES: ("job_downstream_retries_total", "", 1.0),
    call_stats.REFUSED_OPEN: ("job_downstream_not_sent_total", "breaker_open", 1.0),
    call_stats.RETRY_BUDGET_REFUSED: ("job_downstream_not_sent_total", "retry_budget", 1.0),
    call_stats.RATE_LIMIT_PAUSES: ("job_downstream_rate_limit_pauses_total", "", 1.0),
    call_stats.RATE_LIMIT_WAIT_MS: ("job_downstream_rate_limit_wait_seconds_total", "", 0.001),
    call_stats.SPARED: ("job_downstream_spared_total", "", 1.0),
    call_stats.HELD: ("job_downstream_held_total", "", 1.0),
    **{
        call_stats.BREAKER_PREFIX + state: ("job_breaker_transitions_total", state, 1.0)
        for state in call_stats.BREAKER_STATES
    },
}
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


class RunFeed:
    """The counters over the run records of the catalog's jobs, and the cursors they were
    read up to; ``advance`` and ``judge_missed`` add what came since the last scrape."""

    def __init__(self, specs: list[JobSpec], missed_lookback_s: float = MISSED_LOOKBACK_S) -> None:
        self.specs = specs
        self._by_name = {s.name: s for s in specs}
        self.reconciling = [s.name for s in specs if s.signals.reconciliation is not None]
        # job → the error classes job_failed_total serves it (the platform's, then its own)
        self.error_classes = {
            s.name: tuple(dict.fromkeys((*PLATFORM_ERROR_CLASSES, *s.signals.error_classes)))
            for s in specs
        }
        self.missed_lookback_s = missed_lookback_s
        origin = (datetime(1970, 1, 1, tzinfo=UTC), uuid.UUID(int=0))
        self.created_cursor: tuple[datetime, uuid.UUID] = origin
        self.finished_cursor: tuple[datetime, uuid.UUID] = origin
        self.started: defaultdict[str, int] = defaultdict(int)
        self.completed: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.failed: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.sums: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.side_effects: defaultdict[tuple[str, str, str], int] = defaultdict(int)
        self.ambiguity: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.missed: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.missed_cursor: dict[str, datetime] = {}  # last tick judged
        self.audit_cursor: tuple[datetime, int] = (origin[0], 0)  # operator resets read to
        # (metric, job, label value) → the downstream counters of DOWNSTREAM_COUNTERS
        self.downstream: defaultdict[tuple[str, str, str], float] = defaultdict(float)
        # (metric, job, *label values) → the seed's lock, retry, rerun and reconciliation counters
        self.signals: defaultdict[tuple[str, ...], float] = defaultdict(float)
        self.histograms = Histograms()

    def advance(self, conn: Connection) -> None:
        """Count the runs created and finished in (cursor, now − SETTLE_S); the cursors then
        move to that cutoff (with the lowest id, so a run at the cutoff is counted next)."""
        cutoff = conn.execute(_CUTOFF, {"settle": SETTLE_S}).scalar_one()
        created_ts, created_id = self.created_cursor
        for g in conn.execute(_NEW_RUNS, {"cutoff": cutoff, "ts": created_ts, "id": created_id}):
            self.started[g.job_name] += int(g.n)
        finished_ts, finished_id = self.finished_cursor
        for g in conn.execute(
            _NEW_SCHEDULED, {"cutoff": cutoff, "ts": created_ts, "id": created_id}
        ):
            self.histograms.observe("job_scheduler_drift_seconds", (g.job_name,), g)
        finished = {"cutoff": cutoff, "ts": finished_ts, "id": finished_id}
        for g in conn.execute(_FINISHED_RUNS, {**finished, "failing": list(FAILING)}):
            self._count_finished(g)
        for g in conn.execute(_FINISHED_TALLIES, {**finished, "reconciling": self.reconciling}):
            self._count_tally(g.job_name, g.key, int(g.n))
        for g in conn.execute(_FINISHED_LOCKS, {**finished, "failing": list(FAILING)}):
            self._count_locks(g)
        for g in conn.execute(_FINISHED_DELAYS, finished):
            self.histograms.observe("job_start_delay_seconds", (g.job_name, g.trigger_type), g)
        for g in conn.execute(_FINISHED_RERUNS, {**finished, "manual": list(MANUAL_TRIGGERS)}):
            if g.status in MANUAL_RERUN_REASONS:
                key = ("job_manual_reruns_total", g.job_name, MANUAL_RERUN_REASONS[g.status])
                self.signals[key] += int(g.n)
        self._count_operator_resets(conn, cutoff)
        lowest = uuid.UUID(int=0)
        self.created_cursor = (
            max(created_ts, cutoff),
            lowest if cutoff > created_ts else created_id,
        )
        self.finished_cursor = (
            max(finished_ts, cutoff),
            lowest if cutoff > finished_ts else finished_id,
        )

    def _count_operator_resets(self, conn: Connection, cutoff: datetime) -> None:
        """Checkpoints reset by a person since the last scrape (their audit rows)."""
        jobs = [s.name for s in self.specs if s.batching.checkpoint is not None]
        ts, last = self.audit_cursor
        params = {"jobs": jobs, "cutoff": cutoff, "ts": ts, "id": last}
        for g in conn.execute(_OPERATOR_RESETS, {**params, "action": CHECKPOINT_RESET}):
            self.signals[("job_checkpoint_resets_total", g.job_name, "operator")] += int(g.n)
        newest = conn.execute(_LAST_AUDIT, params).first()
        if newest is not None:
            self.audit_cursor = (newest.occurred_at, int(newest.id))

    def _count_finished(self, g: Any) -> None:
        """Add one group of finished runs (same job, status and distinguishing fields)."""
        n = int(g.n)
        self.completed[(g.job_name, g.status)] += n
        if g.status in FAILING:
            self.failed[(g.job_name, self._error_class(g.job_name, g.error_source))] += n
        for metric, (column, _) in ITEM_SUMS.items():
            self.sums[(metric, g.job_name)] += int(getattr(g, column) or 0)
        if g.lease_lost:
            self.sums[("job_lease_lost_total", g.job_name)] += n
        if g.anomaly:
            self.sums[("job_anomaly_stops_total", g.job_name)] += n
        if g.status == RunStatus.SKIPPED:
            self.sums[("job_skipped_total", g.job_name)] += n
        self.histograms.observe("job_duration_seconds", (g.job_name, g.status), g)

    def _error_class(self, job: str, code: str | None) -> str:
        """A failed run's error class as a label: one its job declares, else ``other``."""
        return code if code in self.error_classes.get(job, ()) else OTHER

    def _count_locks(self, g: Any) -> None:
        """Leases taken or found held, the time taking them took, Dagster's run retries."""
        signals, job = self.signals, g.job_name
        signals[("job_lock_acquire_total", job, "acquired")] += int(g.acquired)
        signals[("job_lock_acquire_total", job, "skipped_already_running")] += int(
            g.skipped_already_running
        )
        signals[("job_retries_total", job, "run", "worker_crashed")] += int(g.run_retries)
        signals[("job_retry_exhausted_total", job, "run")] += int(g.run_exhausted)
        if g.waits:
            g_wait = Observed(int(g.waits), float(g.wait_s), list(g.wait_buckets))
            self.histograms.observe("job_lock_wait_seconds", (job,), g_wait)

    def _count_tally(self, job: str, key: str, n: int) -> None:
        """One platform tally key of a job's finished runs; label values only from the
        catalog (side effects) or a fixed word list (results), never free text."""
        spec = self._by_name.get(job)
        if spec is None:
            return
        parts = key.split(".")
        recon = spec.signals.reconciliation
        if recon is not None and key in recon.mismatch_types:
            self.signals[("reconciliation_mismatches_total", job, key)] += n
        elif recon is not None and key in recon.corrections:
            self.signals[("reconciliation_corrections_total", job, recon.corrections[key])] += n
        elif recon is not None and key in recon.unresolved:
            self.signals[("reconciliation_unresolved_total", job, recon.unresolved[key])] += n
        elif key.startswith(ITEM_RETRY_PREFIX):
            reason = key.removeprefix(ITEM_RETRY_PREFIX)
            reason = reason if reason in ITEM_RETRY_REASONS else OTHER
            self.signals[("job_retries_total", job, "item", reason)] += n
        elif key == ITEM_RETRY_EXHAUSTED:
            self.signals[("job_retry_exhausted_total", job, "item")] += n
        elif key == CHECKPOINT_RESETS:
            self.signals[("job_checkpoint_resets_total", job, "rescan_complete")] += n
        elif key in TALLY_COUNTERS:
            self.sums[(TALLY_COUNTERS[key], job)] += n
        elif key in DOWNSTREAM_COUNTERS:
            metric, label, scale = DOWNSTREAM_COUNTERS[key]
            self.downstream[(metric, job, label)] += n * scale
        elif len(parts) == 3 and parts[0] == "side_effect":
            name = parts[1] if parts[1] in spec.signals.side_effects else "other"
            result = parts[2] if parts[2] in SIDE_EFFECT_RESULTS else "other"
            self.side_effects[(job, name, result)] += n
        elif len(parts) == 2 and parts[0] == "side_effect_ambiguity":
            self.ambiguity[(job, parts[1] if parts[1] in AMBIGUITY_REASONS else OTHER)] += n

    def judge_missed(self, conn: Connection, now: datetime) -> None:
        """Judge the ticks whose window has passed since the last scrape (from the job's first
        scheduled run, at most ``missed_lookback_s`` back; at most MAX_TICKS_PER_SCRAPE)."""
        for spec in self.specs:
            until = now - timedelta(seconds=tick_window_s(spec) + SETTLE_S)
            after = self.missed_cursor.get(spec.name)
            if after is None:
                first = first_scheduled_tick(conn, spec.name)
                if first is None:
                    continue  # never scheduled yet: nothing to judge
                after = max(
                    first - timedelta(microseconds=1),
                    now - timedelta(seconds=self.missed_lookback_s),
                )
            ticks = cron_ticks(spec.deployment.cron_schedule, after, until)[:MAX_TICKS_PER_SCRAPE]
            if not ticks:
                continue
            for missed in missed_runs(conn, spec, ticks):
                self.missed[(spec.name, missed.reason)] += 1
            self.missed_cursor[spec.name] = ticks[-1]
