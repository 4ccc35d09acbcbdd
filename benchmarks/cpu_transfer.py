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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_kv_work_args, best, check_kv_work_args  # noqa: E402
from lmkv_ttft import memcpy_gbps  # noqa: E402

from lmkv import ops_torch, transfer  # noqa: E402

BLOCK = 16
DTYPES = {"float16": torch.float16, "float32": torch.float32}


def copies(paged: torch.Tensor, bufs: list[torch.Tensor], spans: list[torch.Tensor], to_paged: bool,
           native: bool, streaming: bool = True):
    """A function copying every chunk buffer to (or from) its slots: natively (with plain
    stores where ``streaming`` is off: every copy below the threshold) or with torch."""
    def run() -> None:
        saved = transfer.STREAM_BYTES
        transfer.STREAM_BYTES = saved if streaming else 1 << 62
        try:
            for buf, slots in zip(bufs, spans, strict=True):
                if native:
                    assert transfer.copy(paged, slots, buf, 0, to_paged)
                elif to_paged:
                    ops_torch.chunk_to_paged(buf, paged, slots)
                else:
                    ops_torch.paged_to_chunk(paged, slots, buf)
        finally:
            transfer.STREAM_BYTES = saved
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_kv_work_args(ap, BLOCK)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    args = ap.parse_args()
    check_kv_work_args(ap, args)
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
        outs = [torch.empty_like(c) for c in chunks]
        spans = [slots[i : i + chunk] for i in range(0, n, chunk)]
        nbytes = sum(c.numel() * c.element_size() for c in chunks)
        memcpy = memcpy_gbps(nbytes)
        for what, bufs, written in (("load", chunks, [paged]), ("save", outs, outs)):
            to_paged = what == "load"
            native, plain = (copies(paged, bufs, spans, to_paged, mode) for mode in (True, False))
            native()
            mine = [t.clone() for t in written]
            plain()
            assert all(torch.equal(a, b) for a, b in zip(mine, written, strict=True)), \
                f"{name} {what}: native and torch copies differ"
            a, b = (nbytes / best(run, args.repeats) / 1e9 for run in (native, plain))
            print(f"{name} {nbytes / 1e6:.0f} MB, {what} (chunk {'->' if to_paged else '<-'} "
                  f"paged): native {a:.2f} GB/s vs torch {b:.2f} GB/s: native/torch = {a / b:.2f}x")
            if to_paged:
                print(f"{name} {nbytes / 1e6:.0f} MB, load: native {a:.2f} GB/s vs memcpy "
                      f"{memcpy:.2f} GB/s: native/memcpy = {a / memcpy:.2f}x")
        # loads into pages written just before (lmcache_compare zeroes them before each
        # retrieve): their lines sit dirty in the caches; and the native copy with plain stores
        def zero(paged=paged, blocks=order):
            paged[:, :, blocks] = 0

        runs = [copies(paged, chunks, spans, True, True), copies(paged, chunks, spans, True, True, False),
                copies(paged, chunks, spans, True, False)]
        for state, before in (("as they are", None), ("just zeroed", zero)):
            a, c, b = (nbytes / best(run, args.repeats, before) / 1e9 for run in runs)
            print(f"{name} {nbytes / 1e6:.0f} MB, load into pages {state}: native {a:.2f} GB/s "
                  f"(with plain stores {c:.2f}) vs torch {b:.2f} GB/s: native/torch = {a / b:.2f}x")


if __name__ == "__main__":
    main()
