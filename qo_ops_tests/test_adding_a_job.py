"""Adding a job is one module and one line (docs/platform.md, "Adding a job"): what the
section says one touches is there for every catalog job, nothing else keeps a list of the
jobs by hand, and a throwaway job added the way it says gets what it says derives from it."""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
import types
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from qo_ops.demo.data import load_demo_data
from qo_ops.jobs.catalog import CATALOG, Catalog
from qo_ops_tests.conftest import base_env

ROOT = Path(__file__).resolve().parents[1]
RUNBOOKS = ROOT / "docs" / "runbooks"
NOT_A_JOB = {"README.md", "data-lifecycle.md"}  # the index and an overview
# Sections 1-6 and 8 are named alike in every runbook; the 7th is the job's own recovery.
SECTIONS = (
    "## 1. What it does, what healthy looks like",
    "## 2. Alerts that point here",
    "## 3. Before rerunning",
    "## 4. Dry-run first",
    "## 5. Safe rerun and backfill",
    "## 6. Stop / pause",
    "## 7. ",
    "## 8. Evidence to record",
)


def adding_a_job() -> str:
    text = (ROOT / "docs" / "platform.md").read_text()
    match = re.search(r"^## Adding a job\n(.*?)(?=^## )", text, re.M | re.S)
    assert match, "docs/platform.md has no 'Adding a job' section"
    return match.group(1)


def runbook_sections(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("## ")]


def sections_missing(headings: list[str]) -> list[str]:
    """The expected sections a runbook's headings lack (in order, one each)."""
    if len(headings) != len(SECTIONS):
        return [f"{len(headings)} sections, not {len(SECTIONS)}"]
    return [want for want, got in zip(SECTIONS, headings, strict=True) if not got.startswith(want)]


@pytest.mark.parametrize("job", sorted(CATALOG))
def test_every_job_is_its_own_module_in_the_catalog(job):
    module = importlib.import_module(f"qo_ops.jobs.{job}")
    assert module.SPEC is CATALOG[job]


def test_a_module_whose_spec_is_another_jobs_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The catalog loads ``qo_ops.jobs.<name>`` by its name: a module whose ``SPEC`` is named
    otherwise (a copied module, a renamed job) is an error, not a second copy of a job."""
    copied = types.ModuleType("qo_ops.jobs.copied_job")
    copied.SPEC = CATALOG["quote_expiration"]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "qo_ops.jobs.copied_job", copied)
    catalog = Catalog(("copied_job",))
    assert "copied_job" in catalog and list(catalog) == ["copied_job"]
    with pytest.raises(TypeError, match="must be the JobSpec named 'copied_job'"):
        catalog["copied_job"]
    with pytest.raises(KeyError):
        catalog["quote_expiration"]  # not in this catalog's names


@pytest.mark.parametrize("job", sorted(CATALOG))
def test_every_job_has_a_runbook_with_the_eight_sections(job):
    path = RUNBOOKS / f"{job}.md"
    assert path.is_file(), f"{job}: write docs/runbooks/{job}.md"
    assert sections_missing(runbook_sections(path.read_text())) == []


def test_the_section_check_finds_a_runbook_that_lacks_one():
    good = (RUNBOOKS / "quote_expiration.md").read_text()
    headings = runbook_sections(good)
    assert sections_missing(headings) == []
    assert sections_missing(headings[:-1]) == ["7 sections, not 8"]
    renamed = [*headings[:3], "## 4. Try it", *headings[4:]]
    assert sections_missing(renamed) == ["## 4. Dry-run first"]


def test_the_runbook_index_lists_exactly_the_catalog():
    index = (RUNBOOKS / "README.md").read_text()
    rows = re.findall(r"^\| (\w+) \| \[(\w+)\.md\]\(\2\.md\) \|", index, re.M)
    assert [job for job, _ in rows] == [link for _, link in rows]
    assert sorted(job for job, _ in rows) == sorted(CATALOG)
    files = {p.name for p in RUNBOOKS.glob("*.md")} - NOT_A_JOB
    assert files == {f"{job}.md" for job in CATALOG}, "a runbook of a job not in the catalog"


def test_the_section_names_files_and_tests_that_exist():
    section = adding_a_job()
    paths = set(re.findall(r"`((?:qo_ops|qo_ops_tests|docs)/[^`\s]+)`", section))
    assert {"qo_ops/jobs/catalog.py", "docs/runbooks/<job>.md"} <= paths
    for path in paths:
        if "<" in path:  # a pattern: its folder is there
            assert (ROOT / path).parent.is_dir(), path
            continue
        assert (ROOT / path).exists(), f"docs/platform.md names {path}, which is not there"
    for test in re.findall(r"`(test_\w+)`", section):
        found = [
            p for p in (ROOT / "qo_ops_tests").rglob("*.py") if f"def {test}(" in p.read_text()
        ]
        assert found, f"docs/platform.md names the test {test}, which is not there"


def hand_kept_lists(tree: ast.AST, jobs: set[str]) -> list[int]:
    """Lines of the literal lists, tuples, sets and dicts that name every job (as strings)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.List | ast.Tuple | ast.Set):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        else:
            continue
        named = {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}
        if jobs <= named:
            lines.append(node.lineno)
    return lines


