"""Status for operators.

For each job and tenant, a row shows the last run (its mode and status), the last success,
whether the tenant is failing or stale, the runs in progress, the lease holder, the backlog
and the checkpoint age. Each job also gets a summary of its rows. A separate table shows the
downstream's circuit breakers."""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from qo_ops.db.schema import downstream_breaker
from qo_ops.platform.calls.breaker import FAILED, BreakerSettings
from qo_ops.platform.job.outcome import BatchContext
from qo_ops.platform.job.scope import TENANT_OF_SCOPE, Scope
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.job.statuses import FAILING, UNSTARTED, RunStatus
from qo_ops.platform.run.liveness import RUN_GONE
from qo_ops.platform.run.selection import capped_count
from qo_ops.platform.schedule.freshness import job_due, stale_limit_s

# Without a list of tenants, the backlog is counted only when a job has at most this many.
BACKLOG_ROWS = 200
BACKLOG_CAP = 100_000  # a backlog is counted up to this, so the reads stay bounded


@dataclass(frozen=True)
class ScopeStatus:
    """The state of one (job, tenant). A windowed job's windows are summed up per tenant."""

    job_name: str
    scope: str  # the tenant
    last_run_at: datetime | None
    last_status: str | None
    last_success_at: datetime | None
    lease_holder: str | None
    backlog: int | None  # items eligible now, for a tenant job; None if not counted
    checkpoint_age_s: float | None = None  # time since the scope's checkpoint last moved
    last_mode: str | None = None  # the last run's mode: dry_run or execute
    last_code: str | None = None  # the code that ran it, as package/schema revision (0018)
    running: int = 0  # runs in progress now
    # The last run ended failed or timeout, or in a partial success the job does not accept.
    failing: bool = False
    stale: bool = False  # no execute success within STALE_FACTOR cadences (freshness.py)
    never_run: bool = True  # the job has never run for this tenant

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def attention(self) -> bool:
        """Whether an operator should look: it is failing, stale, running now, or its scope is
        held."""
        return self.failing or self.stale or self.running > 0 or self.lease_holder is not None


# Read the status of one job for every tenant, set-based. A windowed job's scopes are
# tenant/window, and they are summed up per tenant. For each tenant, the query reads the last
# run (when, mode, status), the last execute success, the runs in progress, the live lease
# (whose holder is not gone) and the checkpoint age. It also reads how long the tenant has
# existed. It walks the job's runs once (ix_job_run_history), not once per tenant.
_STATUS = sa.text(
    f"""
    WITH t AS (SELECT id, extract(epoch FROM now() - created_at) AS age FROM tenant
                WHERE CAST(:tenant AS text) IS NULL OR id = :tenant),
         runs AS (SELECT {TENANT_OF_SCOPE} AS tenant, started_at, finished_at, mode,
                         status, code_version || '/' || code_revision AS code
                    FROM job_run WHERE job_name = :job
                     AND (CAST(:tenant AS text) IS NULL OR scope = :tenant
                          OR scope LIKE :tenant || '/%')),
         last AS (SELECT DISTINCT ON (tenant) tenant, started_at, mode, status, code
                    FROM runs WHERE status <> ALL(CAST(:unstarted AS text[]))
                   ORDER BY tenant, started_at DESC),
         ok AS (SELECT tenant, max(finished_at) AS at FROM runs
                 WHERE mode = 'execute' AND status = ANY(CAST(:fresh AS text[]))
                 GROUP BY tenant),
         active AS (SELECT tenant, count(*) AS n FROM runs WHERE status = 'running'
                     GROUP BY tenant),
         lease AS (SELECT {TENANT_OF_SCOPE} AS tenant, min(l.owner_id) AS holder
                     FROM job_lease l
                    WHERE l.job_name = :job AND l.expires_at > clock_timestamp()
                      AND NOT EXISTS (SELECT 1 FROM job_run r WHERE r.id = l.job_run_id
                                         AND {RUN_GONE})
                    GROUP BY 1),
         ck AS (SELECT {TENANT_OF_SCOPE} AS tenant,
                       min(extract(epoch FROM clock_timestamp() - c.updated_at)) AS age
                  FROM job_checkpoint c WHERE c.job_name = :job GROUP BY 1)
    SELECT t.id AS tenant, t.age AS tenant_age, last.started_at AS last_run_at,
           last.mode AS last_mode, last.status AS last_status, ok.at AS last_success_at,
           last.code AS last_code,
           extract(epoch FROM now() - ok.at) AS success_age, coalesce(active.n, 0) AS running,
           lease.holder AS lease_holder, ck.age AS checkpoint_age_s
      FROM t
      LEFT JOIN last ON last.tenant = t.id
      LEFT JOIN ok ON ok.tenant = t.id
      LEFT JOIN active ON active.tenant = t.id
      LEFT JOIN lease ON lease.tenant = t.id
      LEFT JOIN ck ON ck.tenant = t.id
     ORDER BY t.id
    """
)


