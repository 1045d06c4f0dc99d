"""run_history_retention through the one runner: only history past the period goes; the latest
and last successful run of each job and scope, active runs, leased scopes, runs named by a
business record and other tenants' history stay; job_audit only grows (one row per batch);
a dry run counts exactly what execute deletes and changes nothing; batches are bounded; a
bad QO_OPS_RUN_HISTORY_DAYS is one line and changes nothing; a second run prunes nothing."""

from __future__ import annotations

import re
import uuid
from typing import Any

import pytest
import sqlalchemy as sa

from qo_ops.errors import ConfigError
from qo_ops.jobs.catalog import CATALOG
from qo_ops.jobs.run_history_retention import (
    DAYS_ENV,
    PRUNABLE_CHECKPOINT,
    PRUNABLE_RUN,
    SPEC,
    history_days,
)
from qo_ops.platform.job import statuses
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.runner import RunSummary, run_job
from qo_ops_tests.conftest import base_env, run_cli, standing_approval

APPROVAL = standing_approval("run_history_retention")  # a destructive execute cites one

TENANT, OTHER = "tenant-001", "tenant-002"
WINDOW = f"{TENANT}/2026-01-01..2026-01-02"
OTHER_WINDOW = f"{OTHER}/2026-01-01..2026-01-02"
JOB = "run_history_retention"


