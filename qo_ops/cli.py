"""The ``qo-ops`` command line: one thin adapter over the same code every trigger uses.

Errors reach the user as one line on stderr with a non-zero exit code, never a traceback
(set ``QO_OPS_DEBUG=1`` to see one). ``--json`` output is one JSON object on stdout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import json
import logging
import re
import shutil
import signal
import subprocess
import sys
import uuid
import warnings
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import sqlalchemy as sa
import typer

from qo_ops.cli_support import run_typer_app
from qo_ops.db import migrate
from qo_ops.db.engine import DatabaseTarget, ensure_database, get_engine, resolve_target
from qo_ops.db.schema import BUSINESS_TABLES, PLATFORM_TABLES
from qo_ops.errors import BadInput, ConfigError, QoOpsError, one_line
from qo_ops.platform.manners import DownstreamCalls
from qo_ops.platform.spec import JobSpec, RunOptions, Scope
from qo_ops.platform.tracing import configure_from_env

if TYPE_CHECKING:
    from qo_ops.platform.runs import RunRow

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


def _register_subcommands() -> None:
    from qo_ops.api.cli import api_app
    from qo_ops.downstream.cli import downstream_app
    from qo_ops.jobs.archive_cli import archive_app
    from qo_ops.metrics.cli import metrics_command

    app.add_typer(api_app, name="api")
    app.command("metrics")(metrics_command)
    app.add_typer(downstream_app, name="downstream")
    app.add_typer(archive_app, name="archive")


_register_subcommands()

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")]


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


PIPED_WIDTH = 120  # a note's line when piped and COLUMNS is unset (--json: the text whole)


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


DEMO_TENANTS, DEMO_QUOTES, DEMO_SEED = 3, 2000, 1  # `make demo` and `make ui` load these


@app.command("demo-data")
def demo_data(
    tenants: Annotated[int, typer.Option(help="How many tenants to create.")] = DEMO_TENANTS,
    quotes: Annotated[int, typer.Option(help="Quotes per tenant.")] = DEMO_QUOTES,
    seed: Annotated[int, typer.Option(help="Seed: the same seed gives the same data.")] = DEMO_SEED,
    as_of: Annotated[
        str | None, typer.Option("--as-of", help="Time the data is relative to (default: now).")
    ] = None,
    append: Annotated[bool, typer.Option("--append", help="Add tenants to existing data.")] = False,
    reset: Annotated[bool, typer.Option("--reset", help="Replace existing data.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Load deterministic demo data, anomalies included, in one transaction."""
    anchor = (
        parse_timestamp(as_of, "--as-of") if as_of else datetime.now(UTC).replace(microsecond=0)
    )
    engine = get_engine()
    migrate.require_current(engine)
    _load_demo_data(engine, tenants, quotes, seed, anchor, append, reset, as_json)


