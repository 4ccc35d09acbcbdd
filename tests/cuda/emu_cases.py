"""Random inputs, kernel runs and torch references shared by the kernel tests; run as a script
(``python emu_cases.py [--sanitize thread|address]``) it checks small cases of every kernel
and exits non-zero on a mismatch: the sanitizer and seed-shaking tests start it in a
subprocess, because sanitizer runtimes must be preloaded and CUEMU_SEED is read once.

Outputs are poisoned (NaN, 0xFF bytes) before each run so unwritten elements fail, and
unused paged memory is poisoned so that reads of the wrong slots fail too.
"""

from __future__ import annotations

import argparse
import sys

import torch

from lmkv import ops_torch
from lmkv import ops_torch as reference
from lmkv_cuda import attention, kv_copy, rope
from lmkv_cuda.launcher import Launcher

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.view(torch.uint8).fill_(0xFF).view(t.dtype)


def random_slots(num_slots: int, tokens: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(num_slots, generator=gen)[:tokens].to(torch.int64)


def copy_engine(
    launcher: Launcher, dtype: torch.dtype, layers: int, heads: int, dim: int, tokens: int,
    skip: int, *, seed: int = 0, chunk_offset: int = 0,
) -> bool:  # fmt: skip
    """Both directions, engine layout; chunk_offset (elements) misaligns the chunk."""
    gen = torch.Generator().manual_seed(seed)
    nb, bs = 2 + tokens // 8, 8
    kv = torch.randn(layers, 2, nb, bs, heads, dim, generator=gen).to(dtype)
    slots = random_slots(nb * bs, tokens, gen)
    slots[:skip] = -1  # never read
    size = 2 * layers * tokens * heads * dim
    chunk = poison(torch.empty(size + chunk_offset, dtype=dtype))[chunk_offset:].view(
        2, layers, tokens, heads, dim
    )
    kv_copy.paged_to_chunk(launcher, kv, slots, chunk, skip)
    want = poison(torch.empty_like(chunk))
    ops_torch.paged_to_chunk(kv, slots, want, skip)
    ok = _same(chunk, want)
    back = poison(torch.empty_like(kv))
    back_want = back.clone()
    src = torch.randn(chunk.shape, generator=gen).to(dtype)
    kv_copy.chunk_to_paged(launcher, src, back, slots, skip)
    ops_torch.chunk_to_paged(src, back_want, slots, skip)
    return ok and _same(back, back_want)


def copy_vllm(
    launcher: Launcher, dtype: torch.dtype, layers: int, heads: int, dim: int, tokens: int,
    skip: int, *, seed: int = 0,
) -> bool:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    nb, bs = 2 + tokens // 8, 16
    caches = [torch.randn(nb, bs, heads, 2 * dim, generator=gen).to(dtype) for _ in range(layers)]
    slots = random_slots(nb * bs, tokens, gen)
    chunk = poison(torch.empty(2, layers, tokens, heads, dim, dtype=dtype))
    want = chunk.clone()
    kv_copy.paged_to_chunk_vllm(launcher, caches, slots, chunk, skip)
    ops_torch.paged_to_chunk_vllm(caches, slots, want, skip)
    ok = _same(chunk, want)
    src = torch.randn(chunk.shape, generator=gen).to(dtype)
    back = [poison(torch.empty_like(c)) for c in caches]
    back_want = [b.clone() for b in back]
    kv_copy.chunk_to_paged_vllm(launcher, src, back, slots, skip)
    ops_torch.chunk_to_paged_vllm(src, back_want, slots, skip)
    return ok and all(_same(a, b) for a, b in zip(back, back_want, strict=True))


def reshape_and_cache(
    launcher: Launcher, dtype: torch.dtype, heads: int, dim: int, tokens: int, *, seed: int = 0
) -> bool:
    gen = torch.Generator().manual_seed(seed)
    nb, bs = 2 + tokens // 4, 16
    qkv = torch.randn(tokens, 3 * heads * dim, generator=gen).to(dtype)  # key/value: strided rows
    key = qkv[:, heads * dim : 2 * heads * dim].view(tokens, heads, dim)
    value = qkv[:, 2 * heads * dim :].view(tokens, heads, dim)
    slots = random_slots(nb * bs, tokens, gen)
    slots[::3] = -1
    kv_layer = poison(torch.empty(2, nb, bs, heads, dim, dtype=dtype))
    want = kv_layer.clone()
    kv_copy.reshape_and_cache(launcher, key, value, kv_layer, slots)
    reference.reshape_and_cache(key, value, want, slots)
    return _same(kv_layer, want)


def _paged_kv(
    dtype: torch.dtype, lens: list[int], hkv: int, dim: int, block_size: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_layer with every slot a sequence does not own poisoned, and scattered block tables."""
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    kv = poison(torch.empty(2, num_blocks, block_size, hkv, dim, dtype=dtype))
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(lens), max(need) + 1), 10**6, dtype=torch.int32)  # unused: garbage
    start = 0
    for i, (n, k) in enumerate(zip(lens, need, strict=True)):
        tables[i, :k] = order[start : start + k]
        start += k
        flat = kv[:, tables[i, :k].long()].flatten(1, 2)  # [2, k * BS, Hkv, D]
        flat[:, :n] = torch.randn(2, n, hkv, dim, generator=gen).to(dtype)
        kv[:, tables[i, :k].long()] = flat.view(2, k, block_size, hkv, dim)
    return kv, tables


def decode(
    launcher: Launcher, dtype: torch.dtype, dim: int, hq: int, hkv: int, lens: list[int],
    *, block_size: int = 16, partition_size: int = 512, seed: int = 0,
    kernel: str = "auto", device: str = "cpu",
) -> float:  # fmt: skip
    """Max abs error against the engine's torch decode computed in fp32 (on the CPU; the
    kernel runs on ``device``: the CPU for the emulator, cuda for a GPU launcher)."""
    gen = torch.Generator().manual_seed(seed)
    kv, tables = _paged_kv(dtype, lens, hkv, dim, block_size, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(len(lens), hq, dim, generator=gen).to(dtype)
    out = poison(torch.empty_like(query)).to(device)
    attention.paged_attention_decode(
        launcher, query.to(device), kv.to(device), tables.to(device), seq_lens.to(device),
        dim**-0.5, out=out, partition_size=partition_size, kernel=kernel,
    )
    out = out.cpu()
    want = reference.paged_attention_decode(
        query.float(),
        kv.float().nan_to_num(),
        tables.clamp(max=kv.shape[1] - 1),
        seq_lens,
        dim**-0.5,
    )
    return (out.float() - want).abs().max().item()


def decode_bits_alone_and_batched(
    launcher: Launcher, kernel: str, *, partition_size: int, device: str = "cpu"
) -> bool:  # fmt: skip
    """Whether a sequence of 40 keys decodes to the same bits alone, next to one of 150 keys,
    and over a 4x wider block table with checks off (float32, 4 query heads over 2)."""
    gen = torch.Generator().manual_seed(3)
    lens = [40 * partition_size // 16, 150 * partition_size // 16]
    kv, tables = _paged_kv(torch.float32, lens, 2, 64, 16, gen)
    query = torch.randn(2, 4, 64, generator=gen)

    def run(rows: list[int], width: int, check: bool) -> torch.Tensor:
        wide = torch.zeros(len(rows), width, dtype=torch.int32)
        wide[:, : tables.shape[1]] = tables[rows]
        seq_lens = torch.tensor([lens[r] for r in rows], dtype=torch.int32)
        return attention.paged_attention_decode(
            launcher, query[rows].to(device), kv.to(device), wide.to(device), seq_lens.to(device),
            0.125, partition_size=partition_size, kernel=kernel, check=check,
        ).cpu()  # fmt: skip

    alone = run([0], tables.shape[1], True)[0]
    return (torch.equal(run([0, 1], tables.shape[1], True)[0], alone)
            and torch.equal(run([0], 4 * tables.shape[1], False)[0], alone))


def prefill(
    launcher: Launcher, dtype: torch.dtype, dim: int, hq: int, hkv: int, lens: list[int],
    q_lens: list[int], *, block_size: int = 16, seed: int = 0,
) -> float:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    kv, tables = _paged_kv(dtype, lens, hkv, dim, block_size, gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    starts = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    query = torch.randn(int(starts[-1]), hq, dim, generator=gen).to(dtype)
    out = poison(torch.empty_like(query))
    attention.paged_attention_prefill(
        launcher, query, kv, tables, seq_lens, starts, dim**-0.5, out=out
    )
    want = reference.paged_attention_prefill(
        query.float(), kv.float().nan_to_num(), tables.clamp(max=kv.shape[1] - 1), seq_lens, starts,
        dim**-0.5,
    )  # fmt: skip
    return (out.float() - want).abs().max().item() if len(out) else 0.0


def rerotate(
    launcher: Launcher, dtype: torch.dtype, shape: tuple[int, ...], *, seed: int = 0,
    max_delta: int = 4096,
) -> float:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(shape, generator=gen).to(dtype)
    tokens, dim = shape[-3], shape[-1]
    delta = torch.randint(-max_delta, max_delta, (tokens,), generator=gen)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    got = rope.rerotate_keys(launcher, keys.clone(), delta, inv_freq)
    want = ops_torch.rerotate_keys(keys.clone(), delta, inv_freq)
    return (got.float() - want.float()).abs().max().item()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN poison included)."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def run_all(launcher: Launcher) -> list[str]:
    """Small cases of every kernel; returns the failures."""
    failures = []
    checks = [
        ("copy_engine", lambda: copy_engine(launcher, torch.float16, 2, 2, 64, 21, 3)),
        (
            "copy_engine_odd",
            lambda: copy_engine(launcher, torch.float32, 2, 3, 5, 9, 0, chunk_offset=1),
        ),
        ("copy_vllm", lambda: copy_vllm(launcher, torch.bfloat16, 2, 2, 64, 19, 2)),
        ("reshape_and_cache", lambda: reshape_and_cache(launcher, torch.float16, 2, 64, 10)),
        (
            "decode",
            lambda: decode(launcher, torch.float16, 64, 8, 2, [1, 37], partition_size=32) < 2e-3,
        ),
        (
            "decode_tiles",
            lambda: decode(launcher, torch.float16, 64, 8, 2, [1, 37], partition_size=32,
                           kernel="tiles") < 2e-3,
        ),  # fmt: skip
        (  # "auto" above took warps_lean (group 4); the plain warps kernel here
            "decode_warps",
            lambda: decode(launcher, torch.float16, 64, 8, 2, [1, 37, 70], partition_size=36,
                           kernel="warps") < 2e-3,
        ),  # fmt: skip
        ("decode_mha", lambda: decode(launcher, torch.float32, 128, 2, 2, [20]) < 2e-5),
        (
            "decode_mha_warps",
            lambda: decode(launcher, torch.float32, 128, 2, 2, [20], kernel="warps") < 2e-5,
        ),
        (  # group 8 (R = 8); a partition starting 36 keys in: its steps reach table columns
            # past the sequence's last block (the reads must stay in the row)
            "decode_warps_tail",
            lambda: decode(launcher, torch.float16, 64, 16, 2, [5, 37], partition_size=36,
                           kernel="warps") < 2e-3,
        ),  # fmt: skip
        ("decode_two_tiles", lambda: decode(launcher, torch.float32, 64, 2, 1, [300]) < 2e-5),
        (
            "decode_two_tiles_tiles",
            lambda: decode(launcher, torch.float32, 64, 2, 1, [300], kernel="tiles") < 2e-5,
        ),
        ("prefill", lambda: prefill(launcher, torch.bfloat16, 64, 4, 2, [12, 30], [12, 5]) < 2e-2),
        ("rerotate", lambda: rerotate(launcher, torch.float16, (2, 5, 2, 64)) < 2e-3),
    ]
    for name, check in checks:
        if not check():
            failures.append(name)
    return failures


# the instantiations run_all uses: sanitizer builds compile only these
RUN_ALL_KERNELS = {
    "kv_copy.cu": [
        f"kv_copy<{u}, {d}>" for u in ("uint4", "unsigned int") for d in ("false", "true")
    ],
    "paged_attention.cu": [
        "paged_attention<__half, 64, 4>", "paged_attention<__half, 64, 8>",
        "paged_attention_merge<__half, 64>", "paged_attention<float, 128, 1>",
        "paged_attention<float, 64, 4>", "paged_attention<float, 64, 8>",
        "paged_attention<__nv_bfloat16, 64, 8>", "paged_decode_warps<__half, 64, 4>",
        "paged_decode_warps<float, 128, 1>", "paged_decode_warps<float, 64, 4, true>",
        "paged_decode_warps<__half, 64, 8>", "paged_decode_warps<__half, 64, 4, true>",
    ],
    "rope.cu": ["rerotate_keys<__half, 8>"],
}  # fmt: skip

if __name__ == "__main__":
    from lmkv_cuda.emu import EmuLauncher

    parser = argparse.ArgumentParser()
    parser.add_argument("--sanitize", choices=["thread", "address"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    failed = run_all(EmuLauncher(sanitize=args.sanitize, instantiations=RUN_ALL_KERNELS))
    print("FAILED: " + " ".join(failed) if failed else "all kernels match")
    sys.exit(1 if failed else 0)
