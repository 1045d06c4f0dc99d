"""Job status for operators: per job and scope, the last run, last success, lease holder
and backlog."""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from qo_ops.platform.runner import count_eligible
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


# Last run, last success and live lease of every scope the job has seen, plus every tenant.
_STATUS = sa.text(
    """
    SELECT s.scope,
           (SELECT started_at FROM job_run r WHERE r.job_name = :job AND r.scope = s.scope
             ORDER BY started_at DESC LIMIT 1) AS last_run_at,
           (SELECT status FROM job_run r WHERE r.job_name = :job AND r.scope = s.scope
             ORDER BY started_at DESC LIMIT 1) AS last_status,
           (SELECT max(finished_at) FROM job_run r WHERE r.job_name = :job AND r.scope = s.scope
               AND r.status IN ('success', 'no_work') AND r.mode = 'execute') AS last_success_at,
           (SELECT owner_id FROM job_lease l WHERE l.job_name = :job AND l.scope = s.scope
               AND l.expires_at > clock_timestamp()) AS lease_holder,
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
