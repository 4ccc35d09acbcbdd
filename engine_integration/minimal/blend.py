"""CacheBlend's prefill in the bundled engine: reuse stored RAG chunks anywhere in a prompt.

Stored chunks were computed alone, at positions [0, len), or stored before RoPE
(blend_store_pre_rope); their keys are rotated to where the chunk sits in this prompt.
Layers before the check layer run for every token; at the check layer the tokens whose
fresh KV deviates most from the stored KV are selected, and from then on only they (and
every token without stored KV: prefix, separators, query) are recomputed, attending to
the stored KV of the rest. Ratio 1 is a full prefill; ratio 0 uses the stored KV as is
(naive concatenation). On a device with lmkv's kernels the host reads device values twice
(choosing the tokens at the check layer), not per layer: the rows computed and their
attention groups are known on the host from then on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmkv.blend.plan import BlendPlan, select_recompute
from lmkv.ops import rerotate_keys, reshape_and_cache

from .model import LlamaForCausalLM
from .rope import RotaryEmbedding

ATTENTION_GROUPS = 4


@torch.inference_mode()
def blend_prefill(model: LlamaForCausalLM, kv_cache: torch.Tensor, tokens: list[int],
                  slots: torch.Tensor, plan: BlendPlan, launcher=None,
                  select=select_recompute) -> tuple[torch.Tensor, int]:
    """Fill the KV of all prompt tokens at ``slots`` ([n] int64). Returns the last token's
    logits [vocab] and how many tokens with stored KV were recomputed. Runs on the device of
    ``kv_cache``; ``launcher``: lmkv's kernels' launcher where the device does not say;
    ``select``: picks the tokens to recompute (select_recompute's signature)."""
    m = model.model
    n = len(tokens)
    dev = kv_cache.device
    positions = torch.arange(n, device=dev)
    slots = slots.to(dev)  # the engine's own slots: the cache writes skip their index check
    ratio = plan.recompute_ratio
    stored: torch.Tensor | None = None  # [2, L, n, Hkv, D], keys at prompt positions
    rows: torch.Tensor | None = None  # [t] ascending positions of the tokens computed; None: all
    groups: list[tuple[int, int, int]] = []  # the attention's query groups when rows is set
    recomputed = 0
    h = m.embed_tokens(torch.tensor(tokens, device=dev))  # [t, hidden], rows of the active tokens
    cached = plan.cached_mask(n)  # on the host: it comes from the plan
    if ratio == 0:
        stored = _stored_kv(m.rope, plan, n, kv_cache.dtype, dev, launcher)
        rows, groups = _rows((~cached).nonzero().squeeze(1), dev)
        h = h[rows]
    for i, layer in enumerate(m.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        t = x.shape[0]
        k = m.rope.rotate(attn.k_proj(x).view(t, attn.num_kv_heads, attn.head_dim),
                          positions if rows is None else rows)
        v = attn.v_proj(x).view(t, attn.num_kv_heads, attn.head_dim)
        if i == plan.check_layer and rows is None and ratio > 0:
            stored = _stored_kv(m.rope, plan, n, kv_cache.dtype, dev, launcher)
            # in float32: squares of fp16 keys summed over heads overflow to inf, and the
            # choice among such tokens would be arbitrary
            deviation = ((k.float() - stored[0, i].float()).pow(2).sum((1, 2))
                         + (v.float() - stored[1, i].float()).pow(2).sum((1, 2)))  # [n]
            chosen = select(deviation, cached.to(dev), ratio).cpu()  # the host's one read
            recomputed = int((chosen & cached).sum())
            if not bool(chosen.all()):
                rows, groups = _rows(chosen.nonzero().squeeze(1), dev)
                h, x, k, v = h[rows], x[rows], k[rows], v[rows]
                t = x.shape[0]
        q = m.rope.rotate(attn.q_proj(x).view(t, attn.num_heads, attn.head_dim),
                          positions if rows is None else rows)
        if rows is None:
            k_all, v_all = k, v
        else:  # rows without stored KV are always active: overwritten here
            assert stored is not None
            k_all, v_all = stored[0, i], stored[1, i]
            k_all[rows], v_all[rows] = k, v
        reshape_and_cache(k_all, v_all, kv_cache[i], slots, check=False, launcher=launcher)
        o = _attention(q, k_all, v_all, rows, groups, attn.scale)
        h = h + attn.o_proj(o.reshape(t, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    if rows is None:  # every token computed, the cached ones included
        recomputed = plan.num_cached_tokens
    last = m.norm(h[-1:])  # the last prompt token is always computed: it is never stored
    return model.compute_logits(last)[0], recomputed


@torch.inference_mode()
def continuation_logits(model: LlamaForCausalLM, tokens: list[int], prefix_kv: torch.Tensor
                        ) -> torch.Tensor:
    """Logits [n - P, vocab] (fp32) of every position of ``tokens[P:]``, computed over the
    given KV of ``tokens[:P]`` (``prefix_kv`` [2, L, P, Hkv, D], keys rotated to their
    positions, e.g. decoded from a lossy frame) and causally over each other: naive reuse
    of that KV, without paged memory (the codec's calibration weighs its layers by it)."""
    m = model.model
    dev = model.lm_head.weight.device
    n, start = len(tokens), prefix_kv.shape[2]
    if not 0 < start < n:
        raise ValueError(f"the prefix KV covers {start} of {n} tokens: it must leave some to compute")
    stored = torch.empty((*prefix_kv.shape[:2], n, *prefix_kv.shape[3:]), dtype=prefix_kv.dtype,
                         device=dev)
    stored[:, :, :start] = prefix_kv
    rows, groups = _rows(torch.arange(start, n), dev)
    h = m.embed_tokens(torch.tensor(tokens[start:], device=dev))
    for i, layer in enumerate(m.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        t = x.shape[0]
        stored[0, i, start:] = m.rope.rotate(attn.k_proj(x).view(t, attn.num_kv_heads, attn.head_dim), rows)
        stored[1, i, start:] = attn.v_proj(x).view(t, attn.num_kv_heads, attn.head_dim)
        q = m.rope.rotate(attn.q_proj(x).view(t, attn.num_heads, attn.head_dim), rows)
        o = _attention(q, stored[0, i], stored[1, i], rows, groups, attn.scale)
        h = h + attn.o_proj(o.reshape(t, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.compute_logits(m.norm(h))


def _rows(host_rows: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """The computed tokens' positions (host, ascending) on ``device``, and the attention's
    query groups (first row, end row, keys [0, end)): ATTENTION_GROUPS runs of rows, each
    over the keys up to its last row's position."""
    groups = []
    for part in torch.arange(len(host_rows)).tensor_split(ATTENTION_GROUPS):
        if len(part):
            lo, hi = int(part[0]), int(part[-1]) + 1
            groups.append((lo, hi, int(host_rows[hi - 1]) + 1))
    return host_rows.to(device), groups


def _stored_kv(rope: RotaryEmbedding, plan: BlendPlan, n: int, dtype: torch.dtype,
               device: torch.device, launcher) -> torch.Tensor:
    """The plan's stored KV [2, L, n, Hkv, D] on ``device``, keys rotated to their prompt
    positions."""
    kv = plan.stored_kv(n, dtype).to(device)
    if plan.pre_rope:
        kv[0] = rope.rotate(kv[0], torch.arange(n, device=device))
    else:  # stored at [0, length): move segment rows by their start
        delta = torch.zeros(n, dtype=torch.int64)
        for seg in plan.segments:
            delta[seg.start : seg.start + seg.length] = seg.start
        rerotate_keys(kv[0], delta.to(device), rope.inv_freq, launcher=launcher)  # all layers at once
    return kv


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None,
               groups: list[tuple[int, int, int]], scale: float) -> torch.Tensor:
    """Causal attention of queries q [t, Hq, D] at positions ``rows`` [t] (ascending; None:
    t == n, every position) over k, v [n, Hkv, D] of positions [0, n). Returns [t, Hq, D]."""
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, t, D]
    kh = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
    vh = v.transpose(0, 1).unsqueeze(0)
    if rows is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
    out = torch.empty_like(q)
    # scattered queries: in groups, each over the keys up to its last query's position
    # (about 5/8 of the masked work of one group; 1.4x faster attention on CPU)
    for lo, hi, end in groups:
        mask = torch.arange(end, device=q.device)[None, :] <= rows[lo:hi, None]  # [hi - lo, end]
        o = F.scaled_dot_product_attention(qh[:, :, lo:hi], kh[:, :, :end], vh[:, :, :end],
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        out[lo:hi] = o[0].transpose(0, 1)
    return out
