"""``qo-ops archive``: work with the audit archives the ``audit_archive`` job writes
(``qo-ops archive restore …``)."""

from __future__ import annotations

from datetime import date
from typing import Annotated

import typer

from qo_ops.cli_support import (
    JsonOpt,
    RequesterOpt,
    emit_json,
    plain_app,
    ready_engine,
    resolve_requester,
)
from qo_ops.errors import BadInput

archive_app = plain_app(
    "archive", "Restore audit records from their verified Parquet archives.", no_args_is_help=True
)


@archive_app.callback()
def archive_group() -> None:
    """Restore audit records from their verified Parquet archives."""


def _parse_day(value: str) -> date:
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise BadInput(f"--date must be a date like 2025-01-31, got {value!r}") from None


@archive_app.command("restore")
def restore_command(
    tenant: Annotated[str, typer.Option(help="Tenant id, e.g. tenant-001.")],
    day: Annotated[str, typer.Option("--date", help="The day the records occurred on (UTC).")],
    reason: Annotated[str | None, typer.Option(help="Why (recorded in the audit trail).")] = None,
    requester: RequesterOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Put every VERIFIED archive of a tenant-day back into audit_record (same ids; idempotent)."""
    from qo_ops.jobs.audit_archive import restore_day
    from qo_ops.platform.job.scope import Scope

    parsed = _parse_day(day)
    Scope(tenant)  # a one-line error for a malformed tenant id, before any connection
    if reason is not None and not reason.strip():
        raise BadInput("--reason must not be blank")
    engine = ready_engine()
    result = restore_day(engine, tenant, parsed, actor=resolve_requester(requester), reason=reason)
    payload = {
        "tenant": result.tenant_id,
        "date": result.day.isoformat(),
        "archives": result.archives,
        "archived_rows": result.archived_rows,
        "restored_rows": result.restored_rows,
        "already_present": result.already_present,
    }
    if as_json:
        emit_json(payload)
    else:
        for key, value in payload.items():
            typer.echo(f"{key}={value}")
