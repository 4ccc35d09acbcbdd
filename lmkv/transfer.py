"""Copies between the bundled engine's paged KV memory and chunks on the CPU, in C
(transfer.c, built on first use by lmkv.cc): one memcpy per run of consecutive slots, layer
and K/V, large copies split over torch's intra-op threads and written with streaming stores.
``copy`` answers False for what it does not take (another device or dtype, rows that are not
contiguous, no C compiler, LMKV_NATIVE_COPY=0): the caller then copies with torch. The same
bytes either way."""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch

from .cc import build, cache_dir, compiler, switched_off

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("transfer.c")
DISABLE_ENV = "LMKV_NATIVE_COPY"
STREAM_BYTES = 4 << 20  # copies this large bypass the caches (the chunk would not fit them anyway)
E_SLOT, E_MEMORY = -1, -2  # transfer.c's codes

_I64 = ctypes.c_int64


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded copier, or None (the reason logged once) to copy with torch."""
    if switched_off(DISABLE_ENV):
        log.info("lmkv: native paged copies off (%s=0); copying with torch", DISABLE_ENV)
        return None
    cc = compiler()
    try:
        if cc is None:
            raise OSError("no C compiler (cc, gcc or $CC)")
        path = build(cc, SOURCE, cache_dir(), libs=("-lpthread",))
        lib = load(path)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("lmkv: no native paged copies (%s); copying with torch, at about half the speed", e)
        return None
    log.info("lmkv: native paged copies %s", path)
    return lib


def load(path: Path) -> ctypes.CDLL:
    """A built transfer.c with its function's signature declared."""
    lib = ctypes.CDLL(str(path))
    lib.lmkv_transfer.restype = ctypes.c_int
    lib.lmkv_transfer.argtypes = [ctypes.c_void_p] * 3 + [_I64] * 10 + [ctypes.c_int] * 3
    return lib


def copy(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, chunk: torch.Tensor, skip: int,
         to_paged: bool) -> bool:
    """Tokens [skip, T) between ``chunk`` [2, L, T, Hkv, D] and ``kv_cache`` [L, 2, blocks,
    block_size, Hkv, D] at ``slot_mapping`` [T]; True when done here, False to leave it to
    torch (nothing copied). Raises IndexError for a slot outside paged memory (nothing
    copied)."""
    if not _takes(kv_cache, slot_mapping, chunk, skip) or (lib := library()) is None:
        return False
    layers, _, blocks, block_size, heads, dim = kv_cache.shape
    tokens = chunk.shape[2] - skip
    if tokens == 0:
        return True
    size = kv_cache.element_size()
    cs, ks = [s * size for s in chunk.stride()], [s * size for s in kv_cache.stride()]
    slots = slot_mapping[skip:].contiguous()
    row = heads * dim * size
    rc = lib.lmkv_transfer(chunk.data_ptr() + skip * cs[2], kv_cache.data_ptr(), slots.data_ptr(),
                           tokens, blocks * block_size, layers, row, cs[0], cs[1], cs[2],
                           ks[0], ks[1], ks[3], int(to_paged), torch.get_num_threads(),
                           int(2 * layers * tokens * row >= STREAM_BYTES))
    if rc == E_SLOT:
        raise IndexError(f"slot mapping holds a slot outside paged memory's {blocks * block_size} slots")
    if rc != 0:
        raise MemoryError(f"native paged copy of {tokens} tokens failed ({rc})")
    return True


def _takes(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, chunk: torch.Tensor, skip: int) -> bool:
    """CPU tensors of one dtype, int64 slots, shapes that match, rows of Hkv * D contiguous
    on both sides and blocks back to back in paged memory (any strides above)."""
    if kv_cache.dim() != 6 or chunk.dim() != 5 or slot_mapping.dim() != 1:
        return False
    if {kv_cache.device.type, chunk.device.type, slot_mapping.device.type} != {"cpu"}:
        return False
    if chunk.dtype != kv_cache.dtype or slot_mapping.dtype != torch.int64 or chunk.dtype.is_complex:
        return False  # (complex tensors may be lazy conjugate views: their bits are not their values)
    layers, two, _, block_size, heads, dim = kv_cache.shape
    if two != 2 or chunk.shape != (2, layers, slot_mapping.shape[0], heads, dim):
        return False
    if not 0 <= skip <= chunk.shape[2]:
        return False
    ks, cs = kv_cache.stride(), chunk.stride()
    return (ks[5], ks[4], ks[3], ks[2]) == (1, dim, heads * dim, block_size * heads * dim) and (
        cs[4], cs[3]) == (1, dim)
