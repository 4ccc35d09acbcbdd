"""The storage manager under faults and races (found by a review): every chunk reference is
given back when a read raises half way, a prefetch never deadlocks nor floods the queue
that saves share, a miss never evicts hot chunks, close is safe to race and to repeat, and
the metrics follow evictions and failed writes."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from types import SimpleNamespace

import pytest
import torch

from lmkv.backends.base import BackendError, StorageBackend
from lmkv.layout import KVLayout
from lmkv.memory import HEADER_BYTES, MemoryPool
from lmkv.metrics import LMKVMetrics
from lmkv.storage import manager as manager_module
from lmkv.storage.manager import StorageManager
from lmkv.storage.tier import Tier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, chunk_size=4)
SLOT = HEADER_BYTES + LAYOUT.chunk_bytes


class Memory(StorageBackend):
    def __init__(self):
        self.values: dict[str, bytes] = {}

    def put(self, items):
        self.values.update((k, bytes(v)) for k, v in items)

    def get(self, keys):
        return [self.values.get(k) for k in keys]

    def contains(self, keys):
        return [k in self.values for k in keys]


def manager(slots=8, tiers=1, queue=256, policy="prefix_adaptive"):
    pool = MemoryPool(LAYOUT, slots * SLOT, pin=False)
    ts = [Tier(f"t{i}", Memory(), "raw") for i in range(tiers)]
    return pool, ts, StorageManager(pool, ts, LMKVMetrics(), queue, policy=policy)


def seed(pool, tier, keys):
    for i, key in enumerate(keys):
        buf = pool.allocate()
        buf.kv.fill_(float(i))
        tier.write(key, tier.encode(key, buf))
        buf.release()


def raise_on(tier, bad):
    real = tier._check

    def check(key, buf, data):
        return RuntimeError("a decoder's bug") if key == bad else real(key, buf, data)

    tier._check = check


def metric(m, name, **labels):
    return m.metrics.registry.get_sample_value(name, labels or None) or 0.0


def test_a_read_that_raises_half_way_gives_every_reference_back():
    for tiers, keys, bad in ((1, [f"k{i}" for i in range(12)], "k9"), (2, ["k0", "k1"], "k1")):
        pool, ts, m = manager(slots=32, tiers=tiers)
        if tiers == 1:
            seed(pool, ts[0], keys)
        else:
            seed(pool, ts[0], keys[:1])
            seed(pool, ts[1], keys[1:])
        raise_on(ts[-1], bad)
        with pytest.raises(RuntimeError, match="decoder"):
            m.fetch(keys)
        assert all(b.ref_count == 1 for b in m.hot.entries.values())  # only the cache's own
        pool.check_integrity()
        m.close()


def test_a_prefetch_whose_job_ends_at_once_does_not_deadlock():
    """The job may finish before prefetch returns (a miss, an open breaker)."""
    pool, _, m = manager(slots=16)
    real = m.io.submit

    def submit(fn, urgent=False):
        fut = real(fn, urgent)
        if fut is not None:
            fut.exception()  # the caller preempted until the worker finished the job
        return fut

    m.io.submit = submit
    done = threading.Event()
    threading.Thread(target=lambda: (m.prefetch(["k0", "k1"]), done.set()), daemon=True).start()
    assert done.wait(5), "prefetch deadlocked"
    m.io.submit = real
    m.close()


def test_a_long_prefetch_is_one_job_and_leaves_room_for_saves():
    pool, ts, m = manager(slots=16, queue=16)
    m.prefetch([f"missing{i}" for i in range(100_000)])
    assert m.io.pending() <= 1
    for i in range(10):  # the saves after it are not dropped
        buf = m.allocate()
        m.put(f"s{i}", buf)
        buf.release()
    m.io.drain()
    assert all(f"s{i}" in ts[0].backend.values for i in range(10))
    assert metric(m, "lmkv_dropped_total", what="save_t0") == 0
    m.close()


def test_a_miss_does_not_evict_hot_chunks():
    pool, ts, m = manager(slots=4)
    for i in range(4):  # the hot cache full of chunks the tier also holds
        buf = m.allocate()
        m.put(f"h{i}", buf, f"h{i - 1}" if i else None)
        buf.release()
    m.io.drain()
    got = m.fetch(["h0", "gone1", "gone2", "gone3"])
    assert len(got) == 1 and len(m.hot) == 4  # nothing evicted for the three misses
    for buf in got:
        buf.release()
    m.close()


def test_close_twice_and_a_fetch_racing_close():
    pool, ts, m = manager()
    m.close()
    m.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="closed"):
        m.fetch(["anything"])  # fails at once, never waits for a worker that stopped


def test_a_write_that_fails_unexpectedly_is_counted_and_the_other_tiers_still_get_it(caplog):
    pool, ts, m = manager(tiers=2)

    def broken(key, frame):
        raise OSError("not a BackendError")

    ts[0].write = broken
    buf = m.allocate()
    m.put("k", buf)
    buf.release()
    m.io.drain()
    assert "k" in ts[1].backend.values
    assert metric(m, "lmkv_errors_total", tier="t0", kind="put") == 1
    assert "writing a chunk to the t0 tier failed" in caplog.text
    m.close()


def test_hot_evictions_are_counted_and_the_gauge_follows_them():
    pool, ts, m = manager(slots=4)
    for i in range(6):
        buf = m.allocate()
        m.put(f"k{i}", buf)
        buf.release()
        m.io.drain()  # (the write to the tier holds the slot until it is done)
    assert metric(m, "lmkv_evictions_total", tier="hot") == 2
    held = [m.allocate() for _ in range(4)]  # evicts everything left
    assert metric(m, "lmkv_hot_cache_chunks") == len(m.hot) == 0
    for buf in held:
        buf.release()
    m.close()


def test_chunks_read_from_a_tier_join_the_prefix_tree_under_their_parents():
    """A prompt's first chunk, read back from disk, is not evicted before the chunks that
    continue it (before, every chunk read from a tier was a root)."""
    pool, ts, m = manager(slots=4)
    seed(pool, ts[0], ["A", "B", "C"])
    for buf in m.fetch(["A", "B", "C"]):
        buf.release()
    buf = m.allocate()  # a fourth chunk fills the cache, and a fifth evicts one
    m.put("X0", buf)
    buf.release()
    buf = m.allocate()
    m.put("X1", buf)
    buf.release()
    assert m.hot.contains("A") or not (m.hot.contains("B") or m.hot.contains("C"))
    m.close()


def test_a_tier_that_fails_every_write_still_serves_reads_and_logs_little(caplog):
    """A full or read-only disk: writes back off (1 s, 2 s, ... 30 s) however many reads
    succeed meanwhile, reads keep being served, and a long run logs a few lines, not one a
    second."""
    import logging

    from lmkv.backends.base import BackendError

    pool, ts, m = manager(slots=16)
    seed(pool, ts[0], ["r0"])

    def full(items):
        raise BackendError("[Errno 28] No space left on device")

    ts[0].backend.put = full
    clock = [1000.0]
    monkey = pytest.MonkeyPatch()
    monkey.setattr("lmkv.storage.breaker.time.monotonic", lambda: clock[0])
    try:
        with caplog.at_level(logging.WARNING):
            for step in range(600):  # 10 minutes, a save and a read a second
                clock[0] += 1.0
                buf = m.allocate()
                buf.kv.fill_(1.0)
                m.put(f"s{step}", buf)
                buf.release()
                m.io.drain()
                m.hot.clear()
                got = m.fetch(["r0"])
                assert len(got) == 1  # the reads are not held off by the failing writes
                for b in got:
                    b.release()
    finally:
        monkey.undo()
    failed_writes = metric(m, "lmkv_errors_total", tier="t0", kind="put")
    assert failed_writes < 30 and caplog.text.count("put failed") == failed_writes
    m.close()


def test_corrupt_chunks_are_each_counted_but_logged_once_a_minute(caplog):
    import logging

    pool, ts, m = manager(slots=32)
    keys = [f"k{i}" for i in range(20)]
    seed(pool, ts[0], keys)
    for key in keys:
        frame = bytearray(ts[0].backend.values[key])
        frame[-1] ^= 0xFF
        ts[0].backend.values[key] = bytes(frame)
    with caplog.at_level(logging.WARNING):
        for key in keys:
            assert m.fetch([key]) == []
    assert metric(m, "lmkv_errors_total", tier="t0", kind="corrupt") == 20
    assert caplog.text.count("is corrupt") == 1
    m.close()


class Stuck(Memory):
    """A backend whose writes hang until released (a dead NFS mount, a hung server)."""

    def __init__(self):
        super().__init__()
        self.started, self.release = threading.Event(), threading.Event()

    def put(self, items):
        self.started.set()
        self.release.wait()
        super().put(items)


def hung_write(pool) -> tuple[Stuck, StorageManager]:
    """A manager over one tier whose backend's first write (of chunk "a", made here) hangs
    until ``release`` is set, holding the I/O worker."""
    backend = Stuck()
    m = StorageManager(pool, [Tier("t", backend, "raw")], LMKVMetrics(), 16, policy="lru")
    put_one(pool, m, "a")
    assert backend.started.wait(5)
    return backend, m


def hold_worker(m) -> threading.Event:
    """Keep ``m``'s I/O worker busy and its queue (of one) full until the event is set."""
    gate = threading.Event()
    m.io.submit(gate.wait)
    while m.io.pending():
        pass
    m.io.submit(lambda: None)
    return gate


