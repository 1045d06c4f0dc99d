"""The SQL convention, checked over every module of qo_ops/ (the migrations excepted):

- every module-level statement that writes — ``sa.text("…")`` whose SQL inserts, updates,
  deletes, truncates or copies from (also inside a WITH), or a Core ``insert``/``update``/
  ``delete`` — has a comment block directly above it with a sentence starting ``Twice:``
  saying why running it twice (a rerun, a rival, a retry) is safe;
- no statement's text is formatted: the SQL given to ``text()``, ``exec_driver_sql()`` or
  ``literal_column()`` is a string literal (or a module-level one, by name). Values are bound
  (``:name``, ``= ANY(:ids)``, ``make_interval(days => :days)``), never spliced in.

The one composition the convention allows is a shared fragment, where "the select and the
delete use the same predicate" is itself the safety property: an f-string whose every
interpolation names a module-level string literal (of its module, or imported from another
module of qo_ops) whose comment block says that it is shared. Anything else that formats
SQL is listed in ``ALLOWED``, with the reason.

``ast`` drops comments, so the comment blocks are read from the source lines.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import qo_ops

PACKAGE = Path(qo_ops.__file__).resolve().parent
ROOT = PACKAGE.parent

# Formatted SQL that stays: (path prefix, a piece of the argument's source, why). Matched by
# prefix and piece, so that an entry survives its code moving within a package; an entry
# nothing matches any more is harmless (delete it).
ALLOWED: list[tuple[str, str, str]] = [
    (
        "qo_ops/platform/runner",
        "SET LOCAL idle_in_transaction_session_timeout",
        "SET takes no bind parameters; the value is int() of the lease TTL",
    ),
    (
        "qo_ops/platform/lease",
        "SET LOCAL lock_timeout",
        "SET takes no bind parameters; the value is int() of a number (lease.acquire is the "
        "runner refactor's; set_config('lock_timeout', :ms, true) would serve)",
    ),
    (
        "qo_ops/db/engine",
        "ALTER SYSTEM SET",
        "ALTER SYSTEM takes no parameters (nor is it a session setting for set_config); "
        "names and values are the _EMBEDDED_SETTINGS constants",
    ),
    (
        "qo_ops/db/engine",
        "CREATE DATABASE",
        "an identifier, the database's name; utility statements take no parameters",
    ),
    (
        "qo_ops/db/digest",
        "string_agg(md5(t::text)",
        "identifiers (a table's name and key columns from the schema); ``where`` is SQL the "
        "tests write over alias t, with their values bound",
    ),
    (
        "qo_ops/platform/run/selection",
        "statement.replace",
        "the runner's own selection of a batch (JobSpec.eligible, LIMIT, locks), compiled by "
        "SQLAlchemy with its values bound (:name), into a module-level statement's "
        "{selection} slot (Batching.claims)",
    ),
    ("qo_ops/cli", "SELECT count(*) FROM {t.name}", "an identifier: a schema table's name"),
    ("qo_ops/demo/data", "DROP INDEX {name}", "identifiers: the load drops the tables' indexes"),
    ("qo_ops/demo/data", "ddl", "the load re-creates each index from its own pg_get_indexdef"),
    (
        "qo_ops/demo/data",
        "TRUNCATE {names}",
        "identifiers: schema tables' names, quoted by the dialect's identifier preparer "
        "(TRUNCATE takes no bind parameters; SQLAlchemy has no construct for it)",
    ),
    (
        "qo_ops/demo/data",
        "_typed_params(sql)",
        "the loader's module-level STATEMENTS, with CASTs added to their named parameters",
    ),
    ("qo_ops/demo/data", "pg_get_serial_sequence", "identifiers: _EXPLICIT_ID_TABLES"),
    *(
        (
            "qo_ops/metrics/feed",
            counts,
            "one FILTER per constant bucket bound of a histogram (no run value)",
        )
        for counts in ("_BUCKET_COUNTS", "_DRIFT_COUNTS", "_LOCK_COUNTS", "_DELAY_COUNTS")
    ),
]

SQL_CALLS = {"text", "literal_column"}  # sqlalchemy's, however imported
DRIVER_CALLS = {"exec_driver_sql"}  # a Connection's method
CORE_WRITES = {"insert", "update", "delete"}  # sqlalchemy's and its dialects'

_COMMENT = re.compile(r"--[^\n]*|/\*.*?\*/", re.S)
_QUOTED = re.compile(r"'(?:[^']|'')*'|\$(\w*)\$.*?\$\1\$", re.S)
_LOCKING = re.compile(r"\bFOR\s+(?:NO\s+KEY\s+)?UPDATE\b", re.I)  # a row lock, not a write
_WRITES = re.compile(
    r"\b(?:INSERT|UPDATE|DELETE|TRUNCATE|MERGE)\b"
    r"|\bCOPY\s+[\w.\"]+\s*(?:\([^)]*\)\s*)?FROM\b",  # COPY table FROM; COPY (query) TO reads
    re.I,
)
_SHARED = re.compile(r"\bshar(?:e|ed|es|ing)\b", re.I)


def writes(sql: str) -> bool:
    """Whether ``sql`` changes data: its comments, quoted strings and row locks stripped,
    an INSERT/UPDATE/DELETE/TRUNCATE/MERGE or COPY … FROM anywhere — the statement after
    an optional WITH, or a data-modifying CTE inside it."""
    bare = _LOCKING.sub(" ", _QUOTED.sub("''", _COMMENT.sub(" ", sql)))
    return bool(_WRITES.search(bare))


@dataclass(frozen=True)
class Module:
    rel: str  # qo_ops/jobs/x.py
    dotted: str  # qo_ops.jobs.x
    source: str
    lines: list[str]
    tree: ast.Module
    strings: dict[str, tuple[str, int]]  # module-level name → (string literal, line)
    aliases: dict[str, str]  # local name → what it imports, e.g. sa → sqlalchemy

    def resolve(self, node: ast.expr) -> str | None:
        """The dotted name ``node`` refers to, through the module's imports."""
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        parts.append(self.aliases.get(node.id, node.id))
        return ".".join(reversed(parts))

    def comment_above(self, line: int) -> str:
        """The comment block directly above source line ``line`` (no blank line between)."""
        block: list[str] = []
        i = line - 2
        while i >= 0 and self.lines[i].lstrip().startswith("#"):
            block.insert(0, self.lines[i].lstrip().lstrip("#").strip())
            i -= 1
        return " ".join(block)


