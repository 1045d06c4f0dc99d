"""The Grafana dashboard ops/grafana/qo-ops.json against the metric contract.

The contract is docs/observability.md: the dashboard may only query metric names listed in its
tables (plus the postgres_exporter metrics of the PostgreSQL row), only with the labels the
contract allows, never a tenant, run, quote or order label. When Prometheus's ``promtool`` is on
PATH, every expression is also parsed by it (as a recording rule, Grafana variables
substituted), and the headline expressions are evaluated against synthetic series.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "ops" / "grafana" / "qo-ops.json"
CONTRACT = REPO / "docs" / "observability.md"

# The PostgreSQL row reads prometheus-community/postgres_exporter, not `qo-ops metrics`.
POSTGRES_EXPORTER_METRICS = {
    "pg_stat_activity_max_tx_duration",
    "pg_locks_count",
    "pg_stat_database_deadlocks",
    "pg_stat_activity_count",
}
POSTGRES_EXPORTER_LABELS = {"datname", "state", "mode"}
# Labels of the contract, plus `le` of the histogram's buckets.
CONTRACT_LABELS = {
    "job_name", "status", "error_class", "reason", "side_effect", "result", "le",
    "downstream", "state", "to", "trigger", "scope", "mismatch_type",
}  # fmt: skip
FORBIDDEN_LABEL = re.compile(r"tenant|run_id|quote|order", re.IGNORECASE)

# Grafana's variables, as promtool gets them.
SUBSTITUTIONS = {
    "job": "quote_expiration",
    "__rate_interval": "5m",
    "__range": "1h",
    "__interval": "1m",
}

PROMQL_KEYWORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "group_left",
    "group_right",
    "inf",
    "nan",
}
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
MATCHER_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
TOKEN = re.compile(r"\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|[A-Za-z_:][A-Za-z0-9_:]*")


# --- helpers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def walk(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    for panel in panels:
        yield panel
        yield from walk(panel.get("panels", []))


def all_targets(dash: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(p, t) for p in walk(dash["panels"]) for t in p.get("targets", [])]


def contract_metrics() -> set[str]:
    """Metric names of docs/observability.md: the first column of its `| metric |` tables.

    A histogram (its meaning starts with "histogram") is served as _bucket/_sum/_count series.
    """
    names: set[str] = set()
    in_table = False
    for line in CONTRACT.read_text(encoding="utf-8").splitlines():
        cells = (
            [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        )
        if not cells:
            in_table = False
            continue
        if cells[0] == "metric":
            in_table = True
            continue
        if not in_table or set(cells[0]) <= set("-: "):
            continue
        name = cells[0].strip("`")
        names.add(name)
        if cells[-1].lower().startswith("histogram"):
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def substitute(expr: str) -> str:
    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        assert name in SUBSTITUTIONS, f"unknown Grafana variable ${name} in {expr!r}"
        return SUBSTITUTIONS[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", repl, expr)


def strip_strings(expr: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)


def labels_of(expr: str) -> set[str]:
    """Label names an expression matches on or groups by."""
    text = strip_strings(substitute(expr))
    labels: set[str] = set()
    for body in re.findall(r"\{([^}]*)\}", text):
        labels |= set(MATCHER_LABEL.findall(body))
    for body in GROUPING.findall(text):
        labels |= {x.strip() for x in body.split(",") if x.strip()}
    return labels


def metrics_of(expr: str) -> set[str]:
    """Metric names in an expression: identifiers that are not functions, keywords or labels."""
    text = strip_strings(substitute(expr))
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = GROUPING.sub(" ", text)
    text = re.sub(r"\boffset\s+\S+", " ", text)
    names = set()
    for m in TOKEN.finditer(text):
        token = m.group(0)
        if token[0].isdigit() or token.lower() in PROMQL_KEYWORDS:
            continue
        if re.match(r"\s*\(", text[m.end() :]):  # a function call
            continue
        names.add(token)
    return names


# --- structure -------------------------------------------------------------------------------


def test_identity(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "qo-ops"
    assert dashboard["title"] == "qo-ops jobs"
    assert dashboard["schemaVersion"] == 39


def test_every_panel_has_id_title_description_and_position(dashboard: dict[str, Any]) -> None:
    panels = list(walk(dashboard["panels"]))
    assert len(panels) > 20
    ids = [p.get("id") for p in panels]
    assert all(isinstance(i, int) for i in ids), ids
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(ids)}"
    for p in panels:
        where = f"panel {p.get('id')} {p.get('title')!r}"
        assert p.get("title", "").strip(), where
        assert "healthy" in p.get("description", "").lower(), f"{where}: say what healthy is"
        pos = p.get("gridPos", {})
        assert {"h", "w", "x", "y"} <= pos.keys(), where
        assert all(isinstance(pos[k], int) and pos[k] >= 0 for k in "hwxy"), where
        assert pos["w"] > 0 and pos["h"] > 0 and pos["x"] + pos["w"] <= 24, where


def test_variables(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    job = variables["job"]
    assert job["type"] == "query"
    assert job["multi"] is True and job["includeAll"] is True
    query = job["query"]["query"] if isinstance(job["query"], dict) else job["query"]
    assert query == "label_values(job_expected_interval_seconds, job_name)"
    assert "job_expected_interval_seconds" in contract_metrics()
    # every query goes through the datasource variable, never a hard-wired datasource
    for panel, target in all_targets(dashboard):
        for ds_ref in (panel.get("datasource"), target.get("datasource")):
            if ds_ref is not None:
                assert ds_ref.get("uid") == "${datasource}", panel["title"]


def test_top_row_and_repeated_job_row(dashboard: dict[str, Any]) -> None:
    top = dashboard["panels"]
    assert top[0]["type"] == "row" and top[0]["title"].startswith("Now")
    status_panels = [
        p for p in walk(top) for t in p.get("targets", []) if "job_last_run_status" in t["expr"]
    ]
    assert status_panels, "a panel shows the last status"
    mapped = {
        status: opts["color"]
        for p in status_panels
        for m in p["fieldConfig"]["defaults"]["mappings"]
        + [
            m
            for o in p["fieldConfig"]["overrides"]
            for prop in o["properties"]
            if prop["id"] == "mappings"
            for m in prop["value"]
        ]
        for status, opts in m.get("options", {}).items()
    }
    assert mapped["success"] == mapped["no_work"] == "green"
    assert mapped["partial_success"] == "orange"
    assert mapped["failed"] == mapped["timeout"] == "red"
    assert mapped["cancelled"] == mapped["skipped"] != "green"

    repeated = [p for p in top if p["type"] == "row" and p.get("repeat")]
    assert len(repeated) == 1
    job_row = repeated[0]
    assert job_row["repeat"] == "job"
    assert "$job" in job_row["title"]
    inner = job_row["panels"]
    assert inner, "the repeated row is collapsed and holds its panels"
    for panel in inner:
        for target in panel["targets"]:
            assert 'job_name="$job"' in target["expr"], (panel["title"], target["expr"])

    pg = [p for p in top if p["type"] == "row" and p["title"] == "PostgreSQL"]
    assert len(pg) == 1
    pg_panels = [
        p for p in top if any(m in str(p.get("targets")) for m in POSTGRES_EXPORTER_METRICS)
    ]
    assert len(pg_panels) >= 2
    for panel in pg_panels:
        assert "prometheus-community/postgres_exporter" in panel["description"], panel["title"]


def test_links_to_runbooks_and_contract(dashboard: dict[str, Any]) -> None:
    urls = [link["url"] for link in dashboard["links"]]
    assert any(u.endswith("docs/runbooks/README.md") for u in urls), urls
    assert any(u.endswith("docs/observability.md") for u in urls), urls


# --- expressions against the contract ---------------------------------------------------------


def test_expressions_use_only_contract_metrics(dashboard: dict[str, Any]) -> None:
    allowed = contract_metrics() | POSTGRES_EXPORTER_METRICS
    assert {"job_completed_total", "job_duration_seconds_bucket", "qo_ops_database_up"} <= allowed
    targets = all_targets(dashboard)
    assert targets
    used: set[str] = set()
    for panel, target in targets:
        names = metrics_of(target["expr"])
        assert names, (panel["title"], target["expr"])
        unknown = names - allowed
        assert not unknown, f"{panel['title']!r}: {unknown} not in docs/observability.md"
        used |= names
    # the parser itself: it finds the metric and nothing else
    assert metrics_of(
        'histogram_quantile(0.95, sum by (le) (rate(job_duration_seconds_bucket{job_name="$job"}'
        "[$__rate_interval]))) / on (job_name) group_left max(job_duration_budget_seconds)"
    ) == {"job_duration_seconds_bucket", "job_duration_budget_seconds"}
    assert "job_duration_seconds_bucket" in used


def test_no_high_cardinality_labels(dashboard: dict[str, Any]) -> None:
    allowed = CONTRACT_LABELS | POSTGRES_EXPORTER_LABELS
    for panel, target in all_targets(dashboard):
        expr = target["expr"]
        labels = labels_of(expr) | set(
            re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", ""))
        )
        assert not {x for x in labels if FORBIDDEN_LABEL.search(x)}, (panel["title"], expr)
        assert labels <= allowed, f"{panel['title']!r}: labels {labels - allowed} in {expr!r}"
        assert not re.search(r"tenant|run_id|quote_id|order_id", expr, re.IGNORECASE), expr
    assert labels_of('sum by (status) (x{job_name="$job", tenant_id!="a"})') == {
        "status",
        "job_name",
        "tenant_id",
    }


# --- promtool ---------------------------------------------------------------------------------


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not on PATH (apt-get install prometheus): PromQL syntax not checked")
    return promtool


def test_promtool_parses_every_expression(dashboard: dict[str, Any], tmp_path: Path) -> None:
    promtool = _promtool()
    rules = [
        {"record": f"qo_ops_dashboard:expr_{i}", "expr": substitute(t["expr"])}
        for i, (_, t) in enumerate(all_targets(dashboard))
    ]
    for rule in rules:
        assert "$" not in rule["expr"], rule
    path = tmp_path / "dashboard-rules.yml"
    # JSON is YAML: no YAML library needed.
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}, indent=2))
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(rules)} rules found" in result.stdout + result.stderr


def _now_expr(dashboard: dict[str, Any], title: str) -> str:
    """The first expression of the "Now" row's panel ``title``."""
    [panel] = [p for p in dashboard["panels"] if p["title"] == title]
    return panel["targets"][0]["expr"]


