"""read_model_repair: drifted read-model rows of a window are recomputed, nothing else moves."""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import UTC, date, datetime, timedelta

import pytest
import sqlalchemy as sa

from qo_ops.db.digest import database_digest
from qo_ops.db.schema import BUSINESS_TABLES
from qo_ops.demo.data import load_demo_data
from qo_ops.jobs.read_model_repair import SPEC
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.outcome import BatchContext
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.runner import run_job
from qo_ops_tests.conftest import standing_approval

APPROVAL = standing_approval(SPEC.name)  # a destructive execute cites one

AS_OF = datetime(2026, 3, 1, tzinfo=UTC)
WINDOW = Scope("tenant-001", date(2026, 1, 30), date(2026, 3, 2))  # every order of the load
DRIFT = """
    SELECT count(*) FROM customer_order o LEFT JOIN order_read_model r ON r.order_id = o.id
     WHERE o.tenant_id = :t AND (r.order_id IS NULL OR r.status <> o.status
           OR r.total_amount <> o.total_amount OR r.line_count <> o.line_count)
"""


def _drift(engine: sa.Engine, tenant: str) -> int:
    with engine.connect() as conn:
        return conn.scalar(sa.text(DRIFT), {"t": tenant})


def test_repairs_exactly_the_drift_of_its_window_and_is_idempotent(db):
    load_demo_data(db.engine, tenants=2, quotes=1000, seed=4, as_of=AS_OF)
    with db.engine.begin() as conn:  # one more kind of drift: a stale status
        conn.execute(
            sa.text(
                "UPDATE order_read_model SET status = 'SUBMITTED' WHERE order_id = (SELECT min(order_id) "
                "FROM order_read_model r JOIN customer_order o ON o.id = r.order_id "
                "WHERE o.tenant_id = 'tenant-001' AND o.status = 'COMPLETED')"
            )
        )
    drifted, other_tenant = _drift(db.engine, "tenant-001"), _drift(db.engine, "tenant-002")
    assert drifted > 10 and other_tenant > 0

    with db.engine.connect() as conn:
        before = database_digest(conn, BUSINESS_TABLES)
    dry = run_job(SPEC, WINDOW, RunOptions(mode="dry_run"), engine=db.engine)
    with db.engine.connect() as conn:
        assert database_digest(conn, BUSINESS_TABLES) == before  # dry-run writes nothing
    assert dry.eligible_count == drifted
    by_kind = dry.checks[0].metadata  # the dry-run says what kind of drift it would repair
    assert (
        by_kind["drift_status"] == 1
        and by_kind["drift_missing"] > 0
        and by_kind["drift_total_amount"] > 0
    )
    assert by_kind["drifted_rows"] == drifted

    done = run_job(
        SPEC,
        WINDOW,
        RunOptions(mode="execute", reason="test", approval=APPROVAL, batch_size=7),
        engine=db.engine,
    )
    assert (done.status, done.counts.succeeded) == ("success", drifted)
    assert _drift(db.engine, "tenant-001") == 0
    assert _drift(db.engine, "tenant-002") == other_tenant  # another tenant's drift is not ours
    assert all(c.passed for c in done.checks)

    again = run_job(
        SPEC, WINDOW, RunOptions(mode="execute", reason="test", approval=APPROVAL), engine=db.engine
    )
    assert (again.status, again.counts.succeeded) == ("no_work", 0)


def test_only_the_window_is_repaired(db):
    load_demo_data(db.engine, tenants=1, quotes=1000, seed=4, as_of=AS_OF)
    with db.engine.connect() as conn:  # the day of the first drifted order
        first = conn.scalar(
            sa.text(
                "SELECT (min(o.submitted_at) AT TIME ZONE 'UTC')::date FROM customer_order o JOIN order_read_model r "
                "ON r.order_id = o.id WHERE r.total_amount <> o.total_amount"
            )
        )
    day = Scope("tenant-001", first, first + timedelta(days=1))
    in_day = run_job(SPEC, day, RunOptions(mode="dry_run"), engine=db.engine).eligible_count
    assert in_day > 0
    total = _drift(db.engine, "tenant-001")
    result = run_job(
        SPEC, day, RunOptions(mode="execute", reason="test", approval=APPROVAL), engine=db.engine
    )
    assert result.counts.succeeded == in_day
    assert _drift(db.engine, "tenant-001") == total - in_day


