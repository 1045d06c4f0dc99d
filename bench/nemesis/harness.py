"""One nemesis run: iterations of overlapping real runs under seeded faults, each healed and
timed to a clean end; then a final clean pass and the invariant checker."""

from __future__ import annotations

import heapq
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, date
from pathlib import Path

import sqlalchemy as sa

from bench import common
from bench.nemesis.clean_end import CleanEnd, Reruns, measure_clean_end, reaped_after_kill
from bench.nemesis.faults import FaultRecord, Injector
from bench.nemesis.invariants import (
    Evidence,
    FinalRun,
    Outage,
    Violation,
    check_all,
    coverage,
)
from bench.nemesis.plan import (
    DOWNSTREAM_JOBS,
    SENDING_JOBS,
    FaultKind,
    IterationPlan,
    plan_iterations,
)
from bench.nemesis.processes import Launcher, RunLimits, RunProcess, RunTarget
from bench.nemesis.world import Server, World, bench_server, patiently, world
from qo_ops.jobs.catalog import JOBS

SCHEDULE_EVERY_S = 1.0  # while the downstream is faulty, its callers run again this often
DRAIN_S = 60.0  # the final pass sends what is still due or claimed for at most this long
TICK_S = 0.05
FINAL_AT_ONCE = 2  # runs of the final pass at once (two cores)
SLOW_CLEAN_END_S = 3.0  # a slower clean end is shown with what it waited for
Say = Callable[[str], None]


@dataclass(frozen=True)
class NemesisConfig:
    """One nemesis: its seed, and how long it goes on (``iterations``, else ``seconds``)."""

    seed: int
    iterations: int | None = None
    seconds: float | None = None
    initial_tenants: int = 2
    keep_logs: bool = False  # keep the runs' output even when nothing was found

    def replay_command(self, iterations: int) -> str:
        """The one command that replays this nemesis's fault schedule."""
        return f"python -m bench.nemesis --seed {self.seed} --iterations {iterations}"


@dataclass
class IterationResult:
    """What one iteration ran, the faults it injected and how it ended."""

    number: int
    runs: list[str]
    faults: list[FaultRecord]
    clean_end: CleanEnd
    # each landed SIGKILL that ended a recorded run: seconds until its record was reaped
    reaped_after_kill_s: list[float] = field(default_factory=list)


@dataclass
class NemesisResult:
    """Everything a nemesis found: per iteration, the final pass, the violations."""

    config: NemesisConfig
    iterations: list[IterationResult] = field(default_factory=list)
    final_runs: list[FinalRun] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)  # what the invariants looked at
    took_s: float = 0.0
    logs: Path | None = None  # kept when something was found

    @property
    def replay(self) -> str:
        return self.config.replay_command(len(self.iterations))


@dataclass
class Nemesis:
    """What one nemesis run shares across its iterations."""

    config: NemesisConfig
    world: World
    launcher: Launcher
    say: Say
    used: dict[RunTarget, int] = field(default_factory=dict)  # every (job, scope), its TTL
    outages: list[Outage] = field(default_factory=list)

    def reason(self, iteration: int, what: str) -> str:
        return f"nemesis seed {self.config.seed} iteration {iteration}: {what}"


