"""What a job's functions see of their run (``BatchContext``), what one batch returns
(``BatchOutcome``), the checks and report rows a run produces, and the summary it returns
(``RunSummary``)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from qo_ops.platform.job.counts import Counts, mutated_count
from qo_ops.platform.job.options import Limits, Mode
from qo_ops.platform.job.scope import Scope

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine


class StopRequest(Protocol):
    """The run's stop request as a job's external phase sees it. The runner's side of it is
    :class:`qo_ops.platform.run.stopping.StopSignals`."""

    @property
    def requested(self) -> bool: ...

    @property
    def event(self) -> threading.Event: ...  # set once a stop is asked, so waits can watch it

    def calls_deadline(self) -> float | None: ...


class NoStopRequest:
    """The stop request of a context made outside a run. It is never asked."""

    requested = False

    def __init__(self) -> None:
        self.event = threading.Event()

    def calls_deadline(self) -> float | None:
        return None


S = TypeVar("S")


@dataclass
class BatchContext:
    """What a job's selection and transition see of the run they belong to."""

    job_name: str
    scope: Scope
    mode: Mode
    job_run_id: uuid.UUID
    limits: Limits = field(default_factory=Limits)  # the defaults, outside a run
    settings: object | None = None  # what the job's validate_settings returned (run_settings)
    # A checkpointed job's cursor. It is loaded when the run starts, then set by each batch.
    cursor: dict[str, Any] | None = None
    # Where the next selection may start within this run (BatchOutcome.position). It is never
    # persisted. It lets a state-based sweep skip the index entries its earlier batches left dead.
    position: dict[str, Any] | None = None
    # The run's stop request (SIGTERM/SIGINT). External phases send no call once it is set.
    stop: StopRequest = field(default_factory=NoStopRequest)
    # The run's database, for what must commit on its own beside the batch's transactions:
    # the fleet's rate limit takes its tokens there. None outside a run.
    engine: Engine | None = None
    # The job's own state between its steps within one run, one object per type (run_state).
    _run_states: dict[type, object] = field(default_factory=dict, init=False, repr=False)

    def run_state(self, kind: type[S], make: Callable[[], S] | None = None) -> S:
        """The run's one object of type ``kind``, which holds the job's own state between its
        steps within this run. Examples are the downstream calls' client and a safety gate's
        decision. ``make`` makes it on first use (by default ``kind()``), and later calls get
        the same object.

        Each job keeps its run state in a class of its own, so the type is the key and mypy
        checks what comes back. The platform never reads it. A context made outside a run
        starts with none."""
        found = self._run_states.get(kind)
        if found is None:
            found = self._run_states[kind] = (make or kind)()
        if not isinstance(found, kind):
            raise TypeError(f"run state {kind.__name__} holds a {type(found).__name__}")
        return found

    def run_state_if_made(self, kind: type[S]) -> S | None:
        """The run's object of type ``kind`` if a step made it (:meth:`run_state`), else None."""
        found = self._run_states.get(kind)
        return found if isinstance(found, kind) else None


T = TypeVar("T")


def run_settings(ctx: BatchContext, read: Callable[[], T]) -> T:
    """The job's settings as the run uses them.

    This is the value the runner got from the job's ``validate_settings`` before the run
    wrote anything, and ``read`` is that same function. So what was validated is what is
    used, and the settings are read once. A context made outside a run (an outcome check, a
    backlog count) reads them with ``read`` on first use."""
    if ctx.settings is None:
        ctx.settings = read()
    return cast(T, ctx.settings)


