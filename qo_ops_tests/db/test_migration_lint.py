"""Every Alembic revision's SQL passes squawk, the PostgreSQL migration linter, and the lint
can fail.

The SQL linted is what each revision really executes: an empty database is upgraded one
revision at a time and every statement the engine sends is captured, parameters rendered as
the driver renders them, with the transaction's BEGIN and COMMIT from the engine's events.
The migration runner's bookkeeping is left out (its version tables, its record of the
upgrade, its advisory lock, the catalog queries); its ``SET lock_timeout`` /
``SET statement_timeout`` stay, so squawk's timeout rules see them. The configuration is
``qo_ops/db/migrations/squawk.toml``.

Revisions up to :data:`BASELINE_ENDS` were applied to deployed databases before the lint:
``qo_ops/db/migrations/lint_baseline.toml`` keeps those squawk finds something in, one line
each naming exactly what (rule and count). A newer revision may not be baselined: it must be
clean. A planted unsafe migration shows the same lint failing.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
from alembic.script import ScriptDirectory

from qo_ops.db import migrate

SQUAWK = Path(sys.executable).with_name("squawk")  # the squawk-cli dev dependency
CONFIG = migrate.MIGRATIONS_DIR / "squawk.toml"
BASELINE = migrate.MIGRATIONS_DIR / "lint_baseline.toml"
BASELINE_ENDS = "0017"  # the last revision applied before the lint; never moves
# the settings squawk 2.x reads; it ignores any other key silently (a typo excludes nothing)
CONFIG_KEYS = {
    "excluded_paths",
    "excluded_rules",
    "included_rules",
    "pg_version",
    "assume_in_transaction",
    "upload_to_github",
}
RULE = re.compile(r"[a-z]+(?:-[a-z]+)+")

# The runner's bookkeeping, not the revision's: writes to its version tables and its record
# of each upgrade, its advisory lock, and the catalog queries it and Alembic read state with.
VERSION_TABLES = r"(?:qo_ops_alembic_version|qo_ops_schema_version)"
BOOKKEEPING = re.compile(
    r"^\s*(?:(?:CREATE TABLE(?: IF NOT EXISTS)?|INSERT INTO|UPDATE|DELETE FROM)\s+"
    rf"{VERSION_TABLES}|(?:INSERT INTO|UPDATE)\s+schema_migration)\b",
    re.I,
)
READS = re.compile(
    rf"^\s*(?:SELECT|SHOW)\b.*\b(?:pg_catalog|information_schema|to_regclass|current_schema"
    rf"|pg_advisory\w*|{VERSION_TABLES})\b",
    re.I | re.S,
)


def revisions() -> list[str]:
    """Every revision, oldest first."""
    script = ScriptDirectory(str(migrate.MIGRATIONS_DIR))
    return [s.revision for s in reversed(list(script.walk_revisions()))]


def baseline() -> dict[str, str]:
    """Baselined revision -> its one-line reason."""
    return dict(tomllib.loads(BASELINE.read_text(encoding="utf-8"))["baseline"])


def named_in(reason: str) -> Counter[str]:
    """The findings a baseline reason names before its first colon: ``rule-name`` (once) or
    ``rule-name xN``, separated by commas."""
    found: Counter[str] = Counter()
    for item in reason.partition(":")[0].split(","):
        rule, _, times = item.strip().partition(" x")
        found[rule] = int(times or 1)
    return found


def _render(cursor: Any, statement: str, parameters: Any) -> str:
    """The statement with its parameters in it, as psycopg's client-side binding writes them
    (``%%`` unescaped too); as sent when there are none."""
    if parameters is None:
        return statement
    return psycopg.ClientCursor(cursor.connection).mogrify(statement, parameters)


@dataclass
class Capture:
    """The SQL an engine executes, in the order it commits: each connection's transaction is
    kept whole (BEGIN … COMMIT) when it holds a statement of the revision, dropped when it
    holds none or rolls back; statements outside a transaction (autocommit) as they run."""

    statements: list[str] = field(default_factory=list)
    bookkeeping: int = 0  # the runner's version-table writes seen on this engine
    open: dict[sa.Connection, list[str]] = field(default_factory=dict)

    @staticmethod
    def _autocommit(conn: sa.Connection) -> bool:
        return bool(getattr(conn.connection.dbapi_connection, "autocommit", False))

    def begin(self, conn: sa.Connection) -> None:
        if not self._autocommit(conn):  # an autocommit block's "transaction" is none
            self.open[conn] = []

    def commit(self, conn: sa.Connection) -> None:
        kept = self.open.pop(conn, [])
        if kept:
            self.statements.extend(["BEGIN", *kept, "COMMIT"])

    def rollback(self, conn: sa.Connection) -> None:
        self.open.pop(conn, None)  # undone: none of it was applied

    def execute(  # SQLAlchemy's before_cursor_execute
        self,
        conn: sa.Connection,
        cursor: Any,
        statement: str,
        parameters: Any,
        context: Any,
        executemany: bool,
    ) -> None:
        if BOOKKEEPING.match(statement):
            self.bookkeeping += 1
            return
        if READS.match(statement):
            return
        kept = self.open.get(conn, self.statements)
        for params in parameters if executemany else [parameters]:
            kept.append(_render(cursor, statement, params))

    def attach(self, engine: sa.Engine) -> None:
        sa.event.listen(engine, "before_cursor_execute", self.execute)
        for name in ("begin", "commit", "rollback"):
            sa.event.listen(engine, name, getattr(self, name))


@dataclass
class SqlFile:
    """One revision's SQL as written for squawk, and the line each statement starts on."""

    path: Path
    starts: list[tuple[int, str]]  # (0-based line, statement)

    def statement_at(self, line: int) -> str:
        found = [s for start, s in self.starts if start <= line]
        return found[-1] if found else "?"