def put_one(pool, m, key, parent=None):
    buf = pool.allocate()
    m.put(key, buf, parent)
    buf.release()


def test_a_write_dropped_by_a_full_queue_is_written_when_the_hot_chunk_is_next_used():
    """A hot chunk whose write below was dropped is written when a load hits it, or when a
    save finds it hot already, once."""
    pool, (tier,), m = manager(queue=1, policy="lru")
    gate = hold_worker(m)
    put_one(pool, m, "a")
    put_one(pool, m, "b")
    assert m.metrics.registry.get_sample_value("lmkv_dropped_total", {"what": "save_t0"}) == 2
    gate.set()
    m.io.drain()
    assert tier.contains(["a", "b"]) == [False, False]
    for buf in m.fetch(["a"]):  # a hit on the hot chunk queues the lost write again
        buf.release()
    m.io.drain()  # (a queue of one)
    m.written_below("b")  # a save that found "b" hot
    m.io.drain()
    assert tier.contains(["a", "b"]) == [True, True]
    for buf in m.fetch(["a"]):  # once
        buf.release()
    m.written_below("b")
    assert m.io.drain() and m.metrics.registry.get_sample_value(
        "lmkv_tier_seconds_count", {"tier": "t0", "op": "put"}) == 2
    m.close()


def test_a_lost_write_is_written_again_when_the_engine_serves_the_chunk_from_its_own_memory():
    """An engine's prefix cache serves its most used prefixes itself (lmkv is only told of
    the use, touch): a chunk whose write below was lost (a shared store down when it was
    saved) is queued again then, or it never reached the store after the outage."""
    pool, (tier,), m = manager(queue=1, policy="lru")
    gate = hold_worker(m)
    put_one(pool, m, "a")  # dropped
    put_one(pool, m, "b")  # dropped
    gate.set()
    m.io.drain()
    assert tier.contains(["a", "b"]) == [False, False]
    for _ in range(2):  # (a queue of one: "b"'s is dropped again the first time)
        m.touch(["a", "b"])
        m.io.drain()
    assert tier.contains(["a", "b"]) == [True, True] and not m._unwritten
    m.touch(["a", "b"])  # once
    assert m.io.drain() and m.metrics.registry.get_sample_value(
        "lmkv_tier_seconds_count", {"tier": "t0", "op": "put"}) == 2
    m.close()


def test_a_key_twice_in_one_fetch_gets_two_references_and_leaks_nothing():
    pool, (tier,), m = manager(slots=6, policy="lru")
    seed(pool, tier, ["b"])
    put_one(pool, m, "a")
    got = m.fetch(["b", "a", "a", "b"])
    assert len(got) == 4 and got[1] is got[2] and got[0] is got[3]
    for buf in got:
        buf.release()
    m.io.drain()  # (the write of "a" holds it until done)
    m.hot.clear()
    assert pool.num_free == pool.num_slots
    m.close()


def test_close_and_loads_return_while_a_tier_call_is_stuck(monkeypatch, caplog):
    """A write hangs in its backend: a load waits FETCH_TIMEOUT, then the prefix ends (the
    chunks are recomputed), later loads serve hot chunks only until the stuck job ends,
    what the timed-out load reads goes back to the pool, and close gives up after its
    timeout instead of hanging."""
    from lmkv.storage import manager as manager_module

    monkeypatch.setattr(manager_module, "FETCH_TIMEOUT", 0.2)
    pool = MemoryPool(LAYOUT, 8 * SLOT, pin=False)
    backend = Stuck()
    tier = Tier("t", backend, "raw")
    buf = pool.allocate()
    backend.values["x"] = bytes(tier.encode("x", buf))  # a chunk only the tier holds
    buf.release()
    m = StorageManager(pool, [tier], LMKVMetrics(), 16, policy="lru")
    put_one(pool, m, "hot")  # its write hangs in the backend, holding the I/O worker
    assert backend.started.wait(5)
    got = m.fetch(["hot", "x"])  # "x" waits 0.2 s for the worker, then is a miss
    assert len(got) == 1
    got[0].release()
    assert m.metrics.registry.get_sample_value("lmkv_errors_total",
                                               {"tier": "io", "kind": "timeout"}) == 1
    got = m.fetch(["hot", "x"])  # the worker is still stuck: hot chunks only, no wait
    assert len(got) == 1
    got[0].release()
    assert m.metrics.registry.get_sample_value("lmkv_errors_total",
                                               {"tier": "io", "kind": "timeout"}) == 1
    closer = threading.Thread(target=m.close, kwargs={"timeout": 0.3})
    closer.start()
    closer.join(5)
    assert not closer.is_alive()
    assert "unfinished" in caplog.text or "did not stop" in caplog.text
    backend.release.set()  # the stuck write ends; the load queued behind it had been cancelled
    m.io._thread.join(5)
    assert pool.num_free == pool.num_slots  # nothing held by the abandoned jobs


