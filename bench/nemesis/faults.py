"""Injecting each kind of fault for real, and healing it: signals to ``qo-ops run``
processes, ``pg_ctl restart``, ``pg_terminate_backend``, and the simulator's faults changed
through its admin API (``POST /admin/faults``)."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from bench.nemesis.plan import FaultKind, PlannedFault
from bench.nemesis.processes import RunProcess
from bench.nemesis.world import APPLICATION_NAME, World, patiently
from qo_ops.platform.run.liveness import RUN_GONE

FLAKY = {"error_rate": 0.2, "timeout_rate": 0.05, "poison_rate": 0.01}
HEALTHY = {"error_rate": 0.0, "timeout_rate": 0.0, "poison_rate": 0.0}
SIGNALS = {
    FaultKind.SIGKILL: signal.SIGKILL,
    FaultKind.SIGTERM: signal.SIGTERM,
    FaultKind.SIGSTOP: signal.SIGSTOP,
}

# Whether the running record of process :pid is gone by liveness (None: it has none).
KILLED_RUN_GONE = sa.text(
    f"""
    SELECT {RUN_GONE} FROM job_run r
     WHERE r.status = 'running' AND r.owner_id LIKE '%:' || :pid || ':%'
     ORDER BY r.started_at DESC LIMIT 1
    """
)
GONE_WAIT_S = 10.0  # a bound for the measurement: past it, reported as this many seconds

# Every qo-ops session of the nemesis's database; the harness's own are spared by name.
TERMINATE_QO_OPS_BACKENDS = sa.text(
    """
    SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
     WHERE datname = current_database() AND pid <> pg_backend_pid()
       AND backend_type = 'client backend'
       AND application_name IS DISTINCT FROM :harness
    """
)


@dataclass
class FaultRecord:
    """One fault as it happened: whether it landed (a signal needs a live run, a restart
    our own server), what it hit, and when it began and ended on the database's clock."""

    iteration: int
    kind: FaultKind
    landed: bool
    detail: str
    began_db: datetime
    ended_db: datetime | None = None
    ended: float | None = None  # monotonic: the moment it was over (healed, or done)
    victim: RunProcess | None = None  # the run a signal hit
    # a SIGKILL that hit a recorded running run: seconds until PostgreSQL showed its
    # process gone (its scope free to the next run)
    freed_after_s: float | None = None


class Injector:
    """Injects the planned faults of one nemesis into ``world`` and heals them."""

    def __init__(self, world: World) -> None:
        self.world = world

    def begin(self, iteration: int, fault: PlannedFault, runs: list[RunProcess]) -> FaultRecord:
        """Inject ``fault``; a signal hits the first run still alive from its target on."""
        began = self.world.db_now()
        kind = fault.kind
        if kind.hits_a_run:
            victim = _first_alive(runs, fault.target)
            if victim is None or not victim.send(SIGNALS[kind]):
                return self._done(FaultRecord(iteration, kind, False, "no run alive", began))
            sent = time.monotonic()
            what = f"{kind.value} {victim.target} (pid {victim.pid})"
            record = FaultRecord(iteration, kind, True, what, began, victim=victim)
            if kind is FaultKind.SIGKILL:
                record.freed_after_s = self._gone_after(victim.pid, sent)
            return record if kind is FaultKind.SIGSTOP else self._done(record)
        if kind is FaultKind.PG_RESTART:
            if not self.world.server.restartable:
                detail = "left out: the server is QO_OPS_TEST_DATABASE_URL's, not ours"
                return self._done(FaultRecord(iteration, kind, False, detail, began))
            started = time.monotonic()
            self.world.server.restart()
            detail = f"pg_ctl restart -m fast ({time.monotonic() - started:.1f} s)"
            return self._done(FaultRecord(iteration, kind, True, detail, began))
        if kind is FaultKind.BACKEND_TERMINATE:
            ended = self._terminate_backends()
            record = FaultRecord(iteration, kind, True, f"{ended} qo-ops backends ended", began)
            return self._done(record)
        if kind is FaultKind.FLAKY:
            self.world.client.set_faults(**FLAKY)
            return FaultRecord(iteration, kind, True, "error 0.2, timeout 0.05, poison 0.01", began)
        outage = "503" if kind is FaultKind.OUTAGE_503 else "refuse"
        self.world.client.set_faults(outage=outage)
        return FaultRecord(iteration, kind, True, f"outage {outage}", began)

    def end(self, record: FaultRecord) -> None:
        """Heal a fault that lasts (a freeze, an outage, flakiness); others are over."""
        if record.ended is not None:
            return
        kind = record.kind
        if kind is FaultKind.SIGSTOP and record.victim is not None:
            record.victim.send(signal.SIGCONT)
        elif kind is FaultKind.FLAKY:
            self.world.client.set_faults(**HEALTHY)
        elif kind in (FaultKind.OUTAGE_503, FaultKind.OUTAGE_REFUSE):
            self.world.client.set_faults(outage=None)
        self._done(record)

    def _done(self, record: FaultRecord) -> FaultRecord:
        record.ended_db = self.world.db_now()
        record.ended = time.monotonic()
        return record

    def _gone_after(self, pid: int, sent: float) -> float | None:
        """Seconds from the kill until the killed process's running record is judged gone
        (the lease's and the reaper's predicate); None if it had no running record."""
        while time.monotonic() - sent < GONE_WAIT_S:
            with self.world.engine.connect() as conn:
                gone = conn.execute(KILLED_RUN_GONE, {"pid": str(pid)}).scalar()
            if gone is None:
                return None
            if gone:
                return time.monotonic() - sent
            time.sleep(0.01)
        return GONE_WAIT_S

    def _terminate_backends(self) -> int:
        def terminate() -> int:
            with self.world.engine.connect() as conn:
                ended: int = conn.execute(
                    TERMINATE_QO_OPS_BACKENDS, {"harness": APPLICATION_NAME}
                ).scalar_one()
                conn.commit()
                return ended

        return patiently(terminate, "terminating qo-ops's backends")

    def heal_downstream(self) -> None:
        """The downstream healthy, whatever was planned."""
        self.world.client.set_faults(outage=None, **HEALTHY)


def _first_alive(runs: list[RunProcess], target: int) -> RunProcess | None:
    """The first run still alive (and not frozen) from index ``target`` on, cyclically."""
    if not runs:
        return None
    for step in range(len(runs)):
        run = runs[(target + step) % len(runs)]
        if run.alive() and not run.frozen:
            return run
    return None
