"""Demo data: deterministic, with exactly the anomalies it promises, loaded whole or not at
all; every temp file row with its stored object, which a reset removes again."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa

from qo_ops.db.digest import database_digest
from qo_ops.db.schema import metadata
from qo_ops.demo.data import DemoDataExists, demo_object, load_demo_data
from qo_ops.demo.rules import DemoPlan
from qo_ops.downstream.client import DownstreamClient
from qo_ops.downstream.local import seed_from_demo, simulator_process
from qo_ops_tests.conftest import base_env, run_cli

AS_OF = datetime(2026, 3, 1, 6, 0, tzinfo=UTC)

# How the jobs will select each anomaly, written independently of the generator.
ANOMALY_QUERIES = {
    "expired_active_quotes": "SELECT count(*) FROM quote WHERE status = 'ACTIVE' AND expires_at < :as_of",
    "quotes_without_current_snapshot": """
        SELECT count(*) FROM quote q WHERE NOT EXISTS (
            SELECT 1 FROM pricing_snapshot s JOIN price_book pb
              ON pb.tenant_id = s.tenant_id AND pb.version = s.price_book_version AND pb.is_current
            WHERE s.quote_id = q.id)""",
    "abandoned_checkouts": """
        SELECT count(*) FROM checkout_session
        WHERE status = 'OPEN' AND last_activity_at < :as_of - interval '24 hours'""",
    "due_deliveries": "SELECT count(*) FROM delivery_attempt_item WHERE status = 'READY' AND next_attempt_at <= :as_of",
    "poison_deliveries": """
        SELECT count(*) FROM delivery_attempt_item
        WHERE status = 'READY' AND next_attempt_at <= :as_of AND payload->>'fault' = 'poison'""",
    "dead_letters": "SELECT count(*) FROM delivery_attempt_item WHERE status = 'DEAD_LETTER'",
    "unpublished_due_events": "SELECT count(*) FROM outbox_event WHERE published_at IS NULL AND available_at <= :as_of",
    "drifted_orders": """
        SELECT count(*) FROM customer_order o
        LEFT JOIN downstream_order d ON d.order_number = o.order_number
        WHERE d.status IS DISTINCT FROM o.status""",
    "drifted_read_models": """
        SELECT count(*) FROM customer_order o
        LEFT JOIN order_read_model r ON r.order_id = o.id
        WHERE r.order_id IS NULL OR r.status <> o.status OR r.total_amount <> o.total_amount
           OR r.line_count <> o.line_count""",
    "stale_catalog_cache": """
        SELECT count(*) FROM catalog_item ci LEFT JOIN catalog_cache cc ON cc.catalog_item_id = ci.id
        WHERE cc.cached_version IS DISTINCT FROM ci.version""",
    "temp_files_past_retention": """
        SELECT count(*) FROM temp_file WHERE created_at < :as_of - interval '7 days'
        AND status IN ('COMPLETED', 'FAILED_TERMINAL') AND legal_hold = false""",
    "legal_hold_past_retention": """
        SELECT count(*) FROM temp_file WHERE created_at < :as_of - interval '7 days' AND legal_hold""",
    "old_audit_records": "SELECT count(*) FROM audit_record WHERE occurred_at < :as_of - interval '365 days'",
}


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def cli(db, home):
    """``qo-ops`` against this test's database, its QO_OPS_HOME (the objects) in tmp_path."""

    def _run(*args: str):
        env = base_env(QO_OPS_DATABASE_URL=db.env_url, QO_OPS_HOME=str(home))
        return run_cli(list(args), env)

    return _run


