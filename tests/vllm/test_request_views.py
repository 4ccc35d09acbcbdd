"""lmkv keys a vLLM request's chunks by its prompt tokens alone, so requests whose KV depends
on more (a LoRA adapter, multimodal inputs, a per-request cache_salt, prompt embeddings) are
neither looked up nor stored (no vLLM needed: stand-in requests with vLLM's attributes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lmkv.cache import LMKVCache
from lmkv.config import load_config
from lmkv.connector import SchedulerConnector
from lmkv.layout import KVLayout
from lmkv_engines.vllm.requests import RequestView

TOKENS = list(range(100, 140))


def _request(rid: str, **extra):
    fields = dict(request_id=rid, prompt_token_ids=TOKENS, all_token_ids=TOKENS + [7] * 8,
                  num_tokens=len(TOKENS) + 8, lora_request=None, mm_features=[],
                  cache_salt=None) | extra
    return SimpleNamespace(**fields)


@pytest.mark.parametrize("extra", [dict(lora_request=SimpleNamespace(lora_int_id=1)),
                                   dict(mm_features=[object()]), dict(cache_salt="tenant"),
                                   dict(prompt_token_ids=None)])
def test_requests_whose_kv_lmkv_cannot_key_are_not_cached(extra):
    cfg = load_config(env={}, chunk_size=8, max_local_cpu_size=0.01, save_decode_cache=True)
    cache = LMKVCache(cfg, KVLayout(2, 1, 8, torch.float32, 8), "model")
    sched = SchedulerConnector(cache, block_size=8)
    try:
        plain, other = RequestView(_request("plain")), RequestView(_request("other", **extra))
        assert plain.prompt_token_ids == TOKENS and other.prompt_token_ids == []
        for view in (plain, other):
            assert sched.get_num_new_matched_tokens(view, 0)[0] == 0
            view.block_ids = list(range(6))
            sched.update_state_after_alloc(view, view.block_ids, 0)
        meta = sched.build_connector_meta([(plain, 48), (other, 48)])
        assert [s.request_id for s in meta.saves] == ["plain"]
    finally:
        cache.close()
