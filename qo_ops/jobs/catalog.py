"""The job catalog declares every operational job once. Dagster jobs, schedules, sensors,
checks, CLI commands, API routes and metrics are derived from this list.

A job is the module ``qo_ops.jobs.<name>`` with its ``SPEC``. ``JOBS`` names the jobs in
their declared order. ``CATALOG`` maps each name to its spec, and imports a job's module when
its spec is first asked for. So a command about one job (``qo-ops run quote_expiration``)
loads that job alone, not the other ten and what they import (an HTTP client, Arrow).
Iterating the catalog loads them all.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from qo_ops.errors import BadInput
from qo_ops.platform.job.spec import JobSpec

JOBS: tuple[str, ...] = (
    "quote_expiration",
    "delivery_retry",
    "notification_publish",
    "order_reconciliation",
    "read_model_repair",
    "pricing_snapshot_recalculation",
    "audit_archive",
    "temp_file_cleanup",
    "catalog_cache_refresh",
    "abandoned_checkout_close",
    "run_history_retention",
)


class Catalog(Mapping[str, JobSpec]):
    """Map each job name to its ``SPEC`` in ``JOBS`` order, importing each module on first use."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self._names = names

    def __getitem__(self, name: str) -> JobSpec:
        if name not in self._names:
            raise KeyError(name)
        spec = importlib.import_module(f"qo_ops.jobs.{name}").SPEC
        if not isinstance(spec, JobSpec) or spec.name != name:
            raise TypeError(f"qo_ops.jobs.{name}.SPEC must be the JobSpec named {name!r}")
        return spec

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names


CATALOG: Mapping[str, JobSpec] = Catalog(JOBS)


def get_spec(name: str) -> JobSpec:
    """Return the spec of job ``name``, or raise a one-line error naming the known jobs."""
    normalized = name.strip().replace("-", "_")
    if normalized not in CATALOG:
        raise BadInput(f"unknown job {name!r}; known jobs: {', '.join(sorted(CATALOG))}")
    return CATALOG[normalized]
