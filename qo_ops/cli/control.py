"""Operator controls that change what runs may do: ``qo-ops suspend`` / ``qo-ops resume``
(the kill switch of a job, job-wide or for one tenant). Each is audited and needs a reason."""

from __future__ import annotations

from typing import Annotated

import typer

from qo_ops.cli_support import JsonOpt, RequesterOpt, emit_json, ready_engine, resolve_requester

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
    from qo_ops.platform.actions.control import ControlChange, suspend

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
    from qo_ops.platform.actions.control import ControlChange, resume, suspensions

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
