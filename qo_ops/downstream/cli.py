"""``qo-ops downstream``: run the downstream fulfilment / notification simulator.

``downstream_app`` is a Typer app whose callback is the command, so both
``app.add_typer(downstream_app, name="downstream")`` and running this module
(``python -m qo_ops.downstream.cli --port 8089``) give ``… downstream [OPTIONS]``.
Run as a module, errors are one line on stderr and exit 2, like ``qo-ops``.
"""

from __future__ import annotations

import enum
import sys
from pathlib import Path
from typing import Annotated

import typer

from qo_ops.cli_support import plain_app, run_typer_app
from qo_ops.errors import BadInput

STORE_FILE = "downstream.sqlite3"
PROG = "qo-ops downstream"


class Outage(enum.Enum):
    """``--outage``: answer 503 to everything, or drop every connection at once."""

    HTTP_503 = "503"
    REFUSE = "refuse"


downstream_app = plain_app(
    "downstream",
    "Run the downstream fulfilment and notification simulator (HTTP, SQLite store).",
    subcommand_metavar="",
)


@downstream_app.callback(invoke_without_command=True)
def downstream_command(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (1024-65535).")] = 8089,
    store: Annotated[
        Path | None,
        typer.Option(
            help="SQLite file of the simulator's state [default: QO_OPS_HOME/downstream.sqlite3]."
        ),
    ] = None,
    latency_ms: Annotated[int, typer.Option(help="Added latency per request, ms.")] = 0,
    error_rate: Annotated[float, typer.Option(help="Share of requests answered 503.")] = 0.0,
    timeout_rate: Annotated[
        float, typer.Option(help="Share stored, then answered only after --timeout-s.")
    ] = 0.0,
    reset_rate: Annotated[
        float, typer.Option(help="Share stored, then dropped without an answer.")
    ] = 0.0,
    poison_rate: Annotated[
        float, typer.Option(help="Share of keys / event ids always rejected with 422.")
    ] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed of the fault decisions.")] = 0,
    timeout_s: Annotated[float, typer.Option(help="How long a 'timeout' answer hangs, s.")] = 2.0,
    rate_limit: Annotated[
        float | None,
        typer.Option(
            help="Requests a second to fulfilment/notifications (burst 1 + N/5); "
            "beyond it 429 with Retry-After [default: no limit]."
        ),
    ] = None,
    outage: Annotated[
        Outage | None,
        typer.Option(help="Start in an outage: every request 503, or its connection dropped."),
    ] = None,
) -> None:
    """Serve the downstream simulator until Ctrl-C / SIGTERM (admin API under /admin)."""
    from qo_ops.config import load_settings
    from qo_ops.downstream.simulator import Faults, serve

    if not 1024 <= port <= 65535:
        raise BadInput("--port must be between 1024 and 65535")
    try:
        faults = Faults(
            latency_ms=latency_ms,
            error_rate=error_rate,
            timeout_rate=timeout_rate,
            reset_rate=reset_rate,
            poison_rate=poison_rate,
            seed=seed,
            timeout_s=timeout_s,
            rate_limit=rate_limit,
            outage=outage.value if outage else None,
        )
    except ValueError as exc:  # Faults.problem(): "<field> must be …", said as the flag
        field, _, rest = str(exc).partition(" ")
        raise BadInput(f"--{field.replace('_', '-')} {rest}") from None
    store_path = (store or load_settings().home / STORE_FILE).expanduser().resolve()
    if store_path.is_dir():
        raise BadInput(f"--store must be a file, {store_path} is a directory")
    typer.echo(f"downstream simulator on http://{host}:{port} (store {store_path})", err=True)
    serve(host, port, store_path, faults)


def main(argv: list[str] | None = None) -> int:
    """Run the command; every failure becomes one line on stderr and an exit code."""
    return run_typer_app(downstream_app, argv, PROG)


if __name__ == "__main__":
    sys.exit(main())
