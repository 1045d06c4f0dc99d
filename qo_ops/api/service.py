"""The database side of the operator API: accept a run (run row, idempotency key and audit
row in one transaction), record its launch, approve, read. Every decision the API takes —
allowed or denied — becomes one ``job_audit`` row: here when it belongs to the transaction
that acts on it, through ``deps.Audit`` (one row in its own transaction) for a refusal."""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError

from qo_ops.db import audit
from qo_ops.db.schema import api_idempotency, job_run
from qo_ops.platform.actions import approvals
from qo_ops.platform.job.scope import Scope, tenant_of
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.job.statuses import ACTIVE, RunStatus
from qo_ops.platform.run import records
from qo_ops.platform.schedule import tenants

IDEMPOTENCY_TTL_HOURS = 24
RUN_APPROVAL_VALID_S = 6 * 3600  # an approval the API grants for one run: past any queue

# Twice: a second delete finds the expired keys already gone and matches nothing.
_DELETE_EXPIRED_KEYS = sa.text(
    "DELETE FROM api_idempotency WHERE created_at < now() - make_interval(hours => :ttl_hours)"
)

# The run an identity's Idempotency-Key already names, and the request the key is bound to.
_FIND_KEY = (
    sa.select(api_idempotency.c.request_sha256, job_run.c.id, job_run.c.status)
    .join(job_run, job_run.c.id == api_idempotency.c.job_run_id)
    .where(
        api_idempotency.c.identity == sa.bindparam("identity"),
        api_idempotency.c.idempotency_key == sa.bindparam("idempotency_key"),
    )
)

# One accepting transaction per job and scope at a time (released at commit).
_LOCK_SCOPE = sa.text("SELECT pg_advisory_xact_lock(hashtextextended(:lock_key, 0))")

# The oldest run of the job and scope that has not ended, if any.
_ACTIVE_RUN = (
    sa.select(
        job_run.c.id,
        job_run.c.status,
        job_run.c.dagster_run_id,
        job_run.c.created_at,
        # its age by the database's clock: whether it is stale is no API replica's guess
        sa.func.extract("epoch", sa.func.clock_timestamp() - job_run.c.created_at).label("age_s"),
    )
    .where(
        job_run.c.job_name == sa.bindparam("job_name"),
        job_run.c.scope == sa.bindparam("scope"),
        job_run.c.status.in_(ACTIVE),
    )
    .order_by(job_run.c.created_at)
    .limit(1)
)

# Twice: each call creates its own run (a fresh id); a second request for the same job and
# scope waits on _LOCK_SCOPE and then finds this one in _ACTIVE_RUN: a conflict, no insert.
_INSERT_RUN = sa.insert(job_run)

# Twice: (identity, idempotency_key) is unique: a concurrent twin's insert fails, and submit
# then reads the run the first one created.
_INSERT_KEY = sa.insert(api_idempotency)

# Twice: a run is launched once, by the request that created or approved it; writing the
# same Dagster run id again changes nothing.
_RECORD_LAUNCH = sa.text("UPDATE job_run SET dagster_run_id = :dagster_run_id WHERE id = :run_id")

# The run to approve, locked until the approval commits.
_LOCK_RUN = (
    sa.select(job_run.c.status, job_run.c.job_name, job_run.c.scope, job_run.c.mode)
    .where(job_run.c.id == sa.bindparam("run_id"))
    .with_for_update()
)

# Twice: a second approval finds the run no longer awaiting_approval and matches nothing.
_APPROVE = sa.text(
    """
    UPDATE job_run SET status = 'accepted', approved_by = :identity,
                       approved_at = clock_timestamp(), approval_id = :approval_id
     WHERE id = :run_id AND status = 'awaiting_approval'
    """
)


@dataclass(frozen=True)
class RequestMeta:
    """Where a request came from (kept in the audit row)."""

    request_id: str
    client_address: str | None

    def entry(self, actor: str, action: str, decision: str, **about: Any) -> audit.AuditEntry:
        """An audit entry of this request: ``about`` names the job, scope, run and so on."""
        return audit.AuditEntry(
            actor,
            action,
            decision,
            request_id=self.request_id,
            client_address=self.client_address,
            **about,
        )


