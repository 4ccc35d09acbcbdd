"""A GGUF file (llama.cpp's format, versions 2 and 3, little-endian) read without trusting it:
metadata parsed from a memory map with every length checked against the file's size, and
tensors as read-only views of their bytes, dequantized to float32 on request (F32, F16, BF16,
Q8_0, Q4_0, Q4_1). Errors are ValueErrors naming the file and what was wrong."""

from __future__ import annotations

import contextlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_ARRAY_DEPTH = 4  # arrays of arrays are legal; deeper nesting is not met in real files
MAX_DIMS = 4  # GGML_MAX_DIMS

# GGML tensor type ids -> names (ggml.h); only those in BLOCKS are dequantized here
TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16",
    34: "TQ1_0", 35: "TQ2_0",
}  # fmt: skip
# type name -> (values per block, bytes per block)
BLOCKS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q4_0": (32, 18),
          "Q4_1": (32, 20)}

# metadata value types -> struct format of one scalar (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (GGUF lists the innermost dimension first)
    type_name: str
    offset: int  # bytes from the start of the file (valid only for types in BLOCKS)
    nbytes: int  # 0 for types not in BLOCKS


class GGUFFile:
    """``fields`` (key -> value: ints, floats, bools, str, lists; arrays of numbers as numpy
    arrays) and ``tensors`` (in file order) of one GGUF file; ``data(t)`` and
    ``dequantize(t)`` read a tensor. ``close()`` unmaps it (a file truncated while mapped
    kills the process with SIGBUS when a tensor is read, as with any mapping)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise ValueError(f"{self.path} is not a GGUF file: {size} bytes")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._buf = memoryview(self._map)
        try:
            self._parse(size)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Unmap the file. Views from ``data`` still held keep the mapping until they go."""
        self._buf.release()
        with contextlib.suppress(BufferError):  # a caller's view of a tensor holds it:
            self._map.close()  # unmapped when that view is freed

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _parse(self, size: int) -> None:
        self._pos = 0
        magic = bytes(self._take(4, "the magic"))
        if magic != MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (magic {magic!r})")
        version = self._scalar("<I")
        if version not in (2, 3):
            swapped = " (a big-endian file?)" if version >= 1 << 16 else ""
            raise ValueError(f"{self.path} is GGUF version {version}{swapped}; this engine reads "
                             "versions 2 and 3, little-endian")
        n_tensors, n_fields = self._scalar("<Q"), self._scalar("<Q")
        # every field takes at least 12 bytes, every tensor info at least 24
        if n_fields * 12 + n_tensors * 24 > size:
            raise ValueError(f"{self.path}: header counts {n_fields} fields and {n_tensors} "
                             f"tensors, more than its {size} bytes can hold")
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string("a metadata key")
            if key in self.fields:
                raise ValueError(f"{self.path}: metadata key {key} appears twice")
            self.fields[key] = self._value(self._scalar("<I"), key, 0)
        infos = [self._tensor_info() for _ in range(n_tensors)]
        names = [info[0] for info in infos]
        if len(set(names)) < len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"{self.path}: tensor {twice[0]} appears twice")
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):  # noqa: E721
            raise ValueError(f"{self.path}: general.alignment {alignment!r} is not a power of two")
        start = -(-self._pos // alignment) * alignment
        self.tensors: list[TensorInfo] = []
        for name, shape, type_name, offset, nbytes in infos:
            at = start + offset
            if nbytes and (offset % alignment or at + nbytes > size):
                raise ValueError(f"{self.path}: tensor {name} ({nbytes} bytes at offset {offset}) "
                                 f"is misaligned or runs past the end of the file ({size} bytes)")
            self.tensors.append(TensorInfo(name, shape, type_name, at, nbytes))

    def data(self, t: TensorInfo) -> memoryview:
        """The tensor's bytes in the file (read-only)."""
        if t.type_name not in BLOCKS:
            raise ValueError(f"{self.path}: tensor {t.name} is of type {t.type_name}; this engine "
                             f"reads {', '.join(BLOCKS)}")
        return self._buf[t.offset : t.offset + t.nbytes]

    def dequantize(self, t: TensorInfo) -> np.ndarray:
        """The tensor's values as a float32 array of its shape (a new, writeable array)."""
        return dequantize(self.data(t), t.type_name, t.shape)

    # --- parsing -----------------------------------------------------------------------

    def _take(self, n: int, what: str) -> memoryview:
        if n < 0 or self._pos + n > len(self._buf):
            raise ValueError(f"{self.path}: {what} ({n} bytes at offset {self._pos}) runs past "
                             f"the end of the file ({len(self._buf)} bytes)")
        out = self._buf[self._pos : self._pos + n]
        self._pos += n
        return out

    def _scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self._take(struct.calcsize(fmt), "a header value"))[0]

    def _string(self, what: str) -> str:
        raw = self._take(self._scalar("<Q"), what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.path}: {what} is not UTF-8 ({e})") from e

    def _value(self, kind: int, key: str, depth: int) -> Any:
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind == _STRING:
            return self._string(f"the value of {key}")
        if kind != _ARRAY:
            raise ValueError(f"{self.path}: metadata key {key} has value type {kind}, not a GGUF type")
        if depth >= MAX_ARRAY_DEPTH:
            raise ValueError(f"{self.path}: metadata key {key} nests arrays {depth + 1} deep")
        item, count = self._scalar("<I"), self._scalar("<Q")
        if item not in _NUMPY and item not in (_STRING, _ARRAY):
            raise ValueError(f"{self.path}: metadata key {key} is an array of type {item}, "
                             "not a GGUF type")
        if item in _NUMPY:  # kept as numpy (a list of Python numbers takes ~10x the bytes)
            dtype = np.dtype(_NUMPY[item])
            raw = self._take(count * dtype.itemsize, f"the array {key}")
            values = np.frombuffer(raw, dtype).copy()  # (not a view: close() must be able to unmap)
            return values.astype(bool) if item == 7 else values
        if count * 8 > len(self._buf) - self._pos:  # strings and arrays take 8 bytes at least
            raise ValueError(f"{self.path}: the array {key} claims {count} items, more than the "
                             "file holds")
        if item == _STRING:
            return [self._string(f"an item of {key}") for _ in range(count)]
        return [self._value(item, key, depth + 1) for _ in range(count)]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], str, int, int]:
        name = self._string("a tensor name")
        n_dims = self._scalar("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise ValueError(f"{self.path}: tensor {name} has {n_dims} dimensions")
        dims = [self._scalar("<Q") for _ in range(n_dims)]
        if any(d >= 1 << 62 for d in dims):  # (ggml's dims are int64)
            raise ValueError(f"{self.path}: tensor {name} has dimensions {dims}")
        type_id, offset = self._scalar("<I"), self._scalar("<Q")
        type_name = TYPE_NAMES.get(type_id, f"type {type_id}")
        nbytes = 0
        if type_name in BLOCKS:
            per_block, block_bytes = BLOCKS[type_name]
            if dims[0] % per_block:
                raise ValueError(f"{self.path}: tensor {name} ({type_name}) has rows of {dims[0]} "
                                 f"values, not a multiple of its block of {per_block}")
            nbytes = int(np.prod(dims, dtype=object)) // per_block * block_bytes
        return name, tuple(reversed(dims)), type_name, offset, nbytes


def plain(value: Any) -> Any:
    """A metadata value with its numpy arrays (arrays of numbers) as lists."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list) and value and isinstance(value[0], list | np.ndarray):
        return [plain(v) for v in value]  # (a GGUF array's items are all of one type)
    return value


def dequantize(raw: memoryview | bytes, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of ``shape`` from GGML-encoded bytes (the layouts of ggml-quants.c:
    per block of 32 values an fp16 scale d, for Q4_1 also an fp16 minimum m; Q8_0 holds
    int8 q (value q*d), Q4_0 and Q4_1 nibbles, low ones for the block's first 16 values
    (value (q-8)*d, and q*d+m))."""
    b = np.frombuffer(raw, np.uint8)
    if type_name == "F32":
        out = b.view("<f4").copy()
    elif type_name == "F16":
        out = b.view("<f2").astype(np.float32)
    elif type_name == "BF16":
        out = (b.view("<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        per_block, block_bytes = BLOCKS[type_name]
        blocks = b.reshape(-1, block_bytes)
        d = blocks[:, :2].copy().view("<f2").astype(np.float32)  # [n, 1]
        if type_name == "Q8_0":
            out = blocks[:, 2:].view(np.int8).astype(np.float32) * d
        else:
            head = 4 if type_name == "Q4_1" else 2
            qs = blocks[:, head:]
            q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
            if type_name == "Q4_0":
                out = (q - 8.0) * d
            else:
                m = blocks[:, 2:4].copy().view("<f2").astype(np.float32)
                out = q * d + m
    return out.reshape(shape)