def test_promtool_evaluates_the_headline_stats(dashboard: dict[str, Any], tmp_path: Path) -> None:
    """The "Now" stats on synthetic series: stale `a` (10× its cadence) and `b` (fine); the
    suspended jobs table lists `a` (suspended) only."""
    promtool = _promtool()

    def series(metric: str, job: str, value: str) -> dict[str, str]:
        return {"series": f'{metric}{{job_name="{job}"}}', "values": f"{value}x120"}

    inputs = [
        # at eval time 3600 s: a last succeeded 600 s ago with a 60 s cadence (10×, overdue),
        # b 600 s ago with a 900 s cadence (0.7×)
        series("job_last_success_timestamp_seconds", "a", "3000"),
        series("job_expected_interval_seconds", "a", "60"),
        series("job_last_success_timestamp_seconds", "b", "3000"),
        series("job_expected_interval_seconds", "b", "900"),
        series("job_consecutive_failures", "a", "4"),
        series("job_consecutive_failures", "b", "0"),
        series("job_longest_running_seconds", "a", "0"),
        series("job_duration_budget_seconds", "a", "60"),
        series("job_longest_running_seconds", "b", "1200"),
        series("job_duration_budget_seconds", "b", "900"),
        series("job_deadletter_items", "b", "0"),
        {"series": 'job_last_run_status{job_name="a",status="failed"}', "values": "1x120"},
        {"series": 'job_last_run_status{job_name="a",status="success"}', "values": "0x120"},
        {"series": 'job_last_run_status{job_name="b",status="no_work"}', "values": "1x120"},
        # a suspended for 2 h against a 1 h alert threshold; b not suspended (no series)
        series("job_suspended_seconds", "a", "7200"),
        series("job_suspended", "a", "1"),
        {"series": "job_suspension_alert_after_seconds", "values": "3600x120"},
    ]

    def one(expr: str, value: float, labels: str = "{}") -> dict[str, Any]:
        return {
            "expr": expr,
            "eval_time": "1h",
            "exp_samples": [{"labels": labels, "value": value}],
        }

    [suspended] = [p for p in dashboard["panels"] if p["title"] == "Suspended jobs"]
    age, share, every_scope, _ = (t["expr"] for t in suspended["targets"])
    tests = [
        one(age, 7200, '{job_name="a"}'),
        one(share, 2, '{job_name="a"}'),
        one(every_scope, 1, '{job_name="a"}'),
        one(_now_expr(dashboard, "Jobs overdue (no success for 3× cadence)"), 1),
        one(_now_expr(dashboard, "Jobs failing now"), 1),
        one(_now_expr(dashboard, "Runs over budget"), 1),
        one(_now_expr(dashboard, "Dead letters, all jobs"), 0),
        {
            "expr": _now_expr(dashboard, "Every job now"),
            "eval_time": "1h",
            "exp_samples": [
                {"labels": '{job_name="a",status="failed"}', "value": 1},
                {"labels": '{job_name="b",status="no_work"}', "value": 1},
            ],
        },
    ]
    spec = _expression_tests(inputs, tests, interval="30s")
    _promtool_passes(promtool, spec, tmp_path / "dashboard-test.yml")


