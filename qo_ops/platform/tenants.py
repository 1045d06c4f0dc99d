"""Which tenants exist: the one place the platform, the API and the adapters ask the
tenant table."""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection


def tenant_ids(conn: Connection, among: Sequence[str] | None = None) -> list[str]:
    """Every tenant's id, sorted; with ``among``, only those of them that exist."""
    if among is None:
        return list(conn.execute(sa.text("SELECT id FROM tenant ORDER BY id")).scalars())
    return list(
        conn.execute(
            sa.text("SELECT id FROM tenant WHERE id = ANY(:ids) ORDER BY id"), {"ids": list(among)}
        ).scalars()
    )


_EXISTS = sa.text("SELECT EXISTS (SELECT 1 FROM tenant WHERE id = :t)")


def tenant_exists(conn: Connection, tenant_id: str) -> bool:
    """Whether ``tenant_id`` is a tenant (a run, a suspension or a restore names it)."""
    return bool(conn.execute(_EXISTS, {"t": tenant_id}).scalar())
