"""Approvals: an approver grants one that a destructive execute cites on any path
(``POST /internal/jobs/{jobName}/approvals``: the CLI's --approval, the Launchpad's config
approval, a backfill's tag, the API's approvalId), and the two-person rule's second step: a
second identity approves a held destructive run
(``POST /internal/jobs/{jobName}/runs/{runId}/approve``), which then launches citing the
approval that grants."""

# (no `from __future__ import annotations`: FastAPI reads these annotations at runtime)

from typing import Annotated

from fastapi import APIRouter, Body
from fastapi.responses import JSONResponse

from qo_ops.api import authz, service
from qo_ops.api.deps import Api, Auditor, Caller, Job, Run
from qo_ops.api.errors import WITH_BODY, ApiError, refusals
from qo_ops.api.launch import launch
from qo_ops.api.models import ACCEPTED_HEADERS, Accepted, ApprovalBody, ReasonBody, accepted
from qo_ops.errors import BadInput
from qo_ops.platform.actions import approvals
from qo_ops.platform.job.scope import Scope, tenant_of
from qo_ops.platform.job.statuses import RunStatus

router = APIRouter()


@router.post(
    "/internal/jobs/{jobName}/approvals",
    status_code=201,
    responses=refusals(*WITH_BODY, 403, 404),
    summary="Grant an approval a destructive job's execute cites (approver role)",
)
def grant_approval(
    spec: Job, p: Caller, api: Api, audit: Auditor, body: Annotated[ApprovalBody, Body()]
) -> JSONResponse:
    decision = authz.may_grant(p, body.tenants)
    if not decision.allowed:
        raise audit.deny(p, "approve", decision.reason, job_name=spec.name, reason=body.reason)
    try:
        wanted = approvals.Grant(
            spec.name,
            body.tenants,
            body.reason,
            p.identity,
            body.validForS,
            {"request_id": audit.meta.request_id, "client_address": audit.meta.client_address},
        )
        granted = approvals.grant(api.engine, spec, wanted)
    except BadInput as refused:
        raise ApiError(422, str(refused)) from None
    return JSONResponse(granted.as_dict(), status_code=201)


@router.post(
    "/internal/jobs/{jobName}/runs/{runId}/approve",
    status_code=202,
    response_model=Accepted,
    responses=refusals(*WITH_BODY, 403, 404, 409) | {202: {"headers": ACCEPTED_HEADERS}},
    summary="Approve a held destructive run as a second identity (it then launches)",
)
def approve_run(
    run: Run, p: Caller, api: Api, audit: Auditor, body: Annotated[ReasonBody, Body()]
) -> JSONResponse:
    row = run.load(api.engine)
    decision = authz.may_approve(p, row["requester"], tenant_of(row["scope"]))
    if not decision.allowed:
        raise audit.deny(
            p, "approve", decision.reason, job_name=run.spec.name, scope=row["scope"],
            mode=row["mode"], job_run_id=run.id, reason=body.reason,
        )  # fmt: skip
    before = service.approve(api.engine, p.identity, run.id, body.reason, audit.meta)
    if before != RunStatus.AWAITING_APPROVAL:
        raise ApiError(409, f"run {run.id} is not awaiting approval ({before})")
    held = service.RunRequest(
        spec=run.spec,
        mode=row["mode"],
        scope=Scope.parse(row["scope"]),
        limits={},
        reason=row["reason"],
        correlation_id=row["correlation_id"],
        request_approval=True,
    )
    launch(api, audit.meta, p.identity, run.id, held)
    return accepted(run.spec.name, run.id, RunStatus.ACCEPTED, row["mode"])
