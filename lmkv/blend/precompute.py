"""Precompute the KV of RAG document chunks ahead of time, keyed by content."""

from __future__ import annotations

import hashlib
import logging
import sys
import time
from array import array
from collections.abc import Iterable, Sized
from dataclasses import dataclass

from ..cache import LMKVCache
from ..compute import KVComputer
from .segments import separator_tokens, split_segments

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PrecomputeReport:
    stored: int  # chunks computed and stored now (below the hot cache too, where tiers are)
    skipped: int  # chunks that were already stored (repeats of one chunk count here)
    failed: int  # chunks not stored: rejected by the engine, no room, or a tier's write lost
    tokens: int  # tokens computed
    seconds: float


def precompute(engine: KVComputer, lmkv: LMKVCache, documents: Iterable[str | list[int]],
               batch_size: int = 8, progress: bool = True) -> PrecomputeReport:
    """Compute and store each document chunk's KV. Idempotent: stored chunks are skipped.
    A chunk counts as stored once every tier below the hot cache holds it (a write that
    was dropped or failed is a failure: a later process would not find it), or, with no
    tier below, once it is still in the hot cache when all are done. Documents are taken
    ``batch_size`` at a time, end to end (tokenized, computed, stored, and the writes below
    waited for before the next batch: a tier slower than the computation would otherwise
    have its queued writes dropped for the slots of the next ones), so memory does not
    grow with the corpus (``documents`` may be any iterable: a generator reading files) but
    for the keys of the chunks stored (about 100 bytes a piece), asked for again at the end:
    a corpus larger than a tier's cap has later batches evict earlier ones."""
    if isinstance(documents, str | bytes) or not isinstance(documents, Iterable):
        raise TypeError("documents must be a list of texts or of token id lists (or an "
                        f"iterable of them), not {type(documents).__name__}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    start = time.perf_counter()
    separator = _separator(engine, lmkv)
    if not lmkv.config.enable_blending:
        log.warning("precompute: enable_blending is off in this config; an engine serving with "
                    "it does not reuse these chunks")
    report = PrecomputeReport(0, 0, 0, 0, 0.0)
    seen: dict[bytes, bool] = {}  # digests of the documents met -> stored (repeats skipped)
    kept: list[list[str]] = []  # the stored chunks' keys, each chunk's pieces
    pending: dict[bytes, int] = {}  # digests of the documents to store -> repeats met since
    empty = 0
    todo: list[list[int]] = []
    total = f"/{len(documents)}" if isinstance(documents, Sized) else ""
    i = shown = -1  # the last document counted in a progress line
    for i, document in enumerate(documents):
        tokens = _tokens(engine, lmkv, i, document, separator)
        digest = tokens and _digest(tokens)
        if tokens is None:  # holds the separator: never found whole, not stored
            report.failed += 1
        elif not tokens:
            empty += 1
        elif digest in seen:  # a repeat: counted as its first copy fares (stored or failed)
            if digest in pending:
                pending[digest] += 1
            elif seen[digest]:
                report.skipped += 1
            else:
                report.failed += 1
        else:  # whether it is stored already is asked for the whole batch (_store_todo)
            seen[digest] = False
            todo.append(tokens)
            pending[digest] = 0
        if len(todo) == batch_size:
            _store_todo(engine, lmkv, todo, report, kept, seen, pending)
            todo = []
            if progress:
                _progress(i + 1, total, report, start)
                shown = i + 1
    if todo:
        _store_todo(engine, lmkv, todo, report, kept, seen, pending)
    if progress and shown < i + 1:  # the last batch's line, once
        _progress(i + 1, total, report, start)
    if empty:
        log.warning("precompute: %d empty documents ignored", empty)
    gone = sum(not held for held in _held(lmkv, kept, unknown=True))
    if gone:
        where = ("the tiers below (their size caps, max_local_disk_size: size them for the "
                 "corpus)" if lmkv.storage.tiers else "the hot cache (no tier below holds "
                 "them: size max_local_cpu_size for the corpus, or add local_disk)")
        log.warning("precompute: %d chunks stored were evicted again by later ones from %s",
                    gone, where)
    report.stored, report.failed = report.stored - gone, report.failed + gone
    report.seconds = time.perf_counter() - start
    log.info("precompute: %d stored, %d already stored, %d failed, %.1fs", report.stored,
             report.skipped, report.failed, report.seconds)
    return report


def _progress(done: int, total: str, report: PrecomputeReport, start: float) -> None:
    print(f"precompute: {done}{total} documents, {report.stored} chunks stored, "
          f"{report.skipped} already stored, {report.failed} failed, {report.tokens} tokens, "
          f"{time.perf_counter() - start:.1f}s", file=sys.stderr, flush=True)


def _digest(tokens: list[int]) -> bytes:
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16).digest()


