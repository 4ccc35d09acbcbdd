"""The synthetic QA task: answers sit in the documents a question names."""

from __future__ import annotations

import random
import re

import pytest

from benchmarks.quality import qa_data
from benchmarks.quality.qa import heldout_prompts


def _documents(text: str) -> dict[str, str]:
    """country -> its document, from a prompt's text."""
    docs = re.findall(r"Document \d+: (\w+)\.(.*?)(?=\n\nDocument|\n\nQ:|\n\n$)", text, re.S)
    return dict(docs)


def test_single_and_two_document_answers_come_from_the_right_documents():
    for p in heldout_prompts(30, 5, 1):
        country = re.search(r"Q: The (\w+) of (\w+) is$", p.text)
        attr, name = country.groups()
        assert f"The {attr} of {name} is {p.answer}." in _documents(p.text)[name]
    for p in heldout_prompts(30, 5, 2):
        attr, name = re.search(r"Q: The (\w+) of the neighbor of (\w+) is$", p.text).groups()
        docs = _documents(p.text)
        neighbor = re.search(rf"The neighbor of {name} is (\w+)\.", docs[name]).group(1)
        assert neighbor != name
        assert f"The {attr} of {neighbor} is {p.answer}." in docs[neighbor]
        assert p.num_documents == 2


def test_vocabularies_are_closed_distinct_and_seed_independent():
    v = qa_data.vocabulary()
    words = list(v.countries) + [w for ws in v.values.values() for w in ws]
    want = qa_data.NUM_COUNTRIES + len(qa_data.ATTRIBUTES) * qa_data.NUM_VALUES
    assert len(words) == len(set(words)) == want
    a = qa_data.make_example(random.Random(1), 4, 3)
    b = qa_data.make_example(random.Random(1), 4, 3)
    assert a == b
    assert heldout_prompts(3, 4, 1) == heldout_prompts(3, 4, 1)
    assert heldout_prompts(3, 4, 1) != heldout_prompts(3, 4, 1, seed=7)


def test_text_splits_are_disjoint():
    train, heldout = qa_data.pydoc_topics("train"), qa_data.pydoc_topics("heldout")
    assert heldout and len(train) > 5 * len(heldout)
    assert not set(train) & set(heldout)


def test_a_linked_document_is_named_only_by_the_document_before_it():
    """Its header names an earlier document's neighbor, its facts say "it", its own name is
    never a header (only neighbor facts, the earlier document's among them); held-out linked
    questions ask about it and are answered by its facts."""
    for p in heldout_prompts(20, 6, 2, linked=True):
        attr, name = re.search(r"Q: The (\w+) of (\w+) is$", p.text).groups()
        docs = p.text.split("\n\n")[:-1]
        headers = [re.match(r"Document \d+: ([^.]+)\.", d).group(1) for d in docs]
        assert name not in headers  # never introduced by its name
        sources = [i for i, d in enumerate(docs) if f"The neighbor of {headers[i]} is {name}." in d]
        assert len(sources) == 1
        src = sources[0]
        linked = headers.index(f"The neighbor of {headers[src]}")
        assert linked > src and name not in docs[linked]
        assert f"The {attr} of it is {p.answer}." in docs[linked]
        assert p.num_documents == 2
    plain = qa_data.make_example(random.Random(5), 6, 8)
    assert plain == qa_data.make_example(random.Random(5), 6, 8, linked=0.0)  # same draws
    assert not any("of it is" in d for d in plain.documents)


def test_a_continued_document_names_its_country_only_in_its_first_paragraph():
    """Every document is two paragraphs; the second says "it" and names no country; the
    question asks about a fact of a second paragraph; the last country named before a second
    paragraph is its own document's (the neighbor fact comes first)."""
    for p in heldout_prompts(20, 6, 1, (0, 1), continued=True):
        attr, name = re.search(r"Q: The (\w+) of (\w+) is$", p.text).groups()
        assert all(d.count("\n\n") == 1 for d in p.documents)
        doc = next(d for d in p.documents if re.match(rf"Document \d+: {name}\.", d))
        first, second = doc.split("\n\n")
        assert f"The {attr} of it is {p.answer}." in second
        assert f"The {attr} of" not in first
        countries = set(qa_data.vocabulary().countries)
        assert not countries & set(re.findall(r"\w+", second))
        named = [w for w in re.findall(r"\w+", first) if w in countries]
        assert named[-1] == name and len(named) >= 3  # header, neighbor fact, a named fact
    plain = qa_data.make_example(random.Random(5), 6, 8)
    assert plain == qa_data.make_example(random.Random(5), 6, 8, continued=0.0)  # same draws
    with pytest.raises(ValueError, match="form must be linked or continued"):
        qa_data.dependent_example(random.Random(5), 4, None, (0, 0), "chained")
