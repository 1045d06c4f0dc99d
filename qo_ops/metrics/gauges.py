"""The gauges the exporter reads on each scrape, with index-backed queries: the catalog's
cadences and budgets; per job the latest success, start and status, the failure streak,
running runs, leases and checkpoint age; Dagster's run queue per job (as last sampled); the
kill switch's suspensions (a few rows); the downstream's circuit breakers (a row per origin). Suspensions and breakers are counts, ages
and states only: a tenant, reason, author or breaker reason never becomes a label."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Iterator
from datetime import datetime

import sqlalchemy as sa
from prometheus_client.core import GaugeMetricFamily, Metric
from sqlalchemy.engine import Connection

from qo_ops.platform.actions.control import Suspension
from qo_ops.platform.actions.status import BreakerStatus
from qo_ops.platform.calls import call_stats
from qo_ops.platform.calls.breaker import CLOSED
from qo_ops.platform.job.scope import tenant_of
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.job.statuses import FAILING, FINAL, UNSTARTED, RunStatus
from qo_ops.platform.schedule.cron import cadence_seconds
from qo_ops.platform.schedule.run_queue import QueueReading

STREAK_WINDOW = 1000  # latest finished execute runs read for the failure streaks
# A downstream label is an origin as qo_ops.downstream.calls.origin writes it; anything else
# in the table shows as "other" (never free text in a label)
_ORIGIN = re.compile(r"^https?://[A-Za-z0-9.:\[\]\-]{1,260}:[0-9]{1,5}$")

# A job's run, lease and checkpoint gauges in one row, each an index-backed subquery.
_NOW = sa.text(
    """
    SELECT
      (SELECT finished_at FROM job_run WHERE job_name = :job AND finished_at IS NOT NULL
          AND status = ANY(CAST(:fresh AS text[])) AND mode = 'execute'
        ORDER BY finished_at DESC LIMIT 1) AS last_success,
      (SELECT started_at FROM job_run WHERE job_name = :job AND mode = 'execute'
          AND status <> ALL(CAST(:unstarted AS text[]))
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
# A job's latest finished execute runs, newest first: its tenants' failure streaks.
_RECENT = sa.text(
    """
    SELECT scope, status FROM job_run
     WHERE job_name = :job AND finished_at IS NOT NULL AND mode = 'execute'
     ORDER BY finished_at DESC LIMIT :n
    """
)


def downstream_label(origin: str) -> str:
    """A breaker row's downstream as a label value: the origin, or ``other``."""
    return origin if _ORIGIN.match(origin) else "other"


def suspended_tenants(held: Iterable[Suspension]) -> dict[str, set[str]]:
    """Job name → the tenants suspended on their own (a job-wide suspension is not listed:
    its gauges keep every tenant, and the alerts stay quiet on ``job_suspended``)."""
    paused: dict[str, set[str]] = defaultdict(set)
    for suspension in held:
        if suspension.tenant_id is not None:
            paused[suspension.job_name].add(suspension.tenant_id)
    return paused


def _epoch(value: datetime | None) -> float:
    return value.timestamp() if value is not None else 0.0


def catalog_families(specs: list[JobSpec], suspension_alert_after_s: float) -> Iterator[Metric]:
    """What the catalog and the settings say: each job's cadence and duration budget, and how
    long a suspension may last before it alerts."""
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
    for spec in specs:
        cadence = cadence_seconds(spec.deployment.cron_schedule)
        interval.add_metric([spec.name], cadence)
        budget.add_metric([spec.name], min(cadence, spec.defaults.deadline_s))
    yield interval
    yield budget
    yield GaugeMetricFamily(
        "job_suspension_alert_after_seconds",
        "How long a job may stay suspended before it alerts (QO_OPS_SUSPENSION_ALERT_AFTER_S)",
        value=suspension_alert_after_s,
    )


def run_families(
    conn: Connection, specs: list[JobSpec], paused: dict[str, set[str]]
) -> Iterator[Metric]:
    """Per job: its latest success, start and status, its worst tenant's failure streak (a
    tenant suspended on its own left out), its running runs, leases and checkpoint age."""
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
    for spec in specs:
        row = conn.execute(
            _NOW,
            {"job": spec.name, "fresh": list(spec.fresh_statuses), "unstarted": list(UNSTARTED)},
        ).one()
        g["job_last_success_timestamp_seconds"].add_metric([spec.name], _epoch(row.last_success))
        g["job_last_run_timestamp_seconds"].add_metric([spec.name], _epoch(row.last_start))
        g["job_running"].add_metric([spec.name], float(row.running))
        g["job_longest_running_seconds"].add_metric([spec.name], float(row.longest_running or 0))
        g["job_lease_held"].add_metric([spec.name], float(row.leases))
        g["job_lease_age_seconds"].add_metric([spec.name], float(row.lease_age or 0))
        g["job_checkpoint_age_seconds"].add_metric([spec.name], float(row.checkpoint_age or 0))
        for final in FINAL:
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
            elif run.status not in (
                RunStatus.CANCELLED,
                RunStatus.SKIPPED,
            ):  # neither breaks nor extends
                broken.add(tenant)
        g["job_consecutive_failures"].add_metric(
            [spec.name], float(max(streaks.values(), default=0))
        )
    yield status
    yield from g.values()


def suspension_families(
    specs: list[JobSpec], held: list[Suspension], now: datetime
) -> Iterator[Metric]:
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
    for spec in specs:  # catalog jobs only: a label value never comes from a row
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


def queue_families(specs: list[JobSpec], readings: dict[str, QueueReading]) -> Iterator[Metric]:
    """Per catalog job: the runs waiting in Dagster's run queue and the oldest one's age, as
    run_queue_sensor last sampled them; and how old that sample is (a daemon that stopped
    sampling leaves the figures as they were: the age says so)."""
    depth = GaugeMetricFamily(
        "job_run_queue_depth", "Runs waiting in Dagster's run queue", labels=["job_name"]
    )
    oldest = GaugeMetricFamily(
        "job_run_queue_oldest_seconds",
        "Age of the oldest run waiting in Dagster's run queue (0 when none waits)",
        labels=["job_name"],
    )
    for spec in specs:  # catalog jobs only: a label value never comes from a row
        reading = readings.get(spec.name)
        depth.add_metric([spec.name], float(reading.depth) if reading else 0.0)
        oldest.add_metric([spec.name], reading.oldest_s if reading and reading.depth else 0.0)
    yield depth
    yield oldest
    if readings:
        yield GaugeMetricFamily(
            "job_run_queue_sample_age_seconds",
            "Since run_queue_sensor last sampled Dagster's run queue",
            value=min(r.sample_age_s for r in readings.values()),
        )


def breaker_families(downstreams: list[str], rows: list[BreakerStatus]) -> Iterator[Metric]:
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
    worst: dict[str, tuple[float, str]] = {d: (0.0, CLOSED) for d in downstreams}
    for row in sorted(rows, key=lambda r: r.open_s):  # the longest open one wins a label
        worst[downstream_label(row.downstream)] = (row.open_s, row.state)
    for downstream, (seconds, current) in sorted(worst.items()):
        for name in call_stats.BREAKER_STATES:
            state.add_metric([downstream, name], 1.0 if name == current else 0.0)
        open_s.add_metric([downstream], seconds)  # 0 when closed
    yield state
    yield open_s


# During a rollout: the schema's revision, the oldest code it serves, and the running runs of
# each code revision (a handful of values: releases, never free text). Index-backed:
# ix_job_run_running.
_SCHEMA = sa.text(
    """
    SELECT coalesce(code_revision, 'before 0018') AS code, count(*) AS n FROM job_run
     WHERE status = 'running' GROUP BY 1
    """
)


def schema_families(conn: Connection) -> Iterator[Metric]:
    """``qo_ops_build_info`` (this exporter's code), ``qo_ops_schema_revision``,
    ``qo_ops_schema_serves_code_from`` and ``job_runs_running_by_code``."""
    from qo_ops.db import migrate
    from qo_ops.platform.observability.resource import package_version

    info = GaugeMetricFamily(
        "qo_ops_build_info",
        "1, labelled with this process's service.version and the schema revision its code needs",
        labels=["service_version", "code_revision"],
    )
    info.add_metric([package_version(), migrate.HEAD_REVISION], 1.0)
    yield info
    current, serves = migrate.current_on(conn), migrate.serves_on(conn)
    revision = GaugeMetricFamily(
        "qo_ops_schema_revision", "The revision the qo-ops schema is at (0: empty)"
    )
    revision.add_metric([], float(int(current or 0)))
    yield revision
    floor = GaugeMetricFamily(
        "qo_ops_schema_serves_code_from",
        "The oldest code revision the schema still serves (a contract step raises it)",
    )
    floor.add_metric([], float(int(serves or 0)))
    yield floor
    running = GaugeMetricFamily(
        "job_runs_running_by_code",
        "Runs in progress per code revision that started them (a rollout shows two)",
        labels=["code_revision"],
    )
    for code, n in conn.execute(_SCHEMA):
        running.add_metric([code], float(n))
    yield running
    last = migrate.applied_migrations_on(conn, 1)
    for name, text, value in (
        (
            "qo_ops_schema_upgrade_last_timestamp_seconds",
            "When the last recorded `qo-ops db upgrade` started (0: none)",
            _epoch(last[0].started_at) if last else 0.0,
        ),
        (
            "qo_ops_schema_upgrade_last_duration_seconds",
            "How long the last recorded upgrade took",
            last[0].duration_ms / 1000 if last else 0.0,
        ),
        (
            "qo_ops_schema_upgrade_last_lock_timeouts",
            "Lock timeouts the last recorded upgrade met (each gave way to writers, then retried)",
            float(last[0].lock_timeouts) if last else 0.0,
        ),
        (
            "qo_ops_schema_upgrade_last_failed",
            "1 if the last recorded upgrade failed or was refused",
            1.0 if last and last[0].outcome != "ok" else 0.0,
        ),
    ):
        family = GaugeMetricFamily(name, text)
        family.add_metric([], value)
        yield family
