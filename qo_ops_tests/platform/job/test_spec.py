"""``JobSpec`` (qo_ops.platform.job.spec): the rules between its parts are refused when a
spec is made, a check's description is written once (its ``CheckSpec``), a second
transaction runs with nothing called in between, and a position a job returns must be
declared."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.db.schema import quote
from qo_ops.demo.data import load_demo_data
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.outcome import BatchContext, BatchOutcome, OutcomeCheck
from qo_ops.platform.job.review import DeadLetterKind
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.job.spec import (
    CheckSpec,
    Deployment,
    JobSpec,
    Presentation,
    Recovery,
    SecondTransaction,
)
from qo_ops.platform.run.runner import run_job
from qo_ops.platform.schedule.overdue import database_now, overdue_scope

TENANT = "tenant-001"
CHECK = CheckSpec("nothing_left", "Nothing of the tenant is left to do")


def _quotes(ctx: BatchContext) -> sa.Select[Any]:
    return (
        sa.select(quote.c.id).where(quote.c.tenant_id == ctx.scope.tenant_id).order_by(quote.c.id)
    )


def _seen(conn: Connection, ctx: BatchContext, ids: Sequence[Any]) -> BatchOutcome:
    return BatchOutcome(succeeded=len(ids), work=list(ids))


def _judge(conn: Connection, ctx: BatchContext) -> list[OutcomeCheck]:
    return [CHECK.result(True, {"left": 0})]


SPEC = JobSpec(
    name="test_spec_rules",
    kind="sweep",
    description="test-only job",
    partitioning="tenant",
    eligible=_quotes,
    transition=_seen,
    check=_judge,
    checks=(CHECK,),
    presentation=Presentation(outcome_asset="quotes"),
)


def test_a_check_result_carries_its_declared_description():
    (result,) = SPEC.check(None, None)  # type: ignore[arg-type]
    assert (result.name, result.description, result.metadata) == (
        "nothing_left",
        "Nothing of the tenant is left to do",
        {"left": 0},
    )
    assert CHECK.result(False, backlog=3).backlog == 3


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"presentation": Presentation()}, "checks need presentation.outcome_asset"),
        ({"checks": (CHECK, CHECK)}, "two checks share a name"),
        (
            {"deployment": Deployment(scheduled_window_age_days=lambda: 8)},
            "scheduled_window_age_days is for windowed jobs only",
        ),
        (
            {"recovery": Recovery(requeue=DeadLetterKind("item", sa.text(""), sa.text("")))},
            "recovery.requeue needs signals.dead_letters",
        ),
    ],
)
def test_a_wrong_pairing_is_refused_when_the_spec_is_made(change, says):
    with pytest.raises(ValueError, match=f"JobSpec test_spec_rules: .*{says}"):
        dataclasses.replace(SPEC, **change)


def test_tenants_per_run_must_be_at_least_one():
    with pytest.raises(ValueError, match="tenants_per_run must be at least 1, not 0"):
        Deployment(tenants_per_run=0)


@pytest.mark.parametrize("job", sorted(CATALOG))
def test_every_catalog_check_result_says_what_its_declaration_says(db, job):
    """What Dagster shows on the asset check (the declaration) is what each evaluation and
    run summary carries: the job's check builds its results from its CheckSpecs."""
    spec = CATALOG[job]
    with db.engine.connect() as conn:
        scope = overdue_scope(spec, TENANT, database_now(conn))
        try:
            results = spec.check(conn, BatchContext(spec.name, scope, "dry_run", uuid.uuid4()))
        finally:
            conn.rollback()
    declared = {c.name: c.description for c in spec.checks}
    assert {r.name: r.description for r in results} == declared


@pytest.fixture
def quotes(db):
    load_demo_data(db.engine, tenants=1, quotes=30, seed=3, as_of=datetime(2026, 3, 1, tzinfo=UTC))
    return db


def test_a_second_transaction_gets_the_claims_work_with_nothing_called_between(quotes):
    """``SecondTransaction``: the transition commits, then ``finish`` gets its work in a
    second transaction; the batch's counts are the finish's, its processed the claim's."""
    finished: list[list[Any]] = []

    def finish(conn: Connection, ctx: BatchContext, work: list[Any]) -> BatchOutcome:
        finished.append(work)
        assert conn.in_transaction()
        return BatchOutcome(succeeded=len(work) - 1, skipped=1)

    spec = dataclasses.replace(SPEC, then=SecondTransaction(finish=finish))
    # the test job's rows never leave its selection: the run stops at max_items
    options = RunOptions(mode="execute", reason="test", batch_size=10, max_items=30)
    done = run_job(spec, Scope(TENANT), options, engine=quotes.engine)
    assert done.status == "success" and done.batches == 3
    assert [len(w) for w in finished] == [10, 10, 10]
    assert (done.counts.processed, done.counts.succeeded, done.counts.skipped) == (30, 27, 3)


def test_a_position_the_job_does_not_declare_fails_the_run(quotes):
    """A transition returning a position from a job without ``Batching.positions``: the
    runner would take its last pass from the start without the job saying so."""

    def positioned(conn: Connection, ctx: BatchContext, ids: Sequence[Any]) -> BatchOutcome:
        return BatchOutcome(succeeded=len(ids), position={"id": ids[-1]})

    spec = dataclasses.replace(SPEC, transition=positioned)
    options = RunOptions(mode="execute", reason="test", batch_size=10, max_items=30)
    done = run_job(spec, Scope(TENANT), options, engine=quotes.engine)
    assert (done.status, done.error_code) == ("failed", "internal_error")
    assert "test_spec_rules returned a position but declares no positions" in (
        done.error_text or ""
    )
