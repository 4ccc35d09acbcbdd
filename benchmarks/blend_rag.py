"""CacheBlend on RAG prompts: answer quality and time to first token, one line per result.

    python -m benchmarks.blend_rag [--model DIR] [--qa-prompts N] [--ttft-prompts N]
        [--continued [--filler N]] [--rag [--qa-seconds S]]

A prompt is a held-out QA example (benchmarks/quality/qa.py): 6 documents of ~512 tokens
(LONG_FILLER; ``--filler``) in a shuffled order, then the question, separated by the blend
separator (default "\\n\\n", joined as running text has it: then the prompt is tokenized
exactly as the QA format, only the order is new). Each chunk's KV is precomputed alone
(``LLM.precompute``), so in a prompt it sits at another position and never saw the chunks
before it.

- QA accuracy (first generated word == the answer, benchmarks/quality/metrics.py): full
  prefill vs naive reuse (ratio 0: no recompute) vs blending at 5, 15 and 30%, on questions
  answered from one document or (--answer-documents 2) from two; with ``--continued``,
  every document is two paragraphs, so two chunks, the second saying "it", and the
  question asks about a second paragraph's fact: what the chunk means depends on the chunk
  before it, which naive reuse never shows it (default model: the shipped
  qa-2layer-continued). A second line: blend15 against naive reuse. Meaningful on a
  trained model only: off by default on the default (random) model.
- TTFT over one document set in --ttft-prompts distinct orders: blending at 15% with the
  chunks in the hot cache vs full prefill (target >= 3x), and vs prefix caching alone (the
  engine's prefix cache plus lmkv's prefix chunks, warmed with each document as a prompt);
  then each prompt sent again to the blending engine (served from its pages in the engine's
  blend namespace, not blended again) vs its blend.

With ``--rag``: the chat model's RAG QA set (benchmarks/quality/rag_qa.py, default model
SmolLM2-135M-Instruct) for both: accuracy (answer words in the reply) and TTFT over one
6-document example's orders.

Default model: the realistic-shape random Llama of benchmarks/common.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch

from lmkv.blend.segments import split_segments
from lmkv.config import load_config
from lmkv_engines.minimal.default_model import resolve_model
from lmkv_engines.minimal.llm import LLM

from .common import realistic_model_dir, trained_model_dir
from .quality import metrics
from .quality.probe import greedy, open_llm
from .quality.qa import LONG_FILLER, QAPrompt, heldout_prompts
from .quality.rag_qa import MAX_TOKENS, RagExample, make_examples

RATIOS = (0.05, 0.15, 0.30)
CONTINUED_MODEL = "qa-2layer-continued"  # --continued's default model (benchmarks/quality/models)
NUM_DOCUMENTS = 6


def blend_llm(model: str, args: argparse.Namespace, ratio: float, pre_rope: bool = False, **kw) -> LLM:
    cfg = load_config(env={}, chunk_size=args.chunk_size, max_local_cpu_size=args.hot_cache_gb,
                      enable_blending=True, blend_recompute_ratio=ratio,
                      blend_special_str=args.separator, blend_store_pre_rope=pre_rope)
    return open_llm(model, lmkv_config=cfg, **engine_args(args), **kw)


def engine_args(args: argparse.Namespace) -> dict:
    """--rag prompts reach ~5,000 tokens: a longer window and more KV memory."""
    return dict(max_len=8192, kv_cache_memory=1 << 30) if args.rag else {}


def set_ratio(llm: LLM, ratio: float) -> None:
    """The recompute ratio of the next prompts (lmkv reads it per prompt)."""
    lmkv = llm.engine.kv_connector.cache
    lmkv.config = dataclasses.replace(lmkv.config, blend_recompute_ratio=ratio)


def rag_ids(llm: LLM, prompt: QAPrompt | RagExample, separator: str
            ) -> tuple[list[int], list[list[int]]]:
    """The prompt's token ids (as the blending engine tokenizes it: part by part) and the ids
    of its stored segments (the documents; the first carries the prompt's special tokens).
    A RagExample is the chat model's prompt: [header + instruction], documents, [question +
    the assistant's turn], joined by blank lines (the separator must be "\\n\\n")."""
    if isinstance(prompt, RagExample):
        text = llm.tokenizer.apply_chat_template(prompt.messages())
    else:
        text = separator.join([*prompt.documents, prompt.question])
    ids = llm.engine.tokenize(text)
    segs = split_segments(ids, llm.engine.blend_separator)[:-1]
    return ids, [ids[s.start : s.end] for s in segs]


def shuffled(prompt, rng: random.Random):
    docs = list(prompt.documents)
    rng.shuffle(docs)
    return dataclasses.replace(prompt, documents=tuple(docs))


def rag_accuracy(model: str, args: argparse.Namespace) -> list[str]:
    """--rag: held-out RAG QA prompts (benchmarks/quality/rag_qa.py) with the documents in a
    shuffled order, each document precomputed alone; correct = the answer's words appear in
    the greedy reply (up to rag_qa.MAX_TOKENS tokens, cut at end of sequence)."""
    rng = random.Random(args.seed)
    full = open_llm(model, **engine_args(args))
    blend = blend_llm(model, args, 0.0)
    tok = full.tokenizer
    examples = [shuffled(e, rng) for e in
                make_examples(args.qa_prompts, "heldout", lambda t: len(tok.encode(t)))]
    names = ["full", "naive"] + [f"blend{round(r * 100)}" for r in RATIOS]
    correct = {name: 0 for name in names}
    lengths = []

    def answer(llm: LLM, ids: list[int]) -> str:
        out = []
        for t in greedy(llm, [ids], MAX_TOKENS)[0]:
            if t in tok.eos_token_ids:
                break
            out.append(t)
        return tok.decode(out)

    start = time.perf_counter()
    for i, e in enumerate(examples):  # one prompt at a time: the hot cache only needs its docs
        ids, docs = rag_ids(blend, e, args.separator)
        lengths.append(len(ids))
        blend.precompute(docs, progress=False)
        correct["full"] += e.is_correct(answer(full, ids))
        for name, ratio in zip(names[1:], (0.0, *RATIOS), strict=True):
            set_ratio(blend, ratio)
            correct[name] += e.is_correct(answer(blend, ids))
        elapsed = time.perf_counter() - start
        print(f"[{i + 1}/{len(examples)}] {len(ids)} tokens, {elapsed:.0f}s: "
              + ", ".join(f"{k} {v}" for k, v in correct.items()), flush=True)
        if args.qa_seconds and elapsed > args.qa_seconds:
            examples = examples[: i + 1]
            break
    full.close()
    blend.close()
    acc = {name: 100 * c / len(examples) for name, c in correct.items()}
    scores = ", ".join(f"{name} {a:.1f}%" for name, a in acc.items())
    return [f"RAG QA accuracy over {len(examples)} held-out prompts (documents shuffled, "
            f"{min(lengths)}-{max(lengths)} tokens, mean {statistics.mean(lengths):.0f}): {scores}: "
            f"blend15 - full = {acc['blend15'] - acc['full']:+.1f} points",
            f"RAG QA accuracy blend15 {acc['blend15']:.1f}% vs naive reuse {acc['naive']:.1f}%: "
            f"blend15 - naive = {acc['blend15'] - acc['naive']:+.1f} points"]


def qa_accuracy(model: str, args: argparse.Namespace) -> list[str]:
    rng = random.Random(args.seed)
    filler = (args.filler, args.filler)
    if args.linked:  # in their generated order: a linked document follows the one it names
        prompts = heldout_prompts(args.qa_prompts, NUM_DOCUMENTS, 2, filler, linked=True)
    elif args.continued:  # documents shuffled whole: a second paragraph follows its first
        prompts = [shuffled(p, rng) for p in heldout_prompts(args.qa_prompts, NUM_DOCUMENTS, 1,
                                                             filler, continued=True)]
    else:
        prompts = [shuffled(p, rng) for p in heldout_prompts(args.qa_prompts, NUM_DOCUMENTS,
                                                             args.answer_documents, filler)]
    full = open_llm(model)
    blend = blend_llm(model, args, 0.0)
    names = ["full", "naive"] + [f"blend{round(r * 100)}" for r in RATIOS]
    outputs: dict[str, list[str]] = {name: [] for name in names}
    lengths = []
    for p in prompts:  # one prompt at a time: the hot cache only needs its documents
        ids, docs = rag_ids(blend, p, args.separator)
        lengths.append(len(ids))
        blend.precompute(docs, progress=False)
        outputs["full"].append(full.tokenizer.decode(greedy(full, [ids], 4)[0]))
        for name, ratio in zip(names[1:], (0.0, *RATIOS), strict=True):
            set_ratio(blend, ratio)
            outputs[name].append(blend.tokenizer.decode(greedy(blend, [ids], 4)[0]))
    answers = [p.answer for p in prompts]
    acc = {name: 100 * metrics.qa_accuracy(out, answers).accuracy for name, out in outputs.items()}
    full.close()
    blend.close()
    scores = ", ".join(f"{name} {a:.1f}%" for name, a in acc.items())
    kind = ("linked-document" if args.linked else
            "second-paragraph (12 chunks)" if args.continued else
            "single-document" if args.answer_documents == 1 else "two-document (neighbor)")
    return [f"QA accuracy over {len(prompts)} {kind} prompts of {statistics.mean(lengths):.0f} "
            f"tokens: {scores}: blend15 - full = {acc['blend15'] - acc['full']:+.1f} points",
            f"QA accuracy blend15 {acc['blend15']:.1f}% vs naive reuse {acc['naive']:.1f}%: "
            f"blend15 - naive = {acc['blend15'] - acc['naive']:+.1f} points"]


def ttft_ms(llm: LLM, ids: list[int], clock: str) -> float:
    """Time to the first token; the "cpu" clock counts this process's CPU time instead of
    wall time, which a machine shared with other jobs inflates far less."""
    now = time.process_time if clock == "cpu" else time.perf_counter
    start = now()
    greedy(llm, [ids], 1)
    return (now() - start) * 1e3


def ttft(model: str, args: argparse.Namespace) -> list[str]:
    rng = random.Random(args.seed)
    full = open_llm(model, **engine_args(args))
    if args.rag:  # the first held-out RAG example with 6 documents
        tok = full.tokenizer
        base = next(e for e in make_examples(50, "heldout", lambda t: len(tok.encode(t)))
                    if len(e.documents) == NUM_DOCUMENTS)
    else:
        base = heldout_prompts(1, NUM_DOCUMENTS, 1, LONG_FILLER, seed=args.seed)[0]
    orders = []
    while len(orders) < args.ttft_prompts:
        p = shuffled(base, rng)
        if p not in orders:
            orders.append(p)
    blend = blend_llm(model, args, 0.15, enable_prefix_caching=True)  # as engine serve runs
    prefix = open_llm(model, enable_prefix_caching=True, lmkv_config=load_config(
        env={}, chunk_size=args.chunk_size, max_local_cpu_size=args.hot_cache_gb),
        **engine_args(args))
    prompts = [rag_ids(blend, p, args.separator) for p in orders]
    blend.precompute([d for _, docs in prompts for d in docs], progress=False)
    for doc in prompts[0][1] if args.rag else base.documents:  # warm prefix caching: each
        greedy(prefix, [doc if args.rag else prefix.engine.tokenize(doc)], 1)  # doc as a start
    greedy(full, [prompts[0][1][1]], 1)  # warm-up
    times: dict[str, list[float]] = {"full": [], "blend15": [], "prefix": []}
    for ids, _ in prompts:  # interleaved: a busy machine slows all three alike
        times["full"].append(ttft_ms(full, ids, args.clock))
        times["blend15"].append(ttft_ms(blend, ids, args.clock))
        times["prefix"].append(ttft_ms(prefix, ids, args.clock))
    reg = blend.engine.metrics.registry
    hits = reg.get_sample_value("lmkv_blend_hit_tokens_total")
    recomputed = reg.get_sample_value("lmkv_blend_recomputed_tokens_total")
    # each prompt sent again: served from its pages in the engine's blend namespace
    again = [ttft_ms(blend, ids, args.clock) for ids, _ in prompts]
    blended_again = reg.get_sample_value("lmkv_blend_requests_total") - len(prompts)
    for llm in (full, blend, prefix):
        llm.close()
    med = {name: statistics.median(t) for name, t in times.items()}
    n = statistics.mean(len(ids) for ids, _ in prompts)
    clock = "" if args.clock == "wall" else ", CPU time"
    return [
        f"TTFT prompts: {len(prompts)} orders of {NUM_DOCUMENTS} documents, {n:.0f} tokens on "
        f"average{clock}; blend15 reused {hits:.0f} tokens, recomputed {recomputed:.0f}: "
        f"recomputed/reused = {recomputed / hits:.3f}",
        f"TTFT full {med['full']:.0f} ms vs blend15 {med['blend15']:.0f} ms: "
        f"full/blend15 = {med['full'] / med['blend15']:.1f}x",
        f"TTFT prefix caching alone {med['prefix']:.0f} ms vs blend15 {med['blend15']:.0f} ms: "
        f"prefix/blend15 = {med['prefix'] / med['blend15']:.1f}x",
        f"TTFT the same prompts sent again (blended again: {blended_again:.0f}) "
        f"{statistics.median(again):.0f} ms vs blend15 {med['blend15']:.0f} ms: "
        f"blend15/again = {med['blend15'] / statistics.median(again):.1f}x",
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.blend_rag", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face Llama directory (default: the realistic-shape "
                   f"random model, TTFT only; with --continued the shipped {CONTINUED_MODEL})")
    p.add_argument("--qa-prompts", type=int, help="QA prompts (default 40 with --model, else 0)")
    p.add_argument("--answer-documents", type=int, choices=(1, 2), default=1,
                   help="questions answered from one document, or from two (a neighbor's fact: "
                   "the first document names the neighbor, the second holds the answer)")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--linked", action="store_true",
                   help="questions about a document introduced only as an earlier document's "
                   "neighbor (\"The capital of it is ...\"): its KV means something only after "
                   "that document, the case naive reuse cannot serve")
    form.add_argument("--continued", action="store_true",
                   help="every document in two paragraphs, so two chunks, the second saying "
                   "\"it\"; the question asks about a fact in a second paragraph: its KV means "
                   "something only after its first paragraph, which naive reuse never shows it")
    form.add_argument("--rag", action="store_true",
                   help="the chat model's RAG QA set (benchmarks/quality/rag_qa.py; default "
                   "model SmolLM2-135M-Instruct): 4-8 documents of 300-600 tokens, shuffled")
    p.add_argument("--filler", type=int, default=LONG_FILLER[0],
                   help=f"filler sentences after each fact of a QA prompt's documents (default "
                   f"{LONG_FILLER[0]}: ~512-token documents)")
    p.add_argument("--qa-seconds", type=float, default=0,
                   help="--rag: stop adding QA prompts after this many seconds (0: all)")
    p.add_argument("--ttft-prompts", type=int, default=4, help="orders timed (default 4)")
    p.add_argument("--separator", default="\n\n", help="blend_special_str (default: blank line)")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--hot-cache-gb", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=3000)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="TTFT clock: wall time, or this process's CPU time (on a busy machine; "
                   "use with --threads 1)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.continued and not args.model and (shipped := trained_model_dir(CONTINUED_MODEL)):
        args.model = str(shipped)
    if args.rag and not args.model:
        args.model = str(resolve_model(None))
    if args.qa_prompts is None:
        args.qa_prompts = 40 if args.model else 0
    model = args.model or str(realistic_model_dir())
    print(f"model {model}", flush=True)
    if args.qa_prompts:
        for line in (rag_accuracy if args.rag else qa_accuracy)(model, args):
            print(line, flush=True)
    if args.ttft_prompts:
        for line in ttft(model, args):
            print(line, flush=True)


if __name__ == "__main__":
    main()
