"""The worker role on its own: it takes the chunks the scheduler role pinned, by key, and
writes them into paged memory (whole or layer by layer); a failure anywhere in a load is
reported after the forward pass, never raised into it, never left hanging, and every
chunk goes back to the pool; saves go to the hot cache except for requests it is told
to skip."""

from __future__ import annotations

import threading

import pytest
import torch

from lmkv.cache import LMKVCache
from lmkv.config import load_config
from lmkv.connector import ConnectorMetadata, WorkerConnector
from lmkv.connector.metadata import LoadSpec, SaveSpec
from lmkv.layout import KVLayout
from lmkv.paged import BlockPagedMemory

CHUNK, BLOCK, LAYERS = 8, 4, 3


def _setup(layerwise: bool):
    cfg = load_config(env={}, chunk_size=CHUNK, max_local_cpu_size=0.001, use_layerwise=layerwise)
    engine = LMKVCache(cfg, KVLayout(LAYERS, 2, 4, torch.float32, CHUNK), "model")
    kv_cache = torch.zeros(LAYERS, 2, 16, BLOCK, 2, 4)
    worker = WorkerConnector(engine)
    worker.register_kv_caches(BlockPagedMemory(kv_cache))
    return engine, worker, kv_cache


def _pinned(engine: LMKVCache, keys: list[str]) -> list[torch.Tensor]:
    kvs = []
    for key in keys:
        buf = engine.allocate()
        buf.kv.normal_()
        kvs.append(buf.kv.clone())
        engine.store(key, buf)
        buf.release()
    assert engine.pin(keys) == [False] * len(keys)
    return kvs


def _paged(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[2, L, T, Hkv, D] of the given slots."""
    return kv_cache.flatten(2, 3)[:, :, slots].transpose(0, 1)


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_load_takes_its_pins_and_writes_the_slots_it_names(layerwise):
    engine, worker, kv_cache = _setup(layerwise)
    kvs = _pinned(engine, ["a", "b"])
    slots = [torch.arange(8, 16), torch.arange(20, 25)]  # the second chunk: 5 of its 8 tokens
    worker.bind_connector_metadata(ConnectorMetadata(loads=[LoadSpec("r", ["a", "b"], slots, [2, 0])]))
    worker.start_load_kv()
    for layer in range(LAYERS):
        worker.wait_for_layer_load(layer)
    assert worker.failed_loads() == []
    assert not _paged(kv_cache, slots[0][:2]).any()  # tokens [0, skip) left alone
    assert torch.equal(_paged(kv_cache, slots[0][2:]), kvs[0][:, :, 2:])
    assert torch.equal(_paged(kv_cache, slots[1]), kvs[1][:, :, :5])
    assert len(engine.pins) == 0
    worker.wait_for_save()
    engine.pool.check_integrity()
    assert engine.metrics.loaded_tokens._value.get() == 6 + 5
    worker.close()
    engine.close()


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_failed_load_is_reported_after_the_forward_pass_and_returns_every_chunk(layerwise):
    engine, worker, _ = _setup(layerwise)
    _pinned(engine, ["a", "b"])

    def broken(chunk, slots, skip=0, layer=None):
        if layer in (None, 1):
            raise OSError("injected")

    worker.paged.load = broken
    spec = LoadSpec("r", ["a", "b"], [torch.arange(8), torch.arange(8, 16)], [0, 0])
    worker.bind_connector_metadata(ConnectorMetadata(loads=[spec]))
    worker.start_load_kv()  # never raises
    done = threading.Event()

    def forward() -> None:  # as the model's layers wait for their KV
        for layer in range(LAYERS):
            worker.wait_for_layer_load(layer)
        done.set()

    threading.Thread(target=forward, daemon=True).start()
    assert done.wait(5), "a layer's wait hung after the failure"
    assert worker.failed_loads() == [spec]
    assert engine.metrics.errors.labels("connector", "load")._value.get() == 1
    assert engine.metrics.loaded_tokens._value.get() == 0
    worker.wait_for_save()
    assert len(engine.pins) == 0
    engine.pool.check_integrity()
    assert engine.pool.num_free == engine.pool.num_slots - 2  # only the hot cache holds them
    worker.close()
    engine.close()


def test_a_key_that_is_not_pinned_fails_the_load_and_releases_the_others():
    engine, worker, kv_cache = _setup(False)
    _pinned(engine, ["a"])
    spec = LoadSpec("r", ["a", "gone"], [torch.arange(8), torch.arange(8, 16)], [0, 0])
    worker.bind_connector_metadata(ConnectorMetadata(loads=[spec]))
    worker.start_load_kv()
    assert worker.failed_loads() == [spec]
    assert not kv_cache.any()  # nothing half-loaded
    assert len(engine.pins) == 0
    engine.pool.check_integrity()
    worker.close()
    engine.close()


@pytest.mark.parametrize("layerwise", [False, True])
def test_saves_go_to_the_hot_cache_except_for_skipped_requests(layerwise):
    engine, worker, kv_cache = _setup(layerwise)
    kv_cache.normal_()
    slots = torch.arange(16, 24)
    meta = ConnectorMetadata(saves=[SaveSpec("keep", ["k1"], [slots]),
                                    SaveSpec("skip", ["k2"], [torch.arange(24, 32)])])
    worker.bind_connector_metadata(meta)
    worker.start_load_kv()
    for layer in range(LAYERS):
        worker.save_kv_layer(layer)
    worker.wait_for_save(skip={"skip"})
    assert engine.storage.hot.contains("k1") and not engine.storage.hot.contains("k2")
    buf = engine.storage.hot.get("k1")
    assert torch.equal(buf.kv, _paged(kv_cache, slots))
    buf.release()
    engine.pool.check_integrity()
    worker.close()
    engine.close()
