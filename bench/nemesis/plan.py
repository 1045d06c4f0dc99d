"""The nemesis's schedule: what each iteration runs and which faults it injects when, drawn
from one ``random.Random(seed)`` and nothing else, so that a seed replays exactly.

Jobs and fault kinds are dealt from shuffled decks (a new shuffle once a deck is used up):
every job of the catalog and every kind of fault comes up within a few iterations, in an
order only the seed decides. The plan of iteration ``i`` is the same whatever follows it,
so ``--iterations K`` replays the first K iterations of any longer run of the seed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import date, timedelta
from enum import StrEnum

from qo_ops.jobs.catalog import CATALOG, JOBS

DOWNSTREAM_JOBS = ("delivery_retry", "notification_publish", "order_reconciliation")
SENDING_JOBS = ("delivery_retry", "notification_publish")  # claim → call → record
LEASE_TTLS_S = (2, 3, 4)
# small batches and pauses between them: a run over a tenant's few dozen due rows lasts a
# second or two, so that faults find runs at work, and ends soon enough left alone (a run
# still at work keeps its scope from a clean end)
BATCH_SIZES = (5, 10, 20)
THROTTLES_MS = (50, 100, 200)
FAULT_AT_S = (0.6, 2.5)  # a fault lands this long after the iteration began
AFTER_RUN_START_S = (0.35, 1.5)  # a signal or a database fault, this long after a run started
# longer than a whole retry schedule (0.2 s doubling to 1 s, 8 attempts: about 5 s)
OUTAGE_S = (5.0, 12.0)
FLAKY_S = (3.0, 6.0)
DAY_SPREAD = 3  # a windowed job's window ends on its scheduled day or up to this many before
WINDOW_DAYS = 7  # a week, as the rerun property's: the demo's orders fall on some days only


class FaultKind(StrEnum):
    """What the nemesis does to the system."""

    SIGKILL = "sigkill"  # a run's process killed outright
    SIGTERM = "sigterm"  # a run asked to stop
    SIGSTOP = "sigstop"  # a run frozen past its lease TTL (a rival takes over), then SIGCONT
    PG_RESTART = "pg_restart"  # pg_ctl restart -m fast
    BACKEND_TERMINATE = "backend_terminate"  # pg_terminate_backend of every qo-ops backend
    OUTAGE_503 = "outage_503"  # the downstream answers 503 to everything, later healed
    OUTAGE_REFUSE = "outage_refuse"  # the downstream drops every connection, later healed
    FLAKY = "flaky"  # error_rate 0.2, timeout_rate 0.05, poison_rate 0.01, later healed

    @property
    def hits_a_run(self) -> bool:
        """A signal to one run's process (the others hit the database or the downstream)."""
        return self in (FaultKind.SIGKILL, FaultKind.SIGTERM, FaultKind.SIGSTOP)

    @property
    def timed_by_a_run(self) -> bool:
        """Aimed at a moment when a run is starting or at work: a signal, and a fault of the
        database (a run writing its record, its audit row or a batch meets it)."""
        return self.hits_a_run or self in (FaultKind.PG_RESTART, FaultKind.BACKEND_TERMINATE)

    @property
    def downstream(self) -> bool:
        """A fault of the downstream simulator."""
        return self in (FaultKind.OUTAGE_503, FaultKind.OUTAGE_REFUSE, FaultKind.FLAKY)


@dataclass(frozen=True)
class PlannedRun:
    """One ``qo-ops run … --mode execute`` the iteration starts, ``start_s`` after it began."""

    job: str
    tenant: str
    day_age: int | None  # a windowed job's last day: this many days before today (UTC)
    start_s: float
    batch_size: int
    throttle_ms: int

    def window(self, today: date) -> tuple[date, date] | None:
        """A windowed job's first and last day (``--from``/``--to``): a week."""
        if self.day_age is None:
            return None
        last = today - timedelta(days=self.day_age)
        return last - timedelta(days=WINDOW_DAYS - 1), last


@dataclass(frozen=True)
class PlannedFault:
    """One fault, ``at_s`` after the iteration began; ``target`` is the run a signal hits
    (the index of a planned run: if it has ended, the next one still alive); ``hold_s`` is
    how long a freeze, an outage or flakiness lasts."""

    kind: FaultKind
    at_s: float
    target: int
    hold_s: float


