"""temp_file_cleanup deletes temp files past retention, per tenant and creation day. Each
file loses its row and its stored object, and every removal leaves a tombstone. A run that
would remove an anomalous amount stops before it removes anything.

**Eligible files.** The tenant created the file in the window, the file is older than the
retention, its status is terminal (COMPLETED or FAILED_TERMINAL), and it is not on legal
hold. The retention is ``QO_OPS_TEMP_FILE_RETENTION_DAYS`` (default 7), read when the run
starts. A bad value of any cleanup setting is refused before anything is written. Files are
taken oldest first, on the partial index ``ix_temp_file_cleanup``. Its predicate is written
as SQL literals so that every plan can use it.

Stored objects live under ``QO_OPS_HOME/objects/<storage_path>``. The job reaches them
through :class:`~qo_ops.platform.calls.object_store.ObjectStore`, which never follows a
symlink. A storage path that is not a plain relative path, or that goes through a symlinked
directory, is ``unsafe_storage_path``. That file fails, and its row and object stay.

**Each batch runs two transactions.** The first is the transition, the second the platform's
:class:`~qo_ops.platform.job.spec.SecondTransaction`. Nothing is called between them.

1. *Decide.* The selected rows are locked (FOR UPDATE SKIP LOCKED). On the run's first batch
   the anomaly gate runs. Each selected object is hashed, and a tombstone *intent* is
   written with ``deleted_at`` NULL and the ``sha256`` of the stored bytes (NULL when the
   object is already gone). An earlier run's intent keeps its checksum. Then it commits.
2. *Remove.* One statement deletes the rows that are still eligible and not on hold, and
   completes their tombstones with ``deleted_at`` and the row's ``legal_hold`` as its DELETE
   returned it. The ``temp_file_legal_hold_guard`` trigger refuses a held row whatever the
   query says. Next the objects of exactly the deleted rows are unlinked. Those rows are
   deleted but not committed, so they stay locked and nobody can put a hold on them now.
   Intents of rows that changed since step 1 are dropped (objects kept). Then it commits.

**Why this order.** An object is unlinked only while its row's delete is pending in the same
transaction. The row stays until its object is gone, so the row is the retry token and a
rerun's selection is exactly what is left. A separate sweep would fail, since a rerun that
finds nothing eligible never reaches it. Each checksum is durable before any byte goes.

**What a crash leaves, and what a rerun does.** A rerun first reaps the dead run's record.

=======================================  =========  =========  ==============  ===============
crash                                    rows       objects    tombstones      rerun
=======================================  =========  =========  ==============  ===============
in 1, before its commit                  unchanged  unchanged  none new        starts afresh
after 1 commits (``after_commit``)       unchanged  unchanged  intents         finishes them,
                                                                               same checksums
in 2, before unlinking                   unchanged  unchanged  intents         same
(``before_object_delete``)
in 2, after unlinking, before commit     restored,  gone       intents, with   deletes rows,
(``after_object_delete``: the riskiest)  eligible                original sums   completes them
after 2 commits                          gone       gone       complete        nothing to do
=======================================  =========  =========  ==============  ===============

An unlink error other than "not found" aborts the batch with ``object_store_error``. That is
the same state as a crash in step 2, and a rerun retries.

One state needs a person. Step 2 crashes after unlinking, then someone puts a legal hold on
such a row before the rerun. The row is kept (by the selection and the trigger) but its
bytes are gone. The intent tombstone tells which run removed them and when, while the row
was not on hold. The ``no_legal_hold_removed`` check fails on it so that a person looks.

**Anomaly stop.** Before its first delete, the run counts the eligible set of its scope. The
run raises :class:`AnomalyThreshold` when that set is above ``QO_OPS_CLEANUP_MAX_DELETE``
files (default 10,000) or above ``QO_OPS_CLEANUP_MAX_SHARE`` of all the tenant's files
(default 0.5). Then nothing is deleted, and the run ends ``failed`` with
``anomaly_threshold``. ``QO_OPS_CLEANUP_OVERRIDE=1`` lets a run that has a reason through,
and writes a ``job_audit`` row (action ``anomaly_override``) in that batch's transaction.

There is no checkpoint. A deleted row leaves the selection, so a rerun finds what is left.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.config import whole_number
from qo_ops.db.arrays import int_array
from qo_ops.db.audit import AuditEntry, append_audit
from qo_ops.db.schema import job_run, temp_file
from qo_ops.errors import ClassifiedError, ConfigError
from qo_ops.platform.calls.object_store import (
    ObjectStore,
    ObjectStoreError,
    digest_array,
    objects_root,
)
from qo_ops.platform.job.options import Limits
from qo_ops.platform.job.outcome import BatchContext, BatchOutcome, OutcomeCheck, ReportRow
from qo_ops.platform.job.outcome import SideEffectResult as Result
from qo_ops.platform.job.outcome import run_settings as settings_of_run
from qo_ops.platform.job.resources import RunResources
from qo_ops.platform.job.spec import (
    Batching,
    CheckSpec,
    Deployment,
    JobSpec,
    Positions,
    Presentation,
    SecondTransaction,
    Signals,
)
from qo_ops.platform.run.faults import crash_point
from qo_ops.platform.run.selection import after_position, seconds_or_none

SIDE_EFFECT = "object_delete"  # a file removed from the object store (job_side_effects_total)
RETENTION_ENV = "QO_OPS_TEMP_FILE_RETENTION_DAYS"
MAX_DELETE_ENV = "QO_OPS_CLEANUP_MAX_DELETE"
MAX_SHARE_ENV = "QO_OPS_CLEANUP_MAX_SHARE"
OVERRIDE_ENV = "QO_OPS_CLEANUP_OVERRIDE"
DEFAULT_RETENTION_DAYS = 7
DEFAULT_MAX_DELETE = 10_000
DEFAULT_MAX_SHARE = 0.5
GRACE_DAYS = 1  # nothing_eligible_past_grace forgives files eligible this recently
GUARD_TRIGGER = "temp_file_legal_hold_guard"
CRASH_BEFORE_OBJECT_DELETE = "before_object_delete"  # QO_OPS_CRASH_AT, row delete pending
CRASH_AFTER_OBJECT_DELETE = "after_object_delete"  # QO_OPS_CRASH_AT, objects gone, no commit


class AnomalyThreshold(ClassifiedError):
    """The run would delete more than the anomaly thresholds allow, so it deleted nothing."""

    error_code = "anomaly_threshold"


class CleanupConfigError(ConfigError):
    """A cleanup setting in the environment is unusable."""

    error_code = "bad_config"


# ------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class CleanupSettings:
    """What a run works with, read from the environment when the run starts."""

    retention_days: int
    max_delete: int
    max_share: float
    override: bool
    objects_root: Path


def settings_from_env(environ: Mapping[str, str] | None = None) -> CleanupSettings:
    """Read the cleanup settings. A bad value raises :class:`CleanupConfigError` naming it."""
    env = os.environ if environ is None else environ
    retention = whole_number(
        RETENTION_ENV, DEFAULT_RETENTION_DAYS, 0, 36_500, environ=env, error=CleanupConfigError
    )
    max_delete = whole_number(
        MAX_DELETE_ENV, DEFAULT_MAX_DELETE, 0, 10**12, environ=env, error=CleanupConfigError
    )
    raw_share = (env.get(MAX_SHARE_ENV) or "").strip()
    try:
        share = float(raw_share) if raw_share else DEFAULT_MAX_SHARE
    except ValueError:
        share = math.nan
    if not 0.0 <= share <= 1.0:  # this also refuses nan
        raise CleanupConfigError(f"{MAX_SHARE_ENV} must be a number from 0 to 1, got {raw_share!r}")
    return CleanupSettings(
        retention_days=retention,
        max_delete=max_delete,
        max_share=share,
        override=(env.get(OVERRIDE_ENV) or "").strip() == "1",
        objects_root=objects_root(env),
    )


def run_settings(ctx: BatchContext) -> CleanupSettings:
    """Return the settings checked before the run started, so every batch and check agrees."""
    return settings_of_run(ctx, settings_from_env)


def _retention(ctx: BatchContext) -> sa.Cast[timedelta]:
    """Return the run's retention as a bound interval of whole days."""
    days = timedelta(days=run_settings(ctx).retention_days)
    return sa.cast(sa.bindparam("retention", days, unique=True), sa.Interval)


