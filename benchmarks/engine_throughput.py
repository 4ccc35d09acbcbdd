"""Bundled engine vs Hugging Face transformers on the same weights, side by side.

Prints prefill tokens/s (ratio target >= 0.8x; transformers computes the last position's
logits only, as the engine does) and decode throughput of 16 concurrent sequences vs
transformers generating them one after another (the ratio issue #19 names, mostly
batching), and vs transformers generating them as one batch (like for like). The model is
SmolLM2-135M-Instruct unless --model names another; --device/--dtype say where and in what
the engine and transformers both run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    MODEL_HELP,
    add_device_args,
    bench_model,
    hf_model,
    random_prompt,
    sync,
    timed,
)

from lmkv_engines.minimal.llm import LLM  # noqa: E402
from lmkv_engines.minimal.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--num-seqs", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", help=MODEL_HELP)
    add_device_args(ap)
    args = ap.parse_args()

    model_dir = bench_model(args.model)
    llm = LLM(str(model_dir), kv_cache_memory=2 << 30, enable_prefix_caching=False,
              device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager)
    device = llm.engine.device.torch
    hf = hf_model(model_dir, device, getattr(torch, args.dtype))
    vocab = hf.config.vocab_size
    n_params = sum(p.numel() for p in hf.parameters())
    print(f"model {model_dir.name}: {n_params / 1e6:.0f}M params, {hf.config.num_hidden_layers} layers, "
          f"hidden {hf.config.hidden_size}, GQA {hf.config.num_attention_heads}:"
          f"{hf.config.num_key_value_heads}; {args.dtype} on {device}"
          f"{' (eager)' if args.enforce_eager and device.type == 'cuda' else ''}; "
          f"torch threads {torch.get_num_threads()}")

    # prefill: one prompt, first token only
    prompt = random_prompt(args.prompt_len, vocab, seed=0)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    ids = torch.tensor([prompt], device=device)

    def hf_prefill():
        with torch.inference_mode():
            hf(ids, use_cache=True, logits_to_keep=1)  # the last position's logits, as the engine
        sync(device)

    t_engine = timed(lambda: llm.generate([prompt], one), args.repeats)
    t_hf = timed(hf_prefill, args.repeats)
    n = args.prompt_len
    print(f"prefill {n} tokens: engine {n / t_engine:.0f} tok/s, transformers "
          f"{n / t_hf:.0f} tok/s, engine/transformers = {t_hf / t_engine:.2f}x")

    # decode: 16 sequences concurrently vs transformers one after another
    prompts = [random_prompt(32, vocab, seed=1 + i) for i in range(args.num_seqs)]
    gen = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)

    def hf_generate(batch: list[list[int]]):
        with torch.inference_mode():
            out = hf.generate(torch.tensor(batch, device=device), max_new_tokens=args.decode_tokens,
                              min_new_tokens=args.decode_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        sync(device)
        return out

    # each side: one warm-up run, then the timed one (the sequential side takes ~30 s a run)
    t_engine = timed(lambda: llm.generate(prompts, gen), 1)
    t_hf = timed(lambda: [hf_generate([p]) for p in prompts], 1)
    t_batched = timed(lambda: hf_generate(prompts), 1)  # equal lengths: no padding
    total = args.num_seqs * args.decode_tokens
    print(f"decode {args.num_seqs} seqs x {args.decode_tokens} tokens: engine concurrent "
          f"{total / t_engine:.0f} tok/s, transformers sequential {total / t_hf:.0f} tok/s, "
          f"engine/transformers = {t_hf / t_engine:.2f}x")
    # like for like: transformers given the 16 sequences as one batch too
    print(f"decode {args.num_seqs} seqs x {args.decode_tokens} tokens, both batched: engine "
          f"{total / t_engine:.0f} tok/s, transformers batched {total / t_batched:.0f} tok/s, "
          f"engine/transformers-batched = {t_batched / t_engine:.2f}x")


if __name__ == "__main__":
    main()
