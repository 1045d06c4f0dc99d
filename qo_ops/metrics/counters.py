"""The exporter's counter families, read from the run feed. Every series the code declares
(the catalog's jobs with each value signals.py, the run statuses and the job's spec name) is
served from the first scrape, at zero until runs count some, so that ``rate()`` and
``increase()`` see it start; a value counted but not declared shows as ``other``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TypeVar

from prometheus_client.core import CounterMetricFamily, Metric

from qo_ops.downstream.calls import call_settings
from qo_ops.metrics.feed import ITEM_SUMS, RunFeed
from qo_ops.platform.calls import call_stats
from qo_ops.platform.job.labels import (
    AMBIGUITY_REASONS,
    CHECKPOINT_RESET_REASONS,
    ITEM_RETRY_REASONS,
    LOCK_RESULTS,
    MANUAL_RERUN_REASONS,
    RUN_RETRY_REASONS,
)
from qo_ops.platform.job.outcome import SIDE_EFFECT_RESULTS
from qo_ops.platform.job.statuses import FINAL
from qo_ops.platform.schedule.missed import MISSED_REASONS

DOWNSTREAM_FAMILIES = {  # metric → (help, its label besides job_name, the label's values)
    "job_downstream_calls_total": ("Calls sent to the downstream", None, ("",)),
    "job_downstream_retries_total": (
        "Calls sent for items that had failed before (retry pressure: retries / calls)",
        None,
        ("",),
    ),
    "job_downstream_not_sent_total": (
        "Calls not sent: the circuit breaker was open, or the run's retry budget was used up",
        "reason",
        ("breaker_open", "retry_budget"),
    ),
    "job_downstream_rate_limit_pauses_total": (
        "429 answers with Retry-After: each paused the run's calls",
        None,
        ("",),
    ),
    "job_downstream_rate_limit_wait_seconds_total": (
        "Time calls waited for the rate limit or a Retry-After, summed over workers",
        None,
        ("",),
    ),
    "job_downstream_spared_total": (
        "Items whose failed attempt was given back: the breaker judged the failure systemic",
        None,
        ("",),
    ),
    "job_downstream_held_total": (
        "Items kept at their last attempt: a systemic failure while the downstream was not "
        "known to be up (too few recent calls, or failing); tried again at their backoff",
        None,
        ("",),
    ),
    "job_breaker_transitions_total": (
        "Circuit breaker transitions made by the job's runs, by the state moved to",
        "to",
        call_stats.BREAKER_STATES,
    ),
}


def counter_families(feed: RunFeed) -> Iterator[Metric]:
    """Every counter family, from what ``feed`` has counted so far."""
    # the jobs whose runs call the downstream (their counters exist from the first scrape)
    calling = [s.name for s in feed.specs if s.validate_settings is call_settings]
    yield from _run_families(feed)
    yield from _downstream_families(feed, calling)
    yield from _signal_families(feed, calling)
    yield from _reconciliation_families(feed)


Key = TypeVar("Key", bound=tuple[str, ...])


def _declared(
    metric: str, text: str, labels: list[str], series: Iterable[Key], counts: Mapping[Key, float]
) -> Metric:
    """A counter family with a series for each declared (job, *label values) in ``series``:
    its count so far, else 0."""
    family = CounterMetricFamily(metric, text, labels=["job_name", *labels])
    for key in series:
        family.add_metric(list(key), counts.get(key, 0))
    return family


def _run_families(feed: RunFeed) -> Iterator[Metric]:
    """The runs started, finished and failed, the per-job sums, missed runs, side effects."""
    names = [s.name for s in feed.specs]
    started = CounterMetricFamily("job_started_total", "Runs started", labels=["job_name"])
    for job in names:
        started.add_metric([job], feed.started.get(job, 0))
    yield started
    yield _declared(
        "job_completed_total",
        "Runs finished, by status",
        ["status"],
        [(job, st) for job in names for st in FINAL],
        feed.completed,
    )
    yield _declared(
        "job_failed_total",
        "Runs failed or timed out, by error class",
        ["error_class"],
        [(job, ec) for job in names for ec in feed.error_classes[job]],
        feed.failed,
    )
    per_job = {
        **{m: t for m, (_, t) in ITEM_SUMS.items()},
        "job_skipped_total": "Runs skipped (lease held elsewhere)",
        "job_lock_acquire_failed_total": "Lease acquisitions refused",
        "job_lease_lost_total": "Runs that lost their lease to another holder",
        "job_anomaly_stops_total": "Runs stopped by an anomaly threshold",
        "job_checkpoint_updates_total": "Checkpoints saved (one per batch of a cursor job)",
    }
    for metric, text in per_job.items():
        family = CounterMetricFamily(metric, text, labels=["job_name"])
        source = "job_skipped_total" if metric == "job_lock_acquire_failed_total" else metric
        for job in names:
            family.add_metric([job], feed.sums.get((source, job), 0))
        yield family
    yield _declared(
        "job_missed_runs_total",
        "Scheduled runs (one per tenant and tick) that did not start in their window",
        ["reason"],
        [(job, reason) for job in names for reason in MISSED_REASONS],
        feed.missed,
    )
    effects = CounterMetricFamily(
        "job_side_effects_total",
        "Attempts at a side effect, by result",
        labels=["job_name", "side_effect", "result"],
    )
    for spec in feed.specs:
        for name in spec.signals.side_effects:
            for result in SIDE_EFFECT_RESULTS:
                effects.add_metric(
                    [spec.name, name, result],
                    feed.side_effects.get((spec.name, name, result), 0),
                )
    for (job, name, result), n in sorted(feed.side_effects.items()):
        if name == "other" or result == "other":
            effects.add_metric([job, name, result], n)
    yield effects
    ambiguity = CounterMetricFamily(
        "job_side_effect_ambiguity_total",
        "Side effects whose outcome is unknown, by reason (they need reconciliation)",
        labels=["job_name", "reason"],
    )
    for spec in feed.specs:
        if spec.signals.side_effects:
            for reason in AMBIGUITY_REASONS:
                ambiguity.add_metric(
                    [spec.name, reason], feed.ambiguity.get((spec.name, reason), 0)
                )
    yield ambiguity


def _series(names: list[str], calling: list[str]) -> dict[str, list[tuple[str, ...]]]:
    """Metric → the (job, *label values) of every series it serves: each catalog job
    with every value the code declares (signals.py, the job's spec)."""
    return {
        "job_lock_acquire_total": [(j, r) for j in names for r in LOCK_RESULTS],
        "job_overlap_detected_total": [(j,) for j in names],
        "job_retries_total": [
            *((j, "item", r) for j in calling for r in ITEM_RETRY_REASONS),
            *((j, "run", r) for j in names for r in RUN_RETRY_REASONS),
        ],
        "job_retry_exhausted_total": [
            *((j, "item") for j in calling),
            *((j, "run") for j in names),
        ],
        "job_manual_reruns_total": [
            (j, r) for j in names for r in dict.fromkeys(MANUAL_RERUN_REASONS.values())
        ],
        "job_checkpoint_resets_total": [(j, r) for j in names for r in CHECKPOINT_RESET_REASONS],
    }


def _signal_families(feed: RunFeed, calling: list[str]) -> Iterator[Metric]:
    """The seed's lock, retry and rerun counters."""
    texts = {
        "job_lock_acquire_total": (
            "Execute runs' lease acquisitions, by result",
            ["result"],
        ),
        "job_overlap_detected_total": (
            "Runs that found another holder had taken their lease while they ran "
            "(two at once; fencing kept the old one from writing)",
            [],
        ),
        "job_retries_total": (
            "Retries, by scope (item: a retry scheduled; run: Dagster re-ran a run "
            "whose worker died) and reason",
            ["scope", "reason"],
        ),
        "job_retry_exhausted_total": (
            "Retries given up, by scope (item: dead-lettered after its last attempt; "
            "run: a run retry that failed again with none left)",
            ["scope"],
        ),
        "job_manual_reruns_total": (
            "Execute runs a person asked for over a scope run before, by how the "
            "previous execute run ended",
            ["reason"],
        ),
        "job_checkpoint_resets_total": (
            "Checkpoints forgotten, by reason (rescan_complete: a rescanning job went through "
            "its whole scope; operator: a person reset it)",
            ["reason"],
        ),
    }
    names = [s.name for s in feed.specs]
    for metric, series in _series(names, calling).items():
        text, labels = texts[metric]
        family = CounterMetricFamily(metric, text, labels=["job_name", *labels])
        for key in series:
            if metric == "job_overlap_detected_total":
                n = float(feed.sums.get(("job_lease_lost_total", key[0]), 0))
            else:
                n = feed.signals.get((metric, *key), 0.0)
            family.add_metric(list(key), n)
        yield family


def _reconciliation_families(feed: RunFeed) -> Iterator[Metric]:
    """The seed's reconciliation family, for the jobs that declare a reconciliation."""
    yield _declared(
        "reconciliation_runs_total",
        "Reconciliation runs, by status",
        ["status"],
        [(s.name, st) for s in feed.specs if s.signals.reconciliation is not None for st in FINAL],
        feed.completed,
    )
    scanned = CounterMetricFamily(
        "reconciliation_items_scanned_total",
        "Items a reconciliation compared with the other system",
        labels=["job_name"],
    )
    families = {
        "reconciliation_mismatches_total": CounterMetricFamily(
            "reconciliation_mismatches_total",
            "Mismatches found (dry-run and execute), by type",
            labels=["job_name", "mismatch_type"],
        ),
        "reconciliation_corrections_total": CounterMetricFamily(
            "reconciliation_corrections_total",
            "Repairs attempted in execute, by result",
            labels=["job_name", "result"],
        ),
        "reconciliation_unresolved_total": CounterMetricFamily(
            "reconciliation_unresolved_total",
            "Mismatches left to a person, by reason",
            labels=["job_name", "reason"],
        ),
    }
    for spec in feed.specs:
        recon = spec.signals.reconciliation
        if recon is None:
            continue
        job = spec.name
        scanned.add_metric([job], feed.sums.get(("job_items_processed_total", job), 0))
        for metric, values in (
            ("reconciliation_mismatches_total", recon.mismatch_types),
            ("reconciliation_corrections_total", recon.correction_results),
            ("reconciliation_unresolved_total", recon.unresolved_reasons),
        ):
            for v in values:
                families[metric].add_metric([job, v], feed.signals.get((metric, job, v), 0.0))
    yield scanned
    yield from families.values()


def _downstream_families(feed: RunFeed, calling: list[str]) -> Iterator[Metric]:
    """The downstream counters: every series of a job that calls the downstream from the
    first scrape, another catalog job's once its runs counted some."""
    seen = {job for (_, job, _) in feed.downstream}
    jobs = [s.name for s in feed.specs if s.name in calling or s.name in seen]
    for metric, (text, label, values) in DOWNSTREAM_FAMILIES.items():
        family = CounterMetricFamily(
            metric, text, labels=["job_name"] if label is None else ["job_name", label]
        )
        for job in jobs:
            for value in values:
                n = feed.downstream.get((metric, job, value), 0.0)
                family.add_metric([job] if label is None else [job, value], n)
        yield family
