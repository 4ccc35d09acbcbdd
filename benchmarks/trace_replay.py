"""Replay request traces through lmkv's hot cache: how much of each prompt a cache of a
given size serves, per eviction policy, next to LRU and an offline-optimal bound.

    python benchmarks/trace_replay.py [--trace FILE] [--capacity N ...] [--requests N]

Traces: the Mooncake conversation trace in ../shared/data/traces (one hour of a production
chat service, 12,031 requests, 512-token blocks named by prefix hash ids) and two
generated from a seed in the same shape (benchmarks/synthetic_traces.py: agent sessions
over long shared system prompts; RAG prompts of Zipf-popular documents). Every request,
in arrival order, does what the connector does: fetch the leading chunks held, then store
the chunks it computed (each naming the chunk before it as its parent). A chunk is one
512-token block; only full blocks are stored, and the last prompt token is always computed.

Lines per trace and capacity (in chunks):
- each policy (lmkv.policy) driven directly, as the share of prompt tokens served;
- the default policy told which blocks will be used again (an oracle that stores only
  those, the rest never offered): what admitting only blocks that are ever reused adds;
- Belady: block-level optimal replacement on the same block sequence (evict the block
  used again farthest ahead; never keep a block not used again). It ignores prefixes: a
  prefix-aware optimum could serve a little more, so it is a bound on block hits, not a
  ceiling on served tokens;
- lmkv: a real LMKVCache with the default policy (its hot cache, pins and all), and its
  lookups+inserts per second next to the same engine with cache_policy lru.
Each line ends in the ratio to LRU's served tokens.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script or with -m
from benchmarks.synthetic_traces import SHAPES  # noqa: E402
from lmkv.cache import LMKVCache
from lmkv.config import load_config
from lmkv.layout import KVLayout
from lmkv.memory import HEADER_BYTES
from lmkv.policy import DEFAULT_POLICY, POLICIES, make_policy

BLOCK = 512  # tokens per trace block (the trace's block size)
DEFAULT_TRACE = (Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
                 / "mooncake_conversation_trace.jsonl")
LAYOUT = KVLayout(1, 1, 1, torch.float16, BLOCK)  # 2 KB a chunk: only the bookkeeping matters

Trace = list[tuple[int, list[str]]]  # (prompt tokens, keys of its full blocks) per request


def parse_trace(lines: Iterable[dict], limit: int | None = None) -> Trace:
    out = []
    for req in lines:
        full = req["input_length"] // BLOCK
        out.append((req["input_length"], [f"{h:032x}" for h in req["hash_ids"][:full]]))
        if limit and len(out) == limit:
            break
    return out


def load_trace(path: Path, limit: int | None = None) -> Trace:
    with path.open() as f:
        return parse_trace((json.loads(line) for line in f), limit)


def synthetic_trace(shape: str, requests: int, seed: int = 0) -> Trace:
    return parse_trace(SHAPES[shape](seed, requests))


def served_tokens(prompt: int, chunks: int) -> int:
    return min(chunks * BLOCK, prompt - 1)


def replay(trace: Trace, capacity: int, policy: str = DEFAULT_POLICY) -> tuple[int, int, float]:
    """Prompt tokens a real LMKVCache with a hot cache of ``capacity`` chunks served, the
    lookups + inserts it made, and the seconds taken."""
    slot = HEADER_BYTES + LAYOUT.chunk_bytes
    cfg = load_config(env={}, chunk_size=BLOCK, max_local_cpu_size=capacity * slot / 1e9 + 1e-9,
                      enable_prefetch=False, cache_policy=policy)
    engine = LMKVCache(cfg, LAYOUT, "trace")
    assert engine.pool.num_slots == capacity, (engine.pool.num_slots, capacity)
    served = ops = 0
    start = time.perf_counter()
    try:
        for prompt, keys in trace:
            found = engine.fetch(keys)  # pins them while held
            served += served_tokens(prompt, len(found))
            ops += len(found) + 1
            for buf in found:
                buf.release()
            for i in range(len(found), len(keys)):  # computed now, stored after
                buf = engine.allocate()
                if buf is None:
                    break
                engine.store(keys[i], buf, keys[i - 1] if i else None)
                buf.release()
                ops += 1
    finally:
        engine.close()
    return served, ops, time.perf_counter() - start


def simulate(trace: Trace, capacity: int, policy: str, keep: list[bool] | None = None) -> int:
    """Prompt tokens served by a cache of ``capacity`` chunks run by ``policy`` (the policy
    object driven directly, as the hot cache drives it). ``keep``, per block of the trace in
    order: False for a block that is not stored at all (an admission oracle)."""
    pol = make_policy(policy)
    held: set[str] = set()
    served = pos = 0
    for prompt, keys in trace:
        n = 0
        while n < len(keys) and keys[n] in held:
            pol.accessed(keys[n])
            n += 1
        served += served_tokens(prompt, n)
        for i in range(n, len(keys)):
            key, parent = keys[i], keys[i - 1] if i else None
            if key in held:
                pol.accessed(key)
                continue
            if keep is not None and not keep[pos + i]:
                continue
            if len(held) >= capacity:
                victim = pol.victim(lambda _: True)
                held.discard(victim)
                pol.removed(victim)
            if pol.admit(key, parent, held.__contains__):
                held.add(key)
                pol.inserted(key, parent)
        pos += len(keys)
    return served


def plain_lru(trace: Trace, capacity: int | None) -> int:
    """Prompt tokens a textbook LRU cache of ``capacity`` chunks (None: unbounded) serves."""
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


def next_uses(trace: Trace) -> list[int]:
    """Per block of the trace in order, the position of the next use of its key (the
    number of blocks when there is none)."""
    seq = [k for _, keys in trace for k in keys]
    never = len(seq)
    next_use = [never] * len(seq)
    last: dict[str, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        next_use[i] = last.get(seq[i], never)
        last[seq[i]] = i
    return next_use


def belady(trace: Trace, capacity: int) -> int:
    """Prompt tokens served under block-level optimal replacement of ``capacity`` blocks:
    every block access (hit or not) refreshes the block's next use; on a miss the block is
    kept only if it is used again before the farthest-used block held, which then goes."""
    next_use = next_uses(trace)
    never = len(next_use)
    held: dict[str, int] = {}  # key -> its next use
    heap: list[tuple[int, str]] = []  # (-next use, key), stale entries skipped
    served = pos = 0
    for prompt, keys in trace:
        n, prefix = 0, True
        for key in keys:
            nxt = next_use[pos]
            pos += 1
            if key in held:
                n += prefix
                held[key] = nxt
                heapq.heappush(heap, (-nxt, key))
                continue
            prefix = False
            if nxt == never:
                continue
            if len(held) >= capacity:
                while -heap[0][0] != held.get(heap[0][1]):
                    heapq.heappop(heap)
                if -heap[0][0] <= nxt:
                    continue  # the block itself is the farthest: not kept
                del held[heapq.heappop(heap)[1]]
            held[key] = nxt
            heapq.heappush(heap, (-nxt, key))
        served += served_tokens(prompt, n)
    return served


def report(name: str, trace: Trace, capacities: list[int]) -> None:
    prompt_tokens = sum(p for p, _ in trace)
    chunks = sum(len(k) for _, k in trace)
    best = plain_lru(trace, None)
    keep = [n < chunks for n in next_uses(trace)]  # used again
    print(f"{name}: {len(trace)} requests, {prompt_tokens / 1e6:.1f}M prompt tokens, {chunks} chunks; "
          f"an unbounded cache serves {best / prompt_tokens:.3f} of the prompt tokens")
    for cap in capacities:
        lru = plain_lru(trace, cap)
        share = f"{name} {cap} chunks:"
        for policy in POLICIES:
            s = simulate(trace, cap, policy)
            print(f"{share} {policy} serves {s / prompt_tokens:.3f} (LRU {lru / prompt_tokens:.3f}): "
                  f"{policy}/LRU = {s / lru:.2f}x")
        s = simulate(trace, cap, DEFAULT_POLICY, keep)
        print(f"{share} {DEFAULT_POLICY} storing only the blocks used again (an admission oracle) "
              f"serves {s / prompt_tokens:.3f} (LRU {lru / prompt_tokens:.3f}): "
              f"oracle-admission/LRU = {s / lru:.2f}x")
        opt = belady(trace, cap)
        print(f"{share} Belady (block-level optimal) serves {opt / prompt_tokens:.3f} "
              f"(LRU {lru / prompt_tokens:.3f}): Belady/LRU = {opt / lru:.2f}x")
        served, ops, took = replay(trace, cap)
        _, lru_ops, lru_took = replay(trace, cap, "lru")
        speed, lru_speed = ops / took, lru_ops / lru_took
        print(f"{share} lmkv ({DEFAULT_POLICY}) serves {served / prompt_tokens:.3f} "
              f"(LRU {lru / prompt_tokens:.3f}), {speed / 1e3:.0f}K lookups+inserts/s vs "
              f"{lru_speed / 1e3:.0f}K with lru (speed {speed / lru_speed:.2f}x): "
              f"lmkv/LRU = {served / lru:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--capacity", type=int, nargs="+", default=[1000, 5000, 10000, 50000],
                    help="hot cache sizes to replay, in chunks of 512 tokens")
    ap.add_argument("--requests", type=int, default=12000, help="requests per trace")
    ap.add_argument("--seed", type=int, default=0, help="of the generated traces")
    a = ap.parse_args()
    if not a.trace.is_file():
        raise SystemExit(f"no trace at {a.trace} (pass --trace FILE)")
    report("conversation", load_trace(a.trace, a.requests), a.capacity)
    for shape in SHAPES:
        report(shape, synthetic_trace(shape, a.requests, a.seed), a.capacity)


if __name__ == "__main__":
    main()
