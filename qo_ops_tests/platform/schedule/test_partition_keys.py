"""Tenant chunks, the second dimension of a windowed job's partitions: chunk k holds the
tenants at positions [(k-1)·100, k·100) in (created_at, id) order, on a real PostgreSQL.

Tests ``qo_ops.platform.schedule.partition_keys`` and ``qo_ops.platform.schedule.tenants``.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from qo_ops.errors import BadInput
from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.schedule.partition_keys import (
    CHUNK_SIZE,
    chunk_bounds,
    chunk_keys,
    chunk_number,
    chunks_of,
    partition_tags,
    split_windowed_key,
)
from qo_ops.platform.schedule.tenants import (
    chunk_members,
    chunk_of,
    tenant_chunk_keys,
    tenants_in_chunk_order,
)


def _add(engine: sa.Engine, first: int, last: int) -> None:
    """Tenants t-<first> … t-<last>, created now (one statement: one created_at, id order)."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO tenant (id, name) SELECT 't-' || lpad(g::text, 4, '0'), 't' "
                "FROM generate_series(CAST(:a AS int), CAST(:b AS int)) g"
            ),
            {"a": first, "b": last},
        )


def test_a_chunk_is_as_many_tenants_as_a_windowed_run_takes():
    windowed = [s for s in CATALOG.values() if s.partitioning == "tenant_day"]
    assert windowed and all(s.deployment.tenants_per_run == CHUNK_SIZE for s in windowed)


def test_chunk_keys_and_windowed_keys_are_read_both_ways():
    assert chunk_keys(0) == [] and chunk_keys(1) == ["chunk-001"]
    assert chunk_keys(10_000)[-1] == "chunk-100" and len(chunk_keys(10_001)) == 101
    assert chunk_bounds("chunk-003") == (200, 300) and chunk_number("chunk-1000") == 1000
    for bad in ("chunk-0", "chunk-000", "tenant-001", "chunk-01"):
        with pytest.raises(BadInput, match="is not a tenant chunk"):
            chunk_number(bad)
    assert chunks_of(["a", "b", "c"], 2) == {"chunk-001": ["a", "b"], "chunk-002": ["c"]}
    day = split_windowed_key("2026-12-01|chunk-007")
    assert (day[0].isoformat(), day[1], day[2]) == ("2026-12-01", "chunk-007", None)
    assert split_windowed_key("2026-12-01")[1:] == (None, None)  # the old day-only keys
    assert split_windowed_key("2026-12-01|tenant-001")[1:] == (None, "tenant-001")
    assert partition_tags("2026-12-01|chunk-007") == {
        "dagster/partition": "2026-12-01|chunk-007",
        "dagster/partition/day": "2026-12-01",
        "dagster/partition/tenant_chunk": "chunk-007",
    }
    assert partition_tags("tenant-001") == {"dagster/partition": "tenant-001"}


def test_adding_tenants_never_moves_one_to_another_chunk(db):
    _add(db.engine, 1, 150)
    with db.engine.connect() as conn:
        before = chunks_of(tenants_in_chunk_order(conn))
        assert tenant_chunk_keys(conn) == ["chunk-001", "chunk-002"]
        assert [len(m) for m in before.values()] == [100, 50]
    _add(db.engine, 151, 260)  # appended later: after every earlier tenant
    with db.engine.connect() as conn:
        after = {c: chunk_members(conn, c) for c in tenant_chunk_keys(conn)}
        assert list(after) == ["chunk-001", "chunk-002", "chunk-003"]
        assert after["chunk-001"] == before["chunk-001"]
        assert after["chunk-002"][:50] == before["chunk-002"]  # filled up, nobody moved
        assert chunk_of(conn, "t-0100") == "chunk-001" and chunk_of(conn, "t-0101") == "chunk-002"
        assert chunk_of(conn, "t-0260") == "chunk-003" and chunk_of(conn, "nobody") is None
        # every tenant in exactly one chunk
        everyone = [t for members in after.values() for t in members]
        assert sorted(everyone) == sorted(tenants_in_chunk_order(conn)) and len(everyone) == 260
    with db.engine.begin() as conn:  # a deleted tenant shifts the later ones by one place
        conn.execute(sa.text("DELETE FROM tenant WHERE id = 't-0050'"))
    with db.engine.connect() as conn:
        assert chunk_of(conn, "t-0101") == "chunk-001"
        assert chunk_members(conn, "chunk-002")[0] == "t-0102"
