"""abandoned_checkout_close through the one runner and the real ``qo-ops`` command: dry-run
writes nothing and counts exactly what execute closes, execute abandons exactly the idle
OPEN sessions of its tenant with one CheckoutAbandoned event each, a second run is no work,
the idle timeout comes from QO_OPS_CHECKOUT_IDLE_HOURS, and the outcome checks tell the
truth about a broken state (without blaming sessions the application closed itself)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa

from qo_ops.db.digest import database_digest
from qo_ops.db.schema import BUSINESS_TABLES, outbox_event
from qo_ops.demo.data import load_demo_data
from qo_ops.errors import ConfigError
from qo_ops.jobs.abandoned_checkout_close import IDLE_HOURS_ENV, SPEC, idle_timeout_hours
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.runner import RunSummary, run_job

AS_OF = datetime(2026, 3, 1, tzinfo=UTC)  # in the past: every OPEN checkout is idle by now
TENANT, OTHER = "tenant-001", "tenant-002"
JOB = "abandoned_checkout_close"
CHECKS = ["no_idle_open_checkouts", "one_event_per_abandoned_checkout"]
DATA_TABLES = (*BUSINESS_TABLES, outbox_event)


def rows(engine: sa.Engine, sql: str, **params: Any) -> list[sa.Row]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text(sql), params).all())


def scalar(engine: sa.Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


def eligible_ids(engine: sa.Engine, tenant: str = TENANT, hours: int = 24) -> list[int]:
    """OPEN sessions of ``tenant`` idle more than ``hours``, in the job's order; independent."""
    return [
        r.id
        for r in rows(
            engine,
            "SELECT id FROM checkout_session WHERE tenant_id = :t AND status = 'OPEN' "
            "AND last_activity_at < now() - :h * interval '1 hour' ORDER BY last_activity_at, id",
            t=tenant,
            h=hours,
        )
    ]


def session_states(engine: sa.Engine, ids: list[int]) -> dict[int, tuple[str, int, bool]]:
    """(status, version, has closed_at) per session."""
    return {
        r.id: (r.status, r.version, r.closed_at is not None)
        for r in rows(
            engine,
            "SELECT id, status, version, closed_at FROM checkout_session WHERE id = ANY(:ids)",
            ids=list(ids),
        )
    }


def events_per_session(engine: sa.Engine, ids: list[int]) -> dict[int, int]:
    found = dict.fromkeys(ids, 0)
    for r in rows(
        engine,
        "SELECT aggregate_id, count(*) AS n FROM outbox_event "
        "WHERE event_type = 'CheckoutAbandoned' AND aggregate_id = ANY(:ids) GROUP BY aggregate_id",
        ids=[str(i) for i in ids],
    ):
        found[int(r.aggregate_id)] = r.n
    return found


def tenant_fingerprint(engine: sa.Engine, tenant: str) -> tuple[str, str]:
    return (
        scalar(
            engine,
            "SELECT md5(string_agg(s::text, '|' ORDER BY s.id)) FROM checkout_session s "
            "WHERE s.tenant_id = :t",
            t=tenant,
        ),
        scalar(
            engine,
            "SELECT md5(coalesce(string_agg(e::text, '|' ORDER BY e.id), '')) FROM outbox_event e "
            "WHERE e.tenant_id = :t",
            t=tenant,
        ),
    )


