"""How one run should behave (``RunOptions``), its limits (``Limits``) and who triggered it.
Also the part of the consent rule that needs no database (:func:`check_consent`). The whole
rule is in ``qo_ops/platform/run/consent.py``."""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any, Literal

from qo_ops.errors import BadInput

Mode = Literal["dry_run", "execute"]
Trigger = Literal["schedule", "sensor", "manual", "backfill", "retry", "api"]
TRIGGERS: tuple[str, ...] = ("schedule", "sensor", "manual", "backfill", "retry", "api")
# Triggers a person stands behind. They are the CLI, the Launchpad and a person's
# re-execution (manual), a partition backfill, the operator API, and Dagster's automatic
# retry of a run a person launched. Retries of scheduled and sensor runs keep their parent's
# trigger. Executes by these triggers need a reason and are audited. Schedules and sensors
# are not persons.
TRIGGERS_WITH_A_PERSON: tuple[str, ...] = ("manual", "backfill", "retry", "api")

MAX_BATCH_SIZE = 10_000
MAX_ITEMS = 100_000_000
MAX_THROTTLE_MS = 60_000
MAX_DEADLINE_S = 7 * 24 * 3600
MAX_LEASE_TTL_S = 3600
MAX_TEXT = 500  # reason, requester, correlation id
MAX_CONCURRENCY = 256


@dataclass(frozen=True)
class RunOptions:
    """How one run should behave. A limit left ``None`` takes the job's default."""

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
    dagster_parent_run_id: str | None = None  # the run a Dagster re-execution repeats
    approval: str | None = None  # the approval a destructive execute cites (run/consent.py)
    job_run_id: uuid.UUID | None = None  # adopt a row pre-created by the API
    progress_interval_s: float = 10.0
    sample_size: int = 10
    concurrency: int | None = None
    # When the run was asked for, if the trigger knows it (the Dagster run's creation).
    # job_start_delay_seconds counts from it. When None, it counts from the tick, the API's
    # acceptance or the record.
    requested_at: datetime | None = None
    retry_number: int = 0  # which of the trigger's automatic retries this run is (0 is first)
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
            if name == "reason":  # a blank reason is no reason, refused (and audited) as such
                check_consent(self)
            value = getattr(self, name)
            if value is not None and (len(value) > MAX_TEXT or not value.strip()):
                raise BadInput(f"{name.replace('_', ' ')} must be 1 to {MAX_TEXT} characters")
        return self

    @property
    def person_behind(self) -> bool:
        """Whether a person asked for this run (:data:`TRIGGERS_WITH_A_PERSON`). Then an
        execute needs a reason, and the run is audited."""
        return self.trigger in TRIGGERS_WITH_A_PERSON


# Why an execute was refused (``ExecuteRefused.error_code``, the audit row's details.refused).
REASON_REQUIRED = "reason_required"
APPROVAL_REQUIRED = "approval_required"
REASON_REUSED = "reason_reused"


class ExecuteRefused(BadInput):
    """An execute a person asked for that the rules do not allow. It has no reason, a reused
    reason, or it is a destructive job without a valid approval. Nothing was run, and
    ``run_job`` audits it as ``denied``."""

    def __init__(self, message: str, *, error_code: str) -> None:
        super().__init__(message)
        self.error_code = error_code  # REASON_REQUIRED | APPROVAL_REQUIRED | REASON_REUSED


def check_consent(options: RunOptions, *, destructive: bool = False, job_name: str = "") -> None:
    """Raise :class:`ExecuteRefused` for an execute with a person behind it that gives no
    reason, or that executes a destructive job citing no approval. Every path (CLI,
    Launchpad, backfill, API) is checked alike.

    This is step 1 of the consent rule. :func:`qo_ops.platform.run.consent.check` applies
    the whole rule, because whether the cited approval allows the run, and whether the
    reason is new, need the database."""
    if options.mode != "execute" or not options.person_behind:
        return
    if not (options.reason or "").strip():
        raise ExecuteRefused(
            f"an execute by a person ({options.trigger}) needs a reason (CLI: --reason; "
            "Dagster: config reason, or the tag qo_ops/reason on a backfill or re-execution)",
            error_code=REASON_REQUIRED,
        )
    if destructive and not (options.approval or "").strip():
        job = job_name or "{job}"
        raise ExecuteRefused(
            f"executing {job_name or 'a destructive job'} (destructive) needs an approval: an "
            f"approver grants one (qo-ops approval grant {job} --tenant … --reason …, or POST "
            f"/internal/jobs/{job}/approvals) and the run cites it (CLI --approval; Launchpad config "
            "approval; backfill tag qo_ops/approval; API approvalId, or an approver's own "
            "request)",
            error_code=APPROVAL_REQUIRED,
        )


def _check_range(name: str, value: float | None, lo: float, hi: float) -> None:
    if value is not None and not lo <= value <= hi:
        raise BadInput(f"{name} must be between {lo:g} and {hi:g}, got {value:g}")


@dataclass(frozen=True)
class Limits:
    """A run's limits. A job declares its defaults (``JobSpec.defaults``), and a run's
    options override each of them (:meth:`overridden_by`)."""

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
        """A JSON-ready dict, for the run record's options, the start event and the audit."""
        return asdict(self)
