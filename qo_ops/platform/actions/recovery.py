"""Recovery without database surgery.

This module holds what an operator does after a job has stopped short of done. The same code
path serves the commands (``qo-ops requeue``, ``review``, ``checkpoint``) and the API actions.

- **Dead letters back to work** (:func:`requeue`). A job declares how its dead letters are
  requeued in ``JobSpec.recovery.requeue``, a :class:`DeadLetterKind`.
- **The manual-review queue** (:func:`waiting_for_review`, :func:`resolve`). A job that flags
  items for a person declares how they are listed and which actions it offers, in
  ``JobSpec.recovery.review``, a :class:`Review`. An action runs in one transaction behind the
  lease's guard, as the job's own writes do.
- **Checkpoints** (:func:`checkpoints`, :func:`reset_checkpoints`). A reset forgets where a
  checkpointed job's scopes stopped, so their next run starts from the beginning.

Every change follows the same rules. It validates its input first. It takes the lease of each
scope it touches. While a run holds one of them, it is refused with :class:`ScopeBusy` and
changes nothing. It writes its ``job_audit`` row in the same transaction as the change. It is
idempotent, so a second call finds nothing left to change. It has a dry run that says what it
would change and writes nothing.

This is plain Python over SQLAlchemy, without Dagster.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import date, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from qo_ops.db.audit import AuditEntry, append_audit
from qo_ops.errors import BadInput, QoOpsError, first_few
from qo_ops.platform.job.options import MAX_TEXT
from qo_ops.platform.job.review import DeadLetterKind, Review, ReviewAction, ReviewItem
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.run import lease as leases

MAX_REQUEUE = 100_000
MAX_LISTED = 1000
ACTION_LEASE_TTL_S = 30.0  # an action holds its scope's lease for one short transaction
LEASE_WAIT_S = 5.0  # an action waits this long for a run to give its scope back
CHECKPOINT_RESET = "checkpoint_reset"  # job_checkpoint_resets_total counts this audit action


class NotOffered(BadInput):
    """The job offers no such recovery.

    It keeps no dead letters, flags nothing, or keeps no checkpoint."""


class ScopeBusy(QoOpsError):
    """A run holds the lease of a scope that the action would change. Nothing was changed."""

    exit_code = 4  # like a run skipped because its lease is held


@dataclass(frozen=True)
class Who:
    """Who asks for a recovery action, and why. The API adds where the request came from."""

    actor: str
    reason: str
    request_id: str | None = None
    client_address: str | None = None

    def validated(self) -> Who:
        if not self.reason.strip() or len(self.reason) > MAX_TEXT:
            raise BadInput(f"a reason is required (1 to {MAX_TEXT} characters; it is audited)")
        if not self.actor.strip() or len(self.actor) > MAX_TEXT:
            raise BadInput(f"the requester must be 1 to {MAX_TEXT} characters")
        return self

    def audit(self, conn: Connection, **entry: Any) -> None:
        append_audit(
            conn,
            AuditEntry(
                actor=self.actor,
                reason=self.reason,
                request_id=self.request_id,
                client_address=self.client_address,
                **entry,
            ),
        )


@dataclass
class Outcome:
    """What a recovery action changed, or would change on a ``dry_run``.

    ``items`` are ids, order numbers or checkpoint scopes, never personal data."""

    action: str
    job_name: str
    tenant: str
    dry_run: bool
    items: list[str] = field(default_factory=list)
    summary: str = ""

    @property
    def changed(self) -> int:
        return 0 if self.dry_run else len(self.items)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "changed": self.changed}


# --------------------------------------------------------------------------- dead letters


def dead_letter_kind(spec: JobSpec) -> DeadLetterKind:
    if spec.recovery.requeue is None:
        raise NotOffered(f"{spec.name} keeps no dead letters to requeue")
    return spec.recovery.requeue


@dataclass(frozen=True)
class DeadLetters:
    """Which dead letters of a tenant to requeue: those named in ``ids``, or all of them.

    At most ``limit`` are taken."""

    tenant: str
    ids: Sequence[uuid.UUID] | None = None
    limit: int = 1000


def requeue(
    engine: Engine, spec: JobSpec, who: Who, which: DeadLetters, *, dry_run: bool = False
) -> Outcome:
    """Put ``which`` dead letters of ``spec`` back to work, oldest first, under the tenant's
    lease.

    While a run holds the lease, this is refused with :class:`ScopeBusy`. One audit row, in
    the same transaction, says who, why and how many. A dry run lists what would move and
    writes nothing."""
    kind = dead_letter_kind(spec)
    tenant, ids, limit = which.tenant, which.ids, which.limit
    Scope(tenant)
    who.validated()
    if not 1 <= limit <= MAX_REQUEUE:
        raise BadInput(f"the limit must be between 1 and {MAX_REQUEUE}")
    params = {"tenant": tenant, "ids": list(ids) if ids else None, "limit": limit}
    if dry_run:
        with engine.connect() as conn:
            moved = [str(i) for i in conn.execute(kind.pending, params).scalars()]
        return Outcome(
            "requeue",
            spec.name,
            tenant,
            True,
            moved,
            f"would requeue {len(moved)} dead-lettered {kind.noun}(s) of {tenant}",
        )
    action_id = uuid.uuid4()
    with _held(engine, spec, [Scope(tenant)], action_id) as held, engine.begin() as conn:
        for lease in held:
            lease.guard(conn)
        moved = [str(i) for i in conn.execute(kind.requeue, params).scalars()]
        who.audit(
            conn,
            action="requeue",
            job_name=spec.name,
            scope=tenant,
            mode="execute",
            decision=f"requeued {len(moved)}",
            details={
                "kind": kind.noun,
                "requested_ids": len(ids or []),
                "limit": limit,
                "requeued": len(moved),
            },
        )
    return Outcome(
        "requeue",
        spec.name,
        tenant,
        False,
        moved,
        f"requeued {len(moved)} dead-lettered {kind.noun}(s) of {tenant}",
    )


# --------------------------------------------------------------------------- manual review


def review_queue(spec: JobSpec) -> Review:
    """The job's review queue, or :class:`NotOffered`."""
    if spec.recovery.review is None:
        raise NotOffered(f"{spec.name} flags nothing for manual review")
    return spec.recovery.review


