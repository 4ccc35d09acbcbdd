"""Turn each request's last-position logits into its next token."""

from __future__ import annotations

import torch

from .sampling_params import SamplingParams


def sample(
    logits: torch.Tensor,  # [N, vocab] fp32, on the model's device
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """Greedy rows take their argmax where the logits are (only the token ids reach the
    host); the rows that sample come to the host, where each request's generator lives."""
    rest = [i for i, p in enumerate(params) if not p.greedy]
    if len(rest) == len(params):  # every row samples: nothing to take the argmax of
        out, host = [0] * len(params), logits.cpu()
    else:  # greedy for every row; the sampling rows are overwritten below
        out = logits.argmax(dim=-1).tolist()
        host = logits[rest].cpu() if rest else None
    for j, i in enumerate(rest):
        p = params[i]
        logits_i = host[j]
        # shifted so the largest logit is 0: a tiny temperature makes the others -inf, never
        # inf - inf (NaN) in the softmax; its limit, the greedy token, keeps probability 1
        row = (logits_i - logits_i.max()) / p.temperature
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