def test_drains_behind_a_stuck_tier_call_wait_once_and_queue_nothing(monkeypatch):
    """A producer drains after each finished request. With a tier write hung: the first
    drain waits its timeout, later ones return at once (before, each waited the whole
    timeout again, each behind one more queued no-op filling the queue), as lmkv's drain
    does once a load found the worker stuck; after the write ends drains wait again. A
    drain beside another that has not timed out waits as usual."""
    from lmkv.storage import manager as manager_module

    monkeypatch.setattr(manager_module, "FETCH_TIMEOUT", 0.2)
    pool = MemoryPool(LAYOUT, 8 * SLOT, pin=False)
    backend, m = hung_write(pool)
    start = time.monotonic()
    assert not m.io.drain(0.3)
    assert time.monotonic() - start >= 0.3
    queued = m.io.pending()
    start = time.monotonic()
    for _ in range(5):
        assert not m.io.drain(0.3)
    assert time.monotonic() - start < 0.1 and m.io.pending() == queued
    backend.release.set()
    deadline = time.monotonic() + 5
    while not m.io.drain(5):  # (once the stalled no-op has run)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # two drains side by side behind a job that takes a while: both wait for it
    slow = m.io.submit(lambda: time.sleep(0.5))
    results = []
    drains = [threading.Thread(target=lambda: results.append(m.io.drain(5))) for _ in range(2)]
    for t in drains:
        t.start()
    for t in drains:
        t.join()
    assert slow.done() and results == [True, True]
    # a load that timed out marks the worker stuck: lmkv's drain does not wait for it either
    from lmkv.cache import LMKVCache
    from lmkv.logs import LogThrottle

    cache = object.__new__(LMKVCache)
    cache.storage, cache._quiet = m, LogThrottle()
    backend.release.clear()
    backend.started.clear()
    put_one(pool, m, "b")
    assert backend.started.wait(5)
    backend.values["x"] = b"x"  # held by the tier only: its read waits for the worker
    assert m.fetch(["x"]) == [] and m.io_stuck()  # waited FETCH_TIMEOUT for the worker
    start = time.monotonic()
    assert not cache.drain(10)
    assert time.monotonic() - start < 0.1
    backend.release.set()
    deadline = time.monotonic() + 5
    while m.io_stuck():  # free again once the stuck write has ended
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert cache.drain(5)
    m.close()


def test_failed_tier_calls_are_timed_and_so_are_contains():
    class Failing(Memory):
        def put(self, items):
            raise BackendError("timed out")

        def get(self, keys):
            raise BackendError("timed out")

    pool = MemoryPool(LAYOUT, 4 * SLOT, pin=False)
    tier = Tier("t", Failing(), "zstd")
    buf = pool.allocate()
    tier.write("a", tier.encode("a", buf))
    tier.read(["a"], [buf])
    buf.release()
    count = lambda op: tier.metrics.registry.get_sample_value(  # noqa: E731
        "lmkv_tier_seconds_count", {"tier": "t", "op": op})
    assert count("put") == 1 and count("get") == 1
    tier2 = Tier("t2", Memory(), "raw")
    tier2.contains(["a"])
    assert tier2.metrics.registry.get_sample_value(
        "lmkv_tier_seconds_count", {"tier": "t2", "op": "contains"}) == 1


def test_the_time_a_load_waits_for_the_tiers_below_is_measured():
    """lmkv_load_wait_seconds: what a lookup (and the engine's scheduling with it) waited for
    chunks from below the hot cache, also where the tier's reads took long; a fetch served
    by the hot cache alone waits for nothing and is not counted."""
    class Slow(Memory):
        def get(self, keys):
            time.sleep(0.3)
            return super().get(keys)

    pool = MemoryPool(LAYOUT, 8 * SLOT, pin=False)
    tier = Tier("t", Slow(), "zstd")
    m = StorageManager(pool, [tier], LMKVMetrics(), 256)
    seed(pool, tier, ["a", "b"])
    bufs = m.fetch(["a", "b"])
    assert len(bufs) == 2
    assert metric(m, "lmkv_load_wait_seconds_count") == 1
    assert 0.3 <= metric(m, "lmkv_load_wait_seconds_sum") < 2
    assert metric(m, "lmkv_load_wait_seconds_bucket", le="0.25") == 0
    for buf in bufs:
        buf.release()
    for buf in m.fetch(["a", "b"]):  # hot now
        buf.release()
    assert metric(m, "lmkv_load_wait_seconds_count") == 1
    m.close()


def test_chunks_brought_up_for_a_waiting_request_go_ahead_of_queued_work():
    """bring_up reads chunks that a queued prefetch holds ahead of the saves and prefetches
    queued before it (urgent, as a fetch), without the caller waiting: an engine that leaves
    a request waiting for them never waits behind a backlog of writes."""
    pool, (tier,), m = manager(slots=16)
    seed(pool, tier, ["a", "b", "c"])
    gate = threading.Event()
    order: list[str] = []
    m.io.submit(gate.wait)  # a long job runs
    try:
        m.io.submit(lambda: order.append("queued save"))
        m.prefetch(["a", "b", "c"])  # queued behind the save
        assert m.bring_up(["x"]) is None  # no prefetch holds it: nothing to bring up
        arrival = m.bring_up(["a", "b", "c"])
        assert arrival is not None
        arrival.future.add_done_callback(lambda f: order.append("brought up"))
        assert not arrival.done()
    finally:
        gate.set()
    arrival.future.result(5)
    arrival.release()
    m.io.drain(5)
    assert order == ["brought up", "queued save"]
    assert m.bring_up(["a", "b", "c"]) is None  # the prefetch ran, finding them hot
    for buf in m.fetch(["a", "b", "c"]):
        buf.release()
    assert metric(m, "lmkv_load_wait_seconds_count") == 0  # all hot: nothing waited for
    pool.check_integrity()
    m.close()


def brought_up(m, *runs):
    """bring_up of each run of keys while a prefetch of it is queued, all queued at once;
    their arrivals once done."""
    gate = threading.Event()
    m.io.submit(gate.wait)
    try:
        for keys in runs:
            m.prefetch(keys)
        arrivals = [m.bring_up(keys) for keys in runs]
        assert None not in arrivals
    finally:
        gate.set()
    for arrival in arrivals:
        arrival.future.result(5)
    m.io.drain(5)
    return arrivals


def churn(m, n, prefix="new"):
    """``n`` other chunks saved: as many evictions as the hot cache needs for them."""
    for i in range(n):
        m.io.drain(5)  # (each queued write holds a slot)
        buf = m.allocate()
        assert buf is not None
        m.put(f"{prefix}{i}", buf)
        buf.release()


def test_chunks_brought_up_for_a_waiting_request_stay_hot_until_it_lets_them_go():
    """A hot cache smaller than the chunks of the requests waiting for them: what bring_up
    read up is held until the request lets go (after its lookup), not evicted by other
    requests' saves meanwhile and read from the tier again."""
    pool, (tier,), m = manager(slots=8, policy="lru")
    seed(pool, tier, ["a", "b", "c"])
    (arrival,) = brought_up(m, ["a", "b", "c"])
    churn(m, 20)
    reads = metric(m, "lmkv_tier_seconds_count", tier="t0", op="get")
    bufs = m.fetch(["a", "b", "c"])  # the request's lookup
    assert len(bufs) == 3
    assert metric(m, "lmkv_tier_seconds_count", tier="t0", op="get") == reads  # all hot
    arrival.release()
    arrival.release()  # (once only)
    for buf in bufs:
        buf.release()
    churn(m, 20, "later")  # evictable again, like any chunk
    assert not any(m.hot.contains(k) for k in ("a", "b", "c"))
    pool.check_integrity()
    m.close()


