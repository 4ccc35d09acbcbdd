"""cachegen.cu under the CPU emulator vs the torch twins in lmkv.codec.cachegen: quantize
bit-exact, dequantize to within one rounding of the output type."""

from __future__ import annotations

import pytest
import torch

lmkv_cuda = pytest.importorskip("lmkv_cuda", reason="the CUDA kernel package is not installed")
cachegen = pytest.importorskip("lmkv_cuda.cachegen", reason="lmkv_cuda has no cachegen wrapper")
if "cachegen.cu" not in lmkv_cuda.INSTANTIATIONS:
    pytest.skip("cachegen.cu is not registered in lmkv_cuda.INSTANTIATIONS", allow_module_level=True)

from lmkv.codec import cachegen as twin  # noqa: E402
from lmkv.codec.calibration import calibrate  # noqa: E402


def _case(dtype, layers, tokens, heads, dim, delta_pattern, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(2, layers, tokens, heads, dim, generator=g) * 3 + 1).to(dtype)
    table = calibrate([kv.float()])
    delta = torch.tensor(delta_pattern, dtype=torch.bool).reshape(2, layers)
    return kv, table.step, table.mean, delta


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("layers", "tokens", "heads", "dim", "group", "delta"),
    [
        (2, 40, 2, 16, 16, [1, 0, 0, 1]),  # a partial last group (40 = 16 + 16 + 8)
        (1, 5, 1, 6, 1, [1, 1]),  # group 1: every token an anchor
        (3, 33, 3, 8, 7, [0, 0, 0, 0, 0, 0]),
        (1, 300, 1, 64, 256, [1, 0]),  # more elements than one grid-stride pass of 1 block
    ],
)
def test_matches_torch(emu, dtype, layers, tokens, heads, dim, group, delta):
    kv, step, mean, dl = _case(dtype, layers, tokens, heads, dim, delta)
    kv[0, 0, 3, 0, 0] = 1e6  # clamped to +QMAX by both
    want = twin.quantize(kv, step, mean, dl, group)
    got = cachegen.quantize(emu, kv, step, mean, dl, group)
    assert torch.equal(got, want)
    ref, out = torch.empty_like(kv), torch.empty_like(kv)
    twin.dequantize(want, step, mean, dl, group, ref)
    cachegen.dequantize(emu, got, step, mean, dl, group, out)
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    assert torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol)


def test_wrapper_rejects_bad_arguments(emu):
    kv, step, mean, dl = _case(torch.float32, 2, 8, 1, 4, [0, 0, 0, 0])
    with pytest.raises(ValueError, match="step shape"):
        cachegen.quantize(emu, kv, step[:, :1].contiguous(), mean, dl, 4)
    with pytest.raises(TypeError, match="bool"):
        cachegen.quantize(emu, kv, step, mean, dl.to(torch.uint8), 4)
    with pytest.raises(ValueError, match="contiguous"):
        cachegen.quantize(emu, kv[:, :, ::2], step, mean, dl, 4)
    with pytest.raises(ValueError, match="group_size"):
        cachegen.quantize(emu, kv, step, mean, dl, 0)
    sym = cachegen.quantize(emu, kv, step, mean, dl, 4)
    with pytest.raises(TypeError, match="int16"):
        cachegen.dequantize(emu, sym.int(), step, mean, dl, 4, kv)
