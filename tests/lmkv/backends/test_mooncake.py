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


def test_a_get_that_returns_nothing_for_a_stored_value_is_a_failure_not_a_miss():
    """Mooncake's client answers a failed transfer (a stopped storage process, after its own
    timeout) with empty bytes: a BackendError, so the tier's breaker opens instead of every
    read paying that timeout again."""
    from lmkv.backends.mooncake import MooncakeBackend

    class Store:
        def get_size(self, key):
            return 10

        def get(self, key):
            return b"" if key == "stuck" else b"0123456789"

    backend = object.__new__(MooncakeBackend)  # no client library needed: only get() is exercised
    backend.store = Store()
    assert backend.get(["fine"]) == [b"0123456789"]
    with pytest.raises(BackendError, match="returned nothing"):
        backend.get(["fine", "stuck"])
