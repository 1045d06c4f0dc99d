"""The Prometheus alert rules (``ops/prometheus/alerts.yml``) and their promtool unit tests.

``promtool check rules`` and ``promtool test rules`` run as real processes. promtool comes
from Debian's ``prometheus`` package (``.ci/run`` installs it): without it those two tests
skip with the reason shown, except under ``CI``, where they fail so that CI cannot skip
them silently. The static checks need no promtool: every rule carries its severity and
annotations (a job rule: the job's context, rendered by template queries), uses only the
metrics of ``docs/observability.md`` (in its expression and in its annotations' queries),
has a runbook section, and has a promtool case where it fires and one where it stays quiet.
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
from qo_ops.platform.schedule.cron import cadence_seconds

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "ops" / "prometheus" / "alerts.yml"
RULE_TESTS = REPO / "ops" / "prometheus" / "tests" / "alerts_test.yml"
# the cases that need a week of history, evaluated every 15 minutes instead of every minute
WEEKLY_RULE_TESTS = REPO / "ops" / "prometheus" / "tests" / "alerts_weekly_test.yml"
CONTRACT = REPO / "docs" / "observability.md"
RUNBOOKS = REPO / "docs" / "runbooks"

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
    "QoOpsRunQueueBacklog",
    "QoOpsJobSuspendedTooLong",
    "QoOpsJobRetryPressureHigh",
    "QoOpsJobSchedulerDriftHigh",
    "QoOpsJobPartialFailureRateHigh",
    "QoOpsJobReconciliationMismatchSpike",
    "QoOpsJobRunRetriesSustained",
    "QoOpsDownstreamBreakerOpen",
    "QoOpsExporterDown",
}
# the alerts issue 21 added: their promtool cases render the job context from real series
NEW_ALERTS = {
    "QoOpsJobSchedulerDriftHigh",
    "QoOpsJobPartialFailureRateHigh",
    "QoOpsJobReconciliationMismatchSpike",
    "QoOpsJobRunRetriesSustained",
}
# rules not about one job: the exporter's, the downstream's (labelled by its origin), and the
# run queue's (one alert for the queue, naming every job it holds up)
NOT_JOB_ALERTS = {"QoOpsExporterDown", "QoOpsDownstreamBreakerOpen", "QoOpsRunQueueBacklog"}
SEVERITIES = {"page", "ticket"}
RUNBOOK = "https://github.com/qo-ops/qo-ops/blob/main/docs/runbooks/{{ $labels.job_name }}.md"
EXPORTER_RUNBOOK = "https://github.com/qo-ops/qo-ops/blob/main/docs/observability.md"
DOWNSTREAM_RUNBOOK = (
    "https://github.com/qo-ops/qo-ops/blob/main/docs/downstream.md#during-a-downstream-incident"
)
QUEUE_RUNBOOK = (
    "https://github.com/qo-ops/qo-ops/blob/main/docs/runbooks/README.md#a-backlog-in-the-run-queue"
)
DASHBOARD = "/d/qo-ops/qo-ops?var-job={{ $labels.job_name }}"
# What every job alert says about its job (the seed's "alert message should include"): each
# key's template must query these metrics (any of a tuple's; all of them with `all`).
JOB_CONTEXT: dict[str, tuple[str, ...]] = {
    "job": (),
    "last_run": ("job_last_run_timestamp_seconds",),
    "last_status": ("job_last_run_status",),
    "processed_failed": ("job_items_processed_total", "job_items_failed_total"),
    "backlog": ("job_backlog_items", "job_checkpoint_age_seconds"),
}
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


def _suites() -> dict[Path, dict[str, Any]]:
    return {path: yaml.safe_load(path.read_text()) for path in (RULE_TESTS, WEEKLY_RULE_TESTS)}


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
        metrics[name.group(1)] = labels
        if "histogram" in cells[2].lower():
            metrics[f"{name.group(1)}_bucket"] = labels | {"le"}
            metrics[f"{name.group(1)}_sum"] = labels
            metrics[f"{name.group(1)}_count"] = labels
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


def matcher_labels(expr: str) -> set[str]:
    """Labels named in the selectors' matchers ``{name="…", …}``."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    return {
        m.group(1)
        for body in re.findall(r"\{([^}]*)\}", expr)
        for m in re.finditer(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", body)
    }


