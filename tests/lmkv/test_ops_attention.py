"""Paged attention equals dense attention over the same keys and values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmkv.ops_torch import (
    paged_attention_decode,
    paged_attention_prefill,
    reshape_and_cache,
)


def _scatter_sequences(seq_lens, hkv, d, block_size, num_blocks, gen):
    """Random K/V per sequence written into shuffled pages; returns (kv_layer, tables, kvs)."""
    # finite poison: a read of any unwritten slot shifts the result far beyond tolerance
    kv_layer = torch.full((2, num_blocks, block_size, hkv, d), 1e4)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, kvs = [], []
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    for n in seq_lens:
        nb = -(-n // block_size)
        blocks = [perm.pop() for _ in range(nb)]
        k = torch.randn(n, hkv, d, generator=gen)
        v = torch.randn(n, hkv, d, generator=gen)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(n)])
        reshape_and_cache(k, v, kv_layer, slots)
        tables.append(blocks + [0] * (max_blocks - nb))
        kvs.append((k, v))
    return kv_layer, torch.tensor(tables), kvs


def _dense(q, k, v, scale):
    """q: [Tq, Hq, D] at the last Tq positions of k/v: [S, Hkv, D]."""
    tq, s = q.shape[0], k.shape[0]
    mask = torch.arange(s)[None, :] <= torch.arange(s - tq, s)[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=True,
    )
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 1), (8, 2)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_matches_dense(hq, hkv, block_size):
    gen = torch.Generator().manual_seed(0)
    seq_lens = [1, 15, 16, 17, 100]
    kv_layer, tables, kvs = _scatter_sequences(seq_lens, hkv, 64, block_size, 200, gen)
    q = torch.randn(len(seq_lens), hq, 64, generator=gen)
    out = paged_attention_decode(q, kv_layer, tables, torch.tensor(seq_lens), 0.125)
    for i, (k, v) in enumerate(kvs):
        torch.testing.assert_close(out[i], _dense(q[i : i + 1], k, v, 0.125)[0])


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_prefill_and_extend_match_dense(hq, hkv):
    gen = torch.Generator().manual_seed(1)
    seq_lens = [5, 33, 64, 70, 80]
    q_lens = [5, 1, 20, 70, 50]  # full prefill, single token, short extend, full, long extend
    kv_layer, tables, kvs = _scatter_sequences(seq_lens, hkv, 64, 16, 64, gen)
    q = torch.randn(sum(q_lens), hq, 64, generator=gen)
    loc = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist())
    out = paged_attention_prefill(q, kv_layer, tables, torch.tensor(seq_lens), loc, 0.125)
    for i, (k, v) in enumerate(kvs):
        lo, hi = int(loc[i]), int(loc[i + 1])
        torch.testing.assert_close(out[lo:hi], _dense(q[lo:hi], k, v, 0.125))


def test_reshape_and_cache_skips_negative_slots():
    kv_layer = torch.zeros(2, 4, 4, 1, 8)
    k = torch.ones(3, 1, 8)
    v = torch.full((3, 1, 8), 2.0)
    reshape_and_cache(k, v, kv_layer, torch.tensor([0, -1, 5]))
    flat = kv_layer.view(2, 16, 1, 8)
    assert flat[0, [0, 5]].eq(1).all() and flat[1, [0, 5]].eq(2).all()
    assert flat[:, [1, 2, 3, 4, 6]].eq(0).all()
