"""Where archive files live and how they get there.

The module covers paths under ``QO_OPS_HOME``, durable writes (temp name, fsync, rename,
fsync the directory), checksums, and the sweep of the orphan files a crash can leave.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from datetime import date
from pathlib import Path

import sqlalchemy as sa

from qo_ops.config import load_settings
from qo_ops.jobs.audit_archive.batch import Chunk, Work
from qo_ops.jobs.audit_archive.settings import ARCHIVE_DIR
from qo_ops.platform.run.faults import crash_point


def archive_home() -> Path:
    """Return ``QO_OPS_HOME``. Manifests store file paths relative to it."""
    return load_settings().home


def relative_path(tenant_id: str, day: date, manifest_id: uuid.UUID) -> str:
    """Return where a chunk's file lives, relative to ``QO_OPS_HOME``."""
    return f"{ARCHIVE_DIR}/{tenant_id}/{day.isoformat()}/{manifest_id}.parquet"


def resolve_path(file_path: str) -> Path:
    """Return the file of a manifest. Relative paths are under ``QO_OPS_HOME``."""
    path = Path(file_path)
    return path if path.is_absolute() else archive_home() / path


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    """Durably put ``data`` at ``path`` by temp name, fsync, rename, and fsync of the directory."""
    created = [p for p in (path.parent.parent, path.parent) if not p.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    crash_point("archive_before_file_rename")  # test-only, S0: a .tmp file and nothing else
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    for directory in created:  # new directory entries are durable too
        _fsync_dir(directory.parent)


def sha256_of(path: Path) -> str:
    """Return the sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sha256_or_none(path: Path) -> str | None:
    """Return the sha256 of a file's bytes, or None when it cannot be read (gone, say)."""
    try:
        return sha256_of(path)
    except OSError:
        return None


# ------------------------------------------------------------------------ the orphan sweep

# How the sweep judges a day's directory. It reads the database's clock (never this
# process's), and whether another run holds a live lease of this job over the day.
_SWEEP_STATE = sa.text(
    """
    SELECT extract(epoch FROM clock_timestamp())::float8 AS now,
           EXISTS (SELECT 1 FROM job_lease l JOIN job_run r ON r.id = l.job_run_id
                    WHERE l.job_name = :job AND l.expires_at > clock_timestamp()
                      AND l.job_run_id <> :run AND split_part(l.scope, '/', 1) = :tenant
                      AND r.window_start <= :day AND r.window_end > :day) AS busy
    """
)

# Which of the candidate files' names are manifest ids. Those files are not orphans.
_KNOWN_MANIFESTS = sa.text(
    "SELECT id FROM audit_archive_manifest WHERE id = ANY(CAST(:ids AS uuid[]))"
)


def sweep_orphans(work: Work, chunk: Chunk) -> int:
    """Remove temp files and files without a manifest row from the chunk's day directory.

    Only files older than the lease TTL by the database's clock go. None go while another
    run holds a lease over that day, because its newest file may not have its manifest yet.

    No decision here reads this process's clock. A host whose clock runs ahead would take a
    file another run has just written for an old one. Even so, a file swept before its
    manifest is committed makes that manifest fail verification, so nothing leaves the
    source.
    """
    directory = resolve_path(chunk.file_path).parent
    if not directory.is_dir():
        return 0
    seen: list[tuple[Path, float]] = []
    for entry in directory.iterdir():
        if not (entry.name.endswith(".tmp") or entry.suffix == ".parquet"):
            continue  # not ours: leave it
        try:
            if entry.is_file():
                seen.append((entry, entry.stat().st_mtime))
        except FileNotFoundError:
            continue
    if not seen:
        return 0
    with work.engine.connect() as conn:
        state = conn.execute(
            _SWEEP_STATE,
            {"job": work.job_name, "run": work.job_run_id, "tenant": chunk.tenant_id,
             "day": chunk.day},
        ).one()  # fmt: skip
    if state.busy:
        return 0
    horizon = state.now - work.min_file_age_s
    candidates: dict[str, Path] = {}
    removed = 0
    for entry, mtime in seen:
        if mtime > horizon:
            continue
        if entry.name.endswith(".tmp"):
            entry.unlink(missing_ok=True)
            removed += 1
            continue
        try:
            candidates[str(uuid.UUID(entry.stem))] = entry
        except ValueError:
            continue  # not ours: leave it
    if candidates:
        with work.engine.connect() as conn:
            known = {
                str(i) for i in conn.execute(_KNOWN_MANIFESTS, {"ids": list(candidates)}).scalars()
            }
        for key, path in candidates.items():
            if key not in known:
                path.unlink(missing_ok=True)
                removed += 1
    return removed
