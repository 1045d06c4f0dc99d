"""Checkpoints: a cursor job records its position in the batch's own transaction and a rerun
resumes exactly there. The job here is a test job over real tables: it bumps each quote's
version once, which is only right if no batch is ever applied twice.

Tests ``qo_ops.platform.run.checkpoint``, through ``qo_ops.platform.run.runner``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.db.schema import quote
from qo_ops.demo.data import load_demo_data
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.outcome import BatchContext, BatchOutcome, OutcomeCheck
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.job.spec import Batching, Checkpointing, JobSpec
from qo_ops.platform.run.runner import run_job


def _after_cursor(ctx: BatchContext) -> sa.Select[Any]:
    cursor = ctx.cursor or {"last_id": 0}
    return (
        sa.select(quote.c.id)
        .where(quote.c.tenant_id == ctx.scope.tenant_id, quote.c.id > cursor["last_id"])
        .order_by(quote.c.id)
    )


def _bump(conn: Connection, ctx: BatchContext, ids: Sequence[Any]) -> BatchOutcome:
    # deliberately NOT idempotent: only the checkpoint keeps a rerun from bumping twice
    conn.execute(
        sa.update(quote).where(quote.c.id.in_(list(ids))).values(version=quote.c.version + 1)
    )
    return BatchOutcome(succeeded=len(ids), cursor={"last_id": int(ids[-1])})


def _no_checks(conn: Connection, ctx: BatchContext) -> list[OutcomeCheck]:
    return []


BUMP = JobSpec(
    name="test_bump_versions",
    kind="backfill",
    description="test-only cursor job",
    partitioning="tenant",
    eligible=_after_cursor,
    transition=_bump,
    check=_no_checks,
    batching=Batching(checkpoint=Checkpointing(rescan_when_complete=False)),
)


def _versions(engine: sa.Engine) -> dict[int, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT version, count(*) FROM quote WHERE tenant_id = 'tenant-001' GROUP BY 1")
        )
        return dict(rows.all())


def test_rerun_resumes_from_the_checkpoint_and_never_repeats_a_batch(db):
    load_demo_data(db.engine, tenants=2, quotes=500, seed=2, as_of=datetime(2026, 3, 1, tzinfo=UTC))
    scope = Scope("tenant-001")
    first = run_job(
        BUMP,
        scope,
        RunOptions(
            mode="execute",
            trigger="backfill",
            reason="INC-1 backfill",
            batch_size=60,
            max_items=250,
        ),
        engine=db.engine,
    )
    assert (first.status, first.counts.processed, first.batches) == ("success", 250, 5)
    with db.engine.connect() as conn:
        cursor = conn.execute(
            sa.text(
                "SELECT cursor, job_run_id FROM job_checkpoint WHERE job_name = 'test_bump_versions'"
            )
        ).one()
        ids = (
            conn.execute(sa.text("SELECT id FROM quote WHERE tenant_id = 'tenant-001' ORDER BY id"))
            .scalars()
            .all()
        )
    assert cursor.cursor == {"last_id": ids[249]} and str(cursor.job_run_id) == first.job_run_id
    assert _versions(db.engine) == {2: 250, 1: 250}

    second = run_job(
        BUMP,
        scope,
        RunOptions(mode="execute", trigger="backfill", reason="INC-1 backfill", batch_size=60),
        engine=db.engine,
    )
    assert second.counts.processed == 250  # only what was left
    assert _versions(db.engine) == {2: 500}  # every quote bumped exactly once
    third = run_job(
        BUMP,
        scope,
        RunOptions(mode="execute", trigger="backfill", reason="INC-1 backfill"),
        engine=db.engine,
    )
    assert third.status == "no_work"
    with db.engine.connect() as conn:  # the other tenant was never touched
        assert (
            conn.scalar(sa.text("SELECT max(version) FROM quote WHERE tenant_id = 'tenant-002'"))
            == 1
        )


def test_a_failed_batch_leaves_the_checkpoint_where_the_last_commit_was(db):
    load_demo_data(db.engine, tenants=1, quotes=300, seed=2, as_of=datetime(2026, 3, 1, tzinfo=UTC))
    calls = {"n": 0}

    def flaky(conn: Connection, ctx: BatchContext, ids: Sequence[Any]) -> BatchOutcome:
        calls["n"] += 1
        outcome = _bump(conn, ctx, ids)
        if calls["n"] == 3:
            raise RuntimeError("boom after writing, before commit")
        return outcome

    spec = JobSpec(**{**BUMP.__dict__, "transition": flaky})
    failed = run_job(
        spec,
        Scope("tenant-001"),
        RunOptions(mode="execute", trigger="backfill", reason="INC-1 backfill", batch_size=50),
        engine=db.engine,
    )
    assert (failed.status, failed.error_code) == ("failed", "internal_error")
    assert failed.counts.processed == 100  # two batches committed, the third rolled back
    with db.engine.connect() as conn:
        last = conn.execute(sa.text("SELECT cursor->>'last_id' FROM job_checkpoint")).scalar()
        hundredth = conn.execute(
            sa.text("SELECT id FROM quote ORDER BY id OFFSET 99 LIMIT 1")
        ).scalar()
    assert int(last) == hundredth
    assert _versions(db.engine) == {2: 100, 1: 200}
    resumed = run_job(
        BUMP,
        Scope("tenant-001"),
        RunOptions(mode="execute", trigger="backfill", reason="INC-1 backfill"),
        engine=db.engine,
    )
    assert resumed.counts.processed == 200 and _versions(db.engine) == {2: 300}
