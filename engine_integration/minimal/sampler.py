"""Turn each request's last-position logits into its next token."""

from __future__ import annotations

import torch

from .sampling_params import SamplingParams


def sample(
    logits: torch.Tensor,  # [N, vocab] fp32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    out = logits.argmax(dim=-1).tolist()  # greedy for every row; overwritten below if sampling
    for i, p in enumerate(params):
        if p.greedy:
            continue
        # shifted so the largest logit is 0: a tiny temperature makes the others -inf, never
        # inf - inf (NaN) in the softmax; its limit, the greedy token, keeps probability 1
        row = (logits[i] - logits[i].max()) / p.temperature
        if 0 < p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = sorted_logits.softmax(-1)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = probs.cumsum(-1) - probs >= p.top_p
            drop[0] = False  # a top_p below float32's smallest value would drop every token
            row = row.scatter(0, order[drop], float("-inf"))
        probs = row.softmax(-1)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
