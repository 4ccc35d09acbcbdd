"""KVLayout: a model's KV geometry, and the shape and bytes of a stored chunk."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int  # heads held by this rank
    head_dim: int
    dtype: torch.dtype
    chunk_size: int  # tokens per chunk
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"KV dtype {self.dtype} is not supported ({', '.join(DTYPE_NAMES.values())})")

    @property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        """A chunk: [2 (K, V), layers, tokens, kv heads, head_dim] (LMCache's KV_2LTD)."""
        return (2, self.num_layers, self.chunk_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def chunk_bytes(self) -> int:
        return self.bytes_per_token * self.chunk_size

    @property
    def fingerprint(self) -> str:
        """Short id of everything that makes stored KV incompatible: geometry, dtype, chunking
        and tensor-parallel split."""
        desc = (f"{self.num_layers}/{self.num_kv_heads}/{self.head_dim}/{DTYPE_NAMES[self.dtype]}"
                f"/{self.chunk_size}/{self.world_size}")
        return hashlib.blake2b(desc.encode(), digest_size=4).hexdigest()
