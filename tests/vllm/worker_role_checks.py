"""The vLLM connector's worker role driven step by step without an engine (run by
test_worker_role.py as ``.venv-vllm/bin/python -m tests.vllm.worker_role_checks``): it
prints one JSON object of what each check saw."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch

from lmkv.cache import LMKVCache
from lmkv.config import load_config
from lmkv.connector import WorkerConnector
from lmkv.connector.metadata import ConnectorMetadata, LoadSpec, SaveSpec
from lmkv.keys import chunk_ids
from lmkv.layout import KVLayout
from lmkv_engines.vllm.connector import LMKVConnector, LMKVConnectorMetadata
from lmkv_engines.vllm.paged import cpu_paged_memory

L, H, D, BS, CHUNK, NB = 2, 1, 4, 16, 16, 32


def worker_role() -> tuple[LMKVConnector, LMKVCache]:
    cache = LMKVCache(load_config(env={}, chunk_size=CHUNK, max_local_cpu_size=0.001),
                      KVLayout(L, H, D, torch.float32, CHUNK), "model")
    conn = LMKVConnector.__new__(LMKVConnector)  # no VllmConfig: the worker role's parts only
    conn._connector_metadata, conn.block_size, conn.cache = None, BS, cache
    conn.scheduler = conn.lookups = None
    conn._closed = False
    conn._init_worker(WorkerConnector(cache, key_of=cache.key_of))
    conn.paged = cpu_paged_memory([torch.zeros(NB, H, BS, 2 * D) for _ in range(L)])
    conn.worker.register_kv_caches(conn.paged)
    return conn, cache


def store(cache: LMKVCache, tokens: list[int]) -> None:
    for key in cache.keys(tokens):
        buf = cache.allocate()
        buf.kv.normal_()
        cache.store(key, buf)
        buf.release()


def failed_load(block: int) -> ConnectorMetadata:
    """A load of a chunk that was never pinned (so it fails) into ``block``."""
    key = chunk_ids(list(range(CHUNK)), CHUNK)[0]
    return ConnectorMetadata(loads=[LoadSpec("A", [key], [torch.arange(block * BS, (block + 1) * BS)], [0])])


def deferred_finalize() -> dict:
    """vLLM with speculative decoding asks for load errors before wait_for_save (which it
    defers until after the draft model): the failed block is reported in its own step."""
    import vllm.distributed.kv_transfer.kv_transfer_state as state
    import vllm.v1.worker.kv_connector_model_runner_mixin as mixin

    conn, cache = worker_role()
    state._KV_CONNECTOR_AGENT = conn
    mixin.get_forward_context = lambda: None
    seen = {}
    for defer in (False, True):
        reports = []
        for meta in (failed_load(3), ConnectorMetadata()):
            out_of = SimpleNamespace(kv_connector_metadata=LMKVConnectorMetadata(meta),
                                     has_sync_kv_loads=bool(meta.loads), finished_req_ids=set())
            with mixin.KVConnectorModelRunnerMixin._get_kv_connector_output(
                    out_of, defer_finalize=defer) as out:
                pass  # the forward pass
            if defer:
                mixin.KVConnectorModelRunnerMixin.finalize_kv_connector()
            reports.append(sorted(out.invalid_block_ids))
        seen[f"defer={defer}"] = reports
    cache.close()
    return seen


def saves_after_a_failed_load() -> dict:
    """Async scheduling: the step after a failed load was planned before vLLM learned of it,
    so a request may compute there over the failed pages: its chunks are not stored; two
    steps later they are again."""
    conn, cache = worker_role()
    shared = list(range(100, 100 + CHUNK))
    store(cache, shared)
    stored = []
    for step, tail in enumerate((None, 900, 950)):
        if tail is None:
            meta = failed_load(0)
        else:
            prompt = shared + list(range(tail, tail + CHUNK))
            k0, k1 = chunk_ids(prompt, CHUNK)
            save = SaveSpec(f"B{step}", [k1], [torch.arange(BS, 2 * BS)], k0, CHUNK)
            meta = ConnectorMetadata(saves=[save])
        conn.bind_connector_metadata(LMKVConnectorMetadata(meta))
        conn.start_load_kv(None)
        conn.wait_for_save()
        conn.get_block_ids_with_load_errors()
        conn.clear_connector_metadata()
        if tail is not None:
            stored.append(cache.lookup(cache.keys(shared + list(range(tail, tail + CHUNK)))))
    cache.close()
    return {"chunks found after the next two steps": stored}


def another_ranks_failed_load() -> dict:
    """Tensor parallelism: this rank's load worked, another rank's failed (told by the
    all-reduce, stubbed here): every rank computed over the failed rank's stale attention,
    so this rank stores none of the step's chunks either, and reports no blocks of its own."""
    conn, cache = worker_role()
    conn._any_rank = lambda failed: True
    shared = list(range(100, 100 + CHUNK))
    store(cache, shared)
    (k0,) = chunk_ids(shared, CHUNK)
    assert cache.pin([cache.key_of(k0)]) == [False]
    prompt = shared + list(range(900, 900 + CHUNK))
    _, k1 = chunk_ids(prompt, CHUNK)
    meta = ConnectorMetadata(loads=[LoadSpec("A", [k0], [torch.arange(0, BS)], [0])],
                             saves=[SaveSpec("A", [k1], [torch.arange(BS, 2 * BS)], k0, CHUNK)])
    conn.bind_connector_metadata(LMKVConnectorMetadata(meta))
    conn.start_load_kv(None)
    conn.wait_for_save()
    errors = sorted(conn.get_block_ids_with_load_errors())
    conn.clear_connector_metadata()
    found = cache.lookup(cache.keys(prompt))
    cache.close()
    return {"blocks reported": errors, "chunks found": found}


