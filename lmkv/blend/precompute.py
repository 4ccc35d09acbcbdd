"""Precompute the KV of RAG document chunks ahead of time, keyed by content."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..cache import LMKVCache
from ..compute import KVComputer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PrecomputeReport:
    stored: int  # chunks computed and stored now
    skipped: int  # chunks that were already stored
    failed: int  # chunks that could not be stored (no room in the hot cache)
    tokens: int  # tokens computed
    seconds: float


def precompute(engine: KVComputer, lmkv: LMKVCache, documents: Sequence[str | list[int]],
               batch_size: int = 8, progress: bool = True) -> PrecomputeReport:
    """Compute and store each document chunk's KV. Idempotent: stored chunks are skipped."""
    start = time.perf_counter()
    token_lists = [engine.tokenize(d) if isinstance(d, str) else list(d) for d in documents]
    todo = [t for t in token_lists if t and not lmkv.has_chunk(t)]
    report = PrecomputeReport(0, len(token_lists) - len(todo), 0, 0, 0.0)
    for i in range(0, len(todo), batch_size):
        batch = todo[i : i + batch_size]
        for tokens, kv in zip(batch, engine.compute_kv(batch, lmkv.config.blend_store_pre_rope), strict=True):
            if lmkv.store_chunk(tokens, kv):
                report.stored += 1
            else:
                report.failed += 1
            report.tokens += len(tokens)
        if progress:
            done = min(i + batch_size, len(todo))
            print(f"precompute: {done}/{len(todo)} chunks, {report.tokens} tokens, "
                  f"{time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    lmkv.storage.io.drain()  # lower tiers written before we report success
    report.seconds = time.perf_counter() - start
    log.info("precompute: %d stored, %d already stored, %d failed, %.1fs", report.stored,
             report.skipped, report.failed, report.seconds)
    return report
