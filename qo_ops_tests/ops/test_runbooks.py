"""The runbooks never tell an operator to write to the database by hand: every recovery is a
command (``qo-ops requeue``, ``review``, ``checkpoint``, ``cancel``, ``suspend`` …) that
validates, audits in its own transaction and has a dry run. SQL reads for diagnosis stay.

A write is an SQL statement that changes rows or tables (``UPDATE … SET``, ``DELETE FROM``,
``INSERT INTO``, ``TRUNCATE``) anywhere in a runbook, in any case, or one of those keywords
in upper case inside code (a fenced block or an inline code span), where SQL is written.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qo_ops_tests.conftest import REPO

RUNBOOKS = sorted((REPO / "docs" / "runbooks").glob("*.md"))
STATEMENT = re.compile(
    r"\b(update\s+[\w.\"]+(\s+(as\s+)?\w+)?\s+set|delete\s+from|insert\s+into|truncate(\s+table)?\s+[\w.\"]+)\b",
    re.IGNORECASE,
)
KEYWORD = re.compile(r"\b(UPDATE|DELETE|INSERT|TRUNCATE)\b")
FENCED = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`([^`\n]+)`")


def sql_writes(text: str) -> list[str]:
    """The lines of ``text`` that write to the database in SQL, as found."""
    code = [m.group(1) for m in FENCED.finditer(text)]
    prose = FENCED.sub("", text)
    code += [m.group(1) for m in INLINE.finditer(prose)]
    found = [line.strip() for line in text.splitlines() if STATEMENT.search(line)]
    found += [line.strip() for block in code for line in block.splitlines() if KEYWORD.search(line)]
    return list(dict.fromkeys(found))


def test_there_are_runbooks_to_read():
    names = {p.stem for p in RUNBOOKS}
    assert {"README", "notification_publish", "order_reconciliation"} <= names
    assert "pricing_snapshot_recalculation" in names and len(RUNBOOKS) >= 12


@pytest.mark.parametrize("runbook", RUNBOOKS, ids=lambda p: p.name)
def test_no_runbook_writes_to_the_database_in_sql(runbook: Path):
    assert sql_writes(runbook.read_text()) == [], (
        f"{runbook.name} tells an operator to write SQL by hand: use (or build) a qo-ops "
        "command for it (docs/runbooks/README.md)"
    )


@pytest.mark.parametrize(
    "planted",
    [
        # the three writes the runbooks held before the recovery commands
        "```sql\nBEGIN;\nUPDATE outbox_event SET dead_lettered_at = NULL, publish_attempts = 0\n"
        " WHERE tenant_id = 'T';\nCOMMIT;\n```",
        "`UPDATE customer_order SET needs_manual_review = false WHERE tenant_id = 'T';`",
        "```sql\nDELETE FROM job_checkpoint\n WHERE job_name = 'pricing_snapshot_recalculation';\n```",
        "```sql\nINSERT INTO job_audit (actor) VALUES ('you');\n```",
        "then run truncate table job_lease as the owner",
        "```sh\npsql -c 'delete from job_lease'\n```",
        "```sql\nupdate job_run r set status = 'failed'\n```",
        "the statement `UPDATE … RETURNING` moves it",  # a keyword in code, described
    ],
)
def test_a_planted_write_is_found(planted: str):
    text = f"# A runbook\n\nDiagnose first:\n\n```sql\nSELECT 1;\n```\n\n{planted}\n"
    assert sql_writes(text), planted


def test_reads_and_prose_are_allowed():
    text = (
        "The job's update is conditional; never delete `job_lease` rows by hand.\n\n"
        "```sql\nSELECT id FROM outbox_event WHERE dead_lettered_at IS NOT NULL;\n"
        "SELECT * FROM job_audit WHERE action = 'requeue' ORDER BY id DESC LIMIT 5;\n```\n"
        "`qo-ops checkpoint reset pricing_snapshot_recalculation --tenant T --reason …`\n"
    )
    assert sql_writes(text) == []
