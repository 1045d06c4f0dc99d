"""Who may execute: every execute with a person behind it (the CLI, the Launchpad and a
person's re-execution, a backfill, the API) needs a reason and is audited; a backfill never
executes a destructive job; schedules, sensors and automatic retries are not persons. The
rule is in the platform: ``run_job`` refuses, writes nothing but the audit row of the
refusal, whatever adapter called it.

Tests ``qo_ops.platform.run.consent`` and the consent rule of
``qo_ops.platform.job.options``.
"""

from __future__ import annotations

from datetime import date

import pytest
import sqlalchemy as sa

from qo_ops.db.digest import database_digest
from qo_ops.db.schema import BUSINESS_TABLES, job_audit, job_run, outbox_event
from qo_ops.errors import BadInput
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.job.options import (
    TRIGGERS,
    TRIGGERS_WITH_A_PERSON,
    ExecuteRefused,
    RunOptions,
    check_consent,
)
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.runner import RunSummary, run_job

# the Dagster world of qo_ops_tests/dagster, not the quotes of run/conftest.py
from qo_ops_tests.dagster.conftest import loaded  # noqa: F401

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


@pytest.mark.parametrize("trigger", PERSONS)
def test_a_destructive_execute_by_a_person_cites_an_approval_on_every_path(trigger):
    """One rule: CLI and Launchpad (manual), backfill, retry and API alike."""
    execute = RunOptions(mode="execute", trigger=trigger, reason="INC-3")
    check_consent(execute, destructive=False)  # not destructive: the reason is enough
    with pytest.raises(ExecuteRefused, match="needs an approval") as refused:
        check_consent(execute, destructive=True, job_name="temp_file_cleanup")
    assert refused.value.error_code == "approval_required"
    cause = str(refused.value)
    assert "\n" not in cause
    assert "qo-ops approval grant temp_file_cleanup" in cause
    assert "/internal/jobs/temp_file_cleanup/approvals" in cause
    cited = RunOptions(mode="execute", trigger=trigger, reason="INC-3", approval="apr-x")
    check_consent(cited, destructive=True)  # whether it allows the run: check_approval
    check_consent(RunOptions(mode="dry_run", trigger=trigger), destructive=True)


@pytest.mark.parametrize("trigger", ["schedule", "sensor"])
def test_schedules_and_sensors_run_a_destructive_job_without_an_approval(trigger):
    check_consent(RunOptions(mode="execute", trigger=trigger), destructive=True)


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


def test_run_job_refuses_an_unconsented_execute_writes_nothing_and_audits_it(loaded):  # noqa: F811
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
    assert "needs an approval" in rows[1].details["cause"]
    assert rows[2].details["trigger"] == "manual" and rows[2].details["dagster_run_id"] == "r1"
    assert all(r.job_run_id is None for r in rows)


def test_every_execute_with_a_person_behind_it_is_audited_and_automatic_ones_are_not(loaded):  # noqa: F811
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


# ------------------------------------------------ a Launchpad execute names its own reason

INCIDENT = "INC-9 expire the stale quotes"


def _dagster_execute(
    engine, run_id: str, reason: str, tenant: str = "tenant-001", **options
) -> RunSummary:
    """What the Dagster op hands the runner for a run a person launched (submission.py)."""
    defaults = {"mode": "execute", "trigger": "manual", "progress_interval_s": 3600}
    run = RunOptions(
        **{**defaults, **options},
        reason=reason,
        requester=f"dagster-run:{run_id}",
        correlation_id=run_id,
        dagster_run_id=run_id,
    )
    return run_job(QE, Scope(tenant), run, engine=engine)


