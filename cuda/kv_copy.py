"""Wrappers of kv_copy.cu: KV transfer between paged memory and lmkv chunk buffers, and
reshape_and_cache. Each checks shapes, dtypes, contiguity and (``check=True``, one device
sync) slot ranges, then launches one kernel for all layers and both K and V.

Layouts (see kv_copy.cu): engine ``kv_cache [L, 2, num_blocks, block_size, Hkv, D]``;
vLLM per layer ``[num_blocks, block_size, Hkv, 2 * D]``; chunk ``[2, L, T, Hkv, D]``;
``slot_mapping [T]`` int64 holds the slots of the chunk's tokens. Tokens [0, skip) are not
copied and their slots are not read; the others must be in [0, num_blocks * block_size).
The torch twins (same signatures, no launcher) are in ``lmkv.ops_torch``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lmkv_cuda.launcher import Launcher, check_tensor, num_blocks_for, require

_UNITS = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}
_WARPS = 8  # rows in flight per block (kCopyWarps)


def _check_slots(slots: torch.Tensor, num_slots: int, allow_negative: bool) -> None:
    if slots.numel() == 0:
        return
    lo, hi = torch.stack(list(torch.aminmax(slots))).tolist()  # the one device sync
    require(hi < num_slots, f"slot {hi} out of range: paged memory holds {num_slots} slots")
    require(allow_negative or lo >= 0, f"slot {lo} out of range (negative)")


def _launch(
    launcher: Launcher,
    to_paged: bool,
    *,
    layer_table: torch.Tensor | None,
    layer_align: int,
    paged: torch.Tensor,
    flat_k: torch.Tensor,
    flat_v: torch.Tensor,
    slots: torch.Tensor,
    num_slots: int,
    strides: dict[str, int],
    heads: int,
    head_bytes: int,
    num_layers: int,
    num_tokens: int,
    skip: int,
) -> None:
    """strides: byte strides paged_layer, paged_kv, slot, head, flat_layer, flat_token.
    layer_table: the layers' addresses (int64, on the kernel's device) when the layers are
    separate tensors, all aligned to ``layer_align`` bytes."""
    if 2 * num_layers * (num_tokens - skip) == 0:
        return
    addresses = [paged.data_ptr(), flat_k.data_ptr(), flat_v.data_ptr()]
    unit = next(
        u for u in _UNITS
        if layer_align % u == 0 and all(x % u == 0 for x in (*addresses, *strides.values(), head_bytes))
    )  # fmt: skip
    kernel = launcher.kernel(
        "kv_copy.cu", f"kv_copy<{_UNITS[unit]}, {'true' if to_paged else 'false'}>"
    )
    p = launcher.pointer
    rows = 2 * num_layers * (num_tokens - skip)
    args = (
        p(slots if layer_table is None else layer_table), np.int32(layer_table is not None),
        p(paged), np.int64(strides["paged_layer"] // unit), np.int64(strides["paged_kv"] // unit),
        np.int64(strides["slot"] // unit), np.int64(strides["head"] // unit),
        np.int32(head_bytes // unit), np.int32(heads),
        p(flat_k), p(flat_v), np.int64(strides["flat_layer"] // unit),
        np.int64(strides["flat_token"] // unit),
        p(slots), np.int64(num_slots), np.int32(num_layers), np.int32(num_tokens),
        np.int32(skip),
    )  # fmt: skip
    kernel((num_blocks_for(rows, _WARPS, cap=16384),), (_WARPS * 32,), args)


def _pointer_table(layer_ptrs: list[int], device: torch.device) -> torch.Tensor:
    """The layers' addresses as an int64 tensor on their device, copied from pinned memory
    without blocking the host (torch's pinned allocator keeps the host side until the copy
    has run), allocated on the current stream: the stream that reads it."""
    host = torch.tensor(layer_ptrs, dtype=torch.int64)
    if device.type != "cuda":  # the CPU emulator
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _alignment(ptrs: Sequence[int]) -> int:
    """The largest copy unit (16 bytes at most) that every address is aligned to."""
    return next(u for u in _UNITS if all(x % u == 0 for x in ptrs))


def _check_layers(launcher: Launcher, kv_caches: Sequence[torch.Tensor]) -> None:
    require(len(kv_caches) > 0, "kv_caches is empty")
    first = kv_caches[0]
    for i, t in enumerate(kv_caches):
        check_tensor(t, f"kv_caches[{i}]", launcher, ndim=4)
        require(
            t.shape == first.shape and t.dtype == first.dtype and t.device == first.device,
            f"kv_caches[{i}] {tuple(t.shape)} {t.dtype} differs from kv_caches[0]",
        )
    require(first.shape[3] % 2 == 0,
            f"last dim of a vLLM KV tensor is 2 * head_dim, got {first.shape[3]}")


class VllmLayers:
    """vLLM's per-layer KV tensors ``[num_blocks, block_size, Hkv, 2 * D]``, checked once
    (the copies then check none of them per call: 32 layers cost ~100 us of Python each
    call), with their addresses in a device table that lives as long as this object, so
    that copies on any stream may read it."""

    def __init__(self, launcher: Launcher, kv_caches: Sequence[torch.Tensor]):
        _check_layers(launcher, kv_caches)
        first = kv_caches[0]
        self.tensors = list(kv_caches)
        ptrs = [t.data_ptr() for t in kv_caches]
        self.align = _alignment(ptrs)
        self.table = torch.tensor(ptrs, dtype=torch.int64).to(first.device)  # once: may block

    def __len__(self) -> int:
        return len(self.tensors)

    def layers(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first tensor and the address table of layers [first, first + count)."""
        return self.tensors[first], self.table[first : first + count]


