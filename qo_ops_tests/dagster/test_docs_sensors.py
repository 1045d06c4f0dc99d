"""docs/dagster.md says how each schedule and sensor starts in a new instance: its table
("Schedules and sensors", column `starts`) must name every one of the code location's
schedules and sensors with its ``default_status``."""

from __future__ import annotations

import re

import dagster as dg

from qo_ops.definitions import build_definitions
from qo_ops_tests.conftest import REPO

STARTS = {"running": "RUNNING", "stopped": "STOPPED"}


def doc_table() -> dict[str, str]:
    """name (``<job>_…`` for one row per catalog job) -> starts, from docs/dagster.md."""
    text = (REPO / "docs" / "dagster.md").read_text()
    section = text.split("\n## Schedules and sensors\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| (\w+) \|", section, re.M)
    assert rows, "no table with a `starts` column under 'Schedules and sensors'"
    return dict(rows)


def documented_starts(name: str, table: dict[str, str]) -> str | None:
    if name in table:
        return table[name]
    for pattern, starts in table.items():  # `<job>_backlog_sensor` covers every job's
        if pattern.startswith("<job>") and name.endswith(pattern.removeprefix("<job>")):
            return starts
    return None


def test_the_docs_say_how_every_schedule_and_sensor_starts():
    repo = build_definitions().get_repository_def()
    table = doc_table()
    assert set(table.values()) <= set(STARTS), table
    found: dict[str, str | None] = {}
    actual: dict[str, str] = {}
    for definition in [*repo.schedule_defs, *repo.sensor_defs]:
        found[definition.name] = documented_starts(definition.name, table)
        status: dg.DefaultSensorStatus | dg.DefaultScheduleStatus = definition.default_status
        actual[definition.name] = status.name
    assert [n for n, s in found.items() if s is None] == []  # every one documented
    wrong = {n: (found[n], actual[n]) for n in found if STARTS[found[n] or ""] != actual[n]}
    assert wrong == {}, "docs/dagster.md says (starts, but the code has): " + repr(wrong)