def _store_todo(engine: KVComputer, lmkv: LMKVCache, todo: list[list[int]],
                report: PrecomputeReport, kept: list[list[str]], seen: dict[bytes, bool],
                pending: dict[bytes, int]) -> None:
    """The documents stored already skipped (stored means below the hot cache too, where
    tiers are: one question per tier for the batch), ``_store_batch`` of the others, then
    the repeats of each document counted as it fared."""
    if lmkv.storage.tiers:
        already = _held(lmkv, [lmkv.content_keys(tokens) for tokens in todo], unknown=False)
    else:
        already = [lmkv.has_chunk(tokens) for tokens in todo]
    report.skipped += sum(already)
    compute = [tokens for tokens, held in zip(todo, already, strict=True) if not held]
    stored = {_digest(tokens) for tokens, held in zip(todo, already, strict=True) if held}
    if compute:
        stored.update(map(_digest, _store_batch(engine, lmkv, compute, report, kept)))
    for tokens in todo:
        digest = _digest(tokens)
        seen[digest] = digest in stored
        if seen[digest]:
            report.skipped += pending.pop(digest)
        else:
            report.failed += pending.pop(digest)


def _store_batch(engine: KVComputer, lmkv: LMKVCache, batch: list[list[int]],
                 report: PrecomputeReport, kept: list[list[str]]) -> list[list[int]]:
    """Compute and store ``batch``, then wait for the writes below and count what they lost;
    the chunks stored (their keys added to ``kept``)."""
    stored = []
    room, since = max(1, lmkv.pool.num_slots // 2), 0  # pieces queued below since a drain
    for tokens, kv in _compute(engine, lmkv, batch):
        pieces = -(-len(tokens) // lmkv.chunk_size)
        if lmkv.storage.tiers and since and since + pieces > room:
            lmkv.drain()  # (a slow tier's queued writes would be dropped for the slots)
            since = 0
        since += pieces
        if kv is not None and lmkv.store_chunk(tokens, kv):
            stored.append(tokens)
        else:
            report.failed += 1
        report.tokens += len(tokens) if kv is not None else 0
    if not lmkv.storage.tiers:
        kept.extend(lmkv.content_keys(tokens) for tokens in stored)
        report.stored += len(stored)
        return stored
    lmkv.drain()  # lower tiers written before we count them (and before the next batch)
    keys = [lmkv.content_keys(tokens) for tokens in stored]
    held = _held(lmkv, keys, unknown=False)
    lost = held.count(False)
    stored = [tokens for tokens, ok in zip(stored, held, strict=True) if ok]
    kept.extend(k for k, ok in zip(keys, held, strict=True) if ok)
    if lost:
        log.warning("precompute: %d chunks did not reach every tier below the hot cache "
                    "(writes dropped or failed, or evicted at once by a tier's size cap: see "
                    "lmkv_dropped_total, lmkv_errors_total, lmkv_evictions_total)", lost)
    report.stored += len(stored)
    report.failed += lost
    return stored


def _held(lmkv: LMKVCache, chunks: list[list[str]], unknown: bool,
          batch: int = 1024) -> list[bool]:
    """Whether each chunk (its keys) is held whole by every tier below the hot cache, or,
    with none, by the hot cache; ``unknown`` for the chunks a tier cannot be asked about
    now. One question per tier for each ``batch`` chunks."""
    tiers = lmkv.storage.tiers
    if not tiers:
        return [all(map(lmkv.storage.hot.contains, keys)) for keys in chunks]
    held: list[bool] = []
    for start in range(0, len(chunks), batch):
        group = chunks[start : start + batch]
        found = [t.contains([k for keys in group for k in keys]) for t in tiers]
        if any(f is None for f in found):
            held.extend([unknown] * len(group))
            continue
        at = 0
        for keys in group:
            held.append(all(all(f[at : at + len(keys)]) for f in found))
            at += len(keys)
    return held


def _separator(engine: KVComputer, lmkv: LMKVCache) -> list[int]:
    """The separator's ids as prompts hold them (blending on), else []."""
    if not lmkv.config.enable_blending:
        return []
    return separator_tokens(lambda text: engine.tokenize(text, add_special_tokens=False),
                            lmkv.config.blend_special_str)


def _tokens(engine: KVComputer, lmkv: LMKVCache, i: int, document: str | list[int],
            separator: list[int]) -> list[int] | None:
    """A document's token ids as they appear inside a prompt: no special tokens (a BOS);
    None (logged) for one that holds the separator, which prompts split (blending on)."""
    sep = lmkv.config.blend_special_str
    if isinstance(document, str):
        if lmkv.config.enable_blending and sep in document:
            log.warning("precompute: document %d contains the separator %r: prompts split there, "
                        "so it would never be found whole; not stored", i, sep)
            return None
        if lmkv.config.enable_blending and document and (
                (document + sep).split(sep)[0] != document or (sep + document).split(sep)[-1] != document):
            log.warning("precompute: document %d (%r...) starts or ends with what runs into the "
                        "separator %r (a line end into a blank line): a prompt splits it off, so "
                        "it would never be found whole; not stored (strip it)", i, document[:40], sep)
            return None
        return engine.tokenize(document, add_special_tokens=False)
    if not isinstance(document, list | tuple):
        raise TypeError(f"document {i} is a {type(document).__name__}, not a text or a list of ids")
    tokens = list(document)
    if separator and len(split_segments(tokens, separator)) > 1:
        log.warning("precompute: document %d holds the separator's ids (%r): prompts split "
                    "there, so it would never be found whole; not stored", i, sep)
        return None
    return tokens


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