def _expression_tests(inputs: list[Any], tests: list[Any], interval: str) -> dict[str, Any]:
    """A promtool test file of expression tests over ``inputs`` (no rules)."""
    return {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{"interval": interval, "input_series": inputs, "promql_expr_test": tests}],
    }


def _promtool_passes(promtool: str, spec: dict[str, Any], path: Path, timeout: int = 60) -> None:
    """``promtool test rules`` on ``spec``, written to ``path``: every expectation holds."""
    path.write_text(json.dumps(spec, indent=2))
    result = subprocess.run(
        [promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _job_row_expr(dashboard: dict[str, Any], title: str, ref: str) -> str:
    """Expression ``ref`` of the job row's panel ``title`` (``$job`` substituted)."""
    [panel] = [p for p in walk(dashboard["panels"]) if p.get("title") == title]
    [target] = [t for t in panel["targets"] if t["refId"] == ref]
    return substitute(target["expr"])


def test_promtool_evaluates_the_downstream_panels(
    dashboard: dict[str, Any], tmp_path: Path
) -> None:
    """Retry pressure is retries / calls over 30 minutes; the breaker table lists each origin
    with its current state and open time (the closed one at 0)."""
    promtool = _promtool()
    job = SUBSTITUTIONS["job"]
    inputs = [
        # 200 calls a minute, 50 of them retries: 25 %
        {"series": f'job_downstream_calls_total{{job_name="{job}"}}', "values": "0+100x120"},
        {"series": f'job_downstream_retries_total{{job_name="{job}"}}', "values": "0+25x120"},
        {"series": 'qo_ops_downstream_breaker_state{downstream="http://a:80",state="open"}', "values": "1x120"},
        {"series": 'qo_ops_downstream_breaker_state{downstream="http://a:80",state="closed"}', "values": "0x120"},
        {"series": 'qo_ops_downstream_breaker_state{downstream="http://b:80",state="open"}', "values": "0x120"},
        {"series": 'qo_ops_downstream_breaker_state{downstream="http://b:80",state="closed"}', "values": "1x120"},
        {"series": 'qo_ops_downstream_breaker_open_seconds{downstream="http://a:80"}', "values": "0+30x120"},
        {"series": 'qo_ops_downstream_breaker_open_seconds{downstream="http://b:80"}', "values": "0x120"},
    ]  # fmt: skip
    [table] = [p for p in dashboard["panels"] if p["title"] == "Downstream breakers"]
    state, open_s = (t["expr"] for t in table["targets"])
    tests = [
        {
            "expr": _job_row_expr(dashboard, "Downstream calls and retry pressure", "C"),
            "eval_time": "1h",
            "exp_samples": [{"labels": "{}", "value": 0.25}],
        },
        {
            "expr": state,
            "eval_time": "1h",
            "exp_samples": [
                {"labels": '{downstream="http://a:80",state="open"}', "value": 1},
                {"labels": '{downstream="http://b:80",state="closed"}', "value": 1},
            ],
        },
        {
            "expr": open_s,
            "eval_time": "1h",
            "exp_samples": [
                {"labels": '{downstream="http://a:80"}', "value": 3600},
                {"labels": '{downstream="http://b:80"}', "value": 0},
            ],
        },
    ]
    spec = _expression_tests(inputs, tests, interval="30s")
    _promtool_passes(promtool, spec, tmp_path / "dashboard-downstream-test.yml")


def test_promtool_evaluates_the_drift_and_reconciliation_panels(
    dashboard: dict[str, Any], tmp_path: Path
) -> None:
    """The panels drawn against the issue-21 alerts compute what the alerts compare: drift p90
    over an hour against a quarter of the cadence clamped to 60 s … 10 min; a mismatch type's
    share of the items scanned in the last hour against 3× its share over the week before."""
    promtool = _promtool()
    job = SUBSTITUTIONS["job"]  # quote_expiration: cadence 15 minutes, threshold 225 s
    # every start 60-120 s late, 2 a minute
    drift = [
        {
            "series": f'job_scheduler_drift_seconds_bucket{{job_name="{job}",le="{le}"}}',
            "values": "0x240" if le in ("1", "5", "15", "30", "60") else "0+1x240",
        }
        for le in ("1", "5", "15", "30", "60", "120", "300", "600", "1800", "3600", "+Inf")
    ]
    cadence = {"series": f'job_expected_interval_seconds{{job_name="{job}"}}', "values": "900x240"}
    # 8 days at 15 m: 1,000 items scanned a day and 20 missing_downstream (2 %); at t=192h,
    # 1,000 items and 200 mismatches (20 %)
    scanned = " ".join(f"{1000 * d}x95" for d in range(8)) + " 8000x10"
    mismatches = " ".join(f"{20 * d}x95" for d in range(8)) + " 340x10"
    recon = [
        {"series": f'reconciliation_items_scanned_total{{job_name="{job}"}}', "values": scanned},
        {
            "series": f'reconciliation_mismatches_total{{job_name="{job}",'
            'mismatch_type="missing_downstream"}',
            "values": mismatches,
        },
    ]

    def one(expr: str, eval_time: str, labels: str, value: float) -> dict[str, Any]:
        return {
            "expr": expr,
            "eval_time": eval_time,
            "exp_samples": [{"labels": labels, "value": value}],
        }

    title = "Scheduler drift p50 / p90 (1 h) against the alert threshold"
    share = "Reconciliation: mismatch share (1 h) against 3× the usual (7 d)"
    missing = '{mismatch_type="missing_downstream"}'
    spec = {
        "rule_files": [],
        "evaluation_interval": "1h",
        "tests": [
            {
                "interval": "30s",
                "input_series": [*drift, cadence],
                "promql_expr_test": [
                    one(_job_row_expr(dashboard, title, "B"), "1h", "{}", 114),  # 60 + 0.9 × 60
                    one(_job_row_expr(dashboard, title, "C"), "1h", "{}", 225),  # 900 / 4
                ],
            },
            {
                "interval": "15m",
                "input_series": recon,
                "promql_expr_test": [
                    one(_job_row_expr(dashboard, share, "A"), "192h30m", missing, 0.2),
                    one(_job_row_expr(dashboard, share, "B"), "192h30m", missing, 0.06),
                ],
            },
        ],
    }
    _promtool_passes(promtool, spec, tmp_path / "dashboard-issue21-test.yml", timeout=120)


def test_promtool_evaluates_the_run_queue_panel(dashboard: dict[str, Any], tmp_path: Path) -> None:
    """One line per job with runs queued: how many, the oldest wait, and whether it is held up
    (waited longer than its cadence, clamped to 1-15 minutes: QoOpsRunQueueBacklog's test);
    a job with nothing queued has no line."""
    promtool = _promtool()
    inputs = [
        # a minutely job whose oldest run has waited 2 minutes: held up
        {"series": 'job_run_queue_depth{job_name="quote_expiration"}', "values": "4x10"},
        {"series": 'job_run_queue_oldest_seconds{job_name="quote_expiration"}', "values": "120x10"},
        {"series": 'job_expected_interval_seconds{job_name="quote_expiration"}', "values": "60x10"},
        # a daily job waiting 10 minutes: under its 15-minute bound
        {"series": 'job_run_queue_depth{job_name="audit_archive"}', "values": "1x10"},
        {"series": 'job_run_queue_oldest_seconds{job_name="audit_archive"}', "values": "600x10"},
        {"series": 'job_expected_interval_seconds{job_name="audit_archive"}', "values": "86400x10"},
        # nothing queued
        {"series": 'job_run_queue_depth{job_name="delivery_retry"}', "values": "0x10"},
        {"series": 'job_run_queue_oldest_seconds{job_name="delivery_retry"}', "values": "0x10"},
        {"series": 'job_expected_interval_seconds{job_name="delivery_retry"}', "values": "120x10"},
    ]  # fmt: skip
    [table] = [p for p in dashboard["panels"] if p["title"] == "Run queue"]
    depth, oldest, held = (t["expr"] for t in table["targets"])

    def samples(**values: float) -> list[dict[str, Any]]:
        return [{"labels": f'{{job_name="{j}"}}', "value": v} for j, v in values.items()]

    tests = [
        {"expr": depth, "eval_time": "5m",
         "exp_samples": samples(quote_expiration=4, audit_archive=1)},
        {"expr": oldest, "eval_time": "5m",
         "exp_samples": samples(quote_expiration=120, audit_archive=600)},
        {"expr": held, "eval_time": "5m",
         "exp_samples": samples(quote_expiration=1, audit_archive=0)},
    ]  # fmt: skip
    spec = _expression_tests(inputs, tests, interval="1m")
    _promtool_passes(promtool, spec, tmp_path / "dashboard-queue-test.yml")
