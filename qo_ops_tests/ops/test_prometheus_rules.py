"""The Prometheus alert rules (``ops/prometheus/alerts.yml``) and their promtool unit tests.

``promtool check rules`` and ``promtool test rules`` run as real processes. promtool comes
from Debian's ``prometheus`` package (``.ci/run`` installs it): without it those two tests
skip with the reason shown, except under ``CI``, where they fail so that CI cannot skip
them silently. The static checks need no promtool: every rule carries its severity and
annotations, uses only the metrics of ``docs/observability.md``, and has a promtool case
where it fires and one where it stays quiet.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from qo_ops.jobs.catalog import CATALOG
from qo_ops.platform.spec import cadence_seconds

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "ops" / "prometheus" / "alerts.yml"
RULE_TESTS = REPO / "ops" / "prometheus" / "tests" / "alerts_test.yml"
CONTRACT = REPO / "docs" / "observability.md"

GROUP = "qo-ops-jobs"
ALERTS = {
    "QoOpsJobNotSucceeding",
    "QoOpsJobConsecutiveFailures",
    "QoOpsJobDurationOverBudget",
    "QoOpsJobBacklogGrowing",
    "QoOpsJobCheckpointNotAdvancing",
    "QoOpsJobDeadLetters",
    "QoOpsJobLeaseTakeover",
    "QoOpsJobAnomalyStop",
    "QoOpsJobMissedRuns",
    "QoOpsJobSuspendedTooLong",
    "QoOpsJobRetryPressureHigh",
    "QoOpsDownstreamBreakerOpen",
    "QoOpsExporterDown",
}
# rules not about one job: the exporter's, and the downstream's (labelled by its origin)
NOT_JOB_ALERTS = {"QoOpsExporterDown", "QoOpsDownstreamBreakerOpen"}
SEVERITIES = {"page", "ticket"}
RUNBOOK = "https://github.com/qo-ops/qo-ops/blob/main/docs/runbooks/{{ $labels.job_name }}.md"
EXPORTER_RUNBOOK = "https://github.com/qo-ops/qo-ops/blob/main/docs/observability.md"
DOWNSTREAM_RUNBOOK = (
    "https://github.com/qo-ops/qo-ops/blob/main/docs/downstream.md#during-a-downstream-incident"
)
DASHBOARD = "/d/qo-ops/qo-ops?var-job={{ $labels.job_name }}"
BACKLOG_WINDOW_S = 30 * 60  # QoOpsJobBacklogGrowing: deriv(…[30m]) for 30m
# Prometheus' own labels, besides the exporter's documented ones: the scrape job and target.
SCRAPE_LABELS = {"job", "instance"}

# PromQL words that look like metric names but are not
_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "bool", "offset", "atan2", "inf", "nan",
}  # fmt: skip
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_IDENT = re.compile(r"(?<![\w.:])[A-Za-z_:][A-Za-z0-9_:]*")


def _truthy_env(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def _promtool() -> str:
    """promtool's path; skips (fails under CI) when it is not installed."""
    path = shutil.which("promtool")
    if path is None:
        reason = (
            "promtool not on PATH: install Debian's `prometheus` package "
            "(`apt-get install prometheus`; .ci/run does it as root) to run the rule tests"
        )
        if _truthy_env("CI"):
            pytest.fail(f"{reason} (CI is set, so this does not skip)", pytrace=False)
        pytest.skip(reason)
    return path


def _run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_promtool(), *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def _rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    assert [g["name"] for g in groups] == [GROUP]
    return list(groups[0]["rules"])


def _contract() -> dict[str, set[str]]:
    """Metric name → labels, from the tables of docs/observability.md (first column: the
    metric in backticks, second: its labels). A histogram also has _bucket/_sum/_count."""
    metrics: dict[str, set[str]] = {}
    for line in CONTRACT.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.lstrip().startswith("|") or len(cells) < 3:
            continue
        name = re.fullmatch(r"`([A-Za-z_:][A-Za-z0-9_:]*)`", cells[0])
        if name is None:
            continue  # header or separator row
        labels = {label.strip() for label in cells[1].split(",") if label.strip()}
        names = [name.group(1)]
        if "histogram" in cells[2].lower():
            names += [f"{name.group(1)}_{suffix}" for suffix in ("bucket", "sum", "count")]
        for n in names:
            metrics[n] = labels
    return metrics


def _strip(expr: str) -> str:
    """The expression without string literals, label matchers and range/subquery brackets."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"'(?:[^'\\]|\\.)*'", "''", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    return re.sub(r"\[[^\]]*\]", "", expr)


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers that are not a function or
    aggregation (followed by "("), a keyword, or a label in a by/on/… list."""
    text = _GROUPING.sub(" ", _strip(expr))
    names = set()
    for m in _IDENT.finditer(text):
        if text[m.end() :].lstrip().startswith("(") or m.group(0).lower() in _KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def grouping_labels(expr: str) -> set[str]:
    """Labels named in by(…), on(…), ignoring(…), without(…) and group_left/right(…)."""
    return {
        label.strip()
        for m in _GROUPING.finditer(_strip(expr))
        for label in m.group(2).split(",")
        if label.strip()
    }


def test_metric_name_extraction() -> None:
    expr = (
        'label_replace(up{job="qo-ops"} == 0, "problem", "x", "", "") or time() - max by '
        "(job_name) (min_over_time((job_last_run_timestamp_seconds > 0)[4d:5m])) > on "
        "(job_name) 3 * clamp_min(job_expected_interval_seconds offset 5m, 1e3)"
    )
    assert metric_names(expr) == {
        "up",
        "job_last_run_timestamp_seconds",
        "job_expected_interval_seconds",
    }
    assert grouping_labels(expr) == {"job_name"}
    contract = _contract()
    assert "qo_ops_database_up" in contract and "job_anomaly_stops_total" in contract
    assert contract["job_last_run_status"] == {"job_name", "status"}
    assert "job_duration_seconds_bucket" in contract


