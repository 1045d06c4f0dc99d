"""The ``qo-ops`` command line: one thin adapter over the same code every trigger uses.

Errors reach the user as one line on stderr with a non-zero exit code, never a traceback
(set ``QO_OPS_DEBUG=1`` to see one). ``--json`` output is one JSON object on stdout.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import UTC, datetime
from typing import Annotated, Any

import sqlalchemy as sa
import typer
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from typer._click import exceptions as click_exceptions  # typer vendors click

from qo_ops.db import migrate
from qo_ops.db.engine import DatabaseTarget, ensure_database, get_engine, resolve_target
from qo_ops.db.schema import BUSINESS_TABLES, PLATFORM_TABLES
from qo_ops.errors import EXIT_BAD_INPUT, BadInput, QoOpsError, one_line

EXIT_FAILED = 1
EXIT_INTERNAL = 70

app = typer.Typer(
    name="qo-ops",
    help="Run the operational jobs of the Quote & Order platform safely.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
db_app = typer.Typer(help="Create, upgrade or downgrade the qo-ops schema.", no_args_is_help=True)
app.add_typer(db_app, name="db")

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]


# ------------------------------------------------------------------------- output


def emit_json(payload: dict[str, Any]) -> None:
    """Print ``payload`` as one JSON line on stdout."""
    typer.echo(json.dumps(payload, default=str, sort_keys=True))


def print_table(title: str, headers: list[str], rows: list[list[Any]]) -> None:
    """A readable table: boxed on a terminal, plain aligned columns when piped."""
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for h in headers:
            table.add_column(
                h,
                justify="right" if rows and isinstance(rows[0][headers.index(h)], int) else "left",
            )
        for r in rows:
            table.add_row(*(f"{v:,}" if isinstance(v, int) else str(v) for v in r))
        Console().print(table)
        return
    cells = [headers] + [[str(v) for v in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    typer.echo(title)
    for row in cells:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def parse_timestamp(value: str, option: str) -> datetime:
    """Parse an ISO-8601 timestamp; a naive one is taken as UTC."""
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise BadInput(f"{option} must be an ISO-8601 timestamp, got {value!r}") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


# ------------------------------------------------------------------------- db


@db_app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
) -> None:
    """Migrate the schema up (idempotent: a no-op when already at the target)."""
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
    before = migrate.current_revision(engine)
    migrate.upgrade(engine, revision)
    after = migrate.current_revision(engine)
    change = "already at" if before == after else f"upgraded from {before or 'empty'} to"
    typer.echo(f"schema {change} {after} (head {migrate.head_revision()})")


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
    engine = get_engine()
    before = migrate.current_revision(engine)
    migrate.downgrade(engine, revision)
    typer.echo(
        f"schema downgraded from {before or 'empty'} to {migrate.current_revision(engine) or 'empty'}"
    )


@db_app.command("env")
def db_env() -> None:
    """Print shell exports for Dagster's storage URL (eval "$(qo-ops db env)")."""
    target = resolve_target()
    typer.echo(f"export QO_OPS_DAGSTER_STORAGE_URL='{target.dagster_storage_url()}'")


# ------------------------------------------------------------------------- demo data


@app.command("demo-data")
def demo_data(
    tenants: Annotated[int, typer.Option(help="How many tenants to create.")] = 3,
    quotes: Annotated[int, typer.Option(help="Quotes per tenant.")] = 2000,
    seed: Annotated[int, typer.Option(help="Seed: the same seed gives the same data.")] = 1,
    as_of: Annotated[
        str | None, typer.Option("--as-of", help="Time the data is relative to (default: now).")
    ] = None,
    append: Annotated[bool, typer.Option("--append", help="Add tenants to existing data.")] = False,
    reset: Annotated[bool, typer.Option("--reset", help="Replace existing data.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Load deterministic demo data, anomalies included, in one transaction."""
    from qo_ops.demo.data import load_demo_data

    anchor = (
        parse_timestamp(as_of, "--as-of") if as_of else datetime.now(UTC).replace(microsecond=0)
    )
    engine = get_engine()
    migrate.require_current(engine)
    report = load_demo_data(
        engine,
        tenants=tenants,
        quotes=quotes,
        seed=seed,
        as_of=anchor,
        append=append,
        reset=reset,
    )
    if as_json:
        emit_json(
            {
                "tenants": report.tenants,
                "rows": report.rows,
                "anomalies": report.anomalies,
                "seconds": round(report.seconds, 3),
                "as_of": anchor.isoformat(),
                "seed": seed,
            }
        )
        return
    total = sum(report.rows.values())
    typer.echo(
        f"loaded {total:,} rows for {len(report.tenants)} tenants "
        f"({report.tenants[0]} … {report.tenants[-1]}) in {report.seconds:.1f}s, as of {anchor.isoformat()}"
    )
    print_table(
        "anomalies planted", ["anomaly", "rows"], [[k, v] for k, v in report.anomalies.items()]
    )


# ------------------------------------------------------------------------- info


def _row_counts(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {
            t.name: int(conn.scalar(sa.text(f"SELECT count(*) FROM {t.name}")) or 0)
            for t in BUSINESS_TABLES + PLATFORM_TABLES
        }


@app.command("info")
def info(as_json: JsonOpt = False) -> None:
    """Where the database is, its schema version, and row counts per table."""
    target: DatabaseTarget = resolve_target()
    engine = get_engine(target)
    current, head = migrate.current_revision(engine), migrate.head_revision()
    counts = _row_counts(engine) if current == head else {}
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
    state = "up to date" if current == head else "run `qo-ops db upgrade`"
    typer.echo(f"schema:   {current or 'empty'} (head {head}, {state})")
    if counts:
        print_table("rows per table", ["table", "rows"], [[k, v] for k, v in counts.items()])


# ------------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and turn every failure into one line on stderr and an exit code."""
    command = typer.main.get_command(app)
    debug = os.environ.get("QO_OPS_DEBUG") == "1"
    try:
        result = command.main(args=argv, prog_name="qo-ops", standalone_mode=False)
        code = result if isinstance(result, int) else 0
    except typer.Exit as exc:
        code = exc.exit_code
    except click_exceptions.UsageError as exc:
        hint = f" (see: {exc.ctx.command_path} --help)" if exc.ctx else ""
        typer.echo(f"qo-ops: error: {one_line(exc.format_message())}{hint}", err=True)
        code = EXIT_BAD_INPUT
    except typer.Abort:
        typer.echo("qo-ops: aborted", err=True)
        code = 130
    except QoOpsError as exc:
        typer.echo(f"qo-ops: error: {exc}", err=True)
        code = exc.exit_code
    except (DBAPIError, SQLAlchemyError) as exc:
        if debug:
            raise
        orig = getattr(exc, "orig", None) or exc
        first = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
        typer.echo(f"qo-ops: database error: {one_line(first)}", err=True)
        code = EXIT_FAILED
    except Exception as exc:  # the last line of defence: still one line, still no secrets
        if debug:
            raise
        typer.echo(
            f"qo-ops: internal error: {type(exc).__name__}: {one_line(str(exc))} "
            "(QO_OPS_DEBUG=1 shows the traceback)",
            err=True,
        )
        code = EXIT_INTERNAL
    return code


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())
