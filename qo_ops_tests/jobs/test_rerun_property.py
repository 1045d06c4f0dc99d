"""The rerun property, for every job of the catalog: run it (execute) over a scope of the demo
data, then once more over the same scope with nothing changed in between. The second run
changes no business row, no outbox event and no earlier run's record (only its own run row,
audit rows, result rows, lease and checkpoint are new, and what its calls add to the
downstream breaker's evidence), emits no new side effect (its tally
counts no ``side_effect.*.success``; ``duplicate_prevented`` is fine), and the downstream
simulator receives no new distinct delivery or notification.

One test per catalog entry, parametrized over ``CATALOG`` itself, so a new job is covered
the day it is added. Windowed jobs run over the week ending on the day their schedule would
run today (``JobSpec.deployment.scheduled_window_age_days``, default yesterday): each first run must
find work there, or the property would hold for nothing.
"""

from __future__ import annotations

import os
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from qo_ops.db.digest import database_digest, table_digest
from qo_ops.db.schema import (
    BUSINESS_TABLES,
    PLATFORM_TABLES,
    downstream_breaker,
    downstream_rate_limit,
    job_audit,
    job_checkpoint,
    job_lease,
    job_run,
    reconciliation_result,
)
from qo_ops.demo.data import load_demo_data
from qo_ops.downstream.local import seed_from_demo
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.run.runner import RunSummary, run_job
from qo_ops_tests.jobs.test_run_history_retention import plant_old_history

TENANT = "tenant-001"
WINDOW_DAYS = 7
KEEP_ENV = ("QO_OPS_TEST_DATABASE_URL", "QO_OPS_DEBUG")

# Per-run records a rerun adds by design, digested without the second run's own rows: earlier
# runs' records must stay as they were (run_history_retention's rerun must prune nothing).
PER_RUN = {
    job_run: "t.id <> :run",
    job_audit: "t.job_run_id IS DISTINCT FROM :run",
    reconciliation_result: "t.job_run_id <> :run",  # the mismatches each run saw
}
# The runner's own bookkeeping of each run: the lease it took, the cursor it moved; and what
# its calls add to the downstream's shared manners: the breaker's evidence (a rerun of
# order_reconciliation looks its orders up again: calls, though nothing changes) and the
# fleet's rate-limit tokens.
BOOKKEEPING = (job_lease, job_checkpoint, downstream_breaker, downstream_rate_limit)
# What a rerun must leave alone: every business table, the outbox, the rest of the platform.
STATE_TABLES = tuple(
    t for t in (*BUSINESS_TABLES, *PLATFORM_TABLES) if t not in PER_RUN and t not in BOOKKEEPING
)


def scope_with_work(spec: JobSpec) -> Scope:
    """The tenant, and for a windowed job the week ending on the day its schedule runs today."""
    if spec.partitioning == "tenant":
        return Scope(TENANT)
    age = (
        spec.deployment.scheduled_window_age_days()
        if spec.deployment.scheduled_window_age_days
        else 1
    )
    last = datetime.now(UTC).date() - timedelta(days=age)
    return Scope(TENANT, last - timedelta(days=WINDOW_DAYS - 1), last + timedelta(days=1))


def business_state(engine: sa.Engine, second_run: uuid.UUID) -> dict[str, str]:
    """Digest of every table a rerun must leave alone, without the rows ``second_run`` adds."""
    with engine.connect() as conn:
        digests = database_digest(conn, STATE_TABLES)
        for table, where in PER_RUN.items():
            digests[table.name] = table_digest(conn, table, where, {"run": second_run})
    return digests


def execute(spec: JobSpec, engine: sa.Engine, scope: Scope) -> RunSummary:
    options = RunOptions(mode="execute", trigger="schedule", progress_interval_s=3600)
    return run_job(spec, scope, options, engine=engine)


def new_successes(summary: RunSummary) -> dict[str, int]:
    return {
        k: v
        for k, v in summary.tally.items()
        if k.startswith("side_effect.") and k.endswith(".success") and v
    }


@pytest.mark.parametrize("job_name", sorted(CATALOG))
def test_a_second_run_over_the_same_scope_changes_nothing(
    job_name: str, db, downstream, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spec = CATALOG[job_name]
    for name in [n for n in os.environ if n.startswith("QO_OPS_")]:
        if name not in KEEP_ENV:  # every job setting at its default
            monkeypatch.delenv(name)
    monkeypatch.setenv("QO_OPS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", downstream.url)
    load_demo_data(db.engine, tenants=1, quotes=3000, seed=18, as_of=datetime.now(UTC))
    plant_old_history(db.engine, TENANT)  # something for run_history_retention to prune
    seed_from_demo(db.engine, downstream.url)  # the fulfilment system's view of the orders
    scope = scope_with_work(spec)

    first = execute(spec, db.engine, scope)
    assert first.status in ("success", "partial_success"), first  # poison items fail
    assert first.counts.processed > 0, (
        f"{job_name}: no work in {scope.key}; the rerun proves nothing"
    )

    seen = downstream.client.stats(detail=False)
    with db.engine.connect() as conn:  # before the second run, every row is an earlier one
        before = database_digest(conn, (*STATE_TABLES, *PER_RUN))
    second = execute(spec, db.engine, scope)
    assert second.status in ("success", "no_work"), second
    assert business_state(db.engine, uuid.UUID(second.job_run_id)) == before
    assert second.counts.succeeded == 0, second
    assert new_successes(second) == {}, second.tally
    now = downstream.client.stats(detail=False)
    for counter in ("deliveries_distinct", "notifications_distinct"):
        assert now[counter] == seen[counter], (counter, seen, now)
