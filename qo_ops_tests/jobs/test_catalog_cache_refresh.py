"""catalog_cache_refresh through the one runner: dry-run writes nothing and counts exactly
what execute rewrites, execute rewrites only the missing or stale entries of its tenant,
entries already current are skipped, a second run is no work, and the outcome check tells
the truth about a broken cache."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest
import sqlalchemy as sa

from qo_ops.db.digest import database_digest
from qo_ops.db.schema import BUSINESS_TABLES, outbox_event
from qo_ops.demo.data import load_demo_data
from qo_ops.jobs.catalog_cache_refresh import SPEC, refresh_cache_batch
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.outcome import BatchContext
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.runner import RunSummary, run_job

AS_OF = datetime(2026, 3, 1, tzinfo=UTC)
TENANT, OTHER = "tenant-001", "tenant-002"
CHECK = "cache_versions_match_source"
DATA_TABLES = (*BUSINESS_TABLES, outbox_event)


def rows(engine: sa.Engine, sql: str, **params: Any) -> list[sa.Row]:
    with engine.connect() as conn:
        return list(conn.execute(sa.text(sql), params).all())


def scalar(engine: sa.Engine, sql: str, **params: Any) -> Any:
    with engine.connect() as conn:
        return conn.execute(sa.text(sql), params).scalar()


def eligible_ids(engine: sa.Engine, tenant: str = TENANT) -> list[int]:
    """Items of ``tenant`` whose cache entry is missing or stale, by id; computed independently."""
    return [
        r.id
        for r in rows(
            engine,
            "SELECT i.id FROM catalog_item i WHERE i.tenant_id = :t AND NOT EXISTS ("
            "SELECT 1 FROM catalog_cache c WHERE c.catalog_item_id = i.id "
            "AND c.cached_version = i.version) ORDER BY i.id",
            t=tenant,
        )
    ]


def cache_rows(engine: sa.Engine, tenant: str = TENANT) -> dict[int, str]:
    """Every cache entry of the tenant's items as text, by item id (absent: no entry)."""
    return {
        r.catalog_item_id: r.row
        for r in rows(
            engine,
            "SELECT c.catalog_item_id, c::text AS row FROM catalog_cache c "
            "JOIN catalog_item i ON i.id = c.catalog_item_id WHERE i.tenant_id = :t",
            t=tenant,
        )
    }


def data_digest(engine: sa.Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return database_digest(conn, DATA_TABLES)


def run(engine: sa.Engine, tenant: str = TENANT, **options: Any) -> RunSummary:
    options.setdefault("mode", "execute")
    options.setdefault("requester", "test:catalog-cache-refresh")
    options.setdefault("reason", "test run")
    return run_job(SPEC, Scope(tenant), RunOptions(**options), engine=engine)


def check_of(summary: RunSummary) -> Any:
    assert [c.name for c in summary.checks] == [c.name for c in SPEC.checks] == [CHECK]
    return summary.checks[0]


@pytest.fixture
def loaded(db):
    """Two tenants; demo data leaves every 20th cache entry missing and every 8th stale.
    One more kind of staleness: an item of each tenant changed after its entry was cached."""
    load_demo_data(db.engine, tenants=2, quotes=1000, seed=7, as_of=AS_OF)
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE catalog_item SET version = version + 1, list_price = list_price + 1, "
                "updated_at = now() WHERE sku = 'SKU-00003'"
            )
        )
    eligible = eligible_ids(db.engine)
    missing = [i for i in eligible if i not in cache_rows(db.engine)]
    assert len(eligible) >= 8 and 0 < len(missing) < len(eligible)
    assert eligible_ids(db.engine, OTHER)
    return db, eligible


# ------------------------------------------------------------------------- dry-run


def test_dry_run_writes_nothing_and_counts_exactly_what_execute_then_rewrites(loaded):
    db, eligible = loaded
    before_data, before_cache = data_digest(db.engine), cache_rows(db.engine)

    dry = run(db.engine, mode="dry_run")

    assert data_digest(db.engine) == before_data
    assert (dry.status, dry.eligible_count, dry.counts.processed) == ("success", len(eligible), 0)
    assert dry.sample_ids == [str(i) for i in eligible[:10]]
    assert check_of(dry).passed is False  # the dry-run reports the cache as it is

    executed = run(db.engine, batch_size=4)

    after_cache = cache_rows(db.engine)
    changed = {i for i in after_cache if after_cache[i] != before_cache.get(i)}
    assert changed == set(eligible)
    assert executed.counts.succeeded == dry.eligible_count == len(changed)


# ------------------------------------------------------------------------- execute


