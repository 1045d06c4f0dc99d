"""Running a typer command so that every failure is one line on stderr and an exit code,
never a traceback (``QO_OPS_DEBUG=1`` shows one). Shared by ``qo-ops`` and the
sub-commands that also run as modules (``qo_ops.downstream.cli``, ``qo_ops.jobs.archive_cli``)."""

from __future__ import annotations

import os
import signal
import threading

import typer
from sqlalchemy.exc import SQLAlchemyError
from typer._click import exceptions as click_exceptions  # typer vendors click

from qo_ops.errors import EXIT_BAD_INPUT, QoOpsError, one_line

EXIT_FAILED = 1
EXIT_INTERNAL = 70


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
    except SQLAlchemyError as exc:
        if debug:
            raise
        orig = getattr(exc, "orig", None) or exc
        first = str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__
        typer.echo(f"{prog}: database error: {one_line(first)}", err=True)
        return EXIT_FAILED
    except Exception as exc:  # the last line of defence: still one line, still no secrets
        if debug:
            raise
        typer.echo(
            f"{prog}: internal error: {type(exc).__name__}: {one_line(str(exc))} "
            "(QO_OPS_DEBUG=1 shows the traceback)",
            err=True,
        )
        return EXIT_INTERNAL