def test_chunks_held_for_waiting_requests_take_half_the_hot_cache_at_most():
    """Every request's holds together: half the slots (a chunk two requests hold counts
    once), the rest evictable; saves always find a slot. The reads run in the order the
    requests came, one after the other (never one inside another's batches)."""
    pool, (tier,), m = manager(slots=16, policy="lru")
    a, b = [f"a{i}" for i in range(12)], [f"b{i}" for i in range(8)]
    shared = [f"p{i}" for i in range(4)]  # one prefix, two requests (below)
    seed(pool, tier, a + b + shared + ["x", "y"])
    first, second = brought_up(m, a, b)
    assert len(first.bufs) == 8 and second.bufs == []  # the first came first
    churn(m, 40)
    assert m.allocate() is not None
    assert sum(m.hot.contains(k) for k in a) == 8
    first.release()

    one, two = brought_up(m, [*shared, "x"], [*shared, "y"])
    assert len(one.bufs) == 5 and len(two.bufs) == 5  # 6 slots held, not 10
    assert len(m._held_slots) == 6 == metric(m, "lmkv_held_chunks")
    one.release()
    two.release()
    assert not m._held_slots and metric(m, "lmkv_held_chunks") == 0
    pool.check_integrity()
    m.close()


def test_chunks_held_for_waiting_requests_give_way_to_a_save_or_read_that_needs_a_slot():
    """Holds take only slack: with every other slot in use (loads, saves and pins in
    flight), a save or a read takes a held chunk's slot rather than being dropped, the
    latest request's holds first (the earliest is likeliest to be looked up next)."""
    pool, (tier,), m = manager(slots=8, policy="lru")
    seed(pool, tier, ["a0", "a1", "b0", "b1", "c"])
    early, late = brought_up(m, ["a0", "a1"], ["b0", "b1"])
    assert len(early.bufs) == 2 and len(late.bufs) == 2
    in_use = [m.allocate() for _ in range(4)]  # the other slots: loads in flight
    assert None not in in_use
    saves = [m.allocate(), m.allocate()]  # before: None (dropped: no_memory)
    assert None not in saves and late.bufs == [] and len(early.bufs) == 2
    got = m.fetch(["c"])  # a lookup's read: takes the next held slot
    assert len(got) == 1 and early.bufs == []
    for buf in [*in_use, *saves, *got]:
        buf.release()
    assert metric(m, "lmkv_dropped_total", what="no_memory") == 0
    pool.check_integrity()
    m.close()


def test_many_requests_waiting_on_one_prefix_are_brought_up_without_recursion():
    """Hundreds of waiting requests that share a prefix, their bring_ups queued in one
    scheduler step: each runs on its own (before, each ran inside the one before between
    its batches, until Python's recursion limit), and every slot is accounted for."""
    pool, (tier,), m = manager(slots=64, policy="lru")
    prefix = [f"p{i}" for i in range(16)]
    seed(pool, tier, prefix)
    gate = threading.Event()
    m.io.submit(gate.wait)
    try:
        m.prefetch(prefix)
        arrivals = [m.bring_up([*prefix, f"r{r}"]) for r in range(300)]
    finally:
        gate.set()
    for arrival in arrivals:
        assert arrival.future.exception(10) is None
    assert len(m._held_slots) == 16
    for arrival in arrivals:
        arrival.release()
    pool.check_integrity()
    assert pool.num_free + len(m.hot) == pool.num_slots  # none held by anything else
    m.close()


def test_chunks_brought_up_but_never_let_go_are_let_go_after_a_while(monkeypatch, caplog):
    """A request that never released its chunks (its scheduler went away): held for
    ARRIVAL_HOLD at most, logged; saves may evict them then."""
    pool, (tier,), m = manager(slots=8, policy="lru")
    seed(pool, tier, ["a", "b"])
    (arrival,) = brought_up(m, ["a", "b"])
    monkeypatch.setattr(manager_module, "ARRIVAL_HOLD", 0.05)
    time.sleep(0.1)
    with caplog.at_level("WARNING"):
        churn(m, 20)
    assert not m._held and not m._held_slots and arrival.bufs == []
    assert not m.hot.contains("a") and not m.hot.contains("b")
    assert "did not ask for them within" in caplog.text
    arrival.release()  # (late: nothing left to let go)
    pool.check_integrity()
    m.close()


def test_chunks_let_go_before_they_arrive_are_not_held():
    """A request looked up (or gone) before its read-up ran: the read-up reads nothing and
    holds nothing (the prefetch still brings the chunks up)."""
    pool, (tier,), m = manager(slots=8, policy="lru")
    seed(pool, tier, ["a", "b"])
    gate, after = threading.Event(), threading.Event()
    m.io.submit(gate.wait)
    try:
        m.prefetch(["a", "b"])
        arrival = m.bring_up(["a", "b"])
        m.io.submit(after.wait, soon=True)  # runs after the read-up, before the prefetch
        arrival.release()
    finally:
        gate.set()
    try:
        arrival.future.result(5)
        assert not m.hot.contains("a")  # the read-up ran first, and read nothing
    finally:
        after.set()
    assert m.io.drain(5)
    assert m.hot.contains("a") and not m._held and not m._held_slots
    pool.check_integrity()
    m.close()


def test_reads_a_tier_breaker_holds_off_are_counted_as_skipped():
    pool, (tier,), m = manager(slots=8)
    seed(pool, tier, ["a", "b"])
    tier.breaker.failure()  # held off
    assert m.fetch(["a", "b"]) == []
    assert metric(m, "lmkv_tier_skipped_total", tier="t0", op="get") == 1
    m.close()


def test_nothing_is_brought_up_while_the_io_worker_is_stuck(monkeypatch):
    """With a tier call stuck, a fetch takes hot chunks only, at once: a request is not
    held back for chunks a queued prefetch will not bring while it lasts."""
    pool, (tier,), m = manager(slots=8)
    seed(pool, tier, ["a"])
    gate = threading.Event()
    m.io.submit(gate.wait)
    try:
        m.prefetch(["a"])
        monkeypatch.setattr(m, "io_stuck", lambda: True)
        assert m.bring_up(["a"]) is None
        monkeypatch.setattr(m, "io_stuck", lambda: False)
        arrival = m.bring_up(["a"])
        assert arrival is not None
    finally:
        gate.set()
    arrival.future.result(5)
    m.close()


def test_stored_chunks_counts_only_chunks_kept_or_queued_below():
    pool = MemoryPool(LAYOUT, 4 * SLOT, pin=False)
    metrics = LMKVMetrics()
    m = StorageManager(pool, [], metrics, 16)  # a prefix policy, no tier below
    put_one(pool, m, "child", parent="gone")  # refused: its parent is not held
    put_one(pool, m, "root")
    assert len(m.hot) == 1
    assert metrics.registry.get_sample_value("lmkv_stored_chunks_total") == 1
    m.close()


class Counting(Memory):
    def __init__(self):
        super().__init__()
        self.puts = 0

    def put(self, items):
        self.puts += 1
        super().put(items)


class Refusing(Counting):
    """A tier that takes no writes (a read-only or full disk)."""

    def put(self, items):
        self.puts += 1
        raise BackendError("read-only file system")


