"""Kernel entry points: CUDA tensors go to the kernels in cuda/ (``lmkv_cuda``), everything
else to the same-signature torch code in ``lmkv.ops_torch``, except on the CPU the engine
layout's KV transfers, which ``lmkv.transfer`` copies in C where it can, and attention steps
with a few queries per sequence (decode), which ``lmkv.cpu_attention`` runs in C.

CuPy is imported only when a CUDA tensor arrives; if it (or the driver, or NVRTC) is
unusable, one warning is printed and the torch code runs instead. Kernel-path extras, all
keyword-only: ``check=False`` skips the index-range checks that cost a device sync (for callers
that validated their metadata, e.g. once per step); attention takes ``out=``; ``launcher``
names the kernels' launcher explicitly (the CPU emulator's, which runs them on CPU tensors:
how the engine's GPU path is exercised without a GPU).

Layouts: engine ``kv_cache [L, 2, num_blocks, block_size, Hkv, D]``, one layer
``kv_layer [2, num_blocks, block_size, Hkv, D]``; vLLM per layer
``[num_blocks, block_size, Hkv, 2 * D]``; chunk ``[2, L, T, Hkv, D]``; ``slot_mapping [T]``
int64 (slot = block_id * block_size + offset); tokens [0, skip) of a chunk are not copied.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from lmkv import cpu_attention, ops_torch, transfer

if TYPE_CHECKING:
    from lmkv_cuda.launcher import Launcher

log = logging.getLogger(__name__)


def kernel_launcher(*tensors: torch.Tensor, launcher: Launcher | None = None) -> Launcher | None:
    """The launcher for ``tensors``: ``launcher`` when given and all of them are on its
    device type (the CPU emulator runs the kernels on CPU tensors), else the GPU launcher
    when all are on one CUDA device, else None (CPU tensors, mixed devices such as a pinned
    host chunk, or unusable CUDA kernels: the torch path)."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return None
    device = devices.pop()
    if launcher is not None:
        return launcher if device.type == launcher.device_type else None
    if device.type != "cuda":
        return None
    from lmkv_cuda.launcher import gpu_launcher

    return gpu_launcher(device.index if device.index is not None else torch.cuda.current_device())


# ---- KV transfer between paged memory and chunk buffers (all layers, K and V, one launch)


def paged_to_chunk(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, chunk: torch.Tensor, skip: int = 0,
    *, check: bool = True, launcher: Launcher | None = None,
) -> None:  # fmt: skip
    """chunk[:, :, t] = kv_cache[:, :, slot_mapping[t]] for t in [skip, T)."""
    if (launcher := kernel_launcher(kv_cache, chunk, slot_mapping, launcher=launcher)) is not None:
        from lmkv_cuda import kv_copy

        with _dense(chunk) as out:  # the kernel writes a dense chunk
            kv_copy.paged_to_chunk(launcher, kv_cache, slot_mapping, out, skip, check=check)
        return
    if not transfer.copy(kv_cache, slot_mapping, chunk, skip, to_paged=False):
        ops_torch.paged_to_chunk(kv_cache, slot_mapping, chunk, skip)


def chunk_to_paged(
    chunk: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, skip: int = 0,
    *, check: bool = True, launcher: Launcher | None = None,
) -> None:  # fmt: skip
    """kv_cache[:, :, slot_mapping[t]] = chunk[:, :, t] for t in [skip, T)."""
    if (launcher := kernel_launcher(kv_cache, chunk, slot_mapping, launcher=launcher)) is not None:
        from lmkv_cuda import kv_copy

        # the kernel reads a dense chunk; a load ending inside a stored chunk passes a view
        return kv_copy.chunk_to_paged(launcher, chunk.contiguous(), kv_cache, slot_mapping, skip,
                                      check=check)
    if not transfer.copy(kv_cache, slot_mapping, chunk, skip, to_paged=True):
        ops_torch.chunk_to_paged(chunk, kv_cache, slot_mapping, skip)


def vllm_layers(kv_caches: Sequence[torch.Tensor], *, launcher: Launcher | None = None):
    """``kv_caches`` (vLLM's per-layer tensors) prepared once for the *_vllm copies: checked
    and with their address table on the device where lmkv's kernels take them (no per-call
    checks of every layer, and ``layer=`` copies one layer), else the list itself."""
    if (launcher := kernel_launcher(kv_caches[0], launcher=launcher)) is None:
        return list(kv_caches)
    from lmkv_cuda import kv_copy

    return kv_copy.VllmLayers(launcher, kv_caches)


