"""Schema migrations (Alembic), driven from code: no alembic.ini to find or misconfigure.

Checking the schema (:func:`require_current`, which every command runs first) needs no
Alembic: the revision the database is at is one row of the version table, and the revision
this code needs is :data:`HEAD_REVISION`. Alembic, slow to import, is loaded only to migrate.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from qo_ops.errors import SchemaNotReady

if TYPE_CHECKING:
    from alembic.config import Config
    from sqlalchemy.engine import Connection

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
VERSION_TABLE = "qo_ops_alembic_version"  # Dagster's storage has an alembic_version of its own
MIGRATION_LOCK_KEY = 0x716F6F7073  # advisory lock: two `db upgrade` at once run one after the other
# The newest revision in migrations/versions/: a new migration moves it (a test holds it to
# Alembic's head).
HEAD_REVISION = "0017"

# Whether the version table exists yet (an empty database has none). Read-only.
VERSION_TABLE_EXISTS = sa.text("SELECT to_regclass('qo_ops_alembic_version') IS NOT NULL")
# The revision(s) the database is at, as Alembic records them. Read-only.
RECORDED_REVISIONS = sa.text("SELECT version_num FROM qo_ops_alembic_version")


def _config(connection: Connection) -> Config:
    from alembic.config import Config  # Alembic only to migrate: see the module docstring

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    """The newest revision this code knows."""
    return HEAD_REVISION


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at, or None for an empty database."""
    with engine.connect() as conn:
        if not conn.scalar(VERSION_TABLE_EXISTS):
            return None
        found = list(conn.scalars(RECORDED_REVISIONS))
    if len(found) > 1:  # Alembic's own check: our history has one line, never branches
        raise SchemaNotReady(f"database schema has several heads {sorted(found)}: repair it")
    return found[0] if found else None


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Migrate up to ``revision``; a no-op when already there."""
    from alembic import command  # Alembic only to migrate: see the module docstring

    with engine.begin() as conn:
        command.upgrade(_config(conn), revision)


def downgrade(engine: Engine, revision: str = "-1") -> None:
    """Migrate down to ``revision`` (``base`` drops every qo-ops table)."""
    from alembic import command  # Alembic only to migrate: see the module docstring

    with engine.begin() as conn:
        command.downgrade(_config(conn), revision)


def require_current(engine: Engine) -> None:
    """Raise :class:`SchemaNotReady` unless the database is at the head revision."""
    current, head = current_revision(engine), head_revision()
    if current != head:
        found = current or "empty"
        raise SchemaNotReady(
            f"database schema is at {found}, this code needs {head}: run `qo-ops db upgrade`"
        )
