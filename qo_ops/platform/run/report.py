"""A run's report: the rows that say what it did, beyond its status. They appear as
``RunSummary.report``, the CLI's table and Dagster's ``report`` metadata."""

from __future__ import annotations

from dataclasses import asdict

from sqlalchemy.engine import Connection

from qo_ops.platform.calls.call_stats import is_manners_key, manners_rows
from qo_ops.platform.job.labels import ITEM_RETRY_EXHAUSTED, ITEM_RETRY_PREFIX
from qo_ops.platform.job.outcome import BatchContext, ReportRow, RunSummary
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.run import checkpoint
from qo_ops.platform.run.selection import count_eligible

REPORT_SAMPLE = 20  # sample rows of a dry run's report


def add_report(conn: Connection, spec: JobSpec, ctx: BatchContext, summary: RunSummary) -> None:
    """Put on the summary what the run left behind (its backlog, its checkpoint, the dead
    letters) and its report rows."""
    if spec.batching.checkpoint is not None:
        saved = checkpoint.saved(conn, spec.name, ctx.scope.key)
        if saved is not None:
            summary.checkpoint_after = checkpoint.as_text(saved.cursor)
            summary.checkpoint_age_s = saved.age_s
    elif (
        not spec.batching.dry_run_scans
    ):  # the selection is of what is due, so what is still due is backlog
        summary.backlog = _backlog(conn, spec, ctx, summary)
    if spec.signals.dead_letters is not None:
        summary.dead_letters = spec.signals.dead_letters(conn)
    summary.report = [asdict(row) for row in build_report(conn, spec, ctx, summary)]


def _backlog(conn: Connection, spec: JobSpec, ctx: BatchContext, summary: RunSummary) -> int:
    """What the selection still matches. That is a dry run's count, or a check's count of
    the same selection (``OutcomeCheck.backlog``), or else a count made now."""
    if ctx.mode == "dry_run":
        return summary.eligible_count
    counted = [c.backlog for c in summary.checks if c.backlog is not None]
    if counted:
        return counted[0]
    fresh = BatchContext(
        spec.name, ctx.scope, ctx.mode, ctx.job_run_id, limits=ctx.limits, settings=ctx.settings
    )
    return count_eligible(conn, spec, fresh)


def build_report(
    conn: Connection, spec: JobSpec, ctx: BatchContext, summary: RunSummary
) -> list[ReportRow]:
    """The run's report table. It has a dry run's sample with the change execute would
    make, the counters, the job's own tallies and rows, its calls to the downstream (retry
    pressure, rate limiting, breaker), and the checks."""
    rows: list[ReportRow] = []
    change = spec.presentation.change or "changed"
    if summary.mode == "dry_run":
        rows.append(ReportRow("would_change", change, summary.eligible_count))
        rows += [ReportRow("sample", i, 1, change) for i in summary.sample_ids[:REPORT_SAMPLE]]
    else:
        rows += [
            ReportRow("items", k, v, change if k == "succeeded" else "")
            for k, v in summary.counts.report_items().items()
        ]
    for key, value in sorted(summary.tally.items()):
        if not is_manners_key(key):
            rows.append(_tally_row(key, value))
    rows += manners_rows(summary.tally, summary.error_code, summary.status_reason)
    if spec.signals.report is not None:
        rows += spec.signals.report(conn, ctx)
    words = ("met now", "not met now") if summary.mode == "dry_run" else ("passed", "FAILED")
    rows += [
        ReportRow("check", c.name, int(c.passed), words[0] if c.passed else words[1])
        for c in summary.checks
    ]
    return rows


def _tally_row(key: str, value: int) -> ReportRow:
    """A tally counter as a report row.

    ``outcome.<class>.attempt_<n>.<state>`` counts calls to another system. It becomes an
    outcome row by error class and attempt. Side-effect counts become a row per side effect
    and result, or per ambiguity reason."""
    parts = key.split(".")
    if len(parts) == 4 and parts[0] == "outcome" and parts[2].startswith("attempt_"):
        attempt = parts[2].removeprefix("attempt_")
        return ReportRow("outcome", parts[1], value, f"attempt {attempt} → {parts[3]}")
    if len(parts) == 3 and parts[0] == "side_effect":
        return ReportRow("side_effect", parts[1], value, parts[2])
    if len(parts) == 2 and parts[0] == "side_effect_ambiguity":
        return ReportRow("side_effect_ambiguity", parts[1], value)
    if key.startswith(ITEM_RETRY_PREFIX):
        return ReportRow(
            "retry", key.removeprefix(ITEM_RETRY_PREFIX), value, "item retry scheduled"
        )
    if key == ITEM_RETRY_EXHAUSTED:
        return ReportRow("retry_exhausted", "item", value, "dead-lettered after its last attempt")
    return ReportRow("tally", key, value)
