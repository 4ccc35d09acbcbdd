"""Gather/scatter between paged memory and chunks equals plain indexing."""

from __future__ import annotations

import pytest
import torch

from lmkv import ops


@pytest.mark.parametrize("trial", range(12))
def test_gather_scatter_match_plain_indexing(trial):
    g = torch.Generator().manual_seed(trial)
    layers, heads, dim, bs, tokens = 3, 2, 8, 4, 12
    kv = torch.randn(layers, 2, 20, bs, heads, dim, generator=g)
    if trial % 2:  # whole blocks (the fast path)
        blocks = torch.randperm(20, generator=g)[:3]
        slots = (blocks[:, None] * bs + torch.arange(bs)).flatten()
    else:  # arbitrary slots
        slots = torch.randperm(80, generator=g)[:tokens]
    skip = trial % 7
    chunk = torch.full((2, layers, tokens, heads, dim), 7.0)
    ops.paged_to_chunk(kv, slots, chunk, skip)
    want = kv.flatten(2, 3)[:, :, slots].transpose(0, 1)
    assert torch.equal(chunk[:, :, skip:], want[:, :, skip:])
    assert chunk[:, :, :skip].eq(7).all()  # skipped tokens untouched

    out = torch.zeros_like(kv)
    src = torch.randn(2, layers, tokens, heads, dim, generator=g)
    ops.chunk_to_paged(src, out, slots, skip)
    flat = out.flatten(2, 3)
    assert torch.equal(flat[:, :, slots[skip:]], src[:, :, skip:].transpose(0, 1))
    untouched = torch.ones(80, dtype=torch.bool)
    untouched[slots[skip:]] = False
    assert flat[:, :, untouched].eq(0).all()
