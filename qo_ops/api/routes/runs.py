"""A job's runs: request one (``POST /internal/jobs/{jobName}/runs``: validated against the
catalog, authorized, checked against the kill switch, accepted once per Idempotency-Key and
scope, then launched in Dagster), read one, cancel one."""

# (no `from __future__ import annotations`: FastAPI reads these annotations at runtime)

from datetime import date
from typing import Annotated, Any

from fastapi import APIRouter, Body, Header
from fastapi.responses import JSONResponse

from qo_ops.api import authz, service
from qo_ops.api.dagster import DagsterClient, DagsterUnavailable
from qo_ops.api.deps import Api, Auditor, Caller, Job, Run
from qo_ops.api.errors import WITH_BODY, ApiError, refusals
from qo_ops.api.launch import launch, stale_reason
from qo_ops.api.models import (
    ACCEPTED_HEADERS,
    SAFE_ID,
    Accepted,
    ReasonBody,
    RunRequestBody,
    accepted,
    jsonable,
)
from qo_ops.errors import BadInput
from qo_ops.platform.actions import control
from qo_ops.platform.calls.call_stats import DownstreamCalls
from qo_ops.platform.job.counts import mutated_count
from qo_ops.platform.job.options import ExecuteRefused, RunOptions
from qo_ops.platform.job.scope import FIRST_DAY, LAST_DAY, Scope, tenant_of
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.job.statuses import ACTIVE, UNSTARTED, RunStatus
from qo_ops.platform.run.consent import check_approval
from qo_ops.platform.run.records import request_cancel

MAX_WINDOW_DAYS = 366

# What a client can do next with the run a 202 names (OpenAPI links: a client, or a fuzzer's
# stateful phase, follows them from the answer to the run it created).
RUN_LINKS = {
    name: {
        "operationId": operation,
        "parameters": {"jobName": "$request.path.jobName", "runId": "$response.body#/jobRunId"},
        "description": description,
    }
    for name, operation, description in (
        ("GetRun", "get_run", "The run just accepted."),
        ("CancelRun", "cancel_run", "Cancel the run just accepted."),
        ("ApproveRun", "approve_run", "Approve the run just accepted, if it is held."),
    )
}

router = APIRouter()


@router.post(
    "/internal/jobs/{jobName}/runs",
    status_code=202,
    response_model=Accepted,
    responses=refusals(*WITH_BODY, 403, 404, 409, 423)
    | {202: {"headers": ACCEPTED_HEADERS, "links": RUN_LINKS}},
    summary="Request a run (returns at once; Dagster executes it)",
)
def submit_run(
    spec: Job,
    p: Caller,
    api: Api,
    audit: Auditor,
    body: Annotated[RunRequestBody, Body()],
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", pattern=SAFE_ID)] = None,
) -> JSONResponse:
    run_request = _validated(spec, body)
    scope = run_request.scope
    decision = authz.may_submit(
        p, spec, body.mode, scope.tenant_id, body.requestApproval, run_request.approval is not None
    )
    about = {"job_name": spec.name, "scope": scope.key, "mode": body.mode,
             "reason": body.reason, "correlation_id": body.correlationId}  # fmt: skip
    if not decision.allowed:
        raise audit.deny(p, "submit", decision.reason, **about)
    if not service.tenant_exists(api.engine, scope.tenant_id):
        raise ApiError(422, f"unknown tenant {scope.tenant_id}")
    if run_request.approval is not None:  # the rule the runner applies again at start
        cited = RunOptions(
            mode="execute", trigger="api", reason=run_request.reason, approval=run_request.approval
        )
        try:
            check_approval(api.engine, spec, scope, cited)
        except ExecuteRefused as refused:
            raise audit.deny(p, "submit", str(refused), **about) from None
    with api.engine.connect() as conn:
        held = control.suspension_for(conn, spec.name, scope.tenant_id)
    if held is not None:
        audit(p.identity, "submit", "denied: suspended", details=held.as_dict(), **about)
        raise ApiError(423, f"{held.describe()}; no run accepted", audited=True)
    submission = service.Submission(
        p.identity,
        run_request,
        decision.hold_for_approval,
        idempotency_key,
        audit.meta,
        grant=decision.grant_approval,
    )
    submitted = service.submit(api.engine, submission)
    stale = (
        stale_reason(api.dagster, submitted.active_run) if submitted.outcome == "conflict" else None
    )
    if stale is not None:
        service.expire_stale(api.engine, submitted.active_run["id"], stale, audit.meta)
        submitted = service.submit(api.engine, submission)
    if submitted.outcome == "key_reused":
        raise ApiError(422, "Idempotency-Key already used for a different request", audited=True)
    if submitted.outcome == "conflict":
        raise ApiError(
            409,
            f"{spec.name} {scope.key} already has an active run "
            f"{submitted.run_id} ({submitted.status})",
            active_run=str(submitted.run_id),
        )
    assert submitted.run_id is not None and submitted.status is not None
    if submitted.outcome == "created" and submitted.status == RunStatus.ACCEPTED:
        launch(api, audit.meta, p.identity, submitted.run_id, run_request)
    return accepted(spec.name, submitted.run_id, submitted.status, body.mode)


