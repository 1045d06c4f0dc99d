"""Content digests of tables: evidence that a run (or a dry-run) changed what it says."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.db.schema import BUSINESS_TABLES, PLATFORM_TABLES


def table_digest(
    conn: Connection, table: sa.Table, where: str = "", params: Mapping[str, Any] | None = None
) -> str:
    """md5 over every row of ``table`` in primary-key order (row count prefixed); ``where``
    (SQL over the table's alias ``t``, with bound ``params``) digests only those rows."""
    order = ", ".join(f"t.{c.name}" for c in table.primary_key.columns)
    row = conn.execute(
        sa.text(
            f"SELECT count(*), md5(coalesce(string_agg(md5(t::text), '' ORDER BY {order}), '')) "
            f"FROM {table.name} t" + (f" WHERE {where}" if where else "")
        ),
        dict(params or {}),
    ).one()
    return f"{row[0]}:{row[1]}"


def database_digest(conn: Connection, tables: tuple[sa.Table, ...] | None = None) -> dict[str, str]:
    """Digest of each business and platform table (or of ``tables``), by table name."""
    chosen = tables if tables is not None else BUSINESS_TABLES + PLATFORM_TABLES
    return {t.name: table_digest(conn, t) for t in chosen}
