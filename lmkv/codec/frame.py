"""The frame every stored chunk travels in: a 64-byte header, then the payload.

Header (little-endian): magic "LMKV", version, codec id, dtype code, ndim, shape[5] u32,
payload length u64, xxh3-64 checksum of the payload, xxh3-64 of the chunk's key (so a
payload filed under the wrong key is caught), padding. Decoding checks every field
against what the reader expects before it touches the payload; nothing is unpickled.
The payload is the codec's (base.py: raw, zstd, cachegen).
"""

from __future__ import annotations

import struct

import torch
import xxhash

from ..memory import HEADER_BYTES, ChunkBuffer
from .base import Codec, Raw, by_id, get_codec
from .cachegen import ForeignPayload
from .calibration import CacheGenTable

MAGIC = b"LMKV"
VERSION = 1
_HEADER = struct.Struct("<4sBBBB5IQQQ")
assert _HEADER.size <= HEADER_BYTES

_DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}


class FrameError(ValueError):
    """A stored payload is corrupt, truncated, or not what the reader expects."""


class ForeignFrame(FrameError):
    """A sound frame that this reader cannot decode: lossy, made with another calibration
    table or where the reader has none, or of another frame format version or codec. Not
    corrupt: a miss, left in place for the engines that can read it."""


def encode(buf: ChunkBuffer, key: str, codec: Codec | str, table: CacheGenTable | None = None) -> memoryview:
    """The frame of ``buf``'s chunk. A whole chunk in the raw codec is framed in place, in
    the slot's header area, and the returned view aliases the slot (valid while the caller
    holds a reference). A chunk holding fewer tokens than chunk_size (``buf.num_tokens``)
    is framed at that size: by zstd where the codec cannot (``Codec.partial``)."""
    codec = get_codec(codec) if isinstance(codec, str) else codec
    kv = buf.kv
    whole = buf.num_tokens == kv.shape[2]
    if not whole and not codec.partial:  # cachegen codes whole chunks: a tail goes lossless
        codec = get_codec("zstd")
    if not whole:
        kv = kv[:, :, : buf.num_tokens].contiguous()
    payload = memoryview(codec.encode(kv, table, buf.position))
    shape = list(kv.shape) + [0] * (5 - kv.dim())
    header = _HEADER.pack(
        MAGIC, VERSION, codec.id, _DTYPES[kv.dtype], kv.dim(), *shape, len(payload),
        xxhash.xxh3_64_intdigest(payload), xxhash.xxh3_64_intdigest(key.encode()),
    ).ljust(HEADER_BYTES, b"\0")
    if isinstance(codec, Raw) and whole:
        frame = memoryview(buf.frame.numpy())
        frame[:HEADER_BYTES] = header
        return frame
    return memoryview(header + payload)


def max_frame_bytes(chunk_bytes: int) -> int:
    """An upper bound on the frame of a chunk of ``chunk_bytes`` in any codec: the raw
    frame, plus what zstd or cachegen's streams can add on incompressible data (zstd's
    bound is n/256 + a few hundred bytes). Readers take no stored value larger than this."""
    return HEADER_BYTES + chunk_bytes + chunk_bytes // 128 + (64 << 10)


def decode_into(data: bytes | memoryview, buf: ChunkBuffer, key: str,
                table: CacheGenTable | None = None) -> Codec:
    """Verify the frame ``data`` and place its chunk in ``buf`` (tokens past a partial
    chunk's are zeroed); returns the codec it was made with. ``data`` may already be
    ``buf``'s own slot (a read straight into the slot); then a whole raw chunk is not
    copied. A lossy frame needs the ``table`` it was made with."""
    view = memoryview(data)
    if len(view) < HEADER_BYTES:
        raise FrameError(f"truncated frame: {len(view)} bytes, header needs {HEADER_BYTES}")
    (magic, version, codec_id, dtype, ndim, *rest) = _HEADER.unpack_from(view)
    shape, length, checksum, key_hash = rest[:5], rest[5], rest[6], rest[7]
    kv = buf.kv
    if magic != MAGIC:
        raise FrameError(f"not an lmkv frame (magic {magic!r})")
    if version != VERSION:  # (another lmkv version's, sharing the store: not deleted as corrupt)
        raise ForeignFrame(f"an lmkv frame of format version {version}; this lmkv reads {VERSION}")
    if key_hash != xxhash.xxh3_64_intdigest(key.encode()):
        raise FrameError("frame belongs to another key")
    payload = view[HEADER_BYTES:]
    if len(payload) != length:
        raise FrameError(f"truncated frame: payload {len(payload)} bytes of {length}")
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise FrameError("checksum mismatch: payload corrupted")
    codec = by_id(codec_id)
    if codec is None:  # (a sound frame: of a codec another lmkv version has)
        raise ForeignFrame(f"codec id {codec_id}, which this lmkv version does not know")
    got, want = tuple(shape[:ndim]), tuple(kv.shape)
    partial = (codec.partial and ndim == 5 and got[:2] + got[3:] == want[:2] + want[3:]
               and 1 <= got[2] < want[2])
    if dtype != _DTYPES[kv.dtype] or not (got == want or partial):
        raise FrameError(f"frame holds shape {got} dtype code {dtype}, expected "
                         f"{want} {kv.dtype} (or fewer tokens)")
    try:
        if partial:  # tokens [0, n): decoded apart (the payload may lie in this very slot)
            part = torch.empty(got, dtype=kv.dtype)
            codec.decode_into(payload, part, table)
            kv[:, :, : got[2]].copy_(part)
            kv[:, :, got[2] :].zero_()
        else:
            codec.decode_into(payload, kv, table)
    except ForeignPayload as e:
        raise ForeignFrame(f"{codec.name} payload: {e}") from e
    except (ValueError, MemoryError, OverflowError) as e:  # what bytes from outside can cause
        detail = e if isinstance(e, ValueError) else f"{type(e).__name__} {e}"
        raise FrameError(f"{codec.name} payload: {detail}") from e
    buf.num_tokens = got[2]
    buf.lossy = codec.lossy
    return codec