def _assignment(node: ast.stmt) -> tuple[str | None, ast.expr | None]:
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target = node.targets[0]
        return (target.id if isinstance(target, ast.Name) else None), node.value
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id, node.value
    return None, None


def _module(path: Path) -> Module:
    source = path.read_text()
    tree = ast.parse(source, str(path))
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = (
                    a.name if a.asname else a.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    strings = {}
    for node in tree.body:
        name, value = _assignment(node)
        if name and isinstance(value, ast.Constant) and isinstance(value.value, str):
            strings[name] = (value.value, node.lineno)
    rel = path.relative_to(ROOT).as_posix()
    dotted = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    return Module(rel, dotted, source, source.splitlines(), tree, strings, aliases)


MODULES = [
    _module(p)
    for p in sorted(PACKAGE.rglob("*.py"))
    if "migrations" not in p.relative_to(PACKAGE).parts
]
BY_DOTTED = {m.dotted: m for m in MODULES}


def shared_fragment(module: Module, name: str) -> str | None:
    """The SQL of ``name`` if it is a shared fragment: a module-level string literal of this
    module, or of the qo_ops module it is imported from, whose comment says it is shared."""
    owner = module
    if name not in module.strings:
        target = module.aliases.get(name, "")
        owner_name, _, name = target.rpartition(".")
        found = BY_DOTTED.get(owner_name)
        if found is None or name not in found.strings:
            return None
        owner = found
    text, line = owner.strings[name]
    return text if _SHARED.search(owner.comment_above(line)) else None


def sql_text(module: Module, arg: ast.expr) -> str | None:
    """The SQL of an argument that is not formatted (shared fragments put in); else None."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.Name) and arg.id in module.strings:
        return module.strings[arg.id][0]
    if not isinstance(arg, ast.JoinedStr):
        return None
    parts = []
    for value in arg.values:
        if isinstance(value, ast.Constant):
            parts.append(str(value.value))
            continue
        if not (
            isinstance(value, ast.FormattedValue)
            and isinstance(value.value, ast.Name)
            and value.conversion == -1
            and value.format_spec is None
        ):
            return None  # an expression, a conversion or a format: not a plain name
        fragment = shared_fragment(module, value.value.id)
        if fragment is None:
            return None
        parts.append(fragment)
    return "".join(parts)


def _root_call(node: ast.expr) -> ast.Call | None:
    """The innermost call of a chain such as ``sa.text("…").bindparams(…).columns(…)``."""
    found = None
    while isinstance(node, ast.Call):
        found = node
        if isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Call):
            node = node.func.value
        else:
            break
    return found


def _is_sqlalchemy(module: Module, func: ast.expr, names: set[str]) -> bool:
    name = module.resolve(func) or ""
    return name.split(".")[0] == "sqlalchemy" and name.rsplit(".", 1)[-1] in names


def _allowed(module: Module, arg: ast.expr) -> bool:
    piece = ast.get_source_segment(module.source, arg) or ""
    return any(module.rel.startswith(prefix) and text in piece for prefix, text, _ in ALLOWED)


def formatted_sql(module: Module) -> list[str]:
    """``file:line: call(…)`` for every SQL argument that is formatted and not allowed."""
    found = []
    for node in ast.walk(module.tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        driver = isinstance(func, ast.Attribute) and func.attr in DRIVER_CALLS
        if not (driver or _is_sqlalchemy(module, func, SQL_CALLS)):
            continue
        arg = node.args[0]
        if sql_text(module, arg) is None and not _allowed(module, arg):
            snippet = (ast.get_source_segment(module.source, arg) or "")[:60]
            found.append(f"{module.rel}:{node.lineno}: {ast.unparse(func)}({snippet!r})")
    return found


def writing_statements(module: Module) -> Iterator[tuple[int, str]]:
    """(line, name) of each module-level statement that writes."""
    for node in module.tree.body:
        name, value = _assignment(node)
        call = _root_call(value) if name and value is not None else None
        if call is None:
            continue
        if _is_sqlalchemy(module, call.func, {"text"}) and call.args:
            sql = sql_text(module, call.args[0])
            if sql is not None and writes(sql):
                yield node.lineno, str(name)
        elif _is_sqlalchemy(module, call.func, CORE_WRITES):
            yield node.lineno, str(name)


def test_the_walk_sees_the_package():
    rels = {m.rel for m in MODULES}
    assert "qo_ops/platform/run/lease.py" in rels and "qo_ops/jobs/quote_expiration.py" in rels
    assert not any("/migrations/" in r for r in rels)
    # it finds what it must: the lease's acquire and the retention's composed delete
    lease, retention = (
        BY_DOTTED["qo_ops.platform.run.lease"],
        BY_DOTTED["qo_ops.jobs.run_history_retention"],
    )
    assert "_ACQUIRE" in {name for _, name in writing_statements(lease)}
    assert "PRUNE_HISTORY_BATCH" in {name for _, name in writing_statements(retention)}


def test_every_writing_statement_says_why_it_is_safe_twice():
    missing = [
        f"{m.rel}:{line}: {name}"
        for m in MODULES
        for line, name in writing_statements(m)
        if not re.search(r"(?<!\S)Twice:", m.comment_above(line))
    ]
    assert not missing, (
        "module-level statements that write need a comment block directly above them with a "
        "`Twice:` sentence (why running them twice is safe):\n" + "\n".join(missing)
    )


def test_no_statement_text_is_formatted():
    found = [f for m in MODULES for f in formatted_sql(m)]
    assert not found, (
        "SQL text must be a literal with bound values (or put together from shared fragments "
        "whose comment says so); formatted:\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        ("SELECT id FROM quote WHERE status = 'ACTIVE' FOR UPDATE SKIP LOCKED", False),
        ("SELECT 1 -- DELETE FROM x\n", False),
        ("SELECT 'UPDATE' AS word", False),
        ("SELECT count(*) FROM job_run WHERE updated_at < now()", False),
        ("COPY (SELECT id FROM audit_record WHERE id = ANY(:ids)) TO STDOUT", False),
        ("UPDATE job_lease SET expires_at = now()", True),
        ("WITH gone AS (DELETE FROM t RETURNING id) SELECT count(*) FROM gone", True),
        ("INSERT INTO t VALUES (1) ON CONFLICT DO NOTHING", True),
        ("COPY audit_record (id, tenant_id) FROM STDIN", True),
        ("TRUNCATE a, b", True),
    ],
)
def test_what_counts_as_a_write(sql, expected):
    assert writes(sql) is expected
