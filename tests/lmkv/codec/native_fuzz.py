"""Run as a script, in a process with AddressSanitizer preloaded (test_native.py): decode
valid and corrupted cachegen payloads with an ASan build of native.c, on both of its paths
(AMX where the CPU has it, and without, with bfloat16 and float32 products), and print
"native decode clean"."""

from __future__ import annotations

import contextlib
import ctypes.util
import random
import sys
from pathlib import Path

import torch

from lmkv.codec import cachegen, native
from lmkv.codec.calibration import CalibrationSettings, calibrate
from lmkv.ops_torch import rerotate_keys


def chunk(seed: int, shape=(2, 3, 64, 2, 32)) -> torch.Tensor:
    """KV with a few strong shared directions per layer (so the transform is kept)."""
    g = torch.Generator().manual_seed(seed)
    two, layers, t, h, d = shape
    mix = torch.randn(two, layers, 8, h * d, generator=torch.Generator().manual_seed(1))
    noise = torch.randn(two, layers, t, h * d, generator=g)
    x = torch.randn(two, layers, t, 8, generator=g) @ mix + 0.05 * noise
    return x.view(shape)


def main(build_dir: str) -> None:
    flags = ("-fsanitize=address", "-fno-omit-frame-pointer")
    lib = native.load(native.build("cc", ctypes.util.find_library("zstd"), Path(build_dir), flags))
    native.library = lambda: lib
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 32, 2).float() / 32)
    table = calibrate([chunk(s) for s in range(4)], CalibrationSettings(error=0.02, store_weak=False),
                      rope=inv_freq)
    assert table.basis is not None
    x = chunk(9)
    x[:, :, 7] *= 40  # int16 bands
    rerotate_keys(x[0], torch.arange(100, 164), inv_freq)  # keys as they sit at positions 100..
    payload = cachegen.encode(x, table, position=100)
    head = cachegen._HEAD.size + cachegen._POSITION.size
    count = cachegen._HEAD.unpack_from(payload)[5]
    rng = random.Random(0)
    bad = [payload[:n] for n in (0, 10, head, head + 5 * count - 1, len(payload) - 1)] + [payload + b"\0"]
    for _ in range(300):
        b = bytearray(payload)
        for _ in range(rng.randrange(1, 6)):
            b[rng.randrange(cachegen._HEAD.size, len(b))] = rng.randrange(256)
        bad.append(bytes(b))
    real_amx = lib.lmkv_amx
    for amx, product in ((True, torch.bfloat16), (False, torch.bfloat16), (False, torch.float32)):
        if amx and not real_amx():
            continue
        lib.lmkv_amx = real_amx if amx else (lambda: 0)
        cachegen.product_dtype = lambda c, product=product: product  # coefficients' width in C
        out = torch.empty_like(x)
        cachegen.decode_into(payload, out, table)
        usual = torch.cat((out - x).split([7, 1, 56], dim=2)[::2], dim=2)  # the outlier token aside
        assert usual.norm() / x.norm() < 0.05, (amx, float(usual.norm() / x.norm()))
        for dtype in (torch.float16, torch.bfloat16):  # 2-byte rows
            half = torch.empty(x.shape, dtype=dtype)
            cachegen.decode_into(payload, half, table)
            assert (half.float() - out).abs().max() <= 0.01 * out.abs().max()
        for b in bad:
            with contextlib.suppress(cachegen.PayloadError):
                cachegen.decode_into(b, out, table)
    print("native decode clean")


if __name__ == "__main__":
    main(sys.argv[1])
