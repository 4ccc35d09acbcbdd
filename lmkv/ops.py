"""Kernel entry points for moving KV between an engine's paged memory and chunk buffers.

Paged memory (the bundled engine): kv_cache [L, 2, num_blocks, block_size, Hkv, D].
Chunk buffer: [2, L, T, Hkv, D]. slot_mapping: [T] int64 slots of the chunk's tokens.
Tokens [0, skip) of the chunk are left alone (the engine already has them).
These are the torch implementations (the CPU path and the kernels' reference).
"""

from __future__ import annotations

import torch


def paged_to_chunk(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, chunk: torch.Tensor, skip: int = 0
) -> None:
    """Gather tokens [skip, T) of a chunk from paged memory into ``chunk``."""
    for rows, pages, lo in _spans(kv_cache, slot_mapping, skip):
        for layer in range(kv_cache.shape[0]):
            for kv in range(2):
                out = chunk[kv, layer, lo : lo + rows.shape[0] * _per_row(pages)]
                torch.index_select(pages[layer, kv], 0, rows, out=out.view(-1, *pages.shape[3:]))


def chunk_to_paged(
    chunk: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, skip: int = 0
) -> None:
    """Scatter tokens [skip, T) of ``chunk`` into paged memory."""
    for rows, pages, lo in _spans(kv_cache, slot_mapping, skip):
        for layer in range(kv_cache.shape[0]):
            for kv in range(2):
                src = chunk[kv, layer, lo : lo + rows.shape[0] * _per_row(pages)]
                pages[layer, kv].index_copy_(0, rows, src.view(-1, *pages.shape[3:]))


def _spans(kv_cache: torch.Tensor, slots: torch.Tensor, skip: int):
    """Split tokens [skip, T) into copies of whole blocks where the slots allow (one row per
    block: far fewer, larger copies) and single tokens elsewhere. Yields (row indices,
    paged memory viewed as rows [L, 2, rows, ...], first chunk token)."""
    bs = kv_cache.shape[3]
    per_block = kv_cache  # rows = blocks: [L, 2, num_blocks, bs, Hkv, D]
    per_token = kv_cache.flatten(2, 3)  # rows = slots: [L, 2, num_blocks * bs, Hkv, D]
    t = slots.shape[0]
    head = min(t, -(-skip // bs) * bs)  # [skip, head): up to the first block boundary
    if head > skip:
        yield slots[skip:head], per_token, skip
    body = slots[head:]
    if body.numel() == 0:
        return
    if body.numel() % bs == 0:
        grid = body.view(-1, bs)
        first = grid[:, 0]
        if not bool((first % bs).any()) and torch.equal(grid, first[:, None] + torch.arange(bs)):
            yield first // bs, per_block, head
            return
    yield body, per_token, head


def _per_row(pages: torch.Tensor) -> int:
    """Tokens per row of ``pages``: block_size for the block view, 1 for the slot view."""
    return pages.shape[3] if pages.dim() == 6 else 1


def rerotate_keys(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys [T, Hkv, D] computed with RoPE at position p, returned as if computed at p + delta.
    delta: [T] int64; inv_freq: [D / 2] fp32 (HF Llama's rotate_half convention)."""
    angles = delta.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :]  # [T, 1, D]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :]
    k = keys.float()
    half = k.shape[-1] // 2
    rotated = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
    return (k * cos + rotated * sin).to(keys.dtype)
