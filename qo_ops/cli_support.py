"""What every qo-ops command line shares: building and running a Typer app so that every
failure is one line on stderr and an exit code, never a traceback (``QO_OPS_DEBUG=1`` shows
one); ``--json`` output as one JSON object; tables; timestamps and run ids as the tables show
them; who asks; the engine a command works on.

Used by ``qo-ops`` (``qo_ops.cli``) and its sub-commands in other packages (``qo_ops.api.cli``,
``qo_ops.downstream.cli``, which also runs as a module). It imports nothing of them: a
sub-command that runs alone does not load the whole command line.

A command line answers at once: this module, and every module that declares commands,
imports at module level only Typer, the standard library and light modules of qo_ops (such
as ``qo_ops.errors``); what a command works with (SQLAlchemy, the catalog, the runner,
Alembic, FastAPI…) it imports inside its function, when it runs. ``qo-ops --help`` and each
command thus load only what they use (qo_ops_tests/test_cli_imports.py checks).
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import signal
import sys
import threading
import uuid
from datetime import UTC, date, datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer._click import exceptions as click_exceptions  # typer vendors click

from qo_ops.errors import EXIT_BAD_INPUT, BadInput, QoOpsError, one_line
from qo_ops.errors import age_text as age_text  # re-exported: the CLI's tables use it

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from qo_ops.db.engine import DatabaseTarget

EXIT_FAILED = 1
EXIT_INTERNAL = 70
PIPED_WIDTH = 120  # a note's line when piped and COLUMNS is unset (--json: the text whole)
SHORT_ID = 8  # characters of a run id the tables show, as Dagster's UI does

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]
RequesterOpt = Annotated[str | None, typer.Option(help="Who asks (default: os:$USER).")]


# ------------------------------------------------------------------------- the app


def plain_app(
    name: str, help: str, *, no_args_is_help: bool = False, subcommand_metavar: str | None = None
) -> typer.Typer:
    """A Typer app for a command that also runs on its own: plain-text help (no rich markup),
    no shell-completion options, no pretty tracebacks (``run_typer_app`` reports errors)."""
    return typer.Typer(
        name=name,
        help=help,
        no_args_is_help=no_args_is_help,
        subcommand_metavar=subcommand_metavar,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
    )


def run_typer_app(app: typer.Typer, argv: list[str] | None, prog: str) -> int:
    """Run ``app`` with ``argv``; return its exit code, errors reported as one line.

    As PID 1 (a container without an init), SIGTERM interrupts like SIGINT: the kernel drops
    signals PID 1 has no handler for. A run installs its own handler while it runs."""
    if os.getpid() == 1 and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    command = typer.main.get_command(app)
    debug = os.environ.get("QO_OPS_DEBUG") == "1"
    try:
        result = command.main(args=argv, prog_name=prog, standalone_mode=False)
        return result if isinstance(result, int) else 0
    except typer.Exit as exc:
        return exc.exit_code
    except click_exceptions.UsageError as exc:
        hint = f" (see: {exc.ctx.command_path} --help)" if exc.ctx else ""
        typer.echo(f"{prog}: error: {one_line(exc.format_message())}{hint}", err=True)
        return EXIT_BAD_INPUT
    except typer.Abort:
        typer.echo(f"{prog}: aborted", err=True)
        return 130
    except QoOpsError as exc:
        typer.echo(f"{prog}: error: {exc}", err=True)
        return exc.exit_code
    except Exception as exc:  # the last line of defence: still one line, still no secrets
        if debug:
            raise
        if _is_database_error(exc):
            orig = getattr(exc, "orig", None) or exc
            first = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
            typer.echo(f"{prog}: database error: {one_line(first)}", err=True)
            return EXIT_FAILED
        typer.echo(
            f"{prog}: internal error: {type(exc).__name__}: {one_line(str(exc))} "
            "(QO_OPS_DEBUG=1 shows the traceback)",
            err=True,
        )
        return EXIT_INTERNAL


def _is_database_error(exc: Exception) -> bool:
    """Whether ``exc`` is SQLAlchemy's. Not imported for this: a command that never
    loaded SQLAlchemy cannot have raised its errors."""
    loaded = sys.modules.get("sqlalchemy.exc")
    return loaded is not None and isinstance(exc, loaded.SQLAlchemyError)


# ------------------------------------------------------------------------- input


def parse_day(value: str, option: str) -> date:
    """A day given as ``--from``/``--to``/``--date`` (``YYYY-MM-DD``); one line otherwise."""
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise BadInput(f"{option} must be a date like 2026-01-31, got {value!r}") from None


def resolve_requester(given: str | None) -> str:
    """Who asks: ``given`` (``--requester``), else ``os:<login name>`` (``os:unknown``)."""
    if given:
        return given
    try:
        return f"os:{getpass.getuser()}"
    except (KeyError, OSError):
        return "os:unknown"


def ready_engine(target: DatabaseTarget | None = None) -> Engine:
    """An engine for ``target`` (default: the configured database), reachable and at the
    schema's head revision (``SchemaNotReady``, "run `qo-ops db upgrade`", otherwise)."""
    from qo_ops.db import migrate
    from qo_ops.db.engine import get_engine

    engine = get_engine(target)
    migrate.require_current(engine)
    return engine


