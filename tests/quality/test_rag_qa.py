"""The seeded RAG QA set: reproducible, within its stated sizes, one asked fact stated once in
its document, held-out names disjoint from dev names, and the grading rule."""

from __future__ import annotations

import pytest

from benchmarks.quality import rag_qa


@pytest.fixture(scope="module")
def count_tokens():
    from lmkv_engines.minimal.default_model import default_model_path
    from lmkv_engines.minimal.gguf_loader import GGUFCheckpoint

    try:
        tok = GGUFCheckpoint(default_model_path()).tokenizer()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return lambda text: len(tok.encode(text, add_special_tokens=False))


def test_examples_are_reproducible_and_sized(count_tokens):
    a = rag_qa.make_examples(12, "heldout", count_tokens, seed=3)
    assert a == rag_qa.make_examples(12, "heldout", count_tokens, seed=3)
    assert a != rag_qa.make_examples(12, "heldout", count_tokens, seed=4)
    for e in a:
        assert 4 <= len(e.documents) <= 8
        for i, doc in enumerate(e.documents):
            header, text = doc.split("\n", 1)
            assert header.startswith(f"Document {i + 1}: ")
            assert 300 <= count_tokens(text) <= 600


def test_the_asked_fact_is_stated_once_in_its_document_only(count_tokens):
    for e in rag_qa.make_examples(20, "dev", count_tokens):
        name = e.documents[e.answer_document].split("\n", 1)[0].split(": ")[1]
        assert e.question == rag_qa.FACTS[e.attribute][1].format(c=name)
        fact = rag_qa.FACTS[e.attribute][0].format(c=name, v=e.answer)
        found = [i for i, d in enumerate(e.documents) if fact in d]
        assert found == [e.answer_document]
        assert e.documents[e.answer_document].count(fact) == 1
        # every document states this kind of fact, about its own country (distractors)
        stem = rag_qa.FACTS[e.attribute][0].split("{v}")[0]
        for d in e.documents:
            own = d.split("\n", 1)[0].split(": ")[1]
            assert stem.format(c=own) in d


def test_splits_use_disjoint_names():
    dev, heldout = set(rag_qa.name_pool("dev")), set(rag_qa.name_pool("heldout"))
    assert len(dev) == len(heldout) == 3000 and not dev & heldout
    with pytest.raises(ValueError, match="split must be one of dev, heldout"):
        rag_qa.name_pool("test")


def test_grading_needs_every_word_of_the_answer():
    e = rag_qa.RagExample(("Document 1: X\n...",), "Who founded X?", "Vouva Tirkgram",
                          "founder", 0)
    assert e.is_correct("X was founded by vouva Tirkgram.")
    assert not e.is_correct("X was founded by Vouva.")
    assert not e.is_correct("Tirkgramx Vouvas")
    assert "Question: Who founded X?" in e.messages()[0]["content"]