def piecewise_graphs() -> dict:
    """Whether vLLM is told to capture piecewise CUDA graphs, by lmkv config."""
    return {str(layerwise): LMKVConnector.requires_piecewise_for_cudagraph(
        {"use_layerwise": layerwise}) for layerwise in (False, True)}


def kv_delivery() -> bool:
    """What vLLM's scheduler reads to recompute requests preempted with a hand-off pending
    (its default: True for a producer)."""
    conn = LMKVConnector.__new__(LMKVConnector)
    conn._kv_transfer_config = SimpleNamespace(is_kv_producer=True)
    return conn.requires_kv_delivery


def failed_blocks_evicted() -> list[int]:
    """The blocks the scheduler role takes out of vLLM's prefix cache when the workers report
    a failed load (KVConnectorOutput.invalid_block_ids): request a holds blocks 5-8 and
    failed at 6, b holds 9-10 and loaded fine (a stand-in of vLLM's KV cache manager, with
    the two calls the connector makes)."""
    from vllm.v1.outputs import KVConnectorOutput

    from lmkv_engines.vllm.requests import RequestViews

    evicted: list[int] = []
    conn = LMKVConnector.__new__(LMKVConnector)
    conn.scheduler, conn.views = object(), RequestViews()
    held = {"a": [5, 6, 7, 8], "b": [9, 10]}
    for rid in held:
        conn.views.get(SimpleNamespace(request_id=rid))
    conn._kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: (held[rid],),
                                             evict_blocks=lambda ids: evicted.extend(sorted(ids)))
    conn.update_connector_output(KVConnectorOutput())  # nothing failed: nothing evicted
    conn.update_connector_output(KVConnectorOutput(invalid_block_ids={6}))
    return evicted


if __name__ == "__main__":
    print(json.dumps({"deferred": deferred_finalize(), "saves": saves_after_a_failed_load(),
                      "other_rank": another_ranks_failed_load(), "piecewise": piecewise_graphs(),
                      "kv_delivery": kv_delivery(), "evicted": failed_blocks_evicted()}))
