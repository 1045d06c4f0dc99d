"""``qo-ops dev``: Dagster (webserver + daemon) and the downstream simulator on this machine,
over the embedded or configured database, until Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from qo_ops.cli.demo import demo_data_command
from qo_ops.cli_support import ready_engine
from qo_ops.errors import BadInput, DatabaseUnavailable

if TYPE_CHECKING:
    from qo_ops.downstream.local import SimulatorProcess

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

    # Ctrl-C works even when the parent started qo-ops with SIGINT ignored, and what it
    # starts (the simulator, Dagster) begins with SIGINT at its default, not ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
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
    with downstream_for_demo(engine) as downstream:
        typer.echo(
            f"Dagster UI on http://127.0.0.1:{port} (DAGSTER_HOME={home}); "
            f"downstream simulator on {downstream.url}; Ctrl-C stops both"
        )
        # its own process group: everything Dagster starts (webserver, daemon, code servers,
        # run workers) is in it, so that stopping can reach all of it and wait for all of it
        dev = subprocess.Popen(
            [dagster, "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
            cwd=REPO,
            start_new_session=True,
        )
        code, asked = _wait_for_dagster_dev(dev, _watch(downstream.simulator))
    if asked:  # a stop asked for (Ctrl-C, SIGTERM) and done: a clean end, exit 0
        typer.echo("Dagster and the simulator stopped", err=True)
        raise typer.Exit(0)
    raise typer.Exit(code)  # Dagster ended on its own: its exit code


def _watch(simulator: SimulatorProcess | None) -> Callable[[], None]:
    """What qo-ops checks every second while Dagster runs: the simulator it started is
    restarted on the same URL if it has died, and it says so."""

    def check() -> None:
        if simulator is None:  # QO_OPS_DOWNSTREAM_URL's: not ours to restart
            return
        try:
            said = simulator.revive()
        except DatabaseUnavailable as exc:  # it would not start again: say so, retry next time
            said = f"downstream simulator down and not restarted: {exc}"
        if said:
            typer.echo(said, err=True)

    return check


# How Dagster is stopped: Ctrl-C as a terminal sends it (webserver, daemon and code servers
# shut down on their own), then SIGTERM, then SIGKILL, each to its whole process group and
# each with this long for the group to be gone (the sum stays under 10 s).
STOP_STEPS = ((signal.SIGINT, 6.0), (signal.SIGTERM, 2.5), (signal.SIGKILL, 1.0))


def _wait_for_dagster_dev(
    dev: subprocess.Popen[bytes], every_second: Callable[[], None] = lambda: None
) -> tuple[int, bool]:
    """``dagster dev``'s exit code, and whether a stop was asked for. On Ctrl-C, or a SIGINT,
    SIGTERM or SIGHUP to qo-ops alone, Dagster's whole process group is stopped
    (:data:`STOP_STEPS`) before qo-ops returns: nothing it started is left behind, whichever
    process got the signal and whatever was running (a run a sensor had just launched holds
    up a code server's own shutdown).
    While it runs, ``every_second`` is called once a second (the simulator's watch)."""

    def stop(signum: int, frame: Any) -> None:  # Ctrl-C, a supervisor's SIGTERM, a closed terminal
        raise KeyboardInterrupt

    # SIGINT too, whatever handler came before (Python keeps a SIGINT its parent ignored
    # ignored: a shell without job control starts background commands so)
    stopping = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, stop) for sig in stopping}
    try:
        while True:
            with suppress(subprocess.TimeoutExpired):
                return dev.wait(timeout=1.0), False
            every_second()
    except KeyboardInterrupt:
        typer.echo("stopping Dagster (webserver, daemon, code server)…", err=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for sig, grace_s in STOP_STEPS:
        try:
            os.killpg(dev.pid, sig)
        except ProcessLookupError:
            break  # the group is gone
        if _group_gone(dev, grace_s):
            break
    return dev.wait(), True


def _group_gone(dev: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Whether Dagster's process group is empty within ``timeout_s`` (``dagster dev`` itself
    reaped; its children, orphaned once it exits, are reaped by init)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with suppress(subprocess.TimeoutExpired, KeyboardInterrupt):  # a second Ctrl-C: go on
            dev.wait(timeout=0.1)
        try:
            os.killpg(dev.pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        with suppress(KeyboardInterrupt):
            time.sleep(0.1)  # polling the group for a condition, not a timed wait


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
