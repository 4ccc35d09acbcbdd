"""PinTable: chunks held in the hot cache for a load that the scheduler role has planned.

The scheduler role pins the chunks of a hit by key (they cannot be evicted while pinned);
the worker role takes each pin when it loads the chunk, or the scheduler role gives it
back when the load will not happen. A key may be pinned several times (two requests with
one prefix); each pin is taken or given back once. A pin neither taken nor given back
within ``ttl`` seconds (its scheduler went away) is dropped by the next ``sweep``, which
``add``, ``take`` and lmkv's chunk allocations run (a check of one time when none is due).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import defaultdict

from ..memory import ChunkBuffer

log = logging.getLogger(__name__)

PIN_TTL = 600.0  # seconds


class PinTable:
    def __init__(self, ttl: float = PIN_TTL):
        self.ttl = ttl
        self._pins: dict[str, list[tuple[ChunkBuffer, float]]] = defaultdict(list)  # oldest first
        self._lock = threading.Lock()
        self._oldest = math.inf  # when the oldest pin was taken

    def add(self, keys: list[str], bufs: list[ChunkBuffer]) -> None:
        """Pin ``bufs[i]`` under ``keys[i]``; the table owns the reference each holds."""
        self.sweep()
        now = time.monotonic()
        with self._lock:
            for key, buf in zip(keys, bufs, strict=True):
                self._pins[key].append((buf, now))
            if bufs:
                self._oldest = min(self._oldest, now)

    def sweep(self) -> None:
        """Drop the pins held over ``ttl`` seconds."""
        now = time.monotonic()
        if now - self._oldest <= self.ttl:
            return
        self._drop_where(lambda when: now - when > self.ttl)
        with self._lock:
            self._oldest = min((when for pins in self._pins.values() for _, when in pins),
                               default=math.inf)

    def take(self, key: str) -> ChunkBuffer | None:
        """One pin of ``key``: the caller now owns its reference. None if there is none."""
        self.sweep()
        with self._lock:
            pins = self._pins.get(key)
            if not pins:
                return None
            buf, _ = pins.pop(0)
            if not pins:
                del self._pins[key]
            return buf

    def give_back(self, keys: list[str]) -> None:
        """Release one pin of each key (a load that will not happen)."""
        for key in keys:
            buf = self.take(key)
            if buf is not None:
                buf.release()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(p) for p in self._pins.values())

    def clear(self) -> None:
        self._drop_where(lambda _: True, quiet=True)

    def _drop_where(self, stale, quiet: bool = False) -> None:
        dropped = []
        with self._lock:
            for key in list(self._pins):
                pins = self._pins[key]
                dropped += [b for b, when in pins if stale(when)]
                keep = [(b, when) for b, when in pins if not stale(when)]
                if keep:
                    self._pins[key] = keep
                else:
                    del self._pins[key]
        for buf in dropped:
            buf.release()
        if dropped and not quiet:
            log.warning("lmkv: released %d chunks pinned over %.0f s ago and never loaded",
                        len(dropped), self.ttl)
