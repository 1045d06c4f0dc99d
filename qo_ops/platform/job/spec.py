"""What a job is: ``JobSpec``, declared once per job; every trigger and adapter derives from it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


@dataclass(frozen=True)
class CheckSpec:
    """A business outcome check a job declares (its result comes from ``JobSpec.check``)."""

    name: str
    description: str
    blocking: bool = True  # a failed outcome fails the run


@dataclass(frozen=True)
class JobSpec:
    """One operational job, declared once; every trigger and adapter derives from it.

    ``eligible`` builds the ordered, index-backed selection (the same query serves the
    dry-run count, the sample and each batch); ``transition`` applies one batch inside the
    batch transaction; ``check`` proves the business outcome; ``lag`` gives the age of the
    oldest eligible item.
    """

    name: str
    kind: str
    description: str
    partitioning: Partitioning
    eligible: Callable[[BatchContext], sa.Select[Any]]
    transition: Callable[[Connection, BatchContext, Sequence[Any]], BatchOutcome]
    check: Callable[[Connection, BatchContext], list[OutcomeCheck]]
    lag: Callable[[Connection, BatchContext], float | None] | None = None
    outcome_asset: str = ""  # the business asset whose outcome the checks prove, e.g. "quotes"
    checks: tuple[CheckSpec, ...] = ()
    cron_schedule: str = "0 * * * *"  # default cadence of its schedule (UTC)
    backlog_threshold: int | None = None  # a backlog sensor launches the job past this
    # Whether the exporter serves its eligible items as job_backlog_items (and lag), which
    # QoOpsJobBacklogGrowing watches. A daily job whose items pile up by design all day
    # (run_history_retention) opts out: its backlog grows between healthy runs.
    reports_backlog: bool = True
    defaults: Limits = field(default_factory=Limits)
    run_resources: RunResources = field(default_factory=RunResources)  # one run's CPU and memory
    # Tenants one Dagster run covers when a schedule or sensor tick fans out (one run, and on
    # Kubernetes one pod, per chunk; each tenant still runs through run_job on its own).
    tenants_per_run: int = (
        100  # measured at 1,000 tenants: 20 → 0.09, 50 → 0.12, 100 → 0.21 of in-process
    )
    destructive: bool = False
    calls_downstream: bool = False  # its runs need QO_OPS_DOWNSTREAM_URL (the fulfilment API)
    uses_checkpoint: bool = False
    compete_with_skip_locked: bool = True  # lock selected rows FOR UPDATE SKIP LOCKED
    lock_of: sa.Table | None = None  # the table whose rows a joined selection locks
    # A job whose batches start after a position ends with one pass from the start (rows
    # others held are due too). With this, that pass is taken only if the selection, counted
    # from the start (no LIMIT, no locks: it counts held rows too), still matches something:
    # for a selection whose LIMIT plan walks the whole scope when nothing is left
    # (read_model_repair: 1.9 s at 1,000,000 orders, the count 0.6–1 s).
    count_before_last_pass: bool = False
    # Jobs whose side effect leaves the database run in three steps per batch: the
    # transition only claims (its own transaction), ``external`` calls the other system with
    # no transaction open, and ``record`` writes the results (a second guarded transaction).
    external: Callable[[BatchContext, list[Any]], list[Any]] | None = None
    record: Callable[[Connection, BatchContext, list[Any]], BatchOutcome] | None = None
    # A dry-run that must look (e.g. ask the downstream) runs the batches too; the job's
    # functions write nothing when ``ctx.mode == "dry_run"``, and no checkpoint is saved.
    dry_run_scans: bool = False
    # A cursor job that re-checks its whole scope on every run (reconciliation) forgets its
    # checkpoint once a run has gone through the scope; a backfill keeps it (done is done).
    rescan_when_complete: bool = False
    # Windowed jobs: how many days before its tick the day a schedule runs lies (default 1:
    # yesterday). Retention jobs return retention + 1, the day that has just aged out.
    scheduled_window_age_days: Callable[[], int] | None = None
    # How many items sit dead-lettered now, all tenants (capped count; for the exporter).
    dead_letters: Callable[[Connection], int] | None = None
    # How a person puts its dead letters back to work (qo-ops requeue, the API's requeue).
    dead_letters_requeue: DeadLetterKind | None = None
    # What it flags for a person, and what a person may do with each (qo-ops review).
    review: Review | None = None
    # Reads and checks every setting (environment) the job's functions use, before the run
    # writes or claims anything: raises ConfigError (exit 2, one line), else returns them;
    # the job's functions get that value through run_settings(ctx, <this function>).
    validate_settings: Callable[[], object] | None = None
    # What execute does to one item, in a few words (the dry-run report's "transition").
    change: str = ""
    # What healthy looks like for its outcome asset (shown on the asset's page).
    healthy: str = ""
    # Rows about what one run did, beyond its counters (per day, per mismatch type…), read
    # after the run by its job_run id; ids, states and numbers only.
    report: Callable[[Connection, BatchContext], list[ReportRow]] | None = None
    # The side effects the job counts (``BatchOutcome.side_effect``), e.g. an outbox event or
    # a call to the downstream: the only values the ``side_effect`` metric label takes.
    side_effects: tuple[str, ...] = ()
    # The error classes its own failures raise (an exception's ``error_code``), beside the
    # platform's (signals.PLATFORM_ERROR_CLASSES): the values job_failed_total serves.
    error_classes: tuple[str, ...] = ()
    # A reconciliation job's mismatch types and action outcomes (the reconciliation_* family)
    reconciliation: Reconciliation | None = None
    # How a run ending partial_success counts for freshness (stale_success_sensor, the
    # recent_success check, job_last_success_timestamp_seconds, QoOpsJobNotSucceeding):
    # True where some items failing is the job's normal state (poison items dead-lettered
    # by design, each with its own signal), so such a run keeps the tenant fresh; False
    # (the default) where it means work left undone, so only success and no_work do.
    partial_success_is_fresh: bool = False

    @property
    def fresh_statuses(self) -> tuple[RunStatus, ...]:
        """The final statuses of an execute run that keep a tenant fresh."""
        return fresh_statuses(self.partial_success_is_fresh)