@dataclass(frozen=True)
class RunRequest:
    """A validated request to run a job, from its HTTP body (``models.RunRequestBody``): the
    API records it as an ``accepted`` run and launches it in Dagster, whose op then runs it
    (``run_job``, which admits it: ``qo_ops.platform.run.admission.Admission``)."""

    spec: JobSpec
    mode: str
    scope: Scope
    limits: dict[str, int]  # batch_size, max_items, throttle_ms: only those given
    reason: str | None
    correlation_id: str | None
    request_approval: bool
    approval: str | None = None  # the approval a destructive execute cites

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
            **({"approval": self.approval} if self.approval else {}),
        }
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Submission:
    """A run request as one identity submitted it."""

    identity: str
    request: RunRequest
    hold: bool  # authorization's answer: wait for a second identity's approval
    idempotency_key: str | None
    meta: RequestMeta
    grant: bool = False  # an approver's own destructive execute: it grants its approval


@dataclass
class Submitted:
    """What became of a submission."""

    outcome: Literal["created", "replayed", "conflict", "key_reused"]
    run_id: uuid.UUID | None = None
    status: str | None = None
    active_run: dict[str, Any] = field(default_factory=dict)


def submit(engine: Engine, submission: Submission) -> Submitted:
    """Create the ``accepted`` (or ``awaiting_approval``) run and its audit row, unless the
    key names an earlier run or the job and scope already have an active run."""
    for _attempt in range(2):  # a concurrent twin with the same key: read what it created
        try:
            return _submit_once(engine, submission)
        except IntegrityError:
            continue
    raise RuntimeError("idempotency key kept colliding")


def _submit_once(engine: Engine, submission: Submission) -> Submitted:
    identity, request, meta = submission.identity, submission.request, submission.meta
    key = submission.idempotency_key
    spec, scope = request.spec, request.scope
    fingerprint = request.fingerprint()
    about: dict[str, Any] = {
        "job_name": spec.name,
        "scope": scope.key,
        "mode": request.mode,
        "reason": request.reason,
        "correlation_id": request.correlation_id,
    }
    with engine.begin() as conn:
        if key is not None:
            # keys live a day: an expired one (whose run run_history_retention may have
            # deleted since) is forgotten before the lookup, never replayed or collided with
            conn.execute(_DELETE_EXPIRED_KEYS, {"ttl_hours": IDEMPOTENCY_TTL_HOURS})
            seen = conn.execute(_FIND_KEY, {"identity": identity, "idempotency_key": key}).first()
            if seen is not None:
                same = seen.request_sha256 == fingerprint
                decision = "replayed" if same else "denied: idempotency key reused"
                audit.append_audit(
                    conn, meta.entry(identity, "submit", decision, job_run_id=seen.id, **about)
                )
                return Submitted("replayed" if same else "key_reused", seen.id, seen.status)
        conn.execute(_LOCK_SCOPE, {"lock_key": f"qo_ops.api:{spec.name}:{scope.key}"})
        found = conn.execute(_ACTIVE_RUN, {"job_name": spec.name, "scope": scope.key}).first()
        if found is not None:
            active = dict(found._mapping)
            audit.append_audit(
                conn,
                meta.entry(
                    identity,
                    "submit",
                    "denied: conflict",
                    job_run_id=active["id"],
                    details={"active_status": active["status"]},
                    **about,
                ),
            )
            return Submitted("conflict", active["id"], active["status"], active)
        run_id = uuid.uuid4()
        status = RunStatus.AWAITING_APPROVAL if submission.hold else RunStatus.ACCEPTED
        approval_id = request.approval
        if submission.grant:  # the approver's role is the approval; the run cites it
            approval_id = _grant_for_run(
                conn, identity, spec.name, scope.tenant_id, request.reason, meta
            ).id
        conn.execute(
            _INSERT_RUN,
            {
                "id": run_id,
                "job_name": spec.name,
                "scope": scope.key,
                "window_start": scope.window_start,
                "window_end": scope.window_end,
                "mode": request.mode,
                "trigger_type": "api",
                "requester": identity,
                "reason": request.reason,
                "correlation_id": request.correlation_id,
                "owner_id": "api",
                "options": request.limits,
                "status": status,
                "approval_id": approval_id,
            },
        )
        if key is not None:
            conn.execute(
                _INSERT_KEY,
                {
                    "identity": identity,
                    "idempotency_key": key,
                    "request_sha256": fingerprint,
                    "job_run_id": run_id,
                },
            )
        decision = "held for approval" if submission.hold else "allowed"
        audit.append_audit(
            conn,
            meta.entry(
                identity,
                "submit",
                decision,
                job_run_id=run_id,
                details={"limits": request.limits},
                **about,
            ),
        )
        return Submitted("created", run_id, status)


