"""The database roles of migration 0005: the catalog grants exactly ``qo_ops.db.roles``'
matrix, and real logins in each role can do their work and nothing else.

Roles are cluster-wide: every login made here has a unique name and is dropped when its
test ends (``DROP OWNED`` in the test's database, then ``DROP ROLE``). The logins carry a
random password so that a server which does not trust local connections
(``QO_OPS_TEST_DATABASE_URL``) accepts them too.

A database copied from a template does not inherit the template's database-level ACL
(CONNECT, TEMPORARY): what the migration does to those is tested on a database migrated in
place (``empty_db``).
"""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from qo_ops.db import migrate
from qo_ops.db.roles import (
    API,
    EXPECTED,
    EXPECTED_SEQUENCES,
    READONLY,
    ROLES,
    RUNNER,
    TABLE_NAMES,
    differences,
    privilege_matrix,
    sequence_privileges,
)
from qo_ops.db.schema import BUSINESS_TABLES, PLATFORM_TABLES
from qo_ops.demo.data import load_demo_data
from qo_ops.jobs.audit_archive import restore_day
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.actions import recovery
from qo_ops.platform.actions.status import job_status
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.outcome import BatchContext
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.job.spec import JobSpec
from qo_ops.platform.run import records
from qo_ops.platform.run.faults import CRASH_ENV
from qo_ops.platform.run.runner import RunSummary, count_eligible, run_job
from qo_ops_tests.jobs.test_run_history_retention import plant_old_history

if TYPE_CHECKING:
    pass

AS_OF = datetime(2026, 3, 1, tzinfo=UTC)
TENANT = "tenant-001"
ALL_TABLES = [t.name for t in (*PLATFORM_TABLES, *BUSINESS_TABLES)]
SECRET_TABLES = ("api_token", "api_idempotency")
# What the API's recovery actions write on business tables (migration 0014), and no more
API_RECOVERY_WRITES = {
    "delivery_attempt_item": {"UPDATE"},
    "customer_order": {"UPDATE"},
    "order_resubmission": {"INSERT"},
}
# delivery_retry first: it hands orders to the simulator, which order_reconciliation then finds
# The catalog's jobs, in its order, run_history_retention last: it prunes the old history
# plant_old_history plants (a new job needs no edit here).
JOB_ORDER = sorted(CATALOG, key=lambda name: name == "run_history_retention")


# --------------------------------------------------------------------------- logins


def refused(engine: Engine, statement: str) -> None:
    """``statement`` fails with PostgreSQL's own permission check (not a trigger's)."""
    with pytest.raises(sa.exc.DBAPIError) as caught, engine.begin() as conn:
        conn.exec_driver_sql(statement)
    orig = caught.value.orig
    assert isinstance(orig, psycopg.errors.InsufficientPrivilege), (statement, orig)
    assert "permission denied" in str(orig), (statement, str(orig))


def _first_column(table: str) -> str:
    if table == migrate.VERSION_TABLE:
        return "version_num"
    return next(t for t in (*PLATFORM_TABLES, *BUSINESS_TABLES) if t.name == table).c[0].name


def recover(login: Engine, db) -> None:
    """What the recovery commands and API actions write, as ``login``: every kind of dead
    letter requeued, a flagged order decided, a checkpoint reset (four audit rows)."""
    who = recovery.Who("roles-test", "roles test")
    for name in ("delivery_retry", "notification_publish"):
        recovery.requeue(login, CATALOG[name], who, recovery.DeadLetters(TENANT))
    with db.engine.begin() as conn:  # as the owner: orders waiting for a person (planted)
        flagged = (
            conn.execute(
                sa.text(
                    "UPDATE customer_order SET needs_manual_review = true WHERE id IN (SELECT id "
                    "FROM customer_order WHERE tenant_id = :t AND status IN ('SUBMITTED', "
                    "'IN_FULFILLMENT') AND NOT needs_manual_review AND EXISTS (SELECT 1 FROM "
                    "delivery_attempt_item d WHERE d.order_id = customer_order.id AND d.status "
                    "<> 'IN_PROGRESS') ORDER BY id LIMIT 2) RETURNING order_number"
                ),
                {"t": TENANT},
            )
            .scalars()
            .all()
        )
    assert len(flagged) == 2
    review = CATALOG["order_reconciliation"]
    for number, action in zip(flagged, ("dismiss", "resubmit"), strict=True):
        decided = recovery.resolve(login, review, who, recovery.Decision(TENANT, number, action))
        assert decided.changed == 1, decided
    recovery.reset_checkpoints(
        login, CATALOG["pricing_snapshot_recalculation"], who, recovery.Checkpoints(TENANT)
    )