# ------------------------------------------------------------------------------ selection

# The tenant's unheld, terminal files created in [:start, :end) and older than :days.
# The selection, the anomaly count, the lag, the delete, the overdue check and the bench all
# share it, so the delete can never take a row the selection would not. Hold and status are
# literals, so that every plan implies ix_temp_file_cleanup's predicate.
ELIGIBLE = (
    "tenant_id = :tenant AND legal_hold = false AND status IN ('COMPLETED', 'FAILED_TERMINAL') "
    "AND created_at >= :start AND created_at < :end "
    "AND created_at < now() - make_interval(days => CAST(:days AS integer))"
)


def _eligible_where(ctx: BatchContext) -> sa.TextClause:
    """Return :data:`ELIGIBLE` for the run's scope and retention, with its values bound."""
    start, end = ctx.scope.window_bounds()
    values = {
        "tenant": ctx.scope.tenant_id,
        "start": start,
        "end": end,
        "days": run_settings(ctx).retention_days,
    }
    return sa.text(ELIGIBLE).bindparams(
        *(sa.bindparam(name, value, unique=True) for name, value in values.items())
    )


def eligible_files(ctx: BatchContext) -> sa.Select[Any]:
    """Select the tenant's terminal, unheld files created in the window and past retention,
    oldest first, on ix_temp_file_cleanup.

    Within a run, each batch starts after the last one (``position``), so it does not walk
    the index entries that earlier batches left dead. The runner ends with one pass from the
    start. A file this run could not handle (an unsafe storage path) is not taken again.
    """
    query = (
        sa.select(temp_file.c.id)
        .where(_eligible_where(ctx))
        .order_by(temp_file.c.created_at, temp_file.c.id)
    )
    refused = ctx.run_state(CleanupRun).refused
    if refused:
        query = query.where(temp_file.c.id.not_in(sorted(refused)))
    query = after_position(
        query,
        (temp_file.c.created_at, temp_file.c.id),
        ctx.position,
        ("created_at", "id"),
    )
    return query


