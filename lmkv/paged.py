"""An engine's paged KV memory as lmkv sees it: chunks go in and out by slot mapping.

Each engine layout is one implementation. A chunk is [2, L, T, Hkv, D] (possibly a view of
a stored chunk's first T tokens, not contiguous); ``slots`` [T] int64 are the paged-memory
slots of its tokens; tokens [0, skip) are left alone; ``layer`` restricts the copy to one
layer (layer-wise mode), None = all layers.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from . import ops

if TYPE_CHECKING:
    from lmkv_cuda.launcher import Launcher


class PagedMemory(ABC):
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")  # where the pages are

    @abstractmethod
    def load(self, chunk: torch.Tensor, slots: torch.Tensor, skip: int = 0,
             layer: int | None = None) -> None:
        """Write tokens [skip, T) of ``chunk`` into paged memory."""

    @abstractmethod
    def save(self, slots: torch.Tensor, chunk: torch.Tensor, skip: int = 0,
             layer: int | None = None) -> None:
        """Read tokens [skip, T) from paged memory into ``chunk``. From a device into pinned
        host memory this may finish later, on the current stream: synchronize it before
        reading ``chunk`` (lmkv's worker synchronizes its save stream before storing)."""


class BlockPagedMemory(PagedMemory):
    """The bundled engine's layout: one tensor [L, 2, num_blocks, block_size, Hkv, D], on any
    device. A chunk on another device (lmkv's host memory, pages on a GPU) is staged on the
    pages' device, slots included, and moved by the transfer kernel there. ``launcher``:
    the kernels' launcher when it cannot be told from the device (the CPU emulator)."""

    def __init__(self, kv_cache: torch.Tensor, launcher: Launcher | None = None):
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(f"expected [L, 2, blocks, block_size, Hkv, D], got {tuple(kv_cache.shape)}")
        self.kv_cache = kv_cache
        self.num_layers, _, _, self.block_size, self.num_kv_heads, self.head_dim = kv_cache.shape
        self.dtype = kv_cache.dtype
        self.device = kv_cache.device
        self.launcher = launcher

    @property
    def num_slots(self) -> int:
        return self.kv_cache.shape[2] * self.block_size

    def load(self, chunk, slots, skip=0, layer=None):
        pages = self.kv_cache if layer is None else self.kv_cache[layer : layer + 1]
        src = chunk if layer is None else chunk[:, layer : layer + 1]
        dev = pages.device
        check = not checked_on_host(slots, skip, self.num_slots)
        ops.chunk_to_paged(on_device(src, dev), pages, on_device(slots, dev), skip, check=check,
                           launcher=self.launcher)

    def save(self, slots, chunk, skip=0, layer=None):
        pages = self.kv_cache if layer is None else self.kv_cache[layer : layer + 1]
        dst = chunk if layer is None else chunk[:, layer : layer + 1]
        dev = pages.device
        stage = staging_for(dst, dev)
        check = not checked_on_host(slots, skip, self.num_slots)
        ops.paged_to_chunk(pages, on_device(slots, dev), stage, skip, check=check,
                           launcher=self.launcher)
        if stage is not dst:
            copy_to_host(dst[:, :, skip:], stage[:, :, skip:])


def checked_on_host(slots: torch.Tensor, skip: int, num_slots: int) -> bool:
    """Range-check ``slots[skip:]`` here when they are host memory (ValueError naming the
    slot), so that the kernel's wrapper need not: its check reads them back from the device,
    a host sync per chunk. False for slots already on a device (the wrapper checks them)."""
    if slots.device.type != "cpu":
        return False
    if slots.numel() > skip:
        lo, hi = (int(x) for x in slots[skip:].aminmax())
        if hi >= num_slots or lo < 0:
            raise ValueError(f"slot {hi if hi >= num_slots else lo} out of range: paged memory "
                             f"holds {num_slots} slots")
    return True


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: itself, or a staged copy (asynchronous from pinned host memory;
    a small pageable host tensor, a slot mapping, is pinned first: see ``pinned``).
    A host view that is not contiguous (one layer of a chunk) goes over as its contiguous
    pieces, each copied asynchronously: torch would stage it whole through pageable memory,
    synchronously."""
    if t.device == device:
        return t
    if device.type == "cuda":
        t = pinned(t)
    pieces = contiguous_pieces(t)
    if len(pieces) == 1:
        return t.to(device, non_blocking=True)
    if len(pieces) > MAX_PIECES:
        # many pieces (a load's last chunk, ending inside it: each layer's K and V): the
        # stretch of memory under the view goes over in one copy when it is not much more
        span = storage_span(t)
        if span <= 2 * t.numel() and t.is_pinned():
            return t.as_strided((span,), (1,)).to(device, non_blocking=True).as_strided(
                t.shape, t.stride())
        if device.type == "cuda":  # gathered into pinned memory
            staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return staged.copy_(t).to(device, non_blocking=True)
        return t.to(device, non_blocking=True)
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    for idx in pieces:
        out[idx].copy_(t[idx], non_blocking=True)
    return out


def copy_to_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst (host, maybe a non-contiguous view) = src (a device tensor of its shape), piece by
    contiguous piece of ``dst``. Into pinned memory the copies are asynchronous on the
    current stream, however many pieces (a partial chunk's 2 x layers: a copy through a
    pageable temporary would wait for every copy queued on the stream): synchronize it
    before reading ``dst``. Into pageable memory, many pieces go through one temporary."""
    pieces = contiguous_pieces(dst)
    pinned = dst.is_pinned()
    if len(pieces) > MAX_PIECES and not pinned:
        dst.copy_(src)
        return
    for idx in pieces:
        dst[idx].copy_(src[idx], non_blocking=pinned)


MAX_PIECES = 8  # more pieces than this cost more in copies than the pageable temporary
PIN_MAX_BYTES = 1 << 20  # host tensors up to this size are pinned before a copy to a GPU


def pinned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in pinned host memory when it is a small pageable host tensor and CUDA is
    there (``t`` itself otherwise). A copy to a GPU from pageable memory first waits for
    everything queued on its stream (a host sync); from pinned memory it is only queued.
    Pinned blocks come from torch's caching host allocator, reused once their copies are
    done."""
    if (t.device.type != "cpu" or t.nbytes > PIN_MAX_BYTES or not torch.cuda.is_available()
            or t.is_pinned()):
        return t
    return t.contiguous().pin_memory()  # (a view's pin_memory would pin all under it)


def contiguous_pieces(t: torch.Tensor) -> list[tuple[int, ...]]:
    """Indices over the fewest leading dims of ``t`` whose sub-tensors are each contiguous
    (a chunk's layer view [2, 1, T, Hkv, D]: its K and V; a contiguous tensor: itself)."""
    for k in range(t.dim() + 1):
        if t.numel() == 0 or t[(0,) * k].is_contiguous():
            return list(itertools.product(*(range(n) for n in t.shape[:k])))
    raise AssertionError("a 0-dim tensor is contiguous")


def storage_span(t: torch.Tensor) -> int:
    """Elements of ``t``'s storage from its first element to its last (non-negative strides):
    ``t.as_strided((span,), (1,))`` is that stretch, ``t`` its view with offset 0."""
    if t.numel() == 0:
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))


def staging_for(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Where a copy on ``device`` can write what is meant for ``t``: ``t`` itself when it is
    there, else a new buffer of its shape (copy it into ``t`` after)."""
    return t if t.device == device else torch.empty(t.shape, dtype=t.dtype, device=device)
