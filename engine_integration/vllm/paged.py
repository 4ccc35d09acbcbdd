"""vLLM's paged KV memory as lmkv's PagedMemory: one implementation per attention backend layout.

vLLM hands the connector one tensor per attention layer, a logical view
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` whose physical order depends on
the backend. Both layouts here are reduced to two strided views per layer,
``k`` and ``v``: ``[num_blocks, block_size, Hkv, D]`` each, without copying, and chunks
([2, L, T, Hkv, D]) move through those views: whole blocks at a time where the slots cover
aligned blocks, token by token (from the slot mapping) elsewhere.
"""

from __future__ import annotations

import torch

from lmkv.paged import PagedMemory


class StridedPagedMemory(PagedMemory):
    """Paged memory given as per-layer K and V views, each [num_blocks, block_size, Hkv, D]."""

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]):
        if not k or len(k) != len(v):
            raise ValueError(f"need one K and one V view per layer, got {len(k)} and {len(v)}")
        shape = tuple(k[0].shape)
        for t in (*k, *v):
            if tuple(t.shape) != shape or t.dtype != k[0].dtype:
                raise ValueError(f"all K/V views must be {shape} {k[0].dtype}, "
                                 f"got {tuple(t.shape)} {t.dtype}")
        self.k, self.v = k, v
        self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim = shape
        self.num_layers = len(k)
        self.dtype = k[0].dtype

    # A copy costs ~15 us of fixed overhead on CPU whatever its size, and a 128-token chunk
    # of one layer's K or V is only ~64 KB: loading chunk by chunk (2 copies per layer per
    # chunk) spends more time on overhead than on bytes. load_many joins up to this many
    # bytes of chunks into one token run first (a fast contiguous copy), then moves it with
    # two large strided copies per layer (measured, 31 chunks of 8 layers, fp32: 10.3 ms
    # chunk by chunk vs 5.7 ms joined).
    JOIN_BYTES = 64 << 20

    def load(self, chunk, slots, skip=0, layer=None):
        layers = self._layers(layer)
        self._copy_in(chunk[:, layers.start : layers.stop, skip:], slots[skip:], layers)

    def load_many(self, loads, layer=None):
        layers = self._layers(layer)
        group: list[tuple[torch.Tensor, torch.Tensor]] = []
        size = 0
        for chunk, slots, skip in loads:
            part, slots = chunk[:, layers.start : layers.stop, skip:], slots[skip:]
            if not self._block_aligned(slots):  # token by token anyway: alone
                self._copy_in(part, slots, layers)
                continue
            if group and size + part.nbytes > self.JOIN_BYTES:
                self._copy_in_joined(group, layers)
                group, size = [], 0
            group.append((part, slots))
            size += part.nbytes
        if group:
            self._copy_in_joined(group, layers)

    def _block_aligned(self, slots: torch.Tensor) -> bool:
        n = slots.shape[0]
        return n > 0 and n % self.block_size == 0 and int(slots[0]) % self.block_size == 0

    def _copy_in_joined(self, group: list[tuple[torch.Tensor, torch.Tensor]], layers: range) -> None:
        if len(group) == 1:
            self._copy_in(*group[0], layers)
        else:
            self._copy_in(torch.cat([p for p, _ in group], dim=2), torch.cat([s for _, s in group]), layers)

    def _copy_in(self, src: torch.Tensor, slots: torch.Tensor, layers: range) -> None:
        """``src`` [2, len(layers), T, Hkv, D] into ``slots`` [T] of ``layers``."""
        blocks, offsets = self._index(slots)
        for j, i in enumerate(layers):
            for kv, pages in ((0, self.k[i]), (1, self.v[i])):
                part = src[kv, j]  # [T, Hkv, D]
                if isinstance(blocks, slice):  # a run of consecutive whole blocks
                    pages[blocks].copy_(part.view(-1, *pages.shape[1:]))
                elif offsets is None:  # whole blocks
                    pages.index_copy_(0, blocks, part.view(-1, *pages.shape[1:]))
                else:
                    pages.index_put_((blocks, offsets), part)

    def save(self, slots, chunk, skip=0, layer=None):
        blocks, offsets = self._index(slots[skip:])
        for i in self._layers(layer):
            for kv, pages in ((0, self.k[i]), (1, self.v[i])):
                dst = chunk[kv, i, skip:]  # [T - skip, Hkv, D]
                if isinstance(blocks, slice):
                    dst.view(-1, *pages.shape[1:]).copy_(pages[blocks])
                elif offsets is None:
                    dst.view(-1, *pages.shape[1:]).copy_(pages.index_select(0, blocks))
                else:
                    dst.copy_(pages[blocks, offsets])

    def _layers(self, layer: int | None) -> range:
        return range(self.num_layers) if layer is None else range(layer, layer + 1)

    def _index(self, slots: torch.Tensor) -> tuple[torch.Tensor | slice, torch.Tensor | None]:
        """(a slice of blocks, None) when ``slots`` are consecutive whole blocks (one strided
        copy), (block ids [n], None) when they are whole aligned blocks in order, else
        (block id, offset in block) per token, [T] each."""
        bs = self.block_size
        n = slots.shape[0]
        if n and n % bs == 0:
            grid = slots.view(-1, bs)
            first = grid[:, 0]
            if not bool((first % bs).any()) and torch.equal(grid, first[:, None] + torch.arange(bs)):
                blocks = first // bs
                start = int(blocks[0])
                if torch.equal(blocks, torch.arange(start, start + blocks.shape[0])):
                    return slice(start, start + blocks.shape[0]), None
                return blocks, None
        return slots // bs, slots % bs


def cpu_paged_memory(layers: list[torch.Tensor]) -> StridedPagedMemory:
    """vLLM's CPU attention backend ("vec" kernels, x86 AVX2/AVX-512 and fp32/fp16): each
    layer is [num_blocks, Hkv, block_size, 2 * D] and each (block, head) page of
    ``block_size * 2 * D`` elements holds K transposed, [D, block_size], then V,
    [block_size, D]."""
    ks, vs = [], []
    for t in layers:
        nb, h, bs, d2 = t.shape
        d = d2 // 2
        if t.stride(3) != 1 or t.stride(2) != d2:
            raise ValueError(f"CPU KV layer pages must be contiguous, got strides {t.stride()}")
        s0, s1, off = t.stride(0), t.stride(1), t.storage_offset()
        ks.append(t.as_strided((nb, bs, h, d), (s0, 1, s1, bs), off))  # k[b, s, h, e] = page[e * bs + s]
        vs.append(t.as_strided((nb, bs, h, d), (s0, d, s1, 1), off + bs * d))  # page[bs*D + s*D + e]
    return StridedPagedMemory(ks, vs)


def gpu_paged_memory(layers: list[torch.Tensor]) -> StridedPagedMemory:
    """The GPU backends' (FlashAttention) layout: each layer is [num_blocks, block_size, Hkv,
    2 * D] with K = [..., :D] and V = [..., D:]. (vLLM registers the logical view
    [num_blocks, Hkv, block_size, 2 * D]; pass ``t.transpose(1, 2)`` of it.)"""
    d = layers[0].shape[-1] // 2
    return StridedPagedMemory([t[..., :d] for t in layers], [t[..., d:] for t in layers])
