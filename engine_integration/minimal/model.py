"""A Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) over paged KV memory.

Parameter names follow Hugging Face's LlamaForCausalLM so checkpoints load by name.
Tokens of all sequences in a step are flattened into one batch of T rows.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lmkv.ops import paged_attention_decode, paged_attention_prefill, reshape_and_cache

from .attention_metadata import AttentionMetadata
from .model_config import ModelConfig
from .rope import RotaryEmbedding


class LayerHooks(Protocol):
    """Called around each layer's attention: lets a KV connector load layer i's cached KV
    just before it is read and save it just after it is written."""

    def before_attention(self, layer: int) -> None: ...

    def after_attention(self, layer: int) -> None: ...


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T]
        rope: RotaryEmbedding,
        kv_layer: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        hooks: LayerHooks | None,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = rope.apply(q, k, positions)
        if hooks is not None:
            hooks.before_attention(self.layer)
        # the metadata was built from the engine's own block tables: no index checks (syncs)
        run = {"check": False, "launcher": meta.launcher}
        reshape_and_cache(k, v, kv_layer, meta.slot_mapping, **run)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = paged_attention_decode(
                q[:nd], kv_layer, meta.block_tables[:nd], meta.seq_lens[:nd], self.scale, **run
            )
        if nd < meta.seq_lens.shape[0]:  # host copies where there are: no device reads
            lens = meta.seq_lens if meta.host_seq_lens is None else meta.host_seq_lens
            starts = meta.query_start_loc if meta.host_query_start_loc is None else meta.host_query_start_loc
            out[nd:] = paged_attention_prefill(
                q[nd:], kv_layer, meta.block_tables[nd:], lens[nd:], starts[nd:] - starts[nd],
                self.scale, **run,
            )
        if hooks is not None:
            hooks.after_attention(self.layer)
        return self.o_proj(out.view(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [L, 2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        hooks: LayerHooks | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm: [T, hidden]."""
        m = self.model
        h = m.embed_tokens(input_ids)
        residual = h
        for i, layer in enumerate(m.layers):
            x = layer.input_layernorm(residual)
            x = layer.self_attn(x, positions, m.rope, kv_cache[i], meta, hooks)
            residual = residual + x
            x = layer.post_attention_layernorm(residual)
            residual = residual + layer.mlp(x)
        return m.norm(residual)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] fp32."""
        return self.lm_head(hidden).float()
