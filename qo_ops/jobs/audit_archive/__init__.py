"""audit_archive (tenant × day): audit records past retention are copied to Parquet files
with a checksum manifest, verified, and only then deleted from ``audit_record``.

The window is the UTC day the records *occurred* on; eligible are the tenant's records of
the window older than the retention (``QO_OPS_AUDIT_RETENTION_DAYS``, default 365 days).
Each archive file holds one tenant-day chunk of at most ``batch_size`` records (default
5,000: one file per batch, and a batch short enough that its locks are held briefly),
ordered by id, under ``QO_OPS_HOME/archive/<tenant>/<day>/<manifest id>.parquet``; its
columns are those of ``audit_record``, ``details`` as the JSON text PostgreSQL stores.

One batch of the runner is one chunk (or one per day when a batch spans several days):

1. **select** (batch transaction 1, guarded by the lease): the next eligible ids, by UTC day
   then id (read off the index ``ix_audit_record_tenant_day_id``, no sort), locked; their
   id range is copied out (``COPY … TO STDOUT`` as CSV, parsed by Arrow into the archive's
   columns) and exactly the selected ids of it kept. A chunk is therefore "every eligible
   record of (tenant, day) with an id in [min, max]", which is what its manifest states.
   A WRITTEN manifest left by an earlier run for exactly this chunk is adopted instead of
   writing a new file; one that overlaps the chunk differently is retired (row deleted
   here, file removed after commit).
2. **external** (no transaction open): write the file to ``<name>.tmp``, fsync, rename,
   fsync the directory; insert the manifest ``WRITTEN`` (its own committed transaction,
   fenced: only while this run's lease is current); read the file back and verify it:
   sha256 of its bytes equals the manifest's, it parses, its row count, id range, tenant
   and window match, and Arrow digests its rows (:func:`format.table_digests`: ids, then
   every value). Orphan files (no manifest row, older than the lease TTL by the database's
   clock) in the day's directory are removed, once per day and run, unless another run
   holds a lease over that day (:func:`storage.sweep_orphans`).
3. **record** (batch transaction 2, guarded): the file is hashed once more (still the bytes
   that verified); then, under a savepoint of this transaction, the manifest becomes
   ``VERIFIED`` (``verified_at``) — conditionally, ``WHERE status = 'WRITTEN'`` — and the
   source rows of its tenant, id range and window are deleted by the predicate they were
   copied by (``format.ARCHIVE_ROWS``), PostgreSQL digesting the deleted rows from its own
   values (``format.DELETE_DIGESTED``, ``DELETE … RETURNING``). They must be exactly the
   file's rows — count, ids, every value — or the savepoint is rolled back: nothing
   deleted, and the manifest is marked ``FAILED`` instead; the run then stops with error
   code ``archive_verification_failed``. The two digests are computed each on its own side.

States of one chunk, and where a crash (SIGKILL) anywhere leaves it::

    S0 source rows, no file, no manifest          crash before the rename: at most a .tmp file
    S1 source rows + complete file, no manifest    orphan file: swept by a later run, never counted
    S2 source rows + file + manifest WRITTEN       a rerun adopts it (same chunk) or retires it
    S3 manifest VERIFIED, source rows deleted      only reachable from S2 in ONE transaction
    SF source rows + file + manifest FAILED        verification failed; file kept as evidence

A record is therefore always in exactly one of two places: the source table, or the file of
a VERIFIED manifest (S3) — never neither (rows are deleted only in the transaction that
makes the manifest VERIFIED, and that transaction keeps the delete only when the deleted
rows equal, value for value, a file whose bytes match the manifest's checksum), never both
(the same transaction deletes them, and a second archive of the same rows could only be
VERIFIED if those rows were still in the source). WRITTEN and FAILED manifests never count
as archived.

``restore`` (``qo-ops archive restore``) takes S3 back to S2 in one transaction: the rows of
every VERIFIED archive of the tenant-day are inserted with their ids (``ON CONFLICT (id) DO
NOTHING``) and the manifests become WRITTEN again, so nothing is counted twice; a later
archive run re-verifies and adopts those files.

No checkpoint: deleting a record removes it from the selection, so a rerun's selection is
exactly what is left. Within a run each batch selects after the previous batch's last
(day, id) (the runner's in-memory position, so the index scan does not walk the entries of
every record the run has already deleted), and the runner makes one last pass from the
start for records another run held. A FAILED chunk stays selectable, which is why a run
stops at the first verification failure instead of retrying the same rows in a loop.

Concurrency: one run per (job, scope) through the lease; runs of *overlapping* scopes (a
day, and a range containing it) take disjoint rows through ``SKIP LOCKED`` and every
destructive step re-checks under row locks and conditional updates, so the worst an overlap
can do is leave a manifest FAILED or retired — never lose or double-count a record.

Test-only fault injection, like the runner's: with ``QO_OPS_CRASH_AT`` set to one of
``ARCHIVE_CRASH_POINTS`` the process kills itself with SIGKILL at that point.
``archive_before_file_rename`` (S0: the .tmp file written and fsync'd, not renamed),
``archive_after_file_written`` (S1: file renamed into place, no manifest),
``archive_after_manifest_written`` (S2: WRITTEN committed, not verified),
``archive_before_delete_commit`` (S2: delete + VERIFIED issued, not committed),
``archive_after_delete_commit`` (S3: committed; fires as the next batch starts). The
runner's own ``after_external_call`` is the point "verified, nothing deleted yet" (S2), and
its points before that (``after_batch_select``, ``before_commit``, ``after_commit``) leave
S0. SF is reached by a failed verification, not by a crash (a crash before its commit
leaves S2); the tests plant one.

The package, one purpose a module: ``settings`` (the retention and the archive directory,
checked before a run writes anything), ``errors``, ``format`` (COPY out of PostgreSQL,
Parquet in and out, the rows' digest on both sides), ``storage`` (paths, fsync'd writes,
the orphan sweep), ``batch`` (what one batch carries between its phases), ``steps`` (the
runner's eligible, transition, external and record steps), ``checks`` (outcome checks,
report, lag) and ``restore``; ``SPEC`` below declares the job from them.
"""

