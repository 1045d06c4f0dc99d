"""The job's name and settings.

The settings are the retention, with the cutoff it puts on the database's clock, and the
archive directory. They are checked before a run locks or writes anything.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from qo_ops.config import load_settings, whole_number
from qo_ops.jobs.audit_archive.errors import ArchiveConfigError
from qo_ops.platform.job.outcome import BatchContext, run_settings

JOB_NAME = "audit_archive"
RETENTION_ENV = "QO_OPS_AUDIT_RETENTION_DAYS"
DEFAULT_RETENTION_DAYS = 365
MAX_RETENTION_DAYS = 36_500
# One file per batch, at the default batch size. This keeps a batch's row locks brief and
# bounds the memory a batch holds (figures in bench/TUNING.md).
MAX_ROWS_PER_FILE = 4_000
ARCHIVE_DIR = "archive"  # under QO_OPS_HOME


def retention_days(environ: Mapping[str, str] | None = None) -> int:
    """Read the retention in days (``QO_OPS_AUDIT_RETENTION_DAYS``, default 365, 1 to 36,500)."""
    return whole_number(
        RETENTION_ENV, DEFAULT_RETENTION_DAYS, 1, MAX_RETENTION_DAYS,
        unit="days", environ=environ, error=ArchiveConfigError,
    )  # fmt: skip


@dataclass(frozen=True)
class ArchiveSettings:
    """What an archive run works with, checked before it locks or writes anything."""

    retention_days: int
    archive_root: Path  # where the files go, QO_OPS_HOME/archive


def archive_settings(environ: Mapping[str, str] | None = None) -> ArchiveSettings:
    """Read the retention and an archive directory this process can write.

    The process must be able to write the directory, or the nearest directory above it
    that exists. :class:`ArchiveConfigError` names what is wrong.
    """
    env = os.environ if environ is None else environ
    days = retention_days(env)
    root = load_settings(dict(env)).home / ARCHIVE_DIR
    existing = next(p for p in (root, *root.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ArchiveConfigError(
            f"archive files go to {root}, but {existing} is not a writable directory "
            "(check QO_OPS_HOME and its volume)"
        )
    return ArchiveSettings(days, root)


def retention_cutoff(ctx: BatchContext) -> sa.ColumnElement[Any]:
    """Return the cutoff. Records that occurred before it (database clock) are past retention."""
    days = run_settings(ctx, archive_settings).retention_days
    return sa.func.now() - sa.cast(sa.literal(timedelta(days=days)), sa.Interval)  # bound
