"""The catalog's cron forms, with the seconds between two ticks and the ticks in a span."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta


def cadence_seconds(cron: str) -> float:
    """The seconds between two ticks of one of the catalog's cron forms.

    The forms are ``* * * * *``, ``*/N * * * *``, ``M * * * *`` and ``M H * * *``."""
    minute, hour, dom, month, dow = cron.split()
    if (dom, month, dow) != ("*", "*", "*"):
        raise ValueError(f"unsupported cron for a cadence: {cron}")
    if hour == "*":
        if minute == "*":
            return 60.0
        if minute.startswith("*/"):
            return 60.0 * int(minute[2:])
        if minute.isdigit():
            return 3600.0
    elif hour.isdigit() and minute.isdigit():
        return 86400.0
    raise ValueError(f"unsupported cron for a cadence: {cron}")


def cron_ticks(cron: str, after: datetime, until: datetime) -> list[datetime]:
    """The ticks of ``cron`` (a catalog form, in UTC) in (``after``, ``until``], oldest first.

    The result is exact for the forms that :func:`cadence_seconds` accepts. ``*/N`` restarts
    at minute 0 of every hour, as cron does."""
    cadence_seconds(cron)  # raises unless the form is one we know
    minute, hour = cron.split()[:2]
    step = int(minute[2:]) if minute.startswith("*/") else 1
    if hour.isdigit():
        period, offset = timedelta(days=1), timedelta(hours=int(hour), minutes=int(minute))
    elif minute.isdigit():
        period, offset = timedelta(hours=1), timedelta(minutes=int(minute))
    else:
        period, offset = timedelta(hours=1), timedelta(0)
    minutes = range(0, 60, step) if not minute.isdigit() else (0,)
    start = after.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    if period == timedelta(days=1):
        start = start.replace(hour=0)
    ticks: list[datetime] = []
    while start <= until:
        for m in minutes:
            tick = start + offset + timedelta(minutes=m)
            if after < tick <= until:
                ticks.append(tick)
        start += period
    return ticks
