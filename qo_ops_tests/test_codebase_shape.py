"""The codebase's shape, held (issues 22 and 43): no module of qo_ops/ outside the
migrations, and none of bench/, is longer than 700 lines, no function of qo_ops/platform/
takes more than 6 parameters, the platform, the jobs and the database layer never import
Dagster, no two modules of qo_ops import each other however indirectly (type-only and
function-level imports count), the job's vocabulary (qo_ops/platform/job/) imports nothing
else of qo_ops but its errors, and a run's status is written as a string only in its
enum's module."""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from pathlib import Path

from qo_ops.platform.job.statuses import RunStatus

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "qo_ops"
BENCH = ROOT / "bench"  # the benchmarks are held to the product's module limit too
MAX_LINES = 700
MAX_PARAMETERS = 6
FREE_OF_DAGSTER = ("platform", "jobs", "db")
VOCABULARY = "qo_ops.platform.job"
# What the vocabulary may import of qo_ops besides itself: the error classes, which import
# nothing of qo_ops (checked below), so the vocabulary stays the bottom layer.
VOCABULARY_MAY_IMPORT = ("qo_ops.errors",)
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
    bench = modules(BENCH)
    assert BENCH / "suite.py" in bench and BENCH / "nemesis" / "__main__.py" in bench
    assert too_long(modules(PACKAGE) + bench) == []


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


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(source: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``source`` imports anywhere: at the top, under
    ``TYPE_CHECKING``, or inside a function. ``from a.b import c`` imports ``a.b.c`` when it
    is a module, else ``a.b``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found |= {full} if full in known else {node.module} & known
    return found


def import_graph(root: Path, package: str = "qo_ops") -> dict[str, set[str]]:
    paths = {module_name(p, root): p for p in (root / package).rglob("*.py")}
    known = set(paths)
    return {name: imported(path.read_text(), known) - {name} for name, path in paths.items()}


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Every group of modules that import each other, however indirectly (Tarjan's strongly
    connected components with more than one module), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_two_modules_import_each_other():
    assert cycles(import_graph(ROOT)) == []


def test_the_job_vocabulary_imports_nothing_else_of_qo_ops():
    graph = import_graph(ROOT)
    outside = {
        f"{name} imports {other}"
        for name, imports in graph.items()
        if name == VOCABULARY or name.startswith(f"{VOCABULARY}.")
        for other in imports
        if not other.startswith(VOCABULARY) and other not in VOCABULARY_MAY_IMPORT
    }
    assert outside == set()
    assert VOCABULARY_MAY_IMPORT and all(
        graph[name] <= {"qo_ops"} for name in VOCABULARY_MAY_IMPORT
    )


def test_the_import_checks_find_what_breaks_them(tmp_path):
    package = tmp_path / "qo_ops"
    (package / "platform" / "job").mkdir(parents=True)
    for init in (package, package / "platform", package / "platform" / "job"):
        (init / "__init__.py").write_text("")
    (package / "a.py").write_text("from qo_ops import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from qo_ops.c import C\n"
    )
    (package / "c.py").write_text("def f():\n    from qo_ops.a import x\n")
    (package / "platform" / "job" / "spec.py").write_text("from qo_ops.platform.job import scope\n")
    (package / "platform" / "job" / "scope.py").write_text("from qo_ops.a import x\n")
    graph = import_graph(tmp_path)
    assert graph["qo_ops.b"] == {"qo_ops.c"} and graph["qo_ops.c"] == {"qo_ops.a"}
    assert cycles(graph) == [["qo_ops.a", "qo_ops.b", "qo_ops.c"]]
    assert graph["qo_ops.platform.job.spec"] == {"qo_ops.platform.job.scope"}
    assert graph["qo_ops.platform.job.scope"] == {"qo_ops.a"}  # what the vocabulary test refuses
    (package / "c.py").write_text("def f():\n    import json\n")
    assert cycles(import_graph(tmp_path)) == []


SHARED_HERE = ("__init__.py", "conftest.py")  # all qo_ops_tests/platform/ holds itself


def misplaced_platform_tests(package: Path, tests: Path) -> list[str]:
    """Where a reader looks for a platform module's tests: ``qo_ops_tests/platform/<group>/``
    beside ``qo_ops/platform/<group>/``, in ``test_<module>.py`` when named after a module,
    with a docstring naming a module of that group; none directly in qo_ops_tests/platform/."""
    modules = {
        init.parent.name: {m.stem for m in init.parent.glob("*.py")} - {"__init__"}
        for init in (package / "platform").glob("*/__init__.py")
    }
    group_of = {module: group for group, names in modules.items() for module in names}
    found = []
    for path in sorted((tests / "platform").rglob("*.py")):
        folder = path.parent.relative_to(tests / "platform").parts
        if (folder and not path.name.startswith("test_")) or path.name in SHARED_HERE:
            continue  # a group's helpers, or the fixtures every group shares
        module = path.stem.removeprefix("test_")
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        label = path.relative_to(tests.parent)
        if len(folder) != 1 or folder[0] not in modules:
            found.append(f"{label}: not in a folder named after a group of qo_ops/platform/")
        elif module in group_of and group_of[module] != folder[0]:
            found.append(f"{label}: belongs in qo_ops_tests/platform/{group_of[module]}/")
        elif not any(
            re.search(rf"qo_ops\.platform\.{folder[0]}\.{m}\b", doc) for m in modules[folder[0]]
        ):
            found.append(f"{label}: its docstring names no module of qo_ops/platform/{folder[0]}/")
    return found


def test_each_platform_test_file_sits_beside_the_module_it_tests():
    assert misplaced_platform_tests(PACKAGE, ROOT / "qo_ops_tests") == []


def test_a_misplaced_platform_test_file_is_found(tmp_path):
    for module in ("run/lease.py", "run/runner.py", "calls/retry.py"):
        (tmp_path / "qo_ops/platform" / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "qo_ops/platform" / module).touch()
        (tmp_path / "qo_ops/platform" / module).with_name("__init__.py").touch()
    planted = {
        "test_lease.py": '"""Tests ``qo_ops.platform.run.lease``."""',  # not in a group
        "run/test_lease.py": '"""Tests ``qo_ops.platform.run.lease``."""',  # well placed
        "calls/test_runner.py": '"""Tests ``qo_ops.platform.run.runner``."""',  # wrong group
        "run/test_restart.py": '"""Tests ``qo_ops.platform.calls.retry``."""',  # names none of run/
        "misc/test_retry.py": '"""Tests ``qo_ops.platform.calls.retry``."""',  # no such group
        "conftest.py": "",
        "helpers.py": "",  # not a test, still not in a group
    }
    for name, text in planted.items():
        (tmp_path / "qo_ops_tests/platform" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "qo_ops_tests/platform" / name).write_text(text)
    assert misplaced_platform_tests(tmp_path / "qo_ops", tmp_path / "qo_ops_tests") == [
        "qo_ops_tests/platform/calls/test_runner.py: belongs in qo_ops_tests/platform/run/",
        "qo_ops_tests/platform/helpers.py: not in a folder named after a group of qo_ops/platform/",
        "qo_ops_tests/platform/misc/test_retry.py: not in a folder named after a group of "
        "qo_ops/platform/",
        "qo_ops_tests/platform/run/test_restart.py: its docstring names no module of "
        "qo_ops/platform/run/",
        "qo_ops_tests/platform/test_lease.py: not in a folder named after a group of "
        "qo_ops/platform/",
    ]

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
