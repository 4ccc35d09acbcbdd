"""lmkv.ops on CPU tensors: the torch paths (the kernels' references) against plain indexing."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from lmkv import ops
from lmkv import ops_torch as attention

gen = torch.Generator().manual_seed(0)


def _engine_cache(layers=3, blocks=6, block_size=4, heads=2, dim=8, dtype=torch.float32):
    return torch.randn(layers, 2, blocks, block_size, heads, dim, generator=gen).to(dtype)


@pytest.mark.parametrize("skip", [0, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_to_chunk_matches_indexing(skip, dtype):
    kv = _engine_cache(dtype=dtype)
    slots = torch.randperm(24, generator=gen)[:7]
    chunk = torch.full((2, 3, 7, 2, 8), 7.0, dtype=dtype)
    ops.paged_to_chunk(kv, slots, chunk, skip)
    for layer in range(3):
        for t in range(7):
            block, offset = divmod(int(slots[t]), 4)
            for kv_index in range(2):
                want = kv[layer, kv_index, block, offset] if t >= skip else torch.full((2, 8), 7.0)
                assert torch.equal(chunk[kv_index, layer, t], want.to(dtype))


@pytest.mark.parametrize("skip", [0, 2])
def test_chunk_round_trip(skip):
    kv = _engine_cache()
    slots = torch.randperm(24, generator=gen)[:5]
    chunk = torch.randn(2, 3, 5, 2, 8, generator=gen)
    target = torch.zeros_like(kv)
    ops.chunk_to_paged(chunk, target, slots, skip)
    back = torch.zeros_like(chunk)
    ops.paged_to_chunk(target, slots, back, skip)
    assert torch.equal(back[:, :, skip:], chunk[:, :, skip:])
    assert not back[:, :, :skip].any()
    written = target.flatten(2, 3)[:, :, slots[skip:]]
    assert int((target != 0).sum()) == written.numel()


def test_vllm_layout_matches_engine_layout():
    kv = _engine_cache()  # [L, 2, NB, BS, H, D]
    vllm = [torch.cat([kv[layer, 0], kv[layer, 1]], dim=-1) for layer in range(3)]  # [.., H, 2D]
    slots = torch.randperm(24, generator=gen)[:9]
    a, b = torch.zeros(2, 3, 9, 2, 8), torch.zeros(2, 3, 9, 2, 8)
    ops.paged_to_chunk(kv, slots, a, 1)
    ops.paged_to_chunk_vllm(vllm, slots, b, 1)
    assert torch.equal(a, b)
    back = [torch.zeros_like(v) for v in vllm]
    ops.chunk_to_paged_vllm(a, back, slots, 1)
    for layer in range(3):
        flat, want = back[layer].view(-1, 2, 16), vllm[layer].view(-1, 2, 16)
        assert torch.equal(flat[slots[1:]], want[slots[1:]])
        assert int((flat != 0).any(-1).any(-1).sum()) == 8


@pytest.mark.parametrize("slots", [[-4, -3, -2, -1], [0, -1, 2, 3]])
def test_negative_slots_are_refused_not_taken_from_the_end(slots):
    """The torch copies (what runs without the native ones) refuse a negative slot as those
    do: torch's indexing took -1 for the last block or row, another sequence's page."""
    kv, vllm = _engine_cache(), [torch.zeros(6, 4, 2, 16) for _ in range(3)]
    before = kv.clone()
    chunk = torch.ones(2, 3, 4, 2, 8)
    slots = torch.tensor(slots)
    for copy in (lambda: attention.chunk_to_paged(chunk, kv, slots),
                 lambda: attention.paged_to_chunk(kv, slots, chunk),
                 lambda: attention.chunk_to_paged_vllm(chunk, vllm, slots),
                 lambda: attention.paged_to_chunk_vllm(vllm, slots, chunk)):
        with pytest.raises(IndexError, match="negative"):
            copy()
    assert torch.equal(kv, before) and not any(v.any() for v in vllm)
    attention.chunk_to_paged(chunk, kv, torch.tensor([-1, 5, 6, 7]), skip=1)  # skipped: unread


def _hf_rope(x, positions, inv_freq):
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def test_rerotate_keys_moves_positions_for_all_layers():
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    raw = torch.randn(4, 6, 2, 16, generator=gen)  # [L, T, H, D]
    old, new = torch.arange(6), torch.arange(6) + 40
    keys = torch.stack([_hf_rope(r, old, inv_freq) for r in raw])
    assert ops.rerotate_keys(keys, new - old, inv_freq) is keys
    want = torch.stack([_hf_rope(r, new, inv_freq) for r in raw])
    assert torch.allclose(keys, want, atol=1e-5)


def test_reshape_and_cache_and_attention_dispatch_to_engine():
    kv_layer = torch.zeros(2, 4, 4, 2, 8)
    key, value = torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen)
    slots = torch.tensor([0, 1, 2, -1, 5, 6])
    ops.reshape_and_cache(key, value, kv_layer, slots)
    want = torch.zeros_like(kv_layer)
    attention.reshape_and_cache(key, value, want, slots)
    assert torch.equal(kv_layer, want)
    tables, lens = torch.tensor([[0, 1]]), torch.tensor([7])
    q = torch.randn(1, 4, 8, generator=gen)
    out = torch.full_like(q, float("nan"))
    got = ops.paged_attention_decode(q, kv_layer, tables, lens, 0.3, out=out)
    assert got is out
    # a step with few queries per sequence runs in C (lmkv.cpu_attention, where a compiler
    # is): the reference's result up to float32 rounding
    close = dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out, attention.paged_attention_decode(q, kv_layer, tables, lens, 0.3),
                               **close)
    qp, starts = torch.randn(3, 4, 8, generator=gen), torch.tensor([0, 3])
    torch.testing.assert_close(
        ops.paged_attention_prefill(qp, kv_layer, tables, lens, starts, 0.3),
        attention.paged_attention_prefill(qp, kv_layer, tables, lens, starts, 0.3), **close,
    )


def test_import_stays_light():
    code = (
        "import sys, lmkv, lmkv.ops;"
        "print('cupy' in sys.modules, 'lmkv_cuda.launcher' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.split() == ["False", "False"]


def test_attention_without_a_kernel_for_its_shape_warns_once_and_runs_torch(caplog, monkeypatch):
    class Launcher:  # a device's launcher whose kernels take head_dim 64 / 128 only
        device_type = "cpu"

    monkeypatch.setattr(ops, "_UNSUPPORTED", set())
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 24, generator=gen)
    kv = torch.randn(2, 4, 16, 2, 24, generator=gen)
    tables, lens = torch.tensor([[0, 1], [2, 3]]), torch.tensor([20, 5])
    with caplog.at_level(logging.WARNING, logger="lmkv.ops"):
        out = [ops.paged_attention_decode(query, kv, tables, lens, 0.2, launcher=Launcher())
               for _ in range(2)]
    assert sum("no attention kernel for head_dim 24" in r.getMessage() for r in caplog.records) == 1
    want = attention.paged_attention_decode(query, kv, tables, lens, 0.2)
    for got in out:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
