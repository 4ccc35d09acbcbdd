"""Where a decode step's time goes: torch's profiler over the engine decoding a batch, the
top operations by host (CPU) time and by device time. A diagnostic, not a figure:

    python benchmarks/profile_decode.py [--device cuda] [--dtype bfloat16] [--model smollm2-shape]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODEL_HELP, add_device_args, bench_model, random_prompt  # noqa: E402

from lmkv_engines.minimal.llm import LLM  # noqa: E402
from lmkv_engines.minimal.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", help=MODEL_HELP)
    ap.add_argument("--num-seqs", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--rows", type=int, default=15)
    add_device_args(ap)
    args = ap.parse_args()
    llm = LLM(str(bench_model(args.model)), kv_cache_memory=1 << 30, enable_prefix_caching=False,
              device=args.device, dtype=args.dtype, enforce_eager=args.enforce_eager)
    vocab = llm.engine.model_config.vocab_size
    prompts = [random_prompt(32, vocab, seed=i) for i in range(args.num_seqs)]
    gen = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, gen)  # warm-up: kernels compiled, allocator warm
    start = time.perf_counter()
    llm.generate(prompts, gen)
    wall = time.perf_counter() - start
    print(f"{args.num_seqs} seqs x {args.decode_tokens} tokens: {wall * 1e3:.0f} ms, "
          f"{wall / args.decode_tokens * 1e3:.2f} ms per step")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        llm.generate(prompts, gen)
    keys = prof.key_averages()
    print(keys.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if torch.cuda.is_available():
        print(keys.table(sort_by="self_cuda_time_total", row_limit=args.rows))
    llm.close()


if __name__ == "__main__":
    main()
