"""paged_attention.cu under the CPU emulator vs the engine's torch attention (fp32 reference)."""

from __future__ import annotations

import emu_cases
import pytest
import torch
from emu_cases import TOLERANCE, decode, prefill

from lmkv_cuda import attention

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.parametrize("kernel", ["warps", "warps_lean", "tiles"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize(
    ("hq", "hkv", "lens"),
    [
        (4, 4, [1, 16, 17, 45]),  # MHA (R = 1); lengths 1 and block boundaries
        (8, 1, [33, 2]),  # GQA 8:1
        (4, 2, [31]),  # GQA 2:1, rows unused in a block of 8
        (9, 3, [47, 5]),  # GQA 3:1, SmolLM2's group
        (12, 1, [40]),  # GQA 12:1: a block of 8 heads and one of 4
        (16, 1, [9, 70]),  # GQA 16:1: two blocks of 8 heads per KV head
    ],
)
def test_decode(emu, kernel, dtype, dim, hq, hkv, lens):
    assert decode(emu, dtype, dim, hq, hkv, lens, kernel=kernel) < TOLERANCE[dtype]


@pytest.mark.parametrize("kernel", ["warps", "warps_lean", "tiles"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_split_partitions(emu, kernel, dtype):
    """Flash-decoding: partitions of 48 keys (not a multiple of the block size) + merge."""
    error = decode(emu, dtype, 64, 16, 2, [1, 48, 49, 150], partition_size=48, kernel=kernel)
    assert error < TOLERANCE[dtype]


@pytest.mark.parametrize("kernel", ["warps", "warps_lean", "tiles"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128])
def test_decode_step_boundaries(emu, kernel, dtype, dim):
    """Partial last steps (a warps step is 16 keys per warp at 2-byte dtypes and D = 128, 32
    at D = 64; 8 and 16 at fp32), partitions shorter than one step per warp, block
    boundaries, split partitions and more than one tile or step per warp give the
    reference's result."""
    for lens, parts in (([1, 16, 17, 45, 63, 64, 65, 129], 512), ([300, 600], 96), ([200], 40)):
        error = decode(emu, dtype, dim, 12, 3, lens, partition_size=parts, kernel=kernel)
        assert error < TOLERANCE[dtype]


def test_auto_takes_the_lean_warps_kernel_for_small_gqa_groups_only(emu, monkeypatch):
    launched = []
    real = attention._launch
    monkeypatch.setattr(attention, "_launch", lambda *a: launched.append(a[-1]) or real(*a))
    for hq, hkv in ((4, 4), (6, 3), (8, 2), (16, 2)):
        assert decode(emu, torch.float32, 64, hq, hkv, [20]) < TOLERANCE[torch.float32]
    lean = "paged_decode_warps<{}, {}, {}, true>"
    assert launched == [None, lean, lean, None]
    # a cache of more slots than warps_lean's 32-bit lanes hold takes the plain warps kernel
    assert attention.decode_kernel(4, attention.LEAN_MAX_SLOTS) == "warps_lean"
    assert attention.decode_kernel(4, attention.LEAN_MAX_SLOTS + 1) == "warps"


def test_decode_kernel_choice_is_checked(emu):
    with pytest.raises(ValueError, match="decode kernel 'fast'"):
        decode(emu, torch.float32, 64, 16, 2, [5], kernel="fast")


@pytest.mark.parametrize("kernel", ["warps", "warps_lean", "tiles"])
def test_decode_long_context_two_tiles(emu, kernel):
    """More keys than one shared-memory tile (256) or many steps per warp inside one
    partition: online softmax."""
    error = decode(emu, torch.float32, 64, 2, 1, [600], block_size=32, kernel=kernel)
    assert error < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize(
    ("hq", "hkv", "lens", "q_lens"),
    [
        (
            2,
            2,
            [19, 40, 7],
            [19, 5, 1],
        ),  # MHA: 8 query tokens per block; prefill, extend, decode-like
        (8, 1, [20, 33], [20, 3]),  # GQA 8:1: one token per block
        (6, 2, [17, 9], [0, 9]),  # GQA 3:1 (2 tokens x 3 heads per block), an empty sequence
        (16, 1, [12], [4]),  # GQA 16:1: two blocks of 8 heads per token
    ],
)
def test_prefill(emu, dtype, dim, hq, hkv, lens, q_lens):
    assert prefill(emu, dtype, dim, hq, hkv, lens, q_lens) < TOLERANCE[dtype]


def test_prefill_long(emu):
    assert (
        prefill(emu, torch.float16, 64, 4, 4, [300], [280], block_size=32)
        < TOLERANCE[torch.float16]
    )


def test_wrapper_rejects_bad_arguments(emu):
    kv = torch.zeros(2, 4, 16, 2, 64)
    q = torch.zeros(2, 4, 64)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    run = lambda **kw: attention.paged_attention_decode(
        emu, kw.get("q", q), kw.get("kv", kv), kw.get("tables", tables),
        kw.get("lens", torch.tensor([5, 20])), 0.125,
    )  # fmt: skip
    run()
    with pytest.raises(ValueError, match="seq_lens outside"):
        run(lens=torch.tensor([0, 20]))
    with pytest.raises(ValueError, match="seq_lens outside"):
        run(lens=torch.tensor([33, 20]))
    with pytest.raises(ValueError, match="block_tables entries"):
        run(tables=torch.tensor([[0, 9], [2, 3]]), lens=torch.tensor([17, 5]))
    run(tables=torch.tensor([[0, 9], [2, 3]]), lens=torch.tensor([16, 5]))  # entry 9 unused
    with pytest.raises(ValueError, match="head_dim"):
        run(q=torch.zeros(2, 4, 32), kv=torch.zeros(2, 4, 16, 2, 32))
    with pytest.raises(ValueError, match="multiple"):
        run(q=torch.zeros(2, 3, 64))
    with pytest.raises(TypeError, match="dtype"):
        run(kv=kv.half())
    misaligned = torch.zeros(kv.numel() + 1)[1:].view(kv.shape)  # contiguous, 4 bytes off
    with pytest.raises(ValueError, match="16-byte aligned"):
        run(kv=misaligned)
    no_lens = torch.zeros(0, dtype=torch.int32)
    empty = attention.paged_attention_decode(emu, q[:0], kv, tables[:0], no_lens, 0.125)
    assert empty.shape == (0, 4, 64)
    lens, bad_starts, q3 = torch.tensor([4, 4]), torch.tensor([0, 2, 2]), torch.zeros(3, 4, 64)
    with pytest.raises(ValueError, match="query_start_loc must run"):
        attention.paged_attention_prefill(emu, q3, kv, tables, lens, bad_starts, 0.1)
    starts = torch.tensor([0, 2, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="q_len"):
        attention.paged_attention_prefill(
            emu, torch.zeros(3, 4, 64), kv, tables, torch.tensor([1, 4]), starts, 0.125
        )


def test_decode_splits_into_at_most_max_partitions(emu, monkeypatch):
    """Past MAX_PARTITIONS x partition_size keys the partitions grow instead of multiplying:
    the split's workspace stays bounded, and the result is the same attention."""
    from lmkv_cuda import attention

    monkeypatch.setattr(attention, "MAX_PARTITIONS", 2)
    launches = []
    real = attention._launch
    monkeypatch.setattr(attention, "_launch", lambda *a: launches.append(a[13]) or real(*a))  # num_partitions
    error = decode(emu, torch.float32, 64, 16, 2, [1, 48, 49, 150], partition_size=16)
    assert error < TOLERANCE[torch.float32] and launches == [2]


@pytest.mark.parametrize("kernel", ["warps", "warps_lean", "tiles"])
def test_a_decode_gives_the_same_bits_in_any_batch_and_table_width(emu, monkeypatch, kernel):
    """A sequence's split over partitions follows its own length only: next to a longer
    sequence, or over a wider block table (a CUDA graph's bucket, check off), its output is
    bit for bit the one it gets alone (the partitions grew with the batch's longest context)."""
    monkeypatch.setattr(attention, "MAX_PARTITIONS", 2)
    assert emu_cases.decode_bits_alone_and_batched(emu, kernel, partition_size=16)


def test_lean_decode_refuses_slots_past_32_bits(emu, monkeypatch):
    """warps_lean hands slots between lanes as 32-bit integers: a cache with more slots is
    refused by name (the limit lowered here to a cache of 32 slots)."""
    monkeypatch.setattr(attention, "LEAN_MAX_SLOTS", 31)
    with pytest.raises(ValueError, match="32-bit slots"):
        decode(emu, torch.float32, 64, 4, 2, [20], kernel="warps_lean")  # 2 + 3 blocks of 16
    monkeypatch.setattr(attention, "LEAN_MAX_SLOTS", 80)
    assert decode(emu, torch.float32, 64, 4, 2, [20], kernel="warps_lean") < TOLERANCE[torch.float32]
