"""Wrappers of cachegen.cu: the quantize / dequantize steps of the cachegen codec on the GPU.
Torch twins with the same signatures (less the launcher): lmkv.codec.cachegen.quantize and
lmkv.codec.cachegen.dequantize. lmkv.ops.cachegen_quantize dispatches (encode of a CUDA
chunk); decode runs on the CPU (decode_into), so the dequantize kernel is compiled and
tested but on no product path.
Shapes: kv / out [2, L, T, H, D] float, symbols int16 of the same shape, step / mean
[2, L, H, D] fp32, delta [2, L] bool; all contiguous, one device.
"""

from __future__ import annotations

import numpy as np
import torch

from lmkv_cuda.launcher import CTYPE, FLOAT_DTYPES, Launcher, check_tensor, num_blocks_for, require

THREADS = 256
QMAX = 16383


def _check_table(launcher: Launcher, shape: torch.Size, step: torch.Tensor, mean: torch.Tensor,
                 delta: torch.Tensor, group_size: int) -> None:
    two, layers, _, heads, dim = shape
    require(two == 2, f"KV must be [2, L, T, H, D], got {tuple(shape)}")
    for name, t in (("step", step), ("mean", mean)):
        check_tensor(t, name, launcher, ndim=4, dtypes=(torch.float32,))
        require(tuple(t.shape) == (2, layers, heads, dim),
                f"{name} shape {tuple(t.shape)} != [2, {layers}, {heads}, {dim}]")
    check_tensor(delta, "delta", launcher, ndim=2, dtypes=(torch.bool,))
    require(tuple(delta.shape) == (2, layers), f"delta shape {tuple(delta.shape)} != [2, {layers}]")
    require(1 <= group_size <= 1024, f"group_size {group_size} outside [1, 1024]")


def _grid(n: int) -> tuple[int]:
    return (num_blocks_for(n, THREADS, cap=65535),)


def quantize(launcher: Launcher, kv: torch.Tensor, step: torch.Tensor, mean: torch.Tensor,
             delta: torch.Tensor, group_size: int) -> torch.Tensor:
    """kv [2, L, T, H, D] -> symbols int16 [2, L, T, H, D]."""
    check_tensor(kv, "kv", launcher, ndim=5, dtypes=FLOAT_DTYPES)
    _check_table(launcher, kv.shape, step, mean, delta, group_size)
    symbols = torch.empty(kv.shape, dtype=torch.int16, device=kv.device)
    n = kv.numel()
    if n:
        p = launcher.pointer
        kernel = launcher.kernel("cachegen.cu", f"cachegen_quantize<{CTYPE[kv.dtype]}>")
        kernel(_grid(n), (THREADS,),
               (p(kv), p(step), p(mean), p(delta.view(torch.uint8)), p(symbols), np.int64(n),
                np.int32(kv.shape[2]), np.int32(kv.shape[3] * kv.shape[4]), np.int32(group_size)))
    return symbols


def dequantize(launcher: Launcher, symbols: torch.Tensor, step: torch.Tensor, mean: torch.Tensor,
               delta: torch.Tensor, group_size: int, out: torch.Tensor) -> None:
    """out [2, L, T, H, D] = (symbols + anchor) * step + mean."""
    check_tensor(symbols, "symbols", launcher, ndim=5, dtypes=(torch.int16,))
    check_tensor(out, "out", launcher, ndim=5, dtypes=FLOAT_DTYPES)
    require(symbols.shape == out.shape, f"symbols {tuple(symbols.shape)} != out {tuple(out.shape)}")
    _check_table(launcher, out.shape, step, mean, delta, group_size)
    n = out.numel()
    if n:
        p = launcher.pointer
        kernel = launcher.kernel("cachegen.cu", f"cachegen_dequantize<{CTYPE[out.dtype]}>")
        kernel(_grid(n), (THREADS,),
               (p(symbols), p(step), p(mean), p(delta.view(torch.uint8)), p(out), np.int64(n),
                np.int32(out.shape[2]), np.int32(out.shape[3] * out.shape[4]), np.int32(group_size)))
