"""An engine's paged KV memory as lmkv sees it: chunks go in and out by slot mapping.

Each engine layout is one implementation. A chunk is [2, L, T, Hkv, D] (possibly a view of
a stored chunk's first T tokens, not contiguous); ``slots`` [T] int64 are the paged-memory
slots of its tokens; tokens [0, skip) are left alone; ``layer`` restricts the copy to one
layer (layer-wise mode), None = all layers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from . import ops


class PagedMemory(ABC):
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @abstractmethod
    def load(self, chunk: torch.Tensor, slots: torch.Tensor, skip: int = 0,
             layer: int | None = None) -> None:
        """Write tokens [skip, T) of ``chunk`` into paged memory."""

    @abstractmethod
    def save(self, slots: torch.Tensor, chunk: torch.Tensor, skip: int = 0,
             layer: int | None = None) -> None:
        """Read tokens [skip, T) from paged memory into ``chunk``."""


class BlockPagedMemory(PagedMemory):
    """The bundled engine's layout: one tensor [L, 2, num_blocks, block_size, Hkv, D]."""

    def __init__(self, kv_cache: torch.Tensor):
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(f"expected [L, 2, blocks, block_size, Hkv, D], got {tuple(kv_cache.shape)}")
        self.kv_cache = kv_cache
        self.num_layers, _, _, self.block_size, self.num_kv_heads, self.head_dim = kv_cache.shape
        self.dtype = kv_cache.dtype

    def load(self, chunk, slots, skip=0, layer=None):
        if layer is None:
            ops.chunk_to_paged(chunk, self.kv_cache, slots, skip)
        else:
            ops.chunk_to_paged(chunk[:, layer : layer + 1], self.kv_cache[layer : layer + 1], slots, skip)

    def save(self, slots, chunk, skip=0, layer=None):
        if layer is None:
            ops.paged_to_chunk(self.kv_cache, slots, chunk, skip)
        else:
            ops.paged_to_chunk(self.kv_cache[layer : layer + 1], slots, chunk[:, layer : layer + 1], skip)
