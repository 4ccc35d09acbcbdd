"""The engine's model equals Hugging Face transformers' LlamaForCausalLM on the same weights."""

from __future__ import annotations

import pytest
import torch

from lmkv_engines.minimal.llm import LLM
from lmkv_engines.minimal.sampling_params import SamplingParams

from .hf_models import save_hf_llama

LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256, "rope_theta": 500000.0,
}

CONFIGS = {
    "mha-hd64": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=64),
    "gqa4-hd64-tied": dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
                           head_dim=64, tie_word_embeddings=True),
    "gqa8-hd128": dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=1,
                       head_dim=128),
    "gqa2-llama3-rope": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=64, rope_parameters=LLAMA3_SCALING),
}


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 4096, (n,), generator=g).tolist()


def _engine_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits at every prompt position from one prefill through the paged engine."""
    engine = llm.engine
    req = engine.add_request("logits", ids)
    sched = engine.scheduler.schedule()
    assert [s.request for s in sched.scheduled] == [req]
    assert sched.scheduled[0].num_new_tokens == len(ids)
    input_ids, positions, meta, _ = engine.runner._prepare(sched.scheduled)
    hidden = engine.model(input_ids, positions, engine.kv_cache, meta)
    engine.abort_request("logits")
    return engine.model.compute_logits(hidden)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_greedy_tokens_match_transformers(name, tiny_model_dir, tmp_path):
    hf = save_hf_llama(tmp_path, tiny_model_dir, **CONFIGS[name])
    llm = LLM(str(tmp_path), kv_cache_memory=64 << 20, max_model_len=2304)
    for n in (1, 17, 300):
        ids = _prompt(n, seed=n)
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0].float()
        got = _engine_logits(llm, ids)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    prompts = [_prompt(n, seed=100 + n) for n in (5, 64, 200)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for ids, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert out.output_token_ids == ref[0, len(ids):].tolist()


def test_2k_token_prompt_matches_transformers(tiny_model_dir, tmp_path):
    hf = save_hf_llama(tmp_path, tiny_model_dir, hidden_size=128, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=64, rope_parameters=LLAMA3_SCALING)
    llm = LLM(str(tmp_path), kv_cache_memory=64 << 20, max_model_len=2304)
    ids = _prompt(2048, seed=7)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(_engine_logits(llm, ids), want, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    out = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert out.output_token_ids == ref[0, 2048:].tolist()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_fp32(dtype, tiny_model_dir):
    ids = _prompt(40, seed=3)
    ref = _engine_logits(LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=16 << 20), ids)
    got = _engine_logits(LLM(str(tiny_model_dir), dtype=dtype, kv_cache_memory=16 << 20), ids)
    assert got.dtype == torch.float32
    # half precision: logits agree to a few percent of their spread
    assert (got - ref).abs().max() < 0.05 * ref.std() * 10
