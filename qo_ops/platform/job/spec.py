"""What a job is. Each job declares one ``JobSpec``, and every trigger and adapter derives
from it.

Up front it says what the job does: its selection, its transition (and what follows it),
its outcome check and its limits. Beside them are small parts, grouped by who reads them:
``Batching`` (the runner), ``Presentation`` (the Dagster UI and the run's report),
``Deployment`` (schedules, sensors, Kubernetes), ``Signals`` (the exporter and the run's
report) and ``Recovery`` (the operator's actions). Fields that only work together are one
object, so a wrong pairing cannot be written. The remaining rules are checked when a spec
is made.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.platform.job.labels import Reconciliation
from qo_ops.platform.job.options import Limits
from qo_ops.platform.job.outcome import BatchContext, BatchOutcome, OutcomeCheck, ReportRow
from qo_ops.platform.job.resources import RunResources
from qo_ops.platform.job.review import DeadLetterKind, Review
from qo_ops.platform.job.statuses import RunStatus, fresh_statuses

Partitioning = Literal["tenant", "tenant_day"]
Transition = Callable[[Connection, BatchContext, Sequence[Any]], BatchOutcome]
Record = Callable[[Connection, BatchContext, list[Any]], BatchOutcome]
# One statement that selects a batch and writes it, given the batch's selection (Batching.claims)
Claim = Callable[[Connection, BatchContext, sa.Select[Any]], BatchOutcome]


@dataclass(frozen=True)
class CheckSpec:
    """A business outcome check a job declares. The job's ``check`` function judges it with
    :meth:`result`. So the description Dagster shows on the asset check is also the one
    every result carries, and it is written once, here."""

    name: str
    description: str
    blocking: bool = True  # a failed outcome fails the run

    def result(
        self, passed: bool, metadata: Mapping[str, Any] | None = None, *, backlog: int | None = None
    ) -> OutcomeCheck:
        """This check's result: whether it passed, and its figures. A check that counted
        exactly what the selection matches now also gives the backlog it counted."""
        return OutcomeCheck(self.name, passed, self.description, dict(metadata or {}), backlog)


# ------------------------------------------------------------------ what follows the transition


@dataclass(frozen=True)
class ExternalPhase:
    """A side effect outside the database, between two transactions per batch.

    The transition only claims, and commits. Then ``call`` calls the other system with no
    transaction open and no row locked. Then ``record`` writes the results in a second
    transaction under the lease's guard.

    With ``overlap``, the runner claims the next batch and records the last one while a
    batch's calls are in flight (``qo_ops/platform/run/overlap.py``). Two batches' calls never
    overlap. A job sets it when its claim hides what it claimed until its record (or until
    the claim lapses) and its selection does not depend on the batch before (no positions,
    no checkpoint).

    With ``pipelined``, a batch's call and record run on a second thread and connection
    while the run claims the next batch (``qo_ops/platform/run/pipeline.py``). A job sets it
    when its claim returns the position the next claim starts from (``Positions``) and
    commits nothing a later run needs from a batch never called."""

    call: Callable[[BatchContext, list[Any]], list[Any]]
    record: Record
    overlap: bool = False
    pipelined: bool = False


@dataclass(frozen=True)
class SecondTransaction:
    """A second transaction per batch, under the lease's guard, right after the
    transition's commit. Nothing is called in between. ``finish`` gets the claim's
    ``BatchOutcome.work``. For example, temp_file_cleanup writes the intents, commits, and
    then deletes."""

    finish: Record


# ------------------------------------------------------------------ the runner: Batching


@dataclass(frozen=True)
class SkipLocked:
    """Lock the selected rows ``FOR UPDATE SKIP LOCKED``, so rival runs share the work.
    ``of`` names the table whose rows a joined selection locks. None locks all of them."""

    of: sa.Table | None = None


@dataclass(frozen=True)
class Positions:
    """Each batch's selection starts after the previous batch's last row, which its
    transition returns as ``BatchOutcome.position``. The run ends with one pass from the
    start, because rows other runs held are due too.

    With ``count_before_last_pass``, the run takes that last pass only if the selection
    still matches something. It is counted from the start, without LIMIT or locks, held
    rows included. This suits a selection whose LIMIT plan walks the whole scope when
    nothing is left."""

    count_before_last_pass: bool = False


@dataclass(frozen=True)
class Checkpointing:
    """The job keeps a cursor per scope (``job_checkpoint``). It is written with each batch
    and read back when a run starts, so a rerun resumes where the last commit left off.

    Set ``rescan_when_complete`` for a job that re-checks its whole scope on every run
    (reconciliation). It forgets the cursor once a run has gone through the scope. A
    backfill keeps the cursor, because done is done."""

    rescan_when_complete: bool


@dataclass(frozen=True)
class Batching:
    """How the runner takes the selection, batch by batch. The runner reads it, and so do
    the reports and sensors that say where a run stands."""

    # Rival runs share the work by skipping each other's locked rows. Use None for a
    # selection that takes no row locks (one run per scope holds the lease).
    locks: SkipLocked | None = SkipLocked()
    positions: Positions | None = None  # within a run, each batch starts after the last
    checkpoint: Checkpointing | None = None  # across runs, a run starts where the last stopped
    # A dry run that must look (for example, ask the downstream) runs the batches too. The
    # job's functions write nothing when ``ctx.mode == "dry_run"``, and no checkpoint is saved.
    dry_run_scans: bool = False
    # One statement selects the batch and writes it, so its ids make no round trip through
    # the runner and its rows are not looked up again. The job's function gets the batch's
    # selection (``eligible`` with the batch's LIMIT and locks) to run inside its statement.
    # It writes only what that selection returns, and sets ``processed`` to how many rows it
    # returned (0: nothing selected, nothing written). ``transition`` stays the same work
    # over given ids. The runner's crash point ``after_batch_select`` follows the statement.
    claims: Claim | None = None


# ------------------------------------------------------------------ the Dagster UI: Presentation


@dataclass(frozen=True)
class Presentation:
    """What people see of the job beyond its name and description. The Dagster adapter
    reads it (the outcome asset, its page, the job's description), and so does the run's
    report."""

    outcome_asset: str = ""  # the business asset whose outcome the checks prove, e.g. "quotes"
    healthy: str = ""  # what healthy looks like for that asset (shown on its page)
    change: str = ""  # what execute does to one item, in a few words (the report, the UI)


# ------------------------------------------------------------------ deployment: Deployment


@dataclass(frozen=True)
class Deployment:
    """How the job is scheduled and run. The Dagster schedules and sensors, the Kubernetes
    run launcher, the lateness checks and the CLI read it."""

    cron_schedule: str = "0 * * * *"  # the default cadence of its schedule (UTC)
    backlog_threshold: int | None = None  # a backlog sensor launches the job past this
    # How many tenants one Dagster run covers when a tick fans out. Each chunk is one run
    # (one pod).
    tenants_per_run: int = 100
    run_resources: RunResources = RunResources()  # one run's CPU and memory
    calls_downstream: bool = False  # its runs need QO_OPS_DOWNSTREAM_URL (the fulfilment API)
    # For windowed jobs, how many days before its tick lies the day a schedule runs. None
    # means 1 (yesterday). Retention jobs return retention + 1, the day that just aged out.
    scheduled_window_age_days: Callable[[], int] | None = None

    def __post_init__(self) -> None:
        if self.tenants_per_run < 1:
            raise ValueError(f"tenants_per_run must be at least 1, not {self.tenants_per_run}")


# ------------------------------------------------------------------ metrics: Signals


@dataclass(frozen=True)
class Signals:
    """What the job reports about itself beyond the platform's counters. The exporter reads
    it (its metrics and their label values), and so do the freshness checks and the run's
    report."""

    # The age in seconds of the oldest eligible item (job_lag_seconds, and the run's report).
    lag: Callable[[Connection, BatchContext], float | None] | None = None
    # Whether the exporter serves its eligible items as job_backlog_items (and lag), which
    # QoOpsJobBacklogGrowing watches. Set False for a job whose items pile up all day by design.
    reports_backlog: bool = True
    # How many items sit dead-lettered now, over all tenants. It is a capped count, read by
    # the exporter and the report.
    dead_letters: Callable[[Connection], int] | None = None
    # Rows about what one run did beyond its counters (per day, per mismatch type…). They
    # are read after the run by its job_run id, and hold only ids, states and numbers.
    report: Callable[[Connection, BatchContext], list[ReportRow]] | None = None
    # The side effects it counts (``BatchOutcome.side_effect``). These are the values of the
    # side_effect label.
    side_effects: tuple[str, ...] = ()
    # The ``error_code`` of its own exceptions, beside the platform's. They add to the
    # values of job_failed_total's error_class label.
    error_classes: tuple[str, ...] = ()
    reconciliation: Reconciliation | None = None  # a reconciliation job's reconciliation_* family
    # Whether a run ending partial_success keeps the tenant fresh. The recent_success check,
    # job_last_success_timestamp_seconds and the stale-success sensor all follow it. Set True
    # where some items failing is normal, such as poison items dead-lettered by design, each
    # with its own signal.
    partial_success_is_fresh: bool = False


# ------------------------------------------------------------------ the operator: Recovery


@dataclass(frozen=True)
class Recovery:
    """How a person hands work back to the job. ``qo_ops.platform.actions.recovery`` reads
    it, for qo-ops requeue, qo-ops review and the API's matching actions."""

    requeue: DeadLetterKind | None = None  # how its dead letters go back to work
    review: Review | None = None  # what it flags for a person, and what a person may do


# ------------------------------------------------------------------ the job


@dataclass(frozen=True)
class JobSpec:
    """One operational job, declared once; every trigger and adapter derives from it.

    ``eligible`` builds the ordered, index-backed selection. The same query serves the
    dry-run count, the sample and each batch. ``transition`` applies one batch inside the
    batch transaction. ``then``, if set, is what follows its commit. That is either an
    external call and a second transaction (:class:`ExternalPhase`), or a second
    transaction alone (:class:`SecondTransaction`). ``check`` judges the declared ``checks``.

    ``validate_settings`` reads and checks every setting the job's functions use, before the
    run writes or claims anything. It raises ConfigError, or else returns the settings. The
    job's functions get that value through ``run_settings(ctx, <this function>)``.
    """

    name: str
    kind: str
    description: str
    partitioning: Partitioning
    eligible: Callable[[BatchContext], sa.Select[Any]]
    transition: Transition
    check: Callable[[Connection, BatchContext], list[OutcomeCheck]]
    then: ExternalPhase | SecondTransaction | None = None
    checks: tuple[CheckSpec, ...] = ()
    defaults: Limits = field(default_factory=Limits)
    destructive: bool = False  # an execute by a person cites an approval
    validate_settings: Callable[[], object] | None = None
    batching: Batching = Batching()
    presentation: Presentation = Presentation()
    deployment: Deployment = Deployment()
    signals: Signals = Signals()
    recovery: Recovery = Recovery()

    def __post_init__(self) -> None:
        """The rules between parts that types cannot say."""
        problems = []
        if self.checks and not self.presentation.outcome_asset:
            problems.append("its checks need presentation.outcome_asset, the asset they judge")
        names = [c.name for c in self.checks]
        if len(set(names)) != len(names):
            problems.append(f"two checks share a name: {names}")
        if self.deployment.scheduled_window_age_days and self.partitioning != "tenant_day":
            problems.append("deployment.scheduled_window_age_days is for windowed jobs only")
        overlaps = isinstance(self.then, ExternalPhase) and self.then.overlap
        if overlaps and (self.batching.positions or self.batching.checkpoint):
            problems.append(
                "an overlapping external phase needs a selection without positions or checkpoint"
            )
        pipelined = isinstance(self.then, ExternalPhase) and self.then.pipelined
        if pipelined and (overlaps or not self.batching.positions or self.batching.checkpoint):
            problems.append("a pipelined external phase needs positions, no checkpoint, no overlap")
        if self.batching.claims is not None and self.batching.dry_run_scans:
            problems.append("batching.claims writes: a dry run that scans would run it")
        if self.recovery.requeue is not None and self.signals.dead_letters is None:
            problems.append("recovery.requeue needs signals.dead_letters, the count of them")
        if problems:
            raise ValueError(f"JobSpec {self.name}: " + "; ".join(problems))

    @property
    def fresh_statuses(self) -> tuple[RunStatus, ...]:
        """The final statuses of an execute run that keep a tenant fresh."""
        return fresh_statuses(self.signals.partial_success_is_fresh)
