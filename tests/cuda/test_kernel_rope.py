"""rope.cu under the CPU emulator vs the torch twin, and against HF's RoPE from scratch."""

from __future__ import annotations

import pytest
import torch
from emu_cases import rerotate

from lmkv import ops_torch
from lmkv_cuda import rope


@pytest.mark.parametrize(
    ("dtype", "tol"), [(torch.float32, 2e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)]
)
@pytest.mark.parametrize(  # [N, T, Hkv, D]; N * Hkv = 20 rows: three row groups, the last partial
    "shape", [(7, 8, 128), (3, 5, 2, 64), (5, 3, 4, 64), (2, 1, 1, 6)]  # last: scalar path
)
def test_matches_torch(emu, dtype, tol, shape):
    assert rerotate(emu, dtype, shape) < tol


def test_large_positions(emu):
    assert rerotate(emu, torch.float32, (4, 64, 2, 128), max_delta=200_000) < 1e-4


def _hf_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for x [T, H, D] at positions [T]."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("impl", ["kernel", "torch"])
def test_moves_keys_to_new_positions(emu, impl):
    gen = torch.Generator().manual_seed(1)
    raw = torch.randn(9, 2, 64, generator=gen, dtype=torch.float64).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    old = torch.arange(9) + 3
    new = torch.arange(9) * 2 + 100
    keys = _hf_rope(raw, old, inv_freq)
    if impl == "kernel":
        rope.rerotate_keys(emu, keys, new - old, inv_freq)
    else:
        ops_torch.rerotate_keys(keys, new - old, inv_freq)
    assert torch.allclose(keys, _hf_rope(raw, new, inv_freq), atol=1e-4)