def test_no_module_keeps_a_list_of_the_jobs_by_hand():
    jobs = set(CATALOG)
    found = []
    for path in sorted([*(ROOT / "qo_ops").rglob("*.py"), *(ROOT / "qo_ops_tests").rglob("*.py")]):
        if "migrations" in path.parts or path == ROOT / "qo_ops" / "jobs" / "catalog.py":
            continue  # the catalog is where the one list is declared
        tree = ast.parse(path.read_text())
        found += [f"{path.relative_to(ROOT)}:{line}" for line in hand_kept_lists(tree, jobs)]
    assert found == [], "derive the list from CATALOG"


def test_the_list_check_finds_a_hand_kept_list():
    names = ", ".join(repr(j) for j in sorted(CATALOG))
    assert hand_kept_lists(ast.parse(f"JOBS = ({names},)"), set(CATALOG)) == [1]
    assert hand_kept_lists(ast.parse(f"X = {{{names.replace(',', ': 1,')}: 1}}"), set(CATALOG))
    partial = ", ".join(repr(j) for j in sorted(CATALOG)[1:])
    assert hand_kept_lists(ast.parse(f"JOBS = [{partial}]"), set(CATALOG)) == []


# ------------------------------------------------------------- adding a job, tried for real

THROWAWAY_JOB = '''
"""throwaway_job: upper-case the currency of a tenant's quotes (a test's job, never shipped)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from qo_ops.db.schema import quote
from qo_ops.platform.job.outcome import BatchContext, BatchOutcome, OutcomeCheck
from qo_ops.platform.job.spec import CheckSpec, Deployment, JobSpec, Presentation

LOWER_CASE = quote.c.currency != sa.func.upper(quote.c.currency)


def lower_case_quotes(ctx: BatchContext) -> sa.Select[Any]:
    """Quotes of the tenant whose currency is not upper-case, by id (ix_quote_tenant_id)."""
    return (
        sa.select(quote.c.id)
        .where(quote.c.tenant_id == ctx.scope.tenant_id, LOWER_CASE)
        .order_by(quote.c.id)
    )


# Twice: a currency already upper-case matches nothing, so a second run writes nothing.
UPPER_CASE_BATCH = sa.text(
    "UPDATE quote SET currency = upper(currency) WHERE id = ANY(CAST(:ids AS bigint[])) "
    "AND tenant_id = :tenant AND currency <> upper(currency)"
)


def upper_case_batch(conn: Connection, ctx: BatchContext, ids: Sequence[Any]) -> BatchOutcome:
    params = {"ids": list(ids), "tenant": ctx.scope.tenant_id}
    changed = conn.execute(UPPER_CASE_BATCH, params).rowcount
    return BatchOutcome(succeeded=changed, skipped=len(ids) - changed)


NO_LOWER_CASE_CURRENCY = CheckSpec(
    "no_lower_case_currency", "No quote of the tenant has a lower-case currency"
)


def check_currencies(conn: Connection, ctx: BatchContext) -> list[OutcomeCheck]:
    left = conn.execute(
        sa.select(sa.func.count()).select_from(quote)
        .where(quote.c.tenant_id == ctx.scope.tenant_id, LOWER_CASE)
    ).scalar_one()
    return [NO_LOWER_CASE_CURRENCY.result(left == 0, {"lower_case_quotes": left})]


SPEC = JobSpec(
    name="throwaway_job",
    kind="repair",
    description="Upper-case the currency of quotes that have it in lower case",
    partitioning="tenant",
    eligible=lower_case_quotes,
    transition=upper_case_batch,
    check=check_currencies,
    checks=(NO_LOWER_CASE_CURRENCY,),
    presentation=Presentation(outcome_asset="quote_currencies", change="currency upper-cased"),
    deployment=Deployment(cron_schedule="0 3 * * *"),
)
'''