@router.get(
    "/internal/jobs/{jobName}/runs/{runId}",
    responses=refusals(403, 404, 422),
    summary="A run: status, counters, its calls to the downstream, Dagster run and link",
)
def get_run(run: Run, p: Caller, api: Api, audit: Auditor) -> dict[str, Any]:
    row = run.load(api.engine)
    decision = authz.may_read(p, tenant_of(row["scope"]))
    if not decision.allowed:
        raise audit.deny(p, "read", decision.reason, job_name=run.spec.name, job_run_id=run.id)
    return _run_view(row, api.dagster)


@router.post(
    "/internal/jobs/{jobName}/runs/{runId}/cancel",
    status_code=202,
    responses=refusals(*WITH_BODY, 403, 404, 409),
    summary="Cancel a run (it stops at its next batch boundary; audited)",
)
def cancel_run(
    run: Run, p: Caller, api: Api, audit: Auditor, body: Annotated[ReasonBody, Body()]
) -> dict[str, Any]:
    row = run.load(api.engine)
    decision = authz.may_cancel(p, tenant_of(row["scope"]))
    if not decision.allowed:
        raise audit.deny(
            p, "cancel", decision.reason, job_name=run.spec.name, scope=row["scope"],
            job_run_id=run.id, reason=body.reason,
        )  # fmt: skip
    before = request_cancel(
        api.engine, run.id, p.identity, body.reason,
        request_id=audit.meta.request_id, client_address=audit.meta.client_address,
    )  # fmt: skip
    if before not in ACTIVE:
        raise ApiError(409, f"run {run.id} already ended ({before})")
    terminated = None
    dagster_run_id = row["dagster_run_id"]  # set at launch, before any cancel
    if dagster_run_id:
        try:
            terminated = api.dagster.terminate(dagster_run_id)
        except DagsterUnavailable:
            terminated = False  # the cancel flag stops it at its next batch anyway
    status = RunStatus.CANCELLED if before in UNSTARTED else "cancel_requested"
    return {"jobRunId": str(run.id), "status": status, "dagsterTerminated": terminated}


def _validated(spec: JobSpec, body: RunRequestBody) -> service.RunRequest:
    """The catalog's rules on top of the body's shape; ApiError(422) for anything off."""
    windowed = spec.partitioning == "tenant_day"
    start = end = None
    if windowed:
        if body.from_ is None or body.to is None:
            raise ApiError(422, f"{spec.name} is windowed: give from and to (YYYY-MM-DD)")
        try:
            start, end = date.fromisoformat(body.from_), date.fromisoformat(body.to)
        except ValueError:
            raise ApiError(422, "from/to must be real dates (YYYY-MM-DD)") from None
        if not 0 < (end - start).days <= MAX_WINDOW_DAYS:
            raise ApiError(422, f"to must be 1 to {MAX_WINDOW_DAYS} days after from")
    elif body.from_ is not None or body.to is not None:
        raise ApiError(422, f"{spec.name} is not windowed: drop from and to")
    if body.mode == "execute" and not (body.reason or "").strip():
        raise ApiError(422, "reason is required to execute")
    limits = {
        k: v
        for k, v in (
            ("batch_size", body.batchSize),
            ("max_items", body.maxItems),
            ("throttle_ms", body.throttleMs),
        )
        if v is not None
    }
    try:
        scope = Scope(body.tenant, start, end)  # days at the calendar's edges are refused
    except BadInput:
        raise ApiError(
            422, f"the window's days must lie from {FIRST_DAY} to {LAST_DAY} (to is exclusive)"
        ) from None
    return service.RunRequest(
        spec=spec,
        mode=body.mode,
        scope=scope,
        limits=limits,
        reason=body.reason.strip() if body.reason else None,
        correlation_id=body.correlationId,
        request_approval=body.requestApproval,
        approval=body.approvalId if spec.destructive and body.mode == "execute" else None,
    )


def _run_view(row: dict[str, Any], dagster: DagsterClient) -> dict[str, Any]:
    """The run as JSON: the seed's ``mutated_count`` beside its counters, its downstream
    figures instead of the raw tally, and its Dagster run (id, link, Dagster's status) if it
    has one."""
    view = jsonable(row)
    view["jobRunId"] = view.pop("id")
    view["mutated_count"] = mutated_count(row["mode"], row["succeeded_count"])
    calls = DownstreamCalls.from_tally(view.pop("tally", None))
    view["downstream"] = calls.as_dict() if calls is not None else None
    dagster_run_id = row.get("dagster_run_id")
    view["dagster"] = (
        {
            "runId": dagster_run_id,
            "link": dagster.run_link(dagster_run_id),
            "status": dagster.status(dagster_run_id),
        }
        if dagster_run_id
        else None
    )
    return view
