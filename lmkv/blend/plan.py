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
    chunk_size: int

    def kv(self, layer: int) -> torch.Tensor:
        """This segment's stored KV of one layer, [2, length, Hkv, D], computed at positions
        [0, length) (the segment alone); re-rotate keys before use at ``start``."""
        parts = [p.kv[:, layer] for p in self.pieces]  # [2, C, Hkv, D] each
        return torch.cat(parts, dim=1)[:, : self.length]


@dataclass(slots=True)
class BlendPlan:
    segments: list[CachedSegment] = field(default_factory=list)
    recompute_ratio: float = 0.15
    check_layer: int = 1

    @property
    def num_cached_tokens(self) -> int:
        return sum(s.length for s in self.segments)

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
