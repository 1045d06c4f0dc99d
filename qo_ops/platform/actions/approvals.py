"""Approvals: what a destructive execute that a person asks for must cite, on every path.

A destructive job (cleanup, archive, repair) may be executed by a person from the CLI, the
Dagster Launchpad, a backfill or the operator API. On every path, the run must cite an
approval (``RunOptions.approval``). An approver must have granted it for that job and the
run's tenant, and it must still be valid (not expired, not revoked). A run without one is
refused before anything is claimed. The refusal says in one line how to get an approval, and
it is audited as ``denied`` (``approval_required``). This is the same on every path.

An approver grants approvals. Through the operator API, that is an identity with the
``approver`` role (``POST /internal/jobs/{job}/approvals``). An approver's own destructive
execute also grants one for that run, and so does their approval of a held request. From
the CLI, the approver is whoever holds database credentials that may write
``run_approval``, meaning the owner's or the API's (an administrator). They name themselves
with ``--by``. The runner's role only reads approvals, so a worker cannot grant one.

An approval covers one job over the tenants it names (or every tenant) until it expires, at
most a day later. So one incident's approval covers its runs, retries and backfill chunks.

This module grants, revokes and finds approvals. Whether the approval a run cites allows the
run is part of the consent rule, :func:`qo_ops.platform.run.consent.check_approval`.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from qo_ops.db import audit
from qo_ops.db.schema import run_approval
from qo_ops.errors import BadInput
from qo_ops.platform.job.options import MAX_TEXT
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.schedule.tenants import tenant_exists

MIN_VALID_S = 60
MAX_VALID_S = 24 * 3600
DEFAULT_VALID_S = 3600
# One approval names at most this many tenants. For more, grant every tenant (tenants NULL).
MAX_TENANTS = 1000


@dataclass(frozen=True)
class Approval:
    """One approval, as granted."""

    id: str
    job_name: str
    tenants: list[str] | None  # None means every tenant
    reason: str
    granted_by: str
    granted_at: datetime
    expires_at: datetime
    revoked_at: datetime | None = None
    revoked_by: str | None = None

    def covers(self) -> str:
        return "every tenant" if self.tenants is None else ", ".join(self.tenants)

    def as_dict(self) -> dict[str, Any]:
        return {
            "approvalId": self.id,
            "job": self.job_name,
            "tenants": self.tenants,
            "reason": self.reason,
            "grantedBy": self.granted_by,
            "grantedAt": self.granted_at.isoformat(),
            "expiresAt": self.expires_at.isoformat(),
            "revokedAt": self.revoked_at.isoformat() if self.revoked_at else None,
            "revokedBy": self.revoked_by,
        }


def find(conn: Connection, approval_id: str) -> Approval | None:
    """The approval ``approval_id``, or None."""
    row = conn.execute(sa.select(run_approval).where(run_approval.c.id == approval_id)).first()
    return Approval(**row._mapping) if row is not None else None


@dataclass(frozen=True)
class Grant:
    """An approval being granted for ``job_name``'s execute over ``tenants``, by
    ``granted_by``, for ``valid_for_s`` seconds.

    ``tenants`` None means every tenant. ``request`` holds the API request's ``request_id``
    and ``client_address``, for the audit row."""

    job_name: str
    tenants: Sequence[str] | None
    reason: str
    granted_by: str
    valid_for_s: float = DEFAULT_VALID_S
    request: dict[str, str | None] | None = None


def grant(engine: Engine, spec: JobSpec, wanted: Grant) -> Approval:
    """Record the approval ``wanted``, with an audit row (``approve``, ``granted``).

    It raises BadInput, and writes nothing, for a job that needs no approval, an unknown
    tenant, a blank reason or a validity out of range."""
    if not spec.destructive:
        raise BadInput(f"{spec.name} is not destructive: its execute needs no approval")
    if not wanted.reason.strip() or len(wanted.reason) > MAX_TEXT:
        raise BadInput(f"an approval needs a reason (1 to {MAX_TEXT} characters)")
    if not wanted.granted_by.strip() or len(wanted.granted_by) > MAX_TEXT:
        raise BadInput("an approval names who grants it")
    if not MIN_VALID_S <= wanted.valid_for_s <= MAX_VALID_S:
        raise BadInput(
            f"an approval is valid for {MIN_VALID_S} s to {MAX_VALID_S // 3600} h, "
            f"not {wanted.valid_for_s:g} s"
        )
    named = None if wanted.tenants is None else sorted(set(wanted.tenants))
    if named is not None and not 1 <= len(named) <= MAX_TENANTS:
        raise BadInput(f"name 1 to {MAX_TENANTS} tenants, or every tenant")
    with engine.begin() as conn:
        unknown = [t for t in named or () if not tenant_exists(conn, t)]
        if unknown:
            more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
            raise BadInput(f"unknown tenant {unknown[0]}{more}")
        return record_grant(
            conn, replace(wanted, job_name=spec.name, tenants=named, reason=wanted.reason.strip())
        )


def record_grant(conn: Connection, wanted: Grant) -> Approval:
    """Insert and audit an approval, in the caller's transaction.

    The caller has validated it. The callers are :func:`grant` and the API's acceptance of
    an approver's own execute."""
    row = conn.execute(
        sa.insert(run_approval)
        .values(
            id=new_id(),
            job_name=wanted.job_name,
            tenants=None if wanted.tenants is None else list(wanted.tenants),
            reason=wanted.reason,
            granted_by=wanted.granted_by,
            expires_at=sa.func.now() + timedelta(seconds=wanted.valid_for_s),
        )
        .returning(*run_approval.c)
    ).one()
    approval = Approval(**row._mapping)
    _audit(conn, approval, wanted.granted_by, "granted", wanted.request)
    return approval


