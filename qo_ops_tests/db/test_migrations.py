"""Migrations build exactly the schema in qo_ops.db.schema, and undo it."""

from __future__ import annotations

import re

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy.exc import DBAPIError

from qo_ops.db import migrate
from qo_ops.db.schema import BUSINESS_TABLES, PLATFORM_TABLES, metadata
from qo_ops.platform.job.statuses import RunStatus


def _schema_diff(engine: sa.Engine) -> list:
    with engine.connect() as conn:
        ctx = MigrationContext.configure(
            conn,
            opts={
                "compare_server_default": False,
                "version_table": migrate.VERSION_TABLE,
                # the serves table is the migration runner's, like Alembic's version table
                "include_name": lambda name, kind, _: name != migrate.SERVES_TABLE,
            },
        )
        return compare_metadata(ctx, metadata)


def _qo_ops_tables(engine: sa.Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names()) - {migrate.VERSION_TABLE, migrate.SERVES_TABLE}


def test_up_down_up_builds_exactly_the_declared_schema(empty_db):
    engine = empty_db.engine
    migrate.upgrade(engine)
    assert migrate.current_revision(engine) == migrate.head_revision()
    assert _schema_diff(engine) == []  # every table, column, index and constraint as declared
    assert _qo_ops_tables(engine) == {t.name for t in BUSINESS_TABLES + PLATFORM_TABLES}

    migrate.downgrade(engine, "base")
    assert migrate.current_revision(engine) is None
    assert _qo_ops_tables(engine) == set()
    with engine.connect() as conn:
        leftover = conn.scalar(
            sa.text("SELECT count(*) FROM pg_proc WHERE proname = 'job_audit_refuse_change'")
        )
    assert leftover == 0

    migrate.upgrade(engine)
    assert _schema_diff(engine) == []


def test_upgrade_twice_is_a_no_op(cli, db):
    first = cli("db", "upgrade")
    second = cli("db", "upgrade")
    assert first.code == 0 and second.code == 0, first.stderr + second.stderr
    assert "already at" in second.stdout
    assert migrate.current_revision(db.engine) == migrate.head_revision()


def test_downgrade_needs_confirmation_and_changes_nothing_without_it(cli, db):
    result = cli("db", "downgrade", "--revision", "base")
    assert result.code == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "--yes" in result.stderr
    assert migrate.current_revision(db.engine) == migrate.head_revision()
    confirmed = cli("db", "downgrade", "--revision", "base", "--yes")
    assert confirmed.code == 0, confirmed.stderr
    assert migrate.current_revision(db.engine) is None


EXPECTED_INDEXES = {
    "quote": {"ix_quote_active_expiry", "ix_quote_tenant_created", "ix_quote_tenant_id"},
    "delivery_attempt_item": {"ix_delivery_attempt_item_due", "ix_delivery_attempt_item_dead"},
    "checkout_session": {"ix_checkout_session_open_idle"},
    "temp_file": {"ix_temp_file_cleanup"},
    "audit_record": {"ix_audit_record_tenant_occurred", "ix_audit_record_tenant_day_id"},
    "outbox_event": {"ix_outbox_event_unpublished", "ix_outbox_event_aggregate"},
    "customer_order": {"ix_customer_order_tenant_submitted", "ix_customer_order_tenant_id"},
    "job_run": {"ix_job_run_history", "ix_job_run_running"},
}


def _check_values(engine: sa.Engine, table: str, name: str) -> list[str]:
    """The quoted values of the live check constraint ``name`` on ``table``, in order."""
    with engine.connect() as conn:
        definition = conn.scalar(
            sa.text(
                "SELECT pg_get_constraintdef(oid) FROM pg_constraint "
                "WHERE conrelid = CAST(:table AS regclass) AND conname = :name"
            ),
            {"table": table, "name": name},
        )
    assert definition is not None, (table, name)
    return re.findall(r"'([^']*)'", definition)


def test_the_migrated_status_check_allows_exactly_the_run_statuses(db):
    """The migrations, not the declared schema, say what job_run.status may hold (the schema
    comparison above does not compare a check's text): a status added to RunStatus without
    a migration fails here."""
    allowed = _check_values(db.engine, "job_run", "ck_job_run_status_allowed")
    assert sorted(allowed) == sorted(s.value for s in RunStatus)


def test_selection_indexes_exist(db):
    inspector = sa.inspect(db.engine)
    for table, names in EXPECTED_INDEXES.items():
        present = {ix["name"] for ix in inspector.get_indexes(table)}
        assert names <= present, f"{table} lacks {names - present}"


@pytest.mark.parametrize(
    "operation",
    ["UPDATE job_audit SET reason = 'rewritten'", "DELETE FROM job_audit", "TRUNCATE job_audit"],
)
def test_job_audit_refuses_rewrites(db, operation):
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO job_audit (actor, action, job_name, scope, mode, reason, decision) "
                "VALUES ('alice', 'trigger', 'quote_expiration', 'tenant-001', 'execute', 'incident', 'allowed')"
            )
        )
    with pytest.raises(DBAPIError, match="append-only"), db.engine.begin() as conn:
        conn.execute(sa.text(operation))
    with db.engine.connect() as conn:
        row = conn.execute(sa.text("SELECT count(*), max(reason) FROM job_audit")).one()
    assert tuple(row) == (1, "incident")
