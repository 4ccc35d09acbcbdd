"""A synthetic multi-document question-answering task, and the English text beside it.

Each document is an entity card about a made-up country: its capital, river, language,
animal, export, and its neighbor (another country, described in another document):

    Document 3: Zorvia. The capital of Zorvia is Melk. <filler> The river of Zorvia is Tal. ...

A question asks for one attribute of one country (the answer is a word copied from that
country's document), or for an attribute of a country's neighbor (the answer needs two
documents: the first names the neighbor, the second holds the attribute):

    Q: The capital of Zorvia is Melk
    Q: The river of the neighbor of Zorvia is Dun

A question ends the way its fact's sentence does up to the answer, so that a model answers
by finding the matching sentence and copying the word after it (or, for the neighbor, by
first finding the neighbor's name).

Optionally (``linked``) a document is introduced only as an earlier document's neighbor:

    Document 4: The neighbor of Zorvia. The capital of it is Fous. ...

and "Q: The capital of Tarnia is" (Zorvia's document says its neighbor is Tarnia) is
answered from it: its facts mean something only after the document it names, as a RAG
chunk that says "it" needs the chunk before (what CacheBlend recomputes).

Optionally (``continued``) a document is written as two paragraphs, as a retriever that
splits at blank lines would cut it into two chunks; the second names no country, its facts
say "it":

    Document 3: Zorvia. The neighbor of Zorvia is Tarnia. The capital of Zorvia is Melk.

    The river of it is Tal. The language of it is Quen. ...

and "Q: The river of Zorvia is" needs the first paragraph to make sense of the second.

Names and values are drawn from closed vocabularies of made-up words, fixed for all seeds,
so that a model trained on one seed's examples is tested on another seed's examples with
the same words but new facts. Filler sentences come from the documentation topics shipped
with Python (``pydoc_data``), split by topic into a training and a held-out part.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from functools import cache

ATTRIBUTES = ("capital", "river", "language", "animal", "export")
NUM_COUNTRIES = 240
NUM_VALUES = 80  # per attribute

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr",
           "kr", "tr", "sh", "th", "pl", "st", "qu")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ea")
_CODAS = ("", "n", "r", "l", "s", "th", "x", "m", "nd", "rk")


@dataclass(frozen=True, slots=True)
class Vocabulary:
    countries: tuple[str, ...]
    values: dict[str, tuple[str, ...]]  # attribute -> its closed set of words


@dataclass(frozen=True, slots=True)
class Country:
    name: str
    facts: dict[str, str]  # attribute -> value, plus "neighbor" -> another country's name


@dataclass(frozen=True, slots=True)
class Question:
    text: str  # "Q: The capital of Zorvia is"
    answer: str  # "Melk"
    num_documents: int  # 1 or 2: how many documents the answer needs
    continued: bool = False  # the answer is in a document's second paragraph (says "it")


@dataclass(frozen=True, slots=True)
class QAExample:
    documents: list[str]  # "Document i: ..." paragraphs, in prompt order
    questions: list[Question]

    def context(self) -> str:
        return "\n\n".join(self.documents) + "\n\n"


@cache
def vocabulary() -> Vocabulary:
    """The closed word lists (the same for every seed): distinct capitalized made-up words."""
    rng = random.Random(1234)
    seen: set[str] = set()

    def words(n: int, syllables: tuple[int, ...], ending: str = "") -> tuple[str, ...]:
        out = []
        while len(out) < n:
            w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.choice(syllables)))
            w = (w + rng.choice(_CODAS) + ending).capitalize()
            if w not in seen and len(w) <= 10:
                seen.add(w)
                out.append(w)
        return tuple(out)

    countries = words(NUM_COUNTRIES, (2,), ending="ia")
    values = {a: words(NUM_VALUES, (1, 2)) for a in ATTRIBUTES}
    return Vocabulary(countries, values)


def make_example(
    rng: random.Random,
    num_documents: int,
    num_questions: int,
    filler: list[str] | None = None,
    filler_per_fact: tuple[int, int] = (0, 0),
    two_doc_fraction: float = 0.3,
    distinct: bool = False,
    linked: float = 0.0,
    continued: float = 0.0,
) -> QAExample:
    """One prompt's documents and questions. Countries, facts and neighbors are random; each
    fact may be followed by ``filler_per_fact`` = [lo, hi] filler sentences. ``distinct``:
    no (country, attribute) is asked twice (at most ``num_documents * 5`` questions), so a
    later question cannot be answered by copying an earlier question's line. ``linked``:
    the chance that a document after the first is introduced only as an earlier document's
    neighbor ("Document 4: The neighbor of Kelia. The capital of it is Melk."): its name is
    then written only in neighbor facts, that earlier document's among them, so its facts
    mean something only after that document, and a question about it needs both (as a RAG
    chunk that says "it" needs the one before). ``continued``: the chance that a document
    is written as two paragraphs, the second saying "it" (see the module docstring)."""
    vocab = vocabulary()
    names = rng.sample(vocab.countries, num_documents)
    countries = []
    for i, name in enumerate(names):
        facts = {a: rng.choice(vocab.values[a]) for a in ATTRIBUTES}
        if num_documents > 1:
            facts["neighbor"] = names[(i + rng.randrange(1, num_documents)) % num_documents]
        countries.append(Country(name, facts))
    aliases: dict[int, str] = {}  # document -> "the neighbor of <an earlier one>"
    if linked:
        sources: set[int] = set()
        for j in range(1, num_documents):
            free = [i for i in range(j) if i not in aliases and i not in sources]
            if free and rng.random() < linked:
                i = rng.choice(free)
                countries[i].facts["neighbor"] = names[j]
                sources.add(i)
                aliases[j] = f"the neighbor of {names[i]}"
    by_name = {c.name: c for c in countries}
    # a document's split point (its first paragraph's facts), drawn only when asked for: the
    # examples without continued documents are the same draws as before it existed
    splits = {i: 0 for i in range(num_documents)}
    if continued:
        for i in splits:
            if i not in aliases and rng.random() < continued:
                splits[i] = rng.randint(2, len(countries[i].facts) - 2)
    documents = []
    later: set[tuple[str, str]] = set()  # (country, attribute) written in a second paragraph
    for i, c in enumerate(countries):
        text, second = _document(i + 1, c, rng, filler, filler_per_fact, aliases.get(i), splits[i])
        documents.append(text)
        later.update((c.name, a) for a in second)
    aliased = {names[j] for j in aliases}
    questions = []
    if distinct:
        asks = [(c, a) for c in countries for a in ATTRIBUTES]
        rng.shuffle(asks)
        asks = asks[:num_questions]
    else:  # independent draws (the held-out benchmark prompts depend on this sequence)
        asks = [(rng.choice(countries), rng.choice(ATTRIBUTES)) for _ in range(num_questions)]
    for c, attr in asks:
        if num_documents > 1 and rng.random() < two_doc_fraction:
            other = by_name[c.facts["neighbor"]]
            questions.append(Question(f"Q: The {attr} of the neighbor of {c.name} is",
                                      other.facts[attr], 2))
        else:
            questions.append(Question(f"Q: The {attr} of {c.name} is", c.facts[attr],
                                      2 if c.name in aliased else 1, (c.name, attr) in later))
    return QAExample(documents, questions)


def dependent_example(rng: random.Random, num_documents: int, filler: list[str] | None,
                      filler_per_fact: tuple[int, int], form: str) -> tuple[QAExample, Question]:
    """An example with every document in ``form`` ("linked": introduced as an earlier
    document's neighbor; "continued": two paragraphs), and its first question that needs
    the document or paragraph before (held-out checks of those forms)."""
    if form not in ("linked", "continued"):
        raise ValueError(f"form must be linked or continued, not {form!r}")
    ex = make_example(rng, num_documents, 5 * num_documents, filler, filler_per_fact,
                      two_doc_fraction=0.0, distinct=True, **{form: 1.0})
    return ex, next(q for q in ex.questions
                    if (q.num_documents == 2 if form == "linked" else q.continued))


def _document(index: int, c: Country, rng: random.Random, filler: list[str] | None,
              filler_per_fact: tuple[int, int], alias: str | None = None,
              split: int = 0) -> tuple[str, list[str]]:
    """One document's text, and the attributes of its second paragraph. ``split`` > 0: its
    first ``split`` facts (the neighbor first, so that the last country named before the
    second paragraph is this one) in a paragraph under the header, the others in a second
    paragraph that says "it"."""
    attrs = list(c.facts)
    rng.shuffle(attrs)
    if split:
        attrs.sort(key=lambda a: a != "neighbor")  # stable: the others keep their order
    first = [f"Document {index}: {alias[0].upper() + alias[1:] if alias else c.name}."]
    second: list[str] = []
    for k, a in enumerate(attrs):
        in_second = bool(split) and k >= split
        subject = "it" if alias or in_second else c.name
        part = second if in_second else first
        part.append(f"The {a} of {subject} is {c.facts[a]}.")
        if filler:
            part.extend(rng.choice(filler) for _ in range(rng.randint(*filler_per_fact)))
    text = " ".join(first) + ("\n\n" + " ".join(second) if second else "")
    return text, attrs[split:] if split else []


def training_text(example: QAExample) -> str:
    """Documents, then every question with its answer, one per line."""
    qa = "\n".join(f"{q.text} {q.answer}" for q in example.questions)
    return example.context() + qa + "\n"


# ---- English text: Python's documentation topics ------------------------------------------
def pydoc_topics(split: str) -> list[str]:
    """The documentation topics of one split: "train" (~90%) or "heldout" (~10%, by topic
    name hash, so the split does not depend on the Python version's set of topics)."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    keep = []
    for name in sorted(topics):
        heldout = hashlib.sha256(name.encode()).digest()[0] < 26  # ~10%
        if heldout == (split == "heldout"):
            keep.append(topics[name])
    return keep


def filler_sentences(split: str) -> list[str]:
    """Prose sentences (no code) of 40-200 characters from one split of the topics."""
    out = []
    for text in pydoc_topics(split):
        for para in text.split("\n\n"):
            if para.startswith((" ", "\t")) or ">>>" in para:
                continue  # code and examples
            flat = " ".join(para.split())
            for s in re.split(r"(?<=[.!?])\s+", flat):
                if 40 <= len(s) <= 200 and s[0].isupper() and s.endswith("."):
                    out.append(s)
    return out
