"""The lease decides which run may write for a (job, scope). Only the database clock counts.

A run takes the lease with one conditional upsert. That succeeds when the lease is free or
expired, and it raises the fencing token by one. A heartbeat keeps the lease alive. Every
batch transaction checks the token and the fencing token under a share lock. So a holder
that was paused or cut off past its expiry writes nothing once another run has taken over.
"""

from __future__ import annotations

import logging
import secrets
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from qo_ops.platform.run.liveness import RUN_GONE

log = logging.getLogger(__name__)

# We take the lease when it is free, expired, or held by a run whose process is gone (its
# liveness lock dropped). The fencing token only ever goes up.
# Twice: a held, unexpired lease of a live holder matches nothing (the upsert's WHERE), so
# of two racing acquires one wins, and a second acquire by the winner finds it held.
_ACQUIRE = sa.text(
    f"""
    INSERT INTO job_lease AS l (job_name, scope, owner_id, lease_token, fencing_token,
                                acquired_at, heartbeat_at, expires_at, job_run_id)
    VALUES (:job, :scope, :owner, :token, 1, clock_timestamp(), clock_timestamp(),
            clock_timestamp() + make_interval(secs => :ttl), :run_id)
    ON CONFLICT (job_name, scope) DO UPDATE
       SET owner_id = EXCLUDED.owner_id, lease_token = EXCLUDED.lease_token,
           fencing_token = l.fencing_token + 1, acquired_at = EXCLUDED.acquired_at,
           heartbeat_at = EXCLUDED.heartbeat_at, expires_at = EXCLUDED.expires_at,
           job_run_id = EXCLUDED.job_run_id
     WHERE l.expires_at < clock_timestamp()
        OR EXISTS (SELECT 1 FROM job_run r WHERE r.id = l.job_run_id AND {RUN_GONE})
    RETURNING fencing_token
    """
)

# Extend the lease only while it is still ours and unexpired. A lapsed lease is never revived.
# Twice: extending again only moves the expiry to now + TTL once more.
_HEARTBEAT = sa.text(
    """
    UPDATE job_lease SET heartbeat_at = clock_timestamp(),
                         expires_at = clock_timestamp() + make_interval(secs => :ttl)
     WHERE job_name = :job AND scope = :scope AND lease_token = :token
       AND fencing_token = :fence AND expires_at > clock_timestamp()
    RETURNING expires_at
    """
)

# The fence. Inside the batch transaction it checks that the lease is still ours and
# unexpired, and it holds the row FOR SHARE, so no one can take the lease over until this
# transaction ends.
# It also says why the run must stop now, if it must. That is either a cancel asked on its
# job_run row, or a suspension of its job for its tenant or for every scope (the kill
# switch, job_control). Reading this here saves the batch a round trip.
# In the same round trip it sets idle_in_transaction_session_timeout (SET LOCAL) to the
# lease's TTL, before the transaction can first be idle. The value is bound as :idle_ms,
# because SET takes no parameters. The server then cuts off a holder frozen
# mid-transaction, which releases its locks.
# When the lease is lost, no row comes back, nothing is set, and the transaction is rolled
# back.
_GUARD = sa.text(
    """
    SELECT CASE
             WHEN (SELECT r.cancel_requested_at IS NOT NULL FROM job_run r WHERE r.id = :run_id)
               THEN 'cancel requested'
             WHEN EXISTS (SELECT 1 FROM job_control c WHERE c.job_name = :job
                             AND c.tenant_id IN ('', split_part(:scope, '/', 1)))
               THEN 'suspended'
           END AS stop,
           set_config('idle_in_transaction_session_timeout', :idle_ms, true) AS idle_timeout
      FROM job_lease
     WHERE job_name = :job AND scope = :scope AND lease_token = :token
       AND fencing_token = :fence AND expires_at > clock_timestamp()
    FOR SHARE OF job_lease
    """
)

# Give the lease back by expiring it; the row (and its fencing token) stays.
# Twice: it matches only our token and fencing token. A second release re-expires our own
# lapsed lease, and it never touches a lease another run has taken since (a new token).
_RELEASE = sa.text(
    """
    UPDATE job_lease SET expires_at = clock_timestamp(), heartbeat_at = clock_timestamp()
     WHERE job_name = :job AND scope = :scope AND lease_token = :token AND fencing_token = :fence
    """
)


class LeaseLost(Exception):
    """The run no longer holds its lease, so it must write nothing more."""


