"""One way to write a date range where a person reads it: the days covered, the last one
included (as `qo-ops run --from/--to` and a backfill's plan take them), while the database
keeps its end-exclusive scope keys.

Tests ``qo_ops.platform.job.scope`` (``scope_text``) and ``qo_ops.errors.age_text``.
"""

from datetime import date

import pytest

from qo_ops.errors import BadInput, age_text
from qo_ops.platform.job.scope import Scope, scope_text


@pytest.mark.parametrize(
    ("key", "shown"),
    [
        ("tenant-001", "tenant-001"),  # a tenant job's scope
        ("tenant-001/2026-12-01..2026-12-02", "tenant-001/2026-12-01"),  # `--date 2026-12-01`
        ("tenant-001/2026-11-20..2026-12-05", "tenant-001/2026-11-20..2026-12-04"),
        ("tenant-001/2026-12-31..2027-01-01", "tenant-001/2026-12-31"),  # across a year
        ("2: tenant-001..tenant-002", "2: tenant-001..tenant-002"),  # a chunk: not a window
        ("tenant-001/not-a-day..2026-12-02", "tenant-001/not-a-day..2026-12-02"),
    ],
)
def test_a_scope_key_reads_as_the_days_it_covers(key, shown):
    assert scope_text(key) == shown


def test_a_scope_of_days_reads_as_the_days_it_was_given():
    first, last = date(2026, 11, 20), date(2026, 12, 4)
    scope = Scope.days("tenant-001", first, last)
    assert scope.key == "tenant-001/2026-11-20..2026-12-05"  # the database's form, unchanged
    assert scope.text == "tenant-001/2026-11-20..2026-12-04"
    assert Scope.days("tenant-001", first, first).text == "tenant-001/2026-11-20"


@pytest.mark.parametrize(
    "scope",
    [
        Scope("tenant-001"),
        Scope.days("tenant-001", date(2026, 12, 1), date(2026, 12, 1)),
        Scope.days("t-9", date(2026, 11, 20), date(2026, 12, 4)),
        Scope.days("tenant-001", date(1900, 1, 1), date(9999, 12, 30)),  # the first and last days
    ],
)
def test_a_scope_key_reads_back_as_its_scope(scope):
    assert Scope.parse(scope.key) == scope
    assert Scope.parse(scope.key).key == scope.key


@pytest.mark.parametrize(
    "key",
    [
        "",
        "Tenant-001",  # not a tenant key
        "tenant-001/",
        "tenant-001/2026-12-01",  # a day is written as a window
        "tenant-001/2026-12-01..",
        "tenant-001/2026-12-02..2026-12-01",  # reversed
        "tenant-001/2026-12-01..2026-12-01",  # empty
        "tenant-001/20261201..20261202",  # a date written another way
        "tenant-001/not-a-day..2026-12-02",
        "2: tenant-001..tenant-002",  # a chunk
        "tenant-001/2026-12-01..2026-12-02/x",
        "tenant-001/1899-12-31..1900-01-01",  # before the first day
    ],
)
def test_a_malformed_scope_key_is_refused(key):
    with pytest.raises(BadInput, match="scope key|tenant|window"):
        Scope.parse(key)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(45.4, "45 s"), (720, "12 min"), (12_600, "3.5 h"), (857_692.626891, "9.9 d")],
)
def test_an_age_reads_in_a_unit_a_person_reads(seconds, text):
    assert age_text(seconds) == text
