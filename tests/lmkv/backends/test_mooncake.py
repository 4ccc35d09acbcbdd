"""The Mooncake Store tier against a real master and storage process on loopback."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from lmkv.backends.base import BackendError

pytestmark = pytest.mark.skipif(shutil.which("mooncake_master") is None,
                                reason="mooncake-transfer-engine-non-cuda is not installed")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    from tests.mooncake_store import MooncakeStore

    s = MooncakeStore(tmp_path_factory.mktemp("mooncake")).start()
    yield s
    s.kill()


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it has stopped (on a loaded machine
    a request sent right after the signal can still be answered)."""
    import signal
    import time

    def states() -> set[str]:
        out = set()
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                out.add(f.read().rsplit(")", 1)[1].split()[0])
        return out

    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while states() != {"T"}:
        assert time.monotonic() < deadline, "the process did not stop"
        time.sleep(0.01)


def test_put_get_zero_copy_and_plain(store):
    from lmkv.backends.mooncake import MooncakeBackend

    backend = MooncakeBackend(store.url)
    pool = torch.zeros(4, 1 << 20, dtype=torch.uint8)
    region = memoryview(pool.numpy()).cast("B")
    backend.register_memory(region)
    pool[0] = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8)
    backend.put([("zc", memoryview(pool[0].numpy())), ("plain", b"hello" * 100)])
    assert backend.contains(["zc", "plain", "none"]) == [True, True, False]
    n = backend.get_into("zc", memoryview(pool[1].numpy()))
    assert n == 1 << 20 and torch.equal(pool[0], pool[1])
    assert backend.get(["plain", "none"]) == [b"hello" * 100, None]
    backend.put([("plain", b"new")])  # overwrites
    assert backend.get(["plain"]) == [b"new"]
    backend.close()


def test_batched_reads_into_the_registered_pool(store):
    from lmkv.backends.mooncake import MooncakeBackend
    from tests.backend_checks import check_batched_reads

    backend = MooncakeBackend(store.url)
    pool = torch.zeros(3, 8192, dtype=torch.uint8)
    backend.register_memory(memoryview(pool.numpy()).cast("B"))
    check_batched_reads(backend, [memoryview(row.numpy()) for row in pool])
    backend.close()


def test_dead_master_fails_fast():
    from lmkv.backends.mooncake import MooncakeBackend

    with pytest.raises(BackendError, match="unreachable"):
        MooncakeBackend("mooncakestore://127.0.0.1:1/", timeout=0.5)


def test_a_master_name_the_dns_does_not_answer_for_fails_fast(monkeypatch):
    import time

    from lmkv.backends.mooncake import MooncakeBackend
    from tests.backend_checks import silent_dns

    answer, _ = silent_dns(monkeypatch, "master.example")
    start = time.monotonic()
    try:
        with pytest.raises(BackendError, match="did not resolve within 0.5 s"):
            MooncakeBackend("mooncakestore://master.example:1/", timeout=0.5)
        assert time.monotonic() - start < 0.5 + 0.5
    finally:
        answer.set()


def test_a_get_that_returns_nothing_for_a_stored_value_is_a_failure_not_a_miss():
    """Mooncake's client answers a failed transfer (a stopped storage process, after its own
    timeout) with empty bytes: a BackendError, so the tier's breaker opens instead of every
    read paying that timeout again; unless the key is gone by then (evicted between its size
    and its get): a miss of that key alone."""
    from lmkv.backends.mooncake import NOT_FOUND, MooncakeBackend

    class Store:
        evicted = False

        def get_size(self, key):
            return NOT_FOUND if key == "evicted" and self.evicted else 10

        def get(self, key):
            if key == "evicted":
                self.evicted = True  # between get_size and get: the store evicts it
            return b"" if key in ("stuck", "evicted") else b"0123456789"

    backend = object.__new__(MooncakeBackend)  # no client library needed: only get() is exercised
    backend.store = Store()
    assert backend.get(["fine"]) == [b"0123456789"]
    with pytest.raises(BackendError, match="returned nothing"):
        backend.get(["fine", "stuck"])
    assert backend.get(["evicted", "fine"]) == [None, b"0123456789"]  # a miss, not a failure


