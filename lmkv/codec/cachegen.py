"""cachegen: lossy KV compression in the spirit of CacheGen (Liu et al., SIGCOMM'24).

A chunk kv [2, L, T, Hkv, D] becomes symbols, then bytes:
1. quantize: q = round((x - mean) / step) per channel, clamped to [-16383, 16383]; the
   table (calibration.py) holds mean/step per [kv, layer, head, dim], measured on the model.
2. delta: in (kv, layer) streams the table marks, every token but the first of each group of
   ``group_size`` tokens is replaced by q - q[anchor]. The difference is taken on the
   integers, so it is exact: the error is the quantization error alone, with no drift.
3. entropy coding of each (kv, layer) stream: int8 symbols through zstd (default) or the
   numpy rANS coder (rans.py); a stream with a symbol outside int8 goes as int16 via zstd.

Payload (inside the 64-byte frame, which names codec "cachegen" and checks the bytes):
  "CGv1", table id u64, group size u16, coder u8, reserved u8, streams u32,
  then per stream: width u8 (1 = int8, 2 = int16), length u32; then the stream bytes.

``quantize`` / ``dequantize`` are the torch twins of the CUDA kernels in
cuda/cachegen.cu (same signatures; the wrappers are in cuda/cachegen.py; lmkv.ops picks one
by device). Chunks leave the hot cache from CPU memory, so the torch twins are what runs
today; ``encode`` takes a CUDA chunk too (quantized on the GPU, entropy-coded on the CPU).
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from .. import ops
from . import rans
from .calibration import CacheGenTable

_HEAD = struct.Struct("<4sQHBBI")
_STREAM = struct.Struct("<BI")
MAGIC = b"CGv1"
CODERS = {"zstd": 0, "rans": 1}
QMAX = 16383  # |q| <= QMAX, so anchor differences fit int16


class PayloadError(ValueError):
    """A cachegen payload that is malformed or made with another table."""


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


def encode(kv: torch.Tensor, table: CacheGenTable, coder: str = "zstd") -> bytes:
    """The cachegen payload of one chunk kv [2, L, T, H, D]."""
    import zstandard

    table.check_layout(tuple(kv.shape))
    dev = kv.device  # a CUDA chunk is quantized by the kernel (lmkv.ops), then coded here
    symbols = ops.cachegen_quantize(kv, table.step.to(dev), table.mean.to(dev),
                                    table.delta.to(dev), table.group_size).cpu()
    streams = symbols.reshape(2 * kv.shape[1], -1)  # [2 * L, T * H * D]
    lo, hi = streams.aminmax(dim=1)
    small = (lo >= -127) & (hi <= 127)
    narrow = streams.to(torch.int8).numpy()  # wraps where a stream does not fit: not used
    wide = streams.numpy()
    zc = zstandard.ZstdCompressor(level=1)
    descs, blobs = [], []
    for i, fits in enumerate(small.tolist()):
        if fits:
            arr = narrow[i]
            blob = rans.encode(arr) if coder == "rans" else zc.compress(arr.data)
        else:
            blob = zc.compress(wide[i].astype("<i2").tobytes())
        descs.append(_STREAM.pack(1 if fits else 2, len(blob)))
        blobs.append(blob)
    head = _HEAD.pack(MAGIC, table.table_id, table.group_size, CODERS[coder], 0, len(blobs))
    return b"".join([head, *descs, *blobs])


def decode_into(payload: bytes | memoryview, out: torch.Tensor, table: CacheGenTable) -> None:
    """Decode a payload made by ``encode`` into out [2, L, T, H, D]. Raises PayloadError on
    anything unexpected."""
    import zstandard

    view = memoryview(payload)
    if len(view) < _HEAD.size:
        raise PayloadError("truncated cachegen payload")
    magic, table_id, group, coder, _, count = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise PayloadError(f"not a cachegen payload (magic {bytes(magic)!r})")
    if table_id != table.table_id or group != table.group_size:
        raise PayloadError(f"payload made with calibration table {table_id:016x}, "
                           f"this reader has {table.table_id:016x}")
    if coder not in CODERS.values():
        raise PayloadError(f"unknown entropy coder id {coder}")
    two, layers, t, h, d = out.shape
    if count != two * layers:
        raise PayloadError(f"payload has {count} streams, chunk needs {two * layers}")
    table.check_layout(tuple(out.shape))
    n = t * h * d
    off = _HEAD.size + count * _STREAM.size
    if len(view) < off:
        raise PayloadError("truncated cachegen payload")
    wide = False
    parts: list[np.ndarray] = []
    dz = zstandard.ZstdDecompressor()
    for i in range(count):
        width, length = _STREAM.unpack_from(view, _HEAD.size + i * _STREAM.size)
        blob = view[off : off + length]
        off += length
        if width not in (1, 2) or len(blob) != length:
            raise PayloadError(f"stream {i}: bad width {width} or truncated")
        try:
            if width == 1 and coder == CODERS["rans"]:
                parts.append(rans.decode(blob, n))
                continue
            raw = dz.decompress(blob, max_output_size=n * width)
        except (zstandard.ZstdError, rans.RansError) as e:
            raise PayloadError(f"stream {i} does not decode: {e}") from e
        if len(raw) != n * width:
            raise PayloadError(f"stream {i} decodes to {len(raw)} bytes, expected {n * width}")
        parts.append(np.frombuffer(raw, np.int8 if width == 1 else "<i2"))
        wide |= width == 2
    if off != len(view):
        raise PayloadError(f"{len(view) - off} stray bytes after the last stream")
    if wide:
        symbols = np.concatenate([p.astype(np.int16) for p in parts])
    else:
        symbols = np.concatenate(parts)
    q = torch.from_numpy(symbols).view(out.shape)
    dequantize(q, table.step, table.mean, table.delta, table.group_size, out)