@dataclass(frozen=True)
class AnomalyMeasure:
    eligible: int
    tenant_files: int
    max_delete: int
    max_share: float

    @property
    def share(self) -> float:
        return self.eligible / self.tenant_files if self.tenant_files else 0.0

    def breaches(self) -> list[str]:
        found = []
        if self.eligible > self.max_delete:
            found.append(f"{self.eligible} files eligible, above the cap of {self.max_delete}")
        if self.share > self.max_share:
            found.append(
                f"{self.eligible} of the tenant's {self.tenant_files} files eligible "
                f"({self.share:.0%}), above the share of {self.max_share:.0%}"
            )
        return found

    def as_metadata(self) -> dict[str, Any]:
        return {
            "eligible": self.eligible,
            "tenant_files": self.tenant_files,
            "share": round(self.share, 4),
            "max_delete": self.max_delete,
            "max_share": self.max_share,
        }


@dataclass
class CleanupRun:
    """The anomaly gate's result and the refused files, kept between a cleanup run's batches."""

    measure: AnomalyMeasure | None = None
    gate: Literal["passed", "overridden"] | None = None
    refused: set[int] = field(default_factory=set)


def measure_anomaly(conn: Connection, ctx: BatchContext) -> AnomalyMeasure:
    """Measure how much of the tenant the scope's eligible set is."""
    settings = run_settings(ctx)
    eligible = conn.execute(
        sa.select(sa.func.count()).select_from(temp_file).where(_eligible_where(ctx))
    ).scalar_one()
    total = conn.execute(
        sa.select(sa.func.count())
        .select_from(temp_file)
        .where(temp_file.c.tenant_id == ctx.scope.tenant_id)
    ).scalar_one()
    return AnomalyMeasure(eligible, total, settings.max_delete, settings.max_share)


