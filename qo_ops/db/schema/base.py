"""What every table module of the schema shares: the one ``MetaData`` (with the naming
convention the migrations' names follow), the timestamp type, and two column helpers."""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

TS = sa.DateTime(timezone=True)
NOW = sa.text("now()")


def status_check(column: str, values: tuple[str, ...]) -> sa.CheckConstraint:
    """A CHECK that ``column`` holds one of ``values`` (named ``<column>_allowed``)."""
    allowed = ", ".join(f"'{v}'" for v in values)
    return sa.CheckConstraint(f"{column} IN ({allowed})", name=f"{column}_allowed")


def tenant_fk() -> sa.Column[str]:
    """The ``tenant_id`` column of a business table: required, referencing ``tenant``."""
    return sa.Column("tenant_id", sa.Text, sa.ForeignKey("tenant.id"), nullable=False)
