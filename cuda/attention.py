"""Wrappers of paged_attention.cu with the signatures of the engine's torch functions
(``lmkv.ops_torch.paged_attention_decode`` / ``paged_attention_prefill``),
plus ``check`` (index-range checks; they need one device sync, so a caller that validates
its metadata once per step passes False), ``out`` (an output buffer) and, for decode,
``partition_size`` (keys per split-K partition).

kv_layer: [2, num_blocks, block_size, Hkv, D] (0 = K, 1 = V), same dtype as the query;
D in {64, 128}; dtypes fp16 / bf16 / fp32; Hq a multiple of Hkv.
"""

from __future__ import annotations

import numpy as np
import torch

from lmkv_cuda.launcher import CTYPE, FLOAT_DTYPES, Launcher, check_tensor, require

HEAD_DIMS = (64, 128)
ROWS = 8  # query rows per block sharing each K/V load (template R; decode: 1 without GQA, 4 below)
# decode with a GQA group of at most 4 heads: R = 4 (half the accumulator registers of R = 8,
# so more blocks per SM and more loads in flight; rows beyond the group would sit idle)
SMALL_GROUP_ROWS = 4
THREADS = 128
MAX_PARTITIONS = 64  # splits of one decode's keys, at most
_NO_SPLIT = 1 << 30
# decode kernels: "warps" (paged_decode_warps: each warp its own online softmax, a step's K
# and V loads issued together), "warps_lean" (the same with fewer instructions per step; slots
# passed between lanes as 32-bit integers) and "tiles" (paged_attention: the block's warps
# score a tile of keys, then weigh its values, with barriers between). "auto" takes warps_lean
# for GQA groups of 2-4 heads (R = 4), which an H200 measured fastest at Llama-3-8B's group of
# 4 (0.71 of HBM bandwidth vs 0.60 for warps and 0.51 for tiles in one run; docs/kernels.md;
# groups of 2 and 3 run the same code with rows unused, not measured apart), warps where a
# cache has more slots than 32 bits hold, and tiles for groups of 1 or > 4 (R = 1 and 8: not
# measured).
DECODE_KERNELS = ("auto", "warps", "warps_lean", "tiles")
LEAN_MAX_SLOTS = 2**31 - 1  # warps_lean passes slots between lanes as 32-bit integers


def decode_kernel(group: int, slots: int = 0) -> str:
    """The kernel "auto" takes for a GQA group of ``group`` query heads per KV head over a
    cache of ``slots`` token slots."""
    if not 2 <= group <= SMALL_GROUP_ROWS:
        return "tiles"
    return "warps_lean" if slots <= LEAN_MAX_SLOTS else "warps"


