"""Replay a real request trace through lmkv's own storage path: how much of each prompt a
hot cache of a given size serves.

    python benchmarks/trace_replay.py [--trace FILE] [--capacity N ...] [--requests N]

The trace (default: the Mooncake conversation trace in ../shared/data/traces: one hour of
a production chat service, 12,031 requests, prompts of ~12K tokens in 512-token blocks
named by prefix hash ids) gives each request's blocks. Every request, in arrival order,
does what the engine's connector does: fetch the leading chunks lmkv holds (a real
LMKVCache: its hot cache, LRU that never evicts a pinned chunk), then store the chunks it
computed. A chunk here is one trace block of 512 tokens; only full blocks are stored
(lmkv's rule), and the last prompt token is always computed. Chunk contents are tiny so
that 50K chunks fit in memory: capacity is counted in chunks, not bytes (one chunk of a
Llama-3-8B in fp16 is 64 MB; of the 75M-parameter benchmark model, 8 MB).

Each line: the share of prompt tokens served from the hot cache at that capacity, next to
what an unbounded cache (every chunk ever stored kept) and a textbook LRU cache of the
same size serve on the same accesses; the ratio is lmkv/LRU (1.000: lmkv's hot cache
evicts exactly as LRU does).
For scale, the Mooncake paper reports block hit ratios of ~30% at 1K blocks growing to
~50% at 50K on this trace with LRU.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import OrderedDict
from pathlib import Path

import torch

from lmkv.cache import LMKVCache
from lmkv.config import load_config
from lmkv.layout import KVLayout
from lmkv.memory import HEADER_BYTES

BLOCK = 512  # tokens per trace block (the trace's block size)
DEFAULT_TRACE = (Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
                 / "mooncake_conversation_trace.jsonl")
LAYOUT = KVLayout(1, 1, 1, torch.float16, BLOCK)  # 2 KB a chunk: only the bookkeeping matters


def load_trace(path: Path, limit: int | None) -> list[tuple[int, list[str]]]:
    """(prompt tokens, keys of its full blocks) per request, in arrival order."""
    out = []
    with path.open() as f:
        for line in f:
            req = json.loads(line)
            full = req["input_length"] // BLOCK
            out.append((req["input_length"], [f"{h:032x}" for h in req["hash_ids"][:full]]))
            if limit and len(out) == limit:
                break
    return out


def served_tokens(prompt: int, chunks: int) -> int:
    return min(chunks * BLOCK, prompt - 1)


def replay(trace: list[tuple[int, list[str]]], capacity: int) -> tuple[int, float]:
    """Prompt tokens lmkv served with a hot cache of ``capacity`` chunks, and seconds taken."""
    slot = HEADER_BYTES + LAYOUT.chunk_bytes
    cfg = load_config(env={}, chunk_size=BLOCK, max_local_cpu_size=capacity * slot / 1e9 + 1e-9,
                      enable_prefetch=False)
    engine = LMKVCache(cfg, LAYOUT, "trace")
    assert engine.pool.num_slots == capacity, (engine.pool.num_slots, capacity)
    served = 0
    start = time.perf_counter()
    try:
        for prompt, keys in trace:
            found = engine.fetch(keys)  # pins, and refreshes their place in the LRU order
            served += served_tokens(prompt, len(found))
            for buf in found:
                buf.release()
            for key in keys[len(found):]:  # computed now, stored after
                buf = engine.allocate()
                if buf is None:
                    break
                engine.store(key, buf)
                buf.release()
    finally:
        engine.close()
    return served, time.perf_counter() - start


def plain_lru(trace: list[tuple[int, list[str]]], capacity: int | None) -> int:
    """Prompt tokens a textbook LRU cache of ``capacity`` chunks (None: unbounded) would
    serve on the same accesses: the reference for lmkv's hot cache."""
    cache: OrderedDict[str, None] = OrderedDict()
    served = 0
    for prompt, keys in trace:
        n = 0
        while n < len(keys) and keys[n] in cache:
            cache.move_to_end(keys[n])
            n += 1
        served += served_tokens(prompt, n)
        for key in keys[n:]:
            cache[key] = None
            cache.move_to_end(key)
            if capacity is not None and len(cache) > capacity:
                cache.popitem(last=False)
    return served


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--capacity", type=int, nargs="+", default=[1000, 5000, 10000, 50000],
                    help="hot cache sizes to replay, in chunks of 512 tokens")
    ap.add_argument("--requests", type=int, help="replay only the first N requests")
    a = ap.parse_args()
    if not a.trace.is_file():
        raise SystemExit(f"no trace at {a.trace} (pass --trace FILE)")
    trace = load_trace(a.trace, a.requests)
    prompt_tokens = sum(p for p, _ in trace)
    chunks = sum(len(k) for _, k in trace)
    distinct = len({k for _, ks in trace for k in ks})
    best = plain_lru(trace, None)
    print(f"trace {a.trace.name}: {len(trace)} requests, {prompt_tokens / 1e6:.1f}M prompt tokens, "
          f"{chunks} full 512-token chunks ({distinct} distinct); an unbounded cache serves "
          f"{best / prompt_tokens:.3f} of the prompt tokens")
    for cap in a.capacity:
        served, took = replay(trace, cap)
        ref = plain_lru(trace, cap)
        print(f"hot cache {cap} chunks: lmkv serves {served / prompt_tokens:.3f} of the prompt tokens "
              f"({served / best:.2f} of unbounded; {took:.1f} s, {chunks / took / 1e3:.0f}K chunks/s), "
              f"a plain LRU of {cap} chunks {ref / prompt_tokens:.3f}: lmkv/LRU = {served / ref:.3f}x")


if __name__ == "__main__":
    main()
