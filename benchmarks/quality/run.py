"""Quality of a model directory, one line per metric:

    python -m benchmarks.quality.run --model DIR [--model-b DIR] [--dtype-b bfloat16]

- perplexity (and bits per byte) on the held-out Python documentation topics;
- QA accuracy on held-out multi-document prompts, single- and two-document questions
  apart, with short documents (as in training) and with 6 documents of ~512 tokens;
- run A (--model, fp32) against run B (--model-b, default the same directory, in
  --dtype-b): greedy-token agreement and first divergence, logit KL, per-layer KV error.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from . import metrics, qa_data
from .probe import greedy, open_llm, prefill
from .qa import LONG_FILLER, heldout_prompts


def heldout_perplexity(llm, max_tokens: int, window: int) -> tuple[float, float, int]:
    """(perplexity, bits per byte, tokens scored) over windows of the held-out topics."""
    tok = llm.tokenizer
    ids: list[int] = []
    for topic in qa_data.pydoc_topics("heldout"):
        ids += tok.encode(topic)
    nll, nbytes, count = 0.0, 0, 0
    for start in range(0, min(len(ids), max_tokens) - 1, window):
        w = ids[start : start + window + 1]
        if len(w) < 2:
            break
        logits = prefill(llm, w[:-1]).logits
        nll += metrics.token_nll(logits, torch.tensor(w[1:])).sum().item()
        nbytes += len(tok.decode(w[1:]).encode())
        count += len(w) - 1
    return math.exp(nll / count), nll / math.log(2) / nbytes, count


def qa_line(llm, name: str, n: int, docs: int, answer_docs: int, filler: tuple[int, int]) -> str:
    prompts = heldout_prompts(n, docs, answer_docs, filler)
    ids = [llm.tokenizer.encode(p.text) for p in prompts]
    outs = greedy(llm, ids, max_tokens=4)
    score = metrics.qa_accuracy([llm.tokenizer.decode(o) for o in outs], [p.answer for p in prompts])
    mean_len = statistics.mean(len(i) for i in ids)
    return (f"qa_accuracy {name} {score.accuracy:.3f} ({score.correct}/{score.total}, "
            f"{docs} docs, {mean_len:.0f} prompt tokens on average)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quality.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face Llama directory")
    p.add_argument("--model-b", help="run B's model directory (default: --model)")
    p.add_argument("--dtype-b", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--qa-prompts", type=int, default=100, help="prompts per QA setting")
    p.add_argument("--ppl-tokens", type=int, default=8192)
    p.add_argument("--window", type=int, default=512, help="perplexity window (tokens)")
    p.add_argument("--compare-prompts", type=int, default=8)
    p.add_argument("--compare-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    llm = open_llm(args.model)
    print(f"model {args.model}", flush=True)

    ppl, bpb, count = heldout_perplexity(llm, args.ppl_tokens, args.window)
    print(f"perplexity heldout_text {ppl:.2f} ({bpb:.3f} bits/byte, {count} tokens)", flush=True)

    for name, docs, answer_docs, filler in (
        ("single_doc", 4, 1, (0, 0)), ("two_doc", 4, 2, (0, 0)),
        ("single_doc_long", 6, 1, LONG_FILLER), ("two_doc_long", 6, 2, LONG_FILLER),
    ):
        print(qa_line(llm, name, args.qa_prompts, docs, answer_docs, filler), flush=True)

    llm_b = open_llm(args.model_b or args.model, dtype=args.dtype_b)
    prompts = [llm.tokenizer.encode(q.text)
               for q in heldout_prompts(args.compare_prompts, 6, 1, LONG_FILLER, seed=2000)]
    agree = [metrics.agreement(a, b) for a, b in zip(
        greedy(llm, prompts, args.compare_tokens), greedy(llm_b, prompts, args.compare_tokens),
        strict=True)]
    kl, errors = [], []
    for ids in prompts:
        a, b = prefill(llm, ids), prefill(llm_b, ids)
        kl.append(metrics.kl_divergence(a.logits, b.logits))
        errors.append(metrics.layer_relative_error(a.kv, b.kv))
    first = [a.first_divergence for a in agree if a.first_divergence is not None]
    label = f"A fp32 vs B {args.dtype_b}"
    print(f"generation_agreement {statistics.mean(a.fraction for a in agree):.3f} ({label}; "
          f"{len(first)}/{len(agree)} prompts diverge, first divergence "
          f"{min(first) if first else 'none'} of {args.compare_tokens} tokens)")
    print(f"logit_kl {statistics.mean(kl):.3g} nats ({label}, mean over prompt positions)")
    per_layer = [statistics.mean(e[i] for e in errors) for i in range(len(errors[0]))]
    print(f"kv_relative_error {' '.join(f'{e:.3g}' for e in per_layer)} ({label}, per layer)")
    print(f"took {time.perf_counter() - start:.0f} s")
    llm.close()
    llm_b.close()


if __name__ == "__main__":
    main()
