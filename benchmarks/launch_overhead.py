"""The host's own time per call of lmkv's KV-transfer wrappers for vLLM's GPU layout (one
tensor per layer), with the kernel launch itself stubbed out: what a copy costs the
Python thread that issues it, whatever the GPU does. Runs on any machine.

    python benchmarks/launch_overhead.py [--layers 32] [--calls 2000]

Lines: the layers checked on every call (a plain list of layer tensors, as before) vs
checked once (``kv_copy.VllmLayers``, what lmkv's DevicePagedMemory passes), for a whole
chunk and for one layer (layer-wise mode: before, a list of that one layer); each ends in
checked/prepared.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script or with -m
from lmkv_cuda import kv_copy  # noqa: E402


class StubLauncher:
    """Takes launches and runs nothing: the wrapper's own work is what is timed."""

    device_type = "cpu"

    def kernel(self, file: str, name: str):
        return lambda *args, **kwargs: None

    def pointer(self, t):
        return t.data_ptr() if isinstance(t, torch.Tensor) else t


def per_call_us(fn, calls: int) -> float:
    for _ in range(100):
        fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    blocks, block, heads, dim, tokens = 64, 16, 8, 128, 256
    f16 = dict(dtype=torch.float16)
    layers = [torch.zeros(blocks, block, heads, 2 * dim, **f16) for _ in range(args.layers)]
    chunk = torch.zeros(2, args.layers, tokens, heads, dim, **f16)
    one = torch.zeros(2, 1, tokens, heads, dim, **f16)
    slots = torch.randperm(blocks * block)[:tokens]
    launcher = StubLauncher()
    prepared = kv_copy.VllmLayers(launcher, layers)
    checked = per_call_us(lambda: kv_copy.chunk_to_paged_vllm(
        launcher, chunk, layers, slots, check=False), args.calls)
    whole = per_call_us(lambda: kv_copy.chunk_to_paged_vllm(
        launcher, chunk, prepared, slots, check=False), args.calls)
    mid = args.layers // 2
    checked_one = per_call_us(lambda: kv_copy.chunk_to_paged_vllm(
        launcher, one, layers[mid : mid + 1], slots, check=False), args.calls)
    single = per_call_us(lambda: kv_copy.chunk_to_paged_vllm(
        launcher, one, prepared, slots, check=False, layer=mid), args.calls)
    print(f"vLLM layout chunk_to_paged, {args.layers} layers, launch stubbed: host time per "
          f"call {checked:.1f} us with the layers checked each call vs {whole:.1f} us prepared "
          f"once: checked/prepared = {checked / whole:.1f}x")
    print(f"vLLM layout chunk_to_paged, one layer (layer-wise), launch stubbed: host time per "
          f"call {checked_one:.1f} us with it checked each call vs {single:.1f} us prepared "
          f"once: checked/prepared = {checked_one / single:.1f}x")


if __name__ == "__main__":
    main()