def test_a_tier_that_takes_no_writes_does_not_make_hot_hits_rewrite_the_others():
    pool = MemoryPool(LAYOUT, 8 * SLOT, pin=False)
    refusing, healthy = Refusing(), Counting()
    tiers = [Tier("ro", refusing, "raw"), Tier("ok", healthy, "raw")]
    m = StorageManager(pool, tiers, LMKVMetrics(), 16, policy="lru")
    put_one(pool, m, "a")
    m.io.drain()
    for _ in range(50):  # hits while the read-only tier's write breaker holds writes off
        for buf in m.fetch(["a"]):
            buf.release()
        m.io.drain()
    assert healthy.puts == 1 and refusing.puts == 1
    tiers[0].write_breaker = type(tiers[0].write_breaker)()  # its pause over: tried again, alone
    for buf in m.fetch(["a"]):
        buf.release()
    m.io.drain()
    assert healthy.puts == 1 and refusing.puts == 2
    m.close()


def test_a_lost_write_is_forgotten_with_its_chunk_and_lossy_chunks_are_never_written_again():
    pool, (tier,), m = manager(slots=4, queue=1, policy="lru")
    gate = hold_worker(m)
    put_one(pool, m, "a")  # dropped
    buf = pool.allocate()
    buf.lossy = True  # as if decoded from a cachegen frame
    m.put("b", buf)  # dropped
    buf.release()
    gate.set()
    m.io.drain()
    assert set(m._unwritten) == {"a"}
    for _ in range(pool.num_slots):  # "a" is evicted for new chunks
        m.allocate()
    assert not m.hot.contains("a") and not m._unwritten
    m.close()


def test_a_slow_tier_gives_the_chunks_read_by_the_deadline(monkeypatch):
    """A tier that answers, slowly: the load returns the prefix read by FETCH_TIMEOUT / 2
    instead of throwing all of it away."""
    from lmkv.storage import manager as manager_module

    monkeypatch.setattr(manager_module, "FETCH_TIMEOUT", 2.0)
    pool, (tier,), m = manager(slots=40, policy="lru")
    keys = [f"k{i}" for i in range(32)]
    seed(pool, tier, keys)
    real = tier.backend.get_into_many

    def slow(*args, **kwargs):
        time.sleep(0.4)
        return real(*args, **kwargs)

    tier.backend.get_into_many = slow
    got = m.fetch(keys)
    assert 0 < len(got) < len(keys)  # 8 chunks a batch, one every 0.4 s, none after 1 s
    assert m.metrics.registry.get_sample_value("lmkv_errors_total",
                                               {"tier": "io", "kind": "timeout"}) is None
    for buf in got:
        buf.release()
    m.close()


def test_a_lookup_returns_while_a_write_to_the_tier_hangs(monkeypatch):
    from lmkv.storage import tier as tier_module

    monkeypatch.setattr(tier_module, "LOCK_WAIT", 0.2)
    pool = MemoryPool(LAYOUT, 8 * SLOT, pin=False)
    backend, m = hung_write(pool)
    start = time.monotonic()
    assert m.lookup(["x"]) == 0 and time.monotonic() - start < 2
    assert m.metrics.registry.get_sample_value("lmkv_errors_total",
                                               {"tier": "t", "kind": "busy"}) == 1
    # the next lookups (each on the engine's scheduling thread) do not wait again while
    # the call hangs: before, each waited LOCK_WAIT (5 s) for as long as it did
    start = time.monotonic()
    for i in range(5):
        assert m.lookup([f"k{i}"]) == 0
    assert time.monotonic() - start < 0.15
    assert m.metrics.registry.get_sample_value("lmkv_errors_total",
                                               {"tier": "t", "kind": "busy"}) == 6
    backend.release.set()
    assert m.io.drain(5)
    # the call ended: the next one (a call of 0.05 s) is waited for again, not missed
    tier, taken = m.tiers[0], threading.Event()

    def another_call():
        with tier._lock:
            taken.set()
            time.sleep(0.05)

    caller = threading.Thread(target=another_call)
    caller.start()
    assert taken.wait(5)
    assert tier.contains(["a", "x"]) == [True, False]
    caller.join()
    m.close()


def hot_put(m, key, parent=None):
    buf = m.allocate()
    m.hot.put(key, buf, parent)
    buf.release()


@pytest.mark.parametrize("policy", ["lru", "prefix_lru", "prefix_adaptive"])
def test_a_load_never_evicts_the_chunk_it_continues(policy):
    # a conversation's next turn: its first chunks are hot but the oldest, the rest below;
    # taking slots for the rest must not evict the chunk they continue (a prefix policy
    # would then refuse every chunk read)
    pool, ts, m = manager(slots=4, policy=policy)
    seed(pool, ts[0], ["a0", "a1", "a2", "a3", "c0", "c1"])
    for key, parent in (("a0", None), ("a1", "a0"), ("b0", None), ("b1", "b0")):
        hot_put(m, key, parent)
    m.prefetch(["a0", "a1", "a2", "a3"])
    m.io.drain(5)
    assert sorted(m.hot.entries) == ["a0", "a1", "a2", "a3"]
    assert m.lookup(["a0", "a1", "a2", "a3"]) == 4 and m.hot.num_refused == 0
    m.close()
    assert pool.num_free == 4
    # a fetch past a chunk that the engine's own prefix cache served (lmkv did not touch it)
    pool, ts, m = manager(slots=4, policy=policy)
    seed(pool, ts[0], ["c0", "c1"])
    for key, parent in (("p", None), ("b0", None), ("b1", "b0")):
        hot_put(m, key, parent)
    got = m.fetch(["c0", "c1"], parent="p")
    assert len(got) == 2 and {"p", "c0", "c1"} <= set(m.hot.entries)
    assert m.hot.num_refused == 0
    for buf in got:
        buf.release()
    assert all(b.ref_count == 1 for b in m.hot.entries.values())
    m.close()
    pool.check_integrity()
    assert pool.num_free == 4


def test_a_prefetch_with_a_repeated_key_gives_every_slot_back():
    pool, ts, m = manager(slots=8, policy="lru")
    seed(pool, ts[0], ["a", "b"])
    hot_put(m, "h")
    m.prefetch(["a", "a", "b"])  # a client's list with a repeat: the run stops at it
    m.prefetch(["h", "h", "a"])
    m.io.drain(5)
    assert all(b.ref_count == 1 for b in m.hot.entries.values())
    m.close()
    assert pool.num_free == 8


@pytest.mark.parametrize("policy", ["prefix_lru", "prefix_adaptive"])
def test_chunks_read_from_several_tiers_enter_the_hot_cache_in_prompt_order(policy):
    pool, ts, m = manager(slots=8, tiers=2, policy=policy)
    seed(pool, ts[1], ["a"])  # the first chunk only in the second tier
    seed(pool, ts[0], ["b", "c"])  # the chunks after it in the first
    got = m.fetch(["a", "b", "c"])
    assert len(got) == 3
    assert sorted(m.hot.entries) == ["a", "b", "c"] and m.hot.num_refused == 0
    for buf in got:
        buf.release()
    m.close()