def _anomaly_gate(conn: Connection, ctx: BatchContext) -> None:
    """Stop the run, deleting nothing, when the eligible set is anomalous and not overridden."""
    measure = measure_anomaly(conn, ctx)
    run_state = ctx.run_state(CleanupRun)
    run_state.measure = measure  # for the run's report
    breaches = measure.breaches()
    if not breaches:
        run_state.gate = "passed"
        return
    run = conn.execute(
        sa.select(job_run.c.reason, job_run.c.requester, job_run.c.correlation_id).where(
            job_run.c.id == ctx.job_run_id
        )
    ).one()
    settings = run_settings(ctx)
    if settings.override and (run.reason or "").strip():
        append_audit(
            conn,
            AuditEntry(
                actor=run.requester or "unknown",
                action="anomaly_override",
                decision="allowed",
                job_name=ctx.job_name,
                scope=ctx.scope.key,
                mode=ctx.mode,
                reason=run.reason,
                correlation_id=run.correlation_id,
                job_run_id=ctx.job_run_id,
                details={**measure.as_metadata(), "breaches": breaches},
            ),
        )
        run_state.gate = "overridden"
        return
    how = (
        "the override needs a reason on the run"
        if settings.override
        else f"{OVERRIDE_ENV}=1 and a reason override it"
    )
    raise AnomalyThreshold(f"{'; '.join(breaches)}: nothing deleted ({how})")


# ------------------------------------------------------------------------------ step 1: decide

# The batch's files, which the runner's selection locked in this transaction, oldest first.
_BATCH_FILES = sa.text(
    "SELECT id, storage_path, created_at FROM temp_file "
    "WHERE id = ANY(CAST(:ids AS bigint[])) AND tenant_id = :tenant ORDER BY created_at, id"
)

# Record the decided removal before any byte goes, as one intent per file with its checksum.
# The rows are found by the primary key (= ANY), never by a scan of the tenant's files.
# Twice: the upsert on temp_file_id keeps the checksum first seen and leaves a completed
# tombstone alone (WHERE deleted_at IS NULL), so a rerun only re-stamps its run and reason.
_WRITE_INTENTS = sa.text(
    """
    INSERT INTO temp_file_tombstone AS t
           (temp_file_id, tenant_id, storage_path, size_bytes, sha256, file_status,
            file_created_at, legal_hold, job_run_id, reason, selected_at)
    SELECT f.id, f.tenant_id, f.storage_path, f.size_bytes, h.sha256, f.status, f.created_at,
           f.legal_hold, CAST(:run AS uuid), :reason, clock_timestamp()
      FROM unnest(CAST(:ids AS bigint[]), CAST(:shas AS text[])) AS h(id, sha256)
      JOIN temp_file f ON f.id = h.id
     WHERE f.id = ANY(CAST(:ids AS bigint[])) AND f.tenant_id = :tenant
    ON CONFLICT (temp_file_id) DO UPDATE
       SET sha256 = coalesce(t.sha256, EXCLUDED.sha256),  -- the bytes as first seen
           job_run_id = EXCLUDED.job_run_id, reason = EXCLUDED.reason,
           selected_at = EXCLUDED.selected_at
     WHERE t.deleted_at IS NULL
    """
)


def _reason(ctx: BatchContext) -> str:
    days = run_settings(ctx).retention_days
    reason = f"retention: terminal and older than {days} days"
    overridden = ctx.run_state(CleanupRun).gate == "overridden"
    return reason + " (anomaly threshold overridden)" if overridden else reason


