"""How close a blended prefill comes to a full one, and whether a better choice of the
recomputed tokens could come closer: one line per recompute ratio.

    python -m benchmarks.blend_deviation [--prompts N] [--ratios 0.05 0.15 0.3 0.5]

On held-out RAG prompts (benchmarks/quality/rag_qa.py, SmolLM2-135M-Instruct by default;
documents shuffled, each precomputed alone, as in blend_rag.py --rag), the blended prefill
is compared with a full prefill of the same prompt: the relative error of the question's KV
(every layer; the question is always computed, so its error is what the reused KV did to
it) and the KL divergence of the first answer token's distribution. Two choices of the
recomputed tokens at each ratio:
- hkvd: lmkv's, CacheBlend's: the tokens whose KV deviates most at the check layer;
- all-layer: the tokens whose stored KV deviates most from the full prefill's, summed over
  every layer, known only after a full prefill. A heuristic with more knowledge, not a
  bound: a choice that minimised the question's error directly could do better.
Each line ends with the ratio hkvd error / all-layer error.

``--after-header`` computes each document after the prompt's first segment (the chat
header and instruction, ending in the separator) instead of alone, and stores the
document's rows only (keys before RoPE, ``blend_store_pre_rope``): a shared prefix such as
TurboRAG's and APE's, so that a document's first tokens are not its own attention sink.
``--pre-rope`` stores keys before RoPE with documents computed alone (the same storage as
``--after-header``, to compare the two).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics

import torch

from lmkv.blend.plan import BlendPlan, select_recompute
from lmkv.blend.precompute import precompute
from lmkv.blend.segments import split_segments
from lmkv_engines.minimal.blend import blend_prefill
from lmkv_engines.minimal.default_model import resolve_model

from .blend_rag import blend_llm, rag_ids, shuffled
from .quality.rag_qa import make_examples


class Prefill:
    """Blended prefills of one prompt into a flat KV [L, 2, n, 1, Hkv, D] (one-token blocks)."""

    def __init__(self, llm, ids: list[int]):
        self.engine = llm.engine
        self.model = self.engine.model
        self.ids = ids
        attn = self.model.model.layers[0].self_attn
        self.shape = (len(self.model.model.layers), 2, len(ids), 1, attn.num_kv_heads, attn.head_dim)

    def run(self, plan: BlendPlan, select=select_recompute) -> tuple[torch.Tensor, torch.Tensor]:
        """The last token's log-probabilities [vocab] and the KV [L, 2, n, Hkv, D]."""
        kv = torch.zeros(self.shape, dtype=self.engine.kv_cache.dtype)
        try:
            logits, _ = blend_prefill(self.model, kv, self.ids, torch.arange(len(self.ids)), plan,
                                      select=select)
        finally:
            plan.release()
        return torch.log_softmax(logits.float(), -1), kv[:, :, :, 0].float()

    def full(self):
        return self.run(BlendPlan(recompute_ratio=1.0, check_layer=len(self.model.model.layers)))

    def blended(self, ratio: float, select=select_recompute):
        cache = self.engine.kv_connector.cache
        cache.config = dataclasses.replace(cache.config, blend_recompute_ratio=ratio)
        plan = cache.blend_plan(self.ids, self.engine.blend_separator)
        assert plan is not None, "the prompt's documents were not precomputed"
        return self.run(plan, select)


