"""catalog_cache_refresh rewrites a tenant's catalog_cache entries that are missing, or whose
``cached_version`` differs from their catalog_item's ``version``. It never touches an entry
that is already current. A dry run reports exactly the entries execute rewrites.

The job keeps no checkpoint. It selects by state (items whose cache entry is missing or
stale), and refreshing an entry takes its item out of that state, so a rerun simply finds
what is left.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.db.schema import catalog_cache, catalog_item
from qo_ops.platform.job.options import Limits
from qo_ops.platform.job.outcome import BatchContext, BatchOutcome, OutcomeCheck
from qo_ops.platform.job.spec import (
    Batching,
    CheckSpec,
    Deployment,
    JobSpec,
    Positions,
    Presentation,
    Signals,
    SkipLocked,
)
from qo_ops.platform.run.selection import seconds_or_none

# An item needs a refresh when its cache entry is missing (NULL through the LEFT JOIN) or
# was built from another version of the item.
_OUT_OF_DATE = catalog_cache.c.cached_version.is_distinct_from(catalog_item.c.version)


def stale_catalog_items(ctx: BatchContext) -> sa.Select[Any]:
    """Select the tenant's catalog items with a missing or stale cache entry, by id.

    The query uses ix_catalog_item_tenant_id, then the cache's primary key per item. Within
    a run, each batch starts after the last item of the previous one (``position``). The
    runner ends with one pass from the start for items that others held locked.
    """
    position = ctx.position
    join_on = catalog_cache.c.catalog_item_id == catalog_item.c.id
    if position:
        # Redundant for the result, since the entry's key is the item's id. It lets the
        # cache's primary-key scan start at the position too.
        join_on = sa.and_(join_on, catalog_cache.c.catalog_item_id > position["id"])
    query = (
        sa.select(catalog_item.c.id)
        .select_from(catalog_item.outerjoin(catalog_cache, join_on))
        .where(catalog_item.c.tenant_id == ctx.scope.tenant_id, _OUT_OF_DATE)
        .order_by(catalog_item.c.id)
    )
    if position:
        query = query.where(catalog_item.c.id > position["id"])
    return query


# Upsert each selected item's entry from the item itself.
# Twice: the WHERE on the update leaves an entry already at the item's version untouched, so
# a second run writes nothing.
REFRESH_CACHE_BATCH = sa.text(
    """
    INSERT INTO catalog_cache AS c (catalog_item_id, tenant_id, cached_version, payload,
                                    refreshed_at)
    SELECT i.id, i.tenant_id, i.version,
           jsonb_build_object('sku', i.sku, 'name', i.name, 'list_price', i.list_price,
                              'version', i.version),
           clock_timestamp()
      FROM catalog_item i
     WHERE i.id = ANY(CAST(:ids AS bigint[])) AND i.tenant_id = :tenant
    ON CONFLICT (catalog_item_id) DO UPDATE
       SET tenant_id = EXCLUDED.tenant_id, cached_version = EXCLUDED.cached_version,
           payload = EXCLUDED.payload, refreshed_at = EXCLUDED.refreshed_at
     WHERE c.cached_version IS DISTINCT FROM EXCLUDED.cached_version
    RETURNING (xmax = 0) AS created
    """
)


def refresh_cache_batch(conn: Connection, ctx: BatchContext, ids: Sequence[Any]) -> BatchOutcome:
    """Rewrite the cache entries of the selected items that are missing or stale."""
    written = conn.execute(
        REFRESH_CACHE_BATCH, {"ids": list(ids), "tenant": ctx.scope.tenant_id}
    ).all()
    created = sum(1 for r in written if r.created)
    return BatchOutcome(
        succeeded=len(written),
        skipped=len(ids) - len(written),  # already current, refreshed by someone else
        tally={"cache_entry_created": created, "cache_entry_rewritten": len(written) - created},
        position={"id": ids[-1]},
    )


# The tenant's items without a cache entry, and with one behind their version.
MISSING_AND_STALE = sa.text(
    """
    SELECT count(*) FILTER (WHERE c.catalog_item_id IS NULL) AS missing,
           count(*) FILTER (WHERE c.cached_version <> i.version) AS stale
      FROM catalog_item i
      LEFT JOIN catalog_cache c ON c.catalog_item_id = i.id
     WHERE i.tenant_id = :tenant
    """
)
OLDEST_STALE_SECONDS = sa.text(
    "SELECT extract(epoch FROM now() - min(i.updated_at)) FROM catalog_item i "
    "LEFT JOIN catalog_cache c ON c.catalog_item_id = i.id "
    "WHERE i.tenant_id = :tenant AND c.cached_version IS DISTINCT FROM i.version"
)


# Declared once. Its results in check_catalog_cache carry the same description.
CACHE_VERSIONS_MATCH_SOURCE = CheckSpec(
    "cache_versions_match_source", "Every catalog item has a cache entry at its current version"
)


def check_catalog_cache(conn: Connection, ctx: BatchContext) -> list[OutcomeCheck]:
    """Check that every catalog item of the tenant has a cache entry at its current version."""
    row = conn.execute(MISSING_AND_STALE, {"tenant": ctx.scope.tenant_id}).one()
    return [
        CACHE_VERSIONS_MATCH_SOURCE.result(
            row.missing == 0 and row.stale == 0,
            {"missing_entries": row.missing, "stale_entries": row.stale},
        )
    ]


def oldest_stale_seconds(conn: Connection, ctx: BatchContext) -> float | None:
    """Return the seconds since the least recently changed item with an out-of-date entry."""
    value = conn.execute(OLDEST_STALE_SECONDS, {"tenant": ctx.scope.tenant_id}).scalar()
    return seconds_or_none(value)


SPEC = JobSpec(
    name="catalog_cache_refresh",
    kind="refresh",
    description="Rewrite catalog cache entries that are missing or behind their item's version",
    partitioning="tenant",
    eligible=stale_catalog_items,
    transition=refresh_cache_batch,
    check=check_catalog_cache,
    checks=(CACHE_VERSIONS_MATCH_SOURCE,),
    defaults=Limits(batch_size=500),
    batching=Batching(
        locks=SkipLocked(of=catalog_item),  # the selection LEFT JOINs the cache, so lock items only
        positions=Positions(),
    ),
    presentation=Presentation(
        outcome_asset="catalog_cache",
        change="cache entry rewritten at the item's version",
        healthy="No catalog cache entry missing or behind its item's version (backlog 0).",
    ),
    deployment=Deployment(cron_schedule="*/10 * * * *", backlog_threshold=1000),
    signals=Signals(lag=oldest_stale_seconds),
)
