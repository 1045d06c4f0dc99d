"""The ``qo-ops`` command line: one thin adapter over the same code every trigger uses.

Errors reach the user as one line on stderr with a non-zero exit code, never a traceback
(set ``QO_OPS_DEBUG=1`` to see one). ``--json`` output is one JSON object on stdout.

Here the app is put together; the commands live in the modules beside this one, one purpose
each: ``manual_run`` (``qo-ops run``), ``runs`` (status, runs, downstream-status, cancel,
reap), ``control`` (suspend, resume), ``recovery`` (requeue, review, checkpoint), ``approvals`` (approval grant, list, revoke), ``db`` (db …, info), ``demo`` (demo-data,
demo-dagster), ``dev``, ``archive``; ``api``, ``metrics`` and ``downstream`` come from their
packages. What they share is ``qo_ops.cli_support``, which also says why each command
imports what it works with inside its function: ``qo-ops --help`` loads none of it.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable

import typer

from qo_ops.api.cli import api_app
from qo_ops.cli import control, db, demo, dev, manual_run, recovery, runs
from qo_ops.cli.approvals import approval_app
from qo_ops.cli.archive import archive_app
from qo_ops.cli_support import plain_app, run_typer_app
from qo_ops.config import OTLP_ENV
from qo_ops.downstream.cli import downstream_app
from qo_ops.errors import QoOpsError
from qo_ops.metrics.cli import metrics_command

COMMANDS: dict[str, Callable[..., None]] = {  # --help lists them in this order
    "metrics": metrics_command,
    "demo-data": demo.demo_data_command,
    "info": db.info_command,
    "run": manual_run.run_command,
    "status": runs.status_command,
    "runs": runs.runs_command,
    "downstream-status": runs.downstream_status_command,
    "cancel": runs.cancel_command,
    "suspend": control.suspend_command,
    "resume": control.resume_command,
    "requeue": recovery.requeue_command,
    "reap": runs.reap_command,
    "dev": dev.dev_command,
    "demo-dagster": demo.demo_dagster_command,
}
GROUPS: dict[str, typer.Typer] = {  # then these, each with commands of its own
    "db": db.db_app,
    "api": api_app,
    "downstream": downstream_app,
    "archive": archive_app,
    "review": recovery.review_app,
    "checkpoint": recovery.checkpoint_app,
    "approval": approval_app,
}


def _build_app() -> typer.Typer:
    """The ``qo-ops`` app: ``COMMANDS``, then ``GROUPS``."""
    app = plain_app(
        "qo-ops",
        "Run the operational jobs of the Quote & Order platform safely.",
        no_args_is_help=True,
    )
    for name, command in COMMANDS.items():
        app.command(name)(command)
    for name, group in GROUPS.items():
        app.add_typer(group, name=name)
    return app


app = _build_app()


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and turn every failure into one line on stderr and an exit code."""
    warnings.filterwarnings("ignore", message=".*is currently in beta")  # Dagster's own API notes
    if os.environ.get(OTLP_ENV, "").strip():  # unset: tracing is off, OpenTelemetry not loaded
        from qo_ops.platform.observability.tracing import configure_from_env

        try:
            configure_from_env()  # traces over OTLP
        except QoOpsError as exc:
            typer.echo(f"qo-ops: error: {exc}", err=True)
            return exc.exit_code
    return run_typer_app(app, argv, "qo-ops")


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())
