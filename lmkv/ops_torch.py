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
    _transfer(kv_cache, slot_mapping, chunk, skip, to_paged=False)


def chunk_to_paged(
    chunk: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, skip: int = 0
) -> None:
    _transfer(kv_cache, slot_mapping, chunk, skip, to_paged=True)


def _transfer(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, chunk: torch.Tensor, skip: int,
              to_paged: bool) -> None:
    """Copy tokens [skip, T) between the chunk and paged memory, in either direction."""
    for rows, pages, lo in _spans(kv_cache, _slots(kv_cache, slot_mapping, 0), skip):
        if pages.dim() == 6:  # whole blocks: one strided copy per block, all layers at once
            bs = pages.shape[3]
            for i, block in enumerate(rows.tolist()):
                paged = pages[:, :, block]  # [L, 2, bs, Hkv, D]
                mine = chunk[:, :, lo + i * bs : lo + (i + 1) * bs].transpose(0, 1)
                (paged if to_paged else mine).copy_(mine if to_paged else paged)
            continue
        n = rows.shape[0]
        for layer in range(kv_cache.shape[0]):
            for kv in range(2):
                mine = chunk[kv, layer, lo : lo + n]
                if to_paged:
                    pages[layer, kv].index_copy_(0, rows, mine.to(kv_cache.dtype))
                elif mine.is_contiguous() and mine.dtype == pages.dtype:
                    torch.index_select(pages[layer, kv], 0, rows, out=mine)
                else:
                    mine.copy_(pages[layer, kv].index_select(0, rows))


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
        steps = torch.arange(bs, device=body.device)
        if not bool((first % bs).any()) and torch.equal(grid, first[:, None] + steps):
            yield first // bs, per_block, head
            return
    yield body, per_token, head




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