def test_a_chunk_evicted_while_its_lost_write_is_noted_is_not_remembered():
    """The I/O thread notes a lost write of a hot chunk while another thread evicts it: the
    note must not outlive the chunk (it would make every later hit take the manager's lock
    and could write a chunk of the same key again)."""
    pool, (tier,), m = manager(slots=1, policy="lru")
    gate = hold_worker(m)
    put_one(pool, m, "a")  # the queue is full: its write is dropped and noted
    gate.set()
    m.io.drain()
    m._unwritten.clear()  # as before a second failure of the same write
    evictor = threading.Thread(target=lambda: m.allocate().release())

    class Entries(dict):
        def get(self, key, default=None):
            found = super().get(key, default)
            if key == "a" and not evictor.is_alive() and evictor.ident is None:
                evictor.start()  # evicts "a" now, between this read and the note
                evictor.join(timeout=1.0)
            return found

    m.hot.entries = Entries(m.hot.entries)
    m._note_unwritten("a", [tier])
    evictor.join()
    assert not m.hot.contains("a") and "a" not in m._unwritten
    m.close()


def test_a_load_goes_ahead_of_the_rest_of_a_long_prefetch(monkeypatch):
    """A prefetch of a long prompt from a slow tier is one background job; a load the
    engine waits for (urgent) runs between its batches instead of behind all of it (before:
    it waited FETCH_TIMEOUT, counted an I/O timeout, and took the healthy tier for stuck)."""
    from lmkv.storage import manager as manager_module

    monkeypatch.setattr(manager_module, "FETCH_TIMEOUT", 2.0)

    class Slow(Memory):
        def get_into_many(self, keys, outs, arrived=None):  # 0.1 s a batch
            time.sleep(0.1)
            return super().get_into_many(keys, outs, arrived)

    pool = MemoryPool(LAYOUT, 64 * SLOT, pin=False)
    tier = Tier("slow", Slow(), "raw")
    long_prompt = [f"p{i}" for i in range(48)]  # 6 batches of 8: 0.6 s
    seed(pool, tier, [*long_prompt, "other"])
    m = StorageManager(pool, [tier], LMKVMetrics(), 16, policy="lru")
    m.prefetch(long_prompt)
    time.sleep(0.05)  # its first batch is being read
    start = time.monotonic()
    got = m.fetch(["other"])
    took = time.monotonic() - start
    assert len(got) == 1 and took < 0.4, took
    assert metric(m, "lmkv_errors_total", tier="io", kind="timeout") == 0
    got[0].release()
    assert m.io.drain(5)
    assert m.lookup(long_prompt) == 48 and all(m.hot.contains(k) for k in long_prompt)
    m.close()


def test_a_load_between_prefetch_batches_can_take_the_slots_of_chunks_prefetched():
    """The prefetch holds only its last chunk (the next batch's parent) between batches: a
    load run there may evict the chunks it already put in the hot cache, as it could when
    it ran after the whole prefetch (before, the prefetch held them all and the load got a
    shorter prefix)."""

    class Slow(Memory):
        def get_into_many(self, keys, outs, arrived=None):
            time.sleep(0.2)
            return super().get_into_many(keys, outs, arrived)

    pool = MemoryPool(LAYOUT, 12 * SLOT, pin=False)
    tier = Tier("slow", Slow(), "raw")
    prefetched, other = [f"p{i}" for i in range(16)], [f"o{i}" for i in range(8)]
    seed(pool, tier, prefetched + other)
    m = StorageManager(pool, [tier], LMKVMetrics(), 16, policy="lru")
    m.prefetch(prefetched)
    time.sleep(0.05)
    got = m.fetch(other)
    assert len(got) == 8
    for buf in got:
        buf.release()
    assert m.io.drain(5)
    m.close()
    assert pool.num_free == pool.num_slots


def test_a_load_that_raises_timeout_error_is_not_taken_for_a_stuck_worker():
    """TimeoutError raised by the load itself (the class futures' wait timeout is on Python
    3.11) is its failure, raised to the caller: not a wait that timed out, which would mark
    the worker stuck and serve hot chunks only for a while."""

    class Raising(Memory):
        def get_into_many(self, keys, outs, arrived=None):
            raise TimeoutError("a client library's own timeout")

    pool = MemoryPool(LAYOUT, 8 * SLOT, pin=False)
    tier = Tier("t", Raising(), "raw")
    seed(pool, tier, ["x"])
    m = StorageManager(pool, [tier], LMKVMetrics(), 16, policy="lru")
    with pytest.raises(TimeoutError, match="own timeout"):
        m.fetch(["x"])
    assert not m.io_stuck() and metric(m, "lmkv_errors_total", tier="io", kind="timeout") == 0
    m.close()
    assert pool.num_free == pool.num_slots


def test_a_prefetch_after_close_leaks_nothing():
    """A prefetch arriving as lmkv shuts down (its I/O worker closed) holds nothing."""
    pool, (tier,), m = manager(slots=8, policy="lru")
    seed(pool, tier, ["b"])
    put_one(pool, m, "a")
    assert m.io.drain(5)
    m.io.close()
    m.prefetch(["a", "b"])  # "a" hot (held while the job would run), "b" to fetch
    assert m._inflight == set() and m.hot.contains("a")
    m.hot.clear()
    assert pool.num_free == pool.num_slots
    m.close()


def test_a_chunk_a_prefetch_missed_is_not_asked_for_again_at_admission(monkeypatch):
    """The request's prefetch (in the background, at arrival) found its chunks up to "b":
    the lookup and the fetch at its admission take those from the hot cache and do not ask
    the tier again for "c" (a round trip to a remote on the engine's scheduling thread), for
    MISS_TTL seconds; a chunk stored here meanwhile is found at once."""
    import lmkv.storage.manager as manager_module

    pool, (tier,), m = manager(slots=16)
    seed(pool, tier, ["a", "b"])
    asked: list[str] = []
    for name in ("get", "contains"):
        real = getattr(tier.backend, name)
        setattr(tier.backend, name, lambda keys, real=real, name=name: asked.append(name) or real(keys))
    m.prefetch(["a", "b", "c", "d"])
    m.io.drain(5)
    assert asked  # the prefetch asked the tier
    asked.clear()
    assert m.lookup(["a", "b", "c", "d"]) == 2
    got = m.fetch(["a", "b", "c", "d"])
    assert len(got) == 2 and asked == []  # nothing asked of the tier
    for buf in got:
        buf.release()
    later = time.monotonic() + manager_module.MISS_TTL
    monkeypatch.setattr(manager_module, "time", SimpleNamespace(monotonic=lambda: later))
    assert m.lookup(["a", "b", "c"]) == 2 and asked == ["contains"]  # stale: asked again
    monkeypatch.undo()
    m.prefetch(["c"])
    m.io.drain(5)
    assert m._missed_lately("c")
    buf = pool.allocate()
    assert m.put("c", buf, "b")  # computed and stored here: not a miss any more
    buf.release()
    assert not m._missed_lately("c")
    for key in ("x", "y"):
        m._note_missed(key)
    later = time.monotonic() + manager_module.MISS_TTL
    monkeypatch.setattr(manager_module, "time", SimpleNamespace(monotonic=lambda: later))
    m._note_missed("z")  # the notes past MISS_TTL go (they were kept up to MISSES_KEPT)
    monkeypatch.undo()
    assert list(m._missed) == ["z"]
    pool.check_integrity()
    m.close()


