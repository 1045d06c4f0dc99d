"""``qo-ops db``: create, upgrade or downgrade the schema, print Dagster's storage URL; and
``qo-ops info``: where the database is, its schema version and its rows per table."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Annotated

import typer

from qo_ops.cli_support import JsonOpt, emit_json, print_table
from qo_ops.errors import BadInput, QoOpsError, SchemaNotReady

if TYPE_CHECKING:
    import sqlalchemy as sa

# SQLAlchemy, the engine and Alembic are imported inside each command (qo_ops.cli_support).

db_app = typer.Typer(help="Create, upgrade or downgrade the qo-ops schema.", no_args_is_help=True)


class _RetryLines(logging.Handler):
    """A logging handler printing a migration's lock-timeout retries for a person."""

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "event", {})
        if event.get("event.name") == "migration.lock_timeout":
            typer.echo(
                f"migration {event['revision']} gave way to writers (lock timeout, try "
                f"{event['attempt']}); again in {event['retry_in_s']} s",
                err=True,
            )


@db_app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
    contract: Annotated[
        bool,
        typer.Option(
            "--contract",
            help="Also apply contract steps (they remove what older releases use): refused "
            "while a run of older code holds a lease or is running.",
        ),
    ] = False,
    reason: Annotated[str | None, typer.Option(help="Why (recorded with the upgrade).")] = None,
    requester: Annotated[
        str | None, typer.Option(help="Who asks (default: os:<login name>).")
    ] = None,
) -> None:
    """Migrate the schema up, one short transaction per migration, while qo-ops runs.

    Expand steps only (the previous release keeps working); contract steps with --contract.
    Idempotent: a no-op when already at the target."""
    import sqlalchemy as sa

    from qo_ops.cli_support import resolve_requester
    from qo_ops.db import migrate
    from qo_ops.db.engine import ensure_database, get_engine, resolve_target
    from qo_ops.platform.observability.events import EVENT_LOGGER, configure_event_logging

    if sys.stderr.isatty():  # a person: a line per lock timeout, the summary at the end
        logging.getLogger(f"{EVENT_LOGGER}.migrate").addHandler(_RetryLines())
    else:  # a Job's log: migration.start/lock_timeout/end as JSON lines
        configure_event_logging()
    target = resolve_target()
    engine = get_engine(target)
    if not target.embedded:  # Dagster's storage wants a database of its own beside ours
        dagster_db = sa.engine.make_url(target.dagster_storage_url()).database or ""
        try:
            ensure_database(target.url, dagster_db)
        except QoOpsError:
            typer.echo(
                f"note: could not create database {dagster_db} for Dagster's storage", err=True
            )
    report = migrate.upgrade(
        engine,
        revision,
        contract=contract,
        requested_by=resolve_requester(requester),
        reason=reason,
    )
    before, after = report.before, report.after
    change = "already at" if before == after else f"upgraded from {before or 'empty'} to"
    waits = f", {report.lock_timeouts} lock timeout(s) retried" if report.lock_timeouts else ""
    typer.echo(
        f"schema {change} {after} (head {migrate.head_revision()}, "
        f"{report.duration_s:.1f} s{waits})"
    )
    if report.pending_contract:
        steps = ", ".join(report.pending_contract)
        try:
            migrate.require_current(engine)
        except SchemaNotReady:  # expand steps of this code wait behind the contract step
            raise SchemaNotReady(
                f"schema stopped at {after}, before contract step(s) {steps}; this code needs "
                f"{migrate.required_revision()}: once no release older than "
                f"{report.pending_contract[0]} runs, `qo-ops db upgrade --contract`"
            ) from None
        typer.echo(
            f"contract step(s) {steps} not applied: they remove what older releases use; "
            "once no older release runs, `qo-ops db upgrade --contract`"
        )


