"""Decode attention on the CPU, native (lmkv/attention.c, lmkv.cpu_attention) vs the torch
reference (lmkv.ops_torch: gather the sequence's pages, then scaled_dot_product_attention),
on the same pages in one run.

SmolLM2-135M-Instruct's attention shape by default (30 layers, 9 query heads, 3 KV heads,
head_dim 64, blocks of 16 tokens), each layer's pages a tensor of its own (together larger
than the caches, as in an engine), and a small matrix product before each layer's attention
(an engine's projections, which leave torch's threads busy for a moment; the native code
runs on the calling thread). Lines:
- one sequence of --context keys with 1, 2, 4 and 8 new queries (a decode step, short
  extends): where the native code stops paying (lmkv.cpu_attention.ROWS);
- a decode batch of --batch sequences of --context / 4 keys.
Per dtype (float32, bfloat16); each figure is the best of --repeats over all layers, every
result checked against the other path's. Lines end with torch/native.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import best  # noqa: E402

from lmkv import cpu_attention, ops_torch  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    a = ap.parse_args()
    if cpu_attention.library() is None:
        raise SystemExit("no native CPU attention here (no C compiler, or LMKV_NATIVE_ATTENTION=0)")
    cpu_attention.ROWS = 1 << 30  # time every case natively, the crossover included
    g = torch.Generator().manual_seed(0)
    bs, per_seq = a.block, -(-a.context // a.block)
    blocks = max(per_seq, a.batch * -(-per_seq // 4))
    w, x = torch.randn(576, 576, generator=g), torch.randn(8, 576, generator=g)
    scale = a.head_dim**-0.5
    print(f"{a.layers} layers, {a.heads} query heads, {a.kv_heads} KV heads, head_dim {a.head_dim}, "
          f"blocks of {bs}, {torch.get_num_threads()} torch threads; best of {a.repeats}")
    for name, dtype in ((n, DTYPES[n]) for n in a.dtypes):
        layers = [torch.randn(2, blocks, bs, a.kv_heads, a.head_dim, generator=g).to(dtype)
                  for _ in range(a.layers)]
        one = torch.randperm(blocks, generator=g)[:per_seq][None]
        many = torch.randperm(blocks, generator=g)[: a.batch * -(-per_seq // 4)].view(a.batch, -1)
        cases = [(f"{nq} new quer{'y' if nq == 1 else 'ies'} over {a.context} keys", one,
                  torch.tensor([a.context]), torch.tensor([0, nq])) for nq in (1, 2, 4, 8)]
        cases.append((f"decode batch of {a.batch} x {a.context // 4} keys", many,
                      torch.full((a.batch,), a.context // 4), torch.arange(a.batch + 1)))
        for what, tables, lens, starts in cases:
            q = torch.randn(int(starts[-1]), a.heads, a.head_dim, generator=g).to(dtype)
            outs: dict[str, list[torch.Tensor]] = {"native": [], "torch": []}

            def run(native: bool, outs=outs, q=q, tables=tables, lens=lens, starts=starts,
                    layers=layers) -> None:
                key = "native" if native else "torch"
                outs[key] = []
                for kv in layers:
                    x @ w  # noqa: B018 - the engine's projections before its attention
                    if native:
                        outs[key].append(cpu_attention.attention(q, kv, tables, lens, starts, scale))
                    else:
                        outs[key].append(ops_torch.paged_attention_prefill(q, kv, tables, lens, starts,
                                                                           scale))

            t_native, t_torch = best(lambda: run(True), a.repeats), best(lambda: run(False), a.repeats)
            tol = 1e-4 if dtype == torch.float32 else 2e-2
            for mine, ref in zip(outs["native"], outs["torch"], strict=True):
                torch.testing.assert_close(mine.float(), ref.float(), atol=tol, rtol=tol)
            print(f"{name}, {what}: native {t_native * 1e3:.1f} ms vs torch {t_torch * 1e3:.1f} ms "
                  f"for {a.layers} layers: torch/native = {t_torch / t_native:.2f}x")


if __name__ == "__main__":
    main()
