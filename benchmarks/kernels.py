"""Times lmkv's CUDA kernels against the torch path on the same GPU, in one run.

    python benchmarks/kernels.py [--peak-gbps GBPS] [--iters 50]

For each kernel it prints the bytes the kernel must move (see docs/kernels.md), the achieved
GB/s, the fraction of the HBM floor (bytes / peak bandwidth; the peak is measured first, a
device-to-device copy of 2 GiB counting bytes read and written, unless --peak-gbps gives
one) and the torch path's time as a ratio. Shapes:
Llama-3-8B (32 layers, 8 KV heads, 32 query heads, head_dim 128, bf16). Kernels run with
check=False (no index-check sync), as a per-step caller would.

Then lmkv's transfers between a pinned host chunk and paged device memory, the issue's
"paged <-> pinned" figure, each as a fraction of a plain pinned host<->device copy of the same
bytes: staged (the chunk copied whole to a device buffer, then the transfer kernel; what
lmkv's paged memory does) and mapped (the kernel reads or writes the pinned chunk in place
over the link, through its unified address).

Without a CUDA GPU it says so and exits 0. ``--emulate`` runs the same plumbing on tiny shapes
under the CPU emulator (for testing this script; its timings mean nothing).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmkv import ops_torch
from lmkv import ops_torch as engine_attention
from lmkv.paged import BlockPagedMemory
from lmkv_cuda import attention, kv_copy, rope


@dataclass(frozen=True, slots=True)
class Geometry:
    layers: int = 32
    kv_heads: int = 8
    q_heads: int = 32
    head_dim: int = 128
    chunk_tokens: int = 256
    decode_batch: int = 64
    decode_len: int = 4096
    prefill_tokens: int = 4096
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16

    @property
    def elem(self) -> int:
        return torch.finfo(self.dtype).bits // 8


TINY = Geometry(layers=2, kv_heads=2, q_heads=4, head_dim=64, chunk_tokens=24, decode_batch=2,
                decode_len=40, prefill_tokens=24)  # fmt: skip


REPS = 5


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    bytes_moved: int
    flops: int
    kernel: Callable[[], object]
    torch_path: Callable[[], object]


def _timer(device: torch.device, iters: int) -> Callable[[Callable[[], object]], float]:
    # Each sample: flush L2 (50 MB on H100) by overwriting a larger buffer, then one call timed
    # with events (every call starts cold: a chunk transfer's 34 MB would otherwise sit in L2
    # for the calls after the first); REPS samples per iteration.
    scratch = (
        torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None
    )

    def measure(fn: Callable[[], object]) -> float:  # median seconds per call
        fn()
        samples = []
        for _ in range(iters):
            if scratch is not None:
                for _ in range(REPS):
                    scratch.zero_()
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn()
                    end.record()
                    end.synchronize()
                    samples.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t)
        return statistics.median(samples)

    return measure


def build_cases(g: Geometry, launcher: object, device: torch.device) -> list[Case]:
    torch.manual_seed(0)
    e, row = g.elem, g.kv_heads * g.head_dim * g.elem
    new = dict(dtype=g.dtype, device=device)
    t = g.chunk_tokens
    pool = 16 * t // g.block_size  # blocks per layer for the transfers: slots scattered in it
    kv_cache = torch.randn(g.layers, 2, pool, g.block_size, g.kv_heads, g.head_dim, **new)
    chunk = torch.empty(2, g.layers, t, g.kv_heads, g.head_dim, **new)
    slots = torch.randperm(pool * g.block_size, device=device)[:t]
    vllm = [
        torch.randn(pool, g.block_size, g.kv_heads, 2 * g.head_dim, **new) for _ in range(g.layers)
    ]
    vllm_layers = kv_copy.VllmLayers(launcher, vllm)
    transfer = 2 * 2 * g.layers * t * row  # K and V, read once and written once

    num_blocks = max(g.decode_batch * -(-g.decode_len // g.block_size),
                     -(-g.prefill_tokens // g.block_size)) + 1
    kv_layer = torch.randn(2, num_blocks, g.block_size, g.kv_heads, g.head_dim, **new)
    key = torch.randn(g.prefill_tokens, g.kv_heads, g.head_dim, **new)
    value = torch.randn(g.prefill_tokens, g.kv_heads, g.head_dim, **new)  # K and V apart
    prefill_slots = torch.randperm(num_blocks * g.block_size, device=device)[: g.prefill_tokens]

    delta = torch.randint(-4096, 4096, (t,), device=device)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, g.head_dim, 2, device=device) / g.head_dim))
    keys = chunk[0]

    blocks_per_seq = -(-g.decode_len // g.block_size)
    # scattered pages, as a serving engine's block tables are
    tables = torch.randperm(num_blocks, device=device)[: g.decode_batch * blocks_per_seq]
    tables = tables.to(torch.int32).view(g.decode_batch, blocks_per_seq)
    lens = torch.full((g.decode_batch,), g.decode_len, device=device, dtype=torch.int32)
    query = torch.randn(g.decode_batch, g.q_heads, g.head_dim, **new)
    decode_kv = g.decode_batch * g.decode_len * row * 2
    scale = g.head_dim**-0.5

    pt = g.prefill_tokens
    p_tables = torch.arange(-(-pt // g.block_size), device=device, dtype=torch.int32)[None]
    p_lens = torch.tensor([pt], device=device, dtype=torch.int32)
    p_starts = torch.tensor([0, pt], device=device, dtype=torch.int32)
    p_query = torch.randn(pt, g.q_heads, g.head_dim, **new)
    causal_pairs = pt * (pt + 1) // 2

    def extend(n: int) -> Case:
        """n new queries at the end of a pt-token sequence (an extend, a short chunk): where
        the kernel (CUDA cores) and torch's fused attention (tensor cores) cross over."""
        starts = torch.tensor([0, n], device=device, dtype=torch.int32)
        q = p_query[:n]
        return Case(f"prefill q={n} over {pt}", 2 * pt * row + 2 * n * g.q_heads * g.head_dim * e,
                    4 * n * pt * g.q_heads * g.head_dim,
                    lambda: attention.paged_attention_prefill(
                        launcher, q, kv_layer, p_tables, p_lens, starts, scale, check=False),
                    lambda: engine_attention.paged_attention_prefill(
                        q, kv_layer, p_tables, p_lens, starts, scale))  # fmt: skip

    def decode(name: str, **variant) -> Case:
        return Case(name, decode_kv, 4 * g.decode_batch * g.decode_len * g.q_heads * g.head_dim,
                    lambda: attention.paged_attention_decode(
                        launcher, query, kv_layer, tables, lens, scale, check=False, **variant),
                    lambda: engine_attention.paged_attention_decode(query, kv_layer, tables, lens, scale))

    return [
        Case("paged_to_chunk", transfer, 0,
             lambda: kv_copy.paged_to_chunk(launcher, kv_cache, slots, chunk, check=False),
             lambda: ops_torch.paged_to_chunk(kv_cache, slots, chunk)),
        Case("chunk_to_paged", transfer, 0,
             lambda: kv_copy.chunk_to_paged(launcher, chunk, kv_cache, slots, check=False),
             lambda: ops_torch.chunk_to_paged(chunk, kv_cache, slots)),
        Case("paged_to_chunk_vllm", transfer, 0,  # layers checked once, as DevicePagedMemory does
             lambda: kv_copy.paged_to_chunk_vllm(launcher, vllm_layers, slots, chunk, check=False),
             lambda: ops_torch.paged_to_chunk_vllm(vllm, slots, chunk)),
        Case("chunk_to_paged_vllm", transfer, 0,
             lambda: kv_copy.chunk_to_paged_vllm(launcher, chunk, vllm_layers, slots, check=False),
             lambda: ops_torch.chunk_to_paged_vllm(chunk, vllm, slots)),
        Case("reshape_and_cache", 2 * 2 * pt * row, 0,
             lambda: kv_copy.reshape_and_cache(
                 launcher, key, value, kv_layer, prefill_slots, check=False),
             lambda: engine_attention.reshape_and_cache(key, value, kv_layer, prefill_slots)),
        Case("rerotate_keys", 2 * g.layers * t * row, 0,
             lambda: rope.rerotate_keys(launcher, keys, delta, inv_freq),
             lambda: ops_torch.rerotate_keys(keys, delta, inv_freq)),
        decode("paged_attention_decode"),  # the engine's choice (kernel "auto")
        *(decode(f"decode, kernel {k}", kernel=k) for k in ("warps", "warps_lean", "tiles")
          if k != attention.decode_kernel(g.q_heads // g.kv_heads)),
        Case("paged_attention_prefill", 2 * pt * row + 2 * pt * g.q_heads * g.head_dim * e,
             4 * causal_pairs * g.q_heads * g.head_dim,
             lambda: attention.paged_attention_prefill(
                 launcher, p_query, kv_layer, p_tables, p_lens, p_starts, scale, check=False),
             lambda: engine_attention.paged_attention_prefill(
                 p_query, kv_layer, p_tables, p_lens, p_starts, scale)),
        *(extend(n) for n in (1, 4, 16, 64, 256) if n < pt),
    ]  # fmt: skip


def _mapped(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor on ``device`` over the pinned ``host`` memory: under unified addressing the
    device reaches pinned host memory at its host address. The CPU emulator: ``host``."""
    if device.type != "cuda":
        return host
    import cupy

    nbytes = host.numel() * host.element_size()
    mem = cupy.cuda.UnownedMemory(host.data_ptr(), nbytes, host, device.index)
    raw = cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(mem, 0))
    return torch.from_dlpack(raw).view(host.dtype).view(host.shape)


def transfer_lines(g: Geometry, launcher: object, device: torch.device,
                   measure: Callable[[Callable[[], object]], float]) -> list[str]:
    """One chunk of ``g`` between pinned host memory and scattered pages on ``device``."""
    torch.manual_seed(0)
    t = g.chunk_tokens
    pool = 16 * t // g.block_size
    kv_cache = torch.randn(g.layers, 2, pool, g.block_size, g.kv_heads, g.head_dim,
                           dtype=g.dtype, device=device)
    slots = torch.randperm(pool * g.block_size)[:t]
    host = torch.randn(2, g.layers, t, g.kv_heads, g.head_dim, dtype=g.dtype)
    host = host.pin_memory() if device.type == "cuda" else host
    dev_buf = torch.empty(host.shape, dtype=g.dtype, device=device)
    paged = BlockPagedMemory(kv_cache, launcher)
    dev_slots = slots.to(device)
    nbytes = host.numel() * host.element_size()
    try:
        mapped, why = _mapped(host, device), ""
    except Exception as e:  # noqa: BLE001 - reported, the other lines still run
        mapped, why = None, f"{type(e).__name__}: {e}"
    lines = []
    for direction, copy, staged, in_place in (
        ("host->device", lambda: dev_buf.copy_(host, non_blocking=True),
         lambda: paged.load(host, slots),
         lambda: kv_copy.chunk_to_paged(launcher, mapped, kv_cache, dev_slots, check=False)),
        ("device->host", lambda: host.copy_(dev_buf, non_blocking=True),
         lambda: paged.save(slots, host),
         lambda: kv_copy.paged_to_chunk(launcher, kv_cache, dev_slots, mapped, check=False)),
    ):  # fmt: skip
        c = measure(copy)
        lines.append(f"{direction} pinned copy {nbytes / 1e6:.1f} MB: {c * 1e6:.1f} us, "
                     f"{nbytes / c / 1e9:.1f} GB/s")
        kinds = [("staged", staged)] + ([("mapped", in_place)] if mapped is not None else [])
        for kind, fn in kinds:
            k = measure(fn)
            lines.append(f"{direction} chunk<->pages {kind} {nbytes / 1e6:.1f} MB: {k * 1e6:.1f} us, "
                         f"{nbytes / k / 1e9:.1f} GB/s: {kind}/copy = {c / k:.2f}x")
        if mapped is None:
            lines.append(f"{direction} chunk<->pages mapped: not available ({why})")
    return lines


def copy_gbps(device: torch.device) -> float:
    """HBM bandwidth as a plain copy reaches it: 2 GiB copied on the device (median of 20),
    counting bytes read plus bytes written."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device=device).random_(256)
    dst = torch.empty_like(src)
    seconds = _timer(device, 4)(lambda: dst.copy_(src))
    return 2 * src.numel() / seconds / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak-gbps", type=float, help="HBM bandwidth of the GPU (default: measured)")
    parser.add_argument("--peak-tflops", type=float, default=67.0, help="FP32 (CUDA core) peak")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds over all cases; each line reports the best round's median")
    parser.add_argument("--emulate", action="store_true", help="tiny shapes on the CPU emulator")
    args = parser.parse_args(argv)
    if args.emulate:
        from lmkv_cuda.emu import EmuLauncher

        device, launcher, geometry, iters = torch.device("cpu"), EmuLauncher(), TINY, 2
        args.rounds = 1
        args.peak_gbps = args.peak_gbps or 3350.0
        print("CPU emulator: checks the plumbing only, the timings mean nothing")
    elif not torch.cuda.is_available():
        print("no CUDA GPU present: nothing to time (kernels are tested on CPU under tests/cuda)")
        return 0
    else:
        from lmkv_cuda.launcher import gpu_launcher

        device = torch.device("cuda", torch.cuda.current_device())
        launcher = gpu_launcher(device.index)
        if launcher is None:
            return 1
        geometry, iters = Geometry(), args.iters
        if args.peak_gbps is None:
            args.peak_gbps = copy_gbps(device)
            how = "measured: a device-to-device copy of 2 GiB, bytes read + written"
        else:
            how = "given"
        print(f"{torch.cuda.get_device_name(device)}; floor = bytes / {args.peak_gbps:.0f} GB/s ({how})")
    measure = _timer(device, iters)
    cases = build_cases(geometry, launcher, device)
    best: dict[str, tuple[float, float]] = {}
    for _ in range(args.rounds):  # every case once per round: drifts hit all cases alike
        for case in cases:
            k, t = measure(case.kernel), measure(case.torch_path)
            old = best.get(case.name, (k, t))
            best[case.name] = (min(k, old[0]), min(t, old[1]))
    for case in cases:
        k, t = best[case.name]
        gbps = case.bytes_moved / k / 1e9
        line = (
            f"{case.name:24s} {case.bytes_moved / 1e6:9.1f} MB  kernel {k * 1e6:9.1f} us "
            f"{gbps:7.0f} GB/s {gbps / args.peak_gbps:5.2f} of HBM floor"
        )
        if case.flops:
            tflops = case.flops / k / 1e12
            line += f"  {tflops:6.1f} TFLOP/s ({tflops / args.peak_tflops:4.2f} of FP32 peak)"
        print(f"{line}  torch {t * 1e6:9.1f} us  torch/kernel {t / k:6.2f}x")
    for line in transfer_lines(geometry, launcher, device, measure):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