def _common(
    launcher: Launcher, query: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    check_tensor(query, "query", launcher, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor(kv_layer, "kv_layer", launcher, ndim=5, dtypes=(query.dtype,))
    two, _, _, hkv, d = kv_layer.shape
    hq = query.shape[1]
    require(
        two == 2,
        f"kv_layer must be [2, num_blocks, block_size, Hkv, D], got {tuple(kv_layer.shape)}",
    )
    require(
        d == query.shape[2] and d in HEAD_DIMS,
        f"head_dim {query.shape[2]} / {d}: need equal, in {HEAD_DIMS}",
    )
    require(hq % hkv == 0, f"{hq} query heads is not a multiple of {hkv} KV heads")
    # the kernels read K and V rows as 16-byte vectors: a misaligned view would be a sticky
    # CUDA error (the context lost), not a recompute
    require(kv_layer.data_ptr() % 16 == 0,
            f"kv_layer must start 16-byte aligned (its data is at {kv_layer.data_ptr():#x})")
    for name, t, ndim in (("block_tables", block_tables, 2), ("seq_lens", seq_lens, 1)):
        check_tensor(t, name, launcher, ndim=ndim, contiguous=False)
        require(not t.is_floating_point(), f"{name} must be an integer tensor")
    require(
        block_tables.shape[0] == seq_lens.shape[0],
        "block_tables and seq_lens disagree on batch size",
    )
    if out is None:
        out = torch.empty_like(query)
    check_tensor(out, "out", launcher, dtypes=(query.dtype,))
    require(
        out.shape == query.shape,
        f"out shape {tuple(out.shape)} != query shape {tuple(query.shape)}",
    )
    to_i32 = lambda t: t.to(torch.int32).contiguous()
    return out, to_i32(block_tables), to_i32(seq_lens)


def _check_tables(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int
) -> torch.Tensor:
    """Device-side checks folded into one tensor of violation counts (read with one sync)."""
    capacity = block_tables.shape[1] * block_size
    used = (
        torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] * block_size
        < seq_lens[:, None]
    )
    bad_block = used & ((block_tables < 0) | (block_tables >= num_blocks))
    return torch.stack(
        [((seq_lens < 1) | (seq_lens > capacity)).sum(), bad_block.sum(), seq_lens.max().long()]
    )


def _launch(
    launcher: Launcher, query: torch.Tensor, kv_layer: torch.Tensor, out: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None,
    tile_starts: torch.Tensor | None, grid_x: int, rows: int, heads_per_block: int,
    tile_tokens: int, partition_size: int, num_partitions: int, scale: float,
    kernel_name: str | None = None,
) -> None:  # fmt: skip
    _, nb, bs, hkv, d = kv_layer.shape
    hq = query.shape[1]
    chunks = -(-(hq // hkv) // heads_per_block)
    f32 = dict(dtype=torch.float32, device=query.device)
    if num_partitions > 1:
        part_o = torch.empty(query.shape[0], hq, num_partitions, d, **f32)
        part_ml = torch.empty(query.shape[0], hq, num_partitions, 2, **f32)
    else:
        part_o = part_ml = torch.empty(1, **f32)
    p = launcher.pointer
    dtype = CTYPE[query.dtype]
    kernel_name = kernel_name or "paged_attention<{}, {}, {}>"
    kernel = launcher.kernel("paged_attention.cu", kernel_name.format(dtype, d, rows))
    dummy = seq_lens  # stands for the pointers decode does not use
    kernel(
        (grid_x, hkv * chunks, num_partitions), (THREADS,),
        (
            p(out), p(part_o), p(part_ml), p(query), p(kv_layer[0]), p(kv_layer[1]),
            np.int64(hkv * d), np.int64(d), p(block_tables), np.int32(block_tables.shape[1]),
            np.int32(bs), p(seq_lens),
            p(query_start_loc if query_start_loc is not None else dummy),
            p(tile_starts if tile_starts is not None else dummy), np.int32(tile_starts is not None),
            np.int32(seq_lens.shape[0]), np.int32(hq), np.int32(hkv), np.int32(heads_per_block),
            np.int32(tile_tokens), np.int32(partition_size), np.int32(num_partitions),
            np.int32(MAX_PARTITIONS), np.float32(scale),
        ),
    )  # fmt: skip
    if num_partitions > 1:
        merge = launcher.kernel("paged_attention.cu", f"paged_attention_merge<{dtype}, {d}>")
        merge(
            (hq * seq_lens.shape[0],), (d,),
            (p(out), p(part_o), p(part_ml), p(seq_lens), np.int32(hq), np.int32(partition_size),
             np.int32(num_partitions), np.int32(MAX_PARTITIONS)),
        )  # fmt: skip


def paged_attention_decode(
    launcher: Launcher, query: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, *, check: bool = True, out: torch.Tensor | None = None,
    partition_size: int = 512, kernel: str = "auto",
) -> torch.Tensor:  # fmt: skip
    """query [B, Hq, D] at positions seq_len - 1; block_tables [B, max_blocks]; seq_lens [B].
    Returns [B, Hq, D]. Contexts longer than partition_size keys are split (flash-decoding),
    into MAX_PARTITIONS at most (longer partitions beyond): the split's workspace
    [B, Hq, partitions, D + 2] fp32 stays bounded at any context length. A sequence's split
    follows its own length only, so its result is the same in any batch and table width.
    ``kernel``: one of DECODE_KERNELS (benchmarks/kernels.py times each)."""
    out, block_tables, seq_lens = _common(launcher, query, kv_layer, block_tables, seq_lens, out)
    _, nb, bs, hkv, _ = kv_layer.shape
    batch, hq, _ = query.shape
    require(batch == seq_lens.shape[0], f"query batch {batch} != {seq_lens.shape[0]} sequences")
    require(partition_size > 0, "partition_size must be positive")
    require(kernel in DECODE_KERNELS, f"decode kernel {kernel!r}: one of {DECODE_KERNELS}")
    if batch == 0:
        return out
    max_len = block_tables.shape[1] * bs  # bound without a sync
    if check:
        bad_len, bad_block, max_len = _check_tables(block_tables, seq_lens, nb, bs).tolist()
        require(bad_len == 0, f"{bad_len} seq_lens outside [1, {block_tables.shape[1] * bs}]")
        require(bad_block == 0, f"{bad_block} block_tables entries in use are outside [0, {nb})")
    group = hq // hkv
    rows = 1 if group == 1 else SMALL_GROUP_ROWS if group <= SMALL_GROUP_ROWS else ROWS
    if kernel == "auto":
        kernel = decode_kernel(group, nb * bs)
    require(kernel != "warps_lean" or nb * bs <= LEAN_MAX_SLOTS,
            f"decode kernel warps_lean takes 32-bit slots: {nb} blocks of {bs} tokens are more "
            f"than {LEAN_MAX_SLOTS} slots")
    name = {"warps": "paged_decode_warps<{}, {}, {}>", "tiles": None,
            "warps_lean": "paged_decode_warps<{}, {}, {}, true>"}[kernel]
    num_partitions = min(MAX_PARTITIONS, -(-max_len // partition_size))
    _launch(
        launcher, query, kv_layer, out, block_tables, seq_lens, None, None, batch, rows,
        min(group, rows), 1, partition_size if num_partitions > 1 else _NO_SPLIT,
        num_partitions, scale, name,
    )  # fmt: skip
    return out


def paged_attention_prefill(
    launcher: Launcher, query: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, *, check: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Causal attention; query [T, Hq, D], sequence i's rows [query_start_loc[i],
    query_start_loc[i + 1]) at positions [seq_len_i - q_len_i, seq_len_i). Returns [T, Hq, D]."""
    out, block_tables, seq_lens = _common(launcher, query, kv_layer, block_tables, seq_lens, out)
    check_tensor(query_start_loc, "query_start_loc", launcher, ndim=1, contiguous=False)
    _, nb, bs, hkv, _ = kv_layer.shape
    tokens, hq, _ = query.shape
    batch = seq_lens.shape[0]
    require(query_start_loc.shape[0] == batch + 1, "query_start_loc must have num_seqs + 1 entries")
    qsl = query_start_loc.to(torch.int32).contiguous()
    q_lens = qsl[1:] - qsl[:-1]
    if batch == 0:
        require(tokens == 0, f"{tokens} query tokens but no sequences")
        return out
    if check:
        bad_q = ((q_lens < 0) | (q_lens > seq_lens)).sum()
        flags = [_check_tables(block_tables, seq_lens, nb, bs), qsl[[0, -1]].long(), bad_q[None]]
        bad_len, bad_block, _, first, last, bad_q = torch.cat(flags).tolist()  # one sync
        require(bad_len == 0, f"{bad_len} seq_lens outside [1, {block_tables.shape[1] * bs}]")
        require(bad_block == 0, f"{bad_block} block_tables entries in use are outside [0, {nb})")
        require(first == 0 and last == tokens, f"query_start_loc must run from 0 to {tokens}")
        require(bad_q == 0, f"{bad_q} sequences with q_len < 0 or q_len > seq_len")
    if tokens == 0:
        return out
    group = hq // hkv
    heads_per_block = min(group, ROWS)
    tile_tokens = max(1, ROWS // group)
    tiles = (q_lens + tile_tokens - 1) // tile_tokens
    tile_starts = torch.zeros(batch + 1, dtype=torch.int32, device=query.device)
    tile_starts[1:] = torch.cumsum(tiles, 0)
    max_tiles = (tokens + batch * (tile_tokens - 1)) // tile_tokens  # >= tile_starts[-1]
    _launch(
        launcher, query, kv_layer, out, block_tables, seq_lens, qsl, tile_starts, max_tiles,
        ROWS, heads_per_block, tile_tokens, _NO_SPLIT, 1, scale,
    )  # fmt: skip
    return out