def test_a_key_being_written_is_a_miss_of_that_key_not_a_failed_batch():
    """Engines sharing a prefix write the same chunk again and again: Mooncake answers a
    read of a key being written (or whose lease ran out) with -703 (-707) for that key.
    That failed the whole batch and opened the tier's read breaker (49 of 114 batches, in a
    run with a real master, storage process and one writer)."""
    from lmkv.backends.mooncake import MooncakeBackend

    class Store:
        def batch_get_into(self, keys, addrs, sizes):
            return [{"busy": -703, "lease": -707}.get(k, 100) for k in keys]

        def get_into(self, key, addr, size):
            return -703 if key == "busy" else 100

    backend = object.__new__(MooncakeBackend)  # no client library needed
    backend.store = Store()
    pool = bytearray(1 << 12)
    backend._regions = [(_addr(pool), _addr(pool) + len(pool))]
    outs = [memoryview(pool)[i * 1024 : (i + 1) * 1024] for i in range(3)]
    assert backend.get_into_many(["fine", "busy", "lease"], outs) == [100, None, None]
    assert backend.get_into("busy", outs[0]) is None and backend.get_into("fine", outs[0]) == 100


def _addr(buf: bytearray) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def test_a_hung_master_is_probed_off_the_lookup_thread(store):
    """After a failed call, lookups do not call a hung master again (its client waits 30 s
    per call): a probe does, on a thread of its own, and lookups miss at once until the
    master answers it."""
    import signal
    import time

    from lmkv.backends.mooncake import MooncakeBackend
    from lmkv.storage.breaker import CircuitBreaker
    from lmkv.storage.tier import Tier

    tier = Tier("remote", MooncakeBackend(store.url, timeout=0.5), "raw",
                breaker=CircuitBreaker(base_interval=0.1))
    tier.backend.put([("k", b"v" * 100)])
    assert tier.contains(["k"]) == [True]
    master = store.procs[0]
    tier.breaker.failure()  # as a call that timed out would leave it (that costs 30 s here)
    _stop(master.pid)
    try:
        time.sleep(0.2)  # past the interval
        start = time.monotonic()
        for _ in range(10):
            assert tier.contains(["k"]) is None
            time.sleep(0.1)
        assert time.monotonic() - start < 3  # no lookup waited for the master
    finally:
        os.kill(master.pid, signal.SIGCONT)
    deadline = time.monotonic() + 40
    while not tier.available:  # the probe's call returns once the master runs again
        assert time.monotonic() < deadline, "the probe never answered"
        time.sleep(0.1)
    assert tier.contains(["k"]) == [True]
    tier.close()


