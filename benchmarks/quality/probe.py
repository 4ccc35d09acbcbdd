"""What the metrics need from a run of the bundled engine: logits at every prompt position,
the KV the prefill wrote, and greedy continuations."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmkv_engines.minimal.llm import LLM
from lmkv_engines.minimal.sampling_params import SamplingParams


@dataclass(slots=True)
class Prefill:
    logits: torch.Tensor  # [T, vocab] fp32: logits[i] predicts token i + 1
    kv: list[torch.Tensor]  # per layer [2, T, Hkv, D]: K and V of the prompt's tokens


def open_llm(model_dir: str, max_len: int = 4096, **engine_args) -> LLM:
    """An engine that computes a prompt of up to ``max_len`` tokens in one prefill step,
    by default without prefix caching (each probe computes every token itself)."""
    engine_args.setdefault("kv_cache_memory", 256 << 20)
    engine_args.setdefault("enable_prefix_caching", False)
    engine_args.setdefault("dtype", "float32")  # the reference precision (auto is bf16 on a GPU)
    return LLM(model_dir, max_model_len=max_len, max_num_batched_tokens=max_len, **engine_args)


def prefill(llm: LLM, ids: Sequence[int]) -> Prefill:
    """One full prefill of ``ids`` through the paged engine; the request is then dropped."""
    engine = llm.engine
    req = engine.add_request("quality-probe", list(ids))
    try:
        sched = engine.scheduler.schedule()
        if [s.request for s in sched.scheduled] != [req] or sched.scheduled[0].num_new_tokens != len(ids):
            raise RuntimeError("the probe needs an idle engine that prefills the whole prompt in one step")
        input_ids, positions, meta, _ = engine.runner._prepare(sched.scheduled)
        hidden = engine.model(input_ids, positions, engine.kv_cache, meta)
        logits = engine.model.compute_logits(hidden)
        cache = engine.kv_cache  # [L, 2, num_blocks, block_size, Hkv, D]
        flat = cache.flatten(2, 3)  # [L, 2, num_blocks * block_size, Hkv, D]
        kv = [flat[i][:, meta.slot_mapping].float().clone() for i in range(cache.shape[0])]
    finally:
        engine.abort_request("quality-probe")
    return Prefill(logits, kv)


def greedy(llm: LLM, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations of ``max_tokens`` tokens (end-of-sequence ignored)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = llm.generate([list(p) for p in prompts], params)
    return [o.output_token_ids for o in outs]