class AfterHeader:
    """The engine as lmkv's KVComputer, computing each document after ``header`` (the
    prompt's first segment, which itself is computed alone): the document's rows only,
    keys before RoPE."""

    def __init__(self, engine, header: list[int]):
        self.engine, self.header = engine, header
        self.rope_inv_freq = engine.rope_inv_freq

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.engine.tokenize(text, add_special_tokens)

    def compute_kv(self, token_lists: list[list[int]], pre_rope: bool = False) -> list[torch.Tensor]:
        assert pre_rope, "documents after a header are stored before RoPE"
        h = self.header
        out = []
        for ids in token_lists:
            if ids == h[: len(ids)]:
                out += self.engine.compute_kv([ids], pre_rope=True)
            else:
                out.append(self.engine.compute_kv([h + ids], pre_rope=True)[0][:, :, len(h):].contiguous())
        return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.blend_deviation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="default: SmolLM2-135M-Instruct")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.05, 0.15, 0.3, 0.5])
    p.add_argument("--seed", type=int, default=3000)
    p.add_argument("--after-header", action="store_true",
                   help="compute each document after the prompt's header, not alone")
    p.add_argument("--pre-rope", action="store_true", help="store keys before RoPE")
    args = p.parse_args(argv)
    model = args.model or str(resolve_model(None))
    opts = argparse.Namespace(rag=True, chunk_size=256, hot_cache_gb=2.0, separator="\n\n")
    llm = blend_llm(model, opts, 0.0, pre_rope=args.after_header or args.pre_rope)
    tok = llm.tokenizer
    rng = random.Random(args.seed)
    examples = [shuffled(e, rng) for e in
                make_examples(args.prompts, "heldout", lambda t: len(tok.encode(t)))]
    err: dict[tuple[str, float], list[float]] = {}
    kl: dict[tuple[str, float], list[float]] = {}
    lengths = []
    for e in examples:
        ids, docs = rag_ids(llm, e, opts.separator)
        lengths.append(len(ids))
        segs = split_segments(ids, llm.engine.blend_separator)
        if args.after_header:  # the header: the first segment and the separator after it
            precompute(AfterHeader(llm.engine, ids[: segs[1].start]), llm.engine.kv_connector.cache,
                       docs, progress=False)
        else:
            llm.precompute(docs, progress=False)
        q0 = segs[-1].start  # the question's rows
        run = Prefill(llm, ids)
        ref_lp, ref_kv = run.full()
        ref_q = ref_kv[:, :, q0:]
        _, naive_kv = run.blended(0.0)
        truth = torch.zeros(len(ids))  # each token's stored-KV deviation, all layers
        truth[:q0] = (naive_kv[:, :, :q0] - ref_kv[:, :, :q0]).pow(2).sum((0, 1, 3, 4))

        def all_layer(_deviation, cached, ratio, _truth=truth):
            return select_recompute(_truth, cached, ratio)

        for ratio in [0.0, *args.ratios]:
            for name, select in (("hkvd", select_recompute), ("all-layer", all_layer)):
                if ratio == 0 and name == "all-layer":
                    continue
                lp, kv = run.blended(ratio, select)
                err.setdefault((name, ratio), []).append(
                    float((kv[:, :, q0:] - ref_q).norm() / ref_q.norm()))
                kl.setdefault((name, ratio), []).append(float((ref_lp.exp() * (ref_lp - lp)).sum()))
    llm.close()
    mean = statistics.mean
    how = "computed after the prompt's header" if args.after_header else "computed alone"
    how += ", keys stored before RoPE" if args.after_header or args.pre_rope else ""
    print(f"{len(examples)} held-out RAG prompts, {min(lengths)}-{max(lengths)} tokens, documents "
          f"{how}; question-KV error = |blended - full| / |full| over every layer; KL of the "
          f"first answer token")
    print(f"naive reuse: question-KV error {mean(err['hkvd', 0.0]):.3f}, "
          f"KL {mean(kl['hkvd', 0.0]):.3f}")
    for ratio in args.ratios:
        h, o = mean(err["hkvd", ratio]), mean(err["all-layer", ratio])
        print(f"recompute {ratio:.0%}: question-KV error hkvd {h:.3f} vs all-layer {o:.3f}, KL hkvd "
              f"{mean(kl['hkvd', ratio]):.3f} vs all-layer {mean(kl['all-layer', ratio]):.3f}: "
              f"hkvd/all-layer error = {h / o:.2f}x")


if __name__ == "__main__":
    main()
