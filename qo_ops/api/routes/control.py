"""The kill switch: suspend a job for one tenant or every scope, and lift it
(``POST /internal/jobs/{jobName}/suspend`` and ``/resume``; approvers only, audited)."""

# (no `from __future__ import annotations`: FastAPI reads these annotations at runtime)

from typing import Annotated, Any

from fastapi import APIRouter, Body

from qo_ops.api import authz, service
from qo_ops.api.deps import Api, ApiState, Audit, Auditor, Caller, Job
from qo_ops.api.errors import WITH_BODY, ApiError, refusals
from qo_ops.api.models import ControlBody, jsonable
from qo_ops.api.tokens import Principal
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.actions import control
from qo_ops.platform.job.spec import JobSpec

router = APIRouter()


@router.post(
    "/internal/jobs/{jobName}/suspend",
    responses=refusals(*WITH_BODY, 403, 404),
    summary="Kill switch: suspend a job for a tenant or every scope (approver; audited)",
)
def suspend_job(
    spec: Job, p: Caller, api: Api, audit: Auditor, body: Annotated[ControlBody, Body()]
) -> dict[str, Any]:
    _allowed("suspend", spec, body, p, api, audit)
    found, new = control.suspend(
        api.engine,
        control.ControlChange(
            spec.name, body.tenant, actor=p.identity, reason=body.reason, request=_request_of(audit)
        ),
        known_jobs=set(CATALOG),
    )
    return {"job": spec.name, "suspended": jsonable(found.as_dict()), "new": new}


@router.post(
    "/internal/jobs/{jobName}/resume",
    responses=refusals(*WITH_BODY, 403, 404),
    summary="Lift a suspension made by suspend (approver; audited)",
)
def resume_job(
    spec: Job, p: Caller, api: Api, audit: Auditor, body: Annotated[ControlBody, Body()]
) -> dict[str, Any]:
    _allowed("resume", spec, body, p, api, audit)
    lifted = control.resume(
        api.engine,
        control.ControlChange(
            spec.name, body.tenant, actor=p.identity, reason=body.reason, request=_request_of(audit)
        ),
        known_jobs=set(CATALOG),
    )
    with api.engine.connect() as conn:
        left = control.suspensions(conn, spec.name)
    return {
        "job": spec.name,
        "resumed": jsonable(lifted.as_dict()) if lifted else None,
        "stillSuspended": [jsonable(s.as_dict()) for s in left],
    }


def _allowed(
    action: str, spec: JobSpec, body: ControlBody, p: Principal, api: ApiState, audit: Audit
) -> None:
    """Refuse (audited ``403``) unless ``p`` may suspend or resume for ``body.tenant``;
    ``422`` for a tenant that does not exist."""
    decision = authz.may_control(p, body.tenant)
    if not decision.allowed:
        raise audit.deny(p, action, decision.reason, job_name=spec.name,
                         scope=body.tenant or "*", reason=body.reason)  # fmt: skip
    if body.tenant is not None and not service.tenant_exists(api.engine, body.tenant):
        raise ApiError(422, f"unknown tenant {body.tenant}")


def _request_of(audit: Audit) -> dict[str, str | None]:
    """The request's id and client address, for the kill switch's own audit row."""
    return {"request_id": audit.meta.request_id, "client_address": audit.meta.client_address}
