"""A tier is used from two threads at once: lookups ask it what it holds on the caller's
thread (the engine's scheduler, vLLM's lookup server) while lmkv's I/O worker writes and
reads through the same backend. Backends are not thread-safe (one lm:// connection, the
disk tier's eviction policy), so the tier makes one backend call at a time; before it did,
a real lmkv_server saw requests spliced into each other's payloads."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest
import torch

from lmkv.backends.base import BackendError, StorageBackend
from lmkv.cache import LMKVCache
from lmkv.config import load_config
from lmkv.layout import KVLayout
from lmkv.storage.breaker import CircuitBreaker
from lmkv.storage.tier import PROBE_KEY, Tier

LAYOUT = KVLayout(4, 4, 64, torch.float16, 64)  # 128 KiB chunks


def store_prompt(cache: LMKVCache, seed: int, chunks: int) -> list[str]:
    keys = cache.keys(random.Random(seed).choices(range(30000), k=64 * chunks))
    for key in keys:
        buf = cache.allocate()
        if buf is None:  # every slot waits for its write: the save is dropped, as the connector does
            break
        buf.kv.fill_(seed % 7)
        buf.num_tokens = 64
        cache.store(key, buf)
        buf.release()
    return keys


def test_lookups_beside_saves_on_one_lm_connection_stay_in_step(spawn_server):
    server = spawn_server("--max-memory", "64MiB")
    cfg = load_config(env={}, chunk_size=64, max_local_cpu_size=0.2, remote_url=server.url,
                      remote_timeout=5.0)
    cache = LMKVCache(cfg, LAYOUT, "model")
    try:
        base = store_prompt(cache, 0, 4)
        cache.drain()
        cache.storage.hot.clear()  # lookups must ask the server
        assert cache.lookup(base) == len(base)
        stop = time.monotonic() + 3
        seen: list[int] = []
        errors: list[BaseException] = []

        def look() -> None:
            try:
                while time.monotonic() < stop:
                    seen.append(cache.lookup(base))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        looker = threading.Thread(target=look)
        looker.start()
        seed = 0
        while time.monotonic() < stop:  # saves on the I/O worker, all the while (40 prompts
            store_prompt(cache, 1 + seed % 40, 2)  # over and over: the server never evicts)
            seed += 1
        looker.join()
        cache.drain()
        assert not errors
        assert len(seen) > 100 and set(seen) == {len(base)}  # every lookup found all of it
        samples = cache.metrics.errors.collect()[0].samples
        assert not [s for s in samples if s.value], samples  # no failed call on the tier
        stats = httpx.get(f"http://127.0.0.1:{server.admin_port}/stats").json()
        assert not any(stats["traffic"]["protocol_errors"].values()), stats["traffic"]
        assert cache.fetch(base) and len(cache.fetch(base)) == len(base)
    finally:
        cache.close()


class OneAtATime(StorageBackend):
    """A backend that fails if two of its calls overlap."""

    def __init__(self) -> None:
        self.busy = False
        self.overlaps = 0
        self.calls = 0

    def _enter(self) -> None:
        self.overlaps += self.busy
        self.busy = True
        self.calls += 1
        time.sleep(0.0005)
        self.busy = False

    def put(self, items):
        self._enter()

    def get(self, keys):
        self._enter()
        return [None] * len(keys)

    def contains(self, keys):
        self._enter()
        return [False] * len(keys)


def test_a_tier_never_overlaps_calls_into_its_backend():
    backend = OneAtATime()
    tier = Tier("remote", backend, "zstd")
    frame = memoryview(bytearray(64))

    def hammer(fn) -> None:
        for _ in range(200):
            fn()

    threads = [threading.Thread(target=hammer, args=(fn,)) for fn in (
        lambda: tier.contains(["a", "b"]), lambda: tier.write("a", frame),
        lambda: tier.read(["a"], [None]), lambda: tier.will_get(["a"]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert backend.calls == 600 and backend.overlaps == 0


def test_disk_lookups_do_not_wait_for_the_tiers_call_in_progress(tmp_path):
    """The disk tier answers contains from its index, so a lookup does not queue behind a
    batch read or a write in progress; a backend that is not safe to ask meanwhile waits."""
    from lmkv.backends.disk import DiskBackend

    disk = Tier("disk", DiskBackend(tmp_path, capacity_bytes=1000))
    disk.write("a", memoryview(b"x" * 10))
    other = Tier("remote", OneAtATime(), "zstd")
    answers: list[object] = []
    for tier in (disk, other):
        with tier._lock:  # a call in progress on the I/O worker
            asking = threading.Thread(target=lambda t=tier: answers.append(t.contains(["a"])))
            asking.start()
            asking.join(timeout=0.5)
            waited = asking.is_alive()
        asking.join()
        assert waited == (tier is other)
    assert answers[0] == [True]


def test_a_read_that_raises_returns_every_chunk_it_held(tmp_path):
    """A tier read raising something other than a failed or corrupt read (a decoder's bug)
    reaches the caller, but the hot chunks already taken for it and the slots allocated for
    the batch go back to the pool first."""
    cfg = load_config(env={}, chunk_size=8, max_local_cpu_size=0.001, local_disk=str(tmp_path),
                      max_local_disk_size=0.01)
    cache = LMKVCache(cfg, KVLayout(2, 2, 4, torch.float32, 8), "model")
    try:
        keys = cache.keys(list(range(40)))  # 5 chunks
        for key in keys:
            buf = cache.allocate()
            buf.kv.normal_()
            cache.store(key, buf)
            buf.release()
        cache.drain()
        for key in keys[2:]:  # only on disk now
            cache.storage.hot.entries.pop(key).release()
            cache.storage.hot.policy.removed(key)
        free = cache.pool.num_free

        def broken(keys, bufs, absent=None):
            raise ValueError("a decoder's bug")

        cache.storage.tiers[0].read = broken
        with pytest.raises(ValueError, match="decoder"):
            cache.storage.fetch(keys)
        assert cache.pool.num_free == free
        cache.pool.check_integrity()
    finally:
        cache.close()


class Hangs(StorageBackend):
    """A store that fails, then hangs (a stopped host: calls wait until ``answer`` is set,
    then fail as a client's own timeout would), then answers."""

    def __init__(self) -> None:
        self.mode = "fail"
        self.answer = threading.Event()
        self.calls: list[list[str]] = []

    def put(self, items):
        pass

    def get(self, keys):
        return [None] * len(keys)

    def contains(self, keys):
        self.calls.append(list(keys))
        if self.mode == "hang":
            self.answer.wait(10)
            if self.mode == "hang":
                raise BackendError("timed out")
        elif self.mode == "fail":
            raise BackendError("connection refused")
        return [True] * len(keys)


def test_after_a_failure_a_hung_store_is_probed_off_the_callers_thread():
    """After the breaker's interval a lookup does not call a store that failed: it starts a
    probe on a thread of its own and misses at once, as do the lookups while the probe
    hangs; once the probe answers, lookups go to the store again."""
    backend = Hangs()
    tier = Tier("remote", backend, "zstd", breaker=CircuitBreaker(base_interval=0.05))
    assert tier.contains(["a"]) is None  # fails: the breaker opens
    assert tier.contains(["a"]) is None and len(backend.calls) == 1  # held off
    time.sleep(0.1)
    backend.mode = "hang"
    start = time.monotonic()
    for _ in range(20):  # the probe hangs; lookups miss at once, and start no second probe
        assert tier.contains(["a"]) is None
        assert tier.read(["a"], [None]) == [False]
    assert time.monotonic() - start < 1.0
    deadline = time.monotonic() + 5
    while len(backend.calls) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert backend.calls[1] == [PROBE_KEY] and len(backend.calls) == 2
    backend.mode = "answer"
    backend.answer.set()
    while not tier.available:  # the probe answered: lookups go through again
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert tier.contains(["a", "b"]) == [True, True]
    assert tier.breaker.failures == 0 and not tier.breaker.trial


def test_a_probe_that_fails_holds_reads_off_for_a_longer_interval():
    backend = Hangs()
    tier = Tier("remote", backend, "zstd", breaker=CircuitBreaker(base_interval=0.05))
    assert tier.contains(["a"]) is None
    time.sleep(0.1)
    assert tier.contains(["a"]) is None  # starts the probe, which fails too
    failed = tier.metrics.errors.labels("remote", "probe")
    deadline = time.monotonic() + 5
    while failed._value.get() < 1:  # counted after the breaker reopened
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert tier.breaker.failures == 2 and not tier.available and len(backend.calls) == 2
    assert tier.metrics.errors.labels("remote", "contains")._value.get() == 1


def failed_once() -> tuple[Hangs, list[int], Tier]:
    """A tier whose first lookup failed, its breaker's interval over: the next check of
    ``available`` starts a probe. ``closed`` records the backend's close."""
    backend = Hangs()
    closed: list[int] = []
    backend.close = lambda: closed.append(1)
    tier = Tier("remote", backend, "zstd", breaker=CircuitBreaker(base_interval=0.05))
    assert tier.contains(["a"]) is None
    time.sleep(0.1)
    return backend, closed, tier


def test_closing_does_not_wait_for_a_hung_probe():
    """close returns at once while a probe hangs in the backend; the probe closes the
    backend when its call returns, and no probe starts after close."""
    backend, closed, tier = failed_once()
    backend.mode = "hang"
    assert not tier.available  # starts the probe, which hangs
    deadline = time.monotonic() + 5
    while len(backend.calls) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    start = time.monotonic()
    tier.close()
    assert time.monotonic() - start < 0.5 and closed == []
    backend.answer.set()
    while not closed:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.1)
    assert not tier.available and len(backend.calls) == 2 and closed == [1]


def test_a_probe_thread_that_cannot_start_as_the_tier_closes_still_closes_it(monkeypatch):
    """close() took the probe being started for one in the backend and left the closing to
    it; when its thread cannot start, closing falls to the starter (before: never closed)."""
    import lmkv.storage.tier as tier_module

    backend, closed, tier = failed_once()

    class NoThread:
        def __init__(self, *args, **kwargs):
            pass

        def start(self):
            tier.close()  # close runs between the probe's start and its failure
            raise RuntimeError("can't start new thread")

    from types import SimpleNamespace

    monkeypatch.setattr(tier_module, "threading", SimpleNamespace(Thread=NoThread))  # (here only)
    assert not tier.available
    assert closed == [1]


def test_disk_lookups_do_not_undo_the_breaker_of_failing_reads(tmp_path, monkeypatch):
    """A disk tier's lookups read an index in memory: they answer while its reads fail, so
    they must not reset the breaker the reads opened (else a failing disk would be read at
    every load, its backoff never growing). A file that alone cannot be read is counted
    (kind "unreadable") and missed, without opening the breaker."""
    import errno

    from lmkv.backends.disk import DiskBackend
    from lmkv.memory import MemoryPool

    pool = MemoryPool(LAYOUT, 4 * (64 + LAYOUT.chunk_bytes))
    tier = Tier("disk", DiskBackend(tmp_path, 1 << 30), "zstd",
                breaker=CircuitBreaker(base_interval=0.05))
    src = pool.allocate()
    src.kv.normal_()
    for key in ("a", "b"):
        assert tier.write(key, tier.encode(key, src))
    dst = pool.allocate()
    (tmp_path / tier.backend._name("b")).unlink()
    (tmp_path / tier.backend._name("b")).mkdir()  # EISDIR: this file alone
    assert tier.read(["a", "b"], [dst, pool.allocate()]) == [True, False]
    assert tier.metrics.errors.labels("disk", "unreadable")._value.get() == 1
    assert tier.breaker.failures == 0

    def too_many(*args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr("lmkv.backends.disk._open", too_many)
    assert tier.read(["a"], [dst]) == [False]
    assert tier.breaker.failures == 1
    time.sleep(0.1)
    deadline = time.monotonic() + 5
    while not tier.available:  # the probe (an index lookup) answers
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert tier.contains(["a", "b"]) == [True, False]
    assert tier.breaker.failures == 1  # the lookup proved nothing about reads
    assert tier.read(["a"], [dst]) == [False]
    assert tier.breaker.failures == 2  # the backoff grows
    monkeypatch.undo()
    time.sleep(0.15)
    while not tier.available:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert tier.read(["a"], [dst]) == [True] and torch.equal(dst.kv, src.kv)
    assert tier.breaker.failures == 0


def test_a_breaker_stays_at_its_ceiling_however_long_the_store_is_down():
    """Consecutive failures past 1024 (~8 h at the 30 s ceiling): the interval stays at the
    ceiling (before, the doubling overflowed and every call raised OverflowError)."""
    breaker = CircuitBreaker(base_interval=1.0, max_interval=30.0)
    for _ in range(5000):
        interval = breaker.failure()
    assert interval == 30.0 and not breaker.closed


def test_calls_in_flight_as_the_tier_closes_never_reach_the_closed_backend():
    """A lookup still in flight as lmkv shuts down (a vLLM lookup-socket thread) waits for
    the call in progress, then finds the tier closed: a miss, not a call into a closed
    backend (an lm:// client reconnected, leaking its socket; a native client may crash)."""

    class Recording(OneAtATime):
        closed = False
        after_close = 0

        def _enter(self):
            self.after_close += self.closed
            super()._enter()

        def close(self):
            self.closed = True

    backend = Recording()
    tier = Tier("remote", backend, "zstd")
    frame = memoryview(bytearray(64))
    tier.close()
    assert tier.contains(["a"]) is None and tier.read(["a"], [None]) == [False]
    assert tier.write("a", frame) is False
    # a corrupt frame read just before the close is not removed after it (a closed lazy
    # backend would connect again to do it)
    from lmkv.codec.frame import FrameError

    removed = []
    backend.remove = removed.append
    assert tier._settle("a", b"", FrameError("corrupt")) is False and removed == []
    assert backend.after_close == 0


def test_a_failed_write_and_a_failed_read_say_what_is_paused(caplog):
    """A store that refuses writes pauses writes only, and the warning says so (it said the
    tier was skipped and chunks recomputed, while reads went on); a failed read pauses reads."""

    class Failing(OneAtATime):
        def put(self, items):
            raise BackendError("disk full")

        def get(self, keys):
            raise BackendError("connection reset")

    tier = Tier("disk", Failing(), "zstd")
    with caplog.at_level("WARNING"):
        assert not tier.write("a", memoryview(bytearray(64)))
        tier.read(["a"], [None])
    writes, reads = (r.getMessage() for r in caplog.records[-2:])
    assert "not writing to disk for 1 s (chunks not stored there; reads go on)" in writes
    assert "not reading disk for 1 s" in reads
    tier.close()


def test_a_tier_that_answers_again_says_so_once(caplog):
    """After failed calls the warnings stop when the store answers again, as they would if
    traffic stopped: one line says it answers, after how many failures and how long."""

    class Recovering(OneAtATime):
        down = True

        def put(self, items):
            if self.down:
                raise BackendError("connection refused")

    backend = Recovering()
    tier = Tier("remote", backend, "raw")
    for _ in range(2):
        assert not tier.write("a", memoryview(bytearray(64)))
        tier.write_breaker.open_until = 0.0  # (its pause over)
    backend.down = False
    with caplog.at_level("INFO", logger="lmkv.storage.tier"):
        assert tier.write("a", memoryview(bytearray(64)))
        assert tier.write("b", memoryview(bytearray(64)))
    lines = [r.getMessage() for r in caplog.records if "again" in r.getMessage()]
    assert len(lines) == 1 and "the remote tier takes writes again (after 2 failed calls in" in lines[0]
    tier.close()


def test_a_read_queued_behind_a_call_that_fails_does_not_call_the_store_again():
    """A load that waited for the tier while another call hung in the store, and failed,
    misses at once: the store that just failed is not asked again (before, the read sent
    its own call and the request paid a second timeout)."""

    class Hanging(OneAtATime):
        gets = 0

        def contains(self, keys):
            time.sleep(0.3)
            raise BackendError("timed out receiving")

        def get(self, keys):
            self.gets += 1
            return [None] * len(keys)

    backend = Hanging()
    tier = Tier("remote", backend, "zstd")
    lookup = threading.Thread(target=tier.contains, args=(["a"],))
    lookup.start()
    time.sleep(0.05)  # the lookup holds the tier, its call hanging
    assert tier.read(["a"], [None]) == [False]
    lookup.join()
    assert backend.gets == 0
    tier.close()


class LooksUpButCannotDeliver(StorageBackend):
    """A store over a slow link: lookups (small replies) answer, reads of chunks time out."""

    def __init__(self) -> None:
        self.gets = 0
        self.deliver = False

    def put(self, items):
        pass

    def get(self, keys):
        self.gets += 1
        if not self.deliver:
            raise BackendError("timed out")
        return [None] * len(keys)

    def contains(self, keys):
        return [False] * len(keys)


def test_lookups_that_answer_do_not_reset_the_breaker_of_failing_reads(monkeypatch):
    """After a failed read, the probe and the lookups that follow it answer; the next read
    fails again, and the interval must double (before, each answered lookup reset the
    breaker: one failed read of a whole remote_timeout per base interval, for good). A
    read that succeeds resets it."""
    clock = [1000.0]
    monkeypatch.setattr("lmkv.storage.breaker.time.monotonic", lambda: clock[0])
    backend = LooksUpButCannotDeliver()
    tier = Tier("remote", backend, "zstd", breaker=CircuitBreaker(base_interval=1.0))
    intervals = []
    for _ in range(5):
        assert tier.read(["a"], [None]) == [False]  # the read fails: the breaker opens
        intervals.append(tier.breaker.open_until - clock[0])
        clock[0] = tier.breaker.open_until
        tier._run_probe()  # the interval is over: the probe answers
        assert tier.available and tier.contains(["a", "b"]) == [False, False]
    assert backend.gets == 5 and intervals == [1.0, 2.0, 4.0, 8.0, 16.0]

    backend.deliver = True
    assert tier.read(["a"], [None]) == [False]  # answered (a miss): the breaker closes
    assert tier.breaker.failures == 0 and tier.contains(["a"]) == [False]
    backend.deliver = False
    assert tier.read(["a"], [None]) == [False]
    assert tier.breaker.open_until - clock[0] == 1.0
    skipped = tier.metrics.registry.get_sample_value
    assert skipped("lmkv_tier_skipped_total", {"tier": "remote", "op": "get"}) is None
    # held off: calls are not sent, and counted (no probe yet: the interval is not over)
    assert tier.read(["a"], [None]) == [False] and tier.contains(["a"]) is None
    assert backend.gets == 7
    assert skipped("lmkv_tier_skipped_total", {"tier": "remote", "op": "get"}) == 1
    assert skipped("lmkv_tier_skipped_total", {"tier": "remote", "op": "contains"}) == 1
    # long after the last failed read, with lookups only since, a lookup that answers
    # closes the breaker again (a later glitch is not held against the tier for 30 s)
    clock[0] += 1
    tier._run_probe()
    assert tier.contains(["a"]) == [False] and tier.breaker.failures == 1
    clock[0] += 2 * tier.breaker.max + 1
    assert tier.contains(["a"]) == [False] and tier.breaker.failures == 0


def test_the_remote_tier_is_asked_at_start_and_a_dead_one_is_logged_and_skipped(spawn_server, caplog):
    """An operator learns at start whether the remote store answers, not at the first
    request; a dead one is skipped from then on (no request waits for its timeout)."""
    import logging
    import socket

    caplog.set_level(logging.INFO, logger="lmkv")
    server = spawn_server("--max-memory", "64MiB")
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"lm://127.0.0.1:{s.getsockname()[1]}"
    for url, answers in ((server.url, True), (dead, False)):
        caplog.clear()
        cfg = load_config(env={}, chunk_size=64, max_local_cpu_size=0.1, remote_url=url)
        cache = LMKVCache(cfg, LAYOUT, "model")
        try:
            deadline = time.monotonic() + 10
            while "at start" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.01)
            if answers:
                assert "the remote tier answered at start" in caplog.text
                assert cache.storage.tiers[0].breaker.failures == 0
            else:
                assert "the remote tier did not answer at start" in caplog.text
                assert "Connection refused" in caplog.text
                errors = {tuple(s.labels.values()): s.value
                          for s in cache.metrics.errors.collect()[0].samples
                          if s.name == "lmkv_errors_total"}
                assert errors == {("remote", "probe"): 1.0}
                assert not cache.storage.tiers[0].available  # lookups skip it, at once
        finally:
            cache.close()


@pytest.mark.parametrize("torn", [False, True])
def test_a_corrupt_frame_is_removed_unless_reads_can_be_torn(torn):
    """Mooncake's upsert does not wait for readers: a read beside another engine's rewrite of
    the chunk can hold parts of both (its checksum fails), and removing the key then deleted
    the good value just written. Such a store keeps it (the recomputed chunk's save
    overwrites a value that really is bad); others remove it."""
    from lmkv.codec import FrameError

    class Store(OneAtATime):
        torn_reads = torn

        def __init__(self):
            super().__init__()
            self.removed = []

        def remove(self, keys):
            self.removed += keys

    from lmkv.backends.registry import LazyBackend

    store = Store()
    lazy = LazyBackend(lambda: store, "remote://store")  # (as create_backend wraps it)
    tier = Tier("remote", lazy, "raw")
    assert tier.contains(["k"]) == [False]  # connected
    assert not tier._settle("k", b"x", FrameError("checksum mismatch"))
    assert store.removed == ([] if torn else ["k"])
    tier.close()
