"""lmkv's paged copies on the CPU, native (lmkv/transfer.c) vs torch (lmkv.ops_torch), on the
same chunks in one run.

A prompt of --tokens tokens in chunks of --chunk, Llama-3.2-1B's KV shape by default (16
layers, 8 KV heads, head_dim 64), copied chunk by chunk between contiguous chunk buffers and
paged memory [L, 2, blocks, 16, Hkv, D] on shuffled whole blocks (a load, chunk -> paged,
and a save, paged -> chunk), fp16 and fp32. Each figure is the best of --repeats; every copy
is checked against the other path's. Lines end with native/torch; a line per dtype compares
the native load with the fastest plain copy of the same bytes we know
(lmkv_ttft.memcpy_gbps); two more time loads into the pages as they are and into pages
zeroed just before each load (dirty in the caches, as benchmarks/lmcache_compare.py leaves
them), with the native copy's plain-store variant beside.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lmkv_ttft import memcpy_gbps  # noqa: E402

from lmkv import ops_torch, transfer  # noqa: E402

BLOCK = 16
DTYPES = {"float16": torch.float16, "float32": torch.float32}


def best_seconds(run, repeats: int, before=None) -> float:
    """The best of ``repeats`` timed calls of ``run``, each after an untimed ``before``."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def plain_stores(run):
    """``run`` with the native copy's streaming stores off (every copy below the threshold)."""
    def go():
        saved, transfer.STREAM_BYTES = transfer.STREAM_BYTES, 1 << 62
        try:
            run()
        finally:
            transfer.STREAM_BYTES = saved
    return go


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    args = ap.parse_args()
    if args.tokens % args.chunk or args.chunk % BLOCK:
        ap.error(f"--tokens must be a multiple of --chunk, and --chunk of {BLOCK}")
    if transfer.library() is None:
        sys.exit("no native paged copies here (no C compiler, or LMKV_NATIVE_COPY=0)")
    n, chunk = args.tokens, args.chunk
    print(f"{n} tokens, chunks of {chunk}, {args.layers} layers x {args.heads} KV heads x "
          f"{args.head_dim}, paged blocks of {BLOCK} (shuffled), best of {args.repeats}; "
          f"torch threads {torch.get_num_threads()}")
    for name in args.dtypes:
        dtype = DTYPES[name]
        g = torch.Generator().manual_seed(0)
        blocks = n // BLOCK + 8
        paged = torch.randn(args.layers, 2, blocks, BLOCK, args.heads, args.head_dim, generator=g).to(dtype)
        order = torch.randperm(blocks, generator=g)[: n // BLOCK]
        slots = (order[:, None] * BLOCK + torch.arange(BLOCK)).flatten()
        chunks = [torch.randn(2, args.layers, chunk, args.heads, args.head_dim, generator=g).to(dtype)
                  for _ in range(n // chunk)]
        spans = [slots[i : i + chunk] for i in range(0, n, chunk)]
        nbytes = sum(c.numel() * c.element_size() for c in chunks)

        def load_native(paged=paged, chunks=chunks, spans=spans):
            for c, s in zip(chunks, spans, strict=True):
                assert transfer.copy(paged, s, c, 0, to_paged=True)

        def load_torch(paged=paged, chunks=chunks, spans=spans):
            for c, s in zip(chunks, spans, strict=True):
                ops_torch.chunk_to_paged(c, paged, s)

        outs = [torch.empty_like(c) for c in chunks]

        def save_native(paged=paged, outs=outs, spans=spans):
            for c, s in zip(outs, spans, strict=True):
                assert transfer.copy(paged, s, c, 0, to_paged=False)

        def save_torch(paged=paged, outs=outs, spans=spans):
            for c, s in zip(outs, spans, strict=True):
                ops_torch.paged_to_chunk(paged, s, c)

        memcpy = memcpy_gbps(nbytes)
        for what, native, plain in (("load", load_native, load_torch), ("save", save_native, save_torch)):
            native()
            mine = paged.clone() if what == "load" else [o.clone() for o in outs]
            plain()
            theirs = paged if what == "load" else outs
            same = torch.equal(mine, theirs) if what == "load" else all(
                torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
            assert same, f"{name} {what}: native and torch copies differ"
            a = nbytes / best_seconds(native, args.repeats) / 1e9
            b = nbytes / best_seconds(plain, args.repeats) / 1e9
            print(f"{name} {nbytes / 1e6:.0f} MB, {what} (chunk {'->' if what == 'load' else '<-'} "
                  f"paged): native {a:.2f} GB/s vs torch {b:.2f} GB/s: native/torch = {a / b:.2f}x")
            if what == "load":
                print(f"{name} {nbytes / 1e6:.0f} MB, load: native {a:.2f} GB/s vs memcpy "
                      f"{memcpy:.2f} GB/s: native/memcpy = {a / memcpy:.2f}x")
        # loads into pages written just before (lmcache_compare zeroes them before each
        # retrieve): their lines sit dirty in the caches; and the native copy with plain stores
        dst = order[:, None]

        def zero(paged=paged, dst=dst):
            paged[:, :, dst.flatten()] = 0

        for state, before in (("as they are", None), ("just zeroed", zero)):
            a = nbytes / best_seconds(load_native, args.repeats, before) / 1e9
            c = nbytes / best_seconds(plain_stores(load_native), args.repeats, before) / 1e9
            b = nbytes / best_seconds(load_torch, args.repeats, before) / 1e9
            print(f"{name} {nbytes / 1e6:.0f} MB, load into pages {state}: native {a:.2f} GB/s "
                  f"(with plain stores {c:.2f}) vs torch {b:.2f} GB/s: native/torch = {a / b:.2f}x")


if __name__ == "__main__":
    main()