@dataclass(frozen=True)
class DecidedFile:
    """A file step 1 decided to remove. A ``safe`` one has its intent (sha256 None if gone)."""

    id: int
    storage_path: str
    created_at: datetime
    safe: bool
    sha256: str | None


def decide_batch(conn: Connection, ctx: BatchContext, ids: Sequence[Any]) -> BatchOutcome:
    """Step 1 gates the run on its first batch, hashes the selected objects, writes intents."""
    settings = run_settings(ctx)
    if ctx.run_state(CleanupRun).gate is None:
        _anomaly_gate(conn, ctx)
    files = conn.execute(_BATCH_FILES, {"ids": int_array(ids), "tenant": ctx.scope.tenant_id}).all()
    with ObjectStore(settings.objects_root) as store:  # each object gives (safe, sha256)
        work = [
            DecidedFile(f.id, f.storage_path, f.created_at, *store.sha256(f.storage_path))
            for f in files
        ]
    hashed = [w for w in work if w.safe]
    if hashed:
        conn.execute(
            _WRITE_INTENTS,
            {
                "ids": int_array([w.id for w in hashed]),
                "shas": digest_array([w.sha256 for w in hashed]),
                "run": str(ctx.job_run_id),
                "reason": _reason(ctx),
                "tenant": ctx.scope.tenant_id,
            },
        )
    return BatchOutcome(work=work)


# ------------------------------------------------------------------------------ step 2: remove


# Delete the rows that are still eligible, never a held one. A row changed since step 1 stays.
# The tombstone gets the row's legal_hold as this very DELETE returned it.
# Twice: a deleted row matches nothing again, and the tombstone is upserted on temp_file_id
# (the intent of step 1 is completed, never a second row).
_DELETE_ROWS = sa.text(
    f"""
    WITH gone AS (
        DELETE FROM temp_file f WHERE f.id = ANY(CAST(:ids AS bigint[])) AND {ELIGIBLE}
        RETURNING f.id, f.tenant_id, f.storage_path, f.size_bytes, f.status, f.created_at,
                  f.legal_hold
    )
    INSERT INTO temp_file_tombstone AS t
           (temp_file_id, tenant_id, storage_path, size_bytes, file_status, file_created_at,
            legal_hold, job_run_id, reason, selected_at, deleted_at)
    SELECT id, tenant_id, storage_path, size_bytes, status, created_at, legal_hold,
           CAST(:run AS uuid), :reason, clock_timestamp(), clock_timestamp()
      FROM gone
    ON CONFLICT (temp_file_id) DO UPDATE
       SET storage_path = EXCLUDED.storage_path, size_bytes = EXCLUDED.size_bytes,
           file_status = EXCLUDED.file_status, file_created_at = EXCLUDED.file_created_at,
           legal_hold = EXCLUDED.legal_hold, job_run_id = EXCLUDED.job_run_id,
           reason = EXCLUDED.reason, deleted_at = EXCLUDED.deleted_at
    RETURNING t.temp_file_id, t.storage_path, t.size_bytes
    """
)

# Drop the intents of rows that stay because they changed since step 1 (object intact).
# Twice: only intents (deleted_at IS NULL) go, and a second run finds none of them left.
_FORGET_INTENTS = sa.text(
    "DELETE FROM temp_file_tombstone WHERE temp_file_id = ANY(CAST(:ids AS bigint[])) "
    "AND deleted_at IS NULL"
)


