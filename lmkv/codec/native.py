"""cachegen's decode in C (native.c): built with the system C compiler on first use into
$LMKV_CACHE_DIR (lmkv.cc), linked to the system's libzstd, loaded with ctypes;
``decode`` is its checking wrapper. Where no compiler or libzstd is found, with
LMKV_NATIVE_DECODE=0, or for a chunk it does not take, cachegen decodes with torch. The same
chunk either way, to rounding: float32 chunks to float32 rounding without AMX (with AMX the
products stay in float32 where torch rounds them to bfloat16); bfloat16 and float16 chunks
differ by a rounding or two more, as torch rounds to the chunk's dtype after each step where
the native path rounds once."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import itertools
import logging
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..cc import build as cc_build
from ..cc import cache_dir, compiler, switched_off
from ..memory import NO_POSITION
from .calibration import CacheGenTable

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("native.c")
DISABLE_ENV = "LMKV_NATIVE_DECODE"
ERRORS = {-1: "truncated stream descriptors", -2: "bad width or truncated",  # native.c's codes
          -3: "length does not match its symbols", -4: "does not decode",
          -5: "stray bytes after the last stream", -6: "out of memory"}
STRAY = -5
MAX_CHANNELS = 4096  # heads * head_dim that native.c's row buffers hold
OUT_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # native.c's out_kind

_P, _I64P, _SZ, _INT = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_size_t, ctypes.c_int


def build(cc: str, zstd: str, out_dir: Path, flags: tuple[str, ...] = ()) -> Path:
    """native.c compiled for this CPU (plus ``flags``) and linked to ``zstd``, into out_dir
    (lmkv.cc.build: named by what went into it, built once)."""
    return cc_build(cc, SOURCE, out_dir, flags, libs=(f"-l:{zstd}",))


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded decoder, or None (the reason logged once) to decode with torch."""
    if switched_off(DISABLE_ENV):
        log.info("cachegen: native decode off (%s=0); decoding with torch", DISABLE_ENV)
        return None
    cc = compiler()
    zstd = ctypes.util.find_library("zstd")
    try:
        if cc is None or zstd is None:
            raise OSError("no C compiler (cc, gcc or $CC)" if cc is None else "no libzstd")
        path = build(cc, zstd, cache_dir())
        lib = load(path)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("cachegen: no native decoder (%s); decoding with torch, at about half the speed", e)
        return None
    log.info("cachegen: native decoder %s (%s)", path,
             "AMX" if lib.lmkv_amx() else "no AMX: the matmul runs in torch")
    return lib


def load(path: Path) -> ctypes.CDLL:
    """A built native.c with its functions' signatures declared."""
    lib = ctypes.CDLL(str(path))
    lib.lmkv_symbols.restype = ctypes.c_long
    lib.lmkv_symbols.argtypes = [_P, _SZ, _SZ, _INT, _P, _P, _P, _INT, _P, _SZ, _P, _INT, _P, _I64P]
    lib.lmkv_finish.restype = _INT
    lib.lmkv_finish.argtypes = [_INT] * 4 + [_P, _INT] + [_P] * 4 + [_INT, _P, _P, _P, _INT, _INT, _P, _P]
    lib.lmkv_amx.restype = _INT
    lib.lmkv_amx.argtypes = []
    lib.lmkv_decode_amx.restype = ctypes.c_long
    lib.lmkv_decode_amx.argtypes = ([_P, _SZ, _SZ, _INT, _P, _P, _P] + [_INT] * 4 + [_P] * 5
                                    + [_INT, _INT, _P, _P, _P, _SZ, _P, _I64P])
    return lib


def amx_workspace(c: int, t: int) -> int:
    """Bytes of lmkv_decode_amx's workspace for matrices of C channels and T tokens."""
    return 7 * c * t + 64 * c


@dataclass(frozen=True)
class StreamPlan:
    """Where a transform payload's streams go for chunks of T tokens: symbols per stream,
    their offset in the coefficients [2L, C, T], the (kv-layer, first, end coefficient) of
    each, and the (offset, length) ranges of coefficients no stream holds (zeros)."""

    sizes: np.ndarray  # int64 [S]
    at: np.ndarray  # int64 [S]
    band: np.ndarray  # int32 [S, 3]
    gaps: np.ndarray  # int64 [G, 2]

    @classmethod
    def of(cls, table: CacheGenTable, t: int) -> StreamPlan:
        two, layers, h, d = table.step.shape
        c = h * d
        sizes, at, streams, gaps = [], [], [], []
        for i, e in enumerate(table.bands.reshape(two * layers, -1).tolist()):
            for a, b in itertools.pairwise(e):
                sizes.append((b - a) * t)
                at.append((i * c + a) * t)
                streams.append((i, a, b))
            gaps += [((i * c + lo) * t, (hi - lo) * t) for lo, hi in ((0, e[0]), (e[-1], c)) if hi > lo]
        return cls(np.array(sizes, np.int64), np.array(at, np.int64),
                   np.array(streams, np.int32).reshape(-1, 3), np.array(gaps, np.int64).reshape(-1, 2))