@dataclass(frozen=True)
class Lease:
    """A held lease. ``token`` is secret to its holder and never logged."""

    job_name: str
    scope: str
    owner_id: str
    token: str
    fencing_token: int
    ttl_s: float

    def _params(self) -> dict[str, object]:
        return {
            "job": self.job_name,
            "scope": self.scope,
            "token": self.token,
            "fence": self.fencing_token,
            "ttl": self.ttl_s,
        }

    def guard(self, conn: Connection, run_id: uuid.UUID | None = None) -> str | None:
        """Raise :class:`LeaseLost` unless this lease is still ours, and hold it until commit.

        The transaction's ``idle_in_transaction_session_timeout`` becomes the lease's TTL.
        Returns why run ``run_id`` must stop ("cancel requested", "suspended"), or None.
        """
        idle_ms = f"{int(self.ttl_s * 1000)}ms"
        row = conn.execute(_GUARD, {**self._params(), "run_id": run_id, "idle_ms": idle_ms}).first()
        if row is None:
            raise LeaseLost(f"lease on {self.job_name}/{self.scope} is no longer held")
        stop: str | None = row.stop
        return stop

    def heartbeat(self, engine: Engine) -> bool:
        """Extend the lease. Returns False when it has been lost (expired or taken over)."""
        with engine.begin() as conn:
            return conn.execute(_HEARTBEAT, self._params()).first() is not None

    def release(self, engine: Engine) -> None:
        """Give the lease back (a no-op if someone else holds it now)."""
        with engine.begin() as conn:
            conn.execute(_RELEASE, self._params())

    def still_held(self, engine: Engine) -> bool:
        """Whether the lease is still ours and unexpired (no lock taken)."""
        with engine.connect() as conn:
            return (
                conn.execute(
                    sa.text(
                        "SELECT 1 FROM job_lease WHERE job_name = :job AND scope = :scope "
                        "AND lease_token = :token AND fencing_token = :fence "
                        "AND expires_at > clock_timestamp()"
                    ),
                    self._params(),
                ).first()
                is not None
            )


LOCK_TIMEOUT_MS = 2000  # how long taking the lease waits for a holder's batch to commit
# SET LOCAL lock_timeout. The value is bound, because SET itself takes no parameters.
_LOCK_TIMEOUT = sa.text("SELECT set_config('lock_timeout', :ms, true)")


def acquire(
    engine: Engine,
    job_name: str,
    scope: str,
    owner_id: str,
    ttl_s: float,
    job_run_id: uuid.UUID,
) -> Lease | None:
    """Take the lease of (job, scope) if it is free or expired, else return None.

    Waiting is bounded. If a holder's batch transaction keeps the lease row locked longer
    than :data:`LOCK_TIMEOUT_MS`, the lease counts as held.
    """
    token = secrets.token_hex(16)
    try:
        with engine.begin() as conn:
            conn.execute(_LOCK_TIMEOUT, {"ms": str(LOCK_TIMEOUT_MS)})
            fence = conn.execute(
                _ACQUIRE,
                {
                    "job": job_name,
                    "scope": scope,
                    "owner": owner_id,
                    "token": token,
                    "ttl": ttl_s,
                    "run_id": job_run_id,
                },
            ).scalar()
    except DBAPIError as exc:
        if "lock timeout" in str(exc.orig):
            return None
        raise
    if fence is None:
        return None
    return Lease(job_name, scope, owner_id, token, int(fence), ttl_s)


class Heartbeat:
    """Extends a lease every ``ttl / 3`` seconds in a background thread until stopped.

    When an extension finds the lease gone, it sets ``lost``. The runner checks that flag
    between batches, and the guard refuses inside them regardless. After each beat it calls
    ``on_beat``. The runner's keeps its liveness lock and reaps the runs whose process is gone.
    """

    def __init__(
        self,
        engine: Engine,
        lease: Lease,
        job_run_id: uuid.UUID,
        on_beat: Callable[[], None] | None = None,
    ) -> None:
        self._engine = engine
        self._lease = lease
        self._run_id = job_run_id
        self._on_beat = on_beat
        self._stop = threading.Event()
        self.lost = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="qo-ops-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def _loop(self) -> None:
        interval = max(self._lease.ttl_s / 3.0, 0.2)
        while not self._stop.wait(interval):
            try:
                if not self._lease.heartbeat(self._engine):
                    self.lost.set()
                    return
                with self._engine.begin() as conn:
                    conn.execute(
                        sa.text(
                            "UPDATE job_run SET heartbeat_at = clock_timestamp() WHERE id = :id"
                        ),
                        {"id": self._run_id},
                    )
                if self._on_beat is not None:
                    self._on_beat()
            except DBAPIError as exc:  # the database may come back before the lease expires
                log.warning("heartbeat failed: %s", type(exc.orig).__name__)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


# The scopes of a job whose lease is unexpired and whose holder is not gone. It only reads.
_HELD = sa.text(
    f"""
    SELECT l.scope FROM job_lease l
     WHERE l.job_name = :job AND l.expires_at > clock_timestamp()
       AND NOT EXISTS (SELECT 1 FROM job_run r WHERE r.id = l.job_run_id AND {RUN_GONE})
    """
)


def held_scopes(conn: Connection, job_name: str) -> set[str]:
    """The scopes of ``job_name`` whose lease a live run holds now, so a run is working on
    them."""
    return set(conn.execute(_HELD, {"job": job_name}).scalars())
