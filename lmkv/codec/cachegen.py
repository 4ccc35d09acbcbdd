"""cachegen: lossy KV compression in the spirit of CacheGen (Liu et al., SIGCOMM'24).

A chunk kv [2, L, T, Hkv, D] becomes symbols, then bytes:
1. quantize: q = round((x - mean) / step) per channel, |q| < 16383 (a chunk beyond that
   raises OutOfRange: its caller stores it losslessly); the table (calibration.py) holds
   mean/step per [kv, layer, head, dim], measured on the model.
2. delta: in (kv, layer) streams the table marks, every token but the first of each group of
   ``group_size`` tokens is replaced by q - q[anchor]. The difference is taken on the
   integers, so it is exact: the error is the quantization error alone, with no drift.
3. entropy coding of each (kv, layer) stream: int8 symbols through zstd (default) or the
   numpy rANS coder (rans.py); a stream with a symbol outside int8 goes as int16 via zstd.

With a table that has a decorrelating transform (calibration.py, the default), step 1
quantizes each token's coefficients in the layer's basis instead of its channels (no
deltas), and the streams are the table's bands of each (kv, layer): coefficients of similar
spread, coefficient-major ([coefficients, T]); coefficients past the last band, if the
table drops any, are not stored (they decode to their mean).

With a table that has ``rope`` (calibration.py), keys are un-rotated by their positions
(``position`` + t for token t) before step 1 and rotated back after decoding; a chunk whose
keys carry no rotation (stored before RoPE) is coded with ``NO_POSITION``.

Payload (inside the 64-byte frame, which names codec "cachegen" and checks the bytes):
  "CGv1" (per channel) or "CGv2" (transform), table id u64, group size u16, coder u8,
  flags u8 (1: keys un-rotated, a position u32 follows the head), streams u32, then per
  stream: width u8 (1 = int8, 2 = int16, 3 = int8 not entropy-coded), length u32; then the
  stream bytes (a stream of length 0 holds no symbols).

``quantize`` / ``dequantize`` are the torch twins of the CUDA kernels in
cuda/cachegen.cu (same signatures; the wrappers are in cuda/cachegen.py). Chunks leave the
hot cache from CPU memory, so the torch twins are what runs; ``encode`` takes a CUDA chunk
too (quantized on the GPU through lmkv.ops.cachegen_quantize, entropy-coded on the CPU), and
``decode_into`` writes CPU memory only.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import struct
import threading
import time
from typing import NamedTuple

import numpy as np
import torch

from .. import ops
from ..memory import NO_POSITION
from . import native, rans
from .base import zstd_exact
from .calibration import QMAX, CacheGenTable

_HEAD = struct.Struct("<4sQHBBI")
_STREAM = struct.Struct("<BI")
_POSITION = struct.Struct("<I")
ROPE = 1  # flag: keys un-rotated by the position that follows the head
MAGIC = b"CGv1"
MAGIC_TRANSFORM = b"CGv2"
CODERS = {"zstd": 0, "rans": 1}
STORED = 3  # stream width code: int8 symbols as they are, not entropy-coded
PRODUCT_ENV = "LMKV_CODEC_PRODUCT"  # bfloat16 or float32: the decode's product dtype, not timed
PRODUCT_LEAD = 1.25  # float32 must be this much faster than bfloat16 to be picked

log = logging.getLogger(__name__)


class PayloadError(ValueError):
    """A cachegen payload that is malformed or made with another table."""


class ForeignPayload(PayloadError):
    """A sound payload this reader cannot decode: made with another calibration table than
    its own, or where it has none (another engine's, sharing the store, or its own from
    before the quality gate tripped)."""


class OutOfRange(ValueError):
    """A chunk with values beyond the table's range (|x - mean| / step >= QMAX): coded, they
    would be clamped, far outside the error bound; the caller stores it another way."""


def quantize(kv: torch.Tensor, step: torch.Tensor, mean: torch.Tensor, delta: torch.Tensor,
             group_size: int) -> torch.Tensor:
    """kv [2, L, T, H, D] float -> symbols [2, L, T, H, D] int16 (steps 1 and 2 above).
    step, mean: [2, L, H, D] float32; delta: [2, L] bool."""
    x = kv.float() - mean[:, :, None]  # fp16/bf16: the upcast is one extra pass
    q = x.div_(step[:, :, None]).round_().clamp_(-QMAX, QMAX).to(torch.int16)
    if not bool(delta.any()):
        return q
    t = kv.shape[2]
    anchor = q[:, :, (torch.arange(t, device=kv.device) // group_size) * group_size]
    anchor[:, :, ::group_size] = 0  # anchors stay themselves
    anchor *= delta[:, :, None, None, None].to(torch.int16)
    return q - anchor


def dequantize(symbols: torch.Tensor, step: torch.Tensor, mean: torch.Tensor,
               delta: torch.Tensor, group_size: int, out: torch.Tensor) -> None:
    """The inverse of ``quantize`` up to rounding: out [2, L, T, H, D] (any float dtype) =
    (symbols + anchor) * step + mean. symbols int8 or int16."""
    q = symbols.to(torch.float32)
    t = q.shape[2]
    if bool(delta.any()):
        anchor = q[:, :, ::group_size].repeat_interleave(group_size, dim=2)[:, :, :t]
        anchor[:, :, ::group_size] = 0
        anchor *= delta[:, :, None, None, None]
        q += anchor
    if out.dtype == torch.float32:
        torch.addcmul(mean[:, :, None], q, step[:, :, None], out=out)
    else:
        out.copy_(torch.addcmul(mean[:, :, None], q, step[:, :, None]))


def encode(kv: torch.Tensor, table: CacheGenTable, coder: str = "zstd",
           position: int | None = None) -> bytes:
    """The cachegen payload of one chunk kv [2, L, T, H, D] whose first token is at
    ``position`` (needed by a table with ``rope``; NO_POSITION: keys before RoPE)."""
    import zstandard

    table.check_layout(tuple(kv.shape))
    if position is None:
        if table.rope is not None:
            raise ValueError("a table with rotary frequencies needs the chunk's position")
        position = 0
    if not 0 <= position <= NO_POSITION:
        raise ValueError(f"chunk position {position} outside [0, 2^32)")
    dev = kv.device  # a CUDA chunk is quantized by the kernel (lmkv.ops), then coded here
    two, layers, t, h, d = kv.shape
    x = kv
    if table.rope is not None and position != NO_POSITION:
        x = kv.to(torch.float32, copy=True)  # the rotation below must not touch the caller's
        ops.rerotate_keys(x[0], -_positions(position, t, dev), table.rope.to(dev))
    if table.basis is not None:
        x = (x.float().reshape(two, layers, t, h * d) @ table.basis.to(dev)).view(kv.shape)
    symbols = ops.cachegen_quantize(x, table.step.to(dev), table.mean.to(dev),
                                    table.delta.to(dev), table.group_size).cpu()
    # NaN would quantize to some finite symbol; the rotation and the transform can also
    # overflow finite values near the dtype's limit into inf - inf
    if not (bool(torch.isfinite(kv).all()) and bool(torch.isfinite(x).all())):
        raise OutOfRange("the chunk holds a NaN or an infinity")
    if (worst := _largest_symbol(symbols, table)) >= QMAX:
        raise OutOfRange(f"a value {worst} steps from the table's mean (at most {QMAX - 1} can be "
                         f"coded): the chunk is outside what calibration measured")
    if table.basis is None:
        streams = list(symbols.reshape(two * layers, -1))  # [T * H * D] each
    else:
        coef = symbols.reshape(two * layers, t, h * d).transpose(1, 2)  # [2L, C, T]
        edges = table.bands.reshape(two * layers, -1).tolist()
        streams = [coef[i, a:b].reshape(-1) for i, e in enumerate(edges)
                   for a, b in itertools.pairwise(e)]
    zc = zstandard.ZstdCompressor(level=1, write_content_size=False)
    descs, blobs = [], []
    for stream in streams:
        if stream.numel() == 0:
            descs.append(_STREAM.pack(1, 0))
            continue
        lo, hi = stream.aminmax()
        if lo >= -127 and hi <= 127:
            arr = stream.to(torch.int8).numpy()
            width, blob = 1, rans.encode(arr) if coder == "rans" else zc.compress(arr.data)
            if len(blob) >= arr.nbytes:  # incompressible (tiny or noise-like): as it is
                width, blob = STORED, arr.tobytes()
        else:
            width, blob = 2, zc.compress(stream.numpy().astype("<i2").tobytes())
        descs.append(_STREAM.pack(width, len(blob)))
        blobs.append(blob)
    magic = MAGIC if table.basis is None else MAGIC_TRANSFORM
    flags = ROPE if table.rope is not None else 0
    head = _HEAD.pack(magic, table.table_id, table.group_size, CODERS[coder], flags, len(descs))
    if flags:
        head += _POSITION.pack(position)
    return b"".join([head, *descs, *blobs])


def _largest_symbol(symbols: torch.Tensor, table: CacheGenTable) -> int:
    """max |q| before deltas, for symbols [2, L, T, H, D] int16 (quantize clamps to QMAX, so
    QMAX means a value was clamped)."""
    if not bool(table.delta.any()):
        return int(symbols.to(torch.int32).abs().amax())  # (int16: |-32768| is -32768)
    q = symbols.to(torch.int32)
    g = table.group_size
    anchor = q[:, :, ::g].repeat_interleave(g, dim=2)[:, :, : q.shape[2]]
    anchor[:, :, ::g] = 0
    return int((q + anchor * table.delta[:, :, None, None, None].to(torch.int32)).abs().amax())


def _positions(first: int, t: int, device: torch.device) -> torch.Tensor:
    return torch.arange(first, first + t, dtype=torch.int64, device=device)


def decode_into(payload: bytes | memoryview, out: torch.Tensor, table: CacheGenTable) -> None:
    """Decode a payload made by ``encode`` into out [2, L, T, H, D] in CPU memory (where
    chunks are read to). Raises PayloadError on anything unexpected."""
    if out.device.type != "cpu":
        raise ValueError(f"cachegen decodes into CPU memory, not {out.device}")
    view = memoryview(payload)
    if len(view) < _HEAD.size:
        raise PayloadError("truncated cachegen payload")
    magic, table_id, group, coder, flags, count = _HEAD.unpack_from(view)
    if magic not in (MAGIC, MAGIC_TRANSFORM):
        raise PayloadError(f"not a cachegen payload (magic {bytes(magic)!r})")
    if table_id != table.table_id or group != table.group_size:
        raise ForeignPayload(f"payload made with calibration table {table_id:016x}, "
                             f"this reader has {table.table_id:016x}")
    if (magic == MAGIC_TRANSFORM) != (table.basis is not None):
        raise PayloadError("payload and calibration table disagree on the transform")
    if coder not in CODERS.values():
        raise PayloadError(f"unknown entropy coder id {coder}")
    if flags & ~ROPE or bool(flags & ROPE) != (table.rope is not None):
        raise PayloadError(f"payload flags {flags:#x} do not fit the calibration table")
    start = _HEAD.size
    position = NO_POSITION
    if flags & ROPE:
        if len(view) < start + _POSITION.size:
            raise PayloadError("truncated cachegen payload")
        (position,) = _POSITION.unpack_from(view, start)
        start += _POSITION.size
    table.check_layout(tuple(out.shape))
    two, layers, t, h, d = out.shape
    if table.basis is None:
        sizes = [t * h * d] * (two * layers)
    else:
        widths = table.bands.reshape(two * layers, -1).diff(dim=1)  # coefficients per band
        sizes = (widths * t).reshape(-1).tolist()
    if count != len(sizes):
        raise PayloadError(f"payload has {count} streams, chunk needs {len(sizes)}")
    native_ok = table.basis is not None and coder == CODERS["zstd"]
    if native_ok and native.decode(view, start, table, out, position):
        return
    parts = _read_streams(view, coder, sizes, start)
    if table.basis is None:
        wide = any(p.dtype != np.int8 for p in parts)
        symbols = np.concatenate([p.astype(np.int16) for p in parts] if wide else parts)
        q = torch.from_numpy(symbols).view(out.shape)
        dequantize(q, table.step, table.mean, table.delta, table.group_size, out)
    else:
        _reconstruct(parts, table, out)
    if position != NO_POSITION:
        ops.rerotate_keys(out[0], _positions(position, t, out.device), table.rope)


def _read_streams(view: memoryview, coder: int, sizes: list[int], start: int
                  ) -> list[np.ndarray]:
    """The symbol arrays (int8 or int16) of the streams whose descriptors begin at
    ``start``; ``sizes`` says how many symbols each must hold."""
    count = len(sizes)
    off = start + count * _STREAM.size
    if len(view) < off:
        raise PayloadError("truncated cachegen payload")
    parts: list[np.ndarray] = []
    for i, n in enumerate(sizes):
        width, length = _STREAM.unpack_from(view, start + i * _STREAM.size)
        blob = view[off : off + length]
        off += length
        if width not in (1, 2, STORED) or len(blob) != length:
            raise PayloadError(f"stream {i}: bad width {width} or truncated")
        if n == 0 or length == 0:
            if n != 0 or length != 0:
                raise PayloadError(f"stream {i}: {length} bytes for {n} symbols")
            parts.append(np.zeros(0, np.int8))
            continue
        if width == STORED:
            if length != n:
                raise PayloadError(f"stream {i}: {length} stored bytes for {n} symbols")
            parts.append(np.frombuffer(blob, np.int8))
            continue
        try:
            if width == 1 and coder == CODERS["rans"]:
                parts.append(rans.decode(blob, n))
                continue
            raw = zstd_exact(blob, n * width, f"stream {i}")
        except (ValueError, rans.RansError) as e:
            raise PayloadError(f"stream {i} does not decode: {e}") from e
        parts.append(np.frombuffer(raw, np.int8 if width == 1 else "<i2"))
    if off != len(view):
        raise PayloadError(f"{len(view) - off} stray bytes after the last stream")
    return parts


def _reconstruct(parts: list[np.ndarray], table: CacheGenTable, out: torch.Tensor) -> None:
    """out[kv, layer] = coefficients @ basis^T + offset, from the band streams of a transform
    payload; coefficients not stored are at their mean. The steps are folded into the basis
    (``CacheGenTable.synthesis``). Coefficients coded as int8 are exact in bfloat16, so all
    (kv, layer) products run as one batched matmul in bfloat16 (its rounding is ~0.3% of the
    KV's spread around the offset) or float32, whichever this CPU runs faster
    (``product_dtype``); the offset and the wider bands (the strongest few coefficients) are
    added in ``out``'s dtype, each rounded to it (one rounding per step for bfloat16 and
    float16 chunks; the native decoder rounds once)."""
    two, layers, t, h, d = out.shape
    n, c = two * layers, h * d
    edges = table.bands.reshape(n, -1).tolist()
    pieces, wide = [], []
    for i, e in enumerate(edges):  # every (kv, layer)'s [C, T] symbols, in order
        for j, (a, b) in enumerate(itertools.pairwise(e)):
            p = parts[i * (len(e) - 1) + j]
            if p.dtype != np.int8:
                wide.append((i, a, b, p))
                p = np.zeros(len(p), np.int8)
            pieces.append(p)
        if e[-1] < c:
            pieces.append(np.zeros((c - e[-1]) * t, np.int8))
    synthesis, synthesis_bf16, offset = table.synthesis
    scratch = table.scratch.take(n, c, t, product_dtype(c))
    try:
        scratch.coef.copy_(torch.from_numpy(np.concatenate(pieces)).view(n, c, t))
        rows = synthesis if scratch.coef.dtype == torch.float32 else synthesis_bf16
        torch.bmm(scratch.coef.transpose(1, 2), rows, out=scratch.low)
        flat = out.view(n, t, c)
        flat.copy_(scratch.low)
        flat.add_(offset[:, None, :])
    finally:
        table.scratch.give(scratch)
    for i, a, b, p in wide:
        flat[i].add_(torch.from_numpy(p.astype(np.float32)).view(b - a, t).T @ synthesis[i, a:b])


PROBE_TOKENS = 256  # rows of the timed products (a typical chunk; the pick holds for any)
_products: dict[int, torch.dtype] = {}  # channels -> the product dtype picked
_products_lock = threading.Lock()


def forced_product() -> torch.dtype | None:
    """The product dtype ``LMKV_CODEC_PRODUCT`` sets (None: unset); ValueError naming the
    variable for another value (lmkv checks it when it loads a table, before any decode)."""
    forced = os.environ.get(PRODUCT_ENV)
    if not forced:
        return None
    if forced not in ("bfloat16", "float32"):
        raise ValueError(f"{PRODUCT_ENV}={forced!r}: expected bfloat16 or float32")
    return getattr(torch, forced)


def product_dtype(c: int) -> torch.dtype:
    """The dtype of the decode's batched (kv, layer) products of C channels on this CPU (the
    torch product, used where AMX does not decode): bfloat16 (int8 symbols are exact in it;
    about twice float32's rate where torch has fast bfloat16 kernels, e.g. AVX512-BF16 on
    AMD Zen 4) unless float32 runs more than ``PRODUCT_LEAD`` times faster (some Intel CPUs
    without AMX, whose bfloat16 matmul is slower than their float32 one). Timed once per C
    (on one matrix of ``PROBE_TOKENS`` tokens, at the threads torch has then; one thread at
    a time) unless ``LMKV_CODEC_PRODUCT`` sets it. Never raises: a bad setting or a failed
    timing is logged and gives bfloat16."""
    with _products_lock:
        if c not in _products:
            _products[c] = _pick_product(c)
        return _products[c]


def _pick_product(c: int) -> torch.dtype:
    try:
        forced = forced_product()
        if forced is not None:
            return forced
        bf16, f32 = _product_seconds(torch.bfloat16, c), _product_seconds(torch.float32, c)
    except Exception as e:  # noqa: BLE001 - a decode must not fail on how it multiplies
        log.error("cachegen: decode products in bfloat16 (%s)", e)
        return torch.bfloat16
    dtype = torch.float32 if f32 * PRODUCT_LEAD < bf16 else torch.bfloat16
    log.info("cachegen: decode products in %s (%d channels: bfloat16 %.2f ms, float32 %.2f ms)",
             str(dtype).removeprefix("torch."), c, bf16 * 1e3, f32 * 1e3)
    return dtype


def _product_seconds(dtype: torch.dtype, c: int) -> float:
    """The best of 2 timings of one (kv, layer) product as the decode runs it (coefficients
    [C, T] read transposed) in ``dtype``."""
    gen = torch.Generator().manual_seed(0)
    coef = torch.randint(-8, 8, (1, c, PROBE_TOKENS), generator=gen).to(dtype)
    rows = torch.randn(1, c, c, generator=gen).to(dtype)
    out = torch.empty(1, PROBE_TOKENS, c, dtype=dtype)
    torch.bmm(coef.transpose(1, 2), rows, out=out)  # warm-up
    best = math.inf
    for _ in range(2):
        start = time.perf_counter()
        torch.bmm(coef.transpose(1, 2), rows, out=out)
        best = min(best, time.perf_counter() - start)
    return best


class Scratch(NamedTuple):
    """One decode's buffers: coefficients [n, C, T] and products [n, T, C] in the torch
    product's dtype (``product_dtype``); int16 room [n * C * T] for the int16 streams'
    symbols; the native AMX decode's workspace (bytes; only the pages written are touched)."""

    coef: torch.Tensor
    low: torch.Tensor
    wide: torch.Tensor
    work: torch.Tensor