def review_action(spec: JobSpec, action: str) -> tuple[Review, ReviewAction]:
    """The job's review queue and the named action.

    An unknown action raises :class:`BadInput`, which names the actions the job offers."""
    review = review_queue(spec)
    if action not in review.actions:
        raise BadInput(f"{spec.name} offers --action {'|'.join(review.actions)}, not {action!r}")
    return review, review.actions[action]


def waiting_for_review(
    conn: Connection, specs: Sequence[JobSpec], tenant: str | None = None, limit: int = 100
) -> list[tuple[str, ReviewItem]]:
    """The items waiting for a person, as (job name, item) pairs, oldest flag first.

    Only the jobs of ``specs`` that have a review queue are listed."""
    if tenant is not None:
        Scope(tenant)
    if not 1 <= limit <= MAX_LISTED:
        raise BadInput(f"the limit must be between 1 and {MAX_LISTED}")
    found: list[tuple[str, ReviewItem]] = []
    for spec in specs:
        if spec.recovery.review is None:
            continue
        rows = conn.execute(
            spec.recovery.review.waiting, {"tenant": tenant, "item": None, "limit": limit}
        ).mappings()
        found += [(spec.name, ReviewItem(**row)) for row in rows]
    return found[:limit]


def _find(conn: Connection, review: Review, tenant: str, item: str) -> ReviewItem | None:
    row = (
        conn.execute(review.waiting, {"tenant": tenant, "item": item, "limit": 1})
        .mappings()
        .first()
    )
    return ReviewItem(**row) if row else None


@dataclass(frozen=True)
class Decision:
    """A person's decision on one flagged ``item`` of ``tenant``.

    ``action`` is one of the actions the item's job offers."""

    tenant: str
    item: str
    action: str


