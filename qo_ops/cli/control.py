"""Operator controls that change what runs may do: ``qo-ops suspend`` / ``qo-ops resume``
(the kill switch of a job, job-wide or for one tenant) and ``qo-ops requeue`` (dead-lettered
delivery items back to READY). Each is audited and needs a reason."""

from __future__ import annotations

import uuid
from typing import Annotated

import typer

from qo_ops.cli_support import JsonOpt, RequesterOpt, emit_json, ready_engine, resolve_requester
from qo_ops.errors import BadInput

# The catalog, the platform and SQLAlchemy are imported inside each command (qo_ops.cli_support).


def _control_scope(job: str, tenant: str | None) -> str:
    return f"{job} for tenant {tenant}" if tenant else f"{job} for every scope"


def suspend_command(
    job: Annotated[str, typer.Argument(help="The job to suspend.")],
    reason: Annotated[str, typer.Option(help="Why (required; shown in status, audited).")],
    tenant: Annotated[
        str | None, typer.Option(help="Only this tenant (default: every scope).")
    ] = None,
    requester: RequesterOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Kill switch: no new run of JOB starts (schedules, sensors, CLI, API), and a running
    one stops at its next batch boundary (ends `cancelled`, reason `suspended`)."""
    from qo_ops.jobs.catalog import CATALOG
    from qo_ops.platform.control import ControlChange, suspend

    engine = ready_engine()
    found, new = suspend(
        engine,
        ControlChange(job, tenant, actor=resolve_requester(requester), reason=reason),
        known_jobs=set(CATALOG),
    )
    if as_json:
        emit_json({"suspended": found.as_dict(), "new": new})
        return
    if new:
        typer.echo(
            f"suspended {_control_scope(job, tenant)}; resume with: qo-ops resume {job}"
            f"{' --tenant ' + tenant if tenant else ''} --reason …"
        )
    else:
        typer.echo(f"already suspended: {found.describe()}")


def resume_command(
    job: Annotated[str, typer.Argument(help="The job to resume.")],
    reason: Annotated[str, typer.Option(help="Why (required; audited).")],
    tenant: Annotated[
        str | None, typer.Option(help="Lift the suspension of this tenant (default: job-wide).")
    ] = None,
    requester: RequesterOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Lift a suspension made with `qo-ops suspend` (the same JOB and --tenant)."""
    from qo_ops.jobs.catalog import CATALOG
    from qo_ops.platform.control import ControlChange, resume, suspensions

    engine = ready_engine()
    lifted = resume(
        engine,
        ControlChange(job, tenant, actor=resolve_requester(requester), reason=reason),
        known_jobs=set(CATALOG),
    )
    with engine.connect() as conn:
        left = suspensions(conn, job)
    if as_json:
        emit_json(
            {
                "resumed": lifted.as_dict() if lifted else None,
                "still_suspended": [s.as_dict() for s in left],
            }
        )
        return
    if lifted:
        typer.echo(f"resumed {_control_scope(job, tenant)}")
    else:
        typer.echo(f"{_control_scope(job, tenant)} was not suspended; nothing changed")
    for other in left:
        typer.echo(f"still suspended: {other.describe()}")


def requeue_command(
    job: Annotated[
        str, typer.Argument(help="The job whose dead letters to requeue.")
    ] = "delivery_retry",
    tenant: Annotated[str, typer.Option(help="Tenant whose dead letters to requeue.")] = "",
    reason: Annotated[str, typer.Option(help="Why (recorded in the audit trail).")] = "",
    item: Annotated[
        list[str] | None, typer.Option(help="Only these item ids (repeatable).")
    ] = None,
    all_dead: Annotated[
        bool, typer.Option("--all-dead", help="Every dead letter of the tenant (up to --limit).")
    ] = False,
    limit: Annotated[int, typer.Option(help="At most this many items.")] = 1000,
    requester: RequesterOpt = None,
) -> None:
    """Put dead-lettered delivery items back to READY (audited)."""
    from qo_ops.platform.retry import requeue_dead_letters
    from qo_ops.platform.spec import Scope

    if job.replace("-", "_") != "delivery_retry":
        raise BadInput(f"only delivery_retry keeps dead letters to requeue, not {job!r}")
    if not tenant:
        raise BadInput("--tenant is required")
    if item and all_dead:
        raise BadInput("give either --item or --all-dead, not both")
    if not item and not all_dead:
        raise BadInput("say what to requeue: --item ID (repeatable) or --all-dead")
    Scope(tenant)
    if not reason.strip():
        raise BadInput("--reason is required (recorded in the audit trail)")
    if not 1 <= limit <= 100_000:
        raise BadInput("--limit must be between 1 and 100000")
    try:
        ids = [uuid.UUID(i) for i in item] if item else None
    except ValueError:
        raise BadInput("--item takes delivery item ids (UUIDs)") from None
    engine = ready_engine()
    count = requeue_dead_letters(
        engine,
        tenant_id=tenant,
        requester=resolve_requester(requester),
        reason=reason,
        item_ids=ids,
        limit=limit,
    )
    typer.echo(f"requeued {count} dead-lettered item(s) of {tenant}")