def test_a_hung_master_costs_remote_timeout_per_call_not_30_s(store, monkeypatch):
    """lmkv sets Mooncake's MC_RPC_TIMEOUT_MS to remote_timeout (its default is 30 s): a
    call to a hung master fails within about that, and so does each of a new client's 20
    setup tries, which hold the GIL (a client made when the probe of the metadata server
    could not tell, e.g. a metadata server apart from the master: 10 minutes before)."""
    import signal
    import time

    import lmkv.backends.mooncake as mooncake

    for name in ("MC_RPC_TIMEOUT_MS", "MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(mooncake, "_timeouts_ours", set())
    backend = mooncake.MooncakeBackend(store.url, timeout=0.25)
    assert os.environ["MC_RPC_TIMEOUT_MS"] == "250"
    backend.put([("k", b"v" * 100)])
    master = store.procs[0]
    _stop(master.pid)
    try:
        start = time.monotonic()
        with pytest.raises(BackendError):
            backend.contains(["k"])
        assert time.monotonic() - start < 3
        monkeypatch.setattr(mooncake, "_check_metadata_server", lambda url, timeout: None)
        start = time.monotonic()
        with pytest.raises(BackendError, match="setup"):
            mooncake.MooncakeBackend(store.url, timeout=0.25)
        assert time.monotonic() - start < 20 * 0.25 + 10
    finally:
        os.kill(master.pid, signal.SIGCONT)
    deadline = time.monotonic() + 20
    while True:  # the same client answers again
        try:
            assert backend.contains(["k"]) == [True]
            break
        except BackendError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    backend.close()


def test_a_hung_storage_process_holds_a_read_about_remote_timeout_not_30_s(tmp_path, monkeypatch):
    """Only the calls to the master were bounded: a storage process that stopped answering
    held a read (the I/O worker, the tier's lock) for Mooncake's own 30 s. lmkv sets its TCP
    transfer timeouts from remote_timeout too, where the operator has not."""
    import signal
    import time

    import lmkv.backends.mooncake as mooncake
    from lmkv.backends.registry import create_backend
    from lmkv.layout import KVLayout
    from lmkv.memory import MemoryPool
    from lmkv.storage.tier import Tier
    from tests.mooncake_store import MooncakeStore

    for name in ("MC_RPC_TIMEOUT_MS", "MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(mooncake, "_timeouts_ours", set())
    own = MooncakeStore(tmp_path / "mc", segment="256 MB").start()
    try:
        layout = KVLayout(2, 2, 16, torch.float16, 16)
        pool = MemoryPool(layout, 8 * (64 + layout.chunk_bytes))
        tier = Tier("remote", create_backend(own.url, 0.5), "raw")
        tier.backend.register_memory(memoryview(pool.storage.numpy()).cast("B"))
        src = pool.allocate()
        src.kv.normal_()
        assert tier.write("k", tier.encode("k", src))
        assert os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] == os.environ["MC_TCP_STATUS_TIMEOUT_SEC"] == "1"
        _stop(own.procs[1].pid)  # the storage process
        try:
            start = time.monotonic()
            assert tier.read(["k"], [pool.allocate()]) == [False]
            assert time.monotonic() - start < 5  # (30 s before)
        finally:
            os.kill(own.procs[1].pid, signal.SIGCONT)
        tier.close()
    finally:
        own.kill()


def test_sizes_in_the_config_read_as_mooncakes_own_loader_reads_them(monkeypatch, tmp_path):
    from lmkv.backends.mooncake import _settings

    path = tmp_path / "mooncake.json"
    path.write_text('{"global_segment_size": "1GB", "local_buffer_size": "0.5 mb"}')
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    s = _settings("mooncakestore://127.0.0.1:50051/?global_segment_size=3g")
    assert (s["global_segment_size"], s["local_buffer_size"]) == (3 << 30, 1 << 19)
    for bad in ("lots", "-1", "1 XB", "true"):
        with pytest.raises(BackendError, match="local_buffer_size"):
            _settings(f"mooncakestore://h:1/?local_buffer_size={bad}")
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH")
    assert _settings("mooncakestore://h:1/?local_buffer_size=4096")["local_buffer_size"] == 4096


def test_a_declined_put_is_not_stored_and_the_tier_keeps_writing():
    """Mooncake declines a put when its store is full until its eviction runs (or for a quota,
    or a key another client writes): the chunk is not stored (a dropped save), the store
    has not failed, and the tier's write breaker stays closed. Other codes are failures."""
    from lmkv.backends.mooncake import MooncakeBackend
    from lmkv.logs import LogThrottle
    from lmkv.storage.tier import Tier

    class Store:
        codes = [-200, 0, -705, -1700, 0]

        def upsert(self, key, value):
            return self.codes.pop(0)

    backend = object.__new__(MooncakeBackend)  # no client library needed: only put() runs
    backend.store, backend._regions, backend.copy_limit = Store(), [], 1 << 20
    backend.num_not_stored, backend._quiet = 0, LogThrottle()
    tier = Tier("remote", backend, "raw")
    stored = [tier.write(f"k{i}", memoryview(b"x" * 100)) for i in range(5)]
    assert stored == [False, True, False, False, True] and tier.writable
    assert backend.num_not_stored == 3
    assert tier.metrics.dropped.labels("save_remote")._value.get() == 3
    Store.codes = [-900]  # the master is gone: a failure
    with pytest.raises(BackendError, match="-900"):
        backend.put([("k", b"x")])


def test_values_past_the_local_buffer_are_not_stored_or_read_through_copies(store):
    """A value that is not in the registered pool passes through the client's local buffer:
    a larger one is not stored (rather than a failed put) and, stored zero-copy by another
    client, reads as a miss through copies (rather than a failed read); into the
    registered pool it reads."""
    from lmkv.backends.mooncake import MooncakeBackend

    backend = MooncakeBackend(store.url + "&local_buffer_size=1mb")
    pool = torch.zeros(2, 2 << 20, dtype=torch.uint8)
    backend.register_memory(memoryview(pool.numpy()).cast("B"))
    backend.put([("big-copy", b"y" * (2 << 20))])
    assert backend.num_not_stored == 1 and backend.contains(["big-copy"]) == [False]
    pool[0] = torch.randint(0, 255, (2 << 20,), dtype=torch.uint8)
    backend.put([("big-zc", memoryview(pool[0].numpy()))])
    assert backend.get(["big-zc"]) == [None]
    assert backend.get_into("big-zc", memoryview(pool[1].numpy())) == 2 << 20
    assert torch.equal(pool[0], pool[1])
    backend.close()


def test_a_client_whose_setup_failed_is_closed(store, monkeypatch):
    """A failed setup() left its client (threads, buffers) behind at each retry."""
    import mooncake.store

    import lmkv.backends.mooncake as lmkv_mooncake

    closed = []

    class Failing:
        def setup(self, *args):
            return -1

        def close(self):
            closed.append(1)

    monkeypatch.setattr(mooncake.store, "MooncakeDistributedStore", Failing)
    with pytest.raises(BackendError, match="setup"):
        lmkv_mooncake.MooncakeBackend(store.url, timeout=1.0)
    assert closed == [1]