def _load_demo_data(
    engine: sa.Engine,
    tenants: int,
    quotes: int,
    seed: int,
    anchor: datetime,
    append: bool = False,
    reset: bool = False,
    as_json: bool = False,
) -> None:
    """Load demo data (``load_demo_data``) and say what was loaded."""
    from qo_ops.demo.data import load_demo_data
    from qo_ops.jobs.temp_file_cleanup import objects_root

    report = load_demo_data(
        engine,
        tenants=tenants,
        quotes=quotes,
        seed=seed,
        as_of=anchor,
        append=append,
        reset=reset,
        objects=objects_root(),  # temp_file_cleanup's store: the demo's files are real
    )
    if as_json:
        emit_json(
            {
                "tenants": report.tenants,
                "rows": report.rows,
                "objects": {"written": report.objects_written, "removed": report.objects_removed},
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
    typer.echo(
        f"stored {report.objects_written:,} temp file objects under {objects_root()}"
        + (
            f" (removed {report.objects_removed:,} of the replaced rows)"
            if report.objects_removed
            else ""
        )
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


# ------------------------------------------------------------------------- jobs

EXIT_BY_STATUS = {
    "success": 0,
    "no_work": 0,
    "failed": 1,
    "partial_success": 3,
    "skipped": 4,
    "timeout": 5,
    "cancelled": 6,
}
SUMMARY_KEYS = (
    "job_run_id",
    "job_name",
    "status",
    "mode",
    "scope",
    "requester",
    "eligible_count",
    "processed_count",
    "succeeded_count",
    "failed_count",
    "skipped_count",
    "duration_ms",
)


def _parse_date(value: str, option: str) -> date:
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise BadInput(f"{option} must be a date like 2026-01-31, got {value!r}") from None


def _scope(tenant: str, day: str | None, start: str | None, end: str | None) -> Scope:
    if day and (start or end):
        raise BadInput("give either --date or --from/--to, not both")
    if day:
        d = _parse_date(day, "--date")
        return Scope.days(tenant, d, d)
    if start or end:
        if not (start and end):
            raise BadInput("--from and --to go together")
        first, last = _parse_date(start, "--from"), _parse_date(end, "--to")
        if last < first:
            raise BadInput("--to must not be before --from")
        return Scope.days(tenant, first, last)  # --to is inclusive
    return Scope(tenant)


def _requester(given: str | None) -> str:
    if given:
        return given
    try:
        return f"os:{getpass.getuser()}"
    except (KeyError, OSError):
        return "os:unknown"


class _TerminalProgress(logging.Handler):
    """Renders job.progress events as one updating line on a terminal."""

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "event", {})
        if event.get("event.name") != "job.progress":
            return
        done, eligible = event.get("items.processed", 0), self.eligible or 0
        share = f" of {eligible:,} ({100 * done / eligible:.0f}%)" if eligible else ""
        rate = event.get("throughput_per_second") or 0
        sys.stderr.write(
            f"\r  processed {done:,}{share}, {rate:,.0f}/s, failed {event.get('items.failed', 0):,}   "
        )
        sys.stderr.flush()

    eligible: int | None = None


@app.command("run")
def run_command(
    job: Annotated[str, typer.Argument(help="Job name, e.g. quote_expiration.")],
    tenant: Annotated[str, typer.Option(help="Tenant id, e.g. tenant-001.")],
    mode: Annotated[str, typer.Option(help="dry-run (default) or execute.")] = "dry-run",
    day: Annotated[
        str | None, typer.Option("--date", help="Window of one day (windowed jobs).")
    ] = None,
    start: Annotated[str | None, typer.Option("--from", help="First day of the window.")] = None,
    end: Annotated[
        str | None, typer.Option("--to", help="Last day of the window (inclusive).")
    ] = None,
    batch_size: Annotated[int | None, typer.Option(help="Items per batch transaction.")] = None,
    max_items: Annotated[int | None, typer.Option(help="Stop after this many items.")] = None,
    throttle_ms: Annotated[int | None, typer.Option(help="Pause between batches.")] = None,
    deadline_s: Annotated[
        float | None, typer.Option(help="Stop (status timeout) after this long.")
    ] = None,
    lease_ttl_s: Annotated[float | None, typer.Option(help="Lease time-to-live.")] = None,
    concurrency: Annotated[
        int | None, typer.Option(help="Parallel calls to the downstream (jobs that call it).")
    ] = None,
    reason: Annotated[str | None, typer.Option(help="Why (required to execute by hand).")] = None,
    requester: Annotated[str | None, typer.Option(help="Who asks (default: os:$USER).")] = None,
    correlation_id: Annotated[
        str | None, typer.Option(help="Ties this run to an incident or ticket.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Run a job by hand over one tenant (and window) and print its summary."""
    from qo_ops.jobs.catalog import get_spec
    from qo_ops.platform.runner import run_job
    from qo_ops.platform.telemetry import EVENT_LOGGER, configure_event_logging

    spec = get_spec(job)
    normalized_mode = mode.replace("-", "_")
    if normalized_mode not in ("dry_run", "execute"):
        raise BadInput(f"--mode must be dry-run or execute, not {mode!r}")
    scope = _scope(tenant, day, start, end)
    options = RunOptions(
        mode=normalized_mode,  # type: ignore[arg-type]
        trigger="manual",
        batch_size=batch_size,
        max_items=max_items,
        throttle_ms=throttle_ms,
        deadline_s=deadline_s,
        lease_ttl_s=lease_ttl_s,
        concurrency=concurrency,
        requester=_requester(requester),
        reason=reason,
        correlation_id=correlation_id or str(uuid.uuid4()),
        progress_interval_s=1.0 if sys.stderr.isatty() else 10.0,
    ).validated()
    engine = get_engine()
    migrate.require_current(engine)
    if sys.stderr.isatty() and not as_json:
        progress = _TerminalProgress()
        logging.getLogger(EVENT_LOGGER).addHandler(progress)
        logging.getLogger(EVENT_LOGGER).setLevel(logging.INFO)
        logging.getLogger(EVENT_LOGGER).propagate = False
    else:
        configure_event_logging()
    summary = run_job(spec, scope, options, engine=engine)
    if sys.stderr.isatty() and not as_json:
        sys.stderr.write("\n")
    if as_json:
        emit_json(summary.as_dict())
    else:
        data = summary.as_dict()
        for key in SUMMARY_KEYS:
            typer.echo(f"{key}={'' if data[key] is None else data[key]}")
        for key in ("status_reason", "error_code", "error_text"):
            if data[key]:
                typer.echo(f"{key}={data[key]}")
        calls = DownstreamCalls.from_tally(summary.tally)
        if calls is not None:
            typer.echo(f"downstream={calls.line()}")
        if summary.sample_ids:
            typer.echo(f"sample_ids={','.join(summary.sample_ids)}")
        for check in summary.checks:
            typer.echo(f"check.{check.name}={'passed' if check.passed else 'FAILED'}")
    raise typer.Exit(EXIT_BY_STATUS[summary.status])


def _when(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ") if value else "-"


@app.command("status")
def status_command(
    job: Annotated[str | None, typer.Argument(help="One job (default: all).")] = None,
    tenant: Annotated[str | None, typer.Option(help="One tenant (default: all).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Per job and tenant: last run, last success, lease holder, backlog; what is
    suspended, by whom, since when and why; and a downstream breaker that is not closed."""
    from qo_ops.jobs.catalog import CATALOG, get_spec
    from qo_ops.platform.control import suspensions
    from qo_ops.platform.status import breaker_status, job_status

    specs = [get_spec(job)] if job else list(CATALOG.values())
    engine = get_engine()
    migrate.require_current(engine)
    rows = [r for spec in specs for r in job_status(engine, spec, tenant)]
    with engine.connect() as conn:
        held = suspensions(conn, job, tenant)
        not_closed = [b for b in breaker_status(conn) if b.state != "closed"]
    if as_json:
        emit_json(
            {
                "status": [r.as_dict() for r in rows],
                "suspended": [s.as_dict() for s in held],
                "breakers_not_closed": [b.as_dict() for b in not_closed],
            }
        )
        return
    for b in not_closed:  # every job that calls it waits: say so before the table
        typer.echo(
            f"downstream {b.downstream}: circuit breaker {b.state} for {b.open_s:.0f} s "
            f"({b.reason or 'no reason'}); runs hold their calls: qo-ops downstream-status"
        )
    if held:
        print_table(
            "suspended (qo-ops resume JOB [--tenant T] --reason …)",
            ["job", "scope", "by", "since", "reason"],
            [
                [
                    s.job_name,
                    s.tenant_id or "every scope",
                    s.suspended_by,
                    _when(s.suspended_at),
                    s.reason,
                ]
                for s in held
            ],
        )
    print_table(
        "job status",
        [
            "job",
            "scope",
            "last run",
            "status",
            "last success",
            "lease holder",
            "backlog",
            "checkpoint age",
        ],
        [
            [
                r.job_name,
                r.scope,
                _when(r.last_run_at),
                r.last_status or "-",
                _when(r.last_success_at),
                r.lease_holder or "-",
                "-" if r.backlog is None else r.backlog,
                "-" if r.checkpoint_age_s is None else f"{r.checkpoint_age_s:.0f} s",
            ]
            for r in rows
        ],
    )


@app.command("runs")
def runs_command(
    job: Annotated[str, typer.Argument(help="Job name.")],
    tenant: Annotated[
        str | None, typer.Option(help="One tenant (its windows too, for windowed jobs).")
    ] = None,
    limit: Annotated[int, typer.Option(help="How many runs, newest first.")] = 20,
    as_json: JsonOpt = False,
) -> None:
    """The run history of a job, newest first: ids in short (`qo-ops cancel` takes a running
    run's), why each ended as it did and the reason it was asked for; --json has every field."""
    from qo_ops.jobs.catalog import get_spec
    from qo_ops.platform.runs import list_runs

    spec = get_spec(job)
    if not 1 <= limit <= 1000:
        raise BadInput("--limit must be between 1 and 1000")
    if tenant is not None:
        Scope(tenant)  # validates the id
    engine = get_engine()
    migrate.require_current(engine)
    history = list_runs(engine, spec.name, tenant, limit)
    if as_json:
        emit_json({"runs": [dataclasses.asdict(r) for r in history]})
        return
    calls = [DownstreamCalls.from_tally(r.tally) for r in history]
    headers = ["run", "dagster", "scope", "started", "mode", "trigger", "status"]
    headers += ["eligible", "processed", "failed"]
    if any(calls):  # a job that calls the downstream: how its runs treated it
        headers += ["calls", "retry pressure"]
    print_table(
        f"runs of {spec.name}",
        headers,
        [
            [
                _short_id(r.id),
                _short_id(r.dagster_run_id),
                r.scope,
                r.started_at.astimezone(UTC).strftime("%Y-%m-%d %H:%MZ"),  # --json: to the µs
                r.mode,
                r.trigger_type,
                r.status,
                r.eligible_count,
                r.processed_count,
                r.failed_count,
                *(_calls_cells(c) if any(calls) else []),
            ]
            for r, c in zip(history, calls, strict=True)
        ],
        notes=[_run_note(r, c) for r, c in zip(history, calls, strict=True)],
    )


def _run_note(run: RunRow, calls: DownstreamCalls | None) -> str:
    """A run's words: why it ended as it did (the runner's), the reason it was asked for
    (the requester's) and the breaker transitions it caused."""
    words = [
        f"{label}: {one_line(text, NOTE_FIELD_LIMIT)}"
        for label, text in (
            ("why", run.status_reason),
            ("reason", run.reason),
            ("breaker", calls.breaker_text() if calls else None),
        )
        if text and text != "-"
    ]
    return " · ".join(words)


NOTE_FIELD_LIMIT = 100  # characters of one field of a note
SHORT_ID = 8  # characters of a run id the history shows, as Dagster's UI does
SHORT_RUN_ID = re.compile(rf"[0-9a-f][0-9a-f-]{{{SHORT_ID - 1},34}}")  # a UUID's beginning


def _short_id(value: uuid.UUID | str | None) -> str:
    return str(value)[:SHORT_ID] if value else "-"


def _calls_cells(calls: DownstreamCalls | None) -> list[Any]:
    """A run's calls and retry pressure (retries / calls); its breaker transitions are in
    its note."""
    if calls is None:
        return ["-", "-"]
    pressure = calls.retry_pressure
    return [calls.calls, "-" if pressure is None else f"{pressure * 100:.1f} %"]


@app.command("downstream-status")
def downstream_status_command(as_json: JsonOpt = False) -> None:
    """The downstream's circuit breaker as the runs share it: state, since when and why,
    when the next run probes it. Read-only."""
    from qo_ops.platform.status import breaker_status

    engine = get_engine()
    migrate.require_current(engine)
    with engine.connect() as conn:
        rows = breaker_status(conn)
    if as_json:
        emit_json({"breakers": [r.as_dict() for r in rows]})
        return
    if not rows:
        typer.echo("no breaker recorded: every downstream closed (no run has opened one)")
        return
    print_table(
        "downstream breakers (docs/downstream.md, During a downstream incident)",
        [
            "downstream",
            "state",
            "since",
            "open for",
            "next probe",
            "times opened",
            "reason",
            "by run",
        ],
        [
            [
                r.downstream,
                r.state,
                _when(r.opened_at) if r.state != "closed" else "-",
                f"{r.open_s:.0f} s" if r.state != "closed" else "-",
                _probe_text(r.state, r.probe_in_s),
                r.opened_count,
                r.reason or "-",
                str(r.changed_by_run or "-"),
            ]
            for r in rows
        ],
    )


def _probe_text(state: str, probe_in_s: float | None) -> str:
    if state == "half_open":
        return "probing"
    if state != "open" or probe_in_s is None:
        return "-"
    return "due: the next run probes" if probe_in_s <= 0 else f"in {probe_in_s:.0f} s"


@app.command("cancel")
def cancel_command(
    run_id: Annotated[
        str, typer.Argument(help="The job_run id to stop (of a running run: its short id too).")
    ],
    reason: Annotated[str, typer.Option(help="Why (recorded in the audit trail).")],
    requester: Annotated[str | None, typer.Option(help="Who asks (default: os:$USER).")] = None,
) -> None:
    """Ask a running run to stop after its current batch (it ends `cancelled`)."""
    from qo_ops.platform.runs import UNSTARTED_STATUSES, request_cancel, running_run_by_prefix

    try:
        parsed: uuid.UUID | None = uuid.UUID(run_id)
    except ValueError:
        parsed = None
        if not SHORT_RUN_ID.fullmatch(run_id.lower()):
            raise BadInput(
                f"{run_id!r} is not a run id (a UUID, or the first {SHORT_ID}+ characters "
                "of a running run's, as `qo-ops runs` shows them)"
            ) from None
    if not reason.strip():
        raise BadInput("--reason must not be empty")
    engine = get_engine()
    migrate.require_current(engine)
    if parsed is None:
        parsed = running_run_by_prefix(engine, run_id.lower())
    status = request_cancel(engine, parsed, _requester(requester), reason)
    if status == "running":
        typer.echo("cancel requested")
    elif status in UNSTARTED_STATUSES:
        typer.echo(f"run was {status}; cancelled before it started")
    else:
        typer.echo(f"run is already {status}; nothing to cancel")


def _control_scope(job: str, tenant: str | None) -> str:
    return f"{job} for tenant {tenant}" if tenant else f"{job} for every scope"


@app.command("suspend")
def suspend_command(
    job: Annotated[str, typer.Argument(help="The job to suspend.")],
    reason: Annotated[str, typer.Option(help="Why (required; shown in status, audited).")],
    tenant: Annotated[
        str | None, typer.Option(help="Only this tenant (default: every scope).")
    ] = None,
    requester: Annotated[str | None, typer.Option(help="Who asks (default: os:$USER).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Kill switch: no new run of JOB starts (schedules, sensors, CLI, API), and a running
    one stops at its next batch boundary (ends `cancelled`, reason `suspended`)."""
    from qo_ops.jobs.catalog import CATALOG
    from qo_ops.platform.control import suspend

    engine = get_engine()
    migrate.require_current(engine)
    found, new = suspend(
        engine, job, tenant, actor=_requester(requester), reason=reason, known_jobs=set(CATALOG)
    )
    if as_json:
        emit_json({"suspended": found.as_dict(), "new": new})
        return
    if new:
        typer.echo(
            f"suspended {_control_scope(job, tenant)}; resume with: qo-ops resume {job}"
            f"{' --tenant ' + tenant if tenant else ''} --reason …"
        )
    else:
        typer.echo(f"already suspended: {found.describe()}")


@app.command("resume")
def resume_command(
    job: Annotated[str, typer.Argument(help="The job to resume.")],
    reason: Annotated[str, typer.Option(help="Why (required; audited).")],
    tenant: Annotated[
        str | None, typer.Option(help="Lift the suspension of this tenant (default: job-wide).")
    ] = None,
    requester: Annotated[str | None, typer.Option(help="Who asks (default: os:$USER).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Lift a suspension made with `qo-ops suspend` (the same JOB and --tenant)."""
    from qo_ops.jobs.catalog import CATALOG
    from qo_ops.platform.control import resume, suspensions

    engine = get_engine()
    migrate.require_current(engine)
    lifted = resume(
        engine, job, tenant, actor=_requester(requester), reason=reason, known_jobs=set(CATALOG)
    )
    with engine.connect() as conn:
        left = suspensions(conn, job)
    if as_json:
        emit_json(
            {
                "resumed": lifted.as_dict() if lifted else None,
                "still_suspended": [s.as_dict() for s in left],
            }
        )
        return
    if lifted:
        typer.echo(f"resumed {_control_scope(job, tenant)}")
    else:
        typer.echo(f"{_control_scope(job, tenant)} was not suspended; nothing changed")
    for other in left:
        typer.echo(f"still suspended: {other.describe()}")


@app.command("requeue")
def requeue_command(
    job: Annotated[
        str, typer.Argument(help="The job whose dead letters to requeue.")
    ] = "delivery_retry",
    tenant: Annotated[str, typer.Option(help="Tenant whose dead letters to requeue.")] = "",
    reason: Annotated[str, typer.Option(help="Why (recorded in the audit trail).")] = "",
    item: Annotated[
        list[str] | None, typer.Option(help="Only these item ids (repeatable).")
    ] = None,
    all_dead: Annotated[
        bool, typer.Option("--all-dead", help="Every dead letter of the tenant (up to --limit).")
    ] = False,
    limit: Annotated[int, typer.Option(help="At most this many items.")] = 1000,
    requester: Annotated[str | None, typer.Option(help="Who asks (default: os:$USER).")] = None,
) -> None:
    """Put dead-lettered delivery items back to READY (audited)."""
    from qo_ops.platform.retry import requeue_dead_letters

    if job.replace("-", "_") != "delivery_retry":
        raise BadInput(f"only delivery_retry keeps dead letters to requeue, not {job!r}")
    if not tenant:
        raise BadInput("--tenant is required")
    if item and all_dead:
        raise BadInput("give either --item or --all-dead, not both")
    if not item and not all_dead:
        raise BadInput("say what to requeue: --item ID (repeatable) or --all-dead")
    Scope(tenant)
    if not reason.strip():
        raise BadInput("--reason is required (recorded in the audit trail)")
    if not 1 <= limit <= 100_000:
        raise BadInput("--limit must be between 1 and 100000")
    try:
        ids = [uuid.UUID(i) for i in item] if item else None
    except ValueError:
        raise BadInput("--item takes delivery item ids (UUIDs)") from None
    engine = get_engine()
    migrate.require_current(engine)
    count = requeue_dead_letters(
        engine,
        tenant_id=tenant,
        requester=_requester(requester),
        reason=reason,
        item_ids=ids,
        limit=limit,
    )
    typer.echo(f"requeued {count} dead-lettered item(s) of {tenant}")


@app.command("reap")
def reap_command(
    job: Annotated[str | None, typer.Argument(help="One job (default: all).")] = None,
) -> None:
    """Mark orphaned `running` runs (no live lease, no heartbeat) as failed/orphaned now."""
    from qo_ops.jobs.catalog import get_spec
    from qo_ops.platform.runs import reap_orphans

    name = get_spec(job).name if job else None
    engine = get_engine()
    migrate.require_current(engine)
    reaped = reap_orphans(engine, name)
    typer.echo(f"reaped {len(reaped)} orphaned run(s)" + "".join(f"\n  {r}" for r in reaped))


# ------------------------------------------------------------------------- dagster


@app.command("dev")
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

    from qo_ops.dagster_defs.instance import REPO, prepare_dagster_home

    if not 1024 <= port <= 65535:
        raise BadInput("--port must be between 1024 and 65535")
    _require_free_port(port)  # before the data is replaced: a busy port changes nothing
    target = resolve_target()
    engine = get_engine(target)
    migrate.require_current(engine)
    if reset_demo_data:
        typer.echo(
            f"replacing the data in {target.display()} with fresh demo data: run history, "
            "checkpoints and suspensions go too (job_audit and API tokens stay); "
            "`make ui KEEP_DATA=1` (or qo-ops dev without --reset-demo-data) keeps the data"
        )
        anchor = datetime.now(UTC).replace(microsecond=0)
        _load_demo_data(engine, DEMO_TENANTS, DEMO_QUOTES, DEMO_SEED, anchor, reset=True)
    else:
        with engine.connect() as conn:
            tenants = int(conn.scalar(sa.text("SELECT count(*) FROM tenant")) or 0)
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


def _latest_day_with_work(
    engine: sa.Engine, spec: JobSpec, tenant: str, last: date, days: int = 30
) -> date:
    """The most recent day (back from ``last``) on which ``spec`` has something to do."""
    from qo_ops.platform.runner import count_eligible
    from qo_ops.platform.spec import BatchContext

    with engine.connect() as conn:
        for back in range(days):
            day = last - timedelta(days=back)
            ctx = BatchContext(
                spec.name, Scope(tenant, day, day + timedelta(days=1)), "dry_run", uuid.uuid4()
            )
            if count_eligible(conn, spec, ctx):
                return day
    return last


DEMO_EVENTS_LOG = "logs/demo-dagster.jsonl"  # under QO_OPS_HOME, rewritten by each demo
QUIET_CONSOLE = {"console": {"config": {"log_level": "CRITICAL"}}}  # Dagster's own lines


@dataclasses.dataclass
class DemoRun:
    """What one Dagster run of ``qo-ops demo-dagster`` did, for a person or as JSON."""

    job_name: str
    tenant: str
    scope: str
    mode: str
    dagster_run_id: str
    dagster_success: bool
    status: str  # the runner's status; "not run" when the run failed before it
    eligible_count: int | None
    processed_count: int | None
    mutated_count: int | None
    failed_count: int | None
    duration_ms: int | None
    job_run_id: str | None
    checks: dict[str, bool]  # outcome check -> passed
    error: str | None  # the failed step's one line, when the Dagster run failed

    def lines(self) -> list[str]:
        """Two or three lines: what ran and how it ended, its counts, its checks."""
        counts = (
            f"eligible {self.eligible_count:,}, processed {self.processed_count:,}, "
            f"changed {self.mutated_count:,}, failed {self.failed_count:,}"
            f" in {self.duration_ms:,} ms"
            if self.eligible_count is not None
            else "no counts: the runner did not finish"
        )
        out = [
            f"{self.job_name} · {self.scope} · {self.mode}: {self.status}"
            f" (dagster run {self.dagster_run_id[:SHORT_ID]}"
            f"{'' if self.dagster_success else ' FAILED'})",
            f"  {counts}",
        ]
        failed = [name for name, passed in self.checks.items() if not passed]
        passed = [name for name, ok in self.checks.items() if ok]
        if failed:
            out.append(f"  checks FAILED: {', '.join(failed)}; passed: {len(passed)}")
        elif passed:
            out.append(f"  checks passed: {', '.join(passed)}")
        if self.error:
            out.append(f"  error: {self.error}")
        return out


def _demo_run(spec: JobSpec, tenant: str, result: Any) -> DemoRun:
    """A ``DemoRun`` from a Dagster ``ExecuteInProcessResult`` of ``spec``'s job."""
    node = f"{spec.name}_op"
    try:
        output = result.output_for_node(node)
    except Exception:  # the op failed: no output, its failure says why
        output = {}
    summary = output["runs"][0] if output.get("runs") else output  # a run of named tenants
    error = None
    if not result.success:
        failure = result.failure_data_for_node(node)
        described = failure.user_failure_data.description if failure else None
        error = one_line(described or (failure.error.message if failure else "run failed"))
    return DemoRun(
        job_name=spec.name,
        tenant=tenant,
        scope=summary.get("scope", tenant),
        mode=summary.get("mode", "execute"),
        dagster_run_id=result.run_id,
        dagster_success=result.success,
        status=summary.get("status", "not run"),
        eligible_count=summary.get("eligible_count"),
        processed_count=summary.get("processed_count"),
        mutated_count=summary.get("succeeded_count"),
        failed_count=summary.get("failed_count"),
        duration_ms=summary.get("duration_ms"),
        job_run_id=summary.get("job_run_id"),
        checks={e.check_name: e.passed for e in result.get_asset_check_evaluations()},
        error=error,
    )


@contextlib.contextmanager
def _events_to_file(path: Path) -> Iterator[None]:
    """The runner's JSON events (logger qo_ops.events) also go to ``path``, one a line."""
    from qo_ops.platform.telemetry import EVENT_LOGGER, json_log_handler

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        stream = path.open("w", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror} (QO_OPS_HOME)") from None
    handler = json_log_handler(stream)
    logger = logging.getLogger(EVENT_LOGGER)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        stream.close()


@app.command("demo-dagster")
def demo_dagster_command(
    tenant: Annotated[str, typer.Option(help="The tenant partition to run.")] = "tenant-001",
    verbose: Annotated[
        bool,
        typer.Option("--verbose", help="Also show Dagster's log lines (the JSON events) here."),
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Run every catalog job through Dagster for one tenant: a few lines per run (status,
    counts, outcome checks); the runs' JSON events go to QO_OPS_HOME/logs/demo-dagster.jsonl."""
    from datetime import date as date_cls

    import dagster as dg

    from qo_ops.config import load_settings
    from qo_ops.dagster_defs.instance import prepare_dagster_home
    from qo_ops.dagster_defs.partitions import partition_key_for
    from qo_ops.definitions import build_definitions
    from qo_ops.jobs.catalog import CATALOG

    Scope(tenant)
    target = resolve_target()
    engine = get_engine(target)
    migrate.require_current(engine)
    prepare_dagster_home(target)
    from qo_ops.downstream.local import downstream_for_demo

    events_log = load_settings().home / DEMO_EVENTS_LOG
    defs = build_definitions()
    yesterday = date_cls.today() - timedelta(days=1)
    # its own reason each time: a Dagster execute may not repeat an earlier one's reason
    reason = f"make demo ({datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC)"
    runs: list[DemoRun] = []
    with (
        _events_to_file(events_log),
        downstream_for_demo(engine) as downstream_url,
        dg.DagsterInstance.get() as instance,
    ):
        if not as_json:
            typer.echo(
                f"every catalog job through Dagster for {tenant}, mode execute "
                f"(downstream simulator {downstream_url}); JSON events: {events_log}"
            )
        if tenant not in instance.get_dynamic_partitions("tenants"):
            instance.add_dynamic_partitions("tenants", [tenant])
        for spec in CATALOG.values():
            job = defs.resolve_job_def(spec.name)
            day = (
                _latest_day_with_work(engine, spec, tenant, yesterday)
                if spec.partitioning == "tenant_day"
                else None
            )
            op_config = {
                "mode": "execute",
                "reason": reason,
                **({"tenants": [tenant]} if day is not None else {}),
            }
            result = job.execute_in_process(
                partition_key=partition_key_for(spec, tenant, day),
                instance=instance,
                run_config={
                    "ops": {f"{spec.name}_op": {"config": op_config}},
                    **({} if verbose else {"loggers": QUIET_CONSOLE}),
                },
                raise_on_error=False,
            )
            runs.append(_demo_run(spec, tenant, result))
            if not as_json:
                for line in runs[-1].lines():
                    typer.echo(line)
    failures = sum(not r.dagster_success for r in runs)
    if as_json:
        emit_json(
            {
                "tenant": tenant,
                "events_log": str(events_log),
                "runs": [dataclasses.asdict(r) for r in runs],
                "dagster_failures": failures,
            }
        )
    else:
        statuses: dict[str, int] = {}
        for r in runs:
            statuses[r.status] = statuses.get(r.status, 0) + 1
        checks = [ok for r in runs for ok in r.checks.values()]
        typer.echo(
            f"{len(runs)} Dagster runs, {len(runs) - failures} succeeded "
            f"({', '.join(f'{n} {s}' for s, n in sorted(statuses.items()))}); "
            f"outcome checks: {sum(checks)} passed, {len(checks) - sum(checks)} failed"
        )
        typer.echo(f"JSON events of these runs: {events_log} (--verbose shows them here)")
    raise typer.Exit(1 if failures else 0)


# ------------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and turn every failure into one line on stderr and an exit code."""
    warnings.filterwarnings("ignore", message=".*is currently in beta")  # Dagster's own API notes
    try:
        configure_from_env()  # traces over OTLP when QO_OPS_OTLP_ENDPOINT is set
    except QoOpsError as exc:
        typer.echo(f"qo-ops: error: {exc}", err=True)
        return exc.exit_code
    return run_typer_app(app, argv, "qo-ops")


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())