def job_status(
    engine: Engine,
    spec: JobSpec,
    tenant: str | None = None,
    backlog_of: Collection[str] | None = None,
) -> list[ScopeStatus]:
    """Status rows of ``spec``, one per tenant, or only for ``tenant``.

    For a tenant job, the backlog is counted for the tenants in ``backlog_of``. When
    ``backlog_of`` is None, it is counted for every tenant if there are at most
    :data:`BACKLOG_ROWS`. Each count is one capped count."""
    limit_s = stale_limit_s(spec)
    fresh = list(spec.fresh_statuses)
    with engine.connect() as conn:
        due = job_due(conn, spec)  # a job newer than its stale limit judges no tenant stale
        found = conn.execute(
            _STATUS,
            {"job": spec.name, "tenant": tenant, "fresh": fresh, "unstarted": list(UNSTARTED)},
        ).all()
        counted = set(backlog_of) if backlog_of is not None else (
            {r.tenant for r in found} if len(found) <= BACKLOG_ROWS else set()
        )  # fmt: skip
        rows: list[ScopeStatus] = []
        partial_fails = RunStatus.PARTIAL_SUCCESS not in spec.fresh_statuses
        for r in found:
            rows.append(
                ScopeStatus(
                    spec.name,
                    r.tenant,
                    r.last_run_at,
                    r.last_status,
                    r.last_success_at,
                    r.lease_holder,
                    None,
                    None if r.checkpoint_age_s is None else round(float(r.checkpoint_age_s), 1),
                    last_mode=r.last_mode,
                    last_code=r.last_code,
                    running=int(r.running),
                    failing=r.last_status in FAILING
                    or (partial_fails and r.last_status == RunStatus.PARTIAL_SUCCESS),
                    stale=due
                    and float(r.tenant_age) > limit_s
                    and (r.success_age is None or float(r.success_age) > limit_s),
                    never_run=r.last_run_at is None,
                )
            )
    return with_backlog(engine, spec, rows, counted)


def with_backlog(
    engine: Engine, spec: JobSpec, rows: Sequence[ScopeStatus], tenants: Collection[str]
) -> list[ScopeStatus]:
    """Return ``rows`` with the backlog counted for a tenant job's ``tenants`` among them.

    Each count is one selection, capped at :data:`BACKLOG_CAP`. The other rows stay as they
    were."""
    if spec.partitioning != "tenant" or not tenants:
        return list(rows)
    wanted = set(tenants)
    counted: list[ScopeStatus] = []
    with engine.connect() as conn:
        for row in rows:
            if row.scope in wanted:
                ctx = BatchContext(spec.name, Scope(row.scope), "dry_run", uuid.uuid4())
                row = replace(row, backlog=capped_count(conn, spec.eligible(ctx), BACKLOG_CAP))
            counted.append(row)
    return counted


@dataclass(frozen=True)
class JobSummary:
    """One job over every tenant shown: how many tenants fail, are stale, never ran, or run
    now."""

    job_name: str
    tenants: int
    failing: int
    stale: int
    never_run: int
    running: int
    suspended: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(job_name: str, rows: Sequence[ScopeStatus], suspended: int = 0) -> JobSummary:
    """The summary line of one job's rows."""
    return JobSummary(
        job_name,
        len(rows),
        sum(r.failing for r in rows),
        sum(r.stale for r in rows),
        sum(r.never_run for r in rows),
        sum(r.running for r in rows),
        suspended,
    )


@dataclass(frozen=True)
class BreakerStatus:
    """One downstream's shared circuit breaker (a ``downstream_breaker`` row).

    Its ages are on the database's clock."""

    downstream: str  # scheme://host:port, never credentials
    state: str  # closed | open | half_open
    opened_at: datetime | None  # when the outage began (None once closed)
    open_s: float  # seconds since it last opened; 0 when closed
    probe_after: datetime | None  # the first run after this probes an open breaker
    probe_in_s: float | None  # seconds until probe_after; negative when a probe is due
    reason: str | None  # why it last changed, a short code (e.g. connect_error 10_in_a_row)
    opened_count: int  # how many times it ever opened
    changed_at: datetime
    changed_by_run: uuid.UUID | None  # the job_run that changed it last
    # Its evidence: the last calls of every run, in start order. Stale evidence is forgotten.
    recent_calls: int = 0
    recent_failed: int = 0
    failed_in_a_row: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def evidence_text(self) -> str:
        """``12 of the last 50 failed, 0 in a row``, or ``-`` with no recent call."""
        if not self.recent_calls:
            return "-"
        return (
            f"{self.recent_failed} of the last {self.recent_calls} failed, "
            f"{self.failed_in_a_row} in a row"
        )


_EVIDENCE_S = BreakerSettings().evidence_s  # older evidence is forgotten, as the runs do


def breaker_status(conn: sa.Connection) -> list[BreakerStatus]:
    """Every downstream's breaker, ordered by origin.

    A downstream that no run has opened has no row."""
    b = downstream_breaker.c
    clock = sa.func.clock_timestamp()
    since = sa.func.coalesce(b.opened_at, b.changed_at)
    rows = conn.execute(
        sa.select(
            b.downstream,
            b.state,
            b.opened_at,
            sa.case(
                (b.state == "closed", 0.0),
                else_=sa.func.greatest(0.0, sa.func.extract("epoch", clock - since)),
            ).label("open_s"),
            b.probe_after,
            sa.func.extract("epoch", b.probe_after - clock).label("probe_in_s"),
            b.reason,
            b.opened_count,
            b.changed_at,
            b.changed_by_run,
            sa.case(
                (
                    b.recent_at > clock - sa.func.make_interval(0, 0, 0, 0, 0, 0, _EVIDENCE_S),
                    b.recent,
                ),
                else_="",
            ).label("recent"),
        ).order_by(b.downstream)
    )
    return [
        BreakerStatus(
            r.downstream,
            r.state,
            r.opened_at,
            float(r.open_s),
            r.probe_after,
            None if r.probe_in_s is None else float(r.probe_in_s),
            r.reason,
            int(r.opened_count),
            r.changed_at,
            r.changed_by_run,
            len(r.recent),
            r.recent.count(FAILED),
            len(r.recent) - len(r.recent.rstrip(FAILED)),
        )
        for r in rows
    ]
