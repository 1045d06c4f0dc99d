"""Settings read from the environment, in one place: a reader per kind of value, each
refusing a bad one with a one-line ``ConfigError`` that names the variable. A job's own
settings are read with these by its ``JobSpec.validate_settings``, once, before its run
writes anything (``qo_ops.platform.job.outcome.run_settings``)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from qo_ops.errors import ConfigError

DATABASE_URL_ENV = "QO_OPS_DATABASE_URL"
HOME_ENV = "QO_OPS_HOME"
DEFAULT_HOME = ".qo_ops"
OTLP_ENV = "QO_OPS_OTLP_ENDPOINT"  # traces go there (qo_ops.platform.observability.tracing); unset: no tracing


@dataclass(frozen=True)
class Settings:
    """Where qo-ops keeps its state and which database it talks to."""

    home: Path
    database_url: str | None

    @property
    def embedded_pgdata(self) -> Path:
        """Data directory of the embedded PostgreSQL server (used when no URL is set)."""
        return self.home / "pgdata"


def load_settings(environ: dict[str, str] | None = None) -> Settings:
    """Read settings from ``environ`` (default: the process environment)."""
    env = os.environ if environ is None else environ
    home = Path(env.get(HOME_ENV) or DEFAULT_HOME).expanduser().resolve()
    url = (env.get(DATABASE_URL_ENV) or "").strip() or None
    return Settings(home=home, database_url=url)


def whole_number(
    name: str,
    default: int,
    lo: int,
    hi: int,
    *,
    unit: str = "",
    environ: Mapping[str, str] | None = None,
    error: type[ConfigError] = ConfigError,
) -> int:
    """The whole number in ``name`` (unset or blank: ``default``); anything else than a
    whole number from ``lo`` to ``hi`` raises ``error`` with a one-line message."""
    raw = ((os.environ if environ is None else environ).get(name) or "").strip()
    if not raw:
        return default
    if not raw.isdigit() or not lo <= int(raw) <= hi:
        of = f" of {unit}" if unit else ""
        raise error(f"{name} must be a whole number{of} from {lo} to {hi}, got {raw!r}")
    return int(raw)


def number(
    name: str,
    default: float,
    lo: float,
    hi: float,
    *,
    unit: str = "",
    environ: Mapping[str, str] | None = None,
    error: type[ConfigError] = ConfigError,
) -> float:
    """The number in ``name`` (unset or blank: ``default``); anything else than a finite
    number from ``lo`` to ``hi`` (``abc``, ``nan``, ``inf``, out of range) raises ``error``
    with a one-line message."""
    raw = ((os.environ if environ is None else environ).get(name) or "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not lo <= value <= hi:  # also refuses nan
        of = f" of {unit}" if unit else ""
        raise error(f"{name} must be a number{of} from {lo:g} to {hi:g}, got {raw!r}")
    return value
