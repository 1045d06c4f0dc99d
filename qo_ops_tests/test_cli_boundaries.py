"""The command lines' boundaries: what they share is public and lives in ``qo_ops.cli_support``;
the sub-commands of other packages (``qo-ops api``, ``qo-ops downstream``, ``qo-ops metrics``)
never reach into ``qo_ops.cli``, which is put together from them; and a sub-command that also
runs alone (the downstream simulator, started as a process by the demo and the tests) loads
none of the ``qo-ops`` command."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from qo_ops_tests.conftest import REPO

PACKAGE = REPO / "qo_ops"


def _cli_modules() -> list[Path]:
    """Every command-line module: ``qo_ops/cli/``, ``cli_support.py`` and each ``cli.py``."""
    found = {*PACKAGE.glob("cli/*.py"), *PACKAGE.rglob("cli.py"), PACKAGE / "cli_support.py"}
    return sorted(found)


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, names, line) of each ``import`` / ``from … import`` in ``path``, lazy ones too."""
    found: list[tuple[str, list[str], int]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found.extend((a.name, [], node.lineno) for a in node.names)
    return found


def test_the_cli_modules_exist_where_this_test_looks():
    names = {p.relative_to(PACKAGE).as_posix() for p in _cli_modules()}
    assert {"cli/__init__.py", "cli_support.py", "api/cli.py", "downstream/cli.py"} <= names


def test_no_cli_module_imports_a_private_name_of_another_module():
    private = [
        f"{path.relative_to(REPO)}:{line}: from {module} import {name}"
        for path in _cli_modules()
        for module, names, line in _imports(path)
        if module.startswith("qo_ops")
        for name in names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert private == [], "make it public in qo_ops/cli_support.py:\n" + "\n".join(private)


def test_only_the_qo_ops_command_itself_imports_qo_ops_cli():
    reaching_in = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.parent != PACKAGE / "cli"
        for module, _, line in _imports(path)
        if module == "qo_ops.cli" or module.startswith("qo_ops.cli.")
    ]
    assert reaching_in == [], "\n".join(reaching_in)


def test_a_sub_command_run_alone_loads_none_of_the_qo_ops_command():
    probe = (
        "import sys, qo_ops.downstream.cli, qo_ops.api.cli, qo_ops.cli_support\n"
        "print(sorted(m for m in sys.modules if m == 'qo_ops.cli' or m.startswith('qo_ops.cli.')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert loaded.stdout.strip() == "[]", loaded.stdout
