"""The emulator's own guarantees that the kernel tests rely on: software fp16/bf16 that
rounds like the GPU (and torch), and CuPy's argument rules enforced."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lmkv_cuda.emu import CpuRawModule

SOURCE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
extern "C" __global__ void convert(const float* x, __half* h, __nv_bfloat16* b, float* h_back,
                                   float* b_back, const unsigned short* bits, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    h[i] = __float2half_rn(x[i]);
    b[i] = __float2bfloat16_rn(x[i]);
    h_back[i] = __half2float(__ushort_as_half(bits[i]));
    b_back[i] = __bfloat162float(__ushort_as_bfloat16(bits[i]));
  }
}
extern "C" __global__ void scale(float* x, int n, float factor) {
  if ((int)threadIdx.x < n) x[threadIdx.x] *= factor;
}
"""


@pytest.fixture(scope="module")
def module(emu):  # emu: skips without g++
    return CpuRawModule(code=SOURCE)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.float(), b.float()
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def test_half_and_bfloat16_round_like_torch(module):
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 15,), generator=gen, dtype=torch.int64)
    edges = [0.0, -0.0, 65504.0, 65519.99, 65520.0, 2**-24, 2**-25, 2**-25 * 1.0001, 1e-40,
             float("inf"), -float("inf"), float("nan"), 3.3895314e38]  # fmt: skip
    x = torch.cat([
        bits.to(torch.int32).view(torch.float32), torch.randn(1 << 15, generator=gen) * 1e-5,
        torch.randn(1 << 15, generator=gen) * 7e4, torch.tensor(edges),
    ])  # fmt: skip
    n = x.numel()
    patterns = torch.from_numpy((np.arange(n) % 65536).astype(np.uint16))
    h, b = torch.empty(n, dtype=torch.float16), torch.empty(n, dtype=torch.bfloat16)
    h_back, b_back = torch.empty(n), torch.empty(n)
    module.get_function("convert")((64,), (256,), (x, h, b, h_back, b_back, patterns, np.int64(n)))
    assert _same(h, x.half()) and _same(b, x.bfloat16())
    as_half = torch.from_numpy(patterns.numpy().view(np.float16)).float()
    as_bf16 = torch.from_numpy(patterns.numpy().astype(np.uint32) << 16).view(torch.float32)
    assert _same(h_back, as_half) and _same(b_back, as_bf16)


def test_arguments_are_checked_like_cupy_packs_them(module):
    x = torch.ones(4)
    kernel = module.get_function("scale")
    kernel((1,), (32,), (x, np.int32(4), np.float32(2.0)))
    assert torch.equal(x, torch.full((4,), 2.0))
    with pytest.raises(TypeError, match="arg 1 is i64"):  # a Python int is a long long in CuPy
        kernel((1,), (32,), (x, 4, np.float32(2.0)))
    with pytest.raises(TypeError, match="arg 2 is f64"):  # a Python float is a double
        kernel((1,), (32,), (x, np.int32(4), 2.0))
    with pytest.raises(TypeError, match="expects 3 args"):
        kernel((1,), (32,), (x, np.int32(4)))