@db_app.command("status")
def db_status(as_json: JsonOpt = False) -> None:
    """The schema's revision, the oldest code it serves, pending steps and recent upgrades."""
    from qo_ops.db import migrate
    from qo_ops.db.engine import get_engine

    engine = get_engine()
    current = migrate.current_revision(engine)
    serves = migrate.serves_from(engine)
    pending = migrate.pending_steps(engine)
    history = migrate.applied_migrations(engine)
    try:
        migrate.require_current(engine)
        verdict = "this code runs on it"
    except QoOpsError as exc:
        verdict = str(exc)
    if as_json:
        emit_json(
            {
                "schema_revision": current,
                "serves_code_from": serves,
                "code_revision": migrate.head_revision(),
                "code_needs": migrate.required_revision(),
                "pending_expand": [s.revision for s in pending if not s.contract],
                "pending_contract": [s.revision for s in pending if s.contract],
                "verdict": verdict,
                "recent_upgrades": [
                    {
                        k: (v.isoformat() if hasattr(v, "isoformat") else v)
                        for k, v in r._mapping.items()
                    }
                    for r in history
                ],
            }
        )
        return
    typer.echo(f"schema:      {current or 'empty'}")
    typer.echo(f"serves code: {serves or '-'} and newer (the oldest release that may still run)")
    typer.echo(
        f"this code:   {migrate.head_revision()} (needs {migrate.required_revision()} or "
        f"newer): {verdict}"
    )
    expand = [s.revision for s in pending if not s.contract]
    contract = [s.revision for s in pending if s.contract]
    typer.echo(
        f"pending:     expand {', '.join(expand) or 'none'}; contract {', '.join(contract) or 'none'}"
    )
    if history:
        print_table(
            "recent upgrades",
            ["started", "from", "to", "outcome", "by", "lock timeouts", "took"],
            [
                [
                    f"{r.started_at:%Y-%m-%d %H:%M:%S}",
                    r.from_revision or "empty",
                    r.to_revision or "empty",
                    r.outcome,
                    r.requested_by or "-",
                    r.lock_timeouts,
                    f"{r.duration_ms / 1000:.1f} s",
                ]
                for r in history
            ],
        )


@db_app.command("downgrade")
def db_downgrade(
    revision: Annotated[
        str, typer.Option(help="Target revision: -1, a revision id, or base.")
    ] = "-1",
    yes: Annotated[
        bool, typer.Option("--yes", help="Confirm: downgrading drops tables and data.")
    ] = False,
) -> None:
    """Migrate the schema down. Destroys data, so it needs --yes."""
    if not yes:
        raise BadInput("downgrade drops tables and their data: repeat with --yes to confirm")
    from qo_ops.db import migrate
    from qo_ops.db.engine import get_engine

    engine = get_engine()
    before = migrate.current_revision(engine)
    migrate.downgrade(engine, revision)
    typer.echo(
        f"schema downgraded from {before or 'empty'} to {migrate.current_revision(engine) or 'empty'}"
    )


@db_app.command("env")
def db_env() -> None:
    """Print shell exports for Dagster's storage URL (eval "$(qo-ops db env)")."""
    from qo_ops.db.engine import resolve_target

    target = resolve_target()
    typer.echo(f"export QO_OPS_DAGSTER_STORAGE_URL='{target.dagster_storage_url()}'")


def _row_counts(engine: sa.Engine) -> dict[str, int]:
    import sqlalchemy as sa

    from qo_ops.db.schema import BUSINESS_TABLES, PLATFORM_TABLES

    with engine.connect() as conn:
        return {
            t.name: int(conn.scalar(sa.select(sa.func.count()).select_from(t)) or 0)
            for t in BUSINESS_TABLES + PLATFORM_TABLES
        }


def info_command(as_json: JsonOpt = False) -> None:
    """Where the database is, its schema version, and row counts per table."""
    from qo_ops.db import migrate
    from qo_ops.db.engine import get_engine, resolve_target

    target = resolve_target()
    engine = get_engine(target)
    current, head = migrate.current_revision(engine), migrate.head_revision()
    try:
        migrate.require_current(engine)
        ready = True
    except QoOpsError:
        ready = False
    counts = _row_counts(engine) if ready else {}
    if as_json:
        emit_json(
            {
                "database": target.display(),
                "embedded": target.embedded,
                "schema_revision": current,
                "head_revision": head,
                "row_counts": counts,
            }
        )
        return
    typer.echo(f"database: {target.display()}")
    state = (
        "up to date"
        if current == head
        else "runs this code"
        if ready
        else "run `qo-ops db upgrade`"
    )
    typer.echo(f"schema:   {current or 'empty'} (head {head}, {state})")
    if counts:
        print_table("rows per table", ["table", "rows"], [[k, v] for k, v in counts.items()])
