"""The states of a run: the ``status`` of a ``job_run`` row, and the groups the platform
judges runs by. The database's check constraint, the exporter's ``status`` label, the
sensors, ``qo-ops status`` and the Dagster adapter all take their statuses from here; SQL
text may name a status, Python code names it through :class:`RunStatus`."""

from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    """A run's status. A member is its own value as a ``str`` (``RunStatus.SUCCESS ==
    "success"``), so rows read back from the database compare equal to it."""

    AWAITING_APPROVAL = "awaiting_approval"  # an API execute held for a second identity
    ACCEPTED = "accepted"  # created by the API; the Dagster run adopts it when its op starts
    RUNNING = "running"
    SUCCESS = "success"  # every item it found done
    PARTIAL_SUCCESS = "partial_success"  # some items failed, the run went through
    FAILED = "failed"
    TIMEOUT = "timeout"  # its deadline reached
    CANCELLED = "cancelled"
    SKIPPED = "skipped"  # did nothing: its scope's lease was held by another run
    NO_WORK = "no_work"  # found nothing to do


# Created by the API and not yet adopted by a run: no process works on it yet.
UNSTARTED = (RunStatus.AWAITING_APPROVAL, RunStatus.ACCEPTED)
# Not ended: a run in one of these may still change its status.
ACTIVE = (*UNSTARTED, RunStatus.RUNNING)
# Ended: a run in one of these never changes its status again.
FINAL = tuple(s for s in RunStatus if s not in ACTIVE)
# Ended having done everything it found (the base of a tenant's freshness).
ENDED_WELL = (RunStatus.SUCCESS, RunStatus.NO_WORK)
# Ended without going through: a tenant whose last run ended so is failing.
FAILING = (RunStatus.FAILED, RunStatus.TIMEOUT)


def fresh_statuses(partial_success_is_fresh: bool) -> tuple[RunStatus, ...]:
    """The final statuses of an execute run that keep a tenant fresh: :data:`ENDED_WELL`,
    and ``partial_success`` for a job whose items fail on purpose (poison items)."""
    return (*ENDED_WELL, *((RunStatus.PARTIAL_SUCCESS,) if partial_success_is_fresh else ()))
