"""Recovery without database surgery (``qo_ops.platform.actions.recovery``): ``qo-ops requeue`` (a
job's dead letters back to work), ``qo-ops review list|resolve`` (the items jobs flagged for a
person) and ``qo-ops checkpoint show|reset`` (where a checkpointed job's scopes stopped).
Every change needs a reason, is audited in its own transaction, and has ``--dry-run``."""

from __future__ import annotations

import uuid
from datetime import date
from typing import TYPE_CHECKING, Annotated

import typer

from qo_ops.cli_support import (
    JsonOpt,
    RequesterOpt,
    emit_json,
    parse_day,
    plain_app,
    print_table,
    ready_engine,
    resolve_requester,
    short_id,
    when_text,
)
from qo_ops.errors import BadInput

if TYPE_CHECKING:
    from qo_ops.platform.actions.recovery import Outcome, Who

# The catalog, the platform and SQLAlchemy are imported inside each command (qo_ops.cli_support).

ReasonOpt = Annotated[str, typer.Option(help="Why (required; recorded in the audit trail).")]
TenantOpt = Annotated[str, typer.Option(help="The tenant (required).")]
DryRunOpt = Annotated[
    bool, typer.Option("--dry-run", help="Say what would change; change nothing.")
]
FromOpt = Annotated[str | None, typer.Option("--from", help="First day (windowed jobs).")]
ToOpt = Annotated[str | None, typer.Option("--to", help="Last day, included.")]


def _who(requester: str | None, reason: str) -> Who:
    from qo_ops.platform.actions.recovery import Who

    return Who(resolve_requester(requester), reason).validated()


def _days(start: str | None, end: str | None) -> tuple[date | None, date | None]:
    return (
        parse_day(start, "--from") if start is not None else None,
        parse_day(end, "--to") if end is not None else None,
    )


def _say(outcome: Outcome, as_json: bool) -> None:
    if as_json:
        emit_json(outcome.as_dict())
        return
    typer.echo(outcome.summary)
    if outcome.dry_run and outcome.items:
        shown = outcome.items[:20]
        more = len(outcome.items) - len(shown)
        typer.echo("  " + "\n  ".join(shown) + (f"\n  … and {more} more" if more else ""))