# --------------------------------------------------------------------------- the catalog


def test_granted_privileges_are_exactly_the_matrix(db):
    with db.engine.connect() as conn:
        actual = privilege_matrix(conn)
        sequences = sequence_privileges(conn)
        other = conn.execute(
            sa.text(
                """
                SELECT r.rolname, has_schema_privilege(r.oid, 'public', 'USAGE') AS usage,
                       has_schema_privilege(r.oid, 'public', 'CREATE') AS create_in_schema,
                       has_database_privilege(r.oid, current_database(), 'CREATE') AS create_schema,
                       r.rolcanlogin, r.rolsuper, r.rolcreaterole, r.rolcreatedb, r.rolbypassrls
                  FROM pg_roles r WHERE r.rolname = ANY(CAST(:roles AS text[]))
                """
            ),
            {"roles": list(ROLES)},
        ).all()
    assert set(EXPECTED) == set(ROLES)
    for role in ROLES:  # every table of the schema, and only those, in both
        assert set(EXPECTED[role]) == set(TABLE_NAMES) == set(actual[role]), role
    assert differences(EXPECTED, actual) == []
    assert sequences == EXPECTED_SEQUENCES
    assert len(other) == 3
    for row in other:
        assert row.usage and not row.create_in_schema and not row.create_schema, row
        assert not (row.rolcanlogin or row.rolsuper or row.rolcreaterole or row.rolcreatedb)
        assert not row.rolbypassrls


def test_no_role_may_rewrite_the_audit_trail_or_read_secrets():
    for role in ROLES:
        assert not EXPECTED[role]["job_audit"] & {"UPDATE", "DELETE", "TRUNCATE"}, role
        for table in ALL_TABLES:
            assert "TRUNCATE" not in EXPECTED[role][table], (role, table)
    assert not EXPECTED[RUNNER]["api_token"] and not EXPECTED[RUNNER]["api_idempotency"]
    assert not EXPECTED[READONLY]["api_token"] and not EXPECTED[READONLY]["api_idempotency"]
    for business in BUSINESS_TABLES:  # the API reads, and writes what recovery writes
        writes = API_RECOVERY_WRITES.get(business.name, set())
        assert EXPECTED[API][business.name] == {"SELECT", *writes}, business.name
        assert EXPECTED[READONLY][business.name] == {"SELECT"}, business.name


# --------------------------------------------------------------------------- the runner


def _scope_with_work(engine: Engine, spec: JobSpec) -> Scope:
    """The tenant, or the tenant's first day with work (looked up as the given login)."""
    if spec.partitioning == "tenant":
        return Scope(TENANT)
    with engine.connect() as conn:
        for offset in range(120):
            day = date(2026, 1, 1) + timedelta(days=offset)
            scope = Scope(TENANT, day, day + timedelta(days=1))
            if count_eligible(conn, spec, BatchContext(spec.name, scope, "dry_run", uuid.uuid4())):
                return scope
    raise AssertionError(f"no day with work for {spec.name}")


def _plant_mismatches(owner: Engine, downstream, scope: Scope) -> None:
    """The downstream finished one in-flight order of ``scope`` and has one we never sent,
    so order_reconciliation adopts a status (UPDATE customer_order) and records both."""
    start, end = scope.window_bounds()
    with owner.connect() as conn:
        order_number = conn.scalar(
            sa.text(
                "SELECT order_number FROM customer_order WHERE tenant_id = :t "
                "AND submitted_at >= :s AND submitted_at < :e "
                "AND status IN ('SUBMITTED', 'IN_FULFILLMENT') AND NOT needs_manual_review "
                "ORDER BY id LIMIT 1"
            ),
            {"t": scope.tenant_id, "s": start, "e": end},
        )
    downstream.client.put_order(order_number, scope.tenant_id, "COMPLETED")
    downstream.client.put_order("ORD-ROLES-UNKNOWN", scope.tenant_id, "SUBMITTED")