_QUERY = re.compile(r'\bquery\s+\(?\s*(?:printf\s+)?"((?:[^"\\]|\\.)*)"')


def template_queries(text: str) -> list[str]:
    """The PromQL of a template's ``query "…"`` and ``query (printf "…" …)`` calls, with
    printf's verbs filled in (``%q`` → a quoted job name, ``%s`` → a word)."""
    queries = []
    for m in _QUERY.finditer(text):
        q = m.group(1).replace('\\"', '"')
        queries.append(q.replace("%q", '"x"').replace("%s", "x"))
    return queries


def missing_context(rule: dict[str, Any]) -> list[str]:
    """What a job rule's annotations lack of the job's context (empty: nothing)."""
    annotations = rule.get("annotations") or {}
    problems = []
    for key, metrics in JOB_CONTEXT.items():
        text = str(annotations.get(key, "")).strip()
        if not text:
            problems.append(f"no {key}")
            continue
        if key == "job":
            if text != "{{ $labels.job_name }}":
                problems.append(f"job is {text!r}")
            continue
        used = set().union(*(metric_names(q) for q in template_queries(text)))
        need_all = key == "processed_failed"
        if (need_all and not set(metrics) <= used) or not set(metrics) & used:
            problems.append(f"{key} queries {sorted(used)}, not {' and '.join(metrics)}")
    for key, value in (("runbook_url", RUNBOOK), ("dashboard", DASHBOARD)):
        if annotations.get(key) != value:
            problems.append(f"{key} is not {value}")
    return problems


def _is_job_rule(rule: dict[str, Any]) -> bool:
    return rule["alert"] not in NOT_JOB_ALERTS


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
    assert matcher_labels(expr) == {"job"}
    assert matcher_labels('x{scope="run", reason=~"a|b"} / y{le!="+Inf"}') == {
        "scope",
        "reason",
        "le",
    }
    template = (
        '{{ with query (printf "max(job_backlog_items{job_name=%q})" $labels.job_name) }}'
        '{{ . | first | value }}{{ end }}{{ range query "sum(up{job=\\"qo-ops\\"})" }}{{ end }}'
    )
    assert template_queries(template) == [
        'max(job_backlog_items{job_name="x"})',
        'sum(up{job="qo-ops"})',
    ]
    contract = _contract()
    assert "qo_ops_database_up" in contract and "job_anomaly_stops_total" in contract
    assert contract["job_last_run_status"] == {"job_name", "status"}
    assert "job_duration_seconds_bucket" in contract
    assert contract["job_scheduler_drift_seconds_bucket"] == {"job_name", "le"}
    assert contract["job_retries_total"] == {"job_name", "scope", "reason"}
    assert contract["reconciliation_mismatches_total"] == {"job_name", "mismatch_type"}


def test_promtool_check_rules() -> None:
    result = _run_promtool("check", "rules", str(RULES.relative_to(REPO)))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"SUCCESS: {len(_rules())} rules found" in output, output


def test_promtool_unit_tests() -> None:
    files = [str(path.relative_to(REPO)) for path in (RULE_TESTS, WEEKLY_RULE_TESTS)]
    result = _run_promtool("test", "rules", *files)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert output.count("SUCCESS") == len(files), output


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
    if rule["alert"] == "QoOpsRunQueueBacklog":
        # the queue's alert: how deep, how old, how many jobs; links the backlog section
        assert "job_run_queue_depth" in annotations["summary"]
        assert "job_run_queue_oldest_seconds" in annotations["summary"]
        assert "$value" in annotations["summary"]
        assert annotations["runbook_url"] == QUEUE_RUNBOOK
        section = "## A backlog in the run queue"
        assert section in (RUNBOOKS / "README.md").read_text()
    elif _is_job_rule(rule):
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