def _audit(
    conn: Connection,
    approval: Approval,
    actor: str,
    decision: str,
    request: dict[str, str | None] | None,
) -> None:
    audit.append_audit(
        conn,
        audit.AuditEntry(
            actor=actor,
            action="approve",
            decision=decision,
            job_name=approval.job_name,
            scope=None
            if approval.tenants is None or len(approval.tenants) > 1
            else approval.tenants[0],
            mode="execute",
            reason=approval.reason,
            details={
                "approval": approval.id,
                "tenants": approval.tenants,
                "expires_at": approval.expires_at.isoformat(),
            },
            request_id=(request or {}).get("request_id"),
            client_address=(request or {}).get("client_address"),
        ),
    )


def revoke(
    engine: Engine,
    approval_id: str,
    revoked_by: str,
    request: dict[str, str | None] | None = None,
) -> Approval:
    """Revoke an approval, with an audit row. Runs that cite it from now on are refused.

    An unknown approval raises BadInput."""
    with engine.begin() as conn:
        row = conn.execute(
            sa.update(run_approval)
            .where(run_approval.c.id == approval_id)
            .values(
                revoked_at=sa.func.coalesce(run_approval.c.revoked_at, sa.func.now()),
                revoked_by=sa.func.coalesce(run_approval.c.revoked_by, revoked_by),
            )
            .returning(*run_approval.c)
        ).first()
        if row is None:
            raise BadInput(f"no approval {approval_id}")
        approval = Approval(**row._mapping)
        _audit(conn, approval, revoked_by, "revoked", request)
    return approval


def list_approvals(
    engine: Engine, *, job_name: str | None = None, live: bool = True
) -> list[Approval]:
    """Approvals, newest first. With ``live``, only those neither expired nor revoked."""
    query = sa.select(run_approval).order_by(run_approval.c.granted_at.desc()).limit(200)
    if job_name is not None:
        query = query.where(run_approval.c.job_name == job_name)
    if live:
        query = query.where(
            run_approval.c.revoked_at.is_(None), run_approval.c.expires_at > sa.func.now()
        )
    with engine.connect() as conn:
        return [Approval(**row._mapping) for row in conn.execute(query)]


def new_id() -> str:
    """A new approval id: ``apr-`` and ten lowercase letters and digits.

    It is short enough to type in a form."""
    alphabet = "abcdefghijkmnpqrstuvwxyz23456789"  # no l, o, 0, 1
    return "apr-" + "".join(secrets.choice(alphabet) for _ in range(10))
