"""The bundled engine's host work per decode step, with the model stubbed out: what the
scheduler, block manager, input preparation, sampling bookkeeping and outputs cost, at a
short and a long context. On a GPU this host work runs between the device's steps, so it
must not grow with the sequences' length.

    python benchmarks/engine_host.py [--requests 64] [--short 512] [--long 8000] [--steps 64]

The model is a one-layer Llama whose forward pass is replaced by a stub (zeros, one fixed
token sampled), so only the engine's own work is timed. One line per context and output
kind, then the ratio long/short per output kind (1.0x: no growth with the context).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import random_prompt, realistic_model_dir  # noqa: E402

from lmkv_engines.minimal.llm import LLM  # noqa: E402
from lmkv_engines.minimal.sampling_params import OutputKind, SamplingParams  # noqa: E402

TOKEN = 1000  # the stub's sampled token (not EOS)


class StubModel:
    """The runner's model with the forward pass and logits replaced: zeros, TOKEN always."""

    def __init__(self, model, vocab: int):
        self.model = model.model
        self.logits = torch.zeros(1024, vocab)
        self.logits[:, TOKEN] = 1.0

    def __call__(self, input_ids, positions, kv_cache, meta, hooks=None):
        return torch.empty(len(input_ids), 1)

    def compute_logits(self, hidden):
        return self.logits[: hidden.shape[0]]


def step_ms(llm: LLM, context: int, args, kind: OutputKind) -> float:
    """Host ms per decode step of ``args.requests`` requests at ``context`` tokens."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=args.requests + args.steps + 16, temperature=0, ignore_eos=True,
                            output_kind=kind)
    for i in range(args.requests):
        engine.add_request(f"{context}-{kind.name}-{i}", random_prompt(context, vocab, seed=i), params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()  # the prefills
    for _ in range(4):
        engine.step()  # warm
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    ms = (time.perf_counter() - start) / args.steps * 1e3
    running = len(engine.scheduler.running)
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    assert running == args.requests, f"{running} of {args.requests} requests were decoding"
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--short", type=int, default=512)
    ap.add_argument("--long", type=int, default=8000)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    model = realistic_model_dir(num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                                hidden_size=64, intermediate_size=64)
    max_len = args.long + args.requests + args.steps + 32
    blocks = args.requests * (-(-max_len // 16) + 1)
    llm = LLM(str(model), max_model_len=max_len, max_num_batched_tokens=max_len,
              max_num_seqs=args.requests, kv_cache_memory=blocks * 16 * 2 * 64 * 4,
              dtype="float32", device="cpu")
    llm.engine.runner.model = StubModel(llm.engine.runner.model, llm.engine.model_config.vocab_size)
    print(f"{args.requests} requests decoding together, model stubbed (host work only), "
          f"{args.steps} steps timed; torch threads {torch.get_num_threads()}")
    for kind in OutputKind:
        ms = {}
        for context in (args.short, args.long):
            ms[context] = step_ms(llm, context, args, kind)
            print(f"output {kind.name.lower()}, context {context}: "
                  f"{ms[context]:.2f} ms per decode step", flush=True)
        print(f"output {kind.name.lower()}: host time per decode step at context {args.long} "
              f"{ms[args.long]:.2f} ms vs {args.short} {ms[args.short]:.2f} ms: "
              f"long/short = {ms[args.long] / ms[args.short]:.2f}x", flush=True)
    llm.close()


if __name__ == "__main__":
    main()