@pytest.mark.parametrize(
    "rule", [r for r in _rules() if _is_job_rule(r)], ids=lambda rule: rule.get("alert", "?")
)
def test_every_job_alert_carries_the_jobs_context(rule: dict[str, Any]) -> None:
    """job, last run time and status, processed/failed counts, backlog or checkpoint age, a
    runbook and a dashboard link, each its own annotation key querying the right series."""
    assert "job_name" in grouping_labels(rule["expr"]), rule["alert"]
    assert missing_context(rule) == [], rule["alert"]


def test_the_context_check_finds_what_a_rule_lacks() -> None:
    """The check above, proved on rules planted without part of the context."""
    [real] = [r for r in _rules() if r["alert"] == "QoOpsJobDeadLetters"]
    assert missing_context(real) == []

    def planted(**changes: Any) -> dict[str, Any]:
        annotations = {**real["annotations"], **changes}
        return {**real, "annotations": {k: v for k, v in annotations.items() if v is not None}}

    assert missing_context(planted(last_run=None)) == ["no last_run"]
    assert missing_context(planted(job="{{ $labels.instance }}")) == [
        "job is '{{ $labels.instance }}'"
    ]
    # a backlog that queries something else; counts without the failed ones
    backlog = (
        '{{ with query (printf "max(job_lag_seconds{job_name=%q})" $labels.job_name) }}x{{ end }}'
    )
    [problem] = missing_context(planted(backlog=backlog))
    assert problem.startswith("backlog queries ['job_lag_seconds']")
    processed = (
        '{{ with query (printf "max(increase(job_items_processed_total{job_name=%q}[24h]))"'
        " $labels.job_name) }}{{ . | first | value }}{{ end }}"
    )
    [problem] = missing_context(planted(processed_failed=processed))
    assert problem.startswith("processed_failed queries ['job_items_processed_total']")
    assert missing_context(planted(dashboard="/d/qo-ops/qo-ops")) == [
        f"dashboard is not {DASHBOARD}"
    ]


def test_the_not_job_alerts_carry_what_applies_to_them() -> None:
    """The downstream's alert names the jobs it stopped and their backlog; the exporter's says
    when it last served a good read."""
    rules = {rule["alert"]: rule for rule in _rules()}
    jobs = template_queries(rules["QoOpsDownstreamBreakerOpen"]["annotations"]["jobs"])
    assert set().union(*map(metric_names, jobs)) == {"job_failed_total", "job_backlog_items"}
    last = template_queries(rules["QoOpsExporterDown"]["annotations"]["last_good_scrape"])
    assert set().union(*map(metric_names, last)) == {"qo_ops_database_up"}
    queue = rules["QoOpsRunQueueBacklog"]["annotations"]
    waiting = template_queries(queue["jobs_waiting"])
    assert set().union(*map(metric_names, waiting)) == {
        "job_run_queue_oldest_seconds",
        "job_run_queue_depth",
    }
    behind = template_queries(queue["jobs_behind"])
    assert set().union(*map(metric_names, behind)) == {
        "job_last_success_timestamp_seconds",
        "job_expected_interval_seconds",
        "job_run_queue_oldest_seconds",
    }


@pytest.mark.parametrize("rule", _rules(), ids=lambda rule: rule.get("alert", "?"))
def test_every_metric_and_label_is_in_the_contract(rule: dict[str, Any]) -> None:
    """In the expression and in every query of its annotations' templates."""
    contract = _contract()
    used = metric_names(rule["expr"])
    assert used, f"{rule['alert']}: no metric found in its expression"
    queries = [
        q for text in (rule.get("annotations") or {}).values() for q in template_queries(str(text))
    ]
    known_labels = set().union(*contract.values()) | SCRAPE_LABELS
    for expr in [rule["expr"], *queries]:
        unknown = metric_names(expr) - set(contract) - {"up"}
        assert not unknown, (
            f"{rule['alert']} uses {sorted(unknown)}, which docs/observability.md does not define"
            f" (in {expr!r})"
        )
        labels = grouping_labels(expr) | matcher_labels(expr)
        assert labels <= known_labels, (rule["alert"], sorted(labels - known_labels), expr)


