"""Status for operators: per job and scope, the last run, last success, lease holder and
backlog; and the downstream's circuit breakers."""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from qo_ops.db.schema import downstream_breaker
from qo_ops.platform.breaker import FAILED, BreakerSettings
from qo_ops.platform.liveness import RUN_GONE
from qo_ops.platform.selection import count_eligible
from qo_ops.platform.spec import BatchContext, JobSpec, Scope


@dataclass(frozen=True)
class ScopeStatus:
    """The state of one (job, scope)."""

    job_name: str
    scope: str
    last_run_at: datetime | None
    last_status: str | None
    last_success_at: datetime | None
    lease_holder: str | None
    backlog: int | None
    checkpoint_age_s: float | None = None  # since the scope's checkpoint last moved

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# Last run, last success and live lease (its holder not gone) of every scope the job has
# seen, plus every tenant.
_STATUS = sa.text(
    f"""
    SELECT s.scope,
           (SELECT started_at FROM job_run r WHERE r.job_name = :job AND r.scope = s.scope
             ORDER BY started_at DESC LIMIT 1) AS last_run_at,
           (SELECT status FROM job_run r WHERE r.job_name = :job AND r.scope = s.scope
             ORDER BY started_at DESC LIMIT 1) AS last_status,
           (SELECT max(finished_at) FROM job_run r WHERE r.job_name = :job AND r.scope = s.scope
               AND r.status IN ('success', 'no_work') AND r.mode = 'execute') AS last_success_at,
           (SELECT owner_id FROM job_lease l WHERE l.job_name = :job AND l.scope = s.scope
               AND l.expires_at > clock_timestamp()
               AND NOT EXISTS (SELECT 1 FROM job_run r WHERE r.id = l.job_run_id
                                  AND {RUN_GONE})) AS lease_holder,
           (SELECT extract(epoch FROM clock_timestamp() - c.updated_at) FROM job_checkpoint c
             WHERE c.job_name = :job AND c.scope = s.scope) AS checkpoint_age_s
      FROM (SELECT id AS scope FROM tenant
            UNION SELECT DISTINCT scope FROM job_run WHERE job_name = :job) s
     WHERE CAST(:tenant AS text) IS NULL OR s.scope = :tenant OR s.scope LIKE :tenant || '/%'
     ORDER BY s.scope
    """
)


def job_status(engine: Engine, spec: JobSpec, tenant: str | None = None) -> list[ScopeStatus]:
    """Status rows of ``spec`` (one tenant, or all); backlog only for non-windowed scopes."""
    rows: list[ScopeStatus] = []
    with engine.connect() as conn:
        for r in conn.execute(_STATUS, {"job": spec.name, "tenant": tenant}):
            backlog = None
            if spec.partitioning == "tenant" and "/" not in r.scope:
                ctx = BatchContext(spec.name, Scope(r.scope), "dry_run", uuid.uuid4())
                backlog = count_eligible(conn, spec, ctx)
            rows.append(
                ScopeStatus(
                    spec.name,
                    r.scope,
                    r.last_run_at,
                    r.last_status,
                    r.last_success_at,
                    r.lease_holder,
                    backlog,
                    None if r.checkpoint_age_s is None else round(float(r.checkpoint_age_s), 1),
                )
            )
    return rows


@dataclass(frozen=True)
class BreakerStatus:
    """One downstream's shared circuit breaker (a ``downstream_breaker`` row), with its ages
    on the database's clock."""

    downstream: str  # scheme://host:port, never credentials
    state: str  # closed | open | half_open
    opened_at: datetime | None  # when the outage began (None once closed)
    open_s: float  # since it last opened; 0 when closed
    probe_after: datetime | None  # an open breaker is probed by the first run after this
    probe_in_s: float | None  # until then (negative: due)
    reason: str | None  # why it last changed, a short code (e.g. connect_error 10_in_a_row)
    opened_count: int  # times it opened, ever
    changed_at: datetime
    changed_by_run: uuid.UUID | None  # the job_run that changed it last
    # its evidence (the last calls of every run, in start order; forgotten when stale)
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


_EVIDENCE_S = BreakerSettings().evidence_s  # older evidence is forgotten (the runs' rule)


def breaker_status(conn: sa.Connection) -> list[BreakerStatus]:
    """Every downstream's breaker, by origin. A downstream no run has opened has no row."""
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
