"""How a run treated the other system it calls, read back from the run's tally.

The tally holds the keys that ``qo_ops/downstream/calls.py`` writes. They count the calls
sent, the retries and the retry pressure, and the calls not sent (because the breaker was
open or the retry budget was used up). They also count rate-limit pauses and waiting,
breaker transitions, and items spared. One reading serves the run report, ``qo-ops run`` and
``runs``, the API's run resource, the Dagster run's metadata and the exporter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qo_ops.platform.calls.breaker import CLOSED, HALF_OPEN, OPEN
from qo_ops.platform.job.outcome import ReportRow

CALLS = "downstream.calls"
RETRIES = "downstream.retries"  # calls for items that had failed before
RETRY_BUDGET_REFUSED = "downstream.retry_budget_refused"  # retries not sent, budget used up
REFUSED_OPEN = "downstream.refused_open"  # calls not sent because the breaker was open
RATE_LIMIT_PAUSES = "downstream.rate_limit_pauses"  # 429 answers (each pauses the run)
RATE_LIMIT_WAIT_MS = "downstream.rate_limit_wait_ms"  # time all workers waited for the limiter
# Items that failed in an outage. Each kept its attempt, or got it back.
SPARED = "downstream.spared"
# Last attempts kept. They failed systemically while the downstream was not known to be up.
HELD = "downstream.held"
BREAKER_STATES = (CLOSED, OPEN, HALF_OPEN)
BREAKER_PREFIX = "breaker."  # breaker.<state> counts the transitions to that state
# The error class of a run that the breaker stopped (qo_ops.downstream.calls.finish_calls).
DEPENDENCY_UNAVAILABLE = "dependency_unavailable"
_KEYS = (CALLS, RETRIES, RETRY_BUDGET_REFUSED, REFUSED_OPEN, RATE_LIMIT_PAUSES,
         RATE_LIMIT_WAIT_MS, SPARED, HELD)  # fmt: skip


def is_manners_key(key: str) -> bool:
    """Whether :class:`DownstreamCalls` reads this tally key, so it is shown there, not raw."""
    return key in _KEYS or key.removeprefix(BREAKER_PREFIX) in BREAKER_STATES


@dataclass(frozen=True)
class DownstreamCalls:
    """What a run's calls to the downstream added up to."""

    calls: int = 0
    retries: int = 0
    retry_budget_refused: int = 0
    not_sent_breaker_open: int = 0
    rate_limit_pauses: int = 0
    rate_limit_wait_ms: int = 0
    spared: int = 0
    held: int = 0
    breaker_opened: int = 0
    breaker_half_opened: int = 0
    breaker_closed: int = 0

    @classmethod
    def from_tally(cls, tally: Mapping[str, Any] | None) -> DownstreamCalls | None:
        """The run's figures, or None if its tally has none because no call was due."""
        tally = tally or {}
        if not any(is_manners_key(k) for k in tally):
            return None

        def n(key: str) -> int:
            return int(tally.get(key) or 0)

        return cls(
            calls=n(CALLS),
            retries=n(RETRIES),
            retry_budget_refused=n(RETRY_BUDGET_REFUSED),
            not_sent_breaker_open=n(REFUSED_OPEN),
            rate_limit_pauses=n(RATE_LIMIT_PAUSES),
            rate_limit_wait_ms=n(RATE_LIMIT_WAIT_MS),
            spared=n(SPARED),
            held=n(HELD),
            breaker_opened=n(BREAKER_PREFIX + OPEN),
            breaker_half_opened=n(BREAKER_PREFIX + HALF_OPEN),
            breaker_closed=n(BREAKER_PREFIX + CLOSED),
        )

    @property
    def retry_pressure(self) -> float | None:
        """Retries divided by calls sent (0..1), or None when nothing was sent."""
        return self.retries / self.calls if self.calls else None

    def breaker_text(self) -> str:
        """The breaker's transitions in this run, e.g. ``opened 1, half-opened 1, closed 1``."""
        moves = (
            ("opened", self.breaker_opened),
            ("half-opened", self.breaker_half_opened),
            ("closed", self.breaker_closed),
        )
        return ", ".join(f"{word} {n}" for word, n in moves if n) or "-"

    def line(self) -> str:
        """One line for people: ``120 calls, 30 retries (25.0 % retry pressure), …``."""
        parts = [f"{self.calls} calls", f"{self.retries} retries ({_percent(self)} retry pressure)"]
        if self.rate_limit_pauses or self.rate_limit_wait_ms:
            parts.append(
                f"{self.rate_limit_pauses} rate-limit pauses, "
                f"{self.rate_limit_wait_ms / 1000:.1f} s waited"
            )
        if self.breaker_opened or self.breaker_half_opened or self.breaker_closed:
            parts.append(f"breaker {self.breaker_text()}")
        if self.not_sent_breaker_open:
            parts.append(f"{self.not_sent_breaker_open} not sent (breaker open)")
        if self.retry_budget_refused:
            parts.append(f"{self.retry_budget_refused} retries refused (budget used up)")
        if self.spared:
            parts.append(f"{self.spared} spared (attempt kept)")
        if self.held:
            parts.append(f"{self.held} held at their last attempt (downstream not known up)")
        return ", ".join(parts)

    def rows(self) -> list[ReportRow]:
        """The run report's rows. Calls and retries are always there; the rest only when it
        happened."""
        rows = [
            ReportRow("downstream", "calls", self.calls, "sent"),
            ReportRow("downstream", "retries", self.retries, f"{_percent(self)} of calls"),
        ]
        optional = (
            ("not_sent_breaker_open", self.not_sent_breaker_open, "not sent: breaker open"),
            ("retry_budget_refused", self.retry_budget_refused, "not sent: retry budget used up"),
            ("rate_limit_pauses", self.rate_limit_pauses, "429 + Retry-After: the run paused"),
            ("rate_limit_wait_ms", self.rate_limit_wait_ms, "waited for the rate limit, summed"),
            ("spared", self.spared, "failed in the outage: attempt kept"),
            ("held", self.held, "last attempt failed, downstream not known up: kept, retried"),
        )
        rows += [ReportRow("downstream", name, n, detail) for name, n, detail in optional if n]
        moves = ((OPEN, self.breaker_opened), (HALF_OPEN, self.breaker_half_opened),
                 (CLOSED, self.breaker_closed))  # fmt: skip
        rows += [ReportRow("breaker", to, n, "transitions") for to, n in moves if n]
        return rows

    def as_dict(self) -> dict[str, Any]:
        """The figures as JSON, for the API's run resource.

        They are the counts, ``retry_pressure`` (0..1 or null), ``rate_limit_wait_s`` and the
        breaker's transitions by state."""
        pressure = self.retry_pressure
        return {
            "calls": self.calls,
            "retries": self.retries,
            "retry_pressure": None if pressure is None else round(pressure, 4),
            "not_sent_breaker_open": self.not_sent_breaker_open,
            "retry_budget_refused": self.retry_budget_refused,
            "rate_limit_pauses": self.rate_limit_pauses,
            "rate_limit_wait_s": round(self.rate_limit_wait_ms / 1000, 3),
            "spared": self.spared,
            "held": self.held,
            "breaker_transitions": {
                OPEN: self.breaker_opened,
                HALF_OPEN: self.breaker_half_opened,
                CLOSED: self.breaker_closed,
            },
        }


def _percent(calls: DownstreamCalls) -> str:
    pressure = calls.retry_pressure
    return "-" if pressure is None else f"{pressure * 100:.1f} %"


def manners_rows(
    tally: Mapping[str, Any], error_code: str | None, status_reason: str | None
) -> list[ReportRow]:
    """A run report's downstream rows. A run that called nothing has none.

    If the breaker stopped the run, a breaker row says ``dependency_unavailable`` with the
    run's reason."""
    calls = DownstreamCalls.from_tally(tally)
    rows = calls.rows() if calls is not None else []
    if error_code == DEPENDENCY_UNAVAILABLE:
        rows.append(ReportRow("breaker", DEPENDENCY_UNAVAILABLE, 1, status_reason or ""))
    return rows
