"""Recovery without database surgery (``qo_ops.platform.actions.recovery``), the same actions as
``qo-ops requeue``, ``review`` and ``checkpoint``: a job's dead letters requeued, its
manual-review queue listed and decided, its checkpoints shown and reset. Every change needs
a reason and is audited in its own transaction; ``dryRun`` says what would change."""

# (no `from __future__ import annotations`: FastAPI reads these annotations at runtime)

import uuid
from collections.abc import Callable
from datetime import date, timedelta
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Body, Path, Query
from pydantic import BaseModel, ConfigDict, Field

from qo_ops.api import authz, service
from qo_ops.api.deps import Api, ApiState, Audit, Auditor, Caller, Job
from qo_ops.api.errors import WITH_BODY, ApiError, refusals
from qo_ops.api.models import EXAMPLE_TENANT, ISO_DATE, NO_CONTROL, jsonable
from qo_ops.api.tokens import Principal
from qo_ops.errors import BadInput
from qo_ops.platform.actions import recovery
from qo_ops.platform.job.options import MAX_TEXT
from qo_ops.platform.job.scope import TENANT_ID
from qo_ops.platform.job.spec import JobSpec

router = APIRouter()
T = TypeVar("T")

Tenant = Field(pattern=TENANT_ID.pattern, examples=[EXAMPLE_TENANT], description="The tenant.")
Reason = Field(min_length=1, max_length=MAX_TEXT, pattern=NO_CONTROL, description="Why; audited.")
DryRun = Field(default=False, strict=True, description="Say what would change; change nothing.")


class RequeueBody(BaseModel):
    """Which dead letters of the tenant go back to work: the ones named, or all of them."""

    model_config = ConfigDict(extra="forbid")

    tenant: str = Tenant
    items: list[uuid.UUID] | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="Only these dead letters (up to 200; more: allDead with limit).",
    )
    allDead: bool = Field(default=False, strict=True, description="Every dead letter (to limit).")
    limit: int = Field(default=1000, ge=1, le=recovery.MAX_REQUEUE, strict=True)
    reason: str = Reason
    dryRun: bool = DryRun


class ResolveBody(BaseModel):
    """A decision on one flagged item: an action its job offers."""

    model_config = ConfigDict(extra="forbid")

    tenant: str = Tenant
    action: str = Field(pattern=r"^[a-z_]{1,32}$", examples=["dismiss"])
    reason: str = Reason
    dryRun: bool = DryRun


