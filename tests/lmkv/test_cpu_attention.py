"""The native CPU attention (lmkv/attention.c): the torch reference's result (up to float32
rounding) for every shape it takes, in place over paged KV of the engine's layout; the torch
reference for what it does not take; and lmkv.ops sends CPU decode steps to it."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmkv import cpu_attention, ops, ops_torch

needs_cc = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")


def case(g: torch.Generator, heads: int, kv_heads: int, dim: int, bs: int, lens: list[int],
         queries: list[int], dtype=torch.float32):
    """Query rows, KV pages (as one layer of the engine's [L, 2, ...] cache: strided), block
    tables with the blocks shuffled, seq_lens and query starts."""
    need = max(-(-n // bs) for n in lens)
    blocks = 2 * need
    cache = torch.randn(3, 2, blocks, bs, kv_heads, dim, generator=g).to(dtype)
    kv = cache[1]
    tables = torch.stack([torch.randperm(blocks, generator=g)[:need] for _ in lens])
    starts = torch.tensor([0, *queries]).cumsum(0)
    q = torch.randn(int(starts[-1]), heads, dim, generator=g).to(dtype)
    return q, kv, tables, torch.tensor(lens), starts


@needs_cc
@pytest.mark.parametrize("heads,kv_heads,dim,bs", [(9, 3, 64, 16), (4, 4, 80, 8), (8, 1, 32, 128),
                                                   (6, 2, 128, 1), (2, 1, 7, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_native_attention_equals_the_reference(heads, kv_heads, dim, bs, dtype, monkeypatch):
    monkeypatch.setattr(cpu_attention, "ROWS", cpu_attention.MAX_ROWS)  # all it can take, not only
    g = torch.Generator().manual_seed(heads * dim + bs)  # what it is faster at
    most = min(5, cpu_attention.MAX_ROWS // (heads // kv_heads))  # queries per sequence
    lens = [1, 37, 300, 2 * bs + 1, most]
    queries = [1, min(most, 2), most, 1, most]  # a sequence of only new tokens too
    q, kv, tables, seq_lens, starts = case(g, heads, kv_heads, dim, bs, lens, queries, dtype)
    scale = dim**-0.5
    got = cpu_attention.attention(q, kv, tables, seq_lens, starts, scale)
    assert got is not None and got.dtype == dtype and got.shape == q.shape
    want = ops_torch.paged_attention_prefill(q.float(), kv.float(), tables, seq_lens, starts, scale)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@needs_cc
def test_long_sequences_and_a_decode_batch():
    g = torch.Generator().manual_seed(1)
    q, kv, tables, seq_lens, starts = case(g, 9, 3, 64, 16, [4096, 1, 1500, 2049], [1, 1, 1, 1])
    got = cpu_attention.attention(q, kv, tables, seq_lens, starts, 0.125)
    want = ops_torch.paged_attention_decode(q, kv, tables, seq_lens, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_cc
def test_it_leaves_to_the_reference_what_it_does_not_take():
    g = torch.Generator().manual_seed(2)
    q, kv, tables, seq_lens, starts = case(g, 4, 2, 16, 8, [20, 30], [1, 1])
    run = lambda q=q, kv=kv, starts=starts: cpu_attention.attention(  # noqa: E731
        q, kv, tables, seq_lens, starts, 0.25)
    assert run() is not None
    assert run(q=q.double(), kv=kv.double()) is None  # float64
    assert run(q=q.half()) is None  # query and KV dtypes differ
    assert run(kv=kv.transpose(3, 4).contiguous().transpose(3, 4)) is None  # tokens' rows not contiguous
    # more query rows (queries x heads sharing a KV head) in a sequence than it is faster at
    rows = cpu_attention.ROWS // 2 + 1
    assert run(q=torch.randn(1 + rows, 4, 16), starts=torch.tensor([0, 1, 1 + rows])) is None
    assert run(q=q.to("meta"), kv=kv.to("meta")) is None  # not on the CPU
    with pytest.raises(ValueError, match="block id"):  # a table naming a block past the pages
        cpu_attention.attention(q, kv, tables + kv.shape[1], seq_lens, starts, 0.25)
    with pytest.raises(ValueError, match="longer than its table"):
        cpu_attention.attention(q, kv, tables[:, :2], seq_lens, starts, 0.25)
    # metadata that does not fit the query: refused before attention.c indexes by it
    for bad in (dict(starts=torch.tensor([0, 1, 5])), dict(starts=torch.tensor([0, 2])),
                dict(starts=torch.tensor([1, 0, 2])), dict(lens=torch.tensor([20, 30, 5])),
                dict(tables=tables[:1])):
        with pytest.raises(ValueError, match="metadata does not fit"):
            cpu_attention.attention(q, kv, bad.get("tables", tables), bad.get("lens", seq_lens),
                                    bad.get("starts", starts), 0.25)
    assert cpu_attention.attention(q, kv, tables, seq_lens.to("meta"), starts, 0.25) is None


@needs_cc
def test_ops_send_cpu_decode_steps_here(monkeypatch):
    g = torch.Generator().manual_seed(3)
    q, kv, tables, seq_lens, _ = case(g, 9, 3, 64, 16, [100, 7], [1, 1])
    calls = []
    real = cpu_attention.attention
    monkeypatch.setattr(cpu_attention, "attention", lambda *a: calls.append(1) or real(*a))
    out = ops.paged_attention_decode(q, kv, tables, seq_lens, 0.125)
    assert calls and torch.allclose(out, ops_torch.paged_attention_decode(q, kv, tables, seq_lens, 0.125),
                                    atol=1e-5)
    prefill = torch.randn(40, 9, 64, generator=g)  # a long prefill: the reference's matrix products
    starts = torch.tensor([0, 40])
    calls.clear()
    ops.paged_attention_prefill(prefill, kv, tables[:1], torch.tensor([100]), starts, 0.125)
    assert calls == [1]  # asked, declined (too many rows), then the reference ran


def test_switched_off_by_the_environment(monkeypatch, caplog):
    cpu_attention.library.cache_clear()
    monkeypatch.setenv(cpu_attention.DISABLE_ENV, "0")
    try:
        with caplog.at_level(logging.INFO, logger="lmkv.cpu_attention"):
            assert cpu_attention.library() is None
        assert "off" in caplog.text
        g = torch.Generator().manual_seed(4)
        q, kv, tables, seq_lens, starts = case(g, 2, 1, 8, 4, [9], [1])
        assert cpu_attention.attention(q, kv, tables, seq_lens, starts, 1.0) is None
    finally:
        cpu_attention.library.cache_clear()


@pytest.mark.skipif(shutil.which("cc") is None or shutil.which("g++") is None, reason="no C compiler")
def test_an_address_sanitizer_build_reads_only_its_pages(tmp_path):
    """attention.c built with AddressSanitizer, over exactly sized pages, tables and queries:
    not one out-of-bounds access."""
    from lmkv_cuda.emu import sanitizer_env

    script = Path(__file__).with_name("attention_asan.py")
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], env=sanitizer_env("address"),
                       capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert r.returncode == 0 and "ERROR: AddressSanitizer" not in r.stderr, r.stdout + r.stderr[-6000:]
    assert "native attention clean" in r.stdout


@needs_cc
@pytest.mark.parametrize("float16_type", [True, False], ids=["_Float16", "from-bits"])
def test_every_finite_float16_value_reads_back_exactly(float16_type, tmp_path, monkeypatch):
    """float16 KV as attention.c reads it, with the compiler's _Float16 and with the
    conversion from the bits that compilers without it (GCC < 12 on x86) build: one key
    per sequence, so the output is its value row, for every finite float16 bit pattern
    (subnormals and negative zero included)."""
    from lmkv.cc import build, compiler

    flags = cpu_attention.build_flags() + (() if float16_type else ("-DLMKV_NO_FLOAT16",))
    lib = cpu_attention.load(build(compiler(), cpu_attention.SOURCE, tmp_path, flags, ("-lm",)))
    monkeypatch.setattr(cpu_attention, "library", lambda: lib)
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    values = bits[torch.isfinite(bits)]
    dim = 256
    values = torch.cat([values, values[: -len(values) % dim]])  # whole rows
    n = len(values) // dim
    kv = torch.zeros(2, n, 1, 1, dim, dtype=torch.float16)
    kv[0] = 1.0
    kv[1, :, 0, 0] = values.view(n, dim)
    q = torch.ones(n, 1, dim, dtype=torch.float16)
    got = cpu_attention.attention(q, kv, torch.arange(n)[:, None], torch.ones(n, dtype=torch.int64),
                                  torch.arange(n + 1), 0.0625)
    assert got is not None and torch.equal(got.view(-1), values)
