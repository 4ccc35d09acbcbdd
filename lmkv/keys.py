"""Chunk keys: which model, layout, rank and namespace a chunk belongs to, and its hash.

Prefix chunks are chained: hash_i = H(hash_{i-1} || tokens of chunk i), so a key names the
whole prefix up to its chunk. RAG chunks (CacheBlend) are keyed by content alone.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from .layout import KVLayout

ROOT = b"\x00" * 16


def chunk_hash(parent: bytes, tokens: list[int] | np.ndarray) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


def prefix_hashes(tokens: list[int], chunk_size: int, start: int = 0) -> list[bytes]:
    """Chained hashes of the full chunks of ``tokens``: one per chunk, [0, len // chunk_size)."""
    arr = np.asarray(tokens, dtype=np.int64)
    out: list[bytes] = []
    parent = ROOT
    for i in range(len(arr) // chunk_size):
        parent = chunk_hash(parent, arr[i * chunk_size : (i + 1) * chunk_size])
        out.append(parent)
    return out[start:]


def tail_hash(tokens: list[int], chunk_size: int) -> bytes | None:
    """The hash of ``tokens``' last, partial chunk (the tokens past the last full one),
    chained on the full chunks before it; None where ``tokens`` end on a chunk boundary. A
    whole prompt's tail (``save_unfull_chunk``): found only by the same prompt again."""
    full = len(tokens) // chunk_size
    if len(tokens) == full * chunk_size:
        return None
    parent = prefix_hashes(tokens[: full * chunk_size], chunk_size)[-1] if full else ROOT
    return chunk_hash(parent, np.asarray(tokens[full * chunk_size :], dtype=np.int64))


BLEND_ROOT = b"\x01" * 16  # content keys never collide with prefix keys
BLEND_PRE_ROPE_ROOT = b"\x02" * 16  # nor keys of chunks stored before RoPE with those after


def content_hashes(tokens: list[int], chunk_size: int, pre_rope: bool = False) -> list[bytes]:
    """Keys of a RAG chunk's pieces, by content alone: piece i holds tokens
    [i * chunk_size, (i + 1) * chunk_size), the last one possibly partial. Every piece's hash
    covers the whole chunk (and its length), so a piece is only ever found with its siblings.
    ``pre_rope``: the chunk's keys are stored before RoPE (a disjoint key space)."""
    arr = np.asarray(tokens, dtype=np.int64)
    whole = chunk_hash(BLEND_PRE_ROPE_ROOT if pre_rope else BLEND_ROOT, arr)
    n = -(-len(arr) // chunk_size)
    return [chunk_hash(whole, np.asarray([i, n], dtype=np.int64)) for i in range(n)]


KEY_VERSION = "lmkv1@"  # the start of every chunk key lmkv makes


@dataclass(frozen=True)
class KeyScope:
    """Everything but the hash: entries of different scopes never meet."""

    model: str
    layout: KVLayout
    namespace: str = ""

    @property
    def prefix(self) -> str:
        model_id = hashlib.blake2b(self.model.encode(), digest_size=6).hexdigest()
        ns = hashlib.blake2b(self.namespace.encode(), digest_size=4).hexdigest() if self.namespace else "-"
        lay = self.layout
        return f"{KEY_VERSION}{model_id}@{lay.fingerprint}@{lay.rank}@{ns}"

    def key(self, h: bytes) -> str:
        """The backend key string (ASCII, < 150 bytes)."""
        return f"{self.prefix}@{h.hex()}"


def in_epoch(ids: list[str], epoch: bytes | None) -> list[str]:
    """Rank-free chunk ids (hex) renamed for a cache epoch (``epoch`` None: as they are):
    after an engine's weights change in place, the chunks stored before are never named
    again. Each id still names its whole prefix, at the same length."""
    if epoch is None:
        return ids
    return [hashlib.blake2b(bytes.fromhex(i), key=epoch, digest_size=len(i) // 2).hexdigest()
            for i in ids]


def tail_id(tokens: list[int], chunk_size: int) -> str | None:
    """The rank-free name of ``tokens``' partial last chunk (``tail_hash``, hex), or None."""
    h = tail_hash(tokens, chunk_size)
    return None if h is None else h.hex()


def chunk_ids(tokens: list[int], chunk_size: int) -> list[str]:
    """Rank-free names of the full chunks of ``tokens`` (their chained hashes, hex): what a
    scheduler speaks to several tensor-parallel ranks, each of which scopes them
    (``KeyScope.key``) to the key of its own shard."""
    return [h.hex() for h in prefix_hashes(tokens, chunk_size)]