class Iteration:
    """One iteration as it runs: its plan, the processes it started, its faults."""

    def __init__(self, nemesis: Nemesis, plan: IterationPlan, today: date) -> None:
        self.nemesis, self.plan = nemesis, plan
        self.injector = Injector(nemesis.world)
        self.targets = [RunTarget(r.job, r.tenant, r.window(today)) for r in plan.runs]
        self.events: list[tuple[float, int, str, int]] = []  # (at, order, what, index)
        for index, run in enumerate(plan.runs):
            self._at(run.start_s, "run", index)
        for index, fault in enumerate(plan.faults):
            self._at(fault.at_s, "fault", index)
        self.planned: list[RunProcess] = []  # in plan order: what a signal's target indexes
        self.started: list[RunProcess] = []
        self.records: list[FaultRecord] = []
        self.lasting: list[tuple[float, FaultRecord]] = []  # (when it heals, the fault)
        self.last_schedule = -SCHEDULE_EVERY_S

    def _at(self, at_s: float, what: str, index: int) -> None:
        heapq.heappush(self.events, (at_s, len(self.events), what, index))

    def _start(self, target: RunTarget, limits: RunLimits, why: str) -> RunProcess:
        reason = self.nemesis.reason(self.plan.number, why)
        process = self.nemesis.launcher.start(target, limits, why, reason, self.plan.number)
        self.started.append(process)
        return process

    def run(self) -> IterationResult:
        """Start the runs and inject the faults at their moments, heal, and measure the time
        from the last fault to a clean end."""
        begin = time.monotonic()
        while self.events or self.lasting:
            now = time.monotonic() - begin
            while self.events and self.events[0][0] <= now:
                _, _, what, index = heapq.heappop(self.events)
                self._happen(what, index)
            self._heal_due(now)
            self._schedule_callers(now)
            time.sleep(TICK_S)
        self.injector.heal_downstream()
        nemesis, ttl = self.nemesis, self.plan.lease_ttl_s
        touched = list(dict.fromkeys(p.target for p in self.started))
        for target in touched:
            nemesis.used[target] = max(ttl, nemesis.used.get(target, 0))
        since = max((r.ended or begin for r in self.records), default=begin)
        reason = nemesis.reason(self.plan.number, "rerun after the faults")
        reruns = Reruns(nemesis.launcher, RunLimits(ttl), reason, self.plan.number)
        clean = measure_clean_end(nemesis.world, reruns, touched, since, 3 * ttl + 30.0)
        if clean.seconds is None:  # a violation; the next iteration starts with none alive
            nemesis.launcher.stop_all()
        runs = [f"{p.target} ({p.why}, exit {p.exit_code})" for p in self.started]
        reaped = [
            seconds
            for r in self.records
            if r.kind is FaultKind.SIGKILL and r.landed and r.victim is not None
            if (
                seconds := reaped_after_kill(
                    nemesis.world, r.victim.target, r.victim.pid, r.began_db
                )
            )
            is not None
        ]
        return IterationResult(self.plan.number, runs, self.records, clean, reaped)

    def _happen(self, what: str, index: int) -> None:
        plan = self.plan
        if what == "run":
            run = plan.runs[index]
            limits = RunLimits(plan.lease_ttl_s, run.batch_size, run.throttle_ms)
            self.planned.append(self._start(self.targets[index], limits, "planned"))
        elif what == "fault":
            fault = plan.faults[index]
            record = self.injector.begin(plan.number, fault, self.planned)
            self.records.append(record)
            if record.ended is None:
                self.lasting.append((fault.at_s + fault.hold_s, record))
            if record.kind is FaultKind.SIGSTOP and record.landed:
                self._at(fault.at_s + plan.lease_ttl_s + 0.3, "rival", len(self.records) - 1)
        else:  # a rival of the frozen run, once the frozen run's lease has lapsed
            victim = self.records[index].victim
            assert victim is not None
            self._start(victim.target, RunLimits(plan.lease_ttl_s), "rival")

    def _heal_due(self, now: float) -> None:
        for heals_at, record in list(self.lasting):
            if now >= heals_at:
                self.injector.end(record)
                self.lasting.remove((heals_at, record))
                if record.kind in (FaultKind.OUTAGE_503, FaultKind.OUTAGE_REFUSE):
                    assert record.ended_db is not None
                    outage = Outage(self.plan.number, record.began_db, record.ended_db)
                    self.nemesis.outages.append(outage)

    def _schedule_callers(self, now: float) -> None:
        """While the downstream is faulty, its callers run again every second (as their
        schedules would), one run per scope at a time."""
        if not any(r.kind.downstream for _, r in self.lasting):
            return
        if now - self.last_schedule < SCHEDULE_EVERY_S:
            return
        self.last_schedule = now
        alive = {p.target for p in self.nemesis.launcher.alive()}
        for target in dict.fromkeys(self.targets):
            if target.job in DOWNSTREAM_JOBS and target not in alive:
                self._start(target, RunLimits(self.plan.lease_ttl_s), "schedule")


# ------------------------------------------------------------------ the final clean pass

# What the sending jobs still have to do: items due (or soon) or claimed in the tenants
# delivery_retry ran for, events due (or soon) or claimed, unpublished, in notification_publish's.
LEFT_TO_SEND = sa.text(
    """
    SELECT (SELECT count(*) FROM delivery_attempt_item WHERE tenant_id = ANY(:delivering)
              AND (status = 'IN_PROGRESS' OR (status = 'READY'
                   AND next_attempt_at <= clock_timestamp() + interval '2 seconds')))
         + (SELECT count(*) FROM outbox_event WHERE tenant_id = ANY(:publishing)
              AND published_at IS NULL AND dead_lettered_at IS NULL
              AND available_at <= clock_timestamp() + make_interval(secs => :claim_s))
    """
)


def final_pass(nemesis: Nemesis) -> list[FinalRun]:
    """Each (job, scope) the nemesis ran, once more with no fault: order_reconciliation
    first (its re-submissions are then sent), the sending jobs last, and again until nothing
    is due or claimed in their tenants; the last run of each is its final run."""
    launcher = nemesis.launcher
    for process in launcher.alive():
        process.wait(60.0)
    launcher.stop_all()
    ordered = sorted(nemesis.used, key=lambda t: (JOBS.index(t.job), t.tenant, str(t.window)))
    first = [t for t in ordered if t.job == "order_reconciliation"]
    senders = [t for t in ordered if t.job in SENDING_JOBS]
    others = [t for t in ordered if t not in first and t not in senders]
    last: dict[RunTarget, RunProcess] = {}
    for phase in (first, others, senders):
        last.update(_run_each(nemesis, phase, "final pass"))
    tenants = {job: sorted({t.tenant for t in senders if t.job == job}) for job in SENDING_JOBS}
    claim_s = 2 * max((nemesis.used[t] for t in senders), default=0) + 1
    until = time.monotonic() + DRAIN_S
    while senders and time.monotonic() < until:
        left = _left_to_send(nemesis, tenants, claim_s)
        if not left:
            break
        nemesis.say(f"  draining: {left} items or events due or claimed")
        time.sleep(0.5)
        last.update(_run_each(nemesis, senders, "final pass, draining"))
    return [FinalRun(str(t), p.exit_code, p.summary()) for t, p in last.items()]