def test_a_chunk_written_below_after_a_prefetch_missed_it_is_found_again():
    """A prefetch queued before a chunk's write finds no tier holding it yet and notes it
    missed after put cleared the note; the write that follows clears it again, so a
    lookup finds the chunk below (here the hot cache refused it: its parent is gone)."""
    pool, (tier,), m = manager(slots=8)
    gate = threading.Event()
    m.io.submit(gate.wait)
    try:
        m.prefetch(["k"])  # runs before the write queued next
        buf = pool.allocate()
        assert m.put("k", buf, "gone")  # refused by the hot cache, queued below
        buf.release()
    finally:
        gate.set()
    m.io.drain(5)
    assert not m.hot.contains("k") and tier.contains(["k"]) == [True]
    assert m.lookup(["k"]) == 1
    pool.check_integrity()
    m.close()


def test_a_chunk_a_prefetch_could_not_read_is_asked_for_again_at_admission(caplog):
    """Only a chunk every tier answered it does not hold counts as missed: one the prefetch
    had no slot for (a small hot cache under load), or a tier held off by its breaker, is
    asked for again at admission (the tier may well hold it)."""
    pool, (tier,), m = manager(slots=4)
    seed(pool, tier, ["a", "b"])
    taken = []
    while (buf := pool.allocate()) is not None:  # every slot held by someone else
        taken.append(buf)
    m.prefetch(["a", "b"])
    m.io.drain(5)
    assert metric(m, "lmkv_dropped_total", what="no_memory") >= 1
    assert "no free chunk slot to read a chunk from t0 into" in caplog.text  # said, once a minute
    assert not m._missed_lately("a")
    for buf in taken:
        buf.release()
    tier.breaker.failure()  # held off
    m.prefetch(["a", "b"])
    m.io.drain(5)
    assert not m._missed_lately("a")
    tier.breaker.success()
    got = m.fetch(["a", "b"])  # asked again, found
    assert len(got) == 2
    for buf in got:
        buf.release()
    pool.check_integrity()
    m.close()


def test_writes_queued_behind_a_slow_tier_give_way_to_saves_that_need_a_slot(caplog):
    """Each queued write keeps its chunk's slot until it runs: behind a slow tier they
    took every slot, and then no save or read found one. A save (or read) that finds no
    free slot now drops the latest queued write (counted, logged) and takes its slot."""
    pool = MemoryPool(LAYOUT, 16 * SLOT, pin=False)
    backend, m = hung_write(pool)  # chunk "a"'s write holds the worker
    m.io._background.maxsize = 0  # (the queue's own bound out of the way: unbounded)
    for i in range(30):
        buf = m.allocate()
        assert buf is not None, f"save {i}: no slot left"
        m.put(f"k{i}", buf)
        buf.release()
    assert len(m._queued) == 15 and m.io.pending() == 30  # (the dropped ones return at once)
    assert metric(m, "lmkv_dropped_total", what="save_t") == 15
    assert metric(m, "lmkv_dropped_total", what="no_memory") == 0
    assert "dropped a queued write" in caplog.text
    backend.release.set()
    assert m.io.drain(5)
    written = {f"k{i}" for i in range(14)} | {"k29"}  # the earliest, and the last one queued
    assert set(backend.values) == written | {"a"}
    assert not m._queued
    pool.check_integrity()
    m.close()


def test_a_save_that_finds_no_slot_drops_no_queued_write_whose_chunk_is_in_use():
    """Dropping the write of a chunk a load holds frees no slot: such writes stay queued."""
    pool = MemoryPool(LAYOUT, 8 * SLOT, pin=False)
    backend, m = hung_write(pool)  # "a"'s write holds the worker
    for i in range(7):
        put_one(pool, m, f"k{i}")
    loading = m.fetch(["a"] + [f"k{i}" for i in range(7)])  # a request loads all 8 chunks
    assert len(loading) == 8
    assert m.allocate() is None  # every slot is in use by the load
    assert metric(m, "lmkv_dropped_total", what="save_t") == 0 and len(m._queued) == 7
    for buf in loading:
        buf.release()
    backend.release.set()
    assert m.io.drain(5)
    assert sorted(backend.values) == ["a"] + [f"k{i}" for i in range(7)]
    m.close()


def test_a_queued_write_of_a_chunk_not_kept_hot_is_dropped_only_once_its_saver_let_go():
    """A chunk the hot cache did not keep (the policy refused it, or local_cpu: false) has
    two references while its save is under way, the saver's and the write's: dropping
    that write freed nothing (and lost the chunk) while the saver still held it."""
    pool = MemoryPool(LAYOUT, 4 * SLOT, pin=False)
    backend = Stuck()
    m = StorageManager(pool, [Tier("t", backend, "raw")], LMKVMetrics(), 16, keep_hot=False,
                       policy="lru")
    put_one(pool, m, "a")  # its write holds the worker
    assert backend.started.wait(5)
    saving = [pool.allocate() for _ in range(3)]
    for i, buf in enumerate(saving):
        m.put(f"k{i}", buf)  # (each saver still holds its buffer)
    assert m.allocate() is None  # every slot in use: none freed by dropping a write
    assert metric(m, "lmkv_dropped_total", what="save_t") == 0 and len(m._queued) == 3
    saving[2].release()  # one saver is done: its write alone holds that slot now
    buf = m.allocate()
    assert buf is not None and metric(m, "lmkv_dropped_total", what="save_t") == 1
    buf.release()
    for b in saving[:2]:
        b.release()
    backend.release.set()
    assert m.io.drain(5) and sorted(backend.values) == ["a", "k0", "k1"]
    m.close()


def test_read_ups_for_requests_that_let_go_or_came_too_late_read_nothing(monkeypatch):
    """A read-up job still read its chunks after its request had let go (looked up,
    aborted), or long after its deadline: 50 requests waiting behind one busy tier call
    read 201 chunks nobody wanted, ahead of every queued save. (Found by a review.)"""
    pool, (tier,), m = manager(slots=64, queue=4, policy="lru")
    runs = [["p", *(f"u{i}_{j}" for j in range(4))] for i in range(50)]
    seed(pool, tier, ["p"] + [k for r in runs for k in r[1:]])
    gate = threading.Event()
    m.io.submit(gate.wait)  # the worker is busy (a slow tier call)
    while m.io.pending():
        time.sleep(0.001)
    m.prefetch(["p"])  # one prefetch queued: its key is in flight
    arrivals = [m.bring_up(keys) for keys in runs[:48]]  # waiting requests sharing "p"
    monkeypatch.setattr(manager_module, "FETCH_TIMEOUT", 0.0)
    late = [m.bring_up(keys) for keys in runs[48:]]  # their deadline passes before they run
    for a in arrivals[3:]:  # let go before their jobs ran
        a.release()
    reads = metric(m, "lmkv_tier_hits_total", tier="t0")
    time.sleep(0.01)
    gate.set()
    assert m.io.drain(10)
    assert metric(m, "lmkv_tier_hits_total", tier="t0") - reads == 1 + 3 * 4  # p, 3 read-ups
    assert all(k in m.hot.entries for r in runs[:3] for k in r)
    assert not any(k in m.hot.entries for r in runs[3:] for k in r[1:])
    for a in arrivals[:3] + late:
        a.release()
    pool.check_integrity()
    m.close()


