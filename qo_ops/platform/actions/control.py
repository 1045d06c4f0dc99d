"""The kill switch: suspend a job for one tenant or for every scope, and resume it.

A suspension is a ``job_control`` row. It is honoured everywhere a run can start or go on:

- ``run_job`` refuses to start, raising :class:`JobSuspended` and writing an audit row.
- A running batch loop stops at its next batch boundary, because the lease guard reads the
  row. The run ends with status ``cancelled`` and reason ``suspended``.
- The Dagster schedules and sensors skip the scope with a visible reason.

Suspending and resuming are audited (``job_audit`` actions ``suspend`` and ``resume``) in
the same transaction as the change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from qo_ops.db.audit import AuditEntry, append_audit
from qo_ops.db.schema import job_control
from qo_ops.errors import BadInput, QoOpsError, one_line
from qo_ops.platform.job.options import MAX_TEXT
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.schedule.tenants import tenant_exists

EVERY_SCOPE = ""  # the job_control.tenant_id of a suspension that covers every tenant


class JobSuspended(QoOpsError):
    """The job is suspended for this scope, so nothing was run."""

    exit_code = 7  # in `qo-ops run`, 0-6 are run outcomes and bad input (README)
    error_code = "suspended"


@dataclass(frozen=True)
class Suspension:
    """One suspended job, for ``tenant_id``, or for every scope when it is None."""

    job_name: str
    tenant_id: str | None
    suspended_by: str
    reason: str
    suspended_at: datetime

    @property
    def where(self) -> str:
        return f"tenant {self.tenant_id}" if self.tenant_id else "every scope"

    def describe(self) -> str:
        """One line for an operator: what, by whom, since when, why."""
        return (
            f"{self.job_name} is suspended for {self.where} by {self.suspended_by} since "
            f"{self.suspended_at.isoformat(timespec='seconds')}: {one_line(self.reason, 200)}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "job_name": self.job_name,
            "tenant_id": self.tenant_id,
            "suspended_by": self.suspended_by,
            "reason": self.reason,
            "suspended_at": self.suspended_at.isoformat(),
        }


def _suspension(row: Any) -> Suspension:
    return Suspension(
        row.job_name, row.tenant_id or None, row.suspended_by, row.reason, row.suspended_at
    )


def suspension_for(conn: Connection, job_name: str, tenant_id: str) -> Suspension | None:
    """The suspension that stops ``job_name`` for ``tenant_id`` (job-wide first), if any."""
    return next(iter(suspensions(conn, job_name, tenant_id)), None)


def suspensions(
    conn: Connection, job_name: str | None = None, tenant_id: str | None = None
) -> list[Suspension]:
    """Every suspension, job-wide ones first.

    ``job_name`` keeps one job's suspensions. ``tenant_id`` keeps those that stop one
    tenant: the tenant's own and the job-wide ones."""
    query = sa.select(job_control).order_by(job_control.c.job_name, job_control.c.tenant_id)
    if job_name is not None:
        query = query.where(job_control.c.job_name == job_name)
    if tenant_id is not None:
        query = query.where(job_control.c.tenant_id.in_([EVERY_SCOPE, tenant_id]))
    return [_suspension(r) for r in conn.execute(query)]


def _row_of(job_name: str, tenant_id: str | None) -> sa.ColumnElement[bool]:
    """The job_control row of a job for one tenant, or the job-wide row when it is None."""
    return sa.and_(
        job_control.c.job_name == job_name,
        job_control.c.tenant_id == (tenant_id or EVERY_SCOPE),
    )


def _scope_key(tenant_id: str | None) -> str:
    return tenant_id or "*"


def _checked(job_name: str, tenant_id: str | None, reason: str | None, known: set[str]) -> str:
    if job_name not in known:
        raise BadInput(f"unknown job {job_name!r} (known: {', '.join(sorted(known))})")
    if tenant_id is not None:
        Scope(tenant_id)  # this validates the tenant key
    text = (reason or "").strip()
    if not text:
        raise BadInput("a reason is required (--reason)")
    if len(text) > MAX_TEXT:
        raise BadInput(f"the reason is longer than {MAX_TEXT} characters")
    return text


@dataclass(frozen=True)
class ControlChange:
    """A person's suspend or resume: the job, its tenant, who asks and why.

    A tenant of None means every scope. ``request`` says where an API request came from
    (request id, client address), for the audit row."""

    job_name: str
    tenant_id: str | None
    actor: str
    reason: str | None
    request: dict[str, Any] = field(default_factory=dict)


def suspend(
    engine: Engine,
    change: ControlChange,
    *,
    known_jobs: set[str],
) -> tuple[Suspension, bool]:
    """Suspend the change's job for its tenant (None means every scope).

    It returns the suspension and whether it is new. Suspending twice keeps the first
    suspension, and says so."""
    job_name, tenant_id, actor = change.job_name, change.tenant_id, change.actor
    text = _checked(job_name, tenant_id, change.reason, known_jobs)
    with engine.begin() as conn:
        if tenant_id is not None and not tenant_exists(conn, tenant_id):
            raise BadInput(f"unknown tenant {tenant_id}")
        stmt = sa.dialects.postgresql.insert(job_control).values(
            job_name=job_name,
            tenant_id=tenant_id or EVERY_SCOPE,
            suspended_by=actor,
            reason=text,
        )
        inserted = conn.execute(
            stmt.on_conflict_do_nothing().returning(job_control.c.job_name)
        ).first()
        current = conn.execute(sa.select(job_control).where(_row_of(job_name, tenant_id))).one()
        append_audit(
            conn,
            AuditEntry(
                actor=actor,
                action="suspend",
                decision="allowed" if inserted else "already_suspended",
                job_name=job_name,
                scope=_scope_key(tenant_id),
                reason=text,
                details={"tenant_id": tenant_id, "every_scope": tenant_id is None},
                **change.request,
            ),
        )
    return _suspension(current), inserted is not None


def resume(
    engine: Engine,
    change: ControlChange,
    *,
    known_jobs: set[str],
) -> Suspension | None:
    """Lift the suspension of the change's job for its tenant (None means the job-wide one).

    It returns what was lifted, or None when nothing was suspended there. Either way, it
    writes an audit row."""
    job_name, tenant_id, actor = change.job_name, change.tenant_id, change.actor
    text = _checked(job_name, tenant_id, change.reason, known_jobs)
    with engine.begin() as conn:
        gone = conn.execute(
            sa.delete(job_control).where(_row_of(job_name, tenant_id)).returning(*job_control.c)
        ).first()
        lifted = None if gone is None else _suspension(gone)
        append_audit(
            conn,
            AuditEntry(
                actor=actor,
                action="resume",
                decision="allowed" if lifted else "not_suspended",
                job_name=job_name,
                scope=_scope_key(tenant_id),
                reason=text,
                details={
                    "tenant_id": tenant_id,
                    "every_scope": tenant_id is None,
                    "was": lifted.as_dict() if lifted else None,
                },
                **change.request,
            ),
        )
    return lifted