class DecodeScratch:
    """One table's decode buffers, reused (the first touch of fresh pages costs about as
    much as the matmul that fills them): at most ``KEEP`` sets wait between decodes, and
    decoders on several threads never share one (list pop and append are atomic). Also the
    table's derived decode data, made once under a lock."""

    KEEP = 2

    def __init__(self) -> None:
        self._free: list[Scratch] = []
        self._lock = threading.Lock()
        self._plans: dict[int, native.StreamPlan] = {}
        self._synthesis_t: torch.Tensor | None = None

    def synthesis_t(self, table: CacheGenTable) -> torch.Tensor:
        """bfloat16 [2L, C, C]: row j holds output channel j's synthesis weights (AMX's A)."""
        with self._lock:
            if self._synthesis_t is None:
                self._synthesis_t = table.synthesis[1].transpose(1, 2).contiguous()
            return self._synthesis_t

    def plan(self, table: CacheGenTable, t: int) -> native.StreamPlan:
        with self._lock:
            if t not in self._plans:
                self._plans[t] = native.StreamPlan.of(table, t)
            return self._plans[t]

    def take(self, n: int, c: int, t: int, dtype: torch.dtype = torch.bfloat16) -> Scratch:
        """A set of buffers for n matrices of C channels and T tokens, the coefficients and
        products in ``dtype`` (the torch product's: product_dtype)."""
        try:
            scratch = self._free.pop()
        except IndexError:
            scratch = None
        if scratch is None or scratch.coef.shape != (n, c, t) or scratch.coef.dtype != dtype:
            scratch = Scratch(torch.empty(n, c, t, dtype=dtype), torch.empty(n, t, c, dtype=dtype),
                              torch.empty(n * c * t, dtype=torch.int16),
                              torch.empty(native.amx_workspace(c, t), dtype=torch.uint8))
        return scratch

    def give(self, scratch: Scratch) -> None:
        if len(self._free) < self.KEEP:
            self._free.append(scratch)
