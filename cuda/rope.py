"""Wrapper of rope.cu: RoPE re-rotation of cached keys, in place (torch twin: lmkv.ops)."""

from __future__ import annotations

import numpy as np
import torch

from lmkv_cuda.launcher import CTYPE, FLOAT_DTYPES, Launcher, check_tensor, require

THREADS = 256
ROWS_PER_THREAD = 8  # kRowsPerThread: rows sharing one sin/cos evaluation


def rerotate_keys(
    launcher: Launcher, keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor
) -> torch.Tensor:
    """Rotate keys [..., T, Hkv, D] (contiguous; leading dims e.g. layers) in place by the angle
    delta[t] * inv_freq (delta [T] int64, inv_freq [D/2] fp32), HF rotate_half convention.
    Returns keys."""
    check_tensor(keys, "keys", launcher, dtypes=FLOAT_DTYPES)
    require(keys.dim() >= 3, f"keys must be [..., T, Hkv, D], got {tuple(keys.shape)}")
    check_tensor(delta, "delta", launcher, ndim=1, dtypes=(torch.int64,))
    check_tensor(inv_freq, "inv_freq", launcher, ndim=1, dtypes=(torch.float32,))
    tokens, heads, head_dim = keys.shape[-3:]
    require(head_dim % 2 == 0, f"head_dim {head_dim} must be even")
    require(delta.numel() == tokens, f"delta has {delta.numel()} entries, keys {tokens} tokens")
    require(inv_freq.numel() == head_dim // 2, f"inv_freq must have {head_dim // 2} entries")
    if keys.numel() == 0:
        return keys
    vec = 16 // keys.element_size()
    if (head_dim // 2) % vec or keys.data_ptr() % 16:
        vec = 1
    rows_per_token = keys.numel() // (tokens * heads * head_dim) * heads  # N * Hkv
    kernel = launcher.kernel("rope.cu", f"rerotate_keys<{CTYPE[keys.dtype]}, {vec}>")
    per_token = head_dim // 2 // vec
    require(rows_per_token <= 65535 * ROWS_PER_THREAD, f"too many rows per token: {rows_per_token}")
    grid = (-(-tokens * per_token // THREADS), -(-rows_per_token // ROWS_PER_THREAD))
    p = launcher.pointer
    kernel(
        grid, (THREADS,),
        (p(keys), p(delta), p(inv_freq), np.int32(rows_per_token), np.int32(tokens),
         np.int32(heads), np.int32(head_dim)),
    )  # fmt: skip
    return keys
