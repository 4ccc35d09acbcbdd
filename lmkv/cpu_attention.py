"""Paged attention on the CPU in C (attention.c, built on first use by lmkv.cc) for steps with
a few queries per sequence: decode steps and short extends after a cached prefix (a warm
request's last tokens over the KV lmkv loaded). It reads the pages in place, once, on
torch's OpenMP threads, where the torch reference first gathers every sequence's KV into a
new tensor. ``attention`` answers None for
what it does not take (another device, dtype or layout, too many queries per sequence, no C
compiler, LMKV_NATIVE_ATTENTION=0): the caller then runs the torch reference. Results equal
the reference's up to float32 rounding (another summation order)."""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch

from .cc import build, cache_dir, compiler, switched_off

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("attention.c")
DISABLE_ENV = "LMKV_NATIVE_ATTENTION"
MAX_ROWS, MAX_BLOCK, MAX_DIM = 128, 128, 256  # attention.c's limits
# query rows (queries x heads sharing a KV head) per sequence up to which this is taken: a
# decode step, or up to 5 new tokens of a model with 3 query heads per KV head. Beyond, the
# reference's matrix products catch up (benchmarks/cpu_attention.py on SmolLM2's shape, 4096
# keys: 12 rows 1.58x / 1.20x faster than the reference in float32 / bfloat16, 24 rows
# 1.15x / 0.95x)
ROWS = 16
KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
E_MEMORY = -2  # attention.c's code
# sums and maxima may be reordered (vectorized); infinities and NaNs keep their meaning
FLAGS = ("-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")

_I64, _P = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None (the reason logged once) to run the torch reference."""
    if switched_off(DISABLE_ENV):
        log.info("lmkv: native CPU attention off (%s=0); attention runs in torch", DISABLE_ENV)
        return None
    cc = compiler()
    try:
        if cc is None:
            raise OSError("no C compiler (cc, gcc or $CC)")
        flags = build_flags()
        threads = "-fopenmp" in flags
        try:
            path = build(cc, SOURCE, cache_dir(), flags, libs=("-lm",))
        except OSError as e:  # e.g. a compiler without OpenMP's library: one thread, then
            if not threads:
                raise
            log.warning("lmkv: native CPU attention built without OpenMP (%s)", e)
            threads = False
            path = build(cc, SOURCE, cache_dir(), FLAGS, libs=("-lm",))
        lib = load(path)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("lmkv: no native CPU attention (%s); attention runs in torch", e)
        return None
    log.info("lmkv: native CPU attention %s (%s)", path,
             "on torch's OpenMP threads" if threads else "one thread")
    return lib


def build_flags() -> tuple[str, ...]:
    """attention.c's compiler flags here: with -fopenmp where torch runs GNU OpenMP."""
    return FLAGS + (("-fopenmp",) if _torch_openmp() is not None else ())


def _torch_openmp() -> str | None:
    """The GNU OpenMP runtime this process has loaded (torch's), or None. Built with
    -fopenmp, attention.c binds to the runtime of that soname already loaded, so its
    parallel spans run on torch's threads; with no such runtime loaded (another OpenMP, or
    none), a second pool would contend with torch's, and it is built without."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    found = {line.split()[-1] for line in maps.splitlines() if "/libgomp" in line}
    return next(iter(found)) if len(found) == 1 else None


def load(path: Path) -> ctypes.CDLL:
    """A built attention.c with its function's signature declared."""
    lib = ctypes.CDLL(str(path))
    lib.lmkv_paged_attention.restype = ctypes.c_int
    lib.lmkv_paged_attention.argtypes = [_P] * 4 + [_I64] + [_P] * 2 + [_I64] * 9 + [ctypes.c_float]
    return lib


def attention(query: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
              seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float
              ) -> torch.Tensor | None:
    """Causal attention of query [T, Hq, D] (sequence i: rows [query_start_loc[i], [i + 1]),
    the last at position seq_lens[i] - 1) over kv_layer [2, blocks, block_size, Hkv, D] at
    block_tables [B, max_blocks] -> [T, Hq, D], or None when this does not take it."""
    if not _takes(query, kv_layer, block_tables) or (lib := library()) is None:
        return None
    if {seq_lens.device.type, query_start_loc.device.type} != {"cpu"}:
        return None
    heads, dim = query.shape[1], query.shape[2]
    kv_heads, block_size = kv_layer.shape[3], kv_layer.shape[2]
    starts = query_start_loc.to(torch.int64).contiguous()
    nseq = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    # attention.c indexes the query, the output and the tables by these without bounds
    if (starts.dim() != 1 or starts.numel() != nseq + 1 or block_tables.shape[0] < nseq
            or (nseq and not (int(starts[0]) >= 0 and bool((starts[1:] >= starts[:-1]).all())
                              and int(starts[-1]) <= query.shape[0]))):
        raise ValueError(f"attention metadata does not fit: query {tuple(query.shape)}, "
                         f"seq_lens {tuple(seq_lens.shape)}, query_start_loc {starts.tolist()} "
                         f"(non-decreasing, within the query's rows, one more than seq_lens), "
                         f"block_tables {tuple(block_tables.shape)}")
    if starts.numel() < 2 or int((starts[1:] - starts[:-1]).max()) * (heads // kv_heads) > ROWS:
        return None
    q = query.to(torch.float32).contiguous()
    out = torch.empty_like(q)
    tables = block_tables.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    size = kv_layer.element_size()
    rc = lib.lmkv_paged_attention(
        q.data_ptr(), out.data_ptr(), kv_layer.data_ptr(), tables.data_ptr(), tables.shape[1],
        lens.data_ptr(), starts.data_ptr(), lens.shape[0], heads, kv_heads, dim, block_size,
        KINDS[kv_layer.dtype], kv_layer.stride(0) * size, kv_layer.stride(1) * size,
        kv_layer.shape[1], scale)
    if rc == E_MEMORY:
        raise MemoryError("native CPU attention could not allocate its work space")
    if rc != 0:
        raise ValueError(f"native CPU attention refused its arguments (a block id outside the "
                         f"pages or a sequence longer than its table?): query {tuple(query.shape)}, "
                         f"KV {tuple(kv_layer.shape)}, seq_lens {lens.tolist()}, query starts "
                         f"{starts.tolist()}")
    return out if query.dtype == torch.float32 else out.to(query.dtype)


def _takes(query: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor) -> bool:
    """CPU tensors, the query in the KV's dtype (float32, float16 or bfloat16), a layout of
    [2, blocks, block_size, Hkv, D] with each token's Hkv * D contiguous, and shapes within
    attention.c's limits."""
    if query.dim() != 3 or kv_layer.dim() != 5 or block_tables.dim() != 2:
        return False
    if {query.device.type, kv_layer.device.type, block_tables.device.type} != {"cpu"}:
        return False
    if kv_layer.dtype not in KINDS or query.dtype != kv_layer.dtype:
        return False
    two, _, block_size, kv_heads, dim = kv_layer.shape
    st = kv_layer.stride()
    return (two == 2 and query.shape[2] == dim and query.shape[1] % kv_heads == 0
            and block_size <= MAX_BLOCK and dim <= MAX_DIM
            and (st[4], st[3], st[2]) == (1, dim, kv_heads * dim))