def test_runner_runs_every_job_and_is_refused_the_rest(
    db, logins, downstream, monkeypatch, tmp_path
):
    monkeypatch.setenv("QO_OPS_HOME", str(tmp_path))  # archives and objects
    monkeypatch.setenv("QO_OPS_AUDIT_RETENTION_DAYS", "90")  # so 2026 days have audit work
    monkeypatch.setenv("QO_OPS_DOWNSTREAM_URL", downstream.url)
    monkeypatch.delenv(CRASH_ENV, raising=False)
    load_demo_data(db.engine, tenants=2, quotes=400, seed=9, as_of=AS_OF)  # as the owner
    runner = logins.create(db, RUNNER)
    assert JOB_ORDER[-1] == "run_history_retention" and len(JOB_ORDER) == len(CATALOG)

    migrate.require_current(runner)  # every command starts with it
    summaries: dict[str, tuple[Scope, RunSummary]] = {}
    for name in JOB_ORDER:
        spec = CATALOG[name]
        scope = _scope_with_work(runner, spec)
        if name == "order_reconciliation":
            _plant_mismatches(db.engine, downstream, scope)
        if name == "run_history_retention":
            plant_old_history(db.engine, TENANT)
        summary = run_job(
            spec, scope, RunOptions(mode="execute", trigger="schedule"), engine=runner
        )
        summaries[name] = (scope, summary)
    tally = summaries["order_reconciliation"][1].tally
    assert tally.get("terminal_not_reflected") and tally.get("unknown_downstream"), tally
    # orders never delivered are re-submitted: the runner appends to order_resubmission
    assert tally.get("side_effect.order_resubmit_requested_event.success"), tally
    for name, (_, s) in summaries.items():
        assert "permission denied" not in (s.error_text or ""), (name, s.error_text)
        assert s.status in ("success", "partial_success"), (name, s.status, s.error_text)
        assert s.counts.succeeded > 0, (name, s.as_dict())

    # the rest of what the job commands do: status, a manual (audited) run, cancel, reap,
    # requeue, review resolve, checkpoint reset, archive restore
    for spec in CATALOG.values():
        assert job_status(runner, spec, TENANT)
    manual = run_job(
        CATALOG["quote_expiration"],
        Scope("tenant-002"),
        RunOptions(mode="dry_run", trigger="manual", requester="roles-test", reason="roles test"),
        engine=runner,
    )
    assert manual.status in ("success", "no_work")
    records.request_cancel(runner, uuid.UUID(manual.job_run_id), "roles-test", "roles test")
    records.reap_orphans(runner)
    recover(runner, db)
    archive_day = summaries["audit_archive"][0].window_start
    assert archive_day is not None
    restored = restore_day(runner, TENANT, archive_day, actor="roles-test", reason="roles test")
    assert restored.restored_rows == summaries["audit_archive"][1].counts.succeeded > 0

    with db.engine.connect() as conn:  # as the owner: every run finished, every lease released
        unfinished = conn.scalar(sa.text("SELECT count(*) FROM job_run WHERE finished_at IS NULL"))
        held = conn.scalar(
            sa.text("SELECT count(*) FROM job_lease WHERE expires_at > clock_timestamp()")
        )
        denied = conn.scalar(
            sa.text("SELECT count(*) FROM job_run WHERE last_error_text ILIKE '%permission%'")
        )
        audited = conn.scalar(sa.text("SELECT count(*) FROM job_audit WHERE actor = 'roles-test'"))
    assert (unfinished, held, denied) == (0, 0, 0)
    # trigger, cancel, requeue × 2, review × 2, checkpoint_reset, archive_restore
    assert audited == 8

    for statement in (
        "UPDATE job_audit SET reason = 'rewritten'",
        "DELETE FROM job_audit",
        "TRUNCATE job_audit",
        "SELECT * FROM api_token",
        "SELECT * FROM api_idempotency",
        "INSERT INTO api_idempotency (identity, idempotency_key, request_sha256, job_run_id) "
        "VALUES ('x', 'y', 'z', gen_random_uuid())",
        "CREATE TABLE made_by_runner (id int)",
        "CREATE VIEW made_by_runner AS SELECT 1 AS one",
        "DELETE FROM job_lease",
        "DELETE FROM outbox_event",
        "DELETE FROM quote",
        "INSERT INTO quote (tenant_id) VALUES ('tenant-001')",
        "UPDATE tenant SET name = name",
        "UPDATE price_book SET version = version",
        "SELECT * FROM downstream_order",
        "TRUNCATE quote",
        "TRUNCATE temp_file",
    ):
        refused(runner, statement)


