"""How a chunk becomes bytes when it leaves the hot cache, and back."""

from .base import CODECS, Codec, get_codec
from .frame import ForeignFrame, FrameError, decode_into, encode, max_frame_bytes

__all__ = ["CODECS", "Codec", "ForeignFrame", "FrameError", "decode_into", "encode", "get_codec",
           "max_frame_bytes"]