def requeue_command(
    job: Annotated[str, typer.Argument(help="The job whose dead letters to requeue.")],
    tenant: TenantOpt = "",
    reason: ReasonOpt = "",
    item: Annotated[
        list[str] | None, typer.Option(help="Only these dead letters, by id (repeatable).")
    ] = None,
    all_dead: Annotated[
        bool, typer.Option("--all-dead", help="Every dead letter of the tenant (up to --limit).")
    ] = False,
    limit: Annotated[int, typer.Option(help="At most this many, oldest first.")] = 1000,
    dry_run: DryRunOpt = False,
    requester: RequesterOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Put a job's dead letters (delivery items, outbox events: what the catalog declares)
    back to work, attempts reset; audited."""
    from qo_ops.jobs.catalog import get_spec
    from qo_ops.platform.actions.recovery import DeadLetters, dead_letter_kind, requeue
    from qo_ops.platform.job.scope import Scope

    spec = get_spec(job)
    dead_letter_kind(spec)
    if not tenant:
        raise BadInput("--tenant is required")
    Scope(tenant)
    if item and all_dead:
        raise BadInput("give either --item or --all-dead, not both")
    if not item and not all_dead:
        raise BadInput("say what to requeue: --item ID (repeatable) or --all-dead")
    who = _who(requester, reason)
    try:
        ids = [uuid.UUID(i) for i in item] if item else None
    except ValueError:
        raise BadInput("--item takes the dead letters' ids (UUIDs)") from None
    engine = ready_engine()
    outcome = requeue(engine, spec, who, DeadLetters(tenant, ids, limit), dry_run=dry_run)
    _say(outcome, as_json)


review_app = plain_app(
    "review", "The items jobs flagged for a person, and deciding them.", no_args_is_help=True
)


@review_app.command("list")
def review_list_command(
    job: Annotated[str | None, typer.Argument(help="One job (default: every job).")] = None,
    tenant: Annotated[str | None, typer.Option(help="One tenant (default: all).")] = None,
    limit: Annotated[int, typer.Option(help="At most this many, oldest flag first.")] = 100,
    as_json: JsonOpt = False,
) -> None:
    """What jobs flagged for a person and why (from their result rows), oldest first."""
    from qo_ops.jobs.catalog import CATALOG, get_spec
    from qo_ops.platform.actions.recovery import review_queue, waiting_for_review

    specs = [get_spec(job)] if job else list(CATALOG.values())
    if job:
        review_queue(specs[0])  # NotOffered (one line, exit 2) for a job that flags nothing
    engine = ready_engine()
    with engine.connect() as conn:
        found = waiting_for_review(conn, specs, tenant, limit)
    if as_json:
        emit_json({"waiting": [{"job_name": name, **item.as_dict()} for name, item in found]})
        return
    if not found:
        typer.echo("nothing is waiting for review")
        return
    offered = {
        name: "|".join(CATALOG[name].recovery.review.actions)  # type: ignore[union-attr]
        for name in {n for n, _ in found}
    }
    print_table(
        f"waiting for review ({len(found)}; decide with: qo-ops review resolve JOB ITEM "
        "--tenant T --action A --reason …)",
        ["job", "tenant", "item", "day", "flagged", "ours", "theirs", "by run", "at", "actions"],
        [
            [
                name,
                i.tenant,
                i.item,
                i.day.isoformat() if i.day else "-",
                i.outcome,
                i.ours or "-",
                i.theirs or "-",
                short_id(i.flagged_by_run),
                when_text(i.flagged_at),
                offered[name],
            ]
            for name, i in found
        ],
        notes=[f"{i.kind}: {i.detail}" if i.detail else i.kind for _, i in found],
    )


@review_app.command("resolve")
def review_resolve_command(
    job: Annotated[str, typer.Argument(help="The job that flagged the item.")],
    item: Annotated[str, typer.Argument(help="The item, as review list shows it.")],
    action: Annotated[str, typer.Option(help="What to do: one the job offers (review list).")],
    tenant: TenantOpt = "",
    reason: ReasonOpt = "",
    dry_run: DryRunOpt = False,
    requester: RequesterOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Decide one flagged item with an action its job offers, under its scope's lease, in
    one audited transaction; refused while a run holds the scope."""
    from qo_ops.jobs.catalog import get_spec
    from qo_ops.platform.actions.recovery import Decision, resolve, review_action
    from qo_ops.platform.job.scope import Scope

    spec = get_spec(job)
    review_action(spec, action)
    if not tenant:
        raise BadInput("--tenant is required")
    Scope(tenant)
    who = _who(requester, reason)
    engine = ready_engine()
    outcome = resolve(engine, spec, who, Decision(tenant, item, action), dry_run=dry_run)
    _say(outcome, as_json)


checkpoint_app = plain_app(
    "checkpoint",
    "Where a checkpointed job's scopes stopped, and forgetting it.",
    no_args_is_help=True,
)


@checkpoint_app.command("show")
def checkpoint_show_command(
    job: Annotated[str, typer.Argument(help="A job that keeps checkpoints.")],
    tenant: TenantOpt = "",
    start: FromOpt = None,
    end: ToOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The tenant's checkpoints of JOB (within --from/--to), and whether a run holds each."""
    from qo_ops.jobs.catalog import get_spec
    from qo_ops.platform.actions.recovery import Checkpoints, checkpoint_days, checkpoints
    from qo_ops.platform.job.scope import scope_text

    spec = get_spec(job)
    if not tenant:
        raise BadInput("--tenant is required")
    which = Checkpoints(tenant, *_days(start, end))
    checkpoint_days(spec, which)
    engine = ready_engine()
    with engine.connect() as conn:
        rows = checkpoints(conn, spec, which)
    if as_json:
        emit_json({"checkpoints": [r.as_dict() for r in rows]})
        return
    if not rows:
        typer.echo(
            f"no checkpoint of {spec.name} for {tenant}: its next runs start from the beginning"
        )
        return
    print_table(
        f"checkpoints of {spec.name} for {tenant} (forget with: qo-ops checkpoint reset)",
        ["scope", "saved", "by run", "run holds it", "cursor"],
        [
            [
                scope_text(r.scope),
                when_text(r.updated_at),
                short_id(r.job_run_id),
                "yes" if r.held else "no",
                ", ".join(f"{k}={v}" for k, v in sorted(r.cursor.items())),
            ]
            for r in rows
        ],
    )


@checkpoint_app.command("reset")
def checkpoint_reset_command(
    job: Annotated[str, typer.Argument(help="A job that keeps checkpoints.")],
    tenant: TenantOpt = "",
    start: FromOpt = None,
    end: ToOpt = None,
    reason: ReasonOpt = "",
    dry_run: DryRunOpt = False,
    requester: RequesterOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Forget the tenant's checkpoints of JOB (within --from/--to): the next run of each scope
    starts from the beginning. Refused while a run holds one of them; audited."""
    from qo_ops.jobs.catalog import get_spec
    from qo_ops.platform.actions.recovery import Checkpoints, checkpoint_days, reset_checkpoints

    spec = get_spec(job)
    if not tenant:
        raise BadInput("--tenant is required")
    which = Checkpoints(tenant, *_days(start, end))
    checkpoint_days(spec, which)
    who = _who(requester, reason)
    engine = ready_engine()
    outcome = reset_checkpoints(engine, spec, who, which, dry_run=dry_run)
    _say(outcome, as_json)
