"""The quality metrics on small fixed examples whose answers are known."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.quality import metrics
from benchmarks.quality.metrics import Agreement, QAScore


def test_agreement_counts_positions_and_finds_the_first_divergence():
    assert metrics.agreement([1, 2, 3, 4], [1, 2, 3, 4]) == Agreement(1.0, None, 4)
    assert metrics.agreement([1, 2, 3, 4], [1, 2, 9, 4]) == Agreement(0.75, 2, 4)
    assert metrics.agreement([5, 2, 3, 4], [1, 2, 3, 4]) == Agreement(0.75, 0, 4)
    # a missing token is a disagreement, and where the shorter run ends is the divergence
    assert metrics.agreement([1, 2], [1, 2, 3, 4]) == Agreement(0.5, 2, 4)
    assert metrics.agreement([], []) == Agreement(1.0, None, 0)


def test_kl_divergence_of_identical_logits_is_zero_and_of_known_distributions_exact():
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0))
    assert metrics.kl_divergence(logits, logits.clone()) == 0.0
    assert metrics.kl_divergence(logits, logits + 3.0) == pytest.approx(0.0, abs=1e-12)  # shift-invariant
    p = torch.tensor([0.5, 0.5]).log()
    q = torch.tensor([0.25, 0.75]).log()
    want = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert metrics.kl_divergence(p, q) == pytest.approx(want, rel=1e-6)
    # rows are averaged: one row with KL 0, one with `want`
    two_rows = metrics.kl_divergence(torch.stack([p, p]), torch.stack([p, q]))
    assert two_rows == pytest.approx(want / 2, rel=1e-6)
    with pytest.raises(ValueError, match="shapes differ"):
        metrics.kl_divergence(torch.zeros(2, 3), torch.zeros(2, 4))


def test_layer_relative_error_per_layer():
    a = [torch.ones(2, 5, 1, 4), torch.full((2, 5, 1, 4), -2.0), torch.zeros(2, 5, 1, 4)]
    b = [a[0] * 1.1, a[1].clone(), a[2].clone()]
    assert metrics.layer_relative_error(a, b) == pytest.approx([0.1, 0.0, 0.0])
    b[2][0, 0, 0, 0] = 1.0  # the reference is all zeros, the other is not
    assert metrics.layer_relative_error(a, b)[2] == math.inf
    x = torch.tensor([3.0, 4.0])  # ||x|| = 5; error vector (0, -1) -> 1/5
    assert metrics.layer_relative_error([x], [torch.tensor([3.0, 3.0])]) == pytest.approx([0.2])
    with pytest.raises(ValueError, match="layers"):
        metrics.layer_relative_error(a, b[:2])


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
    vocab = 4096
    targets = torch.randint(0, vocab, (100,), generator=torch.Generator().manual_seed(1))
    assert metrics.perplexity(torch.zeros(100, vocab), targets) == pytest.approx(vocab, rel=1e-9)
    sure = torch.full((100, vocab), -1e4)
    sure[torch.arange(100), targets] = 0.0
    assert metrics.perplexity(sure, targets) == pytest.approx(1.0)
    # half the mass on the target everywhere: NLL ln 2, perplexity 2
    two = torch.full((3, 2), 0.0)
    assert metrics.perplexity(two, torch.tensor([0, 1, 1])) == pytest.approx(2.0)
    assert metrics.token_nll(two, torch.tensor([0, 1, 1])).tolist() == pytest.approx([math.log(2)] * 3)


def test_qa_scoring_takes_the_first_generated_word():
    assert metrics.answer_matches(" Melk\nQ: What", "Melk")
    assert metrics.answer_matches(" melk.", "Melk")
    assert not metrics.answer_matches(" Melkor", "Melk")
    assert not metrics.answer_matches(" The Melk", "Melk")
    assert not metrics.answer_matches("", "Melk")
    score = metrics.qa_accuracy([" Melk", " Tal\n", " Dun"], ["Melk", "Tal", "Zor"])
    assert score == QAScore(2 / 3, 2, 3)
    with pytest.raises(ValueError):
        metrics.qa_accuracy([" Melk"], ["Melk", "Tal"])
