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
    num_layers = kv_cache.shape[0]
    flat = kv_cache.flatten(2, 3)  # [L, 2, slots, Hkv, D]
    slots = slot_mapping[skip:]
    for layer in range(num_layers):
        for kv in range(2):
            torch.index_select(flat[layer, kv], 0, slots, out=chunk[kv, layer, skip:])


def chunk_to_paged(
    chunk: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, skip: int = 0
) -> None:
    """Scatter tokens [skip, T) of ``chunk`` into paged memory."""
    num_layers = kv_cache.shape[0]
    flat = kv_cache.flatten(2, 3)
    slots = slot_mapping[skip:]
    for layer in range(num_layers):
        for kv in range(2):
            flat[layer, kv].index_copy_(0, slots, chunk[kv, layer, skip:])
