"""Store: the server's bounded key -> value map over a PageArena, evicting by a cache
policy (lmkv.policy, by name; the lm:// protocol carries no prefix parents, so every key is
a root to it: ``prefix_lru`` is plain LRU here).

Every entry holds at least one page, an empty value too: the index lives outside the
arena, and this bounds it (and the persisted files) to one entry per page.

Life of a PUT: ``reserve`` pages (evicting the entries the policy picks to make room),
the connection receives the payload straight into them, then ``commit`` publishes the
entry (or ``abort`` returns the pages). Until the commit, readers still see the old value.

Readers pin an entry with ``acquire``/``release`` while they send it; an entry that is
overwritten or deleted while pinned is unlinked at once and its pages return to the arena
when the last reader releases it. Eviction skips pinned entries.

The connection threads, the persistence thread and the admin endpoints all call in, so
every method takes the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from lmkv.backends.lm_wire import Shape
from lmkv.policy import DEFAULT_POLICY, make_policy

from .arena import PageArena


@dataclass(slots=True, eq=False)
class Entry:
    key: bytes
    length: int
    fmt: int
    dtype: int
    shape: Shape
    pages: list[int]
    readers: int = 0
    linked: bool = True  # False once overwritten, evicted or deleted


@dataclass(slots=True)
class StoreStats:
    entries: int
    stored_bytes: int  # sum of value lengths
    used_bytes: int  # pages held (by entries, pinned leftovers and in-flight PUTs) * page size
    capacity_bytes: int
    page_size: int
    evictions: int
    evicted_bytes: int


class Store:
    def __init__(self, arena: PageArena, on_change: Callable[[bytes, bool], None] | None = None,
                 policy: str = DEFAULT_POLICY) -> None:
        """``on_change(key, present)`` is called (under the lock, so it must be quick)
        whenever a key's value is committed (True) or removed (False). ``policy``: a name
        in lmkv.policy.POLICIES."""
        self.arena = arena
        self._on_change = on_change
        self._index: dict[bytes, Entry] = {}
        self._policy = make_policy(policy)
        self._reloaded: dict[bytes, None] = {}  # committed as oldest, not yet told to the policy
        self._evictable_pages = 0  # pages of linked entries no reader pins
        self._lock = threading.Lock()
        self._stored_bytes = 0
        self._evictions = 0
        self._evicted_bytes = 0

    def set_listener(self, on_change: Callable[[bytes, bool], None] | None) -> None:
        with self._lock:
            self._on_change = on_change

    def pages_for(self, nbytes: int) -> int:
        """Pages an entry with a value of ``nbytes`` holds: at least one."""
        return max(1, self.arena.pages_for(nbytes))

    def fits(self, nbytes: int) -> bool:
        """Whether a value of ``nbytes`` could ever be stored (it is not above the cap)."""
        return self.pages_for(nbytes) <= self.arena.num_pages

    def room_for(self, need: int) -> bool:
        """Whether ``need`` pages could be had now: free, or held by entries no reader pins."""
        with self._lock:
            return need <= self.arena.free_pages + self._evictable_pages

    def reserve(self, nbytes: int, evict: bool = True) -> list[int] | None:
        """Pages for a value of ``nbytes``, evicting entries the policy picks if needed; None
        if they cannot be found (value above the cap, or the rest is pinned/in flight); then
        nothing is evicted."""
        return self.reserve_pages(self.pages_for(nbytes), evict)

    def reserve_pages(self, need: int, evict: bool = True) -> list[int] | None:
        """``need`` pages, as ``reserve``."""
        arena = self.arena
        with self._lock:
            missing = need - arena.free_pages
            if missing > 0 and (not evict or missing > self._evictable_pages):
                return None  # nothing is evicted for a PUT that would not get its room
            if missing > 0:
                self._evict(missing)
            return arena.allocate(need)

    def commit(
        self,
        key: bytes,
        length: int,
        fmt: int,
        dtype: int,
        shape: Shape,
        pages: list[int],
        *,
        oldest: bool = False,
        notify: bool = True,
    ) -> None:
        """Publish reserved ``pages`` as ``key``'s value, replacing any older value.
        ``oldest``: older than every value committed so far (reloading, newest file first)."""
        entry = Entry(key, length, fmt, dtype, shape, pages)
        with self._lock:
            old = self._index.get(key)
            if old is not None:
                self._unlink(old, notify=False)
            self._index[key] = entry
            self._evictable_pages += len(pages)
            if oldest:
                self._reloaded[key] = None
            else:
                self._rank_reloaded()
                self._policy.inserted(_name(key), None)
            self._stored_bytes += length
            if notify and self._on_change is not None:
                self._on_change(key, True)

    def abort(self, pages: list[int]) -> None:
        with self._lock:
            self.arena.free(pages)

    def acquire(self, key: bytes, touch: bool = True) -> Entry | None:
        """Pin ``key``'s entry for reading (and count it as a hit with the policy)."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            if touch:
                self._rank_reloaded()
                self._policy.accessed(_name(key))
            entry.readers += 1
            if entry.readers == 1:
                self._evictable_pages -= len(entry.pages)
            return entry

    def release(self, entry: Entry) -> None:
        with self._lock:
            entry.readers -= 1
            if entry.readers == 0:
                if entry.linked:
                    self._evictable_pages += len(entry.pages)
                else:
                    self.arena.free(entry.pages)

    def segments(self, entry: Entry) -> list[memoryview]:
        """Views of a pinned entry's bytes, in order."""
        return self.arena.segments(entry.pages, entry.length)

    def contains(self, key: bytes) -> bool:
        return key in self._index

    def delete(self, key: bytes) -> bool:
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return False
            self._unlink(entry)
            return True

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    def stats(self) -> StoreStats:
        arena = self.arena
        with self._lock:
            return StoreStats(
                entries=len(self._index),
                stored_bytes=self._stored_bytes,
                used_bytes=(arena.num_pages - arena.free_pages) * arena.page_size,
                capacity_bytes=arena.capacity,
                page_size=arena.page_size,
                evictions=self._evictions,
                evicted_bytes=self._evicted_bytes,
            )

    def check_integrity(self) -> None:
        """Arena pages are each free or owned once; byte accounting matches. Only valid
        with no PUT in flight and no reader pinned."""
        with self._lock:
            entries = list(self._index.values())
            self.arena.check_integrity(e.pages for e in entries)
            assert self._stored_bytes == sum(e.length for e in entries), "stored_bytes drift"
            assert all(e.linked and e.readers == 0 for e in entries), "pinned entries left"
            assert self._evictable_pages == sum(len(e.pages) for e in entries), "evictable drift"

    def _evict(self, missing: int) -> None:
        """Evict unpinned entries the policy picks until their pages cover ``missing`` (the
        caller checked that they can)."""
        self._rank_reloaded()
        while missing > 0:
            name = self._policy.victim(lambda k: not self._index[_key(k)].readers)
            if name is None:  # never expected: the evictable pages were counted
                raise AssertionError("the cache policy found no victim among evictable pages")
            entry = self._index[_key(name)]
            self._evictions += 1
            self._evicted_bytes += entry.length
            missing -= len(entry.pages)
            self._unlink(entry)

    def rank_reloaded(self) -> None:
        """Tell the policy of the values committed as oldest so far, the oldest first (at
        the end of a reload: otherwise the first request after it waited for all of them,
        with every connection behind the lock, 1.4 s for 200,000 values)."""
        with self._lock:
            self._rank_reloaded()

    def _rank_reloaded(self) -> None:
        """``rank_reloaded``, under the lock (done lazily by the first PUT or hit if a
        reload did not)."""
        for key in reversed(self._reloaded):
            self._policy.inserted(_name(key), None)
        self._reloaded.clear()

    def _unlink(self, entry: Entry, notify: bool = True) -> None:
        del self._index[entry.key]
        if entry.readers == 0:
            self._evictable_pages -= len(entry.pages)
        if entry.key in self._reloaded:  # reloading: the policy has not seen it yet
            del self._reloaded[entry.key]
        else:
            self._policy.removed(_name(entry.key))
        entry.linked = False
        self._stored_bytes -= entry.length
        if entry.readers == 0:
            self.arena.free(entry.pages)
        if notify and self._on_change is not None:
            self._on_change(entry.key, False)


def _name(key: bytes) -> str:
    """The policy's name for a key (policies key by str; latin-1 maps every byte)."""
    return key.decode("latin-1")


def _key(name: str) -> bytes:
    return name.encode("latin-1")
