"""Who may execute: every execute with a person behind it (the CLI, the Launchpad and a
person's re-execution, a backfill, the API) needs a reason and is audited; a backfill never
executes a destructive job; schedules, sensors and automatic retries are not persons. The
rule is in the platform: ``run_job`` refuses, writes nothing but the audit row of the
refusal, whatever adapter called it."""

from __future__ import annotations

from datetime import date

import pytest
import sqlalchemy as sa

from qo_ops.db.digest import database_digest
from qo_ops.db.schema import BUSINESS_TABLES, job_audit, job_run, outbox_event
from qo_ops.errors import BadInput
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.runner import run_job
from qo_ops.platform.spec import (
    TRIGGERS,
    TRIGGERS_WITH_A_PERSON,
    ExecuteRefused,
    RunOptions,
    Scope,
    check_consent,
)

# ------------------------------------------------------------------ the predicate (no I/O)


PERSONS = ["manual", "backfill", "retry", "api"]


def test_only_schedules_and_sensors_have_no_person_behind_them():
    assert set(TRIGGERS_WITH_A_PERSON) == set(PERSONS) == set(TRIGGERS) - {"schedule", "sensor"}
    for trigger in TRIGGERS:
        behind = RunOptions(trigger=trigger).person_behind  # type: ignore[arg-type]
        assert behind is (trigger in PERSONS), trigger


@pytest.mark.parametrize("trigger", PERSONS)
@pytest.mark.parametrize("reason", [None, "", "   "])
def test_a_persons_execute_without_a_reason_is_refused(trigger, reason):
    options = RunOptions(mode="execute", trigger=trigger, reason=reason)
    with pytest.raises(ExecuteRefused, match=rf"execute by a person \({trigger}\) needs a reason"):
        options.validated()
    with pytest.raises(ExecuteRefused) as refused:
        check_consent(options, destructive=True)
    assert refused.value.error_code == "reason_required"
    assert isinstance(refused.value, BadInput)  # the CLI's exit 2, the API's 4xx


@pytest.mark.parametrize("trigger", ["schedule", "sensor"])
def test_schedules_and_sensors_execute_without_a_reason(trigger):
    options = RunOptions(mode="execute", trigger=trigger)
    assert options.validated() is options
    check_consent(options, destructive=True, job_name="temp_file_cleanup")


@pytest.mark.parametrize("trigger", PERSONS)
def test_a_dry_run_needs_no_reason(trigger):
    options = RunOptions(mode="dry_run", trigger=trigger)
    check_consent(options.validated(), destructive=True)


def test_a_backfill_never_executes_a_destructive_job_but_a_person_by_hand_may():
    backfill = RunOptions(mode="execute", trigger="backfill", reason="INC-3")
    check_consent(backfill, destructive=False)  # not destructive: the reason is enough
    with pytest.raises(ExecuteRefused, match="operator API's approval flow") as refused:
        check_consent(backfill, destructive=True, job_name="temp_file_cleanup")
    assert refused.value.error_code == "approval_required"
    assert "/internal/jobs/temp_file_cleanup/runs" in str(refused.value)
    assert "\n" not in str(refused.value)
    for trigger in ("manual", "retry", "api"):  # by hand; the API has its own two-person rule
        check_consent(RunOptions(mode="execute", trigger=trigger, reason="INC-3"), destructive=True)
    check_consent(RunOptions(mode="dry_run", trigger="backfill"), destructive=True)


# ------------------------------------------------------------------ run_job (real PostgreSQL)

QE = CATALOG["quote_expiration"]
REPAIR = CATALOG["read_model_repair"]  # destructive, windowed
DAY = Scope("tenant-001", date(2026, 2, 10), date(2026, 2, 11))


def _state(engine) -> tuple[str, int]:
    with engine.connect() as conn:
        runs = conn.scalar(sa.select(sa.func.count()).select_from(job_run))
        return str(database_digest(conn, (*BUSINESS_TABLES, outbox_event))), runs


def _audit(engine) -> list[sa.Row]:
    with engine.connect() as conn:
        return conn.execute(
            sa.select(job_audit).where(job_audit.c.action == "trigger").order_by(job_audit.c.id)
        ).all()


def test_run_job_refuses_an_unconsented_execute_writes_nothing_and_audits_it(loaded):
    engine = loaded.engine
    before = _state(engine)
    refusals = [
        (QE, Scope("tenant-001"), RunOptions(mode="execute", trigger="backfill",
                                             requester="backfill:abc")),
        (REPAIR, DAY, RunOptions(mode="execute", trigger="backfill", requester="backfill:abc",
                                 reason="INC-4 drift")),
        (QE, Scope("tenant-002"), RunOptions(mode="execute", trigger="manual",
                                             requester="dagster-run:r1", dagster_run_id="r1")),
    ]  # fmt: skip
    for spec, scope, options in refusals:
        with pytest.raises(ExecuteRefused):
            run_job(spec, scope, options, engine=engine)

    assert _state(engine) == before  # no business row, no event, no job_run
    rows = _audit(engine)
    assert [(r.actor, r.job_name, r.scope, r.mode, r.reason, r.decision) for r in rows] == [
        ("backfill:abc", "quote_expiration", "tenant-001", "execute", None, "denied"),
        ("backfill:abc", "read_model_repair", DAY.key, "execute", "INC-4 drift", "denied"),
        ("dagster-run:r1", "quote_expiration", "tenant-002", "execute", None, "denied"),
    ]
    assert [r.details["refused"] for r in rows] == [
        "reason_required",
        "approval_required",
        "reason_required",
    ]
    assert "needs a reason" in rows[0].details["cause"]
    assert "operator API's approval flow" in rows[1].details["cause"]
    assert rows[2].details["trigger"] == "manual" and rows[2].details["dagster_run_id"] == "r1"
    assert all(r.job_run_id is None for r in rows)


def test_every_execute_with_a_person_behind_it_is_audited_and_automatic_ones_are_not(loaded):
    engine = loaded.engine
    common = {"mode": "execute", "progress_interval_s": 3600}
    backfill = run_job(
        QE,
        Scope("tenant-001"),
        RunOptions(**common, trigger="backfill", requester="backfill:b1", reason="INC-5"),
        engine=engine,
    )
    scheduled = run_job(
        QE, Scope("tenant-002"), RunOptions(**common, trigger="schedule"), engine=engine
    )
    assert backfill.status == "success" and scheduled.status in ("success", "no_work")
    rows = _audit(engine)
    assert [(r.actor, r.scope, r.mode, r.reason, r.decision) for r in rows] == [
        ("backfill:b1", "tenant-001", "execute", "INC-5", "allowed")
    ]
    assert str(rows[0].job_run_id) == backfill.job_run_id
    assert rows[0].details["trigger"] == "backfill"
