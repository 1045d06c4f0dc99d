"""What runs did and do: ``qo-ops status`` (per job and tenant), ``qo-ops runs`` (a job's
history), ``qo-ops downstream-status`` (the shared circuit breaker); and the two commands
that end runs: ``qo-ops cancel`` (a running one) and ``qo-ops reap`` (orphaned ones)."""

from __future__ import annotations

import dataclasses
import re
import uuid
from datetime import UTC
from typing import TYPE_CHECKING, Annotated, Any

import typer

from qo_ops.cli_support import (
    SHORT_ID,
    JsonOpt,
    RequesterOpt,
    age_text,
    emit_json,
    parse_duration,
    print_table,
    ready_engine,
    resolve_requester,
    short_id,
    when_text,
)
from qo_ops.errors import BadInput, one_line

if TYPE_CHECKING:
    from qo_ops.platform.calls.call_stats import DownstreamCalls
    from qo_ops.platform.run.records import RunRow

# The catalog, the platform and SQLAlchemy are imported inside each command (qo_ops.cli_support).

OLD_CODE = "before 0018"  # a run recorded before runs named the code that ran them
NOTE_FIELD_LIMIT = 100  # characters of one field of a note
SHORT_RUN_ID = re.compile(rf"[0-9a-f][0-9a-f-]{{{SHORT_ID - 1},34}}")  # a UUID's beginning


