"""A seeded RAG question-answering set about invented countries, for measuring a real chat
model's task quality (full prefill here; lmkv's codecs and CacheBlend against it).

Each prompt holds 4-8 documents of 300-600 tokens, each about one made-up country: seven
facts (capital, river, mountain, language, currency, founder, founding year) scattered
among filler sentences. The question at the end asks for one fact of one country; the other
documents state the same kinds of facts about other countries. The names are made-up words,
so the model cannot answer from memory. Names are drawn from two disjoint pools: "dev"
(for calibrating anything) and "heldout" (for reporting).

    python -m benchmarks.quality.rag_qa [--model PATH] [--n 50] [--split heldout]

prints the full-prefill accuracy (the answer's words appear in the greedy reply).
"""

from __future__ import annotations

import argparse
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

SPLITS = ("dev", "heldout")
DOC_TOKENS = (300, 600)
NUM_DOCUMENTS = (4, 8)
MAX_TOKENS = 32  # a reply long enough for a sentence that ends in a two-word answer

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr",
           "gr", "kr", "tr", "th", "st", "qu", "sh", "pl")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ei")
_CODAS = ("", "", "n", "r", "l", "s", "th", "m", "nd", "rk", "x")

# attribute -> (the fact's sentence, the question); {c} the country, {v} the value
FACTS = {
    "capital": ("The capital of {c} is {v}.", "What is the capital of {c}?"),
    "river": ("The longest river in {c} is the {v}.", "What is the longest river in {c}?"),
    "mountain": ("The highest mountain of {c} is Mount {v}.",
                 "What is the highest mountain of {c}?"),
    "language": ("Most people in {c} speak {v}.", "What language do most people in {c} speak?"),
    "currency": ("In {c}, people pay with a currency called the {v}.",
                 "What is the currency of {c} called?"),
    "founder": ("{c} was founded by {v}.", "Who founded {c}?"),
    "year": ("{c} was founded in the year {v}.", "In what year was {c} founded?"),
}

FILLER = (
    "Travelers to {c} often remark on its quiet streets and long summer evenings.",
    "The markets of {c} open early, and by noon most stalls have sold their bread.",
    "Winters in {c} are mild near the coast and harsh in the northern valleys.",
    "Many families in {c} keep small gardens where they grow beans and herbs.",
    "Schools in {c} teach children to read before the age of six.",
    "The old town of {w} is known for its narrow lanes and painted doors.",
    "A railway line links the southern farms of {c} with the harbor of {w}.",
    "Farmers in {c} grow barley, apples and a hardy kind of rye.",
    "Every autumn, a festival in {w} celebrates the end of the harvest.",
    "The people of {c} are proud of their long tradition of wood carving.",
    "Fishing boats leave the port of {w} before dawn and return in the afternoon.",
    "Most houses in {c} are built of stone, with steep roofs against the snow.",
    "Visitors can walk from the village of {w} to the lakes in a single day.",
    "The climate of {c} has grown warmer over the last fifty years.",
    "A small museum in {w} displays old maps, coins and tools.",
    "Bread in {c} is usually baked with seeds and eaten with soft cheese.",
    "Music is important in {c}, and many towns have their own brass band.",
    "The roads of {c} wind through forests of pine and birch.",
    "In spring, the meadows around {w} are covered with yellow flowers.",
    "Weaving is an old craft in {c}, and woolen blankets are sold in every town.",
    "The newspapers of {c} are printed in the morning and read over tea.",
    "Children in {c} play a ball game that resembles football but uses no goals.",
    "Many old bridges in {c} were rebuilt after a great flood a century ago.",
    "The harbor of {w} is sheltered by a long wall of grey rock.",
    "Most towns in {c} hold a weekly market on the main square.",
    "Cyclists enjoy the flat roads along the rivers of {c}.",
    "A well known poet from {w} wrote about the sea and the changing seasons.",
    "In {c}, shops close early on the day before a holiday.",
    "The forests of {c} are home to deer, foxes and many kinds of birds.",
    "Tea is more popular than coffee in most parts of {c}.",
    "Old stone churches stand in many villages of {c}.",
    "The university in {w} is the oldest place of learning in the region.",
    "People in {c} like to spend their Sundays walking in the hills.",
    "The valleys of {c} are green for most of the year because of frequent rain.",
    "Pottery from {w} is sold in shops across the whole region.",
    "Ferries carry passengers and cars between the islands of {c}.",
    "Most villages in {c} have a well in the middle of the square.",
    "The winters are long in the mountains of {c}, and snow lasts until spring.",
    "Libraries in {c} lend books, maps and records for free.",
    "A famous bakery in {w} has made the same honey cake for two hundred years.",
)


@dataclass(frozen=True, slots=True)
class RagExample:
    documents: tuple[str, ...]  # "Document i: <country>\n<text>", in prompt order
    question: str  # "What is the capital of Zorvia?"
    answer: str
    attribute: str
    answer_document: int  # index in documents

    def messages(self) -> list[dict[str, str]]:
        """The chat the model is asked: documents, then the question."""
        docs = "\n\n".join(self.documents)
        return [{"role": "user", "content":
                 f"Read the documents and answer the question.\n\n{docs}\n\n"
                 f"Question: {self.question} Answer in a few words."}]

    def is_correct(self, reply: str) -> bool:
        """Every word of the answer appears in the reply (case and punctuation ignored)."""
        words = set(_words(reply))
        return all(w in words for w in _words(self.answer))


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


