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
    emit_json,
    print_table,
    ready_engine,
    resolve_requester,
    short_id,
    when_text,
)
from qo_ops.errors import BadInput, one_line

if TYPE_CHECKING:
    from qo_ops.platform.manners import DownstreamCalls
    from qo_ops.platform.runs import RunRow

# The catalog, the platform and SQLAlchemy are imported inside each command (qo_ops.cli_support).

NOTE_FIELD_LIMIT = 100  # characters of one field of a note
SHORT_RUN_ID = re.compile(rf"[0-9a-f][0-9a-f-]{{{SHORT_ID - 1},34}}")  # a UUID's beginning


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
    engine = ready_engine()
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
                    when_text(s.suspended_at),
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
                when_text(r.last_run_at),
                r.last_status or "-",
                when_text(r.last_success_at),
                r.lease_holder or "-",
                "-" if r.backlog is None else r.backlog,
                "-" if r.checkpoint_age_s is None else f"{r.checkpoint_age_s:.0f} s",
            ]
            for r in rows
        ],
    )


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
    from qo_ops.platform.manners import DownstreamCalls
    from qo_ops.platform.runs import list_runs
    from qo_ops.platform.spec import Scope

    spec = get_spec(job)
    if not 1 <= limit <= 1000:
        raise BadInput("--limit must be between 1 and 1000")
    if tenant is not None:
        Scope(tenant)  # validates the id
    engine = ready_engine()
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
                short_id(r.id),
                short_id(r.dagster_run_id),
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
    from qo_ops.platform.status import breaker_status

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
    engine = ready_engine()
    if parsed is None:
        parsed = running_run_by_prefix(engine, run_id.lower())
    status = request_cancel(engine, parsed, resolve_requester(requester), reason)
    if status == "running":
        typer.echo("cancel requested")
    elif status in UNSTARTED_STATUSES:
        typer.echo(f"run was {status}; cancelled before it started")
    else:
        typer.echo(f"run is already {status}; nothing to cancel")


def reap_command(
    job: Annotated[str | None, typer.Argument(help="One job (default: all).")] = None,
) -> None:
    """Mark orphaned `running` runs (no live lease, no heartbeat) as failed/orphaned now."""
    from qo_ops.jobs.catalog import get_spec
    from qo_ops.platform.runs import reap_orphans

    name = get_spec(job).name if job else None
    engine = ready_engine()
    reaped = reap_orphans(engine, name)
    typer.echo(f"reaped {len(reaped)} orphaned run(s)" + "".join(f"\n  {r}" for r in reaped))