def test_execute_rewrites_exactly_the_stale_entries_of_its_tenant(loaded):
    db, eligible = loaded
    before_cache = cache_rows(db.engine)
    missing = [i for i in eligible if i not in before_cache]
    other_before = cache_rows(db.engine, OTHER)
    items_before = scalar(
        db.engine, "SELECT md5(string_agg(i::text, '|' ORDER BY id)) FROM catalog_item i"
    )

    summary = run(db.engine, batch_size=4)

    assert summary.status == "success"
    assert summary.eligible_count == summary.counts.processed == summary.counts.succeeded
    assert summary.counts.succeeded == len(eligible)
    assert summary.counts.failed == summary.counts.skipped == 0
    assert summary.batches == -(-len(eligible) // 4)
    assert summary.tally == {
        "cache_entry_created": len(missing),
        "cache_entry_rewritten": len(eligible) - len(missing),
    }
    check = check_of(summary)
    assert check.passed, check.metadata
    assert check.metadata == {"missing_entries": 0, "stale_entries": 0}

    refreshed = rows(
        db.engine,
        "SELECT i.id, i.tenant_id AS item_tenant, i.sku, i.name, i.list_price, i.version, "
        "c.tenant_id, c.cached_version, c.payload, c.refreshed_at "
        "FROM catalog_item i JOIN catalog_cache c ON c.catalog_item_id = i.id "
        "WHERE i.id = ANY(:ids)",
        ids=eligible,
    )
    assert len(refreshed) == len(eligible)
    for r in refreshed:
        assert (r.tenant_id, r.cached_version) == (r.item_tenant, r.version)
        assert set(r.payload) == {"sku", "name", "list_price", "version"}
        assert (r.payload["sku"], r.payload["name"], r.payload["version"]) == (
            r.sku,
            r.name,
            r.version,
        )
        assert Decimal(str(r.payload["list_price"])) == r.list_price
        assert r.refreshed_at > AS_OF
    after_cache = cache_rows(db.engine)
    assert {i: v for i, v in after_cache.items() if i not in eligible} == {
        i: v for i, v in before_cache.items() if i not in eligible
    }  # entries already current are untouched
    assert eligible_ids(db.engine) == []
    assert cache_rows(db.engine, OTHER) == other_before  # another tenant's cache is not ours
    assert eligible_ids(db.engine, OTHER)
    assert (
        scalar(db.engine, "SELECT md5(string_agg(i::text, '|' ORDER BY id)) FROM catalog_item i")
        == items_before
    )


def test_a_second_execute_is_no_work_and_changes_nothing(loaded):
    db, eligible = loaded
    assert run(db.engine).counts.succeeded == len(eligible)
    before = data_digest(db.engine)

    again = run(db.engine)

    assert (again.status, again.eligible_count, again.counts.succeeded) == ("no_work", 0, 0)
    assert data_digest(db.engine) == before
    assert check_of(again).passed


def test_the_conditional_upsert_skips_entries_already_current(loaded):
    db, eligible = loaded
    fresh = [
        r.id
        for r in rows(
            db.engine,
            "SELECT id FROM catalog_item WHERE tenant_id = :t AND id <> ALL(:ids) ORDER BY id LIMIT 3",
            t=TENANT,
            ids=eligible,
        )
    ]
    before = cache_rows(db.engine)
    ctx = BatchContext(SPEC.name, Scope(TENANT), "execute", uuid.uuid4())

    with db.engine.begin() as conn:
        first = refresh_cache_batch(conn, ctx, [*eligible[:2], *fresh])
    with db.engine.begin() as conn:
        second = refresh_cache_batch(conn, ctx, [*eligible[:2], *fresh])

    assert (first.succeeded, first.skipped) == (2, 3)
    assert (second.succeeded, second.skipped) == (0, 5)  # run twice: nothing more written
    after = cache_rows(db.engine)
    assert {i for i in after if after[i] != before.get(i)} == set(eligible[:2])


def test_an_item_changed_later_is_picked_up_by_the_next_run(loaded):
    db, eligible = loaded
    run(db.engine)
    with db.engine.begin() as conn:
        changed = conn.execute(
            sa.text(
                "UPDATE catalog_item SET version = version + 1, name = name || ' v2' "
                "WHERE tenant_id = :t AND sku = 'SKU-00010' RETURNING id, name, version"
            ),
            {"t": TENANT},
        ).one()

    summary = run(db.engine)

    assert (summary.status, summary.counts.succeeded) == ("success", 1)
    payload = scalar(
        db.engine, "SELECT payload FROM catalog_cache WHERE catalog_item_id = :id", id=changed.id
    )
    assert (payload["name"], payload["version"]) == (changed.name, changed.version)


# ------------------------------------------------------------------------- outcome check


def test_the_outcome_check_fails_with_the_counts_of_a_broken_cache(loaded):
    db, _ = loaded
    assert check_of(run(db.engine)).passed
    with db.engine.begin() as conn:
        ids = (
            conn.execute(
                sa.text("SELECT id FROM catalog_item WHERE tenant_id = :t ORDER BY id LIMIT 3"),
                {"t": TENANT},
            )
            .scalars()
            .all()
        )
        conn.execute(
            sa.text("DELETE FROM catalog_cache WHERE catalog_item_id = :id"), {"id": ids[0]}
        )
        conn.execute(
            sa.text("UPDATE catalog_item SET version = version + 1 WHERE id = ANY(:ids)"),
            {"ids": ids[1:]},
        )

    dry = run(db.engine, mode="dry_run")

    check = check_of(dry)
    assert not check.passed
    assert check.metadata == {"missing_entries": 1, "stale_entries": 2}
    assert dry.eligible_count == 3
    # the other tenant's still-broken cache does not count against this tenant
    assert eligible_ids(db.engine, OTHER)
    assert check_of(run(db.engine)).passed


# ------------------------------------------------------------------------- Dagster test data


def test_does_real_work_on_the_dagster_test_data(db):
    load_demo_data(db.engine, tenants=2, quotes=400, seed=9, as_of=AS_OF)
    eligible = eligible_ids(db.engine)

    dry = run(db.engine, mode="dry_run")
    executed = run(db.engine)

    assert dry.eligible_count == len(eligible) > 0
    assert (executed.status, executed.counts.succeeded) == ("success", len(eligible))
    assert all(c.passed for c in executed.checks), [c.metadata for c in executed.checks]
