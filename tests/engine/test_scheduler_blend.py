"""The engine scheduler's blended admissions: a request offered a blend plan that cannot get
its KV blocks yet stays as it was, so that when it is tried again without a plan (its RAG
chunks evicted meanwhile) it takes the exact path with prefix caching."""

from __future__ import annotations

from types import SimpleNamespace

from lmkv_engines.minimal.block_manager import BlockManager
from lmkv_engines.minimal.request import Request
from lmkv_engines.minimal.sampling_params import SamplingParams
from lmkv_engines.minimal.scheduler import Scheduler, SchedulerConfig


def test_a_blend_that_gets_no_blocks_leaves_the_request_cacheable():
    class Connector:  # offers a plan once, then none (the chunks were evicted)
        plans = [SimpleNamespace(num_cached_tokens=64)]

        def on_new_request(self, req, hit):
            pass

        def prefix_cache_salt(self, req):
            return b"blend"

        def get_blend_plan(self, req, num_computed):
            return self.plans.pop() if self.plans else None

    blocks = BlockManager(num_blocks=4, block_size=16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4096,
                                      max_model_len=4096), blocks, Connector())
    req = Request("rag", list(range(5, 105)), SamplingParams())  # 100 tokens: 7 blocks
    sched.add(req)
    assert sched.schedule().scheduled == []  # no room for the blended prefill
    assert req.cacheable  # before: False for good, so its blocks never entered the prefix cache

