"""The database side of the operator API: accept a run (run row, idempotency key and audit
row in one transaction), record its launch, approve, cancel, read. Every decision the API
takes — allowed or denied — becomes one ``job_audit`` row here."""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from qo_ops.db.schema import api_idempotency, job_run
from qo_ops.platform import runs, tenants
from qo_ops.platform.spec import JobSpec, Scope

IDEMPOTENCY_TTL_HOURS = 24
_DELETE_EXPIRED_KEYS = sa.delete(api_idempotency).where(
    api_idempotency.c.created_at
    < sa.func.now() - sa.text(f"interval '{IDEMPOTENCY_TTL_HOURS} hours'")
)


@dataclass(frozen=True)
class RequestMeta:
    """Where a request came from (kept in the audit row)."""

    request_id: str
    client_address: str | None


@dataclass(frozen=True)
class RunRequest:
    """A validated request to run a job."""

    spec: JobSpec
    mode: str
    scope: Scope
    limits: dict[str, int]  # batch_size, max_items, throttle_ms: only those given
    reason: str | None
    correlation_id: str | None
    request_approval: bool

    def fingerprint(self) -> str:
        """What an Idempotency-Key is bound to: the same key must mean the same request."""
        body = {
            "job": self.spec.name,
            "mode": self.mode,
            "scope": self.scope.key,
            "limits": self.limits,
            "reason": self.reason,
            "correlation_id": self.correlation_id,
            "request_approval": self.request_approval,
        }
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


@dataclass
class Submitted:
    """What became of a submission."""

    outcome: Literal["created", "replayed", "conflict", "key_reused"]
    run_id: uuid.UUID | None = None
    status: str | None = None
    active_run: dict[str, Any] = field(default_factory=dict)


def audit(
    engine: Engine,
    actor: str,
    action: str,
    decision: str,
    meta: RequestMeta,
    *,
    job_name: str | None = None,
    scope: str | None = None,
    mode: str | None = None,
    reason: str | None = None,
    correlation_id: str | None = None,
    run_id: uuid.UUID | None = None,
    details: dict[str, Any] | None = None,
) -> None:
    """One audit row in its own transaction (denials, launches, reads are not audited)."""
    with engine.begin() as conn:
        runs.append_audit(
            conn,
            runs.AuditEntry(
                actor=actor,
                action=action,
                decision=decision,
                job_name=job_name,
                scope=scope,
                mode=mode,
                reason=reason,
                correlation_id=correlation_id,
                job_run_id=run_id,
                details=details or {},
                request_id=meta.request_id,
                client_address=meta.client_address,
            ),
        )


def _active_run(conn: sa.Connection, job_name: str, scope: str) -> dict[str, Any] | None:
    row = conn.execute(
        sa.select(
            job_run.c.id,
            job_run.c.status,
            job_run.c.dagster_run_id,
            job_run.c.created_at,
            # its age by the database's clock: whether it is stale is no API replica's guess
            sa.func.extract("epoch", sa.func.clock_timestamp() - job_run.c.created_at).label(
                "age_s"
            ),
        )
        .where(
            job_run.c.job_name == job_name,
            job_run.c.scope == scope,
            job_run.c.status.in_(runs.ACTIVE_STATUSES),
        )
        .order_by(job_run.c.created_at)
        .limit(1)
    ).first()
    return dict(row._mapping) if row else None


def submit(
    engine: Engine,
    identity: str,
    request: RunRequest,
    hold: bool,
    idempotency_key: str | None,
    meta: RequestMeta,
) -> Submitted:
    """Create the ``accepted`` (or ``awaiting_approval``) run and its audit row, unless the
    key names an earlier run or the job and scope already have an active run."""
    for _attempt in range(2):  # a concurrent twin with the same key: read what it created
        try:
            return _submit_once(engine, identity, request, hold, idempotency_key, meta)
        except IntegrityError:
            continue
    raise RuntimeError("idempotency key kept colliding")


