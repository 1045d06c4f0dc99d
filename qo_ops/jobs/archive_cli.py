"""``qo-ops archive``: work with the audit archives the ``audit_archive`` job writes.

``archive_app`` is a Typer app (``app.add_typer(archive_app, name="archive")`` gives
``qo-ops archive restore …``). Run as a module (``python -m qo_ops.jobs.archive_cli``) it
behaves the same: errors are one line on stderr, bad input exits 2.
"""

from __future__ import annotations

import getpass
import json
import sys
from datetime import date
from typing import Annotated

import typer

from qo_ops.cli_support import run_typer_app
from qo_ops.errors import BadInput

PROG = "qo-ops archive"

archive_app = typer.Typer(
    name="archive",
    help="Restore audit records from their verified Parquet archives.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@archive_app.callback()
def archive_group() -> None:
    """Restore audit records from their verified Parquet archives."""


def _parse_day(value: str) -> date:
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise BadInput(f"--date must be a date like 2025-01-31, got {value!r}") from None


def _requester(given: str | None) -> str:
    if given:
        return given
    try:
        return f"os:{getpass.getuser()}"
    except (KeyError, OSError):
        return "os:unknown"


@archive_app.command("restore")
def restore_command(
    tenant: Annotated[str, typer.Option(help="Tenant id, e.g. tenant-001.")],
    day: Annotated[str, typer.Option("--date", help="The day the records occurred on (UTC).")],
    reason: Annotated[str | None, typer.Option(help="Why (recorded in the audit trail).")] = None,
    requester: Annotated[str | None, typer.Option(help="Who asks (default: os:$USER).")] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object instead of text.")
    ] = False,
) -> None:
    """Put every VERIFIED archive of a tenant-day back into audit_record (same ids; idempotent)."""
    from qo_ops.db import migrate
    from qo_ops.db.engine import get_engine
    from qo_ops.jobs.audit_archive import restore_day
    from qo_ops.platform.spec import Scope

    parsed = _parse_day(day)
    Scope(tenant)  # a one-line error for a malformed tenant id, before any connection
    if reason is not None and not reason.strip():
        raise BadInput("--reason must not be blank")
    engine = get_engine()
    migrate.require_current(engine)
    result = restore_day(engine, tenant, parsed, actor=_requester(requester), reason=reason)
    payload = {
        "tenant": result.tenant_id,
        "date": result.day.isoformat(),
        "archives": result.archives,
        "archived_rows": result.archived_rows,
        "restored_rows": result.restored_rows,
        "already_present": result.already_present,
    }
    if as_json:
        typer.echo(json.dumps(payload, sort_keys=True))
    else:
        for key, value in payload.items():
            typer.echo(f"{key}={value}")


def main(argv: list[str] | None = None) -> int:
    """Run the command; every failure becomes one line on stderr and an exit code."""
    return run_typer_app(archive_app, argv, PROG)


if __name__ == "__main__":
    sys.exit(main())
