"""A trainable Llama (dense batches, no KV cache) whose parameter names are Hugging Face's,
so its state dict is a checkpoint the engine and transformers load as is."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmkv_engines.minimal.model import RMSNorm


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # x: [B, T, hidden]; cos, sin: [B, 1, T, D]
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int):
        super().__init__()
        self.self_attn = Attention(hidden, heads, kv_heads)
        self.mlp = MLP(hidden, intermediate)
        self.input_layernorm = RMSNorm(hidden, 1e-5)
        self.post_attention_layernorm = RMSNorm(hidden, 1e-5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, vocab: int, hidden: int, intermediate: int, layers: int, heads: int,
                 kv_heads: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            DecoderLayer(hidden, intermediate, heads, kv_heads) for _ in range(layers)
        )
        self.norm = RMSNorm(hidden, 1e-5)


class TrainLlama(nn.Module):
    """Tied input/output embeddings; RoPE at caller-given positions."""

    def __init__(self, vocab: int, hidden: int, intermediate: int, layers: int, heads: int,
                 kv_heads: int, rope_theta: float, init_std: float = 0.02):
        super().__init__()
        self.model = Backbone(vocab, hidden, intermediate, layers, heads, kv_heads)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight
        head_dim = hidden // heads
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = init_std / (2 * layers) ** 0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) \
                    else init_std
                nn.init.normal_(p, std=std)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """ids, positions: [B, T] -> logits [B, T, vocab]."""
        return self.lm_head(self.hidden_states(ids, positions))

    def hidden_states(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The final normed hidden states [B, T, hidden] (logits = lm_head of them: training
        takes it of the supervised positions only, the bulk of a small model's compute)."""
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, D]
        cos, sin = emb.cos(), emb.sin()
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)


def pose_positions(shape: torch.Size, max_positions: int, gen: torch.Generator) -> torch.Tensor:
    """[B, T] position ids with one random skip per sequence (PoSE): half the rows are
    0..T-1; the others jump by up to ``max_positions - T`` at a random point, so training
    on T-token sequences also covers relative distances and positions up to max_positions."""
    b, t = shape
    pos = torch.arange(t).expand(b, t).clone()
    skip = torch.randint(0, max_positions - t + 1, (b, 1), generator=gen)
    skip *= torch.rand(b, 1, generator=gen) < 0.5
    split = torch.randint(1, t, (b, 1), generator=gen)
    return pos + skip * (pos >= split)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
