"""``qo-ops approval``: grant, list and revoke the approvals a destructive execute cites
(``qo_ops/platform/actions/approvals.py``). Granting writes ``run_approval``: it needs the database
credentials of an administrator (the owner's or the API's), not the runner's."""

from __future__ import annotations

from typing import Annotated

import typer

from qo_ops.cli_support import (
    JsonOpt,
    emit_json,
    parse_duration,
    plain_app,
    print_table,
    ready_engine,
    resolve_requester,
    when_text,
)
from qo_ops.errors import BadInput

# The catalog, the platform and SQLAlchemy are imported inside each command (qo_ops.cli_support).

ByOpt = Annotated[str | None, typer.Option(help="Who approves (default: os:$USER).")]

approval_app = plain_app(
    "approval",
    "Approvals a destructive job's execute cites (CLI, Launchpad, backfill, API).",
    no_args_is_help=True,
)


@approval_app.command("grant")
def grant_command(
    job: Annotated[str, typer.Argument(help="The destructive job, e.g. read_model_repair.")],
    reason: Annotated[str, typer.Option(help="Why (the incident; audited).")],
    tenant: Annotated[
        list[str] | None, typer.Option(help="A tenant it covers (repeatable).")
    ] = None,
    all_tenants: Annotated[bool, typer.Option("--all-tenants", help="Cover every tenant.")] = False,
    valid_for: Annotated[
        str, typer.Option(help="How long it may be cited: 90s, 30m, 2h (at most 24h).")
    ] = "1h",
    by: ByOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Approve executes of a destructive JOB over some tenants, for a while; prints the id
    a run cites (--approval, Launchpad config approval, tag qo_ops/approval)."""
    from qo_ops.jobs.catalog import get_spec
    from qo_ops.platform.actions.approvals import Grant, grant

    spec = get_spec(job)
    if bool(tenant) == all_tenants:
        raise BadInput("name the tenants it covers (--tenant, repeatable) or --all-tenants")
    seconds = parse_duration(valid_for, "--valid-for")
    tenants = None if all_tenants else list(tenant or ())
    wanted = Grant(spec.name, tenants, reason, resolve_requester(by), seconds)
    approval = grant(ready_engine(), spec, wanted)
    if as_json:
        emit_json(approval.as_dict())
        return
    typer.echo(
        f"approval {approval.id}: {spec.name} execute for {approval.covers()}, until "
        f"{when_text(approval.expires_at)} (granted by {approval.granted_by})"
    )
    typer.echo(
        f"cite it: qo-ops run {spec.name} --mode execute --approval {approval.id} --reason …"
        f" | Launchpad config approval: {approval.id} | backfill tag qo_ops/approval={approval.id}"
    )


@approval_app.command("list")
def list_command(
    job: Annotated[str | None, typer.Argument(help="One job (default: every job).")] = None,
    show_all: Annotated[bool, typer.Option("--all", help="Expired and revoked ones too.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Approvals, newest first: by default those that may still be cited."""
    from qo_ops.platform.actions.approvals import list_approvals

    found = list_approvals(ready_engine(), job_name=job, live=not show_all)
    if as_json:
        emit_json({"approvals": [a.as_dict() for a in found]})
        return
    if not found:
        typer.echo("no approvals" + ("" if show_all else " that may be cited (--all: every one)"))
        return
    print_table(
        "approvals" + (" (every one)" if show_all else " that may be cited"),
        ["approval", "job", "tenants", "granted by", "until", "revoked"],
        [
            [
                a.id,
                a.job_name,
                a.covers(),
                a.granted_by,
                when_text(a.expires_at),
                when_text(a.revoked_at) if a.revoked_at else "-",
            ]
            for a in found
        ],
        notes=[a.reason for a in found],
    )


@approval_app.command("revoke")
def revoke_command(
    approval_id: Annotated[str, typer.Argument(help="The approval, e.g. apr-7hk2m9x4qa.")],
    by: ByOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Revoke an approval: runs that cite it from now on are refused (audited)."""
    from qo_ops.platform.actions.approvals import revoke

    approval = revoke(ready_engine(), approval_id, resolve_requester(by))
    if as_json:
        emit_json(approval.as_dict())
        return
    typer.echo(f"approval {approval.id} revoked by {approval.revoked_by}")
