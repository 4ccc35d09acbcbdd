"""vLLM's paged KV memory as lmkv's PagedMemory: one implementation per attention backend layout.

vLLM hands the connector one tensor per attention layer, a logical view
``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` whose physical order depends on
the backend. Both layouts here are reduced to two strided views per layer,
``k`` and ``v``: ``[num_blocks, block_size, Hkv, D]`` each, without copying, and chunks
([2, L, T, Hkv, D]) move through those views: whole blocks at a time where the slots cover
aligned blocks, token by token (from the slot mapping) elsewhere; all layers in one copy
where the layers' views sit at one stride in one buffer.
"""

from __future__ import annotations

import torch

from lmkv import ops
from lmkv.paged import PagedMemory, checked_on_host, copy_to_host, on_device, staging_for


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
        self.device = k[0].device
        # A copy costs ~15 us of fixed overhead on CPU, and one layer's K of a 128-token
        # chunk is only ~64 KB: where the layers sit at one stride in one buffer (vLLM
        # allocates them so), a chunk moves with one copy for K and one for V across all
        # layers, [L, blocks, block_size, Hkv, D], instead of two per layer (31 chunks of 8
        # layers, fp32, one thread: 8.7 ms per layer vs 5.8 ms across layers).
        self.k_all, self.v_all = _all_layers(k), _all_layers(v)

    def load(self, chunk, slots, skip=0, layer=None):
        blocks, offsets = self._index(slots[skip:])
        if layer is None and self.k_all is not None:
            pairs = [(chunk[0, :, skip:], self.k_all), (chunk[1, :, skip:], self.v_all)]
            for src, pages in pairs:  # [L, T - skip, Hkv, D] into [L, blocks, block_size, Hkv, D]
                _copy_in(pages, 1, src, blocks, offsets)
            return
        for i in self._layers(layer):
            for kv, pages in ((0, self.k[i]), (1, self.v[i])):
                _copy_in(pages, 0, chunk[kv, i, skip:], blocks, offsets)

    def save(self, slots, chunk, skip=0, layer=None):
        blocks, offsets = self._index(slots[skip:])
        if layer is None and self.k_all is not None:
            for dst, pages in ((chunk[0, :, skip:], self.k_all), (chunk[1, :, skip:], self.v_all)):
                _copy_out(pages, 1, dst, blocks, offsets)
            return
        for i in self._layers(layer):
            for kv, pages in ((0, self.k[i]), (1, self.v[i])):
                _copy_out(pages, 0, chunk[kv, i, skip:], blocks, offsets)

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


def _copy_in(pages: torch.Tensor, dim: int, src: torch.Tensor, blocks: torch.Tensor | slice,
             offsets: torch.Tensor | None) -> None:
    """Tokens ``src`` [..., T, Hkv, D] into ``pages`` [..., blocks, block_size, Hkv, D], whose
    block dimension is ``dim``, at (blocks, offsets) as ``_index`` gives them."""
    lead = (slice(None),) * dim
    if isinstance(blocks, slice):  # a run of consecutive whole blocks: one strided copy
        pages[(*lead, blocks)].copy_(src.reshape(*src.shape[:dim], -1, *pages.shape[dim + 1 :]))
    elif offsets is None:  # whole blocks
        pages.index_copy_(dim, blocks, src.reshape(*src.shape[:dim], -1, *pages.shape[dim + 1 :]))
    else:
        pages[(*lead, blocks, offsets)] = src


def _copy_out(pages: torch.Tensor, dim: int, dst: torch.Tensor, blocks: torch.Tensor | slice,
              offsets: torch.Tensor | None) -> None:
    """The inverse of ``_copy_in``: tokens at (blocks, offsets) of ``pages`` into ``dst``."""
    lead = (slice(None),) * dim
    if isinstance(blocks, slice):
        dst.view(*dst.shape[:dim], -1, *pages.shape[dim + 1 :]).copy_(pages[(*lead, blocks)])
    elif offsets is None:
        dst.view(*dst.shape[:dim], -1, *pages.shape[dim + 1 :]).copy_(pages.index_select(dim, blocks))
    else:
        dst.copy_(pages[(*lead, blocks, offsets)])


