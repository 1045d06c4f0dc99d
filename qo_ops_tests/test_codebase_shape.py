"""The codebase's shape, held (issue 22): no module of qo_ops/ outside the migrations, and no
module of bench/ (issue 43), is longer than 700 lines, no function of qo_ops/platform/ takes more than 6 parameters, and
the platform, the jobs and the database layer never import Dagster."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "qo_ops"
BENCH = ROOT / "bench"  # the benchmarks are held to the product's module limit too
MAX_LINES = 700
MAX_PARAMETERS = 6
FREE_OF_DAGSTER = ("platform", "jobs", "db")


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