def status_command(
    job: Annotated[str | None, typer.Argument(help="One job (default: all).")] = None,
    tenant: Annotated[str | None, typer.Option(help="One tenant (default: all).")] = None,
    failing: Annotated[
        bool, typer.Option("--failing", help="Only tenants whose last run failed.")
    ] = False,
    stale: Annotated[
        bool, typer.Option("--stale", help="Only tenants with no recent successful execute.")
    ] = False,
    show_all: Annotated[
        bool, typer.Option("--all", help="Every tenant's row, healthy ones too.")
    ] = False,
    limit: Annotated[int, typer.Option(help="At most this many rows (text).")] = 50,
    as_json: JsonOpt = False,
) -> None:
    """A summary per job (tenants failing, stale, never run, running, suspended), then the
    tenants that need a look (failing, stale, running or held; --all: every one) with their last
    run, its mode and status, last success, lease holder and backlog; what is suspended; a
    downstream breaker that is not closed."""
    from qo_ops.jobs.catalog import CATALOG, get_spec
    from qo_ops.platform.actions.control import suspensions
    from qo_ops.platform.actions.status import breaker_status, job_status, summarize, with_backlog
    from qo_ops.platform.job.scope import Scope, scope_text
    from qo_ops.platform.schedule.tenants import chunk_of, tenant_exists

    specs = [get_spec(job)] if job else list(CATALOG.values())
    if not 1 <= limit <= 10_000:
        raise BadInput("--limit must be between 1 and 10000")
    if tenant is not None:
        Scope(tenant)  # validates the id
    engine = ready_engine()
    with engine.connect() as conn:
        if tenant is not None and not tenant_exists(conn, tenant):
            raise BadInput(f"unknown tenant {tenant}")
        # the windowed jobs' partition a tenant is in: <day>|<its chunk>
        chunk = chunk_of(conn, tenant) if tenant is not None else None
        held = suspensions(conn, job, tenant)
        not_closed = [b for b in breaker_status(conn) if b.state != "closed"]
    one = tenant is not None  # a tenant's rows: every job's, backlog counted
    # backlog: a tenant's; with --json every tenant's when a job has few (job_status's
    # rule); in text, the rows on screen only (below)
    counted = [tenant] if tenant is not None else (None if as_json else ())
    by_job = {s.name: job_status(engine, s, tenant, backlog_of=counted) for s in specs}
    summary = [
        summarize(name, rows, sum(1 for h in held if h.job_name == name))
        for name, rows in by_job.items()
    ]

    def wanted(r: Any) -> bool:
        if failing or stale:
            return (failing and r.failing) or (stale and r.stale)
        return one or show_all or as_json or r.attention  # --json: every row

    chosen = [r for rows in by_job.values() for r in rows if wanted(r)]
    if as_json:
        emit_json(
            {
                **({"tenant_chunk": chunk} if chunk else {}),
                "summary": [s.as_dict() for s in summary],
                "status": [r.as_dict() for r in chosen],
                "suspended": [s.as_dict() for s in held],
                "breakers_not_closed": [b.as_dict() for b in not_closed],
            }
        )
        return
    shown = chosen[:limit]
    shown = [  # the backlog of the rows on screen (one capped count each)
        r
        for spec in specs
        for r in with_backlog(
            engine,
            spec,
            [r for r in shown if r.job_name == spec.name],
            [r.scope for r in shown if r.job_name == spec.name and r.backlog is None],
        )
    ]
    for b in not_closed:  # every job that calls it waits: say so before the table
        typer.echo(
            f"downstream {b.downstream}: circuit breaker {b.state} for {b.open_s:.0f} s "
            f"({b.reason or 'no reason'}); runs hold their calls: qo-ops downstream-status"
        )
    print_table(
        "summary" + (f" of {tenant} (windowed jobs: tenant chunk {chunk})" if one else ""),
        ["job", "tenants", "failing", "stale", "never run", "running", "suspended"],
        [
            [s.job_name, s.tenants, s.failing, s.stale, s.never_run, s.running, s.suspended]
            for s in summary
        ],
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
                    when_text(s.suspended_at),
                    s.reason,
                ]
                for s in held
            ],
        )
    what = (
        " and ".join(w for w, on in (("failing", failing), ("stale", stale)) if on)
        if failing or stale
        else (
            f"of {tenant}"
            if one
            else "every tenant"
            if show_all
            else "needing a look: failing, stale, running or held"
        )
    )
    if not chosen:
        typer.echo(f"no tenant {what}" if failing or stale else f"job status: no tenant {what}")
        return
    print_table(
        f"job status ({what})",
        [
            "job",
            "tenant",
            "last run",
            "mode",
            "status",
            "last success",
            "stale",
            "lease holder",
            "backlog",
            "checkpoint age",
            "code",
        ],
        [
            [
                r.job_name,
                scope_text(r.scope),
                when_text(r.last_run_at),
                (r.last_mode or "-").replace("_", "-"),
                (r.last_status or "-") + (" (running)" if r.running else ""),
                when_text(r.last_success_at),
                "STALE" if r.stale else "-",
                r.lease_holder or "-",
                "-" if r.backlog is None else r.backlog,
                "-" if r.checkpoint_age_s is None else age_text(r.checkpoint_age_s),
                r.last_code or ("-" if r.last_run_at is None else OLD_CODE),
            ]
            for r in shown
        ],
    )
    if len(chosen) > len(shown):
        typer.echo(f"{len(chosen) - len(shown):,} more rows: --limit N, or --json for all")