@dataclass
class BatchOutcome(Counts):
    """What one transition did, and what the runner does next.

    Its :class:`Counts` add up into the run record. A job sets ``succeeded``, ``failed`` and
    so on, and the runner sets ``processed`` to the items it selected (a job whose statement
    selects its batch itself, ``Batching.claims``, sets it to the rows that statement selected)."""

    events_written: int = 0
    cursor: dict[str, Any] | None = None  # the checkpoint after this batch, for cursor jobs
    # Where the next selection may start within this run. It is kept in memory, never
    # persisted. It lets a state-based sweep skip the index entries its earlier batches left dead.
    position: dict[str, Any] | None = None
    failed_items: list[tuple[str, str]] = field(default_factory=list)  # (item id, error class)
    # What a claiming transition hands the external phase.
    work: list[Any] = field(default_factory=list)
    tally: dict[str, int] = field(
        default_factory=dict
    )  # job-specific counts, such as mismatches by type
    # Events the runner emits for this batch, as (name, fields). An example is a breaker's
    # transition.
    notes: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    # Set to stop the run after this batch, as (error class or None, reason). With an error
    # class the run ends failed with it (such as dependency_unavailable). Without one, the run
    # ends as its counts say. A claim that halts with no work ends its batch at once: a job
    # with an external phase then calls and records nothing (an open breaker).
    halt: tuple[str | None, str] | None = None

    @property
    def ends_at_claim(self) -> bool:
        """A claim that halts the run and took nothing (an open breaker): its batch ends with
        the claim's transaction, nothing to call or record."""
        return self.halt is not None and not self.work

    def side_effect(self, name: str, result: str, n: int = 1, *, reason: str = "") -> None:
        """Count ``n`` attempts at the side effect ``name`` that ended in ``result``.

        The job declares ``name`` in ``JobSpec.signals.side_effects``, and ``result`` is one
        of :data:`SIDE_EFFECT_RESULTS`. An ``ambiguous`` result says why in ``reason``, a
        short snake_case word. The counts go into the run's tally
        (``side_effect.<name>.<result>``, ``side_effect_ambiguity.<reason>``). The exporter
        turns them into ``job_side_effects_total`` and ``job_side_effect_ambiguity_total``."""
        if result not in SIDE_EFFECT_RESULTS:
            raise ValueError(f"unknown side-effect result {result!r}")
        if (result == SideEffectResult.AMBIGUOUS) != bool(reason):
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


# How an attempt at a side effect ended. SUCCESS means it was done. DUPLICATE_PREVENTED means
# it was not repeated, because the business key or the other system's idempotency key showed
# it was done before. FAILED means it was refused or failed, and is retried or dead-lettered.
# AMBIGUOUS means nobody knows: the request may have landed, or it landed and our record of it
# did not. Ambiguous attempts need reconciliation, and they are counted by reason too.
# This is not a run's status (statuses.RunStatus), though two of the words are the same.
class SideEffectResult(StrEnum):
    """How one attempt at a side effect ended (the ``result`` label)."""

    SUCCESS = "success"
    DUPLICATE_PREVENTED = "duplicate_prevented"
    FAILED = "failed"
    AMBIGUOUS = "ambiguous"


SIDE_EFFECT_RESULTS = tuple(r.value for r in SideEffectResult)


@dataclass(frozen=True)
class OutcomeCheck:
    """The business outcome checked after a run (for example, no ACTIVE quote past expiry)."""

    name: str
    passed: bool
    description: str
    metadata: dict[str, Any] = field(default_factory=dict)
    # A check that counted exactly what the job's selection matches now (from its start, with
    # no position) puts the count here. The run's report then takes it as the backlog instead
    # of counting the same rows again, which for a repair job is a full pass over the scope.
    backlog: int | None = None


@dataclass(frozen=True)
class ReportRow:
    """One row of a run's report: what (``kind``, ``name``), how many (``count``), and a
    short ``detail``. It holds only ids, states and classes, never personal data or payloads."""

    kind: str
    name: str
    count: int
    detail: str = ""


@dataclass
class RunSummary:
    """What a run did, as printed by the CLI and returned to Dagster and the API."""

    job_run_id: str
    job_name: str
    status: str  # a RunStatus's value
    mode: str
    scope: str
    trigger: str
    requester: str | None
    eligible_count: int = 0
    counts: Counts = field(default_factory=Counts)  # the batches' counters, added up
    batches: int = 0
    duration_ms: int = 0
    batch_ms_p50: float | None = None  # batch transaction times, from guard to commit
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
    dead_letters: int | None = None  # items dead-lettered now, over all tenants (capped count)
    report: list[dict[str, Any]] = field(default_factory=list)  # ReportRow dicts

    def __setattr__(self, name: str, value: Any) -> None:
        # A status is kept as its plain value, because the summary goes into Dagster's
        # metadata, whose serializer refuses an enum it does not know. The value compares
        # equal to the enum (RunStatus.SUCCESS == "success").
        super().__setattr__(name, str(value) if name == "status" else value)

    def as_dict(self) -> dict[str, Any]:
        """The summary as a JSON-ready dict.

        ``mutated_count`` comes after ``eligible_count``, as in the seed's run summary. The
        counters stand flat where ``counts`` stands, named as the job_run row names them
        (``processed_count``, ``succeeded_count`` …)."""
        flat: dict[str, Any] = {}
        for key, value in asdict(self).items():
            flat |= self.counts.columns() if key == "counts" else {key: value}
            if key == "eligible_count":  # the seed's pair is eligible, then mutated
                flat["mutated_count"] = self.mutated_count
        return flat

    @property
    def mutated_count(self) -> int:
        """Items whose state this run changed (the seed's field; 0 for a dry run)."""
        return mutated_count(self.mode, self.counts.succeeded)