class ResetBody(BaseModel):
    """Which of the tenant's checkpoints to forget: those within the days, or all."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    tenant: str = Tenant
    from_: str | None = Field(
        default=None, alias="from", pattern=ISO_DATE, json_schema_extra={"format": "date"},
        description="First day (windowed jobs), inclusive.",
    )  # fmt: skip
    to: str | None = Field(
        default=None, pattern=ISO_DATE, json_schema_extra={"format": "date"},
        description="The day after the last (exclusive, as every window of the API).",
    )  # fmt: skip
    reason: str = Reason
    dryRun: bool = DryRun


TenantQuery = Annotated[str | None, Query(pattern=TENANT_ID.pattern, examples=[EXAMPLE_TENANT])]
Item = Annotated[str, Path(pattern=r"^[A-Za-z0-9._:-]{1,128}$", description="The flagged item.")]


def _days(start: str | None, end: str | None) -> tuple[date | None, date | None]:
    """``from`` and ``to`` (exclusive, as every window of the API) as the first and last day
    the platform takes (both included); ``422`` for a date off the calendar or an empty
    window."""
    try:
        first = date.fromisoformat(start) if start is not None else None
        after = date.fromisoformat(end) if end is not None else None
    except ValueError:
        raise ApiError(422, "from and to must be dates on the calendar") from None
    if first is not None and after is not None and after <= first:
        raise ApiError(422, "to (exclusive) must be after from")
    return first, after - timedelta(days=1) if after is not None else None


def _answer(action: Callable[[], T]) -> T:
    """``action()``, its refusals as the API answers them: a recovery the job does not have
    ``404``, a scope a run holds ``409``, bad input ``422``."""
    try:
        return action()
    except recovery.NotOffered as exc:
        raise ApiError(404, str(exc)) from None
    except recovery.ScopeBusy as exc:
        raise ApiError(409, str(exc)) from None
    except BadInput as exc:
        raise ApiError(422, str(exc)) from None


def _who(p: Principal, reason: str, audit: Audit) -> recovery.Who:
    meta = audit.meta
    return _answer(recovery.Who(p.identity, reason, meta.request_id, meta.client_address).validated)


def _allowed(
    action: str, spec: JobSpec, p: Principal, api: ApiState, audit: Audit, tenant: str,
    *, destructive: bool = False, dry_run: bool = False, reason: str | None = None,
) -> None:  # fmt: skip
    """Refuse (audited ``403``) unless ``p`` may do ``action`` for ``tenant``; ``422`` for a
    tenant that does not exist."""
    decision = authz.may_recover(p, tenant, destructive=destructive, dry_run=dry_run)
    if not decision.allowed:
        raise audit.deny(p, action, decision.reason, job_name=spec.name, scope=tenant,
                         reason=reason)  # fmt: skip
    if not service.tenant_exists(api.engine, tenant):
        raise ApiError(422, f"unknown tenant {tenant}")


# --------------------------------------------------------------------------- dead letters


@router.post(
    "/internal/jobs/{jobName}/dead-letters/requeue",
    responses=refusals(*WITH_BODY, 403, 404, 409),
    summary="Put a job's dead letters back to work (operator; audited; dryRun to look first)",
)
def requeue_dead_letters(
    spec: Job, p: Caller, api: Api, audit: Auditor, body: Annotated[RequeueBody, Body()]
) -> dict[str, Any]:
    _answer(lambda: recovery.dead_letter_kind(spec))
    if bool(body.items) == body.allDead:
        raise ApiError(422, "give either items or allDead: true")
    _allowed("requeue", spec, p, api, audit, body.tenant, dry_run=body.dryRun, reason=body.reason)
    which = recovery.DeadLetters(body.tenant, body.items, body.limit)
    who = _who(p, body.reason, audit)
    return _answer(
        lambda: recovery.requeue(api.engine, spec, who, which, dry_run=body.dryRun)
    ).as_dict()


# --------------------------------------------------------------------------- manual review


@router.get(
    "/internal/jobs/{jobName}/reviews",
    responses=refusals(403, 404, 422),
    summary="The items a job flagged for a person, with why, oldest first",
)
def list_reviews(
    spec: Job,
    p: Caller,
    api: Api,
    audit: Auditor,
    tenant: TenantQuery = None,
    limit: Annotated[int, Query(ge=1, le=recovery.MAX_LISTED)] = 100,
) -> dict[str, Any]:
    review = _answer(lambda: recovery.review_queue(spec))
    wanted = audit.readable(p, spec.name, tenant)
    with api.engine.connect() as conn:
        found = recovery.waiting_for_review(conn, [spec], wanted, limit)
    return {
        "job": spec.name,
        "actions": {name: a.help for name, a in review.actions.items()},
        "waiting": [jsonable(item.as_dict()) for _, item in found],
    }


@router.post(
    "/internal/jobs/{jobName}/reviews/{item}/resolve",
    responses=refusals(*WITH_BODY, 403, 404, 409),
    summary="Decide one flagged item with an action its job offers (operator; audited)",
)
def resolve_review(
    spec: Job,
    item: Item,
    p: Caller,
    api: Api,
    audit: Auditor,
    body: Annotated[ResolveBody, Body()],
) -> dict[str, Any]:
    _answer(lambda: recovery.review_action(spec, body.action))
    _allowed("resolve", spec, p, api, audit, body.tenant, dry_run=body.dryRun, reason=body.reason)
    decision = recovery.Decision(body.tenant, item, body.action)
    who = _who(p, body.reason, audit)
    return _answer(
        lambda: recovery.resolve(api.engine, spec, who, decision, dry_run=body.dryRun)
    ).as_dict()


# --------------------------------------------------------------------------- checkpoints


@router.get(
    "/internal/jobs/{jobName}/checkpoints",
    responses=refusals(403, 404, 422),
    summary="A tenant's checkpoints of a job (within from..to), and whether a run holds each",
)
def list_checkpoints(
    spec: Job,
    p: Caller,
    api: Api,
    audit: Auditor,
    tenant: Annotated[str, Query(pattern=TENANT_ID.pattern, examples=[EXAMPLE_TENANT])],
    from_: Annotated[
        str | None, Query(alias="from", pattern=ISO_DATE, json_schema_extra={"format": "date"})
    ] = None,
    to: Annotated[str | None, Query(pattern=ISO_DATE, json_schema_extra={"format": "date"})] = None,
) -> dict[str, Any]:
    which = recovery.Checkpoints(tenant, *_days(from_, to))
    _answer(lambda: recovery.checkpoint_days(spec, which))
    audit.readable(p, spec.name, tenant)
    with api.engine.connect() as conn:
        rows = recovery.checkpoints(conn, spec, which)
    return {"job": spec.name, "checkpoints": [jsonable(r.as_dict()) for r in rows]}


@router.post(
    "/internal/jobs/{jobName}/checkpoints/reset",
    responses=refusals(*WITH_BODY, 403, 404, 409),
    summary="Forget a tenant's checkpoints of a job: their next runs start over (approver)",
)
def reset_checkpoints(
    spec: Job, p: Caller, api: Api, audit: Auditor, body: Annotated[ResetBody, Body()]
) -> dict[str, Any]:
    which = recovery.Checkpoints(body.tenant, *_days(body.from_, body.to))
    _answer(lambda: recovery.checkpoint_days(spec, which))
    _allowed("checkpoint_reset", spec, p, api, audit, body.tenant, destructive=True,
             dry_run=body.dryRun, reason=body.reason)  # fmt: skip
    who = _who(p, body.reason, audit)
    return _answer(
        lambda: recovery.reset_checkpoints(api.engine, spec, who, which, dry_run=body.dryRun)
    ).as_dict()