def stored(home: Path) -> dict[str, bytes]:
    """Every file under the object store: path -> bytes."""
    root = home / "objects"
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def temp_files(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT storage_path, size_bytes FROM temp_file")).all()
    return {r.storage_path: r.size_bytes for r in rows}


def _measure(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return {k: conn.scalar(sa.text(q), {"as_of": AS_OF}) for k, q in ANOMALY_QUERIES.items()}


def test_anomalies_are_exactly_as_planned(db):
    report = load_demo_data(db.engine, tenants=2, quotes=1500, seed=11, as_of=AS_OF)
    expected = DemoPlan(tenants=2, quotes=1500).expected_anomalies()
    assert set(expected) == set(ANOMALY_QUERIES)
    assert report.anomalies == expected
    assert _measure(db.engine) == expected
    assert all(v > 0 for v in expected.values()), expected
    # the plan is what it claims: one expired-but-ACTIVE quote in twenty
    assert expected["expired_active_quotes"] == 2 * (1500 // 20)


def test_quote_totals_equal_their_lines_and_every_reference_resolves(db):
    load_demo_data(db.engine, tenants=2, quotes=700, seed=5, as_of=AS_OF)
    with db.engine.connect() as conn:
        mismatched = conn.scalar(
            sa.text(
                "SELECT count(*) FROM quote q JOIN (SELECT quote_id, sum(amount) s, count(*) n "
                "FROM quote_line GROUP BY quote_id) l ON l.quote_id = q.id "
                "WHERE l.s <> q.total_amount"
            )
        )
        assert mismatched == 0
        assert conn.scalar(sa.text("SELECT count(DISTINCT quote_id) FROM quote_line")) == 1400
        # the load skips FK triggers as superuser, so check every reference by hand
        for table in metadata.sorted_tables:
            for fk in table.foreign_keys:
                orphans = conn.scalar(
                    sa.text(
                        f"SELECT count(*) FROM {table.name} c WHERE c.{fk.parent.name} IS NOT NULL "
                        f"AND NOT EXISTS (SELECT 1 FROM {fk.column.table.name} p "
                        f"WHERE p.{fk.column.name} = c.{fk.parent.name})"
                    )
                )
                assert orphans == 0, f"{table.name}.{fk.parent.name} has {orphans} orphans"
        # ids handed out after the load do not collide with the explicit ones
        new_id = conn.scalar(
            sa.text(
                "INSERT INTO quote (tenant_id, quote_number, customer_ref, status, total_amount, "
                "price_book_version, created_at, updated_at, expires_at) VALUES ('tenant-001', "
                "'Q-NEW', 'c', 'DRAFT', 1, 2, now(), now(), now()) RETURNING id"
            )
        )
        assert new_id == 1401


def _fresh_digest(pg_server, template_database, seed: int) -> dict[str, str]:
    from qo_ops_tests.conftest import _test_database

    gen = _test_database(pg_server, template_database)
    database = next(gen)
    try:
        load_demo_data(database.engine, tenants=2, quotes=600, seed=seed, as_of=AS_OF)
        with database.engine.connect() as conn:
            return database_digest(conn)
    finally:
        gen.close()


def test_same_seed_gives_the_same_digest(pg_server, template_database):
    first = _fresh_digest(pg_server, template_database, seed=42)
    second = _fresh_digest(pg_server, template_database, seed=42)
    other = _fresh_digest(pg_server, template_database, seed=43)
    assert first == second
    assert first["quote"] != other["quote"]
    assert first["quote"].split(":")[0] == "1200"  # row count is part of the digest


def test_every_temp_file_has_its_object_and_a_reset_removes_those_of_the_rows_it_replaces(
    cli, db, home
):
    first = cli("demo-data", "--tenants", "2", "--quotes", "600", "--seed", "3", "--json")
    assert first.code == 0, first.stderr
    rows = temp_files(db.engine)
    assert len(rows) == 2 * 60 and json.loads(first.stdout)["objects"] == {
        "written": len(rows),
        "removed": 0,
    }
    objects = stored(home)
    assert set(objects) == set(rows)  # one object per row, nothing else
    assert all(len(objects[p]) == size for p, size in rows.items())  # size_bytes is true
    assert objects["tmp/tenant-002/0000007.bin"] == demo_object(
        "tmp/tenant-002/0000007.bin", rows["tmp/tenant-002/0000007.bin"], 3
    )

    appended = cli("demo-data", "--tenants", "1", "--quotes", "300", "--append", "--json")
    assert appended.code == 0, appended.stderr
    assert json.loads(appended.stdout)["objects"] == {"written": 30, "removed": 0}
    assert set(stored(home)) == set(temp_files(db.engine)) and len(stored(home)) == 150

    # a smaller reset: the replaced rows' objects go, the new rows have theirs
    reset = cli("demo-data", "--tenants", "1", "--quotes", "200", "--reset", "--json")
    assert reset.code == 0, reset.stderr
    rows = temp_files(db.engine)
    assert json.loads(reset.stdout)["objects"] == {"written": 20, "removed": 130}
    objects = stored(home)
    assert set(objects) == set(rows) and len(rows) == 20
    assert all(len(objects[p]) == size for p, size in rows.items())


def test_refuses_to_load_twice_without_append_or_reset(cli, db):
    first = cli("demo-data", "--tenants", "1", "--quotes", "200", "--as-of", AS_OF.isoformat())
    assert first.code == 0, first.stderr
    with db.engine.connect() as conn:
        before = database_digest(conn)
    again = cli("demo-data", "--tenants", "1", "--quotes", "200")
    assert again.code == 2
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and "--append" in lines[0] and "--reset" in lines[0]
    assert "Traceback" not in again.stderr + again.stdout
    with db.engine.connect() as conn:
        assert database_digest(conn) == before

    appended = cli("demo-data", "--tenants", "2", "--quotes", "100", "--append", "--json")
    assert appended.code == 0, appended.stderr
    assert json.loads(appended.stdout)["tenants"] == ["tenant-002", "tenant-003"]
    reset = cli("demo-data", "--tenants", "1", "--quotes", "50", "--reset", "--json")
    assert reset.code == 0, reset.stderr
    with db.engine.connect() as conn:
        assert conn.scalar(sa.text("SELECT count(*) FROM quote")) == 50
        assert conn.execute(sa.text("SELECT id FROM tenant")).scalars().all() == ["tenant-001"]


@pytest.mark.parametrize(
    "args",
    [
        ["--tenants", "0"],
        ["--quotes", "-5"],
        ["--quotes", "ten"],
        ["--as-of", "yesterday"],
        ["--append", "--reset"],
        ["--seed", "-1"],
    ],
)
def test_bad_arguments_are_one_line_and_change_nothing(cli, db, args):
    result = cli("demo-data", *args)
    assert result.code == 2, result
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr
    with db.engine.connect() as conn:
        assert conn.scalar(sa.text("SELECT count(*) FROM tenant")) == 0


def test_existing_tenant_counts_as_data(db):
    with db.engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO tenant (id, name) VALUES ('acme', 'manual')"))
    with pytest.raises(DemoDataExists):
        load_demo_data(db.engine, tenants=1, quotes=100, seed=1, as_of=AS_OF)


def test_a_load_failing_midway_leaves_nothing_behind(cli, db, home):
    """The whole load is one transaction: a failure in a late statement undoes the early ones,
    and the objects written for its temp files are removed again."""
    with (
        db.engine.begin() as conn
    ):  # the fulfilment store already knows an order the load will create
        conn.execute(
            sa.text(
                "INSERT INTO downstream_order (order_number, tenant_id, status, received_at, updated_at) "
                "VALUES ('ORD-001-0000000', 'tenant-001', 'COMPLETED', now(), now())"
            )
        )
    result = cli("demo-data", "--tenants", "1", "--quotes", "100")
    assert result.code == 1
    assert len(result.stderr.strip().splitlines()) == 1 and "database error" in result.stderr
    with db.engine.connect() as conn:
        counts = conn.execute(
            sa.text(
                "SELECT (SELECT count(*) FROM tenant), (SELECT count(*) FROM quote), "
                "(SELECT count(*) FROM customer_order), (SELECT count(*) FROM downstream_order)"
            )
        ).one()
    assert tuple(counts) == (0, 0, 0, 1)
    assert (home / "objects" / "tmp" / "tenant-001").is_dir()  # the writer had started
    assert stored(home) == {}


def _orders(db) -> dict[str, str]:
    with db.engine.connect() as conn:
        return dict(
            conn.execute(sa.text("SELECT order_number, tenant_id FROM downstream_order")).all()
        )


def test_a_reset_gives_the_running_local_simulator_the_new_demos_orders_and_only_those(
    cli, db, home
):
    """The local simulator (`qo-ops dev`'s, on QO_OPS_HOME's store) is the demo's fulfilment
    system: a reset replaces its orders with the new demo's, whether it runs or not."""
    first = cli("demo-data", "--tenants", "3", "--quotes", "300", "--seed", "3")
    assert first.code == 0, first.stderr
    old = _orders(db)
    with simulator_process(home / "downstream.sqlite3") as sim, DownstreamClient(sim.url) as client:
        assert seed_from_demo(db.engine, sim.url) == len(old) > 0  # as qo-ops dev seeds it
        reset = cli(
            "demo-data", "--tenants", "1", "--quotes", "200", "--seed", "4", "--reset", "--json"
        )
        assert reset.code == 0, reset.stderr
        new = _orders(db)
        assert set(new.values()) == {"tenant-001"} and set(new) != set(old)
        said = json.loads(reset.stdout)["downstream"]
        assert (
            said == f"downstream simulator at {sim.url} reset and seeded with {len(new):,} orders"
        )
        assert client.stats(detail=False)["orders"] == len(new)
        assert all(client.get_order(n) is None for n in set(old) - set(new))
        assert all(client.get_order(n).tenant_id == t for n, t in new.items())  # type: ignore[union-attr]

    # stopped: its store is emptied, and the next start seeds it from the demo
    again = cli("demo-data", "--tenants", "2", "--quotes", "200", "--reset")
    assert again.code == 0, again.stderr
    assert "emptied: seeded when it next starts" in again.stdout
    with simulator_process(home / "downstream.sqlite3") as sim, DownstreamClient(sim.url) as client:
        assert client.stats(detail=False)["orders"] == 0
