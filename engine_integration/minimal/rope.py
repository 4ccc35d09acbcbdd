"""Rotary position embeddings (HF Llama's rotate_half convention), with Llama-3 scaling."""

from __future__ import annotations

import math

import torch

from .model_config import RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables; ``apply`` rotates q and k at given positions."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None):
        self.inv_freq = inv_frequencies(head_dim, theta, scaling)
        self.max_positions = max_positions
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.cos = emb.cos()
        self.sin = emb.sin()

    def to(self, device: torch.device) -> RotaryEmbedding:
        self.inv_freq, self.cos, self.sin = (t.to(device) for t in (self.inv_freq, self.cos, self.sin))
        return self

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hkv, D], positions: [T]."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        q_out = q.float() * cos + rotate_half(q.float()) * sin
        k_out = k.float() * cos + rotate_half(k.float()) * sin
        return q_out.to(q.dtype), k_out.to(k.dtype)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x: [..., T, H, D] rotated to ``positions`` [T] (``inverse``: rotated back from
        them to position 0, recovering the keys before RoPE)."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        if inverse:
            sin = -sin
        return (x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