# --------------------------------------------------------------------------- the API


def test_api_writes_runs_audit_rows_and_what_recovery_writes_only(db, logins):
    load_demo_data(db.engine, tenants=2, quotes=100, seed=9, as_of=AS_OF)
    api = logins.create(db, API)
    migrate.require_current(api)
    run_id = uuid.uuid4()
    with api.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO job_run (id, job_name, scope, mode, trigger_type, owner_id, status, "
                "requester, reason) VALUES (:id, 'quote_expiration', 'tenant-001', 'execute', "
                "'api', 'api', 'accepted', 'alice', 'roles test')"
            ),
            {"id": run_id},
        )
        conn.execute(
            sa.text(
                "UPDATE job_run SET cancel_requested_at = now(), dagster_run_id = 'd-1', "
                "approved_by = 'bob', approved_at = now() WHERE id = :id"
            ),
            {"id": run_id},
        )
        conn.execute(
            sa.text(
                "INSERT INTO job_audit (actor, action, job_name, scope, mode, reason, decision, "
                "job_run_id, request_id) VALUES ('alice', 'trigger', 'quote_expiration', "
                "'tenant-001', 'execute', 'roles test', 'accepted', :id, 'req-1')"
            ),
            {"id": run_id},
        )
        conn.execute(
            sa.text(
                "INSERT INTO api_idempotency (identity, idempotency_key, request_sha256, "
                "job_run_id) VALUES ('alice', 'key-1', 'sha', :id)"
            ),
            {"id": run_id},
        )
        conn.exec_driver_sql(
            "DELETE FROM api_idempotency WHERE created_at < now() - interval '1 day'"
        )
        assert conn.exec_driver_sql("SELECT count(*) FROM api_token").scalar() == 0
        for table in BUSINESS_TABLES:
            conn.exec_driver_sql(f"SELECT count(*) FROM {table.name}").scalar()
    for spec in CATALOG.values():  # the status endpoint's backlog: each job's selection
        assert job_status(api, spec, TENANT)
    for day in (date(2026, 2, 10), date(2026, 2, 11)):  # a checkpoint to reset (as the runner)
        with db.engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO job_checkpoint (job_name, scope, cursor, job_run_id, updated_at) "
                    "VALUES ('pricing_snapshot_recalculation', :s, '{\"last_id\": 1}', :r, now())"
                ),
                {"s": Scope.days(TENANT, day, day).key, "r": uuid.uuid4()},
            )
    recover(api, db)
    with db.engine.connect() as conn:
        assert conn.scalar(sa.text("SELECT count(*) FROM job_checkpoint")) == 0

    for statement in (
        "DELETE FROM quote",
        "UPDATE quote SET status = status",
        "INSERT INTO quote (tenant_id) VALUES ('tenant-001')",
        "DELETE FROM job_run",
        "UPDATE job_audit SET reason = 'rewritten'",
        "DELETE FROM job_audit",
        "DELETE FROM job_lease",
        "UPDATE job_checkpoint SET cursor = cursor",
        "INSERT INTO job_checkpoint (job_name) VALUES ('x')",
        "DELETE FROM outbox_event",
        "UPDATE api_token SET revoked_at = now()",
        "INSERT INTO api_token (id) VALUES ('0123456789abcdef')",
        "UPDATE api_idempotency SET job_run_id = job_run_id",
        "CREATE TABLE made_by_api (id int)",
        *(f"TRUNCATE {table}" for table in (*ALL_TABLES, migrate.VERSION_TABLE)),
        *(f"DELETE FROM {t.name}" for t in BUSINESS_TABLES),
        *(
            f"UPDATE {t.name} SET {t.c[0].name} = {t.c[0].name}"
            for t in BUSINESS_TABLES
            if "UPDATE" not in API_RECOVERY_WRITES.get(t.name, ())
        ),
    ):
        refused(api, statement)


# --------------------------------------------------------------------------- read-only


