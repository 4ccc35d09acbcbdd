"""Run as a script, in a process with AddressSanitizer preloaded (test_transfer.py): native
paged copies with an ASan build of transfer.c at the edges of exactly sized buffers, checked
against torch; prints "native copies clean"."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lmkv import cc, ops_torch, transfer


def main(build_dir: str) -> None:
    flags = ("-fsanitize=address", "-fno-omit-frame-pointer")
    lib = transfer.load(cc.build("cc", transfer.SOURCE, Path(build_dir), flags, libs=("-lpthread",)))
    transfer.library = lambda: lib
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    for layers, blocks, bs, heads, dim, t in ((2, 5, 4, 1, 8, 20), (8, 100, 16, 3, 40, 1536)):
        kv = torch.randn(layers, 2, blocks, bs, heads, dim, generator=g).half()
        n = blocks * bs
        for slots in (torch.arange(n - t, n), torch.randperm(n, generator=g)[:t], torch.arange(t).flip(0)):
            for skip in (0, 1, t - 1, t):
                chunk = torch.randn(2, layers, t, heads, dim, generator=g).half()
                mine, theirs = kv.clone(), kv.clone()
                assert transfer.copy(mine, slots, chunk, skip, to_paged=True)
                ops_torch.chunk_to_paged(chunk, theirs, slots, skip)
                assert torch.equal(mine, theirs)
                back, want = torch.zeros_like(chunk), torch.zeros_like(chunk)
                assert transfer.copy(mine, slots, back, skip, to_paged=False)
                ops_torch.paged_to_chunk(theirs, slots, want, skip)
                assert torch.equal(back, want)
    print("native copies clean")


if __name__ == "__main__":
    main(sys.argv[1])
