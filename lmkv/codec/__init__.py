"""How a chunk becomes bytes when it leaves the hot cache, and back."""

from .frame import CODECS, FrameError, decode_into, encode

__all__ = ["CODECS", "FrameError", "decode_into", "encode"]
