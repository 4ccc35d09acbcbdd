"""The hot tier: chunks in CPU memory slots, bounded by the pool; a CachePolicy (by name,
``cache_policy``) picks what to evict and what not to keep."""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..memory import ChunkBuffer, MemoryPool
from ..policy import DEFAULT_POLICY, CachePolicy, make_policy


class HotCache:
    """key -> ChunkBuffer. The cache holds one reference per entry; readers get their own.
    Only entries nobody else references can be evicted."""

    def __init__(self, pool: MemoryPool, policy: CachePolicy | str = DEFAULT_POLICY,
                 on_evict: Callable[[str], None] | None = None):
        self.pool = pool
        self.on_evict = on_evict  # told the key of each eviction
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.entries: dict[str, ChunkBuffer] = {}
        self.num_evictions = 0
        self.num_refused = 0  # chunks the policy did not admit
        self.lossy_ok = True  # whether chunks decoded from lossy frames are kept (drop_lossy)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.entries)

    def contains(self, key: str) -> bool:
        return key in self.entries

    def get(self, key: str, use: bool = True) -> ChunkBuffer | None:
        """The chunk with a reference for the caller (release it), or None; a use to the
        policy unless ``use`` is False."""
        with self._lock:
            buf = self.entries.get(key)
            if buf is None:
                return None
            if use:
                self.policy.accessed(key)
            return buf.retain()

    def hold(self, key: str) -> ChunkBuffer | None:
        """The chunk with a reference for the caller, without counting a use (a chunk that
        work under way continues: it must not be evicted meanwhile), or None."""
        with self._lock:
            buf = self.entries.get(key)
            return None if buf is None else buf.retain()

    def touch(self, keys: list[str]) -> int:
        """A use of the leading ``keys`` held (the engine served their tokens from its own
        memory: the policy sees the use a load would have made); how many were held."""
        n = 0
        with self._lock:
            for key in keys:
                if key not in self.entries:
                    break
                self.policy.accessed(key)
                n += 1
        return n

    def put(self, key: str, buf: ChunkBuffer, parent: str | None = None) -> bool:
        """Insert (or replace) ``key``, the chunk after ``parent`` in its prompt (None: a
        first or content-keyed chunk); the cache takes its own reference. False if the
        policy does not keep it (its parent is gone, or it is not worth the room), or if it
        is lossy after ``drop_lossy``."""
        with self._lock:
            old = self.entries.get(key)
            if buf.lossy and not self.lossy_ok:
                return False
            if old is not None:
                self.entries[key] = buf.retain()
                self.policy.accessed(key)
            elif self.policy.admit(key, parent, self.entries.__contains__):
                self.entries[key] = buf.retain()
                self.policy.inserted(key, parent)
            else:
                self.num_refused += 1
                return False
        if old is not None:
            old.release()
        return True

    def allocate(self) -> ChunkBuffer | None:
        """A free slot, evicting unreferenced entries the policy picks if needed."""
        buf = self.pool.allocate()
        while buf is None:
            if not self._evict_one():
                return None
            buf = self.pool.allocate()
        return buf

    def _evict_one(self) -> bool:
        with self._lock:
            key = self.policy.victim(lambda k: self.entries[k].ref_count == 1)  # only we hold it
            if key is None:
                return False
            buf = self.entries.pop(key)
            self.policy.removed(key)
            self.num_evictions += 1
        buf.release()
        if self.on_evict is not None:
            self.on_evict(key)
        return True

    def drop_lossy(self) -> int:
        """Remove the entries decoded from a lossy codec, and those held after them in their
        prompts (computed over their KV, and unreachable without them), and keep none from
        now on; readers keep their references."""
        with self._lock:
            self.lossy_ok = False
            keys = [k for k, b in self.entries.items() if b.lossy]
            keys += self.policy.continuations(keys)
            dropped = [self.entries.pop(k) for k in keys]
            for key in keys:
                self.policy.removed(key)
        for buf in dropped:
            buf.release()
        return len(dropped)

    def clear(self) -> None:
        with self._lock:
            entries, self.entries = self.entries, {}
            for key in entries:
                self.policy.removed(key)
        for buf in entries.values():
            buf.release()
