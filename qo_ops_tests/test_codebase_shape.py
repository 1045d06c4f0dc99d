"""The codebase's shape, held (issue 22): no module of qo_ops/ outside the migrations is
longer than 700 lines, no function of qo_ops/platform/ takes more than 6 parameters, the
platform, the jobs and the database layer never import Dagster, and a run's status is
written as a string only in its enum's module (issue 43)."""

from __future__ import annotations

import ast
from pathlib import Path

from qo_ops.platform.job.statuses import RunStatus

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "qo_ops"
MAX_LINES = 700
MAX_PARAMETERS = 6
FREE_OF_DAGSTER = ("platform", "jobs", "db")
STATUSES_MODULE = PACKAGE / "platform" / "job" / "statuses.py"
# The string constants equal to a run status that are not one: each a word of another
# vocabulary, named once in the module that owns it. (module, value): why.
OTHER_VOCABULARIES: dict[tuple[str, str], str] = {
    ("qo_ops/platform/job/counts.py", "failed"): "a counter's name (items failed)",
    ("qo_ops/platform/job/counts.py", "skipped"): "a counter's name (items skipped)",
    ("qo_ops/platform/job/outcome.py", "success"): "a side effect's result (SideEffectResult)",
    ("qo_ops/platform/job/outcome.py", "failed"): "a side effect's result (SideEffectResult)",
    ("qo_ops/platform/job/labels.py", "timeout"): "a call's failure code (CALL_TIMEOUT)",
    ("qo_ops/downstream/transport.py", "timeout"): "the same call failure code, where the "
    "bare transport (which imports nothing of qo_ops) raises it",
    ("qo_ops/downstream/simulator/store.py", "timeout"): "a fault the simulator injects",
    ("qo_ops/db/migrate.py", "failed"): "a schema upgrade's outcome (UPGRADE_FAILED)",
    ("qo_ops/db/schema/platform_tables.py", "failed"): "schema_migration.outcome's check "
    "(UPGRADE_OUTCOMES)",
    ("qo_ops/jobs/order_reconciliation.py", "failed"): "a mismatch's action outcome "
    "(ACTION_FAILED)",
    ("qo_ops/dagster_defs/backfills.py", "accepted"): "an audit decision (free text)",
    ("qo_ops/dagster_defs/jobs.py", "failed"): "a column of the tenants table: items failed",
    ("qo_ops/cli/runs.py", "failed"): "a column header: items failed",
    ("qo_ops/cli/runs.py", "running"): "a column header: runs in progress",
}


def modules(under: Path) -> list[Path]:
    return sorted(p for p in under.rglob("*.py") if "migrations" not in p.parts)


def too_long(paths: list[Path], limit: int = MAX_LINES) -> list[str]:
    found = []
    for path in paths:
        lines = len(path.read_text().splitlines())
        if lines > limit:
            label = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            found.append(f"{label}: {lines} lines")
    return found


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """What a caller passes: positional, keyword-only and starred parameters, not self/cls."""
    a = node.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    if names and names[0].arg in ("self", "cls"):
        names = names[1:]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def too_many_parameters(source: str, limit: int = MAX_PARAMETERS) -> list[tuple[str, int]]:
    tree = ast.parse(source)
    return [
        (node.name, parameters(node))
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and parameters(node) > limit
    ]


def dagster_imports(source: str) -> list[int]:
    found = []
    for node in ast.walk(ast.parse(source)):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        if any(n == "dagster" or n.startswith(("dagster.", "dagster_")) for n in names):
            found.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "qo_ops.dagster_defs"
        ):
            found.append(node.lineno)
    return found


def status_literals(source: str) -> list[tuple[int, str]]:
    """Each string constant that *is* a run status (equal to a value of RunStatus): a
    status written as a bare string. SQL text and docstrings that mention one are longer,
    so never equal to one."""
    values = {s.value for s in RunStatus}
    return [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in values
    ]


def test_no_module_is_longer_than_700_lines():
    assert too_long(modules(PACKAGE)) == []


def test_no_platform_function_takes_more_than_6_parameters():
    found = [
        f"{path.relative_to(ROOT)}: {name} takes {n}"
        for path in modules(PACKAGE / "platform")
        for name, n in too_many_parameters(path.read_text())
    ]
    assert found == []


def test_the_platform_the_jobs_and_the_database_never_import_dagster():
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for part in FREE_OF_DAGSTER
        for path in modules(PACKAGE / part)
        for line in dagster_imports(path.read_text())
    ]
    assert found == []


def test_a_run_status_is_written_only_as_a_run_status():
    """Python names a run's status through RunStatus (qo_ops/platform/job/statuses.py); SQL
    text may write one. A word of another vocabulary that is spelled like a status is
    listed in OTHER_VOCABULARIES, with its owner."""
    found, used = [], set()
    for path in modules(PACKAGE):
        if path == STATUSES_MODULE:
            continue
        label = str(path.relative_to(ROOT))
        for line, value in status_literals(path.read_text()):
            if (label, value) in OTHER_VOCABULARIES:
                used.add((label, value))
            else:
                found.append(f"{label}:{line}: {value!r}")
    assert found == []
    assert set(OTHER_VOCABULARIES) - used == set()  # an exemption nothing needs any more


def test_the_checks_find_what_breaks_them(tmp_path):
    long = tmp_path / "long.py"
    long.write_text("x = 1\n" * (MAX_LINES + 1))
    assert too_long([long]) == [f"{long}: 701 lines"]
    long.write_text("x = 1\n" * MAX_LINES)
    assert too_long([long]) == []
    assert too_many_parameters("def f(a, b, c, d, e, f, *, g): ...") == [("f", 7)]
    assert too_many_parameters("class C:\n    def m(self, a, b, c, d, e, f): ...") == []
    assert too_many_parameters("def f(*args, **kwargs): ...") == []
    assert dagster_imports("import dagster as dg") == [1]
    assert dagster_imports("from dagster_postgres import x") == [1]
    assert dagster_imports("from qo_ops.dagster_defs.partitions import y") == [1]
    assert dagster_imports("import dagsterish\nfrom qo_ops.platform import spec") == []
    assert status_literals('if summary.status == "partial_success":\n    x = ("no_work",)') == [
        (1, "partial_success"),
        (2, "no_work"),
    ]
    assert (
        status_literals(
            '"""Ends success or failed."""\nq = sa.text("SELECT 1 WHERE status = \'running\'")\n'
            "ok = RunStatus.SUCCESS\nname = 'successful'"
        )
        == []
    )
