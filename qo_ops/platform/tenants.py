"""Which tenants exist: the one place the Dagster adapter asks the tenant table."""

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
