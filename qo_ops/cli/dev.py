"""``qo-ops dev``: Dagster (webserver + daemon) and the downstream simulator on this machine,
over the embedded or configured database, until Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from qo_ops.cli.demo import demo_data_command
from qo_ops.cli_support import ready_engine
from qo_ops.errors import BadInput

# Dagster, the engine and SQLAlchemy are imported inside the command (qo_ops.cli_support).

COUNT_TENANTS = "SELECT count(*) FROM tenant"


def dev_command(
    port: Annotated[int, typer.Option(help="Port of the Dagster UI (loopback only).")] = 3000,
    reset_demo_data: Annotated[
        bool,
        typer.Option(
            "--reset-demo-data",
            help="First replace everything in the database with fresh demo data "
            "(what `make ui` does unless KEEP_DATA=1).",
        ),
    ] = False,
) -> None:
    """Start Dagster (webserver + daemon) on the embedded or configured database.

    The UI has no authentication (Dagster OSS): it listens on 127.0.0.1 only.
    """

    import sqlalchemy as sa

    from qo_ops.dagster_defs.instance import REPO, prepare_dagster_home
    from qo_ops.db.engine import resolve_target

    if not 1024 <= port <= 65535:
        raise BadInput("--port must be between 1024 and 65535")
    _require_free_port(port)  # before the data is replaced: a busy port changes nothing
    target = resolve_target()
    engine = ready_engine(target)
    if reset_demo_data:
        typer.echo(
            f"replacing the data in {target.display()} with fresh demo data: run history, "
            "checkpoints and suspensions go too (job_audit and API tokens stay); "
            "`make ui KEEP_DATA=1` (or qo-ops dev without --reset-demo-data) keeps the data"
        )
        demo_data_command(reset=True)  # what `qo-ops demo-data --reset` loads and says
    else:
        with engine.connect() as conn:
            tenants = int(conn.scalar(sa.text(COUNT_TENANTS)) or 0)
        typer.echo(
            f"keeping the data in {target.display()} as it is: {tenants:,} tenant(s)"
            + ("" if tenants else "; the UI has nothing to run (`make ui` loads demo data)")
        )
    from qo_ops.downstream.local import downstream_for_demo

    home = prepare_dagster_home(target)
    dagster = str(Path(sys.executable).with_name("dagster"))
    with downstream_for_demo(engine) as downstream_url:
        typer.echo(
            f"Dagster UI on http://127.0.0.1:{port} (DAGSTER_HOME={home}); "
            f"downstream simulator on {downstream_url}; Ctrl-C stops both"
        )
        dev = subprocess.Popen(
            [dagster, "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)], cwd=REPO
        )
        code = _wait_for_dagster_dev(dev)
    raise typer.Exit(code)


def _wait_for_dagster_dev(dev: subprocess.Popen[bytes]) -> int:
    """``dagster dev``'s exit code. On Ctrl-C (or a SIGTERM to qo-ops) it is let stop its
    webserver, daemon and code server (the terminal sent it the same SIGINT; a SIGTERM
    follows if only we got it); killing it at once, as ``subprocess.call`` does, or dying
    on SIGTERM ourselves, would leave those running."""

    def stop(signum: int, frame: Any) -> None:  # a supervisor's SIGTERM: as Ctrl-C
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        return dev.wait()
    except KeyboardInterrupt:
        typer.echo("stopping Dagster (webserver, daemon, code server)…", err=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    for nudge, grace_s in ((None, 5.0), (signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        if nudge is not None:
            dev.send_signal(nudge)
        try:
            return dev.wait(timeout=grace_s)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            continue
    return dev.wait()


def _require_free_port(port: int) -> None:
    """BadInput when something already listens on 127.0.0.1:``port``."""
    import socket

    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the webserver binds
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            raise BadInput(
                f"port {port} on 127.0.0.1 is in use: choose another "
                "(qo-ops dev --port 3001, make ui UI_PORT=3001)"
            ) from None