def scalar(engine: sa.Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


def add_run(
    conn: sa.Connection,
    job: str,
    scope: str,
    finished_days: float | None,
    *,
    status: str = "success",
    mode: str = "execute",
) -> uuid.UUID:
    """A run that finished ``finished_days`` ago (None: still active), started a minute before."""
    run_id = uuid.uuid4()
    days = 100.0 if finished_days is None else finished_days
    conn.execute(
        sa.text(
            "INSERT INTO job_run (id, job_name, scope, mode, trigger_type, owner_id, status, "
            "created_at, started_at, heartbeat_at, finished_at) VALUES (:id, :job, :scope, "
            ":mode, 'schedule', 'test', :status, now() - CAST(:d AS float8) * interval '1 day' - interval "
            "'1 minute', now() - CAST(:d AS float8) * interval '1 day' - interval '1 minute', "
            "now() - CAST(:d AS float8) * interval '1 day', "
            "CASE WHEN :active THEN NULL ELSE now() - CAST(:d AS float8) * interval '1 day' END)"
        ),
        {
            "id": run_id,
            "job": job,
            "scope": scope,
            "mode": mode,
            "status": status,
            "d": days,
            "active": finished_days is None,
        },
    )
    return run_id


def plant_old_history(engine: sa.Engine, tenant: str) -> None:
    """Two finished runs of a year ago, each followed by a newer one: history that
    run_history_retention may delete (the demo data has no run history)."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO job_run (id, job_name, scope, mode, trigger_type, owner_id, status, "
                "started_at, finished_at) SELECT gen_random_uuid(), 'quote_expiration', :t, "
                "'dry_run', 'schedule', 'planted', 'success', now() - d * interval '1 day', "
                "now() - d * interval '1 day' FROM unnest(ARRAY[400, 401]) AS d"
            ),
            {"t": tenant},
        )


def add_checkpoint(
    conn: sa.Connection, job: str, scope: str, updated_days: float, run_id: uuid.UUID | None = None
) -> str:
    conn.execute(
        sa.text(
            "INSERT INTO job_checkpoint (job_name, scope, cursor, updated_at, job_run_id) "
            "VALUES (:job, :scope, '{\"id\": 1}', now() - CAST(:d AS float8) * interval '1 day', :run)"
        ),
        {"job": job, "scope": scope, "d": updated_days, "run": run_id},
    )
    return f"checkpoint:{job}:{scope}"


def add_lease(conn: sa.Connection, job: str, scope: str, run_id: uuid.UUID) -> None:
    conn.execute(
        sa.text(
            "INSERT INTO job_lease (job_name, scope, owner_id, lease_token, fencing_token, "
            "acquired_at, heartbeat_at, expires_at, job_run_id) VALUES (:job, :scope, 'other', "
            "'tok', 1, now(), now(), now() + interval '1 hour', :run)"
        ),
        {"job": job, "scope": scope, "run": run_id},
    )


def add_audit(conn: sa.Connection, run_id: uuid.UUID, days: float) -> None:
    conn.execute(
        sa.text(
            "INSERT INTO job_audit (occurred_at, actor, action, job_name, scope, decision, "
            "job_run_id, details) VALUES (now() - CAST(:d AS float8) * interval '1 day', 'alice', 'trigger', "
            "'quote_expiration', :scope, 'allowed', :run, '{\"limits\": {\"batch_size\": 5}}')"
        ),
        {"d": days, "scope": TENANT, "run": run_id},
    )


def plant(engine: sa.Engine) -> dict[str, Any]:
    """Two tenants' history around the default 90-day period; returns what must go."""
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO tenant (id, name) VALUES (:a, 'A'), (:b, 'B')"),
                     {"a": TENANT, "b": OTHER})  # fmt: skip
        # quote_expiration, tenant scope: the latest stays, 89 days stays, older goes
        add_run(conn, "quote_expiration", TENANT, 1)
        a_89 = add_run(conn, "quote_expiration", TENANT, 89)
        a_91 = add_run(conn, "quote_expiration", TENANT, 91)
        a_dry = add_run(conn, "quote_expiration", TENANT, 120, mode="dry_run")
        a_failed = add_run(conn, "quote_expiration", TENANT, 150, status="failed")
        # order_reconciliation, a window: the latest (failed) and the last success stay,
        # an older success goes, a run named by a reconciliation_result stays
        add_run(conn, "order_reconciliation", WINDOW, 150, status="failed")
        add_run(conn, "order_reconciliation", WINDOW, 200)
        b_named = add_run(conn, "order_reconciliation", WINDOW, 250)
        b_old = add_run(conn, "order_reconciliation", WINDOW, 300)
        conn.execute(
            sa.text(
                "INSERT INTO reconciliation_result (job_run_id, tenant_id, order_number, "
                "mismatch_type, action, outcome) VALUES (:run, :t, 'ORD-1', "
                "'missing_downstream', 'report_only', 'reported')"
            ),
            {"run": b_named, "t": TENANT},
        )
        # delivery_retry: an active run (and an API-accepted one) stays, so does its scope's
        # old checkpoint; the latest stays; an older one goes
        add_run(conn, "delivery_retry", TENANT, None, status="running")
        add_run(conn, "delivery_retry", TENANT, None, status="accepted")
        add_run(conn, "delivery_retry", TENANT, 95)
        c_old = add_run(conn, "delivery_retry", TENANT, 120, status="failed")
        add_checkpoint(conn, "delivery_retry", TENANT, 100)
        # catalog_cache_refresh: a run named by a held lease stays, and the scope's checkpoint
        add_run(conn, "catalog_cache_refresh", TENANT, 2)
        leased = add_run(conn, "catalog_cache_refresh", TENANT, 130)
        add_lease(conn, "catalog_cache_refresh", TENANT, leased)
        add_checkpoint(conn, "catalog_cache_refresh", TENANT, 100)
        # checkpoints: past the period goes, inside stays
        cp_old = add_checkpoint(conn, "pricing_snapshot_recalculation", WINDOW, 100, a_failed)
        add_checkpoint(
            conn, "pricing_snapshot_recalculation", f"{TENANT}/2026-01-02..2026-01-03", 89
        )
        # the other tenant: the same shapes, all of it past the period
        add_run(conn, "quote_expiration", OTHER, 1)
        add_run(conn, "quote_expiration", OTHER, 150)
        add_run(conn, "order_reconciliation", OTHER_WINDOW, 150)
        add_run(conn, "order_reconciliation", OTHER_WINDOW, 300, status="failed")
        add_checkpoint(conn, "pricing_snapshot_recalculation", OTHER_WINDOW, 300)
        # audit rows, some naming runs that will go
        for run_id, days in ((a_91, 91), (b_old, 300), (leased, 130), (a_89, 89)):
            add_audit(conn, run_id, days)
    runs = {a_91, a_dry, a_failed, b_old, c_old}
    return {"runs": runs, "items": {f"run:{r}" for r in runs} | {cp_old}}


def snapshot(engine: sa.Engine, table: str, where: str = "true") -> set[str]:
    with engine.connect() as conn:
        return set(conn.execute(sa.text(f"SELECT t::text FROM {table} t WHERE {where}")).scalars())


