"""Small pieces the jobs' selections share."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa


def after_position(
    query: sa.Select[Any],
    columns: tuple[sa.ColumnElement[Any], ...],
    position: dict[str, Any] | None,
    keys: tuple[str, ...],
) -> sa.Select[Any]:
    """``query`` restricted to rows after ``position`` in the order of ``columns`` (a row
    comparison the index on those columns serves); unchanged when there is no position."""
    if not position:
        return query
    return query.where(sa.tuple_(*columns) > sa.tuple_(*(sa.literal(position[k]) for k in keys)))


def seconds_or_none(value: Any) -> float | None:
    """An age from ``extract(epoch …)``: a float, or None when nothing is waiting."""
    return float(value) if value is not None else None
