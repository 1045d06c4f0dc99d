"""The states of a run: the ``status`` of a ``job_run`` row, and the groups the platform
judges runs by. The database's check constraint, the exporter's ``status`` label, the
sensors, ``qo-ops status`` and the Dagster adapter all take their statuses from here. SQL
text may name a status. Python code names it through :class:`RunStatus`."""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    """A run's status. A member is its own value as a ``str`` (``RunStatus.SUCCESS ==
    "success"``), so rows read back from the database compare equal to it."""

    AWAITING_APPROVAL = "awaiting_approval"  # an API execute held for a second identity
    ACCEPTED = "accepted"  # created by the API. The Dagster run adopts it when its op starts.
    RUNNING = "running"
    SUCCESS = "success"  # every item it found done
    PARTIAL_SUCCESS = "partial_success"  # some items failed, but the run went through
    FAILED = "failed"
    TIMEOUT = "timeout"  # it reached its deadline
    CANCELLED = "cancelled"
    SKIPPED = "skipped"  # it did nothing, because another run held its scope's lease
    NO_WORK = "no_work"  # it found nothing to do


# Created by the API and not yet adopted by a run. No process works on it yet.
UNSTARTED = (RunStatus.AWAITING_APPROVAL, RunStatus.ACCEPTED)
# Not ended. A run in one of these may still change its status.
ACTIVE = (*UNSTARTED, RunStatus.RUNNING)
# Ended. A run in one of these never changes its status again.
FINAL = tuple(s for s in RunStatus if s not in ACTIVE)
# Ended having done everything it found (the base of a tenant's freshness).
ENDED_WELL = (RunStatus.SUCCESS, RunStatus.NO_WORK)
# Ended without going through. A tenant whose last run ended so is failing.
FAILING = (RunStatus.FAILED, RunStatus.TIMEOUT)


def fresh_statuses(partial_success_is_fresh: bool) -> tuple[RunStatus, ...]:
    """The final statuses of an execute run that keep a tenant fresh. They are
    :data:`ENDED_WELL`, plus ``partial_success`` for a job whose items fail on purpose
    (poison items)."""
    return (*ENDED_WELL, *((RunStatus.PARTIAL_SUCCESS,) if partial_success_is_fresh else ()))