def audit_rows(engine: sa.Engine) -> list[tuple[int, str]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text("SELECT id, t::text FROM job_audit t ORDER BY id"))]  # type: ignore[misc]  # fmt: skip


def prune_audits(engine: sa.Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [
            dict(r._mapping)
            for r in conn.execute(
                sa.text(
                    "SELECT actor, job_name, scope, mode, decision, job_run_id, details "
                    "FROM job_audit WHERE action = 'retention.prune' ORDER BY id"
                )
            )
        ]


def run_ids(engine: sa.Engine) -> set[uuid.UUID]:
    with engine.connect() as conn:
        return set(conn.execute(sa.text("SELECT id FROM job_run")).scalars())


def execute(engine: sa.Engine, **limits: Any) -> RunSummary:
    options = RunOptions(mode="execute", trigger="manual", requester="ops-bob",
                         reason="INC-9 run history", approval=APPROVAL, **limits)  # fmt: skip
    return run_job(SPEC, Scope(TENANT), options, engine=engine)


@pytest.fixture(autouse=True)
def _default_period(monkeypatch):
    monkeypatch.delenv(DAYS_ENV, raising=False)


def test_dry_run_counts_both_kinds_and_changes_nothing(db):
    expected = plant(db.engine)
    before = {t: snapshot(db.engine, t) for t in ("job_run", "job_checkpoint", "job_lease")}
    audit_before = audit_rows(db.engine)

    summary = run_job(
        SPEC, Scope(TENANT), RunOptions(mode="dry_run", trigger="schedule"), engine=db.engine
    )

    assert summary.status == "success"
    assert summary.eligible_count == len(expected["items"]) == 6
    assert set(summary.sample_ids) == expected["items"]
    prunable = {(r["name"], r["count"]) for r in summary.report if r["kind"] == "prunable"}
    assert prunable == {("job_run", 5), ("job_checkpoint", 1)}
    # only the dry run's own row was written
    assert snapshot(db.engine, "job_run", f"id <> '{summary.job_run_id}'") == before["job_run"]
    assert snapshot(db.engine, "job_checkpoint") == before["job_checkpoint"]
    assert snapshot(db.engine, "job_lease") == before["job_lease"]
    assert audit_rows(db.engine) == audit_before
    check = {c.name: c for c in summary.checks}["no_expired_run_history"]
    assert not check.passed and check.metadata["expired_runs"] == 5


def test_execute_prunes_only_history_past_the_period_and_only_grows_the_audit(db):
    expected = plant(db.engine)
    runs_before = run_ids(db.engine)
    checkpoints_before = snapshot(db.engine, "job_checkpoint")
    other_before = snapshot(db.engine, "job_run", f"split_part(scope, '/', 1) = '{OTHER}'")
    audit_before = audit_rows(db.engine)

    summary = execute(db.engine)

    assert summary.status == "success", summary.as_dict()
    assert summary.counts.succeeded == 6 and summary.counts.skipped == 0
    assert summary.tally == {"runs_deleted": 5, "checkpoints_deleted": 1}
    assert all(c.passed for c in summary.checks), summary.checks
    assert run_ids(db.engine) == runs_before - expected["runs"] | {uuid.UUID(summary.job_run_id)}
    gone = checkpoints_before - snapshot(db.engine, "job_checkpoint")
    assert len(gone) == 1 and "pricing_snapshot_recalculation,tenant-001/2026-01-01" in gone.pop()
    assert snapshot(db.engine, "job_run", f"split_part(scope, '/', 1) = '{OTHER}'") == other_before
    # job_audit: every earlier row byte-identical, then the trigger row and one per batch
    after = audit_rows(db.engine)
    assert after[: len(audit_before)] == audit_before
    assert len(after) == len(audit_before) + 2
    (audit,) = prune_audits(db.engine)
    assert (audit["actor"], audit["scope"], audit["mode"], audit["decision"]) == (
        "ops-bob", TENANT, "execute", "pruned",
    )  # fmt: skip
    assert str(audit["job_run_id"]) == summary.job_run_id
    details = audit["details"]
    assert (details["runs_deleted"], details["checkpoints_deleted"]) == (5, 1)
    assert details["retention_days"] == 90 and details["cutoff"]
    assert details["runs_finished_from"] < details["runs_finished_to"]
    # the database itself refuses to rewrite it
    with pytest.raises(sa.exc.DBAPIError, match="append-only"), db.engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM job_audit"))

    again = execute(db.engine)
    assert again.status == "no_work" and again.counts.succeeded == 0
    assert len(prune_audits(db.engine)) == 1  # no batch, no prune row
    assert all(c.passed for c in again.checks)


def test_batches_are_bounded_with_one_audit_row_each(db):
    with db.engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO tenant (id, name) VALUES (:t, 'A')"), {"t": TENANT})
        add_run(conn, "quote_expiration", TENANT, 1)
        for i in range(35):
            add_run(conn, "quote_expiration", TENANT, 91 + i)

    summary = execute(db.engine, batch_size=10)

    assert (summary.status, summary.eligible_count, summary.batches) == ("success", 35, 4)
    counts = [a["details"]["runs_deleted"] for a in prune_audits(db.engine)]
    assert counts == [10, 10, 10, 5]
    assert (
        scalar(db.engine, "SELECT count(*) FROM job_run WHERE job_name = 'quote_expiration'") == 1
    )


def test_the_period_comes_from_the_environment(db, monkeypatch):
    expected = plant(db.engine)
    monkeypatch.setenv(DAYS_ENV, "110")  # the 91-day run and the 100-day checkpoint stay now
    summary = execute(db.engine)
    assert summary.tally == {"runs_deleted": 4, "checkpoints_deleted": 0}
    assert len(expected["runs"] - run_ids(db.engine)) == 4
    assert prune_audits(db.engine)[0]["details"]["retention_days"] == 110


@pytest.mark.parametrize("raw", ["6", "3651", "ninety", "-5", "30.5"])
def test_a_bad_period_is_one_line_and_changes_nothing(db, monkeypatch, raw):
    plant(db.engine)
    before = {t: snapshot(db.engine, t) for t in ("job_run", "job_checkpoint", "job_audit")}
    monkeypatch.setenv(DAYS_ENV, raw)
    with pytest.raises(ConfigError) as caught:
        execute(db.engine)
    message = str(caught.value)
    assert "\n" not in message and DAYS_ENV in message and "from 7 to 3650" in message
    assert {t: snapshot(db.engine, t) for t in before} == before


def test_a_bad_period_through_the_cli_exits_2_with_one_line(db):
    plant(db.engine)
    count = scalar(db.engine, "SELECT count(*) FROM job_run")
    env = base_env(QO_OPS_DATABASE_URL=db.env_url, **{DAYS_ENV: "3"})
    result = run_cli(
        [
            "run",
            JOB,
            "--tenant",
            TENANT,
            "--mode",
            "execute",
            "--reason",
            "x",
            "--approval",
            APPROVAL,
        ],
        env,
    )
    assert result.code == 2, result
    assert len(result.stderr.strip().splitlines()) == 1 and DAYS_ENV in result.stderr
    assert scalar(db.engine, "SELECT count(*) FROM job_run") == count


def test_settings_and_catalog_entry():
    assert history_days({}) == 90 and history_days({DAYS_ENV: " 30 "}) == 30
    assert CATALOG[JOB] is SPEC
    assert (
        SPEC.destructive
        and SPEC.partitioning == "tenant"
        and SPEC.deployment.backlog_threshold is None
    )


def _statuses(predicate: str, column: str) -> set[str]:
    found = re.search(rf"{re.escape(column)} IN \(([^)]*)\)", predicate)
    assert found, (column, predicate)
    return set(re.findall(r"'(\w+)'", found.group(1)))


def test_the_predicates_name_the_platforms_statuses():
    """The shared predicates write the status lists out (literals, so that every plan of the
    checkpoint lookup implies ix_job_run_active's predicate): they are the platform's."""
    assert _statuses(PRUNABLE_RUN, "r.status") == set(statuses.FINAL)
    assert _statuses(PRUNABLE_RUN, "n.status") == set(statuses.ENDED_WELL)  # the last success
    assert _statuses(PRUNABLE_CHECKPOINT, "a.status") == set(statuses.ACTIVE)