def _vllm_args(kv_caches, layer: int | None, *others: torch.Tensor, launcher: Launcher | None):
    """(the kernels' launcher, or None for the torch twins; the layers' tensors as the twins
    take them)."""
    tensors = list(getattr(kv_caches, "tensors", kv_caches))
    if layer is not None:
        tensors = tensors[layer : layer + 1]
    return kernel_launcher(tensors[0], *others, launcher=launcher), tensors


def paged_to_chunk_vllm(
    kv_caches, slot_mapping: torch.Tensor, chunk: torch.Tensor, skip: int = 0, *,
    check: bool = True, layer: int | None = None, launcher: Launcher | None = None,
) -> None:  # fmt: skip
    """chunk[0 / 1, l, t] = K / V of kv_caches[l] at slot_mapping[t], t in [skip, T).
    kv_caches: the per-layer tensors, or ``vllm_layers`` of them; with ``layer``, that layer
    only, into a chunk of one layer."""
    launcher, tensors = _vllm_args(kv_caches, layer, chunk, slot_mapping, launcher=launcher)
    if launcher is not None:
        from lmkv_cuda import kv_copy

        with _dense(chunk) as out:
            kv_copy.paged_to_chunk_vllm(launcher, kv_caches, slot_mapping, out, skip, check=check,
                                        layer=layer)
        return
    ops_torch.paged_to_chunk_vllm(tensors, slot_mapping, chunk, skip)


def chunk_to_paged_vllm(
    chunk: torch.Tensor, kv_caches, slot_mapping: torch.Tensor, skip: int = 0, *,
    check: bool = True, layer: int | None = None, launcher: Launcher | None = None,
) -> None:  # fmt: skip
    """K / V of kv_caches[l] at slot_mapping[t] = chunk[0 / 1, l, t], t in [skip, T)
    (kv_caches and ``layer`` as in paged_to_chunk_vllm)."""
    launcher, tensors = _vllm_args(kv_caches, layer, chunk, slot_mapping, launcher=launcher)
    if launcher is not None:
        from lmkv_cuda import kv_copy

        return kv_copy.chunk_to_paged_vllm(launcher, chunk.contiguous(), kv_caches, slot_mapping,
                                           skip, check=check, layer=layer)
    ops_torch.chunk_to_paged_vllm(chunk, tensors, slot_mapping, skip)