def remove_batch(conn: Connection, ctx: BatchContext, files: list[DecidedFile]) -> BatchOutcome:
    """Step 2 deletes the rows still eligible and completes their tombstones. Then it unlinks
    their objects before the commit."""
    settings = run_settings(ctx)
    start, end = ctx.scope.window_bounds()
    unsafe = [f for f in files if not f.safe]
    safe = {f.id: f.storage_path for f in files if f.safe}
    gone = (
        conn.execute(
            _DELETE_ROWS,
            {
                "ids": int_array(list(safe)),
                "tenant": ctx.scope.tenant_id,
                "start": start,
                "end": end,
                "days": settings.retention_days,
                "run": str(ctx.job_run_id),
                "reason": _reason(ctx),
            },
        ).all()
        if safe
        else []
    )
    deleted = {r.temp_file_id for r in gone}
    # Rows that changed since step 1 (e.g. put on hold) stay with their objects. Their intents
    # go, unless the object is missing, which is evidence of an earlier interrupted removal.
    kept = [i for i in safe if i not in deleted]
    removed = already_gone = removed_bytes = 0
    with ObjectStore(settings.objects_root) as store:
        intact = [i for i in kept if store.exists(safe[i])]
        if intact:
            conn.execute(_FORGET_INTENTS, {"ids": int_array(intact)})
        crash_point(CRASH_BEFORE_OBJECT_DELETE)
        for row in sorted(gone, key=lambda r: r.temp_file_id):
            # Safe in step 1. A directory swapped for a symlink since then raises and rolls back.
            if store.remove(row.storage_path):
                removed += 1
                removed_bytes += row.size_bytes
            else:
                already_gone += 1
    crash_point(CRASH_AFTER_OBJECT_DELETE)
    tally = {"objects_removed": removed, "objects_already_gone": already_gone}
    if removed_bytes:
        tally["bytes_removed"] = removed_bytes
    if kept:
        tally["changed_since_selection"] = len(kept)
    if unsafe:
        tally["unsafe_storage_path"] = len(unsafe)
        ctx.run_state(CleanupRun).refused.update(f.id for f in unsafe)
    last = files[-1] if files else None
    outcome = BatchOutcome(
        position={"created_at": last.created_at, "id": last.id} if last else None,
        succeeded=len(gone),
        skipped=len(kept),
        failed=len(unsafe),
        failed_items=[(str(f.id), "unsafe_storage_path") for f in unsafe],
        tally=tally,
    )
    # An object already gone was removed by an earlier attempt whose commit did not happen.
    outcome.side_effect(SIDE_EFFECT, Result.SUCCESS, removed)
    outcome.side_effect(SIDE_EFFECT, Result.DUPLICATE_PREVENTED, already_gone)
    return outcome


# ------------------------------------------------------------------------------ outcome

# Tombstones of the window's held files that were deleted. The guard should keep this at 0.
_HELD_DELETED = sa.text(
    "SELECT count(*) FROM temp_file_tombstone WHERE tenant_id = :tenant "
    "AND file_created_at >= :start AND file_created_at < :end "
    "AND deleted_at IS NOT NULL AND legal_hold"
)
_GUARD_STATE = sa.text(
    "SELECT tgenabled FROM pg_trigger WHERE tgname = :name "
    "AND tgrelid = CAST('temp_file' AS regclass)"
)
# A held row that a removal had been decided for (its object may be gone).
_HELD_WITH_INTENT = sa.text(
    "SELECT f.storage_path FROM temp_file f JOIN temp_file_tombstone t "
    "ON t.temp_file_id = f.id WHERE f.tenant_id = :tenant "
    "AND f.created_at >= :start AND f.created_at < :end AND f.legal_hold"
)
# Deletable files of the window past :days (retention plus grace), on ix_temp_file_cleanup.
_OVERDUE_FILES = sa.text(f"SELECT count(*) FROM temp_file WHERE {ELIGIBLE}")
_PATHS_PART = 10_000  # deleted paths checked at a time
# Paths of the window's deleted files that no live row uses again.
_DELETED_PATHS = sa.text(
    "SELECT t.storage_path FROM temp_file_tombstone t WHERE t.tenant_id = :tenant "
    "AND t.file_created_at >= :start AND t.file_created_at < :end "
    "AND t.deleted_at IS NOT NULL "
    "AND NOT EXISTS (SELECT 1 FROM temp_file f WHERE f.storage_path = t.storage_path)"
)
# What a run deleted, per creation day.
_DELETED_BY_DAY = sa.text(
    "SELECT (file_created_at AT TIME ZONE 'UTC')::date AS day, count(*) AS files, "
    "coalesce(sum(size_bytes), 0) AS bytes, count(sha256) AS checksums "
    "FROM temp_file_tombstone WHERE job_run_id = :run AND deleted_at IS NOT NULL "
    "GROUP BY 1 ORDER BY 1"
)


