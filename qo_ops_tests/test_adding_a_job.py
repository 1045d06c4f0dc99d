"""Adding a job is one module and one line (docs/platform.md, "Adding a job"): what the
section says one touches is there for every catalog job, and nothing else keeps a list of
the jobs by hand."""

from __future__ import annotations

import ast
import importlib
import re
import sys
import types
from pathlib import Path

import pytest

from qo_ops.jobs.catalog import CATALOG, Catalog

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
