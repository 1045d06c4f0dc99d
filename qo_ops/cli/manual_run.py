"""``qo-ops run``: a manual run of a job over one tenant (and window); its summary printed
as ``key=value`` lines or one JSON object, its exit code saying how the run ended. (Not
``run.py``: ``qo_ops.cli.run`` is the console script's entry point.)"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated

import typer

from qo_ops.cli_support import (
    JsonOpt,
    RequesterOpt,
    emit_json,
    parse_day,
    ready_engine,
    resolve_requester,
)
from qo_ops.errors import BadInput
from qo_ops.platform.job.counts import COLUMNS, REPORTED_ALWAYS
from qo_ops.platform.job.statuses import RunStatus

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from qo_ops.platform.job.scope import Scope
    from qo_ops.platform.job.spec import JobSpec

# The catalog, the runner and SQLAlchemy are imported inside the command (qo_ops.cli_support).

EXIT_BY_STATUS: dict[str, int] = {
    RunStatus.SUCCESS: 0,
    RunStatus.NO_WORK: 0,
    RunStatus.FAILED: 1,
    RunStatus.PARTIAL_SUCCESS: 3,
    RunStatus.SKIPPED: 4,
    RunStatus.TIMEOUT: 5,
    RunStatus.CANCELLED: 6,
}
# The key=value lines of a run's summary: who and what, then the counters every report shows.
SUMMARY_KEYS = (
    *("job_run_id", "job_name", "status", "mode", "scope", "requester", "eligible_count"),
    "mutated_count",
    *(COLUMNS[name] for name in REPORTED_ALWAYS),
    "duration_ms",
)


@contextlib.contextmanager
def _demo_downstream(spec: JobSpec, engine: Engine) -> Iterator[None]:
    """On the embedded demo database with no QO_OPS_DOWNSTREAM_URL, a job that calls the
    downstream calls the local simulator (seeded from the demo data, as `make demo` does),
    and says so on stderr; anywhere else the URL is the operator's to give."""
    if not spec.deployment.calls_downstream:
        yield
        return
    from qo_ops.config import DATABASE_URL_ENV
    from qo_ops.downstream.client import DOWNSTREAM_URL_ENV

    if os.environ.get(DOWNSTREAM_URL_ENV, "").strip() or os.environ.get(DATABASE_URL_ENV, ""):
        yield
        return
    from qo_ops.downstream.local import downstream_for_demo

    with downstream_for_demo(engine) as downstream:
        sys.stderr.write(
            f"{DOWNSTREAM_URL_ENV} is not set: {spec.name} calls the local simulator at "
            f"{downstream.url} (the demo's downstream)\n"
        )
        yield


def _scope(tenant: str, day: str | None, start: str | None, end: str | None) -> Scope:
    from qo_ops.platform.job.scope import Scope

    if day and (start or end):
        raise BadInput("give either --date or --from/--to, not both")
    if day:
        d = parse_day(day, "--date")
        return Scope.days(tenant, d, d)
    if start or end:
        if not (start and end):
            raise BadInput("--from and --to go together")
        first, last = parse_day(start, "--from"), parse_day(end, "--to")
        if last < first:
            raise BadInput("--to must not be before --from")
        return Scope.days(tenant, first, last)  # --to is inclusive
    return Scope(tenant)


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
    approval: Annotated[
        str | None,
        typer.Option(
            help="The approval a destructive job's execute cites (qo-ops approval grant)."
        ),
    ] = None,
    requester: RequesterOpt = None,
    correlation_id: Annotated[
        str | None, typer.Option(help="Ties this run to an incident or ticket.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Run a job by hand over one tenant (and window) and print its summary."""
    from qo_ops.jobs.catalog import get_spec
    from qo_ops.platform.calls.call_stats import DownstreamCalls
    from qo_ops.platform.job.options import RunOptions
    from qo_ops.platform.job.scope import scope_text
    from qo_ops.platform.observability.events import EVENT_LOGGER, configure_event_logging
    from qo_ops.platform.run.runner import run_job

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
        requester=resolve_requester(requester),
        reason=reason,
        approval=approval,
        correlation_id=correlation_id or str(uuid.uuid4()),
        progress_interval_s=1.0 if sys.stderr.isatty() else 10.0,
    ).validated()
    engine = ready_engine()
    if sys.stderr.isatty() and not as_json:
        progress = _TerminalProgress()
        logging.getLogger(EVENT_LOGGER).addHandler(progress)
        logging.getLogger(EVENT_LOGGER).setLevel(logging.INFO)
        logging.getLogger(EVENT_LOGGER).propagate = False
    else:
        configure_event_logging()
    with _demo_downstream(spec, engine):
        summary = run_job(spec, scope, options, engine=engine)
    if sys.stderr.isatty() and not as_json:
        sys.stderr.write("\n")
    if as_json:
        emit_json(summary.as_dict())
    else:
        data = summary.as_dict()
        data["scope"] = scope_text(data["scope"])  # the days it covers, the last included
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
        for row in summary.report:  # the job's own counts (order_reconciliation: by mismatch)
            if row["kind"] == "tally":
                typer.echo(f"tally.{row['name']}={row['count']}")
        for check in summary.checks:
            typer.echo(f"check.{check.name}={'passed' if check.passed else 'FAILED'}")
    raise typer.Exit(EXIT_BY_STATUS[summary.status])