@pytest.mark.parametrize("policy", ["prefix_lru", "prefix_adaptive"])
def test_a_prefetch_after_a_parent_files_its_chunks_under_it(policy):
    """A prefetch past the engine's own hit names the chunk before its first: its chunks go
    under it, so the parent is not evicted as a leaf while its continuation stays."""
    pool, ts, m = manager(slots=4, policy=policy)
    seed(pool, ts[0], ["c1", "c2"])
    hot_put(m, "p0")
    m.prefetch(["c1", "c2"], parent="p0")
    m.io.drain(5)
    nodes = m.hot.policy.nodes
    hot_put(m, "x0")
    hot_put(m, "x1", "x0")  # the cache is full: one eviction, a leaf
    parent = nodes["c1"].parent.key if nodes.get("c1") and nodes["c1"].parent else None
    kept = set(m.hot.entries)
    m.close()
    assert parent == "p0"
    assert not ({"c1", "c2"} <= kept and "p0" not in kept)  # no orphans


class _LateFuture(Future):
    """A load whose wait times out just before the job ends: its result is there when the
    waiter asks whether it is done."""

    def __init__(self, fn):
        super().__init__()
        self.fn, self.first = fn, True

    def result(self, timeout=None):
        if self.first and timeout is not None:
            self.first = False
            self.set_result(self.fn())
            raise FuturesTimeout()
        return super().result(timeout)


def test_a_load_that_ends_just_as_its_wait_times_out_is_taken():
    """The wait gave up and the job finished before it was asked whether it had: its chunks
    are the fetch's (they stayed retained for ever, and the fetch raised TimeoutError)."""
    pool = MemoryPool(LAYOUT, 8 * SLOT, pin=False)
    tier = Tier("t", Memory(), "raw")
    seed(pool, tier, ["a", "b"])
    m = StorageManager(pool, [tier], LMKVMetrics(), 16, policy="lru")
    real = m.io.submit
    m.io.submit = lambda fn, urgent=False, soon=False: (
        _LateFuture(fn) if urgent else real(fn, urgent, soon))
    got = m.fetch(["a", "b"])
    m.io.submit = real
    assert len(got) == 2
    for buf in got:
        buf.release()
    assert all(b.ref_count == 1 for b in m.hot.entries.values())  # the hot cache's own
    m.close()
    assert pool.num_free == pool.num_slots


def test_bring_up_of_a_repeated_key_leaks_nothing():
    pool, ts, m = manager(slots=8, policy="lru")
    seed(pool, ts[0], ["a", "b"])
    m._inflight.add("a")  # a prefetch holds "a": bring_up reads it up
    arrival = m.bring_up(["a", "a", "b"])
    arrival.future.result(5)
    arrival.release()
    m._inflight.clear()
    m.close()
    assert pool.num_free == pool.num_slots


def test_hot_chunks_a_queued_prefetch_holds_give_way_to_a_save():
    """A prefetch holds the hot chunks before its run until its job ends; while the job
    waits in the queue, a save that finds no slot takes them back (was: no slot, the save
    dropped) and the job still runs."""
    pool, (tier,), m = manager(slots=4, policy="lru")
    seed(pool, tier, ["x"])
    for key in ("h0", "h1", "h2", "h3"):
        put_one(pool, m, key)
    assert m.io.drain(5)  # written below: no queued write to drop for a slot
    gate = threading.Event()
    m.io.submit(gate.wait)
    try:
        m.prefetch(["h0", "h1", "h2", "h3", "x"])  # all four held, the job queued
        buf = m.allocate()
        assert buf is not None, "the save found no slot"
        buf.release()
        assert metric(m, "lmkv_dropped_total", reason="no_memory") == 0
    finally:
        gate.set()
    assert m.io.drain(5)
    assert m.hot.contains("x") and not m._prefixes
    assert all(b.ref_count == 1 for b in m.hot.entries.values())
    pool.check_integrity()
    m.close()


def test_a_running_prefetch_keeps_the_hot_chunks_it_continues():
    """Only a queued prefetch's holds give way to a slot-less save: once its job runs, the
    chunks before its run stay held (its own reads' slots must not evict them, or the
    chunks it reads would have no parent to follow)."""
    pool, (tier,), m = manager(slots=5, policy="lru")  # h0-h2, the job's read of x, one free
    seed(pool, tier, ["x"])
    for key in ("h0", "h1", "h2"):
        put_one(pool, m, key)
    assert m.io.drain(5)
    reading, go = threading.Event(), threading.Event()
    real = tier.backend.get

    def slow_get(keys):
        reading.set()
        go.wait(5)
        return real(keys)

    tier.backend.get = slow_get
    m.prefetch(["h0", "h1", "h2", "x"])  # holds h0-h2; its job runs and waits in the read
    try:
        assert reading.wait(5)
        first = m.allocate()  # the last free slot
        assert first is not None
        assert m.allocate() is None  # the running job's holds do not give way
        first.release()
    finally:
        go.set()
    assert m.io.drain(5)
    assert all(m.hot.contains(k) for k in ("h0", "h1", "h2"))
    assert all(b.ref_count == 1 for b in m.hot.entries.values())
    m.close()


class Indexed(Memory):
    concurrent_contains = True  # as the disk tier: its index answers beside any call


def test_chunks_stored_nowhere_are_not_waited_for_behind_a_busy_io_worker():
    """A prompt never seen, on a disk tier (an index in memory): its lookup waited for the
    I/O worker to finish the write it was in (10-120 ms a chunk), and a waiting request's
    prefetch, queued as it arrived, held it back one whole engine step (bring_up returned
    an arrival) although the index said at once that nothing was stored."""
    pool = MemoryPool(LAYOUT, 16 * SLOT, pin=False)
    tier = Tier("disk", Indexed(), "raw")
    m = StorageManager(pool, [tier], LMKVMetrics(), 256, policy="prefix_adaptive")
    seed(pool, tier, ["s0"])
    gate = threading.Event()
    m.io.submit(gate.wait)  # a long write runs
    try:
        m.prefetch(["n0", "n1"])
        assert m.bring_up(["n0", "n1"]) is None  # stored nowhere: nothing to wait for
        start = time.monotonic()
        assert m.fetch(["n0", "n1"]) == [] and time.monotonic() - start < 0.5
        m.prefetch(["s0"])
        stored = m.bring_up(["s0"])  # stored below: read up for the waiting request
        assert stored is not None and not stored.done()
    finally:
        gate.set()
    stored.future.result(5)
    stored.release()
    m.io.drain(5)
    pool.check_integrity()
    m.close()


def test_chunks_past_one_no_tier_holds_are_not_read():
    """A disk tier whose cap was lowered keeps a prompt's later chunks and not its first
    (files are written parent first, evicted oldest first): a fetch read them all, counted
    them as hits and dropped them. An index that answers at once ends the read at the gap."""
    pool = MemoryPool(LAYOUT, 16 * SLOT, pin=False)
    tier = Tier("disk", Indexed(), "raw")
    m = StorageManager(pool, [tier], LMKVMetrics(), 256, policy="prefix_adaptive")
    seed(pool, tier, ["k1", "k2", "k3"])
    read = []
    real = tier.read
    tier.read = lambda keys, bufs, absent=None: (read.append(list(keys)), real(keys, bufs, absent))[1]
    assert m.fetch(["k0", "k1", "k2", "k3"]) == []
    assert read == [] and metric(m, "lmkv_tier_hits_total", tier="disk") == 0
    seed(pool, tier, ["k0"])
    got = m.fetch(["k0", "k1", "k2", "k3", "k4"])
    assert len(got) == 4 and read == [["k0", "k1", "k2", "k3"]]
    for buf in got:
        buf.release()
    m.close()
