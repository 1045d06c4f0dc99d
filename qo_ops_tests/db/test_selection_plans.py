"""Every selection of SPEC.md's job catalog can be served by an index, never only a scan."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import sqlalchemy as sa

from qo_ops.demo.data import load_demo_data

AS_OF = datetime(2026, 6, 1, tzinfo=UTC)

# The selections the catalog jobs make (SPEC.md §1 and run_history_retention), as issued.
SELECTIONS = {
    "quote_expiration": (
        "quote",
        "SELECT id FROM quote WHERE tenant_id = 'tenant-001' AND status = 'ACTIVE' "
        "AND expires_at < :now ORDER BY expires_at, id LIMIT 500",
    ),
    "abandoned_checkout_close": (
        "checkout_session",
        "SELECT id FROM checkout_session WHERE tenant_id = 'tenant-001' AND status = 'OPEN' "
        "AND last_activity_at < :now - interval '24 hours' ORDER BY last_activity_at, id LIMIT 500",
    ),
    "delivery_retry": (
        "delivery_attempt_item",
        "SELECT id FROM delivery_attempt_item WHERE tenant_id = 'tenant-001' AND status = 'READY' "
        "AND next_attempt_at <= :now ORDER BY next_attempt_at, id LIMIT 100",
    ),
    "notification_publish": (
        "outbox_event",
        "SELECT id FROM outbox_event WHERE tenant_id = 'tenant-001' AND published_at IS NULL "
        "AND dead_lettered_at IS NULL AND available_at <= :now ORDER BY available_at, id LIMIT 500",
    ),
    "order_reconciliation": (
        "customer_order",
        "SELECT id FROM customer_order WHERE tenant_id = 'tenant-001' "
        "AND submitted_at >= :now - interval '1 day' AND submitted_at < :now "
        "ORDER BY submitted_at, id LIMIT 500",
    ),
    "read_model_repair": (
        "order_read_model",
        "SELECT order_id FROM order_read_model WHERE tenant_id = 'tenant-001' AND order_id > 0 "
        "ORDER BY order_id LIMIT 500",
    ),
    "pricing_snapshot_recalculation": (
        "quote",
        "SELECT id FROM quote WHERE tenant_id = 'tenant-001' AND created_at >= :now - interval '1 day' "
        "AND created_at < :now ORDER BY created_at, id LIMIT 500",
    ),
    "catalog_cache_refresh": (
        "catalog_item",
        "SELECT id FROM catalog_item WHERE tenant_id = 'tenant-001' AND id > 0 ORDER BY id LIMIT 500",
    ),
    "temp_file_cleanup": (
        "temp_file",
        "SELECT id FROM temp_file WHERE tenant_id = 'tenant-001' AND legal_hold = false "
        "AND status IN ('COMPLETED', 'FAILED_TERMINAL') AND created_at < :now - interval '7 days' "
        "ORDER BY created_at, id LIMIT 500",
    ),
    "run_history_retention": (
        "job_run",
        "SELECT id FROM job_run WHERE split_part(scope, '/', 1) = 'tenant-001' "
        "AND finished_at < :now - interval '90 days' ORDER BY finished_at LIMIT 500",
    ),
    "audit_archive": (
        "audit_record",
        "SELECT id FROM audit_record WHERE tenant_id = 'tenant-001' "
        "AND occurred_at < :now - interval '365 days' ORDER BY occurred_at, id LIMIT 500",
    ),
}


@pytest.fixture(scope="module")
def loaded(pg_server, template_database):
    from qo_ops_tests.conftest import _test_database

    gen = _test_database(pg_server, template_database)
    database = next(gen)
    load_demo_data(database.engine, tenants=3, quotes=3000, seed=3, as_of=AS_OF)
    with database.engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE")
    yield database
    gen.close()


@pytest.mark.parametrize("job", sorted(SELECTIONS))
def test_selection_is_index_backed(loaded, job):
    table, sql = SELECTIONS[job]
    with loaded.engine.connect() as conn:
        conn.exec_driver_sql("SET enable_seqscan = off")  # only a usable index avoids a Seq Scan
        plan = "\n".join(
            r[0] for r in conn.execute(sa.text(f"EXPLAIN {sql}"), {"now": AS_OF}).all()
        )
    assert f"Seq Scan on {table}" not in plan, plan
    assert "Index" in plan, plan
