"""The faults the simulator injects (``Faults``, changed at run time through
``/admin/faults``), and the state that decides them per request: the seeded RNG, the rate
limit's token bucket and its recent per-second counts (in memory)."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OUTAGES = ("503", "refuse")
# A rate limit's burst is 1 + rate × this: a client keeping to the rate with a burst of its
# own up to 0.1 s (qo-ops' is rate/10) and 0.1 s of jitter is never refused.
BURST_S = 0.2
RATE_WINDOW_S = 60  # how many recent seconds /admin/stats counts per second

_RATES = ("error_rate", "timeout_rate", "reset_rate", "poison_rate")


@dataclass(frozen=True)
class Faults:
    """Which faults the simulator injects. Rates are probabilities in [0, 1];
    ``rate_limit`` is requests a second (``None``: no limit); ``outage`` is ``None``,
    ``"503"`` or ``"refuse"``."""

    latency_ms: int = 0
    error_rate: float = 0.0
    timeout_rate: float = 0.0
    reset_rate: float = 0.0
    poison_rate: float = 0.0
    seed: int = 0
    timeout_s: float = 2.0  # how long a 'timeout' answer hangs
    rate_limit: float | None = None
    outage: str | None = None

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    def problem(self) -> str | None:
        """What is wrong with these settings, or ``None`` (one line, starting with the field)."""
        for name in _RATES:
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                return f"{name} must be between 0 and 1, got {value}"
        if self.latency_ms < 0:
            return f"latency_ms must not be negative, got {self.latency_ms}"
        if not self.timeout_s > 0:
            return f"timeout_s must be positive, got {self.timeout_s}"
        if self.rate_limit is not None and not (
            math.isfinite(self.rate_limit) and self.rate_limit > 0
        ):
            return (
                f"rate_limit must be a positive number of requests a second, got {self.rate_limit}"
            )
        if self.outage is not None and self.outage not in OUTAGES:
            return f"outage must be one of {', '.join(OUTAGES)} (or null), got {self.outage!r}"
        return None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def updated(self, fields: dict[str, Any]) -> Faults:
        """A copy with ``fields`` (JSON values) changed; ``ValueError`` on a bad name or value."""
        known = {f.name for f in dataclasses.fields(self)}
        changes: dict[str, Any] = {}
        for name, value in fields.items():
            if name not in known:
                raise ValueError(f"unknown fault field {name!r}")
            if value is None and name in ("rate_limit", "outage"):
                changes[name] = None  # switched off
            elif name == "outage":
                if value == 503 and not isinstance(value, bool):  # the number is meant too
                    value = "503"
                if not isinstance(value, str):
                    raise ValueError(f"outage must be one of {', '.join(OUTAGES)} (or null)")
                changes[name] = value
            elif isinstance(value, bool) or not isinstance(value, int | float):
                nullable = " or null" if name == "rate_limit" else ""
                raise ValueError(f"{name} must be a number{nullable}")
            elif name in ("latency_ms", "seed"):
                if not math.isfinite(value) or value != int(value):
                    raise ValueError(f"{name} must be an integer")
                changes[name] = int(value)
            else:
                changes[name] = float(value)
        return dataclasses.replace(self, **changes)


def poison_score(key: str, seed: int) -> float:
    """A stable number in [0, 1) for ``key``: the key is poison when it is below poison_rate."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


class RateBucket:
    """A token bucket: ``rate`` tokens a second, at most ``1 + rate × BURST_S`` held."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = 1.0 + rate * BURST_S
        self._clock = clock
        self._tokens = self.burst
        self._at = clock()

    def take(self) -> float:
        """``0.0`` when a token was taken (admitted); else the seconds until one is there."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self.rate


class FaultState:
    """The current faults, the seeded RNG that decides the random ones per request, and the
    rate limit's bucket with its recent per-second counts (in memory)."""

    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self.rng = random.Random(faults.seed)
        self.bucket = RateBucket(faults.rate_limit) if faults.rate_limit else None
        # [unix second, admitted, rate_limited] for the last RATE_WINDOW_S seconds
        self.per_second: deque[list[int]] = deque(maxlen=RATE_WINDOW_S)

    def update(self, fields: dict[str, Any]) -> Faults:
        new = self.faults.updated(fields)
        if "seed" in fields:
            self.rng = random.Random(new.seed)
        if "rate_limit" in fields:  # a new limit starts with a full bucket
            self.bucket = RateBucket(new.rate_limit) if new.rate_limit else None
        self.faults = new
        return new

    def rate_limited(self) -> float:
        """``0.0`` when this request may pass the rate limit, else seconds to wait."""
        if self.bucket is None:
            return 0.0
        wait = self.bucket.take()
        second = int(time.time())
        if not self.per_second or self.per_second[-1][0] != second:
            self.per_second.append([second, 0, 0])
        self.per_second[-1][1 if wait == 0.0 else 2] += 1
        return wait

    def draw(self) -> tuple[bool, bool, bool]:
        """``(error, timeout, reset)`` for one request: three draws every time, so the
        sequence of decisions depends only on the seed and the order of requests."""
        f = self.faults
        r_error, r_timeout, r_reset = self.rng.random(), self.rng.random(), self.rng.random()
        timeout = r_timeout < f.timeout_rate
        return r_error < f.error_rate, timeout, (not timeout) and r_reset < f.reset_rate

    def is_poison(self, key: str, payload: dict[str, Any]) -> bool:
        if payload.get("fault") == "poison":
            return True
        return self.faults.poison_rate > 0 and poison_score(key, self.faults.seed) < (
            self.faults.poison_rate
        )
