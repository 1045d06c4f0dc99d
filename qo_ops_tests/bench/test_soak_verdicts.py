"""The soak's verdicts (bench/section_soak.py) fail on what they must: a queue above the
coalescing bound, a scope with two runs at once, and an alert nothing explains (daemon_down
with a healthy daemon, the exporter down, the breaker before any outage). The smoke test
runs the soak itself on a real deployment; here its judgement alone, on planted figures, and
its one-line refusal on a machine without Prometheus."""

from __future__ import annotations

import pytest

from bench.section_soak import Facts, Timeline, combined, figures, judge, run
from bench.suite import PROFILES

QUICK = PROFILES["quick"]  # 3 tenants, 1 a run: a bound of 11 jobs x 3 chunks = 33
OUTAGE = (50.0, 100.0)


def _facts(**kw) -> Facts:
    base = dict(
        outage_start=OUTAGE[0],
        failed_jobs=frozenset(),
        anomaly_jobs=frozenset(),
        takeover_jobs=frozenset(),
        downstream_jobs=frozenset({"delivery_retry", "notification_publish"}),
        deadletter_jobs=frozenset({"delivery_retry"}),
        item_failure_jobs=frozenset({"delivery_retry"}),
        retry_jobs=frozenset({"delivery_retry"}),
        mismatch_jobs=frozenset(),
        oldest_queued_s={"quote_expiration": 40.0},
        drift_p90_s={"quote_expiration": 30.0},
    )
    base.update(kw)
    return Facts(**base)


def _sample(t: float, queued: int, doubled: list[str] | None = None) -> dict:
    return {
        "t": t,
        "queued": queued,
        "running": 2,
        "queued_by_job": {"quote_expiration": queued},
        "oldest_s": 10.0,
        "oldest_by_job": {"quote_expiration": 10.0},
        "doubled": doubled or [],
    }


def _section(samples: list[dict], alerts: dict | None = None, facts: Facts | None = None):
    timeline = Timeline(started=0.0, outage=OUTAGE, samples=samples, alerts=alerts or {})
    started = [
        {"job": "quote_expiration", "asked_in": "before", "t": 5.0, "phase": "before",
         "delay_s": 4.0, "by": "schedule"},
    ]  # fmt: skip
    missed = {"daemon_down": 0.0, "queued": 3.0}
    return figures(QUICK, timeline, started, missed, facts or _facts(), 11, 11, "")


def _met(section, what: str) -> bool | None:
    [row] = [r for r in section.rows if r.what.startswith(what)]
    return row.met


def test_a_bounded_queue_with_no_scope_twice_passes_and_either_breach_fails():
    calm = [_sample(t, 20) for t in (0, 60, 120)]
    assert _met(_section(calm), "Run queue") is True
    over = [_sample(0, 20), _sample(60, 34), _sample(120, 5)]  # one above 11 x 3
    assert _met(_section(over), "Run queue") is False
    twice = [_sample(0, 5), _sample(60, 5, ["quote_expiration/tenant-001"]), _sample(120, 5)]
    section = _section(twice)
    assert _met(section, "Run queue") is False
    assert any("quote_expiration/tenant-001" in n for n in section.notes)


def test_only_explained_alerts_pass():
    f = _facts()
    assert judge("QoOpsJobMissedRuns", {"job_name": "x", "reason": "daemon_down"}, 10, f) is None
    queued = {"job_name": "quote_expiration", "reason": "queued"}
    assert judge("QoOpsJobMissedRuns", queued, 10, f) is not None
    assert judge("QoOpsJobMissedRuns", {**queued, "job_name": "audit_archive"}, 10, f) is None
    assert judge("QoOpsExporterDown", {"problem": "scrape_failed"}, 10, f) is None
    breaker = {"downstream": "http://127.0.0.1:1"}
    assert judge("QoOpsDownstreamBreakerOpen", breaker, OUTAGE[0] - 1, f) is None
    assert judge("QoOpsDownstreamBreakerOpen", breaker, OUTAGE[0] + 1, f) is not None
    retry = {"job_name": "delivery_retry"}
    # notification_publish: no retry in its runs, so only the outage explains its pressure
    publish = {"job_name": "notification_publish"}
    assert judge("QoOpsJobRetryPressureHigh", publish, OUTAGE[0] - 1, f) is None
    assert judge("QoOpsJobRetryPressureHigh", publish, OUTAGE[0] + 1, f) is not None
    assert judge("QoOpsJobRetryPressureHigh", retry, 1, f) is not None  # its runs retried
    assert judge("QoOpsJobRetryPressureHigh", {"job_name": "quote_expiration"}, 99, f) is None
    assert judge("QoOpsJobPartialFailureRateHigh", retry, 1, f) is not None
    assert judge("QoOpsJobPartialFailureRateHigh", {"job_name": "audit_archive"}, 99, f) is None
    # the outage explains only the jobs whose runs called the downstream
    assert judge("QoOpsJobNotSucceeding", publish, OUTAGE[0] + 1, f) is not None
    assert judge("QoOpsJobNotSucceeding", {"job_name": "audit_archive"}, OUTAGE[0] + 1, f) is None
    growing = {"job_name": "audit_archive"}  # nothing of it queued, not a downstream job
    assert judge("QoOpsJobBacklogGrowing", growing, 99, f) is None
    assert judge("QoOpsJobBacklogGrowing", {"job_name": "quote_expiration"}, 1, f) is not None
    assert judge("QoOpsJobDeadLetters", retry, 1, f) is not None
    assert judge("QoOpsJobDeadLetters", {"job_name": "quote_expiration"}, 1, f) is None
    drift = {"job_name": "quote_expiration"}
    assert judge("QoOpsJobSchedulerDriftHigh", drift, 1, f) is None  # p90 30 s
    late = _facts(drift_p90_s={"quote_expiration": 75.0})
    assert judge("QoOpsJobSchedulerDriftHigh", drift, 1, late) is not None
    # the queue's one alert: right once a run waited longer than its bound (60 s here)
    assert judge("QoOpsRunQueueBacklog", {}, 1, f) is None  # oldest 40 s
    backed_up = _facts(oldest_queued_s={"quote_expiration": 140.0, "audit_archive": 30.0})
    assert "1 jobs" in judge("QoOpsRunQueueBacklog", {}, 1, backed_up)
    # the queue explains no per-job "not succeeding" page (the rule holds it back): wrong,
    # unless the job's own runs failed
    assert judge("QoOpsJobNotSucceeding", drift, 1, backed_up) is None
    failing = _facts(oldest_queued_s={"quote_expiration": 140.0}, failed_jobs={"quote_expiration"})
    assert judge("QoOpsJobNotSucceeding", drift, 1, failing) == "its runs failed"
    assert judge("QoOpsJobSuspendedTooLong", drift, 1, f) is None


