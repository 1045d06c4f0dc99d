"""How a job hands work back to a person: its dead letters (``DeadLetterKind``) and its
manual-review queue (``Review``). They are declared beside the job, and
``qo_ops.platform.actions.recovery`` acts on them."""

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
    """How a job's dead letters go back to work.

    Both statements take ``:tenant``, ``:ids`` and ``:limit``, and work oldest first.
    ``:ids`` is a ``uuid[]``, or NULL for every dead letter of the tenant. ``pending`` reads
    the ids a requeue would move (the dry run). ``requeue`` moves them and returns their
    ids. A requeue of what is no longer dead matches nothing."""

    noun: str  # "delivery item"
    pending: sa.TextClause
    requeue: sa.TextClause


@dataclass(frozen=True)
class ReviewItem:
    """One item a job flagged for a person. It holds its ``item`` key (an order number …),
    the scope its job works it in, and why it was flagged (the job's result row)."""

    tenant: str
    item: str
    day: date | None  # the day of a windowed job's scope
    kind: str  # for example, the mismatch type
    outcome: str  # for example, dead_letter_flagged
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
    """One thing a person may decide for a flagged item.

    ``describe`` says what it would do (the dry run). It raises :class:`BadInput` when the
    action does not apply to the item. ``apply`` does it in the guarded transaction and says
    what it did. Its first write is the flag's conditional clearing, so it returns None when
    the item is no longer flagged. It raises :class:`BadInput` to roll everything back."""

    help: str
    describe: Callable[[ReviewItem], str]
    apply: Callable[[Connection, ReviewItem, uuid.UUID], str | None]


@dataclass(frozen=True)
class Review:
    """A job's manual-review queue.

    ``waiting`` lists the flagged items. It takes ``:tenant`` and ``:item`` (NULL for all)
    and ``:limit``, and its columns are :class:`ReviewItem`'s fields. ``actions`` says what
    a person may do with one item."""

    waiting: sa.TextClause
    actions: Mapping[str, ReviewAction]
