"""What one batch carries from phase to phase, and what the run keeps between its batches.

A batch carries the chunks the selection cut, the work it hands the file phase, and each
file's verdict for the delete. The run keeps ``ArchiveRun`` between its batches.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import TYPE_CHECKING

from sqlalchemy.engine import Engine

if TYPE_CHECKING:  # pyarrow is loaded where tables are made, never on import
    import pyarrow as pa


@dataclass
class Chunk:
    """One file's worth of records, every eligible one of (tenant, day) with an id in [min, max]."""

    manifest_id: uuid.UUID
    tenant_id: str
    day: date
    window_start: datetime
    window_end: datetime
    file_path: str
    row_count: int
    min_id: int
    max_id: int
    table: pa.Table | None  # the records, or None when adopting an existing WRITTEN manifest
    sha256: str | None = None  # known up front only when adopting
    retired: list[str] = field(default_factory=list)  # files of retired manifests
    adopted: bool = False  # a WRITTEN manifest of an earlier run, to be verified again


@dataclass
class Work:
    """What the selection hands the file phase."""

    engine: Engine
    job_name: str
    scope_key: str
    job_run_id: uuid.UUID
    fencing_token: int | None
    min_file_age_s: float
    chunks: list[Chunk]


@dataclass
class FileResult:
    """A chunk after the file phase, verified against its manifest or with the reason it is not."""

    chunk: Chunk
    ok: bool
    reason: str | None = None
    digests: tuple[str, str] | None = None  # table_digests() of the file's rows
    orphans_removed: int = 0


@dataclass
class ArchiveRun:
    """What an archive run keeps between its batches (``ctx.run_state(ArchiveRun)``)."""

    baseline: int | None = None  # the window's records at the first batch (for the check)
    failure: str | None = None  # why a file failed verification (the next batch stops the run)
    deleted: bool = False  # the last batch deleted rows, for a crash point at the next files
    swept_days: set[date] = field(default_factory=set)  # days whose orphans this run swept