def test_one_wrong_alert_fails_the_alert_row_and_is_named():
    calm = [_sample(t, 20) for t in (0, 60, 120)]
    labels = (("alertname", "QoOpsJobMissedRuns"), ("job_name", "x"), ("reason", "daemon_down"))
    alerts = {("QoOpsJobMissedRuns", labels): {"first_t": 30.0, "state": "firing"}}
    section = _section(calm, alerts)
    assert _met(section, "Alerts") is False
    assert any("WRONG" in n and "daemon_down" in n for n in section.notes)
    assert _met(_section(calm), "Alerts") is True


def test_a_start_later_than_the_queue_explains_fails_the_delay_row():
    """Tick-to-start p95 against what the queue explains: the tick's evaluation (p95), every
    other scope's run ahead of it at the slowest phase's start rate, and the launch (p95)."""
    samples = [_sample(t, 20) for t in range(0, 150, 10)]
    per_phase = QUICK.soak_s / 3

    def section(delay_s: float, before_runs: int = 10):
        runs = [
            {"job": "quote_expiration", "asked_in": phase, "t": start + i, "phase": phase,
             "delay_s": delay_s, "created_s": 2.0, "queued_s": delay_s - 5.0, "launch_s": 3.0,
             "by": "schedule"}
            for phase, start in zip(("before", "outage", "after"), (0.0, 50.0, 100.0), strict=True)
            for i in range(before_runs if phase == "before" else 10)
        ]  # fmt: skip
        timeline = Timeline(started=0.0, outage=OUTAGE, samples=samples, alerts={})
        return figures(QUICK, timeline, runs, {}, _facts(), 11, 11, "")

    rate = 10 / (per_phase / 60)  # starts a minute in each phase
    bound = 2.0 + 32 / rate * 60.0 + 3.0  # 32 runs ahead at most (a bound of 11 x 3 = 33)
    assert _met(section(bound - 1), "Tick-to-start") is True
    assert _met(section(bound + 1), "Tick-to-start") is False
    [row] = [r for r in section(bound + 1).rows if r.what.startswith("Tick-to-start")]
    assert "32 runs ahead at most" in row.limit
    # the slowest phase sets the rate: fewer starts before the outage, a longer allowance
    slower = 2.0 + 32 / (5 / (per_phase / 60)) * 60.0 + 3.0
    assert _met(section(slower - 1, before_runs=5), "Tick-to-start") is True
    assert _met(section(slower + 1, before_runs=5), "Tick-to-start") is False


def test_the_runs_combine_into_median_and_range_and_one_wrong_alert_fails_them_all():
    """Three quiet runs and one under load: each figure as median (min–max), met only if
    every run met it; the loaded run's rows beside them."""
    calm = [_sample(t, 20) for t in (0, 60, 120)]
    labels = (("alertname", "QoOpsJobMissedRuns"), ("job_name", "x"), ("reason", "daemon_down"))
    wrong = {("QoOpsJobMissedRuns", labels): {"first_t": 30.0, "state": "firing"}}
    deeper = [_sample(0, 10), _sample(60, 30), _sample(120, 5)]
    runs = [_section(calm), _section(deeper), _section(calm)]
    section = combined(runs, [_section(calm)], 2)
    [queue] = [r for r in section.rows if r.what == "Run queue, deepest (soak, 3 runs)"]
    assert queue.figure == "20 runs (20 runs–30 runs)" and queue.met is True
    assert queue.ratio_range == (20 / 33, 30 / 33)
    assert _met(section, "Alerts pending or firing (soak, 3 runs)") is True
    assert _met(section, "Alerts pending or firing (soak, 2 busy") is True
    planted = combined([_section(calm), _section(calm, wrong), _section(calm)], [], 0)
    [alerts] = [r for r in planted.rows if r.what.startswith("Alerts")]
    assert alerts.met is False and "wrong per run: 0, 1, 0" in alerts.figure
    assert any(n.startswith("Run 2.") and "WRONG" in n for n in planted.notes)


def test_without_prometheus_the_soak_says_so_in_one_line_before_building_anything(
    monkeypatch, tmp_path
):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no prometheus on it
    with pytest.raises(SystemExit) as stopped:
        run(QUICK)
    message = str(stopped.value.code)
    assert "prometheus" in message and "\n" not in message
