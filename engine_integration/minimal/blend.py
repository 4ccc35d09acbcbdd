"""CacheBlend's prefill in the bundled engine: reuse stored RAG chunks anywhere in a prompt.

Stored chunks were computed alone, at positions [0, len). Their keys are re-rotated to
where the chunk sits in this prompt. Layers before the check layer run for every token;
at the check layer the tokens whose fresh KV deviates most from the stored KV are
selected, and from then on only they (and every token without stored KV: prefix,
separators, query) are recomputed, attending to the stored KV of the rest.
ratio 1 is a full prefill; ratio 0 uses the stored KV as is (naive concatenation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmkv.blend.plan import BlendPlan, select_recompute
from lmkv.ops import rerotate_keys

from .attention import reshape_and_cache
from .model import LlamaForCausalLM


@torch.inference_mode()
def blend_prefill(model: LlamaForCausalLM, kv_cache: torch.Tensor, tokens: list[int],
                  slots: torch.Tensor, plan: BlendPlan) -> tuple[torch.Tensor, int]:
    """Fill the KV of all prompt tokens at ``slots`` ([n] int64). Returns the last token's
    logits [vocab] and how many tokens with stored KV were recomputed."""
    m = model.model
    n = len(tokens)
    positions = torch.arange(n)
    cached = torch.zeros(n, dtype=torch.bool)
    for seg in plan.segments:
        cached[seg.start : seg.start + seg.length] = True

    def stored_kv(layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored K (re-rotated to prompt positions) and V of layer ``layer``: [n, Hkv, D]."""
        k = torch.zeros(n, *like.shape[1:], dtype=like.dtype)
        v = torch.zeros_like(k)
        for seg in plan.segments:
            kv = seg.kv(layer)  # [2, length, Hkv, D] at positions [0, length)
            span = slice(seg.start, seg.start + seg.length)
            k[span], v[span] = kv[0], kv[1]
            delta = torch.full((seg.length,), seg.start, dtype=torch.int64)
            rerotate_keys(k[span], delta, m.rope.inv_freq)  # in place, to prompt positions
        return k, v

    ratio = plan.recompute_ratio
    active: torch.Tensor | None = None if ratio > 0 else ~cached  # None = every token
    recomputed = int(cached.sum()) if ratio > 0 else 0
    h = m.embed_tokens(torch.tensor(tokens))
    if active is not None:
        h = h[active]
    for i, layer in enumerate(m.layers):
        attn = layer.self_attn
        if active is None and i == plan.check_layer:
            x = layer.input_layernorm(h)
            k_new = m.rope.rotate(attn.k_proj(x).view(n, attn.num_kv_heads, attn.head_dim), positions)
            v_new = attn.v_proj(x).view(n, attn.num_kv_heads, attn.head_dim)
            k_old, v_old = stored_kv(i, k_new)
            deviation = (k_new - k_old).pow(2).sum((1, 2)) + (v_new - v_old).pow(2).sum((1, 2))
            chosen = select_recompute(deviation, cached, ratio)
            recomputed = int((chosen & cached).sum())
            if not bool(chosen.all()):
                active = chosen
                h = h[active]
        rows = positions if active is None else positions[active]
        x = layer.input_layernorm(h)
        t = x.shape[0]
        q = attn.q_proj(x).view(t, attn.num_heads, attn.head_dim)
        k = attn.k_proj(x).view(t, attn.num_kv_heads, attn.head_dim)
        v = attn.v_proj(x).view(t, attn.num_kv_heads, attn.head_dim)
        q, k = m.rope.apply(q, k, rows)
        if active is None:
            k_all, v_all = k, v
        else:
            k_all, v_all = stored_kv(i, k)
            k_all[rows], v_all[rows] = k, v
        reshape_and_cache(k_all, v_all, kv_cache[i], slots)
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, t, D]
        kh = k_all.transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
        vh = v_all.transpose(0, 1).unsqueeze(0)
        if active is None:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=attn.scale,
                                               enable_gqa=True)
        else:
            mask = positions[None, :] <= rows[:, None]  # [t, n]
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=attn.scale,
                                               enable_gqa=True)
        h = h + attn.o_proj(o[0].transpose(0, 1).reshape(t, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    last = m.norm(h[-1:])  # the last prompt token is always computed: it is never stored
    return model.compute_logits(last)[0], recomputed
