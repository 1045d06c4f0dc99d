"""The part of the world a run may touch. That is a tenant, and for a windowed job a date
range."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

from qo_ops.errors import BadInput

TENANT_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
# The days a window may cover. None lies before 1900, which is older than any business
# record and than the day a 100-year retention ages out. None has an end that would leave
# the calendar.
FIRST_DAY = date(1900, 1, 1)
LAST_DAY = date.max - timedelta(days=1)  # 9999-12-30, whose window ends on 9999-12-31

# :func:`tenant_of` in SQL. It reads the tenant of the scope key in the column ``scope``,
# from the one table in the statement's FROM that has one. The statements that read a tenant
# out of job_run, job_lease and job_checkpoint keys share it. ix_job_run_retention and
# ix_job_checkpoint_retention index this expression, and migration 0009 writes it out. The
# run-history retention's predicates, the lease's guard and the archive's sweep also write
# it out, over an alias, because a fragment names one column.
TENANT_OF_SCOPE = "split_part(scope, '/', 1)"


@dataclass(frozen=True)
class Scope:
    """The part of the world a run may touch. That is a tenant, and for windowed jobs a date
    range (``window_start`` inclusive, ``window_end`` exclusive)."""

    tenant_id: str
    window_start: date | None = None
    window_end: date | None = None

    def __post_init__(self) -> None:
        if not TENANT_ID.match(self.tenant_id):
            raise BadInput(
                "tenant must be a short key of lowercase letters, digits and '-' (e.g. tenant-001)"
            )
        if (self.window_start is None) != (self.window_end is None):
            raise BadInput("a window needs both a start and an end date")
        if self.window_start and self.window_end and self.window_end <= self.window_start:
            raise BadInput("the window's end date must be after its start date")
        if self.window_start and self.window_end:
            _check_days(self.window_start, self.window_end - timedelta(days=1))

    @classmethod
    def days(cls, tenant_id: str, first: date, last: date) -> Scope:
        """The scope of ``tenant_id`` over the days ``first`` to ``last``, both included.
        Raises :class:`BadInput` when a day lies outside ``FIRST_DAY``..``LAST_DAY``, so the
        window's end is always a date."""
        _check_days(first, last)
        return cls(tenant_id, first, last + timedelta(days=1))

    @classmethod
    def parse(cls, key: str) -> Scope:
        """The scope whose :attr:`key` is ``key``. Every place that reads a key back goes
        through here. Raises :class:`BadInput` when ``key`` is not such a key, including a
        key written another way than :attr:`key` writes it."""
        tenant, slash, window = key.partition("/")
        start = end = None
        if slash:
            first, _, last = window.partition("..")
            try:
                start, end = date.fromisoformat(first), date.fromisoformat(last)
            except ValueError:
                raise BadInput(_not_a_key(key)) from None
        scope = cls(tenant, start, end)  # checks the tenant, the window's order and days
        if scope.key != key:  # such as 20260101 for 2026-01-01. A scope has one key.
            raise BadInput(_not_a_key(key))
        return scope

    def window_bounds(self) -> tuple[datetime, datetime]:
        """The window as UTC timestamps, [start 00:00, end 00:00)."""
        assert self.window_start is not None and self.window_end is not None, "not a windowed scope"
        return (
            datetime.combine(self.window_start, time(), UTC),
            datetime.combine(self.window_end, time(), UTC),
        )

    @property
    def text(self) -> str:
        """The scope as a person reads it (:func:`scope_text`), with the last day included."""
        if self.window_start is None or self.window_end is None:
            return self.tenant_id
        start, last = self.window_start, self.window_end - timedelta(days=1)
        days = start.isoformat() if last == start else f"{start.isoformat()}..{last.isoformat()}"
        return f"{self.tenant_id}/{days}"

    @property
    def key(self) -> str:
        """The lease and checkpoint key, ``tenant-001`` or ``tenant-001/2026-01-01..2026-01-02``.
        The end is exclusive. This is the database's form, and people read :attr:`text`."""
        if self.window_start is None:
            return self.tenant_id
        return f"{self.tenant_id}/{self.window_start.isoformat()}..{self.window_end.isoformat()}"  # type: ignore[union-attr]


def scope_text(scope_key: str) -> str:
    """A scope key as a person reads it. It shows the days it covers, the last one included,
    as ``qo-ops run --from/--to`` and a backfill's plan write them.

    The key's end is exclusive. So ``tenant-001/2026-12-01..2026-12-02`` covers one day and
    is shown ``tenant-001/2026-12-01``, and ``…/2026-11-20..2026-12-05`` is shown
    ``…/2026-11-20..2026-12-04``. A key that is not a window (a tenant, a chunk) is shown as
    it is."""
    try:
        return Scope.parse(scope_key).text
    except BadInput:
        return scope_key


def tenant_of(scope_key: str) -> str:
    """The tenant of a scope key (:attr:`Scope.key`). For ``tenant-001/2026-01-01..`` it is
    ``tenant-001``. Raises :class:`BadInput` when it is not a scope key (:meth:`Scope.parse`)."""
    return Scope.parse(scope_key).tenant_id


def _not_a_key(key: str) -> str:
    return f"not a scope key: {key[:80]!r} (tenant-001 or tenant-001/2026-01-01..2026-01-02)"


def _check_days(first: date, last: date) -> None:
    if not (first >= FIRST_DAY and last <= LAST_DAY):
        raise BadInput(
            f"a window's days must lie from {FIRST_DAY} to {LAST_DAY}, got {first} to {last}"
        )