# ------------------------------------------------------------------------- output


def emit_json(payload: dict[str, Any]) -> None:
    """Print ``payload`` as one JSON line on stdout."""
    typer.echo(json.dumps(payload, default=str, sort_keys=True))


def print_table(
    title: str, headers: list[str], rows: list[list[Any]], notes: list[str] | None = None
) -> None:
    """A readable table: boxed on a terminal, plain aligned columns when piped.

    ``notes`` (one per row, "" for none) holds each row's free text, printed on its own
    indented line under the row so that the columns stay narrow; a table with notes is plain
    on a terminal too, each note cut with an ellipsis to the terminal's width (COLUMNS, or
    PIPED_WIDTH when piped)."""
    tty = sys.stdout.isatty()
    if tty and notes is None:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        table = Table(title=Text(title))
        for h in headers:
            table.add_column(
                h,
                justify="right" if rows and isinstance(rows[0][headers.index(h)], int) else "left",
            )
        for r in rows:
            # Text: an operator's words (a suspension reason) are shown, never read as markup
            table.add_row(*(Text(f"{v:,}" if isinstance(v, int) else str(v)) for v in r))
        Console().print(table)
        return
    cells = [headers] + [[str(v) for v in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    indent = " " * (widths[0] + 2)  # a note starts under the second column
    room = shutil.get_terminal_size((PIPED_WIDTH, 24)).columns - len(indent)  # COLUMNS first
    typer.echo(title)
    for n, row in enumerate(cells):
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if notes and n and notes[n - 1]:
            typer.echo(indent + one_line(notes[n - 1], max(room, 20)))


def when_text(value: datetime | None) -> str:
    """A timestamp as a table shows it, to the second in UTC (``-`` for none)."""
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ") if value else "-"


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: str, option: str) -> float:
    """``90s``, ``30m``, ``2h``, ``1d`` (or plain seconds) as seconds; BadInput otherwise."""
    text = value.strip().lower()
    unit = _UNITS.get(text[-1:])
    number = text[:-1] if unit else text
    try:
        seconds = float(number) * (unit or 1)
    except ValueError:
        raise BadInput(f"{option} must look like 90s, 30m, 2h or 1d, not {value!r}") from None
    if not 0 < seconds < 10 * 365 * 86400:
        raise BadInput(f"{option} must be positive (and under 10 years), not {value!r}")
    return seconds


def short_id(value: uuid.UUID | str | None) -> str:
    """A run id as a table shows it: its first ``SHORT_ID`` characters (``-`` for none)."""
    return str(value)[:SHORT_ID] if value else "-"
