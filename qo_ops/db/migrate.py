"""Schema migrations (Alembic), driven from code: no alembic.ini to find or misconfigure."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection, Engine

from qo_ops.errors import SchemaNotReady

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
VERSION_TABLE = "qo_ops_alembic_version"  # Dagster's storage has an alembic_version of its own
MIGRATION_LOCK_KEY = 0x716F6F7073  # advisory lock: two `db upgrade` at once run one after the other


def _config(connection: Connection) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    """The newest revision this code knows."""
    script = ScriptDirectory(str(MIGRATIONS_DIR))
    head = script.get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at, or None for an empty database."""
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return ctx.get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Migrate up to ``revision``; a no-op when already there."""
    with engine.begin() as conn:
        command.upgrade(_config(conn), revision)


def downgrade(engine: Engine, revision: str = "-1") -> None:
    """Migrate down to ``revision`` (``base`` drops every qo-ops table)."""
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