def resolve(
    engine: Engine, spec: JobSpec, who: Who, decision: Decision, *, dry_run: bool = False
) -> Outcome:
    """Apply the decision's action to its flagged item.

    The action runs under the lease of the item's scope, in one transaction behind the
    lease's guard, and writes its audit row there. While a run holds the lease, it is refused
    with :class:`ScopeBusy`. An item that is no longer waiting changes nothing."""
    tenant, item, action = decision.tenant, decision.item, decision.action
    review, chosen = review_action(spec, action)
    Scope(tenant)
    if not item.strip() or len(item) > MAX_TEXT:
        raise BadInput("name the item to resolve (e.g. the order number)")
    who.validated()
    with engine.connect() as conn:
        found = _find(conn, review, tenant, item)
    if found is None:
        return _not_waiting(spec, tenant, item)
    plan = chosen.describe(found)  # BadInput when the action does not apply to it
    if dry_run:
        return Outcome("resolve", spec.name, tenant, True, [item], f"would {action} {item}: {plan}")
    action_id = uuid.uuid4()
    with _held(engine, spec, [found.scope()], action_id) as held, engine.begin() as conn:
        for lease in held:
            lease.guard(conn)
        did = chosen.apply(conn, found, action_id)  # None if someone resolved it since the read
        who.audit(
            conn,
            action=f"review_{action}",
            job_name=spec.name,
            scope=found.scope().key,
            mode="execute",
            decision=did or "nothing to resolve",
            details={
                "item": item,
                "flagged": found.outcome,
                "kind": found.kind,
                "action_id": str(action_id),
            },
        )
    if did is None:
        return _not_waiting(spec, tenant, item)
    return Outcome("resolve", spec.name, tenant, False, [item], f"{action} {item}: {did}")


def _not_waiting(spec: JobSpec, tenant: str, item: str) -> Outcome:
    return Outcome(
        "resolve",
        spec.name,
        tenant,
        False,
        [],
        f"{item} is not waiting for review; nothing changed",
    )


# --------------------------------------------------------------------------- leases


class _held:
    """The leases of ``scopes`` for one recovery action, taken before it writes and released
    after.

    It raises :class:`ScopeBusy` when a run holds one of these scopes. It also raises when a
    run holds a scope of the same tenant whose window overlaps one of them, because a run
    over a range holds one lease for all its days."""

    def __init__(
        self, engine: Engine, spec: JobSpec, scopes: Sequence[Scope], action_id: uuid.UUID
    ) -> None:
        self.engine, self.spec, self.scopes, self.action_id = engine, spec, scopes, action_id
        self.leases: list[leases.Lease] = []

    def __enter__(self) -> list[leases.Lease]:
        deadline = time.monotonic() + LEASE_WAIT_S  # a run's short batch may be ending
        while busy := self._busy_scopes():
            if time.monotonic() >= deadline:
                self._busy(busy)
            time.sleep(0.5)  # this polls the leases for a condition; it is not a timed wait
        owner = f"recovery:{self.action_id}"
        for scope in self.scopes:
            lease = leases.acquire(
                self.engine, self.spec.name, scope.key, owner, ACTION_LEASE_TTL_S, self.action_id
            )
            if lease is None:
                self.__exit__()
                self._busy([scope.key])
            self.leases.append(lease)  # type: ignore[arg-type]  # None has raised above
        return self.leases

    def _busy_scopes(self) -> list[str]:
        with self.engine.connect() as conn:
            held = leases.held_scopes(conn, self.spec.name)
        return sorted(h for h in held if any(_overlaps(h, s) for s in self.scopes))

    def _busy(self, keys: list[str]) -> None:
        raise ScopeBusy(
            f"a run of {self.spec.name} holds {first_few(keys, 3)}: nothing changed; "
            "wait for it to finish (qo-ops status) or cancel it, then try again"
        )

    def __exit__(self, *_: object) -> None:
        for lease in self.leases:
            lease.release(self.engine)
        self.leases = []


def _overlaps(key: str, scope: Scope) -> bool:
    held = Scope.parse(key)
    if held.tenant_id != scope.tenant_id:
        return False
    if held.window_start is None or held.window_end is None:
        return True
    if scope.window_start is None or scope.window_end is None:
        return True
    return held.window_start < scope.window_end and scope.window_start < held.window_end


# --------------------------------------------------------------------------- checkpoints


@dataclass(frozen=True)
class CheckpointRow:
    """A scope's checkpoint: where the scope's next run starts."""

    scope: str
    cursor: dict[str, Any]
    updated_at: datetime
    job_run_id: str | None
    held: bool  # whether a run holds the scope's lease now

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "updated_at": self.updated_at.isoformat()}


# Read a job's checkpoints for a tenant: the tenant's own scope and its windows.
_CHECKPOINTS = sa.text(
    """
    SELECT c.scope, c.cursor, c.updated_at, CAST(c.job_run_id AS text) AS job_run_id,
           coalesce(l.expires_at > clock_timestamp(), false) AS held
      FROM job_checkpoint c
      LEFT JOIN job_lease l ON l.job_name = c.job_name AND l.scope = c.scope
     WHERE c.job_name = :job AND (c.scope = :tenant OR c.scope LIKE :tenant || '/%')
     ORDER BY c.scope
    """
)
# Forget one checkpoint. The reset holds the lease of its scope, and the lease's guard
# checks it.
# Twice: the second delete finds no row and changes nothing.
_FORGET = sa.text("DELETE FROM job_checkpoint WHERE job_name = :job AND scope = :scope")