def decode(view: memoryview, start: int, table: CacheGenTable, out: torch.Tensor, position: int) -> bool:
    """Decode the transform payload ``view`` (zstd coder; its stream descriptors at ``start``,
    already checked against the table) into ``out`` [2, L, T, H, D] (float32, float16 or
    bfloat16, rounded once). False, with ``out`` untouched, where this path does not take the
    chunk (no library, another dtype, not contiguous, more than MAX_CHANNELS channels, an odd
    head_dim): the caller decodes it with torch. Raises cachegen.PayloadError on a bad
    payload (``out`` may then hold part of a chunk). With AMX, the whole decode runs in C one
    (kv, layer) matrix at a time; else the streams become coefficients in C (in the product
    dtype, cachegen.product_dtype), the batched product is torch's, and one C pass writes
    the chunk."""
    two, layers, t, h, d = out.shape
    n, c = two * layers, h * d
    if (out.dtype not in OUT_KINDS or not out.is_contiguous() or c > MAX_CHANNELS or d % 2
            or (lib := library()) is None):
        return False
    kind = OUT_KINDS[out.dtype]
    plan = table.scratch.plan(table, t)
    data = np.frombuffer(view, np.uint8)
    payload = (data.ctypes.data, len(data), start, len(plan.sizes), plan.sizes.ctypes.data,
               plan.at.ctypes.data)
    wide = np.empty(len(plan.sizes), np.int32)  # the int16 streams' indices
    bad = ctypes.c_int64()
    synthesis, synthesis_bf16, offset = table.synthesis
    rot: tuple[int, int | None, int | None] = (0, None, None)  # keys: the first n matrices
    if position != NO_POSITION:
        angle = (torch.arange(position, position + t, dtype=torch.int64).to(torch.float32)[:, None]
                 * table.rope[None, :])
        cos, sin = angle.cos(), angle.sin()  # [T, D/2], alive until the C calls return
        rot = (layers, cos.data_ptr(), sin.data_ptr())
    # AMX writes a matrix before it reads the next one's streams: not over its own payload
    lo, hi = data.ctypes.data, data.ctypes.data + len(data)
    apart = hi <= out.data_ptr() or out.data_ptr() + out.nbytes <= lo
    amx = c % 32 == 0 and t > 0 and t % 16 == 0 and apart and lib.lmkv_amx()
    from .cachegen import product_dtype  # cachegen imports this module

    scratch = table.scratch.take(n, c, t, torch.bfloat16 if amx else product_dtype(c))
    try:
        if amx:
            synthesis_t = table.scratch.synthesis_t(table)
            rc = lib.lmkv_decode_amx(*payload, plan.band.ctypes.data, n, t, h, d, synthesis_t.data_ptr(),
                                     offset.data_ptr(), synthesis.data_ptr(), scratch.wide.data_ptr(),
                                     out.data_ptr(), kind, *rot, scratch.work.data_ptr(),
                                     scratch.work.numel(), wide.ctypes.data, ctypes.byref(bad))
            _check(rc, bad.value)
            return True
        f32 = scratch.coef.dtype == torch.float32  # the torch product's dtype
        rc = lib.lmkv_symbols(*payload, scratch.coef.data_ptr(), f32, scratch.wide.data_ptr(),
                              scratch.coef.numel(), plan.gaps.ctypes.data, len(plan.gaps),
                              wide.ctypes.data, ctypes.byref(bad))
        _check(rc, bad.value)
        torch.bmm(scratch.coef.transpose(1, 2), synthesis if f32 else synthesis_bf16, out=scratch.low)
        rc = lib.lmkv_finish(n, t, h, d, scratch.low.data_ptr(), f32, offset.data_ptr(), synthesis.data_ptr(),
                             scratch.wide.data_ptr(), wide.ctypes.data, rc, plan.band.ctypes.data,
                             plan.at.ctypes.data, out.data_ptr(), kind, *rot)
        assert rc == 0, f"lmkv_finish refused heads {h} x head_dim {d}"  # checked above
        return True
    finally:
        table.scratch.give(scratch)


def _check(rc: int, bad: int) -> None:
    """A native.c result: an error code raised as cachegen.PayloadError."""
    if rc >= 0:
        return
    from .cachegen import PayloadError  # cachegen imports this module

    if rc == STRAY:
        raise PayloadError(f"{bad} stray bytes after the last stream")
    raise PayloadError(f"stream {bad}: {ERRORS.get(rc, f'error {rc}')}")