def data_digest(engine: sa.Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return database_digest(conn, DATA_TABLES)


def run(engine: sa.Engine, tenant: str = TENANT, **options: Any) -> RunSummary:
    options.setdefault("mode", "execute")
    options.setdefault("requester", "test:abandoned-checkout-close")
    options.setdefault("reason", "test run")
    return run_job(SPEC, Scope(tenant), RunOptions(**options), engine=engine)


def checks_of(summary: RunSummary) -> dict[str, Any]:
    assert [c.name for c in summary.checks] == [c.name for c in SPEC.checks] == CHECKS
    return {c.name: c for c in summary.checks}


def assert_all_checks_passed(summary: RunSummary) -> None:
    failed = [(c.name, c.metadata) for c in checks_of(summary).values() if not c.passed]
    assert failed == []


@pytest.fixture(autouse=True)
def _default_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(IDLE_HOURS_ENV, raising=False)


@pytest.fixture
def loaded(db):
    """Two tenants; every OPEN checkout is idle past 24 h by now, and the application has
    closed some sessions itself (ABANDONED, with no event)."""
    load_demo_data(db.engine, tenants=2, quotes=1000, seed=11, as_of=AS_OF)
    eligible = eligible_ids(db.engine)
    assert len(eligible) >= 50
    assert eligible_ids(db.engine, OTHER)
    app_closed = scalar(
        db.engine,
        "SELECT count(*) FROM checkout_session s WHERE tenant_id = :t AND status = 'ABANDONED' "
        "AND NOT EXISTS (SELECT 1 FROM outbox_event e WHERE e.aggregate_id = s.id::text "
        "AND e.event_type = 'CheckoutAbandoned')",
        t=TENANT,
    )
    assert app_closed > 0
    return db, eligible


# ------------------------------------------------------------------------- dry-run


def test_dry_run_writes_nothing_and_counts_exactly_what_execute_then_closes(loaded):
    db, eligible = loaded
    before = data_digest(db.engine)

    dry = run(db.engine, mode="dry_run")

    assert data_digest(db.engine) == before
    assert (dry.status, dry.eligible_count, dry.counts.processed) == ("success", len(eligible), 0)
    assert dry.sample_ids == [str(i) for i in eligible[:10]]
    checks = checks_of(dry)
    assert not checks["no_idle_open_checkouts"].passed
    assert checks["no_idle_open_checkouts"].metadata["idle_open_checkouts"] == len(eligible)
    assert checks["one_event_per_abandoned_checkout"].passed  # app-closed sessions are not ours

    executed = run(db.engine, batch_size=9)

    states = session_states(db.engine, eligible)
    closed = {i for i, (status, _, _) in states.items() if status == "ABANDONED"}
    assert executed.counts.succeeded == dry.eligible_count == len(closed) == len(eligible)


# ------------------------------------------------------------------------- execute


def test_execute_abandons_every_idle_session_with_one_event_each_and_nothing_else(loaded):
    db, eligible = loaded
    versions = {i: v for i, (_, v, _) in session_states(db.engine, eligible).items()}
    other_before = tenant_fingerprint(db.engine, OTHER)
    untouched_sql = (
        "SELECT md5(string_agg(s::text, '|' ORDER BY id)) FROM checkout_session s "
        "WHERE tenant_id = :t AND id <> ALL(:ids)"
    )
    untouched_before = scalar(db.engine, untouched_sql, t=TENANT, ids=eligible)
    events_before = scalar(db.engine, "SELECT count(*) FROM outbox_event")

    summary = run(db.engine, batch_size=9)

    assert summary.status == "success"
    assert summary.eligible_count == summary.counts.processed == summary.counts.succeeded
    assert summary.counts.succeeded == len(eligible)
    assert (
        summary.counts.failed == summary.counts.skipped == summary.counts.duplicates_prevented == 0
    )
    assert summary.batches == -(-len(eligible) // 9)
    assert_all_checks_passed(summary)

    assert session_states(db.engine, eligible) == {
        i: ("ABANDONED", versions[i] + 1, True) for i in eligible
    }
    events = rows(
        db.engine,
        "SELECT business_key, tenant_id, aggregate_type, aggregate_id, event_type, payload "
        "FROM outbox_event WHERE business_key = ANY(:keys)",
        keys=[f"checkout:{i}:abandoned" for i in eligible],
    )
    assert len(events) == len(eligible)
    for e in events:
        session_id = int(e.aggregate_id)
        assert e.business_key == f"checkout:{session_id}:abandoned"
        assert (e.tenant_id, e.aggregate_type, e.event_type) == (
            TENANT,
            "checkout",
            "CheckoutAbandoned",
        )
        assert e.payload["checkout_id"] == session_id
        assert e.payload["version"] == versions[session_id] + 1
    assert set(events_per_session(db.engine, eligible).values()) == {1}
    assert scalar(db.engine, "SELECT count(*) FROM outbox_event") == events_before + len(eligible)
    assert eligible_ids(db.engine) == []

    assert scalar(db.engine, untouched_sql, t=TENANT, ids=eligible) == untouched_before
    assert tenant_fingerprint(db.engine, OTHER) == other_before
    assert eligible_ids(db.engine, OTHER)


def test_a_second_execute_is_no_work_and_changes_nothing(loaded):
    db, eligible = loaded
    assert run(db.engine).counts.succeeded == len(eligible)
    before = data_digest(db.engine)

    again = run(db.engine)

    assert (again.status, again.eligible_count, again.counts.succeeded) == ("no_work", 0, 0)
    assert data_digest(db.engine) == before
    assert_all_checks_passed(again)


def test_sessions_locked_elsewhere_are_skipped_and_closed_by_the_next_run(loaded):
    db, eligible = loaded
    held = eligible[4:7]
    with db.engine.connect() as other:
        other.execute(
            sa.text("SELECT id FROM checkout_session WHERE id = ANY(:ids) FOR UPDATE"),
            {"ids": held},
        )
        first = run(db.engine, batch_size=5)
        other.rollback()

    assert (first.status, first.counts.succeeded) == ("success", len(eligible) - len(held))
    assert eligible_ids(db.engine) == held
    idle = checks_of(first)["no_idle_open_checkouts"]
    assert (idle.passed, idle.metadata["idle_open_checkouts"]) == (False, len(held))

    second = run(db.engine)

    assert (second.status, second.counts.succeeded) == ("success", len(held))
    assert set(events_per_session(db.engine, eligible).values()) == {1}
    assert_all_checks_passed(second)


# ------------------------------------------------------------------------- outcome checks


def test_the_outcome_checks_fail_with_the_counts_of_a_broken_state(loaded):
    db, eligible = loaded
    assert_all_checks_passed(run(db.engine))
    with db.engine.begin() as conn:
        # one more session went idle past the timeout and is still OPEN
        conn.execute(
            sa.text(
                "INSERT INTO checkout_session (tenant_id, status, started_at, last_activity_at) "
                "VALUES (:t, 'OPEN', now() - interval '50 hours', now() - interval '48 hours')"
            ),
            {"t": TENANT},
        )
        # a session the job closed lost its event; another got a second one
        conn.execute(
            sa.text("DELETE FROM outbox_event WHERE business_key = :k"),
            {"k": f"checkout:{eligible[0]}:abandoned"},
        )
        conn.execute(
            sa.text(
                "INSERT INTO outbox_event (id, business_key, tenant_id, aggregate_type, "
                "aggregate_id, event_type) VALUES (gen_random_uuid(), 'dup', :t, 'checkout', "
                ":id, 'CheckoutAbandoned')"
            ),
            {"t": TENANT, "id": str(eligible[1])},
        )

    checks = checks_of(run(db.engine, mode="dry_run"))

    idle, events = checks["no_idle_open_checkouts"], checks["one_event_per_abandoned_checkout"]
    assert not idle.passed
    assert idle.metadata == {"idle_open_checkouts": 1, "idle_timeout_hours": 24}
    assert not events.passed
    assert events.metadata == {"missing_events": 1, "duplicated_events": 1}


# ------------------------------------------------------------------------- idle timeout


def test_the_idle_timeout_comes_from_the_environment(db, monkeypatch):
    # anchored now: sessions are idle between 0 minutes and ~6 days
    load_demo_data(db.engine, tenants=2, quotes=1000, seed=12, as_of=datetime.now(UTC))
    by_default, by_72h = eligible_ids(db.engine), eligible_ids(db.engine, hours=72)
    assert 0 < len(by_72h) < len(by_default)
    assert set(by_72h) < set(by_default)

    monkeypatch.setenv(IDLE_HOURS_ENV, "72")
    dry = run(db.engine, mode="dry_run")
    executed = run(db.engine)

    assert dry.eligible_count == executed.counts.succeeded == len(by_72h)
    assert {s for s, _, _ in session_states(db.engine, by_72h).values()} == {"ABANDONED"}
    rest = [i for i in by_default if i not in by_72h]
    assert {s for s, _, _ in session_states(db.engine, rest).values()} == {"OPEN"}
    idle = checks_of(executed)["no_idle_open_checkouts"]
    assert (idle.passed, idle.metadata["idle_timeout_hours"]) == (True, 72)

    monkeypatch.delenv(IDLE_HOURS_ENV)
    assert run(db.engine, mode="dry_run").eligible_count == len(rest)
    assert run(db.engine).counts.succeeded == len(rest)
    assert set(events_per_session(db.engine, by_default).values()) == {1}


@pytest.mark.parametrize("value", ["0", "-3", "1.5", "abc", "8761"])
def test_an_invalid_idle_timeout_is_refused(value):
    with pytest.raises(ConfigError, match=IDLE_HOURS_ENV):
        idle_timeout_hours({IDLE_HOURS_ENV: value})


def test_the_idle_timeout_defaults_to_24_hours():
    assert idle_timeout_hours({}) == idle_timeout_hours({IDLE_HOURS_ENV: " "}) == 24
    assert idle_timeout_hours({IDLE_HOURS_ENV: "48"}) == 48


# ------------------------------------------------------------------------- Dagster test data


def test_does_real_work_on_the_dagster_test_data(db):
    load_demo_data(db.engine, tenants=2, quotes=400, seed=9, as_of=AS_OF)
    eligible = eligible_ids(db.engine)

    dry = run(db.engine, mode="dry_run")
    executed = run(db.engine)

    assert dry.eligible_count == len(eligible) > 0
    assert (executed.status, executed.counts.succeeded) == ("success", len(eligible))
    assert_all_checks_passed(executed)


# ------------------------------------------------------------------------- CLI


def test_cli_execute_abandons_the_idle_checkouts(loaded, cli):
    """Passes once the SPEC is registered in qo_ops/jobs/catalog.py."""
    db, eligible = loaded

    result = cli("run", JOB, "--tenant", TENANT, "--mode", "execute", "--reason", "x", "--json")

    assert result.code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert (summary["mode"], summary["status"]) == ("execute", "success")
    assert summary["eligible_count"] == summary["succeeded_count"] == len(eligible)
    assert [(c["name"], c["passed"]) for c in summary["checks"]] == [(n, True) for n in CHECKS]
    assert eligible_ids(db.engine) == []
    assert set(events_per_session(db.engine, eligible).values()) == {1}


def test_a_bad_idle_timeout_is_refused_before_anything_is_written(db, cli, monkeypatch):
    monkeypatch.setenv("QO_OPS_CHECKOUT_IDLE_HOURS", "soon")
    from qo_ops_tests.conftest import base_env, run_cli

    result = run_cli(
        [
            "run",
            "abandoned_checkout_close",
            "--tenant",
            "tenant-001",
            "--mode",
            "execute",
            "--reason",
            "x",
        ],
        base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_CHECKOUT_IDLE_HOURS="soon"),
    )
    assert result.code == 2 and "QO_OPS_CHECKOUT_IDLE_HOURS" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    with db.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM job_run").scalar() == 0
        assert conn.exec_driver_sql("SELECT count(*) FROM job_lease").scalar() == 0