def _window(ctx: BatchContext) -> dict[str, Any]:
    start, end = ctx.scope.window_bounds()
    return {"tenant": ctx.scope.tenant_id, "start": start, "end": end}


# Each check is declared once. Its results in check_cleanup carry the same description.
NO_LEGAL_HOLD_REMOVED = CheckSpec("no_legal_hold_removed", "No file on legal hold was ever deleted")
NOTHING_ELIGIBLE_PAST_GRACE = CheckSpec(
    "nothing_eligible_past_grace", "No deletable file of the window is past retention plus grace"
)
DELETED_OBJECTS_GONE = CheckSpec(
    "deleted_objects_gone", "Every file the job deleted has no stored object left", blocking=False
)
ELIGIBLE_WITHIN_ANOMALY_THRESHOLD = CheckSpec(
    "eligible_within_anomaly_threshold",
    "What is eligible stays within the anomaly thresholds",
    blocking=False,
)


def check_cleanup(conn: Connection, ctx: BatchContext) -> list[OutcomeCheck]:
    """Check that legal holds are intact, nothing eligible is left past retention plus grace,
    deleted objects are gone, and the eligible set is within the anomaly thresholds."""
    settings = run_settings(ctx)
    window = _window(ctx)
    held_deleted = conn.execute(_HELD_DELETED, window).scalar_one()
    guard = conn.execute(_GUARD_STATE, {"name": GUARD_TRIGGER}).scalar()
    guard_enforced = guard in ("O", "A")  # fires in ordinary sessions
    held_with_intent = conn.execute(_HELD_WITH_INTENT, window).scalars()
    with ObjectStore(settings.objects_root) as store:
        held_bytes_lost = sum(1 for p in held_with_intent if not store.exists(p))
    overdue_days = settings.retention_days + GRACE_DAYS
    overdue = conn.execute(_OVERDUE_FILES, {**window, "days": overdue_days}).scalar_one()
    # Streamed, because a check on its own covers every day of the tenant's deletions. Each
    # part lists its directories once instead of a stat per path.
    deleted_paths = conn.execute(
        _DELETED_PATHS, window, execution_options={"yield_per": _PATHS_PART}
    ).scalars()
    with ObjectStore(settings.objects_root) as store:
        leftover = sum(store.count_stored(p) for p in deleted_paths.partitions(_PATHS_PART))
    measure = measure_anomaly(conn, ctx)
    return [
        NO_LEGAL_HOLD_REMOVED.result(
            held_deleted == 0 and guard_enforced and held_bytes_lost == 0,
            {
                "held_rows_deleted": held_deleted,
                "guard_trigger_enforced": guard_enforced,
                "held_objects_removed": held_bytes_lost,
            },
        ),
        NOTHING_ELIGIBLE_PAST_GRACE.result(
            overdue == 0,
            {"overdue_files": overdue, "retention_days": settings.retention_days},
        ),
        DELETED_OBJECTS_GONE.result(leftover == 0, {"objects_left": leftover}),
        ELIGIBLE_WITHIN_ANOMALY_THRESHOLD.result(not measure.breaches(), measure.as_metadata()),
    ]


def _objects_preview(conn: Connection, ctx: BatchContext, eligible: int) -> ReportRow:
    """Preview the eligible files' objects for a dry run. It counts those execute would unlink,
    those already gone (only their rows would go) and those it would refuse as unsafe."""
    paths = conn.execute(sa.select(temp_file.c.storage_path).where(_eligible_where(ctx)))
    with ObjectStore(run_settings(ctx).objects_root) as store:
        stored, unsafe = store.census(paths.scalars())
    detail = f"of the {eligible} eligible files; {eligible - stored - unsafe} already gone"
    return ReportRow(
        "objects", "stored", stored, detail + (f", {unsafe} unsafe_storage_path" if unsafe else "")
    )