@dataclass(frozen=True)
class Checkpoints:
    """Which checkpoints of a tenant: all, or those whose window lies within
    ``first``..``last``.

    Both days are included. The days apply to windowed jobs only."""

    tenant: str
    first: date | None = None
    last: date | None = None


def checkpoint_days(spec: JobSpec, which: Checkpoints) -> tuple[date, date] | None:
    """Check a checkpoint request before anything is read.

    The job must keep checkpoints and the tenant must be well formed. Days may be given
    only for a windowed job, and then both or neither."""
    tenant, first, last = which.tenant, which.first, which.last
    if spec.batching.checkpoint is None:
        raise NotOffered(f"{spec.name} keeps no checkpoint")
    Scope(tenant)
    if first is None and last is None:
        return None
    if spec.partitioning != "tenant_day":
        raise BadInput(f"{spec.name} keeps one checkpoint per tenant: --from/--to do not apply")
    if first is None or last is None:
        raise BadInput("give both --from and --to (days, both included), or neither")
    if last < first:
        raise BadInput("--to must not be before --from")
    Scope.days("t", first, last)  # the days lie on the calendar we accept
    return first, last


def checkpoints(conn: Connection, spec: JobSpec, which: Checkpoints) -> list[CheckpointRow]:
    """List ``which`` checkpoints of ``spec``, and whether a run holds each."""
    days = checkpoint_days(spec, which)
    tenant = which.tenant
    rows = [
        CheckpointRow(**row)
        for row in conn.execute(_CHECKPOINTS, {"job": spec.name, "tenant": tenant}).mappings()
    ]
    if days is None:
        return rows
    start, end = days[0], days[1] + timedelta(days=1)
    return [r for r in rows if _within(Scope.parse(r.scope), start, end)]


def reset_checkpoints(
    engine: Engine, spec: JobSpec, who: Who, which: Checkpoints, *, dry_run: bool = False
) -> Outcome:
    """Forget ``which`` checkpoints of ``spec``, so their scopes' next runs start from the
    beginning.

    While a run holds one of those scopes, this is refused with :class:`ScopeBusy` and
    changes nothing. Otherwise every checkpoint goes in one transaction behind the scopes'
    leases, with one audit row. The exporter counts that row as
    ``job_checkpoint_resets_total{reason="operator"}``."""
    who.validated()
    tenant, first, last = which.tenant, which.first, which.last
    with engine.connect() as conn:
        found = checkpoints(conn, spec, which)
    keys = [r.scope for r in found]
    if dry_run or not keys:
        verb = "would forget" if dry_run else "forgot"
        return Outcome(
            CHECKPOINT_RESET,
            spec.name,
            tenant,
            dry_run,
            keys,
            f"{verb} {len(keys)} checkpoint(s) of {spec.name} for {tenant}",
        )
    action_id = uuid.uuid4()
    scopes = [Scope.parse(k) for k in keys]
    with _held(engine, spec, scopes, action_id) as held, engine.begin() as conn:
        gone: list[str] = []
        for lease in held:
            lease.guard(conn)
            if conn.execute(_FORGET, {"job": spec.name, "scope": lease.scope}).rowcount:
                gone.append(lease.scope)
        who.audit(
            conn,
            action=CHECKPOINT_RESET,
            job_name=spec.name,
            scope=tenant,
            mode="execute",
            decision=f"forgot {len(gone)}",
            details={
                "scopes": gone[:100],
                "reset": len(gone),
                "from": first.isoformat() if first else None,
                "to": last.isoformat() if last else None,
                "cursors": {r.scope: r.cursor for r in found if r.scope in gone[:100]},
            },
        )
    return Outcome(
        CHECKPOINT_RESET,
        spec.name,
        tenant,
        False,
        gone,
        f"forgot {len(gone)} checkpoint(s) of {spec.name} for {tenant}; the next run of each scope starts from the beginning",
    )


def _within(scope: Scope, start: date, end: date) -> bool:
    """Whether ``scope`` is a window inside [``start``, ``end``)."""
    if scope.window_start is None or scope.window_end is None:
        return False
    return start <= scope.window_start and scope.window_end <= end
