"""lmkv_server's memory outside --max-memory: the index and the eviction policy's state,
per entry held, after churn (every PUT evicts one entry).

    python benchmarks/server_index_memory.py [--entries 4096] [--churn 20]

A store of ``--entries`` one-page values is filled, then ``--churn`` times as many fresh
keys (LMCache-style, as lmkv writes them) are put through it, with a read of a recent key
every third PUT; the heap's growth over the churn (tracemalloc), divided by the entries
held, is what each entry costs outside the page arena once the policy's history of keys
that left is full. One line per policy, ending in its ratio to lru's.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lmkv.backends.lm import lmcache_key  # noqa: E402
from lmkv.policy import POLICIES  # noqa: E402
from lmkv_server.arena import PageArena  # noqa: E402
from lmkv_server.store import Store  # noqa: E402


def bytes_per_entry(policy: str, entries: int, churn: int) -> float:
    store = Store(PageArena(entries, 4096, prefault=False), policy=policy)

    def key(i: int) -> bytes:
        return lmcache_key(f"lmkv1@model@layout@0@-@{i:032x}").encode()

    def put(i: int) -> None:
        store.commit(key(i), 100, 4, 6, (100, 0, 0, 0), store.reserve(1))

    for i in range(entries):
        put(i)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(entries, (churn + 1) * entries):
            put(i)
            if i % 3 == 0 and (entry := store.acquire(key(i - 5))) is not None:
                store.release(entry)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert store.stats().entries == entries
    return grown / entries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=4096)
    ap.add_argument("--churn", type=int, default=20, help="fresh keys put, as a multiple of --entries")
    args = ap.parse_args()
    lru = bytes_per_entry("lru", args.entries, args.churn)
    for policy in POLICIES:
        cost = lru if policy == "lru" else bytes_per_entry(policy, args.entries, args.churn)
        print(f"{policy}: {cost:.0f} bytes per entry held outside the arena after churn of "
              f"{args.churn}x {args.entries} entries (lru {lru:.0f}): {policy}/lru = {cost / lru:.1f}x",
              flush=True)


if __name__ == "__main__":
    main()
