"""The exporter's histograms: declared once (help, label, buckets), observed in groups as the
run-record queries sum them (a count, a sum and how many were at most each bound), and
served with every declared series from the first scrape, at zero until runs come."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import HistogramMetricFamily, Metric

from qo_ops.platform.job.options import TRIGGERS
from qo_ops.platform.job.statuses import FINAL

DURATION_BUCKETS = (0.1, 0.5, 1, 5, 15, 60, 300, 900, 1800, 3600, 7200)
DRIFT_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600)
LOCK_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5)


@dataclass(frozen=True)
class HistogramSpec:
    """One histogram family: its help text, its bucket bounds, and its label besides
    job_name with every value the code declares for it (``None``: job_name only)."""

    text: str
    bounds: tuple[float, ...]
    label: tuple[str, tuple[str, ...]] | None = None


HISTOGRAMS: dict[str, HistogramSpec] = {
    "job_duration_seconds": HistogramSpec("Run duration", DURATION_BUCKETS, ("status", FINAL)),
    "job_scheduler_drift_seconds": HistogramSpec(
        "How late a scheduled run started after its tick", DRIFT_BUCKETS
    ),
    "job_start_delay_seconds": HistogramSpec(
        "From when a run was asked for (its Dagster run's creation, the API's acceptance, "
        "its tick) to when the runner started it",
        DRIFT_BUCKETS,
        ("trigger", TRIGGERS),
    ),
    "job_lock_wait_seconds": HistogramSpec(
        "How long taking (or being refused) the scope's lease took", LOCK_WAIT_BUCKETS
    ),
}


def bucket_counts(column: str, bounds: tuple[float, ...], scale: float = 1) -> str:
    """SQL for a group's cumulative bucket counts, the elements of an ``ARRAY[...]``: how
    many ``column`` values are at most each bound (times ``scale``, the column's unit)."""
    return ", ".join(f"count(*) FILTER (WHERE {column} <= {b * scale})" for b in bounds)


@dataclass(frozen=True)
class Observed:
    """A group of histogram observations as the queries return them."""

    n: int
    seconds: float
    buckets: list[int]


@dataclass
class Histograms:
    """Each series' cumulative bucket counts (the last is +Inf) and sum, keyed by
    (metric, job, *label values)."""

    counts: dict[tuple[str, ...], list[float]] = field(default_factory=dict)
    sums: dict[tuple[str, ...], float] = field(default_factory=lambda: defaultdict(float))

    def observe(self, metric: str, labels: tuple[str, ...], g: Any) -> None:
        """Add a group of observations: ``n`` of them, their sum ``seconds``, and ``buckets``
        (how many were at most each bound, cumulative; +Inf is ``n``)."""
        key = (metric, *labels)
        buckets = self.counts.setdefault(key, [0.0] * (len(g.buckets) + 1))
        for i, count in enumerate(g.buckets):
            buckets[i] += count
        buckets[-1] += int(g.n)
        self.sums[key] += float(g.seconds or 0.0)

    def families(self, jobs: Sequence[str]) -> Iterator[Metric]:
        """Every declared histogram, each with a series per job and declared label value."""
        for metric, spec in HISTOGRAMS.items():
            yield self._family(metric, spec, jobs)

    def _family(self, metric: str, spec: HistogramSpec, jobs: Sequence[str]) -> Metric:
        labels, values = spec.label if spec.label is not None else (None, ("",))
        family = HistogramMetricFamily(
            metric, spec.text, labels=["job_name"] if labels is None else ["job_name", labels]
        )
        names = [*(str(float(b)) for b in spec.bounds), "+Inf"]
        for job in jobs:
            for value in values:
                key = (job,) if labels is None else (job, value)
                counts = self.counts.get((metric, *key), [0.0] * (len(spec.bounds) + 1))
                family.add_metric(
                    list(key),
                    list(zip(names, counts, strict=True)),
                    self.sums.get((metric, *key), 0.0),
                )
        return family
