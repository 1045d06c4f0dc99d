"""How late a scheduled run starts after its tick, and why, as far as the run records tell."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from sqlalchemy.engine import Engine

from qo_ops.config import number
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.schedule.missed import scope_busy_at

DRIFT_WARN_ENV = "QO_OPS_DRIFT_WARN_S"
DEFAULT_DRIFT_WARN_S = 300.0


def drift_warn_s() -> float:
    """A scheduled run later than this many seconds logs job.scheduler.drift.detected.

    The value comes from ``QO_OPS_DRIFT_WARN_S``. A bad value is refused before a run
    starts."""
    return number(DRIFT_WARN_ENV, DEFAULT_DRIFT_WARN_S, 0.001, 86400.0, unit="seconds")


def drift_s(options: RunOptions) -> float | None:
    """How late a scheduled run starts after its tick (on UTC clocks), or None if it was not
    scheduled."""
    if options.scheduled_for is None:
        return None
    return (datetime.now(UTC) - options.scheduled_for).total_seconds()


def drift_reason(
    engine: Engine, job_name: str, scope_key: str, run_id: uuid.UUID, tick: datetime
) -> str:
    """Why a scheduled run starts late.

    ``previous_run_active`` means another run of the scope was running at the tick, and this
    run waited behind it. ``start_delayed`` means nothing recorded explains it. Then the
    daemon, the run queue or the run worker's start was slow."""
    with engine.connect() as conn:
        behind = scope_busy_at(conn, job_name, scope_key, tick, other_than=run_id)
    return "previous_run_active" if behind else "start_delayed"