def test_a_run_stopped_midway_resumes_and_its_check_sees_what_is_left(db):
    """Batches start after the last one (position), but the outcome check counts the whole
    window: a row skipped because another transaction held it (it falls behind the position)
    is still reported, and the next run repairs it with the rest."""
    load_demo_data(db.engine, tenants=1, quotes=1000, seed=4, as_of=AS_OF)
    drifted = _drift(db.engine, "tenant-001")
    assert drifted > 10
    ctx = BatchContext(SPEC.name, WINDOW, "execute", uuid.uuid4())
    with db.engine.connect() as holder, holder.begin():  # the first drifted order, locked
        holder.execute(
            SPEC.eligible(ctx).limit(1).with_for_update(of=SPEC.batching.locks.of)
        ).scalar_one()
        part = run_job(
            SPEC,
            WINDOW,
            RunOptions(mode="execute", reason="test", approval=APPROVAL, batch_size=3, max_items=6),
            engine=db.engine,
        )
    assert part.counts.succeeded == 6 and part.batches == 2
    check = part.checks[0]
    assert not check.passed and check.metadata["drifted_rows"] == drifted - 6
    assert part.backlog == drifted - 6  # the check's count of the selection is the backlog
    rest = run_job(
        SPEC,
        WINDOW,
        RunOptions(mode="execute", reason="test", approval=APPROVAL, batch_size=4),
        engine=db.engine,
    )
    assert (rest.status, rest.counts.succeeded) == ("success", drifted - 6)
    assert _drift(db.engine, "tenant-001") == 0 and all(c.passed for c in rest.checks)


@pytest.mark.parametrize("shape", ["one statement", "ids"])
def test_a_row_held_during_its_batch_is_repaired_by_the_last_pass(db, shape):
    """A drifted order another transaction holds is skipped by its batch and falls behind
    the position; once it is free, the run's last pass from the start repairs it (the pass
    is taken because the selection, counted from the start, still matches it). Both batch
    shapes: the job's one statement that selects and writes (``Batching.claims``, what runs)
    and the runner's selection handing ids to ``transition``."""
    load_demo_data(db.engine, tenants=1, quotes=1000, seed=4, as_of=AS_OF)
    drifted = _drift(db.engine, "tenant-001")
    assert drifted > 10
    ctx = BatchContext(SPEC.name, WINDOW, "execute", uuid.uuid4())
    with db.engine.connect() as holder:
        held = holder.begin()  # the first drifted order, locked until the first batch is done
        holder.execute(
            SPEC.eligible(ctx).limit(1).with_for_update(of=SPEC.batching.locks.of)
        ).scalar_one()

        def free_the_held_row(outcome):
            if held.is_active:
                held.commit()
            return outcome

        claims = SPEC.batching.claims
        assert claims is not None
        spec = (
            replace(
                SPEC,
                batching=replace(
                    SPEC.batching, claims=lambda c, bc, sel: free_the_held_row(claims(c, bc, sel))
                ),
            )
            if shape == "one statement"
            else replace(
                SPEC,
                transition=lambda c, bc, ids: free_the_held_row(SPEC.transition(c, bc, ids)),
                batching=replace(SPEC.batching, claims=None),
            )
        )
        run = run_job(
            spec,
            WINDOW,
            RunOptions(mode="execute", reason="test", approval=APPROVAL, batch_size=3),
            engine=db.engine,
        )
    assert (run.status, run.counts.succeeded) == ("success", drifted)
    assert _drift(db.engine, "tenant-001") == 0 and all(c.passed for c in run.checks)
