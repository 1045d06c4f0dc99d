"""A per-key sliding-window rate limit (in this API process; each replica counts its own)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable


class RateLimiter:
    """At most ``limit`` hits per ``window_s`` seconds for each key."""

    def __init__(
        self, limit: int, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limit, self.window_s, self._clock = limit, window_s, clock
        self._hits: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def hit(self, key: str) -> float | None:
        """Count a hit; None if allowed, else the seconds until the next would be."""
        now = self._clock()
        with self._lock:
            hits = self._hits.setdefault(key, deque())
            while hits and hits[0] <= now - self.window_s:
                hits.popleft()
            if len(hits) >= self.limit:
                return max(0.0, hits[0] + self.window_s - now)
            hits.append(now)
            if len(self._hits) > 10_000:  # forget idle keys so memory stays bounded
                for idle in [k for k, v in self._hits.items() if not v]:
                    del self._hits[idle]
            return None