def _check_chunk(
    launcher: Launcher, chunk: torch.Tensor, slot_mapping: torch.Tensor, skip: int,
    num_layers: int, heads: int, head_dim: int, dtype: torch.dtype,
) -> int:  # fmt: skip
    check_tensor(chunk, "chunk", launcher, ndim=5)
    check_tensor(slot_mapping, "slot_mapping", launcher, ndim=1, dtypes=(torch.int64,))
    two, layers, tokens, h, d = chunk.shape
    require(
        (two, layers, h, d) == (2, num_layers, heads, head_dim),
        f"chunk shape {tuple(chunk.shape)} does not match paged memory "
        f"(expected [2, {num_layers}, T, {heads}, {head_dim}])",
    )
    require(chunk.dtype == dtype, f"chunk dtype {chunk.dtype} != paged memory dtype {dtype}")
    require(
        slot_mapping.numel() == tokens,
        f"slot_mapping has {slot_mapping.numel()} entries, chunk {tokens} tokens",
    )
    require(0 <= skip <= tokens, f"skip={skip} outside [0, {tokens}]")
    return tokens


def _engine(
    launcher: Launcher, to_paged: bool, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    chunk: torch.Tensor, skip: int, check: bool,
) -> None:  # fmt: skip
    check_tensor(kv_cache, "kv_cache", launcher, ndim=6)
    num_layers, two, nb, bs, heads, head_dim = kv_cache.shape
    require(
        two == 2,
        f"kv_cache must be [L, 2, num_blocks, block_size, Hkv, D], got {tuple(kv_cache.shape)}",
    )
    tokens = _check_chunk(
        launcher, chunk, slot_mapping, skip, num_layers, heads, head_dim, kv_cache.dtype
    )
    if check:
        _check_slots(slot_mapping[skip:], nb * bs, allow_negative=False)
    row = heads * head_dim * kv_cache.element_size()
    strides = dict(
        paged_layer=2 * nb * bs * row, paged_kv=nb * bs * row, slot=row, head=row,
        flat_layer=tokens * row, flat_token=row,
    )  # fmt: skip
    _launch(
        launcher, to_paged, layer_table=None, layer_align=16, paged=kv_cache, flat_k=chunk[0],
        flat_v=chunk[1],
        slots=slot_mapping, num_slots=nb * bs, strides=strides, heads=1, head_bytes=row,
        num_layers=num_layers, num_tokens=tokens, skip=skip,
    )  # fmt: skip


def paged_to_chunk(
    launcher: Launcher, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, chunk: torch.Tensor,
    skip: int = 0, *, check: bool = True,
) -> None:  # fmt: skip
    """chunk[:, :, t] = kv_cache[:, :, slot t] for t in [skip, T)."""
    _engine(launcher, False, kv_cache, slot_mapping, chunk, skip, check)


def chunk_to_paged(
    launcher: Launcher, chunk: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    skip: int = 0, *, check: bool = True,
) -> None:  # fmt: skip
    """kv_cache[:, :, slot t] = chunk[:, :, t] for t in [skip, T)."""
    _engine(launcher, True, kv_cache, slot_mapping, chunk, skip, check)


