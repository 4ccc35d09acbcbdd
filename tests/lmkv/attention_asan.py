"""Run as a script, in a process with AddressSanitizer preloaded (test_cpu_attention.py):
native attention with an ASan build of attention.c over exactly sized pages, tables and
queries, checked against torch; prints "native attention clean"."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lmkv import cc, cpu_attention, ops_torch


def main(build_dir: str) -> None:
    flags = (*cpu_attention.build_flags(), "-fsanitize=address", "-fno-omit-frame-pointer")
    lib = cpu_attention.load(cc.build("cc", cpu_attention.SOURCE, Path(build_dir), flags, libs=("-lm",)))
    cpu_attention.library = lambda: lib
    cpu_attention.ROWS = cpu_attention.MAX_ROWS  # every shape it can take
    torch.set_num_threads(2)  # spans on two OpenMP threads, where it is built with OpenMP
    g = torch.Generator().manual_seed(0)
    for heads, kv_heads, dim, bs, dtype in ((9, 3, 64, 16, torch.float32), (2, 1, 7, 4, torch.bfloat16),
                                            (8, 8, 80, 128, torch.float16)):
        for lens, queries in (([1], [1]), ([bs * 3], [1]), ([bs * 2 + 1, 5], [2, 1]),
                              ([1100, 513, 3], [1, 2, 1])):  # several spans of 512
            blocks = sum(-(-n // bs) for n in lens)
            kv = torch.randn(2, blocks, bs, kv_heads, dim, generator=g).to(dtype)
            order = torch.randperm(blocks, generator=g).tolist()
            width = max(-(-n // bs) for n in lens)
            rows, at = [], 0
            for n in lens:
                own = order[at : at + -(-n // bs)]
                at += len(own)
                rows.append(own + [own[-1]] * (width - len(own)))
            tables = torch.tensor(rows)
            starts = torch.tensor([0, *queries]).cumsum(0)
            q = torch.randn(int(starts[-1]), heads, dim, generator=g).to(dtype)
            got = cpu_attention.attention(q, kv, tables, torch.tensor(lens), starts, 0.5)
            want = ops_torch.paged_attention_prefill(q.float(), kv.float(), tables, torch.tensor(lens),
                                                     starts, 0.5)
            assert got is not None
            assert torch.allclose(got.float(), want, atol=2e-2), (heads, dim, bs, lens)
    print("native attention clean")


if __name__ == "__main__":
    main(sys.argv[1])