@contextmanager
def _dense(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """``t`` if contiguous, else a dense buffer of its shape copied into ``t`` at the end."""
    if t.is_contiguous():
        yield t
        return
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    yield out
    t.copy_(out)


# ---- RoPE


def rerotate_keys(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor, *,
                  launcher: Launcher | None = None) -> torch.Tensor:
    """In place: keys [..., T, Hkv, D] (e.g. ``chunk[0]``, all layers at once) rotated by
    angle delta[t] * inv_freq, moving keys cached at position p to p + delta[t] (HF Llama
    rotate_half convention; delta [T] int64, inv_freq [D/2] fp32). Returns keys."""
    if (launcher := kernel_launcher(keys, delta, inv_freq, launcher=launcher)) is not None:
        from lmkv_cuda import rope

        if keys.is_contiguous():
            return rope.rerotate_keys(launcher, keys, delta, inv_freq)
    return ops_torch.rerotate_keys(keys, delta, inv_freq)


# ---- the engine's attention and cache writes


def _attention_kernel(query: torch.Tensor, kv_layer: torch.Tensor,
                      given: Launcher | None) -> Launcher | None:
    launcher = kernel_launcher(query, kv_layer, launcher=given)
    if launcher is None:
        return None
    from lmkv_cuda.attention import HEAD_DIMS

    supported = query.shape[-1] in HEAD_DIMS and kv_layer.dtype == query.dtype
    if not supported:
        _warn_unsupported(query.shape[-1], query.dtype, kv_layer.dtype)
    return launcher if supported else None


_UNSUPPORTED: set[tuple] = set()


def _warn_unsupported(head_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    """Once per shape: attention on a device runs torch's code instead of lmkv's kernel."""
    key = (head_dim, q_dtype, kv_dtype)
    if key not in _UNSUPPORTED:
        _UNSUPPORTED.add(key)
        log.warning("lmkv: no attention kernel for head_dim %d (query %s, KV %s; the kernels take "
                    "head_dim 64 or 128 and equal dtypes): torch's attention runs instead, with "
                    "a device sync per layer (and no CUDA graphs of decode steps)",
                    head_dim, q_dtype, kv_dtype)


def paged_attention_decode(
    query: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, *, check: bool = True, out: torch.Tensor | None = None,
    launcher: Launcher | None = None,
) -> torch.Tensor:  # fmt: skip
    """query [B, Hq, D], one token per sequence at position seq_len - 1 -> [B, Hq, D]."""
    if (launcher := _attention_kernel(query, kv_layer, launcher)) is not None:
        from lmkv_cuda import attention

        dev = query.device  # metadata may come from the host: a no-op when already there
        return attention.paged_attention_decode(
            launcher, query.contiguous(), kv_layer, block_tables.to(dev), seq_lens.to(dev), scale,
            check=check, out=out,
        )  # fmt: skip
    result = cpu_attention.attention(query, kv_layer, block_tables, seq_lens,
                                     torch.arange(query.shape[0] + 1), scale)
    if result is None:
        result = ops_torch.paged_attention_decode(query, kv_layer, block_tables, seq_lens, scale)
    return result if out is None else out.copy_(result)


# On a GPU, sequences with more new tokens than this take torch's fused attention (tensor
# cores) over their gathered pages instead of lmkv's kernel (CUDA cores, no split over keys
# in prefill): on an H200 torch was faster for one sequence at every length measured, 1 to
# 4096 new tokens (benchmarks/kernels.py, the "prefill q=" lines; docs/kernels.md), so only
# decode rows (one token each, split over keys) run the kernel.
PREFILL_KERNEL_MAX_QUERY = 1


def paged_attention_prefill(
    query: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *, check: bool = True,
    out: torch.Tensor | None = None, launcher: Launcher | None = None,
) -> torch.Tensor:  # fmt: skip
    """Causal attention of query [T, Hq, D] (sequence i: rows [query_start_loc[i], [i + 1]))
    over its paged KV -> [T, Hq, D]. On a GPU, a host ``query_start_loc`` picks the kernel or
    torch's attention without a device read (on the device, the kernel runs)."""
    if (query.is_cuda and launcher is None and not query_start_loc.is_cuda
            and query_start_loc.numel() > 1
            and int(query_start_loc.diff().max()) > PREFILL_KERNEL_MAX_QUERY):
        result = ops_torch.paged_attention_prefill(
            query, kv_layer, block_tables.to(query.device), seq_lens, query_start_loc, scale)
        return result if out is None else out.copy_(result)
    if (launcher := _attention_kernel(query, kv_layer, launcher)) is not None:
        from lmkv_cuda import attention

        dev = query.device
        return attention.paged_attention_prefill(
            launcher, query.contiguous(), kv_layer, block_tables.to(dev), seq_lens.to(dev),
            query_start_loc.to(dev), scale, check=check, out=out,
        )  # fmt: skip
    result = cpu_attention.attention(query, kv_layer, block_tables, seq_lens, query_start_loc, scale)
    if result is None:
        result = ops_torch.paged_attention_prefill(
            query, kv_layer, block_tables, seq_lens, query_start_loc, scale
        )
    return result if out is None else out.copy_(result)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor,
    *, check: bool = True, launcher: Launcher | None = None,
) -> None:  # fmt: skip
    """kv_layer[0 / 1][slot_mapping[t]] = key / value[t]; slot -1 = skip the token."""
    launcher = kernel_launcher(key, value, kv_layer, slot_mapping, launcher=launcher)
    if launcher is not None and key.dtype == value.dtype == kv_layer.dtype:
        from lmkv_cuda import kv_copy

        rows_ok = all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (key, value))
        if not rows_ok or key.stride(0) != value.stride(0):  # the kernel takes [Hkv, D] rows
            # (clone: .contiguous() keeps the odd strides of size-1 dims, which torch ignores)
            key, value = (t.clone(memory_format=torch.contiguous_format) for t in (key, value))
        return kv_copy.reshape_and_cache(launcher, key, value, kv_layer, slot_mapping, check=check)
    ops_torch.reshape_and_cache(key, value, kv_layer, slot_mapping)


# ---- cachegen quantize (lmkv.codec.cachegen; kv [2, L, T, Hkv, D]; decode runs on the CPU)


def cachegen_quantize(
    kv: torch.Tensor, step: torch.Tensor, mean: torch.Tensor, delta: torch.Tensor, group_size: int,
    *, launcher: Launcher | None = None,
) -> torch.Tensor:
    """int16 symbols of kv: clamp(round((x - mean) / step)), minus the group anchor's in the
    (K/V, layer) streams ``delta`` marks."""
    if (launcher := kernel_launcher(kv, step, mean, delta, launcher=launcher)) is not None:
        from lmkv_cuda import cachegen

        return cachegen.quantize(launcher, kv, step, mean, delta, group_size)
    from lmkv.codec import cachegen as twin

    return twin.quantize(kv, step, mean, delta, group_size)