def _submit_once(
    engine: Engine,
    identity: str,
    request: RunRequest,
    hold: bool,
    idempotency_key: str | None,
    meta: RequestMeta,
) -> Submitted:
    spec, scope = request.spec, request.scope
    fingerprint = request.fingerprint()
    with engine.begin() as conn:
        common: dict[str, Any] = {
            "actor": identity,
            "action": "submit",
            "job_name": spec.name,
            "scope": scope.key,
            "mode": request.mode,
            "reason": request.reason,
            "correlation_id": request.correlation_id,
            "request_id": meta.request_id,
            "client_address": meta.client_address,
        }
        if idempotency_key is not None:
            # keys live a day: an expired one (whose run run_history_retention may have
            # deleted since) is forgotten before the lookup, never replayed or collided with
            conn.execute(_DELETE_EXPIRED_KEYS)
            seen = conn.execute(
                sa.select(api_idempotency.c.request_sha256, job_run.c.id, job_run.c.status)
                .join(job_run, job_run.c.id == api_idempotency.c.job_run_id)
                .where(
                    api_idempotency.c.identity == identity,
                    api_idempotency.c.idempotency_key == idempotency_key,
                )
            ).first()
            if seen is not None:
                same = seen.request_sha256 == fingerprint
                runs.append_audit(
                    conn,
                    runs.AuditEntry(
                        **common,
                        decision="replayed" if same else "denied: idempotency key reused",
                        job_run_id=seen.id,
                    ),
                )
                return Submitted("replayed" if same else "key_reused", seen.id, seen.status)
        # one accepting transaction per job and scope at a time
        conn.execute(
            sa.text("SELECT pg_advisory_xact_lock(hashtextextended(:k, 0))"),
            {"k": f"qo_ops.api:{spec.name}:{scope.key}"},
        )
        active = _active_run(conn, spec.name, scope.key)
        if active is not None:
            runs.append_audit(
                conn,
                runs.AuditEntry(
                    **common,
                    decision="denied: conflict",
                    job_run_id=active["id"],
                    details={"active_status": active["status"]},
                ),
            )
            return Submitted("conflict", active["id"], active["status"], active)
        run_id = uuid.uuid4()
        status = "awaiting_approval" if hold else "accepted"
        conn.execute(
            sa.insert(job_run).values(
                id=run_id,
                job_name=spec.name,
                scope=scope.key,
                window_start=scope.window_start,
                window_end=scope.window_end,
                mode=request.mode,
                trigger_type="api",
                requester=identity,
                reason=request.reason,
                correlation_id=request.correlation_id,
                owner_id="api",
                options=request.limits,
                status=status,
            )
        )
        if idempotency_key is not None:
            conn.execute(
                sa.insert(api_idempotency).values(
                    identity=identity,
                    idempotency_key=idempotency_key,
                    request_sha256=fingerprint,
                    job_run_id=run_id,
                )
            )
        runs.append_audit(
            conn,
            runs.AuditEntry(
                **common,
                decision="held for approval" if hold else "allowed",
                job_run_id=run_id,
                details={"limits": request.limits},
            ),
        )
        return Submitted("created", run_id, status)


def expire_stale(engine: Engine, run_id: uuid.UUID, reason: str, meta: RequestMeta) -> bool:
    """End an accepted run that will never start (its Dagster run ended or its launch was
    lost); audited. False if it started meanwhile."""
    with engine.begin() as conn:
        done = runs.finish_unstarted(conn, run_id, "failed", reason, reason)
        if done:
            runs.append_audit(
                conn,
                runs.AuditEntry(
                    actor="qo-ops-api",
                    action="expire",
                    decision=f"failed: {reason}",
                    job_run_id=run_id,
                    request_id=meta.request_id,
                    client_address=meta.client_address,
                ),
            )
        return done


def record_launch(engine: Engine, run_id: uuid.UUID, dagster_run_id: str) -> None:
    with engine.begin() as conn:
        conn.execute(
            sa.update(job_run).where(job_run.c.id == run_id).values(dagster_run_id=dagster_run_id)
        )


def record_launch_failed(
    engine: Engine, identity: str, run_id: uuid.UUID, message: str, meta: RequestMeta
) -> None:
    """The run could not be handed to Dagster: it ends ``failed``/``launch_failed``."""
    with engine.begin() as conn:
        runs.finish_unstarted(conn, run_id, "failed", "launch_failed", "launch_failed", message)
        runs.append_audit(
            conn,
            runs.AuditEntry(
                actor=identity,
                action="launch",
                decision="failed: launch_failed",
                job_run_id=run_id,
                details={"error": message},
                request_id=meta.request_id,
                client_address=meta.client_address,
            ),
        )


def approve(
    engine: Engine, identity: str, run_id: uuid.UUID, reason: str, meta: RequestMeta
) -> str:
    """Release a held run (status ``accepted``); returns the status it had."""
    with engine.begin() as conn:
        row = conn.execute(
            sa.select(job_run.c.status, job_run.c.job_name, job_run.c.scope, job_run.c.mode)
            .where(job_run.c.id == run_id)
            .with_for_update()
        ).one()
        if row.status == "awaiting_approval":
            conn.execute(
                sa.update(job_run)
                .where(job_run.c.id == run_id)
                .values(
                    status="accepted",
                    approved_by=identity,
                    approved_at=sa.func.clock_timestamp(),
                )
            )
        runs.append_audit(
            conn,
            runs.AuditEntry(
                actor=identity,
                action="approve",
                decision="allowed"
                if row.status == "awaiting_approval"
                else f"ignored: {row.status}",
                job_name=row.job_name,
                scope=row.scope,
                mode=row.mode,
                reason=reason,
                job_run_id=run_id,
                request_id=meta.request_id,
                client_address=meta.client_address,
            ),
        )
        return str(row.status)


RUN_FIELDS = (
    "id",
    "job_name",
    "scope",
    "window_start",
    "window_end",
    "mode",
    "trigger_type",
    "requester",
    "reason",
    "correlation_id",
    "dagster_run_id",
    "status",
    "status_reason",
    "created_at",
    "started_at",
    "finished_at",
    "cancel_requested_at",
    "approved_by",
    "approved_at",
    "fencing_token",
    "last_error_code",
    *runs.COUNTERS,
    "tally",  # shown as the run's downstream figures (qo_ops.platform.manners)
)


def get_run(engine: Engine, job_name: str, run_id: uuid.UUID) -> dict[str, Any] | None:
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(*(job_run.c[f] for f in RUN_FIELDS)).where(
                job_run.c.id == run_id, job_run.c.job_name == job_name
            )
        ).first()
    return dict(row._mapping) if row else None


def tenant_exists(engine: Engine, tenant_id: str) -> bool:
    """Whether ``tenant_id`` is a tenant (before a request claims anything)."""
    with engine.connect() as conn:
        return tenants.tenant_exists(conn, tenant_id)