def test_readonly_reads_and_nothing_more(db, logins):
    load_demo_data(db.engine, tenants=2, quotes=100, seed=9, as_of=AS_OF)
    readonly = logins.create(db, READONLY)
    migrate.require_current(readonly)
    with readonly.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM quote").scalar() > 0
        conn.exec_driver_sql("SELECT count(*) FROM job_run").scalar()
        for table in ALL_TABLES:
            if table not in SECRET_TABLES:
                conn.exec_driver_sql(f"SELECT count(*) FROM {table}").scalar()
    for spec in CATALOG.values():
        assert job_status(readonly, spec, TENANT)

    for statement in (
        "SELECT * FROM api_token",
        "SELECT * FROM api_idempotency",
        "SELECT id FROM job_run FOR UPDATE",  # a row lock is a write
        "SELECT id FROM quote FOR SHARE",
        "CREATE TABLE made_by_readonly (id int)",
    ):
        refused(readonly, statement)
    for table in (*ALL_TABLES, migrate.VERSION_TABLE):
        column = _first_column(table)
        refused(readonly, f"INSERT INTO {table} DEFAULT VALUES")
        refused(readonly, f"UPDATE {table} SET {column} = {column}")
        refused(readonly, f"DELETE FROM {table}")
        refused(readonly, f"TRUNCATE {table}")


# --------------------------------------------------------------------------- the migration


def _database_privileges(engine: Engine) -> dict[str, tuple[bool, bool, bool]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT rolname, has_database_privilege(oid, current_database(), 'CONNECT'), "
                "has_database_privilege(oid, current_database(), 'TEMPORARY'), "
                "has_database_privilege(oid, current_database(), 'CREATE') "
                "FROM pg_roles WHERE rolname = ANY(CAST(:roles AS text[]))"
            ),
            {"roles": list(ROLES)},
        ).all()
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


def _public_database_privileges(engine: Engine) -> set[str]:
    with engine.connect() as conn:
        return set(
            conn.execute(
                sa.text(
                    "SELECT a.privilege_type FROM pg_database d, aclexplode(d.datacl) a "
                    "WHERE d.datname = current_database() AND a.grantee = 0"
                )
            ).scalars()
        )


def test_migration_in_place_closes_the_database_and_downgrade_revokes(empty_db, logins):
    engine = empty_db.engine
    migrate.upgrade(engine)
    assert _public_database_privileges(engine) == set()  # PUBLIC: no CONNECT, no TEMPORARY
    assert _database_privileges(engine) == dict.fromkeys(ROLES, (True, False, False))

    stranger = logins.create(empty_db, None)  # a login in none of the roles
    with pytest.raises(sa.exc.OperationalError, match="permission denied for database"):
        stranger.connect().close()
    runner = logins.create(empty_db, RUNNER)
    with runner.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM job_run").scalar() == 0
    refused(runner, "CREATE TEMP TABLE scratch (id int)")
    refused(runner, "CREATE SCHEMA made_by_runner")
    refused(runner, "CREATE TABLE made_by_runner (id int)")

    migrate.downgrade(engine, "0004")
    with engine.connect() as conn:
        assert all(not p for m in privilege_matrix(conn).values() for p in m.values())
        assert sequence_privileges(conn) == dict.fromkeys(ROLES, frozenset())
        schema_usage = conn.execute(
            sa.text(
                "SELECT count(*) FROM pg_namespace n, aclexplode(n.nspacl) a "
                "JOIN pg_roles r ON r.oid = a.grantee "
                "WHERE n.nspname = 'public' AND r.rolname = ANY(CAST(:roles AS text[]))"
            ),
            {"roles": list(ROLES)},
        ).scalar()
    assert schema_usage == 0
    assert _public_database_privileges(engine) == {"CONNECT", "TEMPORARY"}  # the defaults
    with engine.connect() as conn:  # the roles stay: other databases may use them
        assert conn.scalar(
            sa.text("SELECT count(*) FROM pg_roles WHERE rolname = ANY(CAST(:r AS text[]))"),
            {"r": list(ROLES)},
        ) == len(ROLES)

    migrate.upgrade(engine)  # and up again: the roles exist already
    with engine.connect() as conn:
        assert differences(EXPECTED, privilege_matrix(conn)) == []
        assert sequence_privileges(conn) == EXPECTED_SEQUENCES
    assert _public_database_privileges(engine) == set()
