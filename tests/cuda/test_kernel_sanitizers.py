"""Race and bounds checks of the kernels under the CPU emulator: seeded shaking of the fiber
order, a ThreadSanitizer build and an AddressSanitizer build (subprocesses: the sanitizer
runtime must be preloaded into Python, and CUEMU_SEED is read once per process). Small
deliberately broken kernels show that each check does catch its kind of bug."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmkv_cuda.emu import CpuRawModule, sanitizer_env

CASES = Path(__file__).with_name("emu_cases.py")

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed")


def _python(
    args: list[str], env: dict[str, str], timeout: int = 300
) -> subprocess.CompletedProcess:
    # sys.executable itself: a shell wrapper (pyenv shim) would crash under a preloaded TSan
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_seed_shaking(seed):
    r = _python([str(CASES)], dict(os.environ, CUEMU_SEED=str(seed)))
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]


@pytest.mark.sanitize
def test_kernels_clean_under_tsan_and_asan():
    runs = {  # concurrently: one per core
        sanitize: subprocess.Popen(
            [sys.executable, str(CASES), "--sanitize", sanitize], env=sanitizer_env(sanitize),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for sanitize in ("thread", "address")
    }
    for sanitize, proc in runs.items():
        out, err = proc.communicate(timeout=500)
        assert proc.returncode == 0, f"{sanitize}: {out}{err[-6000:]}"
        assert "ERROR: AddressSanitizer" not in err and "ThreadSanitizer" not in err, err[-6000:]
        assert "all kernels match" in out


BROKEN = r"""
extern "C" __global__ void block_sum(const float* x, float* out) {
  __shared__ float buf[64];
  buf[threadIdx.x] = x[threadIdx.x];
#ifdef FIXED
  __syncthreads();
#endif
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int i = 0; i < 64; ++i) s += buf[i];
    out[0] = s;
  }
}
extern "C" __global__ void shift_read(const float* x, float* out, int n) {
  if (threadIdx.x < n) out[threadIdx.x] = x[threadIdx.x + OFFSET];
}
extern "C" __global__ void divergent_shuffle(float* out) {
  float v = threadIdx.x;
  if ((threadIdx.x & 31) < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);  // half a warp
  __syncthreads();
  out[threadIdx.x] = v;
}
"""

RUN_BROKEN = """
import sys
import numpy as np
from lmkv_cuda.emu import CpuRawModule
kernel, sanitize, *options = sys.argv[1:]
mod = CpuRawModule(code={code!r}, sanitize=sanitize, options=options)
x = np.arange(64, dtype=np.float32)
out = np.zeros(64, dtype=np.float32)
if kernel == "block_sum":
    mod.get_function(kernel)((1,), (64,), (x, out))
else:
    mod.get_function(kernel)((1,), (64,), (x, out, np.int32(64)))
print("finished", out[0])
"""  # numpy only: importing torch under a sanitizer takes seconds


def _run_broken(kernel: str, sanitize: str, *options: str) -> subprocess.CompletedProcess:
    script = RUN_BROKEN.format(code=BROKEN)
    return _python(["-c", script, kernel, sanitize, *options], sanitizer_env(sanitize))


@pytest.mark.sanitize
def test_tsan_finds_a_missing_barrier():
    racy = _run_broken("block_sum", "thread", "-DOFFSET=0")
    assert "ThreadSanitizer: data race" in racy.stderr, racy.stderr[-3000:]
    fixed = _run_broken("block_sum", "thread", "-DOFFSET=0", "-DFIXED")
    assert fixed.returncode == 0 and "ThreadSanitizer" not in fixed.stderr, fixed.stderr[-3000:]


@pytest.mark.sanitize
def test_asan_finds_an_out_of_bounds_read():
    bad = _run_broken("shift_read", "address", "-DOFFSET=1")
    assert "heap-buffer-overflow" in bad.stderr, bad.stderr[-3000:]
    good = _run_broken("shift_read", "address", "-DOFFSET=0")
    assert good.returncode == 0 and "ERROR: AddressSanitizer" not in good.stderr


def test_seed_shaking_finds_a_missing_barrier():
    """Without the barrier, the default order already runs thread 0 first: a wrong sum."""
    mod = CpuRawModule(code=BROKEN, options=["-DOFFSET=0"])
    x, out = torch.ones(64), torch.zeros(1)
    mod.get_function("block_sum")((1,), (64,), (x, out))
    assert out.item() != 64.0
    fixed = CpuRawModule(code=BROKEN, options=["-DOFFSET=0", "-DFIXED"])
    fixed.get_function("block_sum")((1,), (64,), (x, out))
    assert out.item() == 64.0


def test_divergent_shuffle_is_reported_as_deadlock():
    mod = CpuRawModule(code=BROKEN, options=["-DOFFSET=0"])
    with pytest.raises(RuntimeError, match="deadlock"):
        mod.get_function("divergent_shuffle")((1,), (64,), (torch.zeros(64),))
