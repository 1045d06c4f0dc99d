"""The time from the last fault to a clean end: no ``job_run`` row ``running``, no lease
held by a holder that is gone, and a rerun of each (job, scope) the iteration touched that
is not ``skipped``. Reruns are started as an operator (or the schedule) would, every half
second, until then; whatever the time is, it is measured, never assumed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import sqlalchemy as sa

from bench.nemesis.processes import SKIPPED_EXIT, Launcher, RunLimits, RunProcess, RunTarget
from bench.nemesis.world import World, patiently

RERUN_EVERY_S = 0.5

# What is not clean yet: runs still recorded running, leases still unexpired (read when no
# process of the nemesis is alive, so every holder is gone).
UNCLEAN = sa.text(
    """
    SELECT (SELECT coalesce(array_agg(job_name || ' ' || scope ORDER BY job_name, scope), '{}')
              FROM job_run WHERE status = 'running') AS running,
           (SELECT coalesce(array_agg(job_name || ' ' || scope ORDER BY job_name, scope), '{}')
              FROM job_lease WHERE expires_at > clock_timestamp()) AS leased
    """
)


@dataclass(frozen=True)
class Unclean:
    """``job scope`` of each run recorded running and of each lease still held."""

    running: tuple[str, ...]
    leased: tuple[str, ...]

    def jobs(self) -> set[str]:
        return {entry.split(" ", 1)[0] for entry in (*self.running, *self.leased)}

    def __bool__(self) -> bool:
        return bool(self.running or self.leased)


@dataclass
class CleanEnd:
    """How an iteration ended: the seconds from its last fault to a clean end (None: none
    within the timeout, and ``left`` says what was still wrong), and the reruns it took."""

    seconds: float | None
    reruns: int
    left: str = ""
    skipped: list[str] = field(default_factory=list)  # reruns that found the scope held
    waited_for: set[str] = field(default_factory=set)  # runs at work, rows left, meanwhile

    def why_so_long(self) -> str:
        """What the way to the clean end waited for: runs still at work, reruns skipped
        (a lease held), runs recorded running, leases unexpired."""
        skipped = sorted(set(self.skipped))
        parts = sorted(self.waited_for) + [f"rerun skipped: {s}" for s in skipped]
        return "; ".join(parts) or "only the reruns themselves (each a process of its own)"


def unclean(world: World) -> Unclean:
    """Runs recorded running and leases unexpired, now."""

    def read() -> Unclean:
        with world.engine.connect() as conn:
            row = conn.execute(UNCLEAN).one()
        return Unclean(tuple(row.running), tuple(row.leased))

    return patiently(read, "reading runs and leases")


@dataclass(frozen=True)
class Reruns:
    """How the way to a clean end reruns a (job, scope): through which launcher, with which
    limits (the iteration's lease TTL) and under which reason (audited)."""

    launcher: Launcher
    limits: RunLimits
    reason: str
    iteration: int

    def start(self, target: RunTarget) -> RunProcess:
        return self.launcher.start(target, self.limits, "rerun", self.reason, self.iteration)


# The record of the run a SIGKILL ended: finished by a reaper (orphaned) after the kill; how
# long after it (both times the database's). Read-only.
REAPED_AFTER_KILL = sa.text(
    """
    SELECT extract(epoch FROM finished_at - CAST(:killed_at AS timestamptz)) AS seconds
      FROM job_run
     WHERE job_name = :job AND scope = :scope AND owner_id LIKE '%:' || :pid || ':%'
       AND started_at <= CAST(:killed_at AS timestamptz) AND status_reason = 'orphaned'
       AND finished_at >= CAST(:killed_at AS timestamptz)  -- not reaped before (cut session)
     ORDER BY started_at DESC LIMIT 1
    """
)


def reaped_after_kill(world: World, target: RunTarget, pid: int, killed_at: object) -> float | None:
    """Seconds from a SIGKILL to its run's record finished (reaped), its scope free with it
    (the lease of a gone holder is free at once); None when the kill hit no recorded run
    (before its record, or after its end)."""

    def read() -> float | None:
        with world.engine.connect() as conn:
            seconds = conn.execute(
                REAPED_AFTER_KILL,
                {"job": target.job, "scope": target.scope, "pid": str(pid), "killed_at": killed_at},
            ).scalar()
        return None if seconds is None else float(seconds)

    return patiently(read, "reading the killed run's record")


def measure_clean_end(
    world: World, reruns: Reruns, touched: list[RunTarget], since: float, timeout_s: float
) -> CleanEnd:
    """Rerun every touched (job, scope) until each rerun is not skipped, then wait until
    nothing is recorded running and no lease is held (rerunning the jobs that still have
    such rows: a run of a job reaps its orphans); ``since`` is the last fault's end."""
    launcher = reruns.launcher
    done: set[RunTarget] = set()
    pending: dict[RunTarget, RunProcess] = {}
    started, skipped, waited = 0, [], set()
    next_round = time.monotonic()
    state = Unclean((), ())
    while True:
        for target, process in list(pending.items()):
            if not process.alive():
                del pending[target]
                if process.exit_code == SKIPPED_EXIT:
                    skipped.append(str(target))
                else:
                    done.add(target)
        now = time.monotonic()
        at_work = [p for p in launcher.alive() if p.why != "rerun"]
        waited |= {f"{p.why} run at work: {p.target}" for p in at_work}
        if not launcher.alive():
            state = unclean(world)
            waited |= {f"recorded running: {r}" for r in state.running}
            waited |= {f"lease held: {r}" for r in state.leased}
            if not state and done >= set(touched):
                return CleanEnd(time.monotonic() - since, started, "", skipped, waited)
        if now - since > timeout_s:
            left = [f"not rerun without a skip: {', '.join(map(str, set(touched) - done))}"]
            left += [f"recorded running: {', '.join(state.running)}"] if state.running else []
            left += [f"leases held: {', '.join(state.leased)}"] if state.leased else []
            alive = launcher.alive()
            left += [f"processes alive: {', '.join(map(str, (p.target for p in alive)))}"]
            return CleanEnd(None, started, "; ".join(left), skipped, waited)
        if now >= next_round:
            next_round = now + RERUN_EVERY_S
            stuck = state.jobs()
            for target in touched:
                if target in pending or (target in done and target.job not in stuck):
                    continue
                pending[target] = reruns.start(target)
                started += 1
        time.sleep(0.05)
