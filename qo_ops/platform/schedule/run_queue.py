"""Dagster's run queue as the platform sees it.

For each catalog job, ``job_run_queue`` holds how many runs wait in the queue and since
when. Dagster's ``run_queue_sensor`` samples these from the instance's run storage. The
exporter serves them as ``job_run_queue_depth`` and ``job_run_queue_oldest_seconds``. This
module does not use Dagster, because the sensor hands over plain figures."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.engine import Connection


@dataclass(frozen=True)
class QueueSample:
    """One job's queued runs at a sample: how many there are, and when the oldest was
    created."""

    depth: int
    oldest_queued_at: datetime | None


# Keep one current row per job. The latest sample replaces the one before.
# Twice: the same sample written again leaves the same row. Only sampled_at moves on.
_UPSERT = sa.text(
    """
    INSERT INTO job_run_queue (job_name, depth, oldest_queued_at, sampled_at)
    VALUES (:job, :depth, :oldest, clock_timestamp())
    ON CONFLICT (job_name) DO UPDATE
       SET depth = EXCLUDED.depth, oldest_queued_at = EXCLUDED.oldest_queued_at,
           sampled_at = EXCLUDED.sampled_at
    """
)
_READ = sa.text(
    """
    SELECT job_name, depth,
           extract(epoch FROM clock_timestamp() - oldest_queued_at) AS oldest_s,
           extract(epoch FROM clock_timestamp() - sampled_at) AS sample_age_s
      FROM job_run_queue
    """
)


def record_run_queue(
    conn: Connection, job_names: Iterable[str], samples: Mapping[str, QueueSample]
) -> None:
    """Write the sample of every job in ``job_names``.

    A job absent from ``samples`` has an empty queue. So the table always holds one current
    row per catalog job."""
    empty = QueueSample(0, None)
    conn.execute(
        _UPSERT,
        [
            {"job": job, "depth": s.depth, "oldest": s.oldest_queued_at}
            for job in job_names
            for s in [samples.get(job, empty)]
        ],
    )


@dataclass(frozen=True)
class QueueReading:
    """A job's queue as last sampled.

    It holds the depth, the oldest queued run's age now (0 when the queue is empty), and the
    sample's own age."""

    depth: int
    oldest_s: float
    sample_age_s: float


def read_run_queue(conn: Connection) -> dict[str, QueueReading]:
    """The last sample of each job, with ages on the database's clock."""
    return {
        row.job_name: QueueReading(
            int(row.depth), max(0.0, float(row.oldest_s or 0)), max(0.0, float(row.sample_age_s))
        )
        for row in conn.execute(_READ)
    }
