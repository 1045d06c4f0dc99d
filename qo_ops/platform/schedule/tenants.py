"""Which tenants exist.

This is the one place where the platform, the API and the adapters ask the tenant table."""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.platform.schedule.partition_keys import chunk_at, chunk_bounds, chunk_keys


def tenant_ids(conn: Connection, among: Sequence[str] | None = None) -> list[str]:
    """Every tenant's id, sorted. With ``among``, only those ids of it that exist."""
    if among is None:
        return list(conn.execute(sa.text("SELECT id FROM tenant ORDER BY id")).scalars())
    return list(
        conn.execute(
            sa.text("SELECT id FROM tenant WHERE id = ANY(:ids) ORDER BY id"), {"ids": list(among)}
        ).scalars()
    )


_EXISTS = sa.text("SELECT EXISTS (SELECT 1 FROM tenant WHERE id = :t)")


def tenant_exists(conn: Connection, tenant_id: str) -> bool:
    """Whether ``tenant_id`` is a tenant, as named by a run, a suspension or a restore."""
    return bool(conn.execute(_EXISTS, {"t": tenant_id}).scalar())


# Tenant chunks (qo_ops.platform.schedule.partition_keys) are positions in the
# (created_at, id) order. Appending tenants never changes that order.
_CHUNK_MEMBERS = sa.text("SELECT id FROM tenant ORDER BY created_at, id OFFSET :start LIMIT :size")
_POSITION = sa.text(
    """
    SELECT count(*) FROM tenant t, tenant me
     WHERE me.id = :t AND (t.created_at, t.id) < (me.created_at, me.id)
    """
)


def tenants_in_chunk_order(conn: Connection) -> list[str]:
    """Every tenant's id in the order that chunks are cut from: (created_at, id)."""
    return list(conn.execute(sa.text("SELECT id FROM tenant ORDER BY created_at, id")).scalars())


def chunk_members(conn: Connection, chunk: str) -> list[str]:
    """The tenants of windowed partition chunk ``chunk`` (``chunk-001``), in chunk order.

    A key that is not a chunk raises :class:`BadInput`."""
    start, stop = chunk_bounds(chunk)
    rows = conn.execute(_CHUNK_MEMBERS, {"start": start, "size": stop - start})
    return list(rows.scalars())


def chunk_of(conn: Connection, tenant_id: str) -> str | None:
    """The chunk that ``tenant_id`` is in, or None when it is not a tenant."""
    if not tenant_exists(conn, tenant_id):
        return None
    return chunk_at(int(conn.execute(_POSITION, {"t": tenant_id}).scalar_one()))


def tenant_chunk_keys(conn: Connection) -> list[str]:
    """The chunk keys for today's tenant count (``chunk-001`` … ``chunk-NNN``)."""
    return chunk_keys(int(conn.execute(sa.text("SELECT count(*) FROM tenant")).scalar_one()))