def _run_each(nemesis: Nemesis, targets: list[RunTarget], why: str) -> dict[RunTarget, RunProcess]:
    """Run each target to its end, ``FINAL_AT_ONCE`` at a time (distinct scopes: no two
    share a lease)."""
    reason = f"nemesis seed {nemesis.config.seed}: {why}"
    started: dict[RunTarget, RunProcess] = {}
    for target in targets:
        while sum(p.alive() for p in started.values()) >= FINAL_AT_ONCE:
            time.sleep(TICK_S)
        limits = RunLimits(nemesis.used[target])
        started[target] = nemesis.launcher.start(target, limits, "final", reason)
    for process in started.values():
        if process.wait(120.0) is None:
            process.kill()
    return started


def _left_to_send(nemesis: Nemesis, tenants: dict[str, list[str]], claim_s: float) -> int:
    def read() -> int:
        params = {
            "delivering": tenants["delivery_retry"],
            "publishing": tenants["notification_publish"],
            "claim_s": claim_s,
        }
        with nemesis.world.engine.connect() as conn:
            left: int = conn.execute(LEFT_TO_SEND, params).scalar_one()
            return left

    return patiently(read, "counting what is left to send")


# ------------------------------------------------------------------ the whole run


def run_nemesis(
    config: NemesisConfig, server: Server | None = None, say: Say = print
) -> NemesisResult:
    """Run the nemesis of ``config`` on ``server`` (default: our own embedded server, or
    QO_OPS_TEST_DATABASE_URL's); its logs are kept (and named) only when it found something."""
    if (config.iterations is None) == (config.seconds is None):
        raise ValueError("give iterations or seconds, not both")
    work = Path(tempfile.mkdtemp(prefix="qo-ops-nemesis-"))
    result = NemesisResult(config)
    started = time.monotonic()
    try:
        if server is None:
            with bench_server() as own:
                _run(config, own, work, result, say)
        else:
            _run(config, server, work, result, say)
    finally:
        result.took_s = time.monotonic() - started
        if result.violations or config.keep_logs:
            result.logs = work
        else:
            shutil.rmtree(work, ignore_errors=True)
    return result


def _run(
    config: NemesisConfig, server: Server, work: Path, result: NemesisResult, say: Say
) -> None:
    with world(server, work, config.seed) as the_world:
        approvals = common.standing_approvals(the_world.engine)  # destructive executes cite one
        launcher = Launcher(the_world.run_env(), work / "logs", approvals)
        nemesis = Nemesis(config, the_world, launcher, say)
        try:
            the_world.add_tenants(config.initial_tenants)
            since = the_world.db_now()
            plans = plan_iterations(config.seed, config.initial_tenants)
            begin = time.monotonic()
            while _more(config, len(result.iterations), time.monotonic() - begin):
                plan = next(plans)
                (added,) = the_world.add_tenants(1)  # new work of every kind arrives
                assert added == plan.new_tenant, (added, plan.new_tenant)
                today = the_world.db_now().astimezone(UTC).date()
                done = Iteration(nemesis, plan, today).run()
                result.iterations.append(done)
                say(describe_iteration(done))
            say(f"final clean pass over {len(nemesis.used)} (job, scope) …")
            result.final_runs = final_pass(nemesis)
            stats = the_world.client.stats(detail=True)
            evidence = Evidence(since, tuple(nemesis.outages), result.final_runs)
            with the_world.engine.connect() as conn:
                result.violations = check_all(conn, stats, evidence)
                result.checked = coverage(conn, stats, since)
            result.violations += [
                Violation(
                    "clean_end",
                    f"iteration {i.number}: no clean end within the timeout ({i.clean_end.left})",
                )
                for i in result.iterations
                if i.clean_end.seconds is None
            ]
        finally:
            launcher.stop_all()


def _more(config: NemesisConfig, done: int, elapsed_s: float) -> bool:
    if config.iterations is not None:
        return done < config.iterations
    assert config.seconds is not None
    return elapsed_s < config.seconds


def describe_iteration(done: IterationResult) -> str:
    """One line: the iteration's faults and its time to a clean end."""
    faults = ", ".join(
        f"{r.kind.value}{'' if r.landed else ' (missed: ' + r.detail + ')'}" for r in done.faults
    )
    clean = done.clean_end
    end = "no clean end" if clean.seconds is None else f"clean end {clean.seconds:.1f} s"
    line = f"  iteration {done.number}: {len(done.runs)} runs; {faults}; {end}"
    line += f" ({clean.reruns} reruns)"
    if clean.seconds is None or clean.seconds > SLOW_CLEAN_END_S:
        line += f"\n    waited for: {clean.why_so_long()}"
    return line