# Run in a fresh interpreter: the one line first (several modules bind CATALOG when imported),
# then what the section says derives from it. Facts go to a JSON file (argv[2]).
PROBE = """
import contextlib, io, json, sys
import qo_ops.jobs
from qo_ops.jobs import catalog

qo_ops.jobs.__path__.append(sys.argv[1])
catalog.JOBS += ("throwaway_job",)
catalog.CATALOG = catalog.Catalog(catalog.JOBS)

from qo_ops.cli import main
from qo_ops.db.engine import get_engine
from qo_ops.definitions import defs
from qo_ops.platform.job.options import RunOptions
from qo_ops.platform.job.scope import Scope
from qo_ops.platform.run.runner import run_job

def cli(*args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(args))
    return code, out.getvalue()

graph = defs.resolve_asset_graph()
facts = {
    "job": defs.resolve_job_def("throwaway_job").name,
    "schedule": defs.resolve_schedule_def("throwaway_job_schedule").cron_schedule,
    "checks": {k.name: graph.get_check_spec(k).description for k in graph.asset_check_keys},
    "scrape": cli("metrics", "--once"),
    "dry_run": cli("run", "throwaway_job", "--tenant", "tenant-001", "--json"),
}
spec = catalog.CATALOG["throwaway_job"]
for name in ("execute", "rerun"):
    options = RunOptions(mode="execute", requester="test:adding-a-job", reason="test run")
    summary = run_job(spec, Scope("tenant-001"), options, engine=get_engine())
    facts[name] = summary.as_dict()
json.dump(facts, open(sys.argv[2], "w"), default=str)
"""


def test_a_throwaway_job_added_as_the_docs_say_gets_everything(db, tmp_path):
    """Re-tries "Adding a job": a job module written as the section says (kept in a temp
    folder on ``qo_ops.jobs.__path__``) and its one line in ``JOBS`` give it a Dagster job,
    schedule and asset check, a ``qo-ops run`` that knows it, an end-to-end run on the
    database with its check passing, and zero series in the exporter's scrape."""
    load_demo_data(db.engine, tenants=1, quotes=50, seed=5, as_of=datetime(2026, 3, 1, tzinfo=UTC))
    with db.engine.begin() as conn:  # a few quotes the throwaway job has to repair
        planted = conn.execute(
            sa.text("UPDATE quote SET currency = lower(currency) WHERE id % 7 = 0")
        ).rowcount
    assert planted > 0
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "throwaway_job.py").write_text(THROWAWAY_JOB)
    out = tmp_path / "facts.json"
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "jobs"), str(out)],
        env=base_env(QO_OPS_DATABASE_URL=db.env_url),
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(out.read_text())

    assert facts["job"] == "throwaway_job"
    assert facts["schedule"] == "0 3 * * *"
    assert facts["checks"]["no_lower_case_currency"] == (
        "No quote of the tenant has a lower-case currency"
    )
    code, text = facts["dry_run"]
    dry_run = json.loads(text)
    assert (code, dry_run["status"], dry_run["eligible_count"]) == (0, "success", planted)
    execute, rerun = facts["execute"], facts["rerun"]
    assert (execute["status"], execute["succeeded_count"]) == ("success", planted)
    assert [(c["name"], c["passed"]) for c in execute["checks"]] == [
        ("no_lower_case_currency", True)
    ]
    assert (rerun["status"], rerun["succeeded_count"]) == ("no_work", 0)
    with db.engine.connect() as conn:
        left = conn.scalar(sa.text("SELECT count(*) FROM quote WHERE currency <> upper(currency)"))
    assert left == 0
    code, scrape = facts["scrape"]
    zeros = {
        s.name
        for family in text_string_to_metric_families(scrape)
        for s in family.samples
        if s.labels.get("job_name") == "throwaway_job" and s.value == 0
    }
    assert code == 0 and "job_started_total" in zeros, sorted(zeros)
