"""Codec: how a chunk's KV becomes a frame's payload and back. Codecs are objects
registered once by name and id (``CODECS``, ``by_id``); tiers hold the object."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from .calibration import CacheGenTable


class Codec(ABC):
    """Contract: ``encode`` turns kv [2, L, T, Hkv, D] (contiguous; its first token at
    ``position``, which a codec may use and then keeps in the payload) into payload bytes;
    ``decode_into`` fills a kv tensor of that shape from them, or raises ValueError naming
    what is wrong. A lossy codec needs the model's calibration table; a lossless one ignores
    it. ``partial`` codecs also frame a chunk of fewer tokens than chunk_size at its size."""

    name: ClassVar[str]
    id: ClassVar[int]  # in the frame header; never reused
    lossy: ClassVar[bool] = False
    partial: ClassVar[bool] = True

    @abstractmethod
    def encode(self, kv: torch.Tensor, table: CacheGenTable | None, position: int
               ) -> memoryview | bytes: ...

    @abstractmethod
    def decode_into(self, payload: memoryview, kv: torch.Tensor, table: CacheGenTable | None) -> None: ...

    def __repr__(self) -> str:
        return self.name


def _bytes_of(kv: torch.Tensor) -> memoryview:
    return memoryview(kv.reshape(-1).view(torch.uint8).numpy())


class Raw(Codec):
    """The chunk's bytes as they are."""

    name, id = "raw", 0

    def encode(self, kv, table, position):
        return _bytes_of(kv)

    def decode_into(self, payload, kv, table):
        out = _bytes_of(kv)
        if len(payload) != len(out):
            raise ValueError(f"raw payload of {len(payload)} bytes, chunk needs {len(out)}")
        if not _same_memory(payload, out):
            out[:] = payload


class Zstd(Codec):
    """Lossless zstd (level 1) of the chunk's bytes."""

    name, id = "zstd", 1

    def encode(self, kv, table, position):
        import zstandard

        return zstandard.ZstdCompressor(level=1).compress(_bytes_of(kv))

    def decode_into(self, payload, kv, table):
        out = _bytes_of(kv)
        out[:] = zstd_exact(payload, len(out), "zstd payload")


def zstd_exact(blob, size: int, what: str) -> bytes:
    """The ``size`` bytes a zstd frame decodes to; ValueError for anything else. A frame
    that announces another size is refused before it is decoded: zstandard would allocate
    and fill what it announces (32 KiB can announce a GiB), whatever the output bound."""
    import zstandard

    try:
        announced = zstandard.frame_content_size(blob)
        if announced not in (-1, size):
            raise ValueError(f"{what} announces {announced} bytes, expected {size}")
        raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=size)
    except zstandard.ZstdError as e:
        raise ValueError(f"{what} does not decode: {e}") from e
    if len(raw) != size:
        raise ValueError(f"{what} decodes to {len(raw)} bytes, expected {size}")
    if (end := _zstd_frame_end(blob)) != len(blob):  # (as the native decoder, lmkv/codec/native.c)
        raise ValueError(f"{what} has {len(blob) - end} stray bytes after its zstd frame")
    return raw


def _zstd_frame_end(blob) -> int:
    """Where the zstd frame at the start of ``blob`` ends (RFC 8878: its header, blocks of a
    3-byte header each, then the optional 4-byte checksum); ValueError if it runs past."""
    import zstandard

    view = memoryview(blob).cast("B")
    pos = zstandard.frame_header_size(view)
    while True:
        if pos + 3 > len(view):
            raise ValueError("zstd frame truncated in a block header")
        header = int.from_bytes(view[pos : pos + 3], "little")
        kind, size = (header >> 1) & 3, header >> 3
        if kind == 3:
            raise ValueError("zstd frame has a reserved block type")
        pos += 3 + (1 if kind == 1 else size)  # an RLE block stores its one byte
        if header & 1:  # the last block
            break
    if zstandard.get_frame_parameters(view).has_checksum:
        pos += 4
    if pos > len(view):
        raise ValueError("zstd frame truncated")
    return pos


class CacheGen(Codec):
    """Lossy: calibrated quantization, anchor deltas, entropy coding (cachegen.py)."""

    name, id, lossy, partial = "cachegen", 2, True, False

    def encode(self, kv, table, position):
        from . import cachegen

        if table is None:
            raise ValueError("codec cachegen needs a calibration table")
        return cachegen.encode(kv, table, position=position)

    def decode_into(self, payload, kv, table):
        from . import cachegen

        if table is None:
            raise cachegen.ForeignPayload("a cachegen payload, and no calibration table to decode it")
        cachegen.decode_into(payload, kv, table)


CODECS: dict[str, Codec] = {c.name: c for c in (Raw(), Zstd(), CacheGen())}
_BY_ID = {c.id: c for c in CODECS.values()}


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r} (known: {', '.join(CODECS)})") from None


def by_id(codec_id: int) -> Codec | None:
    return _BY_ID.get(codec_id)


def _same_memory(a: memoryview, b: memoryview) -> bool:
    import ctypes

    def addr(m: memoryview) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(m)) if not m.readonly else -1

    return len(a) == len(b) and addr(a) == addr(b) != -1