def runs_command(
    job: Annotated[str | None, typer.Argument(help="Job name (default: every job).")] = None,
    tenant: Annotated[
        str | None, typer.Option(help="One tenant (its windows too, for windowed jobs).")
    ] = None,
    since: Annotated[
        str | None, typer.Option(help="Only runs asked for in the last 30m, 1h, 2d …")
    ] = None,
    limit: Annotated[int, typer.Option(help="How many runs, newest first.")] = 20,
    as_json: JsonOpt = False,
) -> None:
    """Run history, newest first — of one job, or of every job ("what ran in the last
    hour?": qo-ops runs --since 1h): ids in short (`qo-ops cancel` takes a running run's),
    why each ended as it did and the reason it was asked for; --json has every field."""
    from qo_ops.jobs.catalog import get_spec
    from qo_ops.platform.calls.call_stats import DownstreamCalls
    from qo_ops.platform.job.scope import Scope, scope_text
    from qo_ops.platform.run.records import list_runs

    spec = get_spec(job) if job is not None else None
    if not 1 <= limit <= 1000:
        raise BadInput("--limit must be between 1 and 1000")
    if tenant is not None:
        Scope(tenant)  # validates the id
    since_s = parse_duration(since, "--since") if since is not None else None
    engine = ready_engine()
    history = list_runs(engine, spec.name if spec else None, tenant, limit, since_s)
    if as_json:
        emit_json({"runs": [dataclasses.asdict(r) for r in history]})
        return
    calls = [DownstreamCalls.from_tally(r.tally) for r in history]
    headers = ["run", "dagster", *([] if spec else ["job"]), "scope", "started", "mode"]
    headers += ["trigger", "status", "eligible", "processed", "failed"]
    if any(calls):  # a job that calls the downstream: how its runs treated it
        headers += ["calls", "retry pressure"]
    title = f"runs of {spec.name}" if spec else "runs of every job"
    if since is not None:
        title += f" asked for in the last {since}"
    if not history:
        typer.echo(f"{title}: none")
        return
    print_table(
        title,
        headers,
        [
            [
                short_id(r.id),
                short_id(r.dagster_run_id),
                *([] if spec else [r.job_name]),
                scope_text(r.scope),
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


def _calls_cells(calls: DownstreamCalls | None) -> list[Any]:
    """A run's calls and retry pressure (retries / calls); its breaker transitions are in
    its note."""
    if calls is None:
        return ["-", "-"]
    pressure = calls.retry_pressure
    return [calls.calls, "-" if pressure is None else f"{pressure * 100:.1f} %"]


def downstream_status_command(as_json: JsonOpt = False) -> None:
    """The downstream's circuit breaker as the runs share it: state, since when and why,
    when the next run probes it. Read-only."""
    from qo_ops.platform.actions.status import breaker_status

    engine = ready_engine()
    with engine.connect() as conn:
        rows = breaker_status(conn)
    if as_json:
        emit_json({"breakers": [r.as_dict() for r in rows]})
        return
    if not rows:
        typer.echo("no breaker recorded: no run has called a downstream yet")
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
            "evidence",
            "by run",
        ],
        [
            [
                r.downstream,
                r.state,
                when_text(r.opened_at) if r.state != "closed" else "-",
                f"{r.open_s:.0f} s" if r.state != "closed" else "-",
                _probe_text(r.state, r.probe_in_s),
                r.opened_count,
                r.reason or "-",
                r.evidence_text(),
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


def cancel_command(
    run_id: Annotated[
        str, typer.Argument(help="The job_run id to stop (of a running run: its short id too).")
    ],
    reason: Annotated[str, typer.Option(help="Why (recorded in the audit trail).")],
    requester: RequesterOpt = None,
) -> None:
    """Ask a running run to stop after its current batch (it ends `cancelled`)."""
    from qo_ops.platform.job.statuses import UNSTARTED, RunStatus
    from qo_ops.platform.run.records import request_cancel, running_run_by_prefix

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
    engine = ready_engine()
    if parsed is None:
        parsed = running_run_by_prefix(engine, run_id.lower())
    status = request_cancel(engine, parsed, resolve_requester(requester), reason)
    if status == RunStatus.RUNNING:
        typer.echo("cancel requested")
    elif status in UNSTARTED:
        typer.echo(f"run was {status}; cancelled before it started")
    else:
        typer.echo(f"run is already {status}; nothing to cancel")


def reap_command(
    job: Annotated[str | None, typer.Argument(help="One job (default: all).")] = None,
) -> None:
    """Mark orphaned `running` runs (no live lease, no heartbeat) as failed/orphaned now."""
    from qo_ops.jobs.catalog import get_spec
    from qo_ops.platform.run.records import reap_orphans

    name = get_spec(job).name if job else None
    engine = ready_engine()
    reaped = reap_orphans(engine, name)
    typer.echo(f"reaped {len(reaped)} orphaned run(s)" + "".join(f"\n  {r}" for r in reaped))
