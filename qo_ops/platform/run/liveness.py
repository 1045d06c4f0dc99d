"""A run's liveness, which PostgreSQL gives for free.

While a run runs, its process holds a session-level advisory lock on a connection of its
own. That connection is idle except for a ping at each heartbeat. The process may die by
SIGKILL, by the OOM killer or because its pod was deleted. Then the kernel closes its
sockets, and the server ends the session and drops the lock at once. A host that vanishes
without closing them is found by TCP keepalives, which are set short on that connection.

A run whose lock is gone from the server that granted it is *gone*. Its lease is free for
the next run (``lease.acquire``). Its record is finished by the next run to start, or by
any running run's heartbeat, whatever its job (``records.reap_orphans``). This takes
seconds, not the lease's TTL.

What liveness does not judge, the lease still does. A holder that is frozen (SIGSTOP) or cut
off keeps its session and its lock. So only the TTL frees its scope, and its fencing token
keeps its late writes out. A database restart drops every lock. A lock taken before the
server last started says nothing (``liveness_since`` before ``pg_postmaster_start_time()``),
and the run takes it again at its next heartbeat. A run may have no lock, because of older
code or a pooler that hands one session's lock to another. Then it has ``liveness_key``
NULL or looks alive, and only the TTL applies, as before.
"""

from __future__ import annotations

import logging
import secrets
import uuid

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

log = logging.getLogger(__name__)


# True when the ``job_run`` row aliased ``r`` belongs to a process that is gone. That means
# it took its liveness lock on the server that is up now, and no session holds the lock.
# The lease (taking a scope over) and the reaper (finishing a record) share this one
# predicate, so a scope is never free while its record could still be running.
RUN_GONE = """(r.liveness_key IS NOT NULL
        AND r.liveness_since > pg_postmaster_start_time()
        AND NOT EXISTS (
            SELECT 1 FROM pg_locks k
             WHERE k.locktype = 'advisory' AND k.objsubid = 1 AND k.granted
               AND k.database = (SELECT oid FROM pg_database WHERE datname = current_database())
               AND ((CAST(k.classid AS bigint) << 32) | CAST(k.objid AS bigint))
                   = r.liveness_key))"""


# The liveness session. The lock is its whole point, so nothing on the server may end the
# session for idling (idle_session_timeout). A silent peer is found in about 11 s. Keepalives
# apply to TCP, and a Unix socket closes with its process anyway.
_SESSION = sa.text(
    """
    SELECT set_config('idle_session_timeout', '0', false),
           set_config('idle_in_transaction_session_timeout', '0', false),
           set_config('tcp_keepalives_idle', '5', false),
           set_config('tcp_keepalives_interval', '2', false),
           set_config('tcp_keepalives_count', '3', false)
    """
)
_LOCK = sa.text("SELECT pg_try_advisory_lock(:key)")
_UNLOCK = sa.text("SELECT pg_advisory_unlock(:key)")
# After the lock was taken again on a new session (such as after a database restart), the
# record says since when.
# Twice: it sets the time again, on a running record only.
_RETAKEN = sa.text(
    "UPDATE job_run SET liveness_since = clock_timestamp() "
    "WHERE id = :run_id AND liveness_key = :key AND status = 'running'"
)


class Liveness:
    """The lock a running run's process holds. Its ``key`` goes on the run's record."""

    def __init__(self, engine: Engine, key: int, conn: Connection) -> None:
        self.engine, self.key = engine, key
        self._conn: Connection | None = conn  # None when lost, until the next heartbeat

    @classmethod
    def take(cls, engine: Engine) -> Liveness | None:
        """A new lock on a connection of its own, or None when it cannot be had. Then the run
        goes on, judged by its lease's TTL alone."""
        key = secrets.randbits(63)  # non-negative, as pg_locks shows it in two 32-bit halves
        try:
            conn = cls._locked(engine, key)
        except DBAPIError as exc:
            log.warning("no liveness lock: %s", type(exc.orig).__name__)
            return None
        return None if conn is None else cls(engine, key, conn)

    @staticmethod
    def _locked(engine: Engine, key: int) -> Connection | None:
        conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        conn.execute(_SESSION)
        if conn.scalar(_LOCK, {"key": key}):
            return conn
        conn.close()
        return None

    def keep(self, run_id: uuid.UUID) -> None:
        """At each heartbeat, check that the session still answers. If it does not (the
        database restarted, or the session was terminated), take the lock again on a new one
        and say so on the record. A database still away raises ``DBAPIError``, and the next
        heartbeat tries again."""
        if self._conn is not None:
            try:
                self._conn.execute(sa.text("SELECT 1"))
                return
            except DBAPIError:
                self._conn.invalidate()
                self._conn = None
        self._conn = self._locked(self.engine, self.key)  # None if the old session lives on
        if self._conn is not None:
            with self.engine.begin() as record:
                record.execute(_RETAKEN, {"run_id": run_id, "key": self.key})

    def release(self) -> None:
        """Give the lock back and the connection to the pool (closing it would do as well)."""
        if self._conn is None:
            return
        try:
            self._conn.execute(_UNLOCK, {"key": self.key})
            self._conn.close()
        except DBAPIError:
            self._conn.invalidate()
        self._conn = None
