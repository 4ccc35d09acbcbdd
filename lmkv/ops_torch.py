"""Plain-torch twins of the CUDA kernels in cuda/: the CPU path of ``lmkv.ops`` and the
reference the kernel tests compare against. Same signatures as ``lmkv.ops``.

Layouts: engine ``kv_cache [L, 2, num_blocks, block_size, Hkv, D]``; vLLM per layer
``[num_blocks, block_size, Hkv, 2 * D]`` (K = [..., :D], V = [..., D:]); chunk
``[2, L, T, Hkv, D]``; ``slot_mapping [T]`` int64; tokens [0, skip) are not copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _slots(kv_cache_like: torch.Tensor, slot_mapping: torch.Tensor, skip: int) -> torch.Tensor:
    return slot_mapping[skip:].to(kv_cache_like.device)


def paged_to_chunk(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, chunk: torch.Tensor, skip: int = 0
) -> None:
    layers, _, nb, bs, heads, dim = kv_cache.shape
    flat = kv_cache.view(layers, 2, nb * bs, heads, dim)
    chunk[:, :, skip:] = flat[:, :, _slots(kv_cache, slot_mapping, skip)].transpose(0, 1)


def chunk_to_paged(
    chunk: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, skip: int = 0
) -> None:
    layers, _, nb, bs, heads, dim = kv_cache.shape
    flat = kv_cache.view(layers, 2, nb * bs, heads, dim)  # a view: writes land in kv_cache
    src = chunk[:, :, skip:].transpose(0, 1).to(kv_cache.dtype)  # [L, 2, n, Hkv, D]
    flat.index_copy_(2, _slots(kv_cache, slot_mapping, skip), src)


def paged_to_chunk_vllm(
    kv_caches: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    chunk: torch.Tensor,
    skip: int = 0,
) -> None:
    for layer, cache in enumerate(kv_caches):
        dim = cache.shape[-1] // 2
        rows = cache.view(-1, cache.shape[2], 2 * dim)[_slots(cache, slot_mapping, skip)]
        chunk[0, layer, skip:] = rows[..., :dim]
        chunk[1, layer, skip:] = rows[..., dim:]


def chunk_to_paged_vllm(
    chunk: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    skip: int = 0,
) -> None:
    for layer, cache in enumerate(kv_caches):
        dim = cache.shape[-1] // 2
        flat = cache.view(-1, cache.shape[2], 2 * dim)
        rows = torch.cat([chunk[0, layer, skip:], chunk[1, layer, skip:]], dim=-1)
        flat.index_copy_(0, _slots(cache, slot_mapping, skip), rows.to(cache.dtype))


def rerotate_keys(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """In place: keys [..., T, Hkv, D] rotated by angle delta[t] * inv_freq (HF rotate_half
    convention), computed in fp32 and rounded once to the keys' dtype. Returns keys."""
    half = keys.shape[-1] // 2
    angle = delta.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]  # [T, D/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]  # [T, 1, D/2]
    x = keys.float()
    x1, x2 = x[..., :half], x[..., half:]
    keys.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))
    return keys
