"""The frame every stored chunk travels in: a 64-byte header, then the payload.

Header (little-endian): magic "LMKV", version, codec id, dtype code, ndim, shape[5] u32,
payload length u64, xxh3-64 checksum of the payload, xxh3-64 of the chunk's key (so a
payload filed under the wrong key is caught), padding. Decoding checks every field
against what the reader expects before it touches the payload; nothing is unpickled.

Codecs: raw (the chunk's bytes), zstd (lossless), cachegen (lossy, cachegen.py: needs the
model's calibration table; its payload names the table it was made with).
"""

from __future__ import annotations

import struct

import torch
import xxhash

from ..memory import HEADER_BYTES, ChunkBuffer
from .calibration import CacheGenTable

MAGIC = b"LMKV"
VERSION = 1
_HEADER = struct.Struct("<4sBBBB5IQQQ")
CODEC_BYTE = 5  # offset of the codec id in the header
assert _HEADER.size <= HEADER_BYTES

CODECS = {"raw": 0, "zstd": 1, "cachegen": 2}
_DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}


class FrameError(ValueError):
    """A stored payload is corrupt, truncated, or not what the reader expects."""


def encode(buf: ChunkBuffer, key: str, codec: str = "raw",
           table: CacheGenTable | None = None) -> memoryview:
    """The frame of ``buf``'s chunk. For 'raw' it is written in place, in the slot's header
    area, and the returned view aliases the slot (valid while the caller holds a reference).
    'cachegen' needs the model's calibration ``table``. A chunk holding fewer tokens than
    chunk_size (``buf.num_tokens``) is framed at that size, except by cachegen."""
    kv = buf.kv
    raw = memoryview(buf.frame.numpy())[HEADER_BYTES:]
    n = buf.num_tokens
    if n < kv.shape[2] and codec != "cachegen":  # a partial chunk travels at its own size
        kv = kv[:, :, :n].contiguous()
        raw = memoryview(kv.view(-1).view(torch.uint8).numpy())
    if codec == "raw":
        payload = raw
    elif codec == "zstd":
        import zstandard

        payload = memoryview(zstandard.ZstdCompressor(level=1).compress(raw))
    elif codec == "cachegen":
        from . import cachegen

        if table is None:
            raise ValueError("codec cachegen needs a calibration table")
        payload = memoryview(cachegen.encode(kv, table))
    else:
        raise ValueError(f"unknown codec {codec!r} (known: {', '.join(CODECS)})")
    shape = list(kv.shape) + [0] * (5 - kv.dim())
    header = _HEADER.pack(
        MAGIC, VERSION, CODECS[codec], _DTYPES[kv.dtype], kv.dim(), *shape, len(payload),
        xxhash.xxh3_64_intdigest(payload), xxhash.xxh3_64_intdigest(key.encode()),
    ).ljust(HEADER_BYTES, b"\0")
    if codec == "raw" and n == buf.kv.shape[2]:
        frame = memoryview(buf.frame.numpy())
        frame[:HEADER_BYTES] = header
        return frame
    return memoryview(header + payload)


def decode_into(data: bytes | memoryview, buf: ChunkBuffer, key: str,
                table: CacheGenTable | None = None) -> None:
    """Verify the frame ``data`` and place its chunk in ``buf``. ``data`` may already be
    ``buf``'s own slot (a read straight into the slot); then nothing is copied. A cachegen
    frame needs the ``table`` it was made with."""
    view = memoryview(data)
    if len(view) < HEADER_BYTES:
        raise FrameError(f"truncated frame: {len(view)} bytes, header needs {HEADER_BYTES}")
    (magic, version, codec, dtype, ndim, *rest) = _HEADER.unpack_from(view)
    shape, length, checksum, key_hash = rest[:5], rest[5], rest[6], rest[7]
    kv = buf.kv
    if magic != MAGIC or version != VERSION:
        raise FrameError(f"not an lmkv frame (magic {magic!r}, version {version})")
    if codec not in CODECS.values():
        raise FrameError(f"unknown codec id {codec}")
    got, want = tuple(shape[:ndim]), tuple(kv.shape)
    partial = ndim == 5 and got[:2] + got[3:] == want[:2] + want[3:] and 1 <= got[2] < want[2]
    if dtype != _DTYPES[kv.dtype] or not (got == want or (partial and codec != CODECS["cachegen"])):
        raise FrameError(f"frame holds shape {got} dtype code {dtype}, expected "
                         f"{want} {kv.dtype} (or fewer tokens)")
    if key_hash != xxhash.xxh3_64_intdigest(key.encode()):
        raise FrameError("frame belongs to another key")
    payload = view[HEADER_BYTES:]
    if len(payload) != length:
        raise FrameError(f"truncated frame: payload {len(payload)} bytes of {length}")
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise FrameError("checksum mismatch: payload corrupted")
    out = memoryview(buf.frame.numpy())[HEADER_BYTES:]
    if partial:  # tokens [0, n): decoded apart, then placed; the rest of the slot is zeroed
        n = got[2]
        part = torch.empty(got, dtype=kv.dtype)
        _decode_payload(codec, payload, memoryview(part.view(-1).view(torch.uint8).numpy()))
        kv[:, :, :n].copy_(part)
        kv[:, :, n:].zero_()
        buf.num_tokens = n
        return
    buf.num_tokens = want[2]
    if codec == CODECS["cachegen"]:
        from . import cachegen

        if table is None:
            raise FrameError("a cachegen frame, and no calibration table to decode it")
        try:
            cachegen.decode_into(payload, kv, table)
        except ValueError as e:
            raise FrameError(f"cachegen payload: {e}") from e
        return
    _decode_payload(codec, payload, out)


def _decode_payload(codec: int, payload: memoryview, out: memoryview) -> None:
    """A raw or zstd payload into ``out``, which it must fill exactly."""
    if codec == CODECS["raw"]:
        if len(payload) != len(out):
            raise FrameError(f"raw payload of {len(payload)} bytes, chunk needs {len(out)}")
        if not _same_memory(payload, out):
            out[:] = payload
    else:
        import zstandard

        try:
            raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=len(out))
        except zstandard.ZstdError as e:
            raise FrameError(f"zstd payload does not decode: {e}") from e
        if len(raw) != len(out):
            raise FrameError(f"zstd payload decodes to {len(raw)} bytes, chunk needs {len(out)}")
        out[:] = raw


def _same_memory(a: memoryview, b: memoryview) -> bool:
    import ctypes

    def addr(m: memoryview) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(m)) if not m.readonly else -1

    return len(a) == len(b) and addr(a) == addr(b) != -1
