"""What the jobs section's families share: the tenant, the window a windowed job's rows
lie in, the template load, and the statement a job's batch applies (its own, imported)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL

from bench.common import engine_for
from qo_ops.db.arrays import int_array
from qo_ops.jobs import temp_file_cleanup as cleanup_job
from qo_ops.jobs.abandoned_checkout_close import CLOSE_CHECKOUT_BATCH
from qo_ops.jobs.audit_archive import format as archive_format
from qo_ops.jobs.pricing_snapshot_recalculation import RECALCULATE_BATCH
from qo_ops.jobs.quote_expiration import EXPIRE_QUOTE_BATCH
from qo_ops.jobs.read_model_repair import REPAIR_READ_MODEL_BATCH
from qo_ops.platform.job.outcome import BatchContext
from qo_ops.platform.job.scope import Scope

TENANT = "tenant-001"
SPAN_DAYS = 10  # windowed jobs: rows spread over this many UTC days, window = exactly those
AUDIT_RETENTION_DAYS = 365
CLEANUP_RETENTION_DAYS = 7
IDLE_HOURS = 24  # abandoned_checkout_close: its default, set explicitly
TENANT_SQL = "INSERT INTO tenant (id, name) VALUES ('tenant-001', 'bench');"


@dataclass(frozen=True)
class Window:
    """Rows of a windowed job lie in [first, last + 1 day); the CLI gets --from first --to last."""

    first: date
    last: date

    @property
    def start(self) -> datetime:
        return datetime.combine(self.first, datetime.min.time(), UTC)

    @property
    def end(self) -> datetime:
        return datetime.combine(self.last + timedelta(days=1), datetime.min.time(), UTC)

    def cli(self) -> list[str]:
        return ["--from", self.first.isoformat(), "--to", self.last.isoformat()]


def scope_of(w: Window | None) -> Scope:
    """The run's scope: the tenant, over the window for a windowed job."""
    return Scope(TENANT, w.first, w.last + timedelta(days=1)) if w else Scope(TENANT)


def window_for(days_ago: int) -> Window:
    first = datetime.now(UTC).date() - timedelta(days=days_ago)
    return Window(first, first + timedelta(days=SPAN_DAYS - 1))


def spread(expr: str, n: int, window: Window) -> str:
    """SQL: a timestamp inside ``window`` for row ``expr`` of ``n`` (never on a bound)."""
    span_s = SPAN_DAYS * 86400 - 2
    return (
        f"(timestamptz '{window.start.isoformat()}' + interval '1 second' "
        f"+ make_interval(secs => ({expr}) * {span_s}.0 / {n}))"
    )


def load_template(url: URL, sql: str) -> None:
    engine = engine_for(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(sql)
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE")
    engine.dispose()


def one_row(url: URL, sql: str, params: dict[str, Any]) -> dict[str, Any]:
    """The one row of a read-only ``sql`` (verification), as a dict."""
    engine = engine_for(url)
    with engine.connect() as conn:
        row = conn.execute(sa.text(sql), params).one()._asdict()
    engine.dispose()
    return row


def transition_sql(job: str, ids: list[int], ctx: BatchContext) -> tuple[sa.TextClause, dict]:
    """The statement a job's batch applies to ``ids`` (the job's own constant), with the
    parameters the job binds."""
    array = int_array(ids)
    if job == "quote_expiration":
        return EXPIRE_QUOTE_BATCH, {"ids": array, "tenant": TENANT, "last_id": ids[-1]}
    if job == "abandoned_checkout_close":
        params = {"ids": array, "tenant": TENANT, "hours": IDLE_HOURS, "last_id": ids[-1]}
        return CLOSE_CHECKOUT_BATCH, params
    if job == "pricing_snapshot_recalculation":
        params = {"ids": array, "tenant": TENANT, "run": ctx.job_run_id, "last": ids[-1]}
        return RECALCULATE_BATCH, params
    if job == "read_model_repair":
        return REPAIR_READ_MODEL_BATCH, {"ids": array, "tenant": TENANT, "last_id": ids[-1]}
    start, end = ctx.scope.window_bounds()
    if job == "temp_file_cleanup":
        params = {"ids": array, "tenant": TENANT, "start": start, "end": end}
        params |= {"run": str(ctx.job_run_id), "reason": "bench explain"}
        return cleanup_job._DELETE_ROWS, params | {"days": CLEANUP_RETENTION_DAYS}
    assert job == "audit_archive"
    params = {"t": TENANT, "lo": min(ids), "hi": max(ids), "ws": start, "we": end}
    return archive_format.DELETE_DIGESTED, params
