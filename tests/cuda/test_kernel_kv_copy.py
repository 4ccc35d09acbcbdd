"""kv_copy.cu under the CPU emulator vs the torch twins: bit-exact."""

from __future__ import annotations

import pytest
import torch
from emu_cases import copy_engine, copy_vllm, poison, reshape_and_cache

from lmkv_cuda import kv_copy

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("layers", "heads", "dim", "tokens", "skip"),
    [
        (3, 8, 128, 33, 0),  # 16-byte units, 4 per lane
        (2, 2, 64, 1, 0),  # one token
        (2, 1, 64, 16, 16),  # everything skipped
        (4, 3, 64, 40, 17),  # skip not a multiple of anything
        (1, 3, 6, 7, 2),  # rows of 18 elements: narrow units
    ],
)
def test_engine_layout(emu, dtype, layers, heads, dim, tokens, skip):
    assert copy_engine(emu, dtype, layers, heads, dim, tokens, skip)


@pytest.mark.parametrize("offset", [1, 2, 4])
def test_engine_layout_unaligned_chunk(emu, offset):
    assert copy_engine(emu, torch.float16, 2, 2, 64, 12, 1, chunk_offset=offset)


def test_fp8_like_bytes(emu):
    kv = torch.randint(0, 255, (2, 2, 4, 8, 1, 3), dtype=torch.uint8)
    slots = torch.tensor([5, 0, 31, 8], dtype=torch.int64)
    chunk = poison(torch.empty(2, 2, 4, 1, 3, dtype=torch.uint8))
    kv_copy.paged_to_chunk(emu, kv, slots, chunk)
    assert torch.equal(chunk, kv.flatten(2, 3)[:, :, slots].transpose(0, 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("layers", "heads", "dim", "tokens", "skip"), [(3, 4, 128, 35, 0), (2, 3, 64, 9, 4)]
)
def test_vllm_layout(emu, dtype, layers, heads, dim, tokens, skip):
    assert copy_vllm(emu, dtype, layers, heads, dim, tokens, skip)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "dim", "tokens"), [(8, 128, 20), (1, 64, 1), (3, 64, 33)])
def test_reshape_and_cache(emu, dtype, heads, dim, tokens):
    assert reshape_and_cache(emu, dtype, heads, dim, tokens)


def test_rows_with_odd_strides_of_size_one_dims_are_repacked(emu):
    """ops.reshape_and_cache takes what its torch twin takes: one KV head's keys as a
    transposed view ([T, 1, D] with stride(1) != D, which torch calls contiguous)."""
    from lmkv import ops, ops_torch

    key = torch.randn(1, 5, 64).transpose(0, 1)
    value = torch.randn(5, 1, 64)
    assert key.is_contiguous() and key.stride(1) != 64
    slots = torch.tensor([3, 0, -1, 9, 12])
    want = torch.zeros(2, 4, 4, 1, 64)
    ops_torch.reshape_and_cache(key, value, want, slots)
    got = torch.zeros(2, 4, 4, 1, 64)
    ops.reshape_and_cache(key, value, got, slots, launcher=emu)
    assert torch.equal(got, want)


def test_wrapper_rejects_bad_arguments(emu):
    kv = torch.zeros(2, 2, 4, 8, 2, 64, dtype=torch.float16)
    chunk = torch.zeros(2, 2, 3, 2, 64, dtype=torch.float16)
    slots = torch.tensor([0, 1, 32], dtype=torch.int64)  # 32 slots: [0, 32)
    with pytest.raises(ValueError, match="out of range"):
        kv_copy.paged_to_chunk(emu, kv, slots, chunk)
    kv_copy.paged_to_chunk(emu, kv, slots, chunk, skip=3)  # the bad slot is skipped: not read
    with pytest.raises(ValueError, match="negative"):
        kv_copy.chunk_to_paged(emu, chunk, kv, torch.tensor([0, -1, 2]), skip=0)
    with pytest.raises(TypeError, match="int64"):
        kv_copy.paged_to_chunk(emu, kv, slots.int(), chunk)
    with pytest.raises(ValueError, match="does not match"):
        kv_copy.paged_to_chunk(emu, kv, slots, chunk[:, :1].contiguous())
    with pytest.raises(ValueError, match="dtype"):
        kv_copy.paged_to_chunk(emu, kv, slots[:2], chunk.float()[:, :, :2].contiguous())
    with pytest.raises(ValueError, match="contiguous"):
        kv_copy.paged_to_chunk(emu, kv, slots, chunk.transpose(0, 1))
    with pytest.raises(ValueError, match="skip"):
        kv_copy.paged_to_chunk(emu, kv, slots, chunk, skip=4)
    key = torch.zeros(3, 2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="out of range"):
        kv_copy.reshape_and_cache(emu, key, key, kv[0], torch.tensor([0, 99, -1]))


def test_paged_memory_checks_host_slots_on_the_host(emu, monkeypatch):
    """Loads and saves with slots in host memory (lmkv's connector builds them there) are
    range-checked before staging, so the wrapper's check, a read-back from the device (one
    host sync per chunk on a GPU), is not asked for; a slot out of range is still refused."""
    from lmkv.paged import BlockPagedMemory

    asked = []
    real = kv_copy._check_slots
    monkeypatch.setattr(kv_copy, "_check_slots", lambda *a, **k: asked.append(1) or real(*a, **k))
    paged = BlockPagedMemory(torch.zeros(2, 2, 4, 8, 2, 64, dtype=torch.float16), emu)
    chunk = torch.randn(2, 2, 3, 2, 64).half()
    paged.load(chunk, torch.tensor([0, 9, 31]))
    back = torch.zeros_like(chunk)
    paged.save(torch.tensor([0, 9, 31]), back)
    assert torch.equal(back, chunk) and asked == []
    paged.save(torch.tensor([0, 9, 32]), back, skip=3)  # the bad slot is skipped
    for slots in (torch.tensor([0, 1, 32]), torch.tensor([0, -1, 2])):
        with pytest.raises(ValueError, match="out of range"):
            paged.load(chunk, slots)
