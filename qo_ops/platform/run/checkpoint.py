"""A checkpointed job's cursor, one per (job, scope) in ``job_checkpoint``. It says where the
job's next batch, and its next run, start. The runner saves it inside the batch's
transaction, so a batch's work and the cursor past it commit together."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Connection, Engine

from qo_ops.db.schema import job_checkpoint
from qo_ops.errors import one_line

# The scope's cursor. There is no row before its first checkpoint.
_LOAD = sa.select(job_checkpoint.c.cursor).where(
    job_checkpoint.c.job_name == sa.bindparam("job"),
    job_checkpoint.c.scope == sa.bindparam("scope"),
)

# The cursor and how long ago it last moved (seconds), for the run's report.
_SAVED = sa.select(
    job_checkpoint.c.cursor,
    sa.func.extract("epoch", sa.func.clock_timestamp() - job_checkpoint.c.updated_at).label(
        "age_s"
    ),
).where(
    job_checkpoint.c.job_name == sa.bindparam("job"),
    job_checkpoint.c.scope == sa.bindparam("scope"),
)

# A checkpoint row as _SAVE writes it.
# Twice: it never runs alone. _SAVE below is this insert with its conflict rule.
_insert = postgresql.insert(job_checkpoint).values(
    job_name=sa.bindparam("job"),
    scope=sa.bindparam("scope"),
    cursor=sa.bindparam("cursor", type_=job_checkpoint.c.cursor.type),
    job_run_id=sa.bindparam("run_id", type_=job_checkpoint.c.job_run_id.type),
    updated_at=sa.func.clock_timestamp(),
)
# The cursor past this batch, written in the batch's transaction under the lease's guard.
# Twice: one row per (job, scope) holds the latest cursor. Writing the same cursor again
# (a retried batch) leaves the same row, and a rival cannot write while the guard holds.
_SAVE = _insert.on_conflict_do_update(
    index_elements=["job_name", "scope"],
    set_={
        "cursor": _insert.excluded.cursor,
        "job_run_id": _insert.excluded.job_run_id,
        "updated_at": sa.func.clock_timestamp(),
    },
)

# Delete a rescanning job's finished cursor, so its next run starts from the beginning.
# Twice: the second delete finds no row, and the runner counts a reset only when a row went.
_FORGET = sa.delete(job_checkpoint).where(
    job_checkpoint.c.job_name == sa.bindparam("job"),
    job_checkpoint.c.scope == sa.bindparam("scope"),
)


@dataclass(frozen=True)
class Saved:
    """A scope's checkpoint as stored, with the cursor and its age in seconds."""

    cursor: dict[str, Any]
    age_s: float


def load(engine: Engine, job_name: str, scope_key: str) -> dict[str, Any] | None:
    """The cursor the scope's last batch saved, or None when there is no checkpoint yet."""
    with engine.connect() as conn:
        cursor: dict[str, Any] | None = conn.execute(
            _LOAD, {"job": job_name, "scope": scope_key}
        ).scalar()
    return cursor


def saved(conn: Connection, job_name: str, scope_key: str) -> Saved | None:
    """The scope's checkpoint with its age, or None."""
    row = conn.execute(_SAVED, {"job": job_name, "scope": scope_key}).first()
    return None if row is None else Saved(row.cursor, float(row.age_s))


def save(
    conn: Connection, job_name: str, scope_key: str, run_id: uuid.UUID, cursor: dict[str, Any]
) -> None:
    """Save ``cursor`` as the scope's checkpoint (written by run ``run_id``)."""
    conn.execute(_SAVE, {"job": job_name, "scope": scope_key, "cursor": cursor, "run_id": run_id})


def forget(conn: Connection, job_name: str, scope_key: str) -> bool:
    """Delete the scope's checkpoint. Returns whether there was one."""
    return bool(conn.execute(_FORGET, {"job": job_name, "scope": scope_key}).rowcount)


def as_text(cursor: Any) -> str | None:
    """A cursor as short JSON text, for the run summary's ``checkpoint_before``/``_after``."""
    if cursor is None:
        return None
    return one_line(json.dumps(cursor, default=str, sort_keys=True), 200)
