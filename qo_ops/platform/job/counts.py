"""A run's counters, named once: how many items it processed and how each one ended.

A batch's :class:`Counts` add into its run's with ``+=``. A counter has one name, its
field's. The report's rows use that name as it is. The run's events use ``items.<name>``,
except ``retry.scheduled``, which is the seed's name. The job_run row uses ``<name>_count``,
because the columns predate this rule and renaming them needs a migration. All three are
derived here, so a counter added to :class:`Counts` reaches the record, the events and the
report at once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Self


@dataclass
class Counts:
    """How many items were processed, and how they ended."""

    processed: int = 0  # items selected (the runner counts them, or a Batching.claims statement)
    succeeded: int = 0  # changed as the job means to (presentation.change says how)
    failed: int = 0
    skipped: int = 0  # left as they were (already right, or not this run's to change)
    retry_scheduled: int = 0  # failed for now, and tried again later
    deadlettered: int = 0  # failed for good, out of attempts
    duplicates_prevented: int = 0  # a side effect not repeated, because it was done before

    def __iadd__(self, other: Counts) -> Self:
        for name in COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self

    def columns(self) -> dict[str, int]:
        """The counters as the job_run row (and so the run summary's JSON) names them,
        ``processed_count`` … ``duplicates_prevented_count``."""
        return {COLUMNS[name]: getattr(self, name) for name in COUNTERS}

    def event_fields(self, names: tuple[str, ...] | None = None) -> dict[str, int]:
        """The counters ``names`` (by default all) as the run's events name them
        (``items.processed`` …, ``retry.scheduled``, ``items.duplicates_prevented``)."""
        return {EVENT_FIELDS[name]: getattr(self, name) for name in names or COUNTERS}

    def report_items(self) -> dict[str, int]:
        """The report's ``items`` rows, by counter name. Processed, succeeded, failed and
        skipped are always there. Retries, dead letters and duplicates prevented appear when
        there are any."""
        return {
            name: getattr(self, name)
            for name in COUNTERS
            if name in REPORTED_ALWAYS or getattr(self, name)
        }


def mutated_count(mode: str, succeeded: int) -> int:
    """The seed's ``mutated_count``, the items whose state the run changed as the job means
    to (its ``succeeded`` counter). It is 0 for a dry run, which changes nothing whatever it
    counted."""
    return succeeded if mode == "execute" else 0


COUNTERS: tuple[str, ...] = tuple(f.name for f in fields(Counts))
COLUMNS = {name: f"{name}_count" for name in COUNTERS}
# The one event field the seed names otherwise than items.<counter> (its job.finished example).
SEED_EVENT_FIELDS = {"retry_scheduled": "retry.scheduled"}
EVENT_FIELDS = {name: SEED_EVENT_FIELDS.get(name, f"items.{name}") for name in COUNTERS}
REPORTED_ALWAYS = ("processed", "succeeded", "failed", "skipped")
PROGRESS = ("processed", "succeeded", "failed")  # the counters job.progress carries
SPAN = ("processed", "failed")  # the counters the run's and each batch's span carry
