"""How a job hands work back to a person: its dead letters (``DeadLetterKind``) and its
manual-review queue (``Review``), declared beside the job; ``qo_ops.platform.actions.recovery``
acts on them."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import date, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.platform.job.scope import Scope


@dataclass(frozen=True)
class DeadLetterKind:
    """How a job's dead letters go back to work. Both statements take ``:tenant``, ``:ids``
    (a ``uuid[]``, or NULL for every dead letter of the tenant) and ``:limit``, oldest first:
    ``pending`` reads the ids a requeue would move (the dry run), ``requeue`` moves them and
    returns their ids. A requeue of what is no longer dead matches nothing."""

    noun: str  # "delivery item"
    pending: sa.TextClause
    requeue: sa.TextClause


@dataclass(frozen=True)
class ReviewItem:
    """One item a job flagged for a person: its ``item`` key (an order number …), the scope
    its job works it in, and why it was flagged (the job's result row)."""

    tenant: str
    item: str
    day: date | None  # the day of a windowed job's scope
    kind: str  # e.g. the mismatch type
    outcome: str  # e.g. dead_letter_flagged
    detail: str
    ours: str | None = None
    theirs: str | None = None
    flagged_by_run: str | None = None
    flagged_at: datetime | None = None

    def scope(self) -> Scope:
        return Scope.days(self.tenant, self.day, self.day) if self.day else Scope(self.tenant)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "day": self.day.isoformat() if self.day else None}


@dataclass(frozen=True)
class ReviewAction:
    """One thing a person may decide for a flagged item: ``describe`` says what it would do
    (the dry run; raises :class:`BadInput` when the action does not apply to the item),
    ``apply`` does it in the guarded transaction and says what it did, or returns None when
    the item is no longer flagged (its first write is the flag's conditional clearing), or
    raises :class:`BadInput` to roll everything back."""

    help: str
    describe: Callable[[ReviewItem], str]
    apply: Callable[[Connection, ReviewItem, uuid.UUID], str | None]


@dataclass(frozen=True)
class Review:
    """A job's manual-review queue: ``waiting`` lists the flagged items (``:tenant`` and
    ``:item`` NULL for all, ``:limit``; columns as :class:`ReviewItem`'s fields), ``actions``
    what a person may do with one."""

    waiting: sa.TextClause
    actions: Mapping[str, ReviewAction]
