"""A batch's values bound as one array value each (``qo_ops.db.arrays``) come back from
real PostgreSQL exactly as they went in: every character a string may hold (quotes,
backslashes, commas, braces, newlines, the word NULL), ``None`` as NULL, ints and floats
(their extremes too); and what is not of the column's type fails in the cast, never turning
into another value."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from qo_ops.db.arrays import float_array, int_array, text_array

STRINGS = [
    "plain",
    "",
    "NULL",  # a string, not a null
    "null",
    'say "hi"',
    "back\\slash",
    'both \\" at once\\',
    "a,b",
    "{braces}",
    "  spaced  ",
    "line\nbreak\r\ttab",
    "ünïcødé ✓",
    None,
]


def _round_trip(db, value: str, sql_type: str) -> list[object]:
    with db.engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    f"SELECT v FROM unnest(CAST(:v AS {sql_type}[])) WITH ORDINALITY AS t(v, n)"
                    " ORDER BY n"
                ),
                {"v": value},
            ).scalars()
        )


def test_text_values_come_back_exactly(db) -> None:
    assert _round_trip(db, text_array(STRINGS), "text") == STRINGS


def test_uuid_strings_read_as_uuids(db) -> None:
    ids = [str(uuid.uuid4()) for _ in range(3)]
    assert _round_trip(db, text_array(ids), "uuid") == [uuid.UUID(i) for i in ids]


def test_ints_and_bools_come_back_exactly(db) -> None:
    values = [0, -1, 2**62, True, False, 7]
    assert _round_trip(db, int_array(values), "bigint") == [0, -1, 2**62, 1, 0, 7]


def test_floats_come_back_exactly(db) -> None:
    values = [0.0, 0.1, -2.5, 1e-300, 1.7976931348623157e308, 30.000000000000004, float("inf")]
    assert _round_trip(db, float_array(values), "float8") == values


def test_empty_lists_are_empty_arrays(db) -> None:
    for value, sql_type in (
        (text_array([]), "text"),
        (int_array([]), "int"),
        (float_array([]), "float8"),
    ):
        assert _round_trip(db, value, sql_type) == []


@pytest.mark.parametrize(
    ("value", "sql_type"),
    [(text_array(["not-a-uuid"]), "uuid"), (text_array(["1", "x"]), "int")],
)
def test_a_value_not_of_the_type_fails_in_the_cast(db, value: str, sql_type: str) -> None:
    with pytest.raises(sa.exc.DataError):
        _round_trip(db, value, sql_type)


def test_an_int_array_takes_nothing_but_integers() -> None:
    with pytest.raises(ValueError):
        int_array(["1}, {2"])  # what would change the array's shape is refused in Python
