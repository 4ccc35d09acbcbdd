"""The native paged copies (lmkv/transfer.c): the same bytes as the torch copies for every
slot pattern, view and size they take (streaming stores and threads included), nothing
written for a bad slot, and torch for what they do not take."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmkv import ops, ops_torch, transfer

CAN_BUILD = bool(shutil.which("cc") or shutil.which("gcc"))
needs_cc = pytest.mark.skipif(not CAN_BUILD, reason="no C compiler")


@pytest.fixture
def fresh_library(tmp_path, monkeypatch):
    """transfer.library() built into an empty cache dir; the process's one restored after."""
    monkeypatch.setenv("LMKV_CACHE_DIR", str(tmp_path))
    transfer.library.cache_clear()
    yield tmp_path
    transfer.library.cache_clear()


def slot_patterns(g: torch.Generator, blocks: int, bs: int, t: int) -> dict[str, torch.Tensor]:
    whole = torch.randperm(blocks, generator=g)[: -(-t // bs)]
    return {
        "whole blocks": (whole[:, None] * bs + torch.arange(bs)).flatten()[:t],
        "scattered": torch.randperm(blocks * bs, generator=g)[:t],
        "one run across blocks": torch.arange(bs // 2, bs // 2 + t),  # consecutive slots, block edges inside
        "a run, then singles": torch.cat([torch.arange(3, 3 + t // 2), 3 + t // 2 + torch.randperm(
            blocks * bs - 3 - t // 2, generator=g)[: t - t // 2]]),
    }


def both_ways(kv: torch.Tensor, slots: torch.Tensor, chunk: torch.Tensor, skip: int) -> None:
    """Native copies in both directions equal torch's on copies of the same tensors."""
    theirs_kv, mine_kv = kv.clone(), kv.clone()
    ops_torch.chunk_to_paged(chunk, theirs_kv, slots, skip)
    assert transfer.copy(mine_kv, slots, chunk, skip, to_paged=True)
    assert torch.equal(mine_kv, theirs_kv)
    theirs, mine = torch.full_like(chunk, 7), torch.full_like(chunk, 7)
    ops_torch.paged_to_chunk(theirs_kv, slots, theirs, skip)
    assert transfer.copy(mine_kv, slots, mine, skip, to_paged=False)
    assert torch.equal(mine, theirs)


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("skip", [0, 5, 16])
def test_native_copies_equal_torch_for_every_slot_pattern(dtype, skip):
    g = torch.Generator().manual_seed(skip)
    layers, blocks, bs, heads, dim, t = 3, 24, 8, 2, 12, 40
    kv = torch.randn(layers, 2, blocks, bs, heads, dim, generator=g).to(dtype)
    for slots in slot_patterns(g, blocks, bs, t).values():
        chunk = torch.randn(2, layers, t, heads, dim, generator=g).to(dtype)
        both_ways(kv, slots, chunk, skip)
        # views the connector passes: one layer of both, and the first tokens of a stored chunk
        both_ways(kv[1:2], slots, chunk[:, 1:2], skip)
        longer = torch.randn(2, layers, t + 24, heads, dim, generator=g).to(dtype)
        both_ways(kv, slots, longer[:, :, :t], skip)
        # tokens not back to back in the chunk (token-major storage): no runs merged
        token_major = torch.randn(layers, t, 2, heads, dim, generator=g).to(dtype).permute(2, 0, 1, 3, 4)
        both_ways(kv, slots, token_major, skip)


@needs_cc
def test_large_copies_stream_on_threads_and_stay_exact(monkeypatch):
    """Above STREAM_BYTES, over two threads, with rows (3 x 40 halves = 240 bytes) that leave
    every streaming run unaligned at both ends: the same bytes as torch."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    g = torch.Generator().manual_seed(1)
    layers, blocks, bs, heads, dim, t = 12, 200, 16, 3, 40, 2048
    kv = torch.randn(layers, 2, blocks, bs, heads, dim, generator=g).half()
    chunk = torch.randn(2, layers, t, heads, dim, generator=g).half()
    assert 2 * layers * t * heads * dim * 2 >= 2 * transfer.STREAM_BYTES
    token_major = chunk.permute(2, 1, 0, 3, 4).contiguous().permute(2, 1, 0, 3, 4)  # same values
    for slots in slot_patterns(g, blocks, bs, t).values():
        both_ways(kv, slots, chunk, 3)
        both_ways(kv, slots, token_major, 3)


@needs_cc
def test_a_slot_outside_paged_memory_raises_and_writes_nothing():
    kv = torch.zeros(2, 2, 4, 4, 1, 8)
    chunk = torch.ones(2, 2, 6, 1, 8)
    for bad in (16, -1):
        slots = torch.tensor([0, 1, 2, 3, 4, bad])
        with pytest.raises(IndexError, match="outside paged memory's 16 slots"):
            ops.chunk_to_paged(chunk, kv, slots)
        assert not kv.any()
        out = torch.full_like(chunk, 7)
        with pytest.raises(IndexError):
            ops.paged_to_chunk(kv, slots, out)
        assert out.eq(7).all()
        # with nothing to copy (no layers, an empty row) a bad slot is refused all the same
        lib = transfer.library()
        for layers, row in ((0, 32), (2, 0)):
            assert lib.lmkv_transfer(chunk.data_ptr(), kv.data_ptr(), slots.data_ptr(), 6, 16,
                                     layers, row, 0, 0, 0, 0, 0, 0, 1, 1, 0) == -1


@needs_cc
def test_what_the_native_copy_does_not_take_goes_to_torch():
    kv = torch.randn(2, 2, 4, 4, 2, 8)
    slots = torch.randperm(16)[:6]
    half = torch.randn(2, 2, 6, 2, 8).half()  # another dtype: torch converts
    assert not transfer.copy(kv, slots, half, 0, to_paged=True)
    ops.chunk_to_paged(half, kv, slots)
    assert torch.equal(kv.flatten(2, 3)[:, :, slots], half.float().transpose(0, 1))
    assert not transfer.copy(kv.to(torch.complex64), slots, torch.randn(2, 2, 6, 2, 8,
                             dtype=torch.complex64).conj(), 0, to_paged=True)  # lazy conjugate
    strided = torch.randn(2, 2, 6, 8, 2).transpose(3, 4)  # rows not contiguous
    assert not transfer.copy(kv, slots, strided, 0, to_paged=True)
    ops.chunk_to_paged(strided, kv, slots)
    assert torch.equal(kv.flatten(2, 3)[:, :, slots], strided.transpose(0, 1))
    assert transfer.copy(kv, slots, torch.empty(2, 2, 6, 2, 8), 0, to_paged=False)


@needs_cc
def test_the_library_is_built_once_and_off_or_without_a_compiler_torch_copies(
        fresh_library, monkeypatch, caplog):
    assert transfer.library() is not None
    built = list((fresh_library / "native").glob("transfer-*.so"))
    assert len(built) == 1
    transfer.library.cache_clear()
    monkeypatch.setenv(transfer.DISABLE_ENV, "0")
    assert transfer.library() is None
    transfer.library.cache_clear()
    monkeypatch.delenv(transfer.DISABLE_ENV)
    monkeypatch.setenv("CC", str(fresh_library / "no-such-cc"))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger="lmkv.transfer"):
        assert transfer.library() is None
    assert "no native paged copies" in caplog.text
    kv, chunk = torch.zeros(1, 2, 2, 4, 1, 8), torch.randn(2, 1, 4, 1, 8)
    slots = torch.tensor([5, 2, 7, 0])
    assert not transfer.copy(kv, slots, chunk, 0, to_paged=True)
    ops.chunk_to_paged(chunk, kv, slots)
    assert torch.equal(kv.flatten(2, 3)[:, :, slots], chunk.transpose(0, 1))


@pytest.mark.sanitize
@pytest.mark.skipif(not CAN_BUILD or shutil.which("g++") is None, reason="no C compiler")
def test_native_copies_are_clean_under_address_sanitizer(tmp_path):
    """An ASan build of transfer.c copies at the edges of its buffers (last slots, last
    tokens, streaming tails, several threads) without one out-of-bounds access."""
    from lmkv_cuda.emu import sanitizer_env

    script = Path(__file__).with_name("transfer_asan.py")
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], env=sanitizer_env("address"),
                       capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert r.returncode == 0 and "ERROR: AddressSanitizer" not in r.stderr, r.stdout + r.stderr[-6000:]
    assert "native copies clean" in r.stdout