def report_cleanup(conn: Connection, ctx: BatchContext) -> list[ReportRow]:
    """Report the files deleted per creation day, with their bytes and recorded checksums.
    Report the anomaly decision, from the run's gate or what a gate would decide now. A dry
    run within the cap also reports how many of the eligible files' objects are stored."""
    settings = run_settings(ctx)
    run_state = ctx.run_state(CleanupRun)
    stop = "stopped" if run_state.measure is not None else "would stop"  # the gate ran
    measure = run_state.measure or measure_anomaly(conn, ctx)  # or what the gate would decide
    decision = run_state.gate or (stop if measure.breaches() else "within")
    rows = [
        ReportRow(
            "anomaly_gate",
            str(decision),
            measure.eligible,
            f"files eligible of the tenant's {measure.tenant_files}; "
            f"cap {settings.max_delete}, share {settings.max_share:.0%}",
        )
    ]
    for day in conn.execute(_DELETED_BY_DAY, {"run": ctx.job_run_id}):
        name = day.day.isoformat()
        gone = day.files - day.checksums
        detail = f"{day.checksums} checksummed, {gone} object(s) already gone"
        rows.append(ReportRow("deleted", name, day.files, detail))
        rows.append(ReportRow("bytes_deleted", name, int(day.bytes)))
    if ctx.mode == "dry_run" and measure.eligible <= settings.max_delete:  # a stat per object
        rows.append(_objects_preview(conn, ctx, measure.eligible))
    return rows


def overdue_seconds(conn: Connection, ctx: BatchContext) -> float | None:
    """Return the seconds since the oldest eligible file of the window passed retention."""
    oldest = sa.func.min(temp_file.c.created_at) + _retention(ctx)
    value = conn.execute(
        sa.select(sa.func.extract("epoch", sa.func.now() - oldest)).where(_eligible_where(ctx))
    ).scalar()
    return seconds_or_none(value)


SPEC = JobSpec(
    name="temp_file_cleanup",
    kind="cleanup",
    description=(
        "Delete temp files past retention (row and stored object, tombstoned), never one on "
        "legal hold; stop on an anomalous amount; per tenant and creation day"
    ),
    partitioning="tenant_day",
    eligible=eligible_files,
    transition=decide_batch,
    then=SecondTransaction(finish=remove_batch),  # step 2 runs after step 1 has committed
    check=check_cleanup,
    checks=(
        NO_LEGAL_HOLD_REMOVED,
        NOTHING_ELIGIBLE_PAST_GRACE,
        DELETED_OBJECTS_GONE,
        ELIGIBLE_WITHIN_ANOMALY_THRESHOLD,
    ),
    defaults=Limits(batch_size=500),  # each batch hashes its objects inside step 1
    destructive=True,
    validate_settings=settings_from_env,  # a bad setting is refused before anything is written
    batching=Batching(positions=Positions()),
    presentation=Presentation(
        outcome_asset="temp_files",
        change="row and stored object deleted, tombstoned",
        healthy="No deletable temp file past retention plus a day of grace, and no file on legal hold ever deleted.",
    ),
    deployment=Deployment(
        cron_schedule="15 3 * * *",
        run_resources=RunResources(cpu_request="500m"),  # sha256 of every object it deletes
        scheduled_window_age_days=lambda: settings_from_env().retention_days + 1,
    ),
    signals=Signals(
        lag=overdue_seconds,
        report=report_cleanup,
        side_effects=(SIDE_EFFECT,),
        error_classes=(
            AnomalyThreshold.error_code,
            CleanupConfigError.error_code,
            ObjectStoreError.error_code,
        ),
    ),
)