def write_sql(path: Path, statements: list[str]) -> SqlFile:
    lines: list[str] = []
    starts = []
    for statement in statements:
        text = statement.strip()
        text = text if text.endswith(";") else text + ";"
        starts.append((len(lines), text))
        lines.extend(text.splitlines())
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return SqlFile(path, starts)


def capture_revisions(engine: sa.Engine, out: Path) -> dict[str, SqlFile]:
    """Upgrade ``engine``'s empty database one revision at a time; each revision's SQL."""
    capture = Capture()
    capture.attach(engine)
    files = {}
    for rev in revisions():
        capture.statements, capture.bookkeeping = [], 0
        migrate.upgrade(engine, rev)
        assert capture.bookkeeping, f"{rev}: the runner's version table not seen on this engine"
        assert capture.statements and not capture.open, f"{rev}: no SQL, or a transaction open"
        files[rev] = write_sql(out / f"{rev}.sql", capture.statements)
    assert migrate.current_revision(engine) == migrate.head_revision()
    return files


@dataclass
class Finding:
    file: str
    line: int  # 0-based
    rule: str
    message: str


def squawk(paths: list[Path], cwd: Path) -> tuple[int, list[Finding], str]:
    """squawk's exit code, its findings and its raw output, over ``paths``."""
    assert SQUAWK.exists(), f"{SQUAWK} missing: pip install -c constraints.txt -e '.[dev]'"
    proc = subprocess.run(
        [str(SQUAWK), "--config", str(CONFIG), "--reporter", "json", *map(str, paths)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    output = proc.stdout + proc.stderr
    assert proc.stdout.strip(), f"squawk printed no report (exit {proc.returncode}): {output}"
    found = [
        Finding(Path(f["file"]).name, f["line"], f["rule_name"], f["message"])
        for f in json.loads(proc.stdout)
    ]
    return proc.returncode, found, output


def test_every_revision_passes_squawk_unless_baselined(empty_db, tmp_path):
    files = capture_revisions(empty_db.engine, tmp_path)
    code, findings, output = squawk([f.path for f in files.values()], tmp_path)
    by_rev: dict[str, Counter[str]] = {rev: Counter() for rev in files}
    unexpected = []
    for f in findings:
        rev = f.file.removesuffix(".sql")
        by_rev[rev][f.rule] += 1
        if rev not in baseline():
            statement = files[rev].statement_at(f.line).splitlines()[0]
            unexpected.append(f"{rev} line {f.line + 1}: {f.rule}: {f.message} [{statement}]")
    assert not unexpected, "squawk findings:\n" + "\n".join(unexpected)
    assert code == (1 if findings else 0), output
    for rev, reason in baseline().items():
        assert by_rev[rev] == named_in(reason), f"{rev}: squawk finds {dict(by_rev[rev])}"


def test_the_baseline_holds_only_old_revisions_each_with_a_reason():
    known = revisions()
    for rev, reason in baseline().items():
        assert rev in known, f"{rev} is baselined but is no revision"
        assert rev <= BASELINE_ENDS, f"{rev} is newer than the lint: fix it, never baseline it"
        assert reason.strip() and "\n" not in reason, f"{rev}: one line of reason"
        named = named_in(reason)
        assert named and all(RULE.fullmatch(r) for r in named), f"{rev}: '<findings>: <where>'"
    config = tomllib.loads(CONFIG.read_text(encoding="utf-8"))
    assert set(config) <= CONFIG_KEYS, f"unknown squawk settings {set(config) - CONFIG_KEYS}"
    # each excluded rule has its own comment line just above it, saying why
    text = CONFIG.read_text(encoding="utf-8")
    for rule in config.get("excluded_rules", []):
        assert re.search(rf'#[^\n]*\S[^\n]*\n\s*"{rule}"', text), f"{rule}: say why, just above"


PLANTED = "CREATE INDEX ix ON audit_record (tenant_id);\n"  # no CONCURRENTLY, no timeouts


def test_a_planted_unsafe_migration_fails_the_lint(tmp_path):
    planted = tmp_path / "9999.sql"
    planted.write_text(PLANTED, encoding="utf-8")
    code, findings, output = squawk([planted], tmp_path)
    assert code != 0, output
    # squawk 2.70 reports require-timeout-settings as its two halves, one rule each
    unsafe = {
        "require-concurrent-index-creation",
        "require-lock-timeout",
        "require-statement-timeout",
    }
    assert unsafe <= {f.rule for f in findings}, output
