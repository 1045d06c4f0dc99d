"""What a job is: its declaration (``JobSpec``), the scope it runs on, the options of one run,
and the summary a run returns (``RunSummary``). Plain data; no Dagster, no I/O."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.errors import BadInput
from qo_ops.platform.counts import Counts, mutated_count
from qo_ops.platform.signals import Reconciliation
from qo_ops.platform.stopping import DEFAULT_STOP_GRACE_S, StopSignals

if TYPE_CHECKING:  # the recovery module builds on this one
    from qo_ops.platform.recovery import DeadLetterKind, Review

Mode = Literal["dry_run", "execute"]
Trigger = Literal["schedule", "sensor", "manual", "backfill", "retry", "api"]
Partitioning = Literal["tenant", "tenant_day"]
TRIGGERS: tuple[str, ...] = ("schedule", "sensor", "manual", "backfill", "retry", "api")
# Triggers a person stands behind: the CLI, the Launchpad and a person's re-execution
# (manual), a partition backfill, the operator API, and Dagster's automatic retry of a run
# a person launched (retries of scheduled and sensor runs keep their parent's trigger).
# Their executes need a reason and are audited; schedules and sensors are not persons.
TRIGGERS_WITH_A_PERSON: tuple[str, ...] = ("manual", "backfill", "retry", "api")

TENANT_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
MAX_BATCH_SIZE = 10_000
MAX_ITEMS = 100_000_000
MAX_THROTTLE_MS = 60_000
MAX_DEADLINE_S = 7 * 24 * 3600
MAX_LEASE_TTL_S = 3600
MAX_TEXT = 500  # reason, requester, correlation id
MAX_CONCURRENCY = 256
# The days a window may cover: none before 1900 (older than any business record, and than
# the day a 100-year retention ages out), none whose end would leave the calendar.
FIRST_DAY = date(1900, 1, 1)
LAST_DAY = date.max - timedelta(days=1)  # 9999-12-30: its window ends on 9999-12-31


@dataclass(frozen=True)
class Scope:
    """The part of the world a run may touch: a tenant, and for windowed jobs a date range
    (``window_start`` inclusive, ``window_end`` exclusive)."""

    tenant_id: str
    window_start: date | None = None
    window_end: date | None = None

    def __post_init__(self) -> None:
        if not TENANT_ID.match(self.tenant_id):
            raise BadInput(
                "tenant must be a short key of lowercase letters, digits and '-' (e.g. tenant-001)"
            )
        if (self.window_start is None) != (self.window_end is None):
            raise BadInput("a window needs both a start and an end date")
        if self.window_start and self.window_end and self.window_end <= self.window_start:
            raise BadInput("the window's end date must be after its start date")
        if self.window_start and self.window_end:
            _check_days(self.window_start, self.window_end - timedelta(days=1))

    @classmethod
    def days(cls, tenant_id: str, first: date, last: date) -> Scope:
        """The scope of ``tenant_id`` over the days ``first`` to ``last``, both included;
        :class:`BadInput` when a day lies outside ``FIRST_DAY``..``LAST_DAY`` (so the
        window's end is always a date)."""
        _check_days(first, last)
        return cls(tenant_id, first, last + timedelta(days=1))

    def window_bounds(self) -> tuple[datetime, datetime]:
        """The window as UTC timestamps: [start 00:00, end 00:00)."""
        assert self.window_start is not None and self.window_end is not None, "not a windowed scope"
        return (
            datetime.combine(self.window_start, time(), UTC),
            datetime.combine(self.window_end, time(), UTC),
        )

    @property
    def text(self) -> str:
        """The scope as a person reads it (:func:`scope_text`): the last day included."""
        return scope_text(self.key)

    @property
    def key(self) -> str:
        """The lease and checkpoint key: ``tenant-001`` or ``tenant-001/2026-01-01..2026-01-02``
        (end exclusive: the database's form; people read :attr:`text`)."""
        if self.window_start is None:
            return self.tenant_id
        return f"{self.tenant_id}/{self.window_start.isoformat()}..{self.window_end.isoformat()}"  # type: ignore[union-attr]


def scope_text(scope_key: str) -> str:
    """A scope key as a person reads it: the days it covers, the last one included, as
    ``qo-ops run --from/--to`` and a backfill's plan write them. The key's end is exclusive
    (``tenant-001/2026-12-01..2026-12-02`` covers one day), so it is shown
    ``tenant-001/2026-12-01``; ``…/2026-11-20..2026-12-05`` is shown ``…/2026-11-20..2026-12-04``.
    A key that is not a window (a tenant, a chunk) is shown as it is."""
    tenant, _, window = scope_key.partition("/")
    first, dots, end = window.partition("..")
    try:
        start, last = date.fromisoformat(first), date.fromisoformat(end) - timedelta(days=1)
    except ValueError:
        return scope_key
    if not dots or last < start:
        return scope_key
    return f"{tenant}/{start.isoformat()}" + ("" if last == start else f"..{last.isoformat()}")


def tenant_of(scope_key: str) -> str:
    """The tenant of a scope key (:attr:`Scope.key`): ``tenant-001/2026-01-01..`` → ``tenant-001``."""
    return scope_key.partition("/")[0]


def _check_days(first: date, last: date) -> None:
    if not (first >= FIRST_DAY and last <= LAST_DAY):
        raise BadInput(
            f"a window's days must lie from {FIRST_DAY} to {LAST_DAY}, got {first} to {last}"
        )


@dataclass(frozen=True)
class RunOptions:
    """How one run should behave; ``None`` limits take the job's defaults."""

    mode: Mode = "dry_run"
    trigger: Trigger = "manual"
    batch_size: int | None = None
    max_items: int | None = None
    throttle_ms: int | None = None
    deadline_s: float | None = None
    lease_ttl_s: float | None = None
    requester: str | None = None
    reason: str | None = None
    correlation_id: str | None = None
    scheduled_for: datetime | None = None
    dagster_run_id: str | None = None
    dagster_parent_run_id: str | None = None  # a Dagster re-execution: the run it repeats
    approval: str | None = None  # the approval a destructive execute cites (approvals.py)
    job_run_id: uuid.UUID | None = None  # adopt a row pre-created by the API
    progress_interval_s: float = 10.0
    sample_size: int = 10
    concurrency: int | None = None
    # when the run was asked for, if the trigger knows it (the Dagster run's creation): the
    # start of job_start_delay_seconds; None: the tick, the API's acceptance or the record
    requested_at: datetime | None = None
    retry_number: int = 0  # which of the trigger's automatic retries this run is (0: first)
    retries_max: int | None = None  # how many the trigger allows, when it says

    def validated(self) -> RunOptions:
        """Raise :class:`BadInput` (changing nothing) for impossible or absurd options."""
        if self.mode not in ("dry_run", "execute"):
            raise BadInput(f"mode must be dry-run or execute, not {self.mode!r}")
        if self.trigger not in TRIGGERS:
            raise BadInput(f"trigger must be one of {', '.join(TRIGGERS)}")
        _check_range("batch size", self.batch_size, 1, MAX_BATCH_SIZE)
        _check_range("max items", self.max_items, 1, MAX_ITEMS)
        _check_range("throttle (ms)", self.throttle_ms, 0, MAX_THROTTLE_MS)
        _check_range("deadline (s)", self.deadline_s, 0.001, MAX_DEADLINE_S)
        _check_range("lease TTL (s)", self.lease_ttl_s, 1, MAX_LEASE_TTL_S)
        _check_range("concurrency", self.concurrency, 1, MAX_CONCURRENCY)
        for name in ("requester", "correlation_id", "reason", "approval"):
            if name == "reason":  # a blank reason is no reason: refused (and audited) as such
                check_consent(self)
            value = getattr(self, name)
            if value is not None and (len(value) > MAX_TEXT or not value.strip()):
                raise BadInput(f"{name.replace('_', ' ')} must be 1 to {MAX_TEXT} characters")
        return self

    @property
    def person_behind(self) -> bool:
        """A person asked for this run (:data:`TRIGGERS_WITH_A_PERSON`): an execute needs a
        reason, and the run is audited."""
        return self.trigger in TRIGGERS_WITH_A_PERSON


class ExecuteRefused(BadInput):
    """An execute a person asked for that the rules do not allow (no reason; a destructive
    job without a valid approval; a reused reason). Nothing was run; ``run_job`` audits it
    as ``denied``."""

    def __init__(self, message: str, *, error_code: str) -> None:
        super().__init__(message)
        self.error_code = error_code  # reason_required | approval_required | reason_reused


def check_consent(options: RunOptions, *, destructive: bool = False, job_name: str = "") -> None:
    """Raise :class:`ExecuteRefused` for an execute with a person behind it that gives no
    reason, or that executes a destructive job citing no approval — on every path alike
    (CLI, Launchpad, backfill, API). Whether the approval it cites allows it needs the
    database: :func:`qo_ops.platform.approvals.check_approval`."""
    if options.mode != "execute" or not options.person_behind:
        return
    if not (options.reason or "").strip():
        raise ExecuteRefused(
            f"an execute by a person ({options.trigger}) needs a reason (CLI: --reason; "
            "Dagster: config reason, or the tag qo_ops/reason on a backfill or re-execution)",
            error_code="reason_required",
        )
    if destructive and not (options.approval or "").strip():
        job = job_name or "{job}"
        raise ExecuteRefused(
            f"executing {job_name or 'a destructive job'} (destructive) needs an approval: an "
            f"approver grants one (qo-ops approval grant {job} --tenant … --reason …, or POST "
            f"/internal/jobs/{job}/approvals) and the run cites it (CLI --approval; Launchpad config "
            "approval; backfill tag qo_ops/approval; API approvalId, or an approver's own "
            "request)",
            error_code="approval_required",
        )


def _check_range(name: str, value: float | None, lo: float, hi: float) -> None:
    if value is not None and not lo <= value <= hi:
        raise BadInput(f"{name} must be between {lo:g} and {hi:g}, got {value:g}")


def cadence_seconds(cron: str) -> float:
    """Seconds between two ticks of the catalog's cron forms: ``* * * * *``,
    ``*/N * * * *``, ``M * * * *``, ``M H * * *``."""
    minute, hour, dom, month, dow = cron.split()
    if (dom, month, dow) != ("*", "*", "*"):
        raise ValueError(f"unsupported cron for a cadence: {cron}")
    if hour == "*":
        if minute == "*":
            return 60.0
        if minute.startswith("*/"):
            return 60.0 * int(minute[2:])
        if minute.isdigit():
            return 3600.0
    elif hour.isdigit() and minute.isdigit():
        return 86400.0
    raise ValueError(f"unsupported cron for a cadence: {cron}")


def cron_ticks(cron: str, after: datetime, until: datetime) -> list[datetime]:
    """The ticks of ``cron`` (a catalog form, UTC) in (``after``, ``until``], oldest first.
    Exact for the forms :func:`cadence_seconds` accepts; ``*/N`` restarts at minute 0 of
    every hour, as cron does."""
    cadence_seconds(cron)  # the form is one we know
    minute, hour = cron.split()[:2]
    step = int(minute[2:]) if minute.startswith("*/") else 1
    if hour.isdigit():
        period, offset = timedelta(days=1), timedelta(hours=int(hour), minutes=int(minute))
    elif minute.isdigit():
        period, offset = timedelta(hours=1), timedelta(minutes=int(minute))
    else:
        period, offset = timedelta(hours=1), timedelta(0)
    minutes = range(0, 60, step) if not minute.isdigit() else (0,)
    start = after.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    if period == timedelta(days=1):
        start = start.replace(hour=0)
    ticks: list[datetime] = []
    while start <= until:
        for m in minutes:
            tick = start + offset + timedelta(minutes=m)
            if after < tick <= until:
                ticks.append(tick)
        start += period
    return ticks


@dataclass(frozen=True)
class Limits:
    """A run's limits: a job declares its defaults (``JobSpec.defaults``); a run's options
    override each of them (:meth:`overridden_by`)."""

    batch_size: int = 500
    max_items: int = 10_000_000
    throttle_ms: int = 0
    deadline_s: float = 3600.0
    lease_ttl_s: float = 30.0
    concurrency: int = 1  # parallel external calls within a batch (jobs with an external phase)

    def overridden_by(self, options: RunOptions) -> Limits:
        """These limits with the run's own (``--batch-size`` …) in place of the defaults."""
        return Limits(
            batch_size=options.batch_size or self.batch_size,
            max_items=options.max_items or self.max_items,
            throttle_ms=self.throttle_ms if options.throttle_ms is None else options.throttle_ms,
            deadline_s=options.deadline_s or self.deadline_s,
            lease_ttl_s=options.lease_ttl_s or self.lease_ttl_s,
            concurrency=options.concurrency or self.concurrency,
        )

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the run record's options, the start event and audit)."""
        return asdict(self)


_CPU_QUANTITY = re.compile(r"^(\d+m|\d+(\.\d+)?)$")  # millicores (250m) or cores (0.5, 2)
_MEMORY_QUANTITY = re.compile(r"^(\d+)(Ki|Mi|Gi)$")
_MEMORY_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def memory_bytes(quantity: str) -> int:
    """Bytes in a memory quantity written the Kubernetes way with a binary unit (``512Mi``)."""
    match = _MEMORY_QUANTITY.match(quantity)
    if not match:
        raise ValueError(
            f"memory must be a whole number of Ki, Mi or Gi (e.g. 512Mi), not {quantity!r}"
        )
    return int(match.group(1)) * _MEMORY_UNITS[match.group(2)]


@dataclass(frozen=True)
class RunResources:
    """What one run's process asks of the machine it runs on, as Kubernetes quantities: the
    CPU and memory it is guaranteed and the memory it may not exceed. The Kubernetes run
    launcher makes them the run pod's resources; other launchers ignore them. There is no
    CPU limit on purpose: a throttled batch only holds its row locks longer."""

    cpu_request: str = "250m"
    memory_request: str = "512Mi"  # a run worker loads Dagster and the whole code location
    memory_limit: str = "1Gi"

    def __post_init__(self) -> None:
        if not _CPU_QUANTITY.match(self.cpu_request):
            raise ValueError(
                f"cpu_request must be millicores or cores (e.g. 250m, 1), not {self.cpu_request!r}"
            )
        if memory_bytes(self.memory_request) > memory_bytes(self.memory_limit):
            raise ValueError(
                f"memory_request {self.memory_request} exceeds memory_limit {self.memory_limit}"
            )


@dataclass
class BatchContext:
    """What a job's selection and transition see of the run they belong to."""

    job_name: str
    scope: Scope
    mode: Mode
    job_run_id: uuid.UUID
    limits: Limits = field(default_factory=Limits)  # a context made outside a run: defaults
    settings: object | None = None  # what the job's validate_settings returned (run_settings)
    # a checkpointed job's cursor: loaded when the run starts, then each batch's
    cursor: dict[str, Any] | None = None
    # where the next selection may start within this run (BatchOutcome.position), never
    # persisted: lets a state-based sweep skip the index entries its earlier batches left dead
    position: dict[str, Any] | None = None
    # the job's own state between its steps within one run (e.g. the downstream calls'
    # client, a safety gate's decision); the platform never reads it
    state: dict[str, Any] = field(default_factory=dict)
    # the run's stop request (SIGTERM/SIGINT): external phases send no call once it is set
    stop: StopSignals = field(default_factory=lambda: StopSignals(DEFAULT_STOP_GRACE_S))


T = TypeVar("T")


def run_settings(ctx: BatchContext, read: Callable[[], T]) -> T:
    """The job's settings as the run uses them: the value the runner got from the job's
    ``validate_settings`` before the run wrote anything (``read`` is that same function),
    so what was validated is what is used, read once. A context made outside a run (an
    outcome check, a backlog count) reads them with ``read`` on first use."""
    if ctx.settings is None:
        ctx.settings = read()
    return cast(T, ctx.settings)


@dataclass
class BatchOutcome(Counts):
    """What one transition did: its :class:`Counts` (a job sets ``succeeded``, ``failed`` …;
    the runner sets ``processed`` to the items it selected), which add up into the run
    record, and what the runner does next."""

    events_written: int = 0
    cursor: dict[str, Any] | None = None  # the checkpoint after this batch, for cursor jobs
    # where the next selection may start within this run (kept in memory, never persisted):
    # lets a state-based sweep skip the index entries its earlier batches left dead
    position: dict[str, Any] | None = None
    failed_items: list[tuple[str, str]] = field(default_factory=list)  # (item id, error class)
    # what a claiming transition hands the external phase
    work: list[Any] = field(default_factory=list)
    tally: dict[str, int] = field(
        default_factory=dict
    )  # job-specific counts, e.g. mismatches by type
    # events the runner emits for this batch: (name, fields), e.g. a breaker's transition
    notes: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    # the run stops after this batch: (error class or None, reason). With an error class it
    # ends failed with it (e.g. dependency_unavailable); without, as its counts say
    halt: tuple[str | None, str] | None = None

    def side_effect(self, name: str, result: str, n: int = 1, *, reason: str = "") -> None:
        """Count ``n`` attempts at the side effect ``name`` (one the job declares in
        ``JobSpec.side_effects``) that ended in ``result`` (:data:`SIDE_EFFECT_RESULTS`); an
        ``ambiguous`` one says why (``reason``: a short snake_case word). Kept in the run's
        tally (``side_effect.<name>.<result>``, ``side_effect_ambiguity.<reason>``); the
        exporter turns them into ``job_side_effects_total`` and
        ``job_side_effect_ambiguity_total``."""
        if result not in SIDE_EFFECT_RESULTS:
            raise ValueError(f"unknown side-effect result {result!r}")
        if (result == "ambiguous") != bool(reason):
            raise ValueError("an ambiguous side effect, and only that, names its reason")
        if n <= 0:
            return
        keys = [f"side_effect.{name}.{result}"]
        if reason:
            keys.append(f"side_effect_ambiguity.{reason}")
        for key in keys:
            self.tally[key] = self.tally.get(key, 0) + n


# Platform counts kept in a run's tally (the exporter's job_checkpoint_*_total).
CHECKPOINT_UPDATES = "checkpoint.updates"
CHECKPOINT_RESETS = "checkpoint.resets"  # a rescanning job forgot its finished cursor

# How an attempt at a side effect ended: done; not repeated because the business key or the
# other system's idempotency key showed it was done before; refused or failed (retried or
# dead-lettered); or unknown (the request may have landed, or it landed and our record of
# it did not) -- those need reconciliation, and are counted by reason too.
SIDE_EFFECT_RESULTS = ("success", "duplicate_prevented", "failed", "ambiguous")


@dataclass(frozen=True)
class OutcomeCheck:
    """The business outcome checked after a run (e.g. no ACTIVE quote past expiry)."""

    name: str
    passed: bool
    description: str
    metadata: dict[str, Any] = field(default_factory=dict)
    # A check that counted exactly what the job's selection matches now (from its start, no
    # position) says so here: the run's report takes it as the backlog instead of counting
    # the same rows again (a full pass over the scope for a repair job).
    backlog: int | None = None


@dataclass(frozen=True)
class ReportRow:
    """One row of a run's report: what (``kind``, ``name``), how many (``count``), and a
    short ``detail``. Ids, states and classes only: never personal data or payloads."""

    kind: str
    name: str
    count: int
    detail: str = ""


@dataclass
class RunSummary:
    """What a run did, as printed by the CLI and returned to Dagster and the API."""

    job_run_id: str
    job_name: str
    status: str
    mode: str
    scope: str
    trigger: str
    requester: str | None
    eligible_count: int = 0
    counts: Counts = field(default_factory=Counts)  # the batches' counters, added up
    batches: int = 0
    duration_ms: int = 0
    batch_ms_p50: float | None = None  # batch transaction times (guard to commit)
    batch_ms_p99: float | None = None
    batch_ms_max: float | None = None
    status_reason: str | None = None
    error_code: str | None = None
    error_text: str | None = None
    sample_ids: list[str] = field(default_factory=list)
    tally: dict[str, int] = field(default_factory=dict)
    checks: list[OutcomeCheck] = field(default_factory=list)
    fencing_token: int | None = None  # of the lease the run held
    lock_wait_ms: int | None = None  # how long taking (or being refused) the lease took
    checkpoint_before: str | None = None  # the cursor as JSON text (checkpointed jobs)
    checkpoint_after: str | None = None
    backlog: int | None = None  # items still eligible when the run ended
    oldest_due_age_s: float | None = None  # age of the oldest of them (the job's lag)
    checkpoint_age_s: float | None = None  # since the scope's checkpoint last moved
    dead_letters: int | None = None  # items dead-lettered now, all tenants (capped count)
    report: list[dict[str, Any]] = field(default_factory=list)  # ReportRow dicts

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; ``mutated_count`` after ``eligible_count`` (the seed's run
        summary), the counters flat where ``counts`` stands, named as the job_run row names
        them (``processed_count``, ``succeeded_count`` …)."""
        flat: dict[str, Any] = {}
        for key, value in asdict(self).items():
            flat |= self.counts.columns() if key == "counts" else {key: value}
            if key == "eligible_count":  # the seed's pair: eligible, then mutated
                flat["mutated_count"] = self.mutated_count
        return flat

    @property
    def mutated_count(self) -> int:
        """Items whose state this run changed (the seed's field; 0 for a dry run)."""
        return mutated_count(self.mode, self.counts.succeeded)


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
    def fresh_statuses(self) -> tuple[str, ...]:
        """The final statuses of an execute run that keep a tenant fresh."""
        return (
            "success",
            "no_work",
            *(("partial_success",) if self.partial_success_is_fresh else ()),
        )
