"""A batch's values as one PostgreSQL array value each, bound for ``CAST(:x AS <type>[])``.

psycopg dumps a Python list element by element, each through its dumper: for a batch of
4,096 that is 3-8 ms per list (bench/TUNING.md has the figures), and a downstream job's
record binds eight. One string is built here instead, in the array's text form; the cast in
the statement parses it, so a value that is not of the column's type is an error there,
never a different value."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def text_array(values: Sequence[str | None]) -> str:
    """Strings (``None`` is ``NULL``) as ``{"a","b\\"c",NULL}``, for ``CAST(:x AS text[])``
    or any type read from text (``uuid[]``). Every element is quoted, with ``\\`` and ``"``
    escaped: inside quotes nothing else is special (commas, braces, spaces, newlines)."""
    return (
        "{"
        + ",".join(
            [
                "NULL" if v is None else '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
                for v in values
            ]
        )
        + "}"
    )


def int_array(values: Sequence[Any]) -> str:
    """Integers (a batch's ids, attempts; a bool is 0 or 1) as ``{3,-1,2}``, for
    ``CAST(:x AS bigint[])`` or ``int[]``. Each goes through ``int()``, so nothing but
    digits and a sign go in."""
    return "{" + ",".join([str(int(v)) for v in values]) + "}"


def float_array(values: Sequence[float]) -> str:
    """Numbers as ``{0.5,1e-05,inf}``, for ``CAST(:x AS float8[])`` (``repr`` of a float
    round-trips exactly; PostgreSQL reads ``inf`` and ``nan``)."""
    return "{" + ",".join([repr(float(v)) for v in values]) + "}"