def test_every_alert_has_a_runbook_section() -> None:
    """The runbook README has a section per alert; a job alert's runbook_url is the job's
    runbook, which exists for every catalog job with its "Alerts that point here"."""
    readme = (RUNBOOKS / "README.md").read_text()
    for name in ALERTS:
        assert f"**{name}**" in readme, f"docs/runbooks/README.md has no section for {name}"
    for job in CATALOG:
        runbook = RUNBOOKS / f"{job}.md"
        assert runbook.is_file(), f"no runbook for {job}"
        assert "## 2. Alerts that point here" in runbook.read_text(), runbook.name


def test_every_alert_fires_and_stays_quiet_in_the_promtool_tests() -> None:
    text = "".join(path.read_text() for path in (RULE_TESTS, WEEKLY_RULE_TESTS))
    fires: dict[str, int] = {}
    quiet: dict[str, int] = {}
    for suite in _suites().values():
        assert suite["rule_files"] == ["../alerts.yml"]
        for test in suite["tests"]:
            for case in test.get("alert_rule_test") or []:
                counts = fires if case.get("exp_alerts") else quiet
                counts[case["alertname"]] = counts.get(case["alertname"], 0) + 1
    for name in ALERTS:
        assert text.count(name) >= 2, f"{name} appears fewer than twice in the promtool tests"
        assert fires.get(name), f"{name}: no promtool case where it fires"
        assert quiet.get(name), f"{name}: no promtool case where it stays quiet"


def test_the_promtool_cases_check_the_rendered_context() -> None:
    """promtool compares every firing case's annotations whole, so each lists the context.
    The new alerts and at least two older ones have a case fed with the series behind it, so
    the rendered last run time (and, for the new ones, the 24 h counts) are checked, not only
    the texts for missing series."""
    last_run = re.compile(r"1970-01-\d\d \d\d:\d\d:00 \+0000 UTC \(.+ ago\)")
    counts = re.compile(r"\d+ processed, \d+ failed in the last 24 h")
    with_last_run: set[str] = set()
    with_counts: set[str] = set()
    for suite in _suites().values():
        for test in suite["tests"]:
            for case in test.get("alert_rule_test") or []:
                if case["alertname"] in NOT_JOB_ALERTS:
                    continue
                for alert in case.get("exp_alerts") or []:
                    annotations = alert["exp_annotations"]
                    assert set(JOB_CONTEXT) <= annotations.keys(), (test["name"], case)
                    assert annotations["job"] == alert["exp_labels"]["job_name"]
                    if last_run.fullmatch(annotations["last_run"]):
                        with_last_run.add(case["alertname"])
                    if counts.fullmatch(annotations["processed_failed"]):
                        with_counts.add(case["alertname"])
    assert with_last_run >= NEW_ALERTS, NEW_ALERTS - with_last_run
    assert with_counts >= NEW_ALERTS, NEW_ALERTS - with_counts
    assert len(with_last_run - NEW_ALERTS) >= 2, with_last_run


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
        if _is_job_rule(rule) and rule["alert"] != "QoOpsJobSuspendedTooLong"
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
        spec.name: cadence_seconds(spec.deployment.cron_schedule)
        for spec in CATALOG.values()
        if spec.partitioning == "tenant"
        and spec.signals.reports_backlog
        and cadence_seconds(spec.deployment.cron_schedule) > BACKLOG_WINDOW_S
    }
    assert not slow, f"jobs with a backlog slower than the rule's 30 m window: {slow}"
