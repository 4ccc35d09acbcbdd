"""A circuit breaker per tier below the hot cache: after a failure the tier is skipped for a while
(doubling on each consecutive failure, up to a ceiling), so a dead store costs one
timeout per interval instead of one per chunk. ``trial``: a probe made after the interval
answered (the tier's reads run it apart from its callers); calls go through again, and the
next one decides: a success resets the breaker, a failure goes on doubling."""

from __future__ import annotations

import time


class CircuitBreaker:
    def __init__(self, base_interval: float = 1.0, max_interval: float = 30.0):
        self.base = base_interval
        self.max = max_interval
        self.failures = 0
        self.open_until = 0.0
        self.trial = False
        self.failing_since = 0.0  # monotonic time of the first failure in a row

    @property
    def closed(self) -> bool:
        """True when calls may go through (or a probe is due)."""
        return time.monotonic() >= self.open_until

    def success(self) -> tuple[int, float] | None:
        """Record a success; after failures, how many there were and for how long (s)."""
        cleared = (self.failures, time.monotonic() - self.failing_since) if self.failures else None
        self.failures = 0
        self.open_until = 0.0
        self.trial = False
        return cleared

    def failure(self) -> float:
        """Record a failure; returns how long the tier is now skipped."""
        if not self.failures:
            self.failing_since = time.monotonic()
        self.failures += 1
        self.trial = False
        # (the exponent is capped: a float power overflows after 1024 failures, ~8 h down)
        interval = min(self.max, self.base * 2.0 ** min(self.failures - 1, 64))
        self.open_until = time.monotonic() + interval
        return interval