def expire_stale(engine: Engine, run_id: uuid.UUID, reason: str, meta: RequestMeta) -> bool:
    """End an accepted run that will never start (its Dagster run ended or its launch was
    lost); audited. False if it started meanwhile."""
    with engine.begin() as conn:
        done = records.finish_unstarted(conn, run_id, RunStatus.FAILED, reason, reason)
        if done:
            audit.append_audit(
                conn, meta.entry("qo-ops-api", "expire", f"failed: {reason}", job_run_id=run_id)
            )
        return done


def record_launch(engine: Engine, run_id: uuid.UUID, dagster_run_id: str) -> None:
    """Link the run to the Dagster run that will execute it."""
    with engine.begin() as conn:
        conn.execute(_RECORD_LAUNCH, {"run_id": run_id, "dagster_run_id": dagster_run_id})


def record_launch_failed(
    engine: Engine, identity: str, run_id: uuid.UUID, message: str, meta: RequestMeta
) -> None:
    """The run could not be handed to Dagster: it ends ``failed``/``launch_failed``."""
    with engine.begin() as conn:
        records.finish_unstarted(
            conn, run_id, RunStatus.FAILED, "launch_failed", "launch_failed", message
        )
        audit.append_audit(
            conn,
            meta.entry(
                identity,
                "launch",
                "failed: launch_failed",
                job_run_id=run_id,
                details={"error": message},
            ),
        )


def _grant_for_run(
    conn: Connection, identity: str, job_name: str, tenant_id: str, reason: str | None,
    meta: RequestMeta,
) -> approvals.Approval:  # fmt: skip
    """The approval an approver's own execute, or their approval of a held run, grants for
    that run's job and tenant (the same record the CLI and the Launchpad cite)."""
    return approvals.record_grant(
        conn,
        approvals.Grant(
            job_name,
            [tenant_id],
            reason or "approved through the operator API",
            identity,
            RUN_APPROVAL_VALID_S,
            {"request_id": meta.request_id, "client_address": meta.client_address},
        ),
    )


def approve(
    engine: Engine, identity: str, run_id: uuid.UUID, reason: str, meta: RequestMeta
) -> str:
    """Release a held run (status ``accepted``), granting the approval it then cites;
    returns the status it had."""
    with engine.begin() as conn:
        row = conn.execute(_LOCK_RUN, {"run_id": run_id}).one()
        held = row.status == RunStatus.AWAITING_APPROVAL
        if held:
            granted = _grant_for_run(
                conn, identity, row.job_name, tenant_of(row.scope), reason, meta
            )
            conn.execute(
                _APPROVE, {"run_id": run_id, "identity": identity, "approval_id": granted.id}
            )
        audit.append_audit(
            conn,
            meta.entry(
                identity,
                "approve",
                "allowed" if held else f"ignored: {row.status}",
                job_name=row.job_name,
                scope=row.scope,
                mode=row.mode,
                reason=reason,
                job_run_id=run_id,
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
    "approval_id",
    "fencing_token",
    "last_error_code",
    *records.COUNTERS,
    "tally",  # shown as the run's downstream figures (qo_ops.platform.calls.call_stats)
)


# A run of a job, as the API shows it.
_GET_RUN = sa.select(*(job_run.c[f] for f in RUN_FIELDS)).where(
    job_run.c.id == sa.bindparam("run_id"), job_run.c.job_name == sa.bindparam("job_name")
)


def get_run(engine: Engine, job_name: str, run_id: uuid.UUID) -> dict[str, Any] | None:
    """The run ``run_id`` of ``job_name``, or None."""
    with engine.connect() as conn:
        row = conn.execute(_GET_RUN, {"run_id": run_id, "job_name": job_name}).first()
    return dict(row._mapping) if row else None


def tenant_exists(engine: Engine, tenant_id: str) -> bool:
    """Whether ``tenant_id`` is a tenant (before a request claims anything)."""
    with engine.connect() as conn:
        return tenants.tenant_exists(conn, tenant_id)