from __future__ import annotations

from qo_ops.db.schema import audit_record
from qo_ops.jobs.audit_archive.batch import Chunk, FileResult, Work
from qo_ops.jobs.audit_archive.checks import (
    ACCOUNTS_FOR_EVERY_RECORD,
    ARCHIVES_VERIFY,
    check_archive,
    overdue_seconds,
    report_archive,
)
from qo_ops.jobs.audit_archive.errors import (
    VERIFICATION_FAILED,
    ArchiveConfigError,
    ArchiveError,
    ArchiveVerificationFailed,
)
from qo_ops.jobs.audit_archive.format import COLUMNS, archive_schema, read_rows
from qo_ops.jobs.audit_archive.restore import RestoreResult, restore_day
from qo_ops.jobs.audit_archive.settings import (
    JOB_NAME,
    MAX_ROWS_PER_FILE,
    RETENTION_ENV,
    ArchiveSettings,
    archive_settings,
    retention_days,
)
from qo_ops.jobs.audit_archive.steps import (
    ARCHIVE_CRASH_POINTS,
    SIDE_EFFECT,
    archivable_records,
    delete_verified,
    select_chunks,
    write_and_verify,
)
from qo_ops.jobs.audit_archive.storage import relative_path, resolve_path, sha256_of
from qo_ops.platform.job.options import Limits
from qo_ops.platform.job.resources import RunResources
from qo_ops.platform.job.spec import (
    Batching,
    Deployment,
    ExternalPhase,
    JobSpec,
    Positions,
    Presentation,
    Signals,
    SkipLocked,
)

SPEC = JobSpec(
    name=JOB_NAME,
    kind="archive",
    description=(
        "Copy audit records past retention to verified Parquet archives, then delete them, "
        "per tenant and day"
    ),
    partitioning="tenant_day",
    eligible=archivable_records,
    transition=select_chunks,
    then=ExternalPhase(call=write_and_verify, record=delete_verified),
    check=check_archive,
    checks=(ACCOUNTS_FOR_EVERY_RECORD, ARCHIVES_VERIFY),
    defaults=Limits(batch_size=MAX_ROWS_PER_FILE),
    destructive=True,
    validate_settings=archive_settings,  # retention and a writable archive directory
    batching=Batching(locks=SkipLocked(of=audit_record), positions=Positions()),
    presentation=Presentation(
        outcome_asset="audit_records",
        change="archived to a verified Parquet file, then deleted",
        healthy="No audit record past retention left in the source, and every VERIFIED archive still matches its checksum.",
    ),
    deployment=Deployment(
        cron_schedule="15 3 * * *",
        # a chunk of records is held in memory as Arrow; a run worker adds Dagster (bench/TUNING.md)
        run_resources=RunResources(cpu_request="500m", memory_request="1Gi", memory_limit="2Gi"),
        scheduled_window_age_days=lambda: retention_days() + 1,
    ),
    signals=Signals(
        lag=overdue_seconds,
        report=report_archive,
        side_effects=(SIDE_EFFECT,),
        error_classes=(
            ArchiveError.error_code,
            ArchiveVerificationFailed.error_code,
            ArchiveConfigError.error_code,
        ),
    ),
)

__all__ = [
    "ARCHIVE_CRASH_POINTS",
    "COLUMNS",
    "JOB_NAME",
    "RETENTION_ENV",
    "SPEC",
    "VERIFICATION_FAILED",
    "ArchiveConfigError",
    "ArchiveError",
    "ArchiveSettings",
    "ArchiveVerificationFailed",
    "Chunk",
    "FileResult",
    "RestoreResult",
    "Work",
    "archive_schema",
    "archive_settings",
    "read_rows",
    "relative_path",
    "resolve_path",
    "restore_day",
    "retention_days",
    "sha256_of",
]