def test_a_launchpad_execute_repeating_an_earlier_reason_on_its_scope_is_refused(loaded):  # noqa: F811
    """The Launchpad pre-fills an earlier run's config: a relaunch over the same scope that
    carries its reason is refused (audited, nothing claimed); one incident's reason covers
    the next tenant; its own reason, or a re-execution of the run that gave the reason,
    runs."""
    engine = loaded.engine
    first = _dagster_execute(engine, "d1-incident", INCIDENT)
    assert first.status == "success" and first.counts.succeeded > 0
    before = _state(engine)

    for copied in (INCIDENT, f"\t{INCIDENT.upper()}\n", INCIDENT.replace(" ", "  \t ")):
        with pytest.raises(ExecuteRefused) as refused:
            _dagster_execute(engine, "d2-relaunch", copied)
        assert refused.value.error_code == "reason_reused"
        cause = str(refused.value)
        assert "\n" not in cause and "give this run its own reason" in cause
        assert "for tenant-001" in cause
        assert "Dagster run d1-incid" in cause and "re-execute that run" in cause
    # a re-execution of the refused relaunch: its parent never executed with the reason
    with pytest.raises(ExecuteRefused, match="its own reason"):
        _dagster_execute(engine, "d3-reexec", INCIDENT, dagster_parent_run_id="d2-relaunch")

    assert _state(engine) == before  # no job_run row (nothing claimed), no business change
    denied = [r for r in _audit(engine) if r.decision == "denied"]
    assert [(r.actor, r.scope, r.mode, r.job_run_id, r.details["refused"]) for r in denied] == [
        ("dagster-run:d2-relaunch", "tenant-001", "execute", None, "reason_reused"),
    ] * 3 + [("dagster-run:d3-reexec", "tenant-001", "execute", None, "reason_reused")]
    assert denied[0].reason == INCIDENT and denied[0].details["trigger"] == "manual"
    assert "give this run its own reason" in denied[0].details["cause"]

    # one incident over many tenants: the same reason executes the next tenant
    next_tenant = _dagster_execute(engine, "d2b-incident", INCIDENT, tenant="tenant-002")
    assert next_tenant.status == "success" and next_tenant.counts.succeeded > 0
    # its own reason runs; the same Dagster run goes on to its next tenant with it
    own = _dagster_execute(engine, "d4-own", "INC-10 tenant-002 again", tenant="tenant-002")
    assert own.status in ("success", "no_work")
    also = _dagster_execute(engine, "d4-own", "INC-10 tenant-002 again")
    assert also.status in ("success", "no_work")
    # Dagster's re-execution of the run that gave the reason (it copies the config), and a
    # re-execution of that re-execution
    again = _dagster_execute(engine, "d5-reexec", INCIDENT, dagster_parent_run_id="d1-incident")
    assert again.status in ("success", "no_work")
    twice = _dagster_execute(engine, "d6-reexec", INCIDENT, dagster_parent_run_id="d5-reexec")
    assert twice.status in ("success", "no_work")
    with engine.connect() as conn:
        ran = conn.execute(
            sa.select(job_run.c.dagster_run_id).order_by(job_run.c.started_at)
        ).scalars()
        assert list(ran) == [
            "d1-incident", "d2b-incident", "d4-own", "d4-own", "d5-reexec", "d6-reexec"
        ]  # fmt: skip


def test_the_reason_rule_is_for_dagster_launches_only(loaded):  # noqa: F811
    """The CLI and the API send their reason with each request (a repeat is how they resume);
    backfills, automatic retries and dry runs are not a Launchpad's pre-filled execute; and
    another job's reason is no reason of this job's."""
    engine = loaded.engine
    assert _dagster_execute(engine, "d1", INCIDENT).status == "success"
    common = {"mode": "execute", "reason": INCIDENT, "progress_interval_s": 3600}
    cli = run_job(QE, Scope("tenant-002"), RunOptions(**common, requester="os:ops"), engine=engine)
    assert cli.status == "success"
    for trigger in ("api", "backfill", "retry"):
        other = run_job(
            QE,
            Scope("tenant-002"),
            RunOptions(**common, trigger=trigger, dagster_run_id=f"d-{trigger}"),  # type: ignore[arg-type]
            engine=engine,
        )
        assert other.status in ("success", "no_work"), trigger
    dry = _dagster_execute(engine, "d2", INCIDENT, mode="dry_run")
    assert dry.mode == "dry_run" and dry.status in ("success", "no_work")
    elsewhere = run_job(
        CATALOG["abandoned_checkout_close"],
        Scope("tenant-001"),
        RunOptions(**common, dagster_run_id="d3"),
        engine=engine,
    )
    assert elsewhere.status == "success"
    audited = _audit(engine)
    assert [(r.details["trigger"], r.mode, r.decision) for r in audited] == [
        ("manual", "execute", "allowed"),  # d1
        ("manual", "execute", "allowed"),  # the CLI
        ("api", "execute", "allowed"),
        ("backfill", "execute", "allowed"),
        ("retry", "execute", "allowed"),
        ("manual", "dry_run", "allowed"),
        ("manual", "execute", "allowed"),  # abandoned_checkout_close
    ]