@dataclass(frozen=True)
class IterationPlan:
    """What one iteration does: its runs (overlapping), their lease TTL, its faults."""

    number: int
    new_tenant: str  # appended by the iteration, with the demo's anomalies (new work)
    lease_ttl_s: int
    runs: tuple[PlannedRun, ...]
    faults: tuple[PlannedFault, ...]


class Deck:
    """Cards dealt from a shuffled deck, reshuffled when used up: each card comes up once
    per pass, in an order the random source decides."""

    def __init__(self, cards: Sequence[str], rng: random.Random) -> None:
        self.cards, self.rng = list(cards), rng
        self.left: list[str] = []

    def deal(self) -> str:
        if not self.left:
            self.left = self.rng.sample(self.cards, len(self.cards))
        return self.left.pop()


def tenant_name(number: int) -> str:
    """The demo's tenant id of tenant ``number`` (``load_demo_data`` numbers them so)."""
    return f"tenant-{number:03d}"


def scheduled_day_age(job: str) -> int | None:
    """How many days back a windowed job's schedule runs (its catalog entry); None for a
    tenant job."""
    spec = CATALOG[job]
    if spec.partitioning != "tenant_day":
        return None
    return (
        spec.deployment.scheduled_window_age_days()
        if spec.deployment.scheduled_window_age_days
        else 1
    )


def plan_iterations(seed: int, initial_tenants: int) -> Iterator[IterationPlan]:
    """The nemesis's iterations for ``seed``, endlessly; iteration ``i`` appends tenant
    ``initial_tenants + i`` before it runs."""
    rng = random.Random(seed)
    jobs, faults = Deck(JOBS, rng), Deck([k.value for k in FaultKind], rng)
    ages = {job: scheduled_day_age(job) for job in JOBS}
    number = 0
    while True:
        number += 1
        fresh = tenant_name(initial_tenants + number)
        ttl = rng.choice(LEASE_TTLS_S)
        picked: list[str] = []
        for _ in range(rng.randint(2, 3)):
            job = jobs.deal()
            if job not in picked:
                picked.append(job)
        kinds = [FaultKind(faults.deal()) for _ in range(rng.randint(1, 2))]
        runs: list[PlannedRun] = []
        if any(k.downstream for k in kinds):  # an older tenant's few due items meet it
            older = tenant_name(rng.randint(1, initial_tenants + number - 1))
            batch, throttle = rng.choice(BATCH_SIZES), rng.choice(THROTTLES_MS)
            start = round(rng.uniform(0.0, 0.6), 2)
            runs.append(PlannedRun(rng.choice(SENDING_JOBS), older, None, start, batch, throttle))
        for job in picked:
            older = tenant_name(rng.randint(1, initial_tenants + number - 1))
            tenant = fresh if rng.random() < 0.7 else older
            age = ages[job]
            day_age = None if age is None else age + rng.randint(0, DAY_SPREAD)
            start = round(rng.uniform(0.0, 0.6), 2)
            batch, throttle = rng.choice(BATCH_SIZES), rng.choice(THROTTLES_MS)
            runs.append(PlannedRun(job, tenant, day_age, start, batch, throttle))
            if rng.random() < 0.5:  # the same job and scope again, overlapping on purpose
                again = round(start + rng.uniform(0.0, 0.4), 2)
                runs.append(PlannedRun(job, tenant, day_age, again, batch, throttle))
        planned = []
        runs.sort(key=lambda r: r.start_s)
        for kind in kinds:
            target = rng.randrange(len(runs))
            at = round(rng.uniform(*FAULT_AT_S), 2)
            if kind.timed_by_a_run:  # while that run starts or works (it starts in ~0.5 s)
                at = round(runs[target].start_s + rng.uniform(*AFTER_RUN_START_S), 2)
            hold = {
                FaultKind.SIGSTOP: ttl + rng.uniform(0.5, 1.5),
                FaultKind.OUTAGE_503: rng.uniform(*OUTAGE_S),
                FaultKind.OUTAGE_REFUSE: rng.uniform(*OUTAGE_S),
                FaultKind.FLAKY: rng.uniform(*FLAKY_S),
            }.get(kind, 0.0)
            planned.append(PlannedFault(kind, at, target, round(hold, 2)))
        yield IterationPlan(number, fresh, ttl, tuple(runs), tuple(planned))