def _all_layers(views: list[torch.Tensor]) -> torch.Tensor | None:
    """One view [L, *view.shape] over per-layer views that share a storage at one stride
    (each layer's start a fixed number of elements after the previous one's), else None."""
    first = views[0]
    if len(views) < 2:
        return first[None]
    step = views[1].storage_offset() - first.storage_offset()
    ptr = first.untyped_storage().data_ptr()
    for i, t in enumerate(views):
        if (t.untyped_storage().data_ptr() != ptr or t.stride() != first.stride()
                or t.storage_offset() != first.storage_offset() + i * step):
            return None
    extent = 1 + sum((n - 1) * st for n, st in zip(first.shape, first.stride(), strict=True))
    if step < extent:  # the layers would overlap: not vLLM's allocation
        return None
    return first.as_strided((len(views), *first.shape), (step, *first.stride()), first.storage_offset())


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


class DevicePagedMemory(PagedMemory):
    """The GPU backends' (FlashAttention) layout: each layer [num_blocks, block_size, Hkv,
    2 * D], K = [..., :D] and V = [..., D:], on the GPU. Chunks (lmkv's host memory) and
    slot mappings are staged on the pages' device and moved by lmkv's transfer kernels
    there (``lmkv.ops.*_vllm``): no host index ever meets a device page."""

    def __init__(self, layers: list[torch.Tensor], launcher=None):
        shape = tuple(layers[0].shape)
        if any(tuple(t.shape) != shape or t.dtype != layers[0].dtype for t in layers):
            raise ValueError(f"all KV layers must be {shape} {layers[0].dtype}")
        self.layers = layers
        self.num_blocks, self.block_size, self.num_kv_heads, d2 = shape
        self.head_dim = d2 // 2
        self.num_layers = len(layers)
        self.dtype = layers[0].dtype
        self.device = layers[0].device
        self.launcher = launcher  # the kernels' launcher where the device does not say (tests)
        self._prepared: tuple[object, object] | None = None  # (launcher, ops.vllm_layers)

    def load(self, chunk, slots, skip=0, layer=None):
        src = chunk if layer is None else chunk[:, layer : layer + 1]
        check = not checked_on_host(slots, skip, self.num_blocks * self.block_size)
        ops.chunk_to_paged_vllm(on_device(src, self.device), self._kv(), on_device(slots, self.device),
                                skip, check=check, layer=layer, launcher=self.launcher)

    def save(self, slots, chunk, skip=0, layer=None):
        dst = chunk if layer is None else chunk[:, layer : layer + 1]
        stage = staging_for(dst, self.device)
        check = not checked_on_host(slots, skip, self.num_blocks * self.block_size)
        ops.paged_to_chunk_vllm(self._kv(), on_device(slots, self.device), stage, skip, check=check,
                                layer=layer, launcher=self.launcher)
        if stage is not dst:
            copy_to_host(dst[:, :, skip:], stage[:, :, skip:])

    def prepare(self) -> None:
        """Check the layers and build their address table now, which compiles lmkv's kernels
        on a first use (NVRTC: about half a minute without CuPy's cached cubins): at vLLM's
        start, not in the first request's step."""
        self._kv()

    def _kv(self):
        """The layers as the copies take them, checked once per launcher (lmkv.ops.vllm_layers)."""
        if self._prepared is None or self._prepared[0] is not self.launcher:
            self._prepared = (self.launcher, ops.vllm_layers(self.layers, launcher=self.launcher))
        return self._prepared[1]


def gpu_paged_memory(layers: list[torch.Tensor], launcher=None) -> DevicePagedMemory:
    """vLLM registers the logical view [num_blocks, Hkv, block_size, 2 * D] of the GPU
    backends' layout; pass ``t.transpose(1, 2)`` of it. Prepared (kernels compiled) here."""
    paged = DevicePagedMemory(layers, launcher)
    paged.prepare()
    return paged
