"""The hot tier: chunks in CPU memory slots, bounded by the pool, LRU."""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..memory import ChunkBuffer, MemoryPool


class HotCache:
    """key -> ChunkBuffer. The cache holds one reference per entry; readers get their own.
    Only entries nobody else references can be evicted."""

    def __init__(self, pool: MemoryPool):
        self.pool = pool
        self.entries: OrderedDict[str, ChunkBuffer] = OrderedDict()
        self.num_evictions = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.entries)

    def contains(self, key: str) -> bool:
        return key in self.entries

    def get(self, key: str) -> ChunkBuffer | None:
        """The chunk with a reference for the caller (release it), or None."""
        with self._lock:
            buf = self.entries.get(key)
            if buf is None:
                return None
            self.entries.move_to_end(key)
            return buf.retain()

    def put(self, key: str, buf: ChunkBuffer) -> None:
        """Insert (or replace) ``key``; the cache takes its own reference."""
        with self._lock:
            old = self.entries.pop(key, None)
            self.entries[key] = buf.retain()
        if old is not None:
            old.release()

    def allocate(self) -> ChunkBuffer | None:
        """A free slot, evicting least recently used unreferenced entries if needed."""
        buf = self.pool.allocate()
        while buf is None:
            if not self._evict_one():
                return None
            buf = self.pool.allocate()
        return buf

    def _evict_one(self) -> bool:
        with self._lock:
            for key, buf in self.entries.items():
                if buf.ref_count == 1:  # only the cache holds it
                    del self.entries[key]
                    break
            else:
                return False
        buf.release()
        self.num_evictions += 1
        return True

    def drop_lossy(self) -> int:
        """Remove the entries decoded from a lossy codec (readers keep their references)."""
        with self._lock:
            keys = [k for k, b in self.entries.items() if b.lossy]
            dropped = [self.entries.pop(k) for k in keys]
        for buf in dropped:
            buf.release()
        return len(dropped)

    def clear(self) -> None:
        with self._lock:
            entries, self.entries = self.entries, OrderedDict()
        for buf in entries.values():
            buf.release()
