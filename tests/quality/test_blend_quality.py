"""CacheBlend restores what naive reuse loses. With the shipped continued-documents model
(benchmarks/quality/models/qa-2layer-continued), on prompts whose documents are two
paragraphs (two chunks, the second saying "it"): a question about a second paragraph's fact
is answered with a full prefill, mostly not with naive reuse (the paragraph's KV was
computed alone, without the first paragraph that says which country "it" is), and again
with blending at 15%, which recomputes the tokens whose KV deviates most."""

from __future__ import annotations

import random

import pytest

from benchmarks.blend_rag import CONTINUED_MODEL, rag_ids, set_ratio, shuffled
from benchmarks.common import trained_model_dir
from benchmarks.quality import metrics
from benchmarks.quality.probe import greedy
from benchmarks.quality.qa import heldout_prompts
from lmkv.config import load_config
from lmkv_engines.minimal.llm import LLM

MODEL = trained_model_dir(CONTINUED_MODEL)
pytestmark = pytest.mark.skipif(MODEL is None, reason="the shipped checkpoint is missing")
SEPARATOR = "\n\n"


def test_blending_answers_where_naive_reuse_lost_the_chunk_before():
    rng = random.Random(0)
    prompts = [shuffled(p, rng) for p in heldout_prompts(30, 4, 1, continued=True)]
    cfg = load_config(env={}, chunk_size=64, max_local_cpu_size=0.05, enable_blending=True,
                      blend_recompute_ratio=0.0, blend_special_str=SEPARATOR)
    answers: dict[str, list[str]] = {"full": [], "naive": [], "blend15": []}
    with (LLM(str(MODEL), kv_cache_memory=32 << 20, enable_prefix_caching=False) as full,
          LLM(str(MODEL), lmkv_config=cfg, kv_cache_memory=32 << 20,
              enable_prefix_caching=False) as blend):
        for p in prompts:
            ids, chunks = rag_ids(blend, p, SEPARATOR)
            assert len(chunks) == 8  # 4 documents, two paragraphs each
            assert ids == full.tokenizer.encode(p.text)  # the separator joins as text has it
            blend.precompute(chunks, progress=False)
            answers["full"].append(full.tokenizer.decode(greedy(full, [ids], 3)[0]))
            for name, ratio in (("naive", 0.0), ("blend15", 0.15)):
                set_ratio(blend, ratio)
                answers[name].append(blend.tokenizer.decode(greedy(blend, [ids], 3)[0]))
        reg = blend.engine.metrics.registry
        assert reg.get_sample_value("lmkv_blend_recomputed_tokens_total") > 0
    acc = {name: metrics.qa_accuracy(out, [p.answer for p in prompts]).accuracy
           for name, out in answers.items()}
    assert acc["full"] >= 0.75, acc
    assert acc["naive"] <= acc["full"] - 0.3, acc
    assert acc["blend15"] >= acc["full"] - 0.1, acc
