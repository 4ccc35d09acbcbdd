"""Metric functions: two runs' tokens, logits or KV in, one number (or one per layer) out."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F


class Agreement(NamedTuple):
    fraction: float  # positions with the same token / positions compared
    first_divergence: int | None  # first position whose tokens differ; None if identical
    compared: int  # max(len(a), len(b)): a missing token counts as a disagreement


class QAScore(NamedTuple):
    accuracy: float
    correct: int
    total: int


def agreement(tokens_a: Sequence[int], tokens_b: Sequence[int]) -> Agreement:
    """Position-wise agreement of two token sequences (e.g. greedy outputs of two runs)."""
    n = max(len(tokens_a), len(tokens_b))
    if n == 0:
        return Agreement(1.0, None, 0)
    same = [a == b for a, b in zip(tokens_a, tokens_b, strict=False)]
    first = next((i for i, s in enumerate(same) if not s), None)
    if first is None and len(tokens_a) != len(tokens_b):
        first = len(same)
    return Agreement(sum(same) / n, first, n)


def kl_divergence(logits_a: torch.Tensor, logits_b: torch.Tensor) -> float:
    """Mean over rows of KL(softmax(a) || softmax(b)) in nats; logits: [N, V] (or [V])."""
    if logits_a.shape != logits_b.shape:
        raise ValueError(f"logit shapes differ: {tuple(logits_a.shape)} vs {tuple(logits_b.shape)}")
    log_p = F.log_softmax(logits_a.double(), dim=-1)
    log_q = F.log_softmax(logits_b.double(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return kl.mean().item()


def layer_relative_error(kv_a: Sequence[torch.Tensor], kv_b: Sequence[torch.Tensor]) -> list[float]:
    """Per layer, ||b - a|| / ||a|| (Frobenius norms over all of the layer's K and V values),
    with run a the reference. A layer whose reference is all zeros: 0 if equal, else inf."""
    if len(kv_a) != len(kv_b):
        raise ValueError(f"{len(kv_a)} layers vs {len(kv_b)}")
    out = []
    for i, (a, b) in enumerate(zip(kv_a, kv_b, strict=True)):
        if a.shape != b.shape:
            raise ValueError(f"layer {i}: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}")
        a, b = a.double(), b.double()
        ref = a.norm().item()
        diff = (b - a).norm().item()
        out.append(diff / ref if ref else (0.0 if diff == 0 else math.inf))
    return out


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[N] negative log-likelihoods (nats) of targets [N] under logits [N, V]."""
    return F.cross_entropy(logits.double(), targets, reduction="none")


def perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """exp(mean NLL) of targets [N] under logits [N, V], where logits[i] predicts targets[i]."""
    return math.exp(token_nll(logits, targets).mean().item())


def answer_matches(generated: str, answer: str) -> bool:
    """The first word of the generated text equals the answer (case and punctuation aside)."""
    words = re.findall(r"[\w'-]+", generated)
    return bool(words) and words[0].lower() == answer.lower()


def qa_accuracy(generated: Sequence[str], answers: Sequence[str]) -> QAScore:
    if len(generated) != len(answers):
        raise ValueError(f"{len(generated)} outputs for {len(answers)} answers")
    correct = sum(answer_matches(g, a) for g, a in zip(generated, answers, strict=True))
    return QAScore(correct / len(answers) if answers else 0.0, correct, len(answers))