def _vllm(
    launcher: Launcher, to_paged: bool, kv_caches: Sequence[torch.Tensor] | VllmLayers,
    slot_mapping: torch.Tensor, chunk: torch.Tensor, skip: int, check: bool, layer: int | None,
) -> None:  # fmt: skip
    if isinstance(kv_caches, VllmLayers):
        first, count = (0, len(kv_caches)) if layer is None else (layer, 1)
        paged, table = kv_caches.layers(first, count)
        align = kv_caches.align
    else:  # checked now, with a table for this call
        if layer is not None:
            kv_caches = kv_caches[layer : layer + 1]
        _check_layers(launcher, kv_caches)
        paged, count = kv_caches[0], len(kv_caches)
        ptrs = [t.data_ptr() for t in kv_caches]
        table, align = _pointer_table(ptrs, slot_mapping.device), _alignment(ptrs)
    nb, bs, heads, two_d = paged.shape
    head_dim = two_d // 2
    tokens = _check_chunk(launcher, chunk, slot_mapping, skip, count, heads, head_dim, paged.dtype)
    if check:
        _check_slots(slot_mapping[skip:], nb * bs, allow_negative=False)
    e = paged.element_size()
    strides = dict(
        paged_layer=0, paged_kv=head_dim * e, slot=heads * two_d * e, head=two_d * e,
        flat_layer=tokens * heads * head_dim * e, flat_token=heads * head_dim * e,
    )  # fmt: skip
    _launch(
        launcher, to_paged, layer_table=table, layer_align=align, paged=paged,
        flat_k=chunk[0], flat_v=chunk[1], slots=slot_mapping, num_slots=nb * bs, strides=strides,
        heads=heads, head_bytes=head_dim * e, num_layers=count, num_tokens=tokens, skip=skip,
    )  # fmt: skip


def paged_to_chunk_vllm(
    launcher: Launcher, kv_caches: Sequence[torch.Tensor] | VllmLayers, slot_mapping: torch.Tensor,
    chunk: torch.Tensor, skip: int = 0, *, check: bool = True, layer: int | None = None,
) -> None:  # fmt: skip
    """chunk[0, l, t] = kv_caches[l][slot t][..., :D], chunk[1, l, t] = [..., D:], for t in
    [skip, T). With ``layer``, that layer only, into a chunk of one layer."""
    _vllm(launcher, False, kv_caches, slot_mapping, chunk, skip, check, layer)


def chunk_to_paged_vllm(
    launcher: Launcher, chunk: torch.Tensor, kv_caches: Sequence[torch.Tensor] | VllmLayers,
    slot_mapping: torch.Tensor, skip: int = 0, *, check: bool = True, layer: int | None = None,
) -> None:  # fmt: skip
    """The inverse of paged_to_chunk_vllm."""
    _vllm(launcher, True, kv_caches, slot_mapping, chunk, skip, check, layer)


def reshape_and_cache(
    launcher: Launcher, key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor, *, check: bool = True,
) -> None:  # fmt: skip
    """kv_layer[0/1][slot t] = key/value[t] for slots >= 0; key/value [T, Hkv, D] whose rows
    may be strided (slices of a fused qkv tensor), kv_layer [2, num_blocks, block_size, Hkv, D]."""
    check_tensor(kv_layer, "kv_layer", launcher, ndim=5)
    two, nb, bs, heads, head_dim = kv_layer.shape
    require(
        two == 2,
        f"kv_layer must be [2, num_blocks, block_size, Hkv, D], got {tuple(kv_layer.shape)}",
    )
    for name, t in (("key", key), ("value", value)):
        check_tensor(t, name, launcher, ndim=3, contiguous=False)
        require(
            t.shape[1:] == (heads, head_dim),
            f"{name} shape {tuple(t.shape)} != [T, {heads}, {head_dim}]",
        )
        require(
            t.stride(2) == 1 and t.stride(1) == head_dim, f"{name} rows must be contiguous [Hkv, D]"
        )
        require(
            t.dtype == kv_layer.dtype, f"{name} dtype {t.dtype} != kv_layer dtype {kv_layer.dtype}"
        )
    require(key.stride(0) == value.stride(0), "key and value must have the same row stride")
    check_tensor(slot_mapping, "slot_mapping", launcher, ndim=1, dtypes=(torch.int64,))
    tokens = key.shape[0]
    require(
        value.shape[0] == tokens == slot_mapping.numel(),
        "key, value and slot_mapping lengths differ",
    )
    if check:
        _check_slots(slot_mapping, nb * bs, allow_negative=True)
    row = heads * head_dim * kv_layer.element_size()
    strides = dict(
        paged_layer=0, paged_kv=nb * bs * row, slot=row, head=row, flat_layer=0,
        flat_token=key.stride(0) * kv_layer.element_size(),
    )  # fmt: skip
    _launch(
        launcher, True, layer_table=None, layer_align=16, paged=kv_layer, flat_k=key, flat_v=value,
        slots=slot_mapping, num_slots=nb * bs, strides=strides, heads=1, head_bytes=row,
        num_layers=1, num_tokens=tokens, skip=0,
    )  # fmt: skip
