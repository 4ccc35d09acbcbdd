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
    stored: int  # chunks computed and stored now (below the hot cache too, where tiers are)
    skipped: int  # chunks that were already stored (repeats of one chunk count here)
    failed: int  # chunks not stored: rejected by the engine, no room, or a tier's write lost
    tokens: int  # tokens computed
    seconds: float


def precompute(engine: KVComputer, lmkv: LMKVCache, documents: Sequence[str | list[int]],
               batch_size: int = 8, progress: bool = True) -> PrecomputeReport:
    """Compute and store each document chunk's KV. Idempotent: stored chunks are skipped.
    A chunk counts as stored once every tier below the hot cache holds it (a write that
    was dropped or failed is a failure: a later process would not find it)."""
    if isinstance(documents, str | bytes) or not isinstance(documents, Sequence):
        raise TypeError("documents must be a list of texts or of token id lists, "
                        f"not {type(documents).__name__}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    start = time.perf_counter()
    token_lists = [_tokens(engine, lmkv, i, d) for i, d in enumerate(documents)]
    empty = sum(1 for t in token_lists if not t)
    if empty:
        log.warning("precompute: %d empty documents ignored", empty)
    todo: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for tokens in token_lists:
        if tokens and tuple(tokens) not in seen:
            seen.add(tuple(tokens))
            # stored means below the hot cache too, where tiers are (as counted below)
            if not lmkv.has_chunk(tokens) or _not_persisted(lmkv, [tokens]):
                todo.append(tokens)
    report = PrecomputeReport(0, len(token_lists) - empty - len(todo), 0, 0, 0.0)
    stored: list[list[int]] = []
    for i in range(0, len(todo), batch_size):
        for tokens, kv in _compute(engine, lmkv, todo[i : i + batch_size]):
            if kv is not None and lmkv.store_chunk(tokens, kv):
                stored.append(tokens)
            else:
                report.failed += 1
            report.tokens += len(tokens) if kv is not None else 0
        if progress:
            done = min(i + batch_size, len(todo))
            print(f"precompute: {done}/{len(todo)} chunks, {report.tokens} tokens, "
                  f"{time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)
    lmkv.drain()  # lower tiers written before we report success
    lost = _not_persisted(lmkv, stored)
    if lost:
        log.warning("precompute: %d chunks did not reach every tier below the hot cache "
                    "(writes dropped or failed, or evicted at once by a tier's size cap: see "
                    "lmkv_dropped_total, lmkv_errors_total, lmkv_evictions_total)", lost)
    report.stored, report.failed = len(stored) - lost, report.failed + lost
    report.seconds = time.perf_counter() - start
    log.info("precompute: %d stored, %d already stored, %d failed, %.1fs", report.stored,
             report.skipped, report.failed, report.seconds)
    return report


def _tokens(engine: KVComputer, lmkv: LMKVCache, i: int, document: str | list[int]) -> list[int]:
    """A document's token ids as they appear inside a prompt: no special tokens (a BOS)."""
    if isinstance(document, str):
        sep = lmkv.config.blend_special_str
        if lmkv.config.enable_blending and sep in document:
            log.warning("precompute: document %d contains the separator %r: prompts split there, "
                        "so it will never be found whole", i, sep)
        return engine.tokenize(document, add_special_tokens=False)
    if not isinstance(document, list | tuple):
        raise TypeError(f"document {i} is a {type(document).__name__}, not a text or a list of ids")
    return list(document)


def _compute(engine: KVComputer, lmkv: LMKVCache, batch: list[list[int]]):
    """(tokens, kv) for each list of the batch; kv None for a list the engine refuses
    (logged), the others computed one by one then."""
    pre_rope = lmkv.config.blend_store_pre_rope
    try:
        return list(zip(batch, engine.compute_kv(batch, pre_rope), strict=True))
    except ValueError:
        pass
    out = []
    for tokens in batch:
        try:
            out.append((tokens, engine.compute_kv([tokens], pre_rope)[0]))
        except ValueError as e:
            log.error("precompute: a chunk of %d tokens (starting %s) was refused: %s",
                      len(tokens), tokens[:8], e)
            out.append((tokens, None))
    return out


def _not_persisted(lmkv: LMKVCache, stored: list[list[int]]) -> int:
    """How many of the chunks in ``stored`` some tier below the hot cache lacks (or cannot
    be asked about)."""
    tiers = lmkv.storage.tiers
    if not tiers or not stored:
        return 0
    lost = 0
    for tokens in stored:
        keys = lmkv.content_keys(tokens)
        if not all((found := t.contains(keys)) is not None and all(found) for t in tiers):
            lost += 1
    return lost
