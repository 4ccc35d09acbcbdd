"""The lm:// wire format (LMCache 0.5.6 server protocol), as plain functions.

See shared/specs/lm-protocol.md. Shared by the lm:// client (lmkv.backends.lm) and by
lmkv_server. Only ``struct`` is used: nothing received is ever unpickled.

Request header, 186 bytes ``<9i150s``:
    command, length, fmt, dtype, location, shape0..shape3, key (space padded)
Response header, 36 bytes ``<9i``:
    code, length, fmt, dtype, shape0..shape3, location   (location LAST)
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import NamedTuple

KEY_SIZE = 150
REQUEST = struct.Struct(f"<9i{KEY_SIZE}s")
RESPONSE = struct.Struct("<9i")
REQUEST_SIZE = REQUEST.size  # 186
RESPONSE_SIZE = RESPONSE.size  # 36
MAX_LENGTH = 2**31 - 1  # the length field is a signed int32

Shape = tuple[int, int, int, int]
NO_SHAPE: Shape = (0, 0, 0, 0)


class Command(IntEnum):
    PUT = 1
    GET = 2
    EXIST = 3
    LIST = 4
    HEALTH = 5


class Code(IntEnum):
    SUCCESS = 200
    FAIL = 400


class DType(IntEnum):
    NONE = 0
    HALF = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    FLOAT32 = 4
    FLOAT64 = 5
    UINT8 = 6
    FLOAT8_E4M3FN = 7
    FLOAT8_E5M2 = 8


class Fmt(IntEnum):
    UNDEFINED = 0
    KV_2LTD = 1  # [2, L, T, H*D]
    KV_T2D = 2  # [T, 2, H*D]
    KV_2TD = 3  # [2, T, H*D]
    BINARY = 4  # opaque bytes, shape [nbytes, 0, 0, 0]
    BINARY_BUFFER = 5
    KV_MLA_FMT = 6  # [1, L, T, head]
    EC_TD = 7
    HS_TD = 8


class WireError(ValueError):
    """A frame or key that does not follow the lm:// format."""


class RequestHeader(NamedTuple):
    command: int  # a Command value, unchecked: the server decides what to do with others
    length: int
    fmt: int
    dtype: int
    location: int
    shape: Shape
    key: bytes  # padding stripped, not yet validated (see check_key)


class ResponseHeader(NamedTuple):
    code: int
    length: int
    fmt: int
    dtype: int
    shape: Shape
    location: int


def check_key(key: bytes) -> bytes:
    """Return ``key`` if it is a valid lm:// key, else raise WireError.

    Valid: 1..150 bytes, none a control byte (NUL and the like break the reference
    server's parser), not starting or ending with a space (the padding, which the peer
    strips). Spaces inside and bytes past ASCII are fine: LMCache's client names a chunk by
    vLLM's model setting, a path such as "/models/Llama 3.1 8B" (UTF-8).
    """
    if not key:
        raise WireError("empty key")
    if len(key) > KEY_SIZE:
        raise WireError(f"key is {len(key)} bytes, the limit is {KEY_SIZE}")
    bad = key.translate(None, _NOT_CONTROL)
    if bad:
        raise WireError(f"key contains a control byte: {bad[:1]!r}")
    if key[:1] == b" " or key[-1:] == b" ":
        raise WireError("key starts or ends with a space (the padding)")
    return key


def encode_key(key: str) -> bytes:
    """The wire bytes of ``key`` (UTF-8, unpadded); raises WireError if it is not a valid key."""
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError as exc:  # (a lone surrogate)
        raise WireError(f"key is not valid Unicode: {key[:40]!r}") from exc
    return check_key(raw)


def pack_request(
    command: Command,
    key: bytes,
    length: int = 0,
    fmt: int = Fmt.KV_2LTD,
    dtype: int = DType.FLOAT16,
    shape: Shape = NO_SHAPE,
) -> bytes:
    """A request header; ``key`` is checked and padded with spaces to 150 bytes."""
    if not 0 <= length <= MAX_LENGTH:
        raise WireError(f"length {length} outside [0, {MAX_LENGTH}]")
    check_key(key)
    return REQUEST.pack(command, length, fmt, dtype, 0, *shape, key.ljust(KEY_SIZE))


def unpack_request(buf: bytes | bytearray | memoryview) -> RequestHeader:
    """Parse a 186-byte request header. The key keeps any bytes other than spaces."""
    command, length, fmt, dtype, location, s0, s1, s2, s3, key = REQUEST.unpack(buf)
    return RequestHeader(command, length, fmt, dtype, location, (s0, s1, s2, s3), key.strip(b" "))


def pack_response(
    code: Code,
    length: int = 0,
    fmt: int = Fmt.KV_2LTD,
    dtype: int = DType.FLOAT16,
    shape: Shape = NO_SHAPE,
) -> bytes:
    """A response header. The defaults are the reference server's header-only reply."""
    return RESPONSE.pack(code, length, fmt, dtype, *shape, 0)


def unpack_response(buf: bytes | bytearray | memoryview) -> ResponseHeader:
    code, length, fmt, dtype, s0, s1, s2, s3, location = RESPONSE.unpack(buf)
    return ResponseHeader(code, length, fmt, dtype, (s0, s1, s2, s3), location)


def binary_shape(nbytes: int) -> Shape:
    """Shape of an opaque BINARY value: ``[nbytes, 0, 0, 0]``, kept verbatim by peers."""
    return (nbytes, 0, 0, 0)


SUCCESS_EMPTY = pack_response(Code.SUCCESS)
FAIL_EMPTY = pack_response(Code.FAIL)

# bytes.translate deletes these; whatever is left is a control byte
_NOT_CONTROL = bytes(range(0x20, 0x7F)) + bytes(range(0x80, 0x100))
