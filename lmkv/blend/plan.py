"""What lmkv found for a blended prompt: which segments have stored KV, and where."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..memory import ChunkBuffer


@dataclass(slots=True)
class CachedSegment:
    start: int  # prompt tokens [start, start + length) have stored KV
    length: int
    pieces: list[ChunkBuffer]  # retained; piece i holds tokens [i * C, (i + 1) * C) of the segment

    def copy_into(self, out: torch.Tensor) -> None:
        """Write the stored KV into ``out`` [2, L, n, Hkv, D] at rows [start, start + length)."""
        for i, buf in enumerate(self.pieces):
            c = buf.kv.shape[2]
            lo = i * c
            hi = min(lo + c, self.length)
            out[:, :, self.start + lo : self.start + hi] = buf.kv[:, :, : hi - lo]


@dataclass(slots=True)
class BlendPlan:
    """Stored KV of a prompt's segments, fetched into the hot cache and retained. Keys are
    stored either at positions [0, length) of the segment alone, or before RoPE
    (``pre_rope``); the engine rotates them into place."""

    segments: list[CachedSegment] = field(default_factory=list)
    recompute_ratio: float = 0.15
    check_layer: int = 1
    pre_rope: bool = False

    @property
    def num_cached_tokens(self) -> int:
        return sum(s.length for s in self.segments)

    def cached_mask(self, n: int) -> torch.Tensor:
        """[n] bool: the prompt tokens with stored KV."""
        cached = torch.zeros(n, dtype=torch.bool)
        for seg in self.segments:
            cached[seg.start : seg.start + seg.length] = True
        return cached

    def stored_kv(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The stored KV of all segments as one [2, L, n, Hkv, D] tensor, keys not yet
        rotated. Rows without stored KV are left uninitialized."""
        shape = self.segments[0].pieces[0].kv.shape  # [2, L, C, Hkv, D]
        out = torch.empty(2, shape[1], n, *shape[3:], dtype=dtype)
        for seg in self.segments:
            seg.copy_into(out)
        return out

    def release(self) -> None:
        for seg in self.segments:
            for buf in seg.pieces:
                buf.release()
        self.segments = []


def select_recompute(deviation: torch.Tensor, cached: torch.Tensor, ratio: float) -> torch.Tensor:
    """Tokens to recompute: every uncached token, plus the ``ratio`` fraction of cached tokens
    whose KV deviates most from a fresh computation (CacheBlend's HKVD tokens).
    deviation: [n] (ignored where not cached); cached: [n] bool. Returns [n] bool."""
    chosen = ~cached
    num_cached = int(cached.sum())
    k = min(num_cached, round(ratio * num_cached))
    if k > 0:
        scores = deviation.masked_fill(~cached, float("-inf"))
        chosen = chosen.clone()
        chosen[torch.topk(scores, k).indices] = True
    return chosen
