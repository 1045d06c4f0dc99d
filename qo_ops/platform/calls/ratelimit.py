"""A token bucket for the calls a run makes to another system, shared by the run's workers.

It allows at most ``rate`` calls a second on average, and ``burst`` calls at once after a
quiet spell. When the other system asks for a pause (``429`` with ``Retry-After``), every
worker pauses."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

_EPSILON = 1e-9
_WAIT_S = 0.05  # the longest a waiting caller sleeps before it checks the stop request


class TokenBucket:
    """Call ``acquire()`` before each call. A ``rate`` of None means no limit, but pauses
    still apply."""

    def __init__(
        self,
        rate: float | None,
        burst: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if rate is not None and not rate > 0:
            raise ValueError("rate must be positive")
        self.rate = rate
        self.burst = max(1.0, burst if burst is not None else (rate or 1.0) / 10)
        self._clock = clock
        self._tokens = self.burst
        self._at = clock()
        self._paused_until = 0.0
        self._lock = threading.Lock()
        self.waited_s = 0.0  # the time callers spent waiting, summed (the run's slow-down)
        self.pauses = 0  # Retry-After pauses taken

    def pause(self, seconds: float) -> None:
        """Let no call go for ``seconds`` from now. A pause never shortens an earlier one."""
        with self._lock:
            self._paused_until = max(self._paused_until, self._clock() + max(0.0, seconds))
            self.pauses += 1

    def acquire(self, stop: threading.Event | None = None) -> bool:
        """Wait for a token and return True. Return False, with no token taken, if ``stop``
        is set meanwhile."""
        started: float | None = None
        while True:
            with self._lock:
                now = self._clock()
                wait = self._paused_until - now
                if wait <= 0 and self.rate is None:
                    break
                if wait <= 0 and self.rate is not None:
                    self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
                    self._at = now
                    if self._tokens >= 1.0 - _EPSILON:  # a clock's rounding is no reason to wait
                        self._tokens = max(0.0, self._tokens - 1.0)
                        break
                    wait = (1.0 - self._tokens) / self.rate
                if started is None:
                    started = now
            if stop is not None and stop.is_set():
                return False
            _sleep(min(wait, _WAIT_S), stop)
        if started is not None:
            with self._lock:
                self.waited_s += self._clock() - started
        return True


def _sleep(seconds: float, stop: threading.Event | None) -> None:
    if stop is None:
        time.sleep(seconds)
    else:
        stop.wait(seconds)
