"""Dagster's PostgreSQL storage with an event log that keeps its connections.

dagster-postgres opens a new connection for every write to the event log (SQLAlchemy's
``NullPool``): each asset event a run's op yields costs two or three connections, each a
new PostgreSQL backend process, and a chunk of 100 tenants yields ~4 events a tenant. This
storage is ``DagsterPostgresStorage`` (same tables, same configuration) whose event log
keeps a few connections open in a pool instead. ``dagster.yaml`` names it (``storage:
custom``), and every process that loads the instance from that file or from a run's
``InstanceRef`` (daemon, webserver, code server, run workers) gets it. The run and schedule
storages are Dagster's own: they write a few rows a run.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from typing import Any

import sqlalchemy.pool as db_pool
from dagster._core.errors import DagsterInvariantViolationError
from dagster._core.events import ASSET_CHECK_EVENTS, ASSET_EVENTS
from dagster._core.events.log import EventLogEntry
from dagster._core.storage.config import PostgresStorageConfig
from dagster._core.storage.event_log import SqlEventLogStorageTable
from dagster._serdes import ConfigurableClassData
from dagster_postgres import DagsterPostgresStorage, PostgresEventLogStorage
from dagster_postgres.utils import (
    create_pg_engine,
    get_token_provider_from_config,
    pg_url_from_config,
)

# A run worker writes from one thread, and a write holds at most two connections at once
# (Dagster reads inside its index transaction); more threads (the daemon's) borrow overflow
# connections, closed when they are given back.
POOL_SIZE = 2
MAX_OVERFLOW = 8
# A connection older than this is replaced; one the server dropped (a PostgreSQL restart)
# is noticed by the ping before it is used and replaced too.
POOL_RECYCLE_S = 300


def _forget_connections(storage: PostgresEventLogStorage | None) -> None:
    """In a forked child: drop the pooled connections without closing the parent's."""
    if storage is not None:
        storage._engine.dispose(close=False)


class PooledPostgresEventLogStorage(PostgresEventLogStorage):
    """``PostgresEventLogStorage`` over a small ``QueuePool``: the same statements without a
    new connection for each, and without the NOTIFY after each event (nothing of Dagster
    1.13 LISTENs: its webserver polls the event log)."""

    def __init__(
        self,
        postgres_url: str,
        should_autocreate_tables: bool = True,
        inst_data: ConfigurableClassData | None = None,
        token_provider: Any = None,
    ) -> None:
        self._tables_seen: set[str] = set()
        super().__init__(postgres_url, should_autocreate_tables, inst_data, token_provider)
        unpooled = self._engine
        self._engine = create_pg_engine(
            self.postgres_url,
            token_provider,
            isolation_level="AUTOCOMMIT",
            poolclass=db_pool.QueuePool,
            pool_size=POOL_SIZE,
            max_overflow=MAX_OVERFLOW,
            pool_recycle=POOL_RECYCLE_S,
            pool_pre_ping=True,
        )
        unpooled.dispose()
        # a process forked from this one must not use the parent's sockets: it opens its own
        storage = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: _forget_connections(storage()))

    def store_event(self, event: EventLogEntry) -> None:
        """dagster-postgres's ``store_event`` (1.13) without its ``NOTIFY run_events``: Dagster
        keeps it only for webservers older than the polling event watcher ("preserved here
        to support version skew"); the chart's webserver runs the version qo-ops pins. One
        statement and one transaction fewer per event: a tenant of a chunk writes ~4."""
        insert = self.prepare_insert_event(event)
        with self._connect() as conn:
            row = conn.execute(
                insert.returning(SqlEventLogStorageTable.c.run_id, SqlEventLogStorageTable.c.id)
            ).fetchone()
        event_id = int(row[1]) if row is not None else None
        dagster_event = event.dagster_event
        if dagster_event is None:
            return
        if dagster_event.event_type in ASSET_EVENTS and dagster_event.asset_key:
            if event_id is None:
                raise DagsterInvariantViolationError(
                    "Cannot store asset event tags for null event id."
                )
            with self.index_transaction() as conn:
                self._store_asset_event_tags(conn, [event], [event_id])
                self._store_asset_event(conn, event, event_id)
        if dagster_event.event_type in ASSET_CHECK_EVENTS:
            self.store_asset_check_event(event, event_id)

    def has_table(self, table_name: str) -> bool:
        """Whether the table exists, asked of PostgreSQL once per process once it does:
        Dagster asks before every check evaluation it stores (``supports_asset_checks``), a
        catalog query each time. A table Dagster created stays (its migrations add tables)."""
        if table_name in self._tables_seen:
            return True
        found = super().has_table(table_name)
        if found:
            self._tables_seen.add(table_name)
        return found

    @classmethod
    def from_config_value(
        cls, inst_data: ConfigurableClassData | None, config_value: Mapping[str, Any]
    ) -> PooledPostgresEventLogStorage:
        return cls(
            inst_data=inst_data,
            postgres_url=pg_url_from_config(config_value),
            should_autocreate_tables=config_value.get("should_autocreate_tables", True),
            token_provider=get_token_provider_from_config(config_value),
        )


class QoOpsPostgresStorage(DagsterPostgresStorage):
    """``DagsterPostgresStorage`` (same configuration: ``postgres_url`` …) whose event log is
    ``PooledPostgresEventLogStorage``."""

    def __init__(
        self,
        postgres_url: str,
        should_autocreate_tables: bool = True,
        inst_data: ConfigurableClassData | None = None,
        token_provider: Any = None,
    ) -> None:
        super().__init__(postgres_url, should_autocreate_tables, inst_data, token_provider)
        self._event_log_storage = PooledPostgresEventLogStorage(
            postgres_url, should_autocreate_tables, token_provider=token_provider
        )

    @classmethod
    def from_config_value(  # type: ignore[override]
        cls, inst_data: ConfigurableClassData | None, config_value: PostgresStorageConfig
    ) -> QoOpsPostgresStorage:
        return cls(
            inst_data=inst_data,
            postgres_url=pg_url_from_config(config_value),
            should_autocreate_tables=bool(config_value.get("should_autocreate_tables", True)),
            token_provider=get_token_provider_from_config(config_value),
        )

    @property
    def event_storage_data(self) -> ConfigurableClassData | None:
        return (
            ConfigurableClassData(
                __name__, PooledPostgresEventLogStorage.__name__, self.inst_data.config_yaml
            )
            if self.inst_data
            else None
        )
