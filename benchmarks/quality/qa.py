"""Held-out multi-document QA prompts: one question each, from a generator seeded apart from
training's (training draws from seeds 0-3 of qa_data; these start at 1000)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from . import qa_data

HELDOUT_SEED = 1000
# ~500 tokens per document: 7 facts, each followed by 3 filler sentences (~21 tokens each)
LONG_FILLER = (3, 3)


@dataclass(frozen=True, slots=True)
class QAPrompt:
    documents: tuple[str, ...]  # "Document i: ..." paragraphs, in prompt order
    question: str  # "Q: The capital of Zorvia is"
    answer: str
    num_documents: int  # how many documents the answer needs (1 or 2)

    @property
    def text(self) -> str:
        """The prompt as in training: documents, then the question."""
        return qa_data.QAExample(list(self.documents), []).context() + self.question


def heldout_prompts(n: int, num_documents: int, answer_documents: int,
                    filler_per_fact: tuple[int, int] = (0, 0), seed: int = HELDOUT_SEED,
                    linked: bool = False, continued: bool = False) -> list[QAPrompt]:
    """``n`` prompts of ``num_documents`` documents whose question needs ``answer_documents``
    (1 or 2) of them. Filler is the training split's prose (the facts are what is held out).
    ``linked``: the question asks about a document introduced only as an earlier document's
    neighbor (qa_data.make_example's ``linked``), in the documents' generated order.
    ``continued``: every document is two paragraphs (qa_data's ``continued``), and the
    question asks about a fact in a second paragraph, which says "it": the answer needs that
    document's first paragraph too."""
    if answer_documents not in (1, 2):
        raise ValueError("answer_documents must be 1 or 2")
    if continued:
        if answer_documents != 1 or linked:
            raise ValueError("a continued question is about one document, not linked ones")
        return _dependent_prompts(n, num_documents, filler_per_fact, seed, "continued")
    if linked:
        if answer_documents != 2 or num_documents < 2:
            raise ValueError("a linked question needs two documents of at least two")
        return _dependent_prompts(n, num_documents, filler_per_fact, seed, "linked")
    rng = random.Random(seed * 10 + answer_documents)
    filler = qa_data.filler_sentences("train") if filler_per_fact[1] else None
    out = []
    for _ in range(n):
        ex = qa_data.make_example(rng, num_documents, 1, filler, filler_per_fact,
                                  two_doc_fraction=1.0 if answer_documents == 2 else 0.0)
        q = ex.questions[0]
        out.append(QAPrompt(tuple(ex.documents), q.text, q.answer, q.num_documents))
    return out


def qa_text(n: int, num_documents: int = 6, filler_per_fact: tuple[int, int] = LONG_FILLER,
            seed: int = 4000) -> str:
    """``n`` long QA examples (documents, then their questions and answers) as one text, for
    tools that cut prompts out of text (codec calibration and measurement). Filler is the
    held-out split's prose, the facts come from their own seed."""
    rng = random.Random(seed)
    filler = qa_data.filler_sentences("heldout")
    return "\n".join(qa_data.training_text(qa_data.make_example(rng, num_documents, num_documents,
                                                                filler, filler_per_fact))
                     for _ in range(n))


def _dependent_prompts(n: int, num_documents: int, filler_per_fact: tuple[int, int], seed: int,
                       form: str) -> list[QAPrompt]:
    """Prompts whose question is about a document (or paragraph) that needs the one before:
    ``form`` "linked" (a document introduced as a neighbor) or "continued" (a second
    paragraph), every document in that form."""
    rng = random.Random(seed * 10 + {"linked": 5, "continued": 6}[form])
    filler = qa_data.filler_sentences("train") if filler_per_fact[1] else None
    out = []
    for _ in range(n):
        ex, q = qa_data.dependent_example(rng, num_documents, filler, filler_per_fact, form)
        out.append(QAPrompt(tuple(ex.documents), q.text, q.answer, q.num_documents))
    return out
