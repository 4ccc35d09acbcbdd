"""The checkpoint shipped for the quality benchmarks (benchmarks/quality/models/qa-2layer)
loads in the engine and answers held-out single-document questions (98/100 when it was
trained; chance is ~1/80), with lmkv serving the documents' KV giving the same answers."""

from __future__ import annotations

import pytest

from benchmarks.common import trained_model_dir
from benchmarks.quality import metrics
from benchmarks.quality.probe import greedy
from benchmarks.quality.qa import heldout_prompts
from lmkv.config import load_config
from lmkv_engines.minimal.llm import LLM

MODEL = trained_model_dir()
pytestmark = pytest.mark.skipif(MODEL is None, reason="the shipped checkpoint is missing")


def test_shipped_model_answers_single_document_questions():
    prompts = heldout_prompts(30, 4, 1)
    cfg = load_config(env={}, chunk_size=64, max_local_cpu_size=0.05)
    with LLM(str(MODEL), lmkv_config=cfg, kv_cache_memory=32 << 20, enable_prefix_caching=False) as llm:
        ids = [llm.tokenizer.encode(p.text) for p in prompts]
        cold = greedy(llm, ids, max_tokens=4)  # computes and stores every prompt's chunks
        warm = greedy(llm, ids, max_tokens=4)  # the same prompts from lmkv's hot cache
        assert llm.engine.kv_connector.cache.metrics.hit_tokens._value.get() > 0
        answers = [llm.tokenizer.decode(o) for o in cold]
    assert warm == cold
    score = metrics.qa_accuracy(answers, [p.answer for p in prompts])
    assert score.accuracy >= 0.8, f"{score.correct}/{score.total} answered"
