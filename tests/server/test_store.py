"""Store and PageArena on their own: eviction by the cache policy, pinning, accounting."""

from __future__ import annotations

import pytest

from lmkv.policy import DEFAULT_POLICY, POLICIES
from lmkv_server.arena import PageArena
from lmkv_server.store import Store

PAGE = 4096
SHAPE = (0, 0, 0, 0)


def make_store(pages: int = 8, policy: str = DEFAULT_POLICY) -> Store:
    return Store(PageArena(pages, PAGE, prefault=False), policy=policy)


def put(store: Store, key: bytes, value: bytes) -> bool:
    pages = store.reserve(len(value))
    if pages is None:
        return False
    offset = 0
    for segment in store.arena.segments(pages, len(value)):
        segment[:] = value[offset : offset + segment.nbytes]
        offset += segment.nbytes
    store.commit(key, len(value), 4, 6, SHAPE, pages)
    return True


def read(store: Store, key: bytes) -> bytes | None:
    entry = store.acquire(key)
    if entry is None:
        return None
    try:
        return b"".join(bytes(s) for s in store.segments(entry))
    finally:
        store.release(entry)


def test_round_trip_across_pages_and_overwrite():
    store = make_store()
    value = bytes(range(256)) * 40  # 10240 bytes: 3 pages
    assert put(store, b"k", value)
    assert read(store, b"k") == value
    assert put(store, b"k", b"short")
    assert read(store, b"k") == b"short"
    assert store.stats().stored_bytes == 5 and store.stats().used_bytes == PAGE
    store.check_integrity()


@pytest.mark.parametrize("policy", ["lru", DEFAULT_POLICY])  # the default starts as LRU
def test_lru_eviction_keeps_recently_read(policy):
    store = make_store(pages=4, policy=policy)
    for key in (b"a", b"b", b"c", b"d"):
        assert put(store, key, b"x" * PAGE)
    assert read(store, b"a") is not None  # a is now most recently used
    assert put(store, b"e", b"y" * PAGE)  # evicts b, the oldest
    assert sorted(store.keys()) == [b"a", b"c", b"d", b"e"]
    stats = store.stats()
    assert stats.evictions == 1 and stats.used_bytes <= stats.capacity_bytes
    store.check_integrity()


def test_value_above_cap_is_refused_without_evicting():
    store = make_store(pages=4)
    assert put(store, b"a", b"x" * PAGE)
    assert not store.fits(5 * PAGE)
    assert store.reserve(5 * PAGE) is None
    assert store.keys() == [b"a"]


def test_pinned_entry_survives_overwrite_until_released():
    store = make_store(pages=4)
    assert put(store, b"a", b"1" * PAGE)
    entry = store.acquire(b"a")
    assert put(store, b"a", b"2" * PAGE)  # old pages stay with the reader
    assert bytes(store.segments(entry)[0]) == b"1" * PAGE
    assert store.arena.free_pages == 2
    store.release(entry)
    assert store.arena.free_pages == 3
    assert read(store, b"a") == b"2" * PAGE
    store.check_integrity()


def test_eviction_skips_pinned_and_reports_busy():
    store = make_store(pages=2)
    assert put(store, b"a", b"x" * PAGE)
    assert put(store, b"b", b"x" * PAGE)
    pinned = [store.acquire(b"a"), store.acquire(b"b")]
    assert store.reserve(PAGE) is None  # everything pinned: nothing can go
    store.release(pinned[0])
    pages = store.reserve(PAGE)  # a is evicted now
    assert pages is not None and store.keys() == [b"b"]
    store.abort(pages)
    store.release(pinned[1])
    store.check_integrity()


def test_integrity_check_catches_leak():
    store = make_store(pages=2)
    store.arena.allocate(1)  # pages taken and never committed or aborted
    with pytest.raises(AssertionError, match="leaked"):
        store.check_integrity()


def test_the_policy_picks_the_victim():
    # LFU keeps the entry read three times over the newer ones read once; LRU does not
    for policy, kept in (("prefix_lfu", b"a"), ("lru", b"b")):
        store = make_store(pages=2, policy=policy)
        assert put(store, b"a", b"x" * PAGE)
        for _ in range(3):
            assert read(store, b"a") is not None
        assert put(store, b"b", b"x" * PAGE) and put(store, b"c", b"x" * PAGE)
        assert sorted(store.keys()) == sorted([kept, b"c"])


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_keeps_pinned_entries_and_accounts(policy):
    store = make_store(pages=4, policy=policy)
    for i in range(40):
        assert put(store, b"k%d" % (i % 9), bytes([i]) * PAGE)
        if i == 3:
            pinned = store.acquire(b"k3")
        read(store, b"k%d" % (i % 5))
    assert pinned is not None and bytes(store.segments(pinned)[0][:1]) == bytes([3])
    store.release(pinned)
    assert len(store.keys()) <= 4
    store.check_integrity()


def test_a_put_that_cannot_get_room_evicts_nothing():
    store = make_store(pages=4)
    assert put(store, b"big", b"x" * 2 * PAGE)
    assert put(store, b"b", b"x" * PAGE) and put(store, b"c", b"x" * PAGE)
    pinned = store.acquire(b"big")
    assert store.reserve(3 * PAGE) is None  # 2 evictable pages of the 3 it needs
    assert sorted(store.keys()) == [b"b", b"big", b"c"]
    store.release(pinned)
    pages = store.reserve(3 * PAGE)  # now it can: the policy's victims make the room
    assert pages is not None and len(store.keys()) < 3
    store.abort(pages)
    store.check_integrity()


def test_reloaded_values_rank_oldest_first_and_can_go_before_ranking():
    # reloading commits the newest file first, each as the oldest value so far
    store = make_store(pages=3, policy="lru")
    for key in (b"new", b"mid", b"old", b"gone"):
        pages = store.reserve(PAGE, evict=False)
        if key == b"gone":  # no room left while reloading: nothing is evicted
            assert pages is None
            break
        store.commit(key, PAGE, 4, 6, SHAPE, pages, oldest=True, notify=False)
    assert store.delete(b"mid")  # before the policy was told of it
    assert put(store, b"a", b"y" * PAGE)  # room without eviction
    assert put(store, b"b", b"y" * PAGE)  # evicts the oldest file
    assert sorted(store.keys()) == [b"a", b"b", b"new"]
    store.check_integrity()


def test_empty_values_hold_a_page_and_are_evicted_like_any_other():
    store = make_store(pages=4)
    for i in range(10):
        assert put(store, b"e%d" % i, b"")
    assert len(store.keys()) == 4
    stats = store.stats()
    assert stats.evictions == 6 and stats.used_bytes == stats.capacity_bytes == 4 * PAGE
    assert read(store, b"e9") == b""
    store.check_integrity()