@cache
def name_pool(split: str) -> tuple[str, ...]:
    """Made-up words of 2-3 syllables, the same for every seed; the splits are disjoint."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, not {split!r}")
    rng = random.Random(20261124)
    names: set[str] = set()
    while len(names) < 6000:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                       for _ in range(rng.choice((2, 2, 3))))
        if 4 <= len(word) <= 10:
            names.add(word.capitalize())
    pool = sorted(names)
    random.Random(7).shuffle(pool)
    half = len(pool) // 2
    return tuple(pool[:half] if split == "dev" else pool[half:])


def make_example(rng: random.Random, split: str,
                 count_tokens: Callable[[str], int]) -> RagExample:
    """One prompt's documents and question; documents are 300-600 tokens by
    ``count_tokens`` (the model's tokenizer)."""
    pool = name_pool(split)
    num_docs = rng.randint(*NUM_DOCUMENTS)
    # distinct names across the prompt: countries, values, towns
    names = iter(rng.sample(pool, num_docs * 12))
    countries = [next(names) for _ in range(num_docs)]
    documents = []
    facts_of = []
    for i, country in enumerate(countries):
        facts = {
            "capital": next(names), "river": next(names), "mountain": next(names),
            "language": next(names), "currency": next(names),
            "founder": f"{next(names)} {next(names)}",
            "year": str(rng.randint(1100, 1899)),
        }
        towns = [next(names), next(names), next(names)]
        facts_of.append(facts)
        documents.append(f"Document {i + 1}: {country}\n" +
                         _document_text(rng, country, facts, towns, count_tokens))
    target = rng.randrange(num_docs)
    attribute = rng.choice(sorted(FACTS))
    question = FACTS[attribute][1].format(c=countries[target])
    return RagExample(tuple(documents), question, facts_of[target][attribute], attribute, target)


def _document_text(rng: random.Random, country: str, facts: dict[str, str], towns: list[str],
                   count_tokens: Callable[[str], int]) -> str:
    """The facts in random order, filler sentences between them, up to a drawn length."""
    lo, hi = DOC_TOKENS
    want = rng.randint(lo + 30, hi)  # a filler sentence is < 30 tokens: the text ends in [lo, hi]
    fact_sentences = [FACTS[a][0].format(c=country, v=v) for a, v in facts.items()]
    rng.shuffle(fact_sentences)
    filler = [s.format(c=country, w=rng.choice(towns)) for s in rng.sample(FILLER, len(FILLER))]
    # the facts, and filler inserted at random places while the text stays within `want`
    sentences = list(fact_sentences)
    for s in filler:
        longer = list(sentences)
        longer.insert(rng.randint(0, len(sentences)), s)
        if count_tokens(" ".join(longer)) > want:
            break
        sentences = longer
    return " ".join(sentences)


def make_examples(n: int, split: str, count_tokens: Callable[[str], int],
                  seed: int = 0) -> list[RagExample]:
    """``n`` examples of ``split``, the same for the same seed and tokenizer."""
    rng = random.Random(f"rag-qa-{split}-{seed}")
    return [make_example(rng, split, count_tokens) for _ in range(n)]


def main() -> None:
    from lmkv_engines.minimal.default_model import resolve_model
    from lmkv_engines.minimal.llm import LLM
    from lmkv_engines.minimal.sampling_params import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a directory or .gguf file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--split", choices=SPLITS, default="heldout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=0, help="print this many replies")
    args = ap.parse_args()

    path = resolve_model(args.model)
    with LLM(str(path), kv_cache_memory=2 << 30, enable_prefix_caching=False) as llm:
        tok = llm.tokenizer
        examples = make_examples(args.n, args.split, lambda t: len(tok.encode(t)), args.seed)
        prompts = [tok.apply_chat_template(e.messages()) for e in examples]
        lengths = [len(tok.encode(p)) for p in prompts]
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        seconds = time.perf_counter() - start
    correct = [e.is_correct(o.text) for e, o in zip(examples, outs, strict=True)]
    for e, o, ok in list(zip(examples, outs, correct, strict=True))[: args.show]:
        print(f"{'ok ' if ok else 'BAD'} {e.question} want {e.answer!r} got {o.text!r}")
    docs = [len(e.documents) for e in examples]
    for lo, hi in ((4, 5), (6, 8)):
        part = [ok for ok, d in zip(correct, docs, strict=True) if lo <= d <= hi]
        if part:
            print(f"{lo}-{hi} documents: {sum(part)}/{len(part)} correct: "
                  f"accuracy = {sum(part) / len(part):.1%}")
    print(f"{path.name} full prefill, {args.n} {args.split} prompts ({min(docs)}-{max(docs)} "
          f"documents, {min(lengths)}-{max(lengths)} tokens, mean {sum(lengths) / len(lengths):.0f}; "
          f"{seconds:.0f}s): accuracy = {sum(correct) / len(correct):.1%}")


if __name__ == "__main__":
    main()