def test_promtool_check_rules() -> None:
    result = _run_promtool("check", "rules", str(RULES.relative_to(REPO)))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"SUCCESS: {len(_rules())} rules found" in output, output


def test_promtool_unit_tests() -> None:
    result = _run_promtool("test", "rules", str(RULE_TESTS.relative_to(REPO)))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_alerts_are_the_documented_concerns() -> None:
    names = [rule.get("alert") for rule in _rules()]
    assert all(names), "only alerting rules here (a recording rule has no 'alert')"
    assert len(names) == len(set(names)), f"duplicate alert names: {names}"
    assert set(names) == ALERTS


@pytest.mark.parametrize("rule", _rules(), ids=lambda rule: rule.get("alert", "?"))
def test_every_rule_has_severity_annotations_and_links(rule: dict[str, Any]) -> None:
    labels = rule.get("labels") or {}
    annotations = rule.get("annotations") or {}
    assert labels.get("severity") in SEVERITIES, labels
    for key in ("summary", "description", "runbook_url", "dashboard"):
        assert str(annotations.get(key, "")).strip(), f"{rule['alert']}: no {key}"
    if "job_name" in grouping_labels(rule["expr"]):
        # a job alert: says which job and how bad, links the job's runbook and dashboard
        assert "{{ $labels.job_name }}" in annotations["summary"]
        assert "$value" in annotations["summary"]
        assert annotations["runbook_url"] == RUNBOOK
        assert annotations["dashboard"] == DASHBOARD
    elif "downstream" in grouping_labels(rule["expr"]):
        # a downstream's alert: which one and how long, links the incident section
        assert "{{ $labels.downstream }}" in annotations["summary"]
        assert "$value" in annotations["summary"]
        assert annotations["runbook_url"] == DOWNSTREAM_RUNBOOK
        assert "During a downstream incident" in (REPO / "docs" / "downstream.md").read_text()
    else:
        assert annotations["runbook_url"] == EXPORTER_RUNBOOK
        assert (REPO / "docs" / "observability.md").is_file()


@pytest.mark.parametrize("rule", _rules(), ids=lambda rule: rule.get("alert", "?"))
def test_every_metric_and_label_is_in_the_contract(rule: dict[str, Any]) -> None:
    contract = _contract()
    used = metric_names(rule["expr"])
    assert used, f"{rule['alert']}: no metric found in its expression"
    unknown = used - set(contract) - {"up"}
    assert not unknown, (
        f"{rule['alert']} uses {sorted(unknown)}, which docs/observability.md does not define"
    )
    known_labels = set().union(*contract.values()) | SCRAPE_LABELS
    assert grouping_labels(rule["expr"]) <= known_labels


def test_every_alert_fires_and_stays_quiet_in_the_promtool_tests() -> None:
    text = RULE_TESTS.read_text()
    suite = yaml.safe_load(text)
    assert suite["rule_files"] == ["../alerts.yml"]
    fires: dict[str, int] = {}
    quiet: dict[str, int] = {}
    for test in suite["tests"]:
        for case in test.get("alert_rule_test") or []:
            counts = fires if case.get("exp_alerts") else quiet
            counts[case["alertname"]] = counts.get(case["alertname"], 0) + 1
    for name in ALERTS:
        assert text.count(name) >= 2, f"{name} appears fewer than twice in {RULE_TESTS.name}"
        assert fires.get(name), f"{name}: no promtool case where it fires"
        assert quiet.get(name), f"{name}: no promtool case where it stays quiet"


def test_every_job_alert_is_quiet_while_its_job_is_suspended() -> None:
    """The kill switch: each job rule ends ``unless`` the job is suspended for every scope,
    and the promtool suite's suspension case evaluates each of them (quiet, then firing)."""
    suite = yaml.safe_load(RULE_TESTS.read_text())
    [case] = [t for t in suite["tests"] if t["name"].startswith("every job alert is quiet")]
    evaluated = {c["alertname"] for c in case["alert_rule_test"]}
    quiet_clause = re.compile(r"\bunless on \(job_name\)\s+max by \(job_name\) \(job_suspended\)\s")
    job_rules = [
        rule
        for rule in _rules()
        if "job_name" in grouping_labels(rule["expr"])
        and rule["alert"] != "QoOpsJobSuspendedTooLong"
    ]
    assert {rule["alert"] for rule in job_rules} == ALERTS - NOT_JOB_ALERTS - {
        "QoOpsJobSuspendedTooLong"
    }
    for rule in job_rules:
        assert quiet_clause.search(rule["expr"] + "\n"), f"{rule['alert']} ignores job_suspended"
        assert rule["alert"] in evaluated, f"{rule['alert']}: no promtool case while suspended"


def test_backlog_window_covers_every_job_with_a_backlog() -> None:
    """QoOpsJobBacklogGrowing tells growth from a healthy sawtooth (items pile up between
    ticks, a run clears them) only for jobs that run at least every 30 minutes. The exporter
    reports a backlog for the per-tenant jobs; a slower one needs a longer window."""
    slow = {
        spec.name: cadence_seconds(spec.cron_schedule)
        for spec in CATALOG.values()
        if spec.partitioning == "tenant"
        and spec.reports_backlog
        and cadence_seconds(spec.cron_schedule) > BACKLOG_WINDOW_S
    }
    assert not slow, f"jobs with a backlog slower than the rule's 30 m window: {slow}"
