"""LogThrottle: one log line per kind of event per interval, however often it happens; the
next line says how many were left out. A fault that lasts (a full disk, a stream of corrupt
chunks, a misbehaving client) is told once a minute, not once per chunk or request."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter


class LogThrottle:
    def __init__(self, interval: float = 60.0):
        self.interval = interval
        self._last: dict[str, float] = {}
        self._skipped: Counter[str] = Counter()
        self._lock = threading.Lock()

    def log(self, logger: logging.Logger, level: int, kind: str, msg: str, *args: object,
            exc_info: bool = False) -> bool:
        """Log ``msg % args`` (with the exception being handled, given ``exc_info``) unless a
        line of ``kind`` went out less than ``interval`` seconds ago (then count it);
        returns whether it was logged."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval:
                self._skipped[kind] += 1
                return False
            self._last[kind] = now
            skipped = self._skipped.pop(kind, 0)
        if skipped:  # (all since the last line of its kind, however long ago that was)
            msg += " (and %d more like it in the %.0f s since the last such line)"
            args = (*args, skipped, now - last)
        logger.log(level, msg, *args, exc_info=exc_info)
        return True
