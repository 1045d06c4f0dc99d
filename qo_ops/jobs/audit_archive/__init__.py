"""audit_archive copies audit records past retention to Parquet files, per tenant and day.
Each file gets a checksum manifest and is verified. Only then are the records deleted from
``audit_record``.

The window is the UTC day the records *occurred* on. The eligible records are the tenant's
records of the window older than the retention (``QO_OPS_AUDIT_RETENTION_DAYS``, default 365
days). Each archive file holds one tenant-day chunk of at most ``batch_size`` records,
ordered by id. The default of 4,000 (``MAX_ROWS_PER_FILE``) gives one file per batch, and
keeps a batch short enough that it holds its locks briefly. A file lives at
``QO_OPS_HOME/archive/<tenant>/<day>/<manifest id>.parquet``. Its columns are those of
``audit_record``, with ``details`` as the JSON text PostgreSQL stores.

One batch of the runner is one chunk, or one chunk per day when a batch spans several days:

1. **select** runs in batch transaction 1, guarded by the lease, as one statement
   (``Batching.claims``: ``format.COPY_CLAIMED``). It locks the next eligible records, by
   UTC day then id, read off the index ``ix_audit_record_tenant_day_id`` without a sort,
   and copies exactly those out (``COPY … TO STDOUT`` as CSV, parsed by Arrow into the
   archive's columns); their ids make no round trip through Python. A chunk is
   therefore "every eligible record of (tenant, day) with an id in [min, max]", which is
   what its manifest states. If an earlier run left a WRITTEN manifest for exactly this
   chunk, the step adopts it instead of writing a new file. A manifest that overlaps the
   chunk differently is retired. Its row is deleted here, and its file is removed after
   commit.
2. **external** runs with no transaction open. It writes the file to ``<name>.tmp``, fsyncs
   it, renames it and fsyncs the directory. It inserts the manifest as ``WRITTEN`` in its
   own committed transaction, fenced so that it happens only while this run's lease is
   current. Then it reads the file back and verifies it. The sha256 of its bytes must equal
   the manifest's, it must parse, and its row count, id range, tenant and window must
   match. Arrow digests its rows, first the ids and then every value
   (:func:`format.table_digests`). The step also removes orphan files from the day's
   directory, once per day and run. An orphan has no manifest row and is older than the
   lease TTL by the database's clock. The sweep skips a day while another run holds a lease
   over it (:func:`storage.sweep_orphans`).
3. **record** runs in batch transaction 2, guarded by the lease. It hashes the file once
   more, to be sure these are still the bytes that verified. Then, under a savepoint of
   this transaction, it marks the manifest ``VERIFIED`` (``verified_at``), conditionally
   with ``WHERE status = 'WRITTEN'``. In the same savepoint it deletes the source rows of
   the chunk's tenant, id range and window, by the predicate they were copied by
   (``format.ARCHIVE_ROWS``). PostgreSQL digests the deleted rows from its own values
   (``format.DELETE_DIGESTED``, ``DELETE … RETURNING``). They must be exactly the file's
   rows (count, ids, every value). Otherwise the savepoint is rolled back, nothing is
   deleted, and the manifest is marked ``FAILED`` instead. The run then stops with error
   code ``archive_verification_failed``. Each of the two digests is computed on its own
   side.

The runner pipelines the batches (``ExternalPhase(pipelined=True)``,
``qo_ops/platform/run/pipeline.py``): a batch's external and record steps run on a second
thread and connection while the next batch's select runs, so the delete of one batch and
the COPY of the next use two server processes at once. The select's position (the last day
and id it took) is where the next select starts, and the last pass from the start waits for
the batch in flight. A select that is never followed by its files (a stop, an error) left
S0 and, at most, a retired manifest's file for the orphan sweep.

The states of one chunk, and where a crash (SIGKILL) anywhere leaves it::

    S0 source rows, no file, no manifest          crash before the rename: at most a .tmp file
    S1 source rows + complete file, no manifest    orphan file: swept by a later run, never counted
    S2 source rows + file + manifest WRITTEN       a rerun adopts it (same chunk) or retires it
    S3 manifest VERIFIED, source rows deleted      only reachable from S2 in ONE transaction
    SF source rows + file + manifest FAILED        verification failed; file kept as evidence

A record is therefore always in exactly one of two places. It is either in the source table
or in the file of a VERIFIED manifest (S3).

- It is never in neither. Rows are deleted only in the transaction that makes the manifest
  VERIFIED. That transaction keeps the delete only when the deleted rows equal, value for
  value, a file whose bytes match the manifest's checksum.
- It is never in both. The same transaction deletes the rows, and a second archive of the
  same rows could only be VERIFIED if those rows were still in the source.

WRITTEN and FAILED manifests never count as archived.

``restore`` (``qo-ops archive restore``) takes S3 back to S2 in one transaction. It inserts
the rows of every VERIFIED archive of the tenant-day with their ids (``ON CONFLICT (id) DO
NOTHING``), and turns the manifests back to WRITTEN, so nothing is counted twice. A later
archive run re-verifies and adopts those files.

The job keeps no checkpoint. Deleting a record removes it from the selection, so a rerun's
selection is exactly what is left. Within a run, each batch selects after the previous
batch's last (day, id). This is the runner's in-memory position, so the index scan does not
walk the entries of every record the run has already deleted. The runner makes one last pass
from the start for records that another run held. A FAILED chunk stays selectable. That is
why a run stops at the first verification failure instead of retrying the same rows in a
loop.

**Concurrency.** The lease allows one run per (job, scope). Runs of *overlapping* scopes,
such as a day and a range containing it, take disjoint rows through ``SKIP LOCKED``. Every
destructive step re-checks under row locks and conditional updates. So the worst an overlap
can do is leave a manifest FAILED or retired. It never loses or double-counts a record.

**Test-only fault injection** works like the runner's. With ``QO_OPS_CRASH_AT`` set to one
of ``ARCHIVE_CRASH_POINTS``, the process kills itself with SIGKILL at that point:

- ``archive_before_file_rename`` (S0): the .tmp file is written and fsync'd, not renamed.
- ``archive_after_file_written`` (S1): the file is renamed into place, with no manifest.
- ``archive_after_manifest_written`` (S2): WRITTEN is committed, not verified.
- ``archive_before_delete_commit`` (S2): the delete and VERIFIED are issued, not committed.
- ``archive_after_delete_commit`` (S3): committed. It fires as the next batch's files start.

The runner's own ``after_external_call`` is the point "verified, nothing deleted yet" (S2).
Its points before that (``after_batch_select``, ``before_commit``, ``after_commit``) leave
S0. SF is reached by a failed verification, not by a crash, because a crash before its
commit leaves S2. The tests plant one.

The package has one purpose per module:

- ``settings``: the retention and the archive directory, checked before a run writes
  anything.
- ``errors``.
- ``format``: COPY out of PostgreSQL, Parquet in and out, the rows' digest on both sides.
- ``storage``: paths, fsync'd writes, the orphan sweep.
- ``batch``: what one batch carries between its phases.
- ``steps``: the runner's eligible, transition, external and record steps.
- ``checks``: outcome checks, report, lag.
- ``restore``.

``SPEC`` below declares the job from them.
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
    claim_chunks,
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
    then=ExternalPhase(call=write_and_verify, record=delete_verified, pipelined=True),
    check=check_archive,
    checks=(ACCOUNTS_FOR_EVERY_RECORD, ARCHIVES_VERIFY),
    defaults=Limits(batch_size=MAX_ROWS_PER_FILE),
    destructive=True,
    validate_settings=archive_settings,  # the retention and a writable archive directory
    batching=Batching(
        locks=SkipLocked(of=audit_record), positions=Positions(), claims=claim_chunks
    ),
    presentation=Presentation(
        outcome_asset="audit_records",
        change="archived to a verified Parquet file, then deleted",
        healthy="No audit record past retention left in the source, and every VERIFIED archive still matches its checksum.",
    ),
    deployment=Deployment(
        cron_schedule="15 3 * * *",
        # A chunk of records is held in memory as Arrow, and a run worker adds Dagster.
        # Figures in bench/TUNING.md.
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
